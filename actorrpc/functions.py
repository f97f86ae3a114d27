"""``actorrpc.functions``: decorators for RPC functions (``torch.distributed.rpc.functions``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future``; the callee replies when it completes.

    No pool thread is held while the Future is pending, so any number of such
    calls can be in flight. Under ``@staticmethod``/``@classmethod`` put this
    decorator innermost.

    Example::

        >>> @rpc.functions.async_execution
        ... def async_add_chained(to, x, y, z):
        ...     return rpc.rpc_async(to, torch.add, args=(x, y)).then(
        ...         lambda fut: fut.wait() + z)
        >>> # on worker0
        >>> rpc.rpc_sync("worker1", async_add_chained,
        ...              args=("worker2", torch.ones(2), 1, 1))
        tensor([3., 3.])
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._actorrpc_async_execution = True  # type: ignore[attr-defined]
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
