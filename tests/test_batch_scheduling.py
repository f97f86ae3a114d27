"""SCHED_BATCH for the I/O threads (libzmq's and the agent's), and the fallback when it loses."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import Any

import pytest

import actorrpc as rpc
from actorrpc.agent import _batch_scheduling as sched
from actorrpc.agent._batch_scheduling import BatchScheduling, undo_inherited_batch
from actorrpc.agent._pool import WorkerPool
from actorrpc.transport import Transport

from ._waiting import wait_until

pytestmark = pytest.mark.timeout(60)

needs_batch = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
    reason="needs Linux's SCHED_BATCH and /proc",
)


class _Threads:
    """Fake threads: run-queue waits the test sets, policies the scheduling sets."""

    def __init__(self, tids: Iterable[int] = (11, 12)) -> None:
        self.waits = {tid: [0, 1] for tid in tids}  # each ran once (it named itself)
        self.batch: dict[int, bool] = {}
        self.refuse = False
        self.refuse_tids: set[int] = set()  # refused for these threads only
        self.now = 100.0
        self.cpu = 0.0
        self.cpu_share = 0.2  # CPUs this process uses: little, the rest is someone else's
        self.spins = (0.0, 0)  # (seconds busy polls spun, spins and polls that lost the core)
        # the CPUs' busy seconds since boot (None: unknown, as where /proc/stat is missing),
        # the CPUs this process's threads may run on, and the share of those CPUs that
        # other processes use (added to the busy seconds at each check)
        self.core_busy: dict[int, float] | None = None
        self.cores = {0}
        self.foreign_share = 0.0
        self.reads: list[str] = []  # process-wide readings taken: "cpu", "spins", "busy"

    def wake(self, times: int, wait_us: float, tids: Iterable[int] | None = None) -> None:
        for tid in tids or list(self.waits):
            self.waits[tid][0] += int(times * wait_us * 1000)
            self.waits[tid][1] += times

    def read_waits(self, tids: Iterable[int]) -> dict[int, tuple[int, int]]:
        return {t: (self.waits[t][0], self.waits[t][1]) for t in tids if t in self.waits}

    def set_policy(self, tid: int, batch: bool) -> None:
        if self.refuse or tid in self.refuse_tids:
            raise PermissionError("sched_setscheduler refused")
        if tid not in self.waits:
            raise ProcessLookupError(tid)
        self.batch[tid] = batch

    def scheduling(
        self, enabled: bool = True, max_wait: float = sched.MAX_BATCH_WAIT
    ) -> BatchScheduling:
        return BatchScheduling(
            list(self.waits), enabled, self.read_waits, self.set_policy,
            clock=lambda: self.now, cpu_clock=lambda: self._read("cpu", self.cpu),
            max_wait=max_wait, own_spins=lambda: self._read("spins", self.spins),
            read_core_busy=lambda: self._read(
                "busy", None if self.core_busy is None else dict(self.core_busy)),
            process_cores=lambda: set(self.cores),
        )

    def _read(self, what: str, value: Any) -> Any:
        self.reads.append(what)
        return value

    def check(self, scheduling: BatchScheduling) -> None:
        self.now += sched.CHECK_INTERVAL
        self.cpu += self.cpu_share * sched.CHECK_INTERVAL
        if self.core_busy is not None:  # this process's CPU, on its first core, and others'
            first = min(self.cores)
            self.core_busy[first] += self.cpu_share * sched.CHECK_INTERVAL
            for core in self.cores:
                self.core_busy[core] += self.foreign_share * sched.CHECK_INTERVAL
        scheduling.check()

    def judge(self, scheduling: BatchScheduling) -> None:
        """The check that judges a window, and the next one, at which a verdict that batch
        lost is acted on (the process kept its state, quiet or busy)."""
        self.check(scheduling)
        self.check(scheduling)

    def seconds_until_batch_again(self, scheduling: BatchScheduling) -> float:
        """Check every interval until batch is retried (at most MAX_BACKOFF's worth)."""
        gave_up = self.now
        for _ in range(int(sched.MAX_BACKOFF / sched.CHECK_INTERVAL) + 2):
            if scheduling.policy == "batch":
                return self.now - gave_up
            self.check(scheduling)
        raise AssertionError("batch was never retried")


def test_batch_is_kept_while_the_threads_hardly_wait() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    assert scheduling.policy == "batch" and threads.batch == {11: True, 12: True}
    for _ in range(10):
        threads.wake(500, wait_us=5)
        threads.check(scheduling)
    assert scheduling.describe() == {"policy": "batch", "threads": 2, "fallbacks": 0}


def test_batch_is_given_up_when_the_threads_wait_and_retried_after_a_doubling_backoff() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.wake(100, wait_us=900)  # a thread that never yields shares the core
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 1)
    assert threads.batch == {11: False, 12: False}
    backoff = threads.seconds_until_batch_again(scheduling)
    assert sched.MIN_BACKOFF <= backoff < sched.MIN_BACKOFF + 2 * sched.CHECK_INTERVAL
    assert threads.batch == {11: True, 12: True}
    threads.wake(100, wait_us=900)  # still losing: the next back-off is twice as long
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 2)
    assert threads.seconds_until_batch_again(scheduling) >= 2 * sched.MIN_BACKOFF
    threads.wake(100, wait_us=5)  # the other thread left: batch stays, the back-off resets
    threads.check(scheduling)
    threads.wake(100, wait_us=900)
    threads.check(scheduling)
    assert threads.seconds_until_batch_again(scheduling) < 2 * sched.MIN_BACKOFF


