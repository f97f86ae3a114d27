"""The identity ``torch.autograd.Function`` s whose nodes mark where tensors left and
arrived (:mod:`._functions` says how they are used).

Kept apart so that they stay Python classes in the compiled build: torch's
``FunctionMeta`` makes their node classes, and a compiled class body does not go
through it (``actorrpc/_compiled.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ._node_bodies import detached_inputs

__all__ = ["RecvRpc", "SendRpc"]

_detach = torch.Tensor.detach


class SendRpc(torch.autograd.Function):
    """Identity; its node marks where tensors left this worker."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        # A tensor of the message that gets no gradient passes None on (as torch's
        # undefined gradient), so its inputs get no (zero) gradient entry.
        ctx.set_materialize_grads(False)
        # detach(): new tensor objects sharing the data but not flagged as views.
        return tuple(map(_detach, tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return grads


class RecvRpc(torch.autograd.Function):
    """Identity; its node (tagged with the message) is the grad_fn of received tensors."""

    forward = staticmethod(detached_inputs)  # (compiled in the compiled build)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        # Only reached by a plain local backward (outside dist_autograd.backward):
        # nothing flows to the anchor, and nothing is sent.
        return (None,) * (1 + len(grads))
