"""Latency ratios from alternating blocks: both backends' pairs alive, taking turns.

    python benchmarks/paired_blocks.py [--metrics autograd] [--blocks 40] [--pin]
                                       [--calls autograd=1000,...] [--quick] [--json PATH]

A pair of each backend (bench_rpc.py's two spawned processes: rank 0 measures, rank 1
serves) is started and kept; then, block after block, each rank 0 in turn times a block
of calls of the metric (after a tenth as many untimed: the caches are the other
backend's; before its first block, bench_rpc.py's warm-up of the metric) while the other
pair waits idle on its command queue. The order alternates (actorrpc then torch, torch
then actorrpc, ...) so that neither always goes first. Each block pair gives a ratio,
torch's median over actorrpc's (>1: actorrpc is faster), measured within about a second
of each other; the summary per metric is each backend's median of its block medians and
the minimum, median and maximum of the block ratios, with the number of block pairs that
meet the issue's target.

Why: bench_rpc.py's rounds run one backend's metrics after the other's, a minute apart,
and a moment of the host that slows everything for 15-30 s (docs/performance.md,
"Forty-first session") can cover one backend's measurement and not the other's. Blocks
of about a second each put both backends inside the same moment, so it slows both
blocks of a pair alike and the ratio stays; a moment that begins or ends within a block
pair still skews that one ratio, which the minimum shows.

The waiting pair is stopped (``SIGSTOP``) between its blocks, and continued for each:
an idle torch pair that has carried calls keeps both CPUs busy (2.0 CPU-seconds a second,
measured: TensorPipe's loops poll), which slowed our blocks beside it (autograd ~290 µs
pinned against ~260 alone; unpinned, blocks of 550-1,100 µs while our polls kept losing
their cores to it), while ours, idle, uses ~0.01 CPU. Stopped, neither pair takes CPU
from the other. docs/performance.md ("Forty-second session") compares the figures with
bench_rpc.py's. Benchmark an installed or built copy, never while anything else runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from _common import Session, SessionError, ensure_repo_on_path

ensure_repo_on_path()

from _metrics import (  # noqa: E402 - needs the repository on the path
    FULL,
    LATENCY_METRICS,
    QUICK,
    Config,
    block_worker_main,
)
from _report import ROWS  # noqa: E402

BACKENDS = ("actorrpc", "torch")
BLOCK_CALLS = {"rpc_sync": 2000, "remote": 1000, "echo_1mb": 300, "autograd": 1000}
"""Calls per block: about a second of torch's (or less), a few hundred ms of ours. Keep
blocks well under a few seconds (``--calls``): a pair stopped longer than its liveness
checks allow (ours: 5 s) may find its peer late when it is continued."""
QUICK_BLOCK_CALLS = {"rpc_sync": 100, "remote": 50, "echo_1mb": 10, "autograd": 20}
BLOCK_WARMUP = 0.1
"""Untimed calls before each block, as a share of its timed ones: a backend's first
~100 autograd iterations after the other's block ran ~10 % slower (caches), torch's too."""


def target_of(metric: str) -> float | None:
    """The issue's target on the ratio (torch's latency over ours) for ``metric``."""
    return next((row.target for row in ROWS if row.metric == metric and row.target), None)


class Pair:
    """One backend's kept worker pair and the command queue of its rank 0."""

    def __init__(self, backend: str, cfg: Config) -> None:
        self.backend = backend
        self.cfg = cfg
        self.commands: Any = mp.get_context("spawn").Queue()
        self.session = Session(block_worker_main, 2, (backend, cfg, self.commands))
        self.session.start()
        try:
            inits = 0
            while inits < 2:
                kind, rank, key, payload = self.session.get(cfg.init_timeout_s)
                if kind == "fatal":
                    raise SessionError(
                        f"{backend} rank {rank} failed in {key}: {payload['error']}")
                inits += kind == "init"
        except SessionError:
            self.close()
            raise
        self.signal(signal.SIGSTOP)  # (until its first block)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to both processes (``SIGSTOP``: the pair waits stopped)."""
        for proc in self.session.procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signum)

    def block(self, metric: str, calls: int) -> dict[str, Any]:
        """Latency stats of one block of ``calls`` calls, after :data:`BLOCK_WARMUP` of
        them untimed (and the metric's warm-up before its first block); the pair runs
        for the block only and waits stopped (``SIGSTOP``) otherwise."""
        self.signal(signal.SIGCONT)
        try:
            self.commands.put(("block", metric, max(1, int(calls * BLOCK_WARMUP)), calls))
            kind, rank, key, payload = self.session.get(self.cfg.metric_timeout_s)
        finally:
            self.signal(signal.SIGSTOP)
        if kind != "block" or "error" in payload:
            error = payload.get("error") if isinstance(payload, dict) else None
            raise SessionError(f"{self.backend} {metric}: {error or (kind, rank, key)}")
        return dict(payload)

    def close(self) -> None:
        """Stop rank 0's loop and let both ranks shut down (bounded), then end them."""
        self.signal(signal.SIGCONT)
        if self.session.alive():
            self.commands.put(("stop", "", 0, 0))
            deadline = time.monotonic() + 30.0
            shutdowns = 0
            try:
                while shutdowns < 2 and time.monotonic() < deadline:
                    kind, *_ = self.session.get(deadline - time.monotonic())
                    shutdowns += kind in ("shutdown", "fatal")
            except SessionError:
                pass
        self.session.close(grace=2.0)
        self.commands.close()
        self.commands.cancel_join_thread()


