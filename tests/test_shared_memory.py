"""Same-host shared memory for large tensors: the pool, the mapping, and real calls.

The session group's workers all live on 127.0.0.1, so tensors of at least the
threshold (1 MiB by default) travel through pooled /dev/shm segments there.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

import actorrpc as rpc
from actorrpc.agent import current_agent
from actorrpc.errors import ProtocolError
from actorrpc.transport import SharedMappings, SharedMemoryPool, _shared_memory
from actorrpc.transport._segment_copy import (
    FIRST_INTERVAL,
    PLAIN,
    STREAMING,
    streaming_copy_available,
)
from actorrpc.transport._shared_memory import MAX_FREE_BYTES, SHM_DIRECTORY, sweep_orphans
from tests._gil import other_thread_ran_during
from tests._waiting import wait_until

pytestmark = pytest.mark.timeout(60)

BIG = (5 << 20) // 4  # float32 elements in 5 MiB: above the default threshold


def _segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIRECTORY, name))


# --- the pool and the mapping, in one process ------------------------------------------------


def test_export_map_release_reuse():
    pool = SharedMemoryPool()
    try:
        data = torch.arange(1 << 18, dtype=torch.float32)
        buffer = memoryview(data.numpy()).cast("B")
        descriptor, name = pool.export(buffer, borrower=7)
        assert _segment_exists(name)
        assert pool.describe()["segments_lent"] == 1
        freed: list[str] = []
        array = SharedMappings().map(descriptor, 7, freed.append)
        tensor = torch.frombuffer(array, dtype=torch.float32)
        assert torch.equal(tensor, data)
        tensor[0] = -1.0  # the receiver owns the memory while it holds it
        del array
        assert freed == []  # the tensor still uses the mapping
        del tensor
        gc.collect()
        assert freed == [name]
        pool.release(freed, borrower=8)  # not lent to 8: ignored
        assert pool.describe()["segments_lent"] == 1
        pool.release(freed, borrower=7)
        assert pool.describe() == {
            "segments_lent": 0, "bytes_lent": 0, "segments_free": 1, "bytes_free": 1 << 20,
        }
        _, again = pool.export(buffer[:1000], borrower=7)
        assert again != name  # a smaller size class: a new segment
        _, same = pool.export(buffer, borrower=7)
        assert same == name  # the released segment of this size class is reused
    finally:
        pool.close()
    assert not _segment_exists(name)


def test_a_large_copy_into_a_segment_lets_other_threads_run(monkeypatch):
    pool = SharedMemoryPool()
    try:
        buffer = memoryview(torch.rand(16 << 20).numpy()).cast("B")  # 64 MiB: ~10 ms a copy
        assert buffer.nbytes >= _shared_memory.RELEASE_GIL_FROM

        def export_again() -> None:  # (into the segment made before: only the copy)
            _, name = pool.export(buffer, borrower=1)
            pool.release([name], borrower=1)

        export_again()
        assert any(other_thread_ran_during(export_again) for _ in range(3))
        descriptor, name = pool.export(buffer, borrower=1)  # what the copy wrote
        mappings = SharedMappings()
        array = mappings.map(descriptor, 1, lambda _: None)
        assert bytes(array[:4096]) == bytes(buffer[:4096])
        assert bytes(array[-4096:]) == bytes(buffer[-4096:])
        del array
        mappings.close()
        pool.release([name], borrower=1)
        # the control: the same copy keeping the GIL (a smaller one's way) lets nobody run
        monkeypatch.setattr(_shared_memory, "RELEASE_GIL_FROM", 1 << 40)
        assert not other_thread_ran_during(export_again)
    finally:
        pool.close()


def test_segments_of_a_gone_peer_are_dropped_not_reused():
    pool = SharedMemoryPool()
    try:
        descriptor, name = pool.export(b"x" * 4096, borrower=3)
        array = SharedMappings().map(descriptor, 3, lambda _: None)
        pool.forget_lent_to(3)
        assert not _segment_exists(name)
        assert bytes(array[:4]) == b"xxxx"  # its mapping stays valid
        assert pool.describe()["segments_free"] == 0
        _, other = pool.export(b"y" * 4096, borrower=3)
        assert other != name
        assert bytes(array[:4]) == b"xxxx"
    finally:
        pool.close()


def test_free_list_is_bounded():
    pool = SharedMemoryPool()
    try:
        big = bytes(MAX_FREE_BYTES // 2 + 1)
        names = [pool.export(big, borrower=1)[1] for _ in range(3)]
        pool.release(names, borrower=1)
        assert pool.describe()["bytes_free"] <= MAX_FREE_BYTES
        assert sum(_segment_exists(n) for n in names) == 1
    finally:
        pool.close()
    assert not any(_segment_exists(n) for n in names)


def test_a_reused_segment_is_mapped_once_and_the_cache_is_bounded():
    pool = SharedMemoryPool()
    mappings = SharedMappings(max_bytes=3 << 20)
    try:
        freed: list[str] = []
        first = bytes(range(256)) * 4096  # 1 MiB
        descriptor, name = pool.export(first, borrower=5)
        array = mappings.map(descriptor, 5, freed.append)
        assert bytes(array[:256]) == bytes(range(256))
        del array
        gc.collect()
        pool.release(freed, borrower=5)
        descriptor, again = pool.export(b"\x07" * (1 << 20), borrower=5)
        assert again == name  # the pool reused the segment
        array = mappings.map(descriptor, 5, freed.append)
        assert mappings.describe() == {"mappings_cached": 1, "bytes_mapped": 1 << 20}
        assert bytes(array[:2]) == b"\x07\x07"  # the same mapping sees the new bytes
        kept = array  # in use: never closed by trimming
        others = []
        for _ in range(4):  # more segments than the cache may keep mapped
            other, _ = pool.export(b"o" * (1 << 20), borrower=5)
            others.append(mappings.map(other, 5, lambda _: None))
            others.clear()
            gc.collect()
        assert mappings.describe()["bytes_mapped"] <= 3 << 20
        assert bytes(kept[:2]) == b"\x07\x07"
        mappings.forget(5)  # its owner is gone
        assert mappings.describe() == {"mappings_cached": 0, "bytes_mapped": 0}
        assert bytes(kept[:2]) == b"\x07\x07"  # still valid until freed
    finally:
        mappings.close()
        pool.close()


def test_a_cached_mapping_is_not_used_for_another_owner():
    pool = SharedMemoryPool()
    mappings = SharedMappings()
    try:
        descriptor, name = pool.export(b"a" * 4096, borrower=1)
        mappings.map(descriptor, 1, lambda _: None)
        # a different sender naming the same segment gets a mapping of its own
        mappings.map(descriptor, 2, lambda _: None)
        assert mappings.describe()["mappings_cached"] == 1
    finally:
        mappings.close()
        pool.close()


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        (b"\x00" * 8, "too short"),
        ((16).to_bytes(8, "big") + b"../../etc/passwd", "not a segment"),
        ((16).to_bytes(8, "big") + b"actorrpc-1-" + b"0" * 24, "is gone"),
        ((16).to_bytes(8, "big") + b"actorrpc-00000000deadbeef0000", "not a segment"),
    ],
)
def test_bad_descriptors_are_refused(descriptor, match):
    with pytest.raises(ProtocolError, match=match):
        SharedMappings().map(descriptor, 1, lambda _: None)


def test_descriptor_larger_than_its_segment_is_refused():
    pool = SharedMemoryPool()
    try:
        descriptor, name = pool.export(b"z" * 100, borrower=1)  # a 128-byte segment
        forged = (1 << 20).to_bytes(8, "big") + name.encode()
        with pytest.raises(ProtocolError, match="does not hold"):
            SharedMappings().map(forged, 1, lambda _: None)
    finally:
        pool.close()


def test_segments_of_dead_processes_are_swept():
    import subprocess

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    orphan = os.path.join(SHM_DIRECTORY, f"actorrpc-{pid:x}-{'ab' * 12}")
    mine = os.path.join(SHM_DIRECTORY, f"actorrpc-{os.getpid():x}-{'cd' * 12}")
    for path in (orphan, mine):
        with open(path, "wb") as handle:
            handle.write(b"x")
    try:
        assert sweep_orphans() >= 1
        assert not os.path.exists(orphan)
        assert os.path.exists(mine)  # a live process keeps its segments
    finally:
        for path in (orphan, mine):
            if os.path.exists(path):
                os.unlink(path)


# --- real calls between the session group's processes ----------------------------------------

_kept: list[torch.Tensor] = []


def keep(t: torch.Tensor) -> float:
    _kept.append(t)
    return float(t.sum())


def drop_kept() -> int:
    count = len(_kept)
    _kept.clear()
    gc.collect()
    return count


def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t * factor


def lent_segments() -> int:
    gc.collect()
    return int(current_agent().shared.pool.describe()["segments_lent"])


def _all_returned(worker: str) -> bool:
    """Every segment lent either way is back in its pool (the assertion shows the pools)."""
    gc.collect()
    _last_pools[:] = [lent_segments(), rpc.rpc_sync(worker, lent_segments)]
    return _last_pools == [0, 0]


_last_pools: list[int] = []


def test_large_tensors_round_trip_through_shared_memory(cluster):
    data = torch.randn(BIG)
    result = rpc.rpc_sync("worker1", scaled, args=(data, 2.0))
    assert torch.equal(result, data * 2.0)
    echoed = rpc.rpc_sync("worker1", torch.clone, args=(data,))
    assert torch.equal(echoed, data)
    echoed.add_(1.0)  # the copy is ours: the original is untouched
    assert torch.equal(rpc.rpc_sync("worker1", torch.clone, args=(data,)), data)
    del result, echoed
    assert wait_until(lambda: _all_returned("worker1"), 10), f"lent (here, there): {_last_pools}"
    assert current_agent().shared.pool.describe()["segments_free"] >= 1  # kept for reuse


def test_views_dtypes_and_nested_structures(cluster):
    base = torch.randn(3, BIG // 2)
    view = base[1:, ::2]  # gappy: only its elements are sent
    ints = torch.randint(0, 1000, (BIG,), dtype=torch.int64)
    halves = torch.randn(BIG, dtype=torch.float16)
    out = rpc.rpc_sync("worker2", tuple, args=([view, {"ints": ints}, halves],))
    assert torch.equal(out[0], view) and out[0].is_contiguous()
    assert torch.equal(out[1]["ints"], ints)
    assert torch.equal(out[2], halves)
    del out
    assert wait_until(lambda: _all_returned("worker2"), 10), f"lent (here, there): {_last_pools}"


def test_a_tensor_kept_by_the_callee_stays_valid_until_it_drops_it(cluster):
    data = torch.randn(BIG)
    total = rpc.rpc_sync("worker1", keep, args=(data,))
    assert total == pytest.approx(float(data.sum()), rel=1e-4)
    # the segment stays lent while worker1 holds the tensor: later sends use other ones
    for _ in range(3):
        assert torch.equal(rpc.rpc_sync("worker1", torch.clone, args=(data,)), data)
    assert lent_segments() >= 1
    assert rpc.rpc_sync("worker1", drop_kept) == 1
    assert wait_until(lambda: _all_returned("worker1"), 10), f"lent (here, there): {_last_pools}"


def test_many_large_calls_in_flight(cluster):
    tensors = [torch.full((BIG,), float(i)) for i in range(8)]
    futures = [rpc.rpc_async("worker1", scaled, args=(t, 3.0)) for t in tensors]
    results = torch.futures.wait_all(futures)
    for i, r in enumerate(results):
        assert torch.equal(r, torch.full((BIG,), 3.0 * i))
    del results, futures, r  # r: the loop kept the last one
    assert wait_until(lambda: _all_returned("worker1"), 10), f"lent (here, there): {_last_pools}"


def test_small_tensors_stay_on_the_socket(cluster):
    before = current_agent().shared.pool.describe()
    small = torch.randn(1000)
    assert torch.equal(rpc.rpc_sync("worker1", torch.clone, args=(small,)), small)
    after = current_agent().shared.pool.describe()
    assert after["segments_free"] + after["segments_lent"] == (
        before["segments_free"] + before["segments_lent"]
    )


def test_worker_stats_show_the_pool(cluster):
    stats = rpc.get_worker_stats("worker1")
    assert set(stats["shared_memory"]) == {
        "segments_lent", "bytes_lent", "segments_free", "bytes_free",
        "mappings_cached", "bytes_mapped",
    }


def _calls_sent_to(peer: str) -> int:
    return int(rpc.get_worker_stats()["peers"].get(peer, {}).get("calls_sent", 0))


def _riders_carried() -> int:
    from actorrpc.agent import current_agent

    return current_agent().riders.carried


def test_releases_ride_on_the_next_message_instead_of_their_own(cluster):
    data = torch.randn(BIG)
    rpc.rpc_sync("worker1", torch.clone, args=(data,))  # warm: mappings and pools
    sent_before = rpc.rpc_sync("worker1", _calls_sent_to, args=("worker0",))
    carried_before = rpc.rpc_sync("worker1", _riders_carried)
    # 20 calls in flight: worker1 serves them back to back, so each release has a reply
    # to ride on within the riders' delay even on a loaded machine (one call at a time,
    # a caller descheduled for longer than that delay made the releases go alone)
    futures = [rpc.rpc_async("worker1", torch.clone, args=(data,)) for _ in range(20)]
    for future in futures:
        assert torch.equal(future.wait(), data)
    del futures, future  # the futures hold the replies, whose segments worker1 lent
    sent_after = rpc.rpc_sync("worker1", _calls_sent_to, args=("worker0",))
    carried = rpc.rpc_sync("worker1", _riders_carried) - carried_before
    # worker1 handed back worker0's segments on its replies (many of the 20 releases rode;
    # the last ones, or more under load, may still go alone, several to a notification:
    # 8 of 20 rode in a run on a loaded 2-core host)
    assert carried >= 5, carried
    assert sent_after - sent_before <= 10
    assert wait_until(lambda: _all_returned("worker1"), 10), f"lent (here, there): {_last_pools}"


def force_copies(method: str | None) -> None:
    from actorrpc.transport import _segment_copy

    _segment_copy.FORCED_METHOD = method


def _copies_described(worker: str) -> dict[str, object]:
    described = rpc.get_worker_stats(worker)["segment_copies"]
    return {key: value for key, value in described.items() if key.startswith("<=")}


@pytest.mark.skipif(not streaming_copy_available(), reason="the streaming copy is not built here")
@pytest.mark.parametrize("method", [STREAMING, PLAIN])
def test_either_copy_carries_tensors_exactly(cluster, method):
    """Both workers fill their segments with one method only; odd byte counts too."""
    tensors = [torch.randn(BIG), torch.randn(BIG + 3, dtype=torch.float16),
               torch.randint(0, 255, ((1 << 20) + 1,), dtype=torch.uint8)]  # 1 MiB + 1 byte
    force_copies(method)
    rpc.rpc_sync("worker1", force_copies, args=(method,))
    try:
        for tensor in tensors:
            for _ in range(2):  # (the second time through reused segments)
                assert torch.equal(rpc.rpc_sync("worker1", torch.clone, args=(tensor,)), tensor)
        figure = f"{method}_us_per_mib"
        for worker in ("worker0", "worker1"):  # each side measured the copies it made
            classes = _copies_described(worker)
            assert any(c[figure] is not None for c in classes.values()), (worker, classes)
    finally:
        force_copies(None)
        rpc.rpc_sync("worker1", force_copies, args=(None,))
    assert wait_until(lambda: _all_returned("worker1"), 10), f"lent (here, there): {_last_pools}"


@pytest.mark.skipif(not streaming_copy_available(), reason="the streaming copy is not built here")
def test_a_worker_measures_both_copies_and_reports_its_choice(cluster):
    data = torch.randn((12 << 20) // 4)  # 12 MiB: a size class no other test uses
    for _ in range(FIRST_INTERVAL + 1):  # the first try of streaming comes by then
        assert torch.equal(rpc.rpc_sync("worker1", torch.clone, args=(data,)), data)
    stats = rpc.get_worker_stats()["segment_copies"]
    assert stats["streaming_available"] is True
    size_class = stats[f"<={16 << 20} bytes"]
    assert size_class["plain_us_per_mib"] > 0 and size_class["streaming_us_per_mib"] > 0
    assert size_class["chosen"] in (PLAIN, STREAMING) and size_class["tries"] >= 1
    del data
    assert wait_until(lambda: _all_returned("worker1"), 10), f"lent (here, there): {_last_pools}"
