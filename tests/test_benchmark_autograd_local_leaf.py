"""benchmarks/autograd_local_leaf.py times an autograd iteration with a large local leaf."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "autograd_local_leaf.py"
sys.path.insert(0, str(SCRIPT.parent))

import autograd_local_leaf  # noqa: E402


def test_the_summary_reads_the_times() -> None:
    line = autograd_local_leaf.summarize([0.003, 0.001, 0.002, 0.004])
    assert line == "median 2.500 ms, p90 4.000 ms over 4"


def test_iterations_run_between_two_workers_of_the_named_tree() -> None:
    tree = str(SCRIPT.parents[1])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--n", "10", "--size", "64", "--no-pin", "--timeout", "60",
         "--tree", tree],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.fullmatch(rf"{re.escape(tree)}: median [\d.]+ ms, p90 [\d.]+ ms over 10\n",
                        done.stdout), done.stdout


def test_a_tree_without_actorrpc_is_refused_rather_than_measuring_another(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--n", "10", "--size", "64", "--no-pin",
         "--timeout", "60", "--tree", str(tmp_path)],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode != 0
    assert f"not from {tmp_path}" in done.stderr, done.stderr
