"""The deadlines of pending calls: a heap ordered by time, pruned of answered calls.

Callers add entries from any thread; only the I/O thread takes due ones.
Answered calls leave their entries behind (removing from the middle of a heap
is costly): those that reach its top are dropped whenever the I/O thread asks for
the next deadline, and the heap is rebuilt without the others once it holds many
more entries than there are pending calls: no full-GC pauses from a heap that
grows with every call.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import RpcTimeoutError
from ._call_result import complete

__all__ = ["Deadlines"]

_SLACK = 1024


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def add(self, when: float, message_id: int) -> None:
        with self._lock:
            heapq.heappush(self._heap, (when, message_id))

    def seconds_to_next(self, now: float, pending: dict[int, Any]) -> float | None:
        """Seconds until the earliest deadline of a call still ``pending``, None if none
        (answered calls' entries at the top are dropped: an idle worker's I/O thread
        would otherwise wake for each of them)."""
        heap = self._heap
        if heap and heap[0][1] not in pending:
            with self._lock:
                while heap and heap[0][1] not in pending:
                    heapq.heappop(heap)
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

    def expire(self, pending: dict[int, Any], take_pending: Callable[[int], Any]) -> None:
        """Fail every pending call whose deadline passed with torch's timeout error."""
        for message_id in self.due(time.monotonic(), pending):
            call = take_pending(message_id)
            if call is not None:
                complete(
                    call.future,
                    error=RpcTimeoutError(
                        f"RPC ran for more than set timeout ({int(call.timeout * 1000)} ms) and "
                        f"will now be marked with an error: {call.description or 'call'} on "
                        f"{call.dest!r}"
                    ),
                )
