"""benchmarks/async_batches.py times pipelined rpc_async batches between real workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "async_batches.py"
sys.path.insert(0, str(SCRIPT.parent))

import async_batches  # noqa: E402


def test_the_summary_reads_the_batches() -> None:
    line = async_batches.summarize([(0.004, 0.008), (0.005, 0.010), (0.006, 0.012)], 500)
    assert line.startswith("batch ms min/median/mean/p90/max 8.00 / 10.00 / 10.00 / 12.00")
    assert "send 10.00 us/call" in line and "50,000 calls/s" in line


def test_batches_run_between_two_workers() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--batches", "3", "--window", "50", "--no-pin"],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"send [\d.]+ us/call; [\d,]+ calls/s", done.stdout), done.stdout
