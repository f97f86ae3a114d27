"""The pool of threads that run user functions and handlers.

Threads start lazily, one at a time, when work arrives and none is idle, so an
idle worker holds no more threads than it ever needed at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["WorkerPool"]

_log = logging.getLogger("actorrpc.agent")
_Task = tuple[Callable[..., Any], tuple[Any, ...]]


class WorkerPool:
    def __init__(self, max_threads: int, name: str) -> None:
        self._max_threads = max_threads
        self._name = name
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False
        self.busy = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args))
        if self._idle == 0:
            with self._lock:
                if self._idle == 0 and len(self._threads) < self._max_threads and not self._closed:
                    thread = threading.Thread(
                        target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                    )
                    self._threads.append(thread)
                    self._idle += 1
                    thread.start()

    @property
    def size(self) -> int:
        return len(self._threads)

    def _run(self) -> None:
        get = self._queue.get
        while True:
            task = get()
            if task is None:
                return
            with self._lock:
                self._idle -= 1
                self.busy += 1
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a task must never kill its thread
                _log.exception("unhandled error in a pool task")
            finally:
                with self._lock:
                    self._idle += 1
                    self.busy -= 1

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
