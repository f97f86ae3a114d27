"""A distributed-autograd iteration whose loss also depends on a large local parameter:
how long the backward pass takes when the caller has its own leaves to accumulate.

    python benchmarks/autograd_local_leaf.py [--n 400] [--size 1024] [--rounds 1]
                                             [--no-pin] [--timeout 300] [--tree PATH ...]

Two spawned actorrpc workers (pinned, rank r to CPU r, one intra-op thread each).
Rank 0 runs ``--n`` iterations of::

    with dist_autograd.context() as ctx:
        received = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))   # x: 256 x 256
        loss = received.sum() + (weight * weight).sum()            # weight: size x size
        dist_autograd.backward(ctx, [loss])
        dist_autograd.get_gradients(ctx)

and prints the median and p90 iteration time. The caller's local pass yields the
gradient for the message to worker1 and for ``weight``, whose first accumulation in
the context is a copy of ``size * size`` floats (4 MiB at 1024); the message leaves
before that copy (``AutogradEngine._local_pass``), so worker1's pass runs meanwhile.

``--tree PATH`` (repeatable) runs the workers on the actorrpc of another checkout
(e.g. ``git worktree add /tmp/old <sha>``), interleaved with the others, so that two
versions are compared in the same minutes; each worker checks that it imported
actorrpc from the tree it was given (a plain ``PYTHONPATH`` would not: this script
puts its own tree first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import Session, percentile

HERE_TREE = str(Path(__file__).resolve().parents[1])


def _iteration_times(rpc: Any, dist_autograd: Any, n: int, size: int) -> list[float]:
    weight = torch.rand(size, size, requires_grad=True)
    x = torch.rand(256, 256, requires_grad=True)

    def iteration() -> None:
        with dist_autograd.context() as ctx:
            received = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
            loss = received.sum() + (weight * weight).sum()
            dist_autograd.backward(ctx, [loss])
            grads = dist_autograd.get_gradients(ctx)
        if not torch.equal(grads[x], torch.full_like(x, 2.0)):
            raise AssertionError("wrong gradient for x")

    for _ in range(max(5, n // 8)):
        iteration()
    times = []
    for _ in range(n):
        began = time.perf_counter()
        iteration()
        times.append(time.perf_counter() - began)
    return times


def _worker(rank: int, world_size: int, port: int, out: Any, barrier: Any, tree: str, n: int,
            size: int, pin: bool) -> None:
    """Spawned process (``_common.Session``): rank 0 reports ``("times", [...])``; a
    failure is reported as ``("fatal", message)`` too."""
    try:
        sys.path.insert(0, tree)
        if pin:
            cpus = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
        torch.set_num_threads(1)  # (a pinned process with two intra-op threads waits on itself)
        import actorrpc as rpc
        import actorrpc.autograd as dist_autograd

        if not rpc.__file__ or not Path(rpc.__file__).resolve().is_relative_to(tree):
            raise RuntimeError(f"imported actorrpc from {rpc.__file__}, not from {tree}")
        options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
        try:
            if rank == 0:
                out.put(("times", _iteration_times(rpc, dist_autograd, n, size)))
        finally:
            rpc.shutdown()
    except BaseException as exc:
        out.put(("fatal", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def run_once(tree: str, n: int, size: int, pin: bool, timeout: float = 300.0) -> list[float]:
    """Iteration times (s) of one fresh pair of workers on ``tree``'s actorrpc."""
    session = Session(_worker, 2, (tree, n, size, pin))
    session.start()
    try:
        kind, value = session.get(timeout)  # SessionError on a timeout
    finally:
        session.close(grace=10.0)
    if kind == "fatal":
        raise RuntimeError(value)
    return value  # type: ignore[no-any-return]


def summarize(times: list[float]) -> str:
    ordered = sorted(times)
    return (f"median {statistics.median(ordered) * 1e3:.3f} ms, "
            f"p90 {percentile(ordered, 90) * 1e3:.3f} ms over {len(ordered)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree, interleaved")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--tree", action="append", default=[],
                        help="another checkout's root; repeatable (default: this one)")
    args = parser.parse_args()
    trees = [str(Path(t).resolve()) for t in args.tree] or [HERE_TREE]
    for _ in range(args.rounds):
        for tree in trees:
            times = run_once(tree, args.n, args.size, not args.no_pin, args.timeout)
            print(f"{tree}: {summarize(times)}", flush=True)


if __name__ == "__main__":
    main()
