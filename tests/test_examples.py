"""The worked examples, end to end: each is run with ``actorrpc launch`` as a user would.

``--check`` runs compare every step's loss with a single-process run of the same
model, data and seed and print "-> OK" (exit code 0) or "-> MISMATCH" (1). Few
steps keep each run well under 20 seconds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "actorrpc.cli.main", "launch"]


def _launch(nproc: int, script: str | Path, *args: str, timeout: float = 100) -> tuple[int, str]:
    """Run ``actorrpc launch`` to completion from the repo root; return (exit code, output)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORRPC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc-per-node", str(nproc), str(script), *args],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher forwards SIGTERM to its workers
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish within {timeout} s; output:\n{out}")
    return proc.returncode, out


def _assert_check_ok(code: int, out: str) -> None:
    assert code == 0, out
    assert re.search(r"check: .* -> OK$", out, re.MULTILINE), out
    assert "MISMATCH" not in out, out


def _final_losses(out: str) -> dict[str, tuple[float, float]]:
    """``{trainer: (final loss, first loss)}`` from the "final loss X (first Y)" lines."""
    return {
        m["who"]: (float(m["final"]), float(m["first"]))
        for m in re.finditer(
            r"(?P<who>\w+) final loss (?P<final>[\d.]+) \(first (?P<first>[\d.]+)\)", out
        )
    }


@pytest.mark.timeout(120)
def test_parameter_server_check() -> None:
    code, out = _launch(2, "examples/parameter_server.py", "--check", "--steps", "8")
    _assert_check_ok(code, out)


@pytest.mark.timeout(120)
def test_parameter_server_two_trainers_loss_falls() -> None:
    code, out = _launch(3, "examples/parameter_server.py", "--steps", "20")
    assert code == 0, out
    losses = _final_losses(out)
    assert set(losses) == {"trainer1", "trainer2"}, out
    for final, first in losses.values():
        assert final < first, out


@pytest.mark.timeout(120)
def test_rnn_model_parallel_check() -> None:
    code, out = _launch(2, "examples/rnn_model_parallel.py", "--check", "--steps", "10")
    _assert_check_ok(code, out)
    final, first = _final_losses(out)["trainer1"]
    assert final < first, out


@pytest.mark.timeout(120)
def test_pipeline_parallel_check() -> None:
    code, out = _launch(3, "examples/pipeline_parallel.py", "--check", "--steps", "10")
    _assert_check_ok(code, out)
    final, first = _final_losses(out)["driver"]
    assert final < first, out


@pytest.mark.timeout(120)
def test_batch_update_ps_check() -> None:
    code, out = _launch(2, "examples/batch_update_ps.py", "--check", "--steps", "10")
    _assert_check_ok(code, out)
    assert "ps applied 10 batch updates" in out, out


@pytest.mark.timeout(120)
def test_batch_update_ps_two_trainers_one_update_per_round() -> None:
    code, out = _launch(3, "examples/batch_update_ps.py", "--steps", "12")
    assert code == 0, out
    assert "ps applied 12 batch updates" in out, out
    losses = _final_losses(out)
    assert set(losses) == {"trainer1", "trainer2"}, out
    for final, first in losses.values():
        assert final < first, out


@pytest.mark.timeout(120)
def test_main_function_with_comprehension_called_by_rpc(tmp_path: Path) -> None:
    script = tmp_path / "comprehension.py"
    script.write_text(textwrap.dedent("""
        import os, struct, sys
        import actorrpc as rpc

        PACKER = struct.Struct("i")  # a global that cannot be shipped by value

        def squares(n):
            PACKER.pack(n)
            return [i * i for i in range(n)]

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
        if rank == 0:
            print("result", rpc.rpc_sync("w1", squares, args=(4,)), flush=True)
        rpc.shutdown()
    """))
    code, out = _launch(2, script, timeout=60)
    assert code == 0, out
    assert "result [0, 1, 4, 9]" in out, out
