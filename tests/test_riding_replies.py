"""Replies that ride on the next message to their caller (agent/_riders.py, ``add_reply``).

A pool thread that answers one of a burst of requests while another request of
the same caller waits lets its small reply ride on the next message to that
caller. The unit tests drive :class:`Riders` with a stub agent (when a queued
reply leaves, and who sends it); the others run on the session ``cluster``
(worker0 = this process): bursts of ``rpc_async`` calls get their own values,
and a request that runs long never holds back the replies queued before it.
"""

from __future__ import annotations

import collections
import json
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import actorrpc as rpc
from actorrpc.agent._pool import WorkerPool
from actorrpc.agent._riders import REPLY_BATCH, REPLY_DELAY, RIDER_DELAY, Riders
from actorrpc.agent._timed_work import QuietWatch
from actorrpc.protocol import MessageKind, decode_riders

from ._cluster import run_script
from ._waiting import wait_for, wait_until

pytestmark = pytest.mark.internals  # (stand-ins for the agent)

WAIT = 20.0


class _StubAgent:
    """What Riders uses of an agent: membership, liveness, its notification send and
    the I/O thread's wake-up."""

    def __init__(self) -> None:
        self.carriers: list[int] = []  # ranks a PING carrier went to
        self.wake_requests: list[float] = []
        self.warnings: list[str] = []
        self.liveness = SimpleNamespace(dead_peers={})
        self.stats = SimpleNamespace(bytes_out=collections.Counter())
        self.inbox = SimpleNamespace(wake_io_by=lambda when, _: self.wake_requests.append(when))
        self.riders: Riders | None = None
        self.quiet = QuietWatch(nudge=self._nudge)
        self.nudges = 0

    def _nudge(self) -> None:
        self.nudges += 1

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
    riders.flush(now=due - 1e-4)  # not due yet
    assert agent.carriers == [] and riders.queued
    riders.add_reply(1, 43, b"later")  # not earlier than what is queued: no second wake-up
    assert len(agent.wake_requests) == 1
    riders.flush(now=due)
    assert agent.carriers == [1] and not riders.queued
    assert riders.seconds_to_due(time.monotonic()) is None
    assert riders.describe()["replies_deferred"] == 2


def test_a_notification_nudges_the_io_thread_only_while_it_waits_quietly() -> None:
    agent, riders = _riders()
    riders.add(2, MessageKind.RREF_USER_DELETE, (1, 2))
    assert agent.nudges == 0  # it looks at its timed work every 50 ms anyway
    agent.quiet.waiting = True  # (``_timed_work.QuietWatch``: it may wait a second)
    riders.add(2, MessageKind.RREF_USER_DELETE, (3, 4))
    assert agent.nudges == 1


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


def test_a_full_batch_of_replies_leaves_at_once_for_its_caller_only() -> None:
    """REPLY_BATCH replies queued for one caller go together, at once (the caller works
    through them while the burst goes on); another caller's stay queued."""
    agent, riders = _riders()
    riders.add_reply(2, 1000, b"other")
    for message_id in range(1, REPLY_BATCH):
        riders.add_reply(1, message_id, b"r")
    assert agent.carriers == [] and len(riders.queued[1]) == REPLY_BATCH - 1
    riders.add_reply(1, REPLY_BATCH, b"r")  # the batch is full
    assert agent.carriers == [1] and 1 not in riders.queued
    assert [m for _, m, _ in riders.queued[2]] == [1000]
    riders.add_reply(1, REPLY_BATCH + 1, b"r")  # a new batch begins
    assert agent.carriers == [1] and len(riders.queued[1]) == 1
    riders.settle_owed()  # what is left goes when the thread runs out of work
    assert sorted(agent.carriers) == [1, 1, 2] and not riders.queued


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
    assert agent.carriers == [] and not riders.queued


