"""Core RPC behaviour against the session group (this process is worker0).

Module-level functions here are importable on worker1/worker2 (``tests`` is a
package), so they travel by reference; lambdas and closures travel by value.
"""

from __future__ import annotations

import ast
import asyncio
import os
import pickle
import sys
import textwrap
import threading
import time
import traceback
import uuid

import pytest
import torch

import actorrpc as rpc
from actorrpc.agent import current_agent, format_traceback
from actorrpc.agent._remote_exception import pack_exception

pytestmark = pytest.mark.timeout(60)


# --- functions run on the workers ------------------------------------------------------


def add_ones(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    return x + n


def echo(obj):
    return obj


def whoami() -> str:
    return rpc.get_worker_info().name


def with_kwargs(a, b=2, *, scale=1, **extra):
    return {"value": (a + b) * scale, "extra": extra}


def nested_hop(path: list[str], trail: list[str]) -> list[str]:
    """Append this worker's name, then forward to the next worker in ``path``."""
    trail = [*trail, rpc.get_worker_info().name]
    if not path:
        return trail
    return rpc.rpc_sync(path[0], nested_hop, args=(path[1:], trail), timeout=20)


def raise_value_error(message: str) -> None:
    raise ValueError(message)


class TwoArgError(Exception):
    """An exception that cannot be rebuilt from a single message argument."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code
        self.detail = detail


def raise_two_arg_error() -> None:
    raise TwoArgError(7, "needs two args")


_events: dict[str, threading.Event] = {}
_events_lock = threading.Lock()


def _event(key: str) -> threading.Event:
    with _events_lock:
        return _events.setdefault(key, threading.Event())


def wait_for_release(key: str, max_wait: float) -> str:
    """Block (on the callee) until ``release(key)`` or ``max_wait`` seconds pass."""
    released = _event(key).wait(max_wait)
    return "released" if released else "gave up"


def release(key: str) -> None:
    _event(key).set()


def transport_facts() -> dict:
    agent = current_agent()
    return {"endpoint": agent._transport.endpoint, "rank": agent.rank}


def scaled(i: int, t: torch.Tensor) -> torch.Tensor:
    return t * i


def make_adder(n: int):
    def adder(x):
        return x + n

    return adder


# --- rpc_sync / rpc_async / remote --------------------------------------------------------


def test_rpc_sync_to_other_worker(cluster):
    t = torch.arange(4.0)
    assert torch.equal(rpc.rpc_sync("worker1", add_ones, args=(t,)), t + 1)
    assert rpc.rpc_sync("worker2", whoami) == "worker2"


def test_rpc_sync_to_self(cluster):
    assert rpc.rpc_sync("worker0", whoami) == "worker0"
    t = torch.ones(3)
    assert torch.equal(rpc.rpc_sync("worker0", torch.add, args=(t, 2)), t + 2)


def fill_in_place(t: torch.Tensor, value: float) -> torch.Tensor:
    return t.fill_(value)


_KEPT: dict[str, torch.Tensor] = {}


def keep_and_return(key: str, t: torch.Tensor) -> torch.Tensor:
    _KEPT[key] = t
    return t


@pytest.mark.parametrize("numel", [4, 1 << 15, 1 << 20])  # copied, zero-copy, shared memory
def test_a_call_to_itself_copies_arguments_and_results(cluster, numel):
    """A worker's messages to itself take an in-process link: still copies both ways."""
    t = torch.zeros(numel)
    assert torch.equal(rpc.rpc_sync("worker0", fill_in_place, args=(t, 7.0)),
                       torch.full((numel,), 7.0))
    assert torch.equal(t, torch.zeros(numel))  # the callee changed its own copy
    key = f"kept-{numel}"
    returned = rpc.rpc_sync("worker0", keep_and_return, args=(key, t))
    returned.fill_(3.0)
    assert torch.equal(_KEPT.pop(key), torch.zeros(numel))  # the caller got a copy


def test_rpc_async_to_other_and_self(cluster):
    futs = [
        rpc.rpc_async(name, add_ones, args=(torch.zeros(2), i)) for i, name in enumerate(cluster)
    ]
    for i, fut in enumerate(futs):
        assert torch.equal(fut.wait(), torch.full((2,), float(i)))


@pytest.mark.parametrize("to", ["worker1", 1, "info"])
def test_destination_as_name_rank_or_workerinfo(cluster, to):
    if to == "info":
        to = rpc.get_worker_info("worker1")
    assert rpc.rpc_sync(to, whoami) == "worker1"
    assert rpc.rpc_async(to, whoami).wait() == "worker1"
    assert rpc.remote(to, whoami).to_here() == "worker1"


def test_remote_to_other_worker(cluster):
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
    assert not rref.is_owner()
    assert rref.owner() == rpc.get_worker_info("worker1")
    assert torch.equal(rref.to_here(), torch.full((2,), 4.0))


def test_remote_to_self(cluster):
    rref = rpc.remote("worker0", add_ones, args=(torch.ones(2),), kwargs={"n": 5})
    assert rref.is_owner()
    assert torch.equal(rref.to_here(), torch.full((2,), 6.0))
    assert torch.equal(rref.local_value(), torch.full((2,), 6.0))


def test_kwargs(cluster):
    result = rpc.rpc_sync(
        "worker1", with_kwargs, args=(1,), kwargs={"b": 3, "scale": 10, "tag": "x"}
    )
    assert result == {"value": 40, "extra": {"tag": "x"}}
    fut = rpc.rpc_async("worker2", with_kwargs, kwargs={"a": 2})
    assert fut.wait() == {"value": 4, "extra": {}}
    assert (
        rpc.remote("worker1", with_kwargs, args=(1,), kwargs={"scale": 2}).to_here()["value"] == 6
    )


def test_builtin_torch_ops(cluster):
    a = torch.randn(3, 4)
    b = torch.randn(4, 5)
    assert torch.allclose(rpc.rpc_sync("worker1", torch.matmul, args=(a, b)), a @ b)
    assert torch.equal(rpc.rpc_sync("worker2", torch.add, args=(a, a)), a + a)
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(a, 1), kwargs={"alpha": 2}), a + 2)
    assert rpc.rpc_sync("worker1", max, args=(3, 9, 4)) == 9


