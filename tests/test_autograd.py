"""Distributed autograd over the session's real 3-worker group (this process is worker0).

Functions defined at module level here run on the other workers (they import
this module). Every test ends by checking that no worker still holds an autograd
context: leaving a context must release it everywhere, transitively.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import actorrpc as rpc
import actorrpc.autograd as dist_autograd
from actorrpc.autograd import _engine as _engine_module
from actorrpc.errors import DistAutogradError

from ._waiting import wait_until

# -- helpers that run on the workers -------------------------------------------------------------


def _debug_info() -> dict[str, Any]:
    return dist_autograd.debug_info()


def _context_summary(context_id: int) -> dict[str, Any]:
    ctx = dist_autograd._retrieve_context(context_id)
    sends = ctx._send_functions()
    recvs = ctx._recv_functions()
    return {
        "send": len(sends),
        "recv": len(recvs),
        "send_names": sorted(type(n).__name__ for n in sends.values()),
        "recv_names": sorted(type(n).__name__ for n in recvs.values()),
        "known": sorted(ctx._known_worker_ids()),
    }


def _has_context(context_id: int) -> bool:
    try:
        dist_autograd._retrieve_context(context_id)
    except DistAutogradError:
        return False
    return True


def _new_context_id() -> int:
    with dist_autograd.context() as context_id:
        return context_id


def _py_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def _current_id() -> int:
    return dist_autograd._current_context()._context_id()


def _nested_mul_tanh(dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """On the middle worker: a remote product, then a local op that reuses ``a``."""
    product = rpc.rpc_sync(dst, torch.mul, args=(a, b))
    return torch.tanh(product) + a


def _nested_mul_tanh_local(dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a * b) + a


def _call_back(dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """worker1 calls back into ``dst`` (worker0), then uses the result."""
    back = rpc.rpc_sync(dst, _py_add, args=(a * 2, b))
    return back * a


@rpc.functions.async_execution
def _async_mul_double(dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.futures.Future:
    """Replies with a Future: the response's send function is recorded when it completes."""
    return rpc.rpc_async(dst, torch.mul, args=(a, b)).then(lambda fut: fut.wait() * 2)


def _sum_of_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a + b).sum()


def _call_back_local(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * 2 + b) * a


class _Double(torch.autograd.Function):
    """A Python autograd node that also stores a ``variable`` in its ctx (as a user may)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.variable = "user state"
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2


def _nnz(x: torch.Tensor) -> int:
    return int(x._nnz())


def _sparse_from_python_node(n: int) -> torch.Tensor:
    leaf = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (n,), requires_grad=True,
                                   check_invariants=True)
    return _Double.apply(leaf)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise ValueError("boom in a remote backward")


def _raise_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _Boom.apply(x)


_PARAMS: dict[int, torch.Tensor] = {}
_PARAMS_LOCK = threading.Lock()


def _make_param(key: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(key)
    return torch.randn(3, 3, generator=generator, dtype=torch.float64).requires_grad_()


def _param(key: int) -> torch.Tensor:
    with _PARAMS_LOCK:
        if key not in _PARAMS:
            _PARAMS[key] = _make_param(key)
        return _PARAMS[key]


def _param_op(key: int, a: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ _param(key))


def _param_grads(context_id: int, keys: list[int]) -> list[torch.Tensor | None]:
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(_param(k)) for k in keys]


# The random programs' ops: all operands and results are 3x3.
_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "mul": torch.mul,
    "matmul": torch.matmul,
    "tanh": lambda a, b: torch.tanh(a),
    "sum": lambda a, b: a.sum() * b,
}


def _hop(path: list[int], op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Apply ``op`` at the end of ``path``; each worker on the way adds an op on the way back."""
    if not path:
        return _OPS[op](a, b)
    result = rpc.rpc_sync(f"worker{path[0]}", _hop, args=(path[1:], op, a, b))
    return result * 0.5 + a.mean()


def _hop_local(path: list[int], op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not path:
        return _OPS[op](a, b)
    return _hop_local(path[1:], op, a, b) * 0.5 + a.mean()


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def workers(cluster: list[str]) -> Iterator[list[str]]:
    """The group; afterwards, no worker may still hold an autograd context."""
    yield cluster
    assert dist_autograd._wait_for_cleanup(20.0), "context cleanup was not acknowledged"
    assert dist_autograd.debug_info()["num_autograd_contexts"] == 0
    for name in cluster[1:]:
        info = rpc.rpc_sync(name, _debug_info)
        assert info["num_autograd_contexts"] == 0, f"{name} still holds contexts: {info}"


def _leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()
        for shape in shapes
    ]


def _reference(leaves: list[torch.Tensor], forward: Callable[..., torch.Tensor]) -> list[Any]:
    """Gradients of ``forward(*copies)`` by local autograd, for copies of ``leaves``."""
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    return list(torch.autograd.grad(forward(*copies), copies, allow_unused=True))


