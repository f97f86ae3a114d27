"""Per-worker bookkeeping of the Remote Reference Protocol.

Tables (one :class:`RRefContext` per agent):

* ``owners[rref_id]``: the :class:`OwnerState` (the value) of every owner RRef
  that has been forked at least once.
* ``forks[rref_id]``: the fork ids the owner knows of; this set is the
  reference count. When it becomes empty the owner entry is erased.
* ``pending_users[fork_id]``: user RRefs not yet confirmed by their owner,
  held strongly, so they cannot send a delete before the owner knows them.
* ``pending_children[fork_id]``: the parent RRef of every fork sent out and not
  yet accepted, held strongly (guarantee G2: a parent outlives the unconfirmed
  child).
* ``confirmed_users[fork_id]``: weak references to live confirmed users.

Ordering invariants:

* A user sends RREF_USER_DELETE only after it is confirmed (G1 with G2), so the
  owner never sees a delete before the fork it deletes.
* The parent keeps its own fork until RREF_CHILD_ACCEPT, which the child sends
  only after the owner acknowledged RREF_FORK_REQUEST.
* Every control message is idempotent: adding a known fork, deleting an unknown
  one, or accepting an unknown child changes nothing.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..errors import RRefError

if TYPE_CHECKING:
    from ._rref import RRef

__all__ = ["GloballyUniqueId", "OwnerState", "RRefContext"]

_log = logging.getLogger("actorrpc.rref")


class GloballyUniqueId(NamedTuple):
    """An RRef id or fork id: the worker that made it and a per-worker counter."""

    created_on: int
    local_id: int

    def __repr__(self) -> str:
        return f"GloballyUniqueId(created_on={self.created_on}, local_id={self.local_id})"


class OwnerState:
    """The value held by an owner RRef, or the error that creating it raised."""

    def __init__(self, rref_id: GloballyUniqueId, type_name: str = "") -> None:
        self.rref_id = rref_id
        self.ready: torch.futures.Future[Any] = torch.futures.Future()
        self._event = threading.Event()
        self.type_name = type_name

    def set_value(self, value: Any) -> None:
        if not self._event.is_set():
            self.type_name = type(value).__qualname__
            self.ready.set_result(value)
            self._event.set()

    def set_error(self, error: BaseException) -> None:
        if not self._event.is_set():
            self.ready.set_exception(error)
            self._event.set()

    def wait(self, timeout: float) -> Any:
        if not self._event.wait(timeout if timeout > 0 else None):
            from ..errors import RpcTimeoutError

            raise RpcTimeoutError(
                f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) waiting for "
                f"the value of RRef {self.rref_id!r} to be created"
            )
        return self.ready.wait()

    def is_ready(self) -> bool:
        return self._event.is_set()


class RRefContext:
    """The RRef tables of one worker (see the module docstring)."""

    def __init__(self, rank: int, send_control: Callable[[int, Any, Any], Any]) -> None:
        self.rank = rank
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._send_control = send_control
        self.owners: dict[GloballyUniqueId, OwnerState] = {}
        self.forks: dict[GloballyUniqueId, set[GloballyUniqueId]] = {}
        self.pending_users: dict[GloballyUniqueId, RRef[Any]] = {}
        self.pending_children: dict[GloballyUniqueId, RRef[Any]] = {}
        self.confirmed_users: dict[GloballyUniqueId, weakref.ref[RRef[Any]]] = {}
        self.deleted_forks: set[GloballyUniqueId] = set()
        self.local_states: weakref.WeakValueDictionary[GloballyUniqueId, OwnerState] = (
            weakref.WeakValueDictionary()
        )
        self.closed = False

    def new_id(self) -> GloballyUniqueId:
        return GloballyUniqueId(self.rank, next(self._ids))

    # -- owner side -------------------------------------------------------------------

    def get_or_create_owner(self, rref_id: GloballyUniqueId) -> OwnerState:
        with self._lock:
            state = self.owners.get(rref_id)
            if state is None:
                state = self.local_states.get(rref_id) or OwnerState(rref_id)
                self.owners[rref_id] = state
                self.local_states[rref_id] = state
            return state

    def release_if_unforked(self, rref_id: GloballyUniqueId) -> None:
        """Drop the table's hold on an owner nobody forked (the RRef objects keep the value)."""
        with self._lock:
            if not self.forks.get(rref_id):
                self.forks.pop(rref_id, None)
                self.owners.pop(rref_id, None)

    def find_owner(self, rref_id: GloballyUniqueId) -> OwnerState:
        with self._lock:
            state = self.owners.get(rref_id)
        if state is None:
            raise RRefError(
                f"worker {self.rank} owns no RRef {rref_id!r} (it was deleted, or never existed)"
            )
        return state

    def add_fork(self, state: OwnerState, fork_id: GloballyUniqueId) -> None:
        """Register a fork of an owner RRef (early registration when the owner forks)."""
        with self._lock:
            self.owners.setdefault(state.rref_id, state)
            forks = self.forks.setdefault(state.rref_id, set())
            if fork_id not in self.deleted_forks:
                forks.add(fork_id)

    def add_fork_by_id(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            state = self.owners.get(rref_id)
            if state is None:
                raise RRefError(
                    f"fork request for RRef {rref_id!r}, which worker {self.rank} does not own"
                )
            self.add_fork(state, fork_id)

    def delete_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        """Idempotently drop a fork; erase the owner entry when none is left."""
        with self._lock:
            self.deleted_forks.add(fork_id)
            forks = self.forks.get(rref_id)
            if forks is None:
                return
            forks.discard(fork_id)
            if not forks:
                del self.forks[rref_id]
                self.owners.pop(rref_id, None)

    # -- user side ----------------------------------------------------------------------

    def add_pending_user(self, rref: RRef[Any]) -> None:
        with self._lock:
            self.pending_users[rref._fork_id] = rref

    def confirm_user(self, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            rref = self.pending_users.pop(fork_id, None)
            if rref is not None:
                rref._confirmed = True
                self.confirmed_users[fork_id] = weakref.ref(rref)

    def add_confirmed_user(self, rref: RRef[Any]) -> None:
        with self._lock:
            self.confirmed_users[rref._fork_id] = weakref.ref(rref)

    def add_pending_child(self, fork_id: GloballyUniqueId, parent: RRef[Any]) -> None:
        with self._lock:
            self.pending_children[fork_id] = parent

    def accept_child(self, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            self.pending_children.pop(fork_id, None)

    def user_deleted(self, rref: RRef[Any]) -> None:
        """Called when a confirmed user RRef is garbage: tell the owner (G1)."""
        with self._lock:
            self.confirmed_users.pop(rref._fork_id, None)
            if self.closed or rref._deleted:
                return
            rref._deleted = True
        self._send_control(rref._owner.id, rref._rref_id, rref._fork_id)

    def delete_all_users(self) -> int:
        """Send a delete for every live confirmed user (graceful shutdown); return how many."""
        with self._lock:
            users = [ref() for ref in self.confirmed_users.values()]
            self.confirmed_users.clear()
        count = 0
        for rref in users:
            if rref is not None and not rref._deleted:
                rref._deleted = True
                self._send_control(rref._owner.id, rref._rref_id, rref._fork_id)
                count += 1
        return count

    def wait_until(self, condition: Callable[[], bool], deadline: float) -> bool:
        interval = 0.001
        while not condition():
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)
            interval = min(interval * 2, 0.02)
        return True

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
                f"Leaking RRef {rref_id!r} with fork Id {fork_id!r}"
                for rref_id, forks in self.forks.items()
                for fork_id in forks
            ]