def test_large_nested_arguments(cluster):
    payload = {
        "tensors": [torch.randn(256, 1024) for _ in range(4)],  # 1 MiB each
        "names": ["x" * 100_000, "y" * 1_000_000],
        "nested": {"deep": [{"t": torch.arange(500_000, dtype=torch.int64)}, (1, 2.5, None)]},
        "bytes": os.urandom(1_000_000),
    }
    back = rpc.rpc_sync("worker1", echo, args=(payload,))
    assert back.keys() == payload.keys()
    for sent, got in zip(payload["tensors"], back["tensors"]):
        assert torch.equal(sent, got)
    assert back["names"] == payload["names"]
    assert torch.equal(back["nested"]["deep"][0]["t"], payload["nested"]["deep"][0]["t"])
    assert back["nested"]["deep"][1] == (1, 2.5, None)
    assert back["bytes"] == payload["bytes"]


def test_nested_rpc_ring(cluster):
    # worker0 -> worker1 -> worker2 -> worker0, and the result travels back the same way
    trail = rpc.rpc_sync("worker1", nested_hop, args=(["worker2", "worker0"], ["start"]))
    assert trail == ["start", "worker1", "worker2", "worker0"]
    # twice around, asynchronously
    fut = rpc.rpc_async(
        "worker1", nested_hop, args=(["worker2", "worker0", "worker1", "worker2"], [])
    )
    assert fut.wait() == ["worker1", "worker2", "worker0", "worker1", "worker2"]


