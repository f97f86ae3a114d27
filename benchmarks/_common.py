"""Shared helpers for the actorrpc benchmarks.

Only the standard library is imported at module level so that this module is cheap to
import in every spawned benchmark process (including the bare-pyzmq floor processes,
which must not pay for ``import torch``).
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# A message sent by a benchmark process to the parent: (kind, rank, key, payload).
Msg = tuple[str, int, str, Any]


def ensure_repo_on_path() -> None:
    """Make ``import actorrpc`` work when the scripts are run as ``python benchmarks/x.py``."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now, below the ephemeral range (``actorrpc._ports``)."""
    ensure_repo_on_path()
    from actorrpc._ports import free_ports

    return free_ports("127.0.0.1", 1)[0]


def run_worker_pair(worker: Callable[..., None], args: tuple[Any, ...], name: str,
                    result_timeout: float) -> Any:
    """Spawn ``worker(rank, *args, results)`` for ranks 0 and 1 (``MASTER_ADDR`` and
    ``MASTER_PORT`` set to a free local port), return the first value put on ``results``
    (``queue.Empty`` after ``result_timeout`` s: a hang; the workers are killed) and wait
    at most 60 s for both to exit (then kill them and raise ``TimeoutError`` naming
    ``name``)."""
    import torch.multiprocessing as torch_mp  # (not at module level: see the docstring)

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    results = torch_mp.get_context("spawn").Queue()
    processes = torch_mp.start_processes(worker, args=(*args, results), nprocs=2, join=False,
                                         start_method="spawn")
    try:
        result = results.get(timeout=result_timeout)
    except BaseException:  # a hang or an interrupt: no workers left behind
        for process in processes.processes:
            process.kill()
        raise
    deadline = time.monotonic() + 60
    while not processes.join(timeout=1):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            raise TimeoutError(f"{name}: the workers did not exit within 60 s")
    return result


def pin_process(rank: int, mode: str) -> list[int] | None:
    """``mode="split"``: pin this process (and threads it starts later) to one CPU.

    Rank r gets CPU ``r % ncpu`` of the CPUs this process may use, so with two ranks on
    a two-core machine each process owns one core.  On small VMs a ping-pong between
    processes on different cores costs ~3x more than on the same core, and the kernel's
    placement of unpinned processes varies run to run; pinning makes runs comparable.
    """
    if mode != "split" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return [cpu]


def rss_mb() -> float:
    """Resident set size of this process in MiB, from /proc/self/status (VmRSS)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return math.nan


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def latency_stats(samples_s: Sequence[float]) -> dict[str, float]:
    """Median / p99 / mean in microseconds of per-call durations given in seconds."""
    us = sorted(x * 1e6 for x in samples_s)
    return {
        "median_us": float(statistics.median(us)),
        "p99_us": percentile(us, 99.0),
        "mean_us": float(statistics.fmean(us)),
        "n": float(len(us)),
    }


def time_calls(
    fn: Callable[[int], object], warmup: int, n: int, warmup_s: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Call ``fn(i)`` untimed ``warmup`` times and for at least ``warmup_s`` seconds, then
    ``n`` times timed; return the timed durations (s)."""
    started = clock()
    i = 0
    while i < warmup or clock() - started < warmup_s:
        fn(i)
        i += 1
    samples: list[float] = []
    for i in range(n):
        t0 = clock()
        fn(i)
        samples.append(clock() - t0)
    return samples


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return f"not importable ({type(exc).__name__})"
    return str(getattr(mod, "__version__", "unknown"))


def python_probe_us(rounds: int = 300) -> float:
    """Median µs of a fixed pure-Python loop (``sum(range(1000))``): this host's Python speed.

    actorrpc's per-message path is Python and torch's is C++, so their ratio moves with
    it: the probe tells hosts (and slow phases of one shared host) apart in the records.
    """
    return latency_stats(time_calls(lambda _: sum(range(1000)), 10, rounds))["median_us"]


IDLE_LOAD = 0.5
"""The 1-minute load average under which a run starts "on an idle host" (``bench_rpc.py``
warns above it: the previous run's processes, or other work, still weigh on the figures)."""


def wait_until_idle(
    limit_s: float,
    threshold: float = IDLE_LOAD,
    loadavg: Callable[[], tuple[float, float, float]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
    poll_s: float = 5.0,
) -> tuple[float, bool]:
    """Wait (at most ``limit_s``) until the 1-minute load average is under ``threshold``.

    Returns the seconds waited and whether the load got there. The load average decays
    over about a minute, so right after another run this takes a minute or two.
    """
    read_load = loadavg or os.getloadavg
    start = clock()
    while True:
        if read_load()[0] < threshold:
            return clock() - start, True
        left = start + limit_s - clock()
        if left <= 0:
            return clock() - start, False
        pause(min(poll_s, left))


def machine_info() -> dict[str, Any]:
    """Describe the machine and the software versions the figures were taken with."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "nproc": os.cpu_count(),
        "nproc_affinity": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "pyzmq": _version("zmq"),
        "dill": _version("dill"),
        "loadavg_at_start": list(os.getloadavg()),
        "python_probe_us_at_start": python_probe_us(),
    }
    try:
        import zmq

        info["libzmq"] = zmq.zmq_version()
    except Exception:  # noqa: BLE001
        info["libzmq"] = "unknown"
    ensure_repo_on_path()
    info["actorrpc"] = _version("actorrpc")
    info["actorrpc_build"] = actorrpc_build()
    return info


def actorrpc_build() -> str:
    """``compiled (mypyc, N modules)`` or ``pure Python``: the actorrpc this process (and
    the workers it spawns, which import the same tree) runs."""
    ensure_repo_on_path()
    import actorrpc

    compiled = actorrpc.compiled_modules()
    return f"compiled (mypyc, {len(compiled)} modules)" if compiled else "pure Python"


class SessionError(Exception):
    """Raised by :meth:`Session.get` when the processes stall or die."""


class Session:
    """``world_size`` fresh processes (spawn start method) reporting through one queue.

    ``target`` is called as ``target(rank, world_size, port, queue, barrier, *args)`` and
    must be importable by the children (i.e. live in a module, not in ``__main__``).
    """

    def __init__(self, target: Callable[..., None], world_size: int, args: tuple[Any, ...]) -> None:
        ctx = mp.get_context("spawn")
        self.port = free_port()
        self.queue: Any = ctx.Queue()
        self.barrier: Any = ctx.Barrier(world_size)
        self.procs = [
            ctx.Process(
                target=target,
                args=(rank, world_size, self.port, self.queue, self.barrier, *args),
                name=f"bench-rank{rank}",
            )
            for rank in range(world_size)
        ]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    def get(self, timeout: float) -> Msg:
        """Next message; raises :class:`SessionError` on timeout or if every process died."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionError(f"timeout: no progress within {timeout:.0f} s")
            try:
                msg: Msg = self.queue.get(timeout=min(0.25, left))
                return msg
            except queue_mod.Empty:
                pass
            if all(not p.is_alive() for p in self.procs):
                # The feeder threads flush before a process exits; drain once more.
                try:
                    msg = self.queue.get(timeout=0.25)
                    return msg
                except queue_mod.Empty:
                    codes = [p.exitcode for p in self.procs]
                    raise SessionError(
                        f"processes exited without reporting (exit codes {codes})"
                    ) from None

    def alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def close(self, grace: float) -> list[int | None]:
        """Wait up to ``grace`` seconds for the processes, then terminate/kill leftovers."""
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        codes = [p.exitcode for p in self.procs]
        self.queue.close()
        self.queue.cancel_join_thread()
        return codes
