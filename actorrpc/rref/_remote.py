"""``remote()`` and the owner/user message handlers of the RRef protocol."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..agent import (
    Agent,
    CallResult,
    IncomingRequest,
    current_agent,
    encode_reply,
    register_agent_plugin,
    undo_inherited_batch,
)
from ..agent._remote_exception import pack_exception
from ..errors import ProtocolError, RpcTimeoutError, ShutdownError
from ..protocol import MessageKind
from ..serialization import register_reducer
from ._context import (
    CHILD_ACCEPT,
    USER_DELETE,
    FetchFailure,
    OwnerState,
    RRefContext,
    RRefId,
    copy_exception,
    format_id,
    settle,
)
from ._rref import RRef, _reduce_rref, creation_timeout_error, rref_context, send_child_accept

__all__ = ["debug_info", "remote"]

_log = logging.getLogger("actorrpc.rref")

REGISTER_AFTER_REPLY = True
"""An owner enters a value created for another worker in its tables after the reply
(see ``_handle_remote_call``); False: before running the function (same-run A/Bs)."""

# What remote()'s creation completes: a CallResult (no torch future; RRef._get_future()
# makes one only when asked).
_CREATION_RESULT: Any = CallResult


def remote(
    to: Any,
    func: Any,
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = -1.0,
) -> RRef[Any]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return an :class:`RRef` to the result.

    Returns at once; the value is created asynchronously. Errors raised while
    creating it are re-raised by ``to_here()`` (and by the proxies).

    Args:
        to: destination worker name, rank or :class:`WorkerInfo`.
        func: a callable (a builtin, torch op, function or class).
        args, kwargs: its arguments.
        timeout: seconds for the creation (``-1``: the default; ``0``: none).

    Example::

        >>> # on worker0, with worker1 in the group
        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.to_here()
        tensor([4., 4.])
    """
    agent = current_agent()
    dest = agent.resolve(to)
    ctx = rref_context(agent)
    rref_id = ctx.new_id()
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    if dest.id == agent.rank:
        # Case 1 to self: rref id only; the handler finds the state through
        # ``owners`` (held strongly until the value is set, then released unless forked).
        state = ctx.get_or_create_owner(rref_id)
        rref = RRef._make_owner(agent, state)
        try:
            future = agent.call(dest, func, args, kwargs, timeout, MessageKind.REMOTE_CALL,
                                (rref_id, None), make=_CREATION_RESULT)
        except BaseException:
            ctx.release_if_unforked(rref_id)
            raise
        rref._creation_future = future
        future.add_done_callback(lambda f: _self_created(ctx, state, f))
        return rref
    fork_id = ctx.new_id()
    rref = RRef._make_user(agent, dest, rref_id, fork_id)
    ctx.add_pending_user(rref)  # held until REMOTE_RET confirms it (no early delete)
    try:
        # held back a moment: a to_here() right after goes with it (agent/_held.py)
        future = agent.call(dest, func, args, kwargs, timeout, MessageKind.REMOTE_CALL,
                            (rref_id, fork_id), hold=agent.held.may_hold(),
                            make=_CREATION_RESULT)
    except BaseException:
        ctx.forget_pending_user(fork_id)  # never sent: the owner must not hear of it
        raise
    rref._creation_future = future

    def created(done: Any) -> None:
        # The function's own error (also kept by the owner), or a failure of the call
        # itself (timeout, peer gone: the owner may never have run it).
        _, error = settle(done)
        if error is not None:
            rref._creation_error = creation_timeout_error(error, rref)
        ctx.confirm_user(fork_id)

    future.add_done_callback(created)
    # last: the request leaves at this thread's next call, unless that is rref.to_here()
    agent.held.release_on_next_call(future, RRef.to_here.__code__)
    return rref


def _self_created(ctx: RRefContext, state: OwnerState, future: Any) -> None:
    _, error = settle(future)
    if error is not None:  # the call itself failed (e.g. timed out): the handler may not run
        state.set_error(error)
        ctx.release_if_unforked(state.rref_id)