@pytest.mark.timeout(120)
def test_many_threads_many_calls(cluster):
    threads_n, calls_n = 8, 1000
    errors: list[BaseException] = []
    checked = [0] * threads_n

    def caller(index: int) -> None:
        try:
            dest = cluster[1 + index % 2]
            base = torch.full((2,), float(index))
            futs = [rpc.rpc_async(dest, scaled, args=(i, base)) for i in range(calls_n)]
            for i, fut in enumerate(futs):
                result = fut.wait()
                assert torch.equal(result, base * i), (index, i, result)
                checked[index] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(100)
    assert not any(t.is_alive() for t in threads), "caller threads did not finish"
    assert not errors, errors[:3]
    assert checked == [calls_n] * threads_n


# --- futures -------------------------------------------------------------------------


def test_future_then_done_value(cluster):
    fut = rpc.rpc_async("worker1", add_ones, args=(torch.ones(2),))
    chained = fut.then(lambda f: f.wait() * 10)
    assert isinstance(fut, torch.futures.Future)
    assert torch.equal(chained.wait(), torch.full((2,), 20.0))
    assert fut.done()
    assert torch.equal(fut.value(), torch.full((2,), 2.0))
    assert torch.equal(fut.wait(), torch.full((2,), 2.0))


def test_wait_all_and_collect_all(cluster):
    futs = [
        rpc.rpc_async(f"worker{1 + i % 2}", add_ones, args=(torch.zeros(1), i)) for i in range(10)
    ]
    values = torch.futures.wait_all(futs)
    assert [v.item() for v in values] == [float(i) for i in range(10)]

    futs = [rpc.rpc_async("worker2", add_ones, args=(torch.zeros(1), i)) for i in range(5)]
    collected = torch.futures.collect_all(futs).wait()
    assert [f.value().item() for f in collected] == [float(i) for i in range(5)]


def test_wait_all_raises_remote_error(cluster):
    futs = [
        rpc.rpc_async("worker1", add_ones, args=(torch.zeros(1),)),
        rpc.rpc_async("worker1", raise_value_error, args=("in wait_all",)),
    ]
    with pytest.raises(ValueError, match="in wait_all"):
        torch.futures.wait_all(futs)


def test_waiting_twice_on_failed_future_raises_twice(cluster):
    fut = rpc.rpc_async("worker1", raise_value_error, args=("twice",))
    for _ in range(2):
        with pytest.raises(ValueError, match="twice"):
            fut.wait()
    assert fut.done()


def test_await_in_asyncio(cluster):
    async def main():
        single = await rpc.rpc_async("worker1", add_ones, args=(torch.ones(2), 4))
        many = await asyncio.gather(
            *(
                rpc.rpc_async(f"worker{1 + i % 2}", add_ones, args=(torch.zeros(1), i))
                for i in range(6)
            )
        )
        with pytest.raises(ValueError, match="async boom"):
            await rpc.rpc_async("worker2", raise_value_error, args=("async boom",))
        return single, many

    single, many = asyncio.run(main())
    assert torch.equal(single, torch.full((2,), 5.0))
    assert [m.item() for m in many] == [float(i) for i in range(6)]


# --- remote errors -------------------------------------------------------------------


def test_remote_exception_same_type_with_worker_and_traceback(cluster):
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync("worker1", raise_value_error, args=("bad value 42",))
    message = str(info.value)
    assert "worker1" in message
    assert "bad value 42" in message
    assert "Traceback" in message
    assert "raise_value_error" in message  # the remote frame

    with pytest.raises(ValueError, match="bad value 43"):
        rpc.rpc_async("worker2", raise_value_error, args=("bad value 43",)).wait()
    with pytest.raises(ValueError, match="bad value 45"):
        rpc.remote("worker0", raise_value_error, args=("bad value 45",)).to_here()


def test_remote_exception_same_type_on_to_here(cluster):
    rref = rpc.remote("worker1", raise_value_error, args=("bad value 44",))
    for _ in range(2):
        with pytest.raises(ValueError, match="bad value 44"):
            rref.to_here()


