"""Optimizers for parameters spread over the group (``torch.distributed.optim``)."""

from ._distributed_optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
