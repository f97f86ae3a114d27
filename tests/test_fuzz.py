"""Fuzzing the protocol layer of a live worker with malformed messages.

A dedicated 3-worker group (never the session ``cluster``): ``worker0`` drives,
``worker1`` is the target, ``worker2`` lends its routing id. Holding the group
secret, the driver connects two raw DEALER sockets to the target's inbox, so
the bytes pass ZAP authentication and reach the protocol layer:

* ``anon``: a routing id that is no member's, so every message must be dropped
  at the membership check;
* ``forged``: ``worker2``'s routing id (``worker2`` itself never connects to
  the target while the fuzz runs), so messages with a valid header and
  ``sender == 2`` get as far as unpickling and the handlers, and replies go to
  ``worker2``, which drops them as unknown.

It sends thousands of seeded random malformed messages: random frame counts and
bytes, truncated and oversized headers, wrong magic and versions, unknown kinds,
reserved flags, valid headers with garbage or wrongly shaped pickles, buffer
counts that do not match (up to 65535), responses to unknown ids, headers
claiming another rank, and 1 MB frames. Interleaved, it makes legitimate
``rpc_sync`` calls (which must all return the right value) and sends valid
forged ``CALL``s of ``bump`` (which must all run exactly once, while the same
call from a non-member or claiming another rank must never run).
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorrpc.errors import ProtocolError
from actorrpc.protocol import (
    HEADER_SIZE,
    PROTOCOL_VERSION,
    MessageKind,
    decode_header,
    encode_header,
)
from tests.test_reliability import GroupRun, run_group

FUZZ_MESSAGES = 3000
FUZZ_SEED = 20240613
FUZZ_MODULE = "actorrpc_fuzz_scenarios"

FUZZ_SOURCE = r'''
"""The fuzz scenario; ``main()`` runs one role and prints RESULT {json}."""

import collections
import json
import os
import pickle
import random
import struct
import sys
import threading
import time
import traceback

import torch
import zmq

import actorrpc as rpc
from tests._waiting import wait_for
from actorrpc.agent import current_agent
from actorrpc.protocol import PROTOCOL_VERSION, MessageKind
from actorrpc.serialization import dumps

HARD_LIMIT = float(os.environ.get("SCENARIO_HARD_LIMIT", "110"))
_release = threading.Event()
_lock = threading.Lock()
_bumps = 0
_waiting = {}


# -- functions called over RPC (legitimately or by forged messages) ---------------------

def echo(x):
    return x


def bump():
    global _bumps
    with _lock:
        _bumps += 1
    return True


def bumps():
    with _lock:
        return _bumps


def release():
    _release.set()
    return True


def block(limit=60.0):
    _release.wait(limit)
    return "released"


def serving_agent():
    wait_for(rpc.is_initialized, 30, "init_rpc to return on this worker")
    return current_agent()


def target_state():
    agent = serving_agent()
    return {"inflight": agent._inflight, "pending": len(agent._pending),
            "stats": {k: agent.stats[k] for k in ("requests_served", "bytes_in")},
            "pool": agent._pool.size,
            "dead": sorted(agent.liveness.dead_peers)}


def start_waiting_call():
    """On the target: call worker0 (which blocks); return that call's message id."""
    agent = serving_agent()
    future = rpc.rpc_async("worker0", block)
    _waiting["future"] = future
    ids = [mid for mid, p in agent._pending.items() if p.future is future]
    return ids[0]


def waiting_call_state():
    future = _waiting["future"]
    if not future.done():
        return {"done": False}
    try:
        return {"done": True, "value": repr(future.wait())}
    except BaseException as exc:  # noqa: BLE001
        return {"done": True, "error": f"{type(exc).__name__}: {exc}"}


# -- helpers ----------------------------------------------------------------------------

def outcome(fn):
    t0 = time.monotonic()
    try:
        result = {"ok": True, "value": repr(fn())[:300]}
    except BaseException as exc:  # noqa: BLE001
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc)[:2000]}
    result["elapsed"] = time.monotonic() - t0
    return result


def init(ctx):
    rank = ctx["rank"]
    options = rpc.ZmqRpcBackendOptions(init_method=ctx["init_method"], rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=ctx["world_size"],
                 rpc_backend_options=options)


def role_held(ctx):
    """Join; stay out of shutdown (whose probes would connect to the target) until released."""
    init(ctx)
    released = _release.wait(100)
    state = target_state()
    return {"released": released, "state": state,
            "shutdown": outcome(lambda: rpc.shutdown(timeout=60))}


# -- the fuzzer -------------------------------------------------------------------------

