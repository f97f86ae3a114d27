"""Bare pyzmq DEALER/ROUTER ping-pong between two processes: the floor for any ZMQ RPC.

No pickling, no threads: rank 1 binds a ROUTER and echoes every message, rank 0
connects a DEALER and measures.  Does not import torch.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import zmq
from _common import latency_stats, pin_process, time_calls
from _metrics import Config

MB = 1 << 20
STOP = b"stop"


def _serve(port: int, barrier: Any, timeout_s: float) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    barrier.wait(timeout_s)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(int(timeout_s * 1000)):
                return  # client vanished
            frames = sock.recv_multipart(copy=False)
            if frames[-1].bytes == STOP:
                return
            sock.send_multipart(frames, copy=False)
    finally:
        sock.close()
        ctx.term()


def _measure(port: int, barrier: Any, cfg: Config, queue: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    barrier.wait(30)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        payload = (12345).to_bytes(8, "little")

        def ping(_: int) -> None:
            sock.send(payload)
            sock.recv()

        stats = latency_stats(time_calls(ping, cfg.sync_warmup, cfg.sync_n))
        queue.put(("result", 0, "rpc_sync", stats))

        inflight = cfg.async_inflight

        def batch() -> None:
            for _ in range(inflight):
                sock.send(payload)
            for _ in range(inflight):
                sock.recv()

        batch()
        done = 0
        t0 = time.perf_counter()
        while done < cfg.async_total:
            batch()
            done += inflight
        elapsed = time.perf_counter() - t0
        queue.put(("result", 0, "rpc_async", {"msgs_per_s": done / elapsed, "inflight": inflight}))

        for name, size, warmup, n in (
            ("echo_1mb", MB, cfg.echo_1mb_warmup, cfg.echo_1mb_n),
            ("echo_64mb", 64 * MB, cfg.echo_64mb_warmup, cfg.echo_64mb_n),
        ):
            if n <= 0:
                queue.put(("result", 0, name, {"skipped": "skipped (--quick)"}))
                continue
            blob = bytearray(size)

            def echo(_: int, blob: bytearray = blob) -> None:
                sock.send(blob, copy=False)
                sock.recv(copy=False)

            stats = latency_stats(time_calls(echo, warmup, n))
            stats["gb_per_s"] = 2 * size / (stats["median_us"] / 1e6) / 1e9
            queue.put(("result", 0, name, stats))
        sock.send(STOP)
    finally:
        sock.close()
        ctx.term()


def floor_main(
    rank: int,
    world_size: int,
    port: int,
    queue: Any,
    barrier: Any,
    cfg: Config,
) -> None:
    """Spawned process entry point (see :class:`_common.Session`)."""
    del world_size
    try:
        pin_process(rank, cfg.pin)
        if rank == 1:
            _serve(port, barrier, 30.0)
        else:
            _measure(port, barrier, cfg, queue)
            queue.put(("done", 0, "", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        err = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        queue.put(("fatal", rank, "floor", err))
