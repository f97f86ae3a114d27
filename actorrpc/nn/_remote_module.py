"""``RemoteModule``: an ``nn.Module`` whose instance lives on another worker."""

from __future__ import annotations

from typing import Any

import torch

from ..agent import Future, WorkerInfo, current_agent
from ..errors import InvalidArgumentError
from ..rref import RRef, remote

__all__ = ["RemoteModule"]


def _create_module(module_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentError(f"{module_cls!r} did not create a torch.nn.Module")
    return module


def _forward(module_rref: RRef[torch.nn.Module], args: Any, kwargs: Any) -> Any:
    return module_rref.local_value()(*args, **kwargs)


def _parameter_rrefs(module_rref: RRef[torch.nn.Module], recurse: bool) -> list[RRef[Any]]:
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


def parse_remote_device(remote_device: str) -> tuple[str, str]:
    """Split ``"worker1/cpu"`` (or ``"worker1"``) into the worker and the device."""
    worker, _, device = remote_device.partition("/")
    device = device or "cpu"
    if not worker:
        raise InvalidArgumentError(
            f"remote_device {remote_device!r} must look like '<worker name>/cpu'"
        )
    if torch.device(device).type != "cpu":
        raise InvalidArgumentError(
            f"remote_device {remote_device!r}: actorrpc moves CPU tensors only"
        )
    return worker, device


class RemoteModule(torch.nn.Module):
    """Create ``module_cls(*args, **kwargs)`` on a remote worker and call it from here.

    ``forward`` and ``forward_async`` run on the owner; inside a distributed
    autograd context gradients flow through them. ``remote_parameters()``
    gives RRefs for a :class:`~actorrpc.optim.DistributedOptimizer`.

    Example::

        >>> # on worker0
        >>> from actorrpc.nn import RemoteModule
        >>> layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
        >>> layer(torch.randn(3, 4)).shape
        torch.Size([3, 2])
    """

    def __init__(
        self,
        remote_device: str,
        module_cls: Any,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        worker, self.device = parse_remote_device(remote_device)
        self.owner: WorkerInfo = current_agent().resolve(worker)
        self.module_rref: RRef[torch.nn.Module] = remote(
            self.owner, _create_module, (module_cls, tuple(args or ()), dict(kwargs or {}))
        )
        self.module_rref._get_future().wait()  # constructor errors surface here

    @classmethod
    def init_from_module_rref(
        cls, remote_device: str, module_rref: RRef[torch.nn.Module]
    ) -> RemoteModule:
        """Wrap an existing module RRef (e.g. one shared by a parameter server)."""
        self = cls.__new__(cls)
        torch.nn.Module.__init__(self)
        worker, self.device = parse_remote_device(remote_device)
        self.owner = current_agent().resolve(worker)
        if module_rref.owner() != self.owner:
            raise InvalidArgumentError(
                f"module_rref is owned by {module_rref.owner()!r}, not by {self.owner!r}"
            )
        self.module_rref = module_rref
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.forward_async(*args, **kwargs).wait()

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``forward`` on the owner and return a Future of its output."""
        return current_agent().call(self.owner, _forward, (self.module_rref, args, kwargs), {})

    def remote_parameters(self, recurse: bool = True) -> list[RRef[Any]]:
        """RRefs to the remote module's parameters."""
        agent = current_agent()
        result: list[RRef[Any]] = agent.call(
            self.owner, _parameter_rrefs, (self.module_rref, recurse), {}
        ).wait()
        return result

    def get_module_rref(self) -> RRef[torch.nn.Module]:
        """The RRef to the module on its owner."""
        return self.module_rref

    def parameters(self, recurse: bool = True) -> Any:
        raise InvalidArgumentError(
            "RemoteModule does not hold its parameters here; use remote_parameters()"
        )

    def __repr__(self) -> str:
        return f"RemoteModule(owner={self.owner!r}, module={self.module_rref})"
