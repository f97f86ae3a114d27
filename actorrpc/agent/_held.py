"""A request held back for a moment, so that the next one can go with it.

``remote()`` returns at once and ``to_here()`` usually follows right away. Sent
as they come, that pair is four messages: REMOTE_CALL, its answer, RREF_FETCH,
the value. So ``remote()`` encodes its REMOTE_CALL (pickling errors are still
raised by ``remote()``, and the arguments are captured when it is called) and
*holds* it here; a ``to_here()`` that finds it still held sends it as
``REMOTE_CALL_FETCH``, whose answer carries the value: two messages, and the
owner serves the value the moment it is created, as it would serve a fetch
that arrived before the value existed.

The request is held only until the thread that made it does anything else: a
per-thread profile hook (``sys.setprofile``, installed by
:meth:`HeldRequests.release_on_next_call` as the last step of ``remote()``) sends
it at that thread's next function call, unless that call is the one that
merges it (``to_here()``). So a ``remote()`` followed by local computation
starts the remote work as soon as before; only pure bytecode with no call at
all leaves it to the I/O thread (which needs the GIL for it).

Invariants:

* At most one request is held per worker: holding another sends the first.
* A held request leaves before its thread's next function call (bar the merging one, and
  finalizers registered with :func:`ignore_while_holding`, which neither send nor wait:
  ``RRef.__del__``; other packages' code run inside one sends it), so before anything
  that thread sends or waits for next; when the worker shuts down; and at the latest
  :data:`HOLD_SECONDS` after it was held (the I/O thread sends it). Other threads'
  messages need not wait for it: nothing they send can depend on it unless the creating
  thread handed them something (the RRef, its future) after ``remote()``, and that
  hand-over is a call that sends it first. So other traffic on the worker (replies, liveness
  checks) does not spoil the merge, and the send path pays nothing for it.
* Sending it is done under ``_sending``, from taking it out until it is on its
  link: a thread that finds it being sent by another (the I/O thread's timer)
  waits until it has left, so the order of one thread's messages on a link is
  the order of its calls.
* A request is held only when holding is on (``hold_remote_calls``; off from
  Python 3.12, where switching the hook re-instruments the interpreter) and no
  profiler is installed on the thread (the hook would replace it).
* Its pending entry, deadline and flow credit exist from the moment it is held:
  its timeout counts from the call that made it, and one whose deadline passed
  while held is never sent.
* A held request that cannot be sent fails its future with the error and undoes
  what pickling it registered (RRef forks), as a failed send does; one still held
  when the worker closes is dropped the same way. A Ctrl-C while sending it fails
  its future ("interrupted before it was sent") and is raised again.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

from ..errors import ActorRpcError
from ..protocol import MessageKind
from ..serialization import PickleTarget
from ._call_result import complete

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["HOLD_SECONDS", "HeldRequest", "HeldRequests", "ignore_while_holding"]

HOLD_SECONDS = 0.005
"""Most seconds a request is held before the I/O thread sends it (only code that
makes no call at all waits for that: it holds the GIL about as long, Python's
switch interval)."""


_IGNORED: set[CodeType] = set()
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # actorrpc/


def ignore_while_holding(code: CodeType) -> None:
    """Let a function run between ``remote()`` and its merging call without sending the
    held request (see :meth:`HeldRequests.release_on_next_call`): only for finalizers that
    neither send nor wait (they may queue notifications, which ride on it)."""
    _IGNORED.add(code)


class HeldRequest:
    """An encoded request waiting to be sent (see the module docstring)."""

    __slots__ = ("body", "buffers", "dest_rank", "future", "kind", "message_id", "thread",
                 "undo")

    def __init__(self, dest_rank: int, kind: MessageKind, message_id: int, body: bytes,
                 buffers: list[Any], undo: PickleTarget | None, future: Any) -> None:
        self.thread = threading.get_ident()  # the thread that made it
        self.dest_rank = dest_rank
        self.kind = kind
        self.message_id = message_id
        self.body = body
        self.buffers = buffers
        self.undo = undo
        self.future = future


def _release_from_hook(held: HeldRequests, future: Any) -> None:
    """``held.release(future)`` from the profile hook, with the cyclic collector paused.

    The hook runs while the frame it reports is being entered, and sending allocates
    enough to start a collection there. CPython 3.11 has crashed when a collection walked
    a frame in that state (gh-101975, fixed for one case); the suite once died with a
    SIGSEGV in this hook (docs/performance.md, "Twenty-ninth session"; not reproduced
    since). The collection waits until the request left: one message's worth of
    allocations. Pauses of several threads at once nest (the collector comes back with
    the last one); a ``gc.disable()`` by other code during a pause is undone by its end.
    """
    with _collector_pause_lock:
        if not _collector_pause[0]:
            _collector_pause[1] = gc.isenabled()
            gc.disable()
        _collector_pause[0] += 1
    try:
        held.release(future)
    finally:
        with _collector_pause_lock:
            _collector_pause[0] -= 1
            if not _collector_pause[0] and _collector_pause[1]:
                gc.enable()


class _ReleaseHook:
    """The profile hook of :meth:`HeldRequests.release_on_next_call`.

    Invariant: ``sys.setprofile(None)`` drops the interpreter's reference to the hook
    while it runs, and compiled code does not hold one of its own for ``self``: what it
    uses afterwards is read into locals first (a closure's cells were freed the same way).
    """

    def __init__(self, held: HeldRequests, future: Any, merging: CodeType) -> None:
        self.held = held
        self.future = future
        self.merging = merging
        self.passing: list[FrameType] = []  # the frame of a finalizer passed over, while it runs

    def __call__(self, frame: FrameType, event: str, _: Any) -> None:
        passing = self.passing
        if passing:
            if event == "return" and frame is passing[0]:
                passing.clear()
                return
            code = frame.f_code
            if event != "call" or code in _IGNORED or code.co_filename.startswith(_PACKAGE):
                return
            # code of another package run inside it (a finalizer or weakref callback the
            # collector runs) may send or wait: the request goes first
            passing.clear()
        elif event in ("return", "c_return"):  # frames finishing: the caller's, its callers'
            return
        elif event == "call" and frame.f_code in _IGNORED:
            passing.append(frame)
            return
        elif event == "call" and frame.f_code is self.merging:
            sys.setprofile(None)
            return
        held, future = self.held, self.future
        sys.setprofile(None)
        _release_from_hook(held, future)


# (hooks sending now, whether the collector ran before the first of them paused it)
_collector_pause: list[Any] = [0, False]
_collector_pause_lock = threading.Lock()


class HeldRequests:
    """The one request held back on a worker, and the rules for letting it go.

    ``_sending`` (re-entrant) is held from taking a request out until it is on its
    link, and ``pending`` stays true meanwhile.
    """

    def __init__(self, agent: Agent, enabled: bool = True) -> None:
        self._agent = agent
        # the hook costs more from Python 3.12 on (it re-instruments the interpreter)
        self.enabled = enabled and sys.version_info < (3, 12)
        self._sending = threading.RLock()
        self._held: HeldRequest | None = None
        # a request is held or being sent (a hint outside the lock); set when one is
        # held, cleared once it is on its link
        self.pending = False
        self._due = 0.0
        self.merged = 0  # held requests sent as merged with the next one (statistics)
        self.released = 0  # held requests sent as they were (statistics)

    def may_hold(self) -> bool:
        """Whether this thread may hold a request: holding is on and no profiler is
        installed on the thread (the hook would replace it)."""
        return self.enabled and sys.getprofile() is None

    def hold(self, request: HeldRequest) -> None:
        """Hold ``request``, sending the one held before (if any) first."""
        due = time.monotonic() + HOLD_SECONDS
        with self._sending:
            if self._held is not None:
                self._send(self._held)
            self._held, self._due, self.pending = request, due, True
        agent = self._agent
        agent.inbox.wake_io_by(due, agent._transport.wake)

    def held_here(self, future: Any) -> bool:
        """Whether ``future``'s request is held and was made by this thread (which then
        made no call since: a call would have sent it)."""
        held = self._held
        return held is not None and held.future is future and (
            held.thread == threading.get_ident()
        )

    def release_on_next_call(self, future: Any, merging: CodeType) -> None:
        """Send ``future``'s held request at this thread's next function call, unless
        that call runs ``merging`` (which takes it); the caller's last step.

        A finalizer registered with :func:`ignore_while_holding` (``RRef.__del__``: it only
        queues a notification) runs meanwhile without counting as that call, nor does the
        actorrpc code it calls: ``rref = rpc.remote(...)`` drops the previous RRef in that
        variable between ``remote()`` and ``rref.to_here()``. Code of any other package it
        leads to (a finalizer or weakref callback the collector runs) sends the request.
        """
        held = self._held
        if held is None or held.future is not future:
            return
        sys.setprofile(_ReleaseHook(self, future, merging))

    def send_as(self, future: Any, kind: MessageKind, on_result: Callable[[Any], Any],
                on_undecodable: Callable[[BaseException], Any], timeout: float) -> bool:
        """Send ``future``'s held request as ``kind``, its reply going through
        ``on_result`` first (a reply that cannot be unpickled through
        ``on_undecodable``). False, and nothing done, unless it is still held and
        was made with the same effective ``timeout`` (a merged request has one
        deadline)."""
        with self._sending:
            held = self._held
            call = self._agent._pending.get(held.message_id) if held is not None else None
            if held is None or held.future is not future or call is None or (
                call.timeout != timeout
            ):
                return False
            call.kind, call.on_result, call.on_undecodable = kind, on_result, on_undecodable
            held.kind = kind
            self.merged += 1
            self._send(held)
        return True

    def release(self, future: Any = None) -> None:
        """Send the held request now (only if it is ``future``'s, when given); if
        another thread is sending it, wait until it is on its link."""
        with self._sending:
            held = self._held
            if held is None or (future is not None and held.future is not future):
                return
            self.released += 1
            self._send(held)

    def release_if_due(self, now: float) -> None:
        if self._held is not None and now >= self._due:
            self.release()

    def seconds_to_due(self, now: float) -> float | None:
        """Seconds until the held request must leave (None: nothing is held)."""
        return None if self._held is None else max(0.0, self._due - now)

    def discard(self) -> None:
        """The worker closes: a request still held is never sent (its call fails with
        the others); undo what pickling it registered."""
        with self._sending:
            held, self._held, self.pending = self._held, None, False
        if held is not None and held.undo is not None:
            held.undo.abort()

    def _send(self, held: HeldRequest) -> None:
        """Send ``held`` (with ``_sending`` held), or settle its call if it cannot go."""
        agent = self._agent
        self._held = None  # (pending stays true until it is on its link)
        error: BaseException | None = None  # (None and not sent: it expired while held)
        try:
            if held.message_id in agent._pending:
                agent._send(held.dest_rank, held.kind, held.message_id, held.body,
                            held.buffers)
                agent.stats.calls_sent[held.dest_rank] += 1
                return
        except BaseException as exc:  # noqa: BLE001 - the call that made it returned long ago
            error = exc
        finally:
            self.pending = False
        pending = agent._take_pending(held.message_id)
        if agent.tracer.enabled:
            agent.tracer.call_unsent(held.message_id)
        if held.undo is not None:
            held.undo.abort()
        if pending is not None and error is not None:
            failure = error if isinstance(error, Exception) else ActorRpcError(
                f"{pending.description or held.kind.name} to worker {held.dest_rank} was "
                f"interrupted before it was sent ({type(error).__name__})"
            )
            complete(pending.future, error=failure)
        if error is not None and not isinstance(error, Exception):
            raise error  # Ctrl-C or SystemExit: to whoever happened to send it
