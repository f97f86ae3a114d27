"""RRef proxies (``rref.rpc_sync().method(...)``) and per-caller FIFO actor calls.

Calls through a proxy from one caller worker to one owner value start on the
owner in the order the caller made them (per-caller FIFO): each carries a
sequence number per (caller, RRef), and the owner holds back a call until its
predecessor has run (for an ``async_execution`` method: until it returned its
Future). A value whose class sets ``__actorrpc_concurrent__ = True`` opts out
and runs calls concurrently.

Invariants:

* Caller side: a sequence number is consumed only by a call that was sent. The
  number is taken and the message sent under the (caller, RRef) lock, and a
  send that raises (e.g. an unpicklable argument) gives the number back. The
  counters live in the caller's :class:`RRefContext` (``call_sequences``), so a
  new RPC session starts from 0.
* Owner side: the queues live on the value's :class:`OwnerState`, so they go
  with the value and never outlive it. Every sequence number that reaches the
  owner is used exactly once: the call runs (its errors, even a missing method,
  become the call's result in order), or, when the call dies before
  :func:`invoke_method` (its payload did not unpickle, or the serving failed),
  the number's :class:`_Ticket` is freed unclaimed and skips it (its finalizer
  queues the skip for the I/O thread, which hands it to the pool: a finalizer takes
  no lock and runs no calls), so later calls never wait forever for it. A number
  skipped before the owner entered the value (it does so after replying to the
  creation) is kept in ``early_skips`` and applied when the value's queue for that
  caller is made (both under one lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..agent import Agent, current_agent
from ._context import (
    OwnerState,
    RRefContext,
    RRefId,
    detached_exception,
    settle,
    wait_result,
)
from ._rref import RRef, rref_context

__all__ = ["RRefProxy", "fetch_type", "invoke_method", "rref_backward"]


class _CallerSequence:
    """The next sequence number of this worker's calls on one RRef."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = 0


_sequences_lock = threading.Lock()


def _caller_sequence(ctx: RRefContext, rref_id: RRefId) -> _CallerSequence:
    with _sequences_lock:
        sequence: _CallerSequence | None = ctx.call_sequences.get(rref_id)
        if sequence is None:
            sequence = ctx.call_sequences[rref_id] = _CallerSequence()
        return sequence


class _CallOrder:
    """Caller side of a sequence number; becomes a :class:`_Ticket` on the owner."""

    def __init__(self, rref_id: RRefId, caller: int, seq: int) -> None:
        self.rref_id = rref_id
        self.caller = caller
        self.seq = seq

    def __reduce__(self) -> Any:
        return _Ticket, (self.rref_id, self.caller, self.seq)


class _Ticket:
    """Owner side of a sequence number: claimed by :func:`invoke_method`, else skipped."""

    def __init__(self, rref_id: RRefId, caller: int, seq: int) -> None:
        self.rref_id = rref_id
        self.caller = caller
        self.seq = seq
        self.claimed = False
        try:
            self._agent: Agent | None = current_agent()
            self._ctx: RRefContext | None = rref_context(self._agent)
        except Exception:  # noqa: BLE001 - unpickled outside an agent: nothing to skip
            self._agent = self._ctx = None

    def __del__(self) -> None:
        # A finalizer runs wherever the collector does, perhaps under the locks the skip
        # takes, and the skip may run the calls waiting behind this number: so it is only
        # queued here (safe from a finalizer), and the I/O thread hands it to the pool.
        if self.claimed or self._agent is None or self._ctx is None:
            return
        try:
            self._agent.call_soon(
                self._agent.submit, _skip, self._ctx, self.rref_id, self.caller, self.seq
            )
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


EARLY_SKIP_LIMIT = 4096
"""Skipped numbers kept for values not yet entered on their owner (oldest dropped first)."""


def _skip(ctx: RRefContext, rref_id: RRefId, caller: int, seq: int) -> None:
    """Skip number ``seq`` of ``caller``'s calls on ``rref_id``: now, or, when the owner has
    not entered the value yet (it does so after replying to its creation), once it has."""
    with _sequences_lock:  # (a queue made meanwhile takes the kept numbers under it)
        state = ctx.local_states.get(rref_id)
        if state is None:
            skips = ctx.early_skips
            skips.setdefault((rref_id, caller), []).append(seq)
            while len(skips) > EARLY_SKIP_LIMIT:
                skips.popitem(last=False)
            return
    _submit(_queue(ctx, state, caller), seq, None)


