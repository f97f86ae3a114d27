"""Shared memory for large buffers between workers on one host.

A buffer of at least the threshold, going to a peer on this host, is copied
once (:mod:`._segment_copy`) into a segment of the sender's pool (POSIX shared memory under
``/dev/shm``, mode 0600, mapped and pre-faulted once and then reused) instead
of being pushed through the socket; the message carries a small descriptor in
its place. The receiver maps the segment (once: its mappings stay open for the
next message through the same segment) and builds the tensor on the mapping
without a copy. When the last tensor using that memory is freed, the receiver
tells the sender, which puts the segment back in its pool.

Invariants (segment lifetime):

* A segment is *lent* from the moment it is exported until the receiver
  releases it, and is never written while lent. A segment lent to a peer that
  left or stopped answering is unlinked and never reused.
* Released segments go back to the free list of their size class (powers of
  two); at most :data:`MAX_FREE_BYTES` stay there, the rest are unlinked.
* The sender unlinks every segment of its pool when it closes, lent or not
  (mappings a receiver holds stay valid: unlinking removes only the name).
* A receiver opens only names of the form ``actorrpc-<pid>-<hex>``, and maps
  exactly the byte count the descriptor declares, checked against the
  segment's size.
* Segments of a process that died without closing its pool (its pid, in the
  name, no longer exists) are unlinked by the next pool created on the host.

Descriptor frame: ``!Q`` byte count followed by the ASCII segment name.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ._segment_copy import SegmentFiller, size_class

__all__ = [
    "MAX_FREE_BYTES",
    "SHM_DIRECTORY",
    "SharedMemoryPool",
    "SharedMappings",
    "check_segment_name",
    "create_segment",
    "map_segment",
    "new_segment_name",
    "shared_memory_available",
    "sweep_orphans",
]

SHM_DIRECTORY = "/dev/shm"
MAX_FREE_BYTES = 1 << 30
MAX_MAPPED_BYTES = 256 << 20  # a receiver's cached mappings of its peers' segments
# Copies into a segment of at least this many bytes run without the GIL (a 64 MiB one
# takes ~10 ms, during which the worker's I/O thread could otherwise neither receive nor
# answer); smaller ones keep it (releasing it costs ~3 µs, 10 % of a 1 MiB copy). How a
# segment is filled (a plain copy or streaming stores): ``_segment_copy``.
RELEASE_GIL_FROM = 4 << 20
_NAME = re.compile(r"actorrpc-([0-9a-f]{1,8})-[0-9a-f]{24}")
_SIZE = struct.Struct("!Q")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def shared_memory_available() -> bool:
    return os.path.isdir(SHM_DIRECTORY) and os.access(SHM_DIRECTORY, os.W_OK)


def new_segment_name() -> str:
    """A fresh name of this process's kind (what :func:`sweep_orphans` recognises)."""
    return f"actorrpc-{os.getpid():x}-{secrets.token_hex(12)}"


def check_segment_name(name: str) -> str:
    """``name`` if it has the form of an actorrpc segment's name, else ProtocolError."""
    if not _NAME.fullmatch(name):
        raise ProtocolError(f"{name!r} is not an actorrpc shared-memory segment name")
    return name


def create_segment(size: int, populate: bool = True) -> tuple[str, mmap.mmap]:
    """A new segment of ``size`` bytes (mode 0600; pre-faulted if ``populate``): its name
    and mapping."""
    name = new_segment_name()
    path = os.path.join(SHM_DIRECTORY, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        # reserved now: on a full /dev/shm a write into a hole would kill the process (SIGBUS)
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=_MAP_FLAGS if populate else mmap.MAP_SHARED)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    return name, mapping


@dataclass(eq=False)
class _Segment:
    name: str
    size: int
    mapping: mmap.mmap
    borrower: int = -1


