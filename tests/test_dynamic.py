"""Dynamic membership: ``init_rpc(name)`` without a world size joins a running group.

One driver process (``tests/_dynamic_group.py``) starts a dynamic group and
members join, call each other, leave (gracefully, at once, by crashing) and
join again, all over real processes and sockets; it reports what it saw and
these tests check it. The member table itself is unit-tested below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actorrpc.agent._members import MemberTable
from actorrpc.agent._rendezvous import GroupMember
from actorrpc.agent._worker_info import WorkerInfo
from actorrpc.errors import PeerUnreachableError, UnknownWorkerError, WorkerLeftError

from ._cluster import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




@pytest.fixture(scope="module")
def observed() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(variable, None)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "tests._dynamic_group", "driver", "--init-method", init_method],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"driver failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return dict(json.loads(lines[-1][len("RESULT "):]))


pytestmark = pytest.mark.timeout(300)


def test_members_join_a_running_group_and_everyone_sees_them(observed):
    assert observed["alone"] == ["driver"]
    assert observed["all_joined"]
    for who in ("driver_sees", "w0_sees", "w1_sees"):
        assert sorted(observed[who]) == ["driver", "w0", "w1"], who
    assert observed["w0_calls_w1"] == 42.0  # joiners reach each other, not only the driver
    assert observed["rref_value"] == [3.0, 3.0]
    assert observed["status_workers"] == ["driver", "w0", "w1"]  # `actorrpc status` sees them


def test_taken_name_and_taken_rank_are_refused_and_leave_nothing_behind(observed):
    clash = observed["clash"]
    assert clash["returncode"] == 0
    assert clash["taken_name"]["type"] == "RendezvousError"
    assert "'w0' is not unique" in clash["taken_name"]["message"]
    assert clash["taken_rank"]["type"] == "RendezvousError"
    assert "rank 1 is already taken" in clash["taken_rank"]["message"]
    assert clash["initialized_after"] is False
    # the failed attempts never became members
    assert sorted(observed["driver_sees"]) == ["driver", "w0", "w1"]


def test_leaving_worker_answers_calls_in_flight_then_others_forget_it(observed):
    assert observed["in_flight_result"] == 49
    assert observed["w1"]["returncode"] == 0
    assert observed["w1_gone"]
    assert observed["after_w1"] == ["driver", "w0"]
    assert observed["w0_after_w1"] == ["driver", "w0"]


def test_calls_to_a_worker_that_left_fail_naming_it(observed):
    cases = ("call_by_name", "call_by_info", "get_info", "w0_calls_w1_after", "rref_of_departed")
    for case in cases:
        error = observed[case]
        assert error is not None, case
        assert error["type"] == "WorkerLeftError", case
        assert "'w1'" in error["message"] and "left the group" in error["message"], case
        assert "ConnectionError" in error["mro"], case


def test_crashed_member_is_replaced_by_a_new_worker_with_its_name(observed):
    assert observed["w2_joined"] and observed["w2_crash_code"] == 17
    assert observed["new_w2_joined"]
    old_rank, new_rank = observed["w2_ranks"]
    assert new_rank != old_rank
    assert observed["new_w2_answers"] == new_rank
    assert sorted(observed["after_new_w2"]) == ["driver", "w0", "w2"]  # the dead one is gone


def test_leave_and_join_again_in_one_process(observed):
    assert observed["w0_back"]
    old_rank, new_rank = observed["w0_ranks"]
    assert new_rank != old_rank
    assert observed["w0_back_calls"] == 42.0
    w0 = observed["w0"]
    assert w0["after_leave"]["type"] == "NotInitializedError"
    assert sorted(w0["saw_at_rejoin"]) == ["driver", "w0", "w2"]


def test_non_graceful_leave_and_last_member_shutdown(observed):
    assert observed["w2"]["returncode"] == 0
    assert observed["w2_gone"]
    assert observed["w0"]["returncode"] == 0
    assert observed["at_end"] == ["driver"]
    assert observed["driver_shutdown_seconds"] < 10
    # a leave stops the agent's threads once: no wait for the inbox lock it already holds
    assert observed["w2"]["shutdown_seconds"] < 4, observed["w2"]
    assert observed["w0"]["shutdown_seconds"] < 4, observed["w0"]


# --- the member table ------------------------------------------------------------------------


def _member(rank: int, name: str) -> GroupMember:
    return GroupMember(name, rank, f"tcp://127.0.0.1:{1000 + rank}", f"{rank}:x".encode())


def test_member_table_states():
    table = MemberTable()
    for rank, name in ((0, "a"), (1, "b"), (2, "c")):
        table.add(_member(rank, name))
    assert [i.name for i in table.worker_infos()] == ["a", "b", "c"]
    table.mark_leaving(1)
    assert [i.name for i in table.worker_infos()] == ["a", "c"]
    with pytest.raises(WorkerLeftError, match="'b' \\(rank 1\\) is leaving"):
        table.resolve("b")
    assert 1 in table.infos  # replies from it are still accepted
    table.remove(1)
    for to in ("b", 1, WorkerInfo("b", 1)):
        with pytest.raises(WorkerLeftError, match="'b' \\(rank 1\\) left the group"):
            table.resolve(to)
    assert isinstance(table.left_error(1), PeerUnreachableError)
    with pytest.raises(UnknownWorkerError, match="could not find destination 'zz'"):
        table.resolve("zz")
    with pytest.raises(UnknownWorkerError):
        table.resolve(WorkerInfo("zz", 1))  # rank 1 was b, not zz
    # the name comes back with a new rank
    table.add(_member(7, "b"))
    assert table.resolve("b").id == 7
    with pytest.raises(WorkerLeftError):
        table.resolve(1)
    assert [i.id for i in table.worker_infos()] == [0, 2, 7]
    with pytest.raises(UnknownWorkerError, match="destination must be"):
        table.resolve(1.5)
