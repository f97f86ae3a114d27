"""Processes of a dynamic group (``init_rpc`` without a world size), for tests/test_dynamic.py.

``python -m tests._dynamic_group driver --init-method URL`` starts the group,
starts members (``python -m tests._dynamic_group member NAME ...``) that join
and leave while it runs, and prints one line ``RESULT {json}`` with what it
observed; the test makes the checks. Members obey orders sent over RPC
(:func:`order`): leave, leave at once (not graceful), crash, leave and join
again. ``... clash --init-method URL`` tries a taken name and a taken rank.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import actorrpc as rpc
from tests._waiting import wait_until

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_orders: queue.SimpleQueue[str] = queue.SimpleQueue()
_spawned: list[subprocess.Popen[str]] = []  # killed when the driver ends, however it ends
_T0 = time.monotonic()


def _log(step: str) -> None:
    print(f"[dynamic {time.monotonic() - _T0:6.2f}s] {step}", file=sys.stderr, flush=True)


# --- functions called over RPC ---------------------------------------------------------------


def order(what: str) -> None:
    _orders.put(what)


def names() -> list[str]:
    return [w.name for w in rpc.get_worker_infos()]


def my_rank() -> int:
    return rpc.get_worker_info().id


def call_peer(peer: str) -> float:
    return float(rpc.rpc_sync(peer, torch.add, args=(torch.ones(1), 41)).item())


def slow_square(x: int, seconds: float) -> int:
    threading.Event().wait(seconds)
    return x * x


# --- helpers ---------------------------------------------------------------------------------


def _options(init_method: str, **extra: Any) -> rpc.ZmqRpcBackendOptions:
    return rpc.ZmqRpcBackendOptions(init_method=init_method, init_timeout=60, **extra)


def _error(call: Callable[[], Any]) -> dict[str, Any] | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - described for the test
        return {"type": type(exc).__name__, "message": str(exc),
                "mro": [c.__name__ for c in type(exc).__mro__]}
    return None


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    process = subprocess.Popen(
        [sys.executable, "-m", "tests._dynamic_group", *args],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )
    _spawned.append(process)
    return process


def _result_of(process: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]), returncode=process.returncode)
    return {"returncode": process.returncode}


# --- roles -----------------------------------------------------------------------------------


def member(name: str, init_method: str, dead_peer_timeout: float) -> dict[str, Any]:
    options = _options(init_method, dead_peer_timeout=dead_peer_timeout)
    rpc.init_rpc(name, rpc_backend_options=options)
    out: dict[str, Any] = {"saw_at_join": names()}
    while True:
        what = _orders.get()
        _log(f"{name} got order {what!r}")
        if what == "crash":
            os._exit(17)
        if what == "rejoin":
            rpc.shutdown()
            out["after_leave"] = _error(names)
            rpc.init_rpc(name, rpc_backend_options=options)
            out["saw_at_rejoin"] = names()
            continue
        started = time.monotonic()
        rpc.shutdown(graceful=what != "leave_now")
        out["shutdown_seconds"] = time.monotonic() - started
        return out


def clash(init_method: str) -> dict[str, Any]:
    options = _options(init_method, dead_peer_timeout=2.0)
    out = {
        "taken_name": _error(lambda: rpc.init_rpc("w0", rpc_backend_options=options)),
        "taken_rank": _error(lambda: rpc.init_rpc("fresh", rank=1, rpc_backend_options=options)),
    }
    out["initialized_after"] = rpc.is_initialized()
    return out


def driver(init_method: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rpc.init_rpc("driver", rpc_backend_options=_options(init_method, dead_peer_timeout=2.0))
    out["alone"] = names()
    members = {name: _spawn("member", name, "--init-method", init_method) for name in ("w0", "w1")}
    out["all_joined"] = wait_until(lambda: len(names()) == 3, 60)
    out["driver_sees"] = names()
    out["w0_sees"] = rpc.rpc_sync("w0", names)
    out["w1_sees"] = rpc.rpc_sync("w1", names)
    out["w0_calls_w1"] = rpc.rpc_sync("w0", call_peer, args=("w1",))
    rref = rpc.remote("w1", torch.mul, args=(torch.ones(2), 3))
    out["rref_value"] = rref.to_here().tolist()
    del rref
    kept = rpc.remote("w1", torch.mul, args=(torch.ones(2), 5))  # outlives its owner
    kept.to_here()
    out["status_workers"] = _status_workers(init_method, 3)
    _log("a taken name, a taken rank")
    out["clash"] = _result_of(_spawn("clash", "--init-method", init_method))

    _log("w1 leaves with a call in flight")
    w1_info = rpc.get_worker_info("w1")
    in_flight = rpc.rpc_async("w1", slow_square, args=(7, 1.0))
    rpc.rpc_sync("w1", order, args=("leave",))
    out["in_flight_result"] = in_flight.wait()
    out["w1"] = _result_of(members.pop("w1"))
    out["w1_gone"] = wait_until(lambda: "w1" not in names(), 60)
    out["after_w1"] = names()
    out["call_by_name"] = _error(lambda: rpc.rpc_sync("w1", names))
    out["call_by_info"] = _error(lambda: rpc.rpc_sync(w1_info, names))
    out["get_info"] = _error(lambda: rpc.get_worker_info("w1"))
    out["w0_after_w1"] = rpc.rpc_sync("w0", names)
    out["w0_calls_w1_after"] = _error(lambda: rpc.rpc_sync("w0", call_peer, args=("w1",)))
    out["rref_of_departed"] = _error(kept.to_here)

    _log("w2 joins, crashes, and a new w2 takes its name")
    w2 = _spawn("member", "w2", "--init-method", init_method)
    out["w2_joined"] = wait_until(lambda: "w2" in names(), 60)
    old_rank = rpc.get_worker_info("w2").id
    rpc.rpc_async("w2", order, args=("crash",))
    w2.wait(30)
    out["w2_crash_code"] = w2.returncode
    new_w2 = _spawn("member", "w2", "--init-method", init_method, "--dead-peer-timeout", "1")
    out["new_w2_joined"] = wait_until(lambda: "w2" in names() and my_rank_of("w2") != old_rank, 60)
    out["w2_ranks"] = [old_rank, my_rank_of("w2")]
    out["after_new_w2"] = names()
    out["new_w2_answers"] = rpc.rpc_sync("w2", my_rank)

    _log("w0 leaves and joins again in one process")
    old_w0 = rpc.get_worker_info("w0").id
    rpc.rpc_sync("w0", order, args=("rejoin",))
    out["w0_back"] = wait_until(lambda: "w0" in names() and my_rank_of("w0") != old_w0, 60)
    out["w0_ranks"] = [old_w0, my_rank_of("w0")]
    out["w0_back_calls"] = rpc.rpc_sync("w0", call_peer, args=("w2",))

    _log("w0 and w2 leave (w2 not gracefully)")
    rpc.rpc_sync("w2", order, args=("leave_now",))
    out["w2"] = _result_of(new_w2)
    out["w2_gone"] = wait_until(lambda: "w2" not in names(), 30)
    rpc.rpc_sync("w0", order, args=("leave",))
    out["w0"] = _result_of(members.pop("w0"))
    out["at_end"] = names()
    started = time.monotonic()
    rpc.shutdown()
    out["driver_shutdown_seconds"] = time.monotonic() - started
    return out


def _status_workers(init_method: str, count: int) -> list[str]:
    """The workers ``actorrpc status`` lists once ``count`` have published."""
    from actorrpc.cli.status import read_status

    host, port = init_method[len("tcp://"):].rsplit(":", 1)
    seen: list[str] = []

    def listed() -> bool:
        seen[:] = sorted(w["worker"] for w in read_status(host, int(port), 5.0))
        return len(seen) >= count

    wait_until(listed, 15)
    return seen


def my_rank_of(name: str) -> int:
    try:
        return rpc.get_worker_info(name).id
    except Exception:  # noqa: BLE001 - not there (now)
        return -1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("driver", "member", "clash"))
    parser.add_argument("name", nargs="?")
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--dead-peer-timeout", type=float, default=2.0)
    args = parser.parse_args()
    if args.role == "driver":
        try:
            result = driver(args.init_method)
        finally:
            for process in _spawned:
                if process.poll() is None:
                    process.kill()
    elif args.role == "clash":
        result = clash(args.init_method)
    else:
        result = member(args.name, args.init_method, args.dead_peer_timeout)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    # run the importable module's main, so functions sent over RPC travel by reference
    from tests._dynamic_group import main as _main

    _main()
