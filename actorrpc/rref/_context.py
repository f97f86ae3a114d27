"""Per-worker bookkeeping and state machine of the Remote Reference Protocol.

:class:`RRefContext` holds the tables of one worker and implements every
protocol transition as a method. It never touches sockets: control messages it
wants sent go through the ``send_control(dest_rank, kind, payload)`` callable it
was built with (the agent plug-in in ``_remote.py`` turns them into
RREF_USER_DELETE / RREF_CHILD_ACCEPT notifications; the unit tests into an in-memory
list). The only request with a reply, RREF_FORK_REQUEST, is sent by the caller
of :meth:`RRefContext.receive_user` when it returns ``True``; its ack is fed back
through :meth:`RRefContext.fork_acknowledged`.

Tables (one :class:`RRefContext` per agent):

* ``owners[rref_id]``: the :class:`OwnerState` (the value) of every owner RRef
  that has been forked at least once, or that a request named before its
  creation arrived ("pending owner"). Held strongly.
* ``forks[rref_id]``: the fork ids the owner knows of; this set is the
  reference count. When it becomes empty the owner entry is erased, and the
  value is freed unless local code still references it.
* ``pending_users[fork_id]``: user RRefs not yet confirmed by their owner,
  held strongly, so they cannot send a delete before the owner knows them.
* ``pending_children[fork_id]``: the parent RRef of every fork sent out and not
  yet accepted, held strongly (guarantee G2: a parent outlives the unconfirmed
  child).
* ``confirmed_users[fork_id]``: weak references to live confirmed users (the
  deletes to send at graceful shutdown).
* ``local_states[rref_id]``: weak references to every live :class:`OwnerState`
  of this worker, forked or not.
* tombstones: the most recent deleted fork ids (bounded, see
  :attr:`RRefContext.TOMBSTONE_LIMIT`).
* ``call_sequences[rref_id]``: the caller side of per-caller FIFO actor calls
  (``_proxy.py``): one small counter per RRef this worker ever called through
  a proxy, kept for the RPC session (the owner side lives on the
  :class:`OwnerState` and goes with the value).

Invariants:

* G1: every confirmed user RRef sends exactly one RREF_USER_DELETE to its
  owner, when it is garbage or at graceful shutdown, never before it is
  confirmed; so the owner's fork set only shrinks through deletes it was sent.
* G2: the parent of a fork stays in ``pending_children`` until RREF_CHILD_ACCEPT,
  which the child sends only after the owner acknowledged RREF_FORK_REQUEST (or,
  for a fork sent to the owner itself, once it arrived there).
* Every control message is idempotent: adding a known fork, deleting an unknown
  one, accepting an unknown child or acknowledging a confirmed user changes
  nothing. A fork add (RREF_FORK_REQUEST or a REMOTE_CALL) arriving after the
  delete of the same fork id finds its tombstone and neither registers the fork
  nor creates an owner entry.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ..agent import format_traceback, wait_until
from ..errors import ActorRpcError, RpcTimeoutError, RRefError

__all__ = [
    "CHILD_ACCEPT",
    "USER_DELETE",
    "FetchFailure",
    "GloballyUniqueId",
    "OwnerState",
    "RRefContext",
    "RRefId",
    "copy_exception",
    "detached_exception",
    "format_id",
    "settle",
    "wait_result",
]

_log = logging.getLogger("actorrpc.rref")

USER_DELETE = "user_delete"
"""Control kind: payload ``(rref_id, fork_id)``, sent to the owner."""
CHILD_ACCEPT = "child_accept"
"""Control kind: payload ``(fork_id,)``, sent to the parent of a fork."""


RRefId = tuple[int, int]
"""An RRef id or fork id as the tables keep it and messages carry it: ``(created_on,
local_id)``, the worker that made it and a per-worker counter. A plain tuple: pickle writes
it natively, where a named tuple costs a reduce, a class lookup and a Python ``__new__``
each way (four ids travel per ``remote()``; a :class:`GloballyUniqueId` compares and
hashes equal to its plain tuple, so either finds the same table entry)."""


class GloballyUniqueId(NamedTuple):
    """An RRef id or fork id in its named form (how :func:`format_id` shows one)."""

    created_on: int
    local_id: int

    def __repr__(self) -> str:
        return f"GloballyUniqueId(created_on={self.created_on}, local_id={self.local_id})"


def format_id(rref_id: RRefId | None) -> str:
    """An id as torch shows it: ``GloballyUniqueId(created_on=0, local_id=1)``."""
    return "None" if rref_id is None else repr(GloballyUniqueId(*rref_id))


class Handle(Protocol):
    """What the context reads and writes on an RRef handle (see ``_rref.RRef``)."""

    _rref_id: RRefId
    _fork_id: RRefId | None
    _state: OwnerState | None
    _confirmed: bool
    _deleted: bool
    _creation_error: BaseException | None

    @property
    def _owner_rank(self) -> int: ...


SendControl = Callable[[int, str, tuple[Any, ...]], Any]


def copy_exception(error: BaseException, keep_traceback: bool = False) -> BaseException:
    """A fresh exception of the same type and arguments as ``error``.

    Why: a ``torch.futures.Future`` holding an exception is invisible to the
    garbage collector. Raising the stored object again appends the raising
    frames to its traceback, and when one of them references the future (or an
    RRef) that is a reference cycle gc can never free. Raising copies keeps the
    stored exception free of our frames. ``keep_traceback`` starts the copy's
    traceback at ``error``'s (shared, never extended). Falls back to ``error``
    itself when its type cannot be copied.
    """
    try:
        fresh = copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception type copy cannot rebuild
        return error
    if type(fresh) is not type(error):
        return error
    return fresh.with_traceback(error.__traceback__ if keep_traceback else None)


def detached_exception(error: BaseException) -> BaseException:
    """A copy of ``error`` to store in a future: no traceback (so no frames, and
    nothing they reference, are kept alive by it), the original traceback kept
    as text in a note, which the remote error message shows."""
    fresh = copy_exception(error)
    trace = error.__traceback__
    if fresh is not error and trace is not None and hasattr(fresh, "add_note"):
        text = format_traceback(error, frames_only=True).rstrip()
        fresh.add_note(f"Traceback on the owner (most recent call last):\n{text}")
    return fresh


class FetchFailure:
    """The error of a ``to_here()`` sent back as a successful reply value.

    ``info`` is ``pack_exception``'s description (``agent/_remote_exception.py``);
    the caller raises ``rebuild_exception(info)``: the original type, with the
    owner's traceback in the message, exactly like a failed RPC.
    """

    __slots__ = ("info",)

    def __init__(self, info: Any) -> None:
        self.info = info

    def __reduce__(self) -> Any:
        return FetchFailure, (self.info,)


def settle(future: torch.futures.Future[Any]) -> tuple[Any, BaseException | None]:
    """Wait for ``future``: ``(value, None)`` or ``(None, a copy of its error)``.

    The stored exception's traceback is cleared: the frames that just re-raised it
    (``Future.wait`` and this one) hold the future, which holds the exception.
    """
    try:
        return future.wait(), None
    except BaseException as exc:  # noqa: BLE001 - returned to the caller
        exc.__traceback__ = None
        return None, copy_exception(exc)


def wait_result(future: torch.futures.Future[Any]) -> Any:
    """``future.wait()``, raising a copy of its error (see :func:`copy_exception`)."""
    value, error = settle(future)
    del future
    if error is None:
        return value
    try:
        raise error
    finally:
        del error  # this frame must not keep the exception whose traceback holds it


class OwnerState:
    """The value held by an owner RRef, or the error that creating it raised.

    Completion is a flag set under a lock; callbacks waiting for it
    (:meth:`when_ready`) run once it is set, and a thread that must block
    (:meth:`wait` before completion) gets an event made for it then. The common
    path (created, then fetched) makes no future, event or condition: each is a
    torch or threading call costly on a cold cache. Also holds the per-caller
    FIFO queues of actor calls on this value (``actor_queues``, managed by
    ``_proxy.py``), so they live exactly as long as the value can be called.
    """

    def __init__(self, rref_id: RRefId, type_name: str = "") -> None:
        self.rref_id = rref_id
        self._set_lock = threading.Lock()
        self._done = False
        self._callbacks: list[Callable[[], None]] = []  # run once done (see when_ready)
        self._event: threading.Event | None = None  # made for a thread that waits early
        self._value: Any = None
        self._error: BaseException | None = None
        self.type_name = type_name
        self.actor_queues: dict[Any, Any] = {}
        self.actor_lock = threading.Lock()

    def set_value(self, value: Any) -> None:
        """Complete with ``value`` (the first completion wins)."""
        with self._set_lock:
            if self._done:
                return
            self._value = value
            self.type_name = type(value).__qualname__
            waiting = self._mark_done()
        self._wake(*waiting)

    def set_error(self, error: BaseException) -> None:
        """Complete with ``error`` (the first completion wins).

        A detached copy is kept (:func:`detached_exception`): the traceback's
        frames would otherwise live as long as this state.
        """
        with self._set_lock:
            if self._done:
                return
            self._error = detached_exception(error)
            waiting = self._mark_done()
        self._wake(*waiting)

    def _mark_done(self) -> tuple[threading.Event | None, list[Callable[[], None]]]:
        """(Under the lock, after the value or error is set.) Done; who waits for it."""
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        return self._event, callbacks

    def _wake(self, event: threading.Event | None, callbacks: list[Callable[[], None]]) -> None:
        if event is not None:
            event.set()
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - as torch's futures: logged, the others still run
                _log.exception("a callback waiting for the value of RRef %s failed",
                              format_id(self.rref_id))

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once the value or error is set (now, if it is)."""
        with self._set_lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout: float) -> Any:
        """The value (or raise a copy of its error); ``timeout <= 0`` waits forever."""
        if not self._done:
            with self._set_lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout if timeout > 0 else None):
                raise RpcTimeoutError(
                    f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) waiting for "
                    f"the value of RRef {format_id(self.rref_id)} to be created"
                )
        if self._error is not None:
            raise copy_exception(self._error)
        return self._value

    def error(self) -> BaseException | None:
        """The creation error (``None`` while pending or when it succeeded)."""
        return self._error

    def is_ready(self) -> bool:
        return self._done