def test_waits_behind_this_processs_own_busy_threads_keep_batch() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.cpu_share = 1.0  # e.g. a loop issuing rpc_async calls: the waits batch them
    for _ in range(5):
        threads.wake(100, wait_us=900)
        threads.check(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("batch", 0)
    threads.cpu_share = 0.3  # the loop ended; someone else's thread takes the core
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 1)


def test_waits_behind_this_processs_own_spins_keep_batch_as_long_as_they_spun() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    spun = 0.0
    for _ in range(5):  # little CPU over the window (idle stretches), but the waits (90 ms)
        spun += 0.09  # were no longer than this process's own polls spun
        threads.spins = (spun, 0)
        threads.wake(100, wait_us=900)
        threads.check(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("batch", 0)
    threads.spins = (spun + 0.01, 0)  # 10 ms of spins cannot explain 90 ms of waits
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 1)
    assert threads.seconds_until_batch_again(scheduling) > 0
    threads.spins = (spun + 1.0, 1)  # a spin found its core taken: someone else's thread
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 2)


def test_waits_of_a_process_alone_on_its_cores_keep_batch_until_another_process_comes() -> None:
    """A pinned worker waits behind its own long copies with little CPU in all (its core
    idle in between): batch stays while other processes leave that core alone."""
    threads = _Threads()
    threads.core_busy = {0: 50.0, 1: 80.0}
    scheduling = threads.scheduling()
    threads.cpu_share = 0.3  # below SELF_BUSY: the old guard gave batch up here
    for _ in range(5):
        threads.wake(100, wait_us=900)
        threads.check(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("batch", 0)
    threads.cores = {0, 1}  # not confined: the other CPU's use (say, the peer) counts
    threads.foreign_share = 0.5
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 1)
    threads.seconds_until_batch_again(scheduling)
    threads.cores = {0}  # confined again, but a busy process shares the core now
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 2)


def test_the_cpus_busy_time_and_the_process_cores_are_read_from_proc() -> None:
    busy = sched._read_core_busy()
    cores = sched._process_cores()
    if busy is None or cores is None:
        pytest.skip("no /proc/stat or /proc/self/task here")
    assert os.sched_getaffinity(0) <= cores and cores <= set(busy)
    assert all(seconds >= 0 for seconds in busy.values())
    later = sched._read_core_busy()
    assert later is not None and all(later[c] >= busy[c] for c in busy)


def test_quiet_intervals_are_not_judged_but_counted_on() -> None:
    threads = _Threads(tids=[11])
    scheduling = threads.scheduling()
    half = sched.MIN_WAKEUPS // 2
    threads.wake(half, wait_us=900)
    threads.check(scheduling)  # too few wake-ups to judge
    assert scheduling.policy == "batch"
    threads.wake(half, wait_us=900)
    threads.judge(scheduling)  # judged on both intervals together
    assert scheduling.policy == "default"


