"""CPU that idle workers use, side by side: what a group costs while nobody calls.

    python benchmarks/idle_cpu.py [--world 2] [--seconds 8] [--backends torch,actorrpc]
                                  [--timeout 120]

For each backend, ``--world`` spawned workers start a group, make one all-to-all round
of ``rpc_async`` calls (so every connection exists), wait a second, then sit idle for
``--seconds`` while each measures the CPU time its threads ran
(``time.process_time``: the scheduler's own count, in ns, threads that ended included;
not the tick-sampled ``utime``). Prints, per backend, the idle CPU of the whole group
(% of one CPU) and per worker (ms of CPU per second).

On these 2-vCPU VMs every sleep-and-wake of a thread costs ~0.2 ms of CPU (a bare
``time.sleep(0.05)`` loop: 227 µs per wake-up), so an idle worker's CPU is mostly its
wake-ups: actorrpc's I/O thread looks at its timed work 20 times a second. Figures are
in docs/performance.md.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import Session, ensure_repo_on_path

ensure_repo_on_path()

from _metrics import Backend  # noqa: E402 - needs the repository on the path


def noop() -> None:
    return None


def _worker(rank: int, world_size: int, port: int, out: Any, barrier: Any, name: str,
            seconds: float) -> None:
    """Spawned process (``_common.Session``): reports ``("cpu", rank, seconds of CPU)``,
    or ``("fatal", rank, message)``."""
    try:
        backend = Backend(name, port)
        rpc = backend.rpc
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=backend.options)
        try:
            calls = [rpc.rpc_async(f"worker{peer}", noop)
                     for peer in range(world_size) if peer != rank]
            for call in calls:
                call.wait()
            time.sleep(1.0)  # (the round's after-effects: rides, releases, back-offs)
            began = time.process_time()
            time.sleep(seconds)
            out.put(("cpu", rank, time.process_time() - began))
        finally:
            rpc.shutdown()
    except BaseException as exc:
        out.put(("fatal", rank, f"{type(exc).__name__}: {exc}"))
        raise


def measure(name: str, world: int, seconds: float, timeout: float = 120.0) -> float:
    """Seconds of CPU per second that the whole idle group of ``name`` used."""
    session = Session(_worker, world, (name, seconds))
    session.start()
    used: dict[int, float] = {}
    deadline = time.monotonic() + timeout + seconds
    try:
        while len(used) < world:
            kind, rank, value = session.get(deadline - time.monotonic())  # SessionError late
            if kind == "fatal":
                raise RuntimeError(f"{name}, rank {rank}: {value}")
            used[rank] = value
    finally:
        session.close(grace=10.0)
    return sum(used.values()) / seconds


def summarize(name: str, world: int, cpu_per_second: float) -> str:
    return (f"{name}: {world} idle workers use {cpu_per_second * 100:.1f}% of one CPU "
            f"({cpu_per_second / world * 1e3:.2f} ms of CPU per second each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--backends", default="torch,actorrpc")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per backend")
    args = parser.parse_args()
    for name in args.backends.split(","):
        used = measure(name, args.world, args.seconds, args.timeout)
        print(summarize(name, args.world, used), flush=True)


if __name__ == "__main__":
    main()