HEADER = struct.Struct("!2sBBHHIQ")
REQUEST_KINDS = [k for k in MessageKind if k not in (MessageKind.RESPONSE, MessageKind.EXCEPTION)]
LENGTHS = [0, 1, 2, 7, 19, 20, 21, 33, 64, 300, 4096]
SHAPES = [None, 0, -1, 1.5, "x", b"", [], {}, (), (None,), ("a",), (1, 2, 3), (None,) * 4,
          ("a",) * 5, (None,) * 6, (0,) * 7, {"a": 1}, [None] * 4]


def header(kind, nbuffers=0, sender=2, mid=1, magic=b"AR", version=PROTOCOL_VERSION, flags=0):
    return HEADER.pack(magic, version, kind, flags, nbuffers, sender, mid)


class Fuzzer:
    def __init__(self, rng):
        self.rng = rng
        self.valid_call, _ = dumps((echo, (1,), {}, {}))
        self.mid = 10 ** 12

    def next_mid(self):
        self.mid += 1
        return self.mid

    def garbage_pickle(self):
        rng = self.rng
        choice = rng.randrange(6)
        if choice == 0:
            return rng.randbytes(rng.choice(LENGTHS))
        if choice == 1:
            return self.valid_call[: rng.randrange(len(self.valid_call))]
        if choice == 2:
            return b"\x80\x05" + rng.randbytes(rng.randrange(1, 64))
        if choice == 3:
            return b"cno_such_module_for_fuzz\nthing\n."
        if choice == 4:
            return pickle.dumps(rng.choice(SHAPES))
        return self.valid_call + rng.randbytes(rng.randrange(1, 16))

    def message(self):
        """Return (category, frames, use the forged socket)."""
        rng = self.rng
        forged = rng.random() < 0.7
        kind = int(rng.choice(list(MessageKind)))
        category = rng.choice([
            "random frames", "bad header length", "bad magic", "bad version", "unknown kind",
            "flags set", "garbage payload", "wrong-shaped payload", "buffer count mismatch",
            "garbage buffers", "response to unknown id", "claims another rank", "big frame",
            "empty frames", "inline payload",
        ])
        if category == "random frames":
            frames = [rng.randbytes(rng.choice(LENGTHS)) for _ in range(rng.randint(1, 6))]
        elif category == "bad header length":
            valid = header(kind, mid=self.next_mid())
            length = rng.choice([0, 1, 2, 3, 4, 10, 19, 21, 24, 40, 1000])
            frames = [(valid + rng.randbytes(1000))[:length], self.garbage_pickle()]
        elif category == "bad magic":
            magic = rng.choice([b"RA", b"\x00\x00", b"ar", rng.randbytes(2)])
            magic = b"ZZ" if magic == b"AR" else magic
            frames = [header(kind, magic=magic, mid=self.next_mid()), self.valid_call]
        elif category == "bad version":
            version = rng.choice([v for v in (0, 1, 2, 3, 4, 127, 255) if v != PROTOCOL_VERSION])
            frames = [header(kind, version=version, mid=self.next_mid()), self.valid_call]
        elif category == "unknown kind":
            frames = [header(rng.choice([0, *range(13, 256)]), mid=self.next_mid()),
                      self.valid_call]
        elif category == "flags set":
            frames = [header(kind, flags=rng.randrange(1, 65536), mid=self.next_mid()),
                      self.garbage_pickle()]
        elif category == "garbage payload":
            frames = [header(int(rng.choice(REQUEST_KINDS)), mid=self.next_mid()),
                      self.garbage_pickle()]
        elif category == "wrong-shaped payload":
            frames = [header(int(rng.choice(REQUEST_KINDS)), mid=self.next_mid()),
                      pickle.dumps(rng.choice(SHAPES))]
        elif category == "buffer count mismatch":
            declared = rng.choice([1, 2, 3, 255, 65535])
            carried = rng.randrange(0, min(declared, 4))
            if rng.random() < 0.3:
                declared, carried = 0, rng.randint(1, 3)
            frames = [header(kind, nbuffers=declared, mid=self.next_mid()),
                      self.garbage_pickle(), *[rng.randbytes(rng.choice(LENGTHS))
                                               for _ in range(carried)]]
        elif category == "garbage buffers":
            count = rng.randint(1, 4)
            frames = [header(int(rng.choice(REQUEST_KINDS)), nbuffers=count, mid=self.next_mid()),
                      self.garbage_pickle(), *[rng.randbytes(rng.choice(LENGTHS))
                                               for _ in range(count)]]
        elif category == "response to unknown id":
            frames = [header(rng.choice([MessageKind.RESPONSE, MessageKind.EXCEPTION]),
                             mid=rng.randrange(10 ** 9, 2 ** 64)), self.garbage_pickle()]
        elif category == "claims another rank":
            sender = rng.choice([0, 1, 3, 99, 2 ** 32 - 1])
            bump_call, _ = dumps((bump, (), {}, {}))
            frames = [header(MessageKind.CALL, sender=sender, mid=self.next_mid()), bump_call]
        elif category == "big frame":
            frames = [header(int(rng.choice(REQUEST_KINDS)), mid=self.next_mid()),
                      rng.randbytes(1 << 20)]
        elif category == "inline payload":  # FLAG_INLINE_PAYLOAD (8), alone or misused
            flags = rng.choice([8, 8, 8 | 1, 8 | 4, 8 | rng.randrange(1, 65536)])
            payload = rng.choice([self.garbage_pickle(), pickle.dumps(rng.choice(SHAPES)), b""])
            frames = [header(int(rng.choice(REQUEST_KINDS)), flags=flags,
                             nbuffers=rng.choice([0, 0, 1]), mid=self.next_mid()) + payload,
                      *[rng.randbytes(rng.choice(LENGTHS)) for _ in range(rng.choice([0, 0, 1]))]]
        else:  # empty frames
            frames = [b""] * rng.randint(1, 4)
        return category, frames, forged


