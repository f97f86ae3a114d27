"""benchmarks/perf_attribution.py sums `perf script` stacks by compiled function."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "perf_attribution.py"
sys.path.insert(0, str(SCRIPT.parent))

import perf_attribution  # noqa: E402

# four samples as `perf script -F comm,tid,ip,sym,dso` prints them: a busy poll, a
# send's pickling, a C++ leaf (whose name has parentheses of its own) under a serve, and
# the idle task
PERF_SCRIPT = """\
python 27614
\t          1bf080 CPyDef__ring_inbox___RingInbox___any_ready (/m.so)
\t          1b9332 CPyDef__zmq____poll_busily_Transport_obj_____call__ (/m.so)
\t          1b91ce CPyDef__agent___Agent___call_and_wait (/m.so)
\t           fddc4 _PyEval_EvalFrameDefault (/p.so)

python 27614
\t          1af897 _PyObject_Malloc (/p.so)
\t          1af897 _PyObject_Malloc (inlined)
\t          144cd0 CPyDef__pickling____dump (/m.so)
\t          155609 CPyDef__agent___Agent____send_request (/m.so)
\t          1b91ce CPyDef__agent___Agent___call_and_wait (/m.so)

python 27615
\t           20987 c10::function_ref<void (char**, long const*, long, long)>::callback_fn (/t.so)
\t          19b40e CPyDef__dispatch___MessageDispatcher____serve (/m.so)
\t          19b40e CPyDef__dispatch___MessageDispatcher____serve (/m.so)

swapper     0
\t          7ff1a2 pv_native_safe_halt ([kernel.kallsyms])
\t          7ff3b0 default_idle ([kernel.kallsyms])
"""


def test_busy_polls_are_set_apart_and_the_rest_counted_once_per_compiled_function() -> None:
    result = perf_attribution.attribute(PERF_SCRIPT)
    assert (result.samples, result.idle, result.spinning, result.working) == (4, 1, 1, 2)
    assert result.inclusive == {
        "pickling____dump": 1, "agent___Agent____send_request": 1,
        "agent___Agent___call_and_wait": 1,
        "dispatch___MessageDispatcher____serve": 1,  # (recursion counted once)
    }
    assert result.leaves == {
        "_PyObject_Malloc": 1,
        "c10::function_ref<void (char**, long const*, long, long)>::callback_fn": 1,
    }


def test_the_report_gives_shares_of_the_work_samples(tmp_path) -> None:
    text = perf_attribution.report("CPU 0", perf_attribution.attribute(PERF_SCRIPT), 2)
    lines = text.splitlines()
    assert lines[0] == "CPU 0: 4 samples, 25.0 % idle, 25.0 % in busy polls, 50.0 % work"
    assert "    50.0 %  pickling____dump" in lines
    assert perf_attribution.report("CPU 1", perf_attribution.Attribution(), 2) == (
        "CPU 1: no samples")
    saved = tmp_path / "script.txt"
    saved.write_text(PERF_SCRIPT)
    done = subprocess.run([sys.executable, str(SCRIPT), "--from-script", str(saved), "--top", "3"],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith(
        "4 samples, 25.0 % idle, 25.0 % in busy polls, 50.0 % work")
