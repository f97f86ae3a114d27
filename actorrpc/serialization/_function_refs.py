"""A called function as the bytes of its by-reference pickle, made once per function.

A call's payload starts with the function (wire format: ``protocol._wire``). One
that travels by reference (an importable function, a builtin of a module such as
``torch.add``) pickles to the same few bytes every time: its module and name.
Pickling it looks the module up through the import system and the name in it
(~0.7 µs a call), and unpickling imports and looks up again (~0.5 µs). So the
caller sends those bytes, made once per function (:func:`function_reference`),
and the callee keeps what each such reference resolved to
(:func:`resolve_function_reference`).

Invariants:

* Only what travels by reference becomes a reference: a function defined in
  ``__main__``, a lambda or a closure (by value, see ``_pickling``), a bound
  method, a function its module does not hold under its qualified name (a static
  method, a replaced function) or any other callable is pickled in the payload as
  before.
* A reference is the function's pickle by the wire pickler, so a name resolves on
  the callee exactly as the function itself would unpickle there, and a function
  the callee cannot import fails there with :class:`DeserializationError` naming it.
* Both sides look the name up again in its module's namespace on every use (one
  dict lookup) and make or resolve the reference anew when it names another
  object now: a function rebound in its module (a reload, ``mock.patch``) is
  called as the module has it, and a stale function object fails to pickle, as
  plain pickling would.
* Both tables are bounded (cleared when full): a program that makes functions
  without end does not grow them.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ..errors import DeserializationError, SerializationError
from ._pickling import dumps, loads

__all__ = ["function_reference", "resolve_function_reference"]

_TABLE_LIMIT = 4096
# function -> (the namespace that names it, its name there, the bytes that name it)
_references: dict[Any, tuple[dict[str, Any], str, bytes]] = {}
# those bytes -> (the namespace that named the function here, its name, the function)
_resolved: dict[bytes, tuple[dict[str, Any], str, Any]] = {}


def _home(func: Any) -> tuple[dict[str, Any], str] | None:
    """The dict of the module that holds ``func`` and its name there, if it has one: its
    qualified name, undotted (a builtin: its name, as ``torch.add``, whose qualified name
    is its class's)."""
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    name = func.__name__ if type(func) is types.BuiltinFunctionType else func.__qualname__
    if module is None or "." in name or "<" in name:
        return None
    namespace = vars(module)
    return (namespace, name) if namespace.get(name) is func else None


def function_reference(func: Any) -> Any:
    """The bytes that name ``func`` if it travels by reference, else ``func`` itself."""
    cls = type(func)
    if cls is types.FunctionType or cls is types.BuiltinFunctionType:
        entry = _references.get(func)
        if entry is not None and entry[0].get(entry[1]) is func:
            return entry[2]
    else:
        return func
    if cls is types.FunctionType and func.__module__ in (None, "__main__"):
        return func  # by value
    # (a builtin bound to some object has no module that names it: it stays in the payload)
    home = _home(func)
    if home is None:
        _references.pop(func, None)
        return func  # pickled in the payload (a stale one fails there, naming it)
    try:
        reference, buffers = dumps(func, "func")
    except SerializationError:
        return func  # pickled in the payload, whose error names the field
    if buffers:
        return func
    if len(_references) >= _TABLE_LIMIT:
        _references.clear()
    _references[func] = (*home, reference)
    return reference


def resolve_function_reference(reference: bytes) -> Any:
    """The function ``reference`` (from :func:`function_reference`) names on this worker.

    Raises:
        DeserializationError: it cannot be imported here (naming the module or name).
    """
    entry = _resolved.get(reference)
    if entry is not None and entry[0].get(entry[1]) is entry[2]:
        return entry[2]
    func = loads(reference)  # (its DeserializationError names what failed)
    if not callable(func):
        raise DeserializationError(f"a call's function reference named {func!r}, "
                                   "which is not callable")
    home = _home(func)
    if home is None:
        _resolved.pop(reference, None)
        return func  # (resolved again on every call)
    if len(_resolved) >= _TABLE_LIMIT:
        _resolved.clear()
    _resolved[reference] = (*home, func)
    return func
