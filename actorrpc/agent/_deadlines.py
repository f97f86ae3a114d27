"""The deadlines of pending calls: a heap ordered by time, pruned of answered calls.

Callers add entries from any thread; only the I/O thread takes due ones.
Answered calls leave their entries behind (removing from the middle of a heap
is costly), so the heap is rebuilt without them once it holds many more
entries than there are pending calls: no full-GC pauses from a heap that
grows with every call.
"""

from __future__ import annotations

import heapq
import threading
from typing import Any

__all__ = ["Deadlines"]

_SLACK = 1024


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def add(self, when: float, message_id: int) -> None:
        with self._lock:
            heapq.heappush(self._heap, (when, message_id))

    def seconds_to_next(self, now: float) -> float | None:
        """Seconds until the earliest deadline (maybe an answered call's), None if none."""
        heap = self._heap
        return heap[0][0] - now if heap else None

    def due(self, now: float, pending: dict[int, Any]) -> list[int]:
        """Remove and return the message ids whose deadline passed (answered ones too)."""
        heap = self._heap
        if len(heap) > _SLACK + 4 * len(pending):
            with self._lock:
                heap[:] = [entry for entry in heap if entry[1] in pending]
                heapq.heapify(heap)
        expired: list[int] = []
        while heap and heap[0][0] <= now:
            with self._lock:
                if heap and heap[0][0] <= now:
                    expired.append(heapq.heappop(heap)[1])
        return expired
