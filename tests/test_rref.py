"""RRefs over real processes: the session ``cluster`` (worker0 = this process,
worker1 and worker2 = subprocesses), plus private groups for shutdown leaks.

Functions and classes used remotely are defined at module level, so the workers
import them from ``tests.test_rref``. Nothing here synchronises with sleep:
every wait is on a condition (an event, a future, or debug info polled through
RPC) with a deadline.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import actorrpc as rpc
from actorrpc.rref import rref_context
from actorrpc.rref._context import GloballyUniqueId, settle

from ._waiting import wait_until

# How many remote() -> share -> drop cycles the load test runs (the issue asks for 10,000).
LOAD_CYCLES = int(os.environ.get("ACTORRPC_RREF_LOAD_CYCLES", "10000"))
LOAD_IN_FLIGHT = 12  # cycles in flight at once (each holds a pool thread on its creator)
WAIT = 20.0  # seconds any condition below may take before the test fails

# -- functions and classes run on the workers ---------------------------------------------------

_store: dict[str, Any] = {}  # per-process: values tests park on a worker
_store_lock = threading.Lock()
_events: dict[str, threading.Event] = {}
_weak: dict[str, weakref.ref[Any]] = {}
_live: weakref.WeakSet[Any] = weakref.WeakSet()  # load-test values alive in this process
_futures: dict[str, list[torch.futures.Future[Any]]] = {}


class Tracked:
    """A value whose lifetime the tests watch through a weakref on its owner."""

    def __init__(self, key: str, payload: Any = None) -> None:
        self.key = key
        self.payload = payload


class LoadValue:
    """A load-test value; the instances alive in a process are in ``_live``."""

    def __init__(self, i: int) -> None:
        self.i = i
        _live.add(self)


def add(a: Any, b: Any) -> Any:
    return a + b


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def make_tracked(key: str, payload: Any = None) -> Tracked:
    value = Tracked(key, payload)
    _weak[key] = weakref.ref(value)
    return value


def is_alive(key: str) -> bool:
    ref = _weak.get(key)
    return ref is not None and ref() is not None


def local_tracked_rref(key: str) -> rpc.RRef[Tracked]:
    """Case 3 as a return value: an RRef owned by the callee."""
    return rpc.RRef(make_tracked(key))


def owner_rrefs_drop_to(count: int, timeout: float) -> bool:
    """On the owner: wait (polling) until it holds at most ``count`` owner RRefs."""
    return wait_until(lambda: debug_info()["num_owner_rrefs"] <= count, timeout)


def debug_info() -> dict[str, int]:
    import gc

    gc.collect()  # only cyclic garbage left by other code; RRefs need none
    return rpc.get_rref_debug_info()


def _event(key: str) -> threading.Event:
    with _store_lock:
        return _events.setdefault(key, threading.Event())


def wait_event_then(key: str, value: Any, limit: float = WAIT) -> Any:
    """Block until ``set_event(key)`` (at most ``limit`` s), then return ``value``."""
    _event(key).wait(limit)
    return value


def set_event(key: str) -> None:
    _event(key).set()


def store(key: str, value: Any) -> None:
    with _store_lock:
        _store[key] = value


def unstore(key: str) -> None:
    with _store_lock:
        _store.pop(key, None)


def rref_facts(rref: rpc.RRef[Any]) -> dict[str, Any]:
    """What a callee sees of an RRef it received."""
    return {
        "is_owner": rref.is_owner(),
        "confirmed": rref.confirmed_by_owner(),
        "owner": rref.owner_name(),
        "owner_id": rref.owner().id,
        "str": str(rref),
        "value": rref.local_value() if rref.is_owner() else rref.to_here(),
    }


def to_here_of(rref: rpc.RRef[Any]) -> Any:
    return rref.to_here()


def key_of(rref: rpc.RRef[Tracked]) -> str:
    value = rref.local_value() if rref.is_owner() else rref.to_here()
    return value.key


def sum_rrefs(rrefs: list[rpc.RRef[Any]], extra: dict[str, rpc.RRef[Any]]) -> Any:
    total = sum(r.to_here() for r in rrefs)
    return total + sum(r.to_here() for r in extra.values())


def remote_add_on(dest: str, a: Any, b: Any) -> rpc.RRef[Any]:
    """Case 4 as a return value: a user RRef (owned by ``dest``) returned to the caller."""
    return rpc.remote(dest, add, args=(a, b))


def nested_rrefs(dest: str) -> list[rpc.RRef[Any]]:
    return [rpc.remote(dest, add, args=(torch.ones(2, 2), 1)),
            rpc.remote(dest, add, args=(torch.ones(2, 2), 2))]


def rref_forward_chain(dst: int, world_size: int, rref: rpc.RRef[Any], ttl: int) -> Any:
    """torch's test_rref_forward_chain: each hop wraps the rest of the chain in a remote()."""
    if ttl > 0:
        ret_rref = rpc.remote(f"worker{dst}", rref_forward_chain,
                              args=((dst + 1) % world_size, world_size, rref, ttl - 1))
        return [ret_rref]
    return rref.to_here()


def forward_to(rref: rpc.RRef[Any], dest: str, func: Callable[..., Any]) -> Any:
    return rpc.rpc_sync(dest, func, args=(rref,))


class Counter:
    """A small actor."""

    def __init__(self, start: int) -> None:
        self.value = start
        self.lock = threading.Lock()

    def incr(self, n: int) -> int:
        with self.lock:
            self.value += n
            return self.value

    def get(self) -> int:
        return self.value


