"""Distributed autograd's native steps (``actorrpc/autograd/_native.cpp``): the one-node
backward pass and the recv node.

Built where torch is importable at build time (CI's compiled stage builds it in place;
with ``ACTORRPC_EXPECT_COMPILED=1`` it is required); pip's isolated build environment has
no torch, so the pure-Python stage runs without it and its unit tests skip there. The
integration tests at the end run in both stages: hooks on either side of an RPC take
effect in a distributed backward whichever path runs the pass.

Each unit test compares ``run`` with ``torch.autograd.grad`` on the same graph: the same
gradients where it runs, ``None`` (the engine's work) where it must decline.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.autograd.graph import GradientEdge

import actorrpc as rpc
import actorrpc.autograd as dist_autograd
from actorrpc import _native_modules
from actorrpc.autograd import _functions

pytestmark = pytest.mark.timeout(60)

_run = _functions._one_node_pass
needs_native = pytest.mark.skipif(_run is None, reason="the native steps are not built here")


def test_the_native_steps_are_built_where_expected() -> None:
    if os.environ.get("ACTORRPC_EXPECT_COMPILED") != "1":
        pytest.skip("only the compiled stage (an in-place build that sees torch) requires it")
    assert _functions._native is not None, "actorrpc.autograd._native was not built or loaded"


def _edges(node: Any) -> tuple[GradientEdge, ...]:
    return tuple(GradientEdge(child, nr) for child, nr in node.next_functions if child is not None)


def _leaf(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()


def _engine(output: Any, inputs: tuple[Any, ...], grad: torch.Tensor) -> tuple[Any, ...]:
    return torch.autograd.grad((output,), inputs, (grad,), retain_graph=True, allow_unused=True)


def _same(got: tuple[Any, ...] | None, want: tuple[Any, ...]) -> None:
    assert got is not None, "the one-node pass declined a graph it should run"
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"input {index}: a gradient where the engine finds none"
        else:
            assert g is not None and g.dtype == w.dtype and g.shape == w.shape, index
            torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert not g.requires_grad  # grad mode off while the node runs, as in the engine


def _cases() -> Iterator[tuple[str, Callable[[], tuple[Any, tuple[Any, ...], torch.Tensor]]]]:
    # (nodes that save no tensors, over inputs with no edges of their own: what it runs)
    def add_edges() -> tuple[Any, tuple[Any, ...], torch.Tensor]:
        a, b = _leaf(4, 4), _leaf(4, 4, seed=1)
        out = a + b
        return out, _edges(out.grad_fn), torch.ones(4, 4)

    def add_leaves() -> tuple[Any, tuple[Any, ...], torch.Tensor]:
        a, b = _leaf(4, 4), _leaf(4, 4, seed=1)
        return a - b, (a, b), torch.rand(4, 4)

    def doubled() -> tuple[Any, tuple[Any, ...], torch.Tensor]:  # two edges into one input
        a = _leaf(3)
        return a + a, (a,), torch.rand(3)

    def promoted() -> tuple[Any, tuple[Any, ...], torch.Tensor]:  # cast back to float32
        a, b = _leaf(3), _leaf(3, dtype=torch.float64, seed=1)
        return a + b, (a, b), torch.rand(3, dtype=torch.float64)

    def broadcast() -> tuple[Any, tuple[Any, ...], torch.Tensor]:
        a, b = _leaf(1, 3), _leaf(4, 3, seed=1)
        return a + b, (b, a), torch.rand(4, 3)

    def expanded_grad() -> tuple[Any, tuple[Any, ...], torch.Tensor]:  # a sum's gradient
        a = _leaf(8, 8)
        return a.neg(), (a,), torch.ones(()).expand(8, 8)

    def summed() -> tuple[Any, tuple[Any, ...], torch.Tensor]:  # the caller's pass
        a = _leaf(5, 5)
        return a.sum(), (a,), torch.ones(())

    def viewed() -> tuple[Any, tuple[Any, ...], torch.Tensor]:
        a = _leaf(4, 4)
        return a.view(16), (a,), torch.rand(16)

    def second_output() -> tuple[Any, tuple[Any, ...], torch.Tensor]:  # unbind's output 1
        a = _leaf(3, 4)
        part = a.unbind(0)[1]
        edge = GradientEdge(part.grad_fn, part.output_nr)
        return edge, (a,), torch.rand(4)

    def unused_input() -> tuple[Any, tuple[Any, ...], torch.Tensor]:
        a, b, c = _leaf(2), _leaf(2, seed=1), _leaf(2, seed=2)
        return a + b, (c, a, b), torch.rand(2)

    def no_grad_input() -> tuple[Any, tuple[Any, ...], torch.Tensor]:  # an edge nowhere
        a = _leaf(2)
        return a + torch.rand(2), (a,), torch.rand(2)

    def down_to_a_recv_node() -> tuple[Any, tuple[Any, ...], torch.Tensor]:  # the callee's
        outputs, node = _functions.make_recv_outputs([_leaf(3), _leaf(3, seed=1)], 1, 2, 3)
        out = outputs[0] + outputs[1]
        return out, (GradientEdge(node, 0), GradientEdge(node, 1)), torch.rand(3)

    yield from [(f.__name__, f) for f in (add_edges, add_leaves, doubled, promoted, broadcast,
                                           expanded_grad, summed, viewed, second_output,
                                           unused_input, no_grad_input, down_to_a_recv_node)]


@needs_native
@pytest.mark.parametrize("make", [f for _, f in _cases()], ids=[n for n, _ in _cases()])
def test_runs_one_node_as_the_engine_does(make: Callable[..., Any]) -> None:
    output, inputs, grad = make()
    assert _run is not None
    got = _run(output, inputs, (grad,))
    want = _engine(output, inputs, grad) if isinstance(output, torch.Tensor) else (
        torch.autograd.grad(output, inputs, grad, retain_graph=True, allow_unused=True))
    _same(got, want)
    with torch.enable_grad():
        _same(_run(output, inputs, (grad,)), want)  # (grad mode on around it)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _RunsInsideBackward(torch.autograd.Function):
    """Its backward asks the one-node pass for a gradient: a graph task is current."""

    seen: list[Any] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            a = _leaf(2)
            out = a + 3
            assert _run is not None
            _RunsInsideBackward.seen.append(_run(out, (a,), (torch.ones(2),)))
        return grad


def _declined_cases() -> Iterator[tuple[str, Callable[[], tuple[Any, tuple[Any, ...], Any]]]]:
    def hook_on_output() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        out = a + 2
        out.register_hook(lambda g: g * 3)
        return out, (a,), (torch.ones(3),)

    def retained_output() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        out = a + 2
        out.retain_grad()
        return out, (a,), (torch.ones(3),)

    def node_post_hook() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        out = a + 2
        out.grad_fn.register_hook(lambda grads_in, grads_out: None)
        return out, (a,), (torch.ones(3),)

    def node_pre_hook() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        out = a + 2
        out.grad_fn.register_prehook(lambda grads: (grads[0] * 2,))
        return out, (a,), (torch.ones(3),)

    def hook_on_captured_leaf() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        a.register_hook(lambda g: g * 5)
        return a + 2, (a,), (torch.ones(3),)

    def hook_on_a_recv_output() -> tuple[Any, tuple[Any, ...], Any]:
        outputs, node = _functions.make_recv_outputs([_leaf(3)], 1, 2, 3)
        outputs[0].register_hook(lambda g: g * 5)
        return outputs[0] + 1, (GradientEdge(node, 0),), (torch.ones(3),)

    def python_node() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        return _Identity.apply(a), (a,), (torch.ones(3),)

    def two_nodes_deep() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        return (a + 2).sum(), (a,), (torch.ones(()),)

    def edge_not_asked_for() -> tuple[Any, tuple[Any, ...], Any]:
        a, b = _leaf(3), _leaf(3, seed=1)
        return a + b, (a,), (torch.ones(3),)

    def leaf_output() -> tuple[Any, tuple[Any, ...], Any]:  # its AccumulateGrad writes .grad
        a, b = _leaf(3), _leaf(3, seed=1)
        return a, (b,), (torch.ones(3),)

    def two_gradients() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        return a + 2, (a,), (torch.ones(3), torch.ones(3))

    def not_a_tensor_or_edge() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        return "output", (a,), (torch.ones(3),)

    def output_is_an_input() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        out = a + 2
        return out, (out, a), (torch.ones(3),)

    def input_asked_for_twice() -> tuple[Any, tuple[Any, ...], Any]:
        a, b = _leaf(3), _leaf(3, seed=1)
        return a + b, (a, b, a), (torch.ones(3),)

    def output_nr_beyond_the_node() -> tuple[Any, tuple[Any, ...], Any]:
        a = _leaf(3)
        out = a + 2
        return GradientEdge(out.grad_fn, 3), (a,), (torch.ones(3),)

    def saves_tensors() -> tuple[Any, tuple[Any, ...], Any]:  # (unpacking may run Python)
        a, b = _leaf(3), _leaf(3, seed=1)
        return a * b, (a, b), (torch.ones(3),)

    def copy_slices() -> tuple[Any, tuple[Any, ...], Any]:  # (it runs what it wraps)
        s = _leaf(1)
        base = torch.zeros(3)
        base[:1].copy_(s)
        assert base.grad_fn is not None and base.grad_fn.name() == "torch::autograd::CopySlices"
        return base, (s,), (torch.ones(3),)

    def input_above_another() -> tuple[Any, tuple[Any, ...], Any]:  # (the engine runs y's node)
        x = _leaf(3)
        y = x + 1
        return y + x, (y, x), (torch.ones(3),)

    yield from [(f.__name__, f) for f in (
        saves_tensors, copy_slices, input_above_another,
        input_asked_for_twice, output_nr_beyond_the_node,
        hook_on_output, retained_output, node_post_hook, node_pre_hook, hook_on_captured_leaf,
        hook_on_a_recv_output, python_node, two_nodes_deep, edge_not_asked_for, leaf_output,
        two_gradients, not_a_tensor_or_edge, output_is_an_input)]


@needs_native
@pytest.mark.parametrize("make", [f for _, f in _declined_cases()],
                         ids=[n for n, _ in _declined_cases()])
def test_declines_what_only_the_engine_does_right(make: Callable[..., Any]) -> None:
    output, inputs, grads = make()
    assert _run is not None
    assert _run(output, inputs, grads) is None


@needs_native
def test_declines_in_anomaly_mode_and_inside_a_backward() -> None:
    assert _run is not None
    a = _leaf(3)
    out = a + 2
    with torch.autograd.detect_anomaly(check_nan=False):
        assert _run(out, (a,), (torch.ones(3),)) is None
    _RunsInsideBackward.seen.clear()
    _RunsInsideBackward.apply(_leaf(2)).sum().backward()
    assert _RunsInsideBackward.seen == [None]
    assert _run(out, (a,), (torch.ones(3),)) is not None  # (and outside both, it runs)


@needs_native
def test_errors_are_the_engines() -> None:
    assert _run is not None
    a, b = _leaf(4, 4), _leaf(4, 4, seed=1)
    out = a + b
    with pytest.raises(RuntimeError, match=r"invalid gradient at index 0 - got \[3\]"):
        _run(out, (a, b), (torch.ones(3),))


@needs_native
def test_gradients_at_takes_it_and_the_switch_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = _leaf(4, 4), _leaf(4, 4, seed=1)
    out = a + b
    calls: list[Any] = []
    real = _functions._one_node_pass

    def counted(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_functions, "_one_node_pass", counted)
    want = _engine(out, (a, b), torch.ones(4, 4))
    _same(_functions.gradients_at([out], [a, b], [torch.ones(4, 4)]), want)
    assert len(calls) == 1
    monkeypatch.setattr(_functions, "ONE_NODE_PASS", False)
    got = _functions.gradients_at([out], [a, b], [torch.ones(4, 4)])
    assert len(calls) == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@needs_native
def test_compiled_autograd_keeps_every_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch's compiled autograd on, the engine compiles each pass: none runs here."""
    calls: list[Any] = []
    real = _functions._one_node_pass
    monkeypatch.setattr(_functions, "_one_node_pass", lambda *args: calls.append(1) or real(*args))
    a, b = _leaf(3), _leaf(3, seed=1)
    flag = types.SimpleNamespace(compiled_autograd_enabled=True)
    monkeypatch.setitem(sys.modules, "torch._dynamo.compiled_autograd", flag)
    _functions.gradients_at([a + b], [a, b], [torch.ones(3)])
    assert calls == []
    flag.compiled_autograd_enabled = False
    _functions.gradients_at([a + b], [a, b], [torch.ones(3)])
    assert calls == [1]


