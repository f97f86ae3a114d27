"""The ZeroMQ transport alone: framing, batching, wake-ups; and per-peer flow credits."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from actorrpc.agent._calls import FlowCredits
from actorrpc.transport import Transport
from actorrpc.transport._zmq import _RECV_BATCH

from ._waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def _receive(
    receiver: Transport, count: int, deadline_s: float = 20.0, busy: bool = False
) -> list[list[object]]:
    """``count`` messages (fewer if the deadline passes); ``busy``: each receive polls first."""
    messages: list[list[object]] = []
    deadline = time.monotonic() + deadline_s
    while len(messages) < count and time.monotonic() < deadline:
        messages.extend(receiver.receive(0.5, time.monotonic() + 0.5 if busy else 0.0))
    return messages



def _in_this_thread(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` as the transport's yield for the calling (test) thread only: other threads
    of this process (a group's I/O thread polls in a flow of messages) yield as usual."""
    me = threading.get_ident()

    def sched_yield() -> None:
        if threading.get_ident() == me:
            fn()
        else:
            os.sched_yield()

    return sched_yield

def test_messages_keep_order_and_framing_across_receive_batches(pair) -> None:
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)
    big = memoryview(bytes(range(256)) * 400)  # 100 KiB: sent zero-copy
    count = 3 * _RECV_BATCH + 7
    for i in range(count):
        frames = [b"H" * 20, b"%d" % i]
        if i % 100 == 0:
            frames.append(big)
        link.send(frames)
    messages = _receive(receiver, count)
    assert len(messages) == count
    for i, message in enumerate(messages):
        identity, header, *rest = message
        assert identity == b"0:sender"
        assert header == b"H" * 20
        assert bytes(rest[0].buffer) == b"%d" % i  # type: ignore[attr-defined]
        assert len(rest) == (2 if i % 100 == 0 else 1)
        if i % 100 == 0:
            assert bytes(rest[1].buffer) == bytes(big)  # type: ignore[attr-defined]


def test_wake_returns_without_a_message(pair) -> None:
    _, receiver = pair
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(receiver.receive(30.0)))
    thread.start()
    receiver.wake()
    thread.join(10)
    assert not thread.is_alive()
    assert result == [[]]


def test_flow_credits_block_at_the_limit_until_one_is_given_back() -> None:
    credits = FlowCredits(2)
    assert credits.take(None) and credits.take(None)
    assert credits.in_flight == 2
    assert credits.take(0.05) is False  # full: times out
    taken = threading.Event()
    thread = threading.Thread(target=lambda: credits.take(30.0) and taken.set())
    thread.start()
    assert not taken.wait(0.05)
    credits.give_back()
    thread.join(10)
    assert taken.is_set()
    assert credits.in_flight == 2
    credits.give_back()
    credits.give_back()
    assert credits.in_flight == 0


def test_flow_credits_wake_every_waiter_a_credit_is_given_back_for() -> None:
    credits = FlowCredits(3)
    for _ in range(3):
        assert credits.take(None)
    woken = threading.Semaphore(0)

    def wait_for_credit() -> None:
        if credits.take(30.0):
            woken.release()

    threads = [threading.Thread(target=wait_for_credit) for _ in range(3)]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: credits._waiting == 3, 10)  # all three blocked at the limit
    for _ in range(3):  # given back in a burst, before any waiter runs
        credits.give_back()
    for _ in range(3):
        assert woken.acquire(timeout=10)
    for thread in threads:
        thread.join(10)
    assert credits.in_flight == 3


