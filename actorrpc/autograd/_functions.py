"""The autograd nodes that mark message boundaries, and walking values and graphs.

``SendRpc`` and ``RecvRpc`` (:mod:`._nodes`) are identity ``torch.autograd.Function`` s.
Their nodes are named ``SendRpcBackward`` and ``RecvRpcBackward``, as in torch:

* Where tensors left this worker, a pass starts from their gradient edges as
  they were when sent (:func:`edges_of`); backpropagating from those edges with
  the gradients that come back reaches exactly the graph the tensors had when
  they were sent. ``SendRpcBackward`` nodes (over private aliases of the sent
  tensors) are made only when the context is inspected (``_send_functions()``).
* ``RecvRpcBackward`` is the grad_fn of the tensors that arrived. A local pass
  never runs it: it asks ``torch.autograd.grad`` for the gradient at its output
  edges, which is what must travel back to the sender.

Values are walked through lists, tuples (named tuples too) and dict values, in
order, each tensor once; both ends of a message walk the same (pickled) structure
the same way, so the i-th tensor found by the sender is the i-th found by the
receiver.
"""

from __future__ import annotations

import copy
import logging
import operator
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import has_torch_function

from .._native_modules import load_native
from ._nodes import RecvRpc, SendRpc

try:  # torch.autograd.grad's own way into the C++ engine
    from torch.autograd.graph import _engine_run_backward
    from torch.autograd.graph import log as _graph_log
    from torch.autograd.variable import Variable as _Variable
except ImportError:  # pragma: no cover - another torch: the public function does the same
    _engine_run_backward = None  # type: ignore[assignment]

__all__ = [
    "Reach",
    "RecvRpc",
    "SendRpc",
    "find_grad_tensors",
    "gradients_at",
    "edges_of",
    "leaves_of_edges",
    "reach_from",
    "recv_tag",
    "replace_tensors",
]

# The attribute set on a RecvRpcBackward node: (context id, message id, sender,
# number of outputs); ints only, so no cycle node <-> records. One attribute: every
# attribute of a torch node is a torch call, costly when caches are cold.
_TAG = "_actorrpc_recv"

# (map over the unbound method: ~5 µs less per node than a generator expression, warm)
_detach = torch.Tensor.detach
_ON_MACOS = sys.platform == "darwin"  # (MPS)
_PythonNode = torch._C._FunctionBase  # the nodes of torch.autograd.Function s
_AccumulateGrad: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]

# ``GradientEdge(node, output_nr)`` is ``_new_tuple(GradientEdge, (node, output_nr,
# *_EDGE_REST))`` without the named tuple's ``__new__`` (a Python frame, per edge); the
# fields after the two (an ownership token, in newer torch) take their defaults.
_EDGE_REST = tuple(GradientEdge._field_defaults[name] for name in GradientEdge._fields[2:])
_new_tuple = tuple.__new__
_log = logging.getLogger("actorrpc.autograd")


def _load_native() -> Any:
    """The ``_native`` extension, if it was built against this torch and (where its source
    lies beside it: a checkout) from that source; else None."""
    return load_native(f"{__package__}._native", "distributed autograd takes torch's Python API",
                       _log)


# Where built (setup.py), recv nodes are made and one-node passes run natively (their
# file says what each does and when a pass declines); the switches are for same-run A/Bs
# (benchmarks/ab_switch.py).
_native = _load_native()
_one_node_pass: Any = None if _native is None else _native.one_node_pass
_native_recv_outputs: Any = None if _native is None else _native.recv_outputs
ONE_NODE_PASS = True
NATIVE_RECV = True
# the types of recv nodes, both tagged (recv_tag): RecvRpc's, and the native one (which,
# like torch's own C++ nodes, is a ``torch.autograd.graph.Node`` to ``isinstance``)
_RECV_NODES: tuple[Any, ...] = (RecvRpc._backward_cls,)
if _native is not None:
    _RECV_NODES += (_native.RecvRpcBackward,)
    torch.autograd.graph.Node.register(_native.RecvRpcBackward)
_Parameter = torch.nn.Parameter


# Input of every RecvRpc so that its outputs require grad; never receives a gradient.
_ANCHOR = torch.zeros((), requires_grad=True)


