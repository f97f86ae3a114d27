"""Notifications that rode on a request, handled after it was served (or when due).

A notification registered ``after_carrier`` (an RRef user's delete, a context
release: it only lets something go) that rides on a request served on a thread
is not handled before that request, on its critical path, but after it.

Invariants:

* Each set of such riders is handled exactly once: :meth:`DeferredRiders.take`
  hands its items out once, to the thread that served the carrier (right after
  it) or to the I/O thread's timed work once :data:`DEFERRED_RIDER_DELAY` passed
  (a carrier that runs long, waits in the pool's queue, or waits for one of these
  very notifications), whichever comes first.
* They are handled with the sender's ``WorkerInfo`` taken when the message
  arrived: a member that left meanwhile still has its releases applied.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from ..protocol import MessageKind
from ._worker_info import WorkerInfo

__all__ = ["DEFERRED_RIDER_DELAY", "DeferredRiderQueue", "DeferredRiders"]

DEFERRED_RIDER_DELAY = 0.01
"""Most seconds a notification waits for the request that carried it to be served."""


class DeferredRiders:
    """The ``after_carrier`` notifications that rode on one request."""

    __slots__ = ("_items", "_lock", "due", "sender")

    def __init__(
        self, sender: WorkerInfo, items: list[tuple[MessageKind, Any]], due: float
    ) -> None:
        self.sender = sender
        self.due = due
        self._items = items
        self._lock = threading.Lock()

    def take(self) -> list[tuple[MessageKind, Any]]:
        """The notifications, the first time; then nothing."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def taken(self) -> bool:
        return not self._items


class DeferredRiderQueue:
    """Every :class:`DeferredRiders` not handled yet, oldest first (all wait as long)."""

    def __init__(self) -> None:
        self._waiting: deque[DeferredRiders] = deque()
        self._lock = threading.Lock()

    def add(self, sender: WorkerInfo, items: list[tuple[MessageKind, Any]]) -> DeferredRiders:
        deferred = DeferredRiders(sender, items, time.monotonic() + DEFERRED_RIDER_DELAY)
        with self._lock:
            self._waiting.append(deferred)
        return deferred

    def due(self, now: float) -> list[DeferredRiders]:
        """Those whose time is up (and forgets those already handled)."""
        found: list[DeferredRiders] = []
        if not self._waiting:  # (the I/O thread asks at every wake-up; usually none waits)
            return found
        with self._lock:
            waiting = self._waiting
            while waiting and (waiting[0].taken() or waiting[0].due <= now):
                deferred = waiting.popleft()
                if not deferred.taken():
                    found.append(deferred)
        return found

    def seconds_to_due(self, now: float) -> float | None:
        """Seconds until the oldest not yet handled is due (None: none waits)."""
        if not self._waiting:
            return None
        with self._lock:
            waiting = self._waiting
            while waiting and waiting[0].taken():
                waiting.popleft()
            return waiting[0].due - now if waiting else None
