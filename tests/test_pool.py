"""Unit tests of the worker pool (``actorrpc.agent._pool``): tasks queued behind a running
one go on in the same thread, counted busy; ``before_wait`` runs once the queue is empty;
``close`` stops every thread, also one that took another's stop after a task."""

from __future__ import annotations

import threading

from actorrpc.agent._pool import WorkerPool

from ._waiting import wait_until


class _CountedLock:
    """The pool's lock, counting how often it is taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0

    def __enter__(self) -> bool:
        self.taken += 1
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)


def test_queued_tasks_run_on_in_the_thread_that_finds_them_counted_busy() -> None:
    events: list[tuple[str, int, int]] = []  # (what, thread, busy count)
    pool = WorkerPool(1, "pool-test", before_wait=lambda: events.append(
        ("before_wait", threading.get_ident(), pool.busy)))
    lock = pool._lock = _CountedLock()  # type: ignore[assignment]

    def task(name: str, then: list[str]) -> None:
        events.append((name, threading.get_ident(), pool.busy))
        for queued in then:  # queued while this one runs: the queue is not empty after it
            pool.submit(task, queued, [])

    try:
        pool.submit(task, "first", ["second", "third"])
        assert wait_until(lambda: ("third" in [e[0] for e in events]
                                   and events[-1][0] == "before_wait" and pool.busy == 0), 10)
        ran = [e for e in events if e[0] != "before_wait"]
        assert [e[0] for e in ran] == ["first", "second", "third"]
        assert {e[1] for e in ran} == {ran[0][1]} and {e[2] for e in ran} == {1}
        # not between tasks: only once the queue was empty (after "third"), busy and idle
        after = [e for e in events[events.index(ran[-1]):] if e[0] == "before_wait"]
        assert after and after[0][2] == 1
        assert all(e[0] != "before_wait" for e in events[events.index(ran[0]):
                                                        events.index(ran[-1])])
        # the thread's start, idle to busy once, busy to idle once: not twice per task,
        # nor once per task submitted while it runs (it cannot grow past one thread)
        assert lock.taken == 3
    finally:
        pool.close()


def test_close_stops_a_thread_that_took_a_stop_meant_for_another() -> None:
    """Both threads are busy when ``close`` queues one stop each: the first to finish takes a
    stop as its next task, and must leave it for the queue's order, not lose it."""
    release = threading.Event()
    running: list[int] = []

    def blocked() -> None:
        running.append(threading.get_ident())
        release.wait(10)

    pool = WorkerPool(2, "pool-test")
    pool.submit(blocked)
    assert wait_until(lambda: len(running) == 1, 10)
    pool.submit(blocked)  # the second thread starts once the first stalled (STALL_SECONDS)
    assert wait_until(lambda: pool.maintain() or len(running) == 2, 10)
    assert pool.size == 2
    closing = threading.Thread(target=pool.close, args=(10.0,))
    closing.start()
    assert wait_until(lambda: pool.queued() == 2, 10)  # one stop per thread, both queued
    release.set()
    closing.join(15)
    assert not closing.is_alive()
    assert not any(t.is_alive() for t in pool._threads), "a pool thread did not stop"
