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


def _set_training(module_rref: RRef[torch.nn.Module], mode: bool) -> None:
    module_rref.local_value().train(mode)


def _parameter_rrefs(module_rref: RRef[torch.nn.Module], recurse: bool) -> list[RRef[Any]]:
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


def parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    """Split ``"worker1/cpu"``, ``"rank:1/cpu"`` or ``"worker1"`` into the worker and the device.

    The worker is a name, or a rank (``int``) for the ``"rank:N"`` form.
    """
    if not isinstance(remote_device, str):
        raise InvalidArgumentError(
            f"remote_device must be a str like 'worker1/cpu', got {type(remote_device).__name__}"
        )
    worker, _, device = remote_device.partition("/")
    device = device or "cpu"
    if not worker:
        raise InvalidArgumentError(
            f"remote_device {remote_device!r} must look like '<worker name>/cpu'"
        )
    try:
        device_type = torch.device(device).type
    except RuntimeError as exc:
        raise InvalidArgumentError(f"remote_device {remote_device!r}: {exc}") from None
    if device_type != "cpu":
        raise InvalidArgumentError(
            f"remote_device {remote_device!r}: actorrpc moves CPU tensors only; "
            f"use '{worker}/cpu'"
        )
    if worker.startswith("rank:"):
        rank = worker[len("rank:"):]
        if not rank.isdigit():
            raise InvalidArgumentError(
                f"remote_device {remote_device!r}: 'rank:' must be followed by a rank"
            )
        return int(rank), device
    return worker, device


class RemoteModule(torch.nn.Module):
    """Create ``module_cls(*args, **kwargs)`` on a remote worker and call it from here.

    ``forward`` and ``forward_async`` run on the owner; inside a distributed
    autograd context gradients flow through them. ``remote_parameters()``
    gives RRefs for a :class:`~actorrpc.optim.DistributedOptimizer`;
    ``train()``/``eval()`` set the mode of the remote module. ``remote_device``
    is ``"<name>/cpu"`` or ``"rank:<N>/cpu"``; other devices raise ValueError.
    As in torch, the ``nn.Module`` methods that would act on this empty local
    shell (``parameters``, ``state_dict``, ``to``, ``children``, ...) raise
    ValueError instead of silently doing nothing.

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
        return current_agent().call_and_wait(
            self.owner, _forward, (self.module_rref, args, kwargs), {}
        )

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``forward`` on the owner and return a Future of its output."""
        return current_agent().call(self.owner, _forward, (self.module_rref, args, kwargs), {})

    def remote_parameters(self, recurse: bool = True) -> list[RRef[Any]]:
        """RRefs to the remote module's parameters."""
        agent = current_agent()
        result: list[RRef[Any]] = agent.call_and_wait(
            self.owner, _parameter_rrefs, (self.module_rref, recurse), {}
        )
        return result

    def get_module_rref(self) -> RRef[torch.nn.Module]:
        """The RRef to the module on its owner."""
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set training mode on the remote module (and on this shell)."""
        current_agent().call_and_wait(self.owner, _set_training, (self.module_rref, mode), {})
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        """Set evaluation mode on the remote module (``train(False)``)."""
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Any:
        raise InvalidArgumentError(
            "RemoteModule does not hold its parameters here; use remote_parameters()"
        )

    def __repr__(self) -> str:
        return f"RemoteModule(owner={self.owner!r}, module={self.module_rref})"


# nn.Module methods that would act on the empty local shell instead of the remote
# module (as in torch, they raise instead of silently doing nothing).
_UNSUPPORTED = (
    "add_module", "apply", "bfloat16", "buffers", "children", "cpu", "cuda", "double",
    "extra_repr", "float", "half", "ipu", "load_state_dict", "modules", "named_buffers",
    "named_children", "named_modules", "named_parameters", "register_backward_hook",
    "register_buffer", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "register_parameter", "requires_grad_", "share_memory",
    "state_dict", "to", "type", "xpu", "zero_grad",
)


def _not_supported(method: str) -> Any:
    def raise_not_supported(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgumentError(
            f"Method ``{method}`` not supported for RemoteModule: the module lives on "
            f"{self.owner.name}; use remote_parameters(), get_module_rref() or an RPC instead"
        )

    raise_not_supported.__name__ = method
    raise_not_supported.__qualname__ = f"RemoteModule.{method}"
    return raise_not_supported


for _method in _UNSUPPORTED:
    setattr(RemoteModule, _method, _not_supported(_method))
del _method
