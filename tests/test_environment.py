"""Rank, world size and master address from torchrun's and SLURM's variables."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actorrpc._environment import DEFAULT_MASTER_PORT, first_host, launch_environment
from tests._cluster import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(120)

_SCRIPT = textwrap.dedent(
    """
    import os, torch
    import actorrpc as rpc
    rpc.init_rpc(None)  # name, rank and world size all come from the environment
    me = rpc.get_worker_info()
    peer = [w for w in rpc.get_worker_infos() if w != me][0]
    result = rpc.rpc_sync(peer.name, torch.add, args=(torch.ones(2), me.id))
    print(f"RESULT {me.name} {me.id} {len(rpc.get_worker_infos())} {result.tolist()}", flush=True)
    rpc.shutdown()
    """
)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node1", "node1"),
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("a-b[3]", "a-b3"),
        ("n[001-004]", "n001"),
    ],
)
def test_first_host_of_slurm_nodelists(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_torchrun_variables_win_over_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "9",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "1234",
    }.items():
        monkeypatch.setenv(key, value)
    env = launch_environment()
    assert (env.rank, env.world_size, env.local_rank, env.source) == (3, 8, 1, "torchrun")


def test_slurm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "9",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-09]",
        "SLURM_JOB_ID": "123456",
    }.items():
        monkeypatch.setenv(key, value)
    env = launch_environment()
    assert (env.rank, env.world_size, env.local_rank) == (5, 9, 1)
    assert env.master_addr == "gpu07"
    assert env.master_port == DEFAULT_MASTER_PORT + 123456 % 1000


def _run_pair(tmp_path: Path, envs: list[dict[str, str]], launcher: list[str] | None = None) -> str:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))
    }
    base["PYTHONPATH"] = REPO_ROOT
    processes = [
        subprocess.Popen(
            [sys.executable, *(launcher or []), str(script)],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        for env in envs
    ]
    output = ""
    for process in processes:
        out, _ = process.communicate(timeout=90)
        output += out
        assert process.returncode == 0, output
    return output


def test_program_runs_unchanged_under_slurm_variables(tmp_path: Path) -> None:
    port = str(free_port())
    envs = [
        {
            "SLURM_PROCID": str(r),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(r),
            "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": port,
        }
        for r in range(2)
    ]
    output = _run_pair(tmp_path, envs)
    assert "RESULT worker0 0 2 [1.0, 1.0]" in output
    assert "RESULT worker1 1 2 [2.0, 2.0]" in output


def test_program_runs_unchanged_under_torchrun(tmp_path: Path) -> None:
    launcher = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    output = _run_pair(tmp_path, [{"OMP_NUM_THREADS": "1"}], launcher)
    assert "RESULT worker0 0 2 [1.0, 1.0]" in output
    assert "RESULT worker1 1 2 [2.0, 2.0]" in output


def test_two_node_group_from_two_launch_commands(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(PYTHONPATH=REPO_ROOT, ACTORRPC_SECRET="two-node-test-secret")
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "actorrpc.cli.main",
                "launch",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(script),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        for node in range(2)
    ]
    output = ""
    for node in nodes:
        out, _ = node.communicate(timeout=100)
        output += out
        assert node.returncode == 0, output
    assert "RESULT worker0 0 2 [1.0, 1.0]" in output
    assert "RESULT worker1 1 2 [2.0, 2.0]" in output


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    # a worker retrying to connect to a not-yet-listening store port inside the ephemeral
    # range can be handed that port itself (a TCP self-connect) and hold it: EADDRINUSE
    import socket

    from actorrpc._ports import _ephemeral_start, free_ports

    ports = free_ports("127.0.0.1", 3)
    assert len(set(ports)) == 3
    assert all(10000 <= port < _ephemeral_start() for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