def _outside_context(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a fresh thread, which has no current autograd context."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def _assert_grads(context_id: int, leaves: list[torch.Tensor], expected: list[Any]) -> None:
    grads = dist_autograd.get_gradients(context_id)
    for i, (leaf, want) in enumerate(zip(leaves, expected)):
        if want is None:
            assert leaf not in grads, f"leaf {i} should get no gradient"
        else:
            torch.testing.assert_close(grads[leaf], want, msg=lambda m, i=i: f"leaf {i}: {m}")
        assert leaf.grad is None, "distributed backward must not write .grad"


# -- contexts --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_context_ids_unique_and_nesting_raises(workers: list[str]) -> None:
    with dist_autograd.context() as first:
        assert first >> 48 == 0
        assert dist_autograd._current_context()._context_id() == first
        assert rpc.rpc_sync("worker1", _current_id) == first  # the callee runs in it
        with pytest.raises(DistAutogradError, match="Already have an autograd context id"):
            with dist_autograd.context():
                pass
        assert dist_autograd._current_context()._context_id() == first  # still current
        other: list[int] = []
        thread = threading.Thread(target=lambda: other.append(_new_context_id()))
        thread.start()
        thread.join()
        assert other[0] != first  # the current context is per thread
    with dist_autograd.context() as second:
        assert second != first
    remote_ids = {rpc.rpc_sync("worker1", _new_context_id) for _ in range(3)}
    assert len(remote_ids) == 3 and all(i >> 48 == 1 for i in remote_ids)
    assert dist_autograd._get_max_id() == (1 << 48) - 1
    with pytest.raises(DistAutogradError, match="Current thread doesn't have"):
        dist_autograd._current_context()


@pytest.mark.timeout(60)
def test_get_gradients_unknown_context(workers: list[str]) -> None:
    with pytest.raises(DistAutogradError, match="Could not find autograd context with id: 12345"):
        dist_autograd.get_gradients(12345)
    with dist_autograd.context() as context_id:
        assert dist_autograd.get_gradients(context_id) == {}
    missing = f"Could not find autograd context with id: {context_id}"
    with pytest.raises(DistAutogradError, match=missing):
        dist_autograd.get_gradients(context_id)


@pytest.mark.timeout(60)
def test_graph_recorded_only_for_tensors_requiring_grad(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
        local = _context_summary(context_id)
        assert local["send"] == 1 and local["recv"] == 1  # request out, response back
        assert local["send_names"] == ["SendRpcBackward"]
        assert local["recv_names"] == ["RecvRpcBackward"]
        assert local["known"] == [1]
        send = next(iter(dist_autograd._current_context()._send_functions().values()))
        edges = {type(n).__name__ for n, _ in send.next_functions}
        assert edges == {"AccumulateGrad"}
        remote = rpc.rpc_sync("worker1", _context_summary, args=(context_id,))
        assert remote["send"] == 1 and remote["recv"] == 1 and remote["known"] == [0]
    with dist_autograd.context() as context_id:
        plain = torch.ones(3, 3)
        result = rpc.rpc_sync("worker2", torch.add, args=(plain, plain))
        assert not result.requires_grad
        assert _context_summary(context_id)["send"] == 0
        assert _context_summary(context_id)["recv"] == 0
        assert _context_summary(context_id)["known"] == [2]
        remote = rpc.rpc_sync("worker2", _context_summary, args=(context_id,))
        assert remote["send"] == 0 and remote["recv"] == 0
    # Outside a context nothing is recorded and the tensors arrive as leaves.
    result = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
    assert result.requires_grad and result.grad_fn is None


@pytest.mark.timeout(60)
def test_gradients_of_the_wrong_shape_from_a_peer_are_refused(workers: list[str]) -> None:
    # the engine itself would only check that a gradient broadcasts (and sum it)
    from actorrpc.agent import current_agent
    from actorrpc.autograd._engine import engine_of

    t1, t2 = _leaves((3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
        engine = engine_of(current_agent())
        ctx = engine.store.retrieve(context_id)
        (message_id,) = dist_autograd._current_context()._send_functions()
        wrong = [torch.ones(2, 3, 3), torch.ones(3, 3)]  # broadcasts to (3, 3)
        with pytest.raises(DistAutogradError, match=r"shape \(2, 3, 3\) for a tensor of shape"):
            engine._continue_at(ctx, message_id, wrong, False, 1, None, {})
        assert t1.grad is None and dist_autograd.get_gradients(context_id) == {}


# -- backward correctness ------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("func", [torch.add, _py_add], ids=["builtin", "python"])
def test_backward_simple(workers: list[str], func: Callable[..., torch.Tensor]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        loss = (rpc.rpc_sync("worker1", func, args=(t1, t2)) * t1).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [t1, t2], _reference([t1, t2], lambda a, b: ((a + b) * a).sum()))


@pytest.mark.timeout(60)
def test_gradients_for_the_requester_travel_in_the_reply(workers: list[str]) -> None:
    # worker0 -> worker1 -> back to worker0's send function: one message pair, not two
    t1, t2 = _leaves((3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2)).sum()
        rpc.start_tracing()  # counts backward's messages only (not liveness checks, say)
        dist_autograd.backward(context_id, [loss])
        events = rpc.stop_tracing()["traceEvents"]
        backward = sorted(
            (e["pid"], e["cat"])
            for e in events
            if e["ph"] == "X" and ("backward" in e["name"] or e["name"] == "AUTOGRAD_BACKWARD")
        )
        # one call from worker0, served by worker1; nothing sent back but the reply
        assert backward == [(0, "rpc"), (1, "serve")]
        _assert_grads(context_id, [t1, t2], [t2.detach(), t1.detach()])


@pytest.mark.internals
@pytest.mark.timeout(60)
def test_gradients_for_sent_leaves_go_to_them_without_an_engine_pass(
    workers: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.agent import current_agent
    from actorrpc.autograd import _engine

    passes: list[int] = []
    engine_pass = _engine.gradients_at

    def counted(*args: Any) -> Any:
        passes.append(1)
        return engine_pass(*args)

    monkeypatch.setattr(_engine, "gradients_at", counted)
    t1, t2 = _leaves((3, 3), (3, 3), seed=3)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2)).sum()
        dist_autograd.backward(context_id, [loss])
        assert len(passes) == 1  # from the loss; the gradients for t1, t2 went straight in
        _assert_grads(context_id, [t1, t2], [t2.detach(), t1.detach()])
    # A tensor hook on a sent leaf runs on the gradient that comes back, as the engine does.
    t3 = _leaves((3, 3), seed=4)[0]
    t3.register_hook(lambda grad: grad * 3)
    passes.clear()
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t3, t2)).sum()
        dist_autograd.backward(context_id, [loss])
        assert len(passes) == 2
        _assert_grads(context_id, [t3, t2], [3 * t2.detach(), t3.detach()])
    # A gradient of another dtype is cast to the leaf's, as the engine casts it.
    with dist_autograd.context() as context_id:
        rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
        ctx = _engine.engine_of(current_agent()).store.retrieve(context_id)
        (message_id,) = dist_autograd._current_context()._send_functions()
        float32 = [torch.ones(3, 3, dtype=torch.float32), torch.ones(3, 3, dtype=torch.float32)]
        _engine.engine_of(current_agent())._continue_at(ctx, message_id, float32, True, 1, None,
                                                         {})
        grads = dist_autograd.get_gradients(context_id)
        assert grads[t1].dtype == grads[t2].dtype == torch.float64


@pytest.mark.timeout(60)
def test_a_message_of_leaves_makes_its_send_node_only_when_needed(workers: list[str]) -> None:
    """Leaves sent are recorded as they are; their edges are made when needed (a hook
    registered after the send) and a SendRpcBackward node only when asked for
    (``_send_functions()``); a message with a non-leaf gets its edges at once, no node."""
    from actorrpc.agent import current_agent
    from actorrpc.autograd import _engine

    store = _engine.engine_of(current_agent()).store
    t1, t2 = _leaves((3, 3), (3, 3), seed=5)
    with dist_autograd.context() as context_id:
        rpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
        (send,) = store.retrieve(context_id).send_functions.values()
        assert send.aliases is None and send.edges is None and send.leaves == (t1, t2)
        (node,) = dist_autograd._current_context()._send_functions().values()
        assert node.name() == "SendRpcBackward"
        assert [n.variable for n, _ in node.next_functions] == [t1, t2]
        rpc.rpc_sync("worker1", torch.mul, args=(t1, t2 * 1))
        mixed = [s for s in store.retrieve(context_id).send_functions.values() if s is not send]
        assert mixed[0].edges is not None and mixed[0].leaves is None
        assert mixed[0].aliases is None  # no node: a pass starts at the edges
        assert [type(e.node).__name__ for e in mixed[0].edges] == ["AccumulateGrad", "MulBackward0"]
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2)).sum()
        t1.register_hook(lambda grad: grad * 3)  # after the send: the engine must run it
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [t1, t2], [3 * t2.detach(), t1.detach()])
    with dist_autograd.context() as context_id:  # the node can no longer be made: said so
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2)).sum()
        t1.requires_grad_(False)
        with pytest.raises(DistAutogradError, match="no longer requires grad"):
            dist_autograd.backward(context_id, [loss])
    t1.requires_grad_(True)


