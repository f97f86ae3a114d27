"""Unit tests of one worker's local backward pass (``AutogradEngine._local_pass``) over a
fake agent: what it sends, and in which order it does its own work."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actorrpc.agent import CallResult
from actorrpc.autograd._engine import AutogradEngine
from actorrpc.autograd._functions import make_recv_outputs, reach_from
from actorrpc.errors import DistAutogradError

pytestmark = [pytest.mark.timeout(30), pytest.mark.internals]  # (stand-ins, patched methods)


class _RecordingAgent:
    """What ``_local_pass`` uses of an agent: it records each message sent."""

    rank = 0
    name = "worker0"

    def __init__(self, events: list[tuple[str, Any]]) -> None:
        self.events = events
        self.members = self  # (``agent.members.resolve``)

    def resolve(self, rank: int) -> int:
        return rank

    def send_request(self, dest: int, kind: Any, payload: Any, description: str,
                     make: Any) -> CallResult[Any]:
        self.events.append(("send", payload[1]))  # the message id of the recv node
        return CallResult(description)


def _pass_over_local_and_received(events: list[tuple[str, Any]]) -> tuple[Any, ...]:
    """An engine, its context, and a loss over a local leaf and a tensor received from
    worker 1 (message 77)."""
    engine = AutogradEngine(_RecordingAgent(events))  # type: ignore[arg-type]
    ctx = engine.store.create()
    weight = torch.ones(4, requires_grad=True)
    (received,), _ = make_recv_outputs([torch.full((4,), 2.0)], ctx.context_id, 77, 1)
    loss = (weight * received).sum() + (weight * weight).sum()
    return engine, ctx, weight, loss


def test_messages_leave_before_this_worker_accumulates_its_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peers' passes start while this worker adds its own leaves' gradients (a clone
    of each on first accumulation, long for large parameters)."""
    events: list[tuple[str, Any]] = []
    engine, ctx, weight, loss = _pass_over_local_and_received(events)
    accumulate = ctx.accumulate
    monkeypatch.setattr(ctx, "accumulate", lambda leaf, grad, owned=False: (
        events.append(("accumulate", grad.tolist())), accumulate(leaf, grad, owned)))
    futures, owed = engine._local_pass(
        ctx, [loss.grad_fn], [loss], [torch.ones(())], reach_from([loss.grad_fn]),
        False, 5, None,
    )
    assert events == [("send", 77), ("accumulate", [4.0, 4.0, 4.0, 4.0])]
    assert len(futures) == 1 and owed == []
    assert ctx.gradients()[weight].tolist() == [4.0, 4.0, 4.0, 4.0]


def test_a_leaf_that_cannot_take_its_gradient_fails_the_pass_after_the_messages_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The messages already left: the error joins their futures, so the pass reports it
    once they were answered (as any part's first error), rather than leaving them unread."""
    events: list[tuple[str, Any]] = []
    engine, ctx, _, loss = _pass_over_local_and_received(events)

    def refuse(leaf: torch.Tensor, grad: torch.Tensor, owned: bool = False) -> None:
        raise DistAutogradError("no room for this gradient")

    monkeypatch.setattr(ctx, "accumulate", refuse)
    futures, _ = engine._local_pass(
        ctx, [loss.grad_fn], [loss], [torch.ones(())], reach_from([loss.grad_fn]),
        False, 5, None,
    )
    assert events == [("send", 77)]
    assert len(futures) == 2 and not futures[0].done()
    with pytest.raises(DistAutogradError, match="no room for this gradient"):
        futures[1].wait()
