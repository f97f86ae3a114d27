"""Start real actorrpc worker processes for the tests.

``python -m tests._cluster --rank R --world-size N --init-method URL`` joins the
group as ``worker<R>`` and leaves when every member calls ``shutdown``. A
watchdog ends the process if its parent (the pytest process) dies, so no worker
outlives a crashed test run.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from actorrpc._ports import free_ports

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(directory: str | os.PathLike[str], source: str, timeout: float) -> str:
    """Run ``source`` as a script in a fresh interpreter (the repository importable).

    Returns stdout and stderr together; fails the test (showing them) unless it exits 0.
    """
    script = os.path.join(directory, "script.py")
    with open(script, "w") as file:
        file.write(source)
    done = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT), cwd=directory,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def free_port() -> int:
    """A free port below the ephemeral range (see ``actorrpc._ports``)."""
    return free_ports("127.0.0.1", 1)[0]


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def spawn_workers(
    ranks: Sequence[int],
    world_size: int,
    init_method: str,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start ``python -m tests._cluster`` for each rank; returns the processes."""
    path = REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    full_env = dict(os.environ, PYTHONPATH=path)
    full_env.update(env or {})
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests._cluster", "--rank", str(rank), "--world-size",
             str(world_size), "--init-method", init_method, *extra_args],
            cwd=REPO_ROOT,
            env=full_env,
        )
        for rank in ranks
    ]


def dump_threads(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Print every thread's stack, here and in each running worker (a hang's diagnosis)."""
    faulthandler.dump_traceback(all_threads=True)
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGUSR1)


def stop_workers(processes: Sequence[subprocess.Popen[bytes]], timeout: float = 30.0) -> list[int]:
    """Wait for the workers to exit (killing stragglers); return their exit codes."""
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    return codes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--rpc-timeout", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--strict-leaks", action="store_true")
    args = parser.parse_args()
    # a hung worker's threads can be shown: conftest sends SIGUSR1 when shutdown fails
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    sys.path.insert(0, REPO_ROOT)
    import actorrpc as rpc

    options = rpc.ZmqRpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.rpc_timeout,
        num_worker_threads=args.threads,
        strict_rref_leaks=args.strict_leaks,
        # these workers wait in shutdown()'s barrier for the whole session, probing worker0
        # (the pytest process) all along: one answer over 5 s late while the suite loads
        # both cores (seen once in CI) would fail the session. Dead-peer detection itself
        # is tested on groups of its own (test_reliability.py).
        dead_peer_timeout=30.0,
    )
    rpc.init_rpc(f"worker{args.rank}", rank=args.rank, world_size=args.world_size,
                 rpc_backend_options=options)
    rpc.shutdown(timeout=0)


if __name__ == "__main__":
    main()
