"""CPU per call, thread by thread, on both workers: where a call's time goes.

    python benchmarks/cpu_per_call.py [--mode sync|async|remote|echo|autograd] [--n 4000]
                                      [--size BYTES] [--pin] [--profile]

Two spawned actorrpc workers; rank 0 makes ``--n`` calls of one kind to rank 1
(after a warm-up) and prints the latency (median, p90, p99) and, for every
thread of both processes that used CPU, its CPU time per call (from
``/proc/self/task/*/stat``: user + system, 10 ms ticks, so use a few thousand
calls) and its voluntary + involuntary context switches per call (from
``/proc/self/task/*/status``). ``ZMQbg/IO`` threads are libzmq's own; the others
carry their Python names (``MainThread``, ``actorrpc-io-<worker>``, pool threads
``actorrpc-<worker>-<n>``). ``--pin`` pins rank r to CPU r, as ``bench_rpc.py
--pin split`` does. ``async`` pipelines in windows of 500 calls in flight, as
bench_rpc does. ``autograd`` is bench_rpc's iteration (a
context, an RPC'd ``torch.add`` of two 64x64 tensors, backward, get_gradients);
``--profile`` also prints the caller's main thread's costliest functions (cProfile; sorted by
``PROFILE_SORT``, default ``cumulative``, e.g. ``PROFILE_SORT=tottime``).
A waiting thread's busy polling counts as CPU: ``ACTORRPC_BUSY_POLL=0 python
benchmarks/cpu_per_call.py ...`` shows the CPU of the work alone (with blocking
waits, whose wake-ups cost more). So each side's line ``busy polls`` splits the
wall time of a call between the spins of its receiving thread's busy polls (the
transport's own count) and the rest: the work, and the waits that are not spins
(a call's critical path is the two sides' rests, less what they overlap).
Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import ensure_repo_on_path

ensure_repo_on_path()


def noop(*args: Any) -> None:
    return None


def echo(value: Any) -> Any:
    return value


def thread_cpu() -> dict[str, tuple[float, int, int]]:
    """Per thread of this process, keyed ``name:tid``: CPU seconds used so far, and
    voluntary and involuntary context switches so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    usage: dict[str, tuple[float, int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = python_names.get(int(tid)) or comm.read().strip()
            with open(f"/proc/self/task/{tid}/status") as status:
                switches = dict(line.split(":", 1) for line in status if "ctxt_switches" in line)
        except OSError:
            continue  # the thread ended meanwhile
        usage[f"{name}:{tid}"] = (
            (int(fields[11]) + int(fields[12])) / ticks,
            int(switches["voluntary_ctxt_switches"]),
            int(switches["nonvoluntary_ctxt_switches"]),
        )
    return usage


def spun_seconds() -> float:
    """Seconds the busy polls of this worker's transport spun so far."""
    from actorrpc.agent import current_agent

    return current_agent()._transport.spin_counts()[0]


def _cpu_and_spins() -> tuple[dict[str, tuple[float, int, int]], float]:
    """:func:`thread_cpu` and :func:`spun_seconds` of this process, in one call."""
    return thread_cpu(), spun_seconds()


def _report_spins(side: str, spun: float, elapsed: float, n: int) -> None:
    print(f"  {side:6s} busy polls spun {spun / n * 1e6:7.1f} us/call, "
          f"the rest {(elapsed - spun) / n * 1e6:7.1f} us/call")


def _report(side: str, before: dict[str, tuple[float, int, int]],
            after: dict[str, tuple[float, int, int]], n: int) -> None:
    for thread in sorted(after):
        cpu, voluntary, involuntary = (
            now - then for now, then in zip(after[thread], before.get(thread, (0.0, 0, 0)))
        )
        if cpu > 0:
            print(f"  {side:6s} {thread:28s} {cpu / n * 1e6:7.1f} us/call"
                  f"  {voluntary / n:5.2f} + {involuntary / n:5.2f} switches/call")


_ASYNC_WINDOW = 500
_LEAVES = [torch.rand(64, 64, requires_grad=True) for _ in range(2)]


def _autograd_iteration(rpc: Any) -> Any:
    import actorrpc.autograd as dist_autograd

    with dist_autograd.context() as ctx:
        out = rpc.rpc_sync("worker1", torch.add, args=tuple(_LEAVES))
        dist_autograd.backward(ctx, [out.sum()])
        return dist_autograd.get_gradients(ctx)


def _one_call(rpc: Any, mode: str, payload: Any) -> Any:
    if mode == "autograd":
        return _autograd_iteration(rpc)
    if mode == "sync":
        return rpc.rpc_sync("worker1", noop)
    if mode == "remote":
        return rpc.remote("worker1", noop, args=(1,)).to_here()
    return rpc.rpc_sync("worker1", echo, args=(payload,))


def _worker(rank: int, port: int, mode: str, n: int, size: int, pin: bool,
            profile: bool = False) -> None:
    if pin:
        os.sched_setaffinity(0, {rank})
    import actorrpc as rpc

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        payload = torch.rand(max(1, size // 4))
        for _ in range(300):
            _one_call(rpc, "sync" if mode == "async" else mode, payload)
        peer_before, peer_spun = rpc.rpc_sync("worker1", _cpu_and_spins)
        before, spun = _cpu_and_spins()
        latencies: list[float] = []
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        if mode == "async":  # bench_rpc.py's pattern: windows of 500 calls in flight
            for first in range(0, n, _ASYNC_WINDOW):
                window = min(_ASYNC_WINDOW, n - first)
                for future in [rpc.rpc_async("worker1", noop) for _ in range(window)]:
                    future.wait()
        else:
            for _ in range(n):
                begin = time.perf_counter()
                _one_call(rpc, mode, payload)
                latencies.append(time.perf_counter() - begin)
        elapsed = time.perf_counter() - started
        if profiler is not None:
            profiler.disable()
        after, spun_after = _cpu_and_spins()
        peer_after, peer_spun_after = rpc.rpc_sync("worker1", _cpu_and_spins)
        spun, peer_spun = spun_after - spun, peer_spun_after - peer_spun
        line = f"{mode}: {n / elapsed:,.0f} calls/s"
        if latencies:
            latencies.sort()
            line += (
                f", median {statistics.median(latencies) * 1e6:.0f} us, "
                f"p90 {latencies[int(n * 0.9)] * 1e6:.0f}, p99 {latencies[int(n * 0.99)] * 1e6:.0f}"
            )
        if mode == "echo":
            line += f", {2 * size / statistics.median(latencies) / 1e9:.2f} GB/s"
        print(line)
        _report("caller", before, after, n)
        _report("callee", peer_before, peer_after, n)
        _report_spins("caller", spun, elapsed, n)
        _report_spins("callee", peer_spun, elapsed, n)
        if profiler is not None:
            order = os.environ.get("PROFILE_SORT", "cumulative")
            stats = pstats.Stats(profiler).sort_stats(order)
            stats.print_stats(40)
            if os.environ.get("PROFILE_CALLERS"):  # who calls the functions matching it
                stats.print_callers(os.environ["PROFILE_CALLERS"])
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sync", "async", "remote", "echo", "autograd"),
                        default="sync")
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--size", type=int, default=1 << 20, help="echo payload bytes")
    parser.add_argument("--pin", action="store_true", help="pin rank r to CPU r")
    parser.add_argument("--profile", action="store_true", help="cProfile the caller")
    parser.add_argument("--port", type=int, default=29761)
    args = parser.parse_args()
    mp.spawn(_worker, args=(args.port, args.mode, args.n, args.size, args.pin, args.profile),
             nprocs=2)


if __name__ == "__main__":
    main()
