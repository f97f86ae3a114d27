"""Several hosts: workers in separate network namespaces joined by a veth pair.

The test makes two namespaces (hosts) with addresses from TEST-NET-1, runs one
worker in each over TCP, checks RPC, RRef sharing and distributed backward
across them, then takes the link down and checks that the failure is detected
and reported without a hang. Without permission to make namespaces it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._cluster import REPO_ROOT

pytestmark = pytest.mark.timeout(150)

ADDRESSES = ("192.0.2.1", "192.0.2.2")

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, torch
    import actorrpc as rpc
    import actorrpc.autograd as dist_autograd

    def owned_sum(rref):
        return rref.to_here().sum().item()

    rank = int(os.environ["RANK"])
    options = rpc.ZmqRpcBackendOptions(init_method="env://", rpc_timeout=20, dead_peer_timeout=2)
    rpc.init_rpc(f"host{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 1:
        try:
            rpc.shutdown(timeout=60)
        except Exception as exc:
            print("HOST1", type(exc).__name__, flush=True)
        sys.exit(0)
    result = {"endpoint": rpc.get_worker_info("host1").name}
    result["rpc"] = rpc.rpc_sync("host1", torch.add, args=(torch.ones(3), 2)).tolist()
    rref = rpc.remote("host1", torch.ones, args=(4,))
    result["rref_shared_back"] = rpc.rpc_sync("host1", owned_sum, args=(rref,))
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("host1", torch.mul, args=(x, 3.0))
        dist_autograd.backward(ctx, [y.sum()])
        result["grad"] = dist_autograd.get_gradients(ctx)[x].tolist()
    del rref
    pending_context = dist_autograd.context()
    context_id = pending_context.__enter__()
    z = rpc.rpc_sync("host1", torch.mul, args=(x, 2.0))
    print("READY_TO_CUT", flush=True)
    cut = sys.argv[1]
    deadline = time.monotonic() + 60
    while not os.path.exists(cut) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    try:
        dist_autograd.backward(context_id, [z.sum()])
        result["backward_after_cut"] = "finished"
    except Exception as exc:
        result["backward_after_cut"] = f"{type(exc).__name__}: {exc}"
    result["backward_failed_in"] = time.monotonic() - started
    try:
        pending_context.__exit__(None, None, None)
    except Exception:
        pass
    started = time.monotonic()
    try:
        rpc.rpc_sync("host1", torch.add, args=(torch.ones(1), 1))
        result["after_cut"] = "answered"
    except Exception as exc:
        result["after_cut"] = f"{type(exc).__name__}: {exc}"
    result["detected_in"] = time.monotonic() - started
    started = time.monotonic()
    try:
        rpc.shutdown(timeout=10)
        result["shutdown"] = "clean"
    except Exception as exc:
        result["shutdown"] = f"{type(exc).__name__}: {exc}"
    result["shutdown_in"] = time.monotonic() - started
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture()
def hosts() -> Iterator[list[str]]:
    tag = f"{os.getpid() % 100000}"
    names = [f"arh0_{tag}", f"arh1_{tag}"]
    links = [f"arv0_{tag}", f"arv1_{tag}"]
    try:
        for name in names:
            _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, ADDRESSES):
            _ip("link", "set", link, "netns", name)
            _ip("netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", link)
            _ip("netns", "exec", name, "ip", "link", "set", link, "up")
            _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield names + links
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_rpc_rrefs_and_backward_across_hosts_then_a_cut_link(
    hosts: list[str], tmp_path: Path
) -> None:
    h0, h1, _, link1 = hosts
    script = tmp_path / "host.py"
    script.write_text(_SCRIPT)
    cut = tmp_path / "cut"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, MASTER_ADDR=ADDRESSES[0], MASTER_PORT="29777",
               WORLD_SIZE="2", ACTORRPC_SECRET="multi-host-test-secret")
    workers = [
        subprocess.Popen(
            ["ip", "netns", "exec", host, sys.executable, str(script), str(cut)],
            env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=tmp_path,
        )
        for rank, host in enumerate((h0, h1))
    ]
    try:
        assert workers[0].stdout is not None
        lines = []
        for line in workers[0].stdout:
            lines.append(line)
            if line.startswith("READY_TO_CUT"):
                _ip("netns", "exec", h1, "ip", "link", "set", link1, "down")
                cut.touch()
                break
        rest, _ = workers[0].communicate(timeout=90)
        output = "".join(lines) + rest
        assert workers[0].returncode == 0, output
        result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert result["rpc"] == [3.0, 3.0, 3.0]
    assert result["rref_shared_back"] == 4.0
    assert result["grad"] == [3.0, 3.0]
    assert "host1" in result["backward_after_cut"], result
    assert "unreachable" in result["backward_after_cut"], result
    assert result["backward_failed_in"] < 15, result
    assert result["after_cut"].startswith("PeerUnreachableError") and "host1" in result["after_cut"]
    assert result["detected_in"] < 15, result
    assert result["shutdown"].startswith("ShutdownError") and "host1" in result["shutdown"]
    assert result["shutdown_in"] < 15, result
