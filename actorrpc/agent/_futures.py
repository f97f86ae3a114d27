"""Futures returned by the RPC API: ``torch.futures.Future`` that never hang.

A :class:`Future` is completed by the agent with :func:`complete`. ``wait()``
is interruptible (Ctrl-C in a notebook interrupts the wait, not the agent),
refuses to run on the agent's I/O thread (where it could only deadlock), and
fails instead of blocking forever when the agent that should complete it dies.
"""

from __future__ import annotations

import _thread
from collections.abc import Generator
from typing import Any, Generic, TypeVar

import torch

from ._call_result import describe, fresh_error, wait_done

__all__ = ["Completion", "Future"]

T = TypeVar("T")
# torch.futures.Future's methods without their Python layer (a frame per call)
_init_torch_future = torch._C.Future.__init__
_torch_wait = torch._C.Future.wait


class Completion:
    """The state :class:`Future` keeps for the agent's completion (:func:`complete`) and its
    waits (the logic, shared with :class:`CallResult`, is in ``_call_result``)."""

    # (class defaults, set on the instance when they change: fewer stores per message)
    _done = False
    _error: BaseException | None = None
    _receiver: int | None = None  # the thread receiving on the inbox for this future
    _blocked = False  # a thread blocks on the gate (another thread completes it)
    # set by Future's __init__ (inline: one frame less per message): _gate, a lock taken
    # until the future completes; _description, a str, a (what, where) pair or a
    # callable that makes one when needed; _agent
    _gate: Any
    _description: Any
    _agent: Any

    @property
    def description(self) -> str:
        return describe(self._description)


class Future(torch.futures.Future, Completion, Generic[T]):  # type: ignore[misc]
    """A ``torch.futures.Future`` for an RPC; ``wait``/``then``/``done``/``value`` as in torch.

    Also awaitable: ``await rpc.rpc_async(...)`` works in asyncio code.

    Example::

        >>> # on worker0
        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        >>> fut.then(lambda f: f.wait() * 2).wait()
        tensor([4., 4.])
        >>> await rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))  # in asyncio
        tensor([2., 2.])
    """

    # (slots: no instance dict is made for a call in flight, one object fewer for the
    # collector; a dict is still made if anything else sets an attribute; the state
    # Completion keeps in class defaults is set here, as slots shadow them)
    __slots__ = ("_agent", "_blocked", "_description", "_done", "_error", "_gate", "_receiver")

    def __init__(self, description: Any = "", agent: Any = None) -> None:
        _init_torch_future(self, [])
        self._gate = gate = _thread.allocate_lock()
        gate.acquire()
        self._description = description
        self._agent = agent
        self._done = self._blocked = False
        self._error = self._receiver = None

    # (only complete() sets results; set_exception keeps torch's layer, which unwraps errors)
    set_result = torch._C.Future.set_result  # type: ignore[assignment]

    def wait(self) -> T:
        """Block until the call completes; return its result or raise its error.

        Ctrl-C interrupts the wait. Raises :class:`ActorRpcError` instead of
        deadlocking when called on the RPC I/O thread (use ``then()`` there), or
        when the agent that should complete the future stops first.

        Example::

            >>> # on worker0
            >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
            >>> fut.wait()
            tensor([2., 2.])
        """
        wait_done(self)
        if self._error is not None:
            raise fresh_error(self._error)
        return _torch_wait(self)  # type: ignore[no-any-return]

    def __await__(self) -> Generator[Any, None, T]:
        import asyncio

        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not waiter.done():
                waiter.set_result(None)

        def wake(_: Any) -> None:
            loop.call_soon_threadsafe(resolve)

        self.add_done_callback(wake)
        yield from waiter.__await__()
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<actorrpc.Future {self.description} {state}>"
