"""Same-host rings (``transport._ring``): the stream itself, the switch from the socket,
and real workers using them."""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

import actorrpc as rpc
from actorrpc.errors import ProtocolError
from actorrpc.transport import Transport
from actorrpc.transport._ring import (
    MAX_FRAMES,
    Doorbell,
    RingReader,
    RingWriter,
    rings_supported,
)
from actorrpc.transport._ring_inbox import RING_OFFER, RING_REFUSE
from actorrpc.transport._shared_memory import SHM_DIRECTORY

from ._waiting import start_blocked, wait_until

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not rings_supported(), reason="rings need x86-64 and /dev/shm"),
]


@pytest.fixture(autouse=True)
def _rings_offered_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Links offer their ring when made (the switch's tests; the default waits for a few
    messages by socket, tested on its own below)."""
    from actorrpc.transport import _zmq

    monkeypatch.setattr(_zmq, "RING_AFTER_MESSAGES", 0)


@contextlib.contextmanager
def _ring_of(sent_before: int) -> Iterator[tuple[RingWriter, RingReader, Doorbell]]:
    """A 4 KiB ring, started after ``sent_before`` socket messages, and its doorbell."""
    doorbell = Doorbell()
    writer = RingWriter(capacity=1 << 12)
    reader = RingReader(writer.name)
    try:
        writer.start(doorbell.path, sent_before)
        yield writer, reader, doorbell
    finally:
        writer.close()
        reader.close()
        doorbell.close()


@pytest.fixture
def ring() -> Iterator[tuple[RingWriter, RingReader, Doorbell]]:
    with _ring_of(0) as parts:
        yield parts


def _read_all(reader: RingReader, count: int, deadline_s: float = 10.0) -> list[list[object]]:
    messages: list[list[object]] = []
    deadline = time.monotonic() + deadline_s
    while len(messages) < count and time.monotonic() < deadline:
        reader.read(b"peer", messages)
    return messages


def _payloads(message: list[object]) -> list[bytes]:
    first, *rest = message[1:]
    return [bytes(first)] + [bytes(getattr(f, "buffer", f)) for f in rest]


def _write(writer: RingWriter, frames: list[object]) -> None:
    assert writer.write(frames), "no room in the ring"


def _spill(writer: RingWriter, frames: list[object]) -> list[object]:
    """What a link sends by socket for ``frames``, as its receiver sees it."""
    spill = writer.spill_frames(frames)
    return [b"peer", *[bytes(f) if not isinstance(f, bytes) else f for f in spill]]


def test_messages_keep_order_and_frames_as_the_ring_wraps_around(ring) -> None:
    writer, reader, _ = ring
    sent = []
    for i in range(200):  # ~40 KiB through a 4 KiB ring: wraps many times
        frames = [b"H%d" % i, bytes([i % 256]) * (i % 150), b"tail"][: 1 + i % 3]
        _write(writer, frames)
        sent.append(frames)
        if i % 7 == 6:  # the reader drains now and then, often mid-way through the data area
            assert [_payloads(m) for m in _read_all(reader, 7)] == sent[-7:]
    rest = len(sent) % 7
    assert [_payloads(m) for m in _read_all(reader, rest)] == (sent[-rest:] if rest else [])
    assert _read_all(reader, 0) == []


def test_what_does_not_fit_is_spilled_and_delivered_in_its_turn(ring) -> None:
    writer, reader, _ = ring
    _write(writer, [b"r0"])
    assert not writer.write([b"x" * 5000])  # larger than the ring: the caller spills it
    spill1 = _spill(writer, [b"s1", b"x" * 5000])
    _write(writer, [b"r2"])
    _write(writer, [b"r3", b"y" * 3000])
    assert not writer.write([b"z" * 2000])  # no room now (the reader is behind)
    spill4 = _spill(writer, [b"s4"])
    messages: list[list[object]] = []
    assert reader.read(b"peer", messages) == 1  # r0; r2 waits for spill 1
    assert [_payloads(m) for m in messages] == [[b"r0"]]
    assert not reader.ready()
    # spill 4 comes before the reader looked again, spill 1 after it
    assert reader.take_spill(b"peer", spill4, messages) == 0
    assert reader.take_spill(b"peer", spill1, messages) == 4
    assert [_payloads(m) for m in messages] == [
        [b"r0"], [b"s1", b"x" * 5000], [b"r2"], [b"r3", b"y" * 3000], [b"s4"]]
    with pytest.raises(ProtocolError, match="came twice"):
        reader.take_spill(b"peer", spill4, messages)


def test_a_message_of_more_frames_than_a_record_holds_is_spilled(ring) -> None:
    writer, reader, _ = ring
    many = [b"AR-header"] + [b"f"] * MAX_FRAMES  # (out-of-band buffers of a big pickle)
    assert not writer.write(many)
    spill = _spill(writer, many)
    messages: list[list[object]] = []
    assert reader.take_spill(b"peer", spill, messages) == 1
    assert len(messages[0]) == 1 + len(many)


def test_a_spill_that_was_not_sent_gives_its_turn_back(ring) -> None:
    writer, reader, _ = ring
    writer.spill_frames([b"never sent"])
    writer.take_back_spill()
    _write(writer, [b"next"])
    assert [_payloads(m) for m in _read_all(reader, 1)] == [[b"next"]]


def test_a_late_spill_is_waited_for_never_skipped_and_a_long_wait_is_logged(
    ring, monkeypatch, caplog
) -> None:
    from actorrpc.transport import _ring

    monkeypatch.setattr(_ring, "WAIT_WARNING_SECONDS", 0.05)
    writer, reader, _ = ring
    spill = _spill(writer, [b"late"])  # still crossing the socket
    _write(writer, [b"after"])
    assert _read_all(reader, 1, deadline_s=0.2) == []  # held back, however long
    assert "message 0 missing for 0.05 s" in caplog.text
    assert caplog.text.count("missing for") == 1  # once per wait
    messages: list[list[object]] = []
    assert reader.take_spill(b"peer", spill, messages) == 2
    assert [_payloads(m) for m in messages] == [[b"late"], [b"after"]]
    assert not reader.ready()  # (a probe from any thread changes nothing)


def test_the_reader_waits_for_the_socket_messages_sent_before_the_ring() -> None:
    with _ring_of(2) as (writer, reader, _):
        _write(writer, [b"by ring"])
        assert not reader.ready() and _read_all(reader, 1, 0.05) == []
        reader.socket_seen = 1
        assert not reader.ready()
        reader.socket_seen = 2
        assert [_payloads(m) for m in _read_all(reader, 1)] == [[b"by ring"]]


def test_buffers_go_in_memory_order_as_a_socket_sends_them(ring) -> None:
    import numpy as np

    writer, reader, _ = ring
    fortran = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    _write(writer, [b"H", fortran, memoryview(b"abc")])
    (message,) = _read_all(reader, 1)
    assert _payloads(message) == [b"H", fortran.tobytes(order="A"), b"abc"]
    with pytest.raises(BufferError):  # not contiguous: refused, nothing written
        writer.write([b"H", np.arange(10)[::2]])
    _write(writer, [b"after"])
    assert [_payloads(m) for m in _read_all(reader, 1)] == [[b"after"]]


def test_a_ring_waits_for_the_socket_messages_before_it_however_long(
    monkeypatch, caplog
) -> None:
    from actorrpc.transport import _ring

    monkeypatch.setattr(_ring, "WAIT_WARNING_SECONDS", 0.05)
    with _ring_of(3) as (writer, reader, _):  # 3 socket messages still on their way
        _write(writer, [b"by ring"])
        assert _read_all(reader, 1, deadline_s=0.2) == []
        assert "3 socket messages sent before the switch missing" in caplog.text
        reader.socket_seen = 3
        assert [_payloads(m) for m in _read_all(reader, 1)] == [[b"by ring"]]


def test_a_message_rings_the_doorbell_only_while_the_reader_is_asleep(ring) -> None:
    writer, reader, doorbell = ring
    doorbell.drain()
    _write(writer, [b"awake"])  # a reader that polls or is busy will look anyway
    with pytest.raises(BlockingIOError):
        os.read(doorbell.fd, 1)
    reader.set_asleep(True)
    _write(writer, [b"asleep"])
    assert os.read(doorbell.fd, 10) == b"\0" and writer.bells == 1
    reader.set_asleep(False)
    _write(writer, [b"awake again"])
    with pytest.raises(BlockingIOError):
        os.read(doorbell.fd, 1)
    assert [_payloads(m) for m in _read_all(reader, 3)] == [
        [b"awake"], [b"asleep"], [b"awake again"]
    ]


def test_a_corrupt_record_is_a_protocol_error(ring) -> None:
    writer, reader, _ = ring
    _write(writer, [b"fine"])
    assert len(_read_all(reader, 1)) == 1
    start = writer._head
    writer._data[start:start + 12] = struct.pack("<QI", 1, 999_999)  # sequence, frame count
    writer._words[0] = start + 16
    with pytest.raises(ProtocolError, match="999999 frames"):
        reader.read(b"peer", [])


def test_only_segments_and_fifos_of_actorrpc_are_opened(tmp_path) -> None:
    with pytest.raises(ProtocolError, match="not an actorrpc shared-memory segment name"):
        RingReader("../etc/passwd")
    writer = RingWriter(capacity=1 << 12)
    try:
        with pytest.raises(ProtocolError, match="not a FIFO"):
            writer.start(os.path.join(SHM_DIRECTORY, writer.name), 0)  # a segment, not a FIFO
        with pytest.raises(ProtocolError, match="must lie in"):
            writer.start(str(tmp_path / ("actorrpc-1-" + "0" * 24)), 0)
    finally:
        writer.close()


# -- two transports: the switch from the socket to the ring ----------------------------------


def _answered(link) -> bool:
    """Whether the answer to the link's offer waits on its socket (read at its next send)."""
    return bool(link._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)


