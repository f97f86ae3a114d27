"""benchmarks/timeline.py prints each step's median time and the spread of its gap."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cluster import free_port

pytestmark = pytest.mark.timeout(120)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "timeline.py"
_STEP = re.compile(
    r"^ +([\d.]+)  (?:[AB][A-Za-z] +kind \d+ *|end of the iteration)  gap +([\d.]+) / +([\d.]+)$"
)


def test_gap_quantiles_are_taken_per_iteration() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from timeline import _gap_quantiles
    finally:
        sys.path.remove(str(BENCHMARKS))
    # three iterations' event times (s since each began): the first step's gap is steady,
    # the second's is 1, 2 and 9 µs (the median of the times alone would hide which varies)
    rows = [[1e-6, 2e-6], [1e-6, 3e-6], [1e-6, 10e-6]]
    (first, first90), (second, second90) = _gap_quantiles(rows)
    assert first == pytest.approx(1.0) and first90 == pytest.approx(1.0)
    assert second == pytest.approx(2.0) and second90 == pytest.approx(2.0)
    rows = [[0.0, t * 1e-6] for t in range(1, 12)]  # gaps 1..11 µs
    assert _gap_quantiles(rows)[1] == pytest.approx((6.0, 10.0))


def test_prints_each_step_with_its_gap() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", "sync", "--n", "300", "--port", str(free_port())],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # the most common sequence: the indented lines after its heading, up to the next one
    lines = done.stdout.split("iterations had this sequence", 1)[1].splitlines()[1:]
    block = []
    for line in lines:
        if not line.startswith("  "):
            break
        block.append(line)
    steps = [step for step in map(_STEP.match, block) if step is not None]
    assert len(steps) == len(block), done.stdout  # every line: a step and its gap
    assert len(steps) >= 4, done.stdout  # at least the request's and the reply's events
    times = [float(step.group(1)) for step in steps]
    assert times == sorted(times), done.stdout
    for step in steps:
        assert float(step.group(2)) <= float(step.group(3)), done.stdout  # median <= p90
    assert "end of the iteration" in block[-1], done.stdout
