"""Notifications that ride on the next message to their peer (wire flag ``FLAG_RIDERS``).

Control notifications nobody waits for, such as an RRef user's delete or the
release of a peer's shared-memory segment, are queued per destination by
:meth:`Riders.add` and appended to the next message sent to that worker anyway
(one extra frame, wire spec: "Notifications riding on a message"). When none
leaves within :data:`RIDER_DELAY` seconds, the I/O thread sends them on a
``PING`` notification of their own (:meth:`Riders.flush`). In a loop of
``remote()`` + ``to_here()`` this takes one message out of every five, and a
wake-up of the caller's I/O thread.

Kinds registered with :meth:`Riders.batch_kind` (an RRef user's delete) wait in
``waiting`` before they may ride: until :data:`BATCH_SIZE` of them wait for the
same worker, or one is added :data:`BATCH_AGE` seconds or more after the oldest, or
another notification or reply for that worker is queued, or :data:`RIDER_DELAY`
passed (then they go on a message of their own, as any). In a loop of
``remote()`` + ``to_here()`` one request in sixteen carries the deletes of the
sixteen RRefs before it, and the others none (each riders frame costs ~10 µs
to build, send and take apart; 85 → 73 µs per iteration).

Invariants:

* Every change of the tables holds a re-entrant lock, and those that move
  entries between lists count as a change in progress (:meth:`Riders._changing`):
  a notification queued on that thread meanwhile (by a finalizer the collector ran
  inside it) is applied after the outermost change (appends and pops alone need
  not wait: an add between them is taken along or stays queued). So finalizers
  (which may run on any thread, even inside garbage collection on a thread that
  holds the lock) and ``__del__`` may queue.
* A queued notification is sent at most once: taken out of the queue for a
  message, and put back in front if that message could not be sent. Those
  queued for a worker that left, is dead, or cannot be sent a message of their
  own are dropped (with a warning for the last).
* Notifications to one worker keep their order (waiting ones move to ``queued``
  before anything else is queued for that worker); the receiver handles them
  before the message that carried them (so they are never handled earlier than
  if they had been sent on their own when queued), except those of kinds
  registered ``after_carrier`` (an RRef delete, a context release: they only let
  something go) riding on a request that a thread serves: right after that
  request (or once ``DEFERRED_RIDER_DELAY`` passed, if it takes longer), so its
  reply does not wait for them (``_deferred_riders``).
* ``MEMBERSHIP`` messages carry none (they are read before the sender is known).

Replies ride too (:meth:`Riders.add_reply`): a pool thread that answers one of
a burst of requests while another request of the same caller waits lets its small
reply ride on the next message to that caller, usually the burst's last reply, so
the caller receives one message for the burst instead of one per call. Such a
reply leaves no later than:

* the moment :data:`REPLY_BATCH` replies (and notifications) are queued for that
  caller: they leave together, so the caller takes them while this side serves
  the rest of the burst; or
* the moment its thread runs out of queued work (before it blocks on the pool's
  queue or takes a serving turn on the inbox, :meth:`Riders.settle_owed`), or
* the moment its thread starts a request that is not known to be quick, that
  is, not of the kind and function of the last request it ran, or whose last run
  took :data:`QUICK_REQUEST` seconds or more (:meth:`Riders.before_request`):
  a request that holds the GIL would keep every other thread from sending it; or
* :data:`REPLY_DELAY` seconds after it was queued, when its thread went on to a
  quick request that turned out slow (the I/O thread's timed work, woken by then,
  as soon as it gets the GIL).
"""

from __future__ import annotations

import _thread  # noqa: F401  (mypyc: its threading.local subclass needs the module)
import pickle
import threading
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mypy_extensions import mypyc_attr

from ..protocol import MessageKind, encode_riders

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = [
    "BATCH_AGE", "BATCH_SIZE", "MAX_RIDING_REPLY", "QUICK_REQUEST", "REPLY_BATCH",
    "REPLY_DELAY", "RIDER_DELAY", "Riders",
]

RIDER_DELAY = 0.01
"""Most seconds a queued notification waits for a message to ride on."""

BATCH_SIZE = 16
"""Notifications of a batched kind waiting for one worker that make them all ride."""

