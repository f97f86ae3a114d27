"""A worker process that joins a group and serves until the group shuts down.

``python -m actorrpc._serve --rank R --world-size N --init-method URL`` is what
:func:`actorrpc.local_workers` starts (and ``actorrpc launch --serve`` style
setups can use). A watchdog ends the process if its parent dies, so no worker
outlives the notebook or test run that started it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

__all__ = ["main"]


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Join an actorrpc group and serve calls.")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--name", default=None, help="worker name (default worker<rank>)")
    parser.add_argument("--rpc-timeout", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--strict-leaks", action="store_true")
    parser.add_argument("--orphan-ok", action="store_true", help="keep running if the parent dies")
    args = parser.parse_args(argv)
    if not args.orphan_ok:
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    sys.path.insert(0, os.getcwd())
    from ._api import init_rpc, shutdown
    from .agent import ZmqRpcBackendOptions

    options = ZmqRpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.rpc_timeout,
        num_worker_threads=args.threads,
        strict_rref_leaks=args.strict_leaks,
    )
    init_rpc(args.name or f"worker{args.rank}", rank=args.rank,
             world_size=args.world_size, rpc_backend_options=options)
    shutdown(timeout=0)


if __name__ == "__main__":
    main()
