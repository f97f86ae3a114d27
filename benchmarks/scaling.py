"""init_rpc time vs world size, plus one all-to-all round of rpc_async calls.

    python benchmarks/scaling.py                    # actorrpc, K = 4, 8, 16
    python benchmarks/scaling.py --max-world 32     # K = 4, 8, 16, 32
    python benchmarks/scaling.py --backend torch    # the same for torch.distributed.rpc

K fresh ``spawn`` processes start together (a barrier after the imports), each calls
``init_rpc`` (timed), then every worker sends one ``rpc_async(noop)`` to every other
worker and waits for all of them (timed), then ``shutdown()``.  Every phase is bounded
by a timeout; leftover processes are killed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, Session, SessionError, machine_info
from _metrics import BACKENDS, Backend, noop

WORLD_SIZES = (4, 8, 16, 32)


def scaling_worker(
    rank: int,
    world_size: int,
    port: int,
    queue: Any,
    barrier: Any,
    backend_name: str,
    timeout_s: float,
) -> None:
    """Spawned process: timed init_rpc, one all-to-all round, shutdown."""
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        backend = Backend(backend_name, port)
        rpc = backend.rpc
        barrier.wait(timeout_s)
        t0 = time.perf_counter()
        rpc.init_rpc(
            f"worker{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=backend.options,
        )
        queue.put(("init", rank, "", time.perf_counter() - t0))
        barrier.wait(timeout_s)
        t0 = time.perf_counter()
        peers = [j for j in range(world_size) if j != rank]
        futs = [rpc.rpc_async(f"worker{j}", noop, args=(rank,)) for j in peers]
        if [f.wait() for f in futs] != [rank] * len(peers):
            raise AssertionError("all-to-all round returned wrong values")
        queue.put(("a2a", rank, "", time.perf_counter() - t0))
        t0 = time.perf_counter()
        rpc.shutdown()
        queue.put(("shutdown", rank, "", time.perf_counter() - t0))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(("fatal", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def run_world(backend: str, world: int, timeout_s: float) -> dict[str, Any]:
    """One world size; returns timings (seconds) or an ``error``."""
    session = Session(scaling_worker, world, (backend, timeout_s))
    got: dict[str, dict[int, float]] = {"init": {}, "a2a": {}, "shutdown": {}}
    res: dict[str, Any] = {"world_size": world}
    t_start = time.monotonic()
    session.start()
    try:
        while len(got["shutdown"]) < world:
            left = timeout_s - (time.monotonic() - t_start)
            kind, rank, key, payload = session.get(left)
            if kind == "fatal":
                res["error"] = f"rank {rank}: {key}"
                res["traceback"] = payload
                break
            got[kind][rank] = payload
    except SessionError as exc:
        phase = next((k for k in ("init", "a2a", "shutdown") if len(got[k]) < world), "?")
        res["error"] = f"{exc} (phase {phase}: {len(got[phase])}/{world} workers reported)"
    finally:
        session.close(grace=5.0)
    for phase, times in got.items():
        if times:
            res[f"{phase}_max_s"] = max(times.values())
            res[f"{phase}_median_s"] = statistics.median(times.values())
    res["wall_s"] = time.monotonic() - t_start
    return res


def _cell(res: dict[str, Any], key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return fmt.format(res[key] * scale) if key in res else "–"


def markdown(rows: list[dict[str, Any]], backend: str) -> str:
    lines = [
        f"| world size | init_rpc max (s) | init_rpc median (s) | all-to-all round max (ms) "
        f"| shutdown max (s) | status ({backend}) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        status = "ok" if "error" not in r else "error: " + r["error"][:80]
        lines.append(
            f"| {r['world_size']} | {_cell(r, 'init_max_s')} | {_cell(r, 'init_median_s')} "
            f"| {_cell(r, 'a2a_max_s', 1e3, '{:.1f}')} | {_cell(r, 'shutdown_max_s')} "
            f"| {status} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="actorrpc")
    p.add_argument("--max-world", type=int, default=16, help="largest K (4, 8, 16, 32)")
    p.add_argument(
        "--timeout", type=float, default=0.0, help="seconds per world size (default 60 + 8*K)"
    )
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "scaling.json")
    args = p.parse_args(argv)
    worlds = [k for k in WORLD_SIZES if k <= args.max_world]
    rows: list[dict[str, Any]] = []
    for world in worlds:
        timeout = args.timeout or 60.0 + 8.0 * world
        print(f"[scaling] {args.backend}: K={world} (timeout {timeout:.0f} s)", file=sys.stderr)
        rows.append(run_world(args.backend, world, timeout))
    print(markdown(rows, args.backend))
    for r in rows:
        if "traceback" in r:
            print(f"\nK={r['world_size']}: {r['error']}\n{r['traceback']}")
    report = {"machine": machine_info(), "backend": args.backend, "results": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON written to {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
