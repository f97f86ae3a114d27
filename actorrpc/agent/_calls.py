"""Types shared by the agent and the layers that plug into it, and running user functions."""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import FunctionType
from typing import Any, Generic, Protocol, TypeVar

import torch

from ..errors import RpcTimeoutError
from ..protocol import MessageKind
from ..serialization import PickleTarget, dumps_for
from ._call_result import CallResult
from ._futures import Completion
from ._worker_info import WorkerInfo

__all__ = [
    "CallHook",
    "CallRecord",
    "EncodedReply",
    "Failure",
    "FlowCredits",
    "Handler",
    "HandlerEntry",
    "IncomingRequest",
    "PeerCredits",
    "PendingCall",
    "RecentEntries",
    "compose_reply_transforms",
    "encode_reply",
    "outcome_of",
    "run_user_function",
]


class IncomingRequest:
    """A decoded request handed to a registered handler.

    ``after_reply``: set by a handler to work the request needs done but its reply need
    not wait for (bookkeeping); the thread that served the request runs it once the
    reply is handed to the link (or queued to ride), before the request counts as
    served, and an error it raises is logged. A handler whose outcome is a future has it
    run at once. (Notifications riding on another message go to inline handlers, which
    do not set it.)

    ``optional_after_reply``: work a call's serving hooks left (``CallRecord.after_reply``):
    run after ``after_reply`` when the reply was handed to the link; dropped when the
    reply waits to ride on a later message (nothing may hold it back), when it failed,
    and for a handler whose outcome is a future.
    """

    # (an explicit __init__, not @dataclass's: a compiled build compiles it; it runs per message)
    def __init__(
        self, kind: MessageKind, sender: WorkerInfo, message_id: int, payload: Any,
        after_reply: Callable[[], None] | None = None,
        optional_after_reply: Callable[[], None] | None = None,
    ) -> None:
        self.kind = kind
        self.sender = sender
        self.message_id = message_id
        self.payload = payload
        self.after_reply = after_reply
        self.optional_after_reply = optional_after_reply


Handler = Callable[[IncomingRequest], Any]


class EncodedReply:
    """A handler's reply pickled by the handler itself (:func:`encode_reply`): the
    dispatcher sends it as it is. A handler that must answer *something* even when
    its value cannot be pickled encodes it first and falls back on failure."""

    __slots__ = ("body", "buffers", "target")

    def __init__(self, body: bytes, buffers: list[Any], target: PickleTarget | None) -> None:
        self.body = body
        self.buffers = buffers
        # what pickling registered (RRef forks; None: nothing), undone if unsent
        self.target = target


def encode_reply(receiver_rank: int, value: Any) -> EncodedReply:
    """Pickle ``value`` as the reply to worker ``receiver_rank``; raises what pickling
    raises, after undoing what it registered."""
    return EncodedReply(*dumps_for(receiver_rank, value, "result"))


