"""The worker actor: one I/O thread, a dispatcher of typed messages, a worker pool.

Threads and hand-offs (see ``docs/performance.md``):

* A caller thread pickles its request and sends it itself on the peer's DEALER
  link (no hand-off to the I/O thread).
* The callee's I/O thread receives, decodes the header and hands the message to
  a pool thread, or runs it inline when its handler was registered ``inline``
  (control messages that never block). The pool thread runs the function and
  sends the reply itself on its DEALER link to the caller's inbox (or, while
  more requests of that caller wait, queues it to ride on the next message to
  it: ``_riders``).
* On the caller, a thread waiting on its future receives on the inbox itself
  when the inbox is free (``_inbox``: no wake-up by the I/O thread); otherwise
  the I/O thread completes the future, waking the waiting thread.

Invariants:

* A pending call is registered before its request is sent, and removed exactly
  once: by its response, its deadline, the peer's loss, or shutdown.
* Every request kind is answered exactly once, with RESPONSE or EXCEPTION.
* An exception in a handler or while unpickling never escapes into the I/O
  loop; it becomes an EXCEPTION reply or a rate-limited warning.
"""

from __future__ import annotations

import itertools
import logging
import operator
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import (
    ActorRpcError,
    PeerUnreachableError,
    ShutdownError,
)
from ..protocol import FLAG_RIDERS, Header, MessageKind, encode_header, encode_inline
from ..serialization import PickleTarget, dumps_for, function_reference
from ..transport import Transport
from ._batch_scheduling import MAX_AGENT_IO_WAIT, BatchScheduling
from ._call_result import CallResult
from ._calls import (
    CallHook,
    CallRecord,
    FlowCredits,
    Handler,
    HandlerEntry,
    IncomingRequest,
    PeerCredits,
    PendingCall,
    RecentEntries,
    compose_reply_transforms,
)
from ._current import (
    current_agent,
    installed_plugins,
    register_agent_plugin,
    set_current_agent,
)
from ._deadlines import Deadlines
from ._deferred_riders import DeferredRiderQueue
from ._dispatch import MessageDispatcher
from ._dynamic_group import DynamicRendezvous, handle_membership, join_dynamic_group
from ._futures import Completion, Future
from ._held import HeldRequest, HeldRequests
from ._inbox import InboxTurns
from ._liveness import LivenessMonitor
from ._members import MemberTable
from ._observe import StatusPublisher, Tracer, WorkerStats, worker_snapshot
from ._options import ZmqRpcBackendOptions
from ._pool import WorkerPool
from ._rendezvous import GroupMember, Rendezvous, choose_addresses
from ._riders import Riders
from ._shared_buffers import SharedBuffers
from ._shutdown import graceful_barriers, leave, stop_threads, wait_until
from ._timed_work import QuietWatch
from ._worker_info import WorkerInfo

__all__ = [
    "Agent",
    "CallHook",
    "CallRecord",
    "IncomingRequest",
    "current_agent",
    "register_agent_plugin",
    "set_current_agent",
]

_C = TypeVar("_C", bound="Completion | CallResult[Any]")  # what a request's reply completes
_log = logging.getLogger("actorrpc.agent")
_INLINE_LIMIT = 8192  # payloads up to this size travel in the header's frame
_NBYTES = operator.attrgetter("nbytes")  # (map over it: no Python frame per buffer)
_CALL_FIELDS = ("func", "args", "kwargs", "meta")
_CREDITED_KINDS = frozenset({MessageKind.CALL, MessageKind.REMOTE_CALL})
_RECENT_KEPT = 4096  # calls given up on, replies that forked RRefs: remembered for their answers
_PAYLOAD_FIELDS: dict[MessageKind, Any] = {
    MessageKind.CALL: _CALL_FIELDS,
    MessageKind.REMOTE_CALL: _CALL_FIELDS,
}