class SharedMemoryPool:
    """The segments this worker lends to same-host peers, and their free lists."""

    def __init__(self) -> None:
        sweep_orphans()
        self._lock = threading.Lock()
        self._free: dict[int, list[_Segment]] = {}
        self._lent: dict[str, _Segment] = {}
        self._free_bytes = 0
        self._closed = False
        self.filler = SegmentFiller()  # the copy into a segment, and its measurements

    def _create(self, size: int) -> _Segment:
        name, mapping = create_segment(size)
        return _Segment(name, size, mapping)

    def export(self, buffer: Any, borrower: int) -> tuple[bytes, str]:
        """Copy ``buffer`` into a pooled segment lent to ``borrower``; return its descriptor."""
        view = memoryview(buffer).cast("B")
        nbytes = view.nbytes
        size = size_class(nbytes)
        with self._lock:
            if self._closed:
                raise OSError("the shared-memory pool is closed")
            free = self._free.get(size)
            segment = free.pop() if free else None
            if segment is not None:
                self._free_bytes -= size
        if segment is None:
            segment = self._create(size)
        try:  # (a long copy without the GIL: the I/O thread, other calls run meanwhile)
            self.filler.fill(segment.mapping, view, nbytes >= RELEASE_GIL_FROM)
        except BaseException:
            self._give_back(segment)
            raise
        segment.borrower = borrower
        with self._lock:
            self._lent[segment.name] = segment
        return _SIZE.pack(nbytes) + segment.name.encode(), segment.name

    def release(self, names: list[str], borrower: int) -> None:
        """``borrower`` is done with these segments (names it was not lent are ignored)."""
        for name in names:
            with self._lock:
                segment = self._lent.get(name)
                if segment is None or segment.borrower != borrower:
                    continue
                del self._lent[name]
            self._give_back(segment)

    def forget_lent_to(self, borrower: int) -> None:
        """``borrower`` left or stopped answering: unlink what it had, never reuse it.

        Its process may live on with tensors on those mappings (a worker that
        left, one that only hung), so the segments are dropped, not recycled;
        the memory goes when its last mapping does.
        """
        with self._lock:
            forgotten = [s for s in self._lent.values() if s.borrower == borrower]
            for segment in forgotten:
                del self._lent[segment.name]
        for segment in forgotten:
            self._destroy(segment)

    def describe(self) -> dict[str, int]:
        """Segments lent out and kept free, and their bytes."""
        with self._lock:
            return {
                "segments_lent": len(self._lent),
                "bytes_lent": sum(s.size for s in self._lent.values()),
                "segments_free": sum(len(free) for free in self._free.values()),
                "bytes_free": self._free_bytes,
            }

    def _give_back(self, segment: _Segment) -> None:
        segment.borrower = -1
        with self._lock:
            if not self._closed and self._free_bytes + segment.size <= MAX_FREE_BYTES:
                self._free.setdefault(segment.size, []).append(segment)
                self._free_bytes += segment.size
                return
        self._destroy(segment)

    @staticmethod
    def _destroy(segment: _Segment) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIRECTORY, segment.name))
        with contextlib.suppress(BufferError, ValueError):
            segment.mapping.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segments = [s for free in self._free.values() for s in free]
            segments += list(self._lent.values())
            self._free.clear()
            self._lent.clear()
            self._free_bytes = 0
        for segment in segments:
            self._destroy(segment)


def sweep_orphans() -> int:
    """Unlink the segments of processes that no longer exist; return how many."""
    try:
        names = os.listdir(SHM_DIRECTORY)
    except OSError:
        return 0
    swept = 0
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1), 16), 0)
            continue  # alive (or a reused pid: left alone)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIRECTORY, name))
            swept += 1
    return swept


def _parse_descriptor(descriptor: bytes | memoryview) -> tuple[int, str]:
    raw = bytes(descriptor)
    if len(raw) <= _SIZE.size:
        raise ProtocolError("a shared-memory descriptor is too short")
    (nbytes,) = _SIZE.unpack_from(raw)
    name = raw[_SIZE.size:].decode("ascii", errors="replace")
    if not _NAME.fullmatch(name):
        raise ProtocolError(f"a shared-memory descriptor names {name[:80]!r}, not a segment")
    if nbytes <= 0:
        raise ProtocolError(f"shared-memory segment {name} does not hold {nbytes} bytes")
    return nbytes, name