def _send_functions_prepared(context_id: int) -> list[str]:
    """On a worker: how far each of its send functions in the context was worked out
    (``leaves`` for a message of leaves, ``reach`` when its pass inputs were made, else
    ``no``), in message id order."""
    from actorrpc.agent import current_agent
    from actorrpc.autograd import _engine

    ctx = _engine.engine_of(current_agent()).store.retrieve(context_id)
    states = []
    for _, send in sorted(ctx.send_functions.items()):
        if send.leaves:
            states.append("leaves")
        elif send.reach is not None and send.reach._inputs is not None:
            states.append("reach")
        else:
            states.append("no")
    return states


@pytest.mark.timeout(60)
def test_a_callees_send_functions_are_worked_out_after_its_reply(workers: list[str]) -> None:
    """The callee works out the pass its result's gradients will start (the graph's reach
    and the pass inputs) after the reply left, before any backward asks for it."""
    t1, t2 = _leaves((3, 3), (3, 3), seed=21)
    param = _outside_context(lambda: rpc.rpc_sync("worker1", _param, args=(21,))).detach()

    def prepared(context_id: int) -> list[str]:
        return rpc.rpc_sync("worker1", _send_functions_prepared, args=(context_id,))

    with dist_autograd.context() as context_id:
        product = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
        assert wait_until(lambda: prepared(context_id) == ["reach"], 10), prepared(context_id)
        remote_param = rpc.rpc_sync("worker1", _param, args=(21,))  # a leaf: nothing to do
        want = ["reach", "leaves"]
        assert wait_until(lambda: prepared(context_id) == want, 10), prepared(context_id)
        # remote() creations and fetches leave it to the pass that needs it (a fetch may
        # be served inline, on a thread that receives)
        rref = rpc.remote("worker1", torch.add, args=(t1, t2))
        fetched = rref.to_here()
        assert prepared(context_id) == [*want, "no", "no"]  # (the creation's, the fetch's)
        loss = (product * remote_param + fetched).sum()
        dist_autograd.backward(context_id, [loss])
        expected = _reference([t1, t2], lambda a, b: (a * b * param + (a + b)).sum())
        _assert_grads(context_id, [t1, t2], expected)
        del rref


