"""The compiled build (``ACTORRPC_COMPILE=1``, setup.py's ``COMPILED_MODULES``).

CI builds it in a staged copy and runs the integration tests there with
``ACTORRPC_EXPECT_COMPILED=1``, which makes the checks below required: every module
setup.py lists runs compiled in this process and in the session group's other workers.
On the pure-Python build they check that nothing claims to be compiled.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

import actorrpc as rpc
from actorrpc import compiled_modules

pytestmark = pytest.mark.timeout(60)

EXPECT_COMPILED = os.environ.get("ACTORRPC_EXPECT_COMPILED") == "1"
_ROOT = Path(__file__).resolve().parent.parent


def _listed_modules() -> list[str]:
    """setup.py's COMPILED_MODULES as module names (read, not imported: setup.py runs
    setup() when imported)."""
    tree = ast.parse((_ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMPILED_MODULES" for t in node.targets
        ):
            paths = ast.literal_eval(node.value)
            return sorted(p[: -len(".py")].replace("/", ".") for p in paths)
    raise AssertionError("setup.py has no COMPILED_MODULES")


def _loaded_compiled() -> list[str]:
    for name in _listed_modules():
        importlib.import_module(name)
    return compiled_modules()


def test_every_listed_module_has_its_source() -> None:
    for name in _listed_modules():
        path = _ROOT / (name.replace(".", "/") + ".py")
        assert path.is_file(), f"setup.py lists {name}, which has no source"


def test_this_process_runs_the_build_it_should() -> None:
    loaded = _loaded_compiled()
    if EXPECT_COMPILED:
        assert loaded == _listed_modules(), f"compiled: {loaded}"
    else:
        assert loaded == [], f"pure-Python run, yet compiled: {loaded}"


def test_the_other_workers_run_the_same_build(cluster: list[str]) -> None:
    here = _loaded_compiled()
    for name in cluster[1:]:
        there = rpc.rpc_sync(name, _loaded_compiled, timeout=20)
        assert there == here, f"{name} runs {there}, this process {here}"
