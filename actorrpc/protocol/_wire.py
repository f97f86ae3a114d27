"""The actorrpc wire format (protocol version 12).

Topology
--------
Every worker binds one ZeroMQ ROUTER socket (its *inbox*) and connects one
DEALER socket to each peer's ROUTER. All traffic from worker A to worker B,
requests and responses alike, travels over A's DEALER into B's ROUTER; B
answers over its own DEALER into A's ROUTER. A DEALER's routing id is the
sender's *connection id* (``"<rank>:<nonce>"``), so the receiving ROUTER
prefixes every message with a frame naming the sender. (A worker's link to its own
inbox is in-process, with a routing id known only to that process, which its
transport maps back to the worker's connection id.)

Frames
------
A message is one ZeroMQ multipart message::

    frame 0   header       20 bytes, layout below
    frame 1   payload      pickle protocol 5 bytes (may be empty)
    frame 2.. buffers      ``nbuffers`` out-of-band pickle buffers (tensor data)

or, for a small payload and nothing else (no buffers, no other flags), the
header with ``FLAG_INLINE_PAYLOAD`` set and the payload in one frame::

    frame 0   header + payload   20 header bytes, then the (non-empty) payload

which costs one ZeroMQ message part less to send and to receive. On receipt
the ROUTER adds the sender's routing id in front of frame 0.

Header
------
Big-endian, ``struct`` format ``!2sBBHHIQ`` (20 bytes)::

    offset size field
    0      2    magic       b"AR"
    2      1    version     PROTOCOL_VERSION (12; 11 sent no BARRIER
                            notifications at shutdown, 10 named a tensor rebuild
                            function by its extension code each time, never
                            through registered_object, 9 named them by
                            module and name instead of extension codes, 8 had
                            no function references, 7 pickled a
                            strided view of a numpy dtype in the general form of
                            serialization._tensors, and its rings' writers rang
                            the doorbell after every record, their readers never
                            set ``asleep``; 6 had no message id in a
                            rider and no RESPONSE riders, 5 pickled every tensor in the
                            general form of serialization._tensors, 4 had no
                            REMOTE_CALL_FETCH, 3 had
                            no fifth EXCEPTION field and no REPLY_UNDECODED, 2
                            sent AUTOGRAD_CLEANUP as a request, 1 had no inline
                            payload)
    3      1    kind        a :class:`MessageKind`
    4      2    flags       bit 0: FLAG_SHARED_MEMORY, bit 2: FLAG_RIDERS
                            (see below), bit 3: FLAG_INLINE_PAYLOAD (above:
                            alone, with ``nbuffers`` 0); others 0 (bit 1 is
                            retired: it marked a comma-separated release frame)
    6      2    nbuffers    number of buffer frames after the payload
    8      4    sender      rank of the sending worker
    12     8    message id  unique per sender; a response echoes its request's id

Message kinds
-------------
Every kind except ``RESPONSE`` and ``EXCEPTION`` is a *request* and is answered
by exactly one ``RESPONSE`` (payload: the result) or ``EXCEPTION`` (payload: the
tuple in the table below) carrying the same message id, except a request
with message id 0: that is a *notification* and is never answered
(``RREF_USER_DELETE``, ``AUTOGRAD_CLEANUP``, ``SHM_RELEASE`` and
``REPLY_UNDECODED`` are sent as notifications, usually riding on another message,
see below; ``RREF_CHILD_ACCEPT`` as a notification of its own, which a worker still
answers when it comes as a request; and the last ``MEMBERSHIP`` message of a leaving
worker). Payloads are pickled tuples:

========================  ==  ============================================================
kind                      id  payload
========================  ==  ============================================================
CALL                       1  ``(func, args, kwargs, meta)`` (``func``: see below)
RESPONSE                   2  result value
EXCEPTION                  3  ``(type, repr, traceback, worker name, undecoded)``
REMOTE_CALL                4  ``(func, args, kwargs, meta, rref_id, fork_id)``
RREF_FETCH                 5  ``(rref_id, meta)``
RREF_FORK_REQUEST          6  ``(rref_id, fork_id)`` user -> owner
RREF_CHILD_ACCEPT          7  ``(fork_id,)``  child -> parent
RREF_USER_DELETE           8  ``(rref_id, fork_id)`` user -> owner
AUTOGRAD_BACKWARD          9  ``(context_id, message_id, grads, retain_graph, pass_id)``
AUTOGRAD_CLEANUP          10  ``(context_id,)``
PING                      11  ``()`` application-level liveness check
BARRIER                   12  ``(name, rank)`` a shutdown barrier is complete (sent by the
                              last rank to arrive, to the ranks waiting there)
MEMBERSHIP                13  UTF-8 JSON, never pickled (dynamic groups, see below)
SHM_RELEASE               14  ``[segment name, ...]`` the receiver is done with
REPLY_UNDECODED           15  ``(message id, fork ids)`` caller -> callee, see below
REMOTE_CALL_FETCH         16  as REMOTE_CALL; the creator fetches the value too: the
                              RESPONSE carries the value (as a RREF_FETCH reply would)
                              instead of None
========================  ==  ============================================================

``undecoded`` is None, unless the request could not be unpickled (or was
refused before): then it is the tuple of fork ids of the RRefs the receiver
rebuilt before the failure, and the sender undoes every other fork it made for
that request (as if it had never been sent). The other way round, a caller that
cannot unpickle a ``RESPONSE`` tells the callee in a ``REPLY_UNDECODED``
notification naming the request's message id and the fork ids it rebuilt; the
callee undoes the other forks it made for that reply (it remembers the last
4,096 replies that carried RRefs).

A call's ``func`` (``CALL``, ``REMOTE_CALL``, ``REMOTE_CALL_FETCH``) is the
function itself, or, for one that travels by reference (importable by its module
and name), ``bytes``: that function's own pickle, made once per function by the
caller and resolved once per distinct reference by the callee
(``serialization._function_refs``). Protocol version 9 introduced it.

A tensor's rebuild function travels as a pickle extension code (``EXT4``), not
by module and name: ``0x61637200`` rebuilds the array form, ``0x61637201`` the
strided array form, ``0x61637202`` the general form
(``serialization._extension_codes``, ``serialization._tensors``). Protocol
version 10 introduced them. pickle does not memoize extension codes: from the
third time one pickle saves a rebuild function on, it is written as
``registered_object(code)`` (code ``0x61637203``, a ``REDUCE`` that pickle
memoizes), so the later tensors of a message of many refer to it through the memo
(protocol version 11).

``meta`` is a dict of call metadata contributed by registered call hooks (for
example the distributed autograd context id). Higher layers register handlers
for their kinds with the agent's dispatcher; the dispatcher itself knows none
of them.

Shared memory
-------------
Between workers on one host, a large buffer may travel in a POSIX
shared-memory segment lent by the sender instead of through the socket. Then
the header has ``FLAG_SHARED_MEMORY`` set, that buffer's frame holds a
descriptor (``!Q`` byte count, then the segment name ``actorrpc-<hex>``) and
one more frame follows the buffers: the indexes of the descriptor frames among
the buffers, as big-endian unsigned 16-bit integers. When nothing uses the
mapping any more, the receiver hands the segment names back to the sender,
which may then reuse them, in ``SHM_RELEASE`` notifications (which ride along,
see below).

Same-host rings
---------------
Between workers on one host (x86-64), the messages above may travel through a
shared-memory ring instead of the socket, unchanged: the same frames, framed
by the ring's records (spec in ``actorrpc/transport/_ring.py``). The ring is
offered (once a link carried a few messages by socket: ``RING_AFTER_MESSAGES``)
and accepted with transport control messages whose first frame starts
with ``!`` (a message of this protocol starts with ``AR``, so the two never
meet); a message that does not fit the ring's free space goes by socket as a
spill ``[b"!spill", <Q sequence number, frames...]``, and the receiver
delivers ring records and spills in sequence order. Higher layers never see
the difference.

Notifications riding on a message
---------------------------------
A notification nobody waits for (an RRef user's delete, a segment release)
need not be a message of its own: the sender may append it to a later message
it sends to that worker anyway (the next one, or, for RRef deletes, one of a
batch's: ``agent/_riders.py``). Then the header has ``FLAG_RIDERS`` set and the
message's last frame (after the shared-memory index frame, if any) holds one or
more entries, each as ``!BQI`` (kind, message id, payload length) followed by
that many payload bytes. The receiver handles them in order, before the message
that carried them (even when that message itself is refused); notifications that
only let something go (``RREF_USER_DELETE``, ``AUTOGRAD_CLEANUP``) riding on a
request served on a thread may instead be handled right after that request (within a
few milliseconds if it takes longer). They may ride on
every kind but ``MEMBERSHIP``. An entry is either a notification
(``RREF_USER_DELETE``, ``AUTOGRAD_CLEANUP``, ``SHM_RELEASE`` or
``REPLY_UNDECODED``; message id 0; its pickled payload) or a ``RESPONSE`` (the
nonzero message id of the request it answers; the reply's pickled value,
without buffers): a worker serving a burst of requests from one peer lets the
small replies of all but the last ride on the next message to that peer
(usually the burst's last reply). Any other kind, a notification with a message
id or a response without one makes the message malformed.

Membership messages
-------------------
In a dynamic group (``init_rpc`` without a world size) workers join and leave
while the others run. ``MEMBERSHIP`` payloads are JSON objects so that a worker
not yet in the receiver's member table is never unpickled::

    {"op": "join",    "rank": r, "name": n, "endpoint": e, "identity": hex}
    {"op": "probe",   "rank": r, "name": n, "endpoint": e, "identity": hex}
    {"op": "leaving", "rank": r}
    {"op": "left",    "rank": r}

``join`` adds the sender to the member table and ``probe`` only proves the
receiver alive; both are answered over a link to ``endpoint``. ``leaving`` is
answered; ``left`` is the sender's last message and is not answered. The
``identity`` must equal the routing id the message arrived with.

Errors
------
A frame that is too short, carries the wrong magic or version, an unknown kind,
or a buffer count that does not match the frames is a
:class:`~actorrpc.errors.ProtocolError`. When the header could be decoded the
receiver answers with ``EXCEPTION``; otherwise the message is dropped and a
rate-limited warning is logged.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from ..errors import ProtocolError

__all__ = [
    "FLAG_INLINE_PAYLOAD",
    "FLAG_RIDERS",
    "FLAG_SHARED_MEMORY",
    "HEADER_SIZE",
    "MAGIC",
    "PROTOCOL_VERSION",
    "RESPONSE_KINDS",
    "Header",
    "MessageKind",
    "decode_header",
    "decode_riders",
    "encode_header",
    "encode_inline",
    "encode_riders",
]

MAGIC = b"AR"
PROTOCOL_VERSION = 12
_HEADER = struct.Struct("!2sBBHHIQ")
HEADER_SIZE = _HEADER.size
_MAX_BUFFERS = 65535
FLAG_SHARED_MEMORY = 1
FLAG_RIDERS = 4
FLAG_INLINE_PAYLOAD = 8
_KNOWN_FLAGS = FLAG_SHARED_MEMORY | FLAG_RIDERS | FLAG_INLINE_PAYLOAD
_RIDER = struct.Struct("!BQI")


class MessageKind(enum.IntEnum):
    """Every message kind on the wire (see the module docstring)."""

    CALL = 1
    RESPONSE = 2
    EXCEPTION = 3
    REMOTE_CALL = 4
    RREF_FETCH = 5
    RREF_FORK_REQUEST = 6
    RREF_CHILD_ACCEPT = 7
    RREF_USER_DELETE = 8
    AUTOGRAD_BACKWARD = 9
    AUTOGRAD_CLEANUP = 10
    PING = 11
    BARRIER = 12
    MEMBERSHIP = 13
    SHM_RELEASE = 14
    REPLY_UNDECODED = 15
    REMOTE_CALL_FETCH = 16


RESPONSE_KINDS = frozenset({MessageKind.RESPONSE, MessageKind.EXCEPTION})
_KIND_BY_VALUE = {int(k): k for k in MessageKind}


class Header(NamedTuple):
    """A decoded message header."""

    kind: MessageKind
    nbuffers: int
    sender: int
    message_id: int
    flags: int = 0


_new_tuple = tuple.__new__


def encode_header(
    kind: MessageKind, nbuffers: int, sender: int, message_id: int, flags: int = 0
) -> bytes:
    """Pack a header; ``nbuffers`` must fit in 16 bits."""
    if nbuffers > _MAX_BUFFERS:
        raise ProtocolError(f"a message may carry at most {_MAX_BUFFERS} buffers, got {nbuffers}")
    return _HEADER.pack(MAGIC, PROTOCOL_VERSION, int(kind), flags, nbuffers, sender, message_id)


def encode_inline(kind: MessageKind, sender: int, message_id: int, payload: bytes) -> bytes:
    """One frame: a header flagged ``FLAG_INLINE_PAYLOAD`` followed by ``payload``."""
    return _HEADER.pack(
        MAGIC, PROTOCOL_VERSION, int(kind), FLAG_INLINE_PAYLOAD, 0, sender, message_id
    ) + payload


def decode_header(frame: bytes | memoryview) -> Header:
    """Unpack and validate a header frame, raising :class:`ProtocolError` if malformed.

    A frame flagged ``FLAG_INLINE_PAYLOAD`` carries the payload after the header
    (``frame[HEADER_SIZE:]``); any other must be the header alone.
    """
    size = len(frame)
    if size < HEADER_SIZE:
        raise ProtocolError(f"header frame has {size} bytes, expected {HEADER_SIZE}")
    magic, version, kind, flags, nbuffers, sender, message_id = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version} (this worker speaks {PROTOCOL_VERSION})"
        )
    message_kind = _KIND_BY_VALUE.get(kind)
    if message_kind is None:
        raise ProtocolError(f"unknown message kind {kind}")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown header flags {flags:#06x}")
    if flags & FLAG_INLINE_PAYLOAD:
        if size == HEADER_SIZE:
            raise ProtocolError("a header flagged with an inline payload carries none")
        if flags != FLAG_INLINE_PAYLOAD or nbuffers:
            raise ProtocolError(
                "an inline payload travels alone (no buffers, shared memory or riders)"
            )
    elif size != HEADER_SIZE:
        raise ProtocolError(f"header frame has {size} bytes, expected {HEADER_SIZE}")
    # (``tuple.__new__``: the named tuple's own ``__new__`` is a Python frame per message)
    return _new_tuple(Header, (message_kind, nbuffers, sender, message_id, flags))


_NOTIFICATION_RIDER_KINDS = frozenset({
    MessageKind.RREF_USER_DELETE, MessageKind.AUTOGRAD_CLEANUP, MessageKind.SHM_RELEASE,
    MessageKind.REPLY_UNDECODED,
})


def encode_riders(riders: list[tuple[int, int, bytes]]) -> bytes:
    """The frame carrying ``(kind, message id, pickled payload)`` entries on another message."""
    parts: list[bytes] = []
    for kind, message_id, body in riders:
        parts.append(_RIDER.pack(kind, message_id, len(body)))
        parts.append(body)
    return b"".join(parts)


def decode_riders(frame: bytes | memoryview) -> list[tuple[MessageKind, int, memoryview]]:
    """The entries of a riders frame, raising :class:`ProtocolError` if malformed."""
    view = memoryview(frame)
    riders: list[tuple[MessageKind, int, memoryview]] = []
    offset, end = 0, len(view)
    if not end:
        raise ProtocolError("a message flagged with riders carries an empty riders frame")
    while offset < end:
        if end - offset < _RIDER.size:
            raise ProtocolError("a riders frame ends inside an entry header")
        kind, message_id, length = _RIDER.unpack_from(view, offset)
        offset += _RIDER.size
        message_kind = _KIND_BY_VALUE.get(kind)
        if message_kind is MessageKind.RESPONSE:
            if not message_id:
                raise ProtocolError("a response riding on a message has no message id")
        elif message_kind not in _NOTIFICATION_RIDER_KINDS:
            raise ProtocolError(f"message kind {kind} cannot ride on another message")
        elif message_id:
            raise ProtocolError(f"a notification (kind {kind}) riding on a message has "
                                f"message id {message_id}")
        if length > end - offset:
            raise ProtocolError(f"a rider declares {length} bytes but {end - offset} follow")
        riders.append((message_kind, message_id, view[offset : offset + length]))
        offset += length
    return riders
