"""The shutdown barrier on the rendezvous store: who is missing, at a cost per poll that
does not grow with the world size; its completion announced by the last rank to arrive."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from typing import Any

import pytest
import torch.distributed as dist

from actorrpc.agent import _rendezvous
from actorrpc.agent._calls import IncomingRequest
from actorrpc.agent._rendezvous import StoreBarrier
from actorrpc.agent._shutdown import BarrierCompletions
from actorrpc.errors import PeerUnreachableError, ProtocolError
from actorrpc.protocol import MessageKind

pytestmark = pytest.mark.timeout(30)


class _CountingStore:
    """A store that counts the round trips asked of it (each method call is one)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return counted


def _group(world_size: int) -> tuple[_CountingStore, list[StoreBarrier]]:
    store = _CountingStore()
    barriers = [StoreBarrier(store, "shutdown/arrived", r, world_size) for r in range(world_size)]
    return store, barriers


def test_missing_names_the_ranks_that_did_not_arrive() -> None:
    _, barriers = _group(5)
    assert barriers[0].missing() == [0, 1, 2, 3, 4]  # nobody yet (and no blocking read)
    for rank in (0, 3, 4):
        barriers[rank].arrive()
    assert barriers[0].missing() == [1, 2]
    barriers[1].arrive()
    barriers[2].arrive()
    assert barriers[0].missing() == []
    assert barriers[2].wait(time.monotonic() + 5) == []


def test_a_poll_costs_the_same_round_trips_whatever_the_world_size() -> None:
    costs = []
    for world_size in (4, 32):
        store, barriers = _group(world_size)
        for barrier in barriers[:-1]:  # the last rank never arrives
            barrier.arrive()
        polled: list[int] = []

        def dead(
            missing: list[int], store: _CountingStore = store, polled: list[int] = polled
        ) -> list[int]:
            polled.append(store.calls)
            return missing if len(polled) == 3 else []  # found dead at the third poll

        began = store.calls
        assert barriers[0].wait(time.monotonic() + 20, dead) == [world_size - 1]
        costs.append((polled[1] - polled[0], polled[2] - polled[1], store.calls - began))
    (small_gap, small_gap2, _), (large_gap, large_gap2, _) = costs
    assert small_gap == large_gap == small_gap2 == large_gap2 <= 3  # count, check, read


def test_a_waiter_stops_once_only_dead_ranks_are_missing() -> None:
    _, barriers = _group(3)
    barriers[0].arrive()
    barriers[1].arrive()
    started = time.monotonic()
    missing = barriers[0].wait(started + 20, lambda missing: missing)  # all found dead
    assert missing == [2] and time.monotonic() - started < 5


def test_exactly_the_last_rank_to_arrive_completes_the_barrier() -> None:
    _, barriers = _group(4)
    assert [barrier.arrive() for barrier in (barriers[2], barriers[0], barriers[3])] == [
        False, False, False
    ]
    assert barriers[1].arrive() is True


def test_a_waiter_woken_by_the_completion_does_not_wait_for_its_next_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every pause would outlast the test's timeout: only the event can end the wait
    monkeypatch.setattr(_rendezvous, "WOKEN_FIRST_POLL_INTERVAL", 600.0)
    monkeypatch.setattr(_rendezvous, "MAX_WOKEN_POLL_INTERVAL", 600.0)
    _, barriers = _group(2)
    barriers[0].arrive()
    woken = threading.Event()
    began_waiting = threading.Event()
    completed: list[bool] = []

    def dead(missing: list[int]) -> list[int]:
        began_waiting.set()  # (asked at each poll, before the pause)
        return []

    def last_rank() -> None:
        if began_waiting.wait(20):
            completed.append(barriers[1].arrive())
        woken.set()  # what the BARRIER notification does on the waiter

    thread = threading.Thread(target=last_rank)
    thread.start()
    try:
        assert barriers[0].wait(time.monotonic() + 1200, dead, woken) == []
    finally:
        thread.join(20)
    assert completed == [True], "the second rank did not complete the barrier"


def test_a_waiter_woken_too_early_polls_on_without_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, barriers = _group(2)
    barriers[0].arrive()
    woken = threading.Event()
    woken.set()  # (a peer that announced before the barrier was complete)
    polls: list[float] = []

    def dead(missing: list[int]) -> list[int]:
        polls.append(time.monotonic())
        if len(polls) == 4:
            barriers[1].arrive()
        return []

    assert barriers[0].wait(time.monotonic() + 20, dead, woken) == []
    assert len(polls) == 4
    # the pauses after the event was found set are the plain ones (2, 4, 8 ms at least)
    assert polls[-1] - polls[0] >= 0.002 + 0.004 + 0.008


class _FakeLiveness:
    dead_peers = {3: "gone"}


class _FakeAgent:
    """What :class:`BarrierCompletions` uses of an agent: handlers and notifications."""

    rank = 0
    name = "worker0"
    liveness = _FakeLiveness()

    def __init__(self, refuse: Collection[int] = ()) -> None:
        self.handlers: dict[MessageKind, Any] = {}
        self.sent: list[tuple[int, MessageKind, Any]] = []
        self._refuse = refuse

    def register_handler(self, kind: MessageKind, handler: Any, inline: bool = False) -> None:
        assert inline, "a barrier's completion must be handled on the receiving thread"
        self.handlers[kind] = handler

    def send_notification(self, rank: int, kind: MessageKind, payload: Any) -> None:
        if rank in self._refuse:
            raise PeerUnreachableError(f"rank {rank} left")
        self.sent.append((rank, kind, payload))


def _notification(payload: Any) -> IncomingRequest:
    return IncomingRequest(MessageKind.BARRIER, None, 0, payload)  # type: ignore[arg-type]


def test_the_completion_is_announced_to_every_live_waiter_but_the_sender() -> None:
    agent = _FakeAgent(refuse={2})
    completions = BarrierCompletions(agent)  # type: ignore[arg-type]
    completions.announce("shutdown/idle", [0, 1, 2, 3, 4])  # 0: itself, 3: dead, 2: refuses
    assert agent.sent == [
        (1, MessageKind.BARRIER, ("shutdown/idle", 0)),
        (4, MessageKind.BARRIER, ("shutdown/idle", 0)),
    ]


def test_a_completion_sets_the_event_of_its_barrier_only() -> None:
    agent = _FakeAgent()
    completions = BarrierCompletions(agent)  # type: ignore[arg-type]
    arrived, idle = completions.expect("shutdown/arrived"), completions.expect("shutdown/idle")
    assert completions.expect("shutdown/idle") is idle  # (one event per barrier)
    agent.handlers[MessageKind.BARRIER](_notification(("shutdown/idle", 1)))
    assert idle.is_set() and not arrived.is_set()


@pytest.mark.parametrize(
    "payload", [("shutdown/never", 1), (), "shutdown/idle", ([1], 2), None],
    ids=["unknown barrier", "empty", "not a tuple", "unhashable name", "none"],
)
def test_a_malformed_or_unexpected_completion_is_refused_by_name(payload: Any) -> None:
    agent = _FakeAgent()
    completions = BarrierCompletions(agent)  # type: ignore[arg-type]
    idle = completions.expect("shutdown/idle")
    with pytest.raises(ProtocolError, match="BARRIER notification for no barrier"):
        agent.handlers[MessageKind.BARRIER](_notification(payload))
    assert not idle.is_set()