class Journal:
    """An actor recording the order calls reach it."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int]] = []
        self.pending: list[tuple[torch.futures.Future[Any], int]] = []

    def append(self, tag: str, i: int) -> int:
        self.items.append((tag, i))
        return len(self.items)

    def take(self, tag: str, i: int, unused: Any = None) -> int:
        return self.append(tag, i)

    def snapshot(self) -> list[tuple[str, int]]:
        return list(self.items)

    @rpc.functions.async_execution
    def wait_for_release(self, i: int) -> torch.futures.Future[int]:
        future: torch.futures.Future[int] = torch.futures.Future()
        self.pending.append((future, i))
        return future

    def release(self) -> int:
        pending, self.pending = self.pending, []
        for future, i in pending:
            future.set_result(i * 2)
        return len(pending)


class AsyncExec:
    """async_execution under staticmethod/classmethod (decorator innermost), plain and via RRef."""

    def __init__(self, base: int = 0) -> None:
        self.base = base

    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to: str, x: Any, y: Any, z: Any) -> torch.futures.Future[Any]:
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to: str, x: Any, y: Any, z: Any) -> torch.futures.Future[Any]:
        ret_fut: torch.futures.Future[Any] = torch.futures.Future()
        rpc.rpc_async(to, torch.add, args=(x, y)).then(
            lambda fut: ret_fut.set_result(fut.wait() + z)
        )
        return ret_fut

    @rpc.functions.async_execution
    def bound_async_add(self, to: str, x: Any, y: Any) -> torch.futures.Future[Any]:
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + self.base)


@rpc.functions.async_execution
def async_add(to: str, x: Any, y: Any) -> torch.futures.Future[Any]:
    return rpc.rpc_async(to, torch.add, args=(x, y))


@rpc.functions.async_execution
def async_not_a_future() -> int:
    return 1


@rpc.functions.async_execution
def parked(key: str, i: int) -> torch.futures.Future[int]:
    """Returns a Future completed later by :func:`release_parked` (holds no thread)."""
    future: torch.futures.Future[int] = torch.futures.Future()
    with _store_lock:
        _futures.setdefault(key, []).append(future)
    return future.then(lambda fut: fut.wait() + i)


def parked_count(key: str) -> int:
    with _store_lock:
        return len(_futures.get(key, []))


def release_parked(key: str, value: int) -> int:
    with _store_lock:
        futures = _futures.pop(key, [])
    for future in futures:
        future.set_result(value)
    return len(futures)


def hammer(rref: rpc.RRef[Journal], tag: str, n: int) -> int:
    """Another caller: ``n`` in-flight appends from this worker."""
    futures = [rref.rpc_async(timeout=WAIT).append(tag, i) for i in range(n)]
    torch.futures.wait_all(futures)
    return n


class BadOnArrival:
    """Pickles fine, fails to unpickle on the receiver."""

    def __reduce__(self) -> Any:
        return raise_value_error, ("cannot unpickle BadOnArrival",)


# load test: one cycle = create with remote(), share with a third worker, drop.


def load_cycle(owner: str, third: str, i: int) -> int:
    kind = i % 5
    if kind == 4:  # the owner makes a local RRef and sends it out (case 3)
        return rpc.rpc_sync(owner, _owner_shares, args=(third, i))
    rref = rpc.remote(owner, LoadValue, args=(i,))  # case 1
    if kind == 0:  # user -> user (case 4), or -> owner (case 2) when third is the owner
        return rpc.rpc_sync(third, _load_touch, args=(rref,))
    if kind == 1:  # there and back: the third returns the RRef (case 4 in a reply)
        back = rpc.rpc_sync(third, _load_echo, args=(rref,))
        return back.to_here().i
    if kind == 2:  # to the owner (case 2), which forwards it to the third (case 3)
        return rpc.rpc_sync(owner, forward_to, args=(rref, third, _load_touch))
    # kind 3: the third forwards it to the owner (case 4 then case 2)
    return rpc.rpc_sync(third, forward_to, args=(rref, owner, _load_touch))


def _load_touch(rref: rpc.RRef[LoadValue]) -> int:
    if rref.is_owner():
        return rref.local_value().i
    assert rref.confirmed_by_owner()
    return rref.to_here().i


def _load_echo(rref: rpc.RRef[LoadValue]) -> rpc.RRef[LoadValue]:
    return rref


def _owner_shares(third: str, i: int) -> int:
    return rpc.rpc_sync(third, _load_touch, args=(rpc.RRef(LoadValue(i)),))


def live_load_values() -> int:
    import gc

    gc.collect()
    return len(_live)


# -- helpers (worker0 side) -----------------------------------------------------------------------

WORKERS = ("worker0", "worker1", "worker2")
ZERO = {"num_owner_rrefs": 0, "num_forks": 0, "num_pending_users": 0, "num_pending_children": 0}


def wait_for(condition: Callable[[], Any], what: str, limit: float = WAIT) -> Any:
    """Poll ``condition`` until it is truthy; fail after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    pause = threading.Event()
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        pause.wait(0.01)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r}; {_describe_tables()})")


def tables(worker: str) -> dict[str, int]:
    info = rpc.rpc_sync(worker, debug_info)
    return {k: info[k] for k in ZERO}


def wait_tables_empty(workers: tuple[str, ...] = WORKERS, limit: float = WAIT) -> None:
    """Wait until no worker owns, forks or waits on any RRef (polling all, so each collects)."""
    wait_for(lambda: all([tables(w) == ZERO for w in workers]) or None,
             f"empty RRef tables on {', '.join(workers)}", limit)


def _describe_tables() -> str:
    return ", ".join(f"{w}: {tables(w)}" for w in WORKERS)


def remote_alive(worker: str, key: str) -> bool:
    return bool(rpc.rpc_sync(worker, is_alive, args=(key,)))


USER_STR = re.compile(
    r"UserRRef\(RRefId = GloballyUniqueId\(created_on=(\d+), local_id=(\d+)\), "
    r"ForkId = GloballyUniqueId\(created_on=(\d+), local_id=(\d+)\)\)"
)
OWNER_STR = re.compile(r"OwnerRRef\(GloballyUniqueId\(created_on=(\d+), local_id=(\d+)\)\)")

pytestmark = pytest.mark.usefixtures("cluster")


# -- basics ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_remote_to_here_on_other_worker() -> None:
    for to in ("worker1", 1, rpc.get_worker_info("worker1")):
        rref = rpc.remote(to, add, args=(torch.ones(2), 1))
        assert torch.equal(rref.to_here(), torch.tensor([2.0, 2.0]))
        assert torch.equal(rref.to_here(timeout=5), torch.tensor([2.0, 2.0]))  # again
    rref = rpc.remote("worker2", torch.add, kwargs={"input": torch.ones(3), "other": 2})
    assert rref.to_here().tolist() == [3.0, 3.0, 3.0]


@pytest.mark.timeout(60)
def test_remote_to_self() -> None:
    rref = rpc.remote("worker0", add, args=(torch.ones(2), 2))
    assert rref.is_owner() and rref.owner_name() == "worker0"
    assert rref.to_here().tolist() == [3.0, 3.0]
    assert rref.local_value().tolist() == [3.0, 3.0]
    assert rref.confirmed_by_owner()
    assert rpc.rpc_sync("worker1", rref_facts, args=(rref,))["value"].tolist() == [3.0, 3.0]
    del rref
    wait_tables_empty(("worker0",))


@pytest.mark.timeout(60)
def test_owner_queries() -> None:
    rref = rpc.remote("worker1", add, args=(1, 2))
    assert rref.to_here() == 3
    assert not rref.is_owner()
    assert rref.owner() == rpc.get_worker_info("worker1")
    assert repr(rref.owner()) == "WorkerInfo(id=1, name=worker1)"
    assert rref.owner_name() == "worker1"
    wait_for(rref.confirmed_by_owner, "the creator's RRef to be confirmed")
    local = rpc.RRef(5)
    assert local.is_owner() and local.owner_name() == "worker0" and local.confirmed_by_owner()
    assert local.to_here() == 5 and local.local_value() == 5
    assert rref._get_future().done()  # the creation future completed


@pytest.mark.timeout(60)
def test_str_and_repr_forms() -> None:
    local = rpc.RRef(1)
    match = OWNER_STR.fullmatch(str(local))
    assert match and match.group(1) == "0", str(local)
    rref = rpc.remote("worker1", add, args=(1, 1))
    match = USER_STR.fullmatch(str(rref))
    assert match, str(rref)
    created, rid, fork_created, fid = (int(g) for g in match.groups())
    assert created == fork_created == 0 and fid == rid + 1  # ids from one counter
    assert int(OWNER_STR.fullmatch(str(local)).group(2)) < rid  # type: ignore[union-attr]
    assert repr(rref) == f"<{rref} owned by WorkerInfo(id=1, name=worker1)>"
    # the owner sees the same RRef id
    facts = rpc.rpc_sync("worker1", rref_facts, args=(rref,))
    assert facts["str"] == f"OwnerRRef(GloballyUniqueId(created_on=0, local_id={rid}))"


