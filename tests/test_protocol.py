"""The wire header, and a live worker fed raw, malformed ZeroMQ messages.

The live tests talk to the session group's worker1 with a raw pyzmq DEALER.
Every message a worker accepts must come from a group member: the routing id
must be the member's connection id and the header must name its rank. To get
past that check the raw socket presents worker1's *own* connection id (rank 1)
so worker1 answers itself, never disturbing worker0's or worker2's links.
Each probe pickles an object whose unpickling records a token on worker1, so
the tests can see exactly what was (and was not) unpickled there.
"""

from __future__ import annotations

import json
import pickle
import struct
import threading
import time
import uuid

import pytest
import torch
import zmq

import actorrpc as rpc
from actorrpc.agent import current_agent
from actorrpc.protocol import (
    FLAG_INLINE_PAYLOAD,
    FLAG_RIDERS,
    FLAG_SHARED_MEMORY,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    RESPONSE_KINDS,
    Header,
    MessageKind,
    decode_header,
    decode_riders,
    encode_header,
    encode_inline,
    encode_riders,
)
from actorrpc.serialization import dumps

pytestmark = pytest.mark.timeout(60)

_RAW = struct.Struct("!2sBBHHIQ")
_V = PROTOCOL_VERSION
_BIG_ID = 1 << 60  # far above any id worker1 uses for its own calls


# --- header unit tests ------------------------------------------------------------------


def test_header_layout():
    assert HEADER_SIZE == 20 == _RAW.size
    assert MAGIC == b"AR" and PROTOCOL_VERSION == 12
    frame = encode_header(MessageKind.CALL, 3, 7, 123456789)
    assert frame == _RAW.pack(b"AR", 12, 1, 0, 3, 7, 123456789)
    assert {MessageKind.RESPONSE, MessageKind.EXCEPTION} == RESPONSE_KINDS


@pytest.mark.parametrize("kind", list(MessageKind), ids=lambda k: k.name)
def test_header_roundtrip_every_kind(kind):
    for nbuffers, sender, message_id in [(0, 0, 0), (65535, 2**32 - 1, 2**64 - 1), (2, 5, 77)]:
        frame = encode_header(kind, nbuffers, sender, message_id)
        header = decode_header(frame)
        assert header == Header(kind, nbuffers, sender, message_id)
        assert isinstance(header.kind, MessageKind)
        assert decode_header(memoryview(frame)) == header
        assert decode_header(bytearray(frame)) == header


def test_an_empty_payload_is_answered_not_dropped(cluster):
    # an empty payload never travels inline (a flagged header must carry one)
    agent = current_agent()
    future = agent.send_encoded(agent.resolve("worker1"), MessageKind.CALL, b"", timeout=10)
    with pytest.raises(rpc.DeserializationError):
        future.wait()


def test_inline_payload_follows_the_header_in_one_frame():
    frame = encode_inline(MessageKind.RESPONSE, 3, 99, b"payload")
    assert frame[:HEADER_SIZE] == _RAW.pack(b"AR", _V, 2, FLAG_INLINE_PAYLOAD, 0, 3, 99)
    assert decode_header(frame) == Header(MessageKind.RESPONSE, 0, 3, 99, FLAG_INLINE_PAYLOAD)
    assert frame[HEADER_SIZE:] == b"payload"


def test_too_many_buffers_rejected():
    with pytest.raises(rpc.ProtocolError, match="65535"):
        encode_header(MessageKind.CALL, 65536, 0, 1)