@pytest.mark.internals
@pytest.mark.timeout(60)
def test_an_initiator_with_one_message_out_waits_on_its_reply_directly(
    workers: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one backward message is outstanding (a call's, whose reply hands back one
    pass), the initiator waits on that reply and runs the pass itself, with no driver;
    the same chain with the switch off, and two messages out (two peers), take a driver;
    the gradients are the same either way."""
    drivers: list[Any] = []

    class CountedDriver(_engine_module.PassDriver):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            drivers.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_engine_module, "PassDriver", CountedDriver)
    t1, t2 = _leaves((3, 3), (3, 3), seed=31)
    with dist_autograd.context() as context_id:
        chained = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
        chained = rpc.rpc_sync("worker1", torch.add, args=(chained, t1))  # a pass, then another
        dist_autograd.backward(context_id, [chained.sum()])
        expected = _reference([t1, t2], lambda a, b: (a * b + a).sum())
        _assert_grads(context_id, [t1, t2], expected)
    assert drivers == []
    monkeypatch.setattr(_engine_module, "DRIVE_ONE_DIRECTLY", False)  # the driver's way
    with dist_autograd.context() as context_id:
        chained = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
        chained = rpc.rpc_sync("worker1", torch.add, args=(chained, t1))
        dist_autograd.backward(context_id, [chained.sum()])
        _assert_grads(context_id, [t1, t2], expected)
    assert len(drivers) == 1
    monkeypatch.setattr(_engine_module, "DRIVE_ONE_DIRECTLY", True)
    with dist_autograd.context() as context_id:
        loss = (rpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
                + rpc.rpc_sync("worker2", torch.add, args=(t1, t2))).sum()
        dist_autograd.backward(context_id, [loss])
        expected = _reference([t1, t2], lambda a, b: (a * b + a + b).sum())
        _assert_grads(context_id, [t1, t2], expected)
    assert len(drivers) == 2


_stored: list[torch.Tensor] = []


def _store(t: torch.Tensor) -> None:
    _stored.append(t)


def _combine_stored() -> torch.Tensor:
    total = _stored[0]
    for t in _stored[1:]:
        total = total + t
    _stored.clear()
    return total


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "order", [("a", "b"), ("a", "a", "z2"), ("z2", "a", "a"), ("a", "z2", "a")]
)
def test_gradients_kept_from_the_wire_are_never_shared(workers: list[str], order: Any) -> None:
    """The context keeps a received gradient rather than a copy only when nothing else
    refers to it. Here worker1 adds up tensors that came in separate messages, so its
    reply hands back one gradient object (pickle's memo) for several of this worker's
    messages: kept for one leaf it would also be another leaf's, or the start of
    another message's pass, and adding into it would change both."""
    weight = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    a, b, z = (torch.ones(3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sent = {"a": lambda: a, "b": lambda: b, "z2": lambda: z * 2}
    with dist_autograd.context() as context_id:
        for name in order:
            rpc.rpc_sync("worker1", _store, args=(sent[name](),))
        loss = (rpc.rpc_sync("worker1", _combine_stored) * weight).sum()
        for passes in (1, 2):  # a second pass adds into what the first one kept
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            grads = dist_autograd.get_gradients(context_id)
            for leaf, name, factor in ((a, "a", 1), (b, "b", 1), (z, "z2", 2)):
                if name in order:
                    expected = weight * factor * order.count(name) * passes
                    torch.testing.assert_close(grads[leaf], expected, msg=f"{name} pass {passes}")
            if "b" in order:
                assert grads[a] is not grads[b]


@pytest.mark.internals
@pytest.mark.timeout(60)
@pytest.mark.parametrize("same_leaf", [False, True], ids=["two-leaves", "one-leaf-twice"])
def test_a_gradient_given_for_two_leaves_is_kept_by_the_last_only(
    workers: list[str], monkeypatch: pytest.MonkeyPatch, same_leaf: bool
) -> None:
    """An add's two inputs get one gradient object, which its reply carries once (pickle's
    memo): the first leaf takes a copy and the last keeps the tensor itself, so the two
    leaves' gradients stay apart (a second pass adds into each on its own). One leaf
    sent twice travels once, and its one gradient (the two uses' sum) is kept."""
    a, b = _leaves((3,), (3,), seed=41)
    second = a if same_leaf else b
    with dist_autograd.context() as context_id:
        ctx = dist_autograd._retrieve_context(context_id)
        owned_flags: list[bool] = []
        accumulate = ctx.accumulate

        def spy(leaf: torch.Tensor, grad: torch.Tensor, owned: bool = False) -> None:
            owned_flags.append(owned)
            accumulate(leaf, grad, owned)

        monkeypatch.setattr(ctx, "accumulate", spy)
        loss = rpc.rpc_sync("worker1", torch.add, args=(a, second)).sum()
        for passes in (1, 2):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert owned_flags == ([True] if same_leaf else [False, True]) * passes
            grads = dist_autograd.get_gradients(context_id)
            per_use = torch.full((3,), float(passes), dtype=torch.float64)
            if same_leaf:
                torch.testing.assert_close(grads[a], per_use * 2)
            else:
                torch.testing.assert_close(grads[a], per_use)
                torch.testing.assert_close(grads[b], per_use)
                assert grads[a].data_ptr() != grads[b].data_ptr()


def _sparse_embedding_sum(weight: torch.Tensor) -> torch.Tensor:
    rows = torch.tensor([0, 2, 2])
    return torch.nn.functional.embedding(rows, weight, sparse=True).sum()


@pytest.mark.timeout(60)
def test_a_sparse_gradient_from_the_wire_goes_to_its_leaf(workers: list[str]) -> None:
    """A dense leaf's gradient that comes back sparse (an embedding with ``sparse=True`` on
    the callee) is taken as a sparse gradient, and a second pass adds into it."""
    weight = torch.ones(4, 2, dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", _sparse_embedding_sum, args=(weight,))
        expected = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0]],
                                dtype=torch.float64)
        for passes in (1, 2):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            grad = dist_autograd.get_gradients(context_id)[weight]
            assert grad.is_sparse
            torch.testing.assert_close(grad.to_dense(), expected * passes)


@pytest.mark.timeout(60)
def test_an_expanded_gradient_from_the_wire_is_copied(workers: list[str]) -> None:
    """A received gradient with zero strides (the sum's) cannot be added into in place."""
    t1, t2 = _leaves((3, 3), (3, 3), seed=6)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", _sum_of_add, args=(t1, t2))
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [t1, t2], [torch.full((3, 3), 2.0, dtype=torch.float64)] * 2)


@pytest.mark.timeout(60)
def test_a_sent_tensor_changed_in_place_afterwards_backpropagates_as_it_was_sent(
    workers: list[str],
) -> None:
    """The pass from a send function starts at the edges the tensors had when they left
    (torch's SendRpcBackward): ``sent.mul_(5)`` after the RPC is not part of it."""
    (t1,) = _leaves((3, 3), seed=8)
    with dist_autograd.context() as context_id:
        sent = t1 * 3
        loss = rpc.rpc_sync("worker1", torch.sum, args=(sent,))
        sent.mul_(5)
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [t1], [torch.full((3, 3), 3.0, dtype=torch.float64)])


@pytest.mark.timeout(60)
def test_sent_outputs_of_python_nodes_dense_and_sparse(workers: list[str]) -> None:
    """A sent tensor whose grad_fn is a Python node (a custom Function) keeps that node
    alive through its edge's token (a view for strided tensors, an alias for sparse ones,
    which have no views); a ctx attribute named ``variable`` does not make it a leaf."""
    import gc

    from actorrpc.autograd._functions import edges_of, leaves_of_edges

    (x,) = _leaves((3,), seed=9)
    assert leaves_of_edges(edges_of([_Double.apply(x)])) is None
    with dist_autograd.context() as context_id:
        sent = _Double.apply(x)
        loss = rpc.rpc_sync("worker1", torch.sum, args=(sent,))
        sent.detach_()  # only the edge's token keeps the custom node alive now
        del sent
        gc.collect()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [x], [torch.full((3,), 2.0, dtype=torch.float64)])
        sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), requires_grad=True,
                                         check_invariants=True)
        assert rpc.rpc_sync("worker1", _nnz, args=(_Double.apply(sparse),)) == 2
        assert rpc.rpc_sync("worker1", _sparse_from_python_node, args=(3,))._nnz() == 2


@pytest.mark.timeout(60)
def test_gradient_shapes_are_checked_against_the_shapes_sent(workers: list[str]) -> None:
    """``y.data = ...`` after the send changes y's shape, not the graph it was sent with."""
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = x * 3
        loss = rpc.rpc_sync("worker1", torch.sum, args=(y,))
        with torch.no_grad():
            y.data = torch.zeros(5)
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [x], [torch.full((3,), 3.0)])
        y.detach_()
        with pytest.raises(DistAutogradError, match="no longer require grad"):
            dist_autograd._retrieve_context(context_id)._send_functions()


