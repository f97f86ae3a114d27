"""The pool of threads that run user functions and handlers.

Threads start lazily, one at a time, when work waits and no thread is idle and
none has started a task for ``STALL_SECONDS`` (so the running ones are blocked
or slow, not merely busy with a burst of short calls). An idle worker holds no
more threads than it ever needed, and a burst of tiny calls is served by a few
threads instead of many threads fighting over the GIL. ``maintain()``, called
by the I/O loop, grows the pool when every thread is blocked and nothing new
arrives, so queued work never starves. A thread runs ``before_wait`` when it
finds the queue empty after a task (still counted busy), again before it blocks on
the queue, and before it exits.
"""

from __future__ import annotations

import _thread  # noqa: F401  (mypyc: its threading.local subclass needs the module)
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mypy_extensions import mypyc_attr

from ._batch_scheduling import undo_inherited_batch

__all__ = ["STALL_SECONDS", "WorkerPool"]

_log = logging.getLogger("actorrpc.agent")
_Task = tuple[Callable[..., Any], tuple[Any, ...]]
STALL_SECONDS = 0.002


@mypyc_attr(native_class=False)  # (see actorrpc/_compiled.py)
class _PoolMembership(threading.local):
    member = False  # set on the pool's own threads (a class default: no failed lookup)


class WorkerPool:
    def __init__(
        self, max_threads: int, name: str, before_wait: Callable[[], None] = lambda: None
    ) -> None:
        self._max_threads = max_threads
        self._before_wait = before_wait
        self._local = _PoolMembership()
        self._name = name
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False
        self._last_start = 0.0
        self.busy = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args))
        # (what ``_grow`` checks under its lock, first without it: in a stream of requests
        # served by a busy thread it would not grow, and the lock is taken per request)
        if self._idle == 0 and len(self._threads) < self._max_threads:
            now = time.monotonic()
            if not self._threads or now - self._last_start >= STALL_SECONDS:
                self._grow(now)

    def idle_or_empty(self) -> bool:
        return bool(self._idle) or self._queue.empty()

    def maintain(self) -> None:
        """Start a thread if work has been waiting while every thread is stuck."""
        if self._idle == 0 and not self._queue.empty():
            self._grow(time.monotonic())

    def _grow(self, now: float) -> None:
        with self._lock:
            if self._idle or len(self._threads) >= self._max_threads or self._closed:
                return
            if self._threads and now - self._last_start < STALL_SECONDS:
                return
            thread = threading.Thread(
                target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            self._idle += 1
            thread.start()

    def queued(self) -> int:
        return self._queue.qsize()

    def all_idle(self) -> bool:
        """No thread at work and nothing queued."""
        return not self.busy and self._queue.empty()

    def has_queued(self) -> bool:
        return not self._queue.empty()

    def on_pool_thread(self) -> bool:
        """Whether the calling thread is one of this pool's."""
        return self._local.member

    def started_outside(self) -> None:
        """A busy thread started another task itself (a request its serving turn received)."""
        self._last_start = time.monotonic()

    @property
    def size(self) -> int:
        return len(self._threads)

    def _run(self) -> None:
        undo_inherited_batch()  # (when the agent's I/O thread started it: user code runs here)
        self._local.member = True
        get, empty = self._queue.get, self._queue.empty
        task: _Task | None = None  # a task taken while still counted busy
        while True:
            if task is None:
                if empty():  # (usually ran already, while counted busy)
                    self._run_before_wait()
                task = get()
                if task is None:
                    self._run_before_wait()
                    return
                with self._lock:
                    self._idle -= 1
                    self.busy += 1
                    self._last_start = time.monotonic()
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a task must never kill its thread
                _log.exception("unhandled error in a pool task")
            finally:
                # an idle thread must not keep its last request (and the tensors in it) alive
                task = fn = args = None  # type: ignore[assignment]
                # queued work goes on in this thread, still counted busy (no idle-busy
                # round trip per task in a stream of requests); a stop stays queued
                if not empty():
                    try:
                        task = get(False)
                    except queue.Empty:  # another thread took it
                        task = None
                    if task is None:  # (a stop: taken again, idle, at the loop's start)
                        self._queue.put(None)
                    else:
                        self._last_start = time.monotonic()
                if task is None:
                    if empty():  # still counted busy: a send that blocks grows the pool
                        self._run_before_wait()
                    with self._lock:
                        self._idle += 1
                        self.busy -= 1

    def _run_before_wait(self) -> None:
        try:
            self._before_wait()
        except BaseException:  # noqa: BLE001 - nor may what runs before a wait
            _log.exception("unhandled error before a pool thread waits")

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join(timeout)
