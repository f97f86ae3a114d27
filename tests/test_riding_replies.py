"""Replies that ride on the next message to their caller (agent/_riders.py, ``add_reply``).

A pool thread that answers one of a burst of requests while another request of
the same caller waits lets its small reply ride on the next message to that
caller. The unit tests drive :class:`Riders` with a stub agent (when a queued
reply leaves, and who sends it); the others run on the session ``cluster``
(worker0 = this process): bursts of ``rpc_async`` calls get their own values,
and a request that runs long never holds back the replies queued before it.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

import actorrpc as rpc
from actorrpc.agent._pool import WorkerPool
from actorrpc.agent._riders import REPLY_DELAY, RIDER_DELAY, Riders
from actorrpc.protocol import MessageKind, decode_riders

from ._waiting import wait_for, wait_until

WAIT = 20.0


class _StubAgent:
    """What Riders uses of an agent: membership, liveness, its notification send and
    the I/O thread's wake-up."""

    def __init__(self) -> None:
        self.carriers: list[int] = []  # ranks a PING carrier went to
        self.wake_requests: list[float] = []
        self.warnings: list[str] = []
        self.liveness = SimpleNamespace(dead_peers={})
        self.inbox = SimpleNamespace(wake_io_by=lambda when, _: self.wake_requests.append(when))
        self.riders: Riders | None = None

    def wake_inbox(self) -> None:
        pass

    def is_member(self, rank: int) -> bool:
        return rank in (1, 2)

    def warn(self, what: str) -> None:
        self.warnings.append(what)

    def send_notification(self, rank: int, kind: MessageKind, payload: Any) -> None:
        assert kind == MessageKind.PING and self.riders is not None
        self.riders.take(rank)  # a carrier takes everything queued for its worker along
        self.carriers.append(rank)


def _riders() -> tuple[_StubAgent, Riders]:
    agent = _StubAgent()
    agent.riders = Riders(agent)  # type: ignore[arg-type]
    return agent, agent.riders


def test_a_queued_reply_is_due_after_reply_delay_and_the_io_thread_is_told() -> None:
    agent, riders = _riders()
    before = time.monotonic()
    riders.add_reply(1, 42, b"reply")
    due = agent.wake_requests[-1]
    assert before + REPLY_DELAY <= due <= time.monotonic() + REPLY_DELAY
    assert 0 < riders.seconds_to_due(time.monotonic()) <= REPLY_DELAY  # type: ignore[operator]
    riders.flush()  # not due yet
    assert agent.carriers == [] and riders.pending
    riders.add_reply(1, 43, b"later")  # not earlier than what is queued: no second wake-up
    assert len(agent.wake_requests) == 1
    wait_until(lambda: time.monotonic() >= due, 1.0)
    riders.flush()
    assert agent.carriers == [1] and not riders.pending
    assert riders.seconds_to_due(time.monotonic()) is None
    assert riders.describe()["replies_deferred"] == 2


def test_a_reply_makes_queued_notifications_leave_sooner() -> None:
    agent, riders = _riders()
    riders.add(2, MessageKind.RREF_USER_DELETE, (1, 2))
    assert riders.seconds_to_due(time.monotonic()) > REPLY_DELAY  # type: ignore[operator]
    assert agent.wake_requests == []  # a notification alone waits for the timed work
    riders.add_reply(2, 9, b"x")
    assert riders.seconds_to_due(time.monotonic()) <= REPLY_DELAY  # type: ignore[operator]
    assert RIDER_DELAY > REPLY_DELAY


def test_replies_ride_as_pickled_with_their_message_ids_in_order() -> None:
    _, riders = _riders()
    riders.add(1, MessageKind.SHM_RELEASE, ("segment",))
    riders.add_reply(1, 7, b"\x80\x05N.")
    riders.add_reply(1, 8, b"\x80\x05K\x01.")
    decoded = decode_riders(riders.encode(riders.take(1)))
    assert [(kind, message_id) for kind, message_id, _ in decoded] == [
        (MessageKind.SHM_RELEASE, 0), (MessageKind.RESPONSE, 7), (MessageKind.RESPONSE, 8)
    ]
    assert bytes(decoded[1][2]) == b"\x80\x05N." and bytes(decoded[2][2]) == b"\x80\x05K\x01."
    assert riders.take(1) == []


def test_a_thread_settles_only_the_replies_it_queued_and_still_queued() -> None:
    agent, riders = _riders()
    riders.add_reply(1, 1, b"a")
    riders.add_reply(2, 2, b"b")
    other = threading.Thread(target=riders.add_reply, args=(2, 3, b"c"))
    other.start()
    other.join()
    riders.take(2)  # a message to worker 2 took its replies along meanwhile
    assert riders.owes()
    riders.settle_owed()
    assert agent.carriers == [1]  # worker 2's went already; the other thread's are its own
    assert not riders.owes()
    riders.settle_owed()
    assert agent.carriers == [1]


def test_a_reply_put_back_keeps_its_short_delay() -> None:
    _, riders = _riders()
    riders.add_reply(1, 5, b"r")
    queued = riders.take(1)
    riders.put_back(1, queued)
    assert riders.seconds_to_due(time.monotonic()) <= REPLY_DELAY  # type: ignore[operator]
    assert riders.take(1) == queued


def test_replies_to_a_worker_that_left_are_dropped_with_no_send() -> None:
    agent, riders = _riders()
    riders.add_reply(3, 1, b"r")  # rank 3 is no member
    riders.settle_owed()
    assert agent.carriers == [] and not riders.pending


def test_a_pool_thread_runs_before_wait_before_it_blocks_on_an_empty_queue() -> None:
    waits: list[bool] = []
    ran = threading.Event()
    pool = WorkerPool(2, "riding-test", before_wait=lambda: waits.append(pool.on_pool_thread()))
    try:
        assert not pool.on_pool_thread()
        pool.submit(ran.set)
        assert ran.wait(WAIT)
        assert wait_until(lambda: waits, WAIT)  # the queue is empty after the task
        assert all(waits)
    finally:
        pool.close()


# --- end to end, on the session cluster ---------------------------------------------------


def plus_one(value: int) -> int:
    return value + 1


def _replies_deferred(worker: str) -> int:
    return int(rpc.get_worker_stats(worker)["notifications"]["replies_deferred"])


@pytest.mark.usefixtures("cluster")
def test_bursts_of_calls_get_their_own_replies_some_riding() -> None:
    before = _replies_deferred("worker1")

    def burst_rode() -> bool:
        futures = [rpc.rpc_async("worker1", plus_one, args=(i,)) for i in range(300)]
        assert [future.wait() for future in futures] == [i + 1 for i in range(300)]
        return _replies_deferred("worker1") > before

    wait_for(burst_rode, WAIT, "a reply riding on a later message in a burst of calls")


@pytest.mark.usefixtures("cluster")
def test_a_request_that_runs_long_does_not_hold_back_replies_queued_before_it() -> None:
    # the reply to ``fast`` may be queued to ride (``slow`` waits), and its thread may be
    # the one that goes on to run ``slow``: the I/O thread then sends it
    for _ in range(8):
        fast = rpc.rpc_async("worker2", plus_one, args=(1,))
        slow = rpc.rpc_async("worker2", time.sleep, args=(0.5,))
        assert fast.wait() == 2
        assert not slow.done(), "a reply waited for the request after it"
        slow.wait()
