"""The :class:`RRef` handle and ``remote()``.

Sharing cases (A, B, C are workers; B owns the value):

1. ``remote()`` from A: A makes a pending user {rref id, fork id} and sends
   REMOTE_CALL; B registers the fork, runs the function and replies; the reply
   confirms A's user.
2. A user on A sends its RRef to the owner B: A keeps the parent in
   ``pending_children`` under a new fork id; B resolves it to its owner RRef and
   sends RREF_CHILD_ACCEPT to A (a notification from B's I/O thread: nobody waits
   for an answer, and A has none to send).
3. The owner B sends its RRef to C: B registers the fork before sending (early
   registration); C's user is confirmed at once. B sending to itself also
   registers a fork, dropped when the message arrives, so the value survives
   the trip even if every other handle is dropped meanwhile.
4. A user on A sends its RRef to C: A keeps the parent in ``pending_children``;
   C makes a pending user and sends RREF_FORK_REQUEST to B; on B's ack C is
   confirmed and sends RREF_CHILD_ACCEPT to A (a notification, from C's I/O thread).
   C runs the called function only after the ack.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..agent import (
    Agent,
    CallRecord,
    CallResult,
    Future,
    WorkerInfo,
    complete,
    current_agent,
    ignore_while_holding,
)
from ..agent._remote_exception import rebuild_exception
from ..errors import RpcTimeoutError, RRefError, SerializationError
from ..protocol import MessageKind
from ..serialization import current_pickle_target, current_unpickle_source
from ._context import (
    FetchFailure,
    OwnerState,
    RRefContext,
    RRefId,
    copy_exception,
    format_id,
    settle,
    wait_result,
)

__all__ = ["RRef", "rref_context"]

T = TypeVar("T")
_log = logging.getLogger("actorrpc.rref")
# RREF_CHILD_ACCEPT as a request answered by the parent (torch's way) instead of a
# notification: a switch for same-run A/Bs (benchmarks/ab_switch.py)
CHILD_ACCEPT_REPLIED = False


def rref_context(agent: Agent | None = None) -> RRefContext:
    agent = agent or current_agent()
    ctx: RRefContext = agent.extensions["rref"]
    return ctx


class RRef(Generic[T]):
    """A reference to a value owned by one worker of the group.

    ``RRef(value)`` makes a local owner RRef; ``rpc.remote(...)`` returns one
    whose value lives on another worker.

    Example::

        >>> # on worker0
        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rref.to_here()
        tensor([2., 2.])
        >>> rref.owner()
        WorkerInfo(id=1, name=worker1)
    """

    _agent: Agent
    _owner: WorkerInfo
    _rref_id: RRefId
    _fork_id: RRefId | None
    _state: OwnerState | None
    _confirmed: bool
    _deleted: bool
    _creation_error: BaseException | None
    _creation_future: Any  # remote()'s CallResult (None for an RRef made locally)
    _creation_view: Future[Any] | None  # the torch future _get_future() made for it

    def __init__(self, value: T, type_hint: Any = None) -> None:
        agent = current_agent()
        ctx = rref_context(agent)
        state = OwnerState(ctx.new_id())
        state.set_value(value)
        ctx_register(ctx, state)
        self._init_owner(agent, state)

    def _init_owner(self, agent: Agent, state: OwnerState) -> None:
        self._agent = agent
        self._owner = agent.info
        self._rref_id = state.rref_id
        self._fork_id = None
        self._state = state
        self._confirmed = True
        self._deleted = False
        self._creation_error = None
        self._creation_future = None
        self._creation_view = None

    @classmethod
    def _make_owner(cls, agent: Agent, state: OwnerState) -> RRef[Any]:
        rref: RRef[Any] = cls.__new__(cls)
        rref._init_owner(agent, state)
        return rref

    @classmethod
    def _make_user(
        cls, agent: Agent, owner: WorkerInfo, rref_id: RRefId, fork_id: RRefId
    ) -> RRef[Any]:
        rref: RRef[Any] = cls.__new__(cls)
        rref._agent = agent
        rref._owner = owner
        rref._rref_id = rref_id
        rref._fork_id = fork_id
        rref._state = None
        rref._confirmed = False
        rref._deleted = False
        rref._creation_error = None
        rref._creation_future = None
        rref._creation_view = None
        return rref

    # -- queries ------------------------------------------------------------------------------

    def is_owner(self) -> bool:
        """Whether this worker owns the value.

        Example::

            >>> # on worker0
            >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            >>> rref.is_owner(), rpc.RRef(torch.ones(2)).is_owner()
            (False, True)
        """
        return self._state is not None

    def owner(self) -> WorkerInfo:
        """The :class:`WorkerInfo` of the owner.

        Example::

            >>> # on worker0
            >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            >>> rref.owner()
            WorkerInfo(id=1, name=worker1)
        """
        return self._owner

    def owner_name(self) -> str:
        """The name of the owner.

        Example::

            >>> # on worker0
            >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            >>> rref.owner_name()
            'worker1'
        """
        return self._owner.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this handle (always true on the owner).

        A user RRef is confirmed once the owner has acknowledged it (for one
        made by ``remote()``: once the owner has answered that call).

        Example::

            >>> # on worker0
            >>> rpc.RRef(torch.ones(2)).confirmed_by_owner()  # the owner
            True
            >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            >>> rref.confirmed_by_owner()  # False until worker1 has answered remote()
        """
        return self._confirmed

    def _check_usable(self, what: str) -> None:
        if self._deleted:
            raise RRefError(f"{self} was deleted (RPC shut down); cannot call {what}() on it")
        try:
            agent = current_agent()
        except Exception as exc:
            raise RRefError(f"cannot call {what}() on {self}: {exc}") from exc
        if agent is not self._agent:
            raise RRefError(
                f"{self} belongs to an RPC session that has shut down; cannot call {what}() on it"
            )

    def local_value(self) -> T:
        """The value itself; only on the owner (a user raises :class:`RRefError`).

        Example::

            >>> # on worker1
            >>> rref = rpc.RRef(torch.ones(2))
            >>> rref.local_value()
            tensor([1., 1.])
            >>> # on worker0, with a user RRef to it: rref.to_here() (local_value() raises)
        """
        if self._state is None:
            raise RRefError(  # torch's wording (tests match it), plus the way out
                f"For UserRRef(rref_id={format_id(self._rref_id)}, "
                f"fork_id={format_id(self._fork_id)}), can't call "
                f"localValue() on user {self._agent.info!r}. Call it on owner {self._owner!r} "
                "(local_value() is only available on the owner; use to_here() to fetch a copy)"
            )
        return self._state.wait(0)  # type: ignore[no-any-return]

    def to_here(self, timeout: float = -1.0) -> T:
        """Fetch a copy of the value (blocking); on the owner, wait for it and return it.

        Example::

            >>> # on worker0
            >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            >>> rref.to_here()
            tensor([2., 2.])
        """
        self._check_usable("to_here")
        agent = self._agent
        effective = agent.effective_timeout(timeout)
        if self._state is not None:
            return self._state.wait(effective)  # type: ignore[no-any-return]
        if self._creation_error is not None:
            raise copy_exception(self._creation_error)
        creation = self._creation_future
        record: CallRecord | None = None
        on_result: Callable[[Any], Any] | None = None
        # remote()'s request held by this thread: no call hook had anything for it (a
        # request is held only then) and no call since changed what they see (any call
        # would have sent it), so the fetch may go with it without asking them; with
        # another thread's (or none), the hooks are asked first
        if creation is None or not agent.held.held_here(creation):
            record, on_result = agent.prepare_call(self._owner, (), {})
        if creation is not None and (record is None or (not record.meta and on_result is None)):
            fetched = _fetch_with_creation(self, creation, effective)
            if fetched is not _NOT_HELD:
                return fetched  # type: ignore[no-any-return]
        if record is None:  # (still held by this thread, but with another timeout)
            record, on_result = agent.prepare_call(self._owner, (), {})
        if creation is not None:  # (the hook let this call by: remote()'s request goes first)
            agent.held.release(creation)
        future = agent.send_request(  # the owner bounds its wait by the same timeout
            self._owner, MessageKind.RREF_FETCH, (self._rref_id, record.meta, effective),
            timeout, description=f"to_here() of {self}", on_result=on_result,
        )
        if creation is not None and not creation.done():
            _fail_if_creation_fails(future, creation, self)
        value = wait_result(future)
        if isinstance(value, FetchFailure):  # the owner's error, sent as a value
            raise rebuild_exception(value.info)
        return value  # type: ignore[no-any-return]

    def _get_future(self) -> Future[Any]:
        """The future of the ``remote()`` call that created this RRef (a torch future)."""
        creation = self._creation_future
        if isinstance(creation, Future):
            return creation
        if self._creation_view is not None:
            return self._creation_view  # the same future every time, as torch's
        done: Future[Any] = Future("RRef creation", self._agent)
        self._creation_view = done
        if creation is None:
            complete(done, None)
            return done

        def relay(result: Any) -> None:  # the creation's outcome, once it has one
            value, error = settle(result)
            complete(done, value, error)

        creation.add_done_callback(relay)
        return done

    def _get_type(self, timeout: float = -1.0) -> type:
        from ._proxy import fetch_type

        return fetch_type(self, timeout)

    # -- proxies ------------------------------------------------------------------------------

    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``method`` on the owner's value and waits.

        Example::

            >>> # on worker0
            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.rpc_sync().add(1)  # runs on worker1
            tensor([2., 2.])
        """
        from ._proxy import RRefProxy

        return RRefProxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_async().method(*args)`` returns a Future of the method's result.

        Example::

            >>> # on worker0
            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.rpc_async().add(1).wait()  # runs on worker1
            tensor([2., 2.])
        """
        from ._proxy import RRefProxy

        return RRefProxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """``rref.remote().method(*args)`` returns an RRef to the method's result.

        Example::

            >>> # on worker0
            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.remote().add(1).to_here()  # the result stays on worker1 until fetched
            tensor([2., 2.])
        """
        from ._proxy import RRefProxy

        return RRefProxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the value of this RRef (a scalar tensor).

        A user RRef needs ``dist_autograd_ctx_id``; on the owner ``-1`` runs a
        local ``backward()``.

        Example::

            >>> # on worker0
            >>> with dist_autograd.context() as context_id:
            ...     t = torch.ones(2, requires_grad=True)
            ...     rref = rpc.remote("worker1", torch.sum, args=(t * 2,))
            ...     rref.backward(context_id)
            ...     print(dist_autograd.get_gradients(context_id)[t])
            tensor([2., 2.])
        """
        if dist_autograd_ctx_id == -1:
            if self._state is None:
                raise RRefError("User RRefs require 'dist_autograd_ctx_id' to be specified")
            self.local_value().backward(retain_graph=retain_graph)  # type: ignore[attr-defined]
            return
        from ._proxy import rref_backward

        rref_backward(self, dist_autograd_ctx_id, retain_graph)

    # -- strings, pickling, deletion ----------------------------------------------------------

    def __str__(self) -> str:
        if self._state is not None:
            return f"OwnerRRef({format_id(self._rref_id)})"
        return f"UserRRef(RRefId = {format_id(self._rref_id)}, ForkId = {format_id(self._fork_id)})"

    def __repr__(self) -> str:
        return f"<{self} owned by {self._owner!r}>"

    def __reduce__(self) -> Any:
        return _reduce_rref(self)

    @property
    def _owner_rank(self) -> int:
        return self._owner.id

    def __del__(self) -> None:
        # G1: a confirmed user tells its owner it is gone (unconfirmed users are held
        # by the context's pending tables and cannot reach here).
        try:
            if self._state is None and self._confirmed and not self._deleted:
                ctx: RRefContext | None = self._agent.extensions.get("rref")
                if ctx is not None and not ctx.closed:
                    ctx.user_deleted(self)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


# ``rref = rpc.remote(...)`` in a loop drops the previous RRef between remote() and
# to_here(): its delete only queues a notification (riding on a later request, in a batch)
ignore_while_holding(RRef.__del__.__code__)

_NOT_HELD = object()


def _fetch_with_creation(rref: RRef[Any], creation: Future[Any], timeout: float) -> Any:
    """The value, when ``remote()``'s request is still held (agent/_held.py): it goes
    now as REMOTE_CALL_FETCH, whose answer carries the value; else ``_NOT_HELD``.

    Only for a to_here() with the timeout ``remote()`` had (the merged request has
    one deadline); no call hook is involved (a held request never has one).
    """
    fetched: list[Any] = []

    def keep_value(value: Any) -> None:  # the creation future itself completes with None
        fetched.append(value)

    def keep_error(error: BaseException) -> None:  # created, but not unpicklable here
        fetched.append(_Undecodable(error))

    held = rref._agent.held
    if not held.send_as(creation, MessageKind.REMOTE_CALL_FETCH, keep_value, keep_error, timeout):
        return _NOT_HELD
    _, error = settle(creation)
    if error is not None:  # (remote()'s callback may not have run yet: the gate opens first)
        raise copy_exception(_creation_failure(rref, error))
    value = fetched[0]
    if isinstance(value, FetchFailure):  # the value exists but could not be sent
        raise rebuild_exception(value.info)
    if isinstance(value, _Undecodable):
        raise copy_exception(value.error)
    return value


class _Undecodable:
    """A merged fetch's value that this worker could not unpickle (the RRef is fine)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _fail_if_creation_fails(
    fetch: Future[Any], creation: CallResult[Any], rref: RRef[Any]
) -> None:
    """Fail ``fetch`` at once if the RRef's ``remote()`` fails first (e.g. times out).

    The fetch's reply, if it still comes, finds the future completed and is dropped
    (:func:`complete` completes once).
    """

    def created(result: Any) -> None:
        _, error = settle(result)
        if error is not None:  # (remote()'s own callback may run later, on another thread)
            complete(fetch, error=copy_exception(_creation_failure(rref, error)))

    creation.add_done_callback(created)