def _batching(monkeypatch: pytest.MonkeyPatch) -> tuple[_StubAgent, Riders, list[float]]:
    """Riders batching RRef deletes, on a clock the test moves."""
    from actorrpc.agent import _riders as riders_module

    clock = [100.0]
    monkeypatch.setattr(riders_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    agent, riders = _riders()
    riders.batch_kind(MessageKind.RREF_USER_DELETE)
    return agent, riders, clock


_DELETE = int(MessageKind.RREF_USER_DELETE)


def test_batched_notifications_wait_until_a_batch_is_full(monkeypatch) -> None:
    from actorrpc.agent._riders import BATCH_SIZE

    agent, riders, _ = _batching(monkeypatch)
    for i in range(BATCH_SIZE - 1):
        riders.add(1, MessageKind.RREF_USER_DELETE, (i,))
    assert not riders.queued and len(riders.waiting[1]) == BATCH_SIZE - 1
    assert riders.take(1) == []  # a message to worker 1 takes none along
    assert riders.describe()["queued"] == BATCH_SIZE - 1
    riders.add(2, MessageKind.RREF_USER_DELETE, ("other",))  # another worker's batch
    riders.add(1, MessageKind.RREF_USER_DELETE, (BATCH_SIZE - 1,))
    assert riders.take(1) == [(_DELETE, 0, (i,)) for i in range(BATCH_SIZE)]
    assert 1 not in riders.waiting and riders.waiting[2] == [(_DELETE, 0, ("other",))]
    assert agent.carriers == [] and agent.wake_requests == []


def test_a_batched_notification_added_batch_age_after_the_oldest_makes_them_ride(
    monkeypatch,
) -> None:
    from actorrpc.agent._riders import BATCH_AGE

    _, riders, clock = _batching(monkeypatch)
    riders.add(1, MessageKind.RREF_USER_DELETE, ("a",))
    clock[0] += BATCH_AGE / 2
    riders.add(1, MessageKind.RREF_USER_DELETE, ("b",))
    assert riders.take(1) == []
    clock[0] += BATCH_AGE / 2
    riders.add(1, MessageKind.RREF_USER_DELETE, ("c",))
    assert [entry[2] for entry in riders.take(1)] == [("a",), ("b",), ("c",)]
    clock[0] += BATCH_AGE * 10
    riders.add(1, MessageKind.RREF_USER_DELETE, ("d",))  # a new batch begins
    assert riders.take(1) == [] and riders.waiting[1] == [(_DELETE, 0, ("d",))]


def test_waiting_notifications_ride_before_anything_queued_after_them(monkeypatch) -> None:
    _, riders, _ = _batching(monkeypatch)
    riders.add(1, MessageKind.RREF_USER_DELETE, ("a",))
    riders.add(1, MessageKind.SHM_RELEASE, ["segment"])  # not batched: queued at once
    assert riders.take(1) == [(_DELETE, 0, ("a",)), (int(MessageKind.SHM_RELEASE), 0, ["segment"])]
    riders.add(1, MessageKind.RREF_USER_DELETE, ("b",))
    riders.add_reply(1, 7, b"reply")
    assert [entry[:2] for entry in riders.take(1)] == [(_DELETE, 0), (int(MessageKind.RESPONSE), 7)]
    assert not riders.waiting


def test_waiting_notifications_leave_alone_rider_delay_after_the_oldest(monkeypatch) -> None:
    agent, riders, clock = _batching(monkeypatch)
    assert riders.seconds_to_due(clock[0]) is None
    riders.add(1, MessageKind.RREF_USER_DELETE, ("a",))
    start = clock[0]
    riders.add(2, MessageKind.SHM_RELEASE, ["segment"])
    assert riders.seconds_to_due(start) == pytest.approx(RIDER_DELAY)
    riders.flush(now=start + RIDER_DELAY / 2)
    assert agent.carriers == [] and riders.waiting
    riders.take(2)  # worker 2's went on a message: only the waiting delete is left
    assert riders.seconds_to_due(start + 0.004) == pytest.approx(RIDER_DELAY - 0.004)
    riders.flush(now=start + RIDER_DELAY)
    assert agent.carriers == [1] and not riders.waiting and not riders.queued
    assert riders.seconds_to_due(start) is None


def test_everything_flushes_waiting_notifications_and_a_departed_worker_drops_them(
    monkeypatch,
) -> None:
    agent, riders, _ = _batching(monkeypatch)
    riders.add(1, MessageKind.RREF_USER_DELETE, ("a",))
    riders.add(3, MessageKind.RREF_USER_DELETE, ("b",))  # rank 3 is no member
    riders.flush(everything=True)
    assert agent.carriers == [1] and not riders.waiting and not riders.queued
    riders.add(2, MessageKind.RREF_USER_DELETE, ("c",))
    riders.drop(2)
    assert not riders.waiting and riders.seconds_to_due(0.0) is None


class _FinalizerInside(dict):  # type: ignore[type-arg]
    """A table of ``Riders`` whose method ``hooked`` first runs ``finalizer`` (once): as
    if the collector ran a finalizer in the middle of a change of the tables."""

    def __init__(self, contents: dict[Any, Any], hooked: str, finalizer: Any) -> None:
        super().__init__(contents)
        self._hooked, self._finalizer = hooked, finalizer

    def __getattribute__(self, name: str) -> Any:
        if name not in ("_hooked", "_finalizer") and name == self._hooked:
            finalizer, self._finalizer = self._finalizer, None
            if finalizer is not None:
                finalizer()
        return super().__getattribute__(name)


def test_a_finalizer_queueing_inside_a_change_loses_nothing_and_keeps_the_order(
    monkeypatch,
) -> None:
    agent, riders, clock = _batching(monkeypatch)
    riders.add(1, MessageKind.RREF_USER_DELETE, ("a",))
    clock[0] += 0.01  # the next batched one makes them all ride

    def finalizer() -> None:
        riders.add(1, MessageKind.RREF_USER_DELETE, ("finalizer",))

    # the finalizer runs while the outer add has taken worker 1's waiting list
    riders.waiting = _FinalizerInside(riders.waiting, "pop", finalizer)
    riders.add(1, MessageKind.RREF_USER_DELETE, ("b",))
    assert [entry[2] for entry in riders.take(1)] == [("a",), ("b",)]
    assert riders.waiting[1] == [(_DELETE, 0, ("finalizer",))]  # a new batch, after them
    assert riders.seconds_to_due(clock[0]) == pytest.approx(RIDER_DELAY)

    def another() -> None:
        riders.add(2, MessageKind.SHM_RELEASE, ["segment"])

    riders.add(2, MessageKind.SHM_RELEASE, ["first"])
    riders.queued = _FinalizerInside(riders.queued, "pop", another)  # inside take()
    taken = riders.take(2) + riders.take(2)  # (taken along, or kept for the next message)
    assert [entry[2] for entry in taken] == [["first"], ["segment"]]
    assert riders._depth == 0 and not riders._nested
    # a due time the finalizer left for worker 2 (its notification went along) is dropped
    # rather than sending an empty carrier or making every timed look due at once
    riders.add(1, MessageKind.SHM_RELEASE, ["later"])
    assert riders.seconds_to_due(clock[0]) == pytest.approx(RIDER_DELAY)
    riders.flush(now=clock[0] + RIDER_DELAY / 2)
    assert 2 not in riders._due and agent.carriers == []


def test_a_finalizer_queueing_inside_another_change_nudges_a_quiet_io_thread() -> None:
    agent, riders = _riders()
    agent.quiet.waiting = True  # (a quiet wait: only a nudge ends it before a second)

    def finalizer() -> None:  # (its add finds the change in progress: it returns at once)
        riders.add(1, MessageKind.RREF_USER_DELETE, ("finalizer",))

    riders.queued = _FinalizerInside(riders.queued, "pop", finalizer)
    riders.drop(2)  # a change that is not an add (as describe() or put_back() are)
    assert riders.queued[1] == [(_DELETE, 0, ("finalizer",))]
    assert agent.nudges == 1


def test_notifications_put_back_nudge_a_quiet_io_thread() -> None:
    agent, riders = _riders()
    agent.quiet.waiting = True
    riders.put_back(1, [(_DELETE, 0, ("a",))])  # (no reply among them: no wake_io_by)
    assert agent.wake_requests == [] and agent.nudges == 1


def test_a_pool_thread_runs_before_wait_while_busy_before_it_blocks_and_exits() -> None:
    waits: list[tuple[bool, int]] = []
    ran = threading.Event()
    pool = WorkerPool(
        2, "riding-test", before_wait=lambda: waits.append((pool.on_pool_thread(), pool.busy))
    )
    try:
        assert not pool.on_pool_thread()
        pool.submit(ran.set)
        assert ran.wait(WAIT)
        # after its task, with the queue empty, while still counted busy (a send that
        # blocks there must not make the pool look idle), then again before blocking
        assert wait_until(lambda: len(waits) >= 2, WAIT), waits
        assert waits[:2] == [(True, 1), (True, 0)]
    finally:
        pool.close()
    assert waits[-1] == (True, 0) and len(waits) == 3  # and once more as it exits


# --- end to end, on the session cluster ---------------------------------------------------


def plus_one(value: int) -> int:
    return value + 1


def hold_gil(count: int) -> int:
    """Holds the GIL throughout: one C call (no bytecode runs, so no switch interval)."""
    return sum(range(count))


def nap(seconds: float) -> float:
    threading.Event().wait(seconds)  # lets the GIL go
    return seconds


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


@pytest.mark.usefixtures("cluster")
def test_a_lone_call_is_answered_at_once_never_queued() -> None:
    before = _replies_deferred("worker2")
    for i in range(30):
        assert rpc.rpc_sync("worker2", plus_one, args=(i,)) == i + 1
    assert _replies_deferred("worker2") == before


# One worker with one pool thread, so that the thread that queued a reply is the one that
# runs the next request: it must send the reply first when that request may hold the GIL,
# and the I/O thread must send it when the request only waits.
_ONE_THREAD_SCRIPT = textwrap.dedent(
    """
    import json, os, secrets, subprocess, sys
    import actorrpc as rpc
    from actorrpc._ports import free_ports
    from tests.test_riding_replies import hold_gil, nap, plus_one

    init_method = "tcp://127.0.0.1:%d" % free_ports("127.0.0.1", 1)[0]
    os.environ["ACTORRPC_SECRET"] = secrets.token_hex(16)
    worker = subprocess.Popen([sys.executable, "-m", "actorrpc._serve", "--rank", "1",
                               "--world-size", "2", "--init-method", init_method,
                               "--threads", "1"])
    rpc.init_rpc("driver", rank=0, world_size=2,
                 rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method))

    def deferred():
        return rpc.get_worker_stats("worker1")["notifications"]["replies_deferred"]

    def pairs(first, then):
        # until the first reply was queued (its request's successor arrived in time)
        outcomes = []
        for _ in range(40):  # (both must be in one burst: on a loaded host that can take tries)
            before = deferred()
            quick = rpc.rpc_async("worker1", *first)
            slow = rpc.rpc_async("worker1", *then)
            quick.wait()
            outcomes.append(not slow.done())  # the quick reply did not wait for it
            slow.wait()
            if deferred() > before:
                return outcomes, True
        return outcomes, False

    result = {
        "hold_gil": pairs((plus_one, (1,)), (hold_gil, (30_000_000,))),
        "nap": pairs((nap, (0.0,)), (nap, (0.6,))),
    }
    print("RESULT " + json.dumps(result), flush=True)
    rpc.shutdown()
    worker.wait(30)
    """
)


@pytest.mark.timeout(180)
def test_a_queued_reply_never_waits_for_the_next_request(tmp_path: Path) -> None:
    output = run_script(tmp_path, _ONE_THREAD_SCRIPT, timeout=170)
    line = next(text for text in output.splitlines() if text.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for case in ("hold_gil", "nap"):
        outcomes, was_queued = result[case]
        assert all(outcomes), f"{case}: a reply waited for the request after it: {outcomes}"
        assert was_queued, f"{case}: no reply was ever queued ({len(outcomes)} tries)"


def _queue_bad_notification_for(rank: int, value: int) -> int:
    """(On a worker) queue an AUTOGRAD_CLEANUP whose payload its handler cannot unpack."""
    from actorrpc.agent import current_agent

    current_agent().riders.add(rank, MessageKind.AUTOGRAD_CLEANUP, (1, 2, 3))
    return value


@pytest.mark.timeout(60)
def test_a_failing_riding_notification_is_reported_and_its_carrier_still_delivered(
    cluster: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    from actorrpc.agent import current_agent

    agent = current_agent()
    served = agent.stats.requests_served[1]
    suppressed = agent._suppressed_warnings
    with caplog.at_level("WARNING", logger="actorrpc"):
        # the bad notification rides on the reply (or goes alone just before it)
        assert rpc.rpc_sync("worker1", _queue_bad_notification_for, args=(0, 7)) == 7
        wait_for(lambda: agent.stats.requests_served[1] > served, WAIT, "the notification")
    reported = "a notification from worker 1 failed" in caplog.text
    assert reported or agent._suppressed_warnings > suppressed, caplog.text
    assert rpc.rpc_sync("worker1", _queue_bad_notification_for, args=(0, 8)) == 8