BATCH_AGE = 0.001
"""A batched notification added this many seconds or more after the oldest one waiting
for its worker makes them all ride (a later message's riders get older ones along)."""

REPLY_DELAY = 0.002
"""Most seconds a queued reply waits for a message to ride on while its thread runs a
request (the I/O thread looks this often anyway while the pool has queued work)."""

QUICK_REQUEST = 0.001
"""A thread keeps the replies it queued while it runs a request of the kind and
function of the last one it ran only when that one took less than this many seconds
(while a thread computes, others wait for the GIL). Wall time, measured around the
request: at least its CPU time, so a request that sleeps or waits counts as slow too
(only its replies leave sooner), and the thread's CPU clock is a system call here."""

_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType)

REPLY_BATCH = 32
"""Replies (with notifications) queued for one caller that leave together at once: the
caller works through them while this side serves the rest of a burst, instead of all
of them after it. Pipelined ``rpc_async`` in windows of 500, pinned, same-run A/Bs
(``benchmarks/ab_switch.py``): +12.5 % waited on with ``torch.futures.wait_all`` (the
caller's I/O thread takes the replies), +3.1 % waited on one by one (docs/performance.md,
twenty-fourth session)."""

_RESPONSE = int(MessageKind.RESPONSE)

MAX_RIDING_REPLY = 8192
"""Largest pickled reply (bytes, with no buffers) that may ride on a later message."""

_Queued = list[tuple[int, int, Any]]  # (kind, message id, payload or a reply's body)
_T = TypeVar("_T")


@mypyc_attr(native_class=False)  # (see actorrpc/_compiled.py)
class _OwedReplies(threading.local):
    """Per thread: ``ranks``, where the replies it queued go; ``quick``, (kind, id of the
    function) of the last request it ran if that was quick. (Class defaults: a thread
    that never set them reads None without a failed lookup, on every request.)"""

    ranks: set[int] | None = None
    quick: tuple[int, int] | None = None