def test_quiet_checks_read_only_the_threads_waits_and_the_process_clock() -> None:
    """An idle worker's checks read one schedstat per thread and the process clock (cheap):
    the spins and /proc/stat only once a thread woke often enough to be judged."""
    threads = _Threads(tids=[11, 12])
    threads.core_busy = {0: 0.0}
    scheduling = threads.scheduling()
    threads.reads.clear()
    for _ in range(sched.MIN_WAKEUPS - 1):
        threads.wake(1, wait_us=10)
        threads.check(scheduling)
    assert threads.reads == ["cpu"] * (sched.MIN_WAKEUPS - 1)
    threads.reads.clear()
    threads.wake(1, wait_us=10, tids=[12])
    threads.check(scheduling)  # thread 12 is judged (and thread 11 keeps counting)
    assert sorted(threads.reads) == ["busy", "cpu", "cpu", "spins"]
    threads.reads.clear()
    threads.wake(1, wait_us=10, tids=[11])  # its 20th: judged on every wait since the start
    threads.check(scheduling)
    assert sorted(threads.reads) == ["busy", "cpu", "cpu", "spins"]
    assert scheduling.policy == "batch"


def test_a_window_begun_quiet_starts_again_when_the_process_turns_busy() -> None:
    """Idle beside a busy process, then a burst of its own work alone on its core: the
    burst's waits (behind its own threads) are judged on the burst, not on a window whose
    CPU use and foreign share are the idle stretch's (batch was lost there before)."""
    threads = _Threads(tids=[11])
    threads.core_busy = {0: 0.0}
    scheduling = threads.scheduling()
    threads.cpu_share, threads.foreign_share = 0.0, 0.9  # idle; another process runs
    for _ in range(sched.MIN_WAKEUPS // 2 - 1):  # the idle timer's wake-ups: not judged yet
        threads.wake(1, wait_us=10)
        threads.check(scheduling)
    threads.cpu_share, threads.foreign_share = 0.3, 0.0  # a burst of its own, alone
    for _ in range(5):
        threads.wake(100, wait_us=900)  # behind its own threads
        threads.check(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("batch", 0)
    threads.foreign_share = 0.5  # another process comes while it is busy: that loses
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 1)


def test_a_fallback_judged_while_quiet_is_retried_when_the_process_turns_busy() -> None:
    threads = _Threads(tids=[11])
    scheduling = threads.scheduling()
    threads.cpu_share = 0.0  # idle: the timer's wake-ups wait behind another process
    threads.check(scheduling)  # (turned quiet: the windows start here)
    for _ in range(sched.MIN_WAKEUPS):
        threads.wake(1, wait_us=900)
        threads.check(scheduling)
    threads.check(scheduling)  # the verdict stands: still quiet
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 1)
    threads.check(scheduling)  # still quiet: the back-off runs
    assert scheduling.policy == "default"
    threads.cpu_share = 0.5
    threads.check(scheduling)  # turned busy: batch again at once, judged on the burst
    assert scheduling.policy == "batch"
    threads.wake(100, wait_us=900)  # the other process is still there: lost while busy
    threads.judge(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 2)
    threads.cpu_share = 0.0
    threads.check(scheduling)
    threads.cpu_share = 0.5
    threads.check(scheduling)  # a busy fallback waits for its back-off
    assert scheduling.policy == "default"
    assert threads.seconds_until_batch_again(scheduling) > sched.CHECK_INTERVAL


def test_a_verdict_is_dropped_when_the_process_turns_quiet_before_the_next_check() -> None:
    """A window whose last interval straddles the end of a burst: its timer's waits behind
    the process that takes the core next, against the burst's CPU use, do not lose batch."""
    threads = _Threads(tids=[11])
    scheduling = threads.scheduling()
    threads.cpu_share = 0.5
    threads.wake(100, wait_us=900)
    threads.check(scheduling)  # lost on this window ...
    threads.cpu_share = 0.0
    threads.check(scheduling)  # ... but the process turned quiet: the verdict is dropped
    assert (scheduling.policy, scheduling.fallbacks) == ("batch", 0)
    for _ in range(sched.MIN_WAKEUPS):  # quiet windows are judged on their own
        threads.wake(1, wait_us=900)
        threads.check(scheduling)
    threads.check(scheduling)
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 1)


def test_thread_ids_may_come_as_any_iterable() -> None:
    threads = _Threads()
    scheduling = BatchScheduling(iter([11, 12]), True, threads.read_waits, threads.set_policy)
    assert scheduling.tids == [11, 12] and threads.batch == {11: True, 12: True}


