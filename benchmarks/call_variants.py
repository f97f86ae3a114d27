"""rpc_sync variants side by side, actorrpc and torch: what tensors and autograd add to a call.

    python benchmarks/call_variants.py [--n 400] [--rounds 7] [--backends actorrpc,torch]
                                       [--no-pin]

For each backend in turn, two spawned workers (pinned to CPU 0 and 1 unless
``--no-pin``); rank 0 makes ``rpc_sync`` calls of each variant below to rank 1, ``--n``
calls a variant per round after a short warm-up, the variants interleaved within each
round, and prints per variant the median over the rounds of each round's median latency
(µs). Variants: a no-op with an int, with one 4x4 tensor, with two 64x64 tensors; an
identity returning a 64x64 tensor; ``torch.add`` of two 64x64 tensors without grad,
requiring grad outside a context, and inside a distributed-autograd context (each call
in a context of its own; the context's entry and exit are outside the timed call), and
a no-op with two tensors requiring grad inside a context. The difference between the
in-context and out-of-context ``add`` is what recording the distributed graph costs a
call (the recv node on both sides, the callee's context, the send function). Figures are
in docs/performance.md ("Thirty-third session").
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
from _common import ensure_repo_on_path, free_port

ensure_repo_on_path()

PEER = "worker1"
WARMUP = 100


def noop(*args: Any) -> None:
    return None


def ident(value: Any) -> Any:
    return value


def _variants(rpc: Any) -> dict[str, tuple[Callable[[], Any], bool]]:
    """name -> (one call, whether it runs inside a distributed-autograd context)."""
    a = torch.rand(64, 64, requires_grad=True)
    b = torch.rand(64, 64, requires_grad=True)
    a0, b0 = a.detach().clone(), b.detach().clone()
    small = torch.rand(4, 4)

    def call(func: Any, *args: Any) -> Callable[[], Any]:
        return lambda: rpc.rpc_sync(PEER, func, args=args)

    return {
        "noop(1)": (call(noop, 1), False),
        "noop(4x4)": (call(noop, small), False),
        "noop(64x64, 64x64)": (call(noop, a0, b0), False),
        "ident(64x64)": (call(ident, a0), False),
        "add(64x64, 64x64)": (call(torch.add, a0, b0), False),
        "add, requiring grad": (call(torch.add, a, b), False),
        "add, requiring grad, in a context": (call(torch.add, a, b), True),
        "noop(a, b), requiring grad, in a context": (call(noop, a, b), True),
    }


def _median_us(fn: Callable[[], Any], n: int, in_context: bool, dist_autograd: Any) -> float:
    clock = time.perf_counter
    times = []
    for i in range(n + WARMUP):
        if in_context:
            with dist_autograd.context():
                began = clock()
                fn()
                elapsed = clock() - began
        else:
            began = clock()
            fn()
            elapsed = clock() - began
        if i >= WARMUP:
            times.append(elapsed)
    return statistics.median(times) * 1e6


def _worker(rank: int, port: int, backend: str, n: int, rounds: int, pin: bool) -> None:
    if pin:
        os.sched_setaffinity(0, {rank})
    if backend == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc

        options: Any = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    else:
        import actorrpc as rpc
        import actorrpc.autograd as dist_autograd

        options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        variants = _variants(rpc)
        medians: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, (fn, in_context) in variants.items():
                medians[name].append(_median_us(fn, n, in_context, dist_autograd))
        print(f"{backend} ({'pinned' if pin else 'unpinned'}; median of {rounds} rounds "
              f"of {n} calls, µs)", flush=True)
        for name, values in medians.items():
            print(f"  {name:42s} {statistics.median(values):8.1f}", flush=True)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=400, help="calls of a variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backends", default="actorrpc,torch")
    parser.add_argument("--no-pin", action="store_true", help="leave the workers unpinned")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        if backend not in ("actorrpc", "torch"):
            parser.error(f"unknown backend {backend!r}: actorrpc or torch")
        mp.start_processes(
            _worker, args=(free_port(), backend, args.n, args.rounds, not args.no_pin),
            nprocs=2, start_method="spawn",
        )


if __name__ == "__main__":
    main()