class Riders:
    """The notifications and replies queued for each peer rank, and their statistics."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._lock = threading.RLock()
        # what waits to ride, by rank (its truth, read without the lock, is a hint that
        # something is queued: the send path reads it on every message)
        self.queued: dict[int, _Queued] = {}
        self._due: dict[int, float] = {}  # rank -> when what is queued for it must leave
        self._batched: set[int] = set()  # kinds that wait in ``waiting`` (batch_kind)
        # notifications of batched kinds that may not ride yet, by rank, with when the
        # oldest of them was added (they must leave RIDER_DELAY after that)
        self.waiting: dict[int, _Queued] = {}
        self._waiting_since: dict[int, float] = {}
        # changes in progress on the thread holding the lock, and the adds of finalizers
        # that ran inside them (see _changing)
        self._depth = 0
        self._nested: list[tuple[int, tuple[int, int, Any], float]] = []
        self._owed = _OwedReplies()
        self.carried = 0  # notifications that rode on a message sent anyway (statistics)
        self.sent_alone = 0  # messages sent only to carry notifications that waited
        self.replies_deferred = 0  # replies queued to ride on a later message (statistics)

    def batch_kind(self, kind: MessageKind) -> None:
        """Notifications of ``kind`` wait to ride in batches (see the module docs): for
        kinds that only let something go on their receiver, a little later."""
        self._batched.add(int(kind))

    def add(self, rank: int, kind: MessageKind, payload: Any) -> None:
        """Queue a notification of ``kind`` for worker ``rank`` (safe from finalizers)."""
        entry = (int(kind), 0, payload)
        now = time.monotonic()
        with self._lock:
            if self._depth:  # a finalizer run inside a change on this thread: after it
                self._nested.append((rank, entry, now))
                return
            self._changing(self._queue, rank, entry, now)
        self._agent.quiet.nudge_if_waiting()

    def _changing(self, change: Callable[..., _T], *args: Any) -> _T:
        """``change(*args)`` with the lock, as a change of the tables: an :meth:`add` that
        a finalizer makes on this thread meanwhile (the collector runs them at any
        allocation, in the middle of a change) is applied once the outermost change ended.
        """
        with self._lock:
            self._depth += 1
            try:
                return change(*args)
            finally:
                if self._depth == 1:
                    try:
                        nested = self._nested
                        if nested:  # (their adds returned without a nudge)
                            while nested:
                                self._queue(*nested.pop(0))
                            self._agent.quiet.nudge_if_waiting()
                    finally:
                        self._depth -= 1
                else:
                    self._depth -= 1

    def _queue(self, rank: int, entry: tuple[int, int, Any], now: float) -> None:
        if entry[0] in self._batched:
            waiting = self.waiting.setdefault(rank, [])
            waiting.append(entry)
            since = self._waiting_since.setdefault(rank, now)
            if len(waiting) >= BATCH_SIZE or now - since >= BATCH_AGE:
                self._release_waiting(rank)
            return
        if rank in self.waiting or rank in self._waiting_since:  # (only then: a frame less)
            self._release_waiting(rank)
        self.queued.setdefault(rank, []).append(entry)
        self._due.setdefault(rank, now + RIDER_DELAY)

    def _release_waiting(self, rank: int) -> None:
        """Move ``rank``'s waiting notifications to the end of its queue (in a change)."""
        waiting = self.waiting.get(rank)
        if waiting:
            self.queued.setdefault(rank, []).extend(waiting)
            self._due.setdefault(rank, self._waiting_since[rank] + RIDER_DELAY)
        self.waiting.pop(rank, None)
        self._waiting_since.pop(rank, None)

    def add_reply(self, rank: int, message_id: int, body: bytes) -> None:
        """Queue the reply to request ``message_id`` of worker ``rank`` (``body``: its
        pickled value, no buffers); this thread owes its flush (:meth:`settle_owed`)."""
        due = time.monotonic() + REPLY_DELAY
        with self._lock:
            # (moving waiting notifications is a change a finalizer's add must not cut
            # into; appending alone is safe, as in ``put_back``)
            if rank in self.waiting:
                self._changing(self._release_waiting, rank)
            queue = self.queued.setdefault(rank, [])
            queue.append((_RESPONSE, message_id, body))
            full = len(queue) >= REPLY_BATCH
            earlier = due < self._due.get(rank, float("inf"))
            if earlier:
                self._due[rank] = due
            self.replies_deferred += 1
        owed = self._owed.ranks  # (also when the batch leaves now: if sending fails, they
        if owed is None:  # are put back, and the thread's settling sends them later)
            owed = self._owed.ranks = set()
        owed.add(rank)
        agent = self._agent
        agent.stats.bytes_out[rank] += len(body)
        if full:  # the caller takes these while this side serves the rest of the burst
            if rank in self.queued:  # (another message may have taken them along already)
                self._send_alone(rank)
        elif earlier:  # the I/O thread sends it by then if nothing else does
            agent.inbox.wake_io_by(due, agent.wake_inbox)

    def before_request(self, kind: int, first: Any) -> None:
        """This thread is about to run a request of ``kind`` whose payload starts with
        ``first``: the replies it queued go now unless the request is known to be quick."""
        owed = self._owed.ranks
        if owed and self._owed.quick != (kind, id(first)):
            self.settle_owed()

    def after_request(self, kind: int, first: Any, seconds: float | None) -> None:
        """This thread ran a request of ``kind`` whose payload starts with ``first`` (the
        function, for a call) in ``seconds`` (None: not measured)."""
        quick = seconds is not None and seconds < QUICK_REQUEST and type(first) in _FUNCTION_TYPES
        # (an id: the thread keeps nothing of the request alive; a function's is stable)
        self._owed.quick = (kind, id(first)) if quick else None

    def owes(self) -> bool:
        """Whether this thread queued replies it has not settled yet."""
        return bool(self._owed.ranks)

    def settle_owed(self) -> None:
        """Send the replies this thread queued, on a message of their own where nothing
        else took them along meanwhile (a thread calls this before it waits for work)."""
        owed = self._owed.ranks
        if not owed:
            return
        ranks = list(owed)
        owed.clear()
        for rank in ranks:
            if rank in self.queued:
                self._send_alone(rank)

    def take(self, rank: int) -> _Queued:
        """Everything queued for ``rank``, to go on a message to it (cheap when nothing is)."""
        if rank not in self.queued:
            return []
        with self._lock:  # (two pops: a finalizer's add between them is taken along or
            # stays; a due time left behind is dropped by the next look at due times)
            self._due.pop(rank, None)
            return self.queued.pop(rank, [])

    def put_back(self, rank: int, queued: _Queued) -> None:
        """The message that was to carry ``queued`` was not sent: they go first next time."""
        if queued:
            replies = any(entry[1] for entry in queued)
            due = time.monotonic() + (REPLY_DELAY if replies else RIDER_DELAY)
            self._changing(self._put_back, rank, queued, due)
            if replies:
                agent = self._agent
                agent.inbox.wake_io_by(due, agent.wake_inbox)
            else:
                self._agent.quiet.nudge_if_waiting()

    def _put_back(self, rank: int, queued: _Queued, due: float) -> None:
        self.queued.setdefault(rank, [])[:0] = queued
        self._due[rank] = min(self._due.get(rank, float("inf")), due)

    def drop(self, rank: int) -> None:
        """Worker ``rank`` is gone: nothing queued for it will be sent."""
        self._changing(self._drop, rank)

    def _drop(self, rank: int) -> None:
        self.queued.pop(rank, None)
        self._due.pop(rank, None)
        self.waiting.pop(rank, None)
        self._waiting_since.pop(rank, None)

    @staticmethod
    def encode(queued: _Queued) -> bytes:
        """The riders frame for ``queued`` (notification payloads are plain tuples and lists
        of scalars, pickled here; replies are pickled already)."""
        return encode_riders([
            (kind, message_id, payload if message_id else pickle.dumps(payload, 5))
            for kind, message_id, payload in queued
        ])

    def seconds_to_due(self, now: float) -> float | None:
        """Seconds until something queued or waiting must leave on a message of its own
        (None: nothing)."""
        if not self.queued and not self.waiting:
            return None
        if not self.waiting and len(self._due) <= len(self.queued):  # (the I/O loop's case)
            with self._lock:  # (no allocation while iterating: no finalizer cuts in)
                return min(self._due.values(), default=now) - now
        return self._changing(self._next_due, now) - now

    def _next_due(self, now: float) -> float:
        self._forget_stale_dues()
        dues = [*self._due.values(), *(s + RIDER_DELAY for s in self._waiting_since.values())]
        return min(dues, default=now)

    def _forget_stale_dues(self) -> None:
        """Drop the due times of ranks with nothing queued: a finalizer's add run between
        :meth:`take`'s two pops leaves one (its notification went with that message)."""
        queued = self.queued
        if len(self._due) > len(queued) or any(r not in queued for r in self._due):
            for rank in [r for r in self._due if r not in queued]:
                del self._due[rank]

    def flush(self, everything: bool = False, now: float | None = None) -> None:
        """Send what is due by ``now`` (default: the monotonic clock), or ``everything``,
        on messages of their own.

        The carrier is a ``PING`` notification (never answered) that takes
        everything queued for its worker along, in order, as any message would.
        """
        if not self.queued and not self.waiting:
            return
        if now is None:
            now = time.monotonic()
        for rank in self._changing(self._due_ranks, everything, now):
            self._send_alone(rank)

    def _due_ranks(self, everything: bool, now: float) -> list[int]:
        """The ranks whose queue must leave now, after what waited too long joined it."""
        for rank, since in list(self._waiting_since.items()):
            if everything or since + RIDER_DELAY <= now:
                self._release_waiting(rank)
        self._forget_stale_dues()
        return [r for r, due in list(self._due.items()) if everything or due <= now]

    def _send_alone(self, rank: int) -> None:
        agent = self._agent
        if not agent.is_member(rank) or rank in agent.liveness.dead_peers:
            self.drop(rank)  # it left or stopped answering: nobody to tell
            return
        try:
            agent.send_notification(rank, MessageKind.PING, ())
        except Exception as exc:  # noqa: BLE001 - the peer is gone or we are closing
            count = self._changing(lambda: len(self.queued.get(rank, ())))
            self.drop(rank)
            agent.warn(f"cannot send {count} notifications or replies to worker {rank}: {exc}")
        else:
            self.sent_alone += 1

    def describe(self) -> dict[str, int]:
        queued = self._changing(
            lambda: sum(len(q) for q in [*self.queued.values(), *self.waiting.values()])
        )
        return {"queued": queued, "carried": self.carried, "sent_alone": self.sent_alone,
                "replies_deferred": self.replies_deferred}
