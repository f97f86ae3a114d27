"""Whether a piece of code releases the GIL: the one test helper for it."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

__all__ = ["other_thread_ran_during"]


def other_thread_ran_during(action: Callable[[], object]) -> bool:
    """Whether another thread ran Python code while ``action`` ran. The interpreter's
    switch interval is set far beyond the action, so the thread that holds the GIL keeps
    it until it releases it itself: another thread runs only if the action releases it."""
    ticks: list[float] = []
    ticking, stop = threading.Event(), threading.Event()

    def ticker() -> None:
        ticking.set()
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(1e-5)  # (releases the GIL)

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    assert ticking.wait(10)
    sys.setswitchinterval(30.0)
    try:
        begin = time.perf_counter()
        action()
        end = time.perf_counter()
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join(10)
    return any(begin < tick < end for tick in ticks)
