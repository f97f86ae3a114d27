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
                         it switched (written once, before head first moves)
    offset 192   asleep  1 while the reader blocks (or is about to block) on its
                         doorbell, else 0 (the reader's)
    offset 256   data    ``capacity`` bytes (a power of two), a stream that wraps around

Record (split at the end of the data area where it wraps)::

    <Q  sequence number (0, 1, ... over every message sent after the switch)
    <I  number of frames n (1 .. MAX_FRAMES)
    <I  length of each frame, n times
        the frames' bytes, one after another

Invariants:

* One writer thread at a time (the link's lock) and one reader thread at a
  time (the inbox's turn). The writer stores ``head`` only after the bytes it
  covers, the reader stores ``tail`` only after copying them out: on x86-64,
  8-byte aligned stores are atomic and stores are seen in program order, so a
  reader never sees a ``head`` ahead of its data (elsewhere the socket is used:
  :func:`rings_supported`). Records are published whole.
* The writer never waits: a message that does not fit in the free space (a
  reader behind, a message larger than the ring) goes by socket as a *spill*,
  ``[SPILL, <Q sequence number, frames...]``, behind the libzmq queues as any
  socket message. The reader delivers the ring's records and the spills of one
  writer in sequence order (:meth:`RingReader.take_spill`).
* The doorbell (a FIFO): a reader about to block sets ``asleep``, drains the
  doorbell, looks at its rings once more and only then blocks on it, clearing
  ``asleep`` when it wakes; a writer, after publishing a record, writes one byte
  to the doorbell if ``asleep`` is set (and its buffer is not full). Each side
  puts a full memory fence (:func:`full_fence`) between its store and its load,
  so at least one sees the other's: the reader finds the record, or the writer
  rings. A reader that polls or is busy costs its writers no system call (a
  wake-up write to a FIFO whose reader sleeps on another core costs ~15 µs in
  a VM).
* The switch: after its offer the writer keeps sending by socket until the
  reader's acceptance arrives, counting those messages into ``before``; the
  reader delivers the ring's records only after that many plain socket
  messages from the writer (:attr:`RingReader.socket_seen`). Spills follow
  them on the same connection anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import platform
import stat
import struct
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from mypy_extensions import mypyc_attr

from ..errors import ProtocolError
from ._shared_memory import (
    SHM_DIRECTORY,
    check_segment_name,
    create_segment,
    map_segment,
    new_segment_name,
    shared_memory_available,
)

__all__ = [
    "WAIT_WARNING_SECONDS",
    "MAX_FRAMES",
    "RING_BYTES",
    "SPILL",
    "CopiedFrame",
    "Doorbell",
    "RingReader",
    "RingWriter",
    "full_fence",
    "rings_supported",
]

RING_BYTES = 1 << 18
"""Data bytes of one ring (one per ordered pair of same-host workers that talk): ~1,300
small messages; what does not fit goes by socket (a spill). Its pages are reserved when
it is made (a full ``/dev/shm`` refuses the ring instead of failing a later write)."""
MAX_FRAMES = 4096
SPILL = b"!spill"
"""First frame of a message that did not fit its ring and went by socket."""
WAIT_WARNING_SECONDS = 30.0
"""A ring whose next message (a spill, or the socket messages before the switch) has been
missing this long, with no progress, is reported once in the log."""
_HEAD, _TAIL, _BEFORE, _ASLEEP = 0, 8, 16, 24  # word indexes (byte offsets 0, 64, 128, 192)
_DATA = 256
_MIN_CAPACITY = 1 << 10
_SEQUENCE = struct.Struct("<Q")
_ONE_FRAME = struct.Struct("<QII")  # a record's prefix: sequence, 1 frame, its length
_JOIN_LIMIT = 4096  # records up to this size are joined and copied in once
_monotonic = time.monotonic
_log = logging.getLogger("actorrpc.transport")


_fence_lock = threading.Lock()


def full_fence() -> None:
    """A full memory fence: no later load of this thread is done before its earlier
    stores are visible to other cores. On x86-64 every atomic read-modify-write is
    one (``lock``-prefixed), and taking and releasing a lock makes two."""
    with _fence_lock:
        pass


def rings_supported() -> bool:
    """Whether this process can use rings: a 64-bit x86 Python (atomic, ordered 8-byte
    stores) and shared memory."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and sys.maxsize > 2**32
        and shared_memory_available()
    )


@mypyc_attr(native_class=False)  # (see actorrpc/_compiled.py)
class CopiedFrame(bytearray):
    """A frame copied out of a ring, read as a ``zmq.Frame`` is (``buffer``, ``bytes``,
    or as any bytes-like object)."""

    __slots__ = ()

    @property
    def buffer(self) -> memoryview:
        return memoryview(self)

    @property
    def bytes(self) -> bytes:
        return bytes(self)


class RingWriter:
    """The sending end: a new segment of this process, offered to one peer."""

    def __init__(self, capacity: int = RING_BYTES) -> None:
        if capacity < _MIN_CAPACITY or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two >= {_MIN_CAPACITY}")
        self.name, self._mapping = create_segment(_DATA + capacity, populate=False)
        self._words = memoryview(self._mapping).cast("Q")
        self._data = memoryview(self._mapping)[_DATA:]
        self._capacity = capacity
        self._head = 0
        self._sequence = 0
        self._bell = -1
        self.spills = 0
        self.bells = 0  # doorbell writes (the reader was asleep)

    def start(self, bell_path: str, sent_before: int) -> None:
        """The reader accepted: open its doorbell, record the socket messages before."""
        check_segment_name(os.path.basename(bell_path))
        if os.path.dirname(bell_path) != SHM_DIRECTORY:
            raise ProtocolError(f"a ring doorbell must lie in {SHM_DIRECTORY}: {bell_path!r}")
        fd = os.open(bell_path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
        info = os.fstat(fd)
        if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.getuid():
            os.close(fd)
            raise ProtocolError(f"ring doorbell {bell_path!r} is not a FIFO of this user")
        self._bell = fd
        self._words[_BEFORE] = sent_before
        # the reader has mapped it: the name is no longer needed
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIRECTORY, self.name))

    def write(self, frames: Sequence[Any]) -> bool:
        """Append one message if it fits in the free space; False: send it as a spill
        (:meth:`spill_frames`), in its place."""
        head = self._head
        first = frames[0]
        if len(frames) == 1 and type(first) is bytes:  # the common case: one small frame
            total = _ONE_FRAME.size + len(first)
            if self._capacity - (head - self._words[_TAIL]) < total:
                return False
            record = _ONE_FRAME.pack(self._sequence, 1, len(first)) + first
            start = head & (self._capacity - 1)
            if start + total <= self._capacity:  # (_copy_in's common case, without a call)
                self._data[start:start + total] = record
                head += total
            else:
                head = self._copy_in(head, record)
        else:
            # (raw() gives the bytes of any contiguous buffer in memory order, as a socket
            # sends them)
            parts: list[Any] = []  # (a loop: a comprehension is a frame before 3.12)
            for frame in frames:
                parts.append(frame if type(frame) is bytes else pickle.PickleBuffer(frame).raw())
            if len(parts) > MAX_FRAMES:
                return False  # (a record of more is taken for a corrupt one)
            lengths = list(map(len, parts))
            prefix = struct.pack(f"<QI{len(parts)}I", self._sequence, len(parts), *lengths)
            total = len(prefix) + sum(lengths)
            if self._capacity - (head - self._words[_TAIL]) < total:
                return False
            if total <= _JOIN_LIMIT:
                head = self._copy_in(head, b"".join([prefix, *parts]))
            else:
                head = self._copy_in(head, prefix)
                for part in parts:
                    head = self._copy_in(head, part)
        # (an interrupt between the two leaves a record that goes with the next one,
        # never one overwritten after it was published)
        self._head = head
        self._sequence += 1
        self._words[_HEAD] = head  # publishes the record (after its bytes)
        with _fence_lock:  # full_fence(): the store above is seen before the load below
            pass
        if self._words[_ASLEEP]:
            self._ring()
        return True

    def spill_frames(self, frames: Sequence[Any]) -> list[Any]:
        """The frames that carry a message that did not fit by socket, in its turn."""
        sequence = self._sequence
        self._sequence += 1
        self.spills += 1
        return [SPILL, _SEQUENCE.pack(sequence), *frames]

    def take_back_spill(self) -> None:
        """The spill just made was not sent: its sequence number goes to the next message."""
        self._sequence -= 1
        self.spills -= 1

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

    def _ring(self) -> None:
        self.bells += 1
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
        mapping = map_segment(check_segment_name(name), _DATA + _MIN_CAPACITY, populate=False)
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
        self._expected = 0  # sequence number of the next message to deliver
        self._spilled: dict[int, list[Any]] = {}  # spills that came before their turn
        self.socket_seen = 0  # plain socket messages from the writer since its offer
        self.open = False  # the socket messages before the switch have all come
        self._waiting_since = 0.0  # (_note_wait)
        self._waiting_for: tuple[int, int] = (-1, -1)
        self._warned = False

    def set_asleep(self, asleep: bool) -> None:
        """Tell the writer whether to ring the doorbell after each record (see the module
        docstring: after setting it, fence, then look at the ring before blocking)."""
        self._words[_ASLEEP] = 1 if asleep else 0

    def ready(self) -> bool:
        """Whether the next message in sequence may be delivered now (no side effects but
        remembering that the gate opened: any thread may probe)."""
        if self._spilled and self._expected in self._spilled:
            return True
        if self._words[_HEAD] == self._tail:
            return False
        if not self.open:
            if self.socket_seen < self._words[_BEFORE]:
                return False
            self.open = True  # (for good: the count only grows)
        return self._next_sequence() == self._expected

    def _note_wait(self, waiting: bool) -> None:
        """(After a read; ``waiting``: a spill or a record is still due.) Log once when the
        next message has been missing a long time.

        Nothing is skipped: a socket message can only be lost with its connection, when
        the peer stopped for longer than the heartbeat timeout (it is then declared dead
        by liveness checks anyway), whereas a skip on a clock would reorder or drop
        messages that are merely late (a huge spill still crossing TCP)."""
        if not waiting:
            self._waiting_since = 0.0
            return
        now = _monotonic()
        progress = (self._expected, self.socket_seen)
        if progress != self._waiting_for:
            self._waiting_since, self._waiting_for, self._warned = now, progress, False
        elif not self._warned and now - self._waiting_since >= WAIT_WARNING_SECONDS:
            self._warned = True
            what = (f"{self._words[_BEFORE] - self.socket_seen} socket messages sent before "
                    "the switch" if not self.open else f"message {self._expected}")
            _log.warning("ring %s: %s missing for %g s; the messages after it wait",
                         self.name, what, WAIT_WARNING_SECONDS)

    def take_spill(self, identity: bytes, message: list[Any], into: list[list[Any]]) -> int:
        """A spill ``[identity, SPILL, sequence, frames...]`` came: deliver what is due."""
        if len(message) < 4 or len(message[2]) != _SEQUENCE.size:
            raise ProtocolError(f"ring {self.name}: a malformed spill")
        (sequence,) = _SEQUENCE.unpack(message[2])
        if sequence < self._expected or sequence in self._spilled:
            raise ProtocolError(f"ring {self.name}: spill {sequence} came twice")
        first = message[3]
        self._spilled[sequence] = [identity, first if type(first) is bytes else first.bytes,
                                   *message[4:]]
        return self.read(identity, into)

    def read(self, identity: bytes, into: list[list[Any]]) -> int:
        """Append the messages due, as ``[identity, first frame, later frames...]``."""
        count = 0
        while self.ready():
            spilled = self._spilled.pop(self._expected, None) if self._spilled else None
            if spilled is not None:
                into.append(spilled)
            else:
                self._take_record(identity, into)
            self._expected += 1
            count += 1
        if count:
            self._words[_TAIL] = self._tail  # the writer may reuse the space now
        if self.open and self._words[_HEAD] != self._tail:  # waits for a spill, or corrupt
            next_record = self._next_sequence()
            if next_record < self._expected:
                raise ProtocolError(f"ring {self.name}: record {next_record} came twice")
        waiting = bool(self._spilled) or self._words[_HEAD] != self._tail
        if waiting or self._waiting_since:  # (the call only then: a frame less per read)
            self._note_wait(waiting)
        return count

    def _next_sequence(self) -> int:
        start = self._tail & (self._capacity - 1)
        if start + 8 <= self._capacity:
            return int(_SEQUENCE.unpack_from(self._data, start)[0])
        return int(_SEQUENCE.unpack(self._copy_out(self._tail, 8))[0])

    def _take_record(self, identity: bytes, into: list[list[Any]]) -> None:
        tail = self._tail
        available = self._words[_HEAD] - tail
        start = tail & (self._capacity - 1)
        if start + _ONE_FRAME.size <= self._capacity:
            _, nframes, first = _ONE_FRAME.unpack_from(self._data, start)
        else:
            _, nframes, first = _ONE_FRAME.unpack(self._copy_out(tail, _ONE_FRAME.size))
        if nframes == 1:
            size = _ONE_FRAME.size + first
            if available < size:
                raise ProtocolError(f"ring {self.name}: a record runs past the data written")
            into.append([identity, self._copy_out(tail + _ONE_FRAME.size, first, bytes)])
            self._tail = tail + size
            return
        prefix = 12 + 4 * nframes
        if not 0 < nframes <= MAX_FRAMES or available < prefix:
            raise ProtocolError(f"ring {self.name}: a record of {nframes} frames")
        lengths = self._read_counts(tail + 12, nframes)
        size = prefix + sum(lengths)
        if available < size:
            raise ProtocolError(f"ring {self.name}: a record runs past the data written")
        position = tail + prefix
        message: list[Any] = [identity, self._copy_out(position, lengths[0], bytes)]
        position += lengths[0]
        for length in lengths[1:]:
            message.append(self._copy_out(position, length, CopiedFrame))
            position += length
        into.append(message)
        self._tail = tail + size

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
    """A receiver's FIFO that writers of its rings write a byte to after a message while
    the receiver sleeps on it (the rings' ``asleep`` word)."""

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
