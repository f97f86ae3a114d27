"""The I/O thread's timed work, and how long it may wait before doing it again."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ._pool import STALL_SECONDS

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["run_timed_work", "seconds_to_timed_work"]

_MAX_POLL = 0.05
"""Most seconds the I/O thread waits without looking at its timed work."""


def run_timed_work(agent: Agent) -> None:
    """Held requests that are due, queued work, deadlines, liveness, pool growth,
    notifications that waited (to leave, or to be handled after a request that took
    long), the scheduling policy of libzmq's threads and of the I/O thread itself."""
    agent.held.release_if_due(time.monotonic())
    while not agent._soon.empty():
        fn, args = agent._soon.get_nowait()
        fn(*args)
    agent._deadlines.expire(agent._pending, agent._give_up)
    agent.liveness.check()
    agent._pool.maintain()
    agent.riders.flush()
    agent.serve_due_riders(time.monotonic())
    agent.batch_scheduling.check()
    agent.io_thread_scheduling.check()


def seconds_to_timed_work(agent: Agent) -> float:
    """How long the I/O thread may wait before :func:`run_timed_work` is due again."""
    limit = _MAX_POLL if agent._pool.idle_or_empty() else STALL_SECONDS
    now = time.monotonic()
    riders_due = agent.riders.seconds_to_due(now)
    if riders_due is not None:
        limit = min(limit, max(0.0, riders_due))
    deferred_due = agent.deferred_riders.seconds_to_due(now)
    if deferred_due is not None:
        limit = min(limit, max(0.0, deferred_due))
    held_due = agent.held.seconds_to_due(now)
    if held_due is not None:
        limit = min(limit, held_due)
    to_next = agent._deadlines.seconds_to_next(now)
    return limit if to_next is None else max(0.0, min(limit, to_next))
