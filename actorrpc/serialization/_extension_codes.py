"""Pickle extension codes for the functions that rebuild tensors on the wire.

pickle names a global by its module and qualified name, and unpickling that name
imports the module again through the import system (~0.7 µs warm, a few µs when the
caches are cold, as they are between messages): one lookup per message that carries
a tensor. A global registered in :mod:`copyreg`'s extension registry travels as a
four-byte code instead (pickle's ``EXT4`` opcode) and unpickles with one dict
lookup.

Invariants:

* The codes are part of the wire format (``protocol._wire``, protocol version 10):
  fixed, :data:`FIRST_CODE` + the index given to :func:`register_extension_code`,
  the same in every worker of a group. A peer of another protocol version is
  refused on its first message, so no code meets a table other than its own.
* The registry is process-wide. Where another package holds one of these codes
  (or one of these globals under another code), this process would decode a peer's
  code into the wrong object: the registration is left out and
  :func:`check_extension_codes` (run when an agent starts) raises, naming both.
"""

from __future__ import annotations

import copyreg
from typing import Any

from ..errors import SerializationError

__all__ = ["FIRST_CODE", "check_extension_codes", "register_extension_code"]

FIRST_CODE = 0x61637200
"""The first of actorrpc's codes (``b"acr\\0"``; codes above 255 are left to applications
by pickle's registry, none of them assigned)."""

_conflicts: list[str] = []


def register_extension_code(obj: Any, index: int) -> None:
    """Let ``obj`` (a module-level function or class) travel as code ``FIRST_CODE + index``."""
    # (the key pickle's own save_global looks up: the object's module and qualified name)
    module, name = obj.__module__, getattr(obj, "__qualname__", None) or obj.__name__
    code = FIRST_CODE + index
    try:
        copyreg.add_extension(module, name, code)
    except ValueError as exc:  # the code or the global is registered otherwise
        _conflicts.append(f"{module}.{name} as code {code:#x} ({exc})")


def check_extension_codes() -> None:
    """Raise :class:`SerializationError` if one of actorrpc's codes could not be registered."""
    if _conflicts:
        raise SerializationError(
            "actorrpc's pickle extension codes clash with registrations of another package in "
            f"this process (copyreg.add_extension): {'; '.join(_conflicts)}; peers would send "
            "these codes for actorrpc's tensor rebuild functions, so this process cannot take part"
        )
