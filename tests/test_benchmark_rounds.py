"""bench_rpc.py's interleaved rounds: each figure comes from its metric's median round."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_rpc  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _round(sync_us: float, calls_per_s: float, init_s: float, rss: float) -> dict[str, Any]:
    return {
        "sessions": 1,
        "metrics": {
            "rpc_sync": {"median_us": sync_us, "p99_us": 2 * sync_us},
            "rpc_async": {"calls_per_s": calls_per_s},
            "echo_64mb": {"skipped": "--quick"},
            "autograd": {"error": "timeout"} if sync_us > 300 else {"median_us": sync_us * 5},
            "init": {"init_s_max": init_s, "rss_mb": rss},
        },
    }


def test_each_metric_comes_from_its_own_median_round() -> None:
    rounds = [_round(350.0, 9000.0, 0.03, 230.0), _round(100.0, 5000.0, 0.01, 220.0),
              _round(200.0, 7000.0, 0.02, 225.0)]
    merged = bench_rpc.merge_backend_rounds(rounds)
    metrics = merged["metrics"]
    # the median round of each metric, with all its fields (p99 from the same round)
    assert metrics["rpc_sync"]["median_us"] == 200.0 and metrics["rpc_sync"]["p99_us"] == 400.0
    assert metrics["rpc_sync"]["rounds"] == [350.0, 100.0, 200.0]
    assert metrics["rpc_async"]["calls_per_s"] == 7000.0
    assert metrics["init"] == {"init_s_max": 0.02, "rss_mb": 225.0, "rounds": [0.03, 0.01, 0.02]}
    # rounds that failed do not count; a metric no round measured keeps its marker
    assert metrics["autograd"]["median_us"] == 500.0  # lower middle of the two measured
    assert metrics["echo_64mb"]["skipped"] == "--quick"
    assert "remote" not in metrics and merged["sessions"] == 3 and merged["rounds"] == rounds


def test_the_floor_merges_the_same_way() -> None:
    rounds = [{"rpc_sync": {"median_us": us}, "rpc_async": {"msgs_per_s": 1e4 * i}}
              for i, us in enumerate((90.0, 130.0, 110.0, 70.0), start=1)]
    floor = bench_rpc.merge_floor(rounds)
    assert floor["rpc_sync"]["median_us"] == 90.0  # lower middle of four
    assert floor["rpc_async"]["msgs_per_s"] == 2e4 and floor["rounds"] == rounds
    assert "echo_1mb" not in floor


def test_each_round_gives_its_own_ratio() -> None:
    from _report import round_ratios

    torch_rounds = [_round(400.0, 4000.0, 0.08, 250.0), _round(200.0, 5000.0, 0.06, 250.0)]
    actor_rounds = [_round(200.0, 12000.0, 0.01, 225.0), _round(400.0, 5000.0, 0.02, 225.0)]
    results = {"torch": bench_rpc.merge_backend_rounds(torch_rounds),
               "actorrpc": bench_rpc.merge_backend_rounds(actor_rounds)}
    ratios = round_ratios(results)
    # latency: torch ÷ actorrpc; throughput: actorrpc ÷ torch (> 1: actorrpc better)
    assert ratios["rpc_sync latency, median (µs)"] == [2.0, 0.5]
    assert ratios["rpc_async pipelined (calls/s)"] == [3.0, 1.0]
    assert ratios["init_rpc, max of 2 workers (s)"] == pytest.approx([8.0, 3.0])
    # a round where either side has no figure has no ratio
    assert ratios["dist-autograd iteration, median (ms)"] == [None, None]
    assert ratios["remote()+to_here(), median (µs)"] == [None, None]
    # without interleaved rounds there is nothing to report
    assert round_ratios({"torch": torch_rounds[0], "actorrpc": actor_rounds[0]}) == {}


class _FakeHost:
    """A load average read from a list, and a clock that only pauses move."""

    def __init__(self, loads: list[float]) -> None:
        self.loads = loads
        self.now = 100.0
        self.pauses: list[float] = []

    def loadavg(self) -> tuple[float, float, float]:
        load = self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]
        return (load, load, load)

    def clock(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_a_run_waits_for_an_idle_host_within_its_limit() -> None:
    from _common import wait_until_idle

    host = _FakeHost([2.1, 1.2, 0.7, 0.45])
    waited, reached = wait_until_idle(60.0, loadavg=host.loadavg, clock=host.clock,
                                      pause=host.pause, poll_s=5.0)
    assert (waited, reached) == (15.0, True) and host.pauses == [5.0, 5.0, 5.0]

    busy = _FakeHost([1.9])  # never idle: gives up at the limit, its last pause cut short
    waited, reached = wait_until_idle(12.0, loadavg=busy.loadavg, clock=busy.clock,
                                      pause=busy.pause, poll_s=5.0)
    assert (waited, reached) == (12.0, False) and busy.pauses == [5.0, 5.0, 2.0]

    idle = _FakeHost([0.1])  # already idle: no pause at all
    assert wait_until_idle(60.0, loadavg=idle.loadavg, clock=idle.clock,
                           pause=idle.pause) == (0.0, True) and idle.pauses == []

    # the threshold is the caller's, and a load exactly at it is not idle
    edge = _FakeHost([1.0, 0.99])
    waited, reached = wait_until_idle(60.0, threshold=1.0, loadavg=edge.loadavg,
                                      clock=edge.clock, pause=edge.pause, poll_s=5.0)
    assert (waited, reached) == (5.0, True) and edge.pauses == [5.0]


def test_wait_idle_is_an_option_of_the_benchmark_and_recorded() -> None:
    assert bench_rpc.parse_args(["--wait-idle", "90"]).wait_idle == 90.0
    assert bench_rpc.parse_args([]).wait_idle == 0.0
    asked: list[float] = []

    def wait(limit_s: float) -> tuple[float, bool]:
        asked.append(limit_s)
        return 42.04, limit_s > 60

    assert bench_rpc.wait_for_idle_host(0.0, wait) == {} and asked == []  # no wait asked
    assert bench_rpc.wait_for_idle_host(90.0, wait) == {"idle_wait_s": 42.0,
                                                         "idle_reached": True}
    assert bench_rpc.wait_for_idle_host(30.0, wait) == {"idle_wait_s": 42.0,
                                                         "idle_reached": False}
    assert asked == [90.0, 30.0]
    with pytest.raises(SystemExit, match="--wait-idle"):
        bench_rpc.main(["--wait-idle", "-1"])


def test_a_warm_up_runs_its_count_and_its_seconds_whichever_ends_later() -> None:
    """``time_calls`` warms up for ``warmup`` calls and at least ``warmup_s`` seconds (a fake
    clock that advances 0.25 s a call), then times exactly ``n`` calls."""
    import _common

    now = [0.0]
    calls: list[int] = []

    def clock() -> float:
        return now[0]

    def call(i: int) -> None:
        calls.append(i)
        now[0] += 0.25

    assert len(_common.time_calls(call, 2, 3, warmup_s=1.0, clock=clock)) == 3
    assert calls == [0, 1, 2, 3, 0, 1, 2]  # 4 warm-up calls fill the second
    calls.clear()
    assert len(_common.time_calls(call, 5, 1, warmup_s=0.5, clock=clock)) == 1
    assert calls == [0, 1, 2, 3, 4, 0]  # the count outlasts the seconds


def test_a_round_measures_its_share_of_the_iterations_after_the_whole_warm_up() -> None:
    from _metrics import FULL, QUICK

    share = bench_rpc.round_share(FULL, 3)
    assert (share.sync_n, share.remote_n, share.autograd_n, share.echo_64mb_n) == (
        FULL.sync_n // 3, FULL.remote_n // 3, FULL.autograd_n // 3, FULL.echo_64mb_n // 3)
    assert (share.sync_warmup, share.autograd_warmup) == (FULL.sync_warmup, FULL.autograd_warmup)
    assert share.init_rounds == 1
    # a pipelined batch is never cut below one window of calls in flight; a metric the
    # configuration skips (the quick run's 64 MB echo) stays skipped
    assert bench_rpc.round_share(FULL, 1000).async_total == FULL.async_inflight
    assert bench_rpc.round_share(QUICK, 3).echo_64mb_n == 0
    assert bench_rpc.round_share(QUICK, 1000).sync_n == 1
