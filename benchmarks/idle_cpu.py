"""CPU that idle workers use, side by side: what a group costs while nobody calls.

    python benchmarks/idle_cpu.py [--world 2] [--seconds 8] [--backends torch,actorrpc]
                                  [--timeout 120] [--threads] [--in-shutdown]

For each backend, ``--world`` spawned workers start a group, make one all-to-all round
of ``rpc_async`` calls (so every connection exists), wait a second, then sit idle for
``--seconds`` while each measures the CPU time its threads ran
(``time.process_time``: the scheduler's own count, in ns, threads that ended included;
not the tick-sampled ``utime``). Prints, per backend, the idle CPU of the whole group
(% of one CPU) and per worker (ms of CPU per second); with ``--threads``, also each
thread's share and how often it ran (``/proc/self/task/*/schedstat``: ns on the CPU and
times scheduled, of the threads alive at both ends of the window), averaged over the
workers, a worker's own name shown as ``worker<r>``. With ``--in-shutdown``, every rank
but 0 has called ``shutdown()`` and waits there for rank 0 during the window (as a
serving rank often does in torch's examples), while rank 0 idles outside it.

On these 2-vCPU VMs every sleep-and-wake of a thread costs ~0.2 ms of CPU (a bare
``time.sleep(0.05)`` loop: 227 µs per wake-up), so an idle worker's CPU is mostly its
wake-ups: actorrpc's I/O thread looks at its timed work once a second while the worker
is quiet (20 times a second before the twenty-sixth session). Figures are in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import defaultdict
from typing import Any

from _common import Session, ensure_repo_on_path

ensure_repo_on_path()

from _metrics import Backend  # noqa: E402 - needs the repository on the path


def noop() -> None:
    return None


def _thread_clocks(rank: int) -> dict[int, tuple[str, int, int]]:
    """Per thread id of this process: (its name, ns it ran, times it was scheduled)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    clocks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = names.get(int(tid)) or comm.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                ran, _, runs = (int(field) for field in stat.read().split())
        except OSError:  # (it ended)
            continue
        clocks[int(tid)] = (name.replace(f"worker{rank}", "worker<r>"), ran, runs)
    return clocks


_SHUTDOWN_LEAD = 0.5
"""Seconds between the other ranks' call of ``shutdown`` and the window (``--in-shutdown``)."""


def _measure_idle(rank: int, seconds: float, out: Any) -> None:
    """Report the CPU this process uses over the next ``seconds`` (see ``_worker``)."""
    clocks, began = _thread_clocks(rank), time.process_time()
    time.sleep(seconds)
    used = time.process_time() - began
    threads = [(name_, (ran - clocks[tid][1]) / 1e9, runs - clocks[tid][2])
               for tid, (name_, ran, runs) in _thread_clocks(rank).items()
               if tid in clocks]
    out.put(("cpu", rank, (used, threads)))


def _worker(rank: int, world_size: int, port: int, out: Any, barrier: Any, name: str,
            seconds: float, in_shutdown: bool = False) -> None:
    """Spawned process (``_common.Session``): reports ``("cpu", rank, (seconds of CPU,
    [(thread name, seconds, times scheduled)]))``, or ``("fatal", rank, message)``.
    ``in_shutdown``: every rank but 0 waits in ``shutdown`` during the window (measured
    by a thread of its own), while rank 0 idles outside it."""
    try:
        backend = Backend(name, port)
        rpc = backend.rpc
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=backend.options)
        shut_down = False
        try:
            calls = [rpc.rpc_async(f"worker{peer}", noop)
                     for peer in range(world_size) if peer != rank]
            for call in calls:
                call.wait()
            time.sleep(1.0)  # (the round's after-effects: rides, releases, back-offs)
            if in_shutdown and rank != 0:
                def measure_later() -> None:
                    try:
                        time.sleep(_SHUTDOWN_LEAD)
                        _measure_idle(rank, seconds, out)
                    except BaseException as exc:
                        out.put(("fatal", rank, f"{type(exc).__name__}: {exc}"))

                measuring = threading.Thread(target=measure_later)
                measuring.start()
                shut_down = True
                rpc.shutdown()  # (waits for rank 0, which calls it after its window)
                measuring.join()
                return
            if in_shutdown:
                time.sleep(_SHUTDOWN_LEAD)
            _measure_idle(rank, seconds, out)
        finally:
            if not shut_down:
                rpc.shutdown()
    except BaseException as exc:
        out.put(("fatal", rank, f"{type(exc).__name__}: {exc}"))
        raise


def measure(name: str, world: int, seconds: float, timeout: float = 120.0,
            in_shutdown: bool = False) -> tuple[float, list[tuple[str, float, float]]]:
    """Seconds of CPU per second that the whole idle group of ``name`` used, and per
    thread name (mean over the workers): seconds of CPU and times scheduled per second."""
    session = Session(_worker, world, (name, seconds, in_shutdown))
    session.start()
    used: dict[int, float] = {}
    threads: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    deadline = time.monotonic() + timeout + seconds
    try:
        while len(used) < world:
            kind, rank, value = session.get(deadline - time.monotonic())  # SessionError late
            if kind == "fatal":
                raise RuntimeError(f"{name}, rank {rank}: {value}")
            used[rank], per_thread = value
            for thread, ran, runs in per_thread:
                threads[thread][0] += ran / seconds / world
                threads[thread][1] += runs / seconds / world
    finally:
        session.close(grace=10.0)
    ranked = sorted(((thread, ran, runs) for thread, (ran, runs) in threads.items()),
                    key=lambda row: -row[1])
    return sum(used.values()) / seconds, ranked


def summarize(name: str, world: int, cpu_per_second: float) -> str:
    return (f"{name}: {world} idle workers use {cpu_per_second * 100:.1f}% of one CPU "
            f"({cpu_per_second / world * 1e3:.2f} ms of CPU per second each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--backends", default="torch,actorrpc")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per backend")
    parser.add_argument("--threads", action="store_true", help="also each thread's share")
    parser.add_argument("--in-shutdown", action="store_true",
                        help="every rank but 0 waits in shutdown() during the window")
    args = parser.parse_args()
    for name in args.backends.split(","):
        used, threads = measure(name, args.world, args.seconds, args.timeout, args.in_shutdown)
        print(summarize(name, args.world, used), flush=True)
        if args.threads:
            for thread, ran, runs in threads:
                if ran >= 1e-5 or runs >= 0.1:
                    print(f"  {thread}: {ran * 1e3:.2f} ms of CPU per second, "
                          f"scheduled {runs:.1f} times a second", flush=True)


if __name__ == "__main__":
    main()