class RRefContext:
    """The RRef tables of one worker and the protocol transitions on them."""

    TOMBSTONE_LIMIT = 1 << 16
    """Deleted fork ids remembered; a fork add later than this many deletes is not caught."""

    def __init__(self, rank: int, send_control: SendControl) -> None:
        self.rank = rank
        self._ids = itertools.count(0)  # torch numbers RRef and fork ids from 0
        self._lock = threading.RLock()
        self._send_control = send_control
        self.owners: dict[RRefId, OwnerState] = {}
        self.forks: dict[RRefId, set[RRefId]] = {}
        self.pending_users: dict[RRefId, Handle] = {}
        self.pending_children: dict[RRefId, Handle] = {}
        self.confirmed_users: dict[RRefId, weakref.ref[Any]] = {}
        self._tombstones: OrderedDict[RRefId, None] = OrderedDict()
        self.local_states: weakref.WeakValueDictionary[RRefId, OwnerState] = (
            weakref.WeakValueDictionary()
        )
        self.call_sequences: dict[RRefId, Any] = {}  # caller side, see _proxy.py
        # owner side, see _proxy.py: sequence numbers skipped before the value was entered
        self.early_skips: OrderedDict[tuple[RRefId, int], list[int]] = OrderedDict()
        self.closed = False

    def new_id(self) -> RRefId:
        return (self.rank, next(self._ids))

    def _emit(self, dest: int, kind: str, payload: tuple[Any, ...]) -> None:
        """Send a control message; a child accept to this worker is applied at once."""
        if kind == CHILD_ACCEPT and dest == self.rank:
            self.accept_child(payload[0])
            return
        self._send_control(dest, kind, payload)

    # -- owner side: tables -------------------------------------------------------------

    def register_local(self, state: OwnerState) -> None:
        """Make an owner state findable by id while anything holds it (not a fork)."""
        with self._lock:
            self.local_states[state.rref_id] = state

    def get_or_create_owner(self, rref_id: RRefId) -> OwnerState:
        """The owner state of ``rref_id``, entered in ``owners`` (created if unknown)."""
        with self._lock:
            state = self.owners.get(rref_id)
            if state is None:
                state = self.local_states.get(rref_id) or OwnerState(rref_id)
                self.owners[rref_id] = state
                self.local_states[rref_id] = state
            return state

    def release_if_unforked(self, rref_id: RRefId) -> None:
        """Drop the table's hold on an owner nobody forked (the RRef objects keep the value)."""
        with self._lock:
            if not self.forks.get(rref_id):
                self.forks.pop(rref_id, None)
                self.owners.pop(rref_id, None)

    def is_tombstoned(self, fork_id: RRefId) -> bool:
        with self._lock:
            return fork_id in self._tombstones

    def add_fork(self, state: OwnerState, fork_id: RRefId) -> None:
        """Register a fork of an owner RRef, unless it was already deleted (tombstone)."""
        with self._lock:
            if fork_id in self._tombstones:
                return
            rref_id = state.rref_id
            # every entry of ``owners`` is in ``local_states`` (both are set together), so
            # the weak table (a Python-level dict) is written only for a state new here
            if self.owners.get(rref_id) is not state:
                self.owners.setdefault(rref_id, state)
                self.local_states[rref_id] = state
            self.forks.setdefault(rref_id, set()).add(fork_id)

    def delete_fork(self, rref_id: RRefId, fork_id: RRefId) -> None:
        """Idempotently drop a fork; erase the owner entry when none is left."""
        with self._lock:
            self._tombstones[fork_id] = None
            self._tombstones.move_to_end(fork_id)
            while len(self._tombstones) > self.TOMBSTONE_LIMIT:
                self._tombstones.popitem(last=False)
            forks = self.forks.get(rref_id)
            if forks is None:
                return
            forks.discard(fork_id)
            if not forks:
                del self.forks[rref_id]
                self.owners.pop(rref_id, None)

    # -- owner side: protocol transitions -----------------------------------------------

    def on_remote_call(
        self, rref_id: RRefId, fork_id: RRefId | None
    ) -> OwnerState:
        """REMOTE_CALL(rref_id, fork_id) arrived: the state to store the result in.

        ``fork_id`` is ``None`` for ``remote()`` to this worker itself (the
        caller's handle is the owner RRef). If the creator already deleted its
        fork (its ``remote()`` timed out and the handle was dropped), the value
        is still computed but no table entry is made, so it is freed at once.
        """
        with self._lock:
            if fork_id is not None and fork_id in self._tombstones:
                state = self.owners.get(rref_id) or self.local_states.get(rref_id)
                if state is None:
                    state = OwnerState(rref_id)
                    self.local_states[rref_id] = state
                return state
            state = self.get_or_create_owner(rref_id)
            if fork_id is not None:
                self.add_fork(state, fork_id)
            return state

    def on_fork_request(self, rref_id: RRefId, fork_id: RRefId) -> None:
        """RREF_FORK_REQUEST: register the fork (the reply is the ack)."""
        with self._lock:
            if fork_id in self._tombstones:
                return  # a duplicate arriving after the fork's delete
            self.add_fork(self.get_or_create_owner(rref_id), fork_id)

    def on_user_delete(self, rref_id: RRefId, fork_id: RRefId) -> None:
        """RREF_USER_DELETE."""
        self.delete_fork(rref_id, fork_id)

    def on_child_accept(self, fork_id: RRefId) -> None:
        """RREF_CHILD_ACCEPT (on the parent)."""
        self.accept_child(fork_id)

    def receive_at_owner(
        self,
        rref_id: RRefId,
        fork_id: RRefId | None,
        parent: int | None,
    ) -> OwnerState:
        """An RRef this worker owns arrived in a message; return its state.

        * ``parent is None``: the owner sent it to itself; the fork registered
          for the trip kept the value alive in flight and is dropped now.
        * otherwise case 2 (a user sent it back to the owner): accept the child
          so the parent may go (no fork is registered).
        * ``fork_id is None`` is not sent any more; such a handle is just looked up.
        """
        with self._lock:
            state = self.local_states.get(rref_id) or self.get_or_create_owner(rref_id)
        if fork_id is not None:
            if parent is None:
                self.delete_fork(rref_id, fork_id)
            else:
                self._emit(parent, CHILD_ACCEPT, (fork_id,))
        return state

    # -- user side ----------------------------------------------------------------------

    def fork_for(self, handle: Handle, target: int) -> tuple[RRefId, int | None]:
        """A handle is being sent to ``target``: the new fork id and the parent rank.

        The owner registers the fork at once (early registration, case 3, and
        sends to itself); a user keeps the handle as the parent of the new fork
        in ``pending_children`` until the child is accepted (G2, cases 2 and 4).
        """
        if handle._state is not None:
            fork_id = self.new_id()
            self.add_fork(handle._state, fork_id)
            return fork_id, None
        if isinstance(handle._creation_error, ActorRpcError):
            # the REMOTE_CALL itself failed (timed out, peer gone, undecodable): the
            # owner may never have registered this value. (A function that raised is
            # different: its owner keeps the error and the RRef can be shared.)
            raise RRefError(
                f"cannot share {handle}: RRef creation failed: {handle._creation_error}"
            )
        fork_id = self.new_id()
        self.add_pending_child(fork_id, handle)
        return fork_id, self.rank

    def undo_fork(
        self, rref_id: RRefId, fork_id: RRefId, parent: int | None
    ) -> None:
        """The message carrying a fork from :meth:`fork_for` was never sent, or its
        receiver could not unpickle it before it rebuilt the fork: forget it."""
        if parent is None:
            self.delete_fork(rref_id, fork_id)
        else:
            self.accept_child(fork_id)

    def receive_user(self, handle: Handle, parent: int | None) -> bool:
        """A user handle arrived; ``True`` when RREF_FORK_REQUEST must go to the owner.

        ``parent is None`` means the owner itself sent it (case 3): the owner
        registered the fork before sending, so the handle is confirmed now.
        """
        if parent is None:
            handle._confirmed = True
            self.add_confirmed_user(handle)
            return False
        self.add_pending_user(handle)
        return True

    def fork_acknowledged(self, fork_id: RRefId, parent: int) -> None:
        """The owner acked RREF_FORK_REQUEST: confirm the child, release its parent."""
        self.confirm_user(fork_id)
        self._emit(parent, CHILD_ACCEPT, (fork_id,))

    def add_pending_user(self, handle: Handle) -> None:
        assert handle._fork_id is not None
        with self._lock:
            self.pending_users[handle._fork_id] = handle

    def forget_pending_user(self, fork_id: RRefId) -> None:
        """A pending user whose creating message was never sent: drop it silently."""
        with self._lock:
            handle = self.pending_users.pop(fork_id, None)
            if handle is not None:
                handle._deleted = True  # never known to the owner: no delete to send

    def confirm_user(self, fork_id: RRefId) -> None:
        """The owner knows this user (REMOTE_RET or fork ack); idempotent."""
        with self._lock:
            handle = self.pending_users.pop(fork_id, None)
            if handle is not None:
                handle._confirmed = True
                self.confirmed_users[fork_id] = weakref.ref(handle)
        # ``handle`` may be the last reference: its deletion (and G1 delete) happens here,
        # outside the lock.
        del handle

    def add_confirmed_user(self, handle: Handle) -> None:
        assert handle._fork_id is not None
        with self._lock:
            self.confirmed_users[handle._fork_id] = weakref.ref(handle)

    def add_pending_child(self, fork_id: RRefId, parent: Handle) -> None:
        with self._lock:
            self.pending_children[fork_id] = parent

    def accept_child(self, fork_id: RRefId) -> None:
        """Release the parent held for ``fork_id`` (idempotent)."""
        with self._lock:
            parent = self.pending_children.pop(fork_id, None)
        del parent  # may be the last reference: the parent's own delete goes out now

    def user_deleted(self, handle: Handle) -> None:
        """A confirmed user RRef is garbage: tell the owner (G1), once."""
        with self._lock:
            if handle._fork_id is not None:
                self.confirmed_users.pop(handle._fork_id, None)
            if self.closed or handle._deleted or not handle._confirmed:
                return
            handle._deleted = True
        self._send_control(handle._owner_rank, USER_DELETE, (handle._rref_id, handle._fork_id))

    def delete_all_users(self) -> int:
        """Send a delete for every live confirmed user (graceful shutdown); return how many."""
        with self._lock:
            users = [ref() for ref in self.confirmed_users.values()]
            self.confirmed_users.clear()
        count = 0
        for handle in users:
            if handle is not None and not handle._deleted:
                handle._deleted = True
                self._emit(handle._owner_rank, USER_DELETE, (handle._rref_id, handle._fork_id))
                count += 1
        return count

    # -- inspection -----------------------------------------------------------------------

    def wait_until(self, condition: Callable[[], bool], deadline: float) -> bool:
        """Poll ``condition`` with back-off until true (``True``) or ``deadline`` (``False``)."""
        return wait_until(condition, deadline)

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_owner_rrefs": len(self.owners),
                "num_forks": sum(len(f) for f in self.forks.values()),
                "num_pending_users": len(self.pending_users),
                "num_pending_children": len(self.pending_children),
                "num_confirmed_users": sum(1 for r in self.confirmed_users.values() if r()),
            }

    def leaks(self) -> list[str]:
        with self._lock:
            return [
                f"Leaking RRef {format_id(rref_id)} with fork Id {format_id(fork_id)}"
                for rref_id, forks in self.forks.items()
                for fork_id in forks
            ]
