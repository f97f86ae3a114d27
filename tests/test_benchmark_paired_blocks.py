"""benchmarks/paired_blocks.py times alternating blocks of both backends' kept pairs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "paired_blocks.py"
sys.path.insert(0, str(SCRIPT.parent))

import paired_blocks  # noqa: E402


def _block(ours: float, torch: float) -> dict:
    return {"actorrpc": {"median_us": ours}, "torch": {"median_us": torch},
            "ratio": torch / ours}


def test_the_summary_is_the_block_medians_and_the_range_of_the_block_ratios() -> None:
    blocks = [_block(100.0, 300.0), _block(110.0, 190.0), _block(90.0, 270.0)]
    summary = paired_blocks.summarize("autograd", blocks)
    assert summary["actorrpc_median_us"] == 100.0 and summary["torch_median_us"] == 270.0
    assert (summary["ratio_min"], summary["ratio_median"], summary["ratio_max"]) == (
        pytest.approx(190 / 110), 3.0, 3.0)
    assert (summary["target"], summary["met"], summary["block_pairs"]) == (2.0, 2, 3)
    line = paired_blocks.summary_line("autograd", 1000, summary)
    assert line == (
        "autograd: 3 block pairs of 1000 calls; actorrpc 100.0 µs, torch 270.0 µs (medians "
        "of the block medians); ratio min 1.73 / median 3.00 / max 3.00; target ≥2×: 2 of 3 met")


def test_the_targets_are_the_issues() -> None:
    assert [paired_blocks.target_of(m) for m in ("rpc_sync", "remote", "echo_1mb", "autograd")
            ] == [2.5, 2.5, 1.5, 2.0]


def test_calls_per_block_and_refused_arguments() -> None:
    assert paired_blocks.parse_calls("autograd=500", quick=False)["autograd"] == 500
    assert paired_blocks.parse_calls("", quick=True) == paired_blocks.QUICK_BLOCK_CALLS
    for text in ("autograd", "autograd=0", "rpc_async=5", "autograd=x"):
        with pytest.raises(ValueError, match="METRIC=N"):
            paired_blocks.parse_calls(text, quick=False)
    for argv in (["--metrics", "rpc_async"], ["--blocks", "0"], ["--calls", "remote=-1"],
                 ["--metrics", ","]):
        with pytest.raises(SystemExit):
            paired_blocks.parse_args(argv)
    assert paired_blocks.parse_args(["--quick"]).blocks == 4


def test_the_backends_take_turns_in_alternating_order(tmp_path) -> None:
    record = tmp_path / "blocks.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--blocks", "3",
         "--metrics", "rpc_sync,autograd", "--json", str(record)],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    blocks = [re.fullmatch(r"(\w+) #(\d) \d\d:\d\d:\d\d actorrpc [\d.]+ torch [\d.]+ µs "
                           r"ratio [\d.]+", line) for line in lines if "#" in line]
    assert [(m.group(1), m.group(2)) for m in blocks if m] == [
        ("rpc_sync", "0"), ("rpc_sync", "1"), ("rpc_sync", "2"),
        ("autograd", "0"), ("autograd", "1"), ("autograd", "2")], done.stdout
    assert any(line.startswith("rpc_sync: 3 block pairs of 100 calls;") for line in lines)
    assert any(line.startswith("autograd: 3 block pairs of 20 calls;") for line in lines)
    metrics = json.loads(record.read_text())["metrics"]
    rows = metrics["autograd"]["blocks"]
    assert [row["first"] for row in rows] == ["actorrpc", "torch", "actorrpc"]
    for row in rows:  # every block of both timed its calls
        assert row["actorrpc"]["n"] == row["torch"]["n"] == 20
        assert row["ratio"] == row["torch"]["median_us"] / row["actorrpc"]["median_us"]
    assert metrics["rpc_sync"]["summary"]["block_pairs"] == 3