def _switch_after(link, receiver: Transport, sent: int, total: int) -> None:
    """``sent`` messages went by socket, the offer with or after them: the receiver takes
    it, the sender switches at its next send, and all ``total`` arrive in order."""
    # the receiver takes the offer (and maybe some messages after it) and answers ...
    received: list[list[object]] = []
    assert wait_until(lambda: (received.extend(receiver.receive(0.05)),
                               receiver.rings_in() == 1)[1], timeout=20)
    # ... the sender switches at its next send: the ring's messages may then be readable
    # before the socket's last ones were received
    assert wait_until(lambda: _answered(link), timeout=20)
    for i in range(sent, total):
        link.send([b"AR-header", b"%d" % i])
    assert link.ring is not None
    assert wait_until(lambda: (received.extend(receiver.receive(0.05)), len(received))[1]
                      == total, timeout=20)
    assert [bytes(m[2].buffer) for m in received] == [b"%d" % i for i in range(total)]  # type: ignore[attr-defined]
    assert all(m[0] == b"0:sender" for m in received)
    assert receiver.ring_messages_in == total - sent


def test_messages_keep_their_order_across_the_switch_to_the_ring(pair) -> None:
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)  # offers its ring
    for i in range(50):
        link.send([b"AR-header", b"%d" % i])
    _switch_after(link, receiver, 50, 300)
    assert sender.rings_out() == 1


