"""Dynamic groups: ``init_rpc(name)`` without a world size joins a running group.

Store side (c10d store, key space ``actorrpc/dynamic/``)::

    rank/<r>   the claim of rank r (its claimant's token); deleted when it leaves
    next_rank  a counter that hands out ranks to workers that did not choose one
    members    JSON ``{rank: {name, endpoint, identity}}`` of the current members
    lock       ``"<token> <expiry>"``: serializes every change of ``members``
    secret     the generated group secret (groups on one host only)

Message side (``MEMBERSHIP`` requests with JSON payloads, see the wire spec):

* join: holding the lock, the joiner announces itself to every member; each
  adds it and answers. A member that does not answer within
  ``dead_peer_timeout`` is dropped from ``members`` (it died without leaving).
* leave: holding the lock, the leaver removes itself from ``members`` and
  tells every member it is ``leaving``; they stop starting calls to it and
  answer. Then it serves what it was sent, and sends ``left`` last: members
  fail whatever still waits on it and forget it.

Invariants:

* ``members`` changes only under the lock, and the lock is held until every
  member has answered, so whoever reads ``members`` next sees only workers
  that every listed member knows.
* A member's requests sent before its answer to ``leaving`` travel on the same
  pipe ahead of that answer, so the leaver has them all when it starts to wait
  for its own work to finish; ``left`` follows every reply it sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import ActorRpcError, ProtocolError, RendezvousError, WorkerLeftError
from ..protocol import Header, MessageKind
from ..serialization import dumps
from ._rendezvous import (
    GroupMember,
    connect_store,
    describe_init_method,
    group_secret,
    host_store,
    is_listening,
    is_loopback,
    master_address,
    poll_until,
    store_errors,
)

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = [
    "DynamicRendezvous", "forget_member", "handle_membership", "join_dynamic_group",
    "leave_dynamic_group",
]

_log = logging.getLogger("actorrpc.agent")
_PREFIX = "actorrpc/dynamic/"
_MIN_LOCK_LEASE = 30.0
_MAX_RANK = 2**32 - 1
_OPS = ("join", "probe", "leaving", "left")


def _open_dynamic_store(init_method: str, rank: int, timeout: float) -> Any:
    """Connect to the store; on this host, the first worker to come hosts it.

    On another host the store is hosted by rank 0 (as in a static group).
    """
    master = master_address(init_method)
    if master is None and init_method.startswith("env://"):
        raise RendezvousError(
            "init_method env:// needs the environment variables MASTER_ADDR and MASTER_PORT "
            "(no world size was given, so this worker joins a dynamic group there)"
        )
    if master is None:
        raise RendezvousError(
            f"a dynamic group (init_rpc without world_size) needs an env:// or tcp:// "
            f"init_method, got {init_method!r}"
        )
    host, port = master
    deadline = time.monotonic() + timeout
    if (rank == 0 or (rank < 0 and is_loopback(host))) and not is_listening(host, port):
        try:
            return host_store(host, port, timeout)
        except Exception:  # noqa: BLE001 - another worker won the race to host it
            pass
    return connect_store(host, port, deadline, init_method)


def _encode_members(members: dict[int, GroupMember]) -> str:
    return json.dumps(
        {
            str(rank): {"name": m.name, "endpoint": m.endpoint, "identity": m.identity.hex()}
            for rank, m in sorted(members.items())
        }
    )


def _decode_members(raw: bytes) -> dict[int, GroupMember]:
    try:
        entries = json.loads(bytes(raw).decode() or "{}")
        return {
            int(rank): GroupMember(
                str(e["name"]), int(rank), str(e["endpoint"]), bytes.fromhex(str(e["identity"]))
            )
            for rank, e in entries.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousError(
            f"the member list of the dynamic group is malformed: {bytes(raw)[:80]!r}"
        ) from exc


class DynamicRendezvous:
    """The store side of a dynamic group: rank claims, the member list and its lock."""

    def __init__(self, init_method: str, rank: int, timeout: float) -> None:
        self.init_method = init_method
        self.timeout = timeout
        self._token = secrets.token_hex(8)
        where = describe_init_method(init_method)
        try:
            root = _open_dynamic_store(init_method, rank, timeout)
        except RendezvousError:
            raise
        except Exception as exc:
            raise RendezvousError(
                f"could not reach the rendezvous store at {where} within {timeout:.0f}s: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._root: Any = root
        self.store: Any = dist.PrefixStore(_PREFIX, root)
        with store_errors("claiming a rank in the dynamic group"):
            self.rank = self._claim_rank(rank)

    def _claim(self, rank: int) -> bool:
        return bytes(self.store.compare_set(f"rank/{rank}", "", self._token)).decode() == (
            self._token
        )

    def _claim_rank(self, rank: int) -> int:
        if rank >= 0:
            if not self._claim(rank):
                raise RendezvousError(
                    f"rank {rank} is already taken in the dynamic group at "
                    f"{describe_init_method(self.init_method)}; choose another or pass rank=-1"
                )
            return rank
        while True:
            candidate = int(self.store.add("next_rank", 1)) - 1
            if candidate > _MAX_RANK:
                raise RendezvousError("the dynamic group ran out of ranks")
            if self._claim(candidate):
                return candidate

    def group_secret(self, own_secret: str | None) -> str:
        return group_secret(self.store, self.init_method, own_secret, f"rank {self.rank}")

    @contextlib.contextmanager
    def locked_members(self, who: str, deadline: float) -> Iterator[dict[int, GroupMember]]:
        """Hold the membership lock; yield the member list, written back on success."""
        lease = max(_MIN_LOCK_LEASE, self.timeout)
        mine = f"{self._token} {time.time() + lease:.3f}"
        holder = [""]

        def take() -> bool:
            current = bytes(self.store.compare_set("lock", "", mine)).decode()
            if current == mine:
                return True
            holder[0] = current
            try:
                expiry = float(current.split()[1])
            except (IndexError, ValueError):
                expiry = 0.0
            if expiry < time.time():  # its holder died: take the lock over
                return bytes(self.store.compare_set("lock", current, mine)).decode() == mine
            return False

        what = f"{who} (dynamic group membership)"
        with store_errors(what):
            if not poll_until(take, deadline):
                raise RendezvousError(
                    f"{who}: another worker held the membership lock of the dynamic group "
                    f"for the whole timeout (lock {holder[0]!r})"
                )
        try:
            with store_errors(what):
                raw = self.store.get("members") if self.store.check(["members"]) else b"{}"
            members = _decode_members(raw)
            before = dict(members)
            yield members
            if members != before:
                with store_errors(what):
                    self.store.set("members", _encode_members(members))
        finally:
            with contextlib.suppress(Exception):
                self.store.compare_set("lock", mine, "")

    def release_rank(self, rank: int | None = None) -> None:
        """Give back this worker's rank, or a dead one's (and its published status)."""
        rank = self.rank if rank is None else rank
        with contextlib.suppress(Exception):
            self.store.delete_key(f"rank/{rank}")
            self._root.delete_key(f"actorrpc/status/{rank}")

    def publish_status(self, rank: int, world_size: int, payload: str) -> None:
        root = self._root
        if root is not None:
            key = "actorrpc/status/world"
            world = int(root.get(key)) if root.check([key]) else 0
            if rank + 1 > world:
                root.set("actorrpc/status/world", str(rank + 1))
            root.set(f"actorrpc/status/{rank}", payload)

    def close(self) -> None:
        self.store = None
        self._root = None


# -- messages -------------------------------------------------------------------------------


def _announce(
    agent: Agent, member: GroupMember, op: str, deadline: float, dropped: list[int] | None = None
) -> Any:
    body = json.dumps(
        {
            "op": op,
            "rank": agent.rank,
            "name": agent.name,
            "endpoint": agent.endpoint,
            "identity": agent.identity.hex(),
            "dropped": dropped or [],
        }
    ).encode()
    timeout = max(0.001, min(agent.options.dead_peer_timeout, deadline - time.monotonic()))
    return agent.send_encoded(member, MessageKind.MEMBERSHIP, body, timeout, f"membership {op}")


def _answered(futures: dict[int, Any]) -> tuple[list[int], list[int]]:
    """Ranks that answered and ranks that did not (timed out or unreachable)."""
    answered, silent = [], []
    for rank, future in futures.items():
        try:
            future.wait()
            answered.append(rank)
        except Exception:  # noqa: BLE001 - silence is all that matters here
            silent.append(rank)
    return answered, silent


def join_dynamic_group(agent: Agent, rdzv: DynamicRendezvous) -> None:
    """Announce ``agent`` to every member and add it to the member list."""
    me = GroupMember(agent.name, agent.rank, agent.endpoint, agent.identity)
    deadline = time.monotonic() + rdzv.timeout
    who = f"worker {agent.name!r} (rank {agent.rank}) joining"
    with rdzv.locked_members(who, deadline) as members:
        for member in members.values():
            agent.members.add(member)  # before announcing: their answers come from members
        holder = next((m for m in members.values() if m.name == agent.name), None)
        dropped: list[int] = []
        if holder is not None:
            # a worker that died without leaving keeps its name until someone notices
            probe = {holder.rank: _announce(agent, holder, "probe", deadline)}
            if _answered(probe)[0]:
                forget_member(agent, holder.rank)
                raise RendezvousError(
                    f"worker name {agent.name!r} is not unique: rank {holder.rank} of the "
                    "running group uses it"
                )
            _drop_silent(agent, rdzv, members, holder.rank)
            dropped.append(holder.rank)  # the others forget it too
        futures = {
            m.rank: _announce(agent, m, "join", deadline, dropped) for m in members.values()
        }
        for rank in _answered(futures)[1]:
            _drop_silent(agent, rdzv, members, rank)
        agent.members.add(me)
        members[agent.rank] = me


def _drop_silent(
    agent: Agent, rdzv: DynamicRendezvous, members: dict[int, GroupMember], rank: int
) -> None:
    """A member that died without leaving: forget it, free its rank."""
    _log.warning(
        "%s: member %r (rank %d) does not answer; dropping it from the dynamic group",
        agent.name, members[rank].name, rank,
    )
    del members[rank]
    forget_member(agent, rank)
    rdzv.release_rank(rank)


def leave_dynamic_group(agent: Agent, rdzv: DynamicRendezvous, deadline: float) -> list[str]:
    """Tell every member this worker leaves; return the problems met."""
    problems: list[str] = []
    try:
        with rdzv.locked_members(f"worker {agent.name!r} leaving", deadline) as members:
            members.pop(agent.rank, None)
            futures = {}
            for rank in list(agent.members.members):
                member = agent.members.members.get(rank)
                if member is None or rank == agent.rank:
                    continue
                try:
                    futures[rank] = _announce(agent, member, "leaving", deadline)
                except ActorRpcError:
                    pass  # it is gone already
            _answered(futures)
    except RendezvousError as exc:
        problems.append(str(exc))
    rdzv.release_rank()
    return problems


def send_left(agent: Agent) -> None:
    """The last message to every member: fail what still waits on this worker."""
    body = json.dumps({"op": "left", "rank": agent.rank}).encode()
    for member in list(agent.members.members.values()):
        if member.rank != agent.rank:
            with contextlib.suppress(Exception):
                agent.send_to(member, MessageKind.MEMBERSHIP, 0, body, [])


def _parse(frames: list[Any]) -> dict[str, Any]:
    if len(frames) != 1:
        raise ProtocolError("a MEMBERSHIP message carries exactly one frame")
    try:
        message = json.loads(bytes(frames[0]).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a MEMBERSHIP payload is not JSON: {exc}") from exc
    if not isinstance(message, dict) or message.get("op") not in _OPS:
        raise ProtocolError(f"a MEMBERSHIP payload has no known op: {str(message)[:80]!r}")
    return message


def handle_membership(agent: Agent, identity: bytes, header: Header, frames: list[Any]) -> None:
    """Apply one MEMBERSHIP message on the I/O thread (see the module docstring)."""
    try:
        message = _parse(frames)
        op = message["op"]
        if op in ("join", "probe"):
            sender = GroupMember(
                str(message["name"]), int(message["rank"]), str(message["endpoint"]),
                bytes.fromhex(str(message["identity"])),
            )
        else:
            known = agent.members.members.get(header.sender)
            if known is None or known.identity != identity:
                raise ProtocolError(f"{op!r} from rank {header.sender}, which is not a member")
            sender = known
    except (ProtocolError, KeyError, TypeError, ValueError) as exc:
        agent.warn(f"dropped a MEMBERSHIP message from rank {header.sender}: {exc}")
        return
    if sender.identity != identity or sender.rank != header.sender:
        agent.warn("dropped a MEMBERSHIP message whose sender does not match its connection")
        return
    if not agent.dynamic:
        agent.warn(f"dropped a {op!r} from rank {sender.rank}: this group is not dynamic")
        return
    if op == "join":
        for rank in message.get("dropped", []):
            if isinstance(rank, int) and rank not in (agent.rank, sender.rank):
                forget_member(agent, rank)
        agent.members.add(sender)
        agent.liveness.forget(sender.rank)
        _log.info("%s: worker %r (rank %d) joined", agent.name, sender.name, sender.rank)
    elif op == "leaving":
        agent.members.mark_leaving(sender.rank)
    elif op == "left":
        forget_member(agent, sender.rank)
        _log.info("%s: worker %r (rank %d) left", agent.name, sender.name, sender.rank)
        return
    agent.send_to(sender, MessageKind.RESPONSE, header.message_id, *dumps(None, "result"))


def forget_member(agent: Agent, rank: int) -> None:
    """A dynamic group's member left: fail what waits on it, drop its link."""
    for message_id, pending in list(agent._pending.items()):
        if pending.dest.id == rank:
            agent._fail_pending(
                message_id,
                WorkerLeftError(
                    f"{pending.description or 'call'} on {pending.dest!r} failed: the "
                    "worker left the group before answering"
                ),
            )
    member = agent.members.remove(rank)
    agent.liveness.forget(rank)
    agent.shared.peer_gone(rank)
    agent.riders.drop(rank)
    agent._credits.forget(rank)
    with agent._inflight_lock:
        agent._unstarted.pop(rank, None)
    if member is not None:
        agent._transport.drop_link(member.identity)
