"""Shared fixtures: one real 3-worker group for the whole session.

The pytest process is ``worker0``; ``worker1`` and ``worker2`` are separate
processes started by :mod:`tests._cluster`. Tests that need a group of their
own (re-init, failures, shutdown) start their own processes instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import actorrpc as rpc
from tests._cluster import dump_threads, free_port, spawn_workers, stop_workers

WORLD_SIZE = 3


@pytest.fixture(scope="session")
def cluster() -> Iterator[list[str]]:
    """The names of the session group's workers; this process is the first."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = spawn_workers(range(1, WORLD_SIZE), WORLD_SIZE, init_method)
    try:
        rpc.init_rpc(
            "worker0", rank=0, world_size=WORLD_SIZE,
            rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=30),
        )
    except BaseException:
        for process in processes:
            process.kill()
        raise
    try:
        yield [f"worker{r}" for r in range(WORLD_SIZE)]
    finally:
        try:
            rpc.shutdown(timeout=30)
        except BaseException:
            dump_threads(processes)
            raise
        finally:
            codes = stop_workers(processes)
    assert codes == [0] * (WORLD_SIZE - 1), f"cluster workers exited with {codes}"


@pytest.fixture
def pair() -> Iterator[tuple[object, object]]:
    """Two transports of this process (sender, receiver), closed afterwards."""
    from actorrpc.transport import Transport

    sender = Transport(b"0:sender", secret="s", security="plain")
    receiver = Transport(b"1:receiver", secret="s", security="plain")
    yield sender, receiver
    sender.close()
    receiver.close()
