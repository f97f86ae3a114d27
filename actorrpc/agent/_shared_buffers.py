"""The agent's side of same-host shared memory (pool and mapping: ``transport._shared_memory``).

Outgoing: :meth:`SharedBuffers.outgoing` puts each buffer of at least
``shared_memory_threshold`` bytes bound for a peer on this host into a segment
lent from this worker's pool, and marks the message (wire spec: "Shared
memory"). Incoming: :meth:`SharedBuffers.incoming` maps the segments a message
names; when the last tensor on a mapping is freed, the segment's name is
queued and travels back to its owner on the next message sent to it (wire
flag ``FLAG_RELEASES``), or, after :data:`RELEASE_DELAY` seconds without one,
in an ``SHM_RELEASE`` notification sent by the I/O thread.

Invariants:

* A mapping's release is queued by a finalizer, which may run on any thread
  (even inside garbage collection), so it only appends under a lock.
* A queued release is sent exactly once: taken out of the queue for a message,
  and put back if that message could not be sent.
* A segment lent to a peer that left or stopped answering is dropped, never
  reused (its process may still hold tensors on it).
"""

from __future__ import annotations

import functools
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError
from ..protocol import FLAG_RELEASES, FLAG_SHARED_MEMORY, Header, MessageKind
from ..transport import SharedMappings, SharedMemoryPool, shared_memory_available
from ._calls import IncomingRequest
from ._rendezvous import GroupMember

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["RELEASE_DELAY", "SharedBuffers"]

RELEASE_DELAY = 0.01


class SharedBuffers:
    """Lends and maps shared-memory segments for one agent."""

    def __init__(self, agent: Agent, threshold: int) -> None:
        self._agent = agent
        self._threshold = threshold if shared_memory_available() else 0
        self._host = agent.endpoint.rsplit(":", 1)[0]
        self.pool = SharedMemoryPool()
        self.mappings = SharedMappings()
        self._releases: dict[int, list[str]] = {}  # owner rank -> names to hand back
        self._queued_at: dict[int, float] = {}  # owner rank -> when its first one was queued
        # re-entrant: a finalizer may run (garbage collection) while this thread holds it
        self._freed_lock = threading.RLock()
        self.closed = False
        agent.register_handler(MessageKind.SHM_RELEASE, self._handle_release, inline=True)

    def outgoing(
        self, member: GroupMember, body: bytes, buffers: list[Any]
    ) -> tuple[list[Any], int, list[str]]:
        """The frames after the header, the header flags, and the segments lent."""
        frames: list[Any] = [body, *buffers]
        threshold = self._threshold
        if not threshold or not buffers or member.endpoint.rsplit(":", 1)[0] != self._host:
            return frames, 0, []
        indexes = [i for i, b in enumerate(buffers) if b.nbytes >= threshold]
        if not indexes:
            return frames, 0, []
        lent: list[str] = []
        try:
            for i in indexes:
                frames[1 + i], name = self.pool.export(buffers[i], member.rank)
                lent.append(name)
        except OSError as exc:  # /dev/shm full or closed: the socket still works
            self.pool.release(lent, member.rank)
            self._agent.warn(f"shared memory unavailable, sending through the socket: {exc}")
            return [body, *buffers], 0, []
        frames.append(struct.pack(f"!{len(indexes)}H", *indexes))
        return frames, FLAG_SHARED_MEMORY, lent

    def take_back(self, lent: list[str], rank: int) -> None:
        """The message that carried ``lent`` was never sent."""
        self.pool.release(lent, rank)

    def incoming(self, header: Header, frames: list[Any]) -> list[Any]:
        """The payload and buffers of a message, mapping shared-memory ones."""
        if not header.nbuffers and len(frames) == 1:  # the common case: a payload alone
            return [frames[0].buffer]
        if header.flags & FLAG_RELEASES:
            if len(frames) < 2:
                raise ProtocolError("a message flagged with releases carries no release frame")
            self._released(header.sender, frames[-1].bytes)
            frames = frames[:-1]
        shared = header.flags & FLAG_SHARED_MEMORY
        if len(frames) != 1 + header.nbuffers + (1 if shared else 0):
            carried = len(frames) - 1 - (1 if shared else 0)
            raise ProtocolError(
                f"message declares {header.nbuffers} buffers but carries {carried}"
            )
        parts = [f.buffer for f in frames[: 1 + header.nbuffers]]
        if shared:
            table = frames[-1].bytes
            if not table or len(table) % 2:
                raise ProtocolError("malformed shared-memory index frame")
            owner = header.sender
            for index in struct.unpack(f"!{len(table) // 2}H", table):
                if index >= header.nbuffers:
                    raise ProtocolError(f"shared-memory index {index} is out of range")
                parts[1 + index] = self.mappings.map(
                    parts[1 + index], owner, functools.partial(self._freed_by, owner)
                )
        return parts

    def _released(self, borrower: int, frame: bytes) -> None:
        try:
            names = frame.decode("ascii").split(",")
        except UnicodeDecodeError as exc:
            raise ProtocolError("malformed release frame") from exc
        self.pool.release(names, borrower)  # names not lent to ``borrower`` are ignored

    # -- releases ----------------------------------------------------------------------------

    @property
    def has_releases(self) -> bool:
        return bool(self._releases)

    def take_releases(self, owner: int) -> list[str]:
        """The releases queued for ``owner``, to go on a message to it (cheap when none)."""
        if owner not in self._releases:
            return []
        with self._freed_lock:
            self._queued_at.pop(owner, None)
            return self._releases.pop(owner, [])

    def put_back_releases(self, owner: int, names: list[str]) -> None:
        """The message that was to carry ``names`` was not sent."""
        if names:
            with self._freed_lock:
                self._releases.setdefault(owner, []).extend(names)
                self._queued_at.setdefault(owner, time.monotonic())

    def _freed_by(self, owner: int, name: str) -> None:
        if self.closed:
            return
        with self._freed_lock:  # only queued: the pool's lock may be held by this thread
            self._releases.setdefault(owner, []).append(name)
            self._queued_at.setdefault(owner, time.monotonic())

    def flush_stale(self) -> None:
        """I/O thread: notify owners whose releases found no message to ride on in time."""
        if not self._releases:
            return
        limit = time.monotonic() - RELEASE_DELAY
        stale = [owner for owner, since in list(self._queued_at.items()) if since <= limit]
        agent = self._agent
        for owner in stale:
            names = self.take_releases(owner)
            if owner == agent.rank:
                self.pool.release(names, owner)  # segments we lent to ourselves
                continue
            info = agent.members.infos.get(owner)
            if not names or info is None:
                continue  # it left: its pool is gone
            try:
                agent.notify(info, MessageKind.SHM_RELEASE, names)
            except Exception as exc:  # noqa: BLE001 - the owner is gone or we are closing
                agent.warn(f"cannot release shared memory of worker {owner}: {exc}")

    def _handle_release(self, request: IncomingRequest) -> None:
        names = request.payload
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ProtocolError("SHM_RELEASE carries a list of segment names")
        self.pool.release(names, request.sender.id)

    def peer_gone(self, rank: int) -> None:
        self.pool.forget_lent_to(rank)
        self.mappings.forget(rank)

    def close(self) -> None:
        self.closed = True
        self.pool.close()
        self.mappings.close()
