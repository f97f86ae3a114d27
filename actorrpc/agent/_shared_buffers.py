"""The agent's side of same-host shared memory (pool and mapping: ``transport._shared_memory``).

Outgoing: :meth:`SharedBuffers.outgoing` puts each buffer of at least
``shared_memory_threshold`` bytes bound for a peer on this host into a segment
lent from this worker's pool, and marks the message (wire spec: "Shared
memory"). Incoming: :meth:`SharedBuffers.incoming` maps the segments a message
names; when the last tensor on a mapping is freed, the segment's name goes
back to its owner in an ``SHM_RELEASE`` notification, which usually rides on
the next message sent to it (``agent._riders``).

Invariants:

* A mapping's release is queued by a finalizer, which may run on any thread
  (even inside garbage collection), so it only queues a notification.
* A segment lent to a peer that left or stopped answering is dropped, never
  reused (its process may still hold tensors on it).
"""

from __future__ import annotations

import functools
import struct
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError
from ..protocol import FLAG_SHARED_MEMORY, Header, MessageKind
from ..transport import SharedMappings, SharedMemoryPool, shared_memory_available
from ._calls import IncomingRequest
from ._rendezvous import GroupMember

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["SharedBuffers"]

_VIEW: Any = memoryview  # (mapped over frames: no Python frame each, as ``.buffer`` has)


class SharedBuffers:
    """Lends and maps shared-memory segments for one agent."""

    def __init__(self, agent: Agent, threshold: int) -> None:
        self._agent = agent
        self._threshold = threshold if shared_memory_available() else 0
        self._host = agent.endpoint.rsplit(":", 1)[0]
        self.pool = SharedMemoryPool()
        self.mappings = SharedMappings()
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
        indexes = []  # (a loop: a comprehension is a frame before Python 3.12)
        for i, buffer in enumerate(buffers):
            if buffer.nbytes >= threshold:
                indexes.append(i)
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
        """The payload and buffers of a message that has more than its payload, mapping
        shared-memory ones (a payload alone the dispatcher takes as it is)."""
        shared = header.flags & FLAG_SHARED_MEMORY
        if len(frames) != 1 + header.nbuffers + (1 if shared else 0):
            carried = len(frames) - 1 - (1 if shared else 0)
            raise ProtocolError(
                f"message declares {header.nbuffers} buffers but carries {carried}"
            )
        parts: list[Any] = list(map(_VIEW, frames[: 1 + header.nbuffers]))
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

    # -- releases ----------------------------------------------------------------------------

    def _freed_by(self, owner: int, name: str) -> None:
        if not self.closed:  # only queued: the pool's lock may be held by this thread
            self._agent.notify_soon(owner, MessageKind.SHM_RELEASE, [name])

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