def ctx_register(ctx: RRefContext, state: OwnerState) -> None:
    ctx.register_local(state)


def _reduce_rref(rref: RRef[Any]) -> Any:
    """Pickle an RRef travelling in an RPC message: fork it (see the module docstring)."""
    target = current_pickle_target()
    if target is None:
        raise SerializationError(
            f"Can not pickle rref in python pickler: {rref} can only travel as an argument or "
            "result of an RPC (rpc_sync, rpc_async, remote)"
        )
    rref._check_usable("share")
    ctx = rref_context(rref._agent)
    fork_id, parent = ctx.fork_for(rref, target.worker_id)
    # the message may never leave (pickling fails further on, or the send does), or
    # its receiver may fail to unpickle it before it rebuilt this RRef (_rebuild_rref)
    target.add_undo(fork_id, functools.partial(ctx.undo_fork, rref._rref_id, fork_id, parent))
    return _rebuild_rref, (rref._owner, rref._rref_id, fork_id, parent)


def _rebuild_rref(
    owner: WorkerInfo,
    rref_id: RRefId,
    fork_id: RRefId | None,
    parent: int | None,
) -> RRef[Any]:
    """Unpickle an RRef: the receiving side of the four sharing cases."""
    agent = current_agent()
    ctx = rref_context(agent)
    source = current_unpickle_source()
    if source is not None and fork_id is not None:
        source.taken_over.append(fork_id)  # the fork is this side's now, even if the rest fails
    if owner.id == agent.rank:
        return RRef._make_owner(agent, ctx.receive_at_owner(rref_id, fork_id, parent))
    assert fork_id is not None
    rref = RRef._make_user(agent, owner, rref_id, fork_id)
    if not ctx.receive_user(rref, parent):
        return rref
    assert parent is not None
    request = agent.send_request(
        owner, MessageKind.RREF_FORK_REQUEST, (rref_id, fork_id), description="RRef fork request"
    )

    def acknowledged(done: Any) -> None:
        _, error = settle(done)
        if error is not None:  # the owner refused or is gone; still release the parent
            _log.warning("fork request for %s failed: %s", format_id(rref_id), error)
        ctx.fork_acknowledged(fork_id, parent)

    confirmed = request.then(acknowledged)
    if source is not None:
        source.pending.append(confirmed)  # the callee runs only once every RRef is confirmed
    return rref


