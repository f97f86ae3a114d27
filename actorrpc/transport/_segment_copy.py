"""Filling a shared-memory segment: a plain copy or streaming stores, whichever is faster.

A sender copies each large buffer into a segment of its pool (``_shared_memory``); the
receiver reads it there. On some hosts that copy is, for whole sessions, up to ten
times slower than a copy into memory nobody else reads: a plain copy writes through
the cache, so each line the receiver's core still holds from the segment's last use must
first be taken back from it, and where the two cores share no cache (two vCPUs on
different core complexes of an AMD host, a placement the guest cannot see) that costs
~25 ns a line: 1 MiB took 330-540 µs against 26-40. Streaming (non-temporal) stores
write around the cache and take 40-50 µs a MiB there, in either kind of session, but
leave the bytes in memory, where the receiver's read costs more than from a cache.
Neither is best everywhere, so :class:`SegmentFiller` measures both.

Invariants of the choice, per size class (a power of two of bytes):

* Each copy is timed; a method's figure is the least time per byte of its last
  :data:`SAMPLES` copies (a least figure: a copy can only be slowed, by preemption,
  say, never sped up).
* The plain copy is used until streaming has a figure, and then unless streaming's
  figure is lower than its own, by the factor :data:`STREAMING_HANDICAP` for size
  classes up to :data:`HANDICAP_UP_TO` (the receiver then reads streamed bytes from
  memory where it would have found plain ones in a cache, a cost the copy's time does
  not show; larger copies leave the caches either way).
* The method not in use is tried once every ``interval`` copies: ``interval`` starts
  at :data:`FIRST_INTERVAL`, doubles (up to :data:`LONGEST_INTERVAL`) each time a
  try leaves the choice as it was, and starts over when the choice changes. A
  session's kind lasts, so once settled the other method costs a thousandth of the
  copies; a change of kind is found within a few of the longest intervals (the method
  in use, timed on every copy, is given up within :data:`SAMPLES` copies of its figure
  crossing the other's).
* Either method writes every byte before it returns; the streaming one ends with a
  store fence, so a receiver that gets the segment's name from a later message sees
  them (x86-64 orders stores after a fence).

Without the C extension (no compiler at install time, not x86-64) only the plain copy is
used and nothing is measured.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _load_extension() -> Any:
    try:
        return importlib.import_module(f"{__package__}._streaming_copy")
    except ImportError:  # (no compiler at install time): the plain copy alone
        return None


_streaming_copy = _load_extension()

__all__ = [
    "FIRST_INTERVAL",
    "FORCED_METHOD",
    "HANDICAP_UP_TO",
    "LONGEST_INTERVAL",
    "PLAIN",
    "SAMPLES",
    "STREAMING",
    "STREAMING_HANDICAP",
    "SegmentFiller",
    "plain_copy",
    "size_class",
    "streaming_copy_available",
]

PLAIN = "plain"
STREAMING = "streaming"
FORCED_METHOD: str | None = None  # PLAIN or STREAMING: used always (benchmarks and tests)
SAMPLES = 3
# Streaming stores leave the bytes in memory, not in this core's cache: the receiver's
# read of them costs more too, which the copy's own time does not show (a 1 MiB echo
# whose both copies streamed took 285-414 µs in sessions where plain ones took 190-250,
# the copies themselves 45 against 25). Streaming is chosen only when its figure is less
# than the plain copy's by this factor (slow sessions' plain copies: 8-12 times).
STREAMING_HANDICAP = 3.0
# ... for size classes up to this many bytes, which the caches keep: from 4 MiB on,
# streamed copies made the echo faster whatever the copies' own times (4 MiB 658 against
# 1,074 µs, 64 MiB 10.1 against 14.5 ms), and streaming is chosen when it is faster at all.
HANDICAP_UP_TO = 2 << 20
FIRST_INTERVAL = 8
LONGEST_INTERVAL = 1024

CopyFunction = Callable[[Any, memoryview, bool], None]


def size_class(nbytes: int) -> int:
    """The size class of a copy of ``nbytes``: the least power of two of bytes holding it
    (a pool's segments are made in these sizes; a filler measures per class)."""
    return 1 << max(0, nbytes - 1).bit_length()


def streaming_copy_available() -> bool:
    """Whether this build has the streaming copy (its C extension, on an x86-64 CPU)."""
    return _streaming_copy is not None and bool(_streaming_copy.STREAMING_STORES)


def plain_copy(destination: Any, source: memoryview, release_gil: bool) -> None:
    """``source`` into the start of ``destination`` through the cache (glibc's memcpy)."""
    nbytes = source.nbytes
    if release_gil:  # numpy copies without the GIL: the process's other threads run
        np.copyto(np.frombuffer(destination, np.uint8, nbytes), np.frombuffer(source, np.uint8))
    else:  # (~3 µs less than the arrays and the GIL's hand-offs)
        destination[:nbytes] = source


# the streaming copy a filler uses unless told otherwise (None: not built here); the
# extension's function itself, called with the copy's arguments (no Python frame between)
_DEFAULT_STREAMING: CopyFunction | None = (
    _streaming_copy.copy if streaming_copy_available() else None
)


class _SizeClass:
    """The measurements and the choice for copies of one size class."""

    def __init__(self, handicap: float) -> None:
        self.handicap = handicap
        self.chosen = PLAIN
        self.samples: dict[str, list[float]] = {PLAIN: [], STREAMING: []}
        self.copies = 0  # copies since the last try of the other method
        self.interval = FIRST_INTERVAL
        self.tries = 0
        self.changes = 0

    def figure(self, method: str) -> float | None:
        samples = self.samples[method]
        return min(samples) if samples else None

    def method_for_next(self) -> str:
        self.copies += 1
        if self.copies >= self.interval:
            self.copies = 0
            self.tries += 1
            return STREAMING if self.chosen == PLAIN else PLAIN
        return self.chosen

    def record(self, method: str, seconds_per_byte: float) -> None:
        samples = self.samples[method]
        samples.append(seconds_per_byte)
        if len(samples) > SAMPLES:
            del samples[0]
        plain, streaming = self.figure(PLAIN), self.figure(STREAMING)
        best = STREAMING if (
            plain is not None and streaming is not None and streaming * self.handicap < plain
        ) else PLAIN
        if best != self.chosen:
            self.chosen = best
            self.changes += 1
            self.interval = FIRST_INTERVAL
            self.copies = 0
        elif method != self.chosen:  # a try that confirmed the choice
            self.interval = min(self.interval * 2, LONGEST_INTERVAL)


class SegmentFiller:
    """Copies buffers into segments with whichever method measures faster (see above).

    The arguments are for tests: the streaming copy (None: only the plain copy), the
    timer and the plain copy.
    """

    def __init__(
        self,
        streaming: CopyFunction | None = _DEFAULT_STREAMING,
        clock: Callable[[], float] = time.perf_counter,
        plain: CopyFunction = plain_copy,
    ) -> None:
        self._methods = {PLAIN: plain, STREAMING: streaming}
        self._clock = clock
        self._lock = threading.Lock()
        self._classes: dict[int, _SizeClass] = {}  # by size class (bytes)

    def fill(self, destination: Any, source: memoryview, release_gil: bool) -> None:
        """Copy all of ``source`` (bytes) into the start of ``destination``."""
        nbytes = source.nbytes
        if self._methods[STREAMING] is None or not nbytes:
            self._methods[PLAIN](destination, source, release_gil)  # type: ignore[misc]
            return
        key = size_class(nbytes)
        with self._lock:
            measured = self._classes.get(key)
            if measured is None:
                handicap = STREAMING_HANDICAP if key <= HANDICAP_UP_TO else 1.0
                measured = self._classes[key] = _SizeClass(handicap)
            # (a forced method is no try: the choice's counts are left as they are)
            method = FORCED_METHOD or measured.method_for_next()
        copy = self._methods[method]
        clock = self._clock
        began = clock()
        copy(destination, source, release_gil)  # type: ignore[misc]
        elapsed = clock() - began
        with self._lock:
            measured.record(method, elapsed / nbytes)

    def describe(self) -> dict[str, Any]:
        """Per size class (``"<=N bytes"``): the method in use, each method's figure (µs
        per MiB), the tries of the other method and the changes of choice."""
        out: dict[str, Any] = {"streaming_available": self._methods[STREAMING] is not None}
        with self._lock:
            for key in sorted(self._classes):
                measured = self._classes[key]
                figures = {}
                for method in (PLAIN, STREAMING):
                    figure = measured.figure(method)
                    figures[f"{method}_us_per_mib"] = (
                        None if figure is None else round(figure * 1e6 * (1 << 20), 1)
                    )
                out[f"<={key} bytes"] = {
                    "chosen": measured.chosen, **figures,
                    "tries": measured.tries, "changes": measured.changes,
                }
        return out
