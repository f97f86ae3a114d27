"""The median timeline of one call, both workers on one clock: where its time goes.

    python benchmarks/timeline.py [--mode sync|remote|echo|autograd|train|rref] [--n 2000] [--pin]
                                  [--probe MODULE:QUALNAME ...]

Two spawned actorrpc workers on this host (so ``time.perf_counter`` is one clock);
rank 0 makes ``--n`` calls of one kind to rank 1 after a warm-up. Both processes
record, with a timestamp, every message sent (``S`` when ``PeerLink.send`` is
entered, ``s`` when it returns), every message received (``R``, when
``Transport.receive`` hands it over), every request served (``V``/``v``: begin and
end of ``MessageDispatcher._serve``) and every user function run (``U``/``u``).
Events are prefixed ``A`` (the caller) or ``B`` (the callee) and carry the message
kind (``MessageKind`` value: 1 CALL, 2 RESPONSE, 4 REMOTE_CALL, 5 RREF_FETCH,
8 RREF_USER_DELETE, 9 backward, 10 AUTOGRAD_CLEANUP; ``echo`` sends 1 MiB; ``train`` is
one step of bench_rpc.py's RNN tutorial training step, ``benchmarks/_training.py``; ``rref``
passes an RRef to its owner). Iterations are
grouped by their sequence of events and, for the most common sequences, the median time of
each event since the iteration began is printed, with the median and 90th percentile of
the gap since the event before (per iteration: which step varies).
``--probe module:Class.method`` (repeatable) adds events on entering (``P``) and leaving
(``p``) any function; ``kind`` is then the probe's index.

Reading it: the gaps between ``R`` and the next ``S`` on one side are Python
(decoding, unpickling, the handler, pickling); ``S`` to ``s`` is the send (on a
pinned worker it includes libzmq's I/O thread, which runs on the same core);
``s`` to the peer's ``R`` is the wire. The recording itself adds a few µs per event.
In a compiled build (``ACTORRPC_COMPILE=1``) only ``R`` and ``V``/``v`` are recorded:
compiled modules call each other directly, past the wrappers (and past probes of
compiled functions); probes of Python functions (the facades, torch's methods) still
record. Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import ensure_repo_on_path

ensure_repo_on_path()

_EVENTS: list[tuple[float, str, int]] = []
_LEAVES = [torch.rand(64, 64, requires_grad=True) for _ in range(2)]
_MEGABYTE = torch.rand(1 << 18)  # 1 MiB of float32: shared memory between workers of a host


def noop(*args: Any) -> None:
    return None


def echo(value: Any) -> Any:
    return value


def recorded_events() -> list[tuple[float, str, int]]:
    return list(_EVENTS)


def _record_events() -> None:
    """Wrap the send, receive, serve and run steps so that each appends an event."""
    from actorrpc.agent import _calls, _dispatch
    from actorrpc.transport import _zmq

    clock = time.perf_counter
    events = _EVENTS
    send = _zmq.PeerLink.send
    receive = _zmq.Transport.receive
    serve = _dispatch.MessageDispatcher._serve
    run = _calls.run_user_function

    def recorded_send(self: Any, frames: Any) -> None:
        kind = bytes(frames[0][3:4])[0]
        events.append((clock(), "S", kind))
        send(self, frames)
        events.append((clock(), "s", kind))

    def recorded_receive(self: Any, *args: Any, **kwargs: Any) -> Any:
        messages = receive(self, *args, **kwargs)
        now = clock()
        events.extend((now, "R", m[1][3]) for m in messages if len(m) > 1 and len(m[1]) >= 20)
        return messages

    def recorded_serve(self: Any, kind: Any, *args: Any) -> None:
        events.append((clock(), "V", int(kind)))
        serve(self, kind, *args)
        events.append((clock(), "v", int(kind)))

    def recorded_run(func: Any, args: Any, kwargs: Any) -> Any:
        events.append((clock(), "U", 0))
        try:
            return run(func, args, kwargs)
        finally:
            events.append((clock(), "u", 0))

    _zmq.PeerLink.send = recorded_send  # type: ignore[method-assign]
    _zmq.Transport.receive = recorded_receive  # type: ignore[method-assign]
    _dispatch.MessageDispatcher._serve = recorded_serve  # type: ignore[method-assign]
    _dispatch.run_user_function = recorded_run  # type: ignore[attr-defined]


def _record_probes(probes: list[str]) -> None:
    """Wrap each ``module:Qual.name`` so that entering it records ``P<i>`` and leaving ``p<i>``."""
    import importlib

    clock = time.perf_counter
    events = _EVENTS
    for index, probe in enumerate(probes):
        module_name, _, qualname = probe.partition(":")
        owner: Any = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        static = isinstance(owner, type) and isinstance(vars(owner).get(name), staticmethod)

        def recorded(
            *args: Any, __original: Any = original, __index: int = index, **kwargs: Any
        ) -> Any:
            events.append((clock(), "P", __index))
            try:
                return __original(*args, **kwargs)
            finally:
                events.append((clock(), "p", __index))

        setattr(owner, name, staticmethod(recorded) if static else recorded)


_TRAIN_STEP: list[Any] = []  # the train mode's step, made on first use


def _train_step(rpc: Any) -> None:
    if not _TRAIN_STEP:
        from _training import make_train_step, stack_of

        import actorrpc.autograd as dist_autograd

        _TRAIN_STEP.append(make_train_step(stack_of("actorrpc", rpc, dist_autograd), "worker1")[0])
    _TRAIN_STEP[0]()


_OWNED_BY_PEER: list[Any] = []  # the rref mode's RRef, made on first use


def _one_call(rpc: Any, mode: str) -> Any:
    if mode == "train":
        return _train_step(rpc)
    if mode == "rref":
        if not _OWNED_BY_PEER:
            _OWNED_BY_PEER.append(rpc.remote("worker1", echo, args=(1,)))
        return rpc.rpc_sync("worker1", noop, args=(_OWNED_BY_PEER[0],))
    if mode == "remote":
        return rpc.remote("worker1", noop, args=(1,)).to_here()
    if mode == "echo":
        return rpc.rpc_sync("worker1", echo, args=(_MEGABYTE,))
    if mode == "autograd":
        import actorrpc.autograd as dist_autograd

        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync("worker1", torch.add, args=tuple(_LEAVES))
            dist_autograd.backward(ctx, [out.sum()])
            return dist_autograd.get_gradients(ctx)
    return rpc.rpc_sync("worker1", noop)


def _print_timeline(starts: list[float], events: list[tuple[float, str, int]]) -> None:
    events.sort()
    by_sequence: dict[tuple[tuple[str, int], ...], list[list[float]]] = defaultdict(list)
    for begin, end in zip(starts, starts[1:]):
        first = bisect.bisect_left(events, (begin,))
        last = bisect.bisect_left(events, (end,))
        window = events[first:last]
        key = tuple((what, kind) for _, what, kind in window)
        by_sequence[key].append([when - begin for when, _, _ in window] + [end - begin])
    total = len(starts) - 1
    for key, rows in sorted(by_sequence.items(), key=lambda item: -len(item[1]))[:2]:
        print(f"{len(rows)} of {total} iterations had this sequence (median µs since it began;"
              " the gap since the event before, per iteration: median / 90th percentile):")
        medians = [statistics.median(column) * 1e6 for column in zip(*rows)]
        gaps = _gap_quantiles(rows)
        for (what, kind), median, (gap, gap90) in zip(key, medians, gaps):
            print(f"  {median:8.1f}  {what}  kind {kind:<3d}  gap {gap:6.1f} / {gap90:6.1f}")
        gap, gap90 = gaps[-1]
        print(f"  {medians[-1]:8.1f}  end of the iteration  gap {gap:6.1f} / {gap90:6.1f}")


def _gap_quantiles(rows: list[list[float]]) -> list[tuple[float, float]]:
    """Per column of ``rows`` (times since each iteration began, in seconds): the median
    and 90th percentile (µs) of the gap since the column before (the first: since the
    start), taken per iteration. A median timeline alone hides which step varies."""
    quantiles = []
    before = [0.0] * len(rows)
    for column in zip(*rows):
        gaps = sorted((now - then) * 1e6 for now, then in zip(column, before))
        quantiles.append((statistics.median(gaps), gaps[(9 * (len(gaps) - 1)) // 10]))
        before = list(column)
    return quantiles


def _worker(rank: int, port: int, mode: str, n: int, pin: bool, probes: list[str]) -> None:
    if pin:
        os.sched_setaffinity(0, {rank})
        torch.set_num_threads(1)  # (as bench_rpc.py pins: two threads on one CPU wait)
    _record_events()
    _record_probes(probes)
    import actorrpc as rpc

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        for _ in range(300):
            _one_call(rpc, mode)
        # the callee's events so far are skipped by count (fetching them adds events)
        skip = len(rpc.rpc_sync("worker1", recorded_events))
        _EVENTS.clear()
        starts = []
        for _ in range(n):
            starts.append(time.perf_counter())
            _one_call(rpc, mode)
        starts.append(time.perf_counter())
        mine = list(_EVENTS)
        theirs = rpc.rpc_sync("worker1", recorded_events)[skip:]
        _print_timeline(
            starts, [(t, "A" + w, k) for t, w, k in mine] + [(t, "B" + w, k) for t, w, k in theirs]
        )
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode", choices=("sync", "remote", "echo", "autograd", "train", "rref"), default="sync"
    )
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--pin", action="store_true", help="pin rank r to CPU r")
    parser.add_argument("--port", type=int, default=29771)
    parser.add_argument(
        "--probe", action="append", default=[], metavar="MODULE:QUALNAME",
        help="also record entering (P<i>) and leaving (p<i>) this function; repeatable",
    )
    args = parser.parse_args()
    for index, probe in enumerate(args.probe):
        print(f"probe {index}: {probe}")
    mp.spawn(_worker, args=(args.port, args.mode, args.n, args.pin, args.probe), nprocs=2)


if __name__ == "__main__":
    main()
