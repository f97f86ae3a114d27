"""Small calls during bulk transfers, side by side: how long an ``rpc_sync`` of a tiny
function takes while another thread of the same caller echoes large tensors.

    python benchmarks/bulk_interference.py [--seconds 4] [--size-mb 64] [--pin split]
                                           [--backends torch,actorrpc] [--keep-gil]

Two spawned processes. On rank 0, one thread calls ``rpc_sync(worker1, echo, (tensor,))``
with a ``--size-mb`` tensor in a loop while the main thread calls ``rpc_sync(worker1,
tiny)`` for ``--seconds``; it reports the small calls' count, median, p99 and maximum,
and the echoes' median. Between workers of one host, actorrpc copies a large tensor once
into a shared-memory segment on each side; from ``RELEASE_GIL_FROM`` bytes
(``transport/_shared_memory.py``) that copy runs without the GIL, so the process's other
threads (its I/O thread, the small calls) run meanwhile. ``--keep-gil`` adds an actorrpc
run whose copies keep the GIL (the thirty-fifth session's way): the same-run comparison
of that lever. Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch
from _common import ensure_repo_on_path, free_port, percentile, pin_process, run_worker_pair

ensure_repo_on_path()

from _metrics import Backend  # noqa: E402 - needs the repository on the path


def tiny(value: int) -> int:
    return value


def echo(value: Any) -> Any:
    return value


def _keep_gil() -> None:
    from actorrpc.transport import _shared_memory

    _shared_memory.RELEASE_GIL_FROM = 1 << 62


def _worker(rank: int, name: str, keep_gil: bool, port: int, seconds: float, size_mb: int,
            pin: str, results: Any) -> None:
    pin_process(rank, pin)
    torch.set_num_threads(1)
    backend = Backend(name, port)
    if keep_gil:
        _keep_gil()
    rpc = backend.rpc
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=backend.options)
    if rank == 0:
        tensor = torch.rand(size_mb << 18)  # float32: 4 bytes each
        for _ in range(3):  # warm-up: segments made and mapped, connections up
            rpc.rpc_sync("worker1", echo, args=(tensor,))
        for i in range(100):
            rpc.rpc_sync("worker1", tiny, args=(i,))
        stop = threading.Event()
        echoes: list[float] = []

        def bulk() -> None:
            while not stop.is_set():
                began = time.perf_counter()
                out = rpc.rpc_sync("worker1", echo, args=(tensor,))
                echoes.append(time.perf_counter() - began)
                if out.shape != tensor.shape:
                    raise AssertionError("echo returned a tensor of another shape")

        thread = threading.Thread(target=bulk)
        thread.start()
        samples = []
        end = time.perf_counter() + seconds
        try:
            while time.perf_counter() < end:
                began = time.perf_counter()
                if rpc.rpc_sync("worker1", tiny, args=(7,)) != 7:
                    raise AssertionError("tiny returned a wrong value")
                samples.append(time.perf_counter() - began)
        finally:
            stop.set()
            thread.join()
        us = sorted(s * 1e6 for s in samples)
        results.put({"n": len(us), "median_us": percentile(us, 50), "p99_us": percentile(us, 99),
                     "max_us": us[-1], "echoes": len(echoes),
                     "echo_ms": statistics.median(echoes) * 1e3 if echoes else float("nan")})
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--pin", choices=("none", "split"), default="split")
    parser.add_argument("--backends", default="torch,actorrpc")
    parser.add_argument("--keep-gil", action="store_true",
                        help="also run actorrpc with its copies into segments keeping the GIL")
    args = parser.parse_args()
    if args.seconds <= 0 or args.size_mb <= 0:
        parser.error("--seconds and --size-mb must be positive")
    runs = [(name, False) for name in args.backends.split(",")]
    if args.keep_gil:
        runs.append(("actorrpc", True))
    print(f"{args.size_mb} MB echoes in one thread, tiny calls in another ({args.seconds:g} s, "
          f"pin={args.pin}):")
    print(f"{'backend':31s} {'calls':>6s} {'median':>9s} {'p99':>9s} {'max':>9s} "
          f"{'echoes':>6s} {'echo':>8s}")
    for name, keep_gil in runs:
        r = run_worker_pair(_worker, (name, keep_gil, free_port(), args.seconds, args.size_mb,
                                      args.pin), name, result_timeout=args.seconds + 180)
        label = f"{name} (copies keep the GIL)" if keep_gil else name
        print(f"{label:31s} {r['n']:6d} {r['median_us']:7.0f}us {r['p99_us']:7.0f}us "
              f"{r['max_us']:7.0f}us {r['echoes']:6d} {r['echo_ms']:6.1f}ms")


if __name__ == "__main__":
    main()
