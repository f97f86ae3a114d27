"""Filling shared-memory segments: the streaming copy, and the choice between it and a plain one.

The choice's rules are tested with stand-in copies whose cost a fake clock charges; the
copies themselves with real buffers; real workers using each are in test_shared_memory.
"""

from __future__ import annotations

import mmap
import platform
import shutil
from typing import Any

import pytest

from actorrpc.transport import _segment_copy
from actorrpc.transport._segment_copy import (
    FIRST_INTERVAL,
    HANDICAP_UP_TO,
    LONGEST_INTERVAL,
    PLAIN,
    SAMPLES,
    STREAMING,
    STREAMING_HANDICAP,
    SegmentFiller,
    plain_copy,
    size_class,
    streaming_copy_available,
)
from tests._gil import other_thread_ran_during

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


# --- the streaming copy itself -----------------------------------------------------------------


def test_the_streaming_copy_is_built_where_it_can_be():
    """Installing on x86-64 with a C compiler builds it (the package's setup.py)."""
    if platform.machine() not in ("x86_64", "AMD64") or not (
        shutil.which("cc") or shutil.which("gcc")
    ):
        pytest.skip("no x86-64 CPU or no C compiler here: the plain copy alone is used")
    assert streaming_copy_available()


needs_streaming = pytest.mark.skipif(not streaming_copy_available(),
                                     reason="the streaming copy is not built here")


@needs_streaming
@pytest.mark.parametrize("length", [0, 1, 15, 63, 64, 65, 127, 4095, 4096, 65537, MIB + 13])
@pytest.mark.parametrize("destination_offset", [0, 1, 17, 63])
@pytest.mark.parametrize("source_offset", [0, 5])
def test_streaming_copy_writes_exactly_the_source(length, destination_offset, source_offset):
    extension = _segment_copy._streaming_copy
    source = bytes((i * 7 + 3) % 251 for i in range(length + source_offset))
    destination = mmap.mmap(-1, length + destination_offset + 64)
    destination[:] = b"\xee" * len(destination)
    target = memoryview(destination)[destination_offset:]
    extension.copy(target, memoryview(source)[source_offset:], False)
    target.release()
    assert destination[:destination_offset] == b"\xee" * destination_offset
    end = destination_offset + length
    assert destination[destination_offset:end] == source[source_offset:]
    assert destination[end:] == b"\xee" * (len(destination) - end)  # nothing beyond
    destination.close()


@needs_streaming
def test_streaming_copy_refuses_a_destination_too_small():
    with pytest.raises(ValueError, match="cannot copy 100 bytes into a buffer of 99 bytes"):
        _segment_copy._streaming_copy.copy(bytearray(99), bytes(100), False)
    with pytest.raises(TypeError):
        _segment_copy._streaming_copy.copy(bytes(100), bytes(10), False)  # read-only


@needs_streaming
def test_streaming_copy_releases_the_gil_only_when_asked():
    source = bytes(64 * MIB)
    destination = bytearray(64 * MIB)

    def copy(release: bool) -> None:
        _segment_copy._streaming_copy.copy(destination, source, release)

    copy(True)  # (pages touched once: the timed copies are copies alone)
    assert any(other_thread_ran_during(lambda: copy(True)) for _ in range(3))
    assert not other_thread_ran_during(lambda: copy(False))


# --- the choice, with stand-in copies and a fake clock ------------------------------------------


class _Host:
    """Stand-in copies that charge a fake clock per byte, and a log of the methods used."""

    def __init__(self, plain_cost: float, streaming_cost: float) -> None:
        self.now = 0.0
        self.cost = {PLAIN: plain_cost, STREAMING: streaming_cost}
        self.used: list[str] = []

    def clock(self) -> float:
        return self.now

    def copier(self, method: str) -> Any:
        def copy(destination: Any, source: memoryview, release_gil: bool) -> None:
            self.now += self.cost[method] * source.nbytes
            self.used.append(method)
        return copy

    def filler(self) -> SegmentFiller:
        return SegmentFiller(self.copier(STREAMING), self.clock, self.copier(PLAIN))


def _fill(filler: SegmentFiller, copies: int, nbytes: int = MIB) -> None:
    source = memoryview(bytes(nbytes))
    for _ in range(copies):
        filler.fill(None, source, False)


def _described(filler: SegmentFiller, nbytes: int = MIB) -> dict[str, Any]:
    """What ``filler`` reports of the size class of copies of ``nbytes``."""
    return filler.describe()[f"<={size_class(nbytes)} bytes"]


def _tries_at(used: list[str], method: str) -> list[int]:
    return [i for i, m in enumerate(used) if m == method]


def test_plain_copies_stay_while_faster_and_the_tries_of_streaming_grow_apart():
    host = _Host(plain_cost=1.0, streaming_cost=2.0)
    filler = host.filler()
    _fill(filler, 3000)
    tries = _tries_at(host.used, STREAMING)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert tries[0] == FIRST_INTERVAL - 1  # the first try, then ever longer intervals
    assert gaps == sorted(gaps) and gaps[-1] == LONGEST_INTERVAL
    assert len(tries) < 3000 // 200
    described = _described(filler)
    assert described["chosen"] == PLAIN and described["changes"] == 0
    assert described["plain_us_per_mib"] == pytest.approx(1e6 * MIB)


