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
  method or any other callable is pickled in the payload as before.
* A reference is the function's pickle by the wire pickler, so a name resolves on
  the callee exactly as the function itself would unpickle there, and a function
  the callee cannot import fails there with :class:`DeserializationError` naming it.
* Both tables are bounded (cleared when full): a program that makes functions
  without end does not grow them.
"""

from __future__ import annotations

import types
from typing import Any

from ..errors import DeserializationError, SerializationError
from ._pickling import dumps, loads

__all__ = ["function_reference", "resolve_function_reference"]

_TABLE_LIMIT = 4096
_references: dict[Any, bytes] = {}  # function -> the bytes that name it
_resolved: dict[bytes, Any] = {}  # those bytes -> the function they named here


def function_reference(func: Any) -> Any:
    """The bytes that name ``func`` if it travels by reference, else ``func`` itself."""
    cls = type(func)
    if cls is types.FunctionType:
        reference = _references.get(func)
        if reference is not None:
            return reference
        qualname = func.__qualname__
        if (func.__module__ in (None, "__main__") or "<lambda>" in qualname
                or "<locals>" in qualname):
            return func  # by value
    elif cls is types.BuiltinFunctionType:
        reference = _references.get(func)
        if reference is not None:
            return reference
        owner = func.__self__
        if owner is not None and type(owner) is not types.ModuleType:
            return func  # a bound method of some object
    else:
        return func
    try:
        reference, buffers = dumps(func, "func")
    except SerializationError:
        return func  # pickled in the payload, whose error names the field
    if buffers:
        return func
    if len(_references) >= _TABLE_LIMIT:
        _references.clear()
    _references[func] = reference
    return reference


def resolve_function_reference(reference: bytes) -> Any:
    """The function ``reference`` (from :func:`function_reference`) names on this worker.

    Raises:
        DeserializationError: it cannot be imported here (naming the module or name).
    """
    func = _resolved.get(reference)
    if func is None:
        func = loads(reference)  # (its DeserializationError names what failed)
        if not callable(func):
            raise DeserializationError(f"a call's function reference named {func!r}, "
                                       "which is not callable")
        if len(_resolved) >= _TABLE_LIMIT:
            _resolved.clear()
        _resolved[reference] = func
    return func