def summarize(metric: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each backend's median of block medians, the block ratios' range, the met count."""
    ratios = [block["ratio"] for block in blocks]
    target = target_of(metric)
    return {
        "block_pairs": len(blocks),
        **{f"{b}_median_us": statistics.median(block[b]["median_us"] for block in blocks)
           for b in BACKENDS},
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "target": target,
        "met": None if target is None else sum(ratio >= target for ratio in ratios),
    }


def summary_line(metric: str, calls: int, summary: dict[str, Any]) -> str:
    met = ("" if summary["target"] is None else
           f"; target ≥{summary['target']:g}×: {summary['met']} of {summary['block_pairs']} met")
    return (f"{metric}: {summary['block_pairs']} block pairs of {calls} calls; "
            f"actorrpc {summary['actorrpc_median_us']:.1f} µs, torch "
            f"{summary['torch_median_us']:.1f} µs (medians of the block medians); ratio "
            f"min {summary['ratio_min']:.2f} / median {summary['ratio_median']:.2f} / max "
            f"{summary['ratio_max']:.2f}{met}")


def run_metric_blocks(pairs: dict[str, Pair], metric: str, blocks: int,
                      calls: int) -> list[dict[str, Any]]:
    """``blocks`` block pairs of ``metric``, the order alternating; one line per pair."""
    rows: list[dict[str, Any]] = []
    for index in range(blocks):
        order = BACKENDS if index % 2 == 0 else BACKENDS[::-1]
        row: dict[str, Any] = {"block": index, "started": time.strftime("%H:%M:%S"),
                               "first": order[0]}
        for backend in order:
            row[backend] = pairs[backend].block(metric, calls)
        row["ratio"] = row["torch"]["median_us"] / row["actorrpc"]["median_us"]
        rows.append(row)
        print(f"{metric} #{index} {row['started']} actorrpc {row['actorrpc']['median_us']:.1f} "
              f"torch {row['torch']['median_us']:.1f} µs ratio {row['ratio']:.2f}", flush=True)
    return rows


def parse_calls(text: str, quick: bool) -> dict[str, int]:
    calls = dict(QUICK_BLOCK_CALLS if quick else BLOCK_CALLS)
    for item in filter(None, text.split(",")):
        metric, _, count = item.partition("=")
        if metric not in calls or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--calls item {item!r}: expected METRIC=N with METRIC one of "
                             f"{', '.join(LATENCY_METRICS)} and N ≥ 1")
        calls[metric] = int(count)
    return calls


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics", default="autograd",
                        help=f"comma list of: {','.join(LATENCY_METRICS)}")
    parser.add_argument("--blocks", type=int, default=None,
                        help="block pairs per metric (default 40; --quick: 4)")
    parser.add_argument("--calls", default="", help="calls per block, e.g. autograd=1000 "
                        f"(defaults {BLOCK_CALLS})")
    parser.add_argument("--pin", action="store_true", help="pin rank r of each pair to CPU r")
    parser.add_argument("--quick", action="store_true", help="the smoke test's iterations")
    parser.add_argument("--json", default=None, help="write the blocks and summaries here")
    args = parser.parse_args(argv)
    args.metrics = [m for m in args.metrics.split(",") if m]
    unknown = sorted(set(args.metrics) - set(LATENCY_METRICS))
    if unknown or not args.metrics:
        parser.error(f"unknown metrics {unknown}: expected some of {', '.join(LATENCY_METRICS)}")
    if args.blocks is None:
        args.blocks = 4 if args.quick else 40
    if args.blocks < 1:
        parser.error("--blocks must be at least 1")
    try:
        args.calls = parse_calls(args.calls, args.quick)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = replace(QUICK if args.quick else FULL, pin="split" if args.pin else "none")
    record: dict[str, Any] = {"pin": args.pin, "blocks": args.blocks, "calls": args.calls,
                              "metrics": {}}
    pairs: dict[str, Pair] = {}
    try:
        for backend in BACKENDS:  # one after the other: init is not measured here
            pairs[backend] = Pair(backend, cfg)
        for metric in args.metrics:
            rows = run_metric_blocks(pairs, metric, args.blocks, args.calls[metric])
            summary = summarize(metric, rows)
            record["metrics"][metric] = {"blocks": rows, "summary": summary}
            print(summary_line(metric, args.calls[metric], summary), flush=True)
    except SessionError as exc:
        print(f"paired_blocks.py: {exc}", file=sys.stderr)
        return 1
    finally:
        for pair in pairs.values():
            pair.close()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
