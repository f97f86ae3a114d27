"""What a halted core costs, and what busy polling buys, side by side with torch.

    python benchmarks/idle_wake.py [--n 3000] [--rounds 3] [--pin split] [--skip-gaps]

First, in this process alone: the same small piece of work (actorrpc pickling an RPC
call that carries a 4-element tensor) timed right after the thread slept for a gap
(its core halts, as it does while a worker waits for the next message) and right
after it spun for the same gap (the core stays busy). On these virtual machines the
work runs several times slower after a sleep: the code and data it touches went
cold while the virtual CPU was halted.

Then, interleaved for ``--rounds`` rounds, two spawned processes per backend (rank 0
calls, rank 1 serves) time ``--n`` calls of each kind: torch, actorrpc with
``ZmqRpcBackendOptions(busy_poll=0)`` (every wait blocks at once) and actorrpc as
configured by default (a waiting thread polls for ``busy_poll`` = 300 µs first). It
prints the median latency of each kind and the CPU both processes used per call.
Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import ensure_repo_on_path, free_port, pin_process

ensure_repo_on_path()

from _metrics import PEER, Backend, echo, noop  # noqa: E402 - needs the repository on the path

BACKENDS = ("torch", "actorrpc-nopoll", "actorrpc")
GAPS_US = (0, 200, 1000)


def _median_us_after(gap_s: float, spin: bool, work: Callable[[], Any], n: int) -> float:
    samples = []
    for _ in range(n):
        if spin:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        elif gap_s:
            time.sleep(gap_s)
        began = time.perf_counter_ns()
        work()
        samples.append(time.perf_counter_ns() - began)
    return statistics.median(samples) / 1e3


def halted_core_costs(n: int) -> None:
    from actorrpc.serialization import dumps_for

    tensor = torch.rand(4)

    def pickle_a_call() -> Any:
        return dumps_for(1, (echo, (tensor,), {}, {}))

    print("pickling one call carrying a 4-element tensor, median us:")
    print(f"  {'gap before it':>14s} {'after sleeping':>15s} {'after spinning':>15s}")
    for gap_us in GAPS_US:
        slept = _median_us_after(gap_us / 1e6, False, pickle_a_call, n)
        spun = _median_us_after(gap_us / 1e6, True, pickle_a_call, n) if gap_us else slept
        print(f"  {gap_us:>11d} us {slept:>15.1f} {spun:>15.1f}")


def _process_cpu() -> float:
    return time.process_time()


def _worker(rank: int, name: str, port: int, n: int, pin: str, results: Any) -> None:
    pin_process(rank, pin)
    backend = Backend(name.split("-")[0], port)
    if name.endswith("-nopoll"):
        backend.options.busy_poll = 0.0
    rpc = backend.rpc
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=backend.options)
    if rank == 0:
        small = torch.rand(4)
        kinds: dict[str, Callable[[], Any]] = {
            "rpc_sync": lambda: rpc.rpc_sync(PEER, noop, args=(1,)),
            "echo tensor(4)": lambda: rpc.rpc_sync(PEER, echo, args=(small,)),
            "remote+to_here": lambda: rpc.remote(PEER, noop, args=(1,)).to_here(),
        }
        row: dict[str, tuple[float, float]] = {}
        for kind, call in kinds.items():
            for _ in range(300):
                call()
            samples = []
            mine, theirs = _process_cpu(), rpc.rpc_sync(PEER, _process_cpu)
            for _ in range(n):
                began = time.perf_counter()
                call()
                samples.append(time.perf_counter() - began)
            cpu = (_process_cpu() - mine + rpc.rpc_sync(PEER, _process_cpu) - theirs) / n
            row[kind] = (statistics.median(samples) * 1e6, cpu * 1e6)
        results.put(row)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", choices=("none", "split"), default="none")
    parser.add_argument("--skip-gaps", action="store_true", help="only the side-by-side part")
    args = parser.parse_args()
    if not args.skip_gaps:
        halted_core_costs(args.n)
    context = mp.get_context("spawn")
    print(f"\nmedian us per call (CPU us of both processes per call), pin={args.pin}:")
    for round_ in range(args.rounds):
        for name in BACKENDS:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
            results = context.Queue()
            mp.start_processes(_worker, args=(name, free_port(), args.n, args.pin, results),
                               nprocs=2, start_method="spawn")
            row = results.get(timeout=60)
            cells = "  ".join(
                f"{kind} {median:6.0f} ({cpu:4.0f})" for kind, (median, cpu) in row.items()
            )
            print(f"  round {round_ + 1} {name:16s} {cells}", flush=True)


if __name__ == "__main__":
    main()
