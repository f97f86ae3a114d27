"""Notifications deferred past their carrier (agent/_deferred_riders.py): taken once."""

from __future__ import annotations

import threading

import pytest

from actorrpc.agent._deferred_riders import (
    DEFERRED_RIDER_DELAY,
    DeferredRiderQueue,
)
from actorrpc.agent._worker_info import WorkerInfo
from actorrpc.protocol import MessageKind

pytestmark = pytest.mark.timeout(30)

_DELETE = MessageKind.RREF_USER_DELETE
_SENDER = WorkerInfo("worker1", 1)


def test_deferred_riders_are_taken_once_whoever_comes_first() -> None:
    queue = DeferredRiderQueue()
    first = queue.add(_SENDER, [(_DELETE, b"a"), (_DELETE, b"b")])
    second = queue.add(_SENDER, [(_DELETE, b"c")])
    assert first.sender is _SENDER
    now = first.due - DEFERRED_RIDER_DELAY
    assert queue.due(now) == []  # nothing due yet
    assert queue.seconds_to_due(now) == pytest.approx(DEFERRED_RIDER_DELAY)
    # the thread that served the first carrier takes its riders; the timer finds the rest
    assert first.take() == [(_DELETE, b"a"), (_DELETE, b"b")] and first.take() == []
    assert queue.seconds_to_due(now) == pytest.approx(second.due - now)
    assert queue.due(second.due) == [second]
    assert second.take() == [(_DELETE, b"c")]
    assert queue.due(second.due + 1) == [] and queue.seconds_to_due(now) is None


def test_threads_racing_for_deferred_riders_get_them_once() -> None:
    queue = DeferredRiderQueue()
    deferred = queue.add(_SENDER, [(_DELETE, bytes([i])) for i in range(100)])
    got: list[list[object]] = []
    start = threading.Barrier(4)

    def take() -> None:
        start.wait(10)
        got.append(list(deferred.take()))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(len(items) for items in got) == [0, 0, 0, 100]
