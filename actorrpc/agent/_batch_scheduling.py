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
iteration -13.3 % and -16.4 % pinned, -9.0 % unpinned (7, 7 and 5 of 8 block pairs
better), and a call reaching a worker that computes between its own calls
(``mixed_roles.py``) 1.0 ms at the median instead of 1.7 (docs/performance.md,
twentieth session).
It adds itself when it starts (:meth:`BatchScheduling.add`), to a
:class:`BatchScheduling` of its own (``Agent.io_thread_scheduling``; libzmq's are
``Agent.batch_scheduling``), so that either falls back without touching the other.

The price comes when a thread that never yields shares the core: a batch
thread then waits for that thread's time slice to end, up to ~1 ms per
message. When that thread is another process's (a busy loop, a data loader)
the waits are pure loss; when it is this process's own (a loop issuing
``rpc_async`` calls, a long computation), they batch its messages, which helps
throughput. So the policy is watched: every :data:`CHECK_INTERVAL` seconds the
threads' run-queue waits (``/proc/self/task/<tid>/schedstat``) are read, and
when one thread's mean wait per wake-up since it was last judged exceeds the
limit (:data:`MAX_BATCH_WAIT` for libzmq's, :data:`MAX_AGENT_IO_WAIT` for the
agent's) while this process used less than :data:`SELF_BUSY` CPUs (so others
took the core), and its waits less the time this process's busy polls spun
(``transport._zmq`` ``_SPIN_SECONDS``: waits behind those are its own; none are
excused once a spin or poll found its core taken) still exceed the limit, and other
processes used at least :data:`FOREIGN_SHARE` of the CPUs this process's threads may
run on (``/proc/stat``; a worker pinned to its own core waits behind its own long
copies, such as a 64 MB tensor's, in windows where it used little CPU in all), the
threads it watches go back to the default policy. They try ``SCHED_BATCH``
again after a back-off that starts at :data:`MIN_BACKOFF` and doubles (up to
:data:`MAX_BACKOFF`) while the trials keep failing.

A window is judged on one state of this process: quiet or busy (less than
:data:`QUIET_SHARE` or more than :data:`ACTIVE_SHARE` of a CPU in a check interval).
When the state changes, each thread's window starts again there, and a verdict that
batch lost is acted on at the next check only if the state held until then (a window's
last interval may straddle the change). Windows that mixed the two lost batch where
neither state would have: a worker taking turns with another process on its cores
(``benchmarks/paired_blocks.py``) was judged on its own threads' waits in a burst of its
work against the CPU use and foreign share of the idle stretch before it, or on its
timer's waits behind the other process just after the burst against the burst's CPU use;
its autograd iteration ran ~5 % slower. For the same reason a fallback judged on a quiet
window (the idle threads' timer wake-ups behind another process) is retried when the
process turns busy, not after the back-off.

Invariants:

* Only the threads handed in are touched: libzmq's I/O threads of this
  worker's own context (found by name, ``Transport.io_thread_ids``), which live
  as long as its transport (the agent stops checking before closing it), and
  the agent's I/O thread, which adds itself. One found gone by a policy switch
  is dropped. Threads they start inherit their policy (Linux copies it): the
  threads the agent starts (its pool's, the RRef timers') give it up first
  (:func:`undo_inherited_batch`). Still under batch, unwatched: what the I/O
  thread runs itself (callbacks of futures completed there, inline handlers)
  and the threads or processes those start, such as a library's thread pool
  created on its first use there.
* Only one thread changes the state: the agent's I/O thread (``add`` when it
  starts, ``check`` in its timed work); ``describe`` may be read from any thread.
* A refused policy change (a sandbox without ``sched_setscheduler``) turns the
  watching off and puts the threads already switched back, as far as allowed;
  nothing raises.
* Threads whose waits cannot be read (no ``schedstat``, or it counts nothing)
  are never put under ``SCHED_BATCH``: unwatched, batch would have no guard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

__all__ = [
    "BATCH",
    "ACTIVE_SHARE",
    "QUIET_SHARE",
    "CHECK_INTERVAL",
    "FOREIGN_SHARE",
    "DEFAULT",
    "MAX_BACKOFF",
    "MAX_AGENT_IO_WAIT",
    "MAX_BATCH_WAIT",
    "MIN_BACKOFF",
    "MIN_WAKEUPS",
    "SELF_BUSY",
    "OFF",
    "UNAVAILABLE",
    "BatchScheduling",
    "undo_inherited_batch",
]

CHECK_INTERVAL = 0.1
MAX_BATCH_WAIT = 50e-6
"""Mean run-queue wait per wake-up above which batch loses for one of libzmq's threads
(while others took the core): alone they wait 4-5 µs, behind a CPU hog ~1 ms."""
MAX_AGENT_IO_WAIT = 200e-6
"""The same limit for the agent's I/O thread, which waits behind the very threads it
must not preempt: 40-170 µs per wake-up in an autograd loop, pinned and not. With the
50 µs limit the guard gave batch up in windows where the process used a little less
than :data:`SELF_BUSY`, and the loop ran 10-20 % slower."""
MIN_WAKEUPS = 20  # wake-ups of one thread before its waits are judged
ACTIVE_SHARE = 0.1
"""CPUs this process used in a check interval from which it counts as busy ..."""
QUIET_SHARE = 0.02
"""... and below which as quiet (in between: as the interval before). An idle worker uses
~0.001; a loop that mostly waits for its replies behind another process, ~0.05-0.1."""
SELF_BUSY = 0.75  # CPUs this process used per second above which the waits are its own
MIN_BACKOFF = 1.0
MAX_BACKOFF = 60.0
FOREIGN_SHARE = 0.25
"""Share of the CPUs this process may run on that other processes used in a window, below
which long waits are taken for waits behind this process's own threads. A pinned worker
alone on its core, after 64 MB echoes: an autograd iteration 0.47-0.50 ms with batch kept,
0.53-0.60 after the guard gave up (docs/performance.md, twenty-fourth session)."""

BATCH = "batch"
DEFAULT = "default"
OFF = "off"  # not asked for
UNAVAILABLE = "unavailable"  # asked for, but no thread was found or the system refused

_Waits = dict[int, tuple[int, int]]  # thread id -> (run-queue wait in ns, time slices)
_CoreBusy = dict[int, float]  # CPU -> seconds it ran anything (not idle or stolen) since boot
# where a thread's judged window began: its run-queue wait (ns) and slices, the wall
# clock, the process's CPU time, its busy polls' spin_counts() and the CPUs' busy time then
_Baseline = tuple[int, int, float, float, tuple[float, int], _CoreBusy | None]


def _read_core_busy() -> _CoreBusy | None:
    """Seconds each CPU ran anything since boot (``/proc/stat``: user, nice, system, irq,
    softirq; ticks of ``SC_CLK_TCK``); None if unreadable."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            lines = handle.read().splitlines()
        per_tick = 1.0 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy: _CoreBusy = {}
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        fields = line.split()
        try:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
            busy[int(fields[0][3:])] = (user + nice + system + irq + softirq) * per_tick
        except ValueError:
            continue
    return busy or None


def _process_cores() -> set[int] | None:
    """The CPUs any thread of this process may run on (None if unknown)."""
    cores: set[int] = set()
    try:
        names = os.listdir("/proc/self/task")
    except OSError:
        return None
    for name in names:
        try:
            cores |= os.sched_getaffinity(int(name))
        except (OSError, ValueError):
            continue  # it ended meanwhile
    return cores or None


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


def undo_inherited_batch() -> None:
    """Give the calling thread the main thread's policy if it inherited ``SCHED_BATCH``.

    Linux copies a thread's policy to the threads it starts, so a thread started by
    a watched batch thread (the pool's, when the agent's I/O thread grows the pool) would
    run under batch unwatched, and so would what it starts (a user function's threads
    or processes). Threads the agent starts call this first. A process whose main
    thread runs under batch itself (``chrt -b``) keeps it.
    """
    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        if os.sched_getscheduler(0) != os.SCHED_BATCH:
            return
        main = os.sched_getscheduler(os.getpid())  # (the main thread's id is the pid)
        if main in (os.SCHED_OTHER, os.SCHED_IDLE):
            os.sched_setscheduler(0, main, os.sched_param(0))
    except OSError:
        pass  # no such system call here, or refused: the thread stays as it is


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
        max_wait: float = MAX_BATCH_WAIT,
        own_spins: Callable[[], tuple[float, int]] = lambda: (0.0, 0),
        read_core_busy: Callable[[], _CoreBusy | None] = _read_core_busy,
        process_cores: Callable[[], set[int] | None] = _process_cores,
    ) -> None:
        self.fallbacks = 0  # times batch was given up because the threads waited
        self.max_wait = max_wait  # the limit each watched thread is judged against
        self._read_waits = read_waits
        self._set_policy = set_policy
        self._clock = clock
        self._cpu_clock = cpu_clock
        # (seconds this process's busy polls spun, spins and polls that lost their core)
        self._own_spins = own_spins
        self._read_core_busy = read_core_busy
        self._process_cores = process_cores
        self._tids: list[int] = []
        self._backoff = MIN_BACKOFF
        self._retry_at = 0.0
        self._next_check = 0.0
        self._baselines: dict[int, _Baseline] = {}
        self._refused = False  # the system refused a policy change: nothing is touched
        # the process clock at the last check, and whether that interval was busy
        self._last_cpu, self._last_check_at = cpu_clock(), clock()
        self._busy: bool | None = None  # (unknown until the first check: no change then)
        self._quiet_fallback = False  # the last fallback was judged on a quiet window
        # a window that lost batch (True: while busy), waiting for the next check
        self._lost_busy: bool | None = None
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
            watched, self._tids = self._tids, []
            for other in watched:  # those already switched go back, as far as allowed
                try:
                    self._set_policy(other, False)
                except OSError:
                    pass
            return False
        return True

    def add(self, tid: int) -> None:
        """Put thread ``tid`` (started after this was made: the agent's I/O thread) under
        the current policy and watch it with the others; nothing when scheduling is off
        or was refused, or when its waits cannot be read. Called by the thread that
        calls :meth:`check`."""
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
            self._baselines[tid] = (*reading, self._clock(), self._cpu_clock(),
                                    self._own_spins(), self._read_core_busy())

    def _switch(self, batch: bool) -> None:
        for tid in list(self._tids):
            self._apply(tid, batch)
            if self._refused:
                break  # the threads were put back: none may be switched to batch after it
        if self.policy != UNAVAILABLE:
            self.policy = BATCH if batch else DEFAULT

    def _start_window(self) -> None:
        now, cpu, spins = self._clock(), self._cpu_clock(), self._own_spins()
        busy = self._read_core_busy()
        self._baselines = {
            tid: (wait_ns, slices, now, cpu, spins, busy)
            for tid, (wait_ns, slices) in self._read_waits(self.tids).items()
        }
        self._next_check = now + CHECK_INTERVAL

    def check(self) -> None:
        """Judge each thread that woke often enough since its window began; switch policy
        when batch loses for one of them, or when a retry is due.

        Each thread is judged on its own waits: a thread that wakes rarely behind a hog
        is not averaged away by one that wakes often elsewhere.
        """
        now = self._clock()
        if self.policy in (OFF, UNAVAILABLE) or now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL
        turned = self._note_activity(now)
        if self.policy == DEFAULT:
            if now >= self._retry_at or (turned and self._busy and self._quiet_fallback):
                self._switch(True)
                self._start_window()
            return
        if self._lost_busy is not None:  # a verdict stands if the process kept its state
            lost_busy, self._lost_busy = self._lost_busy, None
            if not turned:
                self._fall_back(now, lost_busy)
                return
        if turned:  # a window is judged on one state: quiet, or busy
            self._start_window()
            return
        # the spins and the CPUs' clocks only for a thread to judge (or to start counting):
        # an idle worker's checks read its threads' schedstat and the process clock (~0.6
        # µs), not /proc/stat (~23 µs of CPU a check on a VM)
        due = {
            tid: reading for tid, reading in self._read_waits(self.tids).items()
            if tid not in self._baselines
            or reading[1] - self._baselines[tid][1] >= MIN_WAKEUPS
        }
        if not due:
            return  # too quiet to judge: each keeps counting from the same start
        cpu, spins, busy = self._cpu_clock(), self._own_spins(), self._read_core_busy()
        judged = over = lost = False  # over: a thread waited too long (excused or not)
        for tid, (wait_ns, slices) in due.items():
            baseline = self._baselines.get(tid)
            if baseline is None:
                self._baselines[tid] = (wait_ns, slices, now, cpu, spins, busy)
                continue
            waited_from, slices_from, began, cpu_began, spins_began, busy_began = baseline
            wakeups = slices - slices_from
            self._baselines[tid] = (wait_ns, slices, now, cpu, spins, busy)
            judged = True
            waited = (wait_ns - waited_from) / 1e9
            if waited / wakeups <= self.max_wait:
                continue
            over = True
            # unless this process's own threads kept the core: the waits batched its work,
            # or were behind its busy polls' spins (``transport._zmq``; at most as long as
            # they spun, and none once a spin or poll found its core taken meanwhile)
            unexplained = waited if spins[1] != spins_began[1] else waited - (
                spins[0] - spins_began[0])
            if cpu - cpu_began < SELF_BUSY * (now - began) and (
                unexplained / wakeups > self.max_wait
            ) and not self._alone(busy_began, busy, cpu - cpu_began, now - began):
                lost = True
        if lost:  # acted on at the next check, unless the process turned quiet or busy
            self._lost_busy = bool(self._busy)
        elif judged and not over:  # batch won a judged window outright: retries start over
            self._backoff = MIN_BACKOFF

    def _fall_back(self, now: float, lost_busy: bool) -> None:
        self._switch(False)
        self.fallbacks += 1
        self._quiet_fallback = not lost_busy
        self._retry_at = now + self._backoff
        self._backoff = min(2 * self._backoff, MAX_BACKOFF)

    def _note_activity(self, now: float) -> bool:
        """Read the process clock (cheap, unlike ``/proc/stat``) and classify the interval
        since the last check (module docstring); whether the process turned quiet or busy
        (never at the first check: the first windows start when this is made)."""
        before, cpu = self._busy, self._cpu_clock()
        elapsed, used = now - self._last_check_at, cpu - self._last_cpu
        if elapsed > 0 and used >= ACTIVE_SHARE * elapsed:
            self._busy = True
        elif elapsed > 0 and used < QUIET_SHARE * elapsed:
            self._busy = False
        self._last_cpu, self._last_check_at = cpu, now
        return before is not None and self._busy != before

    def _alone(self, busy_began: _CoreBusy | None, busy: _CoreBusy | None, own_cpu: float,
               seconds: float) -> bool:
        """Whether the CPUs this process's threads may run on ran (almost) nothing but this
        process in a window of ``seconds`` in which it used ``own_cpu``: its threads' waits
        were behind its own."""
        if busy_began is None or busy is None or seconds <= 0:
            return False
        cores = self._process_cores()
        if not cores:
            return False
        used = 0.0
        for core in cores:
            if core not in busy or core not in busy_began:
                return False
            used += busy[core] - busy_began[core]
        return used - own_cpu < FOREIGN_SHARE * seconds * len(cores)

    def describe(self) -> dict[str, object]:
        return {"policy": self.policy, "threads": len(self.tids), "fallbacks": self.fallbacks}
