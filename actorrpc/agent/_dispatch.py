"""The receiving half of the agent: dispatch of incoming messages, serving requests and
answering them (the replies that come back are settled by its base, ``_replies``).

:class:`MessageDispatcher` is a base class of :class:`~actorrpc.agent._agent.Agent`;
it owns no state of its own (the attributes below are the agent's) and runs on
whichever thread receives (:meth:`_on_message`, inline handlers) and on pool
threads (:meth:`_serve`).

Invariants:

* A message whose sender is not a member with the identity it connected with is
  dropped before anything in it is unpickled.
* Every request is answered exactly once: RESPONSE with the handler's result or
  EXCEPTION with the error (including errors while unpickling or replying).
* Replies settle their pending calls (``_replies``, a base class of this one).
* A request that cannot be unpickled (or is refused before) is answered with an
  EXCEPTION naming the RRef forks rebuilt before the failure (none if refused);
  the sender then undoes the forks it made for that request but those, as if it
  had never been sent (a rebuilt fork is the receiver's to release).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DeserializationError, PeerUnreachableError, ProtocolError
from ..protocol import (
    FLAG_INLINE_PAYLOAD,
    FLAG_RIDERS,
    HEADER_SIZE,
    RESPONSE_KINDS,
    Header,
    MessageKind,
    decode_header,
    decode_riders,
)
from ..serialization import dumps, loads, loads_from, resolve_function_reference
from ._call_result import CallResult
from ._calls import (
    CallHook,
    CallRecord,
    EncodedReply,
    Failure,
    HandlerEntry,
    IncomingRequest,
    encode_reply,
    outcome_of,
    run_user_function,
)
from ._deferred_riders import DeferredRiderQueue, DeferredRiders
from ._remote_exception import pack_exception
from ._replies import ReplySettling
from ._riders import MAX_RIDING_REPLY
from ._worker_info import WorkerInfo

if TYPE_CHECKING:
    from ._liveness import LivenessMonitor
    from ._observe import WorkerStats
    from ._pool import WorkerPool
    from ._rendezvous import GroupMember
    from ._riders import Riders
    from ._shared_buffers import SharedBuffers
    from ._timed_work import QuietWatch

__all__ = ["MessageDispatcher"]

_log = logging.getLogger("actorrpc.agent")
# notifications registered ``after_carrier`` riding on a request are handled after it
# (False: before it, as every other rider; a switch for same-run A/Bs, ab_switch.py)
RIDERS_AFTER_CARRIER = True
_WARN_INTERVAL = 5.0
_PING = MessageKind.PING
_CALL_KINDS = frozenset(
    {MessageKind.CALL, MessageKind.REMOTE_CALL, MessageKind.REMOTE_CALL_FETCH}
)


def _request_name(kind: MessageKind, payload: Any) -> str:
    """A served request in words: its function's name for a call, else its kind."""
    if kind in _CALL_KINDS and isinstance(payload, tuple):
        if type(payload[0]) is bytes:  # (one that could not be resolved)
            return "a function reference"
        return getattr(payload[0], "__qualname__", None) or repr(payload[0])
    return kind.name


