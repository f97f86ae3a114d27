"""Python-level calls per call, on both workers: how many frames one RPC walks through.

    python benchmarks/frame_counts.py [--mode sync|async|remote|autograd] [--n 500] [--pin]
                                      [--top 40] [--port PORT]

Two spawned actorrpc workers; every thread of both traces function calls
(``sys.settrace`` / ``threading.settrace``) but counts only while rank 0 makes ``--n``
calls of one kind to rank 1 after a warm-up (rank 1 is switched on and off by an RPC,
whose own frames add a few calls). For each side it prints the Python calls per call
(a generator's every resumption counts as one) with the inbox polling loop's three
functions left out (their count depends on how long a side waits), then the most
frequent functions. ``async`` pipelines windows of 500 calls as ``bench_rpc.py`` does.

Between messages the caches are cold here, so each frame costs ~0.5-1.5 µs: the count
tracks a path's cost where timers (which perturb what they time) cannot. Counts, not
times, so it runs at any speed; tracing slows both workers several times over.
Figures are in docs/performance.md ("Twenty-first session").
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections import Counter
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import ensure_repo_on_path, free_port

ensure_repo_on_path()

_POLLING = ("RingReader.ready", "Transport._socket_has_message", "RingInbox.any_ready")
_ASYNC_WINDOW = 500
_LEAVES = [torch.rand(64, 64, requires_grad=True) for _ in range(2)]
_COUNTS: Counter[str] = Counter()
_COUNTING = [False]


def noop(*args: Any) -> None:
    return None


def _trace(frame: Any, event: str, arg: Any) -> None:
    if _COUNTING[0] and event == "call":
        code = frame.f_code
        _COUNTS[f"{os.path.basename(code.co_filename)}:{code.co_qualname}"] += 1
    return None


def set_counting(on: bool) -> dict[str, int] | None:
    """Switch counting on or off in this worker; off returns the counts and clears them."""
    _COUNTING[0] = on
    if on:
        return None
    counts = dict(_COUNTS)
    _COUNTS.clear()
    return counts


def _calls_of(rpc: Any, mode: str) -> int:
    """Make one unit of calls; the number of calls it was."""
    if mode == "async":
        for future in [rpc.rpc_async("worker1", noop, args=(1,)) for _ in range(_ASYNC_WINDOW)]:
            future.wait()
        return _ASYNC_WINDOW
    if mode == "remote":
        rpc.remote("worker1", noop, args=(1,)).to_here()
    elif mode == "autograd":
        import actorrpc.autograd as dist_autograd

        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync("worker1", torch.add, args=tuple(_LEAVES))
            dist_autograd.backward(ctx, [out.sum()])
            dist_autograd.get_gradients(ctx)
    else:
        rpc.rpc_sync("worker1", noop, args=(1,))
    return 1


def _report(side: str, counts: dict[str, int], calls: int, top: int) -> None:
    kept = {name: n for name, n in counts.items() if not name.endswith(_POLLING)}
    print(f"== {side}: {sum(kept.values()) / calls:.1f} Python calls per call "
          f"(polling left out: {sum(counts.values()) / calls - sum(kept.values()) / calls:.1f})")
    for name, n in sorted(kept.items(), key=lambda item: -item[1])[:top]:
        print(f"   {n / calls:7.2f}  {name}")


def _worker(rank: int, port: int, mode: str, n: int, pin: bool, top: int) -> None:
    if pin:
        os.sched_setaffinity(0, {rank})
    threading.settrace(_trace)
    sys.settrace(_trace)
    import actorrpc as rpc

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        units = max(1, n // _ASYNC_WINDOW) if mode == "async" else n
        for _ in range(max(2, units // 5)):  # warm-up
            _calls_of(rpc, mode)
        rpc.rpc_sync("worker1", set_counting, args=(True,))
        _COUNTING[0] = True
        calls = sum(_calls_of(rpc, mode) for _ in range(units))
        _COUNTING[0] = False
        mine = dict(_COUNTS)
        theirs = rpc.rpc_sync("worker1", set_counting, args=(False,))
        print(f"{mode}: {calls} calls" + (", pinned" if pin else ""))
        _report("caller (rank 0)", mine, calls, top)
        _report("callee (rank 1)", theirs, calls, top)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sync", "async", "remote", "autograd"), default="sync")
    parser.add_argument("--n", type=int, default=500, help="calls (async: rounded to windows)")
    parser.add_argument("--pin", action="store_true", help="pin rank r to CPU r")
    parser.add_argument("--top", type=int, default=40, help="functions listed per side")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    port = args.port or free_port()
    mp.start_processes(_worker, args=(port, args.mode, args.n, args.pin, args.top), nprocs=2,
                       start_method="spawn")


if __name__ == "__main__":
    main()
