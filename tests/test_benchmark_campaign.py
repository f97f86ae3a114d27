"""benchmarks/campaign.py: the order of a campaign's runs and the README's table of ranges."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TAG = "2026-12-04-session36-compiled"  # a campaign whose records are committed


@pytest.fixture(scope="module")
def campaign() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import campaign as module
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_runs_interleave_the_modes_and_only_pinned_runs_pin(campaign: Any, tmp_path: Path) -> None:
    steps = campaign.plan(2, "tag", tmp_path)
    assert [(mode, run) for mode, run, _ in steps] == [
        ("pinned", 1), ("unpinned", 1), ("pinned", 2), ("unpinned", 2)
    ]
    for mode, run, argv in steps:
        assert argv[1].endswith("bench_rpc.py")
        assert ("--pin" in argv) == (mode == "pinned")
        assert argv[argv.index("--wait-idle") + 1] == "180"
        assert argv[argv.index("--rounds") + 1] == "3"
        assert argv[argv.index("--json") + 1] == str(tmp_path / f"{mode}-tag-run{run}.json")


def test_summary_of_recorded_runs_matches_the_readme(campaign: Any) -> None:
    pinned, unpinned = campaign.load(BENCHMARKS / "results", TAG, 3)
    assert campaign.middle_run(pinned) == 0  # rpc_sync ratios 8.03, 8.16, 7.85
    text = campaign.summarize(pinned, unpinned)
    assert "(the middle pinned run by rpc_sync: run 1 of 3)" in text
    rows = [  # metric | torch | actorrpc | better by | range, pinned | range, unpinned
        "rpc_sync latency, median (µs) | 251 | 31.2 | 8.03× | 7.85-8.16× | 10.51-14.99×",
        "rpc_sync ÷ pyzmq floor (107-160 µs) | 1.65× | 0.21× | – | 0.21-0.29× | 0.15-0.25×",
        "dist-autograd iteration, median (ms) | 0.99 | 0.56 | 1.78× | 1.66-2.24× | 1.86-2.48×",
        "idle worker RSS (MiB) | 253 | 229 | 1.10× | 1.10× | 1.10×",
    ]
    for row in rows:
        assert f"| {row} |" in text.splitlines()
    assert "p99" not in text
    assert "per round: 1.78 / 2.15 / 1.92×, 1.80 / 2.52 / 2.24×, 1.78 / 1.46 / 1.69×." in text
    assert "Python probe 11.1-19.2 µs; torch's pinned rpc_sync 243-251 µs" in text
    assert "the floor 107-152 µs pinned, 143-160 µs unpinned." in text


def test_a_missing_record_is_named(campaign: Any, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = campaign.main(["--tag", "none", "--out", str(tmp_path), "--summarize-only"])
    assert code == 2
    assert f"no campaign record {tmp_path / 'pinned-none-run1.json'}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one pinned and one unpinned"):
        campaign.summarize([], [])
