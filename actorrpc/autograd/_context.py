"""Distributed autograd contexts: ids, per-worker storage, the thread-local current context.

A context collects everything one distributed forward/backward pass leaves on
one worker: the send and recv functions recorded for its RPCs, the workers it
exchanged messages with, and the gradients accumulated for this worker's leaf
tensors.

Invariants:

* Ids (contexts, autograd messages, backward passes) are ``(rank << 48) |
  counter``: unique across the group without coordination.
* A context's tables only grow until :meth:`DistAutogradContext.release`, which
  drops every reference it holds to the autograd graph (and so frees it).
* ``grads`` maps a leaf tensor (by ``id``, keeping the leaf) to a tensor owned by the
  context; later passes add into that same tensor in place, so a dict returned by
  ``get_gradients`` sees later accumulation (torch's behaviour).
"""

from __future__ import annotations

import _thread  # noqa: F401  (mypyc: its threading.local subclass needs the module)
import itertools
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch
from mypy_extensions import mypyc_attr
from torch.autograd.graph import GradientEdge

from ..errors import DistAutogradError
from ._functions import Reach, edges_of, leaves_of_edges, make_send_aliases, reach_from

__all__ = [
    "ContextStore",
    "DistAutogradContext",
    "IdGenerator",
    "RecvFunction",
    "SendFunction",
    "THREAD_CONTEXT",
    "current_context_id",
]

ID_BITS = 48
ID_MASK = (1 << ID_BITS) - 1
MAX_RANK = (1 << 16) - 1
_SHAPE = operator.attrgetter("shape")
_IS_LEAF = operator.attrgetter("is_leaf")

_GRAPH_FREED = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). Saved intermediate values of the graph are freed when you "
    "call .backward() or autograd.grad(). Specify retain_graph=True if you need to backward "
    "through the graph a second time or if you need to access saved tensors after calling "
    "backward."
)


class IdGenerator:
    """Yields ``(rank << 48) | n`` for n = 0, 1, 2, ... (thread-safe).

    ``next`` is the counter's own C method: no Python frame per id, and atomic (it
    runs holding the GIL; a free-threaded build would need a lock again). The 2**48
    ids of a worker (nine years at a million ids a second) are not checked per id.
    """

    def __init__(self, rank: int) -> None:
        if not 0 <= rank <= MAX_RANK:
            raise DistAutogradError(
                f"distributed autograd supports ranks up to {MAX_RANK}, got {rank}"
            )
        self._base = rank << ID_BITS
        self.next: Callable[[], int] = itertools.count(self._base).__next__

    @property
    def max_id(self) -> int:
        return self._base | ID_MASK


