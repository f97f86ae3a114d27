"""Recording the distributed graph on RPCs, and the message-driven backward traversal.

Forward (a call hook on every RPC made inside a context; its parts are in ``_recording``):

* The caller puts the context id in the call's meta. If some argument requires
  grad it records a send function (``SendRpcBackward`` over those tensors) under
  a fresh autograd message id, also put in meta. It always allocates a response
  message id too.
* The callee gets or creates the context, makes it current while the function
  runs (nested RPCs carry it), and gives the received tensors requiring grad a
  ``RecvRpcBackward`` grad_fn keyed by the caller's message id. If the result
  holds tensors requiring grad it records a send function under the response id;
  the caller's reply transform gives the same tensors a recv function under that
  id. (The result itself is not wrapped: ``remote()`` stores it as the RRef value,
  and a ``to_here()`` fetch then records its own pair, keyed by the fetch's id.)
  A plain call's callee works out the pass that send function will start (its leaves,
  or the reach of the graph below) after the reply left, while the caller computes:
  the backward message then finds it done (``SendFunction.prepare``).

Backward is a message-driven graph traversal keyed by context id:

1. The initiator runs ``torch.autograd.grad`` from the roots over its local graph
   towards (a) its leaf tensors and (b) the output edges of the recv nodes it
   reaches. Leaf gradients are added into the context; ``.grad`` is never written.
2. For each recv node that got a gradient it sends ``AUTOGRAD_BACKWARD(context_id,
   message_id, grads, retain_graph, pass_id)`` to the worker holding the matching
   send function.
3. That worker runs the same local pass from the send function's edges (where the
   sent tensors' gradients entered their graph when they were sent) with the
   received gradients, sends further messages for the recv nodes it reaches, and
   replies when all of them have replied (its handler returns a future, so no
   pool thread waits: cycles such as worker0 -> worker1 -> worker0 cannot
   deadlock). Gradients for send functions of the worker that sent the request
   are not sent as requests of their own: they travel back in the reply, and
   the requester continues the pass from them (``_pass_driver``), so the usual
   caller -> callee -> caller round trip costs one message pair.
4. The initiator's ``backward`` returns when all its messages were answered, which
   transitively covers the whole graph; the first error anywhere is raised there,
   naming the worker(s) it came through.

Each message triggers its own local pass; by linearity the sum over passes is the
gradient. Messages leave only from recv nodes a pass actually reached with a
gradient, so an RPC output that does not contribute to the loss never gets a
message and nothing waits for one: torch FAST mode's hang on unused send
functions (test_backward_unused_send_function) cannot happen.

Local passes always retain the graph (two messages of one pass may cross the same
subgraph); ``retain_graph=False`` is emulated per start point (a root node or a
send function): a later pass that starts there raises torch's "Trying to backward
through the graph a second time" error. The graph is freed when the context is
released.

Cleanup: leaving a context releases it locally and queues an ``AUTOGRAD_CLEANUP``
notification for every worker it exchanged messages with; each releases its copy
and passes the notification on to its own known workers (idempotent, so it
terminates). As in torch, nobody waits for a cleanup: the notification rides on
the next message to that worker (the next iteration's first RPC, typically) or
leaves alone within ``RIDER_DELAY``, so leaving a context costs no message of
its own and no reply. Riding on a request that a thread serves, it is handled right
after that request (or by the I/O thread once ``DEFERRED_RIDER_DELAY`` passed, if the
request takes longer), so the request's reply does not wait for the graph to be
freed; riding on anything else, before it. torch orders nothing here (its cleanup
is a message of its own, served concurrently with others).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..agent import (
    Agent,
    CallRecord,
    CallResult,
    IncomingRequest,
    complete,
    current_agent,
    wait_until,
)
from ..errors import DistAutogradError, InvalidArgumentError
from ..protocol import MessageKind
from ._context import (
    ID_BITS,
    ContextStore,
    DistAutogradContext,
    SendFunction,
)
from ._context import THREAD_CONTEXT as _current  # this thread's current context id
from ._functions import Reach, find_grad_tensors, gradients_at, reach_from
from ._pass_driver import Owed, PassDriver, checked_reply, kept_positions
from ._recording import KEY_CONTEXT, KEY_MESSAGE, KEY_RESPONSE, ServingInContext, attach_recv

__all__ = ["EXTENSION", "AutogradEngine", "checked_roots", "current_engine", "engine_of", "install"]

_log = logging.getLogger("actorrpc.autograd")

EXTENSION = "autograd"
DRIVE_ONE_DIRECTLY = True  # (a switch for same-run A/Bs: benchmarks/ab_switch.py)


def _failed(exc: BaseException) -> CallResult[Any]:
    future: CallResult[Any] = CallResult("distributed backward")
    complete(future, error=exc)
    return future


def _pass_straight_to_leaves(leaves: tuple[torch.Tensor, ...], grads: list[Any]) -> bool:
    """Whether ``grads`` may go into ``leaves`` without an engine pass.

    Not when a leaf has tensor hooks (the engine runs them on the gradient), nor
    when a gradient's dtype differs from its leaf's (the engine would cast it).
    """
    for leaf, grad in zip(leaves, grads):  # (a loop: a generator is a frame per item)
        if leaf._backward_hooks or (grad is not None and grad.dtype != leaf.dtype):
            return False
    return True


class AutogradEngine:
    """Distributed autograd on one agent: its contexts, call hook and message handlers."""

    serves_only_with_meta = True  # (a call hook: ``serving`` needs the context id in meta)

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.store = ContextStore(agent.rank)
        self.closed = False
        self._passes = 0  # backward() calls in progress on this worker
        self._passes_lock = threading.Lock()

    # -- the call hook (forward recording) ----------------------------------------------------

    def before_send(self, call: CallRecord) -> Callable[[Any], Any] | None:
        context_id = _current.context_id  # (current_context_id(), without its frame)
        if context_id is None:
            return None
        ctx = self.store.get(context_id)
        if ctx is None:
            return None  # an id left over from an agent that was shut down
        call.meta[KEY_CONTEXT] = context_id
        peer = call.peer.id
        if peer != self.agent.rank:
            ctx.add_known_worker(peer)
        if not torch.is_grad_enabled():
            return None  # under no_grad nothing is recorded (torch records anyway, #31937)
        tensors = find_grad_tensors(call.args, call.kwargs)
        if tensors:
            message_id = self.store.message_ids.next()
            ctx.add_send(SendFunction.of(message_id, peer, tensors))
            call.meta[KEY_MESSAGE] = message_id
        response_id = self.store.message_ids.next()
        call.meta[KEY_RESPONSE] = response_id

        def on_reply(value: Any) -> Any:
            received = find_grad_tensors(value)
            if not received:
                return value
            target = self.store.get(context_id)
            if target is None:
                return value  # the context was left before the reply came
            return attach_recv(target, response_id, peer, value, received)

        return on_reply

    def serving(self, call: CallRecord) -> AbstractContextManager[None] | None:
        context_id = call.meta.get(KEY_CONTEXT)
        if context_id is None or self.closed:
            return None  # not a call inside a distributed autograd context
        return ServingInContext(self.store, self.agent.rank, call, context_id)

    # -- backward ----------------------------------------------------------------------------

    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        """Run a distributed backward pass from ``roots``; returns when every worker is done."""
        ctx = self.store.retrieve(context_id)
        pass_id = self.store.message_ids.next()
        nodes: list[Any] = []
        root_leaves: list[torch.Tensor] = []
        grad_outputs: list[torch.Tensor] = []
        for root in roots:  # (a loop: comprehensions are frames before Python 3.12)
            grad_fn = root.grad_fn
            if grad_fn is None:
                root_leaves.append(root)
            else:
                nodes.append(grad_fn)
            grad_outputs.append(torch.ones_like(root))  # (preserve_format: the default)
        reach = reach_from(nodes, root_leaves)
        with self._passes_lock:
            self._passes += 1
        try:
            futures, _ = self._local_pass(ctx, nodes, list(roots), grad_outputs, reach,
                                          retain_graph, pass_id, reply_to=None)
            if futures:
                self._drive_from_here(ctx, futures, retain_graph, pass_id)
        finally:
            with self._passes_lock:
                self._passes -= 1

    def _drive_from_here(self, ctx: DistAutogradContext, futures: list[CallResult[Any]],
                         retain_graph: bool, pass_id: int) -> None:
        """The initiator's wait: every pass handed back to it runs in its own thread.

        The initiator only waits meanwhile, so a pass runs there with no hand-off to
        the pool; and this worker's compute stays on one thread: each thread that
        runs torch's parallel ops gets an OpenMP team of its own, and with more
        team threads than cores GNU OpenMP stops spinning between parallel regions
        process-wide, so every later op of the process pays a wake-up per region
        (a 2-layer LSTM's forward and backward ~6x slower, on both cores). A reply
        received on this thread (its turn on the inbox) queues its passes to run
        after the turn: nothing computes while holding the inbox. While exactly one
        message is outstanding (the usual chain: one call's backward message, whose
        reply hands back one pass), this thread waits on its reply directly and runs
        what it hands back; a :class:`PassDriver` takes over once more is outstanding.

        Invariant (no lost wake-up): the waiter is made under ``lock`` before the
        queue is found empty, and whoever queues a pass (or completes the driver)
        completes the waiter current under ``lock`` after it.
        """
        handed_back: Owed = []
        while len(futures) == 1 and DRIVE_ONE_DIRECTLY:
            # One message outstanding and nothing else to run: its reply is all this
            # worker waits for, so no driver (its error is the first and only one).
            handed_back, futures = checked_reply(futures[0].wait()), []
            if len(handed_back) != 1:
                break
            (message_id, grads), handed_back = handed_back[0], []
            futures, _ = self._continue_at(ctx, message_id, grads, retain_graph, pass_id, None,
                                           kept_positions([grads]))
        if not futures and not handed_back:
            return
        lock = threading.Lock()
        queued: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        wake: list[CallResult[Any]] = [CallResult("distributed backward", self.agent)]

        def wake_initiator() -> None:
            with lock:
                current = wake[0]
            complete(current)  # (ends its wait, or its turn on the inbox)

        def submit(fn: Callable[..., None], *args: Any) -> None:
            with lock:
                queued.append((fn, args))
            wake_initiator()

        driver = self._driver(ctx, retain_graph, pass_id, None, submit)
        driver.result.add_done_callback(lambda _: wake_initiator())
        driver.hand_back(handed_back)  # (before add: it may finish the driver's first unit)
        driver.add(futures, [])
        while True:
            with lock:
                ready = queued[:]
                queued.clear()
                finished = not ready and driver.result.done()
                if not ready and not finished:
                    wake[0] = CallResult("distributed backward", self.agent)
                waiter = wake[0]
            if finished:
                break
            if ready:
                for fn, args in ready:
                    fn(*args)
                continue
            waiter.wait()
        driver.result.wait()  # raises the first error, once every part finished

    def _driver(self, ctx: DistAutogradContext, retain_graph: bool, pass_id: int,
                reply_to: int | None, submit: Callable[..., None] | None = None) -> PassDriver:
        return PassDriver(
            lambda message_id, grads, kept: self._continue_at(
                ctx, message_id, grads, retain_graph, pass_id, reply_to, kept
            ),
            submit or self.agent.submit,
            self.agent,
        )

    def _local_pass(
        self,
        ctx: DistAutogradContext,
        start: list[Any],
        outputs: list[Any],
        grad_outputs: list[torch.Tensor],
        reach: Reach,
        retain_graph: bool,
        pass_id: int,
        reply_to: int | None,
    ) -> tuple[list[CallResult[Any]], Owed]:
        """Backpropagate over this worker's graph.

        Returns the futures of the messages sent, and the gradients owed to
        ``reply_to`` (the worker whose request this pass serves), which go back
        in the reply instead of in a message of their own. The messages leave
        before this worker's leaves take their gradients; an error there comes
        back as one more (failed) future, reported once the messages are answered.
        """
        ctx.claim(start, pass_id, retain_graph)
        inputs, tags = reach.pass_inputs()
        if not inputs:
            return [], []
        # retain_graph=True always: another message of this pass may cross this subgraph.
        grads = gradients_at(outputs, inputs, grad_outputs)
        futures: list[CallResult[Any]] = []
        owed: Owed = []
        offset = len(reach.leaves)
        for tag in tags:
            context_id, message_id, sender, count = tag  # type: ignore[misc]
            part = list(grads[offset:offset + count])
            offset += count
            for grad in part:
                if grad is not None:
                    break
            else:
                continue  # not on a path from the roots: no message
            if sender == reply_to:
                owed.append((message_id, part))
                continue
            payload = (context_id, message_id, part, retain_graph, pass_id)
            try:
                futures.append(self.agent.send_request(
                    self.agent.members.resolve(sender), MessageKind.AUTOGRAD_BACKWARD, payload,
                    description=f"distributed backward (context {context_id})", make=CallResult,
                ))
            except BaseException as exc:  # noqa: BLE001 - reported with the others
                futures.append(_failed(exc))
        # this worker's leaves after the messages left: the peers' passes run meanwhile
        try:
            for leaf, grad in zip(reach.leaves, grads):
                if grad is not None:
                    ctx.accumulate(leaf, grad)
        except BaseException as exc:  # noqa: BLE001 - reported once the messages are answered
            futures.append(_failed(exc))
        return futures, owed

    def _continue_at(
        self,
        ctx: DistAutogradContext,
        message_id: int,
        grads: list[Any],
        retain_graph: bool,
        pass_id: int,
        reply_to: int | None,
        kept: dict[int, int],
    ) -> tuple[list[CallResult[Any]], Owed]:
        """Continue a pass from this worker's send function ``message_id`` with ``grads``.

        ``kept``: for gradients unpickled from the message, the position in ``grads`` at
        which the context may keep each rather than a copy (``kept_positions``).
        """
        send = ctx.get_send(message_id)
        if send is None:
            raise DistAutogradError(
                f"autograd context {ctx.context_id} on {self.agent.name!r} has no send function "
                f"for message {message_id}"
            )
        sent = send.shapes
        if len(grads) != len(sent):
            raise DistAutogradError(
                f"message {message_id} carries {len(grads)} gradients for "
                f"{len(sent)} tensors"
            )
        for index, (shape, grad) in enumerate(zip(sent, grads)):
            if grad is not None and (not isinstance(grad, torch.Tensor) or grad.shape != shape):
                got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
                raise DistAutogradError(
                    f"message {message_id} carries a gradient of shape {got} for a tensor of "
                    f"shape {tuple(shape)} (gradient {index})"
                )
        leaves, reach = send.leaves, send.reach
        if leaves is None or (not leaves and reach is None):  # (usually prepared already)
            send.prepare()
            leaves, reach = send.leaves, send.reach
        if leaves and _pass_straight_to_leaves(leaves, grads):
            # each tensor of the message was a leaf: its gradient is the one that came
            # back, as the engine would find it (SendRpcBackward is the identity)
            ctx.claim([("send", message_id)], pass_id, retain_graph)
            # (a tensor given for several leaves: the earlier ones copy it first, then the
            # last keeps it; kept first, another thread could add into it before a copy)
            for position, (leaf, grad) in enumerate(zip(leaves, grads)):
                if grad is not None:
                    ctx.accumulate(leaf, grad, owned=kept.get(id(grad)) == position)
            return [], []
        if reach is None:  # (leaves whose gradients need the engine: hooks, casts)
            reach = send.pass_reach()
        starts: list[Any] = []
        start_grads: list[Any] = []
        for edge, grad in zip(send.edges or send.roots, grads):  # (loops: no frames)
            if grad is not None:
                starts.append(edge)
                start_grads.append(grad)
        return self._local_pass(
            ctx, [("send", message_id)], starts, start_grads, reach, retain_graph, pass_id,
            reply_to,
        )

    def handle_backward(self, request: IncomingRequest) -> Any:
        """AUTOGRAD_BACKWARD: continue the pass from one of this worker's send functions.

        Replies with the gradients owed to the requester (see ``_pass_driver``),
        once the messages this worker sent for the pass were answered.
        """
        context_id, message_id, grads, retain_graph, pass_id = request.payload
        ctx = self.store.retrieve(context_id)
        requester = request.sender.id
        futures, owed = self._continue_at(ctx, message_id, grads, retain_graph, pass_id,
                                          requester, kept_positions([grads]))
        if not futures:
            return owed or None
        driver = self._driver(ctx, retain_graph, pass_id, requester)
        driver.add(futures, owed)
        return driver.result

    # -- cleanup -------------------------------------------------------------------------------

    def create_context(self) -> DistAutogradContext:
        if self.closed:
            raise DistAutogradError("RPC was shut down; cannot create an autograd context")
        return self.store.create()

    def release(self, context_id: int) -> None:
        """Leave a context: release it here and tell the workers that took part."""
        ctx = self.store.release(context_id)
        if ctx is not None and not self.closed:
            self._notify(ctx, exclude=None)

    def _notify(self, ctx: DistAutogradContext, exclude: int | None) -> None:
        for rank in sorted(ctx.known_workers - {self.agent.rank, exclude}):
            self.agent.notify_soon(rank, MessageKind.AUTOGRAD_CLEANUP, (ctx.context_id,))

    def handle_cleanup(self, request: IncomingRequest) -> Any:
        """AUTOGRAD_CLEANUP (inline notification): release, pass it on to the known workers."""
        (context_id,) = request.payload
        ctx = self.store.release(context_id)
        if ctx is not None and not self.closed:  # (already released here: it stops)
            self._notify(ctx, exclude=request.sender.id)

    def wait_for_cleanup(self, timeout: float) -> bool:
        """Wait until no other worker holds a context this worker created and has left.

        Cleanups are notifications nobody acknowledges, so this asks every worker
        until none holds one; the releases still queued here leave first, on messages
        of their own (riding on the question, a release would be handled only after it
        was answered).
        """
        deadline = time.monotonic() + timeout
        return wait_until(lambda: not self._left_contexts_held_elsewhere(deadline), deadline)

    def _left_contexts_held_elsewhere(self, deadline: float) -> set[int]:
        self.agent.riders.flush(everything=True)
        mine, limit = self.agent.rank, max(0.1, deadline - time.monotonic())
        peers = [info for info in self.agent.worker_infos() if info.id != mine]
        asked = [self.agent.call(info, held_context_ids, (mine,), {}, limit) for info in peers]
        held: set[int] = set().union(*(future.wait() for future in asked))
        return held - {ctx.context_id for ctx in self.store.all()}

    def debug_info(self) -> dict[str, Any]:
        contexts = self.store.all()
        known: set[int] = set()
        sends = recvs = 0
        for ctx in contexts:
            with ctx.lock:
                sends += len(ctx.send_functions)
                recvs += len(ctx.recv_functions)
                known |= ctx.known_workers
        return {
            "num_autograd_contexts": len(contexts),
            "num_send_functions": sends,
            "num_recv_functions": recvs,
            "known_worker_ids": sorted(known),
            "num_current_backward_passes": self._passes,
        }

    def close(self, graceful: bool) -> None:
        self.closed = True
        self.store.clear()


def held_context_ids(creator: int) -> set[int]:
    """The ids of the contexts held on this worker that ``creator`` created (an RPC)."""
    contexts = current_engine().store.all()
    return {ctx.context_id for ctx in contexts if ctx.context_id >> ID_BITS == creator}


def checked_roots(roots: Any) -> list[torch.Tensor]:
    """``backward``'s roots as a list, checked (each a scalar tensor requiring grad)."""
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    if roots is None or not isinstance(roots, (list, tuple)) or len(roots) == 0:
        raise InvalidArgumentError(
            f"roots must be a non-empty list of scalar tensors that require grad, got {roots!r}"
        )
    for i, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise InvalidArgumentError(f"roots[{i}] is a {type(root).__name__}, not a tensor")
        if not root.requires_grad:
            raise InvalidArgumentError(
                f"roots[{i}] does not require grad and has no grad_fn: backward needs a tensor "
                "computed from tensors with requires_grad=True"
            )
        if root.numel() != 1:
            raise InvalidArgumentError(
                f"roots[{i}] is not a scalar (shape {tuple(root.shape)}): backward roots must "
                "have exactly one element (reduce it, e.g. with .sum())"
            )
    return list(roots)


def current_engine() -> AutogradEngine:
    """The engine of this process's agent (raises if RPC is not initialized or the engine
    is not installed)."""
    return engine_of(current_agent())


def engine_of(agent: Agent) -> AutogradEngine:
    engine = agent.extensions.get(EXTENSION)
    if engine is None:
        raise DistAutogradError(
            "distributed autograd is not installed on this RPC agent; import actorrpc.autograd "
            "before init_rpc"
        )
    return engine  # type: ignore[no-any-return]


def install(agent: Agent) -> None:
    """Agent plugin: the engine, its call hook and its two message handlers (idempotent)."""
    if EXTENSION in agent.extensions:
        return
    engine = AutogradEngine(agent)
    agent.extensions[EXTENSION] = engine
    agent.register_handler(MessageKind.AUTOGRAD_BACKWARD, engine.handle_backward)
    agent.register_handler(  # a release only lets the graph go: it may wait
        MessageKind.AUTOGRAD_CLEANUP, engine.handle_cleanup, inline=True, after_carrier=True
    )
    agent.add_call_hook(engine)
    agent.add_close_hook(engine.close)
