"""libzmq's I/O threads under SCHED_BATCH, and the fallback when batch scheduling loses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

from actorrpc.transport import Transport
from actorrpc.transport import _io_threads as io
from actorrpc.transport._io_threads import IoThreadScheduling

from ._waiting import wait_until

pytestmark = pytest.mark.timeout(60)

needs_batch = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
    reason="needs Linux's SCHED_BATCH and /proc",
)


class _Threads:
    """Fake threads: run-queue waits the test sets, policies the scheduling sets."""

    def __init__(self) -> None:
        self.waited_ns = 0
        self.slices = 0
        self.policies: list[bool] = []  # True: batch
        self.refuse = False
        self.now = 100.0

    def wake(self, times: int, wait_us: float) -> None:
        self.slices += times
        self.waited_ns += int(times * wait_us * 1000)

    def read_waits(self, tids: Sequence[int]) -> tuple[int, int]:
        return self.waited_ns, self.slices

    def set_policy(self, tids: Sequence[int], batch: bool) -> None:
        if self.refuse:
            raise PermissionError("sched_setscheduler refused")
        self.policies.append(batch)

    def scheduling(self, enabled: bool = True) -> IoThreadScheduling:
        return IoThreadScheduling(
            [123], enabled, self.read_waits, self.set_policy, clock=lambda: self.now
        )

    def next_check(self) -> None:
        self.now += io.CHECK_INTERVAL


def test_batch_is_kept_while_the_threads_hardly_wait() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    assert (scheduling.policy, threads.policies) == ("batch", [True])
    for _ in range(10):
        threads.wake(500, wait_us=5)
        threads.next_check()
        scheduling.check()
    assert (scheduling.policy, threads.policies, scheduling.fallbacks) == ("batch", [True], 0)


def test_batch_is_given_up_when_the_threads_wait_and_retried_after_a_doubling_backoff() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.wake(100, wait_us=900)  # a thread that never yields shares the core
    threads.next_check()
    scheduling.check()
    assert (scheduling.policy, threads.policies[-1], scheduling.fallbacks) == ("default", False, 1)
    # no retry before the back-off (MIN_BACKOFF) has passed
    while threads.now + io.CHECK_INTERVAL < 100.0 + io.CHECK_INTERVAL + io.MIN_BACKOFF:
        threads.next_check()
        scheduling.check()
        assert scheduling.policy == "default"
    threads.next_check()
    scheduling.check()
    assert scheduling.policy == "batch"
    retried_at = threads.now
    threads.wake(100, wait_us=900)  # still losing: the next back-off is twice as long
    threads.next_check()
    scheduling.check()
    assert (scheduling.policy, scheduling.fallbacks) == ("default", 2)
    while scheduling.policy == "default":
        threads.next_check()
        scheduling.check()
    assert threads.now - retried_at >= 2 * io.MIN_BACKOFF
    threads.wake(100, wait_us=5)  # the other thread left: batch stays, back-off resets
    threads.next_check()
    scheduling.check()
    assert scheduling.policy == "batch" and scheduling._backoff == io.MIN_BACKOFF


def test_quiet_intervals_are_not_judged_but_counted_on() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    for _ in range(3):  # 3 x 10 wake-ups: each check alone has too few to judge
        threads.wake(io.MIN_WAKEUPS // 2, wait_us=900)
        threads.next_check()
        scheduling.check()
        if scheduling.policy == "default":
            break
    assert scheduling.policy == "default"  # judged once 20 had accumulated
    assert threads.slices == 2 * (io.MIN_WAKEUPS // 2)


def test_checks_between_intervals_do_nothing() -> None:
    threads = _Threads()
    scheduling = threads.scheduling()
    threads.wake(100, wait_us=900)
    scheduling.check()  # same instant as the start: not judged yet
    assert scheduling.policy == "batch"


def test_a_refused_policy_leaves_the_threads_alone_and_never_raises() -> None:
    threads = _Threads()
    threads.refuse = True
    scheduling = threads.scheduling()
    assert scheduling.policy == "unavailable" and threads.policies == []
    threads.next_check()
    scheduling.check()
    assert scheduling.describe() == {"policy": "unavailable", "fallbacks": 0}


def test_disabled_scheduling_never_touches_the_threads() -> None:
    threads = _Threads()
    scheduling = threads.scheduling(enabled=False)
    threads.wake(100, wait_us=900)
    threads.next_check()
    scheduling.check()
    assert scheduling.policy == "off" and threads.policies == []


# -- real libzmq threads ----------------------------------------------------------------------


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@needs_batch
@pytest.mark.parametrize("batch", [True, False])
def test_a_transports_own_io_threads_get_the_policy(batch: bool) -> None:
    before = _thread_ids()
    first = Transport(b"0:first", secret="s", security="plain", batch_io_threads=batch)
    started = _thread_ids() - before
    second = Transport(b"1:second", secret="s", security="plain", batch_io_threads=True)
    try:
        if batch:
            assert first.io_threads.tids and first.io_threads.policy == "batch"
            assert set(first.io_threads.tids) <= started
            assert {_policy(t) for t in first.io_threads.tids} == {os.SCHED_BATCH}
        else:
            assert first.io_threads.policy == "off" and first.io_threads.tids == []
            assert started and {_policy(t) for t in started} == {os.SCHED_OTHER}
        assert second.io_threads.policy == "batch"
        assert not set(first.io_threads.tids) & set(second.io_threads.tids)
        for tid in second.io_threads.tids:
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii") as handle:
                assert handle.read().startswith(f"{second.thread_names}IO/")
    finally:
        first.close()
        second.close()


@needs_batch
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_io_threads_leave_batch_when_a_busy_process_shares_their_core() -> None:
    sender = Transport(b"0:sender", secret="s", security="plain")
    receiver = Transport(b"1:receiver", secret="s", security="plain")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cpu = sorted(os.sched_getaffinity(0))[0]
        os.sched_setaffinity(hog.pid, {cpu})
        for tid in receiver.io_threads.tids:
            os.sched_setaffinity(tid, {cpu})
        assert receiver.io_threads.policy == "batch"
        link = sender.link(b"1:receiver", receiver.endpoint)

        def fell_back() -> bool:
            link.send([b"H" * 20, b"ping"])
            assert receiver.receive(5.0), "a message did not arrive"
            receiver.io_threads.check()
            return receiver.io_threads.policy == "default"

        assert wait_until(fell_back, 30), receiver.io_threads.describe()
        assert receiver.io_threads.fallbacks == 1
        assert {_policy(t) for t in receiver.io_threads.tids} == {os.SCHED_OTHER}
    finally:
        hog.kill()
        hog.wait(10)
        sender.close()
        receiver.close()
