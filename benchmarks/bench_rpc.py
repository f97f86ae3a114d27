"""Benchmark actorrpc against torch.distributed.rpc (TensorPipe) side by side.

    python benchmarks/bench_rpc.py                      # full run, both backends
    python benchmarks/bench_rpc.py --quick              # CI smoke test, < 60 s
    python benchmarks/bench_rpc.py --backends torch --quick

Each backend runs in two fresh ``spawn`` processes (rank 0 measures, rank 1 serves);
a bare pyzmq DEALER/ROUTER ping-pong is measured in the same run as the floor.  Every
phase has a timeout; a backend that fails reports ``error: ...`` and the run goes on.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from _common import (
    IDLE_LOAD,
    RESULTS_DIR,
    Session,
    SessionError,
    machine_info,
    python_probe_us,
    wait_until_idle,
)
from _metrics import BACKENDS, FULL, METRICS, QUICK, Config, worker_main
from _report import (
    BANDWIDTH_NOTE,
    ROWS,
    build_table,
    error_lines,
    floor_table,
    markdown_table,
    round_ratios,
    write_chart,
    write_json,
)
from _zmq_floor import floor_main


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _floor_round(cfg: Config) -> dict[str, Any]:
    session = Session(floor_main, 2, (cfg,))
    results: dict[str, Any] = {}
    session.start()
    try:
        while True:
            kind, _rank, key, payload = session.get(cfg.metric_timeout_s)
            if kind == "result":
                results[key] = payload
            elif kind == "fatal":
                results.setdefault("rpc_sync", payload)
                break
            elif kind == "done":
                break
    except SessionError as exc:
        results.setdefault("rpc_sync", {"error": str(exc)})
    finally:
        session.close(grace=5.0)
    return results


def run_floor(cfg: Config) -> dict[str, Any]:
    """Bare pyzmq ping-pong, ``cfg.floor_rounds`` times in fresh process pairs.

    Unpinned, the kernel puts the two processes on the same core or on different cores
    and the round trip differs ~3x between the two, so each figure is the median round
    (the lower middle one for an even count); every round is kept under ``rounds``.
    """
    return merge_floor([_floor_round(cfg) for _ in range(max(1, cfg.floor_rounds))])


_FLOOR_FIELDS = {
    "rpc_sync": "median_us", "rpc_async": "msgs_per_s", "echo_1mb": "gb_per_s",
    "echo_64mb": "gb_per_s",
}
# the figure that orders a metric's rounds: the one of the table's first row for it
_PRIMARY_FIELDS = {row.metric: row.field for row in reversed(ROWS)}


def _median_round(entries: list[dict[str, Any]], field: str) -> dict[str, Any] | None:
    """The entry with the median ``field`` (the lower middle one for an even count);
    without any numeric one, the first entry (an error), or None."""
    ok = sorted(
        (e for e in entries if isinstance(e.get(field), float)), key=lambda e: float(e[field])
    )
    if ok:
        return ok[(len(ok) - 1) // 2]
    return entries[0] if entries else None


def merge_floor(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each floor figure from its median round; every round is kept under ``rounds``."""
    floor: dict[str, Any] = {}
    for metric, field in _FLOOR_FIELDS.items():
        entry = _median_round([r[metric] for r in rounds if metric in r], field)
        if entry is not None:
            floor[metric] = entry
    floor["rounds"] = rounds
    return floor


def merge_backend_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One backend's results from several rounds: each metric from its median round."""
    metrics: dict[str, Any] = {}
    for metric, field in _PRIMARY_FIELDS.items():
        entries = [r["metrics"][metric] for r in rounds if metric in r.get("metrics", {})]
        entry = _median_round([e for e in entries if isinstance(e, dict)], field)
        if entry is not None:
            metrics[metric] = {**entry, "rounds": [e.get(field) for e in entries]}
    return {"metrics": metrics, "sessions": sum(r.get("sessions", 0) for r in rounds),
            "rounds": rounds}


