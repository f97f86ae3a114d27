"""An owner answers ``remote()`` first and enters the value in its tables after the reply
left (``IncomingRequest.after_reply``, rref/_remote.py): the creator's next messages about
the RRef may be served before that, and each must still come out right.

Runs on the session ``cluster`` (worker0 = this process). Worker1's registration of a
created value is held at a gate (an event, opened by the test) to make the window wide.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any

import pytest

import actorrpc as rpc
from actorrpc.agent import current_agent
from actorrpc.rref import rref_context

from ._waiting import wait_for

pytestmark = [pytest.mark.usefixtures("cluster"), pytest.mark.timeout(60)]

WAIT = 20.0

# worker1's side: the gate and what passed it
_GATE = threading.Event()
_PASSED: list[Any] = []
_LOGGED: list[str] = []


def add(a: Any, b: Any) -> Any:
    return a + b


def created_value(a: Any, b: Any) -> Any:
    return a + b


def _close_gate(fail: bool = False) -> None:
    """Hold worker1's registration of created values until ``_open_gate`` (or raise in it)."""
    ctx = rref_context()
    original = type(ctx).on_remote_call
    _GATE.clear()
    _PASSED.clear()

    def gated(rref_id: Any, fork_id: Any) -> Any:
        if not _GATE.wait(WAIT):
            raise AssertionError("the test never opened the gate")
        _PASSED.append(rref_id)
        if fail:
            raise RuntimeError("registration failed on purpose")
        return original(ctx, rref_id, fork_id)

    ctx.on_remote_call = gated  # type: ignore[method-assign]


def _open_gate() -> None:
    _GATE.set()


def _restore() -> None:
    ctx = rref_context()
    vars(ctx).pop("on_remote_call", None)
    _GATE.set()


def _passed() -> int:
    return len(_PASSED)


def _owner_state(rref_id: Any) -> str:
    """``absent``, ``pending`` or ``ready``: worker1's owner entry for ``rref_id``."""
    state = rref_context().owners.get(tuple(rref_id))
    return "absent" if state is None else ("ready" if state.is_ready() else "pending")


def _tombstoned(fork_id: Any) -> bool:
    return rref_context().is_tombstoned(tuple(fork_id))


def _forks_of(rref_id: Any) -> int:
    return len(rref_context().forks.get(tuple(rref_id), ()))


def _capture_agent_log() -> None:
    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _LOGGED.append(record.getMessage())

    _LOGGED.clear()
    logging.getLogger("actorrpc.agent").addHandler(Keep())


def _logged() -> list[str]:
    return list(_LOGGED)


def _requests_being_served() -> list[str]:
    return current_agent().requests_being_served()


@pytest.fixture
def gate() -> Any:
    rpc.rpc_sync("worker1", _close_gate)
    try:
        yield
    finally:
        rpc.rpc_sync("worker1", _restore)


def _on_worker1(func: Any, *args: Any) -> Any:
    return rpc.rpc_sync("worker1", func, args=args)


@pytest.mark.usefixtures("gate")
def test_value_comes_back_before_the_owner_enters_it() -> None:
    rref = rpc.remote("worker1", add, args=(2, 3), timeout=10)
    rref_id = rref._rref_id
    assert rref.to_here(timeout=10) == 5  # merged: answered while registration waits
    assert _on_worker1(_passed) == 0 and _on_worker1(_owner_state, rref_id) == "absent"
    _on_worker1(_open_gate)
    wait_for(lambda: _on_worker1(_owner_state, rref_id) == "ready", WAIT, "the value entered")
    assert _on_worker1(_forks_of, rref_id) == 1
    del rref
    gc.collect()
    wait_for(lambda: _on_worker1(_owner_state, rref_id) == "absent", WAIT, "the fork deleted")


@pytest.mark.usefixtures("gate")
def test_a_fetch_served_before_the_value_is_entered_gets_it() -> None:
    rref = rpc.remote("worker1", add, args=(4, 5), timeout=10)
    assert rref.to_here(timeout=10) == 9
    fetched: list[Any] = []
    second = threading.Thread(target=lambda: fetched.append(rref.to_here()))
    second.start()  # a plain RREF_FETCH: the owner makes a pending entry and waits
    wait_for(lambda: _on_worker1(_owner_state, rref._rref_id) == "pending", WAIT,
             "the fetch's pending entry")
    _on_worker1(_open_gate)
    second.join(WAIT)
    assert fetched == [9]
    assert _on_worker1(_owner_state, rref._rref_id) == "ready"
    assert _on_worker1(_forks_of, rref._rref_id) == 1


@pytest.mark.usefixtures("gate")
def test_a_delete_served_before_the_value_is_entered_frees_it() -> None:
    rref = rpc.remote("worker1", add, args=(1, 1), timeout=10)
    assert rref.to_here(timeout=10) == 2
    rref_id, fork_id = rref._rref_id, rref._fork_id
    del rref
    gc.collect()  # the delete goes (riding, or alone within 10 ms) and leaves a tombstone
    wait_for(lambda: _on_worker1(_tombstoned, fork_id), WAIT, "the delete served")
    _on_worker1(_open_gate)
    wait_for(lambda: _on_worker1(_passed) == 1, WAIT, "the registration run")
    assert _on_worker1(_owner_state, rref_id) == "absent"  # not entered: nobody holds it
    assert _on_worker1(_forks_of, rref_id) == 0


