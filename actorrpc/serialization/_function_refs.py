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
  ``__main__``, a lambda or a closure (by value, see ``_by_value``), a bound
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
# function -> (its module, its name there, the bytes that name it)
_references: dict[Any, tuple[types.ModuleType, str, bytes]] = {}
# those bytes -> (the module that named the function here, its name there, the function)
_resolved: dict[bytes, tuple[types.ModuleType, str, Any]] = {}


def _name_of(func: Any) -> str:
    """The name its module holds ``func`` under: its qualified name (a builtin: its name,
    as ``torch.add``, whose qualified name is its class's)."""
    if type(func) is types.BuiltinFunctionType:
        return func.__name__  # type: ignore[no-any-return]
    return getattr(func, "__qualname__", "")  # ("": any other callable a reference named)


def _home(func: Any) -> tuple[types.ModuleType, str] | None:
    """The module (as ``sys.modules`` has it now) that holds ``func`` under its plain
    undotted name, and that name; None if there is none."""
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    name = _name_of(func)
    namespace = getattr(module, "__dict__", None)
    if namespace is None or "." in name or "<" in name or namespace.get(name) is not func:
        return None
    return module, name  # type: ignore[return-value]


def _at_home(func: Any, module: types.ModuleType, name: str) -> bool:
    """Whether ``func`` is still what ``sys.modules`` says its module holds under ``name``
    (a reload, ``mock.patch``, a renamed function or a re-imported module: no longer)."""
    return (module.__dict__.get(name) is func and sys.modules.get(func.__module__) is module
            and _name_of(func) == name)


def function_reference(func: Any) -> Any:
    """The bytes that name ``func`` if it travels by reference, else ``func`` itself."""
    cls = type(func)
    if cls is types.FunctionType or cls is types.BuiltinFunctionType:
        entry = _references.get(func)
        if entry is not None and _at_home(func, entry[0], entry[1]):
            return entry[2]
    else:
        return func
    if cls is types.FunctionType:
        if func.__module__ in (None, "__main__"):
            return func  # by value
    elif func.__self__ is not None and type(func.__self__) is not types.ModuleType:
        return func  # a builtin bound to some object
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
    if entry is not None and _at_home(entry[2], entry[0], entry[1]):
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