def round_share(cfg: Config, rounds: int) -> Config:
    """``cfg`` with ``1/rounds`` of its iterations (warm-ups kept) and one init sample:
    what each round of :func:`run_interleaved` measures."""
    return replace(
        cfg,
        sync_n=max(1, cfg.sync_n // rounds),
        async_total=max(cfg.async_inflight, cfg.async_total // rounds),
        remote_n=max(1, cfg.remote_n // rounds),
        echo_1mb_n=max(1, cfg.echo_1mb_n // rounds) if cfg.echo_1mb_n else 0,
        echo_64mb_n=max(1, cfg.echo_64mb_n // rounds) if cfg.echo_64mb_n else 0,
        autograd_n=max(1, cfg.autograd_n // rounds),
        train_n=max(1, cfg.train_n // rounds),
        init_rounds=1,
    )


def run_interleaved(
    backends: list[str], metrics: list[str], cfg: Config, rounds: int, floor: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``rounds`` rounds, each measuring the floor and every backend in turn with
    ``1/rounds`` of the iterations: on a shared host whose speed changes from minute
    to minute, each backend then meets the same phases (figures: the median rounds)."""
    share = round_share(cfg, rounds)
    floor_rounds: list[dict[str, Any]] = []
    per_backend: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    for index in range(rounds):
        _log(f"round {index + 1} of {rounds}")
        if floor:
            floor_rounds.append(_floor_round(share))
        for backend in backends:
            per_backend[backend].append(run_backend(backend, metrics, share))
    merged = {b: merge_backend_rounds(rs) for b, rs in per_backend.items()}
    return (merge_floor(floor_rounds) if floor else {}), merged


def _collect_shutdown(
    session: Session, res: dict[str, Any], inits: dict[int, Any], grace: float
) -> None:
    """After rank 0 is done, wait (bounded) for both ranks to finish rpc.shutdown().

    Each process has its own queue feeder thread, so rank 1's "init" message may arrive
    after rank 0's "done": it is collected here too.
    """
    shutdown: dict[str, float | None] = {}
    res.setdefault("shutdown_s", []).append(shutdown)
    problems = res.setdefault("problems", {})
    deadline = time.monotonic() + grace
    while len(shutdown) < 2:
        try:
            kind, rank, _key, payload = session.get(deadline - time.monotonic())
        except SessionError as exc:
            problems[f"shutdown (session {res['sessions']})"] = {"error": f"rpc.shutdown(): {exc}"}
            return
        if kind == "init":
            inits[rank] = payload
        elif kind == "shutdown":
            shutdown[f"rank{rank}"] = payload["shutdown_s"]
        elif kind == "fatal":
            problems[f"shutdown rank{rank} (session {res['sessions']})"] = payload
            shutdown[f"rank{rank}"] = None


def _init_summary(rounds: list[dict[int, dict[str, float]]]) -> dict[str, Any]:
    """init_rpc time (max of the two workers) and idle RSS, median over sessions."""
    maxes = [max(r[0]["init_s"], r[1]["init_s"]) for r in rounds]
    return {
        "init_s_max": statistics.median(maxes),
        "init_s_max_per_session": maxes,
        "rss_mb": statistics.median(r[1]["rss_mb"] for r in rounds),  # rank 1, idle server
        "rss_mb_rank0": statistics.median(r[0]["rss_mb"] for r in rounds),
        "sessions": len(rounds),
    }


def run_backend(name: str, metrics: list[str], cfg: Config) -> dict[str, Any]:
    """Run every metric for one backend in fresh process pairs.

    A hung metric is marked and the rest run in a new pair.  Every pair also times
    init_rpc; extra metric-less pairs are started until ``cfg.init_rounds`` samples exist,
    because a single init_rpc sample is noisy (store connect retries).
    """
    res: dict[str, Any] = {"metrics": {}, "sessions": 0}
    out: dict[str, Any] = res["metrics"]
    remaining = list(metrics)
    budget_end = time.monotonic() + cfg.backend_budget_s
    init_rounds: list[dict[int, dict[str, float]]] = []
    init_error: dict[str, str] | None = None
    while remaining or (init_error is None and len(init_rounds) < cfg.init_rounds):
        if budget_end - time.monotonic() < 3.0:
            for m in remaining:
                out[m] = {"error": "timeout: backend time budget exhausted"}
            break
        res["sessions"] += 1
        session = Session(worker_main, 2, (name, remaining, cfg))
        session.start()
        inits: dict[int, dict[str, float]] = {}
        current: str | None = None
        finished = False
        try:
            while True:
                limit = cfg.init_timeout_s if len(inits) < 2 else cfg.metric_timeout_s
                kind, rank, key, payload = session.get(min(limit, budget_end - time.monotonic()))
                if kind == "init":
                    inits[rank] = payload
                elif kind == "start":
                    current = key
                    _log(f"{name}: {key} ...")
                elif kind == "result":
                    out[key] = payload
                    remaining.remove(key)
                    current = None
                elif kind == "done":
                    finished = True
                    break
                elif kind == "fatal":
                    res.setdefault("problems", {})[f"{key} rank{rank}"] = payload
                    raise SessionError(f"rank {rank} failed in {key}: {payload['error']}")
        except SessionError as exc:
            err = {"error": str(exc)}
            if current is not None:  # a metric hung: mark it, retry the rest in new processes
                out[current] = err
                remaining.remove(current)
            else:  # init failed or the processes died between metrics
                for m in remaining:
                    out[m] = err
                remaining = []
                if len(inits) < 2:
                    init_error = err
            _log(f"{name}: {exc}")
        if finished:
            _collect_shutdown(session, res, inits, grace=min(30.0, cfg.metric_timeout_s))
        res.setdefault("exit_codes", []).append(session.close(grace=2.0))
        if len(inits) == 2:
            init_rounds.append(inits)
    if init_rounds:
        out["init"] = _init_summary(init_rounds)
    elif init_error is not None:
        out["init"] = init_error
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few iterations, no 64 MB; < 60 s")
    p.add_argument("--backends", default="torch,actorrpc", help="comma list of: torch,actorrpc")
    p.add_argument("--metrics", default=",".join(METRICS), help="comma list (default: all)")
    p.add_argument("--no-floor", action="store_true", help="skip the bare pyzmq floor")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the floor and each backend in turn this many times, each with 1/ROUNDS "
        "of the iterations, and report the median rounds (for hosts whose speed changes)",
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help=f"first wait (at most SECONDS) until the 1-minute load average is under "
        f"{IDLE_LOAD} (another run's processes weigh on the figures for a minute or so)",
    )
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "latest.json", help="JSON path")
    p.add_argument("--chart", type=Path, default=RESULTS_DIR / "latest.png", help="PNG path")
    p.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    p.add_argument(
        "--pin",
        choices=("none", "split"),
        default="none",
        help="split: pin rank r to CPU r in every run (steadier figures on small VMs)",
    )
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    for b in args.backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    for m in args.metrics:
        if m not in METRICS:
            p.error(f"unknown metric {m!r} (choose from {', '.join(METRICS)})")
    return args


def wait_for_idle_host(
    limit_s: float, wait: Callable[[float], tuple[float, bool]] = wait_until_idle
) -> dict[str, Any]:
    """``--wait-idle``: wait (at most ``limit_s``; 0: not at all) for an idle host; what
    the record's ``machine`` section says of it."""
    if limit_s <= 0:
        return {}
    _log(f"waiting (at most {limit_s:.0f} s) for a load average under {IDLE_LOAD}")
    waited, reached = wait(limit_s)
    if not reached:
        _log(f"the load average stayed at or above {IDLE_LOAD}; measuring anyway")
    return {"idle_wait_s": round(waited, 1), "idle_reached": reached}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = replace(QUICK if args.quick else FULL, pin=args.pin)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if args.wait_idle < 0:
        raise SystemExit("--wait-idle must be 0 (no wait) or more seconds")
    idle_wait = wait_for_idle_host(args.wait_idle)
    t_start = time.monotonic()
    report: dict[str, Any] = {
        "machine": {**machine_info(), **idle_wait},
        "config": {"quick": args.quick, "backends": args.backends, "rounds": args.rounds,
                   **asdict(cfg)},
        "notes": {"bandwidth": BANDWIDTH_NOTE, "ratio": ">1 means actorrpc is better"},
    }
    load_1m = report["machine"]["loadavg_at_start"][0]
    if load_1m >= IDLE_LOAD:
        _log(f"warning: 1-min load average is {load_1m:.2f}; other work skews the figures")
    floor: dict[str, Any] = {}
    results: dict[str, Any] = {}
    if args.rounds > 1:
        floor, results = run_interleaved(
            args.backends, args.metrics, cfg, args.rounds, not args.no_floor
        )
    else:
        if not args.no_floor:
            _log("pyzmq floor ...")
            floor = run_floor(cfg)
        for backend in args.backends:
            _log(f"{backend}: starting 2 processes")
            results[backend] = run_backend(backend, args.metrics, cfg)
    table = build_table(results, floor)
    report.update(floor=floor, backends=results, table=table)
    per_round = round_ratios(results)
    if per_round:
        report["round_ratios"] = per_round
    report["wall_s"] = time.monotonic() - t_start
    report["loadavg_at_end"] = list(os.getloadavg())
    report["python_probe_us_at_end"] = python_probe_us()

    print(markdown_table(table))
    print()
    print(floor_table(results, floor))
    if per_round:
        print("\nRatio within each round (actorrpc better by; the two measured back to back):")
        for label, ratios in per_round.items():
            cells = " / ".join(f"{r:.2f}×" if r else "–" for r in ratios)
            print(f"  {label}: {cells}")
    print(f"\nNote: {BANDWIDTH_NOTE}.")
    print(
        f"Python probe (sum(range(1000)), median µs; compares hosts and slow phases): "
        f"{report['machine']['python_probe_us_at_start']:.1f} at start, "
        f"{report['python_probe_us_at_end']:.1f} at end."
    )
    print(f"actorrpc build: {report['machine']['actorrpc_build']}.")
    problems = error_lines(results, floor)
    if problems:
        print("\nErrors / n/a:")
        print("\n".join(problems))
    write_json(args.json, report)
    print(f"\nJSON written to {args.json}")
    if not args.no_chart:
        m = report["machine"]
        subtitle = f"{m['cpu_model']}, {m['nproc']} CPUs, pin={cfg.pin}, {m['date']}"
        print(write_chart(args.chart, results, floor, subtitle))
    print(f"total wall time {report['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