def debug_info() -> dict[str, int]:
    """The RRef tables' sizes on this worker (owner RRefs, forks, pending users/children).

    A dict of ints: ``num_owner_rrefs``, ``num_forks``, ``num_pending_users``,
    ``num_pending_children`` and ``num_confirmed_users``.

    Example::

        >>> # on worker0
        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rref.to_here()
        tensor([2., 2.])
        >>> info = rpc.rpc_sync("worker1", rpc.get_rref_debug_info)  # worker1's tables
        >>> info["num_owner_rrefs"], info["num_forks"]
        (1, 1)
    """
    return rref_context().debug_info()


# -- handlers (owner side unless noted) ----------------------------------------------------


def _handle_remote_call(agent: Agent, request: IncomingRequest) -> Any:
    """REMOTE_CALL: register the creator's fork, run the function, keep its result.

    A function's error is kept on the owner like a value (every ``to_here()``
    and proxy call re-raises it here) and also fails the REMOTE_CALL, so the
    creator's ``_get_future()`` and ``to_here()`` raise it without another
    trip. The owner still holds the fork, so the RRef may be shared and dropped
    like any other (``RRefContext.fork_for``).
    """
    func, args, kwargs, meta, rref_id, fork_id = request.payload
    ctx = rref_context(agent)
    if fork_id is not None and REGISTER_AFTER_REPLY:
        # Created for another worker: the tables take the value after the reply left
        # (``after_reply``), off the creator's wait. Its next messages about the RRef may be
        # served first; each already copes with an id not yet created (a fetch or fork
        # request makes the pending owner state, which the value then completes; a delete
        # leaves a tombstone, so the value is not entered), as with a third worker's.
        value, error = _run_creation(agent, request.sender, func, args, kwargs, meta)
        if error is None and not isinstance(value, torch._C.Future):
            request.after_reply = lambda: ctx.on_remote_call(rref_id, fork_id).set_value(value)
            return _created_reply(agent, request, lambda: value)
        state = ctx.on_remote_call(rref_id, fork_id)
    else:
        state = ctx.on_remote_call(rref_id, fork_id)
        value, error = _run_creation(agent, request.sender, func, args, kwargs, meta)
    if error is None and isinstance(value, torch._C.Future):
        reply: torch.futures.Future[Any] = torch.futures.Future()

        def store(done: torch.futures.Future[Any]) -> None:
            result, failure = settle(done)
            if failure is None:
                state.set_value(result)
            else:
                state.set_error(failure)
            _release_self_owner(ctx, rref_id, fork_id)
            if failure is None:
                reply.set_result(_created_reply(agent, request, lambda: state.wait(0)))
            else:  # a copy: ``reply`` must not hold the exception the state holds
                reply.set_exception(copy_exception(failure))

        value.add_done_callback(store)
        return reply
    if error is None:
        state.set_value(value)
        _release_self_owner(ctx, rref_id, fork_id)
        return _created_reply(agent, request, lambda: state.wait(0))
    state.set_error(error)
    _release_self_owner(ctx, rref_id, fork_id)
    raise copy_exception(error, keep_traceback=True)


def _created_reply(
    agent: Agent, request: IncomingRequest, created: Callable[[], Any]
) -> Any:
    """The answer to a creation that succeeded: None, or for REMOTE_CALL_FETCH the value,
    ``created()`` (served as a fetch that arrived before the value existed would be,
    right now)."""
    if request.kind != MessageKind.REMOTE_CALL_FETCH:
        return None
    try:  # encoded here: a value that cannot be pickled fails the fetch, not the creation
        sender = request.sender
        if agent.serving_without_meta:  # served as any fetch (a hook serves calls without meta)
            value = agent.serve(sender, {}, (), {}, lambda call: created())
        else:
            value = created()
        return encode_reply(sender.id, value)
    except BaseException as exc:  # noqa: BLE001 - the creator's to_here() raises it
        return FetchFailure(pack_exception(exc, repr(agent.info)))


def _run_creation(
    agent: Agent, sender: Any, func: Any, args: Any, kwargs: Any, meta: Any
) -> tuple[Any, BaseException | None]:
    """Run the function: ``(value, None)`` or ``(None, error)``.

    A separate frame: the error's traceback (kept on the owner state) must not
    reference a frame that holds the state.
    """
    try:
        value = agent.serve_call(sender, meta, func, args, kwargs)
    except BaseException as exc:  # noqa: BLE001 - stored on the owner
        return None, exc
    return value, None