@pytest.mark.timeout(60)
def test_local_value_on_non_owner_raises_clear_error() -> None:
    rref = rpc.remote("worker1", add, args=(1, 1))
    with pytest.raises(RuntimeError) as info:
        rref.local_value()
    message = str(info.value)
    assert isinstance(info.value, rpc.RRefError)
    assert re.search(
        r"For UserRRef\(rref_id=GloballyUniqueId\(created_on=0, local_id=\d+\), "
        r"fork_id=GloballyUniqueId\(created_on=0, local_id=\d+\)\), can't call localValue\(\) "
        r"on user WorkerInfo\(id=0, name=worker0\)\. Call it on owner "
        r"WorkerInfo\(id=1, name=worker1\)", message), message
    assert "to_here()" in message


@pytest.mark.timeout(60)
def test_plain_pickle_raises_clear_error() -> None:
    for rref in (rpc.RRef(torch.ones(1)), rpc.remote("worker1", add, args=(1, 1))):
        with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler") as info:
            pickle.dumps(rref)
        assert isinstance(info.value, rpc.SerializationError)
        assert "rpc_sync" in str(info.value)
    del rref, info
    wait_tables_empty()  # a failed pickle forks nothing


# -- the four sharing cases -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_user_shares_with_owner() -> None:
    rref = rpc.remote("worker1", make_tracked, args=("u2o",))
    facts = rpc.rpc_sync("worker1", rref_facts, args=(rref,))
    assert facts["is_owner"] and facts["confirmed"] and facts["value"].key == "u2o"
    assert facts["owner"] == "worker1"


@pytest.mark.timeout(60)
def test_owner_shares_with_user() -> None:
    local = rpc.RRef(torch.arange(3))
    assert tables("worker0")["num_owner_rrefs"] == 0  # not in owners_ until forked
    facts = rpc.rpc_sync("worker1", rref_facts, args=(local,))
    assert not facts["is_owner"] and facts["owner"] == "worker0" and facts["owner_id"] == 0
    # actorrpc: the owner registered the fork before sending, so the user is confirmed
    # (torch reports False here, a quirk).
    assert facts["confirmed"]
    assert facts["value"].tolist() == [0, 1, 2]
    assert USER_STR.fullmatch(facts["str"])
    wait_tables_empty()  # the callee's copy is gone: the fork is deleted


@pytest.mark.timeout(60)
def test_user_shares_with_user_confirmed_inside_udf() -> None:
    rref = rpc.remote("worker1", add, args=(torch.ones(2), 1))
    facts = rpc.rpc_sync("worker2", rref_facts, args=(rref,))
    assert facts["confirmed"], "the UDF must start only once its RRef arguments are confirmed"
    assert not facts["is_owner"] and facts["owner"] == "worker1"
    assert facts["value"].tolist() == [2.0, 2.0]
    # also while the creator's own handle is still unconfirmed (shared right away)
    for _ in range(20):
        fresh = rpc.remote("worker1", add, args=(1, 1))
        assert rpc.rpc_sync("worker2", rref_facts, args=(fresh,))["confirmed"]


@pytest.mark.timeout(60)
def test_rrefs_in_containers() -> None:
    rrefs = [rpc.remote(w, add, args=(i, 1)) for i, w in enumerate(("worker1", "worker2"))]
    extra = {"local": rpc.RRef(10), "self": rpc.remote("worker0", add, args=(5, 5))}
    assert rpc.rpc_sync("worker2", sum_rrefs, args=(rrefs, extra)) == 1 + 2 + 10 + 10
    assert rpc.rpc_sync("worker1", sum_rrefs, args=(rrefs,), kwargs={"extra": {}}) == 3


@pytest.mark.timeout(60)
def test_rrefs_as_return_values() -> None:
    owned_by_callee = rpc.rpc_sync("worker1", local_tracked_rref, args=("ret3",))  # case 3
    assert owned_by_callee.owner_name() == "worker1" and not owned_by_callee.is_owner()
    assert owned_by_callee.confirmed_by_owner()
    assert owned_by_callee.to_here().key == "ret3"
    owned_by_third = rpc.rpc_sync("worker1", remote_add_on, args=("worker2", 2, 3))  # case 4
    assert owned_by_third.owner_name() == "worker2"
    assert owned_by_third.to_here() == 5
    wait_for(owned_by_third.confirmed_by_owner, "a returned user RRef to be confirmed")
    owned_by_me = rpc.rpc_sync("worker1", remote_add_on, args=("worker0", 4, 4))  # case 2
    assert owned_by_me.is_owner() and owned_by_me.to_here() == 8
    echoed = rpc.rpc_sync("worker2", _load_echo, args=(owned_by_callee,))
    assert echoed.to_here().key == "ret3"
    del owned_by_callee, echoed
    wait_for(lambda: not remote_alive("worker1", "ret3"), "the returned value to be freed")


@pytest.mark.timeout(60)
def test_nested_rref() -> None:
    rref_of_rrefs = rpc.remote("worker1", nested_rrefs, args=("worker2",))
    rrefs = rref_of_rrefs.to_here()
    assert len(rrefs) == 2
    assert all(r.owner_name() == "worker2" for r in rrefs)
    assert torch.equal(rrefs[0].to_here(), torch.ones(2, 2) + 1)
    assert torch.equal(rrefs[1].to_here(), torch.ones(2, 2) + 2)
    rref_to_rref = rpc.remote("worker1", rpc.RRef, args=(7,))  # an RRef whose value is an RRef
    inner = rref_to_rref.to_here()
    assert isinstance(inner, rpc.RRef) and inner.owner_name() == "worker1"
    assert inner.to_here() == 7
    del rref_of_rrefs, rrefs, rref_to_rref, inner
    wait_tables_empty()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ttl", [8, 1])
def test_forward_chain(ttl: int) -> None:
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(3, 3), 1))
    ret_rref = rref_forward_chain(1, 3, rref, ttl)
    for _ in range(ttl):
        assert len(ret_rref) == 1
        ret_rref = ret_rref[0].to_here()
    assert torch.equal(ret_rref, torch.ones(3, 3) + 1)
    del rref, ret_rref
    wait_tables_empty()


@pytest.mark.timeout(60)
def test_forward_chain_across_three_workers_by_rpc() -> None:
    """worker0 -> worker1 -> worker2 -> worker1 (owner): each hop forwards the same RRef."""
    rref = rpc.remote("worker1", make_tracked, args=("chain",))
    key = rpc.rpc_sync(
        "worker1", forward_to,
        args=(rref, "worker2", _forward_to_owner),
    )
    assert key == "chain"
    del rref
    wait_for(lambda: not remote_alive("worker1", "chain"), "the chained value to be freed")
    wait_tables_empty()


def _forward_to_owner(rref: rpc.RRef[Tracked]) -> str:
    return rpc.rpc_sync(rref.owner(), key_of, args=(rref,))


# -- errors and timeouts --------------------------------------------------------------------------


