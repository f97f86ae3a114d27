"""Waiting on a condition with a deadline: the one polling helper the tests share.

Tests never synchronise with a fixed sleep; they poll a condition with a
growing interval (5 ms up to 100 ms) until it holds or the deadline passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["start_blocked", "wait_for", "wait_until"]


def wait_until(condition: Callable[[], Any], timeout: float) -> bool:
    """Poll ``condition`` until it is truthy (``True``) or ``timeout`` seconds pass (``False``)."""
    deadline = time.monotonic() + timeout
    interval = 0.005
    pause = threading.Event()
    while not condition():
        if time.monotonic() >= deadline:
            return False
        pause.wait(interval)
        interval = min(interval * 2, 0.1)
    return True


def wait_for(condition: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``condition`` until it returns a truthy value, and return that value.

    Raises TimeoutError naming ``what`` at the deadline.
    """
    found: list[T] = []

    def holds() -> bool:
        value = condition()
        if value:
            found.append(value)
        return bool(value)

    if not wait_until(holds, timeout):
        raise TimeoutError(f"gave up after {timeout}s waiting for: {what}")
    return found[-1]


def start_blocked(monkeypatch: Any, target: Callable[[], T]) -> tuple[threading.Thread, list[T]]:
    """Run ``target`` in a thread; return once that thread blocks in the transport's poll
    (``transport._zmq._zmq_poll``, patched to tell): the thread, and ``target``'s result
    once it is done."""
    from actorrpc.transport import _zmq

    blocking, real_poll = threading.Event(), _zmq._zmq_poll
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(target()))

    def poll(*args: Any) -> Any:
        if threading.current_thread() is thread:  # (not a group's I/O thread in this process)
            blocking.set()
        return real_poll(*args)

    monkeypatch.setattr(_zmq, "_zmq_poll", poll)
    thread.start()
    assert blocking.wait(10), "the thread did not block in the transport's poll"
    return thread, result
