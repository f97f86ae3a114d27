"""Futures returned by the RPC API: ``torch.futures.Future`` that never hang.

A :class:`Future` is completed by the agent with :func:`complete`. ``wait()``
is interruptible (Ctrl-C in a notebook interrupts the wait, not the agent),
refuses to run on the agent's I/O thread (where it could only deadlock), and
fails instead of blocking forever when the agent that should complete it dies.
"""

from __future__ import annotations

import _thread
import logging
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import torch

from ..errors import ActorRpcError

__all__ = ["CallResult", "Completion", "Future", "complete"]

T = TypeVar("T")

_log = logging.getLogger("actorrpc.agent")
_LIVENESS_CHECK_INTERVAL = 1.0
# torch.futures.Future's methods without their Python layer (a frame per call)
_init_torch_future = torch._C.Future.__init__
_torch_wait = torch._C.Future.wait


class Completion:
    """What the agent completes (:func:`complete`) and a caller waits for: the state and
    waiting :class:`Future` and :class:`CallResult` share."""

    # (class defaults, set on the instance when they change: fewer stores per message)
    _done = False
    _error: BaseException | None = None
    _receiver: int | None = None  # the thread receiving on the inbox for this future
    _blocked = False  # a thread blocks on the gate (another thread completes it)
    # set by each subclass's __init__ (inline: one frame less per message): _gate, a lock
    # taken until the future completes; _description, a str, a (what, where) pair or a
    # callable that makes one when needed; _agent
    _gate: Any
    _description: Any
    _agent: Any

    def set_result(self, value: Any) -> None:
        raise NotImplementedError

    def set_exception(self, error: BaseException) -> None:
        raise NotImplementedError

    @property
    def description(self) -> str:
        text = self._description
        if type(text) is tuple:  # (what, where): "what on where"
            return f"{text[0]} on {text[1]}"
        return text() if callable(text) else str(text)

    def _wait_done(self) -> None:
        """Block until completed, or at least marked done (see :meth:`Future.wait`)."""
        if not self._done:
            agent = self._agent
            if agent is not None and (
                threading.get_ident() == agent.io_thread_ident
                or agent.inbox.held_by_current_thread()
            ):
                raise ActorRpcError(
                    f"waiting on {self.description or 'a future'} from the RPC I/O thread would "
                    "deadlock; use Future.then() instead of blocking inside a callback"
                )
            if agent is None or not agent.inbox.receive_until(agent, self):
                self._wait_on_gate(agent)

    def _wait_on_gate(self, agent: Any) -> None:
        """Block until another thread (the inbox's holder) completes this future."""
        self._blocked = True
        if agent is not None:
            inbox = agent.inbox
            inbox.count_blocked(1)
            if not inbox.lock.locked():  # the holder may have left before it saw the count:
                inbox.resume()  # the I/O thread takes the inbox (a blocked waiter needs it)
        try:
            while not self._gate.acquire(timeout=_LIVENESS_CHECK_INTERVAL):
                if agent is not None and not agent.is_alive():
                    raise ActorRpcError(
                        f"the RPC agent stopped before {self.description or 'the future'} completed"
                    )
            self._gate.release()  # let any other waiter through
        finally:
            if agent is not None:
                agent.inbox.count_blocked(-1)


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
        self._wait_done()
        if self._error is not None:
            raise _fresh(self._error)
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


class CallResult(Completion, Generic[T]):
    """The result of a call only its caller waits for (``rpc_sync``): a :class:`Future`'s
    completion and ``wait()``, without the C++ future nobody else would see (creating,
    completing and reading one are three torch calls, ~20 µs between messages)."""

    __slots__ = ("_agent", "_blocked", "_callbacks", "_claim", "_description", "_done", "_error",
                 "_gate", "_receiver", "_value")

    def __init__(self, description: Any = "", agent: Any = None) -> None:
        self._gate = gate = _thread.allocate_lock()
        gate.acquire()
        self._description = description
        self._agent = agent
        self._done = self._blocked = False
        self._error = self._receiver = None
        self._value: Any = None
        self._claim = _thread.allocate_lock()  # taken by the one completion (as torch's raises)
        self._callbacks: list[Callable[[CallResult[T]], None]] = []

    def add_done_callback(self, callback: Callable[[CallResult[T]], None]) -> None:
        """Run ``callback(self)`` once completed (at once if it is), as torch's futures do."""
        self._callbacks.append(callback)
        if self._done and not self._gate.locked():  # (done())
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        # each callback is popped by exactly one thread (the completing one, or one adding
        # a callback after completion), in the order they were added
        callbacks = self._callbacks
        while callbacks:
            try:
                callback = callbacks.pop(0)
            except IndexError:
                return
            try:
                callback(self)
            except BaseException:  # noqa: BLE001 - as torch: only logged; the others still run
                _log.exception("a CallResult callback failed")

    def set_result(self, value: Any) -> None:
        if not self._claim.acquire(blocking=False):  # (_take_claim)
            raise RuntimeError("the call's result was set already")
        self._value = value

    def set_exception(self, error: BaseException) -> None:
        self._take_claim()  # (complete() keeps the error)

    def _take_claim(self) -> None:
        if not self._claim.acquire(blocking=False):
            raise RuntimeError("the call's result was set already")

    def done(self) -> bool:
        return self._done and not self._gate.locked()  # (marked done before the value is set)

    def wait(self) -> T:
        """Block until the call completes; return its result or raise its error (as
        :meth:`Future.wait`)."""
        self._wait_done()
        if self._gate.locked():  # marked done, not yet completed (by another thread)
            self._wait_on_gate(self._agent)
        if self._error is not None:
            raise _fresh(self._error)
        return self._value  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<actorrpc.CallResult {self.description} {'done' if self._done else 'pending'}>"


def _fresh(error: BaseException) -> BaseException:
    """A copy of a stored error to raise, so the stored one never collects a traceback.

    (A traceback holds the frames it passes through, and they may hold the
    future itself: a cycle through the C++ future that gc cannot break.)
    """
    from ._calls import copy_error

    return copy_error(error)


def complete(future: Completion, value: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` once; later completions (a late reply after a timeout) are ignored."""
    if future._done:
        return
    future._done = True
    try:
        if error is not None:
            future._error = error
            future.set_exception(error)
        else:
            future.set_result(value)
    except RuntimeError:
        return  # a racing path completed it first and opened the gate
    future._gate.release()
    if isinstance(future, CallResult) and future._callbacks:
        future._run_callbacks()
    agent = future._agent
    if agent is not None:
        if future._blocked:
            agent.inbox.hand_off()
        receiver = future._receiver
        if receiver is not None and receiver != threading.get_ident():
            agent.wake_inbox()  # completed elsewhere (timeout, dead peer): end the turn