class Agent(MessageDispatcher):
    """One worker of the group: its sockets, threads and call bookkeeping."""

    def __init__(
        self, name: str, rank: int, world_size: int | None, options: ZmqRpcBackendOptions
    ) -> None:
        self.name = name
        self.options = options
        self.dynamic = world_size is None
        self._rendezvous: Rendezvous | DynamicRendezvous
        if world_size is None:
            self._rendezvous = DynamicRendezvous(options.init_method, rank, options.init_timeout)
            rank = self._rendezvous.rank
        else:
            self._rendezvous = Rendezvous(
                options.init_method, rank, world_size, options.init_timeout
            )
        self.rank = rank
        self._static_world_size = world_size
        self.info = WorkerInfo(name, rank)
        self.identity = f"{rank}:{secrets.token_hex(4)}".encode()
        self.io_thread_ident: int | None = None
        self._handlers: dict[MessageKind, HandlerEntry] = {}
        self._hooks: list[CallHook] = []
        self.serving_without_meta = False  # some hook may serve a call without meta
        self._shutdown_hooks: list[Callable[[float], None]] = []
        self._close_hooks: list[Callable[[bool], None]] = []
        self._pending: dict[int, PendingCall] = {}
        self._late_replies: RecentEntries[Any, Any] = RecentEntries(_RECENT_KEPT)
        self._replies_with_forks: RecentEntries[Any, Any] = RecentEntries(_RECENT_KEPT)
        self._deadlines = Deadlines()
        self._message_ids = itertools.count(1)
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._unstarted: dict[int, int] = {}  # sender rank -> requests received, not started
        self._serving: dict[tuple[int, int], tuple[MessageKind, Any, float]] = {}
        self.members = MemberTable()
        self._members = self.members.members
        self._infos = self.members.infos
        self.liveness = LivenessMonitor(self)
        self._credits = PeerCredits(options.max_calls_in_flight_per_peer)
        self._running = False
        self._io_thread: threading.Thread | None = None
        self._last_warning = 0.0
        self._suppressed_warnings = 0
        self.extensions: dict[str, Any] = {}
        self.inbox = InboxTurns()
        self.quiet = QuietWatch()
        self.riders = Riders(self)
        self.deferred_riders = DeferredRiderQueue()
        self.held = HeldRequests(self, options.hold_remote_calls)
        self._soon: queue.SimpleQueue[tuple[Callable[..., Any], Any]] = queue.SimpleQueue()
        self.stats = WorkerStats()
        self.tracer = Tracer(rank, name)
        self._status = StatusPublisher(self, self._publish_status)
        self._pool = WorkerPool(options.num_worker_threads, f"actorrpc-{name}",
                                before_wait=self.riders.settle_owed)
        self.register_handler(MessageKind.CALL, self._handle_call)
        self.register_handler(MessageKind.PING, lambda request: None, inline=True)
        self.register_handler(
            MessageKind.REPLY_UNDECODED, self._handle_reply_undecoded, inline=True
        )
        try:
            for install in installed_plugins():
                install(self)
            secret = None
            if options.security != "none":
                secret = self._rendezvous.group_secret(options.resolved_secret())
            bind_host, advertise_host = choose_addresses(options)
            self._transport = Transport(
                self.identity,
                bind_host=bind_host,
                advertise_host=advertise_host,
                secret=secret,
                security=options.security,
                send_timeout=options.rpc_timeout or 0,
                name_threads=options.batch_scheduling,
                rings=options.same_host_rings,
            )
            self.quiet.nudge = self._transport.nudge
            self.inbox.spin_gate = self._transport.spin_gate
            self.batch_scheduling = BatchScheduling(  # libzmq's I/O threads
                self._transport.io_thread_ids(), options.batch_scheduling,
                own_spins=self._transport.spin_counts,
            )
            # the agent's I/O thread, which adds itself: guarded on its own, so that a
            # fallback of either leaves the other's policy alone
            self.io_thread_scheduling = BatchScheduling(
                [], options.batch_scheduling, max_wait=MAX_AGENT_IO_WAIT,
                own_spins=self._transport.spin_counts,
            )
            self.endpoint = self._transport.endpoint
            self.shared = SharedBuffers(self, options.shared_memory_threshold)
        except BaseException:
            if isinstance(self._rendezvous, DynamicRendezvous):
                self._rendezvous.release_rank()
            self._rendezvous.close()
            raise

    @property
    def world_size(self) -> int:
        """The number of workers: fixed in a static group, current members in a dynamic one."""
        if self._static_world_size is not None:
            return self._static_world_size
        return len(self.members.worker_infos())

    # -- registration -------------------------------------------------------------------

    def register_handler(
        self, kind: MessageKind, handler: Handler, inline: bool = False,
        after_carrier: bool = False,
    ) -> None:
        """Route requests of ``kind`` to ``handler``; ``inline`` handlers must never block.

        ``after_carrier`` (notifications that only let go of something, such as a
        reference count's decrement): when one rides on a request that a thread
        serves, it is handled after that request instead of before it, so the
        request's reply does not wait for it.
        """
        self._handlers[kind] = HandlerEntry(handler, inline, after_carrier)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the I/O thread soon; safe from ``__del__`` and any thread."""
        self._soon.put((fn, args))
        self.quiet.nudge_if_waiting()

    def notify_soon(self, rank: int, kind: MessageKind, payload: Any) -> None:
        """Send a notification to ``rank`` on the next message to it (kinds registered with
        ``riders.batch_kind``: a later one, in a batch), or alone within 10 ms.

        For notifications nobody waits for (``payload``: plain tuples and lists of
        scalars); safe from ``__del__``, finalizers and any thread.
        """
        self.riders.add(rank, kind, payload)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread (work that computes: never on the I/O thread)."""
        self._pool.submit(fn, *args)
        self.quiet.nudge_if_waiting()

    def add_call_hook(self, hook: CallHook) -> None:
        self._hooks.append(hook)
        if not getattr(hook, "serves_only_with_meta", False):
            self.serving_without_meta = True

    def add_shutdown_hook(self, hook: Callable[[float], None]) -> None:
        """``hook(deadline)`` runs at the start of a graceful shutdown, before the barrier."""
        self._shutdown_hooks.append(hook)

    def add_close_hook(self, hook: Callable[[bool], None]) -> None:
        """``hook(graceful)`` runs after the sockets closed (leak reports, state reset)."""
        self._close_hooks.append(hook)

    # -- membership -----------------------------------------------------------------------

    def start(self, on_joined: Callable[[], None] | None = None) -> None:
        """Join the group, call ``on_joined``, then start serving.

        Messages that arrive before serving starts wait in the inbox. A worker
        joining a dynamic group serves from the start (its announcements need
        answers), but nobody knows it before it announces itself.
        """
        rendezvous = self._rendezvous
        try:
            if isinstance(rendezvous, DynamicRendezvous):
                if on_joined is not None:
                    on_joined()
                self._start_serving()
                join_dynamic_group(self, rendezvous)
            else:
                members = rendezvous.join(self.name, self._transport.endpoint, self.identity)
                for member in members:
                    self.members.add(member)
                if on_joined is not None:
                    on_joined()
                self._start_serving()
        except BaseException:
            stop_threads(self)
            self._transport.close()
            if isinstance(rendezvous, DynamicRendezvous):
                rendezvous.release_rank()
            rendezvous.close()
            raise
        self._status.start()

    def _start_serving(self) -> None:
        self.members.add(GroupMember(self.name, self.rank, self.endpoint, self.identity))
        self._running = True
        self._io_thread = threading.Thread(
            target=self._io_loop, name=f"actorrpc-io-{self.name}", daemon=True
        )
        self._io_thread.start()

    def _publish_status(self, rank: int, world_size: int, payload: str) -> None:
        self._rendezvous.publish_status(rank, world_size, payload)

    def wake_inbox(self) -> None:
        """Make whichever thread receives on the inbox return from its wait now."""
        self._transport.wake()

    def is_alive(self) -> bool:
        return self._running

    def worker_infos(self) -> list[WorkerInfo]:
        return self.members.worker_infos()

    def resolve(self, to: Any) -> WorkerInfo:
        """Map a name, rank or :class:`WorkerInfo` to a member of the group."""
        return self.members.resolve(to)

    def _on_membership(self, identity: bytes, header: Header, frames: list[Any]) -> None:
        handle_membership(self, identity, header, frames)

    # -- sending ----------------------------------------------------------------------------

    def effective_timeout(self, timeout: float) -> float:
        return self.options.rpc_timeout if timeout is None or timeout < 0 else timeout

    def send_request(
        self,
        dest: WorkerInfo,
        kind: MessageKind,
        payload: Any,
        timeout: float = -1.0,
        description: str = "",
        on_result: Callable[[Any], Any] | None = None,
        hold: bool = False,
        make: Callable[[Any, Agent], Any] = Future,
    ) -> Any:
        """Send a request and return the future of its reply: a :class:`Future`, or what
        ``make`` makes (a :class:`CallResult` where no torch future is needed).

        Pickling errors are raised here, before anything is sent. ``hold``: keep
        it back for a moment (see :mod:`._held`), when no call hook is involved.
        """
        return self._send_request(make, dest, kind, payload, timeout, description, on_result,
                                  hold)

    def _send_request(
        self,
        make: Callable[[Any, Agent], _C],
        dest: WorkerInfo,
        kind: MessageKind,
        payload: Any,
        timeout: float,
        description: str,
        on_result: Callable[[Any], Any] | None,
        hold: bool,
    ) -> _C:
        """:meth:`send_request`, completing ``make(description, agent)`` (a Future or a
        :class:`CallResult`)."""
        if not self._running:
            raise ActorRpcError(f"the RPC agent of {self.name!r} is shut down")
        body, buffers, target = dumps_for(dest.id, payload, _PAYLOAD_FIELDS.get(kind, "arguments"))
        try:
            return self._send_encoded(
                make, dest, kind, body, timeout, description, on_result, buffers,
                target, hold and on_result is None,
            )
        except BaseException:
            if target is not None:  # nothing was sent: undo what pickling registered
                target.abort()
            raise

    def send_encoded(
        self, dest: Any, kind: MessageKind, body: bytes, timeout: float = -1.0,
        description: str = "",
    ) -> Future[Any]:
        """Send an already encoded request (``dest``: a WorkerInfo or GroupMember)."""
        return self._send_encoded(Future, dest, kind, body, timeout, description, None, [],
                                  None, False)

    def _send_encoded(
        self,
        make: Callable[[Any, Agent], _C],
        dest: Any,
        kind: MessageKind,
        body: bytes,
        timeout: float,
        description: str,
        on_result: Callable[[Any], Any] | None,
        buffers: list[Any],
        undo: PickleTarget | None,
        hold: bool,
    ) -> _C:
        if isinstance(dest, GroupMember):
            dest = self.members.infos.get(dest.rank) or WorkerInfo(dest.name, dest.rank)
        if timeout is None or timeout < 0:  # (effective_timeout, without a call per message)
            timeout = self.options.rpc_timeout
        message_id = next(self._message_ids)
        # (a pair, formatted when needed: a closure would be five objects for the garbage
        # collector, per call in flight)
        future = make((description or kind.name, dest.name), self)
        self._pending[message_id] = PendingCall(
            future, dest, description, timeout, on_result, self._take_credit(dest, kind, timeout),
            kind, undo,
        )
        if timeout > 0:
            self._deadlines.add(time.monotonic() + timeout, message_id)
        self.quiet.nudge_for_call(timeout, kind == MessageKind.PING)
        traced = self.tracer.enabled  # recorded before sending: the reply may come first
        if traced:
            self.tracer.call_sent(message_id, dest.id, description or kind.name,
                                  len(body) + sum(map(_NBYTES, buffers)))
        if hold:
            self.held.hold(HeldRequest(dest.id, kind, message_id, body, buffers, undo, future))
            return future
        try:
            self._send(dest.id, kind, message_id, body, buffers)
        except BaseException:
            self._take_pending(message_id)
            if traced:
                self.tracer.call_unsent(message_id)
            raise
        self.stats.calls_sent[dest.id] += 1
        return future

    def send_notification(self, rank: int, kind: MessageKind, payload: Any) -> None:
        """Send a notification (message id 0, never answered) now; see also :meth:`notify_soon`."""
        body, buffers, _ = dumps_for(rank, payload, "arguments")
        self._send(rank, kind, 0, body, buffers)
        self.stats.calls_sent[rank] += 1

    def is_member(self, rank: int) -> bool:
        return rank in self._members

    def _take_credit(
        self, dest: WorkerInfo, kind: MessageKind, timeout: float
    ) -> FlowCredits | None:
        """Flow control (``max_calls_in_flight_per_peer``) for user calls: control
        messages and the threads that receive (the I/O thread, a waiter in its turn
        on the inbox) are never held back."""
        me = threading.get_ident()
        if kind not in _CREDITED_KINDS or me in (self.io_thread_ident, self.inbox.holder):
            return None
        return self._credits.take(dest, timeout)

    def _take_pending(self, message_id: int) -> PendingCall | None:
        """Remove a pending call (exactly once) and give back its flow-control credit."""
        pending = self._pending.pop(message_id, None)
        if pending is not None and pending.credits is not None:
            pending.credits.give_back()
        return pending

    def prepare_call(
        self, dest: WorkerInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[CallRecord, Callable[[Any], Any] | None]:
        """Run every hook's ``before_send``; return the call and the reply transform."""
        record = CallRecord(dest, {}, args, kwargs)
        transforms = []
        for hook in self._hooks:  # (a loop: no generator frames on every call)
            transform = hook.before_send(record)
            if transform is not None:
                transforms.append(transform)
        return record, compose_reply_transforms(transforms) if transforms else None

    def call(
        self,
        dest: WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float = -1.0,
        kind: MessageKind = MessageKind.CALL,
        extra: tuple[Any, ...] = (),
        hold: bool = False,
        make: Callable[[Any, Agent], Any] = Future,
    ) -> Any:
        """Run ``func(*args, **kwargs)`` on ``dest``; ``extra`` fields follow the meta dict
        (``hold``: see :meth:`send_request`). Returns a :class:`Future`, or what ``make``
        makes (:class:`CallResult` where nobody else will see it)."""
        if type(func) is bytes:  # (bytes in a call's place name a function: see below)
            raise TypeError(f"{func!r} is not callable")
        record, on_result = self.prepare_call(dest, args, kwargs)
        name = getattr(func, "__qualname__", None) or repr(func)
        # (an importable function travels as the bytes that name it, made once: see
        # serialization._function_refs)
        payload = (function_reference(func), record.args, record.kwargs, record.meta, *extra)
        return self._send_request(
            make, dest, kind, payload, timeout, name, on_result, hold and not record.meta,
        )

    def call_and_wait(
        self, dest: WorkerInfo, func: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any], timeout: float = -1.0,
    ) -> Any:
        """``call(...).wait()`` for a caller that only waits: its result needs no torch
        future (see :class:`CallResult`)."""
        return self.call(dest, func, args, kwargs, timeout, make=CallResult).wait()

    def _send(
        self, dest_rank: int, kind: MessageKind, message_id: int, body: bytes, buffers: list[Any]
    ) -> None:
        member = self._members.get(dest_rank)
        if member is None:
            if dest_rank in self.members.departed:
                raise self.members.left_error(dest_rank)
            raise PeerUnreachableError(f"worker {dest_rank} is not in the group")
        dead = self.liveness.dead_peers
        if dest_rank in dead and kind != MessageKind.PING:
            raise PeerUnreachableError(dead[dest_rank])
        self.send_to(member, kind, message_id, body, buffers)

    def send_to(self, member: GroupMember, kind: MessageKind, message_id: int, body: bytes,
                buffers: list[Any]) -> None:
        """Put one message on the link to ``member`` (whether or not it is in the table)."""
        shared = self.shared
        riders = self.riders
        link = self._transport.link(member.identity, member.endpoint)
        if not buffers and not riders.queued:  # the common case: one frame if small
            small = 0 < len(body) <= _INLINE_LIMIT  # then a copy costs less than a part
            link.send([encode_inline(kind, self.rank, message_id, body)] if small else
                      [encode_header(kind, 0, self.rank, message_id), body])
            self.stats.bytes_out[member.rank] += len(body)
            return
        frames, flags, lent = shared.outgoing(member, body, buffers)
        carried = [] if kind == MessageKind.MEMBERSHIP else riders.take(member.rank)
        if carried:  # queued notifications for ``member`` ride along
            frames.append(riders.encode(carried))
            flags |= FLAG_RIDERS
        try:
            link.send([encode_header(kind, len(buffers), self.rank, message_id, flags), *frames])
        except Exception:  # not sent
            shared.take_back(lent, member.rank)
            riders.put_back(member.rank, carried)
            raise
        except BaseException:  # an interrupt may come after it left: only replies go again
            riders.put_back(member.rank, [r for r in carried if r[1]])  # (a copy is dropped)
            raise
        if message_id or kind != MessageKind.PING:  # not a flush's carrier (``sent_alone``)
            riders.carried += len(carried)
        self.stats.bytes_out[member.rank] += len(body) + sum(map(_NBYTES, buffers))

    # -- the I/O loop -------------------------------------------------------------------------

    def _io_loop(self) -> None:
        self.io_thread_ident = threading.get_ident()
        # its wake-ups while other threads compute must not preempt them (_batch_scheduling)
        self.io_thread_scheduling.add(threading.get_native_id())
        self.inbox.run_io_loop(self)

    # -- shutdown -------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This worker's statistics (see :func:`actorrpc.get_worker_stats`)."""
        return worker_snapshot(self)

    def idle(self) -> bool:
        """No call pending (PINGs aside), no request being served, no notification queued
        (to ride, or as I/O thread work such as an RRef child accept)."""
        return (
            len(self._pending) <= self.liveness.pings_in_flight()
            and self._inflight == 0
            and not self.riders.queued
            and not self.riders.waiting
            and self._soon.empty()
        )

    def wait_idle(self, deadline: float) -> bool:
        return wait_until(self.idle, deadline)

    def pending_destinations(self) -> Iterator[str]:
        return (f"{p.description or 'call'} on {p.dest!r}" for p in list(self._pending.values()))

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Leave the group; graceful waits for all work everywhere (see module docs)."""
        budget = self.options.shutdown_timeout if timeout is None or timeout < 0 else timeout
        deadline = time.monotonic() + (budget if budget > 0 else 10**9)
        problems: list[str] = []
        self.held.release()
        if isinstance(self._rendezvous, DynamicRendezvous):
            leave(self, self._rendezvous, graceful, deadline, problems)
        elif graceful:
            try:
                graceful_barriers(self, deadline, budget, problems)
            except Exception as exc:  # noqa: BLE001 - report, then still close
                problems.append(f"{type(exc).__name__}: {exc}")
        self._close(graceful)
        if problems:
            raise ShutdownError(f"shutdown of {self.name!r} was not clean: " + "; ".join(problems))

    def _close(self, graceful: bool) -> None:
        stop_threads(self)
        self.held.discard()  # (one held after shutdown() sent the last: its call fails below)
        error = ActorRpcError(f"RPC agent {self.name!r} shut down before the call completed")
        for message_id in list(self._pending):
            self._fail_pending(message_id, error)
        self._transport.close(linger=1.0 if self.dynamic else 0.0)
        self.shared.close()
        self._rendezvous.close()
        for hook in self._close_hooks:
            hook(graceful)
