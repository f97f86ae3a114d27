"""Model-parallel RNN: embedding table and decoder on a server, the LSTM on the trainer.

Run (a parameter server and one trainer, synthetic data, no downloads)::

    actorrpc launch --nproc-per-node 2 examples/rnn_model_parallel.py

As in PyTorch's "Distributed RNN using Distributed Autograd and Distributed
Optimizer" tutorial: rank 0 is the parameter server ``ps``; it holds the
embedding table and the decoder (each a ``RemoteModule`` created by the
trainer), while the LSTM in between lives on the trainer. Every other rank is a
trainer ``trainer<rank>`` with a model of its own. The trainer learns to predict
the next token of a synthetic Markov-chain text, running backward with
``actorrpc.autograd`` and stepping one ``DistributedOptimizer`` (Adam: each
owner keeps the state of its own parameters) over the remote parameters and
its local LSTM parameters (wrapped as ``rpc.RRef(p)``).

With ``--check`` each trainer also trains the same model on the same data in
one process and checks that every step's loss matches within 1e-5.
"""

from __future__ import annotations

import sys

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
)

NTOKEN, NINP, NHID, NLAYERS = 24, 16, 32, 2
BPTT, BATCH = 10, 8
FOLLOW = 0.9


class EmbeddingTable(nn.Module):
    """Lives on the parameter server."""

    def __init__(self, ntoken: int, ninp: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens)


class Decoder(nn.Module):
    """Lives on the parameter server."""

    def __init__(self, ntoken: int, nhid: int) -> None:
        super().__init__()
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(output)


# Seeded factories: the remote and the single-process model start from the same weights.
def make_embedding() -> EmbeddingTable:
    torch.manual_seed(1)
    return EmbeddingTable(NTOKEN, NINP)


def make_rnn() -> nn.LSTM:
    torch.manual_seed(2)
    return nn.LSTM(NINP, NHID, NLAYERS)


def make_decoder() -> Decoder:
    torch.manual_seed(3)
    return Decoder(NTOKEN, NHID)


Hidden = tuple[torch.Tensor, torch.Tensor]


class RNNModel(nn.Module):
    """Embedding and decoder on ``ps`` (RemoteModule), LSTM here."""

    def __init__(self, ps: str) -> None:
        super().__init__()
        self.embedding = RemoteModule(f"{ps}/cpu", make_embedding)
        self.rnn = make_rnn()
        self.decoder = RemoteModule(f"{ps}/cpu", make_decoder)

    def forward(self, tokens: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        emb = self.embedding(tokens)  # runs on ps
        output, hidden = self.rnn(emb, hidden)  # runs here
        return self.decoder(output), hidden  # runs on ps

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        return [
            *self.embedding.remote_parameters(),
            *(rpc.RRef(p) for p in self.rnn.parameters()),
            *self.decoder.remote_parameters(),
        ]


class LocalRNNModel(nn.Module):
    """The same model in one process, for ``--check``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = make_embedding()
        self.rnn = make_rnn()
        self.decoder = make_decoder()

    def forward(self, tokens: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        output, hidden = self.rnn(self.embedding(tokens), hidden)
        return self.decoder(output), hidden


def make_batches(trainer: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` consecutive (input, target) windows, shape (BPTT, BATCH), of a synthetic text.

    Each token is followed by its fixed successor (a random permutation) with
    probability ``FOLLOW``, else by a uniformly random token: the best possible
    loss is about 0.6 nats, against log(NTOKEN) = 3.18 for a blind guess.
    """
    successor = torch.randperm(NTOKEN, generator=torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(100 + trainer)
    length = steps * BPTT + 1
    streams = torch.empty(length, BATCH, dtype=torch.long)
    streams[0] = torch.randint(NTOKEN, (BATCH,), generator=generator)
    for t in range(1, length):
        follow = torch.rand(BATCH, generator=generator) < FOLLOW
        noise = torch.randint(NTOKEN, (BATCH,), generator=generator)
        streams[t] = torch.where(follow, successor[streams[t - 1]], noise)
    return [
        (streams[i : i + BPTT], streams[i + 1 : i + 1 + BPTT])
        for i in range(0, steps * BPTT, BPTT)
    ]


def init_hidden() -> Hidden:
    return torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID)


def train(trainer: int, steps: int, lr: float) -> list[float]:
    model = RNNModel("ps")
    optimizer = DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=lr)
    hidden = init_hidden()
    losses = []
    for tokens, targets in make_batches(trainer, steps):
        hidden = (hidden[0].detach(), hidden[1].detach())  # truncated BPTT
        with dist_autograd.context() as context_id:
            output, hidden = model(tokens, hidden)
            loss = F.cross_entropy(output.view(-1, NTOKEN), targets.reshape(-1))
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        losses.append(loss.item())
    return losses


def train_locally(trainer: int, steps: int, lr: float) -> list[float]:
    model = LocalRNNModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    hidden = init_hidden()
    losses = []
    for tokens, targets in make_batches(trainer, steps):
        hidden = (hidden[0].detach(), hidden[1].detach())
        optimizer.zero_grad()
        output, hidden = model(tokens, hidden)
        loss = F.cross_entropy(output.view(-1, NTOKEN), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = example_arguments(__doc__ or "", steps=60, lr=0.03)
    args = parser.parse_args()
    rank, world = init_parameter_server_group(parser)
    name = rpc.get_worker_info().name
    status = 0
    if rank != 0:
        losses = train(rank, args.steps, args.lr)
        report_losses(name, losses)
        if args.check:
            status = check_losses(name, losses, train_locally(rank, args.steps, args.lr))
    rpc.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
