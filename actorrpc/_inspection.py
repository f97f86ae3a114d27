"""Statistics and tracing across the group (``get_worker_stats``, ``*_tracing``)."""

from __future__ import annotations

import json
from typing import Any

from .agent import current_agent

__all__ = ["get_worker_stats", "start_tracing", "stop_tracing"]


def _local_stats() -> dict[str, Any]:
    return current_agent().snapshot()


def _local_trace_start() -> None:
    current_agent().tracer.start()


def _local_trace_stop() -> list[dict[str, Any]]:
    return current_agent().tracer.stop()


def _paired_flows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop flow arrows with one end: workers stop one after another, so a call
    between two of them may be recorded by its caller and not its callee, or
    the other way round."""
    phases: dict[str, set[str]] = {}
    for event in events:
        if event["ph"] in ("s", "f"):
            phases.setdefault(event["id"], set()).add(event["ph"])
    return [e for e in events if e["ph"] not in ("s", "f") or len(phases[e["id"]]) == 2]


def get_worker_stats(worker: Any = None) -> dict[str, Any]:
    """Statistics of this worker, or of ``worker`` (a name, rank or WorkerInfo).

    Calls sent and served, calls in flight and bytes in and out per peer; pool
    threads, busy threads and queued requests; dead peers; the RRef tables
    (owner RRefs, forks, pending users and children) and distributed autograd
    contexts.

    Example::

        >>> # on worker0
        >>> rpc.get_worker_stats("worker1")["peers"]["worker0"]["requests_served"]
        12
    """
    agent = current_agent()
    if worker is None:
        return agent.snapshot()
    return agent.call(agent.resolve(worker), _local_stats, (), {}).wait()  # type: ignore[no-any-return]


def start_tracing() -> None:
    """Start recording every RPC on every worker (caller, callee, function, sizes, times).

    Example::

        >>> rpc.start_tracing()
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        >>> trace = rpc.stop_tracing("trace.json")   # open in Perfetto / chrome://tracing
    """
    agent = current_agent()
    # The peers start first and this worker last, so the calls that start them
    # are not recorded here half (a sent call whose serving the peer missed).
    peers = [info for info in agent.worker_infos() if info.id != agent.rank]
    for future in [agent.call(info, _local_trace_start, (), {}) for info in peers]:
        future.wait()
    agent.tracer.start()


def stop_tracing(path: str | None = None) -> dict[str, Any]:
    """Stop recording; gather every worker's events into one Chrome trace (written to ``path``).

    Returns the trace: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Example::

        >>> # on worker0, after rpc.start_tracing() and some calls to worker1
        >>> trace = rpc.stop_tracing("trace.json")   # open in Perfetto / chrome://tracing
        >>> sorted(trace)
        ['displayTimeUnit', 'traceEvents']
    """
    agent = current_agent()
    # This worker stops first, so the calls that stop the peers (whose serving
    # they no longer record) are not recorded here either.
    events = agent.tracer.stop()
    peers = [info for info in agent.worker_infos() if info.id != agent.rank]
    for future in [agent.call(info, _local_trace_stop, (), {}) for info in peers]:
        events.extend(future.wait())
    events = _paired_flows(events)
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(trace, handle)
    return trace
