"""The public ``dist_autograd`` functions: ``context``, ``backward``, ``get_gradients``."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from ..errors import DistAutogradError, InvalidArgumentError
from ._context import THREAD_CONTEXT as _current  # this thread's current context id
from ._context import DistAutogradContext, current_context_id
from ._engine import AutogradEngine, checked_roots, current_engine

__all__ = [
    "backward",
    "context",
    "debug_info",
    "get_gradients",
    "is_available",
]


class context:  # noqa: N801 - torch's name
    """A distributed autograd context; ``with`` yields its id, unique across the group.

    The id is ``(rank << 48) | counter``. The context is current for this thread
    inside the block, so RPCs made there record the distributed graph; a thread
    can be in one context at a time. Leaving the block releases the context here
    and on every worker that took part (asynchronously, best effort).

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     t1 = torch.rand(3, 3, requires_grad=True)
        ...     loss = rpc.rpc_sync("worker1", torch.add, args=(t1, 1)).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     grads = dist_autograd.get_gradients(context_id)  # {t1: ...}

    Raises:
        DistAutogradError: on entry, if this thread is already in a context.
    """

    # (class defaults rather than an __init__: one Python frame less per context)
    _engine: AutogradEngine | None = None
    _context_id: int | None = None

    def __enter__(self) -> int:
        current = _current  # (read and set directly: no frame each)
        if current.context_id is not None:
            raise DistAutogradError(
                "Already have an autograd context id for this thread: "
                f"{current.context_id} (contexts do not nest)"
            )
        engine = current_engine()
        ctx = engine.create_context()
        self._engine = engine
        self._context_id = ctx.context_id
        current.context_id = ctx.context_id
        return ctx.context_id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _current.context_id = None
        if self._engine is not None and self._context_id is not None:
            self._engine.release(self._context_id)
        self._engine = None
        self._context_id = None


def backward(
    context_id: Any, roots: Sequence[torch.Tensor] | None = None, retain_graph: bool = False
) -> None:
    """Run distributed backward from ``roots`` in the context ``context_id``.

    Gradients are accumulated in the context on every worker the graph spans (read
    them with :func:`get_gradients`), never in ``.grad``. Returns when the whole
    distributed graph has been processed; the first error raised anywhere is
    raised here, its message naming the worker.

    Args:
        context_id: the id from :class:`context`. The older form ``backward(roots)``
            (torch 1.4) uses the current context.
        roots: scalar tensors that require grad.
        retain_graph: keep the graph for another backward pass (forwarded to every
            worker). Without it a later pass over the same graph raises torch's
            "Trying to backward through the graph a second time" error.

    Raises:
        InvalidArgumentError (a ValueError): bad roots or context id type.
        DistAutogradError: no such context on this worker.

    Example::

        >>> # on worker0
        >>> with dist_autograd.context() as context_id:
        ...     t = torch.ones(2, requires_grad=True)
        ...     loss = rpc.rpc_sync("worker1", torch.mul, args=(t, 3)).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     print(dist_autograd.get_gradients(context_id)[t])
        tensor([3., 3.])
    """
    if roots is None and not isinstance(context_id, int):
        roots, context_id = context_id, current_context_id()  # backward(roots)
        if context_id is None:
            raise DistAutogradError(
                "backward(roots) needs a current autograd context; use "
                "'with dist_autograd.context() as context_id:' and backward(context_id, roots)"
            )
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise InvalidArgumentError(
            "context_id must be an int from dist_autograd.context(), got "
            f"{type(context_id).__name__}"
        )
    if not isinstance(retain_graph, bool):
        raise InvalidArgumentError(
            f"retain_graph must be a bool, got {type(retain_graph).__name__}"
        )
    roots_list = checked_roots(roots)  # (before the engine: a bad argument is named first)
    current_engine().backward(context_id, roots_list, retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's accumulated gradients in the context: ``{leaf tensor: gradient}``.

    The values are the context's own tensors: a later backward pass in the same
    context adds into them in place.

    Raises:
        DistAutogradError: "Could not find autograd context with id: N".

    Example::

        >>> # on worker0
        >>> with dist_autograd.context() as context_id:
        ...     t = torch.ones(2, requires_grad=True)
        ...     dist_autograd.backward(context_id, [rpc.rpc_sync("worker1", torch.sum, args=(t,))])
        ...     grads = dist_autograd.get_gradients(context_id)
        >>> grads[t], t.grad  # not accumulated in .grad
        (tensor([1., 1.]), None)
    """
    return current_engine().store.retrieve(context_id).gradients()


def is_available() -> bool:
    """Always ``True``.

    Example::

        >>> import actorrpc.autograd as dist_autograd
        >>> dist_autograd.is_available()
        True
    """
    return True


# -- private helpers (torch's test-suite names) -----------------------------------------------


def _current_context() -> DistAutogradContext:
    """The current thread's context; raises when there is none."""
    context_id = current_context_id()
    if context_id is None:
        raise DistAutogradError("Current thread doesn't have a valid autograd context")
    return current_engine().store.retrieve(context_id)


def _retrieve_context(context_id: int) -> DistAutogradContext:
    """The context with this id on this worker; raises when it is not here."""
    return current_engine().store.retrieve(context_id)


def _get_max_id() -> int:
    """The largest context id this worker can create."""
    return current_engine().store.context_ids.max_id


def debug_info() -> dict[str, Any]:
    """Counts on this worker: contexts, send and recv functions, known workers, passes.

    A dict: ``num_autograd_contexts``, ``num_send_functions``,
    ``num_recv_functions``, ``known_worker_ids`` (a sorted list of ranks) and
    ``num_current_backward_passes``.

    Example::

        >>> # on worker0
        >>> with dist_autograd.context() as context_id:
        ...     y = rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2, requires_grad=True), 2))
        ...     info = dist_autograd.debug_info()
        >>> info["num_autograd_contexts"], info["num_send_functions"], info["known_worker_ids"]
        (1, 1, [1])
    """
    return current_engine().debug_info()


_get_debug_info = debug_info


def _wait_for_cleanup(timeout: float = 30.0) -> bool:
    """Wait until no other worker holds a context this worker created and has left.

    Releases propagate transitively as notifications nobody acknowledges, so this
    asks every worker until none holds one: ``True`` then, ``False`` on timeout.
    """
    return current_engine().wait_for_cleanup(timeout)
