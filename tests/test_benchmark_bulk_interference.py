"""benchmarks/bulk_interference.py: small calls while another thread echoes large tensors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bulk_interference.py"
_ROW = re.compile(r"^(actorrpc(?: \(copies keep the GIL\))?) +(\d+) +(\d+)us +(\d+)us +(\d+)us"
                  r" +(\d+) +([\d.]+)ms$")


def test_reports_both_actorrpc_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backends", "actorrpc", "--keep-gil", "--seconds",
         "0.5", "--size-mb", "8", "--pin", "none"],
        capture_output=True, text=True, timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {m.group(1): m for m in map(_ROW.match, done.stdout.splitlines()) if m}
    assert set(rows) == {"actorrpc", "actorrpc (copies keep the GIL)"}, done.stdout
    for row in rows.values():
        calls, median, p99, largest, echoes = (int(row.group(i)) for i in range(2, 7))
        assert calls > 0 and echoes > 0, done.stdout  # both threads made progress
        assert median <= p99 <= largest, done.stdout


def test_refuses_a_size_of_zero() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--size-mb", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--seconds and --size-mb must be positive" in done.stderr
