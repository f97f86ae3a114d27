"""RRef proxies (``rref.rpc_sync().method(...)``) and per-caller FIFO actor calls.

Calls through a proxy from one caller to one owner value run on the owner in
the order the caller made them (per-caller FIFO): each carries a sequence
number per (caller, RRef), and the owner holds back a call until its
predecessor has started and finished. A value whose class sets
``__actorrpc_concurrent__ = True`` opts out and runs calls concurrently.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..agent import current_agent
from ._rref import RRef

__all__ = ["RRefProxy", "fetch_type", "invoke_method", "rref_backward"]

_sequence_lock = threading.Lock()
_next_sequence: dict[tuple[Any, ...], itertools.count[int]] = {}


def _take_sequence(rref: RRef[Any]) -> int:
    key = (id(rref._agent), rref._rref_id)
    with _sequence_lock:
        counter = _next_sequence.get(key)
        if counter is None:
            counter = _next_sequence[key] = itertools.count()
    return next(counter)


class _ActorQueue:
    """Runs one caller's calls on one value in sequence order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = 0
        self.waiting: dict[int, Callable[[], None]] = {}


_queues: dict[tuple[Any, ...], _ActorQueue] = {}
_queues_lock = threading.Lock()


def invoke_method(rref: RRef[Any], name: str, args: Any, kwargs: Any, caller_seq: Any) -> Any:
    """Run ``getattr(rref.local_value(), name)(*args, **kwargs)`` on the owner, in caller order."""
    value = rref.local_value()
    method = getattr(value, name)
    if caller_seq is None or getattr(value, "__actorrpc_concurrent__", False):
        return _call(method, args, kwargs)
    caller, seq = caller_seq
    key = (caller, rref._rref_id)
    with _queues_lock:
        queue = _queues.setdefault(key, _ActorQueue())
    result: torch.futures.Future[Any] = torch.futures.Future()

    def run() -> None:
        try:
            outcome = _call(method, args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            result.set_exception(exc)
        else:
            if isinstance(outcome, torch._C.Future):
                outcome.add_done_callback(lambda f: _forward(f, result))
            else:
                result.set_result(outcome)

    with queue.lock:
        if seq != queue.next:
            queue.waiting[seq] = run
            return result
    _drain(queue, run)
    return result


def _forward(source: torch.futures.Future[Any], target: torch.futures.Future[Any]) -> None:
    try:
        target.set_result(source.wait())
    except BaseException as exc:  # noqa: BLE001
        target.set_exception(exc)


def _drain(queue: _ActorQueue, task: Callable[[], None] | None) -> None:
    """Run ``task`` and then every successor already waiting, in sequence order."""
    while task is not None:
        task()
        with queue.lock:
            queue.next += 1
            task = queue.waiting.pop(queue.next, None)


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
            payload = (rref, name, args, kwargs, (agent.rank, _take_sequence(rref)))
            if mode == "remote":
                return remote(rref.owner(), invoke_method, payload, timeout=timeout)
            dest = rref.owner()
            future = agent.call(dest, invoke_method, payload, {}, timeout)
            return future.wait() if mode == "sync" else future

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
            cached = current_agent().call(rref.owner(), _type_of, (rref,), {}, timeout).wait()
        rref._type_cache = cached  # type: ignore[attr-defined]
    return cached  # type: ignore[no-any-return]


def _backward_on_owner(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    from ..autograd import backward

    backward(context_id, [rref.local_value()], retain_graph=retain_graph)


def rref_backward(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    """``rref.backward(ctx_id)``: distributed backward from the owner's value."""
    agent = current_agent()
    agent.call(rref.owner(), _backward_on_owner, (rref, context_id, retain_graph), {}).wait()
