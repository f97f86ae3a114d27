"""Parameter server: one server holds an MLP, trainers train it with distributed autograd.

Run (a server and two trainers, synthetic data, no downloads)::

    actorrpc launch --nproc-per-node 3 examples/parameter_server.py

Rank 0 is the parameter server ``ps``; the other ranks are ``trainer<rank>``.
Each trainer runs forward through the server's model (a ``RemoteModule`` built
from the server's module RRef), backward with ``actorrpc.autograd`` and steps a
``DistributedOptimizer``. With ``--check`` and a single trainer
(``--nproc-per-node 2``) the trainer also trains the same model on the same
data in one process and checks that every step's loss matches within 1e-5.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn

import actorrpc as rpc
import actorrpc.autograd as dist_autograd
from actorrpc.nn import RemoteModule
from actorrpc.optim import DistributedOptimizer

from _common import (
    check_losses,
    example_arguments,
    init_parameter_server_group,
    report_losses,
    train_in_one_process,
)

FEATURES, HIDDEN, CLASSES = 20, 32, 3
_model_lock = threading.Lock()
_model: nn.Module | None = None
# Trainers take turns on the shared model: an optimizer step changes the weights
# in place, and a backward still running for another trainer needs the old ones
# (torch.distributed.rpc fails the same way without such a turn).
_turn = threading.Semaphore(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def shared_model() -> rpc.RRef[nn.Module]:
    """Runs on the server: the one model every trainer trains (created once)."""
    global _model
    with _model_lock:
        if _model is None:
            _model = make_model()
        return rpc.RRef(_model)


def begin_step() -> None:
    """Runs on the server: wait for this trainer's turn (a pool thread blocks here)."""
    if not _turn.acquire(timeout=60):
        raise TimeoutError("waited 60 s for a turn on the shared model")


def end_step() -> None:
    _turn.release()


def make_batches(trainer: int, steps: int, batch: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    weights = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(42))
    generator = torch.Generator().manual_seed(1000 + trainer)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, FEATURES, generator=generator)
        batches.append((x, (x @ weights).argmax(dim=1)))
    return batches


def train(trainer: int, steps: int, lr: float) -> list[float]:
    module_rref = rpc.rpc_sync("ps", shared_model)
    model = RemoteModule.init_from_module_rref("ps/cpu", module_rref)
    optimizer = DistributedOptimizer(torch.optim.SGD, model.remote_parameters(), lr=lr)
    losses = []
    for x, y in make_batches(trainer, steps):
        rpc.rpc_sync("ps", begin_step)
        try:
            with dist_autograd.context() as context_id:
                loss = F.cross_entropy(model(x), y)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
        finally:
            rpc.rpc_sync("ps", end_step)
        losses.append(loss.item())
    return losses


def train_locally(trainer: int, steps: int, lr: float) -> list[float]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return train_in_one_process(model, optimizer, make_batches(trainer, steps))


def main() -> int:
    parser = example_arguments(__doc__ or "", steps=30, lr=0.3)
    args = parser.parse_args()
    rank, world = init_parameter_server_group(parser, min_world=1)
    name = rpc.get_worker_info().name
    status = 0
    if rank != 0:
        losses = train(rank, args.steps, args.lr)
        report_losses(name, losses)
        if args.check:
            expected = train_locally(rank, args.steps, args.lr)
            status = check_losses(name, losses, expected, applicable=world == 2)
    rpc.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
