"""``rpc_sync`` waits on a CallResult (agent/_call_result.py), not a torch future."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import actorrpc as rpc
from actorrpc.agent import _futures
from actorrpc.agent._call_result import CallResult, complete
from actorrpc.errors import ActorRpcError, RpcTimeoutError

pytestmark = pytest.mark.timeout(60)


def _sleep_then(value: Any, seconds: float) -> Any:
    threading.Event().wait(seconds)
    return value


def _fail() -> None:
    raise KeyError("no such key")


# -- unit: completion and waiting -------------------------------------------------------------


def test_a_call_result_gives_its_value_or_a_fresh_copy_of_its_error_each_time() -> None:
    done: CallResult[int] = CallResult("a call")
    complete(done, 7)
    complete(done, 8)  # a late second completion (a reply after a timeout) is ignored
    assert done.done() and done.wait() == 7 and done.wait() == 7
    failed: CallResult[int] = CallResult("a call")
    complete(failed, error=ValueError("bad"))
    complete(failed, 3)
    errors = []
    for _ in range(2):
        with pytest.raises(ValueError, match="bad") as caught:
            failed.wait()
        errors.append(caught.value)
    assert errors[0] is not errors[1]  # each wait raises its own copy (no shared traceback)


def test_a_waiter_gets_the_value_even_when_it_sees_done_before_the_value_is_set() -> None:
    """complete() marks done before it sets the value; a waiter that sees done must not
    return a value that is not there yet."""
    result: CallResult[str] = CallResult("a call")
    result._done = True  # as another thread's complete() has got this far
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(result.wait()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # waits for the gate, does not return None
    result._done = False
    complete(result, "value")
    waiter.join(5)
    assert got == ["value"]


def test_completing_twice_from_two_threads_opens_the_gate_once() -> None:
    failures: list[BaseException] = []
    for _ in range(200):
        result: CallResult[int] = CallResult()
        barrier = threading.Barrier(2)

        def finish(value: int, result: CallResult[int] = result,
                   barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                complete(result, value)
            except BaseException as exc:  # noqa: BLE001 - e.g. releasing the gate twice
                failures.append(exc)

        threads = [threading.Thread(target=finish, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert result.wait() in (0, 1)
        assert not result._gate.locked()
    assert failures == []  # released exactly once: a second release would have raised
    # what keeps a racing second completion from opening the gate again (as torch's
    # futures do): setting a result twice raises
    racing: CallResult[int] = CallResult()
    racing.set_result(1)
    with pytest.raises(RuntimeError):
        racing.set_result(2)
    with pytest.raises(RuntimeError):
        racing.set_exception(ValueError())


# -- against the session group --------------------------------------------------------------


def test_rpc_sync_makes_no_torch_future_but_rpc_async_does(
    cluster: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    init = _futures._init_torch_future
    me = threading.get_ident()

    def counted(future: Any, devices: Any) -> None:
        if threading.get_ident() == me:  # (not the agent's own, such as a liveness check's)
            made.append(future)
        init(future, devices)

    monkeypatch.setattr(_futures, "_init_torch_future", counted)
    assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    assert made == []
    assert rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1)).wait().tolist() == [2, 2]
    assert len(made) == 1


def test_rpc_sync_keeps_errors_timeouts_and_waits_from_other_threads(cluster: list[str]) -> None:
    with pytest.raises(KeyError, match="no such key"):
        rpc.rpc_sync("worker1", _fail)
    with pytest.raises(RpcTimeoutError):
        rpc.rpc_sync("worker1", _sleep_then, args=(1, 5.0), timeout=0.2)
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(
            rpc.rpc_sync("worker1", _sleep_then, args=(i, 0.05))))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == list(range(8))  # most of them waited on the gate


def test_rpc_sync_from_a_then_callback_refuses_to_deadlock(cluster: list[str]) -> None:
    outcome: list[BaseException] = []

    def nested(_: Any) -> None:
        try:
            rpc.rpc_sync("worker1", _sleep_then, args=(1, 0.0))
        except ActorRpcError as exc:
            outcome.append(exc)

    # (the reply comes after the callback is attached: one that came first would run it
    # at once, on this thread, where a nested rpc_sync is fine)
    rpc.rpc_async("worker1", _sleep_then, args=(0, 0.2)).then(nested).wait()
    assert outcome and "would deadlock" in str(outcome[0])


def test_callbacks_run_once_in_order_whether_added_before_or_after_completion(
    caplog: pytest.LogCaptureFixture,
) -> None:
    result: CallResult[int] = CallResult("call")
    seen: list[tuple[str, int]] = []

    def failing(_: CallResult[int]) -> None:
        raise ValueError("a callback's own error")

    result.add_done_callback(lambda r: seen.append(("first", r.wait())))
    result.add_done_callback(failing)  # logged, as torch does, and the others still run
    result.add_done_callback(lambda r: seen.append(("second", r.wait())))
    assert seen == []
    complete(result, 7)
    result.add_done_callback(lambda r: seen.append(("late", r.wait())))
    assert seen == [("first", 7), ("second", 7), ("late", 7)]
    assert "a CallResult callback failed" in caplog.text


def _race_callbacks_with_completion() -> list[int]:
    result: CallResult[None] = CallResult("call")
    runs: list[int] = []
    barrier = threading.Barrier(3)

    def add(base: int) -> None:
        barrier.wait()
        for i in range(base, base + 20):
            result.add_done_callback(lambda _, i=i: runs.append(i))

    def finish() -> None:
        barrier.wait()
        complete(result, None)

    threads = [threading.Thread(target=add, args=(0,)), threading.Thread(target=add, args=(20,)),
               threading.Thread(target=finish)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return runs


def test_callbacks_added_while_another_thread_completes_each_run_exactly_once() -> None:
    for _ in range(50):
        assert sorted(_race_callbacks_with_completion()) == list(range(40))


def test_remote_makes_its_torch_future_only_when_asked_and_the_same_each_time(
    cluster: list[str],
) -> None:
    rref = rpc.remote("worker1", _sleep_then, args=(5, 0.0))
    assert isinstance(rref._creation_future, CallResult)
    future = rref._get_future()
    assert isinstance(future, torch.futures.Future) and future is rref._get_future()
    assert future.wait() is None and rref.to_here() == 5


def test_a_local_rref_gives_the_same_completed_torch_future_each_time(
    cluster: list[str],
) -> None:
    rref = rpc.RRef(3)
    future = rref._get_future()
    assert isinstance(future, torch.futures.Future) and future is rref._get_future()
    assert future.done() and future.wait() is None


def test_a_creation_error_reads_as_one_even_before_remotes_own_callback_ran(
    cluster: list[str],
) -> None:
    # the gate of a CallResult opens before its callbacks run: a waiter may wake first
    from actorrpc.rref._rref import _fail_if_creation_fails

    rref = rpc.remote("worker1", _sleep_then, args=(1, 0.0))
    rref.to_here()
    creation: CallResult[None] = CallResult("creation")
    fetch = _futures.Future("fetch")
    _fail_if_creation_fails(fetch, creation, rref)
    complete(creation, error=RpcTimeoutError("RPC ran for more than set timeout (1 ms)"))
    assert fetch.done(), "the fetch was not failed with the creation"
    with pytest.raises(RpcTimeoutError, match="RRef creation via rpc.remote\\(\\) timed out"):
        fetch.wait()


def test_a_futures_description_names_the_call_and_the_worker(cluster: list[str]) -> None:
    """The description travels as a (what, where) pair, formatted only when shown."""
    future = rpc.rpc_async("worker1", _sleep_then, args=(5, 0.0))
    assert future.wait() == 5
    assert future.description == "_sleep_then on worker1"
    assert repr(future) == "<actorrpc.Future _sleep_then on worker1 done>"
    result: CallResult[int] = CallResult(("a pass", "worker2"))
    assert result.description == "a pass on worker2" and "a pass on worker2" in repr(result)
    assert CallResult("plain text").description == "plain text"
    assert CallResult(lambda: "made when needed").description == "made when needed"