def dealer(context, endpoint, secret, routing_id):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.SNDTIMEO, 10000)
    sock.setsockopt_string(zmq.PLAIN_USERNAME, "actorrpc")
    sock.setsockopt_string(zmq.PLAIN_PASSWORD, secret)
    sock.connect(endpoint)
    return sock


def driver(ctx):
    init(ctx)
    args = ctx["args"]
    agent = current_agent()
    target = agent._members[1]
    secret = agent._transport._secret
    donor = agent._members[2].identity
    rng = random.Random(args["seed"])
    fuzzer = Fuzzer(rng)
    context = zmq.Context()
    sockets = {True: dealer(context, target.endpoint, secret, donor),
               False: dealer(context, target.endpoint, secret, b"fuzz-" + os.urandom(4))}
    bump_call, _ = dumps((bump, (), {}, {}))
    res = {"categories": collections.Counter(), "send_failures": 0, "legit_calls": 0,
           "legit_ok": 0, "legit_errors": [], "forged_bumps": 0, "anon_bumps": 0}
    t0 = time.monotonic()
    for i in range(args["messages"]):
        category, frames, forged = fuzzer.message()
        res["categories"][category] += 1
        try:
            sockets[forged].send_multipart(frames)
        except zmq.Again:
            res["send_failures"] += 1
        if i % 100 == 50:  # a valid request from a member's routing id: must run once
            sockets[True].send_multipart([header(MessageKind.CALL, mid=fuzzer.next_mid()),
                                          bump_call])
            res["forged_bumps"] += 1
        if i % 100 == 75:  # the same from a non-member: must never run
            sockets[False].send_multipart([header(MessageKind.CALL, mid=fuzzer.next_mid()),
                                           bump_call])
            res["anon_bumps"] += 1
        if i % 50 == 0:
            res["legit_calls"] += 1
            value = torch.full((3,), float(i)) if i % 150 == 0 else i
            try:
                got = rpc.rpc_sync("worker1", echo, args=(value,), timeout=30)
                same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
                res["legit_ok"] += bool(same)
            except Exception as exc:  # noqa: BLE001 - reported
                res["legit_errors"].append(f"{i}: {type(exc).__name__}: {exc}"[:500])
    res["fuzz_seconds"] = time.monotonic() - t0
    expected = res["forged_bumps"]
    res["bumps"] = outcome(lambda: wait_for(
        lambda: rpc.rpc_sync("worker1", bumps) >= expected, 60, f"{expected} bumps"))
    res["bumps_final"] = rpc.rpc_sync("worker1", bumps)
    # every request the target accepted was answered: only our own query is in flight
    res["settled"] = outcome(lambda: wait_for(
        lambda: rpc.rpc_sync("worker1", target_state)["inflight"] == 1, 60, "no request stuck"))
    res["target_state"] = rpc.rpc_sync("worker1", target_state)

    # A RESPONSE from worker2 must not complete the target's call that waits on worker0.
    mid = rpc.rpc_sync("worker1", start_waiting_call)
    answer, _ = dumps("forged")
    sockets[True].send_multipart([header(MessageKind.RESPONSE, mid=mid), answer])
    sockets[True].send_multipart([header(MessageKind.CALL, mid=fuzzer.next_mid()), bump_call])
    # the bump is processed after the forged response (one connection, in order)
    wait_for(lambda: rpc.rpc_sync("worker1", bumps) >= res["bumps_final"] + 1, 30,
             "the bump after the forged response")
    res["misrouted_response"] = rpc.rpc_sync("worker1", waiting_call_state)
    release()  # worker0's `block` returns; the real answer reaches the target
    res["waiting_call_final"] = outcome(lambda: wait_for(
        lambda: rpc.rpc_sync("worker1", waiting_call_state)["done"], 30, "the real answer"))
    res["waiting_call_final"] = rpc.rpc_sync("worker1", waiting_call_state)

    for sock in sockets.values():
        sock.close(linger=0)
    context.term()
    res["after_close"] = rpc.rpc_sync("worker1", echo, args=("still serving",))
    rpc.rpc_sync("worker1", release)
    rpc.rpc_sync("worker2", release)
    res["shutdown"] = outcome(lambda: rpc.shutdown(timeout=60))
    res["categories"] = dict(res["categories"])
    return res


