"""Same-host rings: one worker's messages to another through shared memory.

Between two workers of one host, a message through ZeroMQ passes four threads
(sender, the sender's libzmq I/O thread, the receiver's, the receiver) and two
TCP system calls; on a 2-core machine each hand-off is a context switch on a
core the workers also need. A ring is a single-producer single-consumer byte
stream in a shared-memory segment: the sending thread copies the message in,
the receiving thread (polling, or woken by a doorbell) copies it out.

Segment layout (native byte order, 8-byte words; x86-64 only, see below)::

    offset   0   head    bytes written so far (the writer's; published after the data)
    offset  64   tail    bytes read so far (the reader's; its own cache line)
    offset 128   before  messages the writer sent by socket after its offer and before
                         the ring's first message (written once, before head moves)
    offset 256   data    ``capacity`` bytes (a power of two), a stream that wraps around

Record (a stream of bytes, split at the end of the data area where it wraps)::

    <I  number of frames n (1 .. MAX_FRAMES)
    <I  length of each frame, n times
        the frames' bytes, one after another

Invariants:

* One writer thread at a time (the link's lock) and one reader thread at a
  time (the inbox's turn). The writer stores ``head`` only after the bytes it
  covers, the reader stores ``tail`` only after copying them out: on x86-64,
  8-byte aligned stores are atomic and stores are seen in program order, so a
  reader never sees a ``head`` ahead of its data (other architectures keep
  using the socket: :func:`rings_supported`).
* A record that fits the ring is published whole (one ``head`` store); a
  larger one streams through in pieces while the reader drains it.
* Every record is followed by one byte written to the reader's doorbell (a
  FIFO) unless its buffer is full; a reader about to block drains the doorbell,
  looks at its rings once more and only then blocks on it, so no wake-up is
  lost.
* Ordering with the socket: after its offer the writer keeps sending by
  socket until the reader's acceptance arrives, counting those messages into
  ``before``; the reader delivers the ring's messages only after that many
  socket messages from the writer (:attr:`RingReader.socket_seen`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import platform
import stat
import struct
import time
from collections.abc import Sequence
from typing import Any

from ..errors import PeerUnreachableError, ProtocolError
from ._shared_memory import (
    SHM_DIRECTORY,
    check_segment_name,
    create_segment,
    map_segment,
    new_segment_name,
    shared_memory_available,
)

__all__ = [
    "MAX_FRAMES",
    "RING_BYTES",
    "CopiedFrame",
    "Doorbell",
    "RingReader",
    "RingWriter",
    "rings_supported",
]

RING_BYTES = 1 << 20
"""Data bytes of one ring (one per ordered pair of same-host workers that talk): room for
~5,000 small messages, as a socket's queue holds 10,000. Pages are not pre-faulted: a
pair that exchanges little uses little memory."""
MAX_FRAMES = 4096
_HEAD, _TAIL, _BEFORE = 0, 8, 16  # word indexes (byte offsets 0, 64, 128)
_DATA = 256
_JOIN_LIMIT = 4096  # records up to this size are joined and copied in once
GATE_SECONDS = 5.0
"""A ring whose messages wait longer than this for the socket messages sent before it is
read anyway (those were lost with a dropped connection), with an error logged: one lost
message, not every later one held back."""
_SPIN_SECONDS = 0.001  # a writer waiting for space yields this long, then sleeps
_MAX_SLEEP_SECONDS = 0.002
_monotonic = time.monotonic
_log = logging.getLogger("actorrpc.transport")


def rings_supported() -> bool:
    """Whether this host can use rings (shared memory, and x86-64's store ordering)."""
    return platform.machine().lower() in ("x86_64", "amd64") and shared_memory_available()


class CopiedFrame:
    """A frame copied out of a ring, read as a ``zmq.Frame`` is (``buffer``, ``bytes``)."""

    __slots__ = ("buffer",)

    def __init__(self, data: bytearray) -> None:
        self.buffer = memoryview(data)

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()

    def __len__(self) -> int:
        return self.buffer.nbytes


class RingWriter:
    """The sending end: a new segment of this process, offered to one peer."""

    def __init__(self, capacity: int = RING_BYTES) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two, got {capacity}")
        self.name, self._mapping = create_segment(_DATA + capacity, populate=False)
        self._words = memoryview(self._mapping).cast("Q")
        self._data = memoryview(self._mapping)[_DATA:]
        self._capacity = capacity
        self._head = 0
        self._bell = -1
        self.broken = False  # a record was left half written: the stream is unusable

    def start(self, bell_path: str, sent_before: int) -> None:
        """The reader accepted: open its doorbell, record the socket messages before."""
        check_segment_name(os.path.basename(bell_path))
        if os.path.dirname(bell_path) != SHM_DIRECTORY:
            raise ProtocolError(f"a ring doorbell must lie in {SHM_DIRECTORY}: {bell_path!r}")
        fd = os.open(bell_path, os.O_WRONLY | os.O_NONBLOCK)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            raise ProtocolError(f"ring doorbell {bell_path!r} is not a FIFO")
        self._bell = fd
        self._words[_BEFORE] = sent_before
        # the reader has mapped it: the name is no longer needed
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIRECTORY, self.name))

    def write(self, frames: Sequence[Any], timeout: float) -> None:
        """Append one message; waits up to ``timeout`` seconds (< 0: forever) for space."""
        if self.broken:
            raise PeerUnreachableError("a ring message was left half written (a send timed out)")
        # (raw() gives the bytes of any contiguous buffer in memory order, as a socket sends)
        parts: list[Any] = [
            frame if type(frame) is bytes else pickle.PickleBuffer(frame).raw() for frame in frames
        ]
        if not 0 < len(parts) <= MAX_FRAMES:
            raise ValueError(f"a message has 1 to {MAX_FRAMES} frames, not {len(parts)}")
        lengths = [len(part) for part in parts]
        prefix = struct.pack(f"<{len(parts) + 1}I", len(parts), *lengths)
        total = len(prefix) + sum(lengths)
        if total <= _JOIN_LIMIT:
            parts = [b"".join([prefix, *parts])]
        else:
            parts.insert(0, prefix)
        head = self._head
        words = self._words
        if total <= self._capacity:
            if self._capacity - (head - words[_TAIL]) < total:
                self._wait_for_space(total, timeout)
            for part in parts:
                head = self._copy_in(head, part)
            # (an interrupt between the two leaves a record that goes with the next one,
            # never one overwritten after it was published)
            self._head = head
            words[_HEAD] = head  # publishes the record (after its bytes)
        else:
            try:
                self._stream(parts, timeout)
            except BaseException:
                self.broken = True  # part of a record is out: the stream cannot go on
                raise
        self._ring()

    def _copy_in(self, head: int, part: Any) -> int:
        capacity = self._capacity
        start = head & (capacity - 1)
        size = len(part)
        if start + size <= capacity:
            self._data[start:start + size] = part
        else:
            view = memoryview(part)
            first = capacity - start
            self._data[start:] = view[:first]
            self._data[:size - first] = view[first:]
        return head + size

    def _stream(self, parts: list[Any], timeout: float) -> None:
        """Write a record larger than the ring, publishing each piece as it goes in."""
        words = self._words
        for part in parts:
            view = memoryview(part)
            done = 0
            while done < len(view):
                free = self._capacity - (self._head - words[_TAIL])
                if free == 0:
                    self._ring()
                    self._wait_for_space(1, timeout)
                    continue
                size = min(free, len(view) - done)
                self._head = self._copy_in(self._head, view[done:done + size])
                words[_HEAD] = self._head  # the reader drains it while the rest comes
                done += size

    def _wait_for_space(self, needed: int, timeout: float) -> None:
        self._ring()  # a blocked reader must drain the ring
        started = _monotonic()
        deadline = started + timeout if timeout >= 0 else float("inf")
        pause = 0.0001
        while self._capacity - (self._head - self._words[_TAIL]) < needed:
            now = _monotonic()
            if now >= deadline:
                raise PeerUnreachableError(
                    f"the peer did not read its same-host ring within {timeout:g} s "
                    "(it is not receiving)"
                )
            if now - started < _SPIN_SECONDS:
                os.sched_yield()
            else:
                time.sleep(min(pause, max(0.0, deadline - now)))
                pause = min(2 * pause, _MAX_SLEEP_SECONDS)

    def _ring(self) -> None:
        if self._bell >= 0:
            try:
                os.write(self._bell, b"\0")
            except OSError:  # full (the reader will look anyway) or the reader is gone
                pass

    def close(self) -> None:
        """Unmap (the reader's mapping stays valid) and unlink if not done yet."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIRECTORY, self.name))
        if self._bell >= 0:
            with contextlib.suppress(OSError):
                os.close(self._bell)
            self._bell = -1
        self._words.release()
        self._data.release()
        with contextlib.suppress(BufferError, ValueError):
            self._mapping.close()


class RingReader:
    """The receiving end of one peer's ring (mapped by name from its offer)."""

    def __init__(self, name: str) -> None:
        mapping = map_segment(check_segment_name(name), _DATA + 1, populate=False)
        capacity = len(mapping) - _DATA
        if capacity & (capacity - 1):
            mapping.close()
            raise ProtocolError(f"ring {name} has {capacity} data bytes, not a power of two")
        self.name = name
        self._mapping = mapping
        self._words = memoryview(mapping).cast("Q")
        self._data = memoryview(mapping)[_DATA:]
        self._capacity = capacity
        self._tail = 0
        self.socket_seen = 0  # socket messages from the writer since its offer
        self.open = False  # the socket messages before the ring's first have all come
        self._gated_since = 0.0  # when the ring was first seen holding a message, gated
        self._partial: bytearray | None = None  # a record larger than the ring, so far
        self._partial_lengths: tuple[int, ...] = ()
        self._partial_done = 0

    def ready(self) -> bool:
        """Whether a message (or part of a large one) may be read now."""
        if self._words[_HEAD] == self._tail:
            return False
        if not self.open:
            self.open = self.socket_seen >= self._words[_BEFORE] or self._gate_expired()
        return self.open

    def _gate_expired(self) -> bool:
        now = _monotonic()
        if not self._gated_since:
            self._gated_since = now
            return False
        if now - self._gated_since < GATE_SECONDS:
            return False
        _log.error(
            "ring %s: %d of the %d socket messages sent before it did not arrive within "
            "%g s (a dropped connection): reading it anyway", self.name,
            self._words[_BEFORE] - self.socket_seen, self._words[_BEFORE], GATE_SECONDS,
        )
        return True

    def read(self, identity: bytes, into: list[list[Any]]) -> int:
        """Append the complete messages waiting, as ``[identity, first frame, later...]``."""
        if not self.ready():
            return 0
        head = self._words[_HEAD]
        tail = self._tail
        count = 0
        while tail < head:
            if self._partial is not None:
                tail = self._continue_partial(tail, head, identity, into)
                if self._partial is not None:
                    break
                count += 1
                continue
            available = head - tail
            if available < 4:
                break
            (nframes,) = self._read_counts(tail, 1)
            if not 0 < nframes <= MAX_FRAMES:
                raise ProtocolError(f"ring {self.name}: a record of {nframes} frames")
            prefix_size = 4 + 4 * nframes
            if available < prefix_size:
                break
            lengths = self._read_counts(tail + 4, nframes)
            size = prefix_size + sum(lengths)
            if available >= size:
                into.append(self._frames(identity, tail + prefix_size, lengths))
                tail += size
                count += 1
            elif size > self._capacity:  # streams in: collect it
                self._partial = bytearray(size - prefix_size)
                self._partial_lengths = lengths
                self._partial_done = 0
                tail += prefix_size
            else:
                break  # (a whole record is published at once: not reached)
        self._tail = tail
        self._words[_TAIL] = tail
        return count

    def _frames(self, identity: bytes, position: int, lengths: Sequence[int]) -> list[Any]:
        message: list[Any] = [identity, self._copy_out(position, lengths[0], bytes)]
        position += lengths[0]
        for length in lengths[1:]:
            message.append(CopiedFrame(self._copy_out(position, length)))
            position += length
        return message

    def _continue_partial(self, tail: int, head: int, identity: bytes,
                          into: list[list[Any]]) -> int:
        partial = self._partial
        assert partial is not None
        size = min(head - tail, len(partial) - self._partial_done)
        partial[self._partial_done:self._partial_done + size] = self._copy_out(tail, size)
        self._partial_done += size
        tail += size
        if self._partial_done == len(partial):
            view = memoryview(partial)
            lengths = self._partial_lengths
            message: list[Any] = [identity, view[:lengths[0]].tobytes()]
            position = lengths[0]
            for length in lengths[1:]:
                message.append(CopiedFrame(bytearray(view[position:position + length])))
                position += length
            into.append(message)
            self._partial = None
        return tail

    def _read_counts(self, position: int, count: int) -> tuple[int, ...]:
        start = position & (self._capacity - 1)
        if start + 4 * count <= self._capacity:
            return struct.unpack_from(f"<{count}I", self._data, start)
        return struct.unpack(f"<{count}I", self._copy_out(position, 4 * count))

    def _copy_out(self, position: int, size: int, kind: Any = bytearray) -> Any:
        """``size`` bytes from stream position ``position``, as a new ``kind``."""
        capacity = self._capacity
        start = position & (capacity - 1)
        if start + size <= capacity:
            return kind(self._data[start:start + size])
        first = capacity - start
        out = bytearray(size)
        out[:first] = self._data[start:]
        out[first:] = self._data[:size - first]
        return out if kind is bytearray else kind(out)

    def close(self) -> None:
        self._words.release()
        self._data.release()
        with contextlib.suppress(BufferError, ValueError):
            self._mapping.close()


class Doorbell:
    """A receiver's FIFO that writers of its rings write a byte to after each message."""

    def __init__(self) -> None:
        self.path = os.path.join(SHM_DIRECTORY, new_segment_name())
        os.mkfifo(self.path, 0o600)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            # a write end of its own: no hang-up while no writer has it open
            self._keep = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise

    def drain(self) -> None:
        """Forget the rings so far (the caller looks at the rings after this)."""
        try:
            while len(os.read(self.fd, 65536)) == 65536:
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        for fd in (self.fd, self._keep):
            with contextlib.suppress(OSError):
                os.close(fd)