@pytest.mark.parametrize(
    "frame, match",
    [
        (_RAW.pack(b"XX", 1, 1, 0, 0, 0, 1), "magic"),
        (_RAW.pack(b"ar", 1, 1, 0, 0, 0, 1), "magic"),
        (_RAW.pack(b"AR", 0, 1, 0, 0, 0, 1), "version"),
        (_RAW.pack(b"AR", 1, 1, 0, 0, 0, 1), "version"),  # before inline payloads
        (_RAW.pack(b"AR", 2, 1, 0, 0, 0, 1), "version"),  # cleanups were requests
        (_RAW.pack(b"AR", 3, 1, 0, 0, 0, 1), "version"),  # errors had four fields
        (_RAW.pack(b"AR", 4, 1, 0, 0, 0, 1), "version"),  # no REMOTE_CALL_FETCH
        (_RAW.pack(b"AR", 5, 1, 0, 0, 0, 1), "version"),  # tensors in the general form
        (_RAW.pack(b"AR", 6, 1, 0, 0, 0, 1), "version"),  # riders had no message ids
        (_RAW.pack(b"AR", 7, 1, 0, 0, 0, 1), "version"),  # strided views in the general form
        (_RAW.pack(b"AR", 8, 1, 0, 0, 0, 1), "version"),  # every call carried its function
        (_RAW.pack(b"AR", 9, 1, 0, 0, 0, 1), "version"),  # rebuild functions by name
        (_RAW.pack(b"AR", 10, 1, 0, 0, 0, 1), "version"),  # no registered_object
        (_RAW.pack(b"AR", 11, 1, 0, 0, 0, 1), "version"),  # no BARRIER notifications
        (_RAW.pack(b"AR", 13, 1, 0, 0, 0, 1), "version"),
        (_RAW.pack(b"AR", 255, 1, 0, 0, 0, 1), "version"),
        (_RAW.pack(b"AR", _V, 0, 0, 0, 0, 1), "kind"),
        (_RAW.pack(b"AR", _V, 17, 0, 0, 0, 1), "kind"),
        (_RAW.pack(b"AR", _V, 255, 0, 0, 0, 1), "kind"),
        (b"", "0 bytes"),
        (b"AR", "2 bytes"),
        (_RAW.pack(b"AR", _V, 1, 0, 0, 0, 1)[:19], "19 bytes"),
        (_RAW.pack(b"AR", _V, 1, 0, 0, 0, 1) + b"\x00", "21 bytes"),
        (_RAW.pack(b"AR", _V, 1, 2, 0, 0, 1), "unknown header flags"),  # retired bit 1
        (_RAW.pack(b"AR", _V, 1, 16, 0, 0, 1), "unknown header flags"),
        (_RAW.pack(b"AR", _V, 1, 8, 0, 0, 1), "inline payload carries none"),
        (_RAW.pack(b"AR", _V, 1, 8 | 4, 0, 0, 1) + b"x", "travels alone"),
        (_RAW.pack(b"AR", _V, 1, 8 | 1, 0, 0, 1) + b"x", "travels alone"),
        (_RAW.pack(b"AR", _V, 1, 8, 1, 0, 1) + b"x", "travels alone"),
    ],
    ids=[
        "bad-magic",
        "lowercase-magic",
        "version-0",
        "version-1",
        "version-2",
        "version-3",
        "version-4",
        "version-5",
        "version-6",
        "version-7",
        "version-8",
        "version-9",
        "version-10",
        "version-11",
        "version-13",
        "version-255",
        "kind-0",
        "kind-17",
        "kind-255",
        "empty",
        "magic-only",
        "short",
        "long",
        "retired-flag",
        "unknown-flag",
        "inline-without-payload",
        "inline-with-riders",
        "inline-with-shared-memory",
        "inline-with-buffers",
    ],
)
def test_malformed_header_raises_protocol_error(frame, match):
    with pytest.raises(rpc.ProtocolError, match=match) as info:
        decode_header(frame)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


def test_riders_roundtrip_in_order():
    riders = [(MessageKind.RREF_USER_DELETE, 0, b"abc"), (MessageKind.SHM_RELEASE, 0, b""),
              (MessageKind.RESPONSE, 7, b"reply"), (MessageKind.AUTOGRAD_CLEANUP, 0, b"c"),
              (MessageKind.REPLY_UNDECODED, 0, b"r"), (MessageKind.RESPONSE, 2**64 - 1, b""),
              (MessageKind.RREF_USER_DELETE, 0, b"x" * 70000)]
    decoded = decode_riders(encode_riders([(int(k), i, b) for k, i, b in riders]))
    assert [(k, i, bytes(b)) for k, i, b in decoded] == riders
    assert all(isinstance(k, MessageKind) for k, _, _ in decoded)