def _release_self_owner(ctx: RRefContext, rref_id: RRefId, fork_id: Any) -> None:
    if fork_id is None:
        ctx.release_if_unforked(rref_id)


class _Timer:
    """A delayed callback; :meth:`cancel` before it is due and it never runs."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


_PRUNE_AT = 4096


class _Timers:
    """One daemon thread that runs delayed callbacks (the owner's limit on a fetch).

    Most timers are cancelled long before they are due (a fetch answered in
    time): cancelled entries at the head are dropped without waking the thread
    for them, and the heap is rebuilt without cancelled entries whenever it has
    doubled since the last rebuild, so a stream of fetches costs neither memory
    nor wake-ups for the full limit.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Timer]] = []
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._prune_at = _PRUNE_AT

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(callback)
        with self._cond:
            heap = self._heap
            if len(heap) >= self._prune_at:
                heap[:] = [entry for entry in heap if entry[2].callback is not None]
                heapq.heapify(heap)
                self._prune_at = max(_PRUNE_AT, 2 * len(heap))
            entry = (time.monotonic() + delay, next(self._ids), timer)
            heapq.heappush(heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="actorrpc-rref-timers", daemon=True
                )
                self._thread.start()
            if heap[0] is entry:  # otherwise the thread already wakes up earlier
                self._cond.notify()
        return timer

    def pending(self) -> int:
        """Timers in the heap, cancelled ones not yet dropped included."""
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        undo_inherited_batch()  # (started by the agent's I/O thread, perhaps)
        heap = self._heap
        while True:
            with self._cond:
                while heap and heap[0][2].callback is None:
                    heapq.heappop(heap)  # cancelled: nothing to wait for
                if not heap:
                    self._cond.wait()
                    continue
                when, _, timer = heap[0]
                delay = when - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(heap)
                callback, timer.callback = timer.callback, None
            try:
                if callback is not None:
                    callback()
            except Exception:  # noqa: BLE001 - a timer must never stop the others
                _log.exception("error in an RRef timer")


_timers = _Timers()


class _Fetch:
    """One RREF_FETCH waiting for a value not yet created: replied exactly once.

    Either the value (or its error) arrives, or the limit expires first and the
    reply is a timeout, so a fetch of an RRef the owner never hears of (its
    creator died, or the creation timed out) does not stay in flight for ever.
    Once replied it drops every reference (the timer keeps only this shell, so a
    fetched value is not held until the limit passes).
    """

    def __init__(
        self,
        agent: Agent,
        request: IncomingRequest,
        meta: Any,
        state: OwnerState,
        reply: torch.futures.Future[Any],
    ) -> None:
        self.lock = threading.Lock()
        self.meta = meta
        self.timer: _Timer | None = None  # the limit, cancelled once replied
        self._parts: tuple[Agent, IncomingRequest, OwnerState, Any] | None = (
            agent, request, state, reply
        )

    def _take(self) -> tuple[Agent, IncomingRequest, OwnerState, Any] | None:
        """Everything needed to reply, once (then this object holds nothing)."""
        with self.lock:
            parts, self._parts = self._parts, None
            return parts

    def deliver(self, _: Any = None) -> None:
        # An error goes back as a FetchFailure *value*: the agent re-raises the error of a
        # failed reply future through a frame holding that future (agent/_calls.py
        # outcome_of), a cycle gc cannot free that keeps this thread's whole stack.
        parts = self._take()
        if parts is None:
            return
        if self.timer is not None:
            self.timer.cancel()
        agent, request, state, reply = parts
        error = state.error()
        if error is not None:
            reply.set_result(FetchFailure(pack_exception(error, repr(agent.info))))
            return
        try:
            value = _serve_value(agent, request, self.meta, state)
        except BaseException as exc:  # noqa: BLE001 - a hook failed: the caller gets it
            reply.set_result(FetchFailure(pack_exception(exc, repr(agent.info))))
            return
        reply.set_result(value)

    def expire(self, limit: float) -> None:
        parts = self._take()
        if parts is None:
            return
        agent, _, state, reply = parts
        timeout = RpcTimeoutError(
            f"RPC ran for more than set timeout ({int(limit * 1000)} ms) waiting on "
            f"{agent.name!r} for RRef {format_id(state.rref_id)} to be created"
        )
        reply.set_result(FetchFailure(pack_exception(timeout, repr(agent.info))))
        if not state.is_ready():  # a pending owner nobody created: forget it
            rref_context(agent).release_if_unforked(state.rref_id)