def _watchdog(parent):
    start = time.monotonic()
    while os.getppid() == parent and time.monotonic() - start < HARD_LIMIT:
        time.sleep(0.5)
    os._exit(3)


def main():
    scenario, rank, world_size, init_method, workdir, args = sys.argv[1:7]
    ctx = {"rank": int(rank), "world_size": int(world_size), "init_method": init_method,
           "workdir": workdir, "args": json.loads(args)}
    threading.Thread(target=_watchdog, args=(os.getppid(),), daemon=True).start()
    try:
        result = driver(ctx) if ctx["rank"] == 0 else role_held(ctx)
        code = 0
    except BaseException:  # noqa: BLE001
        result = {"crash": traceback.format_exc()}
        code = 1
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(code)
'''


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("fuzz"), "fuzz", 3,
                     {"messages": FUZZ_MESSAGES, "seed": FUZZ_SEED},
                     module=FUZZ_MODULE, source=FUZZ_SOURCE)


@pytest.mark.timeout(120)
def test_fuzzed_worker_keeps_serving(fuzzed):
    result = fuzzed.result(0)
    assert sum(result["categories"].values()) == FUZZ_MESSAGES
    assert len(result["categories"]) == 15, result["categories"]
    assert result["send_failures"] == 0, result
    assert result["legit_errors"] == [], result["legit_errors"]
    assert result["legit_ok"] == result["legit_calls"] == FUZZ_MESSAGES // 50, result
    assert result["after_close"] == "still serving"


@pytest.mark.timeout(120)
def test_fuzzed_worker_runs_valid_member_requests_exactly_once(fuzzed):
    result = fuzzed.result(0)
    assert result["bumps"]["ok"], result["bumps"]
    # forged member requests ran once each; non-members and headers claiming another rank
    # (whose payload is the same bump) never ran
    assert result["bumps_final"] == result["forged_bumps"] == FUZZ_MESSAGES // 100, result


@pytest.mark.timeout(120)
def test_fuzzed_worker_answers_every_request_and_shuts_down_cleanly(fuzzed):
    result = fuzzed.result(0)
    assert result["settled"]["ok"], (result["settled"], result["target_state"])
    assert result["target_state"]["dead"] == [], result["target_state"]
    assert result["shutdown"]["ok"], result["shutdown"]
    for rank in (1, 2):
        assert fuzzed.result(rank)["shutdown"]["ok"], fuzzed.describe()
    assert [r.returncode for r in fuzzed.ranks] == [0, 0, 0], fuzzed.describe()
    target_log = fuzzed.ranks[1].stderr
    assert "error in the I/O loop" not in target_log, target_log[-5000:]
    assert "unhandled error in a pool task" not in target_log, target_log[-5000:]
    # malformed input is logged rate-limited, not once per message
    assert len(target_log.splitlines()) < 300, target_log[-5000:]


@pytest.mark.timeout(120)
def test_response_from_the_wrong_peer_is_ignored(fuzzed):
    result = fuzzed.result(0)
    assert result["misrouted_response"] == {"done": False}, result["misrouted_response"]
    assert result["waiting_call_final"] == {"done": True, "value": "'released'"}, result


# --- the header codec, property-based (no processes) -----------------------------------------


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_decode_header_accepts_or_raises_protocol_error(frame):
    try:
        header = decode_header(frame)
    except ProtocolError:
        return
    assert len(frame) == HEADER_SIZE and frame[:2] == b"AR" and frame[2] == PROTOCOL_VERSION
    assert isinstance(header.kind, MessageKind)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(list(MessageKind)), st.integers(0, 65535), st.integers(0, 2**32 - 1),
       st.integers(0, 2**64 - 1))
def test_encode_decode_round_trip(kind, nbuffers, sender, message_id):
    header = decode_header(encode_header(kind, nbuffers, sender, message_id))
    assert (header.kind, header.nbuffers, header.sender, header.message_id) == (
        kind, nbuffers, sender, message_id)


def test_encode_header_rejects_too_many_buffers():
    with pytest.raises(ProtocolError):
        encode_header(MessageKind.CALL, 65536, 0, 1)
    assert struct.calcsize("!2sBBHHIQ") == HEADER_SIZE == 20
