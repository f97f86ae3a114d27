"""init_rpc / shutdown lifecycles, each in processes (and groups) of their own.

The scenarios run in ``tests/_scenarios.py``; one module fixture starts them
all at once (torch's import dominates, so they overlap it) and the tests check
the JSON each process printed. Name validation needs no group and runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest

import actorrpc as rpc
from actorrpc.agent import validate_worker_name
from tests._cluster import REPO_ROOT, free_port

# One module fixture runs every scenario (about 20 s); the first test pays for it.
pytestmark = pytest.mark.timeout(100)

SCENARIO_DEADLINE = 85.0
NOT_INITIALIZED = "not been initialized"


@dataclass
class Run:
    returncode: int
    result: dict[str, Any]
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}"
            f"\n--- stderr\n{self.stderr[-6000:]}"
        )


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACTORRPC_", "SLURM_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env,
        text=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _finish(process: subprocess.Popen[str], deadline: float) -> Run:
    try:
        stdout, stderr = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += "\n[killed by the test: scenario deadline passed]"
    result: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return Run(process.returncode, result, stdout, stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[Run]]:
    signal_dir = tmp_path_factory.mktemp("signals")
    init_port, env_port, dup_port, quick_port = (free_port() for _ in range(4))
    processes: dict[str, list[subprocess.Popen[str]]] = {"lifecycle": [], "quickstart": []}
    for rank in range(2):
        processes["lifecycle"].append(
            _start(
                [
                    "-m",
                    "tests._scenarios",
                    "lifecycle",
                    "--rank",
                    str(rank),
                    "--world-size",
                    "2",
                    "--init-method",
                    f"tcp://127.0.0.1:{init_port}",
                ],
                _clean_env(
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(env_port),
                    SCENARIO_DUP_INIT=f"tcp://127.0.0.1:{dup_port}",
                    SCENARIO_SIGNAL_DIR=str(signal_dir),
                ),
            )
        )
    processes["failures"] = [_start(["-m", "tests._scenarios", "failures"], _clean_env())]
    for rank in range(2):
        processes["quickstart"].append(
            _start(
                [os.path.join(REPO_ROOT, "examples", "quickstart.py")],
                _clean_env(
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(quick_port),
                ),
            )
        )
    deadline = time.monotonic() + SCENARIO_DEADLINE
    return {name: [_finish(p, deadline) for p in group] for name, group in processes.items()}


def _result(runs: dict[str, list[Run]], scenario: str, index: int = 0) -> dict[str, Any]:
    run = runs[scenario][index]
    assert run.result, f"{scenario}[{index}] printed no result:\n{run.describe()}"
    return run.result


def _assert_error(error: dict[str, Any] | None, type_name: str, *fragments: str) -> None:
    assert error is not None, f"expected {type_name}, but the call succeeded"
    assert type_name in error["mro"], error
    for fragment in fragments:
        assert fragment in error["message"], (fragment, error["message"])


# --- in-process: validation happens before anything else --------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["a b", "x" * 128, "", "a/b", "wörker", "tab\tname", "a.b"])
def test_bad_names_rejected(name):
    with pytest.raises(ValueError) as info:
        rpc.init_rpc(name, rank=0, world_size=1)
    assert isinstance(info.value, rpc.InvalidNameError)
    message = str(info.value)
    assert "letters, digits" in message and "127" in message, message


@pytest.mark.timeout(30)
def test_non_string_name_rejected():
    for name in (3, b"worker", ["w"]):
        with pytest.raises(rpc.InvalidNameError, match="str"):
            rpc.init_rpc(name, rank=0, world_size=1)


@pytest.mark.timeout(30)
def test_valid_names_accepted():
    for name in ("w", "x" * 127, "trainer:0", "ps-1_a", "WORKER9"):
        assert validate_worker_name(name) == name


@pytest.mark.timeout(30)
def test_wrong_backend_and_options_types():
    with pytest.raises(TypeError, match="backend"):
        rpc.init_rpc("w", backend="zmq", rank=0, world_size=1)
    with pytest.raises(TypeError, match="rpc_backend_options"):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options={"init_method": "env://"})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("busy_poll", [-0.001, float("nan"), float("inf")])
def test_bad_busy_poll_rejected(busy_poll):
    with pytest.raises(ValueError, match="busy_poll must be a finite number of seconds >= 0"):
        rpc.ZmqRpcBackendOptions(busy_poll=busy_poll)


@pytest.mark.timeout(30)
def test_options_from_the_environment_are_checked(monkeypatch):
    monkeypatch.setenv("ACTORRPC_BUSY_POLL", "0.002")
    monkeypatch.setenv("ACTORRPC_SHM_THRESHOLD", "4096")
    assert rpc.ZmqRpcBackendOptions().batch_scheduling is True
    monkeypatch.setenv("ACTORRPC_BATCH_SCHEDULING", "0")
    options = rpc.ZmqRpcBackendOptions()
    assert (options.busy_poll, options.shared_memory_threshold) == (0.002, 4096)
    assert options.batch_scheduling is False
    monkeypatch.setenv("ACTORRPC_BUSY_POLL", "soon")
    with pytest.raises(ValueError, match="ACTORRPC_BUSY_POLL='soon' is not a valid float"):
        rpc.ZmqRpcBackendOptions()
    monkeypatch.delenv("ACTORRPC_BUSY_POLL")
    monkeypatch.setenv("ACTORRPC_SHM_THRESHOLD", "1.5")
    with pytest.raises(ValueError, match="ACTORRPC_SHM_THRESHOLD='1.5' is not a valid int"):
        rpc.ZmqRpcBackendOptions()


@pytest.mark.timeout(30)
def test_rank_out_of_range_rejected():
    for rank, world_size in ((3, 2), (0, 0)):
        with pytest.raises(ValueError, match="range"):
            rpc.init_rpc("w", rank=rank, world_size=world_size)


# --- before init / init twice / after shutdown / re-init ----------------------------------------


def test_calls_before_init_raise_not_initialized(runs):
    for index in range(2):
        result = _result(runs, "lifecycle", index)
        assert result["before_init_is_initialized"] is False
        for call, error in result["before_init"].items():
            assert error is not None, call
            _assert_error(error, "NotInitializedError", NOT_INITIALIZED)
            assert "RuntimeError" in error["mro"]
    _assert_error(_result(runs, "failures")["before_init"], "NotInitializedError", NOT_INITIALIZED)


def test_init_twice_raises_already_initialized(runs):
    for index in range(2):
        error = _result(runs, "lifecycle", index)["round1_twice"]
        _assert_error(error, "AlreadyInitializedError", "already initialized")
        assert error["elapsed"] < 1


def test_calls_after_shutdown_raise_not_initialized(runs):
    for index in range(2):
        result = _result(runs, "lifecycle", index)
        assert result["round1_peer"] == [1.0 + index] * 2
        assert result["round1_self"] == f"worker{index}"
        assert result["after_shutdown_is_initialized"] is False
        for error in result["after_shutdown"].values():
            _assert_error(error, "NotInitializedError", NOT_INITIALIZED)


def test_reinit_after_shutdown_in_same_process(runs):
    for index in range(2):
        result = _result(runs, "lifecycle", index)
        assert result["round2_peer"] == [11.0 + index] * 2
        assert result["round2_infos"] == [["worker0", 0], ["worker1", 1]]


def test_init_freezes_the_garbage_collectors_objects_until_shutdown(runs):
    # (full collections with torch loaded otherwise scan ~170,000 objects: ~70 ms stalls)
    for index in range(2):
        result = _result(runs, "lifecycle", index)
        assert result["round1_frozen_objects"] > 50_000  # torch's modules among them
        assert result["after_shutdown_frozen_objects"] == 0
        assert result["round2_frozen_objects"] == 0  # ZmqRpcBackendOptions(freeze_gc=False)


def test_reinit_while_store_host_is_still_leaving(runs):
    worker0 = _result(runs, "lifecycle", 0)
    assert worker0["race_setup"] == "ok", "the scenario could not hold worker0's store open"
    assert worker0["race_worker1_reached_old_store"] is True
    for index in range(2):
        result = _result(runs, "lifecycle", index)
        assert result["race_reinit"] is None, result["race_reinit"]
        assert result["race_peer"] is None and result["race_shutdown"] is None


# --- rendezvous failures ------------------------------------------------------------------------


def test_duplicate_names_fail_on_every_worker(runs):
    errors = [_result(runs, "lifecycle", index)["duplicate"] for index in range(2)]
    for index, error in enumerate(errors):
        assert error is not None, f"worker {index} joined a group with a duplicate name"
        assert error["elapsed"] < 10, error  # within init_timeout
        assert _result(runs, "lifecycle", index)["duplicate_is_initialized"] is False
    # the store host always sees the whole group and says why
    _assert_error(errors[0], "RendezvousError", "'dup'", "not unique")


def test_lost_store_during_rendezvous_raises_rendezvous_error(runs):
    result = _result(runs, "failures")
    assert result["lost_store_rank1_connected"] is True
    _assert_error(result["lost_store"], "RendezvousError")
    assert result["lost_store"]["elapsed"] < 5


def test_world_that_never_fills(runs):
    error = _result(runs, "failures")["never_fills"]
    _assert_error(error, "RendezvousError")
    assert error["elapsed"] < 3 + 3, error  # init_timeout 3 s (torch's store adds ~1 s)


def test_world_that_never_fills_names_missing_ranks(runs):
    error = _result(runs, "failures")["never_fills"]
    _assert_error(error, "RendezvousError", "[1, 2]")


def test_unreachable_master(runs):
    error = _result(runs, "failures")["unreachable_master"]
    _assert_error(error, "RendezvousError", "127.0.0.1")
    assert error["elapsed"] < 3 * 3 + 3, error  # no hang (see the next test)


def test_unreachable_master_within_init_timeout(runs):
    error = _result(runs, "failures")["unreachable_master"]
    assert error is not None and error["elapsed"] < 3 + 2.0, error


def test_env_configuration_errors(runs):
    result = _result(runs, "failures")
    _assert_error(result["env_without_master"], "RendezvousError", "MASTER_ADDR", "MASTER_PORT")
    _assert_error(result["no_rank"], "InvalidArgumentError", "RANK")
    # no world size anywhere: a dynamic group, whose env:// master is not set
    _assert_error(result["no_world_size"], "RendezvousError", "MASTER_ADDR", "dynamic group")
    _assert_error(result["rank_out_of_range"], "InvalidArgumentError", "range")
    assert "ValueError" in result["no_rank"]["mro"]


def test_failed_inits_leave_nothing_behind(runs):
    result = _result(runs, "failures")
    assert result["is_initialized_after_failures"] is False
    assert result["frozen_objects_after_failures"] == 0
    assert result["solo_call"] == 2.0
    assert result["solo_remote"] == "solo"
    assert result["solo_shutdown_s"] < 5


def test_shutdown_that_gives_up_names_the_requests_still_served(runs):
    result = _result(runs, "failures")
    _assert_error(result["stuck_shutdown"], "ShutdownError",
                  "block_until_released on WorkerInfo(id=0, name=solo)",  # the call made
                  "1 requests being served: block_until_released from 'solo' for ")  # served
    assert result["stuck_is_initialized"] is False


# --- env:// and torch's options ----------------------------------------------------------------


def test_env_rank_world_size_and_tensorpipe_options(runs):
    for index in range(2):
        result = _result(runs, "lifecycle", index)
        assert result["env_info"] == [f"worker{index}", index]
        assert result["env_world"] == 2
        assert result["env_timeout"] == 25.0  # from torch's TensorPipeRpcBackendOptions
        assert result["env_peer"] == f"worker{1 - index}"


# --- shutdown ---------------------------------------------------------------------------------


def test_graceful_shutdown_with_uneven_workload(runs):
    worker0 = _result(runs, "lifecycle", 0)
    worker1 = _result(runs, "lifecycle", 1)
    assert worker1["round2_first_call_arrived"] is True
    assert worker1["round2_served_at_shutdown"] < 40, "the calls were not in flight at shutdown"
    assert worker1["round2_served_after_shutdown"] == 40
    assert worker0["round2_done"] == 40
    assert worker0["round2_results_ok"] is True
    assert worker0["round2_shutdown_s"] < 20 and worker1["round2_shutdown_s"] < 20


def test_a_worker_waiting_in_shutdown_is_woken_by_the_last_to_arrive(runs):
    # (every pause between polls of the arrived and idle barriers was 30 s in this step:
    # each shutdown ended sooner only through the BARRIER notifications)
    worker0 = _result(runs, "lifecycle", 0)
    worker1 = _result(runs, "lifecycle", 1)
    assert worker0["woken_peer_waits"] is True, "worker1 never arrived at shutdown"
    assert worker0["woken_peer_serves"] == "worker1", "a worker in shutdown stopped serving"
    assert worker0["woken_shutdown_s"] < 15, worker0
    assert worker1["woken_shutdown_s"] < 25, worker1


def test_shutdown_timeout_names_missing_peer(runs):
    worker0 = _result(runs, "lifecycle", 0)
    error = worker0["shutdown_timeout"]
    _assert_error(error, "ShutdownError", "worker1")
    assert "RuntimeError" in error["mro"]
    assert 2.5 <= error["elapsed"] < 3 + 3, error
    assert worker0["shutdown_timeout_is_initialized"] is False


def test_non_graceful_shutdown_returns_quickly(runs):
    worker1 = _result(runs, "lifecycle", 1)
    assert worker1["saw_worker0_leave"] is True
    assert worker1["non_graceful"] is None, worker1["non_graceful"]
    assert worker1["non_graceful_s"] < 2
    assert worker1["non_graceful_is_initialized"] is False


# --- code shipped from __main__ ------------------------------------------------------------------


def test_main_function_differing_from_receivers_main_runs_senders_code(runs):
    assert _result(runs, "lifecycle", 0)["shadowed_func"] == "sender"


def test_main_class_differing_from_receivers_main_runs_senders_code(runs):
    assert _result(runs, "lifecycle", 0)["shadowed_class"] == "sender"


# --- processes ----------------------------------------------------------------------------------


def test_scenario_processes_exit_cleanly(runs):
    for name in ("lifecycle", "failures"):
        for index, run in enumerate(runs[name]):
            assert run.returncode == 0, f"{name}[{index}]: {run.describe()}"


def test_quickstart_example(runs):
    worker0, worker1 = runs["quickstart"]
    assert worker0.returncode == 0, worker0.describe()
    assert worker1.returncode == 0, worker1.describe()
    out = worker0.stdout
    assert "rpc_sync torch.add on worker1" in out and "[3., 3.]" in out
    assert "sums: [12.0, 24.0, 36.0]" in out
    assert "[4., 4.]" in out
    assert "increment(5) -> 15" in out
    assert out.rstrip().endswith("quickstart done")
