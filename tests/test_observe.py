"""Per-worker statistics, the RPC trace recorder and log records naming the worker."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import actorrpc as rpc

pytestmark = pytest.mark.timeout(60)


def _ping(x: int) -> int:
    return x


def _nested(x: int) -> int:
    return rpc.rpc_sync("worker2", _ping, args=(x,))


def test_worker_stats_count_calls_per_peer(cluster: list[str]) -> None:
    before = rpc.get_worker_stats("worker1")["peers"].get("worker0", {}).get("requests_served", 0)
    for i in range(5):
        assert rpc.rpc_sync("worker1", _ping, args=(i,)) == i
    stats = rpc.get_worker_stats("worker1")
    assert stats["worker"] == "worker1" and stats["world_size"] == 3
    # the 5 calls plus the stats call itself
    assert stats["peers"]["worker0"]["requests_served"] == before + 6
    assert stats["peers"]["worker0"]["bytes_in"] > 0
    assert "rref" in stats and "num_owner_rrefs" in stats["rref"]
    local = rpc.get_worker_stats()
    assert local["worker"] == "worker0"
    assert local["peers"]["worker1"]["calls_sent"] >= 6
    assert local["calls_sent"] >= local["peers"]["worker1"]["calls_sent"]


def test_trace_is_a_chrome_trace_of_who_called_whom(cluster: list[str], tmp_path: Path) -> None:
    rpc.start_tracing()
    rpc.rpc_sync("worker1", _nested, args=(7,))
    rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1000), 1))
    path = tmp_path / "trace.json"
    trace = rpc.stop_tracing(str(path))
    assert json.loads(path.read_text()) == trace
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"worker0", "worker1", "worker2"}
    calls = [e for e in events if e["ph"] == "X" and e["cat"] == "rpc"]
    served = [e for e in events if e["ph"] == "X" and e["cat"] == "serve"]
    short = lambda e: (e["pid"], e["name"].rsplit(".", 1)[-1])  # noqa: E731
    assert {short(e) for e in calls} >= {(0, "_nested"), (1, "_ping"), (0, "add")}
    assert {short(e) for e in served} >= {(1, "_nested"), (2, "_ping"), (2, "add")}
    for event in calls + served:
        assert event["dur"] >= 0 and event["ts"] > 0
    big = next(e for e in calls if e["name"].endswith("add"))
    assert big["args"]["request_bytes"] >= 4000 and big["args"]["reply_bytes"] >= 4000
    # every call made in the test has its flow arrow from caller to callee, and
    # no arrow has only one end (a call between two workers that stopped apart)
    starts = {e["id"] for e in events if e["ph"] == "s"}
    ends = {e["id"] for e in events if e["ph"] == "f"}
    ours = [e for e in calls if e["name"].rsplit(".", 1)[-1] in ("_nested", "_ping", "add")]
    assert len(ours) == 3 and {f"{e['pid']}:{e['args']['message_id']}" for e in ours} <= starts
    assert starts == ends
    # the calls that start and stop the recording are not recorded half
    assert not [e for e in calls if "_local_trace" in e["name"]]
    # the nested call happens inside the outer one, on the callee's timeline
    outer = next(e for e in served if e["name"] == "_nested")
    inner = next(e for e in calls if e["name"] == "_ping" and e["pid"] == 1)
    assert outer["ts"] <= inner["ts"] <= inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    # after stop, nothing more is recorded
    rpc.rpc_sync("worker1", _ping, args=(1,))
    assert rpc.stop_tracing()["traceEvents"] == [
        e for e in rpc.stop_tracing()["traceEvents"] if e["ph"] == "M"
    ]


def test_log_records_name_the_worker(cluster: list[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="actorrpc.agent"):
        logging.getLogger("actorrpc.agent").warning("probe %d", 1)
    record = next(r for r in caplog.records if "probe" in r.getMessage())
    assert record.worker == "worker0"  # type: ignore[attr-defined]
    assert record.getMessage().startswith("[worker0]")


def test_status_command_prints_every_worker(cluster: list[str]) -> None:
    import subprocess
    import sys
    import time

    from actorrpc.agent import current_agent
    from tests._cluster import REPO_ROOT

    port = current_agent()._rendezvous.init_method.rsplit(":", 1)[1]
    command = [sys.executable, "-m", "actorrpc.cli.main", "status", "--master-port", port]
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=30)
        if done.returncode == 0 and all(name in done.stdout for name in cluster):
            break
        assert time.monotonic() < deadline, done.stdout + done.stderr
    header, *rows = done.stdout.strip().splitlines()
    assert "served" in header and "owner rrefs" in header
    assert len(rows) == 3
    raw = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=30)
    assert '"worker": "worker1"' in raw.stdout


def test_flow_arrows_with_one_end_are_dropped() -> None:
    from actorrpc._inspection import _paired_flows

    def flow(phase: str, flow_id: str) -> dict[str, object]:
        return {"ph": phase, "id": flow_id}

    call = {"ph": "X", "name": "add"}
    events = [call, flow("s", "0:1"), flow("f", "0:1"), flow("s", "0:2"), flow("f", "1:3")]
    assert _paired_flows(events) == [call, flow("s", "0:1"), flow("f", "0:1")]


def test_status_is_published_when_it_changes_or_after_the_refresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    from types import SimpleNamespace

    from actorrpc.agent import _observe
    from actorrpc.agent._timed_work import QuietWatch

    from ._waiting import wait_until

    state = {"calls": 0, "looks": 0}
    published: list[dict[str, object]] = []

    real_snapshot = _observe.worker_snapshot

    def snapshot(agent: Any) -> dict[str, object]:
        if agent is not stub:  # (this process's own worker publishes too, when it looks)
            return real_snapshot(agent)  # type: ignore[no-any-return]
        state["looks"] += 1
        return {"calls_sent": state["calls"]}

    monkeypatch.setattr(_observe, "STATUS_INTERVAL", 0.002)
    monkeypatch.setattr(_observe, "worker_snapshot", snapshot)
    class CountingEvent(threading.Event):
        waits = 0

        def wait(self, timeout: float | None = None) -> bool:
            self.waits += 1
            return super().wait(timeout)

    agent = stub = SimpleNamespace(rank=0, world_size=1, name="worker0", quiet=QuietWatch())
    publisher = _observe.StatusPublisher(
        agent, lambda rank, world, payload: published.append(json.loads(payload)),
    )
    publisher._stop = stop = CountingEvent()
    publisher.start()
    try:
        assert wait_until(lambda: state["looks"] >= 20, 10)
        assert [p["calls_sent"] for p in published] == [0]  # unchanged: written once
        state["calls"] = 1
        assert wait_until(lambda: len(published) == 2, 10)
        assert published[1]["calls_sent"] == 1 and "published_at" in published[1]
        # quiet since before its last look (QuietWatch): it does not even look
        agent.quiet._since = 1.0
        waits = stop.waits
        assert wait_until(lambda: stop.waits >= waits + 2, 10)
        looks, state["calls"] = state["looks"], 2
        assert wait_until(lambda: stop.waits >= waits + 20, 10)
        assert state["looks"] == looks and len(published) == 2
        agent.quiet._since = 0.0  # not quiet any more
        assert wait_until(lambda: len(published) == 3, 10)
        assert published[2]["calls_sent"] == 2
        monkeypatch.setattr(_observe, "STATUS_REFRESH", 0.0)  # unchanged, but old
        assert wait_until(lambda: len(published) >= 5, 10)
    finally:
        publisher.stop()
