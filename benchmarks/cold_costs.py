"""What single operations of the message path cost warm (in a loop) and cold (caches evicted).

    python benchmarks/cold_costs.py [--n 1500] [--evict-mib 4]

Between two messages a worker's core runs other code (libzmq's I/O thread, the
kernel's network stack, other threads), which evicts much of what the last
message used from the caches. So one operation in the flow of messages costs
several times what it costs in a loop: a ``timeit`` figure understates it. This
script times each operation once after evicting the caches (touching
``--evict-mib`` MiB of memory and running unrelated torch code) and reports the
median of ``--n`` such runs next to the warm per-call time. torch calls suffer
most (a large code footprint reached through several layers); that is why the
message path makes as few of them as it can (see docs/performance.md,
"Fourteenth session").
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _common import ensure_repo_on_path

ensure_repo_on_path()


class Evictor:
    """Touches ``mib`` MiB of memory and runs unrelated torch code: caches go cold."""

    def __init__(self, mib: int) -> None:
        self._memory = np.ones(mib << 20, dtype=np.uint8)
        self._others = [torch.rand(8) for _ in range(50)]

    def __call__(self) -> None:
        self._memory.sum()
        for other in self._others:
            (other * 2).add_(1).sum()


def warm_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(min(n, 200)):
        fn()
    began = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - began) / n * 1e6


def cold_us(fn: Callable[[], Any], n: int, evict: Callable[[], None]) -> float:
    times = []
    for _ in range(n):
        evict()
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def operations() -> dict[str, Callable[[], Any]]:
    from actorrpc.agent._call_result import CallResult, complete
    from actorrpc.agent._futures import Future
    from actorrpc.serialization import dumps, loads
    from actorrpc.serialization._tensors import _reduce_general, reduce_tensor

    tensor = torch.rand(64, 64)
    array_form = reduce_tensor(tensor)
    general_form = _reduce_general(tensor)
    array_args = (*array_form[1][:3], pickle.PickleBuffer(tensor.numpy()).raw())
    general_args = (*general_form[1][:5], pickle.PickleBuffer(tensor.numpy()).raw())
    payload, buffers = dumps((torch.add, (tensor, tensor), {}, {}))

    def torch_future() -> Any:
        future: Future[int] = Future("call")
        complete(future, 1)
        return future.wait()

    def call_result() -> Any:
        result: CallResult[int] = CallResult("call")
        complete(result, 1)
        return result.wait()

    return {
        "python: sum(range(300))": lambda: sum(range(300)),
        "torch: tensor.dtype": lambda: tensor.dtype,
        "torch: tensor.numpy()": tensor.numpy,
        "tensor, array form: reduce": lambda: reduce_tensor(tensor),
        "tensor, general form: reduce": lambda: _reduce_general(tensor),
        "tensor, array form: rebuild": lambda: array_form[0](*array_args),
        "tensor, general form: rebuild": lambda: general_form[0](*general_args),
        "dumps(None)": lambda: dumps(None),
        "dumps(torch.add call, 2 tensors)": lambda: dumps((torch.add, (tensor, tensor), {}, {})),
        "loads(torch.add call, 2 tensors)": lambda: loads(payload, buffers),
        "torch future: make, complete, wait": torch_future,
        "CallResult: make, complete, wait": call_result,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1500, help="runs per operation")
    parser.add_argument("--evict-mib", type=int, default=4, help="MiB touched between runs")
    args = parser.parse_args(argv)
    evict = Evictor(args.evict_mib)
    print(f"{'operation':40s} {'warm µs':>9s} {'cold µs':>9s} {'cold/warm':>9s}")
    for name, fn in operations().items():
        warm = warm_us(fn, args.n)
        cold = cold_us(fn, args.n, evict)
        print(f"{name:40s} {warm:9.2f} {cold:9.2f} {cold / warm:8.1f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
