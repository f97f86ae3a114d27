"""Worker identity and name validation."""

from __future__ import annotations

import re

from ..errors import InvalidNameError

__all__ = ["MAX_NAME_LENGTH", "WorkerInfo", "validate_worker_name"]

MAX_NAME_LENGTH = 128
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_:\-]+")


def validate_worker_name(name: object) -> str:
    """Return ``name`` if it follows torch's rule, else raise :class:`InvalidNameError`.

    The rule: only letters, digits, ``_``, ``-`` and ``:``; 1 to 127 characters.
    """
    if not isinstance(name, str):
        raise InvalidNameError(f"worker name must be a str, got {type(name).__name__}")
    if not name or len(name) >= MAX_NAME_LENGTH or not _NAME_PATTERN.fullmatch(name):
        raise InvalidNameError(
            f"invalid worker name {name!r}: a name may contain only letters, digits, "
            f"'_', '-' and ':', and must be 1 to {MAX_NAME_LENGTH - 1} characters long"
        )
    return name


class WorkerInfo:
    """The name and id (rank) of a worker; hashable and picklable.

    Example::

        >>> info = rpc.get_worker_info("worker1")
        >>> info
        WorkerInfo(id=1, name=worker1)
    """

    __slots__ = ("id", "name")

    def __init__(self, name: str, id: int) -> None:  # noqa: A002 - torch's argument name
        self.name = name
        self.id = id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerInfo):
            return NotImplemented
        return self.id == other.id and self.name == other.name

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self) -> tuple[type[WorkerInfo], tuple[str, int]]:
        return WorkerInfo, (self.name, self.id)