def error_of(future: torch.futures.Future[Any]) -> BaseException:
    """The error a future failed with, without ``future.wait()`` raising through our frames.

    (A failed ``Future.wait()`` leaks the frames it raises through: see
    ``test_failed_wait_does_not_leak_frames``.)
    """
    _, error = settle(future)
    assert error is not None, "expected the call to fail"
    return error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("owner", ["worker1", "worker0"])
def test_failed_remote_stores_original_error(owner: str) -> None:
    rref = rpc.remote(owner, raise_value_error, args=("boom",))
    for _ in range(2):
        with pytest.raises(ValueError, match="boom"):
            rref.to_here()
    error = error_of(rref._get_future())  # the creation reports it too
    assert isinstance(error, ValueError) and "boom" in str(error)
    with pytest.raises(ValueError, match="boom"):
        rref.rpc_sync().anything()
    error = error_of(rref.rpc_async().anything())
    assert isinstance(error, ValueError) and "boom" in str(error)
    with pytest.raises(ValueError, match="boom"):
        rref.remote().anything().to_here()
    # shared with another worker, it fails there the same way
    error = error_of(rpc.rpc_async("worker2", to_here_of, args=(rref,)))
    assert isinstance(error, ValueError) and "boom" in str(error)
    del rref, error
    wait_tables_empty()


def wait_event_then_raise(key: str) -> None:
    _event(key).wait(WAIT)
    raise ValueError(f"late failure {key}")


@pytest.mark.timeout(60)
def test_fetch_waiting_for_a_failing_creation_gets_its_error() -> None:
    key = "late-failure"
    late = rpc.remote("worker1", wait_event_then_raise, args=(key,))
    fetch = rpc.rpc_async("worker2", to_here_of, args=(late,))  # worker2 has no creation future
    # the REMOTE_CALL, worker2's fetch and this query are in flight on worker1
    wait_for(lambda: rpc.rpc_sync("worker1", _requests_in_flight) == 3, "the pending fetch")
    rpc.rpc_sync("worker1", set_event, args=(key,))
    error = error_of(fetch)
    assert isinstance(error, ValueError) and "late failure" in str(error), error
    error = error_of(rpc.rpc_async("worker0", to_here_of, args=(late,)))
    assert isinstance(error, ValueError)
    del late, fetch, error
    wait_tables_empty()


@pytest.mark.timeout(60)
def test_remote_timeout_marks_the_rref() -> None:
    key = "remote-timeout"
    rref = rpc.remote("worker1", wait_event_then, args=(key, 1), timeout=0.3)
    try:
        # to_here() at once: it fails when the creation times out (not at its own timeout)
        with pytest.raises(rpc.RpcTimeoutError, match="RPC ran for more than") as info:
            rref.to_here()
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, RuntimeError)
        assert "RRef creation via rpc.remote() timed out" in str(info.value)
        error = error_of(rref._get_future())
        assert isinstance(error, rpc.RpcTimeoutError) and "RPC ran for more than" in str(error)
        with pytest.raises(TimeoutError, match="RRef creation"):
            rref.to_here()
        with pytest.raises(RuntimeError, match="RRef creation"):  # and it cannot be shared
            rpc.rpc_async("worker2", to_here_of, args=(rref,))
        own = rpc.remote("worker0", wait_event_then, args=(key + "-self", 1), timeout=0.2)
        with pytest.raises(TimeoutError, match="RPC ran for more than"):
            own.to_here()
    finally:
        rpc.rpc_sync("worker1", set_event, args=(key,))
        set_event(key + "-self")
    del rref, own, info, error
    wait_tables_empty()


@pytest.mark.timeout(60)
def test_to_here_timeout() -> None:
    key = "to-here-timeout"
    rref = rpc.remote("worker1", wait_event_then, args=(key, 42))
    try:
        with pytest.raises(rpc.RpcTimeoutError, match="RPC ran for more than"):
            rref.to_here(timeout=0.3)
    finally:
        rpc.rpc_sync("worker1", set_event, args=(key,))
    assert rref.to_here() == 42  # the RRef itself is fine
    local_key = "to-here-timeout-self"
    own = rpc.remote("worker0", wait_event_then, args=(local_key, 7))
    try:
        with pytest.raises(TimeoutError, match="RPC ran for more than"):
            own.to_here(timeout=0.2)
    finally:
        set_event(local_key)
    assert own.to_here() == 7
    del rref, own
    wait_tables_empty()


def _requests_in_flight() -> int:
    from actorrpc.agent import current_agent

    return current_agent()._inflight


@pytest.mark.timeout(60)
def test_orphan_fetch_is_released_on_the_owner() -> None:
    """A fetch of an RRef its owner never hears of ends on the owner at the caller's timeout."""
    from actorrpc.agent import current_agent
    from actorrpc.protocol import MessageKind

    agent = current_agent()
    never = GloballyUniqueId(2, 10**9)
    # the owner bounds its wait a little later than the caller's deadline (to_here() gives
    # both the same timeout: which ends first is then a race of ~0.1 ms, and the owner's
    # failure reaches this raw request as a value)
    fetch = agent.send_request(agent.resolve("worker1"), MessageKind.RREF_FETCH,
                               (never, {}, 0.7), 0.5, description="orphan fetch")
    assert isinstance(error_of(fetch), rpc.RpcTimeoutError)
    wait_for(lambda: rpc.rpc_sync("worker1", _requests_in_flight) == 1,
             "worker1 to drop the fetch (only this query in flight)")
    wait_tables_empty()  # and the pending owner entry the fetch made is gone


# -- the actor API --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_actor_proxies() -> None:
    rref = rpc.remote("worker1", Counter, args=(0,))
    assert rref.rpc_sync().incr(5) == 5
    future = rref.rpc_async().get()
    assert isinstance(future, torch.futures.Future)
    assert future.wait() == 5
    result = rref.remote().get()
    assert isinstance(result, rpc.RRef) and result.owner_name() == "worker1"
    assert result.to_here() == 5
    assert rref.rpc_sync(timeout=5).incr(n=2) == 7
    assert rref._get_type() is Counter and rref._get_type() is Counter
    with pytest.raises(AttributeError):
        rref.rpc_sync().no_such_method()
    assert rref.rpc_sync().get() == 7  # the error did not stall the caller's queue
    local = rpc.RRef(Counter(10))  # proxies on an owner RRef call through RPC to self
    assert local.rpc_sync().incr(1) == 11 and local.rpc_async().get().wait() == 11
    assert local.remote().incr(1).to_here() == 12
    assert rpc.rpc_sync("worker2", _proxy_from_elsewhere, args=(rref,)) == 8


def _proxy_from_elsewhere(rref: rpc.RRef[Counter]) -> int:
    return rref.rpc_sync().incr(1)


def _check_in_order(items: list[tuple[str, int]], tags: dict[str, int]) -> None:
    for tag, n in tags.items():
        mine = [i for t, i in items if t == tag]
        assert mine == list(range(n)), f"caller {tag}: out of order or lost: {mine[:20]}..."


