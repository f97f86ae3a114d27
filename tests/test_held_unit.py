"""Unit tests of ``agent/_held.py`` with a stub agent: when a held request leaves,
and what a held request that cannot be sent does to its call."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from actorrpc.agent import _held as _held_module
from actorrpc.agent._held import HOLD_SECONDS, HeldRequest, HeldRequests, ignore_while_holding
from actorrpc.agent._worker_info import validate_worker_name
from actorrpc.errors import PeerUnreachableError
from actorrpc.protocol import MessageKind

pytestmark = pytest.mark.internals  # (a stand-in agent)


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
        timeout=timeout, kind=MessageKind.REMOTE_CALL, on_result=None, future=future,
        description="remote()", on_undecodable=None,
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
    on_error = lambda error: None  # noqa: E731
    fetch = MessageKind.REMOTE_CALL_FETCH
    assert not held.send_as(_Future(), fetch, on_result, on_error, 60.0)
    assert not held.send_as(request.future, fetch, on_result, on_error, 5.0)
    assert agent.sent == [] and held.pending
    assert held.send_as(request.future, fetch, on_result, on_error, 60.0)
    assert agent.sent == [(1, fetch, 7)]
    pending = agent._pending[7]
    assert pending.kind == fetch and pending.on_result is on_result
    assert pending.on_undecodable is on_error
    assert held.merged == 1 and held.released == 0
    assert not held.send_as(request.future, fetch, on_result, on_error, 60.0)


def test_release_of_a_given_future_leaves_another_held() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    request = _held(agent, 3)
    held.hold(request)
    held.release(_Future())
    assert held.pending
    held.release(request.future)
    assert not held.pending and agent.sent == [(1, MessageKind.REMOTE_CALL, 3)]


def _held_that_fails(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, message_id: int
) -> tuple[_StubAgent, HeldRequests, HeldRequest, _Undo, list[Any]]:
    """A request held on a stub agent whose sends raise ``error``; the futures it
    completes are recorded as ``(future, error)`` in the returned list."""
    agent = _StubAgent(fail_with=error)
    held = HeldRequests(agent)  # type: ignore[arg-type]
    undo = _Undo()
    request = _held(agent, message_id, undo=undo)
    held.hold(request)
    completed: list[tuple[Any, BaseException | None]] = []
    monkeypatch.setattr(
        "actorrpc.agent._held.complete",
        lambda future, value=None, error=None: completed.append((future, error)),
    )
    return agent, held, request, undo, completed


def test_a_held_request_that_cannot_be_sent_fails_its_call_and_undoes_its_forks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = PeerUnreachableError("worker 1 is gone")
    agent, held, request, undo, completed = _held_that_fails(monkeypatch, error, 4)
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


def test_the_hook_sends_with_the_collector_paused_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sending from the profile hook allocates while a frame is being entered: no
    collection may start there (a SIGSEGV was once seen in this hook); after it, the
    collector is as it was (on, or off if the program turned it off)."""
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    seen: list[bool] = []
    send = agent._send

    def recording_send(*args: Any) -> None:
        seen.append(gc.isenabled())
        send(*args)

    monkeypatch.setattr(agent, "_send", recording_send)

    def merging() -> None:
        pass

    was_enabled = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            request = _held(agent, 7 + enabled)
            held.hold(request)
            held.release_on_next_call(request.future, merging.__code__)
            len(())  # the next call: the hook sends it
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()
    assert seen == [False, False]
    assert [m for _, _, m in agent.sent] == [8, 7]


def test_overlapping_hook_sends_keep_the_collector_paused_until_the_last_ends() -> None:
    """Two threads' hooks sending at once: the first to finish must not turn the collector
    back on while the other still sends; it is on again once both are done."""
    first_sending, second_sending, first_done = (threading.Event() for _ in range(3))
    seen: list[bool] = []

    class _Held:
        def __init__(self, role: str) -> None:
            self.role = role

        def release(self, future: Any) -> None:
            if self.role == "first":
                first_sending.set()
                assert second_sending.wait(10)
            else:
                second_sending.set()
                assert first_done.wait(10)
                seen.append(gc.isenabled())  # the first one has finished by now

    was_enabled = gc.isenabled()
    gc.enable()
    try:
        first = threading.Thread(target=_held_module._release_from_hook,
                                 args=(_Held("first"), None))
        first.start()
        assert first_sending.wait(10)
        second = threading.Thread(target=_held_module._release_from_hook,
                                  args=(_Held("second"), None))
        second.start()
        first.join(10)
        first_done.set()
        second.join(10)
        assert not first.is_alive() and not second.is_alive()
        assert seen == [False]
        assert gc.isenabled()
    finally:
        (gc.enable if was_enabled else gc.disable)()


class _Finalized:
    """A finalizer registered as one to ignore, which calls actorrpc functions (as
    ``RRef.__del__`` does)."""

    calls = 0

    def __del__(self) -> None:
        # a Python call of actorrpc's and its return inside it, twice
        _Finalized.calls += len(validate_worker_name("worker0"))
        _Finalized.calls += len(validate_worker_name("worker1"))


class _OtherFinalizer:
    def __del__(self) -> None:
        _Finalized.calls += 1


ignore_while_holding(_Finalized.__del__.__code__)