def send_child_accept(agent: Agent, parent: int, fork_id: RRefId) -> None:
    """Send RREF_CHILD_ACCEPT(fork_id) to ``parent`` (best effort; if ``CHILD_ACCEPT_REPLIED``
    is false, as a notification: nobody waits for its answer)."""
    try:
        if not CHILD_ACCEPT_REPLIED:
            agent.send_notification(parent, MessageKind.RREF_CHILD_ACCEPT, (fork_id,))
            return
        agent.send_request(
            agent.resolve(parent), MessageKind.RREF_CHILD_ACCEPT, (fork_id,),
            description="RRef child accept",
        )
    except Exception as exc:  # noqa: BLE001 - best effort while shutting down
        _log.warning("cannot send child accept for %s: %s", fork_id, exc)


def _creation_failure(rref: RRef[Any], error: BaseException) -> BaseException:
    """What a failed creation means for ``rref``: what remote()'s callback recorded, or
    (when a waiter wakes before that callback ran) the same, made from ``error``."""
    return rref._creation_error or creation_timeout_error(error, rref)


def creation_timeout_error(error: BaseException, rref: RRef[Any]) -> BaseException:
    if isinstance(error, RpcTimeoutError):
        return RpcTimeoutError(f"RRef creation via rpc.remote() timed out: {rref}: {error}")
    return error
