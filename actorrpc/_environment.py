"""Where a worker learns its rank, world size and rendezvous address.

Sources, first match wins: the arguments of ``init_rpc``; the variables
torchrun and ``actorrpc launch`` set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``); SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, and the first host of ``SLURM_JOB_NODELIST`` as the master,
with ``MASTER_PORT`` defaulting to 29500 plus the job id modulo 1000).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import InvalidArgumentError

__all__ = ["LaunchEnvironment", "first_host", "launch_environment"]

DEFAULT_MASTER_PORT = 29500


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    match = re.match(r"\s*([^,\[\s]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        raise InvalidArgumentError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


@dataclass(frozen=True)
class LaunchEnvironment:
    rank: int | None
    world_size: int | None
    local_rank: int | None
    master_addr: str | None
    master_port: int | None
    source: str


def _int(variable: str) -> int | None:
    value = os.environ.get(variable)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise InvalidArgumentError(f"{variable}={value!r} is not an integer") from exc


def launch_environment() -> LaunchEnvironment:
    """Read the launcher's variables (torchrun / ``actorrpc launch`` first, then SLURM)."""
    if os.environ.get("RANK") is not None or os.environ.get("WORLD_SIZE") is not None:
        port = _int("MASTER_PORT")
        return LaunchEnvironment(
            _int("RANK"), _int("WORLD_SIZE"), _int("LOCAL_RANK"),
            os.environ.get("MASTER_ADDR"), port, "torchrun",
        )
    if os.environ.get("SLURM_PROCID") is not None:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        master = os.environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else None)
        port = _int("MASTER_PORT")
        if port is None:
            job = _int("SLURM_JOB_ID") or 0
            port = DEFAULT_MASTER_PORT + job % 1000
        return LaunchEnvironment(
            _int("SLURM_PROCID"), _int("SLURM_NTASKS"), _int("SLURM_LOCALID"),
            master, port, "SLURM",
        )
    return LaunchEnvironment(None, None, None, os.environ.get("MASTER_ADDR"),
                             _int("MASTER_PORT"), "none")
