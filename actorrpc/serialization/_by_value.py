"""Functions and classes that travel by value (dill): the pickling of what the receiver
cannot import by name, and its rebuilding there.

Kept apart from :mod:`._pickling`, whose per-message path may be compiled (mypyc):
``dill.Pickler``'s subclass here must stay a Python class.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import sys
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any

import dill

from ..errors import DeserializationError

__all__ = ["reduce_by_value"]

_by_value_cache: weakref.WeakKeyDictionary[Any, tuple[Any, bytes, bytes]] = (
    weakref.WeakKeyDictionary()
)
_rebuilt_cache: OrderedDict[bytes, Any] = OrderedDict()
_rebuilt_lock = threading.Lock()
_REBUILT_CACHE_SIZE = 512


def _load_by_value(blob: bytes) -> Any:
    key = hashlib.blake2b(blob, digest_size=16).digest()
    with _rebuilt_lock:
        obj = _rebuilt_cache.get(key)
        if obj is not None:
            _rebuilt_cache.move_to_end(key)
            return obj
    obj = dill.loads(blob)
    with _rebuilt_lock:
        _rebuilt_cache[key] = obj
        if len(_rebuilt_cache) > _REBUILT_CACHE_SIZE:
            _rebuilt_cache.popitem(last=False)
    return obj


def _code_fingerprint(code: types.CodeType) -> bytes:
    """Hash of a code object that is stable across processes (nested code included)."""
    consts = tuple(
        _code_fingerprint(c) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    text = repr((code.co_code, consts, code.co_names, code.co_varnames)).encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def _code_digest(obj: Any) -> bytes:
    """A fingerprint of a function's code, or of a class's name, bases and methods."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        return _code_fingerprint(code)
    if isinstance(obj, type):
        parts = [obj.__qualname__.encode(), *(b.__qualname__.encode() for b in obj.__bases__)]
        for name, member in sorted(vars(obj).items()):
            function = getattr(member, "__func__", member)  # static/class methods
            if isinstance(function, types.FunctionType):
                parts.append(name.encode() + _code_fingerprint(function.__code__))
        return hashlib.blake2b(b"|".join(parts), digest_size=16).digest()
    return str(getattr(obj, "__qualname__", "")).encode()


# qualname -> (this process's ``__main__`` function, its code object, that code's digest):
# a call of a ``__main__`` function arrives with the caller's digest, compared with the
# receiver's own on every call (a fingerprint costs ~2.6 µs warm). Kept while the
# function and its code are the same objects: a redefinition (a notebook cell run again)
# or a new ``__code__`` is fingerprinted afresh.
_main_digests: dict[str, tuple[Any, types.CodeType, bytes]] = {}


def _main_digest(qualname: str, target: Any) -> bytes:
    """``_code_digest(target)`` for the receiver's ``__main__`` definition ``qualname``."""
    code = getattr(target, "__code__", None)
    if not isinstance(code, types.CodeType):
        return _code_digest(target)  # a class: its methods may change without a new object
    entry = _main_digests.get(qualname)
    if entry is not None and entry[0] is target and entry[1] is code:
        return entry[2]
    digest = _code_fingerprint(code)
    _main_digests[qualname] = (target, code, digest)
    return digest


def _load_main_or_value(qualname: str, digest: bytes, blob: bytes | None, error: str = "") -> Any:
    """Prefer the receiver's own ``__main__`` definition when it is the same code.

    Workers started from one script (``actorrpc launch``, torchrun) then use
    their own globals, as with torch; a notebook's definitions, which the
    workers lack, are rebuilt from the shipped bytes.
    """
    target: Any = sys.modules.get("__main__")
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            break
    if target is not None and _main_digest(qualname, target) == digest:
        return target
    if blob is None:
        raise DeserializationError(
            f"{qualname!r} from the caller's __main__ is not defined here with the same code, "
            f"and it could not be shipped by value: {error}"
        )
    return _load_by_value(blob)


class _ModulesByReference(dill.Pickler):  # type: ignore[misc]
    """dill, except that every importable module travels by name.

    dill ships modules it does not consider installed (a project run from its
    checkout, an editable install) by value, which fails for most of them.
    """

    dispatch = dill.Pickler.dispatch.copy()


_dill_save_module = dill.Pickler.dispatch[types.ModuleType]


def _save_module(pickler: Any, module: types.ModuleType) -> None:
    if module.__name__ != "__main__" and sys.modules.get(module.__name__) is module:
        pickler.save_reduce(importlib.import_module, (module.__name__,), obj=module)
    else:
        _dill_save_module(pickler, module)


_ModulesByReference.dispatch[types.ModuleType] = _save_module


def _dill_dumps(obj: Any) -> bytes:
    stream = io.BytesIO()
    _ModulesByReference(stream, protocol=5, recurse=True).dump(obj)
    return stream.getvalue()


def reduce_by_value(obj: Any) -> Any:
    """The reduction of a function or class that travels by value."""
    code = getattr(obj, "__code__", None)
    try:
        cached = _by_value_cache.get(obj)
    except TypeError:
        cached = None
    qualname = getattr(obj, "__qualname__", "")
    from_main = getattr(obj, "__module__", None) == "__main__" and "<" not in qualname
    if cached is not None and cached[0] is code:
        blob, digest = cached[1], cached[2]
    else:
        digest = _code_digest(obj)
        try:
            blob = _dill_dumps(obj)
        except Exception as exc:
            if not from_main:
                raise
            # the receiver may still have it (same script); otherwise it raises there
            return _load_main_or_value, (qualname, digest, None, f"{type(exc).__name__}: {exc}")
        try:
            _by_value_cache[obj] = (code, blob, digest)
        except TypeError:
            pass
    if from_main:
        return _load_main_or_value, (qualname, digest, blob)
    return _load_by_value, (blob,)
