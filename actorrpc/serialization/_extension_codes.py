"""Pickle extension codes for the functions that rebuild tensors on the wire.

pickle names a global by its module and qualified name, and unpickling that name
imports the module again through the import system (~0.7 µs warm, a few µs when the
caches are cold, as they are between messages): one lookup per message that carries
a tensor. A global registered in :mod:`copyreg`'s extension registry travels as a
four-byte code instead (pickle's ``EXT4`` opcode) and unpickles with one dict
lookup.

Invariants:

* The codes are part of the wire format (``protocol._wire``, protocol version 11):
  fixed, :data:`FIRST_CODE` + the index given to :func:`register_extension_code`,
  the same in every worker of a group. A peer of another protocol version is
  refused on its first message, so no code meets a table other than its own.
* The registry is process-wide. A process whose registry does not map each code to
  its global and back when it joins a group (another package holds the code or the
  global, or removed the registration) would decode a peer's code into the wrong
  object, or not at all: :func:`check_extension_codes` (``init_rpc``, before the
  rendezvous) raises instead, naming what holds them.
* Every pickle of these functions made in a process that imported actorrpc carries
  the codes, so it unpickles only where actorrpc is imported too. Only the wire's
  pickler reduces tensors to them.
* pickle does not memoize what it writes as an extension code, so each tensor of a
  message would name its function again, and the pickler checks a global by importing
  its module each time (~1 µs a tensor between messages: an ``rpc_sync`` of 32 small
  tensors took 135 µs, 103 with the memo). From the third save of any of them in one
  pickle on (:data:`MEMOIZED_AFTER`), the wire's pickler writes the function as
  ``registered_object(code)`` instead, which pickle memoizes: its later saves in that
  pickle are memo references (``registered_object`` has a code of its own). Messages of
  one or two tensors, the common case, never pay for the call it costs to unpickle.
"""

from __future__ import annotations

import copyreg
import pickle
from typing import Any

from ..errors import RendezvousError

__all__ = [
    "FIRST_CODE",
    "MEMOIZED_AFTER",
    "check_extension_codes",
    "memoized_codes",
    "register_extension_code",
    "registered_object",
]

FIRST_CODE = 0x61637200
"""The first of actorrpc's codes (``b"acr\\0"``). pickle's registry reserves codes from 256
on for future assignment (none assigned so far, and few packages use the registry at
all); :func:`check_extension_codes` guards against another use of them."""

MEMOIZED_AFTER = 2
"""Saves of a memoized object (``register_extension_code(..., memoized=True)``) in one
pickle written as its code alone; the next one goes through :func:`registered_object`."""

# (module, qualified name, code) of each registration: the key pickle's save_global looks up
_wanted: list[tuple[str, str, int]] = []
_by_code: dict[int, Any] = {}  # each registered object, by its code
memoized_codes: dict[int, tuple[int, str]] = {}
"""``id(obj)`` -> (code, qualified name), for the registered objects a message may carry
many times (the wire's pickler consults it: see the module docstring)."""


def register_extension_code(obj: Any, index: int, memoized: bool = False) -> None:
    """Let ``obj`` (a module-level function or class) travel as code ``FIRST_CODE + index``
    (left out where the code or ``obj`` is registered otherwise: see the module docstring);
    ``memoized``: the wire's pickler memoizes it in a pickle that saves it often."""
    module, name = obj.__module__, getattr(obj, "__qualname__", None) or obj.__name__
    code = FIRST_CODE + index
    _wanted.append((module, name, code))
    _by_code[code] = obj
    if memoized:
        memoized_codes[id(obj)] = code, name  # (the object lives as long as its module)
    try:
        copyreg.add_extension(module, name, code)
    except ValueError:
        pass  # (named by check_extension_codes)


def registered_object(code: int) -> Any:
    """The object actorrpc registered under extension code ``code`` (how a pickle refers to
    one it memoizes; see the module docstring)."""
    try:
        return _by_code[code]
    except KeyError:
        raise pickle.UnpicklingError(
            f"no actorrpc object is registered under extension code {code:#x}"
        ) from None


def _holder(code: int) -> str:
    key = copyreg._inverted_registry.get(code)  # type: ignore[attr-defined]
    return "nothing" if key is None else ".".join(key)


def check_extension_codes() -> None:
    """Raise :class:`RendezvousError` unless each of actorrpc's codes maps to its global and
    back in this process's registry."""
    registry: dict[tuple[str, str], int] = copyreg._extension_registry  # type: ignore[attr-defined]
    clashes = []
    for module, name, code in _wanted:
        held = registry.get((module, name))
        if held != code or copyreg._inverted_registry.get(code) != (module, name):  # type: ignore[attr-defined]
            now = "" if held is None or held == code else f"; {module}.{name} has code {held:#x}"
            clashes.append(f"code {code:#x} for {module}.{name} is held by {_holder(code)}{now}")
    if clashes:
        raise RendezvousError(
            "this process cannot join an actorrpc group: actorrpc sends its tensor rebuild "
            "functions as pickle extension codes, and this process's copyreg registry maps them "
            f"otherwise ({'; '.join(clashes)}); run it without the registration that takes them "
            "(copyreg.add_extension)"
        )


register_extension_code(registered_object, 3)  # (the index is part of the wire format)