def test_a_failed_registration_is_logged_and_the_request_still_finishes() -> None:
    rpc.rpc_sync("worker1", _close_gate, args=(True,))
    try:
        _on_worker1(_capture_agent_log)
        _on_worker1(_open_gate)
        rref = rpc.remote("worker1", created_value, args=(20, 22), timeout=10)
        assert rref.to_here(timeout=10) == 42  # the reply left before the bookkeeping failed
        logged = wait_for(lambda: _on_worker1(_logged), WAIT, "the failure logged")
        assert any("the work left after a reply failed" in line for line in logged), logged
        # the request counts as served (nothing left for shutdown to wait for)
        wait_for(lambda: not [r for r in _on_worker1(_requests_being_served)
                              if "created_value" in r], WAIT, "the request finished")
        assert rpc.rpc_sync("worker1", add, args=(1, 2)) == 3
    finally:
        rpc.rpc_sync("worker1", _restore)


class Echoer:
    def echo(self, value: Any) -> Any:
        return value


def _refuse(message: str) -> None:
    raise ValueError(message)


class RefusedOnArrival:
    """Pickles; unpickling it fails (as on any worker)."""

    def __reduce__(self) -> Any:
        return (_refuse, ("cannot be rebuilt here",))


@pytest.mark.usefixtures("gate")
def test_a_proxy_call_skipped_before_the_value_is_entered_keeps_the_order() -> None:
    # per-caller FIFO: a call whose payload does not unpickle on the owner skips its
    # sequence number; here it does so while the owner has not entered the value yet
    rref = rpc.remote("worker1", Echoer, timeout=10)
    refused = rref.rpc_async(timeout=10).echo(RefusedOnArrival())
    with pytest.raises(Exception, match="cannot be rebuilt here"):
        refused.wait()
    following = rref.rpc_async(timeout=10).echo(7)  # waits for the value, not for ever
    _on_worker1(_open_gate)
    assert following.wait() == 7
    assert rref.rpc_sync(timeout=10).echo(8) == 8


def test_a_ticket_freed_under_the_proxy_lock_only_queues_its_skip() -> None:
    # the collector may free a ticket anywhere, even while its thread holds the lock the
    # skip takes: the finalizer only queues the skip (I/O thread, then the pool)
    from actorrpc.rref import _proxy

    never = (0, 10**9)  # an RRef this worker does not own: the skip is kept for it
    ctx = rref_context()
    ticket = _proxy._Ticket(never, 1, 0)
    with _proxy._sequences_lock:
        del ticket
    wait_for(lambda: ctx.early_skips.get((never, 1)) == [0], WAIT, "the skip kept")
    with _proxy._sequences_lock:
        ctx.early_skips.pop((never, 1), None)



class _Dispatcher:
    """What ``MessageDispatcher._finish_request`` uses of a dispatcher, recording."""

    def __init__(self, waiting_requests: int, send_fails: bool = False) -> None:
        from types import SimpleNamespace

        self.events: list[str] = []
        self._inflight_lock = threading.Lock()
        self._inflight = 1
        self._serving: dict[Any, Any] = {}
        self._unstarted = {1: waiting_requests}  # another request of worker 1 waits: rides
        self._pool = SimpleNamespace(on_pool_thread=lambda: True)
        self.riders = SimpleNamespace(add_reply=lambda *args: self.events.append("rides"))
        self.name = "stub"
        self._send_fails = send_fails

    def _send(self, *args: Any) -> None:
        if self._send_fails:
            raise OSError("link gone")
        self.events.append("sent")

    def _reply_exception(self, *args: Any) -> None:
        self.events.append("error reply")

    def _reply(self, *args: Any) -> bool:
        from actorrpc.agent._dispatch import MessageDispatcher

        return MessageDispatcher._reply(self, *args)  # type: ignore[arg-type]

    def _run_after_reply(self, work: Any) -> None:
        from actorrpc.agent._dispatch import MessageDispatcher

        MessageDispatcher._run_after_reply(self, work)  # type: ignore[arg-type]


@pytest.mark.internals
def test_a_serving_scopes_work_runs_only_after_a_reply_that_left() -> None:
    """``optional_after_reply`` (a call hook's ``CallRecord.after_reply``) runs after the
    request's own ``after_reply`` once the reply was handed to the link; it is dropped
    when the reply waits to ride on a later message (nothing may hold it back) or could
    not be sent, and for a failed request."""
    from actorrpc.agent._calls import IncomingRequest
    from actorrpc.agent._dispatch import Failure, MessageDispatcher
    from actorrpc.protocol import MessageKind

    def finish(dispatcher: _Dispatcher, outcome: Any) -> list[str]:
        request = IncomingRequest(
            MessageKind.CALL, current_agent().info, 7, None,
            after_reply=lambda: dispatcher.events.append("after"),
            optional_after_reply=lambda: dispatcher.events.append("optional"),
        )
        MessageDispatcher._finish_request(dispatcher, 1, 7, outcome, request)  # type: ignore[arg-type]
        assert dispatcher._inflight == 0
        return dispatcher.events

    assert finish(_Dispatcher(waiting_requests=0), 42) == ["sent", "after", "optional"]
    assert finish(_Dispatcher(waiting_requests=2), 42) == ["rides", "after"]
    failed = _Dispatcher(waiting_requests=0, send_fails=True)
    assert finish(failed, 42) == ["error reply", "after"]
    errored = Failure(ValueError("the function raised"), None)
    assert finish(_Dispatcher(waiting_requests=0), errored) == ["error reply", "after"]
