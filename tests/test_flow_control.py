"""Flow control: a fast caller flooding a slow worker is held back, and nothing is lost."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests._cluster import run_script

pytestmark = pytest.mark.timeout(120)

_SCRIPT = textwrap.dedent(
    """
    import actorrpc as rpc
    from actorrpc.agent import current_agent

    LIMIT, CALLS = 50, 400

    def slow_echo(i):
        total = sum(range(20000))  # slower than the caller can send
        return i if total else -1

    group = rpc.local_workers(1, max_calls_in_flight_per_peer=LIMIT)
    agent = current_agent()
    futures, peaks = [], []
    for i in range(CALLS):
        futures.append(rpc.rpc_async("worker1", slow_echo, args=(i,)))
        peaks.append(sum(1 for p in list(agent._pending.values()) if p.credits is not None))
    results = [f.wait() for f in futures]
    print("peak:", max(peaks), "all:", results == list(range(CALLS)), flush=True)
    group.shutdown()
    """
)


def test_flooding_caller_waits_for_slots_and_loses_nothing(tmp_path: Path) -> None:
    output = run_script(tmp_path, _SCRIPT, timeout=110)
    # the caller was held at the limit (the worker is slower than the caller) and
    # every call arrived and was answered exactly once, in order
    assert "peak: 50 all: True" in output, output