@pytest.mark.timeout(60)
def test_backward_from_a_received_scalar(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker2", _sum_of_add, args=(t1, t2 * t2))
        assert type(loss.grad_fn).__name__ == "RecvRpcBackward"
        dist_autograd.backward(context_id, [loss])
        ones = torch.ones(3, 3, dtype=torch.float64)
        _assert_grads(context_id, [t1, t2], [ones, 2 * t2.detach()])


@pytest.mark.timeout(60)
def test_backward_old_form_uses_current_context(workers: list[str]) -> None:
    (t1,) = _leaves((2, 2))
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker2", torch.mul, args=(t1, t1)).sum()
        dist_autograd.backward([loss])
        _assert_grads(context_id, [t1], [2 * t1.detach()])


@pytest.mark.timeout(60)
def test_backward_chain_through_three_workers(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3), seed=1)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", _nested_mul_tanh, args=("worker2", t1, t2))
        loss = out.sum()
        dist_autograd.backward(context_id, [loss])
        expected = _reference([t1, t2], lambda a, b: _nested_mul_tanh_local("", a, b).sum())
        _assert_grads(context_id, [t1, t2], expected)
        # worker1 knows both neighbours; worker2 knows worker1 (and worker0 from this query).
        assert rpc.rpc_sync("worker1", _context_summary, args=(context_id,))["known"] == [0, 2]
        assert 1 in rpc.rpc_sync("worker2", _context_summary, args=(context_id,))["known"]


@pytest.mark.timeout(60)
def test_backward_cycle_back_to_initiator(workers: list[str]) -> None:
    t1, t2 = _leaves((3,), (3,), seed=2)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", _call_back, args=("worker0", t1, t2))
        loss = (out * t2).sum()
        dist_autograd.backward(context_id, [loss])
        expected = _reference([t1, t2], lambda a, b: (((a * 2 + b) * a) * b).sum())
        _assert_grads(context_id, [t1, t2], expected)


@pytest.mark.timeout(60)
def test_backward_multiple_round_trips(workers: list[str]) -> None:
    t1, t2, t3, t4 = _leaves((3, 3), (3, 3), (3, 3), (3, 3), seed=3)

    def forward(a: Any, b: Any, c: Any, d: Any, call: Callable[..., Any]) -> torch.Tensor:
        val = call("worker1", torch.add, (a, b))
        val = call("worker2", torch.mul, (c, val))
        s1 = call("worker1", torch.stack, ([val],))
        s2 = call("worker2", torch.sum, (s1,))
        val = call("worker1", torch.matmul, (s1[0], d))
        return call("worker2", torch.sum, (val,)) + s2

    with dist_autograd.context() as context_id:
        loss = forward(t1, t2, t3, t4, lambda to, f, args: rpc.rpc_sync(to, f, args=args))
        dist_autograd.backward(context_id, [loss])
        expected = _reference(
            [t1, t2, t3, t4], lambda *ts: forward(*ts, call=lambda to, f, args: f(*args))
        )
        _assert_grads(context_id, [t1, t2, t3, t4], expected)


@pytest.mark.timeout(60)
def test_backward_through_remote_and_to_here(workers: list[str]) -> None:
    t1, t2, t3 = _leaves((3, 3), (3, 3), (3, 3), seed=4)
    with dist_autograd.context() as context_id:
        rref = rpc.remote("worker1", torch.add, args=(t1, t2))
        other = rpc.remote("worker2", _py_add, args=(t2, t3))
        loss = (rref.to_here() * other.to_here()).sum()
        dist_autograd.backward(context_id, [loss])
        expected = _reference([t1, t2, t3], lambda a, b, c: ((a + b) * (b + c)).sum())
        _assert_grads(context_id, [t1, t2, t3], expected)
        del rref, other


@pytest.mark.timeout(60)
def test_backward_to_self(workers: list[str]) -> None:
    t1, t2 = _leaves((4,), (4,), seed=5)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker0", torch.mul, args=(t1, t2)).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [t1, t2], [t2.detach(), t1.detach()])


@pytest.mark.timeout(60)
def test_same_tensor_twice_and_nested_containers(workers: list[str]) -> None:
    t1, t2 = _leaves((3,), (3,), seed=11)
    with dist_autograd.context() as context_id:
        square = rpc.rpc_sync("worker1", torch.mul, args=(t1, t1))
        stacked = rpc.rpc_sync("worker2", torch.stack, args=([t1, {"x": t2}["x"]],))
        echoed = rpc.rpc_sync("worker1", _py_add, kwargs={"a": (t2,)[0], "b": t2 * 3})
        loss = (square + stacked.sum(0) + echoed).sum()
        dist_autograd.backward(context_id, [loss])
        expected = _reference([t1, t2], lambda a, b: (a * a + (a + b) + (b + b * 3)).sum())
        _assert_grads(context_id, [t1, t2], expected)


@pytest.mark.timeout(60)
def test_backward_through_async_execution(workers: list[str]) -> None:
    t1, t2 = _leaves((3,), (3,), seed=12)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", _async_mul_double, args=("worker2", t1, t2))
        dist_autograd.backward(context_id, [(out * t1).sum()])
        expected = _reference([t1, t2], lambda a, b: (a * b * 2 * a).sum())
        _assert_grads(context_id, [t1, t2], expected)


@pytest.mark.timeout(60)
def test_rref_backward_runs_on_owner(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3), seed=13)
    with dist_autograd.context() as context_id:
        rref = rpc.remote("worker1", _sum_of_add, args=(t1, t2 * t2))
        rref.backward(context_id)
        expected = _reference([t1, t2], lambda a, b: (a + b * b).sum())
        _assert_grads(context_id, [t1, t2], expected)
        del rref


@pytest.mark.timeout(60)
def test_gradients_of_remote_leaves_stay_on_their_worker(workers: list[str]) -> None:
    (t1,) = _leaves((3, 3), seed=6)
    key = 10_000
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker2", _param_op, args=(key, t1)).sum()
        dist_autograd.backward(context_id, [loss])
        param = _make_param(key)
        expected = _reference([t1, param], lambda a, p: torch.tanh(a @ p).sum())
        _assert_grads(context_id, [t1], expected[:1])
        (remote_grad,) = rpc.rpc_sync("worker2", _param_grads, args=(context_id, [key]))
        torch.testing.assert_close(remote_grad, expected[1])