def _handle_fetch(agent: Agent, request: IncomingRequest) -> Any:
    """RREF_FETCH (``to_here``): reply with the value, or its error, once it exists.

    Payload ``(rref_id, meta[, timeout])``: the caller's timeout (``0``: none)
    bounds the wait here too; without one the owner's default RPC timeout does.
    """
    rref_id, meta, timeout = _fetch_payload(request.payload)
    limit = agent.effective_timeout(timeout)
    ctx = rref_context(agent)
    state = ctx.local_states.get(rref_id) or ctx.get_or_create_owner(rref_id)
    error = state.error()
    if error is not None:  # raised, not put in a future (see invoke_method)
        raise copy_exception(error)
    if state.is_ready():  # the common case (creation came first on the link): no future
        return _serve_value(agent, request, meta, state)
    reply: torch.futures.Future[Any] = torch.futures.Future()
    fetch = _Fetch(agent, request, meta, state, reply)
    if not state.is_ready() and limit > 0:
        fetch.timer = _timers.call_later(limit, lambda: fetch.expire(limit))
    state.when_ready(fetch.deliver)
    return reply


def _serve_value(agent: Agent, request: IncomingRequest, meta: Any, state: OwnerState) -> Any:
    """The created value, returned inside the call hooks' serving scopes (a fetch's reply)."""
    return agent.serve(request.sender, meta, (), {}, lambda call: state.wait(0))


def _fetch_payload(payload: Any) -> tuple[RRefId, dict[str, Any], float]:
    """``(rref_id, meta[, timeout])``, checked: a malformed request is refused at once."""
    if isinstance(payload, tuple) and len(payload) in (2, 3):
        rref_id, meta, *rest = payload
        timeout = rest[0] if rest else -1.0
        if (isinstance(rref_id, tuple) and isinstance(meta, dict)
                and isinstance(timeout, (int, float)) and not isinstance(timeout, bool)):
            return rref_id, meta, float(timeout)  # type: ignore[return-value]
    raise ProtocolError(f"malformed RREF_FETCH payload: {_describe(payload)}")


def _ids(payload: Any, count: int, kind: str) -> tuple[Any, ...]:
    """``count`` RRef/fork ids (tuples) from a control message, or ProtocolError."""
    if (isinstance(payload, tuple) and len(payload) == count
            and all(isinstance(i, tuple) for i in payload)):
        return payload
    raise ProtocolError(f"malformed {kind} payload: {_describe(payload)}")


def _describe(payload: Any) -> str:
    text = repr(payload)
    return text if len(text) <= 80 else text[:77] + "..."


def _handle_fork_request(agent: Agent, request: IncomingRequest) -> None:
    rref_id, fork_id = _ids(request.payload, 2, "RREF_FORK_REQUEST")
    rref_context(agent).on_fork_request(rref_id, fork_id)


def _handle_child_accept(agent: Agent, request: IncomingRequest) -> None:
    (fork_id,) = _ids(request.payload, 1, "RREF_CHILD_ACCEPT")
    rref_context(agent).on_child_accept(fork_id)


def _handle_user_delete(agent: Agent, request: IncomingRequest) -> None:
    rref_id, fork_id = _ids(request.payload, 2, "RREF_USER_DELETE")
    rref_context(agent).on_user_delete(rref_id, fork_id)


SHUTDOWN_RREF_WAIT_LIMIT = 100.0
"""Most seconds graceful shutdown waits for RRef deletes (torch waits 100 s)."""
DYNAMIC_LEAVE_FORK_WAIT = 1.0
"""Most seconds a worker leaving a dynamic group waits for others to drop its RRefs."""