class CallRecord:
    """One call as call hooks see it: on the caller before sending, on the callee while serving.

    ``after_reply``: set by a hook's ``serving`` scope on the callee (one hook: a second
    would have to chain) for work that may as well be done later and that the reply
    need not wait for. A plain call (CALL, served on the pool) runs it as
    :attr:`IncomingRequest.optional_after_reply`; elsewhere (a ``remote()`` creation, an
    RRef fetch, which may be served inline on a receiving thread) it is dropped, so it
    must be work that is also done when needed.
    """

    # (an explicit __init__, not @dataclass's: a compiled build compiles it; it runs per message)
    def __init__(
        self, peer: WorkerInfo, meta: dict[str, Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.peer = peer
        self.meta = meta
        self.args = args
        self.kwargs = kwargs
        self.result: Any = None
        self.after_reply: Callable[[], None] | None = None


class CallHook(Protocol):
    """Plug-in point for layers that travel with calls (e.g. distributed autograd).

    ``before_send`` runs on the caller; it may edit ``call.args``, ``call.kwargs``
    and ``call.meta`` and may return a function applied to the reply's value.
    ``serving`` returns a context manager entered on the callee around the
    function (it may edit ``call.args``/``call.kwargs`` on entry and
    ``call.result`` on exit), or None when the hook has nothing to do for this call.
    A hook whose ``serving`` returns None for every call without meta may say so with
    a true ``serves_only_with_meta`` attribute: then such calls skip the hooks.
    """

    def before_send(self, call: CallRecord) -> Callable[[Any], Any] | None: ...

    def serving(self, call: CallRecord) -> AbstractContextManager[Any] | None: ...


@dataclass
class HandlerEntry:
    handler: Handler
    inline: bool
    # a notification of this kind riding on a request served on a thread is handled
    # after that request (see ``MessageDispatcher._on_message``)
    after_carrier: bool = False


class PendingCall:
    """A request sent and not yet answered (one per message id)."""

    __slots__ = (
        "credits", "description", "dest", "future", "kind", "on_result", "on_undecodable",
        "timeout", "undo",
    )

    def __init__(
        self,
        future: Completion | CallResult[Any],
        dest: WorkerInfo,
        description: str,
        timeout: float,
        on_result: Callable[[Any], Any] | None = None,
        credits: FlowCredits | None = None,
        kind: MessageKind = MessageKind.CALL,
        undo: PickleTarget | None = None,
    ) -> None:
        self.kind = kind
        # what pickling the request registered (RRef forks): undone, but for what the
        # receiver took over, if it answers that it could not unpickle the request
        self.undo = undo
        self.future = future
        self.dest = dest
        self.description = description
        self.timeout = timeout
        self.on_result = on_result
        # a RESPONSE that cannot be unpickled: its error through this completes the future
        # normally (None: the future fails with it)
        self.on_undecodable: Callable[[BaseException], Any] | None = None
        self.credits = credits  # the flow-control credits to give one back to when it ends


class FlowCredits:
    """At most ``limit`` calls in flight to one peer; a caller beyond it waits.

    The common case (a slot is free) costs one lock round trip; a
    :class:`threading.Condition` is only waited on at the limit.
    """

    __slots__ = ("_available", "_lock", "_waiters", "_waiting", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._available = limit
        self._waiting = 0
        self._lock = threading.Lock()
        self._waiters = threading.Condition(self._lock)

    def take(self, timeout: float | None) -> bool:
        """Take a credit, waiting up to ``timeout`` seconds (None: forever); False on timeout."""
        with self._lock:
            if self._available > 0:
                self._available -= 1
                return True
            deadline = None if timeout is None else time.monotonic() + timeout
            self._waiting += 1
            try:
                while self._available <= 0:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._waiters.wait(remaining)
            finally:
                self._waiting -= 1
            self._available -= 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._available += 1
            if self._waiting:
                self._waiters.notify()

    @property
    def in_flight(self) -> int:
        return self.limit - self._available


class PeerCredits:
    """Flow control: at most ``limit`` user calls in flight to each peer.

    A caller beyond the limit waits (up to its timeout) for a reply to free a slot.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_rank: dict[int, FlowCredits] = {}

    def take(self, dest: WorkerInfo, timeout: float) -> FlowCredits:
        """A credit for a call to ``dest`` (given back when it is answered), or
        :class:`RpcTimeoutError` after ``timeout`` seconds (``<= 0``: waits for ever)."""
        credits = self._by_rank.get(dest.id)
        if credits is None:
            credits = self._by_rank.setdefault(dest.id, FlowCredits(self.limit))
        if not credits.take(timeout if timeout > 0 else None):
            raise RpcTimeoutError(
                f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) waiting to send: "
                f"{self.limit} calls to {dest!r} are in flight"
            )
        return credits

    def forget(self, rank: int) -> None:
        self._by_rank.pop(rank, None)


def compose_reply_transforms(
    transforms: list[Callable[[Any], Any]],
) -> Callable[[Any], Any] | None:
    """One transform of a reply from the hooks' (applied last hook first), or None."""
    if not transforms:
        return None
    if len(transforms) == 1:
        return transforms[0]

    last_first = transforms[::-1]  # (mypyc cannot compile reversed() over this closure's list)

    def transform_all(value: Any) -> Any:
        for transform in last_first:
            value = transform(value)
        return value

    return transform_all


_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


class RecentEntries(Generic[_Key, _Value]):
    """The last ``limit`` entries remembered (older ones are forgotten); any thread."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._entries: OrderedDict[_Key, _Value] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: _Key, value: _Value) -> None:
        with self._lock:
            self._entries[key] = value
            if len(self._entries) > self._limit:
                self._entries.popitem(last=False)

    def take(self, key: _Key) -> _Value | None:
        """Forget ``key``; return what it held (None if it was never or no longer kept)."""
        with self._lock:
            return self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


class Failure:
    """A request's failure; ``undecoded``: the request itself could not be unpickled, and
    these are the keys of the side effects (RRef forks) taken over before it failed."""

    __slots__ = ("error", "undecoded")

    def __init__(
        self, error: BaseException, undecoded: tuple[Hashable, ...] | None = None
    ) -> None:
        self.error = error
        self.undecoded = undecoded


def outcome_of(future: Any) -> Any:
    """The value of a completed future, or a :class:`Failure` holding a copy of its error.

    Re-raising the stored error attaches this frame, and through ``f_back`` its
    callers' frames (which may hold the future), to the error's traceback: a cycle
    through the C++ future that gc cannot break, keeping the request (and every
    object it refers to, such as an actor) alive. So the traceback of the stored
    error is dropped once it was raised here, and a copy is returned.
    """
    try:
        return future.wait()
    except BaseException as exc:  # noqa: BLE001
        error = copy_error(exc)
        exc.__traceback__ = None
        del future, exc
        return Failure(error)


def copy_error(error: BaseException) -> BaseException:
    """A copy of ``error`` without a traceback (the original if it cannot be copied)."""
    try:
        fresh = copy.copy(error)
    except Exception:  # noqa: BLE001
        return error.with_traceback(None)
    fresh.__cause__ = error.__cause__
    return fresh.with_traceback(None)


def run_user_function(func: Any, args: Any, kwargs: Any) -> Any:
    """Call a user function; an ``async_execution`` one must return a Future."""
    if not callable(func):
        raise TypeError(f"{func!r} is not callable")
    result = func(*(args or ()), **(kwargs or {}))
    # (a plain function with an empty ``__dict__`` carries neither mark: two failed
    # lookups less per call)
    if (type(func) is not FunctionType or func.__dict__) and (
        getattr(func, "_wrapped_async_rpc_function", None) is not None
        or getattr(func, "_actorrpc_async_execution", False)
    ):
        if not isinstance(result, torch._C.Future):
            raise TypeError(
                f"async_execution function {getattr(func, '__qualname__', func)!r} must return "
                f"a torch.futures.Future, got {type(result).__name__}"
            )
        return result
    if isinstance(result, torch._C.Future):
        raise TypeError(
            f"{getattr(func, '__qualname__', func)!r} returned a Future; decorate it with "
            "@rpc.functions.async_execution to reply with the Future's value"
        )
    return result
