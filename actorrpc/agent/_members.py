"""Who is in the group: the member table every agent keeps.

A static group's table is filled once at rendezvous. A dynamic group's table
changes while the agent runs, only on its I/O thread (members join, start
leaving, and leave); other threads read it. Readers take a snapshot (``list``
or ``dict.get``), which is atomic, so they never see a half-applied change.

States of a peer: *member* (calls go to it), *leaving* (it announced that it
leaves: it still answers the calls it has, but new calls to it fail), *departed*
(it left: everything that still waited on it failed, its name is remembered so
that errors can say it left rather than that it never existed).
"""

from __future__ import annotations

from typing import Any

from ..errors import UnknownWorkerError, WorkerLeftError
from ._rendezvous import GroupMember
from ._worker_info import WorkerInfo

__all__ = ["MemberTable"]


class MemberTable:
    """Members by rank and by name, plus the ones leaving or gone."""

    def __init__(self) -> None:
        self.members: dict[int, GroupMember] = {}
        self.infos: dict[int, WorkerInfo] = {}
        self.by_name: dict[str, WorkerInfo] = {}
        self.leaving: set[int] = set()
        self.departed: dict[int, str] = {}
        self._departed_names: dict[str, int] = {}

    def add(self, member: GroupMember) -> WorkerInfo:
        info = WorkerInfo(member.name, member.rank)
        self.members[member.rank] = member
        self.infos[member.rank] = info
        self.by_name[member.name] = info
        self.leaving.discard(member.rank)
        self.departed.pop(member.rank, None)
        self._departed_names.pop(member.name, None)
        return info

    def mark_leaving(self, rank: int) -> None:
        if rank in self.members:
            self.leaving.add(rank)

    def remove(self, rank: int) -> GroupMember | None:
        """Forget a member that left; later lookups of it raise :class:`WorkerLeftError`."""
        member = self.members.pop(rank, None)
        self.infos.pop(rank, None)
        self.leaving.discard(rank)
        if member is not None:
            named = self.by_name.get(member.name)
            if named is not None and named.id == rank:
                del self.by_name[member.name]
            self.departed[rank] = member.name
            self._departed_names[member.name] = rank
        return member

    def worker_infos(self) -> list[WorkerInfo]:
        """Current members (not those leaving), ordered by rank."""
        leaving = self.leaving
        return sorted(
            (info for rank, info in list(self.infos.items()) if rank not in leaving),
            key=lambda info: info.id,
        )

    def left_error(self, rank: int, what: str = "") -> WorkerLeftError:
        name = self.departed.get(rank)
        if name is None:
            info = self.infos.get(rank)
            name = info.name if info is not None else "?"
        state = "is leaving" if rank in self.leaving else "left"
        prefix = f"{what}: " if what else ""
        return WorkerLeftError(f"{prefix}worker {name!r} (rank {rank}) {state} the group")

    def resolve(self, to: Any) -> WorkerInfo:
        """Map a name, rank or :class:`WorkerInfo` to a current member."""
        info: WorkerInfo | None = None
        rank: int | None = None
        if isinstance(to, WorkerInfo):
            info = self.infos.get(to.id)
            rank = to.id
            if info != to:
                info = None
                if self.departed.get(to.id) != to.name:
                    rank = None
        elif isinstance(to, str):
            info = self.by_name.get(to)
            rank = info.id if info is not None else self._departed_names.get(to)
        elif isinstance(to, int) and not isinstance(to, bool):
            info = self.infos.get(to)
            rank = to if info is not None or to in self.departed else None
        else:
            raise UnknownWorkerError(
                f"destination must be a worker name, rank or WorkerInfo, got {type(to).__name__}"
            )
        if rank is not None and (rank in self.leaving or rank in self.departed):
            raise self.left_error(rank)
        if info is not None:
            return info
        known = ", ".join(sorted(self.by_name))
        raise UnknownWorkerError(f"could not find destination {to!r}; known workers: {known}")