def test_a_link_offers_its_ring_once_some_messages_went_by_socket(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link that carries a message or two (one call to each of many peers) never pays
    for a ring; one that keeps carrying switches, its messages in order."""
    from actorrpc.transport import _zmq

    monkeypatch.setattr(_zmq, "RING_AFTER_MESSAGES", 8)
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)
    for i in range(7):
        link.send([b"AR-header", b"%d" % i])
    assert link._offered is None and link.ring is None
    link.send([b"AR-header", b"7"])  # the eighth: the offer follows it
    assert link._offered is not None
    _switch_after(link, receiver, 8, 40)


def test_an_offer_due_after_messages_already_sent_goes_at_once_and_only_once(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    monkeypatch.setattr(_zmq, "RING_AFTER_MESSAGES", 100)
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)
    for i in range(3):
        link.send([b"AR-header", b"%d" % i])
    assert link._offered is None and link._ring_after == 100
    link.offer_ring(after_messages=3)  # three went already: now
    offered = link._offered
    assert offered is not None and link._ring_after is None
    link.offer_ring(after_messages=1)  # (offered: nothing more)
    assert link._offered is offered and link._ring_after is None


def test_a_new_link_to_a_peer_that_reads_the_old_ring_offers_before_its_messages(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the old link's ring still holds is delivered before anything the new link
    sends: the receiver empties the old ring when the new offer comes, so that offer
    goes first, however many messages a new link otherwise sends before offering."""
    from actorrpc.transport import _zmq

    sender, receiver = pair
    old = _switched(sender, receiver)
    old.send([b"AR-header", b"old ring"])  # not received yet
    monkeypatch.setattr(_zmq, "RING_AFTER_MESSAGES", 8)
    sender.drop_link(b"1:receiver")
    new = sender.link(b"1:receiver", receiver.endpoint)
    assert new is not old and new._offered is not None
    new.send([b"AR-header", b"new link"])
    received: list[list[object]] = []
    assert wait_until(lambda: (received.extend(receiver.receive(0.05)), len(received))[1] == 2,
                      timeout=20)
    assert [bytes(m[2].buffer) for m in received] == [b"old ring", b"new link"]  # type: ignore[attr-defined]


def _switched(sender: Transport, receiver: Transport):
    link = sender.link(b"1:receiver", receiver.endpoint)
    assert wait_until(lambda: (receiver.receive(0.01), receiver.rings_in() == 1)[1], timeout=20)
    assert wait_until(lambda: _answered(link), timeout=20)
    link.send([b"AR-header", b"switch"])  # the first through the ring
    assert link.ring is not None
    assert wait_until(lambda: receiver.receive(0.01) != [], timeout=20)
    return link


def test_a_ring_is_private_to_its_user_and_unlinked_once_in_use(pair) -> None:
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)
    offered = link._offered
    assert offered is not None
    path = os.path.join(SHM_DIRECTORY, offered.name)
    assert os.stat(path).st_mode & 0o777 == 0o600
    _switched(sender, receiver)
    assert link.ring is offered and not os.path.exists(path)
    doorbell = receiver._ring_inbox.doorbell
    assert doorbell is not None and os.stat(doorbell.path).st_mode & 0o777 == 0o600


