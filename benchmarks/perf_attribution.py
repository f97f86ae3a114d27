"""Where a worker's CPU goes, by compiled function: `perf` stacks of a pinned loop, summed.

    python benchmarks/perf_attribution.py --record [--metric autograd|rpc_sync|remote] [--seconds 3]
                                          [--frequency 1000] [--top 40]
    python benchmarks/perf_attribution.py --from-script perf-script.txt [--top 40]

``--record`` (needs Linux ``perf`` and a compiled build, ``ACTORRPC_COMPILE=1``, whose
functions appear by name in native stacks) starts one of bench_rpc.py's pinned pairs
running ``--metric`` for long enough, records ``perf record -C <cpu> --call-graph dwarf``
on each worker's CPU in turn once the pair has warmed up (rank r runs on CPU r) and reads
the stacks back with ``perf script`` once the pair is done (slow: minutes for a few
seconds of samples). ``--from-script`` reads such text instead. Per CPU it prints the
share of samples in the idle task, in busy polls (any stack through ``_poll_busily`` or
``any_ready``: waiting, not work) and at work; and, of the work samples, the share whose
stack passes through each compiled function (``CPyDef_*``: inclusive, each counted once
per sample) and the leaf functions. Interpreted Python shows as the
interpreter's own frames. Figures are in docs/performance.md ("Forty-first session").
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from _common import ensure_repo_on_path

ensure_repo_on_path()

from _metrics import FULL  # noqa: E402 - needs the repository on the path
from bench_rpc import run_backend  # noqa: E402

SPIN_MARKERS = ("poll_busily", "any_ready")
"""A sample whose stack passes through one of these is a busy poll: waiting, not work."""

# "<address> <function> (<object file>)"; C++ names have parentheses of their own
_FRAME = re.compile(r"^\s*[0-9a-f]+ (.*?)(?: \(([^()]*)\))?$")


@dataclass
class Attribution:
    """Samples of one CPU: how many were idle, how many waited in busy polls, and what
    the rest ran."""

    samples: int = 0
    idle: int = 0  # the CPU's idle task (``swapper``): nothing ran
    spinning: int = 0
    inclusive: Counter[str] = field(default_factory=Counter)  # compiled functions
    leaves: Counter[str] = field(default_factory=Counter)

    @property
    def working(self) -> int:
        return self.samples - self.idle - self.spinning


def frames_of(sample: str) -> list[str]:
    """The function names of one ``perf script`` sample, innermost first."""
    names = []
    for line in sample.splitlines()[1:]:
        match = _FRAME.match(line)
        if match:
            names.append(match.group(1))
    return names


def attribute(script_text: str) -> Attribution:
    """Sum the stacks of ``perf script`` output (samples separated by blank lines)."""
    result = Attribution()
    for sample in script_text.split("\n\n"):
        names = frames_of(sample.strip("\n"))
        if not names:
            continue
        result.samples += 1
        if sample.strip().startswith("swapper"):
            result.idle += 1
            continue
        if any(marker in name for name in names for marker in SPIN_MARKERS):
            result.spinning += 1
            continue
        # each once (recursion), in stack order: ties in the report keep the order met
        compiled = dict.fromkeys(name.removeprefix("CPyDef_").lstrip("_") for name in names
                                 if name.startswith("CPyDef_"))
        result.inclusive.update(compiled.keys())
        result.leaves[names[0]] += 1
    return result


def report(label: str, result: Attribution, top: int) -> str:
    """The printed summary of one CPU's samples."""
    if not result.samples:
        return f"{label}: no samples"
    share = {name: f"{100 * count / result.samples:.1f} %" for name, count in
             (("idle", result.idle), ("spinning", result.spinning), ("work", result.working))}
    lines = [f"{label}: {result.samples} samples, {share['idle']} idle, {share['spinning']} in "
             f"busy polls, {share['work']} work"]
    work = max(1, result.working)
    for title, counts in (("compiled functions on the stack", result.inclusive),
                          ("leaf functions", result.leaves)):
        lines.append(f"  {title} (% of the work samples):")
        lines += [f"  {100 * n / work:6.1f} %  {name[:100]}" for name, n in counts.most_common(top)]
    return "\n".join(lines)


# the least a call of each metric takes here (µs): the pair runs at least long enough
_FASTEST_CALL_US = {"rpc_sync": 15.0, "remote": 25.0, "autograd": 200.0}
_START_SECONDS = 15.0  # spawn, imports, init_rpc and the metric's warm-up, at most


def record(metric: str, seconds: float, frequency: int, workdir: Path) -> dict[int, str]:
    """``perf record`` of CPU 0, then CPU 1, for ``seconds`` each while one pinned pair
    runs ``metric``; the ``perf script`` text of each."""
    span = _START_SECONDS + 2 * seconds + 5.0
    calls = int(span / (_FASTEST_CALL_US[metric] * 1e-6))
    cfg = replace(FULL, pin="split", init_rounds=1, autograd_n=calls, sync_n=calls,
                  remote_n=calls, metric_timeout_s=4 * span, backend_budget_s=8 * span)
    pair = threading.Thread(target=run_backend, args=("actorrpc", [metric], cfg), daemon=True)
    pair.start()
    pair.join(timeout=_START_SECONDS)  # (the pair's start-up and warm-up, not recorded)
    texts = {}
    for cpu in (0, 1):
        data = workdir / f"cpu{cpu}.data"
        subprocess.run(["perf", "record", "-C", str(cpu), "-F", str(frequency), "--call-graph",
                        "dwarf,16384", "-o", str(data), "--", "sleep", str(seconds)],
                       check=True, capture_output=True, timeout=seconds + 60)
    pair.join(timeout=8 * span)
    for cpu in (0, 1):
        script = subprocess.run(
            ["perf", "script", "-i", str(workdir / f"cpu{cpu}.data"), "-F",
             "comm,tid,ip,sym,dso"], check=True, capture_output=True, text=True, timeout=3600)
        texts[cpu] = script.stdout
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--record", action="store_true", help="record a pinned pair now")
    source.add_argument("--from-script", type=Path, help="a `perf script` text to attribute")
    parser.add_argument("--metric", default="autograd", choices=sorted(_FASTEST_CALL_US))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--frequency", type=int, default=1000)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    if args.from_script:
        print(report(str(args.from_script), attribute(args.from_script.read_text()), args.top))
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        texts = record(args.metric, args.seconds, args.frequency, Path(workdir))
    for cpu, text in texts.items():
        print(report(f"CPU {cpu} (rank {cpu})", attribute(text), args.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