def test_unrebuildable_exception_becomes_remote_error(cluster):
    with pytest.raises(rpc.RemoteError) as info:
        rpc.rpc_sync("worker1", raise_two_arg_error)
    error = info.value
    assert isinstance(error, RuntimeError)
    assert isinstance(error, rpc.ActorRpcError)
    assert "TwoArgError" in error.remote_type
    assert "TwoArgError" in str(error)
    assert "worker1" in str(error) and error.worker and "worker1" in error.worker
    assert "needs two args" in str(error)
    assert "raise_two_arg_error" in error.remote_traceback


def _divide_by_zero(numbers: list[int]) -> float:
    return numbers[0] / 0  # a line Python 3.11 would place column markers under


def test_remote_traceback_is_formatted_without_parsing_source(monkeypatch):
    # CPython 3.11 places the markers with ast.parse, whose per-interpreter state breaks
    # a parse racing in another thread (pytest's, IPython's): agent threads never parse
    parsed: list[object] = []
    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(a) or real_parse(*a, **k))
    try:
        try:
            _divide_by_zero([1])
        except ZeroDivisionError as cause:
            raise ValueError("wrapped") from cause
    except ValueError as error:
        _, _, text, worker = pack_exception(error, "worker7")
        frames = format_traceback(error.__cause__, frames_only=True)  # type: ignore[arg-type]
        assert parsed == []
        if sys.version_info[:2] == (3, 11):  # the premise: the standard format parses there
            traceback.format_exception(error)
            assert parsed
    assert worker == "worker7"
    assert "numbers[0] / 0" in text and "_divide_by_zero" in text
    assert "ZeroDivisionError" in text and "ValueError: wrapped" in text and "^^" not in text
    assert "numbers[0] / 0" in frames and "ZeroDivisionError" not in frames


