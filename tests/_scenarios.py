"""Scenario runner for tests that need processes (and RPC groups) of their own.

``python -m tests._scenarios SCENARIO [--rank R] [--world-size N] [--init-method URL]``
runs one scenario as one worker and prints one line ``RESULT {json}`` with what
it observed; it exits 0 when the scenario ran to the end (the checks are made
by the test from the JSON), 1 on an unexpected exception (traceback on stderr).

Scenarios (see ``tests/test_lifecycle.py``):

* ``lifecycle`` (2 workers): calls before init; duplicate names; init twice;
  shutdown, calls after it, re-init on the same init method; graceful shutdown
  with calls in flight; env:// with RANK/WORLD_SIZE and torch's
  TensorPipeRpcBackendOptions; a worker waiting in shutdown while its peer
  still calls it; shutdown timeout naming the missing peer;
  non-graceful shutdown.
* ``failures`` (1 worker): a world that never fills, an unreachable master,
  env:// without MASTER_ADDR, no RANK; then a 1-worker group still works.

Everything lives in the importable module ``tests._scenarios`` (``__main__``
only forwards to it) so functions sent between the workers travel by
reference and share the module's state.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests._waiting import wait_until

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- functions called over RPC ---------------------------------------------------------------

_served = 0
_served_lock = threading.Lock()
_first_served = threading.Event()


def slow_work(i: int, seconds: float) -> int:
    """Simulated work: the callee takes ``seconds`` to answer."""
    global _served
    _first_served.set()
    threading.Event().wait(seconds)
    with _served_lock:
        _served += 1
    return i * i


def served() -> int:
    with _served_lock:
        return _served


def whoami() -> str:
    import actorrpc as rpc

    return rpc.get_worker_info().name


class Shadowed:
    """The receiver's own ``__main__.Shadowed``; a sender's different class must win."""

    def who(self) -> str:
        return "receiver"


def shadowed_func() -> str:
    return "receiver"


# --- helpers ----------------------------------------------------------------------------------


_T0 = time.monotonic()


def _log(step: str) -> None:
    """Progress on stderr (shown by the test when a scenario fails)."""
    print(f"[scenario {time.monotonic() - _T0:7.2f}s] {step}", file=sys.stderr, flush=True)


def _error(call: Callable[[], Any]) -> dict[str, Any] | None:
    """Run ``call``; describe the exception it raised (``None`` if it returned)."""
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - described for the test
        return {
            "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "elapsed": time.monotonic() - start,
        }
    return None


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    value = call()
    return value, time.monotonic() - start


def _watch_parent(parent: int) -> None:
    pause = threading.Event()
    while True:
        if os.getppid() != parent:
            os._exit(3)
        pause.wait(0.5)


# --- scenarios ------------------------------------------------------------------------------


def scenario_lifecycle(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    import torch
    import torch.distributed.rpc as torch_rpc

    import actorrpc as rpc
    from actorrpc.agent import current_agent

    peer = f"worker{1 - rank}"
    me = f"worker{rank}"
    signal_dir = os.environ["SCENARIO_SIGNAL_DIR"]

    def signal(name: str) -> None:
        with open(os.path.join(signal_dir, name), "w") as handle:
            handle.write("1")

    def wait_signal(name: str, timeout: float = 60) -> bool:
        return wait_until(lambda: os.path.exists(os.path.join(signal_dir, name)), timeout)

    out: dict[str, Any] = {}

    _log("1. calls before init_rpc")
    t = torch.ones(2)
    out["before_init"] = {
        "rpc_sync": _error(lambda: rpc.rpc_sync(peer, torch.add, args=(t, 1))),
        "rpc_async": _error(lambda: rpc.rpc_async(peer, torch.add, args=(t, 1))),
        "remote": _error(lambda: rpc.remote(peer, torch.add, args=(t, 1))),
        "get_worker_info": _error(lambda: rpc.get_worker_info()),
        "get_worker_infos": _error(lambda: rpc.get_worker_infos()),
        "get_rpc_timeout": _error(lambda: rpc.get_rpc_timeout()),
        "shutdown": _error(lambda: rpc.shutdown()),
    }
    out["before_init_is_initialized"] = rpc.is_initialized()

    _log("2. duplicate names")
    dup_options = rpc.ZmqRpcBackendOptions(
        init_method=os.environ["SCENARIO_DUP_INIT"], init_timeout=10
    )
    out["duplicate"] = _error(
        lambda: rpc.init_rpc("dup", rank=rank, world_size=2, rpc_backend_options=dup_options)
    )
    out["duplicate_is_initialized"] = rpc.is_initialized()

    _log("3. a group; init twice; shutdown; calls after shutdown")
    options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20, init_timeout=30)
    rpc.init_rpc(me, rank=rank, world_size=world_size, rpc_backend_options=options)
    out["round1_twice"] = _error(
        lambda: rpc.init_rpc(me, rank=rank, world_size=world_size, rpc_backend_options=options)
    )
    out["round1_peer"] = rpc.rpc_sync(peer, torch.add, args=(t, rank)).tolist()
    out["round1_self"] = rpc.rpc_sync(me, whoami)
    out["round1_frozen_objects"] = gc.get_freeze_count()
    if rank == 0:
        # definitions made in __main__ (a notebook, a script) that the receiver's own
        # __main__ also defines, differently: the sender's must run
        namespace: dict[str, Any] = {"__name__": "__main__"}
        exec(
            "class Shadowed:\n"
            "    def who(self):\n"
            "        return 'sender'\n"
            "def shadowed_func():\n"
            "    return 'sender'\n",
            namespace,
        )
        out["shadowed_func"] = rpc.rpc_sync(peer, namespace["shadowed_func"])
        out["shadowed_class"] = rpc.rpc_sync(peer, namespace["Shadowed"]).who()
    _, out["round1_shutdown_s"] = _timed(lambda: rpc.shutdown())
    out["after_shutdown"] = {
        "rpc_sync": _error(lambda: rpc.rpc_sync(peer, torch.add, args=(t, 1))),
        "rpc_async": _error(lambda: rpc.rpc_async(peer, torch.add, args=(t, 1))),
        "remote": _error(lambda: rpc.remote(peer, torch.add, args=(t, 1))),
        "get_worker_info": _error(lambda: rpc.get_worker_info()),
        "shutdown": _error(lambda: rpc.shutdown()),
    }
    out["after_shutdown_is_initialized"] = rpc.is_initialized()
    out["after_shutdown_frozen_objects"] = gc.get_freeze_count()

    _log("4. re-init on the same init method; graceful shutdown, uneven workload")
    if rank == 0:
        signal("round1-closed")
    else:
        out["round1_closed_seen"] = wait_signal("round1-closed")
    options.freeze_gc = False
    rpc.init_rpc(me, rank=rank, world_size=world_size, rpc_backend_options=options)
    out["round2_frozen_objects"] = gc.get_freeze_count()
    out["round2_peer"] = rpc.rpc_sync(peer, torch.add, args=(t, 10 + rank)).tolist()
    out["round2_infos"] = [(i.name, i.id) for i in rpc.get_worker_infos()]
    calls = 40
    if rank == 0:
        # Hold this worker's store open until worker1's next init_rpc has reached it,
        # as happens when worker1 re-inits while worker0 is still leaving (step 4b).
        out["race_setup"] = "unavailable"
        rendezvous = getattr(current_agent(), "_rendezvous", None)
        held = [getattr(rendezvous, "_root", None)]
        if held[0] is not None and hasattr(rendezvous, "close"):
            real_close = rendezvous.close

            def close_when_worker1_is_back() -> None:
                out["race_worker1_reached_old_store"] = wait_until(
                    lambda: int(held[0].add("actorrpc/inits", 0)) >= 3, 15
                )
                held.clear()  # keep no reference: the store lives as long as actorrpc keeps it
                real_close()

            rendezvous.close = close_when_worker1_is_back
            out["race_setup"] = "ok"
        futures = [rpc.rpc_async(peer, slow_work, args=(i, 0.02)) for i in range(calls)]
        _, out["round2_shutdown_s"] = _timed(lambda: rpc.shutdown())
        out["round2_done"] = sum(f.done() for f in futures)
        out["round2_results_ok"] = [f.wait() for f in futures] == [i * i for i in range(calls)]
    else:
        out["round2_first_call_arrived"] = _first_served.wait(20)
        out["round2_served_at_shutdown"] = served()
        _, out["round2_shutdown_s"] = _timed(lambda: rpc.shutdown())
        out["round2_served_after_shutdown"] = served()

    _log("4b. re-init at once, while worker0 may still be leaving")
    race_options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=10, init_timeout=2)
    out["race_reinit"] = _error(
        lambda: rpc.init_rpc(me, rank=rank, world_size=world_size, rpc_backend_options=race_options)
    )
    if rpc.is_initialized():
        out["race_peer"] = _error(lambda: rpc.rpc_sync(peer, whoami, timeout=10))
        out["race_shutdown"] = _error(lambda: rpc.shutdown(timeout=10))

    _log("4c. worker1 waits in shutdown while worker0 still calls it; the last to arrive "
         "at each barrier wakes the others")
    from actorrpc.agent import _rendezvous

    rpc.init_rpc(me, rank=rank, world_size=world_size, rpc_backend_options=options)
    polls = (_rendezvous.WOKEN_FIRST_POLL_INTERVAL, _rendezvous.MAX_WOKEN_POLL_INTERVAL)
    # every pause between polls of the barriers that are announced (arrived, idle) lasts
    # 30 s: only a BARRIER notification from the last rank to arrive ends it sooner
    _rendezvous.WOKEN_FIRST_POLL_INTERVAL = _rendezvous.MAX_WOKEN_POLL_INTERVAL = 30.0
    try:
        if rank == 0:
            store = current_agent()._rendezvous.store
            out["woken_peer_waits"] = wait_until(
                lambda: int(store.add("shutdown/arrived", 0)) == 1, 20
            )
            out["woken_peer_serves"] = rpc.rpc_sync(peer, whoami, timeout=10)
        _, out["woken_shutdown_s"] = _timed(lambda: rpc.shutdown(timeout=60))
    finally:
        _rendezvous.WOKEN_FIRST_POLL_INTERVAL, _rendezvous.MAX_WOKEN_POLL_INTERVAL = polls

    _log("5. env:// with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, torch's options class")
    torch_options = torch_rpc.TensorPipeRpcBackendOptions(rpc_timeout=25, num_worker_threads=4)
    rpc.init_rpc(
        f"worker{os.environ['RANK']}",
        backend=rpc.BackendType.TENSORPIPE,
        rpc_backend_options=torch_options,
    )
    info = rpc.get_worker_info()
    out["env_info"] = (info.name, info.id)
    out["env_world"] = len(rpc.get_worker_infos())
    out["env_timeout"] = rpc.get_rpc_timeout()
    out["env_peer"] = rpc.rpc_sync(peer, whoami)

    _log("6. worker1 never calls shutdown; then it leaves with graceful=False")
    if rank == 0:
        out["shutdown_timeout"] = _error(lambda: rpc.shutdown(timeout=3))
        out["shutdown_timeout_is_initialized"] = rpc.is_initialized()
        signal("worker0-left")
    else:
        out["saw_worker0_leave"] = wait_signal("worker0-left")
        start = time.monotonic()
        out["non_graceful"] = _error(lambda: rpc.shutdown(graceful=False))
        out["non_graceful_s"] = time.monotonic() - start
        out["non_graceful_is_initialized"] = rpc.is_initialized()
    _log("end")
    return out


def scenario_failures(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import actorrpc as rpc

    def unused_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    out: dict[str, Any] = {}
    out["before_init"] = _error(lambda: rpc.rpc_sync("worker1", torch.add, args=(1, 1)))

    _log("a world that never fills: ranks 1 and 2 never come")
    lonely = rpc.ZmqRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{unused_port()}", init_timeout=3
    )
    out["never_fills"] = _error(
        lambda: rpc.init_rpc("lonely", rank=0, world_size=3, rpc_backend_options=lonely)
    )

    _log("rank 1 of a group whose master (rank 0) never listens")
    orphan = rpc.ZmqRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{unused_port()}", init_timeout=3
    )
    out["unreachable_master"] = _error(
        lambda: rpc.init_rpc("orphan", rank=1, world_size=2, rpc_backend_options=orphan)
    )

    _log("the master's store goes away while rank 1 is joining")
    port = unused_port()
    holder = [
        dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)
    ]

    def drop_store_once_rank1_joined() -> None:
        out["lost_store_rank1_connected"] = wait_until(
            lambda: holder[0].check(["actorrpc/inits"]), 10
        )
        holder.clear()  # the last reference: the server stops

    killer = threading.Thread(target=drop_store_once_rank1_joined, daemon=True)
    killer.start()
    lost = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", init_timeout=5)
    out["lost_store"] = _error(
        lambda: rpc.init_rpc("joiner", rank=1, world_size=2, rpc_backend_options=lost)
    )
    killer.join(10)

    _log("env:// without MASTER_ADDR / MASTER_PORT, no RANK, no WORLD_SIZE")
    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(variable, None)
    out["env_without_master"] = _error(lambda: rpc.init_rpc("w", rank=0, world_size=1))
    out["no_rank"] = _error(lambda: rpc.init_rpc("w", world_size=1))
    out["no_world_size"] = _error(lambda: rpc.init_rpc("w", rank=0))
    out["rank_out_of_range"] = _error(lambda: rpc.init_rpc("w", rank=2, world_size=2))
    out["is_initialized_after_failures"] = rpc.is_initialized()
    out["frozen_objects_after_failures"] = gc.get_freeze_count()  # (unfrozen by each failure)

    _log("the failures left nothing behind: a 1-worker group works")
    solo = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{unused_port()}")
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=solo)
    out["solo_call"] = rpc.rpc_sync("solo", torch.add, args=(torch.ones(1), 1)).item()
    out["solo_remote"] = rpc.remote(0, whoami).to_here()
    _, out["solo_shutdown_s"] = _timed(lambda: rpc.shutdown())

    _log("a graceful shutdown that gives up names the request it still serves")
    stuck_options = rpc.ZmqRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{unused_port()}", shutdown_timeout=2
    )
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=stuck_options)
    stuck = rpc.rpc_async("solo", block_until_released)
    out["stuck_shutdown"] = _error(lambda: rpc.shutdown())
    _released.set()
    out["stuck_call"] = _error(stuck.wait)
    out["stuck_is_initialized"] = rpc.is_initialized()
    _log("end")
    return out


_released = threading.Event()


def block_until_released() -> str:
    _released.wait(60)
    return "released"


SCENARIOS: dict[str, Callable[[int, int, str], dict[str, Any]]] = {
    "lifecycle": scenario_lifecycle,
    "failures": scenario_failures,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--init-method", default="env://")
    args = parser.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        result = SCENARIOS[args.scenario](args.rank, args.world_size, args.init_method)
    except BaseException:  # noqa: BLE001 - reported, then a failing exit code
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print("RESULT " + json.dumps(result, default=repr), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from tests._scenarios import main as _main  # the importable copy holds all state

    _main()
