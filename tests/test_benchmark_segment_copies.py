"""benchmarks/segment_copies.py: the 1 MB echo per session, per way of filling segments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from actorrpc.transport._segment_copy import streaming_copy_available

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "segment_copies.py"
_SESSION = re.compile(r"^ +1 +(\d+) ([ps])/([ps]) +(\d+) +(\d+)$")
_SUMMARY = re.compile(r"^  (adaptive|plain|streaming) +(\d+) / +(\d+)$")


@pytest.mark.skipif(not streaming_copy_available(), reason="the streaming copy is not built here")
def test_reports_each_policy_per_session_and_a_summary() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--sessions", "1", "--calls", "20",
         "--policies", "adaptive,plain,streaming", "--pin", "none"],
        capture_output=True, text=True, timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    sessions = [m for m in map(_SESSION.match, lines) if m]
    assert len(sessions) == 1, done.stdout
    assert all(int(sessions[0].group(i)) > 0 for i in (1, 4, 5)), done.stdout
    summary = {m.group(1): m for m in map(_SUMMARY.match, lines) if m}
    assert set(summary) == {"adaptive", "plain", "streaming"}, done.stdout
    for row in summary.values():  # one session: its median is the median and the worst
        assert row.group(2) == row.group(3), done.stdout


def test_refuses_an_unknown_policy() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--policies", "adaptive,fast"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown policies ['fast']" in done.stderr
