"""Seeing what runs: per-peer statistics and an opt-in recorder of every RPC.

The agent's hot path only increments dict counters and, when tracing is on,
appends tuples; everything else (snapshots, Chrome trace events) is computed
when asked for.

Trace format: the Chrome trace-event JSON (``{"traceEvents": [...]}``) that
Perfetto and ``chrome://tracing`` open. Each worker is a process (``pid`` =
rank); a call is a complete event (``ph: "X"``) on the caller, from send to
reply, and one on the callee, from the start to the end of serving it; a flow
arrow (``ph: "s"`` / ``"f"``) joins the two.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._agent import Agent

STATUS_INTERVAL = 2.0
STATUS_REFRESH = 30.0
"""Unchanged statistics are published again after this many seconds (``actorrpc status``
shows their age): an idle worker does not write the store every :data:`STATUS_INTERVAL`."""
_log = logging.getLogger("actorrpc.agent")

__all__ = [
    "STATUS_INTERVAL", "STATUS_REFRESH", "StatusPublisher", "Tracer", "WorkerStats",
    "worker_snapshot",
]


class WorkerStats:
    """Counters per peer rank, kept by the agent."""

    def __init__(self) -> None:
        self.calls_sent: Counter[int] = Counter()
        self.requests_served: Counter[int] = Counter()
        self.bytes_out: Counter[int] = Counter()
        self.bytes_in: Counter[int] = Counter()

    def __getitem__(self, counter: str) -> int:
        """The total of one counter over all peers, e.g. ``stats["calls_sent"]``."""
        values: Counter[int] = getattr(self, counter)
        return sum(values.values())

    def totals(self) -> dict[str, int]:
        names = ("calls_sent", "requests_served", "bytes_out", "bytes_in")
        return {name: self[name] for name in names}

    def per_peer(self, names: dict[int, str], in_flight: Counter[int]) -> dict[str, Any]:
        ranks = set(self.calls_sent) | set(self.requests_served) | set(in_flight)
        return {
            names.get(rank, str(rank)): {
                "calls_sent": self.calls_sent[rank],
                "requests_served": self.requests_served[rank],
                "calls_in_flight": in_flight[rank],
                "bytes_out": self.bytes_out[rank],
                "bytes_in": self.bytes_in[rank],
            }
            for rank in sorted(ranks)
        }


class Tracer:
    """Records calls made and served by one worker while enabled."""

    def __init__(self, rank: int, name: str) -> None:
        self.rank = rank
        self.name = name
        self.enabled = False
        self._lock = threading.Lock()
        self._open: dict[int, tuple[float, int, str, int, int]] = {}
        self._events: list[dict[str, Any]] = []

    def start(self) -> None:
        with self._lock:
            self._open.clear()
            self._events.clear()
        self.enabled = True

    def call_sent(self, message_id: int, dest: int, description: str, nbytes: int) -> None:
        self._open[message_id] = (time.time(), dest, description, nbytes, threading.get_ident())

    def call_unsent(self, message_id: int) -> None:
        """A call recorded by :meth:`call_sent` could not be sent after all."""
        self._open.pop(message_id, None)

    def call_done(self, message_id: int, reply_bytes: int, outcome: str) -> None:
        started = self._open.pop(message_id, None)
        if started is None:
            return
        start, dest, description, nbytes, thread = started
        event = {
            "name": description or "call",
            "cat": "rpc",
            "ph": "X",
            "pid": self.rank,
            "tid": thread,
            "ts": start * 1e6,
            "dur": (time.time() - start) * 1e6,
            "args": {
                "caller": self.name,
                "callee_rank": dest,
                "request_bytes": nbytes,
                "reply_bytes": reply_bytes,
                "outcome": outcome,
                "message_id": message_id,
            },
        }
        self._record(event, self._flow("s", f"{self.rank}:{message_id}", thread, start))

    def served(
        self, sender: int, message_id: int, what: str, nbytes: int, start: float, outcome: str
    ) -> None:
        thread = threading.get_ident()
        event = {
            "name": what,
            "cat": "serve",
            "ph": "X",
            "pid": self.rank,
            "tid": thread,
            "ts": start * 1e6,
            "dur": (time.time() - start) * 1e6,
            "args": {
                "callee": self.name,
                "caller_rank": sender,
                "request_bytes": nbytes,
                "outcome": outcome,
                "message_id": message_id,
            },
        }
        flow = self._flow("f", f"{sender}:{message_id}", thread, start)
        flow["bp"] = "e"  # binds to the enclosing serve slice
        self._record(event, flow)

    def _flow(self, phase: str, flow_id: str, thread: int, start: float) -> dict[str, Any]:
        """A flow event: the arrow from a call's start on the caller to its serving."""
        return {"name": "rpc", "cat": "rpc", "ph": phase, "id": flow_id, "pid": self.rank,
                "tid": thread, "ts": start * 1e6}

    def _record(self, *events: dict[str, Any]) -> None:
        with self._lock:
            self._events += events

    def stop(self) -> list[dict[str, Any]]:
        """Stop recording and return this worker's events (with a process-name record)."""
        self.enabled = False
        with self._lock:
            events = list(self._events)
            self._events.clear()
            self._open.clear()
        meta = {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": self.name}}
        return [meta, *events]


def worker_snapshot(agent: Agent) -> dict[str, Any]:
    """One worker's statistics (see :func:`actorrpc.get_worker_stats`)."""
    in_flight: Counter[int] = Counter(p.dest.id for p in list(agent._pending.values()))
    names = {rank: info.name for rank, info in agent._infos.items()}
    stats: dict[str, Any] = {
        "worker": agent.name,
        "rank": agent.rank,
        "world_size": agent.world_size,
        **agent.stats.totals(),
        "peers": agent.stats.per_peer(names, in_flight),
        "requests_in_flight": agent._inflight,
        "pool_threads": agent._pool.size,
        "pool_busy": agent._pool.busy,
        "pool_queued": agent._pool.queued(),
        "dead_peers": sorted(names.get(r, str(r)) for r in agent.liveness.dead_peers),
        "shared_memory": {**agent.shared.pool.describe(), **agent.shared.mappings.describe()},
        # how segments were filled, per size class: plain copy or streaming stores
        "segment_copies": agent.shared.pool.filler.describe(),
        "inbox_turns": agent.inbox.turns,  # waits that received their own reply
        "inbox_stays": agent.inbox.stays,  # replies that waited for the I/O thread
        "serving_turns": agent.inbox.serving_turns,  # pool threads receiving the next request
        # turns' busy polls (ZmqRpcBackendOptions.busy_poll) that found a message / blocked
        "busy_poll_hits": agent._transport.busy_poll_hits,
        "busy_poll_misses": agent._transport.busy_poll_misses,
        "busy_poll_contended": agent._transport.busy_poll_contended,  # misses: core shared
        # polls allowed to begin with a spin (without yielding; immediate hits too), and
        # spins that found their core given to another thread
        "busy_poll_spins": agent._transport.spins,
        "busy_poll_spins_stopped": agent._transport.spins_stopped,
        "io_flow_polls": agent.inbox.io_flow_polls,  # I/O thread receives that polled first
        "quiet_waits": agent.quiet.long_waits,  # I/O thread waits of a quiet worker (long)
        # same-host rings: peers whose ring this worker reads, links sending through one,
        # messages received through rings
        "rings": {
            "in": agent._transport.rings_in(),
            "out": agent._transport.rings_out(),
            "messages_in": agent._transport.ring_messages_in,
        },
        # libzmq's I/O threads: "batch" / "default" policy, times batch was given up
        "batch_scheduling": agent.batch_scheduling.describe(),
        # the agent's own I/O thread: the same, guarded on its own
        "io_thread_scheduling": agent.io_thread_scheduling.describe(),
        # riders: queued, carried on messages, carriers sent alone, replies queued to ride
        "notifications": agent.riders.describe(),
    }
    for name, extension in agent.extensions.items():
        describe = getattr(extension, "debug_info", None)
        if callable(describe):
            stats[name] = describe()
    return stats


class StatusPublisher:
    """Publishes the worker's statistics to the rendezvous store for ``actorrpc status``.

    A daemon thread of its own (never the I/O thread: a store call may block
    while the store's host is gone) looks every :data:`STATUS_INTERVAL` seconds and
    writes ``actorrpc/status/<rank>`` when the statistics changed, or
    :data:`STATUS_REFRESH` seconds after it last wrote them.
    """

    def __init__(self, agent: Agent, publish: Any) -> None:
        self._agent = agent
        self._publish = publish
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"actorrpc-status-{agent.name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        last, last_at, looked_at = None, float("-inf"), float("-inf")
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                refresh = now - last_at >= STATUS_REFRESH
                # quiet since before the last look: nothing to tell (nor to compute,
                # ~0.3 ms of CPU on a cold core)
                if not refresh and 0 < self._agent.quiet.quiet_since() <= looked_at:
                    self._stop.wait(STATUS_INTERVAL)
                    continue
                looked_at = now
                snapshot = worker_snapshot(self._agent)
                if snapshot != last or refresh:
                    published = {**snapshot, "published_at": time.time()}
                    self._publish(self._agent.rank, self._agent.world_size,
                                  json.dumps(published))
                    last, last_at = snapshot, now
            except Exception as exc:  # noqa: BLE001 - status is best effort
                _log.debug("status publishing failed: %s", exc)
            self._stop.wait(STATUS_INTERVAL)

    def stop(self) -> None:
        self._stop.set()