@pytest.mark.timeout(60)
def test_backward_accumulates_with_retain_graph(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3), seed=7)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2)).tanh().sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        first = dist_autograd.get_gradients(context_id)
        once = _reference([t1, t2], lambda a, b: (a * b).tanh().sum())
        _assert_grads(context_id, [t1, t2], once)
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        _assert_grads(context_id, [t1, t2], [2 * g for g in once])
        torch.testing.assert_close(first[t1], 2 * once[0])  # updated in place
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [t1, t2], [3 * g for g in once])


@pytest.mark.timeout(60)
def test_second_backward_without_retain_graph_raises(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3), seed=8)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
        loss = out.sum()
        dist_autograd.backward(context_id, [loss])
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            dist_autograd.backward(context_id, [loss])
        # A new root over the same remote graph: the error comes from worker1.
        with pytest.raises(RuntimeError, match="(?s)worker1.*backward through the graph a second"):
            dist_autograd.backward(context_id, [(out * 2).sum()])


@pytest.mark.timeout(60)
def test_error_in_remote_backward_reaches_initiator(workers: list[str]) -> None:
    t1, t2 = _leaves((3,), (3,), seed=9)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", _raise_in_backward, args=(t1,))
        loss = (out * t2).sum()
        with pytest.raises(ValueError, match="(?s)worker1.*boom in a remote backward"):
            dist_autograd.backward(context_id, [loss])
    # Through a chain: the error passes worker1 on its way back.
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", _hop, args=([2], "mul", t1, t2))
        out = rpc.rpc_sync("worker2", _raise_in_backward, args=(out,))
        with pytest.raises(ValueError, match="(?s)worker2.*boom"):
            dist_autograd.backward(context_id, [out.sum()])
    # Nothing is left broken: a fresh context works.
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2)).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, [t1, t2], [t2.detach(), t1.detach()])


@pytest.mark.timeout(60)
def test_concurrent_contexts_in_threads(workers: list[str]) -> None:
    """Threads run their own contexts at once; passes cross the same workers concurrently."""
    errors: list[BaseException] = []

    def train(seed: int) -> None:
        try:
            t1, t2 = _leaves((3, 3), (3, 3), seed=100 + seed)
            for _ in range(5):
                with dist_autograd.context() as context_id:
                    out = rpc.rpc_sync("worker1", _nested_mul_tanh, args=("worker2", t1, t2))
                    back = rpc.rpc_sync("worker2", _call_back, args=("worker0", out, t2))
                    dist_autograd.backward(context_id, [back.sum()])
                    expected = _reference([t1, t2], lambda a, b: _call_back_local(
                        _nested_mul_tanh_local("", a, b), b).sum())
                    _assert_grads(context_id, [t1, t2], expected)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@pytest.mark.timeout(60)
def test_unused_rpc_output_does_not_hang(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3), seed=10)
    with dist_autograd.context() as context_id:
        unused = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
        used = rpc.rpc_sync("worker2", torch.mul, args=(t1, t2))
        dist_autograd.backward(context_id, [used.sum()])
        _assert_grads(context_id, [t1, t2], [t2.detach(), t1.detach()])
        assert unused.requires_grad


@pytest.mark.timeout(60)
def test_backward_invalid_args(workers: list[str]) -> None:
    (t1,) = _leaves((3, 3))
    with dist_autograd.context() as context_id:
        with pytest.raises(ValueError, match="does not require grad"):
            dist_autograd.backward(context_id, [torch.ones(())])
        with pytest.raises(ValueError, match="not a scalar"):
            dist_autograd.backward(context_id, [t1 * 2])
        with pytest.raises(ValueError, match="non-empty list"):
            dist_autograd.backward(context_id, None)
        with pytest.raises(ValueError, match="non-empty list"):
            dist_autograd.backward(context_id, [])
        with pytest.raises(ValueError, match="not a tensor"):
            dist_autograd.backward(context_id, [1.0])
        with pytest.raises(ValueError, match="context_id must be an int"):
            dist_autograd.backward("nope", [t1.sum()])
        with pytest.raises(ValueError, match="retain_graph must be a bool"):
            dist_autograd.backward(context_id, [t1.sum()], retain_graph=None)  # type: ignore[arg-type]
        with pytest.raises(DistAutogradError, match="Could not find autograd context with id: 7"):
            dist_autograd.backward(7, [t1.sum()])
    with pytest.raises(DistAutogradError, match="needs a current autograd context"):
        dist_autograd.backward([t1.sum()])


