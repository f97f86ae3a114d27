"""Modules that live on other workers (``torch.distributed.nn``)."""

from ._remote_module import RemoteModule

__all__ = ["RemoteModule"]