# ``Function.apply`` without its Python layer, which (with no functorch transform
# active) only binds default arguments for ``setup_context`` (neither defines one) and
# unwraps dead functorch wrappers from the arguments (none without a transform): about
# 5 µs of ``SendRpc.apply`` and 10 of ``RecvRpc.apply``, per message, on a slow host.
_send_rpc_apply = super(torch.autograd.Function, SendRpc).apply
_recv_rpc_apply = super(torch.autograd.Function, RecvRpc).apply
_functorch_active = torch._C._are_functorch_transforms_active


def _apply_recording(
    function: type[torch.autograd.Function], fast_apply: Any, *inputs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``function`` applied with grad mode on (the C++ apply unless functorch is active;
    no ``enable_grad`` context manager when grad mode is on already, as it usually is)."""
    apply = function.apply if _functorch_active() else fast_apply
    if torch.is_grad_enabled():
        return tuple(apply(*inputs))
    with torch.enable_grad():
        return tuple(apply(*inputs))


def make_send_aliases(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``SendRpc`` applied to ``tensors`` (each requires grad)."""
    return _apply_recording(SendRpc, _send_rpc_apply, *tensors)


def make_recv_outputs(
    tensors: list[torch.Tensor], context_id: int, message_id: int, sender: int
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """New tensors with the received values whose grad_fn is one tagged ``RecvRpcBackward``
    (native where built, for plain tensors and parameters outside functorch transforms)."""
    if _native_recv_outputs is not None and NATIVE_RECV and not _functorch_active():
        for tensor in tensors:  # (a loop: no frame)
            kind = type(tensor)
            if kind is not _Tensor and kind is not _Parameter:
                break  # (a subclass: its own torch functions, through RecvRpc)
        else:
            return _native_recv_outputs(  # type: ignore[no-any-return]
                tuple(tensors), context_id, message_id, sender)
    outputs = _apply_recording(RecvRpc, _recv_rpc_apply, _ANCHOR, *map(_detach, tensors))
    node = outputs[0].grad_fn
    setattr(node, _TAG, (context_id, message_id, sender, len(outputs)))
    return outputs, node


def edges_of(tensors: Iterable[torch.Tensor]) -> tuple[GradientEdge, ...]:
    """Where each tensor's gradient enters its graph now: ``GradientEdge(grad_fn, output_nr)``
    (a leaf's is its ``AccumulateGrad`` node's)."""
    edges = []
    for tensor in tensors:
        grad_fn = tensor.grad_fn
        if grad_fn is None:  # a leaf: its AccumulateGrad node
            edges.append(get_gradient_edge(tensor))
        elif isinstance(grad_fn, _PythonNode):
            # the Python object of a Python node does not keep the node alive: the edge
            # holds a token that does (torch's is a view, which only strided tensors have)
            if tensor.layout == torch.strided:
                edges.append(get_gradient_edge(tensor))
            else:
                token = make_send_aliases([tensor])[0]
                edges.append(GradientEdge(grad_fn, tensor.output_nr, token))
        else:
            edges.append(_new_tuple(GradientEdge, (grad_fn, tensor.output_nr, *_EDGE_REST)))
    return tuple(edges)


def leaves_of_edges(edges: Iterable[GradientEdge]) -> tuple[torch.Tensor, ...] | None:
    """The leaf tensors ``edges`` lead to, in order, if every edge leads to one."""
    leaves = []
    for edge in edges:
        node: Any = edge.node
        if type(node) is not _AccumulateGrad:  # (the node of a leaf)
            return None
        leaves.append(node.variable)
    return tuple(leaves)


def recv_tag(node: Any) -> tuple[int, int, int, int] | None:
    """``(context_id, message_id, sender, num_outputs)`` of a RecvRpcBackward node, else None."""
    # (other nodes fail the lookup: an exception each, per node a pass walks)
    return getattr(node, _TAG, None) if type(node) in _RECV_NODES else None


# -- values ------------------------------------------------------------------------------


_Tensor = torch.Tensor
_CONTAINERS = (list, tuple, dict)
_WALKED = (torch.Tensor, *_CONTAINERS)  # what the walks below look into (or replace)


def find_grad_tensors(*values: Any) -> list[torch.Tensor]:
    """Tensors requiring grad in ``values``, in walk order, each once.

    Depth first, each container's elements in order; a container reached twice (or
    through a cycle) is walked once, where it is first reached. A stack of iterators:
    no recursion, however deep the nesting. (The usual call's arguments, a flat tuple
    and no keyword arguments, and a lone tensor take a loop without the stack.)
    """
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, _Tensor):
            if value.requires_grad:
                found.append(value)
        elif type(value) is tuple or type(value) is list:
            for obj in value:
                if isinstance(obj, _Tensor):
                    if obj.requires_grad:
                        found.append(obj)
                elif isinstance(obj, _CONTAINERS):
                    return _find_nested(values)
        elif isinstance(value, _CONTAINERS) and value:  # a dict, a named tuple
            return _find_nested(values)
    if len(found) > 1 and len(set(map(id, found))) < len(found):
        return list({id(t): t for t in found}.values())  # each once, where first found
    return found


def _find_nested(values: tuple[Any, ...]) -> list[torch.Tensor]:
    """:func:`find_grad_tensors` over any nesting."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[Iterator[Any]] = [iter(values)]
    while stack:
        for obj in stack[-1]:
            if isinstance(obj, _Tensor):
                if obj.requires_grad and id(obj) not in seen:
                    seen.add(id(obj))
                    found.append(obj)
            elif isinstance(obj, (list, tuple)):
                if obj and id(obj) not in seen:
                    seen.add(id(obj))
                    stack.append(iter(obj))
                    break  # (this level's iterator resumes after the container)
            elif isinstance(obj, dict) and obj and id(obj) not in seen:
                seen.add(id(obj))
                stack.append(iter(obj.values()))
                break
        else:
            stack.pop()
    return found


def replace_tensors(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    """A copy of ``obj`` whose tensors with ids in ``mapping`` are replaced; shares the rest
    (a container none of whose elements changed is itself, not a copy). A lone tensor
    takes the general path: ``attach_recv`` replaces a call's usual result, one tensor,
    without a mapping and without this function."""
    if type(obj) is tuple or type(obj) is list:  # the usual call's arguments: flat
        get = mapping.get
        elements = []
        for value in obj:
            if isinstance(value, _Tensor):
                value = get(id(value), value)
            elif isinstance(value, _CONTAINERS):
                break
            elements.append(value)
        else:
            if all(map(operator.is_, elements, obj)):
                return obj
            return tuple(elements) if type(obj) is tuple else elements
    return _replace_nested(obj, mapping)


def _replace_nested(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    """:func:`replace_tensors` over any nesting."""
    memo: dict[int, Any] = {}

    def rebuild(value: Any) -> Any:
        if isinstance(value, _Tensor):
            return mapping.get(id(value), value)
        key = id(value)
        if key in memo:
            return memo[key]
        memo[key] = value  # a cycle back to this container keeps the original
        if isinstance(value, dict):
            items = {
                k: (mapping.get(id(v), v) if isinstance(v, _Tensor) else rebuild(v))
                if isinstance(v, _WALKED) else v
                for k, v in value.items()
            }
            if all(items[k] is value[k] for k in value):
                return value
            if type(value) is dict:
                new: Any = items
            else:
                new = copy.copy(value)
                new.update(items)
        else:
            elements = [
                (mapping.get(id(v), v) if isinstance(v, _Tensor) else rebuild(v))
                if isinstance(v, _WALKED) else v
                for v in value
            ]
            if all(map(operator.is_, elements, value)):
                return value
            if isinstance(value, list):
                new = elements if type(value) is list else type(value)(elements)
            elif type(value) is tuple:
                new = tuple(elements)
            elif hasattr(value, "_fields"):
                new = type(value)(*elements)  # a named tuple
            else:
                new = type(value)(elements)
        memo[key] = new
        return new

    return rebuild(obj) if isinstance(obj, _WALKED) else obj


# -- graphs --------------------------------------------------------------------------------


class Reach:
    """What a local pass from some nodes can reach: leaves, and recv nodes (where it stops)."""

    # (an explicit __init__, not @dataclass's: a compiled build compiles it)
    def __init__(self, leaves: list[torch.Tensor], recvs: list[Any]) -> None:
        self.leaves = leaves
        self.recvs = recvs
        self._inputs: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def pass_inputs(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Where a pass over this reach asks for gradients (the leaves, then each recv
        node's output edges) and the recv nodes' tags (:func:`recv_tag`); made once."""
        if self._inputs is None:
            tags = tuple(map(recv_tag, self.recvs))
            inputs: list[Any] = list(self.leaves)
            for node, tag in zip(self.recvs, tags):
                for output_nr in range(tag[3]):  # type: ignore[index]
                    inputs.append(_new_tuple(GradientEdge, (node, output_nr, *_EDGE_REST)))
            self._inputs = (tuple(inputs), tags)
        return self._inputs


def reach_from(nodes: Iterable[Any], extra_leaves: Iterable[torch.Tensor] = ()) -> Reach:
    """Walk the local graph below ``nodes``; never crosses a RecvRpcBackward node."""
    leaves: list[torch.Tensor] = []
    leaf_ids: set[int] = set()
    for leaf in extra_leaves:
        if id(leaf) not in leaf_ids:
            leaf_ids.add(id(leaf))
            leaves.append(leaf)
    recvs: list[Any] = []
    seen: set[Any] = set()  # node objects are stable while referenced (they are, here)
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) is _AccumulateGrad:  # a leaf (not any node with a ``variable``)
            variable = node.variable
            if id(variable) not in leaf_ids:
                leaf_ids.add(id(variable))
                leaves.append(variable)
            continue
        if type(node) in _RECV_NODES and getattr(node, _TAG, None) is not None:  # (recv_tag)
            recvs.append(node)
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return Reach(leaves, recvs)


