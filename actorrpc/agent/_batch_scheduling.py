"""``SCHED_BATCH`` for the I/O threads (libzmq's and the agent's own), while it is faster.

libzmq moves every message through an I/O thread of its own. Under Linux's
default policy, waking that thread (a message to send, bytes that arrived)
preempts whatever runs on its core. When that is one of this worker's own
threads busy-polling for a message (``ZmqRpcBackendOptions.busy_poll``), the
preemption only costs time: on these VMs ~20 µs per message, ~35 % of an
``rpc_sync`` (docs/performance.md, eleventh session). A ``SCHED_BATCH`` thread
that wakes does not preempt; it runs when the running thread yields (the poll's
``sched_yield``), blocks or uses up its time slice.

The agent's own I/O thread (``agent/_inbox.py``) wakes every back-off period
while another thread takes turns on the inbox, and for its timed work. Under the
default policy each of those wake-ups preempted the thread that computes (a
caller between an RPC's reply and its next request: ~2.5 wake-ups per
distributed-autograd iteration), which then ran on cold caches; while that thread
held the GIL the woken one could not even run Python. As a batch thread it runs
when the computing thread yields or blocks: same-run A/Bs of an autograd
iteration -15.5 %, -10.7 % and -3.0 % (11, 11 and 8 of 12 block pairs better), and
a call reaching a worker that computes between its own calls (``mixed_roles.py``)
1.0 ms at the median instead of 1.7 (docs/performance.md, twentieth session).
It joins the watched threads when it starts (:meth:`BatchScheduling.add`).

The price comes when a thread that never yields shares the core: a batch
thread then waits for that thread's time slice to end, up to ~1 ms per
message. When that thread is another process's (a busy loop, a data loader)
the waits are pure loss; when it is this process's own (a loop issuing
``rpc_async`` calls, a long computation), they batch its messages, which helps
throughput. So the policy is watched: every :data:`CHECK_INTERVAL` seconds the
threads' run-queue waits (``/proc/self/task/<tid>/schedstat``) are read, and
when their mean wait per wake-up exceeds :data:`MAX_BATCH_WAIT` while this
process used less than :data:`SELF_BUSY` CPUs (so others took the core) they
go back to the default policy. They try ``SCHED_BATCH`` again after a back-off
that starts at :data:`MIN_BACKOFF` and doubles (up to :data:`MAX_BACKOFF`)
while the trials keep failing.

Invariants:

* Only the threads handed in are touched: libzmq's I/O threads of this
  worker's own context (found by name, ``Transport.io_thread_ids``), which live
  as long as its transport (the agent stops checking before closing it), and
  the agent's I/O thread, which adds itself. One found gone by a policy switch
  is dropped.
* Only one thread changes the state: the agent's I/O thread (``add`` when it
  starts, ``check`` in its timed work); ``describe`` may be read from any thread.
* A refused policy change (a sandbox without ``sched_setscheduler``) leaves
  the threads as they are and turns the watching off; nothing raises.
* Threads whose waits cannot be read (no ``schedstat``, or it counts nothing)
  are never put under ``SCHED_BATCH``: unwatched, batch would have no guard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

__all__ = [
    "BATCH",
    "CHECK_INTERVAL",
    "DEFAULT",
    "MAX_BACKOFF",
    "MAX_BATCH_WAIT",
    "MIN_BACKOFF",
    "MIN_WAKEUPS",
    "SELF_BUSY",
    "OFF",
    "UNAVAILABLE",
    "BatchScheduling",
]

CHECK_INTERVAL = 0.1
MAX_BATCH_WAIT = 200e-6
"""Mean run-queue wait per wake-up above which batch loses (while others took the core).

