"""benchmarks/frame_counts.py counts the Python calls of real calls on both workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "frame_counts.py"


def test_counts_the_frames_of_a_call_on_both_sides() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", "remote", "--n", "20", "--top", "200"],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    per_call = [float(x) for x in re.findall(r"== \w+ \(rank \d\): ([\d.]+) Python calls", out)]
    assert len(per_call) == 2 and all(n > 10 for n in per_call), out
    # the frames are the ones a remote()+to_here() walks through, on the right side
    caller, callee = out.split("== callee")
    assert "_remote.py:remote" in caller and "_rref.py:RRef.to_here" in caller, out
    assert "_remote.py:_handle_remote_call" in callee, out
    assert "RingReader.ready" not in out  # the polling loop is left out
