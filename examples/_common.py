"""What the training examples share: their options, loss reports and the one-process check."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F

import actorrpc as rpc


def example_arguments(doc: str, steps: int, lr: float) -> argparse.ArgumentParser:
    """``--steps``, ``--lr`` and ``--check`` (compare every step's loss with one process)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--check", action="store_true", help="compare with a one-process run")
    return parser


def init_parameter_server_group(
    parser: argparse.ArgumentParser, min_world: int = 2
) -> tuple[int, int]:
    """Join the launcher's group (RANK, WORLD_SIZE): rank 0 is ``ps``, others ``trainer<rank>``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < min_world:
        parser.error("needs a parameter server and at least one trainer (--nproc-per-node 2)")
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=world)
    return rank, world


def report_losses(name: str, losses: list[float]) -> None:
    """Print about ten steps' losses and the final one, so the fall is visible."""
    for step in range(0, len(losses), max(1, len(losses) // 10)):
        print(f"{name} step {step:3d} loss {losses[step]:.4f}", flush=True)
    print(f"{name} final loss {losses[-1]:.4f} (first {losses[0]:.4f})", flush=True)


def check_losses(
    name: str, losses: list[float], expected: list[float], applicable: bool = True,
    reference: str = "single-process loss",
) -> int:
    """Print whether every step's loss equals the reference run within 1e-5; 0 if it does."""
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    ok = applicable and len(losses) == len(expected) and worst <= 1e-5
    print(f"{name} check: max |loss - {reference}| = {worst:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def train_in_one_process(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> list[float]:
    """The reference run for ``--check``: plain local training with cross-entropy."""
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
