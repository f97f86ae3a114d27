"""benchmarks/fresh_pairs.py measures metrics in fresh worker pairs one after another."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fresh_pairs.py"
sys.path.insert(0, str(SCRIPT.parent))

import fresh_pairs  # noqa: E402


def _row(**medians: float) -> dict:
    return {"started": "00:00:00", "seed": None, "medians": medians, "errors": {}}


def test_a_slow_pair_is_named_by_its_place_in_the_sequence() -> None:
    rows = [{**_row(rpc_sync=20.0 + place), "place": place} for place in range(4)]
    rows.append({**_row(rpc_sync=40.0), "place": 9})
    assert fresh_pairs.summarize(rows, "rpc_sync", "torch") == (
        "torch rpc_sync: 5 pairs, 20.0 / 22.0 / 40.0 µs (min / median / max); "
        "slow (> 1.2x the median): 1: #9 40.0"
    )


def test_the_summary_names_the_pairs_slower_than_the_factor_times_the_median() -> None:
    rows = [_row(autograd=100.0), _row(autograd=119.0), _row(autograd=102.0),
            _row(autograd=130.0), _row(rpc_sync=20.0)]
    # the median of 100, 102, 119 and 130 is 110.5: none above 1.2 x 110.5 = 132.6
    assert fresh_pairs.summarize(rows, "autograd") == (
        "autograd: 4 pairs, 100.0 / 110.5 / 130.0 µs (min / median / max); "
        "slow (> 1.2x the median): 0: none"
    )
    rows.append(_row(autograd=200.0))  # the median 119: 200 is above 142.8
    assert fresh_pairs.summarize(rows, "autograd").endswith("slow (> 1.2x the median): 1: #5 200.0")
    assert fresh_pairs.summarize(rows, "remote") == "remote: no pair measured it"


def test_one_pair_is_one_round_of_a_campaign() -> None:
    cfg = fresh_pairs.pair_config(quick=False, pin=True)
    assert (cfg.sync_n, cfg.autograd_n, cfg.pin, cfg.init_rounds) == (1666, 1000, "split", 1)
    assert fresh_pairs.pair_config(quick=True, pin=False).autograd_n == 50


def test_unknown_metrics_and_seeds_are_refused() -> None:
    for argv in (["--metrics", "rpc_sink"], ["--hash-seed", "often"], ["--pairs", "0"],
                 ["--backends", "grpc"], ["--backends", ","]):
        with pytest.raises(SystemExit):
            fresh_pairs.parse_args(argv)


def test_each_place_runs_a_pair_of_each_backend_with_its_own_hash_seed(tmp_path) -> None:
    record = tmp_path / "pairs.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--pairs", "2", "--metrics", "rpc_sync", "--quick",
         "--backends", "actorrpc,torch", "--hash-seed", "random", "--json", str(record)],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("[bench")]
    pairs = [re.fullmatch(r"#(\d) (\w+) \d\d:\d\d:\d\d seed (\d+): rpc_sync [\d.]+", line)
             for line in lines[:4]]
    assert all(pairs), done.stdout
    assert [(m.group(1), m.group(2)) for m in pairs if m] == [
        ("0", "actorrpc"), ("0", "torch"), ("1", "actorrpc"), ("1", "torch")]
    assert lines[4].startswith("actorrpc rpc_sync: 2 pairs, "), done.stdout
    assert lines[5].startswith("torch rpc_sync: 2 pairs, "), done.stdout
    import json

    rows = json.loads(record.read_text())["rows"]
    assert [row["seed"] for row in rows] == [m.group(3) for m in pairs if m]
    assert len({row["seed"] for row in rows}) == 4
    assert all(row["medians"]["rpc_sync"] > 0 for row in rows)
