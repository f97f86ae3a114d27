"""Tail latency of remote()+to_here(), side by side: torch, actorrpc, and actorrpc
without its garbage-collector freeze.

    python benchmarks/tail_latency.py [--n 15000] [--warmup 300] [--pin split] [--backends ...]

For each backend two spawned processes (rank 0 calls, rank 1 serves) run ``--n``
``remote(noop).to_here()`` after a warm-up and report the median, p99, p99.9 and
the slowest call, how many calls took over 20 ms, the full garbage collections
(generation 2) both processes ran meanwhile with the longest one, and what one
full collection (``gc.collect()``) then costs on the serving process. A full
collection runs whenever enough long-lived objects have piled up since the last
(the first one usually soon after start, so it may fall in the warm-up).
``actorrpc-nofreeze`` is actorrpc with ``ZmqRpcBackendOptions(freeze_gc=False)``:
with torch loaded a full collection scans ~170,000 objects, and the call it
interrupts waits for it. Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch.multiprocessing as mp
from _common import ensure_repo_on_path, free_port, percentile, pin_process

ensure_repo_on_path()

from _metrics import PEER, Backend, noop  # noqa: E402 - needs the repository on the path

BACKENDS = ("torch", "actorrpc", "actorrpc-nofreeze")
SLOW_S = 0.020


class FullCollections:
    """Counts generation-2 collections in this process and keeps the longest."""

    def __init__(self) -> None:
        self.count = 0
        self.longest_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.longest_s = max(self.longest_s, time.perf_counter() - self._started)

    def report(self) -> tuple[int, float]:
        gc.callbacks.remove(self)
        return self.count, self.longest_s * 1e3


_collections: FullCollections | None = None


def watch_collections() -> None:
    global _collections
    _collections = FullCollections()
    gc.callbacks.append(_collections)


def collections_report() -> tuple[int, float]:
    assert _collections is not None
    return _collections.report()


def full_collection_ms() -> float:
    """What one full collection costs in this process now (``gc.collect()``)."""
    began = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - began) * 1e3


def _worker(
    rank: int, name: str, port: int, n: int, warmup: int, pin: str, results: Any
) -> None:
    pin_process(rank, pin)
    backend = Backend(name.split("-")[0], port)
    if name.endswith("-nofreeze"):
        backend.options.freeze_gc = False
    rpc = backend.rpc
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=backend.options)
    if rank == 0:
        for i in range(warmup):
            rpc.remote(PEER, noop, args=(i,)).to_here()
        rpc.rpc_sync(PEER, watch_collections)
        watch_collections()
        samples = []
        for i in range(n):
            began = time.perf_counter()
            if rpc.remote(PEER, noop, args=(i,)).to_here() != i:
                raise AssertionError("remote(noop).to_here() returned a wrong value")
            samples.append(time.perf_counter() - began)
        mine, theirs = collections_report(), rpc.rpc_sync(PEER, collections_report)
        collect_ms = rpc.rpc_sync(PEER, full_collection_ms)
        us = sorted(s * 1e6 for s in samples)
        results.put({
            "backend": name, "n": n, "median_us": percentile(us, 50), "p99_us": percentile(us, 99),
            "p999_us": percentile(us, 99.9), "max_us": us[-1],
            "over_20ms": sum(s > SLOW_S for s in samples),
            "full_collections": mine[0] + theirs[0],
            "longest_collection_ms": max(mine[1], theirs[1]),
            "gc_collect_ms": collect_ms,
        })
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=15_000)
    parser.add_argument("--warmup", type=int, default=300,
                        help="untimed calls first (0: the window may hold the first full GC)")
    parser.add_argument("--pin", choices=("none", "split"), default="none")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args()
    context = mp.get_context("spawn")
    print(f"{'backend':18s} {'median':>8s} {'p99':>8s} {'p99.9':>8s} {'max':>9s} "
          f"{'>20ms':>6s} {'full GCs':>8s} {'longest GC':>10s} {'gc.collect()':>12s}")
    for name in args.backends.split(","):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        results = context.Queue()
        mp.start_processes(_worker,
                           args=(name, free_port(), args.n, args.warmup, args.pin, results),
                           nprocs=2, start_method="spawn")
        r = results.get(timeout=60)
        print(f"{name:18s} {r['median_us']:6.0f}us {r['p99_us']:6.0f}us {r['p999_us']:6.0f}us "
              f"{r['max_us'] / 1e3:7.1f}ms {r['over_20ms']:6d} {r['full_collections']:8d} "
              f"{r['longest_collection_ms']:8.1f}ms {r['gc_collect_ms']:10.1f}ms")


if __name__ == "__main__":
    main()