class SendFunction:
    """Where tensors requiring grad left this worker in one message.

    ``edges`` are where each tensor's gradient entered its graph when the message
    left (``GradientEdge(grad_fn, output_nr)``): the pass that the gradients coming
    back start goes from there, so changing a sent tensor in place afterwards does
    not change what it backpropagates through. They are the edges torch's
    ``SendRpcBackward`` node has; no node is made for them (the engine starts at
    edges): a Python node cost ~60 µs to make and ~45 µs to run per message in the
    flow of messages.

    A message of leaf tensors records only the leaves (a leaf's edge is itself and
    never changes): a pass that brings gradients for leaves adds them into the
    context directly, and their edges are made if a pass needs them.
    """

    # (an explicit __init__, not @dataclass's: a compiled build compiles it; it runs per message)
    def __init__(
        self,
        message_id: int,
        dest: int,
        tensors: tuple[torch.Tensor, ...],
        shapes: tuple[torch.Size, ...],
        edges: tuple[GradientEdge, ...] | None,
        leaves: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        self.message_id = message_id
        self.dest = dest  # rank holding the matching recv function
        self.tensors = tensors  # as sent
        self.shapes = shapes  # the tensors' shapes when sent (check the gradients)
        self.edges = edges  # None until needed, for a message of leaves
        # cached reach of the edges (the graph below never changes)
        self.reach: Reach | None = None
        # the leaves the edges lead to (set by ``of`` for a message of leaves, else by
        # ``prepare``); () if some edge leads elsewhere (None: not looked at yet)
        self.leaves = leaves
        self.aliases: tuple[torch.Tensor, ...] | None = None  # made by ``node`` (introspection)

    @classmethod
    def of(cls, message_id: int, dest: int, tensors: list[torch.Tensor]) -> SendFunction:
        """The send function of ``tensors`` (each requires grad), as the message leaves."""
        shapes = tuple(map(_SHAPE, tensors))  # (maps: no Python frame per tensor)
        if all(map(_IS_LEAF, tensors)):
            return cls(message_id, dest, tuple(tensors), shapes, None, leaves=tuple(tensors))
        return cls(message_id, dest, tuple(tensors), shapes, edges_of(tensors))

    def prepare(self) -> None:
        """Work out what a pass from here needs: the leaves the edges lead to, else the
        reach of the graph below and the pass's inputs. Once, when a pass first needs it;
        the callee of a plain call does it earlier, after its reply was handed to the
        link (not when the reply waits to ride on a later message), while the caller
        computes. (The graph below a send function never changes, and two threads
        preparing at once write the same.)"""
        if self.leaves is None:
            self.leaves = leaves_of_edges(self.roots) or ()
        if not self.leaves:
            self.pass_reach()

    def pass_reach(self) -> Reach:
        """The reach of the graph below the edges, with its pass inputs made (cached)."""
        reach = self.reach
        if reach is None:
            reach = reach_from([edge.node for edge in self.roots])
            reach.pass_inputs()
            self.reach = reach
        return reach

    @property
    def roots(self) -> tuple[GradientEdge, ...]:
        """``edges``, made now for a message of leaves (if not yet)."""
        if self.edges is None:
            self._check_leaves_require_grad()
            self.edges = edges_of(self.tensors)
        return self.edges

    @property
    def node(self) -> Any:
        """A ``SendRpcBackward`` node over the sent tensors, for ``_send_functions()``.

        Made when first asked for: its edges are the tensors' edges at that moment
        (the same as ``edges`` unless a tensor was changed in place since); a tensor
        detached since (``detach_()``) is left out.
        """
        if self.aliases is None:
            if self.edges is None:  # a message of leaves
                self._check_leaves_require_grad()
            live = [t for t in self.tensors if t.requires_grad]
            if not live:
                raise DistAutogradError(
                    f"the tensors of autograd message {self.message_id} no longer require "
                    "grad (detach_() after the RPC): no SendRpcBackward node can show its "
                    "edges (a backward pass still starts where they were when sent)"
                )
            self.aliases = make_send_aliases(live)
        return self.aliases[0].grad_fn

    def _check_leaves_require_grad(self) -> None:
        frozen = [i for i, t in enumerate(self.tensors) if not t.requires_grad]
        if frozen:
            raise DistAutogradError(
                f"tensor {frozen[0]} of autograd message {self.message_id} was sent as a "
                "leaf requiring grad but no longer requires grad: its send function "
                "cannot be made (requires_grad_(False) after the RPC)"
            )


class RecvFunction:
    """Where tensors requiring grad arrived on this worker in one message."""

    # (an explicit __init__, not @dataclass's: a compiled build compiles it; it runs per message)
    def __init__(self, message_id: int, sender: int, node: Any, num_outputs: int) -> None:
        self.message_id = message_id
        self.sender = sender  # rank holding the matching send function
        self.node = node  # the RecvRpcBackward node, grad_fn of the received tensors
        self.num_outputs = num_outputs


class DistAutogradContext:
    """One context's state on one worker (torch's ``DistAutogradContext``).

    Example::

        >>> # on worker0
        >>> with dist_autograd.context() as context_id:
        ...     t = torch.ones(2, requires_grad=True)
        ...     y = rpc.rpc_sync("worker1", torch.mul, args=(t, 2))
        ...     ctx = dist_autograd._retrieve_context(context_id)
        ...     print(ctx._known_worker_ids(), len(ctx._send_functions()))
        {1} 1
    """

    # (an explicit __init__, not @dataclass's: a compiled build compiles it; one per context)
    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        self.send_functions: dict[int, SendFunction] = {}
        self.recv_functions: dict[int, RecvFunction] = {}
        self.known_workers: set[int] = set()
        # id(leaf) -> (leaf, its gradient): keyed by id, as a tensor's own hash is a
        # Python call
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # start point of a local pass (a root node or ("send", message_id)) -> the pass
        # id that ran it without retain_graph; later passes may not run it again.
        self.spent: dict[Any, int] = {}
        self.released = False
        self.lock = threading.Lock()

    # -- torch-compatible private accessors ---------------------------------------------

    def _context_id(self) -> int:
        return self.context_id

    def _send_functions(self) -> dict[int, Any]:
        """Message id -> ``SendRpcBackward`` node."""
        with self.lock:
            return {mid: send.node for mid, send in self.send_functions.items()}

    def _recv_functions(self) -> dict[int, Any]:
        """Message id -> ``RecvRpcBackward`` node."""
        with self.lock:
            return {mid: recv.node for mid, recv in self.recv_functions.items()}

    def _known_worker_ids(self) -> set[int]:
        with self.lock:
            return set(self.known_workers)

    # -- recording ------------------------------------------------------------------------

    def add_known_worker(self, rank: int) -> None:
        with self.lock:
            self.known_workers.add(rank)

    def add_send(self, send: SendFunction) -> None:
        with self.lock:
            self.send_functions[send.message_id] = send

    def add_recv(self, recv: RecvFunction) -> None:
        with self.lock:
            self.recv_functions[recv.message_id] = recv
            self.known_workers.add(recv.sender)

    def get_send(self, message_id: int) -> SendFunction | None:
        with self.lock:
            return self.send_functions.get(message_id)

    # -- backward -------------------------------------------------------------------------

    def claim(self, keys: list[Any], pass_id: int, retain_graph: bool) -> None:
        """Check that no start point in ``keys`` was consumed by another pass; consume them.

        Passes always retain the real graph internally (several messages of one
        pass may cross the same subgraph), so freeing is emulated here: a start
        point run without ``retain_graph`` cannot be run by a later pass.
        """
        with self.lock:
            for key in keys:
                owner = self.spent.get(key)
                if owner is not None and owner != pass_id:
                    raise DistAutogradError(_GRAPH_FREED)
            if not retain_graph:
                for key in keys:
                    self.spent[key] = pass_id

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor, owned: bool = False) -> None:
        """Add ``grad`` into the context's gradient of ``leaf`` (never into ``leaf.grad``).

        ``owned``: ``grad`` was just unpickled and nothing reads it after this call
        (where one tensor is given for several leaves: its last use), so the context may
        keep it rather than a copy.
        """
        with self.lock:
            if self.released:
                return
            entry = self.grads.get(id(leaf))
            if entry is None:
                # later gradients are added into it in place: a copy unless owned (an
                # engine's gradient may be a caller's tensor, or given to two leaves)
                # and contiguous (a received expanded gradient keeps its zero strides; a
                # sparse one is copied too: older torch refuses is_contiguous() on it)
                if grad.requires_grad:  # (rare: an engine's gradient under create_graph)
                    grad, owned = grad.detach(), False
                keep = owned and grad.layout == torch.strided and grad.is_contiguous()
                self.grads[id(leaf)] = (leaf, grad if keep else grad.clone())
            elif entry[1].is_sparse and not grad.is_sparse:
                self.grads[id(leaf)] = (leaf, entry[1] + grad)  # dense result; rare path
            else:
                entry[1].add_(grad)

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        with self.lock:
            return dict(self.grads.values())

    def release(self) -> None:
        """Drop every reference to the graph and the gradients."""
        with self.lock:
            self.released = True
            self.send_functions.clear()
            self.recv_functions.clear()
            self.grads.clear()
            self.spent.clear()


