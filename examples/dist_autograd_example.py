"""Train a tiny model split across two workers with distributed autograd.

worker0 holds the data and the first layer; worker1 holds the second layer (and
its optimizer) behind an RRef. Each step runs in its own autograd context: the
forward pass crosses to worker1 and back, ``dist_autograd.backward`` sends the
gradients back across, and each worker updates its own parameters from the
gradients stored in the context on that worker (``.grad`` is never written by
distributed backward; we copy the context's gradients there for torch.optim).

Run::

    actorrpc launch --nproc-per-node 2 examples/dist_autograd_example.py
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

import actorrpc as rpc
import actorrpc.autograd as dist_autograd  # registers distributed autograd before init_rpc

STEPS = 40
LR = 0.05


def make_head(in_features: int, out_features: int, lr: float) -> dict[str, Any]:
    """On worker1: the second layer and its optimizer (the RRef's value)."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(in_features, out_features)
    return {"layer": layer, "optimizer": torch.optim.SGD(layer.parameters(), lr=lr)}


def head_forward(head: rpc.RRef, hidden: torch.Tensor) -> torch.Tensor:
    """On worker1 (the owner): run the second layer."""
    return head.local_value()["layer"](hidden)


def apply_gradients(params: Any, optimizer: torch.optim.Optimizer, context_id: int) -> None:
    """Step ``optimizer`` with this worker's gradients from the autograd context."""
    grads = dist_autograd.get_gradients(context_id)
    for param in params:
        param.grad = grads.get(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def head_step(head: rpc.RRef, context_id: int) -> None:
    """On worker1: update the second layer from its gradients in ``context_id``."""
    value = head.local_value()
    apply_gradients(value["layer"].parameters(), value["optimizer"], context_id)


def train() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(64, 8)
    targets = inputs @ torch.randn(8, 1) + 0.1 * torch.randn(64, 1)
    body = torch.nn.Linear(8, 16)
    optimizer = torch.optim.SGD(body.parameters(), lr=LR)
    head = rpc.remote("worker1", make_head, args=(16, 1, LR))
    for step in range(STEPS):
        with dist_autograd.context() as context_id:
            hidden = torch.relu(body(inputs))
            prediction = rpc.rpc_sync("worker1", head_forward, args=(head, hidden))
            loss = F.mse_loss(prediction, targets)
            dist_autograd.backward(context_id, [loss])
            apply_gradients(body.parameters(), optimizer, context_id)
            rpc.rpc_sync("worker1", head_step, args=(head, context_id))
        if step % 5 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)


def main() -> None:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    try:
        if rank == 0:
            train()
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