def test_a_blocked_receiver_wakes_for_a_ring_message(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, receiver = pair
    link = _switched(sender, receiver)
    # it blocks; without the doorbell it would wait 30 s
    thread, result = start_blocked(monkeypatch, lambda: receiver.receive(30.0))
    started = time.monotonic()
    assert link.ring is not None
    bells = link.ring.bells
    link.send([b"AR-header", b"wake up"])
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert link.ring.bells == bells + 1  # (it was asleep)
    assert [bytes(m[2].buffer) for m in result[0]] == [b"wake up"]  # type: ignore[attr-defined]


def test_a_ring_message_ends_a_quiet_wait_and_a_ready_ring_skips_it(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    sender, receiver = pair
    link = _switched(sender, receiver)
    assert link.ring is not None
    # it sleeps; without the doorbell it would wait 30 s
    thread, result = start_blocked(monkeypatch, lambda: receiver.wait_quietly(30.0))
    bells = link.ring.bells
    link.send([b"AR-header", b"wake up"])
    thread.join(10)
    assert not thread.is_alive() and result == [True]
    assert link.ring.bells == bells + 1  # (its writer was told it sleeps)
    # not received yet: the next quiet wait returns at once, without polling
    me, real_poll = threading.current_thread(), _zmq._zmq_poll

    def poll(*args: object) -> object:
        assert threading.current_thread() is not me, "a ready ring was polled for"
        return real_poll(*args)

    monkeypatch.setattr(_zmq, "_zmq_poll", poll)
    receiver.nudge()  # (drained, not counted, by the wait that sees the ring ready)
    assert receiver.wait_quietly(30.0) is True
    got = receiver.receive(0.01)
    assert [bytes(m[2].buffer) for m in got] == [b"wake up"]  # type: ignore[attr-defined]
    monkeypatch.setattr(_zmq, "_zmq_poll", real_poll)
    assert receiver.wait_quietly(0.01) is False  # (and the nudge was drained)


def test_a_socket_message_ends_a_blocked_receive_of_a_ring_reader_every_time(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the blocking poll asks ZMQ_EVENTS itself (taking the inbox FD's signal): the socket
    # must be asked again after it, not trusted to signal (transport._socket_has_message)
    from actorrpc.transport import _link, _zmq

    sender, receiver = pair
    link = _switched(sender, receiver)
    monkeypatch.setattr(_link, "_SEND_THROUGH_RINGS", False)  # by socket from now on
    real_poll = _zmq._zmq_poll

    def receive_while_sending(payload: bytes) -> list[list[object]]:
        """A receive that blocks in the poll, and ``payload`` sent by socket meanwhile."""
        blocking = threading.Event()
        result: list[list[list[object]]] = []
        thread = threading.Thread(target=lambda: result.append(receiver.receive(30.0)))

        def poll(*args: object) -> object:
            if threading.current_thread() is thread:
                blocking.set()
            return real_poll(*args)

        monkeypatch.setattr(_zmq, "_zmq_poll", poll)
        thread.start()
        assert blocking.wait(10)
        link.send([b"AR-header", payload])
        thread.join(10)
        assert not thread.is_alive()
        return result[0] or receiver.receive(0.5)  # (or with the next receive)

    for i in range(20):
        messages = receive_while_sending(b"%d" % i)
        assert [bytes(m[2].buffer) for m in messages] == [b"%d" % i]  # type: ignore[attr-defined]


def test_a_receiver_that_does_not_block_costs_its_writers_no_doorbell(pair) -> None:
    sender, receiver = pair
    link = _switched(sender, receiver)
    assert link.ring is not None
    bells = link.ring.bells
    for n in range(50):
        link.send([b"AR-header", b"%d" % n])
    received: list[list[object]] = []
    while len(received) < 50:  # (polls: never blocks)
        received += receiver.receive(0.0)
    assert [bytes(m[2].buffer) for m in received] == [b"%d" % n for n in range(50)]  # type: ignore[attr-defined]
    assert link.ring.bells == bells


def test_a_receiver_interrupted_in_its_sleep_or_a_forgotten_ring_is_awake_again(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    sender, receiver = pair
    link = _switched(sender, receiver)
    assert link.ring is not None

    me, real_poll = threading.current_thread(), _zmq._zmq_poll

    def interrupted(*args: object) -> object:
        if threading.current_thread() is not me:  # (a group's I/O thread in this process)
            return real_poll(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(_zmq, "_zmq_poll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        receiver.receive(30.0)  # (its sleep is cut short: writers need not ring any more)
    bells = link.ring.bells
    link.send([b"AR-header", b"after"])
    assert link.ring.bells == bells
    (_, reader), = receiver._ring_inbox.snapshot
    reader.set_asleep(True)
    receiver.drop_link(b"no such peer")  # (others' rings stay as they are)
    link.send([b"AR-header", b"asleep"])
    assert link.ring.bells == bells + 1
    receiver._ring_inbox.forget(receiver._ring_inbox.snapshot[0][0])
    link.send([b"AR-header", b"forgotten"])
    assert link.ring.bells == bells + 1


def test_a_busy_poll_finds_a_ring_message(pair) -> None:
    sender, receiver = pair
    link = _switched(sender, receiver)
    link.send([b"AR-header", b"polled"])
    hits = receiver.busy_poll_hits
    messages = receiver.receive(30.0, busy_until=time.monotonic() + 30.0)
    assert [bytes(m[2].buffer) for m in messages] == [b"polled"]  # type: ignore[attr-defined]
    assert receiver.busy_poll_hits == hits + 1


class _Clock:
    """``time.monotonic`` for the transport, with a hook run at a given reading."""

    def __init__(self, at: int, hook, step: float = 0.0) -> None:
        self.readings = 0
        self._at, self._hook, self._step, self._offset = at, hook, step, 0.0

    def __call__(self) -> float:
        self.readings += 1
        if self.readings == self._at:
            self._hook()
        self._offset += self._step
        return time.monotonic() + self._offset


def _quiet(receiver: Transport) -> None:
    """No socket message in or out for long (as after the switch, in a ring-only flow)."""
    receiver.socket_activity.at = float("-inf")


def _spinning(pair, monkeypatch: pytest.MonkeyPatch):
    """The pair switched to a ring, busy polls spinning first for 30 s: (link, receiver)."""
    from actorrpc.transport import _zmq

    sender, receiver = pair
    link = _switched(sender, receiver)
    _quiet(receiver)
    monkeypatch.setattr(_zmq, "_SPIN_SECONDS", 30.0)
    monkeypatch.setattr(_zmq, "_LONG_YIELD_SECONDS", 30.0)  # (a send in a yield is slow)
    return link, receiver


def _send_in_the_first_yield(monkeypatch: pytest.MonkeyPatch, link, text: bytes) -> list[int]:
    """Yields are counted (in the list returned); the first sends ``text`` on ``link``."""
    from actorrpc.transport import _zmq

    yields: list[int] = []

    def send_in_the_first_yield() -> None:
        yields.append(1)
        if len(yields) == 1:
            link.send([b"AR-header", text])

    monkeypatch.setattr(_zmq, "_sched_yield", send_in_the_first_yield)
    return yields


def _polled(receiver: Transport) -> list[bytes]:
    messages = receiver.receive(30.0, busy_until=time.monotonic() + 30.0)
    return [bytes(m[2].buffer) for m in messages]  # type: ignore[attr-defined]


def test_a_busy_poll_spins_without_yielding_while_only_rings_carried_messages(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    link, receiver = _spinning(pair, monkeypatch)
    yields: list[int] = []
    monkeypatch.setattr(_zmq, "_sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(_zmq, "_SHARED_CORE_SECONDS", 30.0)  # (a preempted spin goes on)
    # the message is written after a few rounds of the spin
    clock = _Clock(5, lambda: link.send([b"AR-header", b"spun"]))
    monkeypatch.setattr(_zmq, "_monotonic", clock)
    assert _polled(receiver) == [b"spun"]
    assert clock.readings >= 5 and yields == []


def test_a_spinning_poll_looks_at_the_socket_only_between_stretches_of_ring_looks(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look at the socket is a system call: while a poll spins it looks at its rings alone
    for ``_SOCKET_LOOK_SECONDS`` between them, and still finds what comes by socket."""
    from actorrpc.transport import _zmq

    link, receiver = _spinning(pair, monkeypatch)
    monkeypatch.setattr(_zmq, "_SHARED_CORE_SECONDS", 30.0)  # (a preempted spin goes on)
    monkeypatch.setattr(_zmq, "_SOCKET_LOOK_SECONDS", 30.0)
    looks: list[int] = []
    has_message = receiver._socket_has_message
    monkeypatch.setattr(receiver, "_socket_has_message", lambda: looks.append(1) or has_message())
    # the ring's message is written after a few rounds of the ring-only stretch
    clock = _Clock(8, lambda: link.send([b"AR-header", b"by ring"]))
    monkeypatch.setattr(_zmq, "_monotonic", clock)
    assert _polled(receiver) == [b"by ring"]
    # the socket before the poll and once in it, then the rings alone (every round: ~8)
    assert clock.readings >= 8 and len(looks) <= 2
    # with looks at the socket every 10 µs, a message by socket is found while spinning
    monkeypatch.setattr(_zmq, "_monotonic", time.monotonic)
    monkeypatch.setattr(_zmq, "_SOCKET_LOOK_SECONDS", 0.00001)
    sender, _ = pair
    third = Transport(b"2:third", secret="s", security="plain")
    try:
        third.link(b"1:receiver", receiver.endpoint).send([b"AR-header", b"by socket"])
        _quiet(receiver)  # (still spinning: no socket activity seen yet)
        assert _polled(receiver) == [b"by socket"]
        assert receiver.spins >= 2 and len(looks) >= 2
    finally:
        third.close()


def test_a_busy_poll_yields_from_the_start_after_a_socket_message(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    link, receiver = _spinning(pair, monkeypatch)
    monkeypatch.setattr(_zmq, "_QUIET_SOCKET_SECONDS", 60.0)  # (however slow this test runs)
    third = Transport(b"2:third", secret="s", security="plain")
    try:  # its first message goes by socket (no ring yet)
        third.link(b"1:receiver", receiver.endpoint).send([b"AR-header", b"by socket"])
        assert wait_until(lambda: receiver.receive(0.01) != [], timeout=20)
        assert receiver.socket_activity.at > float("-inf")  # a message came by socket
    finally:
        third.close()
    _send_in_the_first_yield(monkeypatch, link, b"after a yield")
    assert _polled(receiver) == [b"after a yield"]
    # and a message sent by socket counts as well
    sender, _ = pair
    _quiet(receiver)
    receiver.link(b"0:sender", sender.endpoint).send([b"AR-header", b"out by socket"])
    assert receiver.socket_activity.at > float("-inf")


def test_a_spin_that_lost_its_core_makes_polls_yield_for_a_while(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    link, receiver = _spinning(pair, monkeypatch)
    monkeypatch.setattr(receiver.spin_gate, "pause", 60.0)
    yields = _send_in_the_first_yield(monkeypatch, link, b"after the core was lost")
    # each reading of the clock 1 ms after the one before: as if another thread ran
    monkeypatch.setattr(_zmq, "_monotonic", _Clock(0, lambda: None, step=0.001))
    stopped = receiver.spins_stopped
    assert _polled(receiver) == [b"after the core was lost"]
    assert receiver.spins_stopped == stopped + 1 and yields
    monkeypatch.setattr(_zmq, "_monotonic", time.monotonic)
    # the next poll yields from the start (else it would spin for 30 s: nothing sends)
    _send_in_the_first_yield(monkeypatch, link, b"next")
    assert _polled(receiver) == [b"next"]
    assert receiver.spins_stopped == stopped + 1


def test_a_gap_that_outlasts_the_spin_still_counts_as_a_lost_core(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorrpc.transport import _zmq

    link, receiver = _spinning(pair, monkeypatch)
    monkeypatch.setattr(_zmq, "_SPIN_SECONDS", 0.0005)  # (as shipped)
    monkeypatch.setattr(receiver.spin_gate, "pause", 60.0)
    yields = _send_in_the_first_yield(monkeypatch, link, b"after a long gap")
    # one reading 4 ms after the one before (a time slice of another thread), past the spin
    monkeypatch.setattr(_zmq, "_monotonic", _Clock(3, lambda: None, step=0.0))
    clock: Any = _zmq._monotonic
    clock._hook = lambda: setattr(clock, "_offset", clock._offset + 0.004)
    stopped, spun = receiver.spins_stopped, receiver.spun_seconds
    assert _polled(receiver) == [b"after a long gap"]
    assert receiver.spins_stopped == stopped + 1 and yields
    assert receiver.spun_seconds - spun < 0.004  # (the gap is not counted as spinning)


def test_polls_do_not_spin_without_rings_and_wakes_are_no_socket_traffic(pair) -> None:
    sender, receiver = pair
    quiet = Transport(b"2:quiet", secret="s", security="plain", rings=False)
    try:
        link = sender.link(b"2:quiet", quiet.endpoint)
        link.send([b"AR-header", b"by socket"])
        assert wait_until(lambda: quiet.receive(0.01) != [], timeout=20)
        assert quiet.receive(0.01, busy_until=time.monotonic() + 0.005) == []
        assert quiet.spins == 0  # no ring: nothing arrives but by socket
    finally:
        quiet.close()
    _switched(sender, receiver)
    _quiet(receiver)
    receiver.wake()
    assert wait_until(lambda: receiver.receive(0.01) == [], timeout=20)
    assert receiver.socket_activity.at == float("-inf")  # a wake is not a message


def test_the_io_threads_polls_in_a_flow_never_spin(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Polls that do not watch contention (the I/O thread's, in a flow of messages) yield
    from the start: the threads the flow keeps busy are this process's own."""
    link, receiver = _spinning(pair, monkeypatch)
    _send_in_the_first_yield(monkeypatch, link, b"flow")
    messages = receiver.receive(30.0, time.monotonic() + 30.0, False)
    assert [bytes(m[2].buffer) for m in messages] == [b"flow"]  # type: ignore[attr-defined]
    assert receiver.spins == 0


def test_a_thread_handed_work_makes_polls_yield_for_a_while(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:

    link, receiver = _spinning(pair, monkeypatch)
    monkeypatch.setattr(receiver.spin_gate, "pause", 60.0)
    receiver.spin_gate.close_for_a_while(time.monotonic())  # (as the inbox at a hand-off)
    _send_in_the_first_yield(monkeypatch, link, b"yielded")
    assert _polled(receiver) == [b"yielded"]  # (a spin would last 30 s: nothing sends)


def test_large_messages_spill_and_keep_their_order_with_the_ring(pair) -> None:
    sender, receiver = pair
    link = _switched(sender, receiver)
    big = memoryview(bytearray(os.urandom(3 << 20)))  # 3 MiB: more than a ring holds
    sent = []
    for i in range(40):
        frames = [b"AR-header", b"%d" % i] + ([big] if i % 10 == 5 else [])
        link.send(frames)
        sent.append([bytes(f) for f in frames[1:]])
    assert link.ring is not None and link.ring.spills >= 4
    messages: list[list[object]] = []
    assert wait_until(lambda: (messages.extend(receiver.receive(0.05)), len(messages))[1] == 40,
                      timeout=20)
    assert [[bytes(f.buffer) for f in m[2:]] for m in messages] == sent  # type: ignore[attr-defined]
    assert all(m[0] == b"0:sender" and m[1] == b"AR-header" for m in messages)


@pytest.mark.parametrize("off", ["sender", "receiver"])
def test_without_rings_everything_goes_by_socket(off: str) -> None:
    sender = Transport(b"0:sender", secret="s", security="plain", rings=off != "sender")
    receiver = Transport(b"1:receiver", secret="s", security="plain", rings=off != "receiver")
    try:
        link = sender.link(b"1:receiver", receiver.endpoint)
        messages: list[list[object]] = []
        for i in range(20):
            link.send([b"AR-header", b"%d" % i])
            messages.extend(receiver.receive(0.0))
        if off == "receiver":  # it refuses the offer (read by a send, maybe one above)
            assert wait_until(lambda: (messages.extend(receiver.receive(0.05)),
                                       link._offered is None or _answered(link))[1], timeout=20)
        link.send([b"AR-header", b"last"])  # (reads the refusal)
        assert wait_until(lambda: (messages.extend(receiver.receive(0.05)), len(messages))[1]
                          == 21, timeout=20)
        assert link.ring is None and link._offered is None
        assert receiver.rings_in() == 0 and receiver.ring_messages_in == 0
    finally:
        sender.close()
        receiver.close()


def test_an_offer_of_a_missing_segment_is_refused_and_the_socket_stays(pair, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="actorrpc")
    sender, receiver = pair
    link = sender.link(b"1:receiver", receiver.endpoint)
    offered = link._offered
    assert offered is not None
    os.unlink(os.path.join(SHM_DIRECTORY, offered.name))  # gone before the receiver maps it
    link.send([b"AR-header", b"by socket"])
    messages: list[list[object]] = []
    assert wait_until(lambda: (messages.extend(receiver.receive(0.05)), len(messages))[1] == 1,
                      timeout=20)
    # (a sender that closed after its offer, as at its shutdown: no warning)
    refusals = [r for r in caplog.records if "refused the ring" in r.getMessage()]
    assert [r.levelno for r in refusals] == [logging.DEBUG], caplog.text
    assert "its sender closed" in refusals[0].getMessage()
    assert wait_until(lambda: _answered(link), timeout=20)
    link.send([b"AR-header", b"still by socket"])  # reads the refusal
    assert link.ring is None and link._offered is None and receiver.rings_in() == 0
    assert wait_until(lambda: (messages.extend(receiver.receive(0.05)), len(messages))[1] == 2,
                      timeout=20)


def test_dropping_a_link_forgets_the_peers_ring(pair) -> None:
    sender, receiver = pair
    _switched(sender, receiver)
    assert receiver.rings_in() == 1
    receiver.drop_link(b"0:sender")
    assert receiver.rings_in() == 0


# -- real workers ------------------------------------------------------------------------------


def _ring_stats() -> dict[str, int]:
    return rpc.get_worker_stats()["rings"]


def _ring_after_messages() -> int:
    from actorrpc.transport import _zmq

    return _zmq.RING_AFTER_MESSAGES


def test_workers_of_one_host_talk_through_rings(cluster: list[str]) -> None:
    # (the first ones by socket, as many as the workers' own setting says)
    for i in range(20 + 2 * rpc.rpc_sync("worker1", _ring_after_messages)):
        assert rpc.rpc_sync("worker1", max, args=(i, 3)) == max(i, 3)
    local = rpc.get_worker_stats()["rings"]
    remote = rpc.rpc_sync("worker1", _ring_stats)
    assert local["out"] >= 1 and local["in"] >= 1 and local["messages_in"] >= 20
    assert remote["out"] >= 1 and remote["in"] >= 1 and remote["messages_in"] >= 20


def test_frames_from_a_ring_read_as_bytes_like_socket_frames(ring) -> None:
    from actorrpc.agent._dynamic_group import _parse

    writer, reader, _ = ring
    _write(writer, [b"AR-header", b'{"op": "probe"}'])
    (message,) = _read_all(reader, 1)
    frame = message[2]
    assert bytes(frame) == frame.bytes == bytes(frame.buffer) == b'{"op": "probe"}'  # type: ignore[attr-defined]
    assert _parse([frame]) == {"op": "probe"}  # (a MEMBERSHIP message's payload frame)


def test_an_offer_refused_for_another_reason_warns(pair, caplog) -> None:
    _, receiver = pair
    answer = receiver._ring_inbox.on_control([b"0:sender", RING_OFFER, b"not a segment"], [])
    assert answer == [RING_REFUSE, b"not a segment"]
    refusals = [r for r in caplog.records if "refused the ring" in r.getMessage()]
    assert [r.levelno for r in refusals] == [logging.WARNING], caplog.text


def test_an_offer_from_a_peer_gone_before_the_answer_is_dropped_quietly(pair, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="actorrpc")
    _, receiver = pair
    # an offer whose connection is gone (no peer of that identity): the refusal cannot leave
    receiver._answer_control([b"9:gone", RING_OFFER, b"not a segment"], [])
    unanswered = [r for r in caplog.records if "could not answer" in r.getMessage()]
    assert [r.levelno for r in unanswered] == [logging.DEBUG], caplog.text
    assert "unreachable" in unanswered[0].getMessage().lower()
