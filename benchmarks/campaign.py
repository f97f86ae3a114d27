"""A campaign: several full ``bench_rpc.py`` runs, pinned and unpinned interleaved, and
the README's table of ranges over them.

    python benchmarks/campaign.py --tag DATE-sessionN                  # run, then the table
    python benchmarks/campaign.py --tag 2026-12-04-session36-compiled --summarize-only

Each run is ``python benchmarks/bench_rpc.py [--pin split] --rounds 3 --wait-idle 180``
(each starts once the 1-minute load average is under 0.5), in the order pinned run 1,
unpinned run 1, pinned run 2, ... so that both modes meet the host's phases alike; the
records are ``OUT/{pinned,unpinned}-TAG-run{k}.json`` with a chart beside each (a tag
whose records exist is refused unless ``--force``). The table has the figures of the
README's (which words some labels differently): those of the middle pinned run by
rpc_sync ratio and, per metric, the range of the ratio over the pinned and the unpinned
runs; below it, the pinned autograd ratio of each round, and the ranges of the Python
probe, of torch's rpc_sync and of the pyzmq floor (host phases). Benchmark an installed
or built copy, never while anything else runs (tests, another benchmark). Figures are in
docs/performance.md.

After each bench_rpc.py run, ``paired_blocks.py`` runs in the same mode (``--paired-blocks
N`` block pairs per latency metric, default 30; 0: none), recorded as
``OUT/paired-{pinned,unpinned}-TAG-run{k}.json``: both backends' pairs kept, taking turns
in blocks of up to a second, so that a moment of the host slows both sides of a ratio
alike. Its table follows the other: per metric, the range of the block ratios over each
mode's runs and how many block pairs met the issue's target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

BENCHMARKS = Path(__file__).resolve().parent
MODES = ("pinned", "unpinned")
_AUTOGRAD = "dist-autograd iteration, median (ms)"
_SYNC = "rpc_sync latency, median (µs)"
_FLOOR_RATIO = "rpc_sync median ÷ pyzmq floor RTT (×)"
_LEFT_OUT = ("rpc_sync latency, p99 (µs)",)  # in the records, not in the README's table
PAIRED_METRICS = ("rpc_sync", "remote", "echo_1mb", "autograd")
PAIRED_BLOCKS = 30  # block pairs per metric in each paired_blocks.py run (~75 s a run)


def record_path(out: Path, mode: str, tag: str, run: int) -> Path:
    return out / f"{mode}-{tag}-run{run}.json"


def paired_record_path(out: Path, mode: str, tag: str, run: int) -> Path:
    return out / f"paired-{mode}-{tag}-run{run}.json"


class Step(NamedTuple):
    mode: str
    run: int
    record: Path
    argv: list[str]


def plan(runs: int, tag: str, out: Path, blocks: int = PAIRED_BLOCKS) -> list[Step]:
    """Each run in the order they run: a bench_rpc.py run, then (``blocks`` > 0) a
    paired_blocks.py run of the latency metrics in the same mode."""
    steps = []
    for run in range(1, runs + 1):
        for mode in MODES:
            record = record_path(out, mode, tag, run)
            pin = ["--pin", "split"] if mode == "pinned" else []
            argv = [sys.executable, str(BENCHMARKS / "bench_rpc.py"), *pin, "--rounds", "3",
                    "--wait-idle", "180", "--json", str(record),
                    "--chart", str(record.with_suffix(".png"))]
            steps.append(Step(mode, run, record, argv))
            if blocks > 0:
                paired = paired_record_path(out, mode, tag, run)
                argv = [sys.executable, str(BENCHMARKS / "paired_blocks.py"), *pin[:1],
                        "--metrics", ",".join(PAIRED_METRICS), "--blocks", str(blocks),
                        "--json", str(paired)]
                steps.append(Step(mode, run, paired, argv))
    return steps


def _rows(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["metric"]: row for row in record["table"]}


def _span(values: Sequence[float], fmt: str, unit: str = "×") -> str:
    low, high = min(values), max(values)
    if fmt.format(low) == fmt.format(high):
        return fmt.format(low) + unit
    return f"{fmt.format(low)}-{fmt.format(high)}{unit}"


def middle_run(records: Sequence[dict[str, Any]]) -> int:
    """The index of the record whose rpc_sync ratio is the median one (of an even number
    of records, the lower of the two middle ones)."""
    order = sorted(range(len(records)), key=lambda i: _rows(records[i])[_SYNC]["ratio"])
    return order[(len(order) - 1) // 2]


def summarize(pinned: Sequence[dict[str, Any]], unpinned: Sequence[dict[str, Any]],
              paired: dict[str, list[dict[str, Any]]] | None = None) -> str:
    """The README's table (the middle pinned run's figures, the ranges of each mode's
    ratios) and the lines that go with it, as Markdown; then the alternating blocks'
    table of the ``paired`` records (:func:`load_paired`), if any."""
    if not pinned or not unpinned:
        raise ValueError("a campaign needs at least one pinned and one unpinned record")
    middle = middle_run(pinned)
    shown = _rows(pinned[middle])
    floors = [r["floor"]["rpc_sync"]["median_us"] for r in (*pinned, *unpinned)]
    lines = [
        f"(the middle pinned run by rpc_sync: run {middle + 1} of {len(pinned)})",
        "",
        "| metric | torch | actorrpc | actorrpc better by | range, pinned | range, unpinned |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for metric, row in shown.items():
        if metric in _LEFT_OUT:
            continue
        if metric == _FLOOR_RATIO:  # actorrpc's ratio to the floor, not to torch
            label = f"rpc_sync ÷ pyzmq floor ({_span(floors, '{:.0f}', ' µs')})"
            ranges = [_span([_rows(r)[metric]["actorrpc"] for r in records], "{:.2f}")
                      for records in (pinned, unpinned)]
            lines.append(f"| {label} | {row['torch_text']}× | {row['actorrpc_text']}× | – "
                         f"| {ranges[0]} | {ranges[1]} |")
            continue
        ranges = []
        for records in (pinned, unpinned):
            ratios = [_rows(r)[metric]["ratio"] for r in records]
            ranges.append(_span(ratios, "{:.2f}") if None not in ratios else "–")
        better = f"{row['ratio']:.2f}×" if row["ratio"] is not None else "–"
        lines.append(f"| {metric} | {row['torch_text']} | {row['actorrpc_text']} | {better} "
                     f"| {ranges[0]} | {ranges[1]} |")
    rounds = ", ".join(
        " / ".join(f"{ratio:.2f}" for ratio in r["round_ratios"][_AUTOGRAD]) + "×"
        for r in pinned if r.get("round_ratios", {}).get(_AUTOGRAD)
    ) or "n/a (no per-round figures)"
    probes = [p for r in (*pinned, *unpinned)
              for p in (r["machine"]["python_probe_us_at_start"], r["python_probe_us_at_end"])]
    torch_sync = [_rows(r)[_SYNC]["torch"] for r in pinned]
    lines += [
        "",
        f"The pinned autograd iteration per round: {rounds}.",
        f"Python probe {_span(probes, '{:.1f}', ' µs')}; torch's pinned rpc_sync "
        f"{_span(torch_sync, '{:.0f}', ' µs')}; the floor "
        f"{_span(floors[:len(pinned)], '{:.0f}', ' µs')} pinned, "
        f"{_span(floors[len(pinned):], '{:.0f}', ' µs')} unpinned.",
    ]
    hosts = sorted({_host(r) for r in (*pinned, *unpinned)})
    if len(hosts) == 1:
        lines.append(f"Host: {hosts[0]}.")
    else:  # records of different hosts or builds do not make one campaign
        lines.append("WARNING: the records differ in host or build: " + "; ".join(hosts) + ".")
    lines += paired_lines(paired or {})
    return "\n".join(lines)


def _host(record: dict[str, Any]) -> str:
    machine = record["machine"]
    return (f"{machine['cpu_model']}, {machine['nproc']} CPUs; actorrpc build: "
            f"{machine.get('actorrpc_build', 'unknown')}")


def load_paired(out: Path, tag: str, runs: int) -> dict[str, list[dict[str, Any]]]:
    """The campaign's paired_blocks.py records of each mode (those that exist: campaigns
    before the forty-second session have none)."""
    return {mode: [json.loads(path.read_text()) for run in range(1, runs + 1)
                   if (path := paired_record_path(out, mode, tag, run)).exists()]
            for mode in MODES}


def paired_lines(paired: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A table of the alternating blocks' ratios: per metric, the range (and median) of
    the block ratios over each mode's runs, and how many block pairs met the target."""
    metrics = [m for m in PAIRED_METRICS
               if any(m in r["metrics"] for records in paired.values() for r in records)]
    if not metrics:
        return []
    lines = ["", "Alternating blocks (`paired_blocks.py`: both backends' pairs kept, blocks "
             "of up to ~1 s in turn; torch's block median over ours):", "",
             "| metric | block ratios, pinned | block ratios, unpinned | met the target, "
             "pinned / unpinned |", "|---|---:|---:|---:|"]
    for metric in metrics:
        cells, met = [], []
        for mode in MODES:
            blocks = [b for r in paired.get(mode, []) for b in r["metrics"].get(metric, {})
                      .get("blocks", [])]
            ratios = [b["ratio"] for b in blocks]
            cells.append(f"{_span(ratios, '{:.2f}')} (median {statistics.median(ratios):.2f}×)"
                         if ratios else "–")
            target = next((r["metrics"][metric]["summary"]["target"] for r in paired[mode]
                           if metric in r["metrics"]), None)
            met.append(f"{sum(ratio >= target for ratio in ratios) if target else 0} of "
                       f"{len(ratios)}")
        lines.append(f"| {metric} | {cells[0]} | {cells[1]} | {' / '.join(met)} |")
    return lines