def _shutdown_rrefs(agent: Agent, ctx: RRefContext, deadline: float) -> None:
    """Graceful shutdown: drain pending users/children, delete users, wait for forks to go.

    Every worker runs this after the first shutdown barrier, so the deletes it
    waits for are being sent concurrently by the others. It uses at most half of
    the time left (and :data:`SHUTDOWN_RREF_WAIT_LIMIT`), so a leak leaves the
    later barriers time to complete: a leak is reported, never a hang.
    """
    now = time.monotonic()
    deadline = min(now + (deadline - now) / 2, now + SHUTDOWN_RREF_WAIT_LIMIT)
    drained = ctx.wait_until(lambda: not ctx.pending_users and not ctx.pending_children, deadline)
    ctx.delete_all_users()
    # (deletes wait to ride in batches: not now; the I/O thread queues them, then flushes)
    agent.call_soon(agent.riders.flush, True)
    if agent.dynamic:
        # the others go on: forks they keep would be waited for in vain (deletes in flight
        # still get a moment to arrive)
        deadline = min(deadline, time.monotonic() + DYNAMIC_LEAVE_FORK_WAIT)
    forks_gone = ctx.wait_until(lambda: not ctx.forks, deadline)
    if drained and forks_gone:
        return
    leaks = ctx.leaks()
    info = ctx.debug_info()
    for line in leaks:
        _log.warning("%s: %s", agent.name, line)
    message = (
        f"RRefs leaked on {agent.name!r}: {len(leaks)} forks still registered, "
        f"{info['num_pending_users']} pending users, {info['num_pending_children']} pending "
        f"children at shutdown"
    )
    if agent.options.strict_rref_leaks:
        raise ShutdownError(message + ": " + "; ".join(leaks[:10]))
    _log.warning("%s", message)


def _install(agent: Agent) -> None:
    def send_control(dest: int, kind: str, payload: tuple[Any, ...]) -> None:
        # Safe from __del__ and under the context's lock: only queued. Deletes ride in
        # batches on messages to the owner (or go alone within 10 ms): nobody waits for
        # them. A delete (usually from a finalizer, on the thread that dropped the RRef,
        # between its calls) is handed to the I/O thread, which queues it to ride: one
        # queue put here instead of the riders' lock and tables (remote()+to_here() in a
        # loop -3.6 %, rebinding -8.5 %; docs/performance.md, "Thirty-first session").
        if kind == USER_DELETE:
            agent.call_soon(agent.riders.add, dest, MessageKind.RREF_USER_DELETE, payload)
        elif kind == CHILD_ACCEPT:
            agent.call_soon(send_child_accept, agent, dest, *payload)
        else:  # pragma: no cover - the context sends no other kind
            raise ValueError(f"unknown RRef control message {kind!r}")

    ctx = RRefContext(agent.rank, send_control)
    agent.extensions["rref"] = ctx
    agent.register_handler(MessageKind.REMOTE_CALL, lambda r: _handle_remote_call(agent, r))
    agent.register_handler(
        MessageKind.REMOTE_CALL_FETCH, lambda r: _handle_remote_call(agent, r)
    )
    agent.register_handler(MessageKind.RREF_FETCH, lambda r: _handle_fetch(agent, r), inline=True)
    agent.register_handler(
        MessageKind.RREF_FORK_REQUEST, lambda r: _handle_fork_request(agent, r), inline=True
    )
    agent.register_handler(
        MessageKind.RREF_CHILD_ACCEPT, lambda r: _handle_child_accept(agent, r), inline=True
    )
    agent.register_handler(  # a fork's delete only lets the value go: it may wait
        MessageKind.RREF_USER_DELETE, lambda r: _handle_user_delete(agent, r), inline=True,
        after_carrier=True,
    )
    agent.riders.batch_kind(MessageKind.RREF_USER_DELETE)  # (only lets a value go, later)
    agent.add_shutdown_hook(lambda deadline: _shutdown_rrefs(agent, ctx, deadline))

    def close(graceful: bool) -> None:
        ctx.closed = True

    agent.add_close_hook(close)


register_agent_plugin(_install)
register_reducer(RRef, _reduce_rref)
