"""``local_workers(n)``: a group of local worker processes driven from this process.

Made for notebooks and scripts: the calling process joins as the driver (rank
0); ``n`` worker processes (``worker1`` .. ``workerN``) serve until
``shutdown``. Functions and classes defined in notebook cells travel by value,
so the workers need nothing but actorrpc installed.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from types import TracebackType
from typing import Any

from ._api import init_rpc, shutdown
from ._ports import free_ports
from .agent import ZmqRpcBackendOptions

__all__ = ["LocalWorkers", "local_workers"]


class LocalWorkers:
    """Handle of a local group; ``shutdown()`` (or leaving the ``with`` block) ends it.

    Made by :func:`local_workers`: this process is the driver, ``names`` are
    the worker processes' names and ``processes`` their ``Popen`` objects.

    Example::

        >>> with rpc.local_workers(2) as group:   # this process joins as "driver"
        ...     print(group.names)
        ...     print(rpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 1)))
        ['worker1', 'worker2']
        tensor([2., 2.])
    """

    def __init__(self, processes: list[subprocess.Popen[bytes]], names: list[str]) -> None:
        self.processes = processes
        self.names = names

    def shutdown(self, timeout: float = 60.0) -> None:
        """Shut RPC down here (graceful, bounded by ``timeout``), then end the workers.

        Each worker process gets ``timeout`` seconds to exit and is killed if it
        has not. Leaving the ``with`` block calls ``shutdown()``.

        Example::

            >>> group = rpc.local_workers(2)
            >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
            tensor([2., 2.])
            >>> group.shutdown(timeout=30)
            >>> rpc.is_initialized()
            False
        """
        try:
            shutdown(timeout=timeout)
        finally:
            for process in self.processes:
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"LocalWorkers(driver + {self.names})"


def local_workers(
    n: int, driver_name: str = "driver", rpc_timeout: float = 60.0, **options: Any
) -> LocalWorkers:
    """Start ``n`` local workers and join them from this process as ``driver_name``.

    Example::

        >>> import actorrpc as rpc
        >>> group = rpc.local_workers(2)          # driver + worker1, worker2
        >>> rpc.rpc_sync("worker1", lambda x: x * 2, args=(21,))
        42
        >>> group.shutdown()
    """
    (port,) = free_ports("127.0.0.1", 1)
    init_method = f"tcp://127.0.0.1:{port}"
    secret = options.pop("secret", None) or secrets.token_hex(32)
    env = dict(os.environ, ACTORRPC_SECRET=secret)
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "actorrpc._serve", "--rank", str(rank), "--world-size",
             str(n + 1), "--init-method", init_method, "--rpc-timeout", str(rpc_timeout)],
            env=env,
        )
        for rank in range(1, n + 1)
    ]
    try:
        init_rpc(driver_name, rank=0, world_size=n + 1, rpc_backend_options=ZmqRpcBackendOptions(
            init_method=init_method, rpc_timeout=rpc_timeout, secret=secret, **options
        ))
    except BaseException:
        for process in processes:
            process.kill()
        raise
    return LocalWorkers(processes, [f"worker{rank}" for rank in range(1, n + 1)])
