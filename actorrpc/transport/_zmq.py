"""ZeroMQ sockets: with ``_link`` (a DEALER to one peer) and ``_security`` (their
authentication), the only modules of actorrpc that touch ZeroMQ.

Invariants:

* The inbox ROUTER socket is received on (:meth:`Transport.receive`) by one
  thread at a time, under a lock its caller holds (the agent's inbox turns),
  which gives the memory barrier ZeroMQ asks for when a socket changes threads;
  other threads reach it only through :meth:`wake`.
* Each outgoing DEALER link is used by whichever thread sends, but only while
  holding that link's lock, which also gives the memory barrier ZeroMQ asks for
  when a socket moves between threads.
* Nothing is dropped silently: DEALER sockets queue up to the high-water mark
  and then block the sender (back-pressure); a link that cannot take a message
  within the send timeout raises :class:`~actorrpc.errors.PeerUnreachableError`.
* Every connection from outside the process is authenticated before a byte of it
  reaches the inbox (ZAP with PLAIN credentials by default, or CURVE, which also
  encrypts: ``_security``). The process's own connections (the wake-ups, and a
  worker's link to itself) use the inbox's in-process endpoint, which only sockets of
  the transport's own ZeroMQ context can reach; the link to itself has a routing id of
  its own, known only in the process, mapped back to the worker's identity on receipt.
* libzmq's threads of a transport are named ``<n>/ZMQbg/...`` with ``n``
  unique in the process, so that their scheduling policy can be set
  (``agent._batch_scheduling``) without touching other contexts' threads.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import threading
import time
import weakref
from typing import Any

import zmq
import zmq.auth.thread  # (the type of the authenticator)
from mypy_extensions import mypyc_attr

from ..errors import ActorRpcError, InvalidArgumentError, PeerUnreachableError
from ._link import (
    _EVENTS,
    _NOBLOCK,
    _POLLIN,
    PeerLink,
    _monotonic,
    _socket_get,
    _socket_recv,
)
from ._ring import full_fence, rings_supported
from ._ring_inbox import RingInbox
from ._security import configure_client, configure_server
from ._spin import SocketActivity, SpinGate

__all__ = ["SECURITY_MODES", "PeerLink", "Transport"]

SECURITY_MODES = ("plain", "curve", "none")
_RECV_BATCH = 256
_WAKE_ID = b"!wake"  # agent identities start with a rank digit
_CONTROL = b"!"  # transport control messages start with it (``_ring_inbox``)
# False: ask ZMQ_EVENTS on every look at the inbox socket, not only when its FD signals
# (see ``Transport._socket_has_message``): a same-run A/B switch
_FD_GATED_EVENTS = True
# A same-host link offers its ring once this many messages went by socket: a ring costs
# a segment and a mapping on both ends (~0.3 ms of CPU in all), which a link that carries
# a message or two (one call to each of 31 peers) never earns back; 0 offers at once.
# (A link that replaces an earlier one to the same peer offers at once: ``Transport.link``.)
RING_AFTER_MESSAGES = 8
_log = logging.getLogger("actorrpc.transport")
_thread_name_prefixes = itertools.count(1)  # one per transport (ZMQ_THREAD_NAME_PREFIX)
_THREAD_NAME_PREFIX = int(getattr(zmq, "THREAD_NAME_PREFIX", 9))  # ZMQ_THREAD_NAME_PREFIX

_zmq_poll = zmq.backend.zmq_poll
# gives the core to any other runnable thread, without the GIL (time.sleep(0) where absent)
_sched_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
# A yield that took longer gave the core away for a time slice: another process's thread
# shares it, and a blocked thread is woken sooner than one that yielded (wake-up
# preemption), so polls stop for a while: a pause that doubles while yields keep
# being long (up to the maximum) and starts again from the minimum after a hit.
_LONG_YIELD_SECONDS = 0.0005
# A busy poll first spins for this long without yielding, while only same-host rings
# carried this process's messages lately: a yield hands the core to the threads that
# run only then (the SCHED_BATCH ones: the agent's I/O thread, for its looks and timed
# work, and libzmq's), and each such run leaves the poller to go on with cold caches,
# while none of them is needed to bring a ring's message. Polls yield from the start
# again after any socket message in or out within _QUIET_SOCKET_SECONDS (libzmq's
# threads may have it in hand), and for a while (``SpinGate``) after a spin found
# its core taken for _SHARED_CORE_SECONDS or more, or after a request or reply was
# handed to another thread of this process (``SpinGate``): spinning would keep a
# thread that has work waiting for the core or the GIL. Polls that keep finding their
# messages within their spins never yield: a SCHED_BATCH thread needing their core
# then runs when the scheduler ends the poller's time slice (a few ms), so the first
# socket message after a quiet stretch (a spill, a peer without a ring) may wait that
# long; once received it stamps SocketActivity, and polls yield again.
_SPIN_SECONDS = 0.0005
_QUIET_SOCKET_SECONDS = 0.01
# A spinning poll looks at its rings alone for this long between looks at the socket (a
# system call, ~1.5 µs here against ~0.2 for the rings: a ring's message waited for the
# spin to come round to it); 0: the socket every round.
_SOCKET_LOOK_SECONDS = 0.00001
_SHARED_CORE_SECONDS = 0.0003
_MIN_CONTENDED_PAUSE_SECONDS = 0.02
_MAX_CONTENDED_PAUSE_SECONDS = 1.0


def _host(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[0]


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""  # the thread ended


@mypyc_attr(native_class=False)  # (see actorrpc/_compiled.py)
class Transport:
    """One worker's sockets: the inbox ROUTER and a DEALER link per peer.

    Args:
        identity: the routing id this worker's DEALERs present to peers.
        bind_host: interface for the inbox (``127.0.0.1`` keeps it on loopback,
            ``0.0.0.0`` listens on every interface).
        advertise_host: the address peers connect to (default: ``bind_host``).
        secret: the group secret; required unless ``security == "none"``.
        security: ``"plain"`` (authenticated), ``"curve"`` (authenticated and
            encrypted) or ``"none"``.
        send_timeout: seconds a send may block on a full queue before failing.
        high_water_mark: messages queued per link before senders block.
        name_threads: name libzmq's threads of this transport ``<n>/ZMQbg/...``
            (``n`` unique in the process), so that :meth:`io_thread_ids` can find them.
    """

    def __init__(
        self,
        identity: bytes,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        secret: str | None = None,
        security: str = "plain",
        send_timeout: float = 60.0,
        high_water_mark: int = 10000,
        name_threads: bool = True,
        rings: bool = True,
    ) -> None:
        if security not in SECURITY_MODES:
            raise InvalidArgumentError(
                f"security must be one of {SECURITY_MODES}, got {security!r}"
            )
        if security != "none" and not secret:
            raise InvalidArgumentError(f"security={security!r} needs a group secret")
        self._identity = identity
        # the routing id of this transport's link to its own inbox (see ``link``): not its
        # identity, which a peer holding the group's credentials could take over (the
        # inbox hands an id to its newest connection), and an in-process connection,
        # unlike a TCP one, never connects again; nobody outside the process knows it
        self._own_link_id = b"!own-" + os.urandom(12)
        self._security = security
        self._secret = secret or ""
        self._send_timeout_ms = int(send_timeout * 1000) if send_timeout > 0 else -1
        self._rings = rings and rings_supported()
        self._ring_inbox = RingInbox(accept=self._rings)  # peers' rings
        self._hwm = high_water_mark
        self._context: zmq.Context[Any] = zmq.Context()
        # libzmq's threads of this transport are named "<n>/ZMQbg/...": set before the
        # first socket, which starts them ("" where this libzmq cannot name them)
        self.thread_names = ""
        if name_threads:
            prefix = next(_thread_name_prefixes)
            try:
                self._context.set(_THREAD_NAME_PREFIX, prefix)
                self.thread_names = f"{prefix}/ZMQbg/"
            except zmq.ZMQError:
                pass
        self._authenticator: zmq.auth.thread.ThreadAuthenticator | None = None
        self._links: dict[bytes, PeerLink] = {}
        self._links_lock = threading.Lock()
        # peers linked to before: a new link's ring is offered at once (the peer may still
        # read the old link's ring, and empties it when the new offer comes: the offer
        # must come before the new link's messages, see ``_ring_inbox``)
        self._linked: set[bytes] = set()
        # the nudge (see :meth:`nudge`): a non-blocking pipe, written without a lock
        self._nudge_fd, self._nudge_write_fd = os.pipe()
        os.set_blocking(self._nudge_fd, False)
        os.set_blocking(self._nudge_write_fd, False)
        weakref.finalize(self, os.close, self._nudge_write_fd)
        try:
            self._inbox = self._context.socket(zmq.ROUTER)
            self._inbox.setsockopt(zmq.LINGER, 0)
            self._inbox.setsockopt(zmq.RCVHWM, high_water_mark)
            self._inbox.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._inbox.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._authenticator = configure_server(
                self._inbox, self._context, self._security, self._secret
            )
            wildcard = "*" if bind_host in ("0.0.0.0", "*", "") else bind_host
            port = self._inbox.bind_to_random_port(f"tcp://{wildcard}")
        except zmq.ZMQError as exc:
            self.close()
            raise ActorRpcError(f"cannot bind the inbox on {bind_host}: {exc}") from exc
        self.endpoint = f"tcp://{advertise_host or bind_host}:{port}"
        # Wake-ups arrive in the inbox itself, from an in-process DEALER (inproc
        # connections carry no security handshake), so a receiver blocks in one
        # zmq_recv instead of polling two sockets: far fewer system calls per message.
        self._wake_lock = threading.Lock()
        local = self._local = f"inproc://inbox-{id(self)}"
        self._inbox.bind(local)
        self._wake_tx = self._context.socket(zmq.DEALER)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.setsockopt(zmq.ROUTING_ID, _WAKE_ID)
        self._wake_tx.setsockopt(zmq.SNDHWM, 64)
        self._wake_tx.connect(local)
        self._timeout_ms = -2
        self.busy_poll_hits = 0  # busy polls that found a message (statistics)
        self.busy_poll_misses = 0  # busy polls that gave up and blocked
        self.busy_poll_contended = 0  # of those, polls ended by a long yield
        self._no_poll_until = 0.0  # after a long yield: no busy polls until then
        self.spin_gate = SpinGate()  # closed after a spin lost its core, or a hand-off
        self.spins = 0  # busy polls allowed to begin with a spin (statistics)
        self.spun_seconds = 0.0  # how long they spun in all
        self.spins_stopped = 0  # spins that lost the core (statistics)
        # when a message last went by socket, in or out (see _SPIN_SECONDS)
        self.socket_activity = SocketActivity()
        self._contended_pause = _MIN_CONTENDED_PAUSE_SECONDS
        # readable when the inbox may hold messages (ZMQ_FD); any thread may poll it
        self.inbox_fd = int(self._inbox.getsockopt(zmq.FD))
        self._inbox_fd_poll: Any = None  # (no select.poll, e.g. Windows: never gated)
        if hasattr(select, "poll"):
            self._inbox_fd_poll = select.poll()
            self._inbox_fd_poll.register(self.inbox_fd, select.POLLIN)
        # True while the inbox's FD may not signal a message the socket holds (see
        # ``_socket_has_message``)
        self._socket_unsure = True

    def io_thread_ids(self, timeout: float = 1.0) -> list[int]:
        """Native ids of libzmq's I/O threads of this transport (``[]`` if unnamed).

        A new thread names itself once it runs: this waits up to ``timeout``
        seconds for at least one.
        """
        if not self.thread_names:
            return []
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        prefix = f"{self.thread_names}IO/"
        while True:
            try:
                tids = [int(t) for t in os.listdir("/proc/self/task")]
            except OSError:
                return []  # no /proc here
            found = [t for t in tids if _thread_name(t).startswith(prefix)]
            if found or time.monotonic() >= deadline:
                return found
            pause.wait(0.001)

    def link(self, peer: bytes, endpoint: str) -> PeerLink:
        """Return the link to ``peer``'s inbox at ``endpoint``, connecting on first use."""
        link = self._links.get(peer)
        if link is not None and link.endpoint == endpoint and not link.closed:
            return link
        with self._links_lock:
            link = self._links.get(peer)
            if link is not None and link.endpoint == endpoint and not link.closed:
                return link
            try:
                in_process = peer == self._identity
                socket = self._context.socket(zmq.DEALER)
                socket.setsockopt(zmq.ROUTING_ID,
                                  self._own_link_id if in_process else self._identity)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, self._hwm)
                socket.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
                socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
                socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
                # itself: through the in-process endpoint (no TCP, no libzmq I/O thread;
                # like the wake-ups, no security handshake: nothing outside this process
                # can connect there)
                if in_process:
                    socket.connect(self._local)
                else:
                    configure_client(socket, self._security, self._secret)
                    socket.connect(endpoint)
            except zmq.ZMQError as exc:
                raise PeerUnreachableError(f"cannot connect to {endpoint}: {exc}") from exc
            if link is not None:
                link.close()
            link = PeerLink(socket, endpoint, self.socket_activity, in_process)
            self._links[peer] = link
            relinked = peer in self._linked
            self._linked.add(peer)
        if self._rings and peer != self._identity and _host(endpoint) == _host(self.endpoint):
            link.offer_ring(after_messages=0 if relinked else RING_AFTER_MESSAGES)
        return link

    def drop_link(self, peer: bytes) -> None:
        """Close the link to ``peer`` (a peer that left or died), and forget its ring."""
        with self._links_lock:
            link = self._links.pop(peer, None)
        if link is not None:
            link.close()
        self._ring_inbox.forget(peer)

    def rings_out(self) -> int:
        """Links whose messages go through a same-host ring."""
        with self._links_lock:
            return sum(1 for link in self._links.values() if link.ring is not None)

    def rings_in(self) -> int:
        """Peers whose ring this transport reads."""
        return len(self._ring_inbox.snapshot)

    def rings_ready(self) -> bool:
        """Whether a peer's ring holds a message (a probe, as ``inbox_fd`` is for the socket)."""
        return bool(self._ring_inbox.snapshot) and self._ring_inbox.any_ready()

    @property
    def ring_messages_in(self) -> int:
        """Messages that came through peers' rings."""
        return self._ring_inbox.messages_in

    def receive(
        self, timeout: float, busy_until: float = 0.0, watch_contention: bool = True
    ) -> list[list[Any]]:
        """Wait up to ``timeout`` seconds and return the messages that arrived.

        One thread at a time calls this (see the module docstring). Each
        message is ``[sender id (bytes), first frame (bytes), later frames
        (zmq.Frame, zero-copy)...]``; a :meth:`wake` returns early with no message.

        Until ``busy_until`` (a :func:`time.monotonic` time; within ``timeout``
        all the same) the thread polls the inbox, yielding its core to any other
        runnable thread between polls (after a first spin without yielding, see
        ``_SPIN_SECONDS``), before it blocks for the rest: a core
        that halts while it waits runs the next message's code several times
        slower (its caches went cold), and the system call that wakes a blocked
        thread costs more than a poll. When the core is shared with another
        process's busy thread (a yield gave it away for long), polls stop for a
        while (20 ms, doubling up to 1 s while that goes on), unless
        ``watch_contention`` is False (a poller whose yields go to this process's
        own threads: the I/O thread in a flow of messages).
        """
        inbox = self._inbox
        if busy_until:
            began = _monotonic()
            until = min(busy_until, began + timeout)  # the poll is part of the timeout
            if began < until and (began >= self._no_poll_until or not watch_contention):
                found = self._poll_busily(until, watch_contention)
                if not found:
                    timeout = max(0.0, timeout - (_monotonic() - began))
                if watch_contention:  # (the turns' statistics and contention pauses)
                    if found:
                        self.busy_poll_hits += 1
                        self._contended_pause = _MIN_CONTENDED_PAUSE_SECONDS
                    else:
                        self.busy_poll_misses += 1
        messages: list[list[Any]] = []
        if self._ring_inbox.doorbell is not None:  # peers' rings too
            return self._receive_with_rings(messages, timeout)
        timeout_ms = max(0, int(timeout * 1000))
        if timeout_ms != self._timeout_ms:
            inbox.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        self._socket_unsure = True  # (a receive, even one that finds nothing)
        try:
            frame = _socket_recv(inbox, 0, False)
        except zmq.Again:
            return messages
        self._take_batch(frame, messages)
        return messages

    def _take_batch(self, frame: Any, messages: list[list[Any]]) -> None:
        """Append the message that starts with ``frame`` and those waiting after it."""
        inbox = self._inbox
        gated = self._ring_inbox.gated
        for count in range(1, _RECV_BATCH + 1):
            # zmq.Frame.more is read without a socket option lookup (which builds an enum)
            message: list[Any] = [frame.bytes]
            if frame.more:
                frame = _socket_recv(inbox, 0, False)
                message.append(frame.bytes)
                while frame.more:
                    frame = _socket_recv(inbox, 0, False)
                    message.append(frame)
            if message[0] != _WAKE_ID:
                if message[0] == self._own_link_id:
                    message[0] = self._identity
                self.socket_activity.at = _monotonic()
                if len(message) > 1 and message[1][:1] == _CONTROL:
                    self._answer_control(message, messages)
                else:
                    if gated:
                        reader = gated.get(message[0])
                        if reader is not None:
                            reader.socket_seen += 1
                    messages.append(message)
            # (``_socket_unsure`` is True here: set before the first receive, kept by a "yes")
            if count == _RECV_BATCH or not self._socket_has_message():
                break
            frame = _socket_recv(inbox, 0, False)

    def _answer_control(self, message: list[Any], messages: list[list[Any]]) -> None:
        """A ring's spill, or an offer answered on its connection (see ``_ring_inbox``)."""
        identity = message[0]
        answer = self._ring_inbox.on_control(message, messages)
        if not answer:
            return
        self._socket_unsure = True  # (a send processes the socket's commands too)
        try:
            self._inbox.send_multipart([identity, *answer], _NOBLOCK)
        except zmq.ZMQError as exc:  # the connection went meanwhile
            # (unreachable: the peer closed after its offer, as at its shutdown)
            _log.log(logging.DEBUG if exc.errno == zmq.EHOSTUNREACH else logging.WARNING,
                     "could not answer the ring offer of %r: %s", identity, exc)
            self._ring_inbox.forget(identity)

    def _receive_with_rings(self, messages: list[list[Any]], timeout: float) -> list[list[Any]]:
        """:meth:`receive` once this transport reads peers' rings: socket and rings."""
        inbox = self._inbox
        rings = self._ring_inbox
        doorbell = rings.doorbell
        assert doorbell is not None
        for attempt in range(2):
            if self._socket_has_message():
                try:
                    self._take_batch(_socket_recv(inbox, _NOBLOCK, False), messages)
                except zmq.Again:
                    pass
            rings.read(messages)
            if messages or timeout <= 0 or attempt:
                return messages
            # asleep, fenced and drained before the last look: a record published
            # after it rings the doorbell (see ``_ring``)
            told = rings.fall_asleep()
            try:
                full_fence()
                doorbell.drain()
                rings.read(messages)
                if not messages:
                    self._socket_unsure = True  # (it asks ZMQ_EVENTS itself)
                    _zmq_poll([(inbox, _POLLIN), (doorbell.fd, _POLLIN)], int(timeout * 1000))
            finally:
                rings.wake_up(told)
            if messages:
                return messages
        return messages

    def _poll_busily(self, until: float, watch_contention: bool = True) -> bool:
        """Poll the inbox and rings until ``until``, yielding between polls (after a first
        spin, see ``_SPIN_SECONDS``); whether a message waits."""
        rings_ready = self._ring_inbox.any_ready if self._ring_inbox.snapshot else None
        socket_has_message = self._socket_has_message
        last = started = _monotonic()
        # (not the I/O thread's polls in a flow of messages: they yield to the threads
        # of this process that the flow keeps busy)
        spinning = (watch_contention and rings_ready is not None
                    and started >= self.spin_gate.closed_until
                    and started - self.socket_activity.at >= _QUIET_SOCKET_SECONDS)
        spin_until = started + _SPIN_SECONDS
        if spinning:
            self.spins += 1
        try:
            while not socket_has_message():
                if rings_ready is not None:
                    if rings_ready():
                        return True
                    if spinning:  # the rings alone until the next look at the socket
                        look_at = _monotonic() + _SOCKET_LOOK_SECONDS
                        while _monotonic() < look_at:
                            if rings_ready():
                                return True
                now = _monotonic()
                if spinning:
                    # (checked on the round after the spin's end too: a gap that outlasts it)
                    if now - last >= _SHARED_CORE_SECONDS:  # the core or the GIL was taken
                        spinning = False
                        self.spun_seconds += last - started
                        self.spin_gate.close_for_a_while(now)
                        self.spins_stopped += 1
                    elif now < spin_until and now < until:
                        last = now
                        continue
                    else:
                        spinning = False
                        self.spun_seconds += now - started
                if now >= until:
                    return False
                _sched_yield()
                if watch_contention and _monotonic() - now > _LONG_YIELD_SECONDS:
                    pause = self._contended_pause
                    self._no_poll_until = now + pause
                    self._contended_pause = min(2 * pause, _MAX_CONTENDED_PAUSE_SECONDS)
                    self.busy_poll_contended += 1
                    return False
            return True
        finally:
            if spinning:  # (a message came while it spun)
                self.spun_seconds += _monotonic() - started

    def spin_counts(self) -> tuple[float, int]:
        """(Seconds busy polls spun, spins and polls that found their core taken)."""
        return self.spun_seconds, self.spins_stopped + self.busy_poll_contended

    def _socket_has_message(self) -> bool:
        """Whether the inbox socket holds a message (``ZMQ_EVENTS``, ~3 µs: a system call).

        Once it found none, each message that arrives signals the inbox's FD (a reader
        that found its pipe empty is sent a command), so the answer stands until the FD
        is readable (a 1 µs poll), unless another socket operation ran since (it may
        have taken the signal) or messages were left (``_socket_unsure``).
        """
        if not self._socket_unsure and not self._inbox_fd_poll.poll(0):
            return False
        self._socket_unsure = True  # (until it answered: it takes the signal, and may raise)
        has_message = bool(int(_socket_get(self._inbox, _EVENTS)) & _POLLIN)
        # a "no" stands until the FD signals; after a "yes" its messages are about to be
        # received (which takes the signal), so the socket stays unsure
        if not has_message and _FD_GATED_EVENTS and self._inbox_fd_poll is not None:
            self._socket_unsure = False
        return has_message

    def wake(self) -> None:
        """Make a :meth:`receive` in progress return now (callable from any thread)."""
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def nudge(self) -> None:
        """End a :meth:`wait_quietly` in progress or about to begin.

        Unlike :meth:`wake` it takes no lock, so code that may run inside a
        finalizer (which the collector runs on whichever thread allocates, in
        the middle of anything, a lock's holder too) may call it.
        """
        try:
            os.write(self._nudge_write_fd, b"\0")
        except Exception:  # noqa: BLE001 - full (a nudge waits anyway), closed, teardown
            pass

    def wait_quietly(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds, receiving nothing, until a message may wait
        (socket or rings), a :meth:`wake` or a :meth:`nudge`; whether one came.

        The caller receives afterwards. Nudges given before this call count too:
        they wait in the pipe, drained here only after the answer is taken.
        """
        inbox = self._inbox
        rings = self._ring_inbox
        doorbell = rings.doorbell
        # asleep and fenced before the last look at the rings, as a receive does
        told = rings.fall_asleep() if doorbell is not None else ()
        try:
            items: list[tuple[Any, int]] = [(inbox, _POLLIN), (self._nudge_fd, _POLLIN)]
            came = False
            if doorbell is not None:
                full_fence()
                doorbell.drain()
                came = rings.any_ready()
                items.append((doorbell.fd, _POLLIN))
            if not came:
                self._socket_unsure = True  # (the poll may take the FD's signal)
                came = bool(_zmq_poll(items, max(0, int(timeout * 1000))))
        finally:
            rings.wake_up(told)
        try:
            while len(os.read(self._nudge_fd, 4096)) == 4096:
                pass
        except (BlockingIOError, InterruptedError):
            pass
        return came

    def close(self, linger: float = 0.0) -> None:
        """Close every socket and terminate the ZeroMQ context.

        Messages still queued on links get up to ``linger`` seconds to leave
        (a worker leaving a running group makes sure its last message arrives).
        """
        with self._links_lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close(linger)
        self._ring_inbox.close()
        for name in ("_inbox", "_wake_tx"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._context.term()
        # the read end only: a nudge racing with this (it read the write end's number)
        # writes to a pipe with no reader (EPIPE) rather than to a reused descriptor; the
        # write end closes with this object
        fd, self._nudge_fd = self._nudge_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