class MessageDispatcher(ReplySettling):
    """Incoming messages: requests to handlers (inline or on the pool), replies to futures."""

    name: str
    rank: int
    info: WorkerInfo
    liveness: LivenessMonitor
    stats: WorkerStats
    _handlers: dict[MessageKind, HandlerEntry]
    _hooks: list[CallHook]
    serving_without_meta: bool
    _members: dict[int, GroupMember]
    _infos: dict[int, WorkerInfo]
    _inflight: int
    _inflight_lock: threading.Lock
    _unstarted: dict[int, int]
    _serving: dict[tuple[int, int], tuple[MessageKind, Any, float]]
    _pool: WorkerPool
    riders: Riders
    deferred_riders: DeferredRiderQueue
    _last_warning: float
    _suppressed_warnings: int
    shared: SharedBuffers
    quiet: QuietWatch

    def _send(
        self, dest_rank: int, kind: MessageKind, message_id: int, body: bytes, buffers: list[Any]
    ) -> None:
        raise NotImplementedError

    def wake_inbox(self) -> None:
        raise NotImplementedError

    def _on_membership(self, identity: bytes, header: Header, frames: list[Any]) -> None:
        raise NotImplementedError

    def serve(
        self,
        sender: WorkerInfo,
        meta: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[[CallRecord], Any],
        request: IncomingRequest | None = None,
    ) -> Any:
        """Run ``run(call)`` inside every hook's ``serving`` scope; return the call's result.

        Work a scope leaves in ``call.after_reply`` goes to ``request`` (its
        ``optional_after_reply``); without a request it is dropped.
        """
        record = CallRecord(sender, meta, args, kwargs)
        if not meta and not self.serving_without_meta:  # no hook has anything to do
            return run(record)
        scopes: list[AbstractContextManager[Any]] = []
        for hook in self._hooks:  # (a loop: no generator frames on every call)
            scope = hook.serving(record)
            if scope is not None:
                scopes.append(scope)
        if not scopes:
            return run(record)
        if len(scopes) == 1:  # (an ExitStack costs ~3 µs per call warm)
            with scopes[0]:
                record.result = run(record)
        else:
            with ExitStack() as stack:
                for scope in scopes:
                    stack.enter_context(scope)
                record.result = run(record)
        if request is not None and record.after_reply is not None:
            request.optional_after_reply = record.after_reply
        return record.result

    # -- replying -----------------------------------------------------------------------------

    def _reply(self, sender: int, message_id: int, value: Any) -> bool:
        """Answer with ``value``; True if the reply was handed to the link (not queued to
        ride on a later message, nor replaced by an error)."""
        try:  # (a handler may have pickled its reply itself)
            encoded = value if type(value) is EncodedReply else encode_reply(sender, value)
        except BaseException as exc:  # noqa: BLE001 - its side effects are undone already
            self._reply_exception(sender, message_id, exc)  # the error goes back instead
            return False
        target = encoded.target
        if (
            not encoded.buffers and target is None
            and len(encoded.body) <= MAX_RIDING_REPLY
            and self._unstarted.get(sender) and self._pool.on_pool_thread()
        ):  # another request of ``sender`` waits: this reply rides on the next message to it
            self.riders.add_reply(sender, message_id, encoded.body)
            return False
        try:
            if target is not None:  # before sending: REPLY_UNDECODED may come at once
                self._replies_with_forks.remember((sender, message_id), target)
            self._send(sender, MessageKind.RESPONSE, message_id, encoded.body, encoded.buffers)
            return True
        except BaseException as exc:  # noqa: BLE001 - nothing was sent
            if target is not None:  # (it was remembered) undo what pickling registered
                self._replies_with_forks.take((sender, message_id))
                target.abort()
            if isinstance(exc, PeerUnreachableError):
                _log.warning("%s: cannot reply to worker %s: it is unreachable", self.name, sender)
            else:  # the error goes to the caller instead
                self._reply_exception(sender, message_id, exc)
            return False

    def _reply_exception(
        self,
        sender: int,
        message_id: int,
        exc: BaseException,
        undecoded: tuple[Hashable, ...] | None = None,
    ) -> None:
        """Answer with EXCEPTION; ``undecoded``: see :class:`Failure` (the wire format's
        fifth field, None when the request was unpickled)."""
        info = pack_exception(exc, repr(self.info))
        try:
            body, buffers = dumps((*info, undecoded), "exception")
            self._send(sender, MessageKind.EXCEPTION, message_id, body, buffers)
        except BaseException:  # noqa: BLE001 - last resort: nothing else can be done
            _log.exception("%s: cannot send an error reply to worker %s", self.name, sender)

    def _finish_request(
        self, sender: int, message_id: int, outcome: Any, request: IncomingRequest | None = None
    ) -> None:
        """Answer the request (unless a notification), then run the work ``request`` left
        for after its reply (``after_reply``; ``optional_after_reply`` only if the reply
        left now)."""
        after_reply = None if request is None else request.after_reply
        if message_id == 0:  # a notification: never answered
            try:
                if isinstance(outcome, Failure):
                    self._notification_failed(sender, outcome.error)
                if after_reply is not None:
                    self._run_after_reply(after_reply)
            finally:
                with self._inflight_lock:
                    self._inflight -= 1
            return
        sent = False  # the reply was handed to the link now (not queued to ride, no error)
        try:
            if isinstance(outcome, (torch._C.Future, CallResult)):  # served until it completes
                try:
                    if after_reply is not None:
                        self._run_after_reply(after_reply)
                finally:

                    def finish(future: Any) -> None:  # (torch hands it its C future: Any)
                        self._finish_request(sender, message_id, outcome_of(future))

                    outcome.add_done_callback(finish)
                return
            if isinstance(outcome, Failure):
                self._reply_exception(sender, message_id, outcome.error, outcome.undecoded)
            else:
                sent = self._reply(sender, message_id, outcome)
        except BaseException as exc:  # noqa: BLE001
            self._reply_exception(sender, message_id, exc)
        try:
            if after_reply is not None:
                self._run_after_reply(after_reply)
            if sent and request is not None and request.optional_after_reply is not None:
                self._run_after_reply(request.optional_after_reply)
        finally:  # (the request counts as served whatever happens)
            self._serving.pop((sender, message_id), None)
            with self._inflight_lock:
                self._inflight -= 1

    def _run_after_reply(self, after_reply: Callable[[], None]) -> None:
        try:
            after_reply()
        except Exception:  # noqa: BLE001 - the reply is gone: only a log can tell
            _log.exception("%s: the work left after a reply failed", self.name)

    # -- serving ------------------------------------------------------------------------------

    def _serve(
        self,
        kind: MessageKind,
        sender: WorkerInfo,
        message_id: int,
        parts: list[Any],
        entry: HandlerEntry,
        later: DeferredRiders | None = None,
    ) -> None:
        """Serve one request, then the notifications that rode on it to be handled after it."""
        try:
            started = time.time()
            in_burst = False  # more requests of this sender wait (its reply may ride: _riders)
            if message_id:
                with self._inflight_lock:
                    waiting = self._unstarted.get(sender.id)
                    if waiting:  # (none when the sender left meanwhile: forget_member)
                        self._unstarted[sender.id] = waiting - 1
                        in_burst = waiting > 1
            payload: Any = None
            undecoded: tuple[Hashable, ...] | None = None
            request: IncomingRequest | None = None
            try:
                try:
                    payload, source = loads_from(sender.id, parts[0], parts[1:])
                except DeserializationError as exc:
                    undecoded = exc.taken_over
                    raise
                first = payload[0] if type(payload) is tuple and payload else None
                if type(first) is bytes and kind in _CALL_KINDS:  # a function by reference
                    first = resolve_function_reference(first)
                    payload = (first, *payload[1:])
                if message_id:  # what shutdown names if it gives up waiting for it
                    self._serving[(sender.id, message_id)] = (kind, payload, started)
                if source is not None and source.pending:  # it waits: queued replies go first
                    self.riders.settle_owed()
                    for waiter in source.pending:
                        waiter.wait()
                else:
                    self.riders.before_request(kind, first)
                # its time, measured only in a burst: wall time, at least its CPU time (the
                # thread's CPU clock is a system call here, twice per request)
                started_at = time.perf_counter() if in_burst else 0.0
                request = IncomingRequest(kind, sender, message_id, payload)
                outcome = entry.handler(request)
                self.riders.after_request(
                    kind, first, time.perf_counter() - started_at if in_burst else None
                )
            except BaseException as exc:  # noqa: BLE001 - every failure is answered
                outcome = Failure(exc, undecoded)
                self.riders.after_request(kind, None, None)  # not known to be quick
            if self.tracer.enabled:  # recorded before the reply leaves: a trace stopped after
                # the caller has its reply holds this request's event
                what = _request_name(kind, payload)
                nbytes = sum(memoryview(p).nbytes for p in parts)
                outcome_name = "error" if isinstance(outcome, Failure) else "ok"
                self.tracer.served(sender.id, message_id, what, nbytes, started, outcome_name)
            self._finish_request(sender.id, message_id, outcome, request)
        finally:
            if later is not None:
                self.serve_deferred(later)

    def _handle_call(self, request: IncomingRequest) -> Any:
        func, args, kwargs, meta = request.payload[:4]
        return self.serve_call(request.sender, meta, func, args, kwargs, request)

    def serve_call(self, sender: WorkerInfo, meta: dict[str, Any], func: Callable[..., Any],
                   args: tuple[Any, ...], kwargs: dict[str, Any],
                   request: IncomingRequest | None = None) -> Any:
        """``func(*args, **kwargs)`` as a served call (:meth:`serve`, with the hooks' view of
        the arguments), or directly when no hook has anything to do (no CallRecord, no
        closure: most calls)."""
        if not meta and not self.serving_without_meta:
            return run_user_function(func, args, kwargs)
        return self.serve(
            sender, meta, args, kwargs,
            lambda call: run_user_function(func, call.args, call.kwargs), request,
        )

    def requests_being_served(self) -> list[str]:
        """The requests this worker serves now: what, from whom, for how long."""
        now = time.time()
        described = []
        for (sender, _), (kind, payload, started) in sorted(
            list(self._serving.items()), key=lambda item: item[1][2]
        ):
            info = self._infos.get(sender)
            source = info.name if info is not None else f"rank {sender}"
            described.append(f"{_request_name(kind, payload)} from {source!r} for "
                             f"{now - started:.1f} s")
        return described

    def warn(self, what: str) -> None:
        """Log a warning about a peer's message, at most one per interval."""
        now = time.monotonic()
        if now - self._last_warning < _WARN_INTERVAL:
            self._suppressed_warnings += 1
            return
        count = self._suppressed_warnings
        extra = f" ({count} similar suppressed)" if count else ""
        self._last_warning = now
        self._suppressed_warnings = 0
        _log.warning("%s: %s%s", self.name, what, extra)

    def _on_message(self, message: list[Any]) -> None:
        if len(message) < 2:
            self.warn(f"dropped a message of {len(message)} frames (need at least 2)")
            return
        identity = message[0]
        try:
            header = decode_header(message[1])
        except ProtocolError as exc:
            self.warn(f"dropped a malformed message: {exc}")
            return
        if header.flags == FLAG_INLINE_PAYLOAD:  # the payload follows the header
            frames = [memoryview(message[1])[HEADER_SIZE:], *message[2:]]
        elif len(message) < 3:
            self.warn("dropped a message of 2 frames whose header has no inline payload")
            return
        else:
            frames = message[2:]
        if header.kind == MessageKind.MEMBERSHIP:
            self._on_membership(identity, header, frames)
            return
        member = self._members.get(header.sender)
        if member is None or member.identity != identity:
            self.warn(f"dropped a message claiming to be rank {header.sender}: unknown sender")
            return
        liveness = self.liveness
        liveness.last_seen[header.sender] = time.monotonic()  # (heard_from, in the common case)
        if header.sender in liveness.dead_peers:
            liveness.heard_from(header.sender, member.name)
        self.stats.bytes_in[header.sender] += (
            len(frames[0]) if len(frames) == 1 else sum(map(len, frames))
        )
        is_response = header.kind in RESPONSE_KINDS
        # (a liveness check, or its answer, leaves a quiet worker quiet)
        if (header.kind != _PING or header.flags & FLAG_RIDERS) and not (
                is_response and self._answers_liveness_check(header.message_id)):
            self.quiet.interrupted()
        later: list[tuple[MessageKind, Any]] | None = None  # riders handled after the request
        try:
            if header.flags & FLAG_INLINE_PAYLOAD and len(frames) > 1:
                raise ProtocolError("a message with an inline payload carries more frames")
            if header.flags & FLAG_RIDERS:  # notifications rode along in the last frame
                if len(frames) < 2:
                    raise ProtocolError("a message flagged with riders carries no riders frame")
                riders = decode_riders(memoryview(frames[-1]))  # (not .buffer: a frame)
                frames = frames[:-1]
                # handled before the message that carried them, and even if it is refused;
                # those registered ``after_carrier`` riding on a request served on a
                # thread: after it
                carrier = None if is_response or not header.message_id else (
                    self._handlers.get(header.kind))
                defer = (carrier is not None and not carrier.inline and RIDERS_AFTER_CARRIER
                         and not self.tracer.enabled)  # (traced: each is recorded as served)
                for kind, rider_id, body in riders:
                    if rider_id:  # a reply (see _riders)
                        self._on_response(kind, header.sender, rider_id, [body])
                    elif defer and self._after_carrier(kind):
                        if later is None:
                            later = []
                        later.append((kind, body))
                    else:
                        self._on_riding_notification(kind, header.sender, body)
            if not header.nbuffers and len(frames) == 1:  # the common case: a payload alone
                payload = frames[0]
                parts = [payload if type(payload) is memoryview else memoryview(payload)]
            else:
                parts = self.shared.incoming(header, frames)
        except ProtocolError as error:
            self._serve_riders(header.sender, later or ())  # (the request is refused)
            pending = self._pending.get(header.message_id)
            if is_response and pending is not None and pending.dest.id == header.sender:
                self._fail_pending(header.message_id, error)
            elif is_response:
                self.warn(f"dropped a malformed reply from rank {header.sender}")
            else:  # refused before anything in it was unpickled
                self._reply_exception(header.sender, header.message_id, error, ())
            return
        if is_response:
            self._on_response(header.kind, header.sender, header.message_id, parts)
        else:
            self._on_request(header.kind, header.sender, header.message_id, parts, later)

    def _answers_liveness_check(self, message_id: int) -> bool:
        """Whether ``message_id`` is a liveness PING of this worker's, still unanswered."""
        pending = self._pending.get(message_id)
        return pending is not None and pending.kind == _PING

    def serve_deferred(self, deferred: DeferredRiders) -> None:
        """Handle notifications deferred past their carrier (once, see ``_deferred_riders``),
        with the sender known when they arrived."""
        sender = deferred.sender
        for kind, body in deferred.take():
            self._on_riding_notification(kind, sender.id, body, sender)

    def serve_due_riders(self, now: float) -> None:
        """The I/O thread's timed work: deferred notifications whose carrier took too long."""
        for deferred in self.deferred_riders.due(now):
            self.serve_deferred(deferred)

    def _after_carrier(self, kind: MessageKind) -> bool:
        entry = self._handlers.get(kind)
        return entry is not None and entry.after_carrier

    def _serve_riders(
        self, sender_rank: int, riders: list[tuple[MessageKind, Any]] | tuple[()]
    ) -> None:
        """Handle notifications that rode on a message, in order (see ``_on_message``)."""
        for kind, body in riders:
            self._on_riding_notification(kind, sender_rank, body)

    def _on_request(self, kind: MessageKind, sender_rank: int, message_id: int,
                    parts: list[Any], riders: list[tuple[MessageKind, Any]] | None = None) -> None:
        """A request (``message_id`` 0: a notification) to its handler, inline or on the pool.

        ``riders``: ``after_carrier`` notifications that rode on it, handled once it was
        served or after ``DEFERRED_RIDER_DELAY`` (now, if it is not served).
        """
        later = riders or ()
        entry = self._handlers.get(kind)
        if entry is None:
            self._serve_riders(sender_rank, later)
            error = ProtocolError(f"worker {self.name!r} has no handler for kind {kind.name}")
            if message_id:
                self._reply_exception(sender_rank, message_id, error, ())
            else:
                self.warn(f"dropped a notification from rank {sender_rank}: {error}")
            return
        sender = self._infos.get(sender_rank)
        if sender is None:  # it left the group meanwhile (a dynamic group)
            self.warn(f"dropped a request from rank {sender_rank}: it is no longer a member")
            self._serve_riders(sender_rank, later)
            return
        # a request waited while nobody received (not a peer's liveness PING: it says
        # nothing of requests to come)
        if message_id and self.inbox.probing and kind != _PING:
            self.inbox.stay()
        with self._inflight_lock:
            self._inflight += 1
            if message_id:
                self._unstarted[sender_rank] = self._unstarted.get(sender_rank, 0) + 1
        self.stats.requests_served[sender_rank] += 1
        deferred = None
        if riders:  # (the list made for this message: kept, not copied)
            deferred = self.deferred_riders.add(sender, riders)
            # (no system call when the I/O thread looks by then anyway, as it usually does)
            self.inbox.wake_io_by(deferred.due, self.wake_inbox)
        if entry.inline:  # (never with riders to defer: only a thread's requests carry them)
            self._serve(kind, sender, message_id, parts, entry, deferred)
            return
        request = (kind, sender, message_id, parts, entry, deferred)
        # kept for the pool thread receiving it, unless older work waits in the pool's queue
        if self._pool.has_queued() or not self.inbox.claim(request):
            self._pool.submit(self._serve_on_pool, [request])
            self.inbox.hand_off()  # the I/O thread lets that thread take the next turn

    def _on_riding_notification(self, kind: MessageKind, sender_rank: int, body: Any,
                                sender: WorkerInfo | None = None) -> None:
        """A notification that rode on another message, served here and now.

        Every kind that may ride has an inline handler, and its payload was pickled
        with plain :func:`pickle.dumps` (``Riders.encode``): so it skips the request
        path's bookkeeping (unpickling context, counts of requests in flight, the
        reply-riding policy), which cost more than the handler itself. Traced
        workers take the request path, which records the notification. ``sender``:
        the sender as known when the message arrived (else looked up now).
        """
        entry = self._handlers.get(kind)
        sender = sender or self._infos.get(sender_rank)
        if entry is None or not entry.inline or sender is None or self.tracer.enabled:
            self._on_request(kind, sender_rank, 0, [body])
            return
        self.stats.requests_served[sender_rank] += 1
        try:
            entry.handler(IncomingRequest(kind, sender, 0, loads(body)))
        except Exception as exc:  # noqa: BLE001 - as any failed notification
            self._notification_failed(sender_rank, exc)

    def _notification_failed(self, sender_rank: int, error: BaseException) -> None:
        """Nobody waits for a notification's outcome: its failure is only logged."""
        self.warn(f"a notification from worker {sender_rank} failed: {error!r}")

    def _serve_on_pool(self, box: list[tuple[Any, ...]]) -> None:
        """A pool task: serve the request in ``box``, then receive the next ones here.

        A thread that served a request takes a serving turn on the inbox and
        runs the next request that arrives itself, without the hand-off from
        the I/O thread to the pool (see :meth:`InboxTurns.serving_turn`).
        (The box is emptied so that the task does not keep the request alive.)
        """
        next_request: tuple[Any, ...] | None = box.pop()
        while next_request is not None:
            self._serve(*next_request)
            next_request = None  # its frames (tensor data, mappings) are not kept meanwhile
            if self._pool.has_queued():
                return  # queued work first: it never waits behind a stream of requests
            self.riders.settle_owed()  # replies left to ride go before this thread waits
            next_request = self.inbox.serving_turn(self)  # type: ignore[arg-type]
            if next_request is not None:
                self._pool.started_outside()
