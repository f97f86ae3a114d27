"""benchmarks/cold_costs.py runs every operation it lists, warm and cold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cold_costs  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_every_operation_runs_and_gets_both_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert cold_costs.main(["--n", "3", "--evict-mib", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = list(cold_costs.operations())
    assert len(lines) == 1 + len(names)
    for name, line in zip(names, lines[1:]):
        assert line.startswith(name)
        warm, cold, ratio = line[40:].split()
        assert float(warm) > 0 and float(cold) > 0 and ratio.endswith("×")
