"""A link to one peer's inbox: a DEALER socket shared between the threads that send,
and the same-host ring that replaces it once the peer accepts one.

Invariants:

* The socket is used only under the link's lock, which also gives the memory barrier
  ZeroMQ asks for when a socket moves between threads.
* A ring is offered on the socket (``_ring_inbox``: RING_OFFER) after the messages sent
  before it and before the ones after it; the writer counts the socket messages it
  sends after its offer (``before``, ``_ring``), and switches to the ring at its first
  send after the peer's acceptance arrived on this socket.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from ..errors import PeerUnreachableError, ProtocolError
from ._ring import RingWriter
from ._ring_inbox import RING_ACCEPT, RING_OFFER
from ._spin import SocketActivity

__all__ = ["PeerLink"]

# The per-message path calls the socket methods of pyzmq's compiled base class
# with plain-int flags: its pure-Python wrappers (and the enum arithmetic on
# their flags) cost more than the system calls for small messages.
_socket_send = zmq.backend.Socket.send
_socket_recv = zmq.backend.Socket.recv
_socket_get = zmq.backend.Socket.get
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_monotonic = time.monotonic
# False: links whose ring is in use send every message as a spill, by socket (in order
# with the ring all the same): a same-run A/B switch (benchmarks/ab_switch.py)
_SEND_THROUGH_RINGS = True
_COPY_THRESHOLD = 65536  # memoryview frames at least this big are sent zero-copy
_log = logging.getLogger("actorrpc.transport")


class PeerLink:
    """A DEALER socket connected to one peer's inbox, safe to share between threads."""

    def __init__(self, socket: zmq.Socket[Any], endpoint: str,
                 activity: SocketActivity | None = None, in_process: bool = False) -> None:
        self._socket = socket
        # an in-process connection hands a zero-copy frame's memory itself to the
        # receiver: the link copies every frame, as a socket to another process does
        self._copy_threshold = sys.maxsize if in_process else _COPY_THRESHOLD
        self._activity = activity or SocketActivity()
        self._lock = threading.Lock()
        self.endpoint = endpoint
        self.closed = False
        self.ring: RingWriter | None = None  # in use: every message goes through it
        self._offered: RingWriter | None = None  # offered, not accepted yet
        # messages sent by socket since the offer (before one: since the link was made)
        self._sent_since_offer = 0
        self._ring_after: int | None = None  # offer a ring at that count (None: not due)

    def send(self, frames: Sequence[Any]) -> None:
        """Send one multipart message; memoryview frames of 64 KiB or more go zero-copy
        (except on an in-process link: copied).

        Through the same-host ring once the peer accepted it (see ``_ring``).
        """
        last = len(frames) - 1
        socket = self._socket
        with self._lock:
            if self.closed:
                raise PeerUnreachableError(f"link to {self.endpoint} is closed")
            ring = self.ring
            if ring is None and self._offered is not None:
                ring = self._answer_to_offer()
            if ring is not None:
                if _SEND_THROUGH_RINGS and ring.write(frames):
                    return
                frames = ring.spill_frames(frames)  # no room: by socket, in its turn
                last = len(frames) - 1
            self._activity.at = _monotonic()
            try:
                for index, frame in enumerate(frames):
                    flags = _SNDMORE if index < last else 0
                    if type(frame) is bytes:
                        _socket_send(socket, frame, flags)
                    else:
                        big = isinstance(frame, memoryview) and frame.nbytes >= self._copy_threshold
                        _socket_send(socket, frame, flags, not big)
            except zmq.Again as exc:
                if ring is not None:
                    ring.take_back_spill()
                raise PeerUnreachableError(
                    f"peer at {self.endpoint} did not accept a message in time "
                    "(it is not reading, or the connection is down)"
                ) from exc
            except zmq.ZMQError as exc:
                if ring is not None:
                    ring.take_back_spill()
                raise PeerUnreachableError(f"sending to {self.endpoint} failed: {exc}") from exc
            self._activity.at = _monotonic()  # (again: a send may block, or go on in libzmq)
            if ring is None:
                self._sent_since_offer += 1
                if self._ring_after is not None and self._sent_since_offer >= self._ring_after:
                    self._offer_ring()

    def offer_ring(self, after_messages: int = 0) -> None:
        """Offer the peer a ring for this link's messages (see ``_ring_inbox``), once
        ``after_messages`` messages went by socket (at once if they did)."""
        with self._lock:
            if self._sent_since_offer >= after_messages:
                self._offer_ring()
            elif self.ring is None and self._offered is None:
                self._ring_after = after_messages

    def _offer_ring(self) -> None:
        """(Under the lock.) Offer a ring now, unless one is in use or offered already."""
        self._ring_after = None
        if self.closed or self.ring is not None or self._offered is not None:
            return
        try:
            ring = RingWriter()
        except OSError:
            return  # no shared memory now: the socket it is
        try:
            _socket_send(self._socket, RING_OFFER, _SNDMORE)
            _socket_send(self._socket, ring.name.encode(), 0)
        except zmq.ZMQError:
            ring.close()
            return
        self._offered, self._sent_since_offer = ring, 0

    def _answer_to_offer(self) -> RingWriter | None:
        """(Under the lock.) The ring to use from now on, if the peer accepted it."""
        offered = self._offered
        assert offered is not None
        socket = self._socket
        try:
            if not int(_socket_get(socket, _EVENTS)) & _POLLIN:
                return None  # no answer yet
            answer = [_socket_recv(socket, _NOBLOCK, True)]
            while socket.rcvmore:
                answer.append(_socket_recv(socket, _NOBLOCK, True))
        except zmq.ZMQError:
            return None
        self._offered = None
        if len(answer) == 3 and answer[:2] == [RING_ACCEPT, offered.name.encode()]:
            try:
                offered.start(answer[2].decode("ascii", "replace"), self._sent_since_offer)
                self.ring = offered
                return offered
            except (OSError, ProtocolError) as exc:
                _log.warning("could not start the ring to %s: %s", self.endpoint, exc)
        offered.close()  # refused (or a malformed answer): the socket it is
        return None

    def close(self, linger: float = 0.0) -> None:
        """Close the socket; messages still queued get up to ``linger`` seconds to leave.

        Messages in a ring stay readable: the reader's mapping outlives the writer's.
        """
        with self._lock:
            if not self.closed:
                self.closed = True
                self._socket.close(linger=int(linger * 1000))
                for ring in (self.ring, self._offered):
                    if ring is not None:
                        ring.close()
                self.ring = self._offered = None
