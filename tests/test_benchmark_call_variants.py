"""benchmarks/call_variants.py times each call variant on real workers and prints them all."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "call_variants.py"


def test_prints_a_latency_for_every_variant() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backends", "actorrpc", "--n", "5", "--rounds", "1",
         "--no-pin"],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^  (\S.*?)\s+([\d.]+)$", done.stdout, re.MULTILINE)
    assert [name for name, _ in rows] == [
        "noop(1)", "noop(4x4)", "noop(64x64, 64x64)", "ident(64x64)", "add(64x64, 64x64)",
        "add, requiring grad", "add, requiring grad, in a context",
        "noop(a, b), requiring grad, in a context",
    ], done.stdout
    assert all(float(us) > 0 for _, us in rows), done.stdout


def test_refuses_an_unknown_backend() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backends", "grpc"], capture_output=True, text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown backend 'grpc'" in done.stderr, done.stderr