def _accelerator_initialized() -> bool:
    """Whether the engine may run nodes on device threads (CUDA, XPU; any on macOS)."""
    # (their flags, read without a frame each; without the flag, the public function)
    if _ON_MACOS or getattr(torch.cuda, "_initialized", None) is not False and (
        torch.cuda.is_initialized()
    ):
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is None or getattr(xpu, "_initialized", None) is False:
        return False
    return bool(xpu.is_initialized())


def _compiled_autograd_enabled() -> bool:
    """Whether torch's compiled autograd is on (the engine then compiles every pass: a
    one-node pass must not run eagerly beside it). Off while its module is not loaded."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(getattr(module, "compiled_autograd_enabled", False))


def gradients_at(
    outputs: Sequence[Any], inputs: Sequence[Any], grad_outputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True)``.

    ``outputs`` and ``inputs`` are tensors and ``GradientEdge`` s. Enters the C++ engine as
    ``torch.autograd.grad`` does, without its argument normalisation and Python
    shape checks (~13 µs of a pass): callers pass gradients of their outputs'
    exact shapes (the engine would only check that they broadcast; gradients
    from a peer are checked on arrival, ``AutogradEngine._continue_at``).
    Tensor subclasses that override torch functions take the public path.

    While no accelerator is initialized, the engine runs every node on this thread, so
    the C++ engine is called directly, without ``_engine_run_backward``'s work
    for other threads (a copy of the ``contextvars`` context stashed for device
    threads) and its logging check (~13 µs warm, 30-80 cold); with the
    ``torch.autograd`` logger at DEBUG it goes through that function (which
    logs the nodes). Then, from one output whose node is the only one the pass would
    run (the usual pass on either side of an RPC'd op: ``sum`` down to the recv node,
    ``add`` down to the received tensors), the node runs without the engine, where the
    native extension is built (``_native.one_node_pass``): 0.3 against 7.5 µs warm, about
    25 in a pass between messages (its file states when it declines: hooks, Python nodes,
    node types that save tensors, inputs with edges of their own, anomaly mode; and here,
    under torch's compiled autograd).
    """
    tensors = []  # (a loop: a generator is a Python frame per item)
    for value in (*outputs, *inputs):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
    if _engine_run_backward is not None and not has_torch_function(tensors):
        run = _engine_run_backward
        if not _accelerator_initialized() and not _graph_log.isEnabledFor(logging.DEBUG):
            if (len(outputs) == 1 and _one_node_pass is not None and ONE_NODE_PASS
                    and not _compiled_autograd_enabled()):
                grads = _one_node_pass(outputs[0], tuple(inputs), tuple(grad_outputs))
                if grads is not None:
                    return grads  # type: ignore[no-any-return]
            run = _Variable._execution_engine.run_backward
        return run(  # type: ignore[no-any-return]
            tuple(outputs), tuple(grad_outputs), True, False, tuple(inputs), True,
            accumulate_grad=False,
        )
    return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True,
                               allow_unused=True)