@pytest.mark.timeout(60)
def test_per_caller_fifo_under_load() -> None:
    n = 250
    journal = rpc.remote("worker1", Journal)
    results: dict[str, list[Any]] = {}

    def caller(tag: str) -> None:
        results[tag] = [journal.rpc_async(timeout=WAIT).append(tag, i) for i in range(n)]

    remote_callers = [rpc.rpc_async("worker2", hammer, args=(journal, f"w2-{k}", n))
                      for k in range(2)]
    threads = [threading.Thread(target=caller, args=(f"w0-{k}",)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    for futures in results.values():
        torch.futures.wait_all(futures)
    assert [f.wait() for f in remote_callers] == [n, n]
    items = journal.rpc_sync().snapshot()
    assert len(items) == 6 * n
    _check_in_order(items, {**{f"w0-{k}": n for k in range(4)}, **{f"w2-{k}": n for k in range(2)}})


@pytest.mark.timeout(60)
def test_fifo_survives_calls_that_never_run() -> None:
    """A call that cannot be sent, or cannot be unpickled on the owner, leaves no gap."""
    journal = rpc.remote("worker1", Journal)
    futures = []
    for i in range(30):
        if i % 10 == 3:
            with pytest.raises(TypeError, match="pickle"):
                journal.rpc_async().take("t", -1, threading.Lock())  # fails before sending
        if i % 10 == 6:
            bad = journal.rpc_async().take("t", -1, BadOnArrival())  # fails on the owner
            assert "BadOnArrival" in str(error_of(bad))
            del bad
        if i % 10 == 8:
            with pytest.raises(AttributeError):
                journal.rpc_sync().missing("t", -1)
        futures.append(journal.rpc_async(timeout=WAIT).append("t", i))
    assert [f.wait() for f in futures] == list(range(1, 31))
    _check_in_order(journal.rpc_sync().snapshot(), {"t": 30})
    # the payloads that failed to unpickle on the owner never rebuilt their RRef: their
    # error replies said so, and the forks made for them were undone here (the others'
    # child accepts may still be on their way)
    wait_for(lambda j=journal: j not in rref_context().pending_children.values(),
             "no pending child of the journal", WAIT)
    del journal, futures
    wait_tables_empty()


class Failing:
    """An actor whose ``fail`` method raises; its lifetime is watched through ``_weak``."""

    def __init__(self, key: str) -> None:
        self.key = key
        _weak[key] = weakref.ref(self)

    def fail(self) -> None:
        raise KeyError(self.key)

    def wait_then(self, key: str) -> str:
        _event(key).wait(WAIT)
        return key


@pytest.mark.timeout(60)
def test_actor_freed_after_its_methods_raised() -> None:
    key = "failing-actor"
    rref = rpc.remote("worker1", Failing, args=(key,))
    assert isinstance(error_of(rref.rpc_async().fail()), KeyError)
    with pytest.raises(KeyError, match=key):
        rref.rpc_sync().fail()
    with pytest.raises(KeyError, match="in fail"):  # with the owner's traceback
        rref.remote().fail().to_here()
    early = rref.remote().fail()  # fetched before the creation fails: the error comes back
    fetch = rpc.rpc_async("worker2", to_here_of, args=(early,))  # from the owner's table
    assert isinstance(error_of(fetch), KeyError)
    del rref, early, fetch
    wait_tables_empty()
    wait_for(lambda: not remote_alive("worker1", key), "the actor to be freed")


@pytest.mark.timeout(60)
def test_actor_freed_after_a_queued_method_raised() -> None:
    # Regression: the failure was stored in a future from inside the except block, so a
    # callback re-raising it chained the original error (and the method's frames, which
    # hold the actor) as __context__: a cycle through the C++ future gc cannot free.
    key = "queued-failing-actor"
    rref = rpc.remote("worker1", Failing, args=(key,))
    first = rref.rpc_async(timeout=WAIT).wait_then(key)
    second = rref.rpc_async(timeout=WAIT).fail()  # queued behind ``first``: fails via a future
    rpc.rpc_sync("worker1", set_event, args=(key,))
    assert first.wait() == key
    assert isinstance(error_of(second), KeyError)
    del rref, first, second
    wait_tables_empty()
    wait_for(lambda: not remote_alive("worker1", key), "the actor to be freed", 3)


# -- async_execution ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_async_execution_functions_and_methods() -> None:
    x, y = torch.ones(2), torch.ones(2)
    assert rpc.rpc_sync("worker1", async_add, args=("worker2", x, y)).tolist() == [2.0, 2.0]
    assert rpc.rpc_sync("worker1", AsyncExec.static_async_add,
                        args=("worker2", x, y, 1)).tolist() == [3.0, 3.0]
    assert rpc.rpc_sync("worker1", AsyncExec.class_async_add,
                        args=("worker2", x, y, 2)).tolist() == [4.0, 4.0]
    assert rpc.remote("worker1", AsyncExec.static_async_add,
                      args=("worker0", x, y, 3)).to_here().tolist() == [5.0, 5.0]
    assert rpc.remote("worker1", async_add, args=("worker2", x, y)).to_here().tolist() == [2, 2]
    with pytest.raises(TypeError, match="must return"):
        rpc.rpc_sync("worker1", async_not_a_future)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["rpc_sync", "rpc_async", "remote"])
def test_async_execution_through_rref_proxies(mode: str) -> None:
    x, y = torch.ones(2), torch.ones(2)
    rref = rpc.remote("worker1", AsyncExec, args=(10,))

    def call(name: str, *args: Any) -> Any:
        proxy = getattr(rref, mode)(timeout=WAIT)
        result = getattr(proxy, name)(*args)
        if mode == "rpc_async":
            return result.wait()
        if mode == "remote":
            return result.to_here()
        return result

    assert call("static_async_add", "worker2", x, y, 1).tolist() == [3.0, 3.0]
    assert call("class_async_add", "worker2", x, y, 2).tolist() == [4.0, 4.0]
    assert call("bound_async_add", "worker0", x, y).tolist() == [12.0, 12.0]


@pytest.mark.timeout(60)
def test_more_async_calls_than_worker_threads() -> None:
    """40 > num_worker_threads (16) parked async calls, completed later by another call."""
    key = "park"
    futures = [rpc.rpc_async("worker1", parked, args=(key, i), timeout=WAIT) for i in range(40)]
    wait_for(lambda: rpc.rpc_sync("worker1", parked_count, args=(key,)) == 40,
             "40 parked calls (each holding no thread)")
    assert not any(f.done() for f in futures)
    assert rpc.rpc_sync("worker1", release_parked, args=(key, 100)) == 40
    assert [f.wait() for f in futures] == [100 + i for i in range(40)]
    # the same through an actor: 40 parked method calls, then the releasing call (FIFO)
    journal = rpc.remote("worker2", Journal)
    parked_calls = [journal.rpc_async(timeout=WAIT).wait_for_release(i) for i in range(40)]
    assert journal.rpc_sync(timeout=WAIT).release() == 40
    assert [f.wait() for f in parked_calls] == [2 * i for i in range(40)]


# -- lifetimes ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dropped_rrefs_free_the_value() -> None:
    key = "lifetime"
    rref = rpc.remote("worker1", make_tracked, args=(key, torch.ones(100)))
    rpc.rpc_sync("worker2", store, args=(key, rref))  # a second user on worker2
    assert rref.to_here().key == key
    wait_for(lambda: tables("worker1")["num_forks"] == 2, "two forks on the owner")
    del rref
    wait_for(lambda: tables("worker1")["num_forks"] == 1, "the creator's fork to go")
    assert remote_alive("worker1", key), "worker2 still references the value"
    rpc.rpc_sync("worker2", unstore, args=(key,))
    wait_tables_empty()
    wait_for(lambda: not remote_alive("worker1", key), "the value to be freed on its owner")


@pytest.mark.timeout(60)
def test_local_rref_shared_then_dropped_frees_value() -> None:
    value = make_tracked("local-share")
    local = rpc.RRef(value)
    rpc.rpc_sync("worker1", store, args=("local-share", local))
    rpc.rpc_sync("worker2", rref_facts, args=(local,))
    del value, local
    assert is_alive("local-share"), "worker1's user keeps it alive"
    assert tables("worker0")["num_owner_rrefs"] == 1
    rpc.rpc_sync("worker1", unstore, args=("local-share",))
    wait_tables_empty()
    wait_for(lambda: not is_alive("local-share"), "the local value to be freed")


@pytest.mark.timeout(60)
def test_owner_rref_sent_to_itself_survives_the_trip() -> None:
    """Sending an owner RRef to this worker itself while dropping every other handle."""
    results = [rpc.rpc_async("worker0", key_of, args=(rpc.RRef(make_tracked(f"self{i}")),))
               for i in range(20)]
    assert [f.wait() for f in results] == [f"self{i}" for i in range(20)]
    wait_tables_empty(("worker0",))
    wait_for(lambda: not any(is_alive(f"self{i}") for i in range(20)), "values freed")


@pytest.mark.timeout(60)
def test_remote_whose_request_cannot_be_sent_leaves_nothing() -> None:
    for to in ("worker1", "worker0"):
        with pytest.raises(TypeError, match="pickle"):
            rpc.remote(to, add, args=(threading.Lock(), 1))
    assert tables("worker0") == ZERO


@pytest.mark.timeout(60)
def test_load_remote_share_drop_cycles() -> None:
    """LOAD_CYCLES cycles of remote() -> share with a third worker -> drop, in every direction."""
    permutations = [(a, b, c) for a in WORKERS for b in WORKERS for c in WORKERS
                    if len({a, b, c}) == 3]
    # plus degenerate directions: creator == owner, third == owner, third == creator
    permutations += [("worker0", "worker0", "worker1"), ("worker1", "worker2", "worker2"),
                     ("worker2", "worker1", "worker2")]
    slots = threading.Semaphore(LOAD_IN_FLIGHT)
    futures = []
    errors: list[BaseException] = []
    started = time.monotonic()
    for i in range(LOAD_CYCLES):
        creator, owner, third = permutations[i % len(permutations)]
        slots.acquire()
        future = rpc.rpc_async(creator, load_cycle, args=(owner, third, i), timeout=WAIT)

        def done(fut: Any) -> None:
            try:
                fut.wait()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            slots.release()

        future.add_done_callback(done)
        futures.append(future)
        if errors:
            break
    values = [f.wait() for f in futures]
    assert not errors, errors[:3]
    assert values == list(range(LOAD_CYCLES))
    elapsed = time.monotonic() - started
    wait_tables_empty()
    wait_for(lambda: all([rpc.rpc_sync(w, live_load_values) == 0 for w in WORKERS]),
             "every load value to be freed")
    print(f"{LOAD_CYCLES} cycles in {elapsed:.1f}s")


# -- replies and payloads the agent cannot deliver --------------------------------------------


@pytest.mark.timeout(60)
def test_late_reply_with_rref_does_not_leak() -> None:
    """The reply to a call that timed out is unpickled and dropped: its RRef is released."""
    key = "late-reply"
    future = rpc.rpc_async("worker1", _late_rref_reply, args=(key,), timeout=0.3)
    try:
        with pytest.raises(TimeoutError):
            future.wait()
    finally:
        rpc.rpc_sync("worker1", set_event, args=(key,))
    wait_for(lambda: rpc.rpc_sync("worker1", _created, args=(key,)), "the late value")
    wait_for(lambda: not remote_alive("worker1", key), "the late reply's value freed")
    wait_tables_empty()


def _late_rref_reply(key: str) -> rpc.RRef[Tracked]:
    _event(key).wait(WAIT)
    return rpc.RRef(make_tracked(key))


def _created(key: str) -> bool:
    return key in _weak


def _drop_leaked_forks() -> None:
    ctx = rref_context()
    for rref_id, forks in list(ctx.forks.items()):
        for fork_id in list(forks):
            ctx.delete_fork(rref_id, fork_id)


@pytest.mark.timeout(60)
def test_unsendable_call_leaves_no_fork() -> None:
    # Pickling forks the RRefs before it reaches the lock it cannot pickle; the
    # aborted message undoes those forks (PickleTarget.on_abort).
    rref = rpc.remote("worker1", add, args=(1, 1))
    assert rref.to_here() == 2  # confirmed: no pending user left from remote() itself
    local = rpc.RRef(1)
    try:
        with pytest.raises(TypeError, match="pickle"):
            rpc.rpc_sync("worker2", sum_rrefs, args=([rref, local], {"x": threading.Lock()}))
        assert tables("worker0") == ZERO
    finally:
        ctx = rref_context()
        ctx.pending_children.clear()
        _drop_leaked_forks()


def rref_and_lock() -> list[Any]:
    """A result whose RRef is forked by pickling before the lock fails it."""
    return [rpc.RRef(5), threading.Lock()]


@pytest.mark.timeout(60)
def test_unsendable_reply_leaves_no_fork() -> None:
    with pytest.raises(TypeError, match="pickle"):
        rpc.rpc_sync("worker1", rref_and_lock)
    wait_tables_empty()


@pytest.mark.timeout(60)
def test_failed_wait_does_not_leak_frames() -> None:
    """A failed rpc_sync() with an RRef argument does not keep the RRef alive.

    (Future.wait() once re-raised the exception stored in the C++ future, which then
    held the waiting frames: a cycle gc cannot see.)
    """
    rref = rpc.remote("worker1", make_tracked, args=("wait-leak",))
    fork_id = rref._fork_id
    with pytest.raises(ValueError):
        rpc.rpc_sync("worker2", fail_with, args=(rref,))
    del rref
    try:
        wait_tables_empty(limit=5)  # (collecting on every worker: worker2's failed call)
        assert not remote_alive("worker1", "wait-leak")
    finally:
        _release_leaked_user_handle(fork_id)


def fail_with(rref: rpc.RRef[Any]) -> None:
    raise ValueError(f"boom with {rref}")


def _release_leaked_user_handle(fork_id: Any) -> None:
    """Cleanup after a failure of the test above: send the delete the leaked handle never will."""
    import gc

    for obj in gc.get_objects():
        if type(obj) is rpc.RRef and obj._fork_id == fork_id and not obj._deleted:
            rref_context().user_deleted(obj)


_kept: list[Any] = []  # what KeptOnArrival rebuilt on the worker that unpickled it


class KeptOnArrival:
    """Unpickles as its value, which the receiving worker also keeps in ``_kept``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        return _keep, (self.value,)


def _keep(value: Any) -> Any:
    _kept.append(value)
    return value


def kept_values() -> list[Any]:
    return [r.to_here() for r in _kept.pop()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rebuilt_first", [False, True], ids=["none-rebuilt", "some-rebuilt"])
def test_undecodable_request_undoes_the_forks_not_rebuilt(rebuilt_first: bool) -> None:
    # worker2 fails to unpickle the request at BadOnArrival: RRefs before it were rebuilt
    # there (their forks are worker2's to release; KeptOnArrival keeps them alive), those
    # after it never were. The error reply names the rebuilt forks; the sender undoes the
    # others' (a pending child for a user RRef, the owner's fork for an owned one).
    user = rpc.remote("worker1", add, args=(1, 1))  # worker0 is a user of worker1's value
    assert user.to_here() == 2
    owned = rpc.RRef(3)  # worker0 owns it: forking registers the fork at once
    early = [rpc.remote("worker1", add, args=(2, 2)), rpc.RRef(4)] if rebuilt_first else []
    args = (KeptOnArrival(early), BadOnArrival(), [user, owned])
    error = error_of(rpc.rpc_async("worker2", sum_rrefs_then, args=args))
    assert isinstance(error, rpc.DeserializationError) and "BadOnArrival" in str(error)
    assert "worker2" in str(error)  # where it failed
    if not rebuilt_first:  # undone before the error was delivered
        assert tables("worker0")["num_forks"] == tables("worker0")["num_pending_children"] == 0
    # early[0]'s pending child goes when worker1 accepts worker2's fork; early[1]'s fork
    # stays registered here while worker2 keeps its copy
    wait_for(lambda: tables("worker0")["num_pending_children"] == 0, "no pending child", WAIT)
    assert tables("worker0")["num_forks"] == (1 if rebuilt_first else 0)
    assert rpc.rpc_sync("worker2", kept_values) == ([4, 4] if rebuilt_first else [])
    assert user.to_here() == 2 and owned.to_here() == 3  # still usable here
    del user, owned, early, args, error
    wait_tables_empty()


def sum_rrefs_then(early: list[rpc.RRef[Any]], bad: Any, rrefs: list[rpc.RRef[Any]]) -> Any:
    return sum(r.to_here() for r in [*early, *rrefs])


def reply_with_forks(rebuilt_first: bool) -> list[Any]:
    """On worker1: a reply the caller cannot unpickle past BadOnArrival."""
    user = rpc.remote("worker2", add, args=(1, 1))  # worker1 is a user of worker2's value
    assert user.to_here() == 2
    early = [rpc.remote("worker2", add, args=(2, 2)), rpc.RRef(4)] if rebuilt_first else []
    return [KeptOnArrival(early), BadOnArrival(), [user, rpc.RRef(3)]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rebuilt_first", [False, True], ids=["none-rebuilt", "some-rebuilt"])
def test_undecodable_reply_undoes_the_callees_forks_not_rebuilt(rebuilt_first: bool) -> None:
    # The other way round: worker0 cannot unpickle worker1's reply; it tells worker1 which
    # forks it rebuilt (REPLY_UNDECODED) and worker1 undoes the others.
    error = error_of(rpc.rpc_async("worker1", reply_with_forks, args=(rebuilt_first,)))
    assert isinstance(error, rpc.DeserializationError) and "BadOnArrival" in str(error)
    assert "worker1" in str(error)  # whose reply
    wait_for(lambda: tables("worker1")["num_pending_children"] == 0 or None,
             "no pending child on worker1", WAIT)
    # early[1]'s fork stays registered on worker1 while worker0 keeps its copy
    wait_for(lambda: tables("worker1")["num_forks"] == (1 if rebuilt_first else 0) or None,
             "worker1's forks undone", WAIT)
    kept = _kept.pop()
    assert [r.to_here() for r in kept] == ([4, 4] if rebuilt_first else [])
    del kept, error
    wait_tables_empty()


# -- shutdown with leaks (a private 2-worker group per scenario) ----------------------------------


def _scenario_main(scenario: str, rank: int, init_method: str, strict: bool) -> None:
    """One worker of a private group; prints a JSON report as its last line."""
    report: dict[str, Any] = {}
    options = rpc.ZmqRpcBackendOptions(
        init_method=init_method, rpc_timeout=20, strict_rref_leaks=strict, shutdown_timeout=20,
    )
    rpc.init_rpc(f"s{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    keep: list[Any] = []
    if rank == 0:
        local = rpc.RRef(1)
        report["owner_str"] = str(local)
        rref = rpc.remote("s1", torch.add, args=(torch.ones(2), 1))
        report["user_str"] = str(rref)
        rref.to_here()
        keep.append(rref)
        if scenario == "leak":
            # what torch's test_rref_leak mocks: the user never sends its delete
            rref_context().delete_all_users = lambda: 0  # type: ignore[method-assign]
    try:
        rpc.shutdown(timeout=6)
        report["shutdown"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the report says what happened
        report["shutdown"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        try:
            keep[0].to_here()
            report["after"] = "ok"
        except Exception as exc:  # noqa: BLE001
            report["after"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report), flush=True)


def _run_group(scenario: str, strict: bool) -> list[dict[str, Any]]:
    from tests._cluster import REPO_ROOT, free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.test_rref", scenario, str(rank), init_method,
             "strict" if strict else "lenient"],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(2)
    ]
    reports = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        assert process.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.mark.timeout(60)
def test_strict_shutdown_reports_leak() -> None:
    user, owner = _run_group("leak", strict=True)
    assert owner["shutdown"].startswith("ShutdownError"), owner
    assert "Leaking RRef GloballyUniqueId(created_on=0, local_id=1) with fork Id " \
           "GloballyUniqueId(created_on=0, local_id=2)" in owner["shutdown"], owner
    assert user["shutdown"] == "ok", user
    # a fresh process numbers ids from 0, like torch (test_rref_str)
    assert user["owner_str"] == "OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))"
    assert user["user_str"] == (
        "UserRRef(RRefId = GloballyUniqueId(created_on=0, local_id=1), "
        "ForkId = GloballyUniqueId(created_on=0, local_id=2))"
    )


@pytest.mark.timeout(60)
def test_lenient_shutdown_logs_leak_and_clean_shutdown_deletes_users() -> None:
    user, owner = _run_group("leak", strict=False)
    assert owner["shutdown"] == "ok" and user["shutdown"] == "ok", (user, owner)
    user, owner = _run_group("clean", strict=True)
    assert owner["shutdown"] == "ok" and user["shutdown"] == "ok", (user, owner)
    assert "deleted" in user["after"] and user["after"].startswith("RRefError"), user


if __name__ == "__main__":
    _scenario_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "strict")







def test_user_deletes_are_notifications_and_still_reach_the_owner(cluster):
    """A user's delete is one message (no reply to wait for), and the owner applies it."""
    from actorrpc.agent import current_agent

    agent = current_agent()
    before = rpc.rpc_sync("worker1", debug_info)["num_owner_rrefs"]
    rrefs = [rpc.remote("worker1", torch.add, args=(torch.ones(1), i)) for i in range(20)]
    assert [r.to_here().item() for r in rrefs] == [float(i + 1) for i in range(20)]
    del rrefs
    pending = [p.description for p in list(agent._pending.values())]
    assert not any("delete" in d for d in pending), pending
    deadline = time.monotonic() + WAIT
    while rpc.rpc_sync("worker1", debug_info)["num_owner_rrefs"] > before:
        assert time.monotonic() < deadline, "the owner never applied the deletes"
        threading.Event().wait(0.01)


def test_user_deletes_ride_in_batches_on_messages_to_the_owner(cluster, monkeypatch):
    """Deletes wait until a batch is full, then travel on a message that leaves anyway;
    a batch not yet full waits (the next call does not carry it)."""
    import gc

    from actorrpc.agent import _riders, current_agent

    # no flush of their own meanwhile, however long this thread is descheduled, and no
    # batch made to ride by its age
    monkeypatch.setattr(_riders, "RIDER_DELAY", 60.0)
    monkeypatch.setattr(_riders, "BATCH_AGE", 60.0)

    agent = current_agent()
    owner = agent.resolve("worker1").id
    gc.collect()  # (an earlier test's RRefs)
    agent.riders.flush(everything=True)
    before = rpc.rpc_sync("worker1", debug_info)["num_owner_rrefs"]
    rrefs = [rpc.remote("worker1", torch.add, args=(torch.ones(1), i)) for i in range(20)]
    assert [r.to_here().item() for r in rrefs] == [float(i + 1) for i in range(20)]
    rpc.rpc_sync("worker1", debug_info)  # every creation is acknowledged by now
    carried, alone = agent.riders.carried, agent.riders.sent_alone
    sent = agent.stats.calls_sent[owner]
    del rrefs

    def batch_queued_rest_waiting() -> bool:
        # (a liveness PING may carry the full batch already; carried counts every worker's)
        queued = len(agent.riders.queued.get(owner, []))
        waiting = len(agent.riders.waiting.get(owner, []))
        return queued + agent.riders.carried - carried + waiting >= 20

    assert wait_until(batch_queued_rest_waiting, WAIT)
    # (4 wait, unless a late delete of an earlier test's RRef joined the batches)
    rest = agent.riders.waiting[owner][:]
    assert 1 <= len(rest) < 16
    assert not agent.idle()  # deletes still to send
    rpc.rpc_sync("worker1", debug_info)  # carries the full batch, not the rest
    assert agent.riders.carried - carried >= 16 and not agent.riders.queued.get(owner)
    assert agent.riders.waiting[owner] == rest
    assert agent.riders.sent_alone == alone
    assert agent.stats.calls_sent[owner] - sent <= 2  # (a liveness PING may go too)
    rpc.rpc_sync("worker1", debug_info)  # a call more: still the same ones waiting
    assert agent.riders.waiting[owner] == rest
    assert agent.riders.describe()["queued"] >= len(rest)
    agent.riders.flush(everything=True)  # (what a graceful shutdown does)
    assert not agent.riders.waiting.get(owner) and agent.riders.sent_alone > alone
    # the owner applies them once it served the call that carried them (its reply does
    # not wait for them); at most before: an earlier test's RRef may be freed meanwhile
    assert wait_until(
        lambda: rpc.rpc_sync("worker1", debug_info)["num_owner_rrefs"] <= before, WAIT
    )
    # the worker stats show these counters (read between two readings: they only grow)
    low = agent.riders.carried, agent.riders.sent_alone
    notifications = rpc.get_worker_stats()["notifications"]
    high = agent.riders.carried, agent.riders.sent_alone
    assert low[0] <= notifications["carried"] <= high[0]
    assert low[1] <= notifications["sent_alone"] <= high[1]


def test_a_delete_riding_on_a_call_that_waits_for_it_is_still_applied(cluster, monkeypatch):
    """A delete riding on a request is handled after that request, or by the owner's I/O
    thread within DEFERRED_RIDER_DELAY if the request takes longer: a call that waits for
    the delete it carries sees it applied. (The finalizer hands the delete to the I/O
    thread, which queues it: a reply that thread sends to worker1 first may carry it
    instead, and the call still sees it applied.)"""
    from actorrpc.agent import _riders, current_agent

    monkeypatch.setattr(_riders, "RIDER_DELAY", 60.0)  # the delete rides on the next call
    monkeypatch.setattr(_riders, "BATCH_SIZE", 1)  # (a batch of one)
    agent = current_agent()
    before = rpc.rpc_sync("worker1", debug_info)["num_owner_rrefs"]
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(1), 1))
    assert rref.to_here().item() == 2.0
    carried = agent.riders.carried
    del rref
    owner = agent.resolve("worker1").id
    # queued (not sent alone), or already on a message the I/O thread sent to worker1
    assert wait_until(lambda: agent.riders.queued.get(owner) or agent.riders.carried > carried,
                      WAIT)
    assert rpc.rpc_sync("worker1", owner_rrefs_drop_to, args=(before, 10.0))
    assert agent.riders.carried > carried