def test_checks_between_intervals_do_nothing() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.wake(100, wait_us=900)
    scheduling.check()  # the same instant as the start: not judged yet
    assert scheduling.policy == "batch"


def test_a_thread_that_ended_is_dropped() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    del threads.waits[12]
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert scheduling.policy == "default" and scheduling.tids == [11]


def test_a_refused_policy_leaves_the_threads_alone_and_never_raises() -> None:
    threads = _Threads()
    threads.refuse = True
    scheduling = threads.scheduling()
    assert scheduling.policy == "unavailable" and threads.batch == {}
    threads.check(scheduling)
    assert scheduling.describe() == {"policy": "unavailable", "threads": 0, "fallbacks": 0}


def test_threads_whose_waits_cannot_be_read_are_left_alone() -> None:
    threads = _Threads()
    threads.waits = {11: [0, 0], 12: [5000, 3]}  # 11: schedstat counts nothing here
    scheduling = threads.scheduling()
    assert scheduling.tids == [12] and threads.batch == {12: True}
    threads.waits = {}
    scheduling = threads.scheduling()  # no schedstat at all: no unguarded batch
    assert scheduling.policy == "unavailable" and scheduling.tids == []


def test_disabled_scheduling_never_touches_the_threads() -> None:
    threads = _Threads()
    scheduling = threads.scheduling(enabled=False)
    threads.wake(100, wait_us=900)
    threads.check(scheduling)
    assert scheduling.policy == "off" and threads.batch == {} and scheduling.tids == []


def test_a_thread_added_later_joins_the_current_policy_and_its_waits_count_from_then() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.waits[13] = [5_000_000, 40]  # the agent's I/O thread: waits before it joined
    scheduling.add(13)
    assert scheduling.tids == [11, 12, 13] and threads.batch == {11: True, 12: True, 13: True}
    threads.wake(100, wait_us=10, tids=[13])  # judged on its own, the others quiet
    threads.check(scheduling)
    assert scheduling.policy == "batch"  # 10 µs per wake-up since it joined (not 5 ms / 40)
    threads.wake(100, wait_us=900, tids=[13])
    threads.judge(scheduling)
    assert scheduling.policy == "default" and threads.batch[13] is False


def test_a_thread_added_while_batch_lost_waits_for_the_retry() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert scheduling.policy == "default"
    threads.waits[13] = [0, 1]
    scheduling.add(13)
    assert threads.batch[13] is False
    assert threads.seconds_until_batch_again(scheduling) > 0 and threads.batch[13] is True


def test_an_added_thread_is_the_first_watched_when_no_other_was_found() -> None:
    threads = _Threads(tids=(13,))
    scheduling = BatchScheduling([], True, threads.read_waits, threads.set_policy,
                                 clock=lambda: threads.now, cpu_clock=lambda: threads.cpu)
    assert scheduling.policy == "unavailable"
    scheduling.add(13)
    assert scheduling.policy == "batch" and scheduling.tids == [13] and threads.batch == {13: True}


def test_each_thread_is_judged_on_its_own_waits() -> None:
    threads = _Threads(tids=(11,))  # libzmq's thread, behind a hog on its core
    scheduling = threads.scheduling()
    threads.waits[13] = [0, 1]  # the agent's, on another core, waking far more often
    scheduling.add(13)
    threads.wake(20, wait_us=1000, tids=[11])
    threads.wake(1000, wait_us=5, tids=[13])  # averaged together: ~24 µs per wake-up
    threads.judge(scheduling)
    assert scheduling.policy == "default" and threads.batch == {11: False, 13: False}


def test_the_agents_io_thread_is_judged_against_its_own_limit() -> None:
    libzmq = _Threads(tids=(11,))
    libzmq_scheduling = libzmq.scheduling()  # MAX_BATCH_WAIT, 50 µs
    agent = _Threads(tids=(13,))
    agent_scheduling = agent.scheduling(max_wait=sched.MAX_AGENT_IO_WAIT)  # 200 µs
    for threads, scheduling in ((libzmq, libzmq_scheduling), (agent, agent_scheduling)):
        threads.wake(100, wait_us=150)  # behind the threads of this process it must not preempt
        threads.judge(scheduling)
    assert libzmq_scheduling.policy == "default" and agent_scheduling.policy == "batch"


