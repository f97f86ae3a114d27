"""Packaging shim; metadata lives in setup.cfg.

`packages` is computed here because setup.cfg's ``find:`` cannot add the
top-level ``cli/`` folder, which is installed as ``actorrpc.cli`` through the
``package_dir`` mapping in setup.cfg (no top-level ``cli`` package is installed).

``ACTORRPC_COMPILE=1 pip install ...`` also compiles the per-message path (the modules in
``COMPILED_MODULES``) with mypyc: the build environment gets mypy, and a C compiler
must be present. Without it the package is pure Python, as before. Which build a process
runs is reported by ``actorrpc.compiled_modules()``; the rules compiled code
keeps are in ``actorrpc/_compiled.py``'s docstring.

Every build also tries one small C extension, ``actorrpc.transport._streaming_copy``
(a copy into shared memory with streaming stores); it is optional: where it cannot be
built, installing goes on without it. A build that can import torch (not pip's isolated
build environment: ``python setup.py build_ext --inplace`` or ``pip install
--no-build-isolation``) also tries ``actorrpc.autograd._native`` and
``actorrpc.serialization._native_codec``, C++ against torch's headers (a message's recv
node and a local backward pass over one node, without torch's Python layers and engine;
a tensor's wire form made and rebuilt without numpy), optional too.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup

packages = find_packages(include=["actorrpc", "actorrpc.*"], exclude=["actorrpc.cli*"])
packages += ["actorrpc.cli" + name[len("cli"):] for name in find_packages(include=["cli", "cli.*"])]

# The per-message path: what one call, its reply and a distributed backward run through.
COMPILED_MODULES = [
    "actorrpc/protocol/_wire.py",
    "actorrpc/transport/_link.py",
    "actorrpc/transport/_ring.py",
    "actorrpc/transport/_ring_inbox.py",
    "actorrpc/transport/_spin.py",
    "actorrpc/transport/_zmq.py",
    "actorrpc/serialization/_function_refs.py",
    "actorrpc/serialization/_pickling.py",
    "actorrpc/serialization/_tensors.py",
    "actorrpc/agent/_agent.py",
    "actorrpc/agent/_batch_scheduling.py",
    "actorrpc/agent/_call_result.py",
    "actorrpc/agent/_calls.py",
    "actorrpc/agent/_current.py",
    "actorrpc/agent/_deadlines.py",
    "actorrpc/agent/_deferred_riders.py",
    "actorrpc/agent/_dispatch.py",
    "actorrpc/agent/_held.py",
    "actorrpc/agent/_inbox.py",
    "actorrpc/agent/_liveness.py",
    "actorrpc/agent/_members.py",
    "actorrpc/agent/_pool.py",
    "actorrpc/agent/_replies.py",
    "actorrpc/agent/_riders.py",
    "actorrpc/agent/_shared_buffers.py",
    "actorrpc/agent/_timed_work.py",
    "actorrpc/autograd/_context.py",
    "actorrpc/autograd/_engine.py",
    "actorrpc/autograd/_functions.py",
    "actorrpc/autograd/_node_bodies.py",
    "actorrpc/autograd/_pass_driver.py",
    "actorrpc/autograd/_recording.py",
]
MYPY_FOR_COMPILING = "mypy==2.4.1"  # (constraints.txt pins the same one for linting)


_METADATA_ONLY = {"egg_info", "dist_info", "sdist"}  # (an sdist ships the sources only)


def _compile_requested() -> bool:
    return os.environ.get("ACTORRPC_COMPILE", "").lower() in ("1", "true", "yes")


def _compiled_extensions() -> list:  # type: ignore[type-arg]
    if not _compile_requested() or _METADATA_ONLY.intersection(sys.argv):
        return []  # (type-checking and translating take a minute or two: only when building)
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit(
            f"ACTORRPC_COMPILE=1 needs mypyc ({MYPY_FOR_COMPILING}) in the build environment"
        ) from None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    # torch, pyzmq, dill and numpy are typed as Any, wherever it is built: an isolated
    # build environment lacks them, and one program whether they are installed or not
    options = ["--no-site-packages", "--ignore-missing-imports", f"--python-version={version}"]
    return mypycify(options + COMPILED_MODULES, opt_level="3")


# Always attempted, never required: without a C compiler the package installs without it
# and fills shared-memory segments with the plain copy alone (transport/_segment_copy.py).
STREAMING_COPY = Extension(
    "actorrpc.transport._streaming_copy",
    ["actorrpc/transport/_streaming_copy.c"],
    optional=True,
)


def _native_extensions() -> list:  # type: ignore[type-arg]
    """The native steps written against torch's headers, built against the torch this
    build environment has: distributed autograd's (``actorrpc/autograd/_native.cpp``) and
    the tensor codec's (``actorrpc/serialization/_native_codec.cpp``). Optional, and only
    where torch is importable here (``python setup.py build_ext --inplace``, ``pip install
    --no-build-isolation``; pip's isolated build environment has no torch, and must not
    fetch one). Without them, the same steps run through torch's Python API and numpy."""
    if _METADATA_ONLY.intersection(sys.argv):
        return []
    try:
        import torch
        from torch.utils.cpp_extension import include_paths, library_paths
    except Exception:  # noqa: BLE001 - no torch, or a broken one: build without it
        return []
    extensions = []
    for name in ("actorrpc.autograd._native", "actorrpc.serialization._native_codec"):
        source = Path(*name.split(".")).with_suffix(".cpp")
        if not source.is_file():
            continue
        # (the loader compares it with the file beside the module: actorrpc._native_modules)
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
        extensions.append(Extension(
            name,
            [str(source)],
            include_dirs=include_paths(),
            library_dirs=library_paths(),
            libraries=["c10", "torch", "torch_cpu", "torch_python"],
            language="c++",
            extra_compile_args=[
                "-std=c++20",
                "-O2",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                f'-DACTORRPC_TORCH_VERSION="{torch.__version__}"',
                f'-DACTORRPC_SOURCE_DIGEST="{digest}"',
            ],
            optional=True,
        ))
    return extensions


setup(
    packages=packages,
    ext_modules=[STREAMING_COPY, *_native_extensions(), *_compiled_extensions()],
    setup_requires=[MYPY_FOR_COMPILING] if _compile_requested() else [],
)