@pytest.fixture
def no_collection() -> Iterator[None]:
    """No garbage collection meanwhile: it could run an earlier test's finalizer, which
    (rightly) sends a held request."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_collection")
def test_a_finalizer_registered_to_be_ignored_does_not_send_it() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]

    def merging() -> None:
        pass

    doomed = _Finalized()
    other = _held(agent, 8)
    held.hold(other)
    held.release_on_next_call(other.future, merging.__code__)
    del doomed  # its __del__ runs, and calls actorrpc code: neither counts
    still_held = held.pending
    merging()
    hook_left = sys.getprofile() is None
    assert still_held and hook_left and held.pending and _Finalized.calls > 0
    assert agent.sent == []

    held.release()
    request = _held(agent, 9)
    doomed = _Finalized()
    held.hold(request)
    held.release_on_next_call(request.future, merging.__code__)
    del doomed
    len(())  # an ordinary call after the finalizer: it goes
    assert sys.getprofile() is None and not held.pending
    assert agent.sent == [(1, MessageKind.REMOTE_CALL, 8), (1, MessageKind.REMOTE_CALL, 9)]


class _FinalizedDropping:
    """A registered finalizer inside which code of another package runs (as the
    collector may run any object's finalizer)."""

    def __init__(self) -> None:
        self.other: object = _OtherFinalizer()

    def __del__(self) -> None:
        self.other = None


ignore_while_holding(_FinalizedDropping.__del__.__code__)


@pytest.mark.usefixtures("no_collection")
def test_another_finalizer_run_inside_an_ignored_one_sends_it() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    doomed = _FinalizedDropping()
    request = _held(agent, 10)
    held.hold(request)

    def merging() -> None:
        pass

    held.release_on_next_call(request.future, merging.__code__)
    calls = _Finalized.calls
    del doomed  # its __del__ frees the other: that one may send, so the request goes first
    assert _Finalized.calls == calls + 1
    assert sys.getprofile() is None and not held.pending
    assert agent.sent == [(1, MessageKind.REMOTE_CALL, 10)]


def test_may_hold_is_false_under_a_profiler_or_when_turned_off() -> None:
    held = HeldRequests(_StubAgent())  # type: ignore[arg-type]
    assert held.may_hold() is (sys.version_info < (3, 12))
    sys.setprofile(lambda *_: None)
    try:
        answer = held.may_hold()
    finally:
        sys.setprofile(None)
    assert answer is False
    assert HeldRequests(_StubAgent(), enabled=False).may_hold() is False  # type: ignore[arg-type]


def test_the_option_turns_holding_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import actorrpc as rpc

    assert rpc.ZmqRpcBackendOptions().hold_remote_calls is True
    monkeypatch.setenv("ACTORRPC_HOLD_REMOTE_CALLS", "0")
    assert rpc.ZmqRpcBackendOptions().hold_remote_calls is False


def test_a_request_that_expired_while_held_is_never_sent() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    undo = _Undo()
    held.hold(_held(agent, 8, undo=undo))
    del agent._pending[8]  # its deadline passed (the deadline code failed its future)
    held.release()
    assert agent.sent == [] and undo.aborted == 1 and not held.pending


def test_a_request_held_when_the_worker_closes_is_discarded() -> None:
    agent = _StubAgent()
    held = HeldRequests(agent)  # type: ignore[arg-type]
    undo = _Undo()
    held.hold(_held(agent, 9, undo=undo))
    held.discard()
    held.release()
    assert agent.sent == [] and undo.aborted == 1 and not held.pending


def test_ctrl_c_while_sending_fails_the_call_and_is_raised_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, held, request, undo, completed = _held_that_fails(monkeypatch, KeyboardInterrupt(), 10)
    with pytest.raises(KeyboardInterrupt):
        held.release()
    [(future, error)] = completed
    assert future is request.future and "interrupted before it was sent" in str(error)
    assert undo.aborted == 1 and not held.pending


def test_a_send_in_progress_keeps_it_pending_and_other_threads_wait_for_it() -> None:
    entered, proceed = threading.Event(), threading.Event()
    agent = _StubAgent()
    original = agent._send
    order: list[str] = []

    def slow_send(*args: Any) -> None:
        entered.set()
        assert proceed.wait(10)
        original(*args)
        order.append("sent")

    agent._send = slow_send  # type: ignore[method-assign]
    held = HeldRequests(agent)  # type: ignore[arg-type]
    waiting = threading.Event()

    class SpyLock:
        """The held table's lock, noting when a second thread starts to wait for it."""

        def __init__(self, lock: Any) -> None:
            self._lock = lock

        def __enter__(self) -> None:
            if threading.current_thread() is not sender:
                waiting.set()
            self._lock.acquire()

        def __exit__(self, *_: Any) -> None:
            self._lock.release()

    held.hold(_held(agent, 11))
    held._sending = SpyLock(held._sending)  # type: ignore[assignment]
    sender = threading.Thread(target=held.release)
    sender.start()
    assert entered.wait(10)
    assert held.pending  # taken out, not yet on its link: a send must wait for it
    other = threading.Thread(target=lambda: (held.release(), order.append("other went on")))
    other.start()
    assert waiting.wait(10)
    proceed.set()
    sender.join(10)
    other.join(10)
    assert order == ["sent", "other went on"]
    assert agent.sent == [(1, MessageKind.REMOTE_CALL, 11)] and not held.pending


@pytest.fixture(autouse=True)
def _no_profile_left() -> Any:
    yield
    sys.setprofile(None)
