"""benchmarks/campaign.py: the order of a campaign's runs and the table of ranges."""

from __future__ import annotations

import copy
import json
import subprocess
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
    steps = campaign.plan(2, "tag", tmp_path, blocks=0)
    assert [(step.mode, step.run) for step in steps] == [
        ("pinned", 1), ("unpinned", 1), ("pinned", 2), ("unpinned", 2)
    ]
    for mode, run, record, argv in steps:
        assert argv[1].endswith("bench_rpc.py")
        assert ("--pin" in argv) == (mode == "pinned")
        assert argv[argv.index("--wait-idle") + 1] == "180"
        assert argv[argv.index("--rounds") + 1] == "3"
        assert argv[argv.index("--json") + 1] == str(record)
        assert record == tmp_path / f"{mode}-tag-run{run}.json"


def test_each_run_is_followed_by_alternating_blocks_in_its_mode(campaign: Any,
                                                                tmp_path: Path) -> None:
    steps = campaign.plan(1, "tag", tmp_path)
    assert [(Path(s.argv[1]).name, s.mode) for s in steps] == [
        ("bench_rpc.py", "pinned"), ("paired_blocks.py", "pinned"),
        ("bench_rpc.py", "unpinned"), ("paired_blocks.py", "unpinned")]
    for step in steps[1::2]:
        assert ("--pin" in step.argv) == (step.mode == "pinned")
        assert step.argv[step.argv.index("--blocks") + 1] == "30"
        assert step.argv[step.argv.index("--metrics") + 1] == "rpc_sync,remote,echo_1mb,autograd"
        assert step.record == tmp_path / f"paired-{step.mode}-tag-run1.json"
        assert step.argv[step.argv.index("--json") + 1] == str(step.record)


def _paired_record(metric: str, ratios: list[float], target: float) -> dict[str, Any]:
    return {"metrics": {metric: {"blocks": [{"ratio": r} for r in ratios],
                                 "summary": {"target": target}}}}


def test_the_alternating_blocks_table_spans_every_runs_block_ratios(campaign: Any,
                                                                    tmp_path: Path) -> None:
    paired = {"pinned": [_paired_record("autograd", [2.5, 2.9], 2.0),
                         _paired_record("autograd", [1.9, 2.7], 2.0)],
              "unpinned": [_paired_record("autograd", [3.5, 3.1, 3.3], 2.0)]}
    lines = campaign.paired_lines(paired)
    assert lines[-1] == ("| autograd | 1.90-2.90× (median 2.60×) | 3.10-3.50× (median 3.30×) "
                         "| 3 of 4 / 3 of 3 |")
    assert campaign.paired_lines({"pinned": [], "unpinned": []}) == []
    pinned, unpinned = campaign.load(BENCHMARKS / "results", TAG, 1)
    assert campaign.summarize(pinned, unpinned, paired).splitlines()[-1] == lines[-1]
    (tmp_path / "paired-pinned-t-run2.json").write_text(json.dumps(paired["pinned"][0]))
    assert campaign.load_paired(tmp_path, "t", 2) == {"pinned": [paired["pinned"][0]],
                                                      "unpinned": []}


