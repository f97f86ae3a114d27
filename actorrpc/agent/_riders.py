"""Notifications that ride on the next message to their peer (wire flag ``FLAG_RIDERS``).

Control notifications nobody waits for, such as an RRef user's delete or the
release of a peer's shared-memory segment, are queued per destination by
:meth:`Riders.add` and appended to the next message sent to that worker anyway
(one extra frame, wire spec: "Notifications riding on a message"). When none
leaves within :data:`RIDER_DELAY` seconds, the I/O thread sends them on a
``PING`` notification of their own (:meth:`Riders.flush`). In a loop of
``remote()`` + ``to_here()`` this takes one message out of every five, and a
wake-up of the caller's I/O thread.

Invariants:

* Queueing only appends under a re-entrant lock: finalizers (which may run on
  any thread, even inside garbage collection on a thread that holds the lock)
  and ``__del__`` may queue.
* A queued notification is sent at most once: taken out of the queue for a
  message, and put back in front if that message could not be sent. Those
  queued for a worker that left, is dead, or cannot be sent a message of their
  own are dropped (with a warning for the last).
* Notifications to one worker keep their order; the receiver handles them
  before the message that carried them (so they are never handled earlier than
  if they had been sent on their own when queued).
* ``MEMBERSHIP`` messages carry none (they are read before the sender is known).
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import TYPE_CHECKING, Any

from ..protocol import MessageKind, encode_riders

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["RIDER_DELAY", "Riders"]

RIDER_DELAY = 0.01
"""Most seconds a queued notification waits for a message to ride on."""

_Queued = list[tuple[int, Any]]


class Riders:
    """The notifications queued for each peer rank, and their statistics."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._lock = threading.RLock()
        self._queued: dict[int, _Queued] = {}
        self._since: dict[int, float] = {}  # rank -> when its oldest queued one was queued
        self.carried = 0  # notifications that rode on a message sent anyway (statistics)
        self.sent_alone = 0  # messages sent only to carry notifications that waited

    @property
    def pending(self) -> bool:
        """Whether any notification is queued (read without the lock: a hint)."""
        return bool(self._queued)

    def add(self, rank: int, kind: MessageKind, payload: Any) -> None:
        """Queue a notification of ``kind`` for worker ``rank`` (safe from finalizers)."""
        with self._lock:
            self._queued.setdefault(rank, []).append((int(kind), payload))
            self._since.setdefault(rank, time.monotonic())

    def take(self, rank: int) -> _Queued:
        """Everything queued for ``rank``, to go on a message to it (cheap when nothing is)."""
        if rank not in self._queued:
            return []
        with self._lock:
            self._since.pop(rank, None)
            return self._queued.pop(rank, [])

    def put_back(self, rank: int, queued: _Queued) -> None:
        """The message that was to carry ``queued`` was not sent: they go first next time."""
        if queued:
            with self._lock:
                # in place: a finalizer may add to this list while this line runs
                self._queued.setdefault(rank, [])[:0] = queued
                self._since.setdefault(rank, time.monotonic())

    def drop(self, rank: int) -> None:
        """Worker ``rank`` is gone: nothing queued for it will be sent."""
        with self._lock:
            self._queued.pop(rank, None)
            self._since.pop(rank, None)

    @staticmethod
    def encode(queued: _Queued) -> bytes:
        """The riders frame for ``queued`` (payloads are plain tuples and lists of scalars)."""
        return encode_riders([(kind, pickle.dumps(payload, 5)) for kind, payload in queued])

    def flush(self, everything: bool = False) -> None:
        """Send what waited :data:`RIDER_DELAY` (or ``everything``) on messages of their own.

        The carrier is a ``PING`` notification (never answered) that takes
        everything queued for its worker along, in order, as any message would.
        """
        if not self._queued:
            return
        limit = time.monotonic() - RIDER_DELAY
        with self._lock:
            ranks = [r for r, since in list(self._since.items()) if everything or since <= limit]
        agent = self._agent
        for rank in ranks:
            if not agent.is_member(rank) or rank in agent.liveness.dead_peers:
                self.drop(rank)  # it left or stopped answering: nobody to tell
                continue
            try:
                agent.send_notification(rank, MessageKind.PING, ())
            except Exception as exc:  # noqa: BLE001 - the peer is gone or we are closing
                with self._lock:
                    count = len(self._queued.get(rank, ()))
                self.drop(rank)
                agent.warn(f"cannot send {count} notifications to worker {rank}: {exc}")
            else:
                self.sent_alone += 1

    def describe(self) -> dict[str, int]:
        with self._lock:
            queued = sum(len(q) for q in list(self._queued.values()))
        return {"queued": queued, "carried": self.carried, "sent_alone": self.sent_alone}
