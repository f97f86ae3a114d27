"""Pipeline parallelism: a model split in two shards on two workers, micro-batches in flight.

Run (a driver and two shard workers, synthetic data, no downloads)::

    actorrpc launch --nproc-per-node 3 examples/pipeline_parallel.py

As in PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial: rank 0
is the driver ``driver``; ranks 1 and 2 (``worker1``, ``worker2``) each hold one
shard of an MLP. The driver splits every batch into micro-batches and sends
them through the pipeline without waiting: micro-batch *i* runs on shard 1
(``rref.remote().forward``) while micro-batch *i-1* runs on shard 2
(``rref.rpc_async().forward``), which fetches its input straight from shard 1
with ``to_here()``. ``torch.futures.wait_all`` collects the outputs; one
``actorrpc.autograd`` backward and one ``DistributedOptimizer`` step follow per
batch.

With ``--check`` the driver also trains the unsplit model on the same data in
one process and checks that every step's loss matches within 1e-5.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn

import actorrpc as rpc
import actorrpc.autograd as dist_autograd
from actorrpc.optim import DistributedOptimizer

from _common import check_losses, example_arguments, report_losses, train_in_one_process

FEATURES, HIDDEN, CLASSES = 16, 64, 4
SPLIT = 4  # layers [0, SPLIT) form shard 1, the rest shard 2


def make_model() -> nn.Sequential:
    """The unsplit model; every shard builds it from the same seed and keeps its part."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


class Shard(nn.Module):
    """One part of the model, living on a worker; ``forward`` takes an RRef to its input."""

    def __init__(self, part: int) -> None:
        super().__init__()
        model = make_model()
        self.layers = model[:SPLIT] if part == 0 else model[SPLIT:]
        self._lock = threading.Lock()  # one micro-batch at a time through this shard

    def forward(self, x_rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
        x = x_rref.to_here()
        with self._lock:
            return self.layers(x)

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        return [rpc.RRef(p) for p in self.parameters()]


class DistPipeline(nn.Module):
    """Drives the two shards; ``forward`` keeps all micro-batches of a batch in flight."""

    def __init__(self, workers: tuple[str, str], micro_batch: int) -> None:
        super().__init__()
        self.micro_batch = micro_batch
        self.shard1 = rpc.remote(workers[0], Shard, args=(0,))
        self.shard2 = rpc.remote(workers[1], Shard, args=(1,))

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for x in xs.split(self.micro_batch):
            x_rref = rpc.RRef(x)
            y_rref = self.shard1.remote().forward(x_rref)  # returns at once
            outputs.append(self.shard2.rpc_async().forward(y_rref))  # so does this
        return torch.cat(torch.futures.wait_all(outputs))

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        return [
            *self.shard1.rpc_sync().parameter_rrefs(),
            *self.shard2.rpc_sync().parameter_rrefs(),
        ]


def make_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    weights = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(42))
    generator = torch.Generator().manual_seed(1000)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, FEATURES, generator=generator)
        batches.append((x, (x @ weights).argmax(dim=1)))
    return batches


def train(steps: int, batch: int, micro_batch: int, lr: float) -> list[float]:
    model = DistPipeline(("worker1", "worker2"), micro_batch)
    optimizer = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=lr, momentum=0.9)
    losses = []
    for x, y in make_batches(steps, batch):
        with dist_autograd.context() as context_id:
            loss = F.cross_entropy(model(x), y)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        losses.append(loss.item())
    return losses


def train_locally(steps: int, batch: int, lr: float) -> list[float]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return train_in_one_process(model, optimizer, make_batches(steps, batch))


def main() -> int:
    parser = example_arguments(__doc__ or "", steps=40, lr=0.1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 3:
        parser.error("needs a driver and two shard workers (--nproc-per-node 3)")
    name = "driver" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world)
    status = 0
    if rank == 0:
        losses = train(args.steps, args.batch, args.micro_batch, args.lr)
        report_losses(name, losses)
        if args.check:
            expected = train_locally(args.steps, args.batch, args.lr)
            status = check_losses(name, losses, expected, reference="unsplit single-process loss")
    rpc.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
