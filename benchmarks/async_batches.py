"""Pipelined rpc_async in batches, the send phase timed apart from the wait.

    python benchmarks/async_batches.py [--batches 150] [--window 500] [--each] [--no-pin]

Two spawned actorrpc workers on this host (rank r pinned to CPU r unless ``--no-pin``);
rank 0 issues ``--batches`` batches of ``--window`` ``rpc_async`` calls of a no-op and
waits for each batch with ``torch.futures.wait_all`` (bench_rpc.py's pattern; ``--each``:
each future in turn). Prints the distribution of batch times (min / median / mean / p90 /
max, ms), the median send phase per call (µs: the caller's own CPU, as nothing else runs
on its core) and the calls/s of the median batch. Compare trees by running each tree's
own copy of this script (``benchmarks/_common.py`` puts the script's tree first on
``sys.path``). Figures are in docs/performance.md (twenty-fourth session).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import ensure_repo_on_path, free_port

ensure_repo_on_path()


def noop(x: Any) -> Any:
    return x


def summarize(batches: list[tuple[float, float]], window: int) -> str:
    """``batches``: (send phase, whole batch) in seconds, one pair per batch."""
    totals = sorted(total for _, total in batches)
    send = statistics.median(phase for phase, _ in batches)
    shown = [totals[0], statistics.median(totals), statistics.mean(totals),
             totals[int(len(totals) * 0.9)], totals[-1]]
    return (
        "batch ms min/median/mean/p90/max " + " / ".join(f"{t * 1e3:.2f}" for t in shown)
        + f"; send {send / window * 1e6:.2f} us/call; "
        + f"{window / statistics.median(totals):,.0f} calls/s (median batch)"
    )


def _worker(rank: int, port: int, batches: int, window: int, each: bool, pin: bool) -> None:
    if pin:
        os.sched_setaffinity(0, {rank})
    import actorrpc as rpc

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        for i in range(300):
            rpc.rpc_sync("worker1", noop, args=(i,))
        measured: list[tuple[float, float]] = []
        for batch in range(batches + 10):  # the first 10 warm up
            began = time.perf_counter()
            futures = [rpc.rpc_async("worker1", noop, args=(j,)) for j in range(window)]
            sent = time.perf_counter()
            if each:
                values = [future.wait() for future in futures]
            else:
                values = torch.futures.wait_all(futures)
            if values[-1] != window - 1:
                raise AssertionError("rpc_async(noop) returned a wrong value")
            if batch >= 10:
                measured.append((sent - began, time.perf_counter() - began))
        print(summarize(measured, window))
    rpc.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--each", action="store_true", help="wait on each future in turn")
    parser.add_argument("--no-pin", action="store_true")
    args = parser.parse_args(argv)
    mp.spawn(_worker, args=(free_port(), args.batches, args.window, args.each,
                            not args.no_pin), nprocs=2)


if __name__ == "__main__":
    main()
