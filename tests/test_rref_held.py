"""``remote()`` holds its request until the creating thread's next call, so that a
``to_here()`` right after goes with it as one REMOTE_CALL_FETCH (agent/_held.py).

Runs on the session ``cluster`` (worker0 = this process). Reads of
``agent.held._held`` are plain attribute reads on purpose: any function call
(a property included) is the "next call" that sends a held request.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import actorrpc as rpc
from actorrpc.agent import current_agent
from actorrpc.protocol import MessageKind

from ._waiting import wait_for

pytestmark = pytest.mark.usefixtures("cluster")

WAIT = 20.0


def add(a: Any, b: Any) -> Any:
    return a + b


def fail(message: str) -> None:
    raise ValueError(message)


class NotPicklable:
    """Lives on its owner only: pickling it fails, its methods work."""

    def __reduce__(self) -> Any:
        raise TypeError("NotPicklable stays where it is")

    def answer(self) -> int:
        return 42


def _refuse_on_worker0() -> Any:
    if rpc.get_worker_info().name == "worker0":
        raise RuntimeError("this value cannot be rebuilt on worker0")
    return UnpicklableOnWorker0()


class UnpicklableOnWorker0:
    """Pickles everywhere; unpickling it fails on worker0 only."""

    def __reduce__(self) -> Any:
        return (_refuse_on_worker0, ())

    def answer(self) -> int:
        return 7


@rpc.functions.async_execution
def add_later(a: Any, b: Any) -> torch.futures.Future[Any]:
    return rpc.rpc_async("worker2", add, args=(a, b))


_CREATE_OR_FETCH = frozenset(
    {MessageKind.REMOTE_CALL, MessageKind.REMOTE_CALL_FETCH, MessageKind.RREF_FETCH}
)


@pytest.fixture
def kinds_sent_to_worker1(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The RRef creation and fetch requests this worker puts on its link to worker1
    from now on (liveness traffic, which may come at any time, is not counted)."""
    agent = current_agent()
    worker1 = agent.resolve("worker1").id
    kinds: list[str] = []
    send_to = agent.send_to

    def spy(member: Any, kind: Any, *rest: Any) -> None:
        if member.rank == worker1 and kind in _CREATE_OR_FETCH:
            kinds.append(kind.name)
        send_to(member, kind, *rest)

    monkeypatch.setattr(agent, "send_to", spy)
    return kinds


@pytest.mark.internals
@pytest.mark.timeout(60)
def test_remote_then_to_here_is_one_request(kinds_sent_to_worker1: list[str]) -> None:
    agent = current_agent()
    merged = agent.held.merged
    assert rpc.remote("worker1", add, args=(torch.ones(2), 1)).to_here().tolist() == [2.0, 2.0]
    rref = rpc.remote("worker1", add, args=(3, 4))
    value = rref.to_here()  # on a statement of its own: still the next call
    assert value == 7
    assert agent.held.merged == merged + 2
    assert kinds_sent_to_worker1 == ["REMOTE_CALL_FETCH"] * 2  # no RREF_FETCH
    assert rref.confirmed_by_owner()
    assert rref.to_here() == 7  # a second to_here() fetches again
    assert kinds_sent_to_worker1[2:] == ["RREF_FETCH"]