def test_a_rarely_woken_thread_is_judged_once_its_wake_ups_add_up() -> None:
    threads = _Threads(tids=(11,))
    scheduling = threads.scheduling()
    threads.waits[13] = [0, 1]
    scheduling.add(13)
    for _ in range(sched.MIN_WAKEUPS // 5 - 1):
        threads.wake(5, wait_us=1000, tids=[11])
        threads.wake(100, wait_us=5, tids=[13])  # judged (fine) at every check
        threads.check(scheduling)
        assert scheduling.policy == "batch"
    threads.wake(5, wait_us=1000, tids=[11])
    threads.judge(scheduling)
    assert scheduling.policy == "default"


def test_a_refusal_puts_the_threads_already_switched_back() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    assert threads.batch == {11: True, 12: True}
    threads.waits[13] = [0, 1]
    threads.refuse_tids = {13}
    scheduling.add(13)
    assert scheduling.policy == "unavailable" and scheduling.tids == []
    assert threads.batch == {11: False, 12: False}


def test_a_refusal_in_the_middle_of_a_switch_switches_no_further_thread() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert scheduling.policy == "default" and threads.batch == {11: False, 12: False}
    threads.refuse_tids = {11}  # the retry is refused for the first thread only
    for _ in range(int(sched.MIN_BACKOFF / sched.CHECK_INTERVAL) + 2):
        threads.check(scheduling)
    assert scheduling.policy == "unavailable" and scheduling.tids == []
    assert threads.batch == {11: False, 12: False}  # 12 is not left under batch, unwatched


def test_an_excused_wait_does_not_start_the_retries_over() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)  # lost: retried after MIN_BACKOFF, then after twice that
    assert threads.seconds_until_batch_again(scheduling) >= sched.MIN_BACKOFF
    threads.cpu_share = 1.0  # over the limit, but behind this process's own threads
    threads.wake(100, wait_us=900)
    threads.check(scheduling)
    assert scheduling.policy == "batch"
    threads.cpu_share = 0.2
    threads.wake(100, wait_us=900)
    threads.judge(scheduling)
    assert scheduling.policy == "default"
    assert threads.seconds_until_batch_again(scheduling) >= 2 * sched.MIN_BACKOFF


def test_no_thread_is_added_when_scheduling_is_off_refused_or_unwatchable() -> None:
    threads = _Threads()
    threads.waits[13] = [0, 1]
    off = threads.scheduling(enabled=False)
    off.add(13)
    assert off.policy == "off" and off.tids == [] and threads.batch == {}
    threads.refuse = True
    refused = threads.scheduling()
    threads.refuse = False  # even if a later change would be allowed: nothing is touched
    refused.add(13)
    assert refused.policy == "unavailable" and refused.tids == [] and threads.batch == {}
    unwatchable = threads.scheduling()
    threads.waits[14] = [0, 0]  # schedstat counts nothing for it
    unwatchable.add(14)
    assert unwatchable.tids == [11, 12, 13] and 14 not in threads.batch


# -- real threads -----------------------------------------------------------------------------


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@needs_batch
def test_a_transport_finds_its_own_io_threads_only() -> None:
    before = _thread_ids()
    first = Transport(b"0:first", secret="s", security="plain")
    second = Transport(b"1:second", secret="s", security="plain")
    unnamed = Transport(b"2:unnamed", secret="s", security="plain", name_threads=False)
    try:
        mine, theirs = first.io_thread_ids(), second.io_thread_ids()
        assert mine and theirs and not set(mine) & set(theirs)
        assert set(mine) | set(theirs) <= _thread_ids() - before
        for tid in theirs:
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii") as handle:
                assert handle.read().startswith(f"{second.thread_names}IO/")
        assert unnamed.io_thread_ids() == []
    finally:
        first.close()
        second.close()
        unnamed.close()


def _started_by_a_batch_thread(target: object) -> None:
    """Run ``target`` in a thread started by a thread under SCHED_BATCH; wait for both."""

    def parent() -> None:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        child = threading.Thread(target=target)  # type: ignore[arg-type]
        child.start()
        child.join(20)

    thread = threading.Thread(target=parent)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


@needs_batch
def test_a_thread_started_by_a_batch_thread_gives_the_inherited_policy_up() -> None:
    seen: dict[str, int] = {}

    def child() -> None:
        seen["inherited"] = os.sched_getscheduler(0)
        undo_inherited_batch()
        seen["after"] = os.sched_getscheduler(0)

    assert os.sched_getscheduler(os.getpid()) == os.SCHED_OTHER  # (the main thread's)
    _started_by_a_batch_thread(child)
    assert seen == {"inherited": os.SCHED_BATCH, "after": os.SCHED_OTHER}


