"""The I/O thread's timed work, and how long it may wait before doing it again."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._pool import STALL_SECONDS

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = [
    "MAX_POLL", "QUIET_POLL", "QUIET_SECONDS", "QuietWatch", "run_timed_work",
    "seconds_to_timed_work",
]

MAX_POLL = 0.05
"""Most seconds the I/O thread waits without looking at its timed work, bar a quiet
worker's (below)."""

QUIET_SECONDS = 1.0
"""How long a worker stays quiet (:class:`QuietWatch`) before its I/O thread waits longer."""

QUIET_POLL = 1.0
"""Most seconds a quiet worker's I/O thread waits. Each wake-up of a thread costs ~0.2 ms
of CPU on these machines: an idle worker's I/O thread took ~8 ms/s looking every
:data:`MAX_POLL` (docs/performance.md, twenty-sixth session)."""


class QuietWatch:
    """Whether a worker is quiet enough for its I/O thread's long wait, and whether it
    waits so now (:attr:`waiting`).

    Quiet: no call pending (liveness PINGs aside), no request being served, no pool
    thread at work, nothing queued for the I/O thread or to ride on a message, no dead
    peer to check again; and every look at the timed work for :data:`QUIET_SECONDS`
    found it so, with no message received (liveness PINGs and their answers aside:
    ``MessageDispatcher._on_message``), no nudge ending a long wait, nor a turn of another
    thread on the inbox in between. A worker waiting in ``shutdown`` probes the ranks it waits for
    once a second; counted, those probes kept both workers from ever being quiet (~20
    looks a second each instead of one).

    Invariant (no lost wake-up): the I/O thread sets :attr:`waiting` before its last
    look at what other threads queue (:meth:`begin`); they queue first, then read
    :attr:`waiting` and, if set, nudge the transport (``Transport.nudge``, which
    takes no lock: finalizers queue work too). The nudgers: a new call (its deadline,
    liveness), ``call_soon``, ``submit`` (pool growth), a notification (``Riders.add``,
    and a change of the riders' tables that applied finalizers' adds made meanwhile,
    ``put_back``). Held requests, riding replies and deferred riders ask for a look by
    their due time (``InboxTurns.wake_io_by``), which ends the wait through the inbox
    (``Transport.wake``); what arrives by message ends it anyway. A liveness PING due
    after :data:`QUIET_POLL` does not nudge (:meth:`nudge_for_call`).
    """

    def __init__(self, nudge: Callable[[], None] = lambda: None) -> None:
        self.waiting = False
        self.nudge = nudge  # ends the wait (``Transport.nudge``, set once it exists)
        self._since = 0.0  # when the current quiet stretch began (0: not quiet)
        self.long_waits = 0  # waits longer than MAX_POLL (statistics)

    def nudge_if_waiting(self) -> None:
        """Something was queued for the I/O thread's timed work: end its quiet wait, if
        it waits so (call after queueing: see the invariant above)."""
        if self.waiting:
            self._since = 0.0
            self.nudge()

    def quiet_since(self) -> float:
        """When the current quiet stretch began (monotonic time; 0: not quiet now)."""
        return self._since

    def interrupted(self) -> None:
        """Something happened: the worker is not quiet."""
        self._since = 0.0

    def limit(self, agent: Agent, now: float) -> float:
        """How long the I/O thread may wait as far as quiet goes."""
        if not _nothing_queued(agent) or agent.liveness.dead_peers:
            self._since = 0.0
            return MAX_POLL
        if not self._since:
            self._since = now
        return QUIET_POLL if now - self._since >= QUIET_SECONDS else MAX_POLL

    def begin(self, agent: Agent) -> bool:
        """About to wait longer than :data:`MAX_POLL`: whether it may (nothing was
        queued meanwhile); if so, :attr:`waiting` is set until :meth:`end`."""
        self.waiting = True
        if _nothing_queued(agent):
            self.long_waits += 1
            return True
        self.waiting = False
        self._since = 0.0
        return False

    def nudge_for_call(self, timeout: float, liveness_check: bool) -> None:
        """A call was made (its deadline, ``timeout`` seconds from now, and its peer's
        liveness are timed work): end a long wait, unless it is a liveness check due after
        the longest wait, whose end looks at it in time."""
        if liveness_check and (timeout <= 0 or timeout >= QUIET_POLL):
            return
        self.nudge_if_waiting()

    def end(self) -> None:
        """The long wait ended (a nudge ended the quiet when given; a message does when
        dispatched, unless it is a liveness check or its answer)."""
        self.waiting = False


def _nothing_queued(agent: Agent) -> bool:
    """No call pending (liveness PINGs aside), no request in flight, nothing queued for
    the I/O thread, the pool or a message."""
    return (len(agent._pending) <= agent.liveness.pings_in_flight() and agent._inflight == 0
            and agent._soon.empty() and not agent.riders.queued and not agent.riders.waiting
            and agent._pool.all_idle())


def run_timed_work(agent: Agent) -> None:
    """Held requests that are due, queued work, deadlines, liveness, pool growth,
    notifications that waited (to leave, or to be handled after a request that took
    long), the scheduling policy of libzmq's threads and of the I/O thread itself."""
    agent.held.release_if_due(time.monotonic())
    while not agent._soon.empty():
        fn, args = agent._soon.get_nowait()
        fn(*args)
    agent._deadlines.expire(agent._pending, agent._give_up)
    agent.liveness.check()
    agent._pool.maintain()
    agent.riders.flush()
    agent.serve_due_riders(time.monotonic())
    agent.batch_scheduling.check()
    agent.io_thread_scheduling.check()


def seconds_to_timed_work(agent: Agent) -> float:
    """How long the I/O thread may wait before :func:`run_timed_work` is due again."""
    now = time.monotonic()
    if agent._pool.idle_or_empty():
        limit = agent.quiet.limit(agent, now)
    else:  # (work waits while every pool thread is at work)
        agent.quiet.interrupted()
        limit = STALL_SECONDS
    riders_due = agent.riders.seconds_to_due(now)
    if riders_due is not None:
        limit = min(limit, max(0.0, riders_due))
    deferred_due = agent.deferred_riders.seconds_to_due(now)
    if deferred_due is not None:
        limit = min(limit, max(0.0, deferred_due))
    held_due = agent.held.seconds_to_due(now)
    if held_due is not None:
        limit = min(limit, held_due)
    to_next = agent._deadlines.seconds_to_next(now, agent._pending)
    return limit if to_next is None else max(0.0, min(limit, to_next))
