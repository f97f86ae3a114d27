"""The scheduling policy of libzmq's I/O threads: ``SCHED_BATCH`` while it is faster.

libzmq moves every message through an I/O thread of its own. Under Linux's
default policy, waking that thread (a message to send, bytes arriving)
preempts whatever runs on its core. When that is one of this worker's own
threads busy-polling for the reply (``ZmqRpcBackendOptions.busy_poll``), the
preemption only costs time: on these VMs ~20 µs per message, ~40 % of an
``rpc_sync`` (docs/performance.md, eleventh session). Under ``SCHED_BATCH`` a
woken I/O thread does not preempt; it runs when the running thread yields (the
poll's ``sched_yield``) or blocks.

The price comes when a thread that never yields shares the core (another
process's busy loop, a long computation): a batch thread then waits for that
thread's time slice to end, ~1 ms per message. So the policy is watched: every
:data:`CHECK_INTERVAL` seconds the I/O threads' run-queue waits
(``/proc/self/task/<tid>/schedstat``) are read, and when their mean wait per
wake-up exceeds :data:`MAX_BATCH_WAIT` the threads go back to the default
policy. They try ``SCHED_BATCH`` again after a back-off that starts at
:data:`MIN_BACKOFF` and doubles (up to :data:`MAX_BACKOFF`) while the trials
keep failing.

Invariants:

* Only threads whose name carries this context's prefix are touched
  (``<prefix>/ZMQbg/IO/<n>``, libzmq's ``ZMQ_THREAD_NAME_PREFIX``).
* A refused policy change (a sandbox without ``sched_setscheduler``) leaves
  the threads as they are and turns the watching off; it never raises.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

__all__ = [
    "CHECK_INTERVAL",
    "MAX_BACKOFF",
    "MAX_BATCH_WAIT",
    "MIN_BACKOFF",
    "IoThreadScheduling",
    "threads_named",
]

CHECK_INTERVAL = 0.1
MAX_BATCH_WAIT = 50e-6  # mean run-queue wait per wake-up above which batch loses
MIN_WAKEUPS = 20  # wake-ups a check needs before it judges
MIN_BACKOFF = 1.0
MAX_BACKOFF = 60.0

_TASKS = "/proc/self/task"
BATCH = "batch"
DEFAULT = "default"
OFF = "off"  # not asked for
UNAVAILABLE = "unavailable"  # asked for, but no thread was found or the system refused


def _thread_name(tid: int) -> str:
    try:
        with open(f"{_TASKS}/{tid}/comm", encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""  # the thread ended


def threads_named(prefix: str, timeout: float = 1.0) -> list[int]:
    """Ids of this process's threads whose name starts with ``prefix``.

    A new thread names itself once it runs, so this waits (up to ``timeout``
    seconds) for at least one; ``[]`` where ``/proc`` is absent.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        try:
            tids = [int(t) for t in os.listdir(_TASKS)]
        except OSError:
            return []
        found = [t for t in tids if _thread_name(t).startswith(prefix)]
        if found or time.monotonic() >= deadline:
            return found
        pause.wait(0.001)


def _read_waits(tids: Sequence[int]) -> tuple[int, int]:
    """Summed run-queue wait (ns) and time slices of ``tids`` (``schedstat``)."""
    waited = slices = 0
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/schedstat", encoding="ascii") as handle:
                _, wait_ns, count = handle.read().split()
        except (OSError, ValueError):
            continue
        waited += int(wait_ns)
        slices += int(count)
    return waited, slices


def _set_policy(tids: Sequence[int], batch: bool) -> None:
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    for tid in tids:
        os.sched_setscheduler(tid, policy, os.sched_param(0))


class IoThreadScheduling:
    """Keeps ``tids`` (libzmq's I/O threads) under ``SCHED_BATCH`` while that is faster.

    ``check()`` is cheap between intervals (one clock comparison) and may be
    called from one thread at a time (the agent's housekeeping).
    """

    def __init__(
        self,
        tids: Sequence[int],
        enabled: bool,
        read_waits: Callable[[Sequence[int]], tuple[int, int]] = _read_waits,
        set_policy: Callable[[Sequence[int], bool], None] = _set_policy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tids = list(tids)
        self.fallbacks = 0  # times batch was given up because the threads waited
        self._read_waits = read_waits
        self._set_policy = set_policy
        self._clock = clock
        self._backoff = MIN_BACKOFF
        self._retry_at = 0.0
        self._next_check = 0.0
        self._last = (0, 0)
        self.policy = UNAVAILABLE if enabled else OFF
        if enabled and self.tids and hasattr(os, "SCHED_BATCH") and self._apply(True):
            self._last = self._read_waits(self.tids)
            self._next_check = self._clock() + CHECK_INTERVAL

    def _apply(self, batch: bool) -> bool:
        try:
            self._set_policy(self.tids, batch)
        except OSError:
            self.policy = UNAVAILABLE  # not allowed here: leave the threads be
            return False
        self.policy = BATCH if batch else DEFAULT
        return True

    def check(self) -> None:
        """Judge the last interval; switch policy when batch loses or a retry is due."""
        now = self._clock()
        if self.policy in (OFF, UNAVAILABLE) or now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL
        if self.policy == DEFAULT:
            if now >= self._retry_at and self._apply(True):
                self._last = self._read_waits(self.tids)
            return
        waited, slices = self._read_waits(self.tids)
        wakeups = slices - self._last[1]
        if wakeups < MIN_WAKEUPS:
            return  # too quiet to judge: keep counting from the same start
        mean_wait = (waited - self._last[0]) / wakeups / 1e9
        self._last = (waited, slices)
        if mean_wait <= MAX_BATCH_WAIT:
            self._backoff = MIN_BACKOFF
            return
        if self._apply(False):
            self.fallbacks += 1
            self._retry_at = now + self._backoff
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)

    def describe(self) -> dict[str, object]:
        return {"policy": self.policy, "fallbacks": self.fallbacks}