def test_summary_of_the_recorded_session36_runs(campaign: Any) -> None:
    pinned, unpinned = campaign.load(BENCHMARKS / "results", TAG, 3)
    assert campaign.middle_run(pinned) == 0  # rpc_sync ratios 8.03, 8.16, 7.85
    text = campaign.summarize(pinned, unpinned)
    assert "(the middle pinned run by rpc_sync: run 1 of 3)" in text
    rows = [  # metric | torch | actorrpc | better by | range, pinned | range, unpinned
        "rpc_sync latency, median (µs) | 251 | 31.2 | 8.03× | 7.85-8.16× | 10.51-14.99×",
        "rpc_sync ÷ pyzmq floor (107-160 µs) | 1.65× | 0.21× | – | 0.21-0.29× | 0.15-0.25×",
        "dist-autograd iteration, median (ms) | 0.99 | 0.56 | 1.78× | 1.66-2.24× | 1.86-2.48×",
        "idle worker RSS (MiB) | 253 | 229 | 1.10× | 1.10× | 1.10×",
        "rpc_async pipelined (calls/s) | 9,803 | 70,931 | 7.24× | 4.61-7.40× | 6.75-13.83×",
        "remote()+to_here(), median (µs) | 309 | 46.8 | 6.61× | 5.52-6.91× | 4.86-7.44×",
        "tensor echo 1 MB (GB/s) | 2.70 | 8.91 | 3.30× | 2.49-3.98× | 1.20-3.13×",
        "tensor echo 64 MB (GB/s) | 1.56 | 11.5 | 7.38× | 5.27-7.82× | 5.21-7.03×",
        "RNN tutorial training step, median (ms) | 3.51 | 2.94 | 1.19× | 1.19-1.89× | 1.24-1.51×",
        "init_rpc, max of 2 workers (s) | 0.06 | 0.01 | 5.43× | 4.92-6.37× | 4.88-7.22×",
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


def _with_sync_ratio(record: dict[str, Any], ratio: float) -> dict[str, Any]:
    changed = copy.deepcopy(record)
    for row in changed["table"]:
        if row["metric"] == "rpc_sync latency, median (µs)":
            row["ratio"] = ratio
    return changed


def test_the_middle_run_is_the_median_by_rpc_sync_ratio(campaign: Any) -> None:
    record, _ = campaign.load(BENCHMARKS / "results", TAG, 1)
    records = [_with_sync_ratio(record[0], r) for r in (7.85, 8.16, 8.03)]
    assert campaign.middle_run(records) == 2
    records = [_with_sync_ratio(record[0], r) for r in (9.0, 6.0, 8.0, 7.0)]
    assert campaign.middle_run(records) == 3  # the lower of the two middle ones (7 and 8)
    text = campaign.summarize(records, records)
    assert "(the middle pinned run by rpc_sync: run 4 of 4)" in text
    row = "| rpc_sync latency, median (µs) | 251 | 31.2 | 7.00× | 6.00-9.00× | 6.00-9.00× |"
    assert row in text.splitlines()


def test_records_of_another_host_or_without_figures_are_named(campaign: Any, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    pinned, unpinned = campaign.load(BENCHMARKS / "results", TAG, 1)
    other = copy.deepcopy(unpinned[0])
    other["machine"]["cpu_model"] = "Intel Xeon"
    assert "WARNING: the records differ in host or build" in campaign.summarize(pinned, [other])
    broken = copy.deepcopy(pinned[0])
    del broken["floor"]["rpc_sync"]  # a --no-floor run
    for mode, record in (("pinned", broken), ("unpinned", unpinned[0])):
        (tmp_path / f"{mode}-t-run1.json").write_text(json.dumps(record))
    code = campaign.main(["--tag", "t", "--runs", "1", "--out", str(tmp_path), "--summarize-only"])
    assert code == 2
    assert "lacks a figure the table needs" in capsys.readouterr().err


def test_existing_records_are_not_overwritten_and_a_failed_run_stops(
    campaign: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[list[str]] = []

    def failing_run(command: list[str], **_: Any) -> subprocess.CompletedProcess[bytes]:
        ran.append(command)
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.setattr(campaign.subprocess, "run", failing_run)
    (tmp_path / "unpinned-t-run2.json").write_text("{}")
    assert campaign.main(["--tag", "t", "--runs", "2", "--out", str(tmp_path)]) == 2
    assert "records of tag 't' exist" in capsys.readouterr().err and not ran
    assert campaign.main(["--tag", "t", "--runs", "2", "--out", str(tmp_path), "--force"]) == 1
    assert len(ran) == 1 and "--pin" in ran[0]  # the first run failed: nothing after it
    assert "pinned run 1 failed (bench_rpc.py, exit 3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        campaign.main(["--tag", "t", "--runs", "0"])
