"""Metrics in many fresh worker pairs, one after another: a property of a pair, or a moment?

    python benchmarks/fresh_pairs.py [--pairs 20] [--metrics rpc_sync,autograd]
                                     [--backends actorrpc[,torch]] [--pin]
                                     [--hash-seed random|N] [--quick] [--json PATH]

Each pair is bench_rpc.py's (two spawned processes; rank 0 measures, rank 1 serves) with
one campaign round's iterations (``--quick``: the smoke test's); with several
``--backends``, each place in the sequence runs one pair of each, back to back. One line
per pair: its place, when it started, its hash seed, each metric's median. Then, per
backend and metric, the range and the pairs slower than 1.2 times the median ("slow"),
with their places: a moment of the host slows the pairs of every backend at one place.

A slow round of a campaign is either a property of that process pair (what differs from
one fresh pair to the next: the hash seed, the address layout, the pages its shared
memory got) or a moment of the host. Pairs in a row tell them apart: a property recurs
at random places in every sample and, with ``--hash-seed random``, each pair gets its own
``PYTHONHASHSEED``, printed, so a slow pair's seed can be run again (``--hash-seed N``);
a moment shows as slow pairs next to each other, and a later sample without any.
Figures are in docs/performance.md ("Forty-first session").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from _common import ensure_repo_on_path

ensure_repo_on_path()

from _metrics import FULL, METRICS, QUICK, Config  # noqa: E402 - needs the repository on the path
from bench_rpc import round_share, run_backend  # noqa: E402

SLOW_FACTOR = 1.2
"""A pair is slow when its median is above this many times the sample's median."""


def pair_config(quick: bool, pin: bool) -> Config:
    """One round of a three-round campaign (bench_rpc.py's ``--rounds 3``), or the quick
    smoke test's iterations."""
    base = QUICK if quick else round_share(FULL, 3)
    return replace(base, pin="split" if pin else "none")  # (one init sample: both have 1)


def summarize(rows: list[dict[str, Any]], metric: str, label: str = "") -> str:
    """One line for ``metric`` of ``rows`` (one backend's pairs, each with its ``place``
    in the sequence): the range of the pairs' medians and the slow pairs."""
    name = f"{label} {metric}" if label else metric
    values = [row["medians"][metric] for row in rows if metric in row["medians"]]
    if not values:
        return f"{name}: no pair measured it"
    middle = statistics.median(values)
    slow = [(row.get("place", index), row["medians"][metric]) for index, row in enumerate(rows)
            if row["medians"].get(metric, 0.0) > SLOW_FACTOR * middle]
    slow_text = ", ".join(f"#{place} {value:.1f}" for place, value in slow) or "none"
    return (f"{name}: {len(values)} pairs, {min(values):.1f} / {middle:.1f} / "
            f"{max(values):.1f} µs (min / median / max); slow (> {SLOW_FACTOR}x the median): "
            f"{len(slow)}: {slow_text}")


def run_pair(backend: str, metrics: list[str], cfg: Config, seed: str | None) -> dict[str, Any]:
    """One fresh pair (``seed``: its ``PYTHONHASHSEED``; None: the environment's)."""
    saved = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        os.environ["PYTHONHASHSEED"] = seed  # (spawned processes read it at start)
    try:
        started = time.strftime("%H:%M:%S")
        result = run_backend(backend, metrics, cfg)["metrics"]
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
    medians = {m: round(float(result[m]["median_us"]), 1) for m in metrics
               if isinstance(result.get(m), dict) and "median_us" in result[m]}
    errors = {m: result[m]["error"] for m in metrics
              if isinstance(result.get(m), dict) and "error" in result[m]}
    return {"started": started, "seed": seed, "medians": medians, "errors": errors}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--metrics", default="rpc_sync,autograd",
                        help=f"comma list of: {','.join(METRICS)} (medians in µs)")
    parser.add_argument("--backends", default="actorrpc",
                        help="comma list of: actorrpc,torch (each place runs one pair of each)")
    parser.add_argument("--pin", action="store_true", help="pin rank r to CPU r")
    parser.add_argument("--hash-seed", default=None,
                        help="random: each pair its own PYTHONHASHSEED (printed); N: all N")
    parser.add_argument("--quick", action="store_true", help="the smoke test's iterations")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    args.metrics = [m for m in args.metrics.split(",") if m]
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(args.metrics) - set(METRICS)) + sorted(
        set(args.backends) - {"actorrpc", "torch"})
    if unknown or args.pairs < 1 or not args.backends:
        parser.error(f"unknown metrics or backends {unknown}" if unknown
                     else "--pairs must be at least 1 and --backends name one")
    if args.hash_seed not in (None, "random") and not args.hash_seed.isdigit():
        parser.error("--hash-seed is 'random' or a number")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = pair_config(args.quick, args.pin)
    rows: list[dict[str, Any]] = []
    for place in range(args.pairs):
        for backend in args.backends:
            seed = (str(random.randrange(1, 2**32)) if args.hash_seed == "random"
                    else args.hash_seed)
            row = {"place": place, "backend": backend,
                   **run_pair(backend, args.metrics, cfg, seed)}
            rows.append(row)
            shown = " ".join(f"{m} {v:.1f}" for m, v in row["medians"].items())
            failed = " ".join(f"{m}: {e}" for m, e in row["errors"].items())
            print(f"#{place} {backend} {row['started']} seed {seed or '-'}: {shown} "
                  f"{failed}".rstrip(), flush=True)
    for backend in args.backends:
        for metric in args.metrics:
            mine = [row for row in rows if row["backend"] == backend]
            print(summarize(mine, metric, backend if len(args.backends) > 1 else ""))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"backends": args.backends, "pin": args.pin, "rows": rows}, out, indent=1)
    return 0 if all(not row["errors"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
