"""Recording the distributed graph on calls: a message's recv and send functions, and the
scope of a call served inside a context (``AutogradEngine``'s call hook uses these).

Invariants (see ``_engine`` for the whole protocol):

* A message's recv function is made when it arrives, before anything uses its
  tensors: the received tensors requiring grad are replaced by outputs of one
  tagged ``RecvRpcBackward`` node, keyed by the sender's message id.
* A send function is recorded before the message carrying its tensors leaves (a
  call's arguments in ``before_send``, a served call's result as the scope closes,
  before the reply is pickled): the edges it keeps are those the tensors had then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..agent import CallRecord
from ._context import THREAD_CONTEXT as _current  # this thread's current context id
from ._context import ContextStore, DistAutogradContext, RecvFunction, SendFunction
from ._functions import find_grad_tensors, make_recv_outputs, replace_tensors

__all__ = [
    "KEY_CONTEXT",
    "KEY_MESSAGE",
    "KEY_RESPONSE",
    "ServingInContext",
    "attach_recv",
    "record_response",
]

# A call's meta entries (part of the wire format of calls made inside a context).
KEY_CONTEXT = "autograd_context_id"
KEY_MESSAGE = "autograd_message_id"  # the caller's send function of the arguments
KEY_RESPONSE = "autograd_response_id"  # the callee's send function of the result
PREPARE_AFTER_REPLY = True  # (a switch for same-run A/Bs: benchmarks/ab_switch.py)


def attach_recv(ctx: DistAutogradContext, message_id: int, sender: int, value: Any,
                received: list[torch.Tensor]) -> Any:
    """``value`` with its tensors ``received`` (requiring grad, in walk order) replaced by
    the outputs of the recv function of message ``message_id`` from ``sender``."""
    outputs, node = make_recv_outputs(received, ctx.context_id, message_id, sender)
    ctx.add_recv(RecvFunction(message_id, sender, node, len(outputs)))
    if value is received[0]:  # a lone tensor (a call's usual result): no id map, no replace
        return outputs[0]
    return replace_tensors(value, dict(zip(map(id, received), outputs)))


def record_response(ctx: DistAutogradContext, response_id: int, caller: int,
                    value: Any) -> SendFunction | None:
    """The send function of a reply's tensors requiring grad (None if it has none)."""
    tensors = find_grad_tensors(value)
    if not tensors:
        return None
    send = SendFunction.of(response_id, caller, tensors)
    ctx.add_send(send)
    return send


def _then(future: Any, fn: Callable[[Any], Any]) -> torch.futures.Future:
    """``future.then`` keeping exception types (torch's then() turns them into RuntimeError)."""
    result: torch.futures.Future = torch.futures.Future()

    def done(source: torch._C.Future[Any]) -> None:  # (torch hands callbacks its C future)
        try:
            value = fn(source.wait())
        except BaseException as exc:  # noqa: BLE001 - goes to the caller
            result.set_exception(exc)
            return
        result.set_result(value)

    future.add_done_callback(done)
    return result


class ServingInContext:
    """The scope of a call served inside a context (a class, not a generator-based
    context manager: ~2 µs less per call warm).

    On entering: the context exists here and is current, and the received tensors
    requiring grad have their recv function. On leaving without an error: the
    result's tensors requiring grad have their send function. The previous current
    context is restored either way.
    """

    __slots__ = ("_call", "_context_id", "_ctx", "_previous", "_rank", "_store")

    def __init__(self, store: ContextStore, rank: int, call: CallRecord, context_id: int) -> None:
        self._store = store
        self._rank = rank  # this worker's
        self._call = call
        self._context_id = context_id

    def __enter__(self) -> None:
        call = self._call
        ctx = self._ctx = self._store.get_or_create(self._context_id)
        caller = call.peer.id
        if caller != self._rank:
            ctx.add_known_worker(caller)
        current = _current  # (read and set directly: no frame each)
        self._previous = current.context_id
        current.context_id = self._context_id
        try:
            message_id = call.meta.get(KEY_MESSAGE)
            if message_id is not None:
                received = find_grad_tensors(call.args, call.kwargs)
                if received and call.kwargs:
                    call.args, call.kwargs = attach_recv(
                        ctx, message_id, caller, (call.args, call.kwargs), received
                    )
                elif received:  # (no pair to build and take apart)
                    call.args = attach_recv(ctx, message_id, caller, call.args, received)
        except BaseException:
            _current.context_id = self._previous
            raise

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        try:
            if exc_type is None:
                self._record_result()
        finally:
            _current.context_id = self._previous

    def _record_result(self) -> None:
        call = self._call
        response_id = call.meta.get(KEY_RESPONSE)
        if response_id is None:
            return
        ctx, caller = self._ctx, call.peer.id
        if isinstance(call.result, torch._C.Future):  # async_execution

            def record(value: Any) -> Any:
                record_response(ctx, response_id, caller, value)
                return value

            call.result = _then(call.result, record)
            return
        send = record_response(ctx, response_id, caller, call.result)
        if send is not None and PREPARE_AFTER_REPLY:
            # the pass the gradients coming back start is worked out while the caller
            # computes (after the reply left): not while it waits for that pass's reply
            call.after_reply = send.prepare
