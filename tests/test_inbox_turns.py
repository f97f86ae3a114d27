"""Waiting threads take turns on the inbox (agent/_inbox.py), against the session group."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import actorrpc as rpc
from actorrpc.agent import current_agent
from actorrpc.agent._inbox import (
    BACKOFF_SECONDS,
    CLOSE_TURNS_SECONDS,
    LONG_TURN_SECONDS,
    MAX_LOOK_SECONDS,
    InboxTurns,
)
from actorrpc.errors import ActorRpcError, RpcTimeoutError
from actorrpc.protocol import MessageKind

from ._cluster import run_script
from ._waiting import wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.internals]  # (stand-ins, patched methods)


def _plus_one(x: int) -> int:
    return x + 1


def _sleep_then(value: int, seconds: float) -> int:
    threading.Event().wait(seconds)
    return value


def _end_pauses() -> None:
    """Polls on again: no contended pause, and the I/O thread not staying on the inbox
    (an earlier test's long yield, or its C++ waits, may have set either)."""
    agent = current_agent()
    agent._transport._no_poll_until = 0.0
    agent.inbox._no_backoff_until = float("-inf")


def test_a_waiting_thread_receives_its_own_replies(cluster: list[str]) -> None:
    _end_pauses()  # the I/O thread not staying on the inbox after an earlier test's C++ waits
    before = rpc.get_worker_stats()["inbox_turns"]
    for i in range(50):
        assert rpc.rpc_sync("worker1", _plus_one, args=(i,)) == i + 1
    # the I/O thread steps back after serving a blocked waiter: the later waits take turns
    assert rpc.get_worker_stats()["inbox_turns"] - before >= 40


def test_a_pool_thread_serves_the_next_request_itself(cluster: list[str]) -> None:
    rpc.rpc_sync("worker1", _end_pauses)  # its I/O thread not staying on the inbox
    before = rpc.get_worker_stats("worker1")["serving_turns"]
    for i in range(50):
        assert rpc.rpc_sync("worker1", _plus_one, args=(i,)) == i + 1
    # after the first, the thread that served a call receives and runs the next one
    assert rpc.get_worker_stats("worker1")["serving_turns"] - before >= 40


def test_turns_poll_busily_on_both_sides_before_they_block(cluster: list[str]) -> None:
    def polls(worker: str | None = None) -> int:
        stats = rpc.get_worker_stats(worker)
        return int(stats["busy_poll_hits"] + stats["busy_poll_misses"])

    assert current_agent().options.busy_poll > 0  # on by default
    mine, theirs = polls(), polls("worker1")

    def both_polled() -> bool:
        # the caller's turns and worker1's serving turns poll before blocking: hits or
        # misses depending on this machine's load. A loaded machine can keep the I/O
        # threads on the inboxes (a reply waited for them: they stay), or pause polls
        # (a long yield), for a while: each round ends both, then makes 20 calls
        _end_pauses()
        rpc.rpc_sync("worker1", _end_pauses)
        for i in range(20):
            assert rpc.rpc_sync("worker1", _plus_one, args=(i,)) == i + 1
        return polls() > mine and polls("worker1") > theirs

    assert wait_until(both_polled, 20), (polls() - mine, polls("worker1") - theirs)


def test_a_workers_hand_offs_close_its_transports_spin_gate(cluster: list[str]) -> None:
    agent = current_agent()
    gate = agent._transport.spin_gate
    before = time.monotonic()
    agent.inbox.hand_off()  # (as when a request or reply is given to another thread)
    assert gate.closed_until >= before + gate.pause  # the transport's polls yield a while
    assert "busy_poll_spins" in rpc.get_worker_stats()


def test_a_long_request_in_a_serving_thread_holds_nothing_back(cluster: list[str]) -> None:
    for i in range(5):  # worker1's pool thread is in its serving turns
        rpc.rpc_sync("worker1", _plus_one, args=(i,))
    slow = rpc.rpc_async("worker1", _sleep_then, args=(7, 1.5))
    started = time.monotonic()
    for i in range(20):
        assert rpc.rpc_sync("worker1", _plus_one, args=(i,), timeout=10) == i + 1
    assert time.monotonic() - started < 1.0  # served meanwhile, not after the slow one
    assert not slow.done()
    assert slow.wait() == 7


def test_threads_waiting_together_all_get_their_replies_without_stalls(
    cluster: list[str],
) -> None:
    errors: list[BaseException] = []
    slowest: list[float] = []

    def caller(offset: int) -> None:
        try:
            worst = 0.0
            for i in range(100):
                started = time.monotonic()
                peer = "worker1" if i % 2 else "worker2"
                if i % 3:
                    value = rpc.rpc_sync(peer, _plus_one, args=(offset + i,))
                else:
                    value = rpc.rpc_async(peer, _plus_one, args=(offset + i,)).wait()
                worst = max(worst, time.monotonic() - started)
                assert value == offset + i + 1
            slowest.append(worst)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k * 1000,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not errors, errors
    assert len(slowest) == 8
    # nobody waited on a reply that sat in the inbox (a stall would take >= the poll interval)
    assert max(slowest) < 1.0, slowest


def test_waiting_inside_a_callback_raises_instead_of_deadlocking(cluster: list[str]) -> None:
    pending = rpc.rpc_async("worker2", _sleep_then, args=(1, 1.0))
    fast = rpc.rpc_async("worker1", _sleep_then, args=(2, 0.1))  # done after then() below
    chained = fast.then(lambda _: pending.wait())  # runs on whichever thread receives
    with pytest.raises(Exception, match="would deadlock"):
        chained.wait()
    assert pending.wait() == 1


def test_a_timeout_ends_the_waiting_threads_turn_promptly(cluster: list[str]) -> None:
    started = time.monotonic()
    with pytest.raises(RpcTimeoutError):
        rpc.rpc_sync("worker1", _sleep_then, args=(1, 3.0), timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert rpc.rpc_sync("worker1", _plus_one, args=(2,)) == 3  # the inbox is served again


def test_tensor_replies_and_callbacks_during_turns(cluster: list[str]) -> None:
    results: list[torch.Tensor] = []
    futures = [rpc.rpc_async("worker1", torch.add, args=(torch.ones(4), i)) for i in range(20)]
    for future in futures:
        future.then(lambda f: results.append(f.value()))
    values = [f.wait() for f in futures]
    assert [int(v[0]) for v in values] == [1 + i for i in range(20)]
    assert wait_until(lambda: len(results) == 20, 10)


def test_io_thread_backs_off_only_after_serving_a_waiter() -> None:
    turns = InboxTurns()
    now = time.monotonic()
    assert turns.io_pause(now) == 0.0  # nobody waited: the I/O thread receives
    assert turns.spin_gate.closed_until < now
    turns.hand_off()  # (another thread runs now: the transport's polls yield to it a while)
    assert turns.spin_gate.closed_until >= now + turns.spin_gate.pause
    assert 0 < turns.io_pause(time.monotonic()) <= BACKOFF_SECONDS
    assert turns.io_pause(time.monotonic() + 2 * BACKOFF_SECONDS) == 0.0  # not back: take it
    now = turns._begin_turn(SimpleNamespace(_running=True))  # type: ignore[arg-type,assignment]
    assert now is not None  # a waiter receives, the first turn (no run of close turns yet)
    assert turns.io_pause(now + BACKOFF_SECONDS / 2) == BACKOFF_SECONDS  # look again soon
    # a long turn wakes the I/O thread when it ends: meanwhile it sleeps
    assert turns.io_pause(now + 2 * LONG_TURN_SECONDS) == float("inf")
    assert turns.held_by_current_thread()


def _close_turns(turns: InboxTurns, count: int) -> list[float]:
    """``count`` turns back to back; the I/O thread's pause as it looks during each."""
    agent = SimpleNamespace(_running=True)
    pauses = []
    for _ in range(count):
        started = turns._begin_turn(agent)  # type: ignore[arg-type]
        assert started is not None
        pauses.append(turns.io_pause(started))  # (a look at the turn's start: never a long one)
        turns._end_turn(started, coming_back=True)
    return pauses


def test_io_thread_looks_less_often_while_turns_follow_closely(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actorrpc.agent import _inbox

    monkeypatch.setattr(_inbox, "CLOSE_TURNS_SECONDS", 60.0)  # (however slow this host is)
    turns = InboxTurns()
    grown = [min(BACKOFF_SECONDS * 2**i, MAX_LOOK_SECONDS) for i in range(5)]
    assert _close_turns(turns, 5) == grown  # the first look has seen no gap yet
    assert grown[-1] == MAX_LOOK_SECONDS > BACKOFF_SECONDS
    # between turns, just after one more ended: the grown period, not the back-off's rest
    started = turns._begin_turn(SimpleNamespace(_running=True))  # type: ignore[arg-type]
    assert started is not None
    turns._end_turn(started, coming_back=True)
    assert turns.io_pause(turns._turn_ended + 1e-6) == MAX_LOOK_SECONDS
    # a gap as wide as the back-off: the I/O thread takes the inbox and looks often again
    assert turns.io_pause(turns._handed_off_at + 2 * BACKOFF_SECONDS) == 0.0
    assert turns.look_period == BACKOFF_SECONDS
    assert _close_turns(turns, 2) == grown[1:3]  # (the period went back; no gap since)


def test_one_long_turn_puts_the_look_period_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn that lasts several looks (a slow reply): its thread may compute for long
    after it, so the I/O thread looks every back-off again."""
    from actorrpc.agent import _inbox

    monkeypatch.setattr(_inbox, "CLOSE_TURNS_SECONDS", 60.0)
    turns = InboxTurns()
    _close_turns(turns, 4)
    started = turns._begin_turn(SimpleNamespace(_running=True))  # type: ignore[arg-type]
    assert started is not None
    assert turns.io_pause(started) == MAX_LOOK_SECONDS  # a turn began since the last look
    assert turns.io_pause(started) == BACKOFF_SECONDS  # none since: the same long turn
    turns._end_turn(started, coming_back=True)


def test_a_wide_gap_between_turns_puts_the_look_period_back() -> None:
    turns = InboxTurns()
    turns.look_period = MAX_LOOK_SECONDS
    turns._widest_gap = 0.0
    turns._turn_ended = time.monotonic() - 2 * CLOSE_TURNS_SECONDS  # ... then nobody took one
    assert _close_turns(turns, 1) == [BACKOFF_SECONDS]
    # a gap in progress counts too
    turns.look_period, turns._widest_gap = MAX_LOOK_SECONDS, 0.0
    now = time.monotonic()
    turns._turn_ended, turns._handed_off_at = now - 2 * CLOSE_TURNS_SECONDS, now
    assert turns.io_pause(now) == pytest.approx(BACKOFF_SECONDS)
    assert turns.look_period == BACKOFF_SECONDS


def test_the_look_period_stays_short_after_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actorrpc.agent import _inbox

    monkeypatch.setattr(_inbox, "CLOSE_TURNS_SECONDS", 60.0)
    turns = InboxTurns()
    _close_turns(turns, 4)
    assert turns.look_period == MAX_LOOK_SECONDS and not turns._serving_last
    # the I/O thread handed a request to a pool thread: it runs now, maybe for long
    turns.hand_off()
    now = turns._handed_off_at
    assert turns.io_pause(now) == pytest.approx(BACKOFF_SECONDS)
    assert turns.look_period == BACKOFF_SECONDS
    # a waiter's own turn ends that: the period may grow again after it
    future = SimpleNamespace(_done=False, _receiver=None)
    assert turns.receive_until(_OneTurnAgent(future), future) is True  # type: ignore[arg-type]
    assert not turns._serving_last
    # ... unless it handed something to a thread itself meanwhile
    handing = SimpleNamespace(_done=False, _receiver=None)
    agent = _OneTurnAgent(handing)
    receive = agent._transport.receive
    agent._transport.receive = lambda *a: (turns.hand_off(), receive(*a))[1]
    assert turns.receive_until(agent, handing) is True  # type: ignore[arg-type]
    assert turns._serving_last
    # a serving turn that claimed a request: the request runs now
    turns._serving_last = False
    serving = _ServingAgent(turns, [[("request", 2)]])
    assert turns.serving_turn(serving) == ("request", 2)  # type: ignore[arg-type]
    assert turns._serving_last
    assert turns.io_pause(turns._turn_ended) == pytest.approx(BACKOFF_SECONDS)
    assert turns.look_period == BACKOFF_SECONDS


def test_a_thread_that_blocks_while_nobody_holds_the_inbox_wakes_the_io_thread() -> None:
    """Its turn failed while another held the inbox, which was let go before that holder
    saw it counted as blocked: the I/O thread, maybe in a long look period, takes over."""
    from actorrpc.agent._call_result import CallResult, complete, wait_on_gate

    turns = InboxTurns()
    agent = SimpleNamespace(inbox=turns, is_alive=lambda: True)
    future: CallResult[int] = CallResult("a call", None)
    threading.Thread(target=complete, args=(future, 7)).start()  # (the holder's part)
    wait_on_gate(future, agent)
    assert turns._resume.is_set() and turns.blocked_waiters == 0
    turns._resume.clear()
    other: CallResult[int] = CallResult("another call", None)
    turns.lock.acquire()  # held: its holder completes the future, nobody to wake
    threading.Thread(target=complete, args=(other, 8)).start()
    wait_on_gate(other, agent)
    assert not turns._resume.is_set()


def test_a_serving_turn_keeps_the_io_thread_looking_every_back_off() -> None:
    turns = InboxTurns()
    turns.look_period, turns._widest_gap = MAX_LOOK_SECONDS, 0.0
    started = turns._begin_turn(SimpleNamespace(_running=True))  # type: ignore[arg-type]
    assert started is not None
    turns._claiming = True  # (as serving_turn sets it)
    # it ends at the next request, whose run leaves the inbox to nobody: look again soon
    assert turns.io_pause(started) == BACKOFF_SECONDS
    assert turns.look_period == BACKOFF_SECONDS
    turns._claiming = False
    turns._end_turn(started, coming_back=True)


class _OneTurnAgent:
    """Just enough of an agent for one turn: its first receive completes the future."""

    _running = True

    def __init__(self, future: Any, busy_poll: float = 0.0) -> None:
        self.options = SimpleNamespace(busy_poll=busy_poll)
        self.busy_until: list[float] = []

        def receive(timeout: float, busy_until: float = 0.0) -> list[Any]:
            self.busy_until.append(busy_until)
            future._done = True
            return []

        self._transport = SimpleNamespace(receive=receive)

    def _on_message(self, message: Any) -> None:
        raise AssertionError("no message arrives")

    def wake_inbox(self) -> None:
        pass


@pytest.mark.parametrize("long_turn", [True, False])
def test_only_a_long_turn_wakes_the_io_thread_when_it_ends(
    long_turn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.agent import _inbox

    monkeypatch.setattr(_inbox, "LONG_TURN_SECONDS", 0.0 if long_turn else 1e9)
    turns = InboxTurns()
    future = SimpleNamespace(_done=False, _receiver=None)
    assert turns.receive_until(_OneTurnAgent(future), future) is True  # type: ignore[arg-type]
    assert turns._resume.is_set() is long_turn  # a short turn leaves the I/O thread be
    assert not turns.lock.locked() and turns.holder is None


@pytest.mark.parametrize("busy_poll", [0.0, 30.0])
def test_a_turn_polls_busily_for_busy_poll_seconds_from_its_start(busy_poll: float) -> None:
    turns = InboxTurns()
    future = SimpleNamespace(_done=False, _receiver=None)
    agent = _OneTurnAgent(future, busy_poll)
    before = time.monotonic()
    assert turns.receive_until(agent, future) is True  # type: ignore[arg-type]
    [busy_until] = agent.busy_until
    if busy_poll:
        assert before + busy_poll <= busy_until <= time.monotonic() + busy_poll
    else:
        assert busy_until == 0.0  # 0: the receive blocks at once


class _FlowAgent:
    """Just enough of an agent for the I/O thread's receives: each returns the next batch."""

    def __init__(self, batches: list[list[Any]], busy_poll: float = 0.001) -> None:
        self.options = SimpleNamespace(busy_poll=busy_poll)
        self.calls: list[tuple[float, bool]] = []  # (busy_until, watch_contention)

        def receive(timeout: float, busy_until: float = 0.0,
                    watch_contention: bool = True) -> list[Any]:
            self.calls.append((busy_until, watch_contention))
            return batches.pop(0)

        self._transport = SimpleNamespace(receive=receive)


@pytest.mark.parametrize("busy_poll", [0.001, 0.0])
def test_the_io_thread_polls_only_in_a_flow_of_messages(
    busy_poll: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a receive that returned messages the I/O thread polls first (its yields go
    to this worker's own threads: no contention pause); after an empty one it blocks."""
    from actorrpc.agent import _inbox

    turns = InboxTurns()
    agent = _FlowAgent([[["m"]], [["m"], ["n"]], [], [], [["m"]]], busy_poll)
    before = time.monotonic()
    for _ in range(5):
        turns._io_receive(agent, 0.05)  # type: ignore[arg-type]
    polled = [busy_until > 0 for busy_until, _ in agent.calls]
    if busy_poll:
        assert polled == [False, True, True, False, False]
        assert turns.io_flow_polls == 2
        for busy_until, watch_contention in agent.calls[1:3]:
            assert before < busy_until <= time.monotonic() + _inbox.IO_FLOW_POLL_SECONDS
            assert watch_contention is False
    else:  # busy polling switched off: the I/O thread never polls either
        assert polled == [False] * 5 and turns.io_flow_polls == 0
    monkeypatch.setattr(_inbox, "IO_FLOW_POLL_SECONDS", 0.0)
    agent = _FlowAgent([[["m"]], [["m"]]], busy_poll)
    turns._io_receive(agent, 0.05)  # type: ignore[arg-type]
    turns._io_receive(agent, 0.05)  # type: ignore[arg-type]
    assert [busy_until for busy_until, _ in agent.calls][1] == 0.0


def test_the_io_thread_polls_in_a_burst_of_requests(cluster: list[str]) -> None:
    """A pipelined burst reaches worker1's I/O thread (its pool threads serve): the I/O
    thread polls between the burst's messages instead of sleeping on its inbox."""
    before = rpc.get_worker_stats("worker1")["io_flow_polls"]

    def polled() -> bool:
        futures = [rpc.rpc_async("worker1", _plus_one, args=(i,)) for i in range(200)]
        assert [f.wait() for f in futures] == [i + 1 for i in range(200)]
        return bool(rpc.get_worker_stats("worker1")["io_flow_polls"] > before)

    assert wait_until(polled, 20)


class _ServingAgent:
    """Just enough of an agent for a serving turn: each receive returns the next batch."""

    _running = True
    name = "fake"

    def __init__(self, turns: InboxTurns, batches: list[list[Any]]) -> None:
        self.turns = turns
        self.handled: list[Any] = []
        self.options = SimpleNamespace(busy_poll=0.0)

        def receive(timeout: float, busy_until: float = 0.0) -> list[Any]:
            assert turns.held_by_current_thread()
            return batches.pop(0) if batches else []

        self._transport = SimpleNamespace(receive=receive)
        self.queued = False  # work waiting in the pool's queue
        self._pool = SimpleNamespace(has_queued=lambda: self.queued)

    def _on_message(self, message: Any) -> None:
        # as the dispatcher does: a request goes to the serving thread if it has none yet
        if message[0] == "request" and self.turns.claim(message):
            return
        self.handled.append(message)


def test_a_serving_turn_returns_the_first_request_and_hands_on_the_rest() -> None:
    turns = InboxTurns()
    assert turns.claim(("request", 0)) is False  # nobody is in a serving turn
    agent = _ServingAgent(turns, [[("reply", 1)], [("request", 2), ("request", 3)]])
    claimed = turns.serving_turn(agent)  # type: ignore[arg-type]
    assert claimed == ("request", 2)
    assert agent.handled == [("reply", 1), ("request", 3)]  # the second request: to the pool
    assert not turns.lock.locked() and turns.holder is None and turns.serving_turns == 1
    # the I/O thread stays off for a moment: this thread comes back after running it
    assert 0 < turns.io_pause(time.monotonic()) <= BACKOFF_SECONDS
    assert not turns._resume.is_set()
    assert turns.claim(("request", 4)) is False  # the turn is over


def test_queued_pool_work_ends_a_serving_turn() -> None:
    turns = InboxTurns()
    agent = _ServingAgent(turns, [[("reply", 1)], [("request", 2)]])
    agent.queued = True  # the thread goes back to the queue instead of waiting here
    assert turns.serving_turn(agent) is None  # type: ignore[arg-type]
    assert agent.handled == [("reply", 1)] and turns._resume.is_set()


def test_a_claimed_request_is_returned_even_if_a_later_message_fails() -> None:
    turns = InboxTurns()

    class _Failing(_ServingAgent):
        def _on_message(self, message: Any) -> None:
            if message[0] == "broken":
                raise ValueError("a malformed reply")
            super()._on_message(message)

    agent = _Failing(turns, [[("request", 1), ("broken", 2)]])
    assert turns.serving_turn(agent) == ("request", 1)  # type: ignore[arg-type]
    assert not turns.lock.locked() and turns.claim(("request", 3)) is False


def test_a_serving_turn_without_requests_ends_and_wakes_the_io_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actorrpc.agent import _inbox

    monkeypatch.setattr(_inbox, "SERVING_TURN_SECONDS", 0.01)
    turns = InboxTurns()
    agent = _ServingAgent(turns, [[("reply", 1)]])
    assert turns.serving_turn(agent) is None  # type: ignore[arg-type]
    assert agent.handled == [("reply", 1)]
    assert turns._resume.is_set() and turns.io_pause(time.monotonic()) == 0.0
    # the inbox is busy (the I/O thread or a waiter has it): no turn
    turns.lock.acquire()
    assert turns.serving_turn(_ServingAgent(turns, [])) is None  # type: ignore[arg-type]
    assert turns.serving_turns == 1


def test_a_stopped_agent_refuses_turns() -> None:
    class _Stopped:
        _running = False

    class _Future:
        _done = False

    turns = InboxTurns()
    assert turns.receive_until(_Stopped(), _Future()) is False  # type: ignore[arg-type]
    assert not turns.lock.locked()


def test_error_type_of_a_deadlocking_wait_is_actorrpc_error(cluster: list[str]) -> None:
    agent = current_agent()
    future = rpc.rpc_async("worker1", _sleep_then, args=(5, 0.2))
    agent.inbox.holder = threading.get_ident()  # pretend this thread has the turn
    try:
        with pytest.raises(ActorRpcError, match="would deadlock"):
            future.wait()
    finally:
        agent.inbox.holder = None
    assert future.wait() == 5


_QUEUED_WORK_IS_NOT_STARVED = textwrap.dedent(
    """
    import threading, time
    import torch
    import actorrpc as rpc
    from actorrpc.agent import current_agent

    def ping():
        return 1

    def two_streams(seconds):
        # on worker1: two threads call the driver back to back; returns the calls of
        # each and the second one's slowest call
        end = time.monotonic() + seconds
        counts = {"first": 0}

        def first():
            while time.monotonic() < end:
                rpc.rpc_sync("driver", ping)
                counts["first"] += 1

        thread = threading.Thread(target=first)
        thread.start()
        slowest, second = 0.0, 0
        while time.monotonic() < end:
            started = time.monotonic()
            rpc.rpc_sync("driver", ping)
            slowest = max(slowest, time.monotonic() - started)
            second += 1
        thread.join()
        return counts["first"], second, slowest

    # the driver serves with one pool thread, which takes serving turns; its main thread
    # waits in C++ (no waiting turns of its own)
    group = rpc.local_workers(1, num_worker_threads=1)
    future = rpc.rpc_async("worker1", two_streams, args=(3.0,))
    first, second, slowest = torch.futures.wait_all([future])[0]
    print("serving turns:", current_agent().inbox.serving_turns > 50, flush=True)
    print("both streams served:", first > 50 and second > 50, first, second, flush=True)
    print("slowest call under 0.5 s:", slowest < 0.5, slowest, flush=True)
    group.shutdown()
    """
)


def test_queued_work_is_not_starved_by_a_stream_of_serving_turns(tmp_path: Path) -> None:
    output = run_script(tmp_path, _QUEUED_WORK_IS_NOT_STARVED, timeout=90)
    for line in ("serving turns: True", "both streams served: True",
                 "slowest call under 0.5 s: True"):
        assert line in output, output


_SHUTDOWN_DURING_TURN = textwrap.dedent(
    """
    import threading, time
    import actorrpc as rpc
    from actorrpc.agent import current_agent

    def wait_for_gate(gate):
        return gate.local_value().wait(60)

    group = rpc.local_workers(1)
    # the waiter's long call may find the I/O thread on the inbox (then that thread serves
    # it, no turn): the gate of such an attempt is opened and the waiter tries again
    gates = [rpc.remote("worker1", threading.Event) for _ in range(5)]
    agent = current_agent()
    outcome = {}
    attempt = [-1]

    def waiter():
        try:
            for index, gate in enumerate(gates):
                turns = agent.inbox.turns
                while agent.inbox.turns == turns:  # until this thread's waits take turns
                    rpc.rpc_sync("worker1", len, args=([1],))
                attempt[0] = index
                outcome["value"] = rpc.rpc_sync("worker1", wait_for_gate, args=(gate,))
        except Exception as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=waiter)
    thread.start()
    held = False
    for index, gate in enumerate(gates):
        deadline = time.monotonic() + 20
        while attempt[0] < index and thread.is_alive() and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        deadline = time.monotonic() + 2
        while agent.inbox.holder != thread.ident and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        held = agent.inbox.holder == thread.ident
        if held:
            break
        gate.rpc_sync().set()
    print("turn held by the waiter:", held, "attempt", attempt[0], flush=True)
    started = time.monotonic()
    rpc.shutdown(graceful=False)
    thread.join(20)
    print("waiter finished:", not thread.is_alive(), flush=True)
    print("outcome:", outcome, flush=True)
    print("within:", time.monotonic() - started < 10, flush=True)
    for process in group.processes:
        process.kill()
    """
)


def test_shutdown_while_a_waiter_holds_the_inbox_fails_its_wait(tmp_path: Path) -> None:
    output = run_script(tmp_path, _SHUTDOWN_DURING_TURN, timeout=100)
    assert "turn held by the waiter: True" in output, output
    assert "waiter finished: True" in output, output
    assert "within: True" in output, output
    assert "shut down before the call completed" in output or "stopped" in output, output


def test_replies_for_a_thread_that_waits_without_turns_are_not_held_back(
    cluster: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.futures.wait_all waits in C++ (no turn on the inbox): the I/O thread, backing
    # off after a sync call's turn, must notice the reply that waits and stay on the inbox
    from actorrpc.agent import _inbox

    monkeypatch.setattr(_inbox, "BACKOFF_SECONDS", 0.05)  # a long window: the reply lands in it
    turns = current_agent().inbox
    deadline = time.monotonic() + 20
    while turns._no_backoff_until < time.monotonic() and time.monotonic() < deadline:
        assert rpc.rpc_sync("worker1", _plus_one, args=(1,)) == 2  # a turn, then a back-off
        assert torch.futures.wait_all([rpc.rpc_async("worker1", _plus_one, args=(2,))]) == [3]
    assert turns._no_backoff_until > time.monotonic()
    rpc.rpc_sync("worker1", _plus_one, args=(1,))
    started = time.monotonic()
    assert torch.futures.wait_all([rpc.rpc_async("worker1", _plus_one, args=(3,))]) == [4]
    assert time.monotonic() - started < 0.05  # served at once, not after the back-off


@pytest.mark.parametrize("kind", [MessageKind.PING, MessageKind.RREF_FETCH])
def test_only_a_request_that_is_not_a_liveness_ping_makes_the_io_thread_stay(
    kind: MessageKind,
) -> None:
    """A request that waited while nobody received keeps the I/O thread on the inbox for
    a while (more may come); a peer's PING says nothing of that (a group's workers waiting
    in shutdown() probe the others every second)."""
    import threading as _threading
    from collections import Counter

    from actorrpc.agent._calls import HandlerEntry
    from actorrpc.agent._dispatch import MessageDispatcher

    served: list[MessageKind] = []
    inbox = SimpleNamespace(probing=True, stays=0)
    inbox.stay = lambda: setattr(inbox, "stays", inbox.stays + 1)
    stub = SimpleNamespace(
        _handlers={kind: HandlerEntry(lambda request: None, True, False)},
        _infos={1: object()}, inbox=inbox, _inflight_lock=_threading.Lock(), _inflight=0,
        _unstarted={}, stats=SimpleNamespace(requests_served=Counter()),
        _serve=lambda kind, *rest: served.append(kind),
    )
    MessageDispatcher._on_request(stub, kind, 1, 7, [])  # type: ignore[arg-type]
    assert served == [kind]
    assert inbox.stays == (0 if kind == MessageKind.PING else 1)
