"""The notebook workflow: a real Jupyter kernel drives local workers; Ctrl-C while waiting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._cluster import REPO_ROOT

pytestmark = pytest.mark.timeout(180)


def _outputs(cell: dict) -> str:  # type: ignore[type-arg]
    return "".join(out.get("text", "") for out in cell.get("outputs", []))


def test_example_notebook_runs_headless(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(os.path.join(REPO_ROOT, "examples", "notebook.ipynb"), as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = REPO_ROOT + os.pathsep + env_path
    try:
        nbclient.NotebookClient(
            notebook, timeout=120, kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    text = "\n".join(_outputs(c) for c in notebook.cells if c.cell_type == "code")
    assert "WorkerInfo(id=1, name=worker1)" in text
    assert "f -> 2" in text and "f -> 101" in text  # a re-defined function is sent anew
    assert "counter -> 15 16" in text
    assert "UserRRef(RRefId = GloballyUniqueId(" in text
    assert "awaited -> [3.0, 3.0]" in text
    assert "falling" in text and "NOT falling" not in text
    assert "initialized after shutdown: False" in text
    assert "again -> 102" in text


_INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import threading
    import actorrpc as rpc

    def wait_for_gate(gate):
        return gate.local_value().wait(60)

    group = rpc.local_workers(1)
    # a shipped function's globals travel as copies: share worker-side state through an actor
    gate = rpc.remote("worker1", threading.Event)
    future = rpc.rpc_async("worker1", wait_for_gate, args=(gate,))
    try:
        print("waiting", flush=True)  # inside the try: the signal may land right after it
        future.wait()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print("still works:", rpc.rpc_sync("worker1", len, args=([1, 2, 3],)), flush=True)
    gate.rpc_sync().set()
    print("gate result:", future.wait(), flush=True)
    del gate
    group.shutdown()
    print("done", flush=True)
    """
)


def test_ctrl_c_interrupts_the_wait_not_the_agent(tmp_path: Path) -> None:
    script = tmp_path / "interrupt.py"
    script.write_text(_INTERRUPT_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(os.environ, PYTHONPATH=REPO_ROOT), cwd=tmp_path,
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("waiting"):
            process.send_signal(signal.SIGINT)
            break
    rest, _ = process.communicate(timeout=120)
    output = "".join(lines) + rest
    assert process.returncode == 0, output
    assert "interrupted" in output
    assert "still works: 3" in output
    assert "gate result: True" in output
    assert "done" in output
