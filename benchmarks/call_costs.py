"""Where the time of a call goes: rpc_sync by argument kind, and the autograd phases.

    python benchmarks/call_costs.py [--n 1000] [--port 29741]

Two spawned actorrpc workers; rank 0 times 1,000 calls of each kind (median µs, the
first fifth dropped as warm-up) and the phases of one distributed-autograd
iteration (context enter, rpc_sync(torch.add) of two 64x64 tensors, backward,
get_gradients, context exit). Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import ensure_repo_on_path

ensure_repo_on_path()


def noop(*args: Any) -> None:
    return None


def seven(_: Any) -> int:
    return 7


def make() -> torch.Tensor:
    return torch.ones(1)


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples[len(samples) // 5:]) * 1e6


def _time(call: Callable[[], Any], n: int) -> float:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return _median_us(samples)


def _calls(rpc: Any, n: int) -> None:
    one = torch.ones(1)
    a, b = torch.rand(64, 64), torch.rand(64, 64)
    cases: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "noop()": (noop, ()),
        "seven(tensor(1))": (seven, (one,)),
        "make() -> tensor(1)": (make, ()),
        "torch.add(64x64, 64x64)": (torch.add, (a, b)),
    }
    for name, (func, args) in cases.items():
        median = _time(lambda: rpc.rpc_sync("worker1", func, args=args), n)  # noqa: B023
        print(f"rpc_sync {name:28s} {median:8.1f} us", flush=True)


def _autograd(rpc: Any, n: int) -> None:
    import actorrpc.autograd as dist_autograd

    a = torch.rand(64, 64, requires_grad=True)
    b = torch.rand(64, 64, requires_grad=True)
    phases: dict[str, list[float]] = {
        k: [] for k in ("enter", "rpc_sync", "backward", "get_gradients", "exit", "total")
    }
    for _ in range(n):
        t0 = time.perf_counter()
        context = dist_autograd.context()
        context_id = context.__enter__()
        t1 = time.perf_counter()
        loss = rpc.rpc_sync("worker1", torch.add, args=(a, b)).sum()
        t2 = time.perf_counter()
        dist_autograd.backward(context_id, [loss])
        t3 = time.perf_counter()
        dist_autograd.get_gradients(context_id)
        t4 = time.perf_counter()
        context.__exit__(None, None, None)
        t5 = time.perf_counter()
        for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            phases[key].append(value)
    for key, samples in phases.items():
        print(f"autograd {key:28s} {_median_us(samples):8.1f} us", flush=True)


def _worker(rank: int, port: int, n: int) -> None:
    import actorrpc as rpc

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        _calls(rpc, n)
        _autograd(rpc, n)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--port", type=int, default=29741)
    args = parser.parse_args()
    mp.spawn(_worker, args=(args.port, args.n), nprocs=2)


if __name__ == "__main__":
    main()
