"""Stress check of the rings' doorbell protocol: no lost wake-up (``transport/_ring.py``).

    python benchmarks/ring_wakeup_stress.py                 # 25 s, exit status 1 on a failure
    DURATION=60 WIDEN=1 python benchmarks/ring_wakeup_stress.py
    CONTROL=late DURATION=8 python benchmarks/ring_wakeup_stress.py   # must fail

The receiver (this process) loops on ``Transport.receive(3.0)``; two forked sender
processes take turns and send one message (or a burst) at a random moment after the
receiver took the previous one, so that sends often land while it is going to sleep,
through several rings, with occasional spills (bigger than a ring) and new links every
3 s (which go through the gated switch). A message that waited more than a second was
a lost wake-up: the receiver slept to its timeout although a message was there.
``WIDEN=1`` adds random spins inside both sides' race windows; ``CONTROL=late`` breaks
the reader on purpose (``asleep`` set after its last look), to show the check catches it.
Written by a review of the seventeenth session; figures in docs/performance.md.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import struct
import sys
import time

from _common import ensure_repo_on_path

ensure_repo_on_path()

DURATION = float(os.environ.get("DURATION", "25"))
TIMEOUT = 3.0
LATE = 1.0
CONTROL = os.environ.get("CONTROL", "")
WIDEN = os.environ.get("WIDEN", "") == "1"
_HDR = struct.Struct("<Qd")
NSENDERS = 2


def _spin(limit_us: float) -> None:
    end = time.perf_counter() + random.random() * limit_us * 1e-6
    while time.perf_counter() < end:
        pass


def sender(index: int, endpoint: str, conn, shared) -> None:
    from actorrpc.transport import Transport, _ring

    if WIDEN:  # a random pause between publishing head and reading 'asleep'
        real_fence = _ring.full_fence

        def fence() -> None:
            if random.random() < 0.5:
                _spin(30)
            real_fence()

        _ring.full_fence = fence
    rng = random.Random(index)
    generation = 0
    transports = []
    sent: dict[bytes, int] = {}

    def new_transport() -> None:
        nonlocal generation
        identity = b"%d:s%d.%d" % (10 + index, index, generation)
        generation += 1
        t = Transport(identity, security="none")
        link = t.link(b"1:receiver", endpoint)
        transports.append([t, link, identity, 0])
        sent[identity] = 0

    for _ in range(2):
        new_transport()
    deadline = time.monotonic() + DURATION
    next_new = time.monotonic() + 3.0
    n = 0
    while time.monotonic() < deadline:
        if time.monotonic() > next_new and len(transports) < 8:
            next_new = time.monotonic() + 3.0
            new_transport()
        acked, sent_total, turn = shared
        while not (turn.value == index and acked.value == sent_total.value):
            if time.monotonic() > deadline:
                break
            if turn.value != index:
                time.sleep(0.0005)
        if time.monotonic() > deadline:
            break
        r = rng.random()
        if r < 0.5:
            _spin(40)
        elif r < 0.8:
            time.sleep(rng.random() * 0.0003)
        before_total = sent_total.value
        entry = rng.choice(transports[-3:])
        t, link, identity, seq = entry
        payload = _HDR.pack(seq, time.monotonic())
        if rng.random() < 0.002:
            frames = [b"AR-x", payload, bytes(300_000)]  # > ring capacity: a spill
        elif rng.random() < 0.01:
            frames = [b"AR-x", payload + bytes(rng.randrange(10_000, 60_000))]
        else:
            frames = [b"AR-x", payload]
        link.send(frames)
        entry[3] = seq + 1
        sent[identity] = seq + 1
        n += 1
        r = rng.random()
        count = 1
        if r < 0.99:
            pass
        else:  # a burst
            for _ in range(rng.randrange(1, 50)):
                payload = _HDR.pack(entry[3], time.monotonic())
                link.send([b"AR-x", payload])
                entry[3] += 1
                sent[identity] = entry[3]
                count += 1
        sent_total.value = before_total + count
        turn.value = rng.randrange(NSENDERS)
    bells = sum(t[1].ring.bells for t in transports if t[1].ring is not None)
    rings = sum(1 for t in transports if t[1].ring is not None)
    conn.send((sent, bells, rings))
    conn.recv()  # the receiver has all
    for t in transports:
        t[0].close(linger=1.0)


def main() -> int:
    from actorrpc.transport import Transport, _ring, _ring_inbox, _zmq

    receiver = Transport(b"1:receiver", security="none")
    if CONTROL == "late":  # broken: asleep set after the last look, just before blocking
        real_fall_asleep = _ring_inbox.RingInbox.fall_asleep
        _ring_inbox.RingInbox.fall_asleep = lambda self: tuple(r for _, r in self.snapshot)
        real_poll = _zmq._zmq_poll

        def poll(items, timeout):
            real_fall_asleep(receiver._ring_inbox)
            return real_poll(items, timeout)

        _zmq._zmq_poll = poll
    if WIDEN:  # random pauses inside the reader's window
        real_drain = _ring.Doorbell.drain

        def drain(self):
            if random.random() < 0.5:
                _spin(30)
            real_drain(self)

        _ring.Doorbell.drain = drain
    ctx = mp.get_context("fork")
    shared = (ctx.RawValue("Q", 0), ctx.RawValue("Q", 0), ctx.RawValue("Q", 0))
    pipes, procs = [], []
    for i in range(NSENDERS):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=sender, args=(i, receiver.endpoint, child, shared), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    got: dict[bytes, int] = {}
    late = []
    worst = 0.0
    receives = empty = blocked = 0
    real_poll2 = _zmq._zmq_poll

    def counting_poll(items, timeout):
        nonlocal blocked
        blocked += 1
        return real_poll2(items, timeout)

    _zmq._zmq_poll = counting_poll
    results = {}
    end = time.monotonic() + DURATION + 60
    while time.monotonic() < end:
        started = time.monotonic()
        batch = receiver.receive(TIMEOUT)
        now = time.monotonic()
        receives += 1
        if not batch:
            empty += 1
        for m in batch:
            seq, sent_at = _HDR.unpack(bytes(memoryview(m[2])[:16]))
            latency = now - sent_at
            worst = max(worst, latency)
            if latency > LATE:
                late.append((m[0], seq, round(latency, 3), round(now - started, 3)))
            got[m[0]] = got.get(m[0], 0) + 1
        shared[0].value += len(batch)
        for i, pipe in enumerate(pipes):
            if i not in results and pipe.poll():
                results[i] = pipe.recv()
        if len(results) == len(pipes):
            expected = {k: v for r in results.values() for k, v in r[0].items()}
            if all(got.get(k, 0) >= v for k, v in expected.items()):
                break
    expected = {k: v for r in results.values() for k, v in r[0].items()}
    for pipe in pipes:
        pipe.send(None)
    for p in procs:
        p.join(10)
    missing = {k: v - got.get(k, 0) for k, v in expected.items() if got.get(k, 0) != v}
    print(f"control={CONTROL or 'none'} widen={WIDEN} messages={sum(got.values())} "
          f"receives={receives} empty={empty} blocked_polls={blocked} "
          f"rings_in={receiver.rings_in()} writer_bells={sum(r[1] for r in results.values())} "
          f"writer_rings={sum(r[2] for r in results.values())} worst_latency={worst:.4f}s")
    print(f"late (>{LATE}s): {len(late)} {late[:10]}")
    print(f"missing: {missing}")
    receiver.close()
    return 1 if late or missing else 0


if __name__ == "__main__":
    sys.exit(main())