class ContextStore:
    """The contexts of one worker, by id."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.context_ids = IdGenerator(rank)
        self.message_ids = IdGenerator(rank)  # autograd messages and backward passes
        self._contexts: dict[int, DistAutogradContext] = {}
        self._lock = threading.Lock()  # (for changes: a look-up is one atomic dict call)
        # the context of an id, or None: the dict's own method (no Python frame, no lock)
        self.get: Callable[[int], DistAutogradContext | None] = self._contexts.get

    def create(self) -> DistAutogradContext:
        ctx = DistAutogradContext(self.context_ids.next())
        with self._lock:
            self._contexts[ctx.context_id] = ctx
        return ctx

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None:
                ctx = self._contexts[context_id] = DistAutogradContext(context_id)
            return ctx

    def retrieve(self, context_id: int) -> DistAutogradContext:
        ctx = self.get(context_id)
        if ctx is None:
            raise DistAutogradError(f"Could not find autograd context with id: {context_id}")
        return ctx

    def release(self, context_id: int) -> DistAutogradContext | None:
        """Remove and release the context; ``None`` if it is not here (idempotent)."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is not None:
            ctx.release()
        return ctx

    def all(self) -> list[DistAutogradContext]:
        with self._lock:
            return list(self._contexts.values())

    def clear(self) -> None:
        with self._lock:
            contexts = list(self._contexts.values())
            self._contexts.clear()
        for ctx in contexts:
            ctx.release()


@mypyc_attr(native_class=False)  # (see actorrpc/_compiled.py)
class _CurrentContext(threading.local):
    """The current context is per thread (as in torch); it holds an id, not the object,
    so a stale id after shutdown simply finds no context. (A class default: a thread
    that never entered one reads None without a failed lookup, on every call it makes.)"""

    context_id: int | None = None


# (``THREAD_CONTEXT.context_id``: this thread's current context id; entering and leaving a
# context or a served call set it directly, and hot paths read it without a frame)
THREAD_CONTEXT = _CurrentContext()


def current_context_id() -> int | None:
    return THREAD_CONTEXT.context_id