def test_plain_copies_stay_unless_streaming_is_faster_by_its_handicap():
    """Streamed bytes cost the receiver more: a plain copy somewhat slower still wins."""
    host = _Host(plain_cost=0.9 * STREAMING_HANDICAP, streaming_cost=1.0)
    filler = host.filler()
    _fill(filler, 500)
    described = _described(filler)
    assert described["chosen"] == PLAIN and described["changes"] == 0
    assert described["streaming_us_per_mib"] is not None  # tried, and not taken
    host.cost[PLAIN] = 1.1 * STREAMING_HANDICAP
    _fill(filler, SAMPLES)
    assert _described(filler)["chosen"] == STREAMING


def test_streaming_takes_over_at_its_first_try_when_plain_copies_are_slow():
    host = _Host(plain_cost=10.0, streaming_cost=1.0)
    filler = host.filler()
    _fill(filler, 2000)
    assert host.used[:FIRST_INTERVAL] == [PLAIN] * (FIRST_INTERVAL - 1) + [STREAMING]
    plain_tries = _tries_at(host.used[FIRST_INTERVAL:], PLAIN)
    assert 0 < len(plain_tries) < 12  # the plain copy is tried again, rarely
    assert _described(filler)["chosen"] == STREAMING


def test_the_choice_follows_a_change_of_session_kind():
    host = _Host(plain_cost=1.0, streaming_cost=2.0)
    filler = host.filler()
    _fill(filler, 100)
    host.cost[PLAIN] = 10.0  # the plain copy turns slow: given up within SAMPLES copies
    start = len(host.used)
    _fill(filler, SAMPLES + 1)
    assert host.used[start + SAMPLES:] == [STREAMING]
    _fill(filler, 200)
    host.cost[PLAIN] = 1.0  # fast again: its next try takes the choice back
    start = len(host.used)
    _fill(filler, 2 * LONGEST_INTERVAL + 10)
    first_plain = _tries_at(host.used[start:], PLAIN)[0]
    assert host.used[start + first_plain + 1:].count(STREAMING) <= (
        len(host.used[start + first_plain + 1:]) // FIRST_INTERVAL + 1)
    assert _described(filler)["chosen"] == PLAIN


def test_a_slowed_copy_does_not_change_the_choice():
    """A method's figure is its least time of its last copies: one preempted copy is no sign."""
    host = _Host(plain_cost=1.0, streaming_cost=2.0)
    filler = host.filler()
    _fill(filler, 50)
    host.cost[PLAIN] = 100.0
    _fill(filler, 1)
    host.cost[PLAIN] = 1.0
    _fill(filler, 5)
    described = _described(filler)
    assert described["chosen"] == PLAIN and described["changes"] == 0


def test_large_copies_choose_streaming_when_it_is_faster_at_all():
    """Beyond HANDICAP_UP_TO the bytes leave the caches either way: no handicap."""
    host = _Host(plain_cost=1.5, streaming_cost=1.0)
    filler = host.filler()
    for nbytes in (HANDICAP_UP_TO, HANDICAP_UP_TO + 1):
        _fill(filler, 20, nbytes)
    assert _described(filler, HANDICAP_UP_TO)["chosen"] == PLAIN
    assert _described(filler, HANDICAP_UP_TO + 1)["chosen"] == STREAMING


def test_size_classes_are_powers_of_two_and_choose_apart():
    assert [size_class(n) for n in (0, 1, 2, 3, MIB, MIB + 1)] == [1, 1, 2, 4, MIB, 2 * MIB]
    host = _Host(plain_cost=1.0, streaming_cost=2.0)
    filler = host.filler()
    _fill(filler, 20, nbytes=MIB)
    host.cost = {PLAIN: 10.0, STREAMING: 1.0}  # (other sizes, another kind of session)
    _fill(filler, 20, nbytes=64 * MIB)
    assert _described(filler, MIB)["chosen"] == PLAIN
    assert _described(filler, 64 * MIB)["chosen"] == STREAMING


def test_without_the_streaming_copy_only_the_plain_one_runs_unmeasured():
    host = _Host(plain_cost=10.0, streaming_cost=1.0)
    filler = SegmentFiller(None, host.clock, host.copier(PLAIN))
    _fill(filler, 50)
    assert host.used == [PLAIN] * 50
    assert filler.describe() == {"streaming_available": False}


def test_a_forced_method_is_used_always(monkeypatch):
    host = _Host(plain_cost=1.0, streaming_cost=2.0)
    filler = host.filler()
    monkeypatch.setattr(_segment_copy, "FORCED_METHOD", STREAMING)
    _fill(filler, 40)
    assert host.used == [STREAMING] * 40
    assert _described(filler)["tries"] == 0  # forced copies are no tries of the choice


@pytest.mark.parametrize("release_gil", [False, True])
def test_plain_copy_writes_the_source(release_gil):
    destination = mmap.mmap(-1, 3 * MIB)
    source = memoryview(bytes(range(256)) * (MIB // 256 + 1))
    plain_copy(destination, source, release_gil)
    assert destination[:source.nbytes] == source.tobytes()
    assert destination[source.nbytes:] == bytes(3 * MIB - source.nbytes)
    destination.close()