def test_function_missing_on_callee(cluster, tmp_path, monkeypatch):
    module_name = f"only_on_worker0_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module_name}.py").write_text(
        textwrap.dedent(
            """
            def local_only(x):
                return x * 2
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(module_name)
    try:
        assert module.local_only(2) == 4  # it works here, the callee cannot import it
        with pytest.raises(rpc.ActorRpcError) as info:
            rpc.rpc_sync("worker1", module.local_only, args=(3,), timeout=20)
        message = str(info.value)
        assert module_name in message
        assert "worker1" in message
        assert isinstance(info.value, rpc.DeserializationError)
        # the callee keeps serving
        assert rpc.rpc_sync("worker1", whoami) == "worker1"
    finally:
        sys.modules.pop(module_name, None)


def test_unpicklable_argument_raises_locally(cluster):
    agent = current_agent()
    sent_before = agent.stats["calls_sent"]
    lock = threading.Lock()
    with pytest.raises(rpc.SerializationError) as info:
        rpc.rpc_sync("worker1", echo, args=(lock,))
    assert "lock" in str(info.value).lower()
    assert isinstance(info.value, TypeError) and isinstance(info.value, RuntimeError)
    with pytest.raises(rpc.SerializationError):
        rpc.rpc_async("worker1", echo, kwargs={"obj": {"nested": [1, lock]}})
    pending_users = rpc.get_rref_debug_info()["num_pending_users"]
    with pytest.raises(rpc.SerializationError):
        rpc.remote("worker1", echo, args=(lock,))
    with pytest.raises(rpc.SerializationError):
        rpc.remote("worker0", echo, args=(lock,))
    # a remote() that was never sent leaves no RRef bookkeeping behind
    assert rpc.get_rref_debug_info()["num_pending_users"] == pending_users
    assert agent.stats["calls_sent"] == sent_before  # nothing was sent
    assert not agent._pending
    assert rpc.rpc_sync("worker1", whoami) == "worker1"


def test_unpicklable_argument_error_names_args_path(cluster):
    lock = threading.Lock()
    with pytest.raises(rpc.SerializationError) as info:
        rpc.rpc_sync("worker1", echo, args=(1, lock))
    assert "args[1]" in str(info.value) and "arguments[" not in str(info.value)
    with pytest.raises(rpc.SerializationError) as info:
        rpc.rpc_async("worker1", echo, kwargs={"obj": lock})
    assert "kwargs['obj']" in str(info.value)


def test_unpicklable_result_is_reported(cluster):
    with pytest.raises(rpc.SerializationError, match="lock"):
        rpc.rpc_sync("worker1", threading.Lock)
    assert rpc.rpc_sync("worker1", whoami) == "worker1"


# --- timeouts -------------------------------------------------------------------------


def _release_on(worker: str, key: str) -> None:
    rpc.rpc_sync(worker, release, args=(key,), timeout=10)


def test_timed_out_call_error(cluster):
    key = uuid.uuid4().hex
    start = time.monotonic()
    fut = rpc.rpc_async("worker1", wait_for_release, args=(key, 30), timeout=0.5)
    try:
        with pytest.raises(rpc.RpcTimeoutError) as info:
            fut.wait()
        elapsed = time.monotonic() - start
        error = info.value
        assert isinstance(error, TimeoutError)
        assert isinstance(error, RuntimeError)
        assert "RPC ran for more than" in str(error)
        assert 0.4 <= elapsed < 5, elapsed  # the per-call 0.5 s beat the 30 s default
        with pytest.raises(TimeoutError):
            fut.wait()  # still failed on a second wait
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            rpc.rpc_sync("worker2", wait_for_release, args=(key, 30), timeout=0.3)
    finally:
        _release_on("worker1", key)
        _release_on("worker2", key)


def test_per_call_timeout_beats_default_and_zero_means_none(cluster, monkeypatch):
    # shrink this worker's default timeout (what torch's _set_rpc_timeout does)
    monkeypatch.setattr(current_agent().options, "rpc_timeout", 0.3)
    assert rpc.get_rpc_timeout() == 0.3
    key = uuid.uuid4().hex
    try:
        # the default applies when no timeout is given
        with pytest.raises(rpc.RpcTimeoutError):
            rpc.rpc_sync("worker1", wait_for_release, args=(key, 30))
        # a longer per-call timeout beats the short default: the callee gives up after 1 s
        assert (
            rpc.rpc_sync("worker1", wait_for_release, args=(key + "x", 1.0), timeout=20)
            == "gave up"
        )
        # timeout=0: no timeout at all, even well past the default
        fut = rpc.rpc_async("worker2", wait_for_release, args=(key, 30), timeout=0)
        finished = threading.Event()
        fut.add_done_callback(lambda _: finished.set())
        assert not finished.wait(1.0), "a timeout=0 call completed or failed early"
        _release_on("worker2", key)
        assert fut.wait() == "released"
    finally:
        _release_on("worker1", key)
        _release_on("worker2", key)


def test_remote_timeout(cluster):
    key = uuid.uuid4().hex
    try:
        rref = rpc.remote("worker1", wait_for_release, args=(key, 30), timeout=0.5)
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            rref._get_future().wait()
        with pytest.raises(RuntimeError, match="RRef creation via rpc.remote"):
            rref.to_here()
    finally:
        _release_on("worker1", key)


def test_to_here_timeout(cluster):
    key = uuid.uuid4().hex
    try:
        rref = rpc.remote("worker2", wait_for_release, args=(key, 30), timeout=0)
        start = time.monotonic()
        with pytest.raises(rpc.RpcTimeoutError, match="RPC ran for more than"):
            rref.to_here(timeout=0.5)
        assert time.monotonic() - start < 5
        _release_on("worker2", key)
        assert rref.to_here(timeout=10) == "released"
    finally:
        _release_on("worker2", key)


# --- workers and their identities -------------------------------------------------------


def test_unknown_worker_raises_value_error_listing_names(cluster):
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync("worker9", whoami)
    for name in cluster:
        assert name in str(info.value)
    assert "worker9" in str(info.value)
    assert isinstance(info.value, rpc.UnknownWorkerError)
    with pytest.raises(ValueError):
        rpc.rpc_async(17, whoami)
    with pytest.raises(ValueError):
        rpc.remote(rpc.WorkerInfo("worker1", 2), whoami)  # name and id do not match
    with pytest.raises(ValueError, match="worker0"):
        rpc.get_worker_info("nobody")


def test_get_worker_info_and_infos(cluster):
    me = rpc.get_worker_info()
    assert (me.name, me.id) == ("worker0", 0)
    assert rpc.get_worker_info("worker2") == rpc.WorkerInfo("worker2", 2)
    infos = rpc.get_worker_infos()
    assert [(i.name, i.id) for i in infos] == [(f"worker{r}", r) for r in range(3)]
    # ids equal ranks on every worker
    assert rpc.rpc_sync("worker1", rpc.get_worker_info) == rpc.WorkerInfo("worker1", 1)
    assert rpc.rpc_sync("worker2", rpc.get_worker_infos) == infos


def test_workerinfo_repr_hash_eq_pickle(cluster):
    info = rpc.get_worker_info("worker1")
    assert repr(info) == "WorkerInfo(id=1, name=worker1)"
    same = rpc.WorkerInfo("worker1", 1)
    assert info == same and hash(info) == hash(same)
    assert info != rpc.WorkerInfo("worker1", 2)
    assert info != rpc.WorkerInfo("worker2", 1)
    assert info != "worker1"
    assert len({info, same, rpc.WorkerInfo("worker2", 2)}) == 2
    assert pickle.loads(pickle.dumps(info)) == info
    assert rpc.rpc_sync("worker2", echo, args=(info,)) == info


def test_init_rpc_while_initialized_raises(cluster):
    with pytest.raises(rpc.AlreadyInitializedError, match="already initialized"):
        rpc.init_rpc("worker5", rank=0, world_size=3)
    assert rpc.rpc_sync("worker1", whoami) == "worker1"


# --- functions by value ------------------------------------------------------------------


def test_lambda_travels_by_value(cluster):
    assert rpc.rpc_sync("worker1", lambda x: x * 3 + 1, args=(4,)) == 13
    t = torch.ones(2)
    assert torch.equal(rpc.rpc_sync("worker2", lambda x: torch.mul(x, 5), args=(t,)), t * 5)


def test_closure_travels_by_value(cluster):
    offset = 100
    adder = make_adder(7)
    assert rpc.rpc_sync("worker1", adder, args=(1,)) == 8
    assert rpc.rpc_sync("worker2", lambda x: x + offset, args=(1,)) == 101
    assert rpc.remote("worker1", make_adder(9), args=(1,)).to_here() == 10


def test_main_module_function_travels_by_value(cluster):
    namespace = {"__name__": "__main__"}
    exec(
        textwrap.dedent(
            """
            FACTOR = 6

            def main_style(x):
                return x * FACTOR

            class MainStyle:
                def __init__(self, v):
                    self.v = v

                def doubled(self):
                    return self.v * 2
            """
        ),
        namespace,
    )
    func = namespace["main_style"]
    assert func.__module__ == "__main__"
    assert rpc.rpc_sync("worker1", func, args=(7,)) == 42
    assert rpc.rpc_sync("worker2", namespace["MainStyle"], args=(5,)).doubled() == 10


def test_redefined_lambda_is_not_served_from_cache(cluster):
    results = []
    for k in range(3):
        results.append(rpc.rpc_sync("worker1", lambda x, k=k: x + k, args=(10,)))
    assert results == [10, 11, 12]
    for k in range(3):
        code = f"def f(x):\n    return x * {k + 2}\n"
        namespace = {"__name__": "__main__"}
        exec(code, namespace)
        assert rpc.rpc_sync("worker2", namespace["f"], args=(10,)) == 10 * (k + 2)
