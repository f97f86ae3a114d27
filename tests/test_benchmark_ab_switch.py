"""benchmarks/ab_switch.py: naming a switch, setting it, and the summary it prints."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ab_switch  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_a_switch_is_a_module_attribute_or_an_agent_attribute_path() -> None:
    assert ab_switch.parse_switch("actorrpc.agent._held:HOLD_SECONDS") == (
        "actorrpc.agent._held", "HOLD_SECONDS", []
    )
    assert ab_switch.parse_switch("agent:held.enabled") == ("agent", "held", ["enabled"])
    for bad in ("held.enabled", "agent:", ":x", "agent:held..enabled", "m:not-a-name"):
        with pytest.raises(argparse.ArgumentTypeError, match="--switch must be"):
            ab_switch.parse_switch(bad)


def test_set_switch_sets_a_module_global_and_refuses_unknown_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("ab_switch_target")
    module.FLAG = False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ab_switch_target", module)
    ab_switch.set_switch("ab_switch_target:FLAG", "True")
    assert module.FLAG is True  # type: ignore[attr-defined]
    ab_switch.set_switch("ab_switch_target:FLAG", "lambda: 3")
    assert module.FLAG() == 3  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'MISSING'"):
        ab_switch.set_switch("ab_switch_target:MISSING", "1")


def test_summary_orients_the_change_by_mode() -> None:
    latency = ab_switch.summarize("sync", [90.0, 100.0, 95.0], [110.0, 99.0, 120.0])
    assert "-13.6 %" in latency and "better" in latency and "2 of 3" in latency
    throughput = ab_switch.summarize("async", [900.0, 1000.0], [1000.0, 1100.0])
    assert "worse" in throughput and "0 of 2" in throughput
    waited_all = ab_switch.summarize("async_all", [1100.0, 1200.0], [1000.0, 1100.0])
    assert "better" in waited_all and "2 of 2" in waited_all


def test_the_command_line_refuses_unknown_modes_and_too_few_blocks() -> None:
    with pytest.raises(SystemExit):
        ab_switch.main(["--switch", "agent:held.enabled", "--modes", "sync,nope"])
    with pytest.raises(SystemExit):
        ab_switch.main(["--switch", "agent:held.enabled", "--blocks", "1"])


def test_the_many_tensors_mode_sends_one_list_of_32_tensors() -> None:
    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def rpc_sync(self, to: str, func: Any, args: tuple[Any, ...] = ()) -> None:
            calls.append((to, func, args))

    assert "tensors32" in ab_switch.MODES and ab_switch._BLOCK_CALLS["tensors32"] > 0
    ab_switch._one_call(Recorder(), "tensors32")
    [(to, func, args)] = calls
    assert to == "worker1" and func is ab_switch.noop
    [tensors] = args
    assert len(tensors) == 32 and all(isinstance(t, torch.Tensor) for t in tensors)
    assert len({id(t) for t in tensors}) == 32  # (distinct tensors: each is reduced)
