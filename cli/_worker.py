"""Bootstrap of one worker started by ``actorrpc launch``.

The elastic agent gives every worker the same environment apart from its ranks,
so this shim, run by file path as ``python -u _worker.py script.py [args...]``,
adds the per-worker settings and then ``exec``s ``python -u script.py [args...]``
in the same process (same pid, so the agent's signals still reach the script):

* ``ACTORRPC_WORKER_NAME`` from the ``--names`` pattern and ``RANK``;
* ``MASTER_PORT`` set to the port reserved for the job's own rendezvous (the
  agent's store listens on a separate port), with
  ``TORCHELASTIC_USE_AGENT_STORE=False`` so torch's ``env://`` init on rank 0
  hosts its own store there instead of looking for the agent's.

It imports only the standard library: being run by path, it does not import
the ``actorrpc`` package (nor torch) a second time per worker.
"""

from __future__ import annotations

import os
import sys

NAMES_ENV = "ACTORRPC_LAUNCH_NAMES"
MASTER_PORT_ENV = "ACTORRPC_LAUNCH_MASTER_PORT"
WORKER_NAME_ENV = "ACTORRPC_WORKER_NAME"


def worker_name(pattern: str, rank: int, local_rank: int | None = None) -> str:
    """Name of the worker of global ``rank`` under a ``--names`` pattern.

    The pattern is a comma-separated list: item ``i`` names rank ``i`` and the
    last item names every further rank. ``{rank}`` (and ``{local_rank}``) in an
    item are replaced by the worker's ranks: ``ps,trainer{rank}`` gives ``ps``,
    ``trainer1``, ``trainer2``, ...
    """
    items = [item.strip() for item in pattern.split(",")]
    if not all(items):
        raise ValueError(f"empty name in --names pattern {pattern!r}")
    if rank < 0:
        raise ValueError(f"negative rank {rank}")
    name = items[min(rank, len(items) - 1)].replace("{rank}", str(rank))
    if local_rank is not None:
        name = name.replace("{local_rank}", str(local_rank))
    return name


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -u _worker.py script.py [args...]")
    env = os.environ
    pattern = env.pop(NAMES_ENV, None)
    if pattern is not None:
        env[WORKER_NAME_ENV] = worker_name(
            pattern, int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
        )
    port = env.pop(MASTER_PORT_ENV, None)
    if port is not None:
        env["MASTER_PORT"] = port
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-u", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
