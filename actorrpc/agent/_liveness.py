"""Failure detection: application-level PINGs to the peers that calls wait on.

ZeroMQ heartbeats notice a dead *connection*; a hung process keeps its
connection up. So a peer that a call waits on and that has been silent for
``liveness_interval`` gets a PING, which its I/O thread answers inline; a PING
unanswered for ``dead_peer_timeout`` marks the peer dead, failing every call
that waits on it with :class:`PeerUnreachableError` naming it. Any later
message from the peer revives it, and a peer declared dead is checked again
every ``dead_peer_timeout``: one that only stalled (a machine overloaded for a
while) is revived by its answer instead of staying dead for good, since
nothing else is sent to a dead peer.

Shutdown's barriers count a missing peer as dead only when a check sent during
the shutdown went unanswered (:meth:`LivenessMonitor.dead_among`), never on an
older verdict.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from ..errors import PeerUnreachableError, RpcTimeoutError
from ..protocol import MessageKind

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["LivenessMonitor"]

_log = logging.getLogger("actorrpc.agent")


class LivenessMonitor:
    """Tracks when each peer was last heard from and which peers are dead."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self.last_seen: dict[int, float] = {}
        self.dead_peers: dict[int, str] = {}
        self._declared: dict[int, float] = {}  # when each dead peer was last found dead
        self._pinging: set[int] = set()
        self._next_check = 0.0

    def pings_in_flight(self) -> int:
        return len(self._pinging)

    def heard_from(self, rank: int, name: str) -> None:
        self.last_seen[rank] = time.monotonic()
        if rank in self.dead_peers:
            _log.warning("%s: worker %s answers again", self._agent.name, name)
            del self.dead_peers[rank]
            self._declared.pop(rank, None)

    def forget(self, rank: int) -> None:
        """A member that joined anew or left: nothing known about it holds any more."""
        self.last_seen.pop(rank, None)
        self.dead_peers.pop(rank, None)
        self._declared.pop(rank, None)
        self._pinging.discard(rank)

    def dead_among(self, ranks: list[int], since: float = float("-inf")) -> list[int]:
        """Of ``ranks``, those found dead by a check at or after ``since``; the others
        are probed, those found dead before ``since`` again (used while a barrier waits)."""
        for rank in ranks:
            self.probe(rank, again=self._declared.get(rank, since) < since)
        declared = self._declared
        return [rank for rank in ranks if rank in declared and declared[rank] >= since]

    def check(self) -> None:
        """PING silent peers that calls wait on; a PING left unanswered marks the peer dead."""
        now = time.monotonic()
        if now < self._next_check:
            return
        interval = self._agent.options.liveness_interval
        self._next_check = now + interval
        waited_on = {pending.dest.id for pending in list(self._agent._pending.values())}
        for rank in waited_on - self._pinging - set(self.dead_peers) - {self._agent.rank}:
            if now - self.last_seen.get(rank, 0.0) < interval:
                continue
            self.probe(rank)
        timeout = self._agent.options.dead_peer_timeout
        for rank, declared in list(self._declared.items()):
            if now - declared >= timeout:
                self.probe(rank, again=True)  # it may only have stalled

    def probe(self, rank: int, again: bool = False) -> None:
        """Send a liveness PING to ``rank`` unless one is in flight or it is known dead
        (``again``: even then)."""
        info = self._agent.members.infos.get(rank)
        if rank in self._pinging or rank == self._agent.rank:
            return
        if rank in self.dead_peers and not again:
            return
        if info is None:
            return  # it left the group
        self._pinging.add(rank)
        try:
            ping = self._agent.send_request(
                info,
                MessageKind.PING,
                (),
                self._agent.options.dead_peer_timeout,
                description="liveness check",
            )
        except PeerUnreachableError as exc:
            self._pinging.discard(rank)
            self.declare_dead(rank, str(exc))
            return
        ping.add_done_callback(lambda done: self._on_ping_done(rank, done))

    def _on_ping_done(self, rank: int, done: torch._C.Future[Any]) -> None:
        # (torch hands callbacks its C future, not the Python subclass: typed so for mypyc)
        self._pinging.discard(rank)
        try:
            done.wait()
        except RpcTimeoutError:
            info = self._agent.members.infos.get(rank)
            if info is None:
                return  # it left the group meanwhile
            self.declare_dead(
                rank,
                (
                    f"worker {info.name!r} (rank {rank}) is unreachable: it did not answer a "
                    f"liveness check within {self._agent.options.dead_peer_timeout:.1f}s "
                    "(it died or hung)"
                ),
            )
        except Exception:  # noqa: BLE001 - any answer, even an error, proves it is alive
            pass

    def declare_dead(self, rank: int, reason: str) -> None:
        """Fail every call waiting on ``rank``; later sends to it fail at once."""
        if rank not in self.dead_peers:  # (a check of a dead peer confirms it quietly)
            _log.warning("%s: %s", self._agent.name, reason)
        self.dead_peers[rank] = reason
        self._declared[rank] = time.monotonic()
        self._agent.shared.peer_gone(rank)
        for message_id, pending in list(self._agent._pending.items()):
            if pending.dest.id == rank:
                self._agent._fail_pending(
                    message_id,
                    PeerUnreachableError(
                        f"{pending.description or 'call'} on {pending.dest!r} failed: {reason}"
                    ),
                )
