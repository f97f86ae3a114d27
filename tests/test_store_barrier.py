"""The shutdown barrier on the rendezvous store: who is missing, at a cost per poll that
does not grow with the world size."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from actorrpc.agent._rendezvous import StoreBarrier

pytestmark = pytest.mark.timeout(30)


class _CountingStore:
    """A store that counts the round trips asked of it (each method call is one)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return counted


def _group(world_size: int) -> tuple[_CountingStore, list[StoreBarrier]]:
    store = _CountingStore()
    barriers = [StoreBarrier(store, "shutdown/arrived", r, world_size) for r in range(world_size)]
    return store, barriers


def test_missing_names_the_ranks_that_did_not_arrive() -> None:
    _, barriers = _group(5)
    assert barriers[0].missing() == [0, 1, 2, 3, 4]  # nobody yet (and no blocking read)
    for rank in (0, 3, 4):
        barriers[rank].arrive()
    assert barriers[0].missing() == [1, 2]
    barriers[1].arrive()
    barriers[2].arrive()
    assert barriers[0].missing() == []
    assert barriers[2].wait(time.monotonic() + 5) == []


def test_a_poll_costs_the_same_round_trips_whatever_the_world_size() -> None:
    costs = []
    for world_size in (4, 32):
        store, barriers = _group(world_size)
        for barrier in barriers[:-1]:  # the last rank never arrives
            barrier.arrive()
        polled: list[int] = []

        def dead(
            missing: list[int], store: _CountingStore = store, polled: list[int] = polled
        ) -> list[int]:
            polled.append(store.calls)
            return missing if len(polled) == 3 else []  # found dead at the third poll

        began = store.calls
        assert barriers[0].wait(time.monotonic() + 20, dead) == [world_size - 1]
        costs.append((polled[1] - polled[0], polled[2] - polled[1], store.calls - began))
    (small_gap, small_gap2, _), (large_gap, large_gap2, _) = costs
    assert small_gap == large_gap == small_gap2 == large_gap2 <= 3  # count, check, read


def test_a_waiter_stops_once_only_dead_ranks_are_missing() -> None:
    _, barriers = _group(3)
    barriers[0].arrive()
    barriers[1].arrive()
    started = time.monotonic()
    missing = barriers[0].wait(started + 20, lambda missing: missing)  # all found dead
    assert missing == [2] and time.monotonic() - started < 5
