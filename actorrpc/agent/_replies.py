"""The replies half of the agent's receiving side: settling pending calls.

:class:`ReplySettling` is a base class of
:class:`~actorrpc.agent._dispatch.MessageDispatcher` (and so of the agent); it owns
no state of its own (the attributes below are the agent's) and runs on whichever
thread receives (the I/O thread, or a thread in its turn on the inbox).

Invariants:

* A reply settles the pending call it answers once; a late reply is dropped. A
  late reply to a call this worker gave up on (timed out, peer found dead) is
  unpickled first, so that RRefs forked into it are rebuilt and released as usual
  (else their owners would keep them for good); a reply to a call never made is
  never unpickled.
* An EXCEPTION saying a request could not be unpickled names the RRef forks the
  receiver rebuilt before the failure; the caller undoes the forks it made for
  that request but those, as if it had never been sent (a rebuilt fork is the
  receiver's to release). A RESPONSE this worker cannot unpickle is reported back
  (REPLY_UNDECODED, naming the forks rebuilt) so that its sender undoes the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import DeserializationError, ProtocolError
from ..protocol import MessageKind
from ..serialization import PickleTarget, loads_from
from ._call_result import complete
from ._calls import IncomingRequest, PendingCall, RecentEntries
from ._remote_exception import rebuild_exception

if TYPE_CHECKING:
    from ._inbox import InboxTurns
    from ._observe import Tracer

__all__ = ["ReplySettling"]

# replies a user may wait for (control replies, such as remote()'s creation ack or a
# cleanup's, arrive after what is waited for and must not keep the I/O thread on the inbox)
_AWAITED_KINDS = frozenset({
    MessageKind.CALL, MessageKind.RREF_FETCH, MessageKind.REMOTE_CALL_FETCH,
    MessageKind.AUTOGRAD_BACKWARD,
})


class ReplySettling:
    """Replies (RESPONSE, EXCEPTION) to the pending calls they answer, late ones included."""

    inbox: InboxTurns
    tracer: Tracer
    _pending: dict[int, PendingCall]
    _late_replies: RecentEntries[int, tuple[int, PickleTarget | None]]
    _replies_with_forks: RecentEntries[tuple[int, int], PickleTarget]

    def _take_pending(self, message_id: int) -> PendingCall | None:
        raise NotImplementedError  # the agent's

    def notify_soon(self, rank: int, kind: MessageKind, payload: Any) -> None:
        raise NotImplementedError  # the agent's

    def warn(self, what: str) -> None:
        raise NotImplementedError  # the dispatcher's

    def _fail_pending(self, message_id: int, error: BaseException) -> None:
        pending = self._give_up(message_id)
        if pending is not None:
            complete(pending.future, error=error)

    def _give_up(self, message_id: int) -> PendingCall | None:
        """Take a pending call that fails before its reply came; remember whom it went to
        (the last few thousand), so that its reply, if it still comes, can be settled."""
        pending = self._take_pending(message_id)
        if pending is not None:
            self._late_replies.remember(message_id, (pending.dest.id, pending.undo))
        return pending

    def _settle_late_reply(
        self, kind: MessageKind, sender: int, message_id: int, parts: list[Any]
    ) -> None:
        """Unpickle and drop the late reply to a call given up on: RRefs in it are rebuilt
        (so their forks are accepted, then deleted) instead of leaking on their owners, and
        an EXCEPTION saying the request could not be unpickled undoes the request's forks."""
        late = self._late_replies.take(message_id)
        if late is None or late[0] != sender:
            return  # a reply to a call never made (or long forgotten): never unpickled
        undo = late[1]
        if kind == MessageKind.EXCEPTION and undo is None:
            return  # an error, and nothing to undo
        try:
            value = self._unpickle_reply(kind, sender, message_id, parts)
        except DeserializationError as exc:
            self.warn(f"dropped a late reply from rank {sender} that cannot be unpickled: {exc}")
            return
        if kind == MessageKind.EXCEPTION and undo is not None:
            self._error_of_reply(value, undo)

    def _unpickle_reply(
        self, kind: MessageKind, sender: int, message_id: int, parts: list[Any]
    ) -> Any:
        """A reply's value. A RESPONSE that cannot be unpickled raises, after telling its
        sender (REPLY_UNDECODED, naming the forks rebuilt) so that it undoes the others."""
        try:
            return loads_from(sender, parts[0], parts[1:])[0]
        except DeserializationError as exc:
            if kind == MessageKind.RESPONSE:
                self.notify_soon(sender, MessageKind.REPLY_UNDECODED, (message_id, exc.taken_over))
            raise

    def _handle_reply_undecoded(self, request: IncomingRequest) -> None:
        """A caller could not unpickle this worker's reply: undo the reply's other forks."""
        payload = request.payload
        if not (isinstance(payload, tuple) and len(payload) == 2
                and isinstance(payload[0], int) and isinstance(payload[1], tuple)):
            raise ProtocolError("REPLY_UNDECODED carries (message id, fork ids)")
        target = self._replies_with_forks.take((request.sender.id, payload[0]))
        if target is not None:
            target.abort(frozenset(payload[1]))

    @staticmethod
    def _error_of_reply(value: Any, undo: PickleTarget | None) -> BaseException:
        """The error an EXCEPTION reply's payload describes. When it says the request could
        not be unpickled, ``undo`` is run but for what the receiver took over."""
        if not (isinstance(value, tuple) and len(value) == 5):
            return ProtocolError(f"an error reply holds {type(value).__name__}, not 5 fields")
        undecoded = value[4]
        if undo is not None and isinstance(undecoded, tuple):
            undo.abort(frozenset(undecoded))
        return rebuild_exception(value[:4])

    def _on_response(
        self, kind: MessageKind, sender: int, message_id: int, parts: list[Any]
    ) -> None:
        pending = self._pending.get(message_id)
        if pending is None:  # a late reply to a call that timed out, or failed otherwise
            self._settle_late_reply(kind, sender, message_id, parts)
            return
        if pending.dest.id != sender:
            self.warn(f"dropped a reply from rank {sender} to a call made to {pending.dest!r}")
            return
        if self._take_pending(message_id) is None:  # it expired meanwhile (another thread)
            self._settle_late_reply(kind, sender, message_id, parts)
            return
        if self.inbox.probing and pending.kind in _AWAITED_KINDS:
            self.inbox.stay()  # someone may be waiting for it without taking turns
        if self.tracer.enabled:
            outcome = "error" if kind == MessageKind.EXCEPTION else "ok"
            self.tracer.call_done(message_id, sum(memoryview(p).nbytes for p in parts), outcome)
        try:
            value = self._unpickle_reply(kind, sender, message_id, parts)
        except DeserializationError as exc:
            error = DeserializationError(
                f"the reply to {pending.description or 'a call'} from {pending.dest!r}: {exc}"
            )
            if pending.on_undecodable is not None and kind == MessageKind.RESPONSE:
                complete(pending.future, pending.on_undecodable(error))
            else:
                complete(pending.future, error=error)
            return
        if kind == MessageKind.EXCEPTION:
            complete(pending.future, error=self._error_of_reply(value, pending.undo))
            return
        try:
            if pending.on_result is not None:
                value = pending.on_result(value)
        except BaseException as exc:  # noqa: BLE001
            complete(pending.future, error=exc)
            return
        complete(pending.future, value)
