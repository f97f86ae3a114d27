"""The body of ``RecvRpc.forward`` (:mod:`._nodes`), apart from its class so that the
compiled build compiles it.

torch's C++ ``Function.apply`` calls ``forward`` once per message that carries
tensors requiring grad: a compiled function is called without a Python frame,
while the classes themselves stay Python (torch's ``FunctionMeta`` makes their
node classes). Measured on the pinned autograd iteration: -0.5 %, better in 10 of
12 block pairs (``docs/performance.md``, thirty-fourth session).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["detached_inputs"]

_detach = torch.Tensor.detach


def detached_inputs(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> tuple[Any, ...]:
    """``RecvRpc.forward``: new tensor objects sharing the data of ``tensors`` (not views:
    users may modify received tensors in place); ``anchor`` only makes them require grad."""
    return tuple(map(_detach, tensors))