def load(out: Path, tag: str, runs: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The campaign's records (a missing one is an error naming its path)."""
    loaded: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for mode in MODES:
        for run in range(1, runs + 1):
            path = record_path(out, mode, tag, run)
            if not path.exists():
                raise FileNotFoundError(f"no campaign record {path}")
            loaded[mode].append(json.loads(path.read_text()))
    return loaded["pinned"], loaded["unpinned"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True, help="names the records, e.g. DATE-sessionN")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results")
    parser.add_argument("--summarize-only", action="store_true",
                        help="only print the table of records already written")
    parser.add_argument("--paired-blocks", type=int, default=PAIRED_BLOCKS,
                        help="block pairs per metric of each run's paired_blocks.py "
                        f"(default {PAIRED_BLOCKS}; 0: none)")
    parser.add_argument("--force", action="store_true",
                        help="run even if records of this tag exist (they are overwritten)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not args.summarize_only:
        steps = plan(args.runs, args.tag, args.out, args.paired_blocks)
        existing = [step.record for step in steps if step.record.exists()]
        if existing and not args.force:
            print(f"campaign.py: records of tag {args.tag!r} exist ({existing[0]}, ...): "
                  "choose another tag, --summarize-only, or --force", file=sys.stderr)
            return 2
        if importlib.util.find_spec("matplotlib") is None:
            print("[campaign] matplotlib is not installed: no charts (pip install matplotlib)",
                  file=sys.stderr)
        for step in steps:
            script = Path(step.argv[1]).name
            print(f"[campaign] {step.mode} run {step.run}: {' '.join(step.argv[1:])}",
                  flush=True)
            done = subprocess.run(step.argv, stdout=subprocess.DEVNULL, check=False)
            if done.returncode != 0:
                print(f"[campaign] {step.mode} run {step.run} failed ({script}, exit "
                      f"{done.returncode})", file=sys.stderr)
                return 1
    try:
        pinned, unpinned = load(args.out, args.tag, args.runs)
    except FileNotFoundError as exc:
        print(f"campaign.py: {exc}", file=sys.stderr)
        return 2
    try:
        print(summarize(pinned, unpinned, load_paired(args.out, args.tag, args.runs)))
    except (KeyError, TypeError) as exc:  # a --quick or --no-floor run, another layout
        print(f"campaign.py: a record of tag {args.tag!r} lacks a figure the table needs "
              f"({exc!r}); records of full bench_rpc.py runs are expected", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