_DELETE = int(MessageKind.RREF_USER_DELETE)


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "empty"),
        (b"\x08\x00", "inside an entry header"),
        (encode_riders([(_DELETE, 0, b"abc")])[:-1], "declares 3 bytes but 2"),
        (encode_riders([(_DELETE, 0, b"abc")]) + b"\x08", "inside an entry header"),
        (encode_riders([(int(MessageKind.RESPONSE), 0, b"")]), "response .* no message id"),
        (encode_riders([(_DELETE, 5, b"")]), "notification .* has message id 5"),
        (encode_riders([(int(MessageKind.EXCEPTION), 3, b"")]), "kind 3 cannot ride"),
        (encode_riders([(int(MessageKind.MEMBERSHIP), 0, b"{}")]), "kind 13 cannot ride"),
        (encode_riders([(0, 0, b"")]), "kind 0 cannot ride"),
        (encode_riders([(200, 0, b"")]), "kind 200 cannot ride"),
        (encode_riders([(int(MessageKind.CALL), 1, b"")]), "kind 1 cannot ride"),
        (encode_riders([(int(MessageKind.PING), 0, b"")]), "kind 11 cannot ride"),
    ],
    ids=["empty", "short-entry", "truncated-body", "trailing-byte", "response-without-id",
         "notification-with-id", "exception", "membership", "kind-0", "kind-200", "call",
         "ping"],
)
def test_malformed_riders_raise_protocol_error(frame, match):
    with pytest.raises(rpc.ProtocolError, match=match):
        decode_riders(frame)


# --- helpers that run on worker1 ---------------------------------------------------------

_marks: set[str] = set()
_marks_lock = threading.Lock()


def mark(token: str) -> str:
    with _marks_lock:
        _marks.add(token)
    return token


def mark_called(token: str, _unpickled: str) -> str:
    return mark(token)


def marked(tokens: list[str]) -> list[str]:
    with _marks_lock:
        return [t for t in tokens if t in _marks]


class MarkOnUnpickle:
    """Unpickling this object on a worker records ``token`` there."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __reduce__(self):
        return mark, (self.token,)


def transport_facts() -> dict:
    agent = current_agent()
    return {
        "endpoint": agent._transport.endpoint,
        "secret": agent._transport._secret,
        "identity": agent.identity,
        "rank": agent.rank,
    }


def whoami() -> str:
    return rpc.get_worker_info().name


def call_self_and_peers() -> list[str]:
    return [rpc.rpc_sync(name, whoami, timeout=10) for name in ("worker1", "worker0", "worker2")]


# --- raw client -------------------------------------------------------------------------


class RawPeer:
    """A raw DEALER connected to worker1's inbox, optionally with PLAIN credentials."""

    def __init__(self, context, facts, *, password=None, identity=None, username="actorrpc"):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, -1)  # never fight worker1's own link
        self.socket.setsockopt(zmq.SNDTIMEO, 2000)
        self.socket.setsockopt(
            zmq.ROUTING_ID, identity if identity is not None else facts["identity"]
        )
        if password is not None:
            self.socket.setsockopt_string(zmq.PLAIN_USERNAME, username)
            self.socket.setsockopt_string(zmq.PLAIN_PASSWORD, password)
        self.socket.connect(facts["endpoint"])

    def send(self, frames) -> None:
        self.socket.send_multipart(frames)

    def send_unless_refused(self, frames) -> None:
        """Send, unless the connection was refused first (a failed handshake closes the
        only pipe, and the send then times out: nothing reached worker1 either way)."""
        try:
            self.socket.send_multipart(frames)
        except zmq.Again:
            pass

    def got_reply(self, wait: float) -> bool:
        return bool(self.socket.poll(int(wait * 1000), zmq.POLLIN))

    def close(self) -> None:
        self.socket.close(linger=0)


def header(kind, nbuffers=0, sender=1, message_id=None) -> bytes:
    return encode_header(kind, nbuffers, sender, message_id if message_id is not None else _BIG_ID)


