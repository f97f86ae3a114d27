"""Same-run A/B of one switch in actorrpc: alternating blocks, both workers switched.

    python benchmarks/ab_switch.py --switch agent:held.enabled --modes remote --pin
    python benchmarks/ab_switch.py --switch actorrpc.autograd._functions:_functorch_active \\
        --on-value "lambda: False" --off-value "lambda: True" --modes autograd

On hosts whose speed changes from one minute to the next, two separate runs cannot
tell a 5 % change from the noise; alternating blocks of calls in one pair of workers
can. Two spawned workers (rank 0 measures, rank 1 serves); for each mode, a warm-up,
then ``--blocks`` blocks of calls, the switch set to its "on" value in even blocks and
its "off" value in odd ones, on both workers at once (an RPC sets it on rank 1). Each
block's median latency (or throughput, for ``async``) is printed, then the median of
the blocks per side and the change.

``--switch`` names what to set: ``MODULE:ATTR`` (a module global, e.g.
``actorrpc.transport._zmq:_SOME_FLAG``) or ``agent:ATTR.PATH`` (an attribute reached
from the worker's agent, e.g. ``agent:held.enabled``). ``--on-value`` / ``--off-value``
are Python expressions (default ``True`` / ``False``), evaluated on each worker.
Modes: ``sync`` (rpc_sync of a no-op), ``remote`` (remote().to_here()), ``rebind``
(``rref = remote(...)``, then ``rref.to_here()``: each remote() drops the RRef made
before), ``autograd`` (bench_rpc's iteration), ``async`` (windows of 500 rpc_async,
each future waited on in turn), ``async_all`` (the same, waited on with
``torch.futures.wait_all`` as bench_rpc does: the replies are taken by the agent's I/O
thread while the caller blocks in C++), ``tensor`` (rpc_sync of ``torch.add`` on two
64x64 tensors, outside autograd), ``tensors32`` (rpc_sync of a no-op with a list of 32
4x4 tensors) and ``rref`` (rpc_sync passing an RRef to its owner).
Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import ensure_repo_on_path, free_port

ensure_repo_on_path()

MODES = ("sync", "remote", "rebind", "autograd", "async", "async_all", "tensor", "tensors32",
         "rref")
_BLOCK_CALLS = {"sync": 300, "remote": 250, "rebind": 250, "autograd": 120, "async": 2000,
                "async_all": 2000, "tensor": 250, "tensors32": 200, "rref": 300}
_THROUGHPUT_MODES = ("async", "async_all")
_REBOUND: dict[str, Any] = {}
_ASYNC_WINDOW = 500
_LEAVES = [torch.rand(64, 64, requires_grad=True) for _ in range(2)]
_TENSORS = [leaf.detach() for leaf in _LEAVES]
_SMALL_TENSORS = [torch.rand(4, 4) for _ in range(32)]


def noop(*args: Any) -> None:
    return None


def parse_switch(text: str) -> tuple[str, str, list[str]]:
    """``"MODULE:ATTR"`` or ``"agent:A.B"`` -> (where, first name, attribute path)."""
    where, sep, path = text.partition(":")
    names = path.split(".")
    if not sep or not where or not all(name.isidentifier() for name in names):
        raise argparse.ArgumentTypeError(
            f"--switch must be MODULE:ATTR or agent:ATTR.PATH, got {text!r}"
        )
    return where, names[0], names[1:]


def set_switch(switch: str, expression: str) -> None:
    """Set the attribute ``switch`` names to ``eval(expression)`` in this process."""
    where, first, rest = parse_switch(switch)
    if where == "agent":
        from actorrpc.agent import current_agent

        owner: Any = current_agent()
        names = [first, *rest]
    else:
        owner = importlib.import_module(where)
        names = [first, *rest]
    for name in names[:-1]:
        owner = getattr(owner, name)
    if not hasattr(owner, names[-1]):
        raise AttributeError(f"{switch}: {type(owner).__name__} has no attribute {names[-1]!r}")
    setattr(owner, names[-1], eval(expression))  # noqa: S307 - a developer's own switch value


def _one_call(rpc: Any, mode: str) -> None:
    if mode == "sync":
        rpc.rpc_sync("worker1", noop)
    elif mode == "remote":
        rpc.remote("worker1", noop, args=(1,)).to_here()
    elif mode == "rebind":  # the RRef made before is dropped between remote() and to_here()
        _REBOUND["rref"] = rpc.remote("worker1", noop, args=(1,))
        _REBOUND["rref"].to_here()
    elif mode == "tensor":
        rpc.rpc_sync("worker1", torch.add, args=(_TENSORS[0], _TENSORS[1]))
    elif mode == "tensors32":  # a message of many small tensors (a list of parameters)
        rpc.rpc_sync("worker1", noop, args=(_SMALL_TENSORS,))
    elif mode == "rref":  # an RRef passed to its owner
        if "owned" not in _REBOUND:
            _REBOUND["owned"] = rpc.remote("worker1", noop, args=(1,))
        rpc.rpc_sync("worker1", noop, args=(_REBOUND["owned"],))
    else:
        import actorrpc.autograd as dist_autograd

        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync("worker1", torch.add, args=tuple(_LEAVES))
            dist_autograd.backward(context_id, [out.sum()])
            dist_autograd.get_gradients(context_id)


def _block(rpc: Any, mode: str, calls: int) -> float:
    """Median µs of ``calls`` calls, or calls/s for the ``async`` modes."""
    if mode in _THROUGHPUT_MODES:
        windows = max(1, calls // _ASYNC_WINDOW)
        began = time.perf_counter()
        for _ in range(windows):
            futures = [rpc.rpc_async("worker1", noop) for _ in range(_ASYNC_WINDOW)]
            if mode == "async_all":
                torch.futures.wait_all(futures)
            else:
                for future in futures:
                    future.wait()
        return windows * _ASYNC_WINDOW / (time.perf_counter() - began)
    latencies = []
    for _ in range(calls):
        began = time.perf_counter()
        _one_call(rpc, mode)
        latencies.append(time.perf_counter() - began)
    return statistics.median(latencies) * 1e6


def summarize(mode: str, on: list[float], off: list[float]) -> str:
    """One line: each side's blocks and median, and the change from off to on."""
    unit = "calls/s" if mode in _THROUGHPUT_MODES else "µs"
    on_median, off_median = statistics.median(on), statistics.median(off)
    better = on_median > off_median if mode in _THROUGHPUT_MODES else on_median < off_median
    change = (on_median - off_median) / off_median * 100
    wins = sum((a > b) if mode in _THROUGHPUT_MODES else (a < b) for a, b in zip(on, off))
    return (
        f"{mode:8s} on : {' / '.join(f'{x:,.0f}' for x in on)} -> {on_median:,.0f} {unit}\n"
        f"{'':8s} off: {' / '.join(f'{x:,.0f}' for x in off)} -> {off_median:,.0f} {unit}\n"
        f"{'':8s} on vs off {change:+.1f} % ({'better' if better else 'worse'}; "
        f"on better in {wins} of {len(on)} block pairs)"
    )


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    if args.pin:
        os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    import actorrpc as rpc

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        set_switch(args.switch, args.on_value)  # fail early on a bad switch
        for mode in args.modes:
            calls = args.calls or _BLOCK_CALLS[mode]
            _block(rpc, mode, calls)  # warm-up
            sides: dict[bool, list[float]] = {True: [], False: []}
            for block in range(args.blocks):
                on = block % 2 == 0
                value = args.on_value if on else args.off_value
                set_switch(args.switch, value)
                rpc.rpc_sync("worker1", set_switch, args=(args.switch, value))
                sides[on].append(_block(rpc, mode, calls))
            print(summarize(mode, sides[True], sides[False]), flush=True)
        set_switch(args.switch, args.on_value)
        rpc.rpc_sync("worker1", set_switch, args=(args.switch, args.on_value))
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", required=True,
                        help="MODULE:ATTR or agent:ATTR.PATH (see the module docstring)")
    parser.add_argument("--on-value", default="True")
    parser.add_argument("--off-value", default="False")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES),
                        help=f"comma list of: {','.join(MODES)}")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per mode (even: on)")
    parser.add_argument("--calls", type=int, default=0, help="calls per block (0: per mode)")
    parser.add_argument("--pin", action="store_true", help="pin rank r to CPU r")
    args = parser.parse_args(argv)
    parse_switch(args.switch)
    unknown = [mode for mode in args.modes if mode not in MODES]
    if unknown or args.blocks < 2:
        parser.error(f"unknown modes {unknown}" if unknown else "--blocks must be >= 2")
    began = time.perf_counter()
    mp.spawn(_worker, args=(free_port(), args), nprocs=2)
    print(f"total wall time {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
