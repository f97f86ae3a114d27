"""Batch-updating parameter server: one update per round of gradients from all trainers.

Run (a server and two trainers, synthetic data, no downloads)::

    actorrpc launch --nproc-per-node 3 examples/batch_update_ps.py

As in PyTorch's "Implementing Batch RPC Processing Using Asynchronous
Executions" tutorial: rank 0 is the parameter server ``ps``, every other rank a
trainer ``trainer<rank>``. Each trainer fetches the model, computes gradients
locally with plain autograd and sends them to
``BatchUpdateParameterServer.update_and_fetch_model``, a static method marked
``@rpc.functions.async_execution``. The server adds them up and returns a
Future that completes only once every trainer has reported for this round: the
last one averages the gradients, steps the optimizer and completes the Future
with the new model, which every waiting trainer receives. No server thread is
blocked while a round is incomplete.

With ``--check`` and a single trainer (``--nproc-per-node 2``) the server also
trains the same model on the same data in one process and checks that every
step's loss matches within 1e-5.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn

import actorrpc as rpc

from _common import (
    check_losses,
    example_arguments,
    init_parameter_server_group,
    report_losses,
    train_in_one_process,
)

FEATURES, HIDDEN, CLASSES = 20, 32, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


class BatchUpdateParameterServer:
    """Holds the model; applies one averaged update per round of ``batch_update_size`` reports."""

    def __init__(self, batch_update_size: int, lr: float) -> None:
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model: torch.futures.Future[nn.Module] = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.updates = 0
        self.optimizer = make_optimizer(self.model, lr)
        self.grad_sums = [torch.zeros_like(p) for p in self.model.parameters()]

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(
        ps_rref: rpc.RRef[BatchUpdateParameterServer], grads: list[torch.Tensor]
    ) -> torch.futures.Future[nn.Module]:
        """Add one trainer's gradients; the Future completes when this round's update is done."""
        self = ps_rref.local_value()
        with self.lock:
            for total, grad in zip(self.grad_sums, grads):
                total += grad
            self.curr_update_size += 1
            future = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p, total in zip(self.model.parameters(), self.grad_sums):
                    p.grad = total / self.batch_update_size  # the round's average
                    total.zero_()
                self.optimizer.step()
                self.curr_update_size = 0
                self.updates += 1
                self.future_model = torch.futures.Future()
                future.set_result(self.model)  # every trainer of this round gets the new model
        return future

    def update_count(self) -> int:
        with self.lock:
            return self.updates


Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(trainer: int, steps: int, batch: int = 32) -> list[Batch]:
    weights = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(42))
    generator = torch.Generator().manual_seed(1000 + trainer)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, FEATURES, generator=generator)
        batches.append((x, (x @ weights).argmax(dim=1)))
    return batches


def gradients(model: nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]


def run_trainer(ps_rref: rpc.RRef[BatchUpdateParameterServer], steps: int) -> list[float]:
    """Runs on a trainer (started by the server): report gradients, get the next model."""
    name = rpc.get_worker_info().name
    trainer = int(name.removeprefix("trainer"))
    model: nn.Module = ps_rref.rpc_sync().get_model()
    losses = []
    for x, y in make_batches(trainer, steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        model = rpc.rpc_sync(
            ps_rref.owner(),
            BatchUpdateParameterServer.update_and_fetch_model,
            args=(ps_rref, gradients(model)),
        )
    return losses


def train_locally(trainer: int, steps: int, lr: float) -> list[float]:
    model = make_model()
    optimizer = make_optimizer(model, lr)
    return train_in_one_process(model, optimizer, make_batches(trainer, steps))


def main() -> int:
    parser = example_arguments(__doc__ or "", steps=30, lr=0.1)
    args = parser.parse_args()
    rank, world = init_parameter_server_group(parser)
    name = rpc.get_worker_info().name
    status = 0
    if rank == 0:
        trainers = [f"trainer{r}" for r in range(1, world)]
        server = BatchUpdateParameterServer(len(trainers), args.lr)
        ps_rref = rpc.RRef(server)
        futures: list[torch.futures.Future[list[float]]] = [
            rpc.rpc_async(t, run_trainer, args=(ps_rref, args.steps)) for t in trainers
        ]
        all_losses = torch.futures.wait_all(futures)
        assert server.update_count() == args.steps, server.update_count()
        for trainer, losses in zip(trainers, all_losses):
            report_losses(trainer, losses)
        print(f"{name} applied {server.update_count()} batch updates", flush=True)
        if args.check:
            expected = train_locally(1, args.steps, args.lr)
            status = check_losses(name, all_losses[0], expected, applicable=len(trainers) == 1)
    rpc.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
