"""Unit tests of ``agent/_held.py`` with a stub agent: when a held request leaves,
and what a held request that cannot be sent does to its call."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from actorrpc.agent._held import HOLD_SECONDS, HeldRequest, HeldRequests
from actorrpc.errors import PeerUnreachableError
from actorrpc.protocol import MessageKind


class _Future:
    def __init__(self) -> None:
        self.error: BaseException | None = None


class _Undo:
    aborted = 0

    def abort(self) -> None:
        self.aborted += 1


class _StubAgent:
    """What HeldRequests uses of an agent: its send, pending table, inbox and stats."""

    def __init__(self, fail_with: BaseException | None = None) -> None:
        self.sent: list[tuple[int, MessageKind, int]] = []
        self.wake_requests: list[float] = []
        self.fail_with = fail_with
        self._pending: dict[int, Any] = {}
        self.tracer = SimpleNamespace(enabled=False)
        self.stats = SimpleNamespace(calls_sent={1: 0, 2: 0})
        self.inbox = SimpleNamespace(wake_io_by=lambda when, _: self.wake_requests.append(when))
        self._transport = SimpleNamespace(wake=lambda: None)

    def _send(self, rank: int, kind: MessageKind, message_id: int, body: bytes,
              buffers: list[Any]) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.sent.append((rank, kind, message_id))

    def _take_pending(self, message_id: int) -> Any:
        return self._pending.pop(message_id, None)


def _held(agent: _StubAgent, message_id: int, rank: int = 1, timeout: float = 60.0,
          undo: Any = None) -> HeldRequest:
    future = _Future()
    agent._pending[message_id] = SimpleNamespace(
        timeout=timeout, kind=MessageKind.REMOTE_CALL, on_result=None, future=future
    )
    return HeldRequest(rank, MessageKind.REMOTE_CALL, message_id, b"body", [], undo, future)


def test_a_held_request_is_due_after_hold_seconds_and_the_io_thread_is_told() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    before = time.monotonic()
    held.hold(_held(agent, 1))
    due = agent.wake_requests[-1]
    assert before + HOLD_SECONDS <= due <= time.monotonic() + HOLD_SECONDS
    assert 0 < held.seconds_to_due(time.monotonic()) <= HOLD_SECONDS  # type: ignore[operator]
    held.release_if_due(due - 1e-4)
    assert agent.sent == [] and held.pending
    held.release_if_due(due)
    assert agent.sent == [(1, MessageKind.REMOTE_CALL, 1)] and not held.pending
    assert held.seconds_to_due(due) is None
    assert agent.stats.calls_sent[1] == 1


def test_holding_another_sends_the_first_in_order() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    held.hold(_held(agent, 1))
    held.hold(_held(agent, 2, rank=2))
    assert agent.sent == [(1, MessageKind.REMOTE_CALL, 1)]
    held.release()
    assert agent.sent[-1] == (2, MessageKind.REMOTE_CALL, 2)


def test_send_as_merges_only_the_same_future_with_the_same_timeout() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    request = _held(agent, 7, timeout=60.0)
    held.hold(request)
    on_result = lambda value: None  # noqa: E731
    assert not held.send_as(_Future(), MessageKind.REMOTE_CALL_FETCH, on_result, 60.0)
    assert not held.send_as(request.future, MessageKind.REMOTE_CALL_FETCH, on_result, 5.0)
    assert agent.sent == [] and held.pending
    assert held.send_as(request.future, MessageKind.REMOTE_CALL_FETCH, on_result, 60.0)
    assert agent.sent == [(1, MessageKind.REMOTE_CALL_FETCH, 7)]
    pending = agent._pending[7]
    assert pending.kind == MessageKind.REMOTE_CALL_FETCH and pending.on_result is on_result
    assert held.merged == 1 and held.released == 0
    assert not held.send_as(request.future, MessageKind.REMOTE_CALL_FETCH, on_result, 60.0)


def test_release_of_a_given_future_leaves_another_held() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    request = _held(agent, 3)
    held.hold(request)
    held.release(_Future())
    assert held.pending
    held.release(request.future)
    assert not held.pending and agent.sent == [(1, MessageKind.REMOTE_CALL, 3)]


def test_a_held_request_that_cannot_be_sent_fails_its_call_and_undoes_its_forks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = PeerUnreachableError("worker 1 is gone")
    agent = _StubAgent(fail_with=error)
    held = HeldRequests(agent)  # type: ignore[arg-type]
    undo = _Undo()
    request = _held(agent, 4, undo=undo)
    held.hold(request)
    completed: list[tuple[Any, BaseException | None]] = []
    monkeypatch.setattr(
        "actorrpc.agent._held.complete",
        lambda future, value=None, error=None: completed.append((future, error)),
    )
    held.release()  # raises nothing: the call that made it returned long ago
    assert completed == [(request.future, error)]
    assert undo.aborted == 1 and 4 not in agent._pending


def test_the_next_call_of_the_holding_thread_sends_it_unless_it_merges() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]

    def merging() -> None:
        pass

    request = _held(agent, 5)
    held.hold(request)
    held.release_on_next_call(request.future, merging.__code__)
    merging()  # the merging call: the hook goes, the request stays
    hook_left = sys.getprofile() is None
    assert hook_left and held.pending
    held.release()

    other = _held(agent, 6)
    held.hold(other)
    held.release_on_next_call(other.future, merging.__code__)
    len(())  # any other call sends it first
    assert sys.getprofile() is None and not held.pending
    assert agent.sent[-1] == (1, MessageKind.REMOTE_CALL, 6)


def test_may_hold_is_false_under_a_profiler() -> None:
    assert HeldRequests.may_hold()
    sys.setprofile(lambda *_: None)
    try:
        answer = HeldRequests.may_hold()
    finally:
        sys.setprofile(None)
    assert answer is False


@pytest.fixture(autouse=True)
def _no_profile_left() -> Any:
    yield
    sys.setprofile(None)