@pytest.mark.internals
@pytest.mark.timeout(60)
def test_a_remote_whose_rref_replaces_another_still_goes_with_its_to_here(
    kinds_sent_to_worker1: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rref = rpc.remote(...)`` drops the RRef held in ``rref`` before: its finalizer
    runs between remote() and to_here() and only hands its delete to the I/O thread
    (which queues it to ride on a later message, as a batch of one here, or alone): the
    held request still merges with its to_here()."""
    from actorrpc.agent import _riders

    monkeypatch.setattr(_riders, "BATCH_SIZE", 1)
    agent = current_agent()
    merged = agent.held.merged
    deletes = agent.riders.carried + agent.riders.sent_alone
    rref = rpc.remote("worker1", add, args=(1, 1))
    assert rref.to_here() == 2
    rref = rpc.remote("worker1", add, args=(2, 2))
    assert rref.to_here() == 4
    assert agent.held.merged == merged + 2
    assert kinds_sent_to_worker1 == ["REMOTE_CALL_FETCH"] * 2
    wait_for(lambda: agent.riders.carried + agent.riders.sent_alone > deletes, WAIT,
             "the first RRef's delete to leave")


@pytest.mark.timeout(60)
def test_a_held_request_leaves_at_the_next_call_of_its_thread() -> None:
    agent = current_agent()
    rref = rpc.remote("worker1", add, args=(1, 1))
    held_after_return = agent.held._held is not None
    len(())  # any call: the request goes before it runs
    held_after_call = agent.held._held is not None
    assert (held_after_return, held_after_call) == (True, False)
    wait_for(rref.confirmed_by_owner, WAIT, "the owner to answer remote()")
    assert rref.to_here() == 2


@pytest.mark.timeout(60)
def test_a_held_request_leaves_without_any_call_by_the_io_thread() -> None:
    agent = current_agent()
    rref = rpc.remote("worker1", add, args=(2, 2))
    # bytecode only, no call: the I/O thread sends it (within HOLD_SECONDS, once it
    # gets the GIL); the bound keeps a regression from spinning for ever
    spins = 0
    while agent.held._held is not None and spins < 200_000_000:
        spins += 1
    assert agent.held._held is None, "the I/O thread did not send the held request"
    wait_for(rref.confirmed_by_owner, WAIT, "the owner to answer remote()")


@pytest.mark.timeout(60)
def test_nothing_is_held_under_a_profiler() -> None:
    agent = current_agent()
    sys.setprofile(lambda *_: None)
    try:
        rref = rpc.remote("worker1", add, args=(1, 2))
        held = agent.held._held is not None
    finally:
        sys.setprofile(None)
    assert not held
    assert rref.to_here() == 3


@pytest.mark.internals
@pytest.mark.timeout(60)
def test_to_here_with_its_own_timeout_fetches_separately(
    kinds_sent_to_worker1: list[str],
) -> None:
    agent = current_agent()
    merged = agent.held.merged
    assert rpc.remote("worker1", add, args=(5, 5)).to_here(timeout=7) == 10
    assert agent.held.merged == merged
    assert kinds_sent_to_worker1 == ["REMOTE_CALL", "RREF_FETCH"]


def _merged_failure(func: Any, *args: Any) -> tuple[Any, BaseException | None]:
    """``remote(worker1, func, args)`` then ``to_here()`` at once (merged: nothing else is
    called in between, pytest.raises included): the RRef and what to_here() raised."""
    agent = current_agent()
    merged = agent.held.merged
    rref = rpc.remote("worker1", func, args=args)
    try:
        rref.to_here()
    except Exception as exc:  # noqa: BLE001 - the callers check it
        error: BaseException | None = exc
    else:
        error = None
    assert agent.held.merged == merged + 1
    return rref, error


@pytest.mark.timeout(60)
def test_merged_creation_error_is_raised_by_to_here() -> None:
    rref, error = _merged_failure(fail, "creation failed here")
    assert isinstance(error, ValueError) and "creation failed here" in str(error)
    with pytest.raises(ValueError, match="creation failed here"):
        rref.to_here()


@pytest.mark.timeout(60)
def test_merged_value_that_cannot_be_sent_fails_the_fetch_not_the_rref() -> None:
    rref, error = _merged_failure(NotPicklable)
    assert error is not None and "NotPicklable stays where it is" in str(error)
    assert rref._creation_error is None
    assert rref.rpc_sync().answer() == 42  # the value exists on its owner


@pytest.mark.timeout(60)
def test_merged_fetch_of_an_async_function() -> None:
    agent = current_agent()
    merged = agent.held.merged
    assert rpc.remote("worker1", add_later, args=(torch.ones(1), 2)).to_here().item() == 3.0
    assert agent.held.merged == merged + 1


@pytest.mark.timeout(60)
def test_remote_inside_a_dist_autograd_context_is_not_held() -> None:
    import actorrpc.autograd as dist_autograd

    agent = current_agent()
    merged = agent.held.merged
    with dist_autograd.context():
        rref = rpc.remote("worker1", add, args=(torch.ones(2, requires_grad=True), 1))
        held = agent.held._held is not None
        assert rref.to_here().tolist() == [2.0, 2.0]
    assert not held and agent.held.merged == merged


@pytest.mark.timeout(60)
def test_merged_value_the_creator_cannot_unpickle_fails_the_fetch_not_the_rref() -> None:
    rref, error = _merged_failure(UnpicklableOnWorker0)
    assert isinstance(error, rpc.DeserializationError), error
    assert "cannot be rebuilt on worker0" in str(error)
    assert rref._creation_error is None and rref._get_future().wait() is None
    assert rref.rpc_sync().answer() == 7  # the value lives on its owner