@needs_batch
def test_pool_threads_grown_by_a_batch_thread_run_under_the_default_policy() -> None:
    pool = WorkerPool(2, "batch-test")
    policies: queue.SimpleQueue[int] = queue.SimpleQueue()
    # the agent's I/O thread grows the pool when it hands a request over
    _started_by_a_batch_thread(lambda: pool.submit(lambda: policies.put(os.sched_getscheduler(0))))
    try:
        assert policies.get(timeout=20) == os.SCHED_OTHER
    finally:
        pool.close()


@needs_batch
def test_real_threads_switch_policy() -> None:
    transport = Transport(b"0:real", secret="s", security="plain")
    try:
        scheduling = BatchScheduling(transport.io_thread_ids(), True)
        assert scheduling.tids and {_policy(t) for t in scheduling.tids} == {os.SCHED_BATCH}
        scheduling._switch(False)
        assert {_policy(t) for t in scheduling.tids} == {os.SCHED_OTHER}
        assert scheduling.policy == "default"
    finally:
        transport.close()


def test_no_thread_found_means_unavailable() -> None:
    assert BatchScheduling([], True).policy == "unavailable"


@needs_batch
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_io_threads_leave_batch_when_a_busy_process_shares_their_core() -> None:
    sender = Transport(b"0:sender", secret="s", security="plain")
    receiver = Transport(b"1:receiver", secret="s", security="plain")
    scheduling = BatchScheduling(receiver.io_thread_ids(), True)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cpu = sorted(os.sched_getaffinity(0))[0]
        os.sched_setaffinity(hog.pid, {cpu})
        for tid in scheduling.tids:
            os.sched_setaffinity(tid, {cpu})
        assert scheduling.policy == "batch"
        link = sender.link(b"1:receiver", receiver.endpoint)

        def fell_back() -> bool:
            link.send([b"H" * 20, b"ping"])
            assert receiver.receive(5.0), "a message did not arrive"
            scheduling.check()
            return scheduling.policy == "default"

        assert wait_until(fell_back, 30), scheduling.describe()
        assert scheduling.fallbacks == 1
        assert {_policy(t) for t in scheduling.tids} == {os.SCHED_OTHER}
    finally:
        hog.kill()
        hog.wait(10)
        sender.close()
        receiver.close()


@needs_batch
def test_a_workers_io_threads_run_batch_by_default(cluster: list[str]) -> None:
    stats = rpc.rpc_sync("worker1", rpc.get_worker_stats)
    for key in ("batch_scheduling", "io_thread_scheduling"):  # libzmq's, the agent's
        assert stats[key]["policy"] in ("batch", "default")  # default: it fell back under load
        assert stats[key]["threads"] == 1
    # the I/O thread follows its watched policy (read between two equal descriptions: the
    # guard may switch at any moment, setting the thread before it says so); the pool's
    # threads never run under batch, whoever started them
    readings: list[tuple[str, int, str, list[int]]] = []

    def consistent() -> bool:
        reading = rpc.rpc_sync("worker1", _agent_thread_policies)
        readings.append(reading)
        before, policy, after, pool_policies = reading
        return (before == after
                and policy == (os.SCHED_BATCH if before == "batch" else os.SCHED_OTHER))

    assert wait_until(consistent, 20), readings[-3:]
    assert readings[-1][3] and set(readings[-1][3]) == {os.SCHED_OTHER}


def _agent_thread_policies() -> tuple[str, int, str, list[int]]:
    """The I/O thread's watched policy, its scheduling policy, its watched policy again,
    and the policies of the pool's threads (run on a worker)."""
    import threading

    (thread,) = [t for t in threading.enumerate() if t.name.startswith("actorrpc-io-")]
    assert thread.native_id is not None
    pool = [t.native_id for t in threading.enumerate()
            if t.name.startswith("actorrpc-worker") and t.native_id is not None]
    before = rpc.get_worker_stats()["io_thread_scheduling"]["policy"]
    policy = os.sched_getscheduler(thread.native_id)
    after = rpc.get_worker_stats()["io_thread_scheduling"]["policy"]
    return before, policy, after, [os.sched_getscheduler(tid) for tid in pool]
