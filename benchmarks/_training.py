"""The training-step metric: one iteration of PyTorch's model-parallel RNN tutorial.

"Distributed RNN using Distributed Autograd and Distributed Optimizer": the embedding
table and the decoder live on the peer (``RemoteModule``), the LSTM on the measuring
worker. One step is two RPCs forward (embedding, decoder), a distributed backward
through both, and a ``DistributedOptimizer`` (SGD) step on the remote parameters and
the local ones (``RRef(p)``). The same code runs against ``torch.distributed`` and
``actorrpc``: only the four modules it is given differ.

Sizes are the tutorial's small ones (24 tokens, 16-wide embedding, a 2-layer LSTM of
32, windows of 10 x 8 tokens), so the step measures the framework more than the math;
the local LSTM's forward and backward are the same for both backends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NTOKEN, NINP, NHID, NLAYERS = 24, 16, 32, 2
BPTT, BATCH = 10, 8
LEARNING_RATE = 0.05


class EmbeddingTable(nn.Module):
    """Lives on the peer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.encoder = nn.Embedding(NTOKEN, NINP)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens)


class Decoder(nn.Module):
    """Lives on the peer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.decoder = nn.Linear(NHID, NTOKEN)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(output)


@dataclass(frozen=True)
class Stack:
    """The four modules a backend provides for the step."""

    rpc: ModuleType
    dist_autograd: ModuleType
    remote_module: Any  # RemoteModule class
    distributed_optimizer: Any  # DistributedOptimizer class


def stack_of(backend: str, rpc: ModuleType, dist_autograd: ModuleType) -> Stack:
    if backend == "torch":
        from torch.distributed.nn import RemoteModule
        from torch.distributed.optim import DistributedOptimizer
    else:
        from actorrpc.nn import RemoteModule  # type: ignore[assignment]
        from actorrpc.optim import DistributedOptimizer  # type: ignore[assignment]
    return Stack(rpc, dist_autograd, RemoteModule, DistributedOptimizer)


def make_train_step(stack: Stack, peer: str) -> tuple[Callable[[], None], list[float]]:
    """The model (its tables and decoder on ``peer``) and one training step of it; the
    list gets each step's loss."""
    embedding = stack.remote_module(f"{peer}/cpu", EmbeddingTable)
    torch.manual_seed(2)
    lstm = nn.LSTM(NINP, NHID, NLAYERS)
    decoder = stack.remote_module(f"{peer}/cpu", Decoder)
    params = [
        *embedding.remote_parameters(),
        *(stack.rpc.RRef(p) for p in lstm.parameters()),
        *decoder.remote_parameters(),
    ]
    optimizer = stack.distributed_optimizer(torch.optim.SGD, params, lr=LEARNING_RATE)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(NTOKEN, (BPTT + 1, BATCH), generator=generator)
    inputs, targets = tokens[:-1], tokens[1:].reshape(-1)  # learnable: one fixed window
    hidden = (torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID))
    losses: list[float] = []

    def step() -> None:
        nonlocal hidden
        hidden = (hidden[0].detach(), hidden[1].detach())
        with stack.dist_autograd.context() as context_id:
            output, hidden = lstm(embedding(inputs), hidden)
            loss = F.cross_entropy(decoder(output).view(-1, NTOKEN), targets)
            stack.dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        losses.append(loss.detach().item())

    return step, losses


def train_step_times(stack: Stack, peer: str, warmup: int, n: int) -> list[float]:
    """Durations (s) of ``n`` training steps after ``warmup`` untimed ones; checks that
    the loss falls (the parameters really are updated on both workers)."""
    step, losses = make_train_step(stack, peer)
    times = []
    clock = time.perf_counter
    for index in range(warmup + n):
        began = clock()
        step()
        if index >= warmup:
            times.append(clock() - began)
    if len(losses) >= 10 and not losses[-1] < losses[0]:
        raise AssertionError(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    return times
