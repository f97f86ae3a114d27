"""benchmarks/idle_cpu.py measures the CPU an idle group uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "idle_cpu.py"
sys.path.insert(0, str(SCRIPT.parent))

import idle_cpu  # noqa: E402


def test_the_summary_reads_the_figure() -> None:
    assert idle_cpu.summarize("actorrpc", 4, 0.05) == (
        "actorrpc: 4 idle workers use 5.0% of one CPU (12.50 ms of CPU per second each)"
    )


def test_an_idle_group_is_measured() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--world", "2", "--seconds", "1", "--backends", "actorrpc",
         "--timeout", "60", "--threads"],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first, *threads = done.stdout.splitlines()
    assert re.fullmatch(r"actorrpc: 2 idle workers use [\d.]+% of one CPU "
                        r"\([\d.]+ ms of CPU per second each\)", first), done.stdout
    names = [line.split(":")[0].strip() for line in threads]
    # (the worker's own name folded, so both workers' threads add up)
    assert "actorrpc-io-worker<r>" in names, done.stdout
    assert all(re.fullmatch(r"  .+: [\d.]+ ms of CPU per second, scheduled [\d.]+ times a "
                            r"second", line) for line in threads), done.stdout


def test_a_group_whose_other_ranks_wait_in_shutdown_is_measured() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--world", "2", "--seconds", "1", "--backends", "actorrpc",
         "--timeout", "60", "--threads", "--in-shutdown"],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first, *threads = done.stdout.splitlines()
    assert first.startswith("actorrpc: 2 idle workers use "), done.stdout
    names = [line.split(":")[0].strip() for line in threads]
    assert "MainThread" in names and "actorrpc-io-worker<r>" in names, done.stdout
