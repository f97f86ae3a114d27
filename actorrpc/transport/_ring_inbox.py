"""The receiving side of same-host rings: the peers' rings a transport reads, and its doorbell.

The handshake (transport control messages start with ``!``; an agent's start with
``AR``)::

    offerer DEALER -> receiver ROUTER   [RING_OFFER, ring name]
    receiver ROUTER -> offerer DEALER   [RING_ACCEPT, ring name, doorbell path]
                                     or [RING_REFUSE, ring name]
    writer DEALER -> reader ROUTER      [SPILL, <Q sequence number, frames...]
                                        (a message that did not fit the ring, ``_ring``)

The answer goes back on the connection the offer came on, so it reaches the very
socket that offered (no second connection to the offerer is made); the offerer
reads it before its next send (``PeerLink``).

Invariants:

* Only the thread holding the inbox (one at a time) reads rings and counts
  socket messages; the registry's lock only guards the snapshot it iterates.
* A peer's ring is read only after the socket messages its writer sent before
  the switch (``RingReader.socket_seen``), and its records and spills in
  sequence order, so the two paths keep one order.
* A new offer from a peer whose ring is read (a new link of the same worker)
  first delivers what the old ring holds; a new link offers before its first
  message (``Transport.link``), so nothing it sends overtakes the old ring.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..errors import ProtocolError
from ._ring import SPILL, Doorbell, RingReader

__all__ = ["RING_ACCEPT", "RING_OFFER", "RING_REFUSE", "RingInbox"]

RING_OFFER = b"!ring-offer"
RING_ACCEPT = b"!ring-accept"
RING_REFUSE = b"!ring-refuse"

_log = logging.getLogger("actorrpc.transport")


class RingInbox:
    """The peers' rings one transport reads, by sender identity."""

    def __init__(self, accept: bool) -> None:
        self._accept = accept  # (else every offer is refused; the transport checked support)
        self._readers: dict[bytes, RingReader] = {}
        self.snapshot: tuple[tuple[bytes, RingReader], ...] = ()  # what receivers iterate
        self.gated: dict[bytes, RingReader] = {}  # readers still counting socket messages
        self._lock = threading.Lock()
        self.doorbell: Doorbell | None = None
        self.messages_in = 0

    def on_control(self, message: list[Any], into: list[list[Any]]) -> list[bytes]:
        """Handle a control message ``[identity, kind, ...]`` that came by socket; the
        answer to send back on its connection (empty: none)."""
        identity, kind = message[0], message[1]
        if kind == SPILL:
            reader = self._readers.get(identity)
            try:
                if reader is None:  # a ring no longer read: in arrival order, as best it can
                    into.append([identity, bytes(message[3]), *message[4:]])
                else:
                    self.messages_in += reader.take_spill(identity, message, into)
            except Exception as exc:  # noqa: BLE001 - a malformed message is dropped
                _log.error("dropped the ring of %r: %s", identity, exc)
                self.forget(identity)
            return []
        name = bytes(message[2]) if len(message) == 3 else b""
        if kind != RING_OFFER or not name:
            _log.warning("dropped an unknown transport control message from %r", identity)
            return []
        if not self._accept:
            return [RING_REFUSE, name]
        try:
            reader = RingReader(name.decode("ascii"))
            if self.doorbell is None:
                self.doorbell = Doorbell()
        except (OSError, ProtocolError, UnicodeDecodeError) as exc:
            # a segment already gone: its peer closed while the offer was on its way (a
            # race with that peer's shutdown, nothing to warn about); anything else warns
            gone = isinstance(exc.__cause__, FileNotFoundError)
            _log.log(logging.DEBUG if gone else logging.WARNING,
                     "refused the ring of %r: %s", identity, exc)
            return [RING_REFUSE, name]
        previous = self._readers.get(identity)
        if previous is not None:  # an earlier link's ring: what it holds comes first
            self._read_one(identity, previous, into)
            previous.set_asleep(False)
        with self._lock:
            self._readers[identity] = reader
            self.gated[identity] = reader
            self.snapshot = tuple(self._readers.items())
        return [RING_ACCEPT, name, self.doorbell.path.encode()]

    def forget(self, identity: bytes) -> None:
        """Stop reading ``identity``'s ring (the receiving thread may finish a read of it)."""
        with self._lock:
            reader = self._readers.pop(identity, None)
            self.gated.pop(identity, None)
            self.snapshot = tuple(self._readers.items())
        if reader is not None:
            reader.set_asleep(False)  # (a writer still alive need not ring for it)

    def fall_asleep(self) -> tuple[RingReader, ...]:
        """Tell the writers of every ring read here that this receiver is about to block
        on the doorbell (see ``_ring``); the rings told, for :meth:`wake_up`."""
        readers = tuple(reader for _, reader in self.snapshot)
        for reader in readers:
            reader.set_asleep(True)
        return readers

    @staticmethod
    def wake_up(readers: tuple[RingReader, ...]) -> None:
        """This receiver no longer blocks: the rings :meth:`fall_asleep` told (also any
        forgotten meanwhile, whose writers would otherwise ring for nothing)."""
        for reader in readers:
            reader.set_asleep(False)

    def any_ready(self) -> bool:
        for _, reader in self.snapshot:  # noqa: SIM110 - a busy poll's loop: no generator
            if reader.ready():
                return True
        return False

    def read(self, messages: list[list[Any]]) -> None:
        """Append the messages due from the rings."""
        for identity, reader in self.snapshot:
            self._read_one(identity, reader, messages)

    def _read_one(self, identity: bytes, reader: RingReader, messages: list[list[Any]]) -> None:
        try:
            count = reader.read(identity, messages)
        except Exception as exc:  # noqa: BLE001 - a corrupt ring is dropped, not the batch
            _log.error("dropped the ring of %r: %s", identity, exc)
            self.forget(identity)
            return
        if count:
            self.messages_in += count
            if identity in self.gated and reader.open:  # no more counting
                with self._lock:
                    self.gated.pop(identity, None)

    def close(self) -> None:
        with self._lock:
            self._readers.clear()
            self.gated.clear()
            self.snapshot = ()
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None
