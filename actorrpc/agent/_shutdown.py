"""Graceful shutdown: three store barriers that make sure no work is left anywhere.

1. ``arrived``: every worker's program has called ``shutdown``.
2. (shutdown hooks run: RRef users are deleted and owners drain.)
   ``idle``: every worker was idle (no pending call, no request in flight)
   when it arrived. Work a peer starts later is caused by a peer that has not
   arrived yet, and that peer waits for it before arriving.
3. ``done``: everyone is past ``idle``; rank 0, which hosts the store, waits for
   this before closing it.

A rank that never arrives is reported by name once the deadline passes; a rank
known dead is reported and not waited for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..errors import ProtocolError
from ..protocol import MessageKind
from ._calls import IncomingRequest
from ._dynamic_group import DynamicRendezvous, leave_dynamic_group, send_left
from ._rendezvous import Rendezvous

if TYPE_CHECKING:
    from ._agent import Agent

_log = logging.getLogger("actorrpc.agent")

__all__ = ["BarrierCompletions", "graceful_barriers", "leave", "stop_threads", "wait_until"]


def graceful_barriers(agent: Agent, deadline: float, budget: float, problems: list[str]) -> None:
    """Run the barriers; append what went wrong to ``problems``.

    A peer found dead is reported only if it never arrived at a barrier: one
    that left after finishing its shutdown is not dead but done.
    """
    dead_missing: set[int] = set()
    started = time.monotonic()  # a peer counts as dead if a check since then failed

    def dead(missing: list[int]) -> list[int]:
        return agent.liveness.dead_among(missing, started)

    completions = BarrierCompletions(agent)
    try:
        for tag in ("arrived", "idle", "done"):
            if tag == "idle":
                _run_shutdown_hooks(agent, deadline, problems)
            if tag != "arrived":
                _wait_idle(agent, deadline, problems)
            assert isinstance(agent._rendezvous, Rendezvous), "static groups only"
            name = f"shutdown/{tag}"
            barrier = agent._rendezvous.barrier(name)
            # Registered before arriving: the completion, sent once everyone arrived,
            # always finds it. Not at ``done``: a rank past it closes its sockets at once
            # (linger 0), which may drop its notification; rank 0 waits there only for the
            # others' last idle check, polling as before.
            woken = completions.expect(name) if tag != "done" else None
            if barrier.arrive() and woken is not None:  # the last to arrive wakes the others
                completions.announce(name, list(agent._infos))
            if tag == "done" and agent.rank != 0:
                return
            missing = barrier.wait(deadline, dead, woken)
            found_dead = set(dead(missing))  # the verdict the barrier waited on, not an older one
            dead_missing.update(found_dead)
            alive = [r for r in missing if r not in found_dead]
            if alive:
                names = [agent._infos[r].name for r in alive if r in agent._infos]
                problems.append(
                    f"workers {names} (ranks {alive}) did not reach shutdown ({tag}) "
                    f"within {budget:.1f}s"
                )
                return
    finally:
        for rank in sorted(dead_missing):
            problems.append(f"dead peer: {agent.liveness.dead_peers.get(rank, rank)}")


class BarrierCompletions:
    """The shutdown barriers' ``BARRIER`` notifications: the last rank to arrive at a
    barrier (``arrived``, ``idle``) sends ``(name, rank)`` to every other rank, whose wait
    then ends at once instead of at its next poll of the store (the polls, which also probe the
    missing ranks' liveness, then come at most once a second: a worker waiting in
    ``shutdown`` while the others work costs them and itself almost nothing).

    Invariant: a rank registers its event for a barrier before it arrives there, so
    the notification, which is sent only once everyone arrived, finds it.
    """

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._events: dict[str, threading.Event] = {}
        agent.register_handler(MessageKind.BARRIER, self._on_completion, inline=True)

    def expect(self, name: str) -> threading.Event:
        """The event set when barrier ``name`` is reported complete."""
        return self._events.setdefault(name, threading.Event())

    def announce(self, name: str, ranks: Iterable[int]) -> None:
        """Tell ``ranks`` (but this one and the dead) that barrier ``name`` is complete."""
        agent = self._agent
        dead = agent.liveness.dead_peers
        for rank in ranks:
            if rank == agent.rank or rank in dead:
                continue
            try:
                agent.send_notification(rank, MessageKind.BARRIER, (name, agent.rank))
            except Exception as exc:  # noqa: BLE001 - its poll of the store finds it anyway
                _log.debug("%s: could not tell rank %d that %s is complete: %s",
                           agent.name, rank, name, exc)

    def _on_completion(self, request: IncomingRequest) -> None:
        payload = request.payload
        name = payload[0] if type(payload) is tuple and payload else None
        event = self._events.get(name) if type(name) is str else None
        if event is None:
            raise ProtocolError(f"BARRIER notification for no barrier this worker waits at: "
                                f"{payload!r}")
        event.set()


def leave(
    agent: Agent, rendezvous: DynamicRendezvous, graceful: bool, deadline: float,
    problems: list[str],
) -> None:
    """Leave a dynamic group; the others go on (see ``_dynamic_group``)."""
    if graceful:
        _run_shutdown_hooks(agent, deadline, problems)
        problems.extend(leave_dynamic_group(agent, rendezvous, deadline))
        _wait_idle(agent, deadline, problems)
    else:
        leave_dynamic_group(agent, rendezvous, min(deadline, time.monotonic() + 1.0))
    stop_threads(agent)
    send_left(agent)


def _wait_idle(agent: Agent, deadline: float, problems: list[str]) -> None:
    """Wait for ``agent.idle()``; report what was still unfinished at the deadline."""
    if agent.wait_idle(deadline):
        return
    unfinished = list(agent.pending_destinations())
    if agent._inflight:
        serving = agent.requests_being_served()
        names = ": " + "; ".join(serving[:8]) if serving else ""
        more = f" and {len(serving) - 8} more" if len(serving) > 8 else ""
        unfinished.append(f"{agent._inflight} requests being served{names}{more}")
    queued = agent.riders.describe()["queued"]
    if queued:
        unfinished.append(f"{queued} notifications or replies queued")
    problems.append("work still pending: " + ", ".join(unfinished))


def _run_shutdown_hooks(agent: Agent, deadline: float, problems: list[str]) -> None:
    for hook in agent._shutdown_hooks:
        try:
            hook(deadline)
        except Exception as exc:  # noqa: BLE001 - report every problem
            problems.append(str(exc))


def wait_until(condition: Callable[[], bool], deadline: float) -> bool:
    """Poll ``condition`` (1 ms growing to 20 ms) until it holds or ``deadline`` passes."""
    interval = 0.001
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
        interval = min(interval * 2, 0.02)
    return True


def stop_threads(agent: Agent) -> None:
    """Stop the agent's threads; what is queued for the I/O thread still goes out."""
    agent._status.stop()
    agent._running = False
    agent._transport.wake()
    agent.inbox.resume()
    if agent._io_thread is not None and agent._io_thread is not threading.current_thread():
        agent._io_thread.join(5.0)
    # no thread may receive on the inbox any more (a waiter's turn ends within its poll)
    if not agent.inbox.closed and not agent.inbox.held_by_current_thread():
        if not agent.inbox.lock.acquire(timeout=5.0):
            _log.warning("%s: a thread still receives on the inbox while stopping", agent.name)
        agent.inbox.closed = True  # the lock stays taken: nobody receives again
    while not agent._soon.empty():  # queued I/O work (deletes, releases) still goes out
        fn, args = agent._soon.get_nowait()
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - best effort while closing
            _log.debug("%s: queued work failed while closing", agent.name, exc_info=True)
    agent.riders.flush(everything=True)
    agent._pool.close()
    agent.riders.flush(everything=True)  # replies queued by requests that ended meanwhile