def test_a_busy_poll_finds_a_message_sent_meanwhile_without_blocking(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    sender, receiver = pair
    yields: list[int] = []
    sent = threading.Event()
    link = sender.link(b"1:receiver", receiver.endpoint)
    link.send([b"H" * 20, b"warm-up"])  # the connection is up
    assert len(_receive(receiver, 1)) == 1

    def poll_then_send() -> None:
        # the message goes out only once the receiver has polled (yielded) a few times
        yields.append(1)
        if len(yields) == 3:
            link.send([b"H" * 20, b"during the busy poll"])
            sent.set()

    monkeypatch.setattr(_zmq, "_sched_yield", _in_this_thread(poll_then_send))
    monkeypatch.setattr(_zmq, "_LONG_YIELD_SECONDS", 30.0)  # (the send in a yield is slow)
    # a blocking receive of 30 s would fail the test's timeout if the poll missed it
    messages = receiver.receive(30.0, busy_until=time.monotonic() + 30.0)
    assert sent.is_set() and len(yields) >= 3
    assert [bytes(m[2].buffer) for m in messages] == [b"during the busy poll"]  # type: ignore[attr-defined]
    assert (receiver.busy_poll_hits, receiver.busy_poll_misses) == (1, 0)


def test_a_busy_poll_that_finds_nothing_blocks_as_usual(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    _, receiver = pair
    monkeypatch.setattr(
        _zmq, "_sched_yield", _in_this_thread(lambda: pytest.fail("polled past busy_until"))
    )
    monkeypatch.setattr(_zmq, "_LONG_YIELD_SECONDS", 30.0)  # (a preempted poll is no pause here)
    started = time.monotonic()
    assert receiver.receive(0.05, busy_until=started - 1.0) == []  # nothing came: timed out
    assert time.monotonic() - started >= 0.04
    assert receiver.receive(0.01) == []  # busy_until 0: no poll at all
    assert (receiver.busy_poll_hits, receiver.busy_poll_misses) == (0, 0)
    yields: list[int] = []
    monkeypatch.setattr(_zmq, "_sched_yield", _in_this_thread(lambda: yields.append(1)))
    # nothing comes within the poll (30 ms: room to be preempted): a miss, then it blocks
    assert receiver.receive(0.05, busy_until=time.monotonic() + 0.03) == []
    assert yields and (receiver.busy_poll_hits, receiver.busy_poll_misses) == (0, 1)
    # a poll longer than the receive's timeout ends with the timeout
    started = time.monotonic()
    assert receiver.receive(0.05, busy_until=started + 30.0) == []
    assert time.monotonic() - started < 10.0 and receiver.busy_poll_misses == 2


def test_a_poll_that_does_not_watch_contention_leaves_the_turns_statistics_alone(pair) -> None:
    """The I/O thread's polls (``watch_contention=False``) neither count as the turns'
    hits and misses nor reset the turns' contention pause."""
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)
    link.send([b"H" * 20, b"warm-up"])
    assert len(_receive(receiver, 1)) == 1
    receiver._contended_pause = 0.64
    hits, misses = receiver.busy_poll_hits, receiver.busy_poll_misses
    link.send([b"H" * 20, b"polled"])
    messages: list[Any] = []
    deadline = time.monotonic() + 10.0
    while not messages and time.monotonic() < deadline:
        messages = receiver.receive(0.05, time.monotonic() + 0.0002, False)
    assert messages
    assert receiver.receive(0.01, time.monotonic() + 0.0002, False) == []  # a miss
    assert (receiver.busy_poll_hits, receiver.busy_poll_misses) == (hits, misses)
    assert receiver._contended_pause == 0.64


def test_a_yield_that_gives_the_core_away_stops_polling_for_a_while(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    _, receiver = pair
    yields: list[int] = []

    def slow_yield() -> None:  # as if another process's busy thread took the time slice
        yields.append(1)
        time.sleep(0.002)

    monkeypatch.setattr(_zmq, "_sched_yield", _in_this_thread(slow_yield))
    monkeypatch.setattr(_zmq, "_MIN_CONTENDED_PAUSE_SECONDS", 30.0)  # (the test's pace)
    monkeypatch.setattr(_zmq, "_MAX_CONTENDED_PAUSE_SECONDS", 100.0)
    monkeypatch.setattr(receiver, "_contended_pause", 30.0)
    assert receiver.receive(0.05, busy_until=time.monotonic() + 30.0) == []
    assert len(yields) == 1  # given up after the first long yield, then blocked
    assert (receiver.busy_poll_misses, receiver.busy_poll_contended) == (1, 1)
    assert receiver.receive(0.01, busy_until=time.monotonic() + 30.0) == []
    assert len(yields) == 1 and receiver.busy_poll_misses == 1  # no poll meanwhile
    assert receiver._contended_pause == 60.0  # the next pause doubles
    monkeypatch.setattr(receiver, "_no_poll_until", 0.0)  # the pause is over
    assert receiver.receive(0.01, busy_until=time.monotonic() + 30.0) == []
    assert len(yields) == 2 and receiver.busy_poll_contended == 2
    assert receiver._contended_pause == 100.0  # doubled again, up to the maximum
    # a poll that finds a message starts the pauses again from the minimum
    monkeypatch.setattr(receiver, "_no_poll_until", 0.0)
    monkeypatch.setattr(_zmq, "_sched_yield", _in_this_thread(lambda: None))
    monkeypatch.setattr(_zmq, "_LONG_YIELD_SECONDS", 30.0)  # (a preempted poll is no pause here)
    sender, _ = pair
    sender.link(b"1:receiver", receiver.endpoint).send([b"H" * 20, b"x"])
    assert len(_receive(receiver, 1, busy=True)) == 1
    assert receiver._contended_pause == 30.0  # back to the minimum


@pytest.mark.parametrize("gated", [True, False])
def test_the_inbox_socket_is_asked_only_when_its_fd_signals(
    pair, monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    from actorrpc.transport import _link, _zmq

    sender, receiver = pair
    monkeypatch.setattr(_zmq, "_FD_GATED_EVENTS", gated)
    monkeypatch.setattr(_link, "_SEND_THROUGH_RINGS", False)  # every message by socket
    link = sender.link(b"1:receiver", receiver.endpoint)
    link.send([b"H" * 20, b"warm-up"])  # the connection is up
    assert len(_receive(receiver, 1)) == 1
    asked: list[int] = []
    real_get = _zmq._socket_get

    def counting_get(socket: Any, option: int) -> Any:
        if socket is receiver._inbox:
            asked.append(option)
        return real_get(socket, option)

    monkeypatch.setattr(_zmq, "_socket_get", counting_get)
    assert receiver._socket_has_message() is False  # asked once: nothing there
    before = len(asked)
    for _ in range(5):
        assert receiver._socket_has_message() is False
    # gated: the answer stands until the FD signals; ungated: asked every time
    assert len(asked) - before == (0 if gated else 5)
    link.send([b"H" * 20, b"later"])
    # the message signals the FD: the next look asks, and finds it
    assert wait_until(receiver._socket_has_message, 10)
    messages = _receive(receiver, 1)
    assert [bytes(m[2].buffer) for m in messages] == [b"later"]  # type: ignore[attr-defined]
    assert receiver._socket_has_message() is False


def test_bursts_from_many_threads_all_arrive_through_busy_polls(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every look at the socket goes through the FD gate here (short busy polls, receives
    # that never block for long): a lost FD signal would leave messages behind
    from actorrpc.transport import _link

    monkeypatch.setattr(_link, "_SEND_THROUGH_RINGS", False)  # every message by socket
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)
    per_thread, threads = 400, 4
    lock = threading.Lock()
    received_per_tag = [0] * threads

    def send_bursts(tag: int) -> None:
        for i in range(per_thread):
            with lock:  # (one link: its socket is used by one thread at a time)
                link.send([b"H" * 20, b"%d:%d" % (tag, i)])
            if i % 50 == 49:  # the receiver has this burst before the next: it finds none
                wait_until(lambda i=i: received_per_tag[tag] > i, 20)

    workers = [threading.Thread(target=send_bursts, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    received: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(received) < per_thread * threads and time.monotonic() < deadline:
        for message in receiver.receive(0.002, time.monotonic() + 0.001):
            payload = bytes(message[2].buffer)  # type: ignore[attr-defined]
            received.append(payload)
            received_per_tag[int(payload.split(b":")[0])] += 1
    for worker in workers:
        worker.join(10)
    assert len(received) == per_thread * threads
    for tag in range(threads):  # each thread's messages in its order
        mine = [r for r in received if r.startswith(b"%d:" % tag)]
        assert mine == [b"%d:%d" % (tag, i) for i in range(per_thread)]
