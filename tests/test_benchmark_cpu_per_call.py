"""benchmarks/cpu_per_call.py reports each thread's CPU and each side's busy-poll spins."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cluster import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_per_call.py"


def test_splits_each_sides_wall_time_into_spins_and_the_rest() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", "sync", "--n", "2000", "--port", str(free_port())],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    latency = re.search(r"^sync: [\d,]+ calls/s, median (\d+) us", done.stdout, re.MULTILINE)
    assert latency is not None, done.stdout
    spins = dict(
        (side, (float(spun), float(rest))) for side, spun, rest in re.findall(
            r"^  (caller|callee) busy polls spun +([\d.-]+) us/call, the rest +([\d.-]+) us/call$",
            done.stdout, re.MULTILINE,
        )
    )
    assert set(spins) == {"caller", "callee"}, done.stdout
    for spun, rest in spins.values():
        assert spun >= 0 and rest > 0, done.stdout  # (the rest holds each call's own work)
    # (2,000 calls: the busy caller's thread CPU grows by whole 10 ms clock ticks)
    assert re.search(r"^  caller MainThread:\d+ +[\d.]+ us/call", done.stdout, re.MULTILINE), (
        done.stdout
    )