def inline(kind, payload: bytes, sender=1) -> bytes:
    """A header and its payload in one frame (``FLAG_INLINE_PAYLOAD``)."""
    return encode_inline(kind, sender, _BIG_ID, payload)


def shm_header() -> bytes:
    """A CALL header with one buffer, flagged as travelling in shared memory."""
    return encode_header(MessageKind.CALL, 1, 1, _BIG_ID, flags=FLAG_SHARED_MEMORY)


def riders_header(kind: MessageKind = MessageKind.CALL) -> bytes:
    """A header flagged as carrying notifications in its last frame."""
    return encode_header(kind, 0, 1, _BIG_ID, flags=FLAG_RIDERS)


def _descriptor(name: bytes) -> bytes:
    return (4096).to_bytes(8, "big") + name


_NO_SEGMENT = _descriptor(b"actorrpc-0123456789ab")


def marking_call(token: str) -> bytes:
    """A well-formed CALL payload: run ``mark(token)`` (and record on unpickling)."""
    return pickle.dumps(
        (mark_called, (token, MarkOnUnpickle(token + ":unpickled")), {}, {}), protocol=5
    )


def token() -> str:
    return uuid.uuid4().hex


def wait_marked(tokens: list[str], timeout: float) -> list[str]:
    """Poll worker1 until every token is marked or ``timeout`` passes; return those marked."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        seen = rpc.rpc_sync("worker1", marked, args=(tokens,), timeout=10)
        if len(seen) == len(tokens) or time.monotonic() >= deadline:
            return seen
        pause.wait(0.02)


def assert_worker1_serves() -> None:
    assert rpc.rpc_sync("worker1", whoami, timeout=10) == "worker1"
    x = torch.arange(3.0)
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(x, 1), timeout=10), x + 1)


@pytest.fixture
def worker1(cluster):
    """worker1's facts and a ZeroMQ context for raw sockets.

    A raw socket presenting worker1's connection id takes that id over in worker1's
    ROUTER (ROUTER_HANDOVER). worker1's link to itself uses an id of its own, which
    nothing outside worker1 knows, so its calls to itself keep working meanwhile and
    afterwards (checked after each test).
    """
    facts = rpc.rpc_sync("worker1", transport_facts)
    assert facts["rank"] == 1 and facts["secret"], facts
    context = zmq.Context()
    try:
        yield context, facts
        assert rpc.rpc_sync("worker1", call_self_and_peers, timeout=30) == [
            "worker1", "worker0", "worker2",
        ]
    finally:
        context.destroy(linger=0)
    assert_worker1_serves()
    assert rpc.rpc_sync("worker1", call_self_and_peers, timeout=30) == [
        "worker1",
        "worker0",
        "worker2",
    ]


# --- unauthenticated peers ----------------------------------------------------------------


@pytest.mark.parametrize(
    "password", [None, "wrong-secret"], ids=["no-credentials", "wrong-password"]
)
def test_unauthenticated_messages_are_never_unpickled(worker1, password):
    context, facts = worker1
    refused, control = token(), token()
    stranger = RawPeer(context, facts, password=password)
    try:
        stranger.send_unless_refused([header(MessageKind.CALL), marking_call(refused)])
        stranger.send_unless_refused([b"garbage"])
        stranger.send_unless_refused([header(MessageKind.CALL, nbuffers=2), b"\x80\x05junk"])
        # positive control: the same message with the group's credentials is served
        member = RawPeer(context, facts, password=facts["secret"])
        try:
            member.send([header(MessageKind.CALL), marking_call(control)])
            assert wait_marked([control, control + ":unpickled"], 10) == [
                control,
                control + ":unpickled",
            ]
        finally:
            member.close()
        assert not stranger.got_reply(0.3), "an unauthenticated peer got a reply"
        assert wait_marked([refused + ":unpickled", refused], 0.5) == []
    finally:
        stranger.close()
    assert_worker1_serves()


def test_wrong_username_is_refused(worker1):
    context, facts = worker1
    refused = token()
    stranger = RawPeer(context, facts, password=facts["secret"], username="intruder")
    try:
        stranger.send_unless_refused([header(MessageKind.CALL), marking_call(refused)])
        # a legitimate call afterwards proves time passed for the stranger's message
        assert_worker1_serves()
        assert not stranger.got_reply(0.3)
        assert wait_marked([refused + ":unpickled"], 0.3) == []
    finally:
        stranger.close()


# --- authenticated, malformed -------------------------------------------------------------


def _dropped_messages(bad: str) -> list[list[bytes]]:
    """Messages a worker must drop without unpickling anything (no reply either)."""
    payload = marking_call(bad)
    ok_header = header(MessageKind.CALL)
    return [
        [b"single garbage frame"],
        [ok_header],  # header, no payload frame
        [b"", b""],  # empty header
        [b"\x00" * 7, payload],  # truncated header
        [ok_header[:19], payload],  # one byte short
        [ok_header + b"\x00", payload],  # one byte long
        [_RAW.pack(b"XX", 1, 1, 0, 0, 1, _BIG_ID), payload],  # bad magic
        [_RAW.pack(b"AR", _V + 1, 1, 0, 0, 1, _BIG_ID), payload],  # future version
        [_RAW.pack(b"AR", 2, 1, 0, 0, 1, _BIG_ID), payload],  # version 2
        [_RAW.pack(b"AR", 0, 1, 0, 0, 1, _BIG_ID), payload],  # version 0
        [_RAW.pack(b"AR", 1, 1, 0, 0, 1, _BIG_ID), payload],  # version 1
        [_RAW.pack(b"AR", _V, 99, 0, 0, 1, _BIG_ID), payload],  # unknown kind
        [_RAW.pack(b"AR", _V, 0, 0, 0, 1, _BIG_ID), payload],  # kind 0
        [header(MessageKind.CALL, sender=0), payload],  # claims rank 0 with rank 1's id
        [header(MessageKind.CALL, sender=2), payload],  # claims rank 2
        [header(MessageKind.CALL, sender=77), payload],  # not a member at all
        # responses to calls worker1 never made: nothing to complete, nothing unpickled
        [header(MessageKind.RESPONSE), payload],
        [header(MessageKind.EXCEPTION), payload],
        [header(MessageKind.RESPONSE, nbuffers=4), payload],
        [header(MessageKind.EXCEPTION, nbuffers=0), payload, b"extra", b"frames"],
        [header(MessageKind.RESPONSE), b"\x80\x05 definitely not a pickle"],
        [inline(MessageKind.RESPONSE, payload)],
        # ... and riding on such a response (kind 2 with a message id)
        [riders_header(MessageKind.RESPONSE), payload,
         encode_riders([(int(MessageKind.RESPONSE), _BIG_ID + 3, payload)])],
        [_RAW.pack(b"AR", _V, 1, FLAG_INLINE_PAYLOAD, 0, 1, _BIG_ID)],  # inline, but empty
        [_RAW.pack(b"AR", _V, 1, FLAG_INLINE_PAYLOAD | FLAG_RIDERS, 0, 1, _BIG_ID) + payload],
        [inline(MessageKind.CALL, payload, sender=2)],  # claims rank 2
        # membership messages are JSON, never unpickled; a static group takes none
        [header(MessageKind.MEMBERSHIP), payload],
        [header(MessageKind.MEMBERSHIP), b"[1, 2]"],
        [header(MessageKind.MEMBERSHIP), b'{"op": "bogus", "rank": 1}'],
        [header(MessageKind.MEMBERSHIP), b'{"op": "join"}'],
        [header(MessageKind.MEMBERSHIP), b'{"op": "left", "rank": 1}', payload],
        [header(MessageKind.MEMBERSHIP, sender=77), b'{"op": "left", "rank": 77}'],
        [header(MessageKind.MEMBERSHIP, sender=0), b'{"op": "leaving", "rank": 0}'],
        [
            header(MessageKind.MEMBERSHIP, sender=5),
            json.dumps(
                {"op": "join", "rank": 5, "name": "intruder", "endpoint": "tcp://127.0.0.1:1",
                 "identity": "00"}
            ).encode(),
        ],
    ]


def test_malformed_messages_are_dropped_without_unpickling(worker1):
    context, facts = worker1
    bad, sentinel = token(), token()
    peer = RawPeer(context, facts, password=facts["secret"])
    try:
        for frames in _dropped_messages(bad):
            peer.send(frames)
        # same connection, so it is read after all of the above
        peer.send([header(MessageKind.CALL), marking_call(sentinel)])
        assert wait_marked([sentinel], 10) == [sentinel], "worker1 stopped reading its inbox"
        assert not peer.got_reply(0.2)
    finally:
        peer.close()
    assert wait_marked([bad, bad + ":unpickled"], 0) == []
    assert_worker1_serves()


def _unterminated_marking_pickle(tok: str) -> bytes:
    """A pickle that records ``tok`` while loading, then hits garbage."""
    body = pickle.dumps(MarkOnUnpickle(tok), protocol=5)
    assert body.endswith(b".")
    return body[:-1] + b"\xfe\xfe garbage after a valid prefix"


def _requests_answered_with_errors(tok: str) -> list[tuple[str, list[bytes]]]:
    """Malformed requests that pass the membership check; worker1 answers each with an error.

    Each is ``(expected token or '', frames)``: a token the worker records while
    unpickling, so the test knows the message was processed.
    """
    u = tok + ":unpickled"
    two_tensors, buffers = dumps((torch.ones(2000), torch.ones(3000)))  # 2 out-of-band buffers
    assert len(buffers) == 2
    return [
        ("", [header(MessageKind.CALL), b"\x80\x05 garbage pickle"]),
        ("", [inline(MessageKind.CALL, b"\x80\x05 garbage pickle")]),
        ("", [inline(MessageKind.CALL, marking_call(tok)), b"an extra frame"]),
        (u + "15", [inline(MessageKind.CALL, pickle.dumps((MarkOnUnpickle(u + "15"),)))]),
        ("", [header(MessageKind.CALL), b""]),  # empty payload
        ("", [header(MessageKind.CALL, nbuffers=5), marking_call(tok)]),  # buffers missing
        ("", [header(MessageKind.CALL, nbuffers=0), marking_call(tok), b"b1", b"b2"]),  # extra
        ("", [header(MessageKind.CALL, nbuffers=65535), marking_call(tok)]),
        ("", [header(MessageKind.CALL, nbuffers=1), two_tensors, b"\x00" * 8]),  # too few buffers
        # notifications riding on a request: malformed riders frames
        ("", [riders_header(), marking_call(tok)]),  # flagged, but no riders frame
        ("", [riders_header(), marking_call(tok), b"\xff\xfe"]),
        ("", [riders_header(), marking_call(tok), encode_riders([(2, 0, pickle.dumps(None))])]),
        (
            "",
            [riders_header(), marking_call(tok), encode_riders([(_DELETE, 0, b"abc")])[:-1]],
        ),
        (  # a rider is handled even when the message that carried it is refused
            u + "14",
            [
                encode_header(MessageKind.CALL, 1, 1, _BIG_ID,
                              flags=FLAG_SHARED_MEMORY | FLAG_RIDERS),
                marking_call(u + "s7"),
                _NO_SEGMENT,
                b"\x00\x00",
                encode_riders([(_DELETE, 0, pickle.dumps((MarkOnUnpickle(u + "14"),)))]),
            ],
        ),
        (  # a well-formed rider is handled (as a notification) before its carrier
            u + "13",
            [
                riders_header(MessageKind.PING),
                pickle.dumps(()),
                encode_riders([(_DELETE, 0, pickle.dumps((MarkOnUnpickle(u + "13"),)))]),
            ],
        ),
        (u + "1", [header(MessageKind.CALL), _unterminated_marking_pickle(u + "1")]),
        (u + "2", [header(MessageKind.CALL), pickle.dumps((MarkOnUnpickle(u + "2"),))]),
        (u + "3", [header(MessageKind.CALL), pickle.dumps(MarkOnUnpickle(u + "3"))]),
        (
            u + "4",
            [header(MessageKind.CALL), pickle.dumps((5, (MarkOnUnpickle(u + "4"),), {}, {}))],
        ),
        (
            u + "5",
            [
                header(MessageKind.CALL),
                pickle.dumps((mark, (MarkOnUnpickle(u + "5"),), "not a dict", {})),
            ],
        ),
        (u + "6", [header(MessageKind.REMOTE_CALL), pickle.dumps((MarkOnUnpickle(u + "6"),))]),
        ("", [header(MessageKind.REMOTE_CALL), b"\x80\x05 garbage"]),
        (u + "7", [header(MessageKind.RREF_FETCH), pickle.dumps((MarkOnUnpickle(u + "7"),))]),
        ("", [header(MessageKind.RREF_FETCH), b"garbage"]),
        (
            u + "8",
            [header(MessageKind.RREF_FORK_REQUEST), pickle.dumps((MarkOnUnpickle(u + "8"),))],
        ),
        (u + "9", [header(MessageKind.RREF_CHILD_ACCEPT), pickle.dumps(MarkOnUnpickle(u + "9"))]),
        (
            u + "10",
            [header(MessageKind.RREF_USER_DELETE), pickle.dumps((MarkOnUnpickle(u + "10"),))],
        ),
        (
            u + "11",
            [header(MessageKind.AUTOGRAD_BACKWARD), pickle.dumps((MarkOnUnpickle(u + "11"),))],
        ),
        (
            u + "12",
            [header(MessageKind.AUTOGRAD_CLEANUP), pickle.dumps((MarkOnUnpickle(u + "12"),))],
        ),
        # shared-memory descriptors that name nothing mappable: refused, never opened
        ("", [shm_header(), marking_call(u + "s1"), b"\x00" * 8, b"\x00\x00"]),
        (
            "",
            [shm_header(), marking_call(u + "s2"), _descriptor(b"../../etc/passwd"), b"\x00\x00"],
        ),
        ("", [shm_header(), marking_call(u + "s3"), _NO_SEGMENT, b"\x00\x00"]),
        ("", [shm_header(), marking_call(u + "s4"), _NO_SEGMENT, b"\x00\x05"]),
        ("", [shm_header(), marking_call(u + "s5"), _NO_SEGMENT]),
        ("", [shm_header(), marking_call(u + "s6"), _NO_SEGMENT, b"\x00"]),
        ("", [header(MessageKind.PING), b"garbage"]),
        ("", [header(MessageKind.BARRIER), b"garbage"]),
        ("", [header(MessageKind.BARRIER), pickle.dumps(("x", 1))]),
    ]


def test_malformed_requests_get_error_replies_and_worker_survives(worker1):
    context, facts = worker1
    base = token()
    for index, (expected, frames) in enumerate(_requests_answered_with_errors(base)):
        sentinel = f"{base}:sentinel{index}"
        peer = RawPeer(context, facts, password=facts["secret"])
        try:
            peer.send(frames)
            peer.send([header(MessageKind.CALL, message_id=_BIG_ID + 1), marking_call(sentinel)])
            seen = wait_marked([sentinel], 2)
        finally:
            peer.close()
        if not seen:
            # worker1's error reply to itself can take its connection id over before the
            # sentinel was read on that connection; send the sentinel afresh
            retry = RawPeer(context, facts, password=facts["secret"])
            try:
                retry.send(
                    [header(MessageKind.CALL, message_id=_BIG_ID + 2), marking_call(sentinel)]
                )
                seen = wait_marked([sentinel], 10)
            finally:
                retry.close()
        assert seen == [sentinel], f"worker1 stopped serving after case {index}: {frames[:1]}"
        if expected:
            assert wait_marked([expected], 5) == [expected], f"case {index} was never processed"
    assert_worker1_serves()


def test_worker_keeps_serving_everyone_after_raw_traffic(cluster):
    assert_worker1_serves()
    assert rpc.rpc_sync("worker1", call_self_and_peers, timeout=30) == [
        "worker1",
        "worker0",
        "worker2",
    ]
    assert rpc.rpc_sync("worker2", whoami) == "worker2"
