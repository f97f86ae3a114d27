"""Whose turn it is to receive on the inbox: the I/O thread, a thread waiting for a
reply, or a pool thread waiting for the next request.

A thread blocked in ``Future.wait()`` would otherwise be woken by the I/O
thread, which received its reply: two thread wake-ups per synchronous call on
the caller's side. Instead the waiting thread takes a turn on the inbox itself
when it is free, receiving and handling every message that arrives (replies to
other calls, requests, which go to the pool as usual) until its own future is
done. After it handed a reply to a blocked waiter, the I/O thread stays off the
inbox for :data:`BACKOFF_SECONDS`, so a thread making synchronous calls one after
another receives its own replies; it takes the inbox back when no waiter used it for
that long (after a waiter's own turn, for its look period, below), and meanwhile keeps
doing its timed work (deadlines, liveness, queued ``call_soon`` work).

The serving side has the same hand-off: the I/O thread receives a request and
wakes a pool thread to run it. So a pool thread that served a request takes a
*serving turn*: it receives (handling replies and inline requests as the I/O
thread would) until the next request arrives, gives the inbox up and runs that
request itself; a turn with no request for :data:`SERVING_TURN_SECONDS` ends.
After handing a request to the pool, or while a serving thread runs the one it
received, the I/O thread again stays off the inbox for :data:`BACKOFF_SECONDS` (never
longer there: requests may run long).

Invariants:

* Only the thread holding :attr:`InboxTurns.lock` receives on the inbox socket
  or handles what arrived; acquiring and releasing the lock is the full memory
  barrier ZeroMQ asks for when a socket moves between threads.
* A waiting thread never waits for the inbox: it takes a turn only if the lock
  is free, else it blocks on its future as before (the holder completes it).
* A message that arrives while nobody holds the inbox waits at most the I/O
  thread's look period (plus its wake-up) before it is received: :data:`BACKOFF_SECONDS`,
  except in the first gap wider than :data:`CLOSE_TURNS_SECONDS` after a run of
  waiters' turns that followed each other closer than that, where it may wait up to
  :data:`MAX_LOOK_SECONDS` plus :data:`CLOSE_TURNS_SECONDS` (the grown period counts
  from a look up to that far into the gap; each look costs the thread taking turns a
  wake-up of the I/O thread on its core). A serving turn and a hand-off to a thread keep
  it at :data:`BACKOFF_SECONDS`; a thread that blocks on its future while nobody holds
  the inbox wakes the I/O thread, which takes the inbox for it.
  When a request or a reply someone may wait for (its receiver may block
  without taking turns, e.g. in ``torch.futures.wait_all``) did wait, the I/O
  thread stays on the inbox for ``_STAY_SECONDS`` before it backs off again;
  control replies nobody waits for (``remote()``'s creation ack, a cleanup's)
  do not count. While a waiter receives, the I/O thread looks again every
  look period, since a turn may end with nobody receiving; once a turn has
  lasted :data:`LONG_TURN_SECONDS` it sleeps instead (bar its timed work), and
  that turn wakes it when it ends.
* A serving turn ends with the first request (at most one request is kept
  for the turn's thread, :meth:`InboxTurns.claim`; others go to the pool), after
  :data:`SERVING_TURN_SECONDS`, when work waits in the pool's queue, or when the
  agent stops; the inbox is free before that request runs, so a request that
  blocks holds nothing else back. No request is kept while the pool's queue holds
  work, and a thread goes back to the queue before taking another turn: queued
  work never waits behind a stream of requests served in turns.
* A turn (a waiter's or a serving one) polls the inbox for ``options.busy_poll``
  seconds from its start, yielding the core between polls (after a first spin
  without yields while only rings carry messages: ``transport._zmq``
  ``_SPIN_SECONDS``; a hand-off closes the transport's ``SpinGate`` for a while),
  before its receives block (``Transport.receive``'s ``busy_until``); the I/O
  thread polls only in a flow of messages, for :data:`IO_FLOW_POLL_SECONDS` after a
  receive that returned some, so an idle worker uses no CPU.
* The I/O thread looks at its timed work at least every ``_timed_work.MAX_POLL``
  (50 ms); once the worker has been quiet for a second (``_timed_work.QuietWatch``),
  up to every ``QUIET_POLL`` (1 s). That wait (``Transport.wait_quietly``) holds the
  inbox without receiving: it ends when a message may wait (socket or rings), at a
  wake-up or a nudge, and what came is received on the next loop. Whatever other
  threads queue for the timed work ends it (``QuietWatch``'s invariant).
* A turn ends when the future is done or the agent stops; a future completed by
  another thread (a timeout, a dead peer, shutdown) wakes the inbox so the turn
  ends promptly. While the main thread has a turn, SIGINT is deferred to the end
  of the turn (``KeyboardInterrupt`` cannot strike between receiving a message
  and handling it) and then delivered as usual.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]
import logging
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..transport import SpinGate
from ._timed_work import MAX_POLL, run_timed_work, seconds_to_timed_work

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = [
    "BACKOFF_SECONDS", "CLOSE_TURNS_SECONDS", "IO_FLOW_POLL_SECONDS", "LONG_TURN_SECONDS",
    "MAX_LOOK_SECONDS", "SERVING_TURN_SECONDS", "InboxTurns",
]

_log = logging.getLogger("actorrpc.agent")
BACKOFF_SECONDS = 0.001
_STAY_SECONDS = 0.1
_TURN_POLL = 0.05
IO_FLOW_POLL_SECONDS = 0.0002
"""After a receive that returned messages, the I/O thread polls the inbox this long
before it blocks (0: never; never either with ``busy_poll`` 0)."""
LONG_TURN_SECONDS = 0.01
"""A turn this old wakes the I/O thread when it ends; meanwhile that thread sleeps."""
MAX_LOOK_SECONDS = 0.004
"""The longest the I/O thread's look period grows to while threads take turns close
together: below :data:`LONG_TURN_SECONDS` and below ``_held.HOLD_SECONDS`` (5 ms), since
``remote()``'s held request asks for a look by then (``wake_io_by``), which would
otherwise wake it once per call (measured: 8 ms made remote()+to_here() 1.8 % slower)."""
CLOSE_TURNS_SECONDS = 0.0005
"""Turns following each other within this (one's end to the next one's start) since the
I/O thread's last look let its look period grow; a wider gap puts it back to
:data:`BACKOFF_SECONDS`."""
SERVING_TURN_SECONDS = 0.01
"""How long a pool thread that served a request waits on the inbox for the next one."""


class InboxTurns:
    """The inbox lock and the I/O thread's back-off (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: int | None = None  # thread ident while a thread holds the lock
        self.blocked_waiters = 0  # threads blocked on a future (not receiving)
        self.turns = 0  # turns taken by waiting threads (statistics)
        self.stays = 0  # times the I/O thread found messages waiting after backing off
        self._count_lock = threading.Lock()
        self._io_ident: int | None = None
        self._handed_off_at = float("-inf")
        self._turn_started = 0.0  # when the current waiter's turn began
        self._turn_ended = float("-inf")  # when the last turn ended
        # the widest gap between two turns since the I/O thread's last look (written by
        # turns, read and reset by the I/O thread without a lock: a lost update costs at
        # most one look period that grew when it should not have)
        self._widest_gap = float("inf")
        self._turns_begun = 0  # turns begun by any thread (written under the lock)
        self._turns_at_look = 0  # ... as the I/O thread last looked
        self.look_period = BACKOFF_SECONDS  # the I/O thread's, while threads take turns
        # the last turn was a serving turn, or a request or reply was handed to a thread
        # since the last waiter's turn began (that thread runs now, maybe long)
        self._serving_last = False
        # hand_off() calls (by the threads that hand off: a lost increment costs at most
        # one grown look period)
        self._hand_offs = 0
        # the transport's (``Agent`` sets it), closed for a while at each hand-off
        self.spin_gate = SpinGate()
        self._no_backoff_until = float("-inf")
        self.probing = False  # the I/O thread handles messages that waited during its back-off
        self._resume = threading.Event()
        # when the I/O thread will next look at its timed work (see wake_io_by); set
        # before it reads what it waits for, so a writer sees it or is seen
        self._io_wakes_at = float("inf")
        # it waits in Transport.receive or wait_quietly (else on _resume or the lock)
        self._io_receiving = False
        self.closed = False  # the agent stopped: the lock stays taken for good
        self.serving_turns = 0  # turns taken by pool threads after serving (statistics)
        self.io_wakes = 0  # times wake_io_by woke the I/O thread early (statistics)
        self.io_flow_polls = 0  # I/O thread receives that polled first (statistics)
        self._io_flowing = False  # the I/O thread's last receive returned messages
        self._io_woken = False  # its last quiet wait ended early: it receives next
        self._claiming = False  # the holder is a pool thread that runs the next request
        self._claimed: tuple[Any, ...] | None = None

    def held_by_current_thread(self) -> bool:
        return self.holder == threading.get_ident()

    def count_blocked(self, delta: int) -> None:
        with self._count_lock:
            self.blocked_waiters += delta

    def hand_off(self) -> None:
        """A blocked waiter got its reply, or a pool thread a request: the I/O thread
        stays off the inbox for :data:`BACKOFF_SECONDS`, so that thread takes the next
        turn itself."""
        self._serving_last = True
        self._hand_offs += 1
        self._handed_off_at = now = time.monotonic()
        gate = self.spin_gate  # that thread runs now: polls yield to it (a store, no call)
        gate.closed_until = now + gate.pause

    def claim(self, request: tuple[Any, ...]) -> bool:
        """Keep ``request`` for the pool thread receiving in a serving turn, if it has none."""
        if not self._claiming or self._claimed is not None:
            return False
        self._claimed = request
        return True

    def io_pause(self, now: float) -> float:
        """Seconds the I/O thread should stay off the inbox (0: take it)."""
        holder = self.holder
        # read after the holder, which a turn sets after its start: this start is the
        # holder's or a later turn's (never an older, longer one's)
        started = self._turn_started
        if holder is not None and holder != self._io_ident:
            if now - started >= LONG_TURN_SECONDS:
                return float("inf")  # a long turn: it wakes this thread when it ends
            if self._claiming:  # a serving turn: it ends at the next request, so look soon
                self.look_period = BACKOFF_SECONDS
                return BACKOFF_SECONDS
            return self._next_look(0.0)  # a waiter is receiving
        if now < self._no_backoff_until:
            return 0.0
        pause = self._handed_off_at + BACKOFF_SECONDS - now
        if pause <= 0.0:
            self.look_period = BACKOFF_SECONDS
            return 0.0
        if self._serving_last:  # a thread runs what it was handed: the inbox may stay free
            self.look_period = BACKOFF_SECONDS
            return pause
        look = self._next_look(now - self._turn_ended)
        return max(pause, look) if look > BACKOFF_SECONDS else pause

    def _next_look(self, current_gap: float) -> float:
        """The I/O thread's look period while threads take turns: it doubles, up to
        :data:`MAX_LOOK_SECONDS`, while turns keep beginning (one at least since its last
        look) and every gap between turns since then (``current_gap``: the one in
        progress) was under :data:`CLOSE_TURNS_SECONDS`; else it is :data:`BACKOFF_SECONDS`
        (a wider gap, or one long turn, which its thread may not follow with another).

        Each look is a wake-up of the I/O thread on the core of the thread taking
        turns, which then waits for it (~75 µs per look on a 2-vCPU host, see
        docs/performance.md); threads taking turns close together receive what
        arrives between their turns themselves. The price: a message arriving in the
        first wide gap after such a run waits up to the grown period.
        """
        widest, self._widest_gap = max(self._widest_gap, current_gap), 0.0
        begun, self._turns_at_look = self._turns_begun - self._turns_at_look, self._turns_begun
        if begun and widest < CLOSE_TURNS_SECONDS:
            self.look_period = min(2 * self.look_period, MAX_LOOK_SECONDS)
        else:
            self.look_period = BACKOFF_SECONDS
        return self.look_period

    def stay(self) -> None:
        """A message waited for the I/O thread: keep receiving instead of backing off."""
        self._no_backoff_until = time.monotonic() + _STAY_SECONDS
        self.stays += 1

    def resume(self) -> None:
        """End the I/O thread's back-off now (a waiter left while others block; shutdown)."""
        self._resume.set()

    # -- the I/O thread ---------------------------------------------------------------------

    def run_io_loop(self, agent: Agent) -> None:
        self._io_ident = threading.get_ident()
        arrivals = select.poll()  # the inbox's notification fd: readable when messages may wait
        arrivals.register(agent._transport.inbox_fd, select.POLLIN)
        backed_off = False
        while agent._running:
            try:
                now = time.monotonic()
                pause = self.io_pause(now)
                if pause > 0:
                    backed_off = True
                    agent.quiet.interrupted()
                    run_timed_work(agent)
                    # while a waiter receives, look again every look period: its turn
                    # may end with nobody receiving (it does not wake this thread)
                    self._io_receiving, self._io_wakes_at = False, float("inf")
                    wait = min(pause, seconds_to_timed_work(agent))
                    self._io_wakes_at = time.monotonic() + wait
                    self._resume.wait(wait)
                    self._io_wakes_at = 0.0
                    self._resume.clear()
                    if self.blocked_waiters and not self.lock.locked():
                        self._handed_off_at = float("-inf")  # someone waits: take it now
                    continue
                # messages that waited while nobody received are probed as they are
                # handled: a request, or a reply someone may wait for without taking
                # turns (a C++ wait such as torch.futures.wait_all), makes it stay()
                probing = backed_off and (
                    bool(arrivals.poll(0)) or agent._transport.rings_ready()
                )
                backed_off = False
                if not self.lock.acquire(timeout=BACKOFF_SECONDS):
                    run_timed_work(agent)
                    continue
                self.probing = probing  # set under the lock: only the holder's messages count
                self.holder = self._io_ident
                try:
                    self._io_receiving, self._io_wakes_at = True, float("inf")
                    wait = 0.0 if self.probing else seconds_to_timed_work(agent)
                    if wait > MAX_POLL and not self._io_woken and agent.quiet.begin(agent):
                        self._io_woken = self._wait_quietly(agent, wait)
                    else:
                        # (after a quiet wait that something ended: no longer than MAX_POLL,
                        # a wait that nudges would not end)
                        messages = self._io_receive(
                            agent, min(wait, MAX_POLL) if self._io_woken else wait
                        )
                        self._io_woken = False
                        for message in messages:  # (each but liveness checks: not quiet)
                            agent._on_message(message)
                finally:
                    self._io_receiving, self._io_wakes_at = False, 0.0
                    self.probing = False
                    self.holder = None
                    self.lock.release()
                run_timed_work(agent)
            except BaseException:  # noqa: BLE001 - the loop must survive anything
                _log.exception("%s: error in the I/O loop", agent.name)

    def _io_receive(self, agent: Agent, wait: float) -> list[list[Any]]:
        """The I/O thread's receive (up to ``wait`` seconds), holding the inbox.

        In a flow of messages (the last receive returned some) it polls for
        :data:`IO_FLOW_POLL_SECONDS` first, yielding between polls even to this
        worker's own threads: a peer sending to a sleeping reader pays a system call
        that wakes this core (``transport/_ring.py``), half of its calls in a
        pipelined burst without the poll. An idle worker polls once after its last
        message, then blocks.
        """
        now = time.monotonic()
        self._io_wakes_at = now + wait
        busy_until = 0.0
        if (self._io_flowing and wait > 0 and agent.options.busy_poll > 0
                and IO_FLOW_POLL_SECONDS > 0):  # (a probe, wait 0, never polls)
            busy_until = now + IO_FLOW_POLL_SECONDS
            self.io_flow_polls += 1
        messages = agent._transport.receive(wait, busy_until, False)
        self._io_flowing = bool(messages)
        return messages

    def _wait_quietly(self, agent: Agent, wait: float) -> bool:
        """A quiet worker's I/O thread waits up to ``wait`` seconds for what may wake it
        (``_timed_work.QuietWatch``), holding the inbox; it receives afterwards. Whether
        something (a message, a wake-up, a nudge) ended the wait early."""
        self._io_wakes_at = time.monotonic() + wait
        try:
            return agent._transport.wait_quietly(wait)
        finally:
            agent.quiet.end()
            self._io_flowing = False

    def wake_io_by(self, when: float, wake_receive: Callable[[], None]) -> None:
        """Make the I/O thread run its timed work by monotonic time ``when``.

        ``wake_receive`` interrupts its wait on the inbox (``Transport.wake``).
        Nothing happens when it will look by then anyway (the common case while
        waiting threads take turns: it looks every look period).
        """
        if self._io_wakes_at <= when:
            return
        self._io_wakes_at = when
        self.io_wakes += 1
        if self._io_receiving:
            wake_receive()
        else:
            self._resume.set()

    # -- a pool thread that served a request -------------------------------------------------

    def serving_turn(self, agent: Agent) -> tuple[Any, ...] | None:
        """Receive in this pool thread, after it served a request, until the next request.

        Returns that request for this thread to run (the inbox is free again by
        then), or None when the inbox was busy, nothing came for
        :data:`SERVING_TURN_SECONDS` or the agent stopped. Replies and inline
        requests that arrive first are handled here, as the I/O thread would;
        a second request in one batch goes to the pool as usual.
        """
        started = self._begin_turn(agent)
        if started is None:
            return None
        claimed: tuple[Any, ...] | None = None
        try:
            self._claiming = True
            self.serving_turns += 1
            receive = agent._transport.receive
            until = started + SERVING_TURN_SECONDS
            busy_until = _busy_until(agent, started)
            has_queued = agent._pool.has_queued
            while agent._running:
                for message in receive(max(0.001, until - time.monotonic()), busy_until):
                    agent._on_message(message)
                claimed = self._claimed
                # queued work (a request handed to the pool) ends the turn: this thread
                # goes back to serve it rather than waiting here
                if claimed is not None or time.monotonic() >= until or has_queued():
                    break
        except Exception:  # noqa: BLE001 - as in the I/O loop: the thread goes back to the pool
            _log.exception("%s: error while receiving", agent.name)
        finally:
            claimed = self._claimed  # also one claimed before a later message failed
            self._claiming = False
            self._claimed = None
            # with a request, this thread comes back after running it; without, the
            # I/O thread takes over now
            self._serving_last = True
            self._end_turn(started, coming_back=claimed is not None)
        return claimed

    def _begin_turn(self, agent: Agent) -> float | None:
        """Take the inbox if it is free; the turn's start time, or None (busy, stopped)."""
        if not agent._running or not self.lock.acquire(blocking=False):
            return None
        started = self._turn_started = time.monotonic()  # before the holder (io_pause)
        self.holder = threading.get_ident()
        if started - self._turn_ended > self._widest_gap:
            self._widest_gap = started - self._turn_ended
        self._turns_begun += 1
        return started

    def _end_turn(self, started: float, coming_back: bool) -> None:
        """Give the inbox up; the I/O thread backs off if this thread comes back soon,
        and is woken if it does not, if a waiter blocks, if the turn was long, or while it
        stays on the inbox (:meth:`stay`: it may have slept through this turn)."""
        self.holder = None
        ended = self._turn_ended = time.monotonic()
        if coming_back:
            self._handed_off_at = ended
        self.lock.release()
        if (not coming_back or self.blocked_waiters or ended - started >= LONG_TURN_SECONDS
                or ended < self._no_backoff_until):  # (staying: messages wait for it, stay())
            self.resume()

    # -- a waiting thread -------------------------------------------------------------------

    def receive_until(self, agent: Agent, future: Any) -> bool:
        """Receive on the inbox in this thread until ``future`` is done, if the inbox is free.

        Returns whether the future is done; False if the inbox was busy (or the
        agent stopped), and the caller then waits on the future as usual.
        """
        me = threading.get_ident()
        # SIGINT is deferred before the lock is taken: no KeyboardInterrupt may leave it held
        deferral = _defer_sigint(agent) if me == _MAIN_IDENT else None
        started = self._begin_turn(agent)
        if started is None:
            if deferral is not None:
                deferral.end_turn()
            return False
        hand_offs = self._hand_offs
        try:
            self.turns += 1
            future._receiver = me
            receive = agent._transport.receive
            busy_until = _busy_until(agent, started)
            while not future._done and agent._running:
                try:
                    for message in receive(_TURN_POLL, busy_until):
                        agent._on_message(message)
                except Exception:  # noqa: BLE001 - as in the I/O loop: never lose the turn
                    _log.exception("%s: error while receiving", agent.name)
                if deferral is not None and deferral.deferred:
                    break
        finally:
            future._receiver = None
            # a thread making calls one after another takes its next turn itself
            if self._hand_offs == hand_offs:  # (else what it handed on may run long)
                self._serving_last = False
            self._end_turn(started, coming_back=True)
            if deferral is not None:
                deferral.end_turn()
        return bool(future._done)


