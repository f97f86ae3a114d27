"""Unit tests of the liveness monitor's verdicts (a fake agent and clock, no sockets).

The integration tests (``test_reliability.py``: SIGSTOP, SIGKILL) cover the
real detection; these pin down what happens to a verdict afterwards: a peer
found dead is checked again, its answer revives it, and shutdown counts only a
verdict reached during the shutdown.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from actorrpc.agent import WorkerInfo, _liveness
from actorrpc.agent._liveness import LivenessMonitor
from actorrpc.errors import RpcTimeoutError
from actorrpc.protocol import MessageKind

pytestmark = [pytest.mark.timeout(30), pytest.mark.internals]  # (stand-ins, patched methods)

TIMEOUT = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class FakeAgent:
    """What the monitor uses of an agent; ``pings`` holds (rank, future) per PING sent."""

    def __init__(self) -> None:
        self.name = "worker0"
        self.rank = 0
        self.options = SimpleNamespace(liveness_interval=1.0, dead_peer_timeout=TIMEOUT)
        self._pending: dict[int, Any] = {}
        infos = {rank: WorkerInfo(f"worker{rank}", rank) for rank in (1, 2)}
        self.members = SimpleNamespace(infos=infos)
        self.shared = SimpleNamespace(peer_gone=lambda rank: None)
        self.pings: list[tuple[int, torch.futures.Future[Any]]] = []

    def send_request(self, dest: WorkerInfo, kind: MessageKind, payload: Any, timeout: float,
                     description: str = "") -> torch.futures.Future[Any]:
        assert kind == MessageKind.PING and timeout == TIMEOUT
        future: torch.futures.Future[Any] = torch.futures.Future()
        self.pings.append((dest.id, future))
        return future

    def _fail_pending(self, message_id: int, error: BaseException) -> None:
        raise AssertionError("no call waits in these tests")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(_liveness, "time", fake)
    return fake


def unanswered(agent: FakeAgent, rank: int) -> None:
    """The last PING to ``rank`` times out."""
    sent_to, future = agent.pings[-1]
    assert sent_to == rank
    future.set_exception(RpcTimeoutError("no answer"))


def test_a_peer_found_dead_is_checked_again_and_revived_by_its_answer(clock: Clock) -> None:
    agent = FakeAgent()
    monitor = LivenessMonitor(agent)  # type: ignore[arg-type]
    monitor.probe(1)
    unanswered(agent, 1)
    assert 1 in monitor.dead_peers and "did not answer a liveness check" in monitor.dead_peers[1]

    clock.now += TIMEOUT - 0.5
    monitor.check()
    assert len(agent.pings) == 1  # not before dead_peer_timeout
    clock.now += 1.0
    monitor.check()
    assert [rank for rank, _ in agent.pings] == [1, 1]  # checked again: it may only have stalled
    unanswered(agent, 1)  # still silent: still dead, checked again later
    assert 1 in monitor.dead_peers
    clock.now += TIMEOUT
    monitor.check()
    assert len(agent.pings) == 3
    monitor.heard_from(1, "worker1")  # its answer (any message) revives it
    assert monitor.dead_peers == {}
    clock.now += 10 * TIMEOUT
    monitor.check()
    assert len(agent.pings) == 3  # alive, and no call waits on it: no more checks


def test_shutdown_counts_only_a_verdict_reached_during_it(clock: Clock) -> None:
    agent = FakeAgent()
    monitor = LivenessMonitor(agent)  # type: ignore[arg-type]
    monitor.probe(1)
    unanswered(agent, 1)  # found dead before the shutdown started
    clock.now += 1.0
    started = clock.now
    assert monitor.dead_among([1, 2], started) == []  # an old verdict is checked again
    assert sorted(rank for rank, _ in agent.pings[1:]) == [1, 2]
    assert monitor.dead_among([1, 2], started) == []  # no second PING while one is in flight
    assert len(agent.pings) == 3
    clock.now += TIMEOUT
    for rank, future in agent.pings[1:]:
        if rank == 1:
            future.set_exception(RpcTimeoutError("no answer"))
        else:
            future.set_result(None)
    assert monitor.dead_among([1, 2], started) == [1]  # confirmed during the shutdown
    assert monitor.dead_among([1, 2]) == [1]  # (without a start: any verdict counts)
