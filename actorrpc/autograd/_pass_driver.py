"""The rest of one distributed backward pass on one worker, after its first local pass.

A local pass sends ``AUTOGRAD_BACKWARD`` for every recv node it reaches, except
for recv nodes whose sender is the worker that asked this worker to run the pass
(it is waiting on the reply anyway): those gradients are *owed* to it and travel
back inside the reply, as ``[(message_id, grads), ...]``. So the common
round trip caller -> callee -> caller costs one message pair instead of two.

A :class:`PassDriver` waits for the replies to the messages its passes sent; a
reply may hand back gradients owed to this worker, for which it runs more local
passes through the ``submit`` it was given (a pass computes, and replies arrive on
whichever thread receives: on a callee the agent's pool, on a backward's initiator
its own thread, ``AutogradEngine._drive_from_here``), which may send more messages.
``result`` completes once nothing is outstanding: with the gradients this worker
owes its own requester, or with the first error seen (after every outstanding part
finished, as before).

Invariant: ``_outstanding`` counts the passes to run plus the replies to wait
for; each is added before the unit that creates it is finished, so the count
reaches zero exactly once, when the whole pass is done on this worker.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..agent import Agent, CallResult, complete
from ..errors import DistAutogradError

__all__ = ["Owed", "PassDriver", "checked_reply", "kept_positions"]

Owed = list[tuple[int, list[Any]]]  # (message id of one of the requester's send functions, grads)
_GRADS = operator.itemgetter(1)  # (message id, grads) -> grads
# (message id, grads, where each tensor among them may be kept: ``kept_positions``)
ContinueAt = Callable[[int, list[Any], dict[int, int]], tuple[list[CallResult[Any]], Owed]]


class PassDriver:
    """Drives one worker's share of a backward pass (see the module docstring)."""

    def __init__(
        self, continue_at: ContinueAt, submit: Callable[..., None], agent: Agent | None = None
    ) -> None:
        # a thread waiting on it takes its turn on the inbox; no torch future (each is
        # several torch calls, costly between messages), as for the replies it waits on
        self.result: CallResult[Owed] = CallResult("distributed backward", agent)
        self._continue_at = continue_at
        self._submit = submit
        self._owed: Owed = []
        self._error: BaseException | None = None
        self._outstanding = 1  # the pass that created this driver, finished by its add()
        self._lock = threading.Lock()

    def add(self, futures: Sequence[CallResult[Any]], owed: Owed) -> None:
        """A local pass finished: wait for the messages it sent; keep what it owes."""
        with self._lock:
            self._owed.extend(owed)
            self._outstanding += len(futures)
        for future in futures:
            future.add_done_callback(self._on_reply)
        self._finish_one()

    def fail(self, error: BaseException) -> None:
        """A local pass failed before sending anything."""
        self._record(error)
        self._finish_one()

    def hand_back(self, handed_back: Owed) -> None:
        """Gradients handed back to this worker: a local pass for each, through ``submit``."""
        if not handed_back:
            return
        with self._lock:
            self._outstanding += len(handed_back)
        kept = kept_positions(list(map(_GRADS, handed_back)))
        for message_id, grads in handed_back:
            self._submit(self._run, message_id, grads, kept)

    def _on_reply(self, future: CallResult[Any]) -> None:
        handed_back: Owed = []
        try:
            handed_back = checked_reply(future.wait())
        except BaseException as exc:  # noqa: BLE001 - reported once everything finished
            self._record(exc)
        self.hand_back(handed_back)
        self._finish_one()

    def _run(self, message_id: int, grads: list[Any], kept: dict[int, int]) -> None:
        try:
            futures, owed = self._continue_at(message_id, grads, kept)
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return
        self.add(futures, owed)

    def _record(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _finish_one(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._outstanding:
                return
            error, owed = self._error, self._owed
        if error is not None:
            complete(self.result, error=error)
        else:
            complete(self.result, owed)


def kept_positions(grad_lists: Iterable[list[Any]]) -> dict[int, int]:
    """Where a context may keep each tensor of one unpickled message rather than a copy:
    ``id(tensor) -> position`` of its last appearance in its list, for the tensors that
    appear in one of ``grad_lists`` only.

    Pickle gives a tensor that was sent twice as one object (the gradients of an
    ``add``'s two inputs are one tensor), and nothing else refers to it: the leaves
    before its last appearance take copies, and the last may keep it, as nothing reads
    it afterwards. A tensor that appears in two lists (two send functions, passes that
    may run at once) is always copied.
    """
    positions: dict[int, int] = {}
    list_of: dict[int, int] = {}
    shared: list[int] = []
    for number, grads in enumerate(grad_lists):  # (loops: a generator is a frame per item)
        for position, grad in enumerate(grads):
            if grad is not None:
                key = id(grad)
                if list_of.setdefault(key, number) != number:
                    shared.append(key)
                positions[key] = position
    for key in shared:
        positions.pop(key, None)
    return positions


def checked_reply(reply: Any) -> Owed:
    """The gradients a reply hands back (``None``: none), or :class:`DistAutogradError`."""
    if reply is None:
        return []
    if isinstance(reply, list):
        for item in reply:  # (a loop: a generator is a Python frame per item)
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)
                    and isinstance(item[1], list)):
                break
        else:
            return reply
    raise DistAutogradError(f"malformed reply to a distributed backward message: {reply!r:.80}")