def test_queued_deletes_are_sent_alone_when_no_message_follows(cluster):
    """With nothing else going to the owner, a delete leaves on its own within milliseconds."""
    from actorrpc.agent import current_agent

    agent = current_agent()
    before = rpc.rpc_sync("worker1", debug_info)["num_owner_rrefs"]
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(1), 1))
    assert rref.to_here().item() == 2.0
    rpc.rpc_sync("worker1", debug_info)  # the creation is acknowledged by now
    left = agent.riders.sent_alone + agent.riders.carried
    del rref
    deadline = time.monotonic() + WAIT
    # alone, or on a message the agent sends by itself (a liveness ping)
    while (agent.riders.sent_alone + agent.riders.carried == left or agent.riders.queued
           or agent.riders.waiting):
        assert time.monotonic() < deadline, "the queued delete was never sent"
        threading.Event().wait(0.005)
    # it left before this call, on the same link: the owner applied it first
    assert rpc.rpc_sync("worker1", debug_info)["num_owner_rrefs"] == before


def _sum_local_values(rrefs: list[rpc.RRef]) -> Any:
    return sum(rref.local_value() for rref in rrefs)


def _send_back_to_owner(rrefs: list[rpc.RRef]) -> Any:
    """On a user: pass RRefs to their owner, worker0, in a call."""
    return rpc.rpc_sync("worker0", _sum_local_values, args=(rrefs,))


@pytest.mark.internals
def test_an_owner_accepts_a_users_rref_with_a_notification(cluster, monkeypatch):
    """A user's RRef sent to its owner: the owner's RREF_CHILD_ACCEPT is a notification
    (no reply to wait for or send), and the user lets the parent go when it arrives."""
    from actorrpc.agent import current_agent
    from actorrpc.protocol import MessageKind

    agent = current_agent()
    requested: list[MessageKind] = []
    send_request = agent.send_request

    def recording(dest: Any, kind: MessageKind, *args: Any, **kwargs: Any) -> Any:
        requested.append(kind)
        return send_request(dest, kind, *args, **kwargs)

    monkeypatch.setattr(agent, "send_request", recording)
    rrefs = [rpc.RRef(i) for i in range(5)]  # owned here; worker1 gets confirmed users
    assert rpc.rpc_sync("worker1", _send_back_to_owner, args=(rrefs,)) == 10
    wait_for(lambda: tables("worker1")["num_pending_children"] == 0 or None,
             "worker1's parents let go", WAIT)
    assert MessageKind.RREF_CHILD_ACCEPT not in requested, requested
    del rrefs
    wait_tables_empty()
