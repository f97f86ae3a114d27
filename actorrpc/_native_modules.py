"""Loading the optional extensions written against torch's headers.

``actorrpc.autograd._native`` (distributed autograd's native steps) and
``actorrpc.serialization._native_codec`` (the tensor codec's) read torch's structures
directly, so each is used only under the torch it was built against and, where its C++
source lies beside it (a checkout built in place), only when built from that source: a
stale build is refused with a warning, and the Python path (torch's Python API, numpy)
runs instead. Neither is built where the build could not import torch (pip's isolated
build environment); ``setup.py`` records the torch version and the source's digest.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_native", "native_source_digest"]


def native_source_digest(source: bytes) -> str:
    """What an extension records of the source it was built from (setup.py passes it)."""
    return hashlib.sha256(source).hexdigest()[:16]


def load_native(name: str, instead: str, logger: logging.Logger) -> Any:
    """The extension module ``name`` (e.g. ``actorrpc.autograd._native``) if it was built
    against this torch and from the source beside it (if any); else None, with a warning
    on ``logger`` saying that ``instead`` runs in its place."""
    try:
        module: Any = importlib.import_module(name)
    except ImportError:  # (not built: pip's isolated build environment has no torch)
        return None
    if torch.__version__ != module.TORCH_VERSION:  # it reads torch's structures directly
        logger.warning(
            "%s was built against torch %s, not this torch (%s): %s instead; rebuild actorrpc",
            name, module.TORCH_VERSION, torch.__version__, instead,
        )
        return None
    source = Path(module.__file__).with_name(name.rsplit(".", 1)[1] + ".cpp")
    if source.is_file() and native_source_digest(source.read_bytes()) != module.SOURCE_DIGEST:
        logger.warning(
            "%s was built from other sources than %s: %s instead; rebuild it (python "
            "setup.py build_ext --inplace)", name, source, instead,
        )
        return None
    return module
