"""What waking libzmq's I/O thread costs a sender that was running, by scheduling policy.

    python benchmarks/send_preemption.py [--n 3000]

Two processes, each pinned to its own CPU, ping-pong small messages over a bare pyzmq
DEALER/ROUTER pair. Before each send the client either goes straight on or spins for
35 µs (as a thread that builds a call does); both ends wait for messages either
blocked in ``recv`` (the bare floor) or polling with ``sched_yield`` between polls
(actorrpc's busy poll). Each combination runs with libzmq's I/O threads under the default policy and
under ``SCHED_BATCH`` (``zmq.THREAD_SCHED_POLICY``), and prints the median time inside
``send`` and the median round trip. Under the default policy the woken I/O thread
preempts a sender that was running: its ``send`` takes ~20 µs. See
docs/performance.md, "Eleventh session".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import zmq

_SPIN_SECONDS = 35e-6


def _context(batch: bool) -> zmq.Context:  # type: ignore[type-arg]
    context: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    if batch:
        context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return context


def _server(port: int, batch: bool, poll: bool) -> None:
    os.sched_setaffinity(0, {1})
    router = _context(batch).socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    while True:
        if poll:
            _wait_polling(router)
        identity, body = router.recv_multipart()
        if body == b"quit":
            return
        router.send_multipart([identity, b"r" * 40])


def _wait_polling(socket: zmq.Socket) -> None:  # type: ignore[type-arg]
    """Poll until a message waits, yielding the core between polls (actorrpc's busy poll)."""
    while not socket.get(zmq.EVENTS) & zmq.POLLIN:
        os.sched_yield()


def _client(port: int, batch: bool, spin: bool, poll: bool, n: int) -> tuple[float, float]:
    dealer = _context(batch).socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    in_send: list[float] = []
    round_trips: list[float] = []
    for _ in range(n):
        began = time.perf_counter()
        if spin:
            until = began + _SPIN_SECONDS
            while time.perf_counter() < until:
                pass
        sending = time.perf_counter()
        dealer.send(b"x" * 60)
        sent = time.perf_counter()
        if poll:
            _wait_polling(dealer)
        dealer.recv()
        in_send.append(sent - sending)
        round_trips.append(time.perf_counter() - began)
    dealer.send(b"quit")
    warm = n // 5
    return statistics.median(in_send[warm:]) * 1e6, statistics.median(round_trips[warm:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--port", type=int, default=29871)
    args = parser.parse_args()
    if not hasattr(os, "SCHED_BATCH") or (os.cpu_count() or 1) < 2:
        raise SystemExit("needs Linux's SCHED_BATCH and two CPUs")
    os.sched_setaffinity(0, {0})
    print("I/O threads | before the send | waits by | in send (µs) | round trip (µs), medians")
    cases = [(b, s, p) for p in (False, True) for s in (False, True) for b in (False, True)]
    for index, (batch, spin, poll) in enumerate(cases):
        port = args.port + index
        server = mp.get_context("spawn").Process(target=_server, args=(port, batch, poll))
        server.start()
        in_send, round_trip = _client(port, batch, spin, poll, args.n)
        server.join(30)
        policy = "SCHED_BATCH" if batch else "default"
        before = "spun 35 µs" if spin else "waited"
        waits = "polling" if poll else "recv"
        print(f"{policy:>11} | {before:>15} | {waits:>8} | {in_send:12.1f} | {round_trip:15.1f}")


if __name__ == "__main__":
    main()