def map_segment(name: str, nbytes: int, populate: bool = True) -> mmap.mmap:
    """Map all of segment ``name`` (pre-faulted if ``populate``), checking it holds
    ``nbytes``."""
    try:
        fd = os.open(os.path.join(SHM_DIRECTORY, name), os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise ProtocolError(f"shared-memory segment {name} is gone (its sender closed)") from exc
    except OSError as exc:  # (a symbolic link, say)
        raise ProtocolError(f"cannot open shared-memory segment {name}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ProtocolError(f"shared-memory segment {name} is not a file of this user")
        size = info.st_size
        if nbytes > size:
            raise ProtocolError(f"shared-memory segment {name} does not hold {nbytes} bytes")
        return mmap.mmap(fd, size, flags=_MAP_FLAGS if populate else mmap.MAP_SHARED)
    finally:
        os.close(fd)


@dataclass(eq=False)
class _Mapping:
    mapping: mmap.mmap
    owner: int
    size: int


class SharedMappings:
    """A receiver's mappings of its peers' segments, kept open to be used again.

    The senders' pools reuse segments, so mapping each one once (and keeping its
    page tables) removes the map/unmap cost from every later message through it.
    At most ``max_bytes`` stay mapped: the least recently used mappings that no
    tensor uses any more are closed first. Mappings of a peer that is gone are
    dropped from the cache (those still in use stay valid until freed).
    """

    def __init__(self, max_bytes: int = MAX_MAPPED_BYTES) -> None:
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Mapping] = OrderedDict()
        self._bytes = 0

    def map(
        self, descriptor: bytes | memoryview, owner: int, on_free: Callable[[str], None]
    ) -> np.ndarray[Any, Any]:
        """The bytes a descriptor names; ``on_free(name)`` runs once nothing uses them."""
        nbytes, name = _parse_descriptor(descriptor)
        with self._lock:  # a mapping is closed only under the lock, when nothing uses it
            cached = self._cache.get(name)
            if cached is not None and cached.owner == owner and cached.size >= nbytes:
                self._cache.move_to_end(name)
                array = np.frombuffer(cached.mapping, dtype=np.uint8, count=nbytes)
            else:
                array = None
        if array is None:
            mapping = map_segment(name, nbytes)
            with self._lock:
                previous = self._cache.pop(name, None)
                if previous is not None:
                    self._bytes -= previous.size
                self._cache[name] = _Mapping(mapping, owner, len(mapping))
                self._bytes += len(mapping)
                array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
                self._trim()
        weakref.finalize(array, on_free, name)
        return array

    def forget(self, owner: int) -> None:
        """``owner`` is gone: drop its mappings (closing those no tensor uses)."""
        with self._lock:
            names = [name for name, m in self._cache.items() if m.owner == owner]
            for name in names:
                self._drop(name)

    def describe(self) -> dict[str, int]:
        with self._lock:
            return {"mappings_cached": len(self._cache), "bytes_mapped": self._bytes}

    def close(self) -> None:
        with self._lock:
            for name in list(self._cache):
                self._drop(name)

    def _trim(self) -> None:
        """Close the least recently used mappings nothing uses until under the limit."""
        for name in list(self._cache):
            if self._bytes <= self._max_bytes:
                return
            entry = self._cache[name]
            try:
                entry.mapping.close()
            except BufferError:
                continue  # a tensor still uses it
            del self._cache[name]
            self._bytes -= entry.size

    def _drop(self, name: str) -> None:
        entry = self._cache.pop(name)
        self._bytes -= entry.size
        with contextlib.suppress(BufferError, ValueError):
            entry.mapping.close()  # in use: unmapped when its last tensor goes