@pytest.mark.internals
def test_a_module_built_against_another_torch_or_source_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    stale = types.SimpleNamespace(TORCH_VERSION="1.0.0")
    monkeypatch.setattr(_native_modules.importlib, "import_module", lambda name: stale)
    with caplog.at_level(logging.WARNING, logger="actorrpc.autograd"):
        assert _functions._load_native() is None
    assert "built against torch 1.0.0" in caplog.text and torch.__version__ in caplog.text
    current = types.SimpleNamespace(TORCH_VERSION=torch.__version__, SOURCE_DIGEST="0" * 16,
                                    __file__=str(tmp_path / "_native.so"))
    monkeypatch.setattr(_native_modules.importlib, "import_module", lambda name: current)
    assert _functions._load_native() is current  # (no source beside it: an installed build)
    (tmp_path / "_native.cpp").write_bytes(b"// other sources")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="actorrpc.autograd"):
        assert _functions._load_native() is None  # a stale build in a checkout
    assert "built from other sources" in caplog.text
    current.SOURCE_DIGEST = _native_modules.native_source_digest(b"// other sources")
    assert _functions._load_native() is current

    def missing(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(_native_modules.importlib, "import_module", missing)
    assert _functions._load_native() is None


# -- the recv node --------------------------------------------------------------------------------


def _python_recv(tensors: list[torch.Tensor], tag: tuple[int, int, int],
                 monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[torch.Tensor, ...], Any]:
    with monkeypatch.context() as patch:
        patch.setattr(_functions, "NATIVE_RECV", False)
        return _functions.make_recv_outputs(tensors, *tag)


@needs_native
def test_the_native_recv_node_is_what_recv_rpc_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    received = [_leaf(3, 4), torch.nn.Parameter(torch.rand(2)), _leaf(5, dtype=torch.float64)]
    native_outputs, native_node = _functions.make_recv_outputs(received, 7, 8, 2)
    python_outputs, python_node = _python_recv(received, (7, 8, 2), monkeypatch)
    assert type(native_node) is _functions._native.RecvRpcBackward
    assert type(python_node) is not type(native_node)
    for node in (native_node, python_node):
        assert node.name() == type(node).__name__ == "RecvRpcBackward"
        assert isinstance(node, torch.autograd.graph.Node)
        assert _functions.recv_tag(node) == (7, 8, 2, 3)
    for index, (native, python, tensor) in enumerate(
            zip(native_outputs, python_outputs, received)):
        for output in (native, python):
            assert type(output) is torch.Tensor and output.requires_grad and not output.is_leaf
            assert output.data_ptr() == tensor.data_ptr() and not output._is_view()
            assert output is not tensor and output.output_nr == index
        assert native.grad_fn is native_node
        assert native.dtype == python.dtype and native.shape == python.shape
    # a local pass asks for the gradient at its outputs, and the reach stops at it
    loss = (native_outputs[0] * 3).sum() + native_outputs[1].sum()
    reach = _functions.reach_from([loss.grad_fn])
    assert reach.recvs == [native_node] and reach.leaves == []
    inputs, tags = reach.pass_inputs()
    assert tags == ((7, 8, 2, 3),) and len(inputs) == 3
    grads = _functions.gradients_at([loss], inputs, [torch.ones(())])
    torch.testing.assert_close(grads[0], torch.full((3, 4), 3.0))
    torch.testing.assert_close(grads[1], torch.ones(2))
    assert grads[2] is None
    # a plain local backward stops at it: nothing flows to the received tensors
    loss.backward()
    assert all(tensor.grad is None for tensor in received)
    # an output may be changed in place, as a received tensor may (it shares the data and,
    # as detach() would, the version counter: autograd sees the change through either)
    before = received[2].detach().clone()
    versions = (received[2]._version, python_outputs[2]._version)
    native_outputs[2].add_(1)
    torch.testing.assert_close(received[2].detach(), before + 1)
    assert received[2]._version == versions[0] + 1 == native_outputs[2]._version
    assert python_outputs[2]._version == versions[1] + 1


@needs_native
def test_a_subclass_or_a_functorch_transform_takes_recv_rpc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Marked(torch.Tensor):
        pass

    marked = torch.rand(3).as_subclass(Marked).requires_grad_()
    _, node = _functions.make_recv_outputs([_leaf(2), marked], 1, 2, 3)
    assert type(node) is not _functions._native.RecvRpcBackward
    assert _functions.recv_tag(node) == (1, 2, 3, 2)
    monkeypatch.setattr(_functions, "_functorch_active", lambda: True)
    _, node = _functions.make_recv_outputs([_leaf(2)], 1, 2, 3)
    assert type(node) is not _functions._native.RecvRpcBackward


@needs_native
def test_recv_outputs_refuses_what_is_not_a_tensor() -> None:
    assert _functions._native is not None
    with pytest.raises(TypeError, match="item 1 is not a tensor"):
        _functions._native.recv_outputs((_leaf(2), "x"), 1, 2, 3)


# -- through real workers: hooks on either side of an RPC ----------------------------------------


def _add_with_hook(a: torch.Tensor, b: torch.Tensor, factor: float) -> torch.Tensor:
    """On the callee: a result whose gradient a tensor hook scales (its node's pre-hook)."""
    out = a + b
    out.register_hook(lambda grad: grad * factor)
    return out


@pytest.fixture
def workers(cluster: list[str]) -> Iterator[list[str]]:
    yield cluster
    assert dist_autograd._wait_for_cleanup(20.0), "context cleanup was not acknowledged"


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_a_hook_on_the_callees_result_scales_the_gradients(workers: list[str],
                                                          factor: float) -> None:
    a, b = _leaf(4, 4), _leaf(4, 4, seed=1)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", _add_with_hook, args=(a, b, factor))
        dist_autograd.backward(context_id, [out.sum()])
        grads = dist_autograd.get_gradients(context_id)
    torch.testing.assert_close(grads[a], torch.full((4, 4), factor))
    torch.testing.assert_close(grads[b], torch.full((4, 4), factor))


def test_hooks_on_the_callers_graph_run(workers: list[str]) -> None:
    a, b = _leaf(4, 4), _leaf(4, 4, seed=1)
    with dist_autograd.context() as context_id:  # a tensor hook on the loss
        loss = rpc.rpc_sync("worker1", torch.add, args=(a, b)).sum()
        loss.register_hook(lambda grad: grad * 2)
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a],
                                   torch.full((4, 4), 2.0))
    ran: list[str] = []
    with dist_autograd.context() as context_id:  # a pre-hook and a post-hook on its node
        loss = rpc.rpc_sync("worker1", torch.add, args=(a, b)).sum()
        assert loss.grad_fn is not None
        loss.grad_fn.register_prehook(lambda grads: (grads[0] * 5,))
        loss.grad_fn.register_hook(lambda grads_in, grads_out: ran.append("post") or None)
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[b],
                                   torch.full((4, 4), 5.0))
    assert ran == ["post"]
    with dist_autograd.context() as context_id:  # a tensor hook on the received result
        out = rpc.rpc_sync("worker1", torch.add, args=(a, b))
        out.register_hook(lambda grad: grad * 7)
        dist_autograd.backward(context_id, [out.sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a],
                                   torch.full((4, 4), 7.0))