class _ActorQueue:
    """Runs one caller's calls on one value in sequence order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = 0
        self.waiting: dict[int, Callable[[], None] | None] = {}  # None: a skipped number


def _queue(ctx: RRefContext, state: OwnerState, caller: int) -> _ActorQueue:
    with state.actor_lock:
        queue: _ActorQueue | None = state.actor_queues.get(caller)
        if queue is None:
            queue = state.actor_queues[caller] = _ActorQueue()
            with _sequences_lock:
                skipped = ctx.early_skips.pop((state.rref_id, caller), [])
            for seq in skipped:  # (a new queue runs nothing: this only moves its numbers)
                _submit(queue, seq, None)
        return queue


def _submit(queue: _ActorQueue, seq: int, task: Callable[[], None] | None) -> None:
    """Run ``task`` (``None``: skip) as number ``seq`` once its predecessors ran."""
    with queue.lock:
        if seq < queue.next or seq in queue.waiting:
            return  # a number already used (a late skip): nothing to do
        if seq != queue.next:
            queue.waiting[seq] = task
            return
    while True:  # this thread owns number ``queue.next`` now
        if task is not None:
            task()
        with queue.lock:
            queue.next += 1
            if queue.next not in queue.waiting:
                return
            task = queue.waiting.pop(queue.next)


def invoke_method(rref: RRef[Any], name: str, args: Any, kwargs: Any, ticket: Any) -> Any:
    """Run ``getattr(rref.local_value(), name)(*args, **kwargs)`` on the owner, in caller order.

    Returns a Future (this function is an ``async_execution`` one), completed
    with the method's result or error; a call that runs at once and fails
    raises instead (a failed future kept by the agent would keep the frames).
    """
    result: torch.futures.Future[Any] = torch.futures.Future()
    caller = threading.get_ident()
    inline = [True]  # True while this call may raise its error itself (see run)
    raised: list[BaseException] = []

    def run() -> None:
        detached: BaseException | None = None
        try:
            outcome = _call(getattr(rref.local_value(), name), args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised below or delivered by the future
            if inline[0] and threading.get_ident() == caller:
                raised.append(exc)  # ran inside invoke_method, which re-raises it
                return
            # detached: a traceback would keep the method's frames (and the actor)
            detached = detached_exception(exc)
        if detached is not None:
            # outside the except block: callbacks that re-raise it must not chain the
            # original (with its frames) as __context__ through the C++ future
            result.set_exception(detached)
            return
        if isinstance(outcome, torch._C.Future):
            outcome.add_done_callback(lambda f: _forward(f, result))
        else:
            result.set_result(outcome)

    state = rref._state
    if not isinstance(ticket, _Ticket) or state is None:
        run()
    else:
        ticket.claimed = True
        queue = _queue(rref_context(rref._agent), state, ticket.caller)
        if state.is_ready() and getattr(_value_or_none(state), "__actorrpc_concurrent__", False):
            _submit(queue, ticket.seq, None)
            run()
        else:
            _submit(queue, ticket.seq, run)  # runs now, or later on the thread of its predecessor
    inline[0] = False
    if not raised:
        return result
    error = raised.pop()
    try:
        raise error
    finally:
        del error


def _invoke_in_order(ticket: Any, name: str, args: Any, kwargs: Any, rref: RRef[Any]) -> Any:
    """What a proxy sends: :func:`invoke_method` with the RRef pickled last."""
    return invoke_method(rref, name, args, kwargs, ticket)


_invoke_in_order._actorrpc_async_execution = True  # type: ignore[attr-defined]


def _value_or_none(state: OwnerState) -> Any:
    """The value of a ready state, ``None`` if its creation failed."""
    return None if state.error() is not None else state.wait(0)


def _forward(source: torch.futures.Future[Any], target: torch.futures.Future[Any]) -> None:
    value, error = settle(source)
    if error is None:
        target.set_result(value)
    else:
        target.set_exception(error)


def _call(method: Any, args: Any, kwargs: Any) -> Any:
    result = method(*(args or ()), **(kwargs or {}))
    if isinstance(result, torch._C.Future) and not _is_async(method):
        raise TypeError(
            f"{getattr(method, '__qualname__', method)!r} returned a Future; decorate it with "
            "@rpc.functions.async_execution to reply with the Future's value"
        )
    return result


def _is_async(method: Any) -> bool:
    func = getattr(method, "__func__", method)
    return bool(getattr(func, "_actorrpc_async_execution", False)) or getattr(
        func, "_wrapped_async_rpc_function", None
    ) is not None


invoke_method._actorrpc_async_execution = True  # type: ignore[attr-defined]


class RRefProxy:
    """Turns attribute calls into RPCs on the RRef's owner."""

    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def method(*args: Any, **kwargs: Any) -> Any:
            from ._remote import remote

            agent = current_agent()
            dest = rref.owner()
            sequence = _caller_sequence(rref_context(agent), rref._rref_id)
            with sequence.lock:  # number order == send order; a failed send keeps the number
                order = _CallOrder(rref._rref_id, agent.rank, sequence.next)
                # The RRef goes last: arguments that cannot be pickled fail before it is
                # forked. The ticket goes first: it exists on the owner even when the
                # arguments then fail to unpickle there.
                payload = (order, name, args, kwargs, rref)
                if mode == "remote":
                    handle = remote(dest, _invoke_in_order, payload, timeout=timeout)
                else:
                    future = agent.call(dest, _invoke_in_order, payload, {}, timeout)
                sequence.next += 1
            if mode == "remote":
                return handle
            return wait_result(future) if mode == "sync" else future

        method.__name__ = name
        return method

    def __repr__(self) -> str:
        return f"<RRefProxy {self._mode} of {self._rref}>"


def _type_of(rref: RRef[Any]) -> type:
    return type(rref.local_value())


def fetch_type(rref: RRef[Any], timeout: float = -1.0) -> type:
    """The type of the RRef's value, fetched once from the owner and cached."""
    cached = getattr(rref, "_type_cache", None)
    if cached is None:
        if rref.is_owner():
            cached = _type_of(rref)
        else:
            cached = current_agent().call_and_wait(rref.owner(), _type_of, (rref,), {}, timeout)
        rref._type_cache = cached  # type: ignore[attr-defined]
    return cached  # type: ignore[no-any-return]


def _backward_on_owner(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    from ..autograd import backward

    backward(context_id, [rref.local_value()], retain_graph=retain_graph)


def rref_backward(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    """``rref.backward(ctx_id)``: distributed backward from the owner's value."""
    agent = current_agent()
    agent.call_and_wait(rref.owner(), _backward_on_owner, (rref, context_id, retain_graph), {})