@pytest.mark.timeout(60)
def test_context_cleanup_propagates(workers: list[str]) -> None:
    t1, t2 = _leaves((3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        # worker0 -> worker1 -> worker2: worker0 does not know worker2.
        rpc.rpc_sync("worker1", _nested_mul_tanh, args=("worker2", t1, t2))
        assert dist_autograd._retrieve_context(context_id)._known_worker_ids() == {1}
        # Asked from another thread (no current context), so worker0 still does not know worker2.
        assert _outside_context(lambda: rpc.rpc_sync("worker2", _has_context, args=(context_id,)))
        assert dist_autograd._retrieve_context(context_id)._known_worker_ids() == {1}
    assert dist_autograd._wait_for_cleanup(20.0)
    with pytest.raises(DistAutogradError):
        dist_autograd._retrieve_context(context_id)
    for name in ("worker1", "worker2"):
        assert not rpc.rpc_sync(name, _has_context, args=(context_id,))


@pytest.mark.timeout(60)
def test_context_cleanup_is_a_notification_riding_on_the_next_message(
    workers: list[str],
) -> None:
    from actorrpc.agent import current_agent

    agent = current_agent()
    (t1,) = _leaves((2, 2))
    with dist_autograd.context() as context_id:
        rpc.rpc_sync("worker1", torch.mul, args=(t1, t1))
    # leaving sent nothing that waits for a reply (torch: fire and forget)
    assert not [p for p in list(agent._pending.values()) if "cleanup" in p.description]
    carried, alone = agent.riders.carried, agent.riders.sent_alone
    # the release rides on this call (or left alone just before it, after RIDER_DELAY);
    # riding on a call, it is handled once the call was served: the reply does not
    # wait for the graph to be freed
    seen_by_carrier = rpc.rpc_sync("worker1", _has_context, args=(context_id,))
    rode = agent.riders.carried - carried
    assert rode + agent.riders.sent_alone - alone >= 1
    if rode:
        assert seen_by_carrier
    assert wait_until(lambda: not rpc.rpc_sync("worker1", _has_context, args=(context_id,)), 10)


@pytest.mark.timeout(60)
def test_no_grad_records_nothing(workers: list[str]) -> None:
    (t1,) = _leaves((3,))
    with dist_autograd.context() as context_id:
        with torch.no_grad():
            rpc.rpc_sync("worker1", torch.add, args=(t1, 1))
        assert _context_summary(context_id)["send"] == 0
        assert _context_summary(context_id)["recv"] == 0


# -- randomized programs over three workers ----------------------------------------------------


def _random_program(seed: int) -> tuple[list[tuple[Any, ...]], list[int], list[int]]:
    """Steps ``(kind, ...)`` over a pool that starts with 4 leaves; the pool indices in the loss."""
    rng = random.Random(seed)
    steps: list[tuple[Any, ...]] = []
    size = 4
    keys: list[int] = []
    for _ in range(rng.randint(4, 10)):
        a, b = rng.randrange(size), rng.randrange(size)  # reuse: fan-out
        choice = rng.random()
        if choice < 0.15:
            key = seed * 100 + len(keys)
            keys.append(key)
            steps.append(("param", rng.randrange(3), key, a))
        else:
            path = [rng.randrange(3) for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))]
            via = "rref" if path and rng.random() < 0.2 else "rpc"
            steps.append(("op", rng.choice(list(_OPS)), path, via, a, b))
        size += 1
    # The last value always counts; the others at random, so some outputs go unused.
    used = [i for i in range(size - 1) if rng.random() < 0.4] + [size - 1]
    return steps, used, keys


def _run_program(steps: list[tuple[Any, ...]], used: list[int], leaves: list[torch.Tensor],
                 distributed: bool, params: dict[int, torch.Tensor]) -> torch.Tensor:
    pool = list(leaves)
    for step in steps:
        if step[0] == "param":
            _, worker, key, a = step
            if distributed:
                pool.append(rpc.rpc_sync(f"worker{worker}", _param_op, args=(key, pool[a])))
            else:
                pool.append(torch.tanh(pool[a] @ params[key]))
            continue
        _, op, path, via, a, b = step
        if not distributed or not path:
            pool.append(_hop_local(path, op, pool[a], pool[b]))
        elif via == "rref":
            rref = rpc.remote(f"worker{path[0]}", _hop, args=(path[1:], op, pool[a], pool[b]))
            pool.append(rref.to_here() * 0.5 + pool[a].mean())  # what _hop does after its RPC
        else:
            pool.append(_hop(path, op, pool[a], pool[b]))
    # Keep values bounded so float64 comparisons stay meaningful.
    return sum((torch.tanh(pool[i]).sum() for i in used), torch.zeros((), dtype=torch.float64))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(20))
def test_random_programs_match_local_autograd(workers: list[str], seed: int) -> None:
    steps, used, keys = _random_program(seed)
    leaves = _leaves((3, 3), (3, 3), (3, 3), (3, 3), seed=seed)
    params = {k: _make_param(k) for k in keys}
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    ref_loss = _run_program(steps, used, copies, False, params)
    expected = torch.autograd.grad(ref_loss, copies + list(params.values()), allow_unused=True)
    with dist_autograd.context() as context_id:
        loss = _run_program(steps, used, leaves, True, params)
        torch.testing.assert_close(loss, ref_loss.detach())
        dist_autograd.backward(context_id, [loss])
        _assert_grads(context_id, leaves, list(expected[: len(leaves)]))
        param_workers = {step[2]: step[1] for step in steps if step[0] == "param"}
        for key, want in zip(keys, expected[len(leaves):]):
            (got,) = rpc.rpc_sync(f"worker{param_workers[key]}", _param_grads,
                                  args=(context_id, [key]))
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want)


@pytest.mark.timeout(30)
def test_walking_values_finds_tensors_in_order_once_and_replaces_sharing_the_rest() -> None:
    """Both ends of a message must find the same tensors in the same order (depth
    first, each once); replacing copies only the containers that change."""
    from collections import OrderedDict, namedtuple

    from actorrpc.autograd._functions import find_grad_tensors, replace_tensors

    a, b, c = (torch.ones(1, requires_grad=True) for _ in range(3))
    frozen = torch.ones(1)
    Pair = namedtuple("Pair", "x y")
    shared = [b, frozen]
    cyclic: list[Any] = [c]
    cyclic.append(cyclic)
    value = ((a, shared), {"k": Pair(shared, c), "empty": []}, cyclic, "text", a)
    assert [id(t) for t in find_grad_tensors(*value)] == [id(a), id(b), id(c)]
    deep: list[Any] = [a]
    for _ in range(5000):  # deeper than the recursion limit: walked without recursion
        deep = [deep]
    assert find_grad_tensors(deep, b) == [a, b]

    a2, c2 = torch.zeros(1), torch.zeros(1)
    untouched = (frozen, [1, 2], OrderedDict(z=frozen))
    args = (a, untouched, Pair(c, 3), OrderedDict(k=c), [cyclic])
    new = replace_tensors(args, {id(a): a2, id(c): c2})
    assert new[0] is a2 and new[1] is untouched  # a container without changes is shared
    assert type(new[2]) is Pair and new[2].x is c2 and new[2].y == 3
    assert type(new[3]) is OrderedDict and new[3]["k"] is c2
    assert new[4][0][0] is c2 and new[4][0][1] is cyclic  # the cycle back keeps the original
    assert args[0] is a and args[2].x is c  # the original is unchanged
    assert replace_tensors("text", {}) == "text"
    assert replace_tensors(a, {id(a): a2}) is a2 and replace_tensors(b, {id(a): a2}) is b


