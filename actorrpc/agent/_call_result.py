"""What the agent completes and a caller waits for: :class:`CallResult` (the result of a
call only its caller waits for) and the completion and waiting it shares with
``_futures.Future``.

Compiled in the compiled build (``setup.py``): ``Future`` derives from torch's pybind
future and stays Python (``_futures``), so the logic both share lives here as functions
of a duck-typed future (a ``Future`` or a :class:`CallResult`: the attributes below),
which ``Future`` and its base class ``Completion`` call.

A future's state: ``_done`` (marked done: set first, by the one completing thread),
``_error``, ``_receiver`` (the thread receiving on the inbox for it), ``_blocked`` (a
thread blocks on the gate), ``_gate`` (a lock taken until it completes),
``_description`` (a str, a (what, where) pair or a callable that makes one when
needed) and ``_agent``.
"""

from __future__ import annotations

import _thread
import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import ActorRpcError

__all__ = ["CallResult", "complete", "describe", "fresh_error", "wait_done", "wait_on_gate"]

T = TypeVar("T")

_log = logging.getLogger("actorrpc.agent")
LIVENESS_CHECK_INTERVAL = 1.0


def describe(description: Any) -> str:
    """A future's description as text (see the module docstring)."""
    if type(description) is tuple:  # (what, where): "what on where"
        return f"{description[0]} on {description[1]}"
    return str(description()) if callable(description) else str(description)


def wait_done(future: Any) -> None:
    """Block until ``future`` is completed, or at least marked done (see ``Future.wait``)."""
    if not future._done:
        agent = future._agent
        if agent is not None and (
            threading.get_ident() == agent.io_thread_ident
            or agent.inbox.held_by_current_thread()
        ):
            raise ActorRpcError(
                f"waiting on {describe(future._description) or 'a future'} from the RPC I/O "
                "thread would deadlock; use Future.then() instead of blocking inside a callback"
            )
        if agent is None or not agent.inbox.receive_until(agent, future):
            wait_on_gate(future, agent)


def wait_on_gate(future: Any, agent: Any) -> None:
    """Block until another thread (the inbox's holder) completes ``future``."""
    future._blocked = True
    if agent is not None:
        inbox = agent.inbox
        inbox.count_blocked(1)
        if not inbox.lock.locked():  # the holder may have left before it saw the count:
            inbox.resume()  # the I/O thread takes the inbox (a blocked waiter needs it)
    try:
        gate = future._gate
        while not gate.acquire(timeout=LIVENESS_CHECK_INTERVAL):
            if agent is not None and not agent.is_alive():
                raise ActorRpcError(
                    f"the RPC agent stopped before {describe(future._description) or 'the future'}"
                    " completed"
                )
        gate.release()  # let any other waiter through
    finally:
        if agent is not None:
            agent.inbox.count_blocked(-1)


class CallResult(Generic[T]):
    """The result of a call only its caller waits for (``rpc_sync``): a :class:`Future`'s
    completion and ``wait()``, without the C++ future nobody else would see (creating,
    completing and reading one are three torch calls, ~20 µs between messages)."""

    # (slots: no instance dict in the pure build, one object fewer for the collector per
    # call in flight; a native class in the compiled build)
    __slots__ = ("_agent", "_blocked", "_callbacks", "_claim", "_description", "_done", "_error",
                 "_gate", "_receiver", "_value")

    def __init__(self, description: Any = "", agent: Any = None) -> None:
        self._gate = gate = _thread.allocate_lock()
        gate.acquire()
        self._description: Any = description
        self._agent: Any = agent
        self._done = False
        self._blocked = False
        self._error: BaseException | None = None
        self._receiver: int | None = None
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

    @property
    def description(self) -> str:
        return describe(self._description)

    def done(self) -> bool:
        return self._done and not self._gate.locked()  # (marked done before the value is set)

    def wait(self) -> T:
        """Block until the call completes; return its result or raise its error (as
        :meth:`Future.wait`)."""
        wait_done(self)
        if self._gate.locked():  # marked done, not yet completed (by another thread)
            wait_on_gate(self, self._agent)
        if self._error is not None:
            raise fresh_error(self._error)
        return self._value  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<actorrpc.CallResult {self.description} {'done' if self._done else 'pending'}>"


def fresh_error(error: BaseException) -> BaseException:
    """A copy of a stored error to raise, so the stored one never collects a traceback.

    (A traceback holds the frames it passes through, and they may hold the
    future itself: a cycle through the C++ future that gc cannot break.)
    """
    from ._calls import copy_error

    return copy_error(error)


def complete(future: Any, value: Any = None, error: BaseException | None = None) -> None:
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
