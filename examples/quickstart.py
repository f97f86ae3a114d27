"""Quickstart: rpc_sync, rpc_async and remote/to_here between two workers.

Run it with the launcher (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)::

    actorrpc launch --nproc-per-node 2 examples/quickstart.py

or by hand, in two shells::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/quickstart.py
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/quickstart.py

The same program runs under torch with ``import torch.distributed.rpc as rpc``.
"""

from __future__ import annotations

import os

import torch

import actorrpc as rpc


def add_and_scale(x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return (x + y) * scale


class Counter:
    """A tiny stateful object living on worker1, used through an RRef."""

    def __init__(self, start: int) -> None:
        self.value = start

    def increment(self, by: int = 1) -> int:
        self.value += by
        return self.value


def main() -> None:
    rank = int(os.environ["RANK"])
    # rank and world_size come from RANK / WORLD_SIZE; the group meets at
    # MASTER_ADDR:MASTER_PORT (the default init_method is env://)
    rpc.init_rpc(f"worker{rank}")

    if rank == 0:
        x, y = torch.ones(2, 2), torch.full((2, 2), 2.0)

        # 1. rpc_sync: blocks until worker1 returns the result
        result = rpc.rpc_sync("worker1", torch.add, args=(x, y))
        print(f"rpc_sync torch.add on worker1:\n{result}")

        # 2. rpc_async: returns a Future at once
        futures = [
            rpc.rpc_async("worker1", add_and_scale, args=(x, y), kwargs={"scale": float(k)})
            for k in range(1, 4)
        ]
        sums = [f.wait().sum().item() for f in futures]
        print(f"rpc_async add_and_scale on worker1, sums: {sums}")

        # 3. remote: the value stays on worker1; the RRef refers to it
        rref = rpc.remote("worker1", torch.matmul, args=(x, y))
        print(f"remote torch.matmul on worker1, to_here():\n{rref.to_here()}")

        counter = rpc.remote("worker1", Counter, args=(10,))
        print(f"remote Counter on worker1, increment(5) -> {counter.rpc_sync().increment(5)}")
        print("quickstart done")

    # every worker waits here until all workers are done, then leaves
    rpc.shutdown()


if __name__ == "__main__":
    main()