def _busy_until(agent: Agent, started: float) -> float:
    """Until when a turn that began at ``started`` polls before it blocks (0: never)."""
    busy_poll = agent.options.busy_poll
    return started + busy_poll if busy_poll > 0 else 0.0


_MAIN_IDENT = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)


class _SigintDeferral:
    """A SIGINT handler wrapping the previous one: deferred while the main thread has a turn.

    Installed once (again only if someone replaced it); outside a turn it calls
    the previous handler at once, so it is transparent.
    """

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.agent: Agent | None = None  # set while the main thread has a turn
        self.deferred: list[tuple[int, Any]] = []

    def __call__(self, signum: int, frame: Any) -> None:
        agent = self.agent
        if agent is not None:
            self.deferred.append((signum, frame))
            agent.wake_inbox()
            return
        _deliver(self.previous, signum, frame)

    def end_turn(self) -> None:
        self.agent = None
        if self.deferred:
            signum, frame = self.deferred[0]
            self.deferred.clear()
            _deliver(self.previous, signum, frame)


_deferral: _SigintDeferral | None = None


def _defer_sigint(agent: Agent) -> _SigintDeferral | None:
    """Make SIGINT wait for the end of the main thread's turn (None: not possible here)."""
    global _deferral
    current = _signal.getsignal(_SIGINT)  # the C function: signal.getsignal builds an enum
    if current is None:
        return None  # a handler installed from C: leave it alone
    if current is not _deferral or _deferral is None:
        wrapper = _SigintDeferral(current)
        try:
            signal.signal(signal.SIGINT, wrapper)
        except ValueError:  # not the main thread of the main interpreter
            return None
        _deferral = wrapper
    _deferral.agent = agent
    return _deferral


def _deliver(handler: Any, signum: int, frame: Any) -> None:
    if callable(handler):
        handler(signum, frame)  # the default handler raises KeyboardInterrupt
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
