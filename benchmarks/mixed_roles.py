"""A worker that is client and server at once, side by side: how long a call to it
waits while its own thread computes between its own synchronous calls.

    python benchmarks/mixed_roles.py [--seconds 6] [--pin split] [--backends torch,actorrpc]
                                     [--backoff 0.001,0.004]

Two spawned processes. Rank 0 is a client: it calls ``rpc_sync(worker1, tiny)`` in a
loop and computes (a busy loop holding the GIL) for 0.5-3 ms between its calls.
Rank 1 calls ``rpc_sync(worker0, tiny)`` at random moments (computing 1-10 ms after
each reply) and reports the latency of those calls: median, p90, p99. A request
reaches rank 0 while its main thread either waits for its own reply (actorrpc: the
waiter's turn on the inbox receives it) or computes (then actorrpc's inbox is read by
a pool thread still in its serving turn after the previous request, or by nobody
until the I/O thread's back-off, ``agent/_inbox.py`` ``BACKOFF_SECONDS``, ends or the
next turn begins; the handler then needs the GIL, which the computing thread gives up
every ``sys.getswitchinterval()`` seconds). ``--backoff`` runs actorrpc once per value
of ``BACKOFF_SECONDS`` (same-run comparison of the trade-off: a 4 ms back-off measured
1-11 % faster than 1 ms in most of ``ab_switch.py``'s benchmark loops, and slower
here). Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from _common import ensure_repo_on_path, free_port, percentile, pin_process, run_worker_pair

ensure_repo_on_path()

from _metrics import Backend  # noqa: E402 - needs the repository on the path


def tiny(value: int) -> int:
    return value


def compute(seconds: float) -> None:
    """Hold the GIL for ``seconds`` (user code between calls)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _worker(
    rank: int, name: str, backoff: float, port: int, seconds: float, pin: str, results: Any
) -> None:
    pin_process(rank, pin)
    backend = Backend(name, port)
    if name == "actorrpc" and backoff > 0:
        from actorrpc.agent import _inbox

        _inbox.BACKOFF_SECONDS = backoff
    rpc = backend.rpc
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=backend.options)
    rng = random.Random(rank)
    peer = f"worker{1 - rank}"
    for i in range(50):  # warm-up
        rpc.rpc_sync(peer, tiny, args=(i,))
    rpc.rpc_sync(peer, tiny, args=(0,))
    end = time.monotonic() + seconds
    samples = []
    while time.monotonic() < end:
        began = time.perf_counter()
        if rpc.rpc_sync(peer, tiny, args=(7,)) != 7:
            raise AssertionError("tiny returned a wrong value")
        samples.append(time.perf_counter() - began)
        compute(rng.uniform(0.0005, 0.003) if rank == 0 else rng.uniform(0.001, 0.01))
    if rank == 1:
        us = sorted(s * 1e6 for s in samples)
        results.put({"n": len(us), "median_us": percentile(us, 50),
                     "p90_us": percentile(us, 90), "p99_us": percentile(us, 99)})
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--pin", choices=("none", "split"), default="split")
    parser.add_argument("--backends", default="torch,actorrpc")
    parser.add_argument("--backoff", default="",
                        help="comma list of actorrpc BACKOFF_SECONDS values (default: as shipped)")
    args = parser.parse_args()
    runs: list[tuple[str, float]] = []
    for name in args.backends.split(","):
        if name == "actorrpc" and args.backoff:
            runs += [(name, float(value)) for value in args.backoff.split(",")]
        else:
            runs.append((name, 0.0))
    print(f"{'backend':24s} {'calls':>6s} {'median':>8s} {'p90':>8s} {'p99':>8s}")
    for name, backoff in runs:
        r = run_worker_pair(_worker, (name, backoff, free_port(), args.seconds, args.pin), name,
                            result_timeout=args.seconds + 120)
        label = f"{name} (back-off {backoff * 1e3:g} ms)" if backoff else name
        print(f"{label:24s} {r['n']:6d} {r['median_us']:6.0f}us {r['p90_us']:6.0f}us "
              f"{r['p99_us']:6.0f}us")


if __name__ == "__main__":
    main()