def _identities(value: Any) -> Any:
    """``value``'s structure, with its containers' types and everything else's id."""
    if isinstance(value, dict):
        return type(value), {k: _identities(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value), [_identities(v) for v in value]
    return id(value)


def test_flat_arguments_are_walked_as_any_nesting_would_be() -> None:
    """The loops for flat arguments (and a lone tensor) find and replace exactly what the
    general walks do: the same tensors in the same order, each once."""
    from collections import namedtuple

    from actorrpc.autograd._functions import (
        _find_nested,
        _replace_nested,
        find_grad_tensors,
        replace_tensors,
    )

    a, b = (torch.ones(1, requires_grad=True) for _ in range(2))
    frozen = torch.ones(1)
    Pair = namedtuple("Pair", "x y")

    class Args(list):  # type: ignore[type-arg]
        pass

    shapes: list[tuple[Any, ...]] = [
        ((a, b, 3, "x"), {}), ((a, a, frozen, b, a), {}), ((b, a), {"k": a}), (a,), (frozen,),
        ([b, 1.5, a],), ((), {}), ((a, [b]), {}), ((Pair(a, b),), {}), (Pair(b, a), {}),
        (Args([a, b]),), ((a, b), (b, a)), (None, a),
    ]
    mapping = {id(a): torch.zeros(1), id(b): torch.zeros(1)}
    for values in shapes:
        found = find_grad_tensors(*values)
        assert [id(t) for t in found] == [id(t) for t in _find_nested(values)], values
        for value in values:
            flat, nested = replace_tensors(value, mapping), _replace_nested(value, mapping)
            assert _identities(flat) == _identities(nested), values
            assert (flat is value) == (nested is value), values  # unchanged: shared


@pytest.mark.timeout(30)
def test_local_passes_call_the_engine_directly_unless_autograd_logs_debug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without CUDA every node runs on the calling thread: the C++ engine is entered
    directly; with torch's autograd logger at DEBUG, through torch's wrapper (which logs)."""
    from actorrpc.autograd import _functions

    wrapped: list[int] = []
    real = _functions._engine_run_backward
    monkeypatch.setattr(_functions, "_engine_run_backward",
                        lambda *a, **k: wrapped.append(1) or real(*a, **k))
    leaf = torch.ones(3, requires_grad=True)
    loss = (leaf * 2).sum()
    (grad,) = _functions.gradients_at([loss], [leaf], [torch.ones(())])
    assert grad.tolist() == [2.0, 2.0, 2.0] and wrapped == []
    monkeypatch.setattr(_functions._graph_log, "level", logging.DEBUG)
    _functions._graph_log.manager._clear_cache()
    try:
        (grad,) = _functions.gradients_at([loss], [leaf], [torch.full((), 3.0)])
    finally:
        monkeypatch.undo()
        _functions._graph_log.manager._clear_cache()
    assert grad.tolist() == [6.0, 6.0, 6.0] and wrapped == [1]


@pytest.mark.timeout(30)
def test_boundary_nodes_skip_the_python_apply_layer_unless_functorch_is_active(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actorrpc.autograd import _functions

    used: list[str] = []
    # (RecvRpc's path: the native recv node, where built, has tests of its own in
    # tests/test_native_autograd.py)
    monkeypatch.setattr(_functions, "NATIVE_RECV", False)
    fast_send, fast_recv = _functions._send_rpc_apply, _functions._recv_rpc_apply
    monkeypatch.setattr(_functions, "_send_rpc_apply",
                        lambda *a: used.append("send") or fast_send(*a))
    monkeypatch.setattr(_functions, "_recv_rpc_apply",
                        lambda *a: used.append("recv") or fast_recv(*a))
    leaf = torch.ones(2, requires_grad=True)
    (alias,) = _functions.make_send_aliases([leaf])
    outputs, node = _functions.make_recv_outputs([torch.ones(2)], 1, 2, 3)
    assert used == ["send", "recv"]
    assert alias.grad_fn.name() == "SendRpcBackward" and node.name() == "RecvRpcBackward"
    assert _functions.recv_tag(node) == (1, 2, 3, 1) and outputs[0].requires_grad
    (alias * 3).sum().backward()  # the identity node passes the gradient to the leaf
    assert leaf.grad is not None and leaf.grad.tolist() == [3.0, 3.0]
    monkeypatch.setattr(_functions, "_functorch_active", lambda: True)
    _functions.make_send_aliases([leaf])
    _functions.make_recv_outputs([torch.ones(2)], 1, 2, 3)
    assert used == ["send", "recv"]  # under a transform: torch's own Function.apply


class _SlowIdentity(torch.autograd.Function):
    """Identity whose backward takes a while (on the callee): the reply to the backward
    message comes after the initiator stopped polling for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        threading.Event().wait(0.01)  # (a slow computation, not a synchronisation)
        return grad


def _slow_double(x: torch.Tensor) -> torch.Tensor:
    return _SlowIdentity.apply(x) * 2


def _pause(seconds: float) -> None:
    threading.Event().wait(seconds)  # (work that takes a while, on worker2)


def test_passes_handed_back_to_the_initiator_run_on_its_thread(cluster) -> None:
    """Whichever thread receives the reply, the initiator's local passes run on the
    thread that called backward(): compute stays on one thread (each thread running
    torch's parallel ops gets an OpenMP team, and more team threads than cores slow
    every op of the process). Another thread's calls, waiting meanwhile, take turns on
    the inbox and receive many of the replies."""
    leaf = torch.rand(3, requires_grad=True)
    threads: list[int] = []
    stop = threading.Event()

    def other_calls() -> None:
        while not stop.is_set():
            rpc.rpc_sync("worker2", _pause, args=(0.02,))

    other = threading.Thread(target=other_calls)
    other.start()
    try:
        _initiator_loop(leaf, threads)
    finally:
        stop.set()
        other.join(30)
    assert not other.is_alive()
    assert threads == [threading.get_ident()] * 20


def _initiator_loop(leaf: torch.Tensor, threads: list[int]) -> None:
    for _ in range(20):
        with dist_autograd.context() as context_id:
            sent = leaf * 1.5  # not a leaf: its gradient continues a local pass here
            sent.register_hook(lambda grad: threads.append(threading.get_ident()))
            out = rpc.rpc_sync("worker1", _slow_double, args=(sent,))
            dist_autograd.backward(context_id, [out.sum()])
            grads = dist_autograd.get_gradients(context_id)
        assert torch.allclose(grads[leaf], torch.full((3,), 3.0))