Behind a CPU hog on its core a batch thread waits ~1 ms per wake-up; libzmq's threads
alone wait 4-5 µs. The agent's I/O thread waits behind the threads it must not
preempt, 40-170 µs per wake-up in an autograd loop (pinned and not): with a 50 µs
limit the guard gave batch up in windows where the process used a little less than
:data:`SELF_BUSY`, and the loop ran 10-20 % slower."""
MIN_WAKEUPS = 20  # wake-ups a check needs before it judges
SELF_BUSY = 0.75  # CPUs this process used per second above which the waits are its own
MIN_BACKOFF = 1.0
MAX_BACKOFF = 60.0

BATCH = "batch"
DEFAULT = "default"
OFF = "off"  # not asked for
UNAVAILABLE = "unavailable"  # asked for, but no thread was found or the system refused

_Waits = dict[int, tuple[int, int]]  # thread id -> (run-queue wait in ns, time slices)


def _read_waits(tids: Iterable[int]) -> _Waits:
    """Run-queue wait and time slices of each thread in ``tids`` that still runs."""
    waits: _Waits = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as handle:
                _, wait_ns, slices = handle.read().split()
        except (OSError, ValueError):
            continue
        waits[tid] = (int(wait_ns), int(slices))
    return waits


def _set_policy(tid: int, batch: bool) -> None:
    os.sched_setscheduler(tid, os.SCHED_BATCH if batch else os.SCHED_OTHER, os.sched_param(0))


class BatchScheduling:
    """Keeps a set of threads under ``SCHED_BATCH`` while that is faster (module docstring).

    Only the thread that calls ``check()`` and ``add()`` (the agent's I/O thread)
    changes its state, so it needs no lock; ``describe()`` may be read from any thread.
    ``check()`` is cheap between intervals (one clock comparison).
    """

    def __init__(
        self,
        tids: Iterable[int],
        enabled: bool,
        read_waits: Callable[[Iterable[int]], _Waits] = _read_waits,
        set_policy: Callable[[int, bool], None] = _set_policy,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        self.fallbacks = 0  # times batch was given up because the threads waited
        self._read_waits = read_waits
        self._set_policy = set_policy
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._window_start = (0.0, 0.0)  # (wall, process CPU) when the judged window began
        self._tids: list[int] = []
        self._backoff = MIN_BACKOFF
        self._retry_at = 0.0
        self._next_check = 0.0
        self._last: _Waits = {}
        self._refused = False  # the system refused a policy change: nothing is touched
        if not enabled:
            self.policy = OFF
            return
        # batch only where its waits can be watched: a thread that ran has counted slices
        candidates = list(tids)
        samples = self._read_waits(candidates)
        watchable = [t for t in candidates if samples.get(t, (0, 0))[1] > 0]
        self.policy = BATCH if hasattr(os, "SCHED_BATCH") and watchable else UNAVAILABLE
        for tid in watchable:
            if self.policy == BATCH and self._apply(tid, True):
                self._tids.append(tid)
        if not self._tids:
            self.policy = UNAVAILABLE  # no thread found, no schedstat, or refused
        self._start_window()

    @property
    def tids(self) -> list[int]:
        return list(self._tids)

    def _apply(self, tid: int, batch: bool) -> bool:
        """Set one thread's policy; False if it is gone or refused."""
        try:
            self._set_policy(tid, batch)
        except ProcessLookupError:
            if tid in self._tids:
                self._tids.remove(tid)  # it ended
            return False
        except OSError:
            self.policy = UNAVAILABLE  # not allowed here: leave the threads be
            self._refused = True
            self._tids.clear()
            return False
        return True

    def add(self, tid: int) -> None:
        """Put thread ``tid`` (started after this was made) under the current policy and
        watch it with the others; nothing when scheduling is off or was refused, or when
        its waits cannot be read. Called by the thread that calls :meth:`check`."""
        if self.policy == OFF or self._refused or not hasattr(os, "SCHED_BATCH"):
            return
        reading = self._read_waits([tid]).get(tid, (0, 0))
        if reading[1] == 0:
            return  # unwatchable: never under an unguarded batch
        if self.policy == UNAVAILABLE:  # no libzmq thread was found: the first one to watch
            self.policy = BATCH
            self._start_window()
        if self._apply(tid, self.policy == BATCH):
            self._tids.append(tid)
            self._last[tid] = reading  # its waits count from now, in the current window

    def _switch(self, batch: bool) -> None:
        for tid in list(self._tids):
            self._apply(tid, batch)
        if self.policy != UNAVAILABLE:
            self.policy = BATCH if batch else DEFAULT

    def _start_window(self) -> None:
        self._last = self._read_waits(self.tids)
        now = self._clock()
        self._window_start = (now, self._cpu_clock())
        self._next_check = now + CHECK_INTERVAL

    def check(self) -> None:
        """Judge the last interval; switch policy when batch loses or a retry is due."""
        now = self._clock()
        if self.policy in (OFF, UNAVAILABLE) or now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL
        if self.policy == DEFAULT:
            if now >= self._retry_at:
                self._switch(True)
                self._start_window()
            return
        current = self._read_waits(self.tids)
        waited = wakeups = 0
        for tid, (wait_ns, slices) in current.items():
            before = self._last.get(tid)
            if before is not None:
                waited += wait_ns - before[0]
                wakeups += slices - before[1]
        if wakeups < MIN_WAKEUPS:
            return  # too quiet to judge: keep counting from the same start
        self._last = current
        began, cpu_began = self._window_start
        cpu = self._cpu_clock()
        self._window_start = (now, cpu)
        if waited / wakeups / 1e9 <= MAX_BATCH_WAIT:
            self._backoff = MIN_BACKOFF
            return
        if cpu - cpu_began >= SELF_BUSY * (now - began):
            return  # this process's own threads kept the core: the waits batched its messages
        self._switch(False)
        self.fallbacks += 1
        self._retry_at = now + self._backoff
        self._backoff = min(2 * self._backoff, MAX_BACKOFF)

    def describe(self) -> dict[str, object]:
        return {"policy": self.policy, "threads": len(self.tids), "fallbacks": self.fallbacks}
