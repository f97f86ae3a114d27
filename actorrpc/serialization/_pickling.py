"""Pickling for the wire: protocol 5, out-of-band tensor buffers, dill only where needed.

Invariants:

* Tensor data never enters the pickle stream beyond a few KiB: a dense CPU tensor
  is reduced to its dtype, size (strides) and one buffer holding exactly the bytes
  its view spans (:mod:`._tensors`).
* Importable functions and classes travel by reference (plain pickle). Those
  defined in ``__main__``, in a notebook cell, as lambdas or closures travel by
  value through dill; the receiver caches what it rebuilt by content, so one
  definition maps to one object there and a re-defined one replaces it. A
  ``__main__`` definition that the receiver has too (same code) resolves to the
  receiver's own object, so programs launched from one script keep torch's
  by-reference semantics for their globals (:mod:`._by_value`).
* Upper layers (RRefs) add reducers by registration and read the thread-local
  :class:`PickleTarget` / :class:`UnpickleSource` to learn where bytes go or
  come from.
"""

from __future__ import annotations

import _pickle  # noqa: F401  (mypyc: _WirePickler needs the module)
import _thread  # noqa: F401  (mypyc: its threading.local subclass needs the module)
import io
import logging
import pickle
import threading
import types
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any, TypeVar

import torch
from mypy_extensions import mypyc_attr

from ..errors import DeserializationError, SerializationError
from ._by_value import reduce_by_value
from ._extension_codes import MEMOIZED_AFTER, memoized_codes, registered_object
from ._tensors import reduce_tensor

__all__ = [
    "PickleTarget",
    "UnpickleSource",
    "current_pickle_target",
    "current_unpickle_source",
    "dumps",
    "dumps_for",
    "loads",
    "loads_from",
    "register_reducer",
]

Reducer = Callable[[Any], Any]
_reducers: dict[type, Reducer] = {}


class PickleTarget:
    """Where the bytes being pickled on this thread will go (a worker id).

    Reducers with side effects (an RRef registers a fork when it is pickled)
    record an undo with :meth:`add_undo`, keyed by what the receiver will take
    over when it unpickles the object (the fork id). Whoever pickled calls
    :meth:`abort` when the bytes will never be sent (pickling failed midway, or
    the send did), or, with the keys the receiver reported as taken over, when
    the receiver could not unpickle the whole message.
    """

    __slots__ = ("_undo", "worker_id")

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self._undo: list[tuple[Hashable, Callable[[], None]]] = []

    def add_undo(self, key: Hashable, action: Callable[[], None]) -> None:
        self._undo.append((key, action))

    @property
    def has_undo(self) -> bool:
        return bool(self._undo)

    def abort(self, taken_over: Collection[Hashable] = ()) -> None:
        """Undo every side effect of pickling but those whose key is in ``taken_over``."""
        undo, self._undo = self._undo, []
        for key, action in reversed(undo):
            if key in taken_over:
                continue
            try:
                action()
            except Exception:  # noqa: BLE001 - undo what can be undone
                logging.getLogger("actorrpc.serialization").exception("undo after abort failed")


class UnpickleSource:
    """Which worker sent the bytes being unpickled on this thread."""

    __slots__ = ("pending", "taken_over", "worker_id")

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.pending: list[Any] = []  # futures to wait on before the payload may be used
        # keys (see PickleTarget.add_undo) of side effects this side took over while
        # unpickling: reported back when the rest of the message cannot be unpickled
        self.taken_over: list[Hashable] = []


# Typed as what a reducer may put in their place: read back after the pickling, these
# attributes must not be taken for None (mypy's narrowing, which compiled code checks)
_NO_TARGET: PickleTarget | None = None
_NO_SOURCE: UnpickleSource | None = None


def register_reducer(cls: type, reducer: Reducer) -> None:
    """Make ``reducer(obj)`` pickle instances of exactly ``cls`` on the wire."""
    _reducers[cls] = reducer


class _ThreadState:
    """What this thread's pickling keeps between messages: where the bytes it pickles go
    and those it unpickles come from, and its reusable pickler.

    The :class:`PickleTarget` / :class:`UnpickleSource` is made only when a reducer
    asks for it (an RRef's fork): most messages carry none, and each object made and
    context entered costs Python calls on every message. One plain object per thread,
    reached with one ``threading.local`` lookup per message: each attribute of a
    ``threading.local`` costs a lookup of the thread's dict (~0.5 µs a message in all).
    """

    __slots__ = ("buffers", "busy", "pickler", "source", "source_rank", "stream", "target",
                 "target_rank")

    def __init__(self) -> None:
        self.target: PickleTarget | None = None
        self.target_rank: int | None = None
        self.source: UnpickleSource | None = None
        self.source_rank: int | None = None
        self.busy = False  # the pickler is in use (a reducer pickling something re-entered)
        self.renew()

    def renew(self) -> None:
        """A fresh pickler, stream and buffer list (dropping the old memo table)."""
        self.stream = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        self.pickler = _WirePickler(self.stream, protocol=5, buffer_callback=self.buffers.append)


@mypyc_attr(native_class=False)  # (see actorrpc/_compiled.py)
class _PerThread(threading.local):
    state: _ThreadState

    def __init__(self) -> None:
        self.state = _ThreadState()


_RAW = pickle.PickleBuffer.raw  # (mapped over buffers: no Python frame each)
_ATOMIC_TYPES = frozenset({type(None), bool, int, float, str, bytes})
"""Types the C pickler writes itself, never asking ``reducer_override``: a payload of
exactly one of them pickles the same with plain :func:`pickle.dumps` (~0.2 µs), without
the thread's pickler and its target (~1.1 µs more): most results of small calls."""


_Endpoint = TypeVar("_Endpoint", PickleTarget, UnpickleSource)


def _made_on_demand(name: str, make: Callable[[int], _Endpoint]) -> _Endpoint | None:
    """This thread's ``name`` (target or source), made for its rank on first demand (only
    reducers that register side effects ask: not a per-message path)."""
    state = _per_thread.state
    made: _Endpoint | None = getattr(state, name)
    rank: int | None = getattr(state, name + "_rank")
    if made is None and rank is not None:
        made = make(rank)
        setattr(state, name, made)
    return made


def current_pickle_target() -> PickleTarget | None:
    """The target of the bytes being pickled on this thread (None outside :func:`dumps_for`)."""
    return _made_on_demand("target", PickleTarget)


def current_unpickle_source() -> UnpickleSource | None:
    """The source of the bytes being unpickled on this thread (None outside :func:`loads_from`)."""
    return _made_on_demand("source", UnpickleSource)


def dumps_for(
    worker_id: int, obj: Any, what: str | Sequence[str] = "object"
) -> tuple[bytes, list[memoryview], PickleTarget | None]:
    """:func:`dumps` of bytes that go to worker ``worker_id``, and the
    :class:`PickleTarget` of what pickling registered for them (None when nothing
    was). If pickling fails, what it registered is undone before the error is raised.
    """
    if type(obj) in _ATOMIC_TYPES:
        return pickle.dumps(obj, 5), [], None
    state = _per_thread.state
    previous = state.target, state.target_rank
    state.target, state.target_rank = _NO_TARGET, worker_id
    try:
        body, pickle_buffers = _dump(obj, state)  # (as dumps(), without a call more)
    except BaseException as exc:
        try:  # named while the target is still this one (naming pickles parts again)
            error = _pickling_error(obj, what, exc) if isinstance(exc, Exception) else exc
        finally:  # (also when naming fails: what was registered is undone all the same)
            target = state.target
            state.target, state.target_rank = previous
            if target is not None:
                target.abort()
        if error is exc:
            raise
        raise error from exc
    target = state.target
    state.target, state.target_rank = previous
    return body, list(map(_RAW, pickle_buffers)) if pickle_buffers else [], target


def loads_from(
    worker_id: int, payload: Any, buffers: Sequence[Any] = ()
) -> tuple[Any, UnpickleSource | None]:
    """:func:`loads` of bytes from worker ``worker_id``, and the :class:`UnpickleSource`
    that unpickling them needed (None when nothing asked for one).

    Raises:
        DeserializationError: its ``taken_over`` names what this side took over before
            the failure (see :class:`UnpickleSource`).
    """
    state = _per_thread.state
    previous = state.source, state.source_rank
    state.source, state.source_rank = _NO_SOURCE, worker_id
    try:
        return pickle.loads(payload, buffers=buffers), state.source  # (as loads())
    except Exception as exc:
        error = _unpickling_error(exc)
        source = state.source
        error.taken_over = () if source is None else tuple(source.taken_over)
        raise error from exc
    finally:
        state.source, state.source_rank = previous


def _torch_function(name: str) -> Any:
    """``torch.<name>``: how a function of the ``torch`` namespace travels."""
    return getattr(torch, name)


# reductions of builtin functions of modules, by function: torch's own ("torch.add")
# reduce to one global and a name (their own reduction is getattr on a C class: three
# objects to pickle, each a call of the reducer); others to NotImplemented (pickle's
# by-name reference)
_builtin_reductions: dict[Any, Any] = {}


def _reduce_builtin(obj: Any) -> Any:
    self = obj.__self__
    if self is not None and type(self) is not types.ModuleType:
        return NotImplemented  # a bound method of some object: never cached
    reduction = _builtin_reductions.get(obj)
    if reduction is None:
        name = obj.__name__
        is_torch = getattr(obj, "__module__", None) == "torch" and getattr(torch, name, None) is obj
        reduction = (_torch_function, (name,)) if is_torch else NotImplemented
        _builtin_reductions[obj] = reduction
    return reduction


register_reducer(types.BuiltinFunctionType, _reduce_builtin)


@mypyc_attr(native_class=False)  # (see actorrpc/_compiled.py)
class _WirePickler(pickle.Pickler):
    # saves of the objects in ``memoized_codes`` (tensor rebuild functions) in this pickle
    # (reset by ``_dump``; a fresh pickler starts at 0)
    memoized_saves = 0

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return reduce_tensor(obj)
        registered = memoized_codes.get(id(obj))
        if registered is not None:  # its code alone the first times, then memoized (the
            # memo answers later saves before this is asked again: see _extension_codes)
            self.memoized_saves = saves = self.memoized_saves + 1
            if saves > MEMOIZED_AFTER:
                return registered_object, (registered[0],)
            # its name: pickle writes the global (as its code) without first asking the
            # object for a reduction (a compiled function's __reduce_ex__ and __reduce__)
            return registered[1]
        reducer = _reducers.get(cls)
        if reducer is not None:
            return reducer(obj)
        if cls is types.FunctionType or isinstance(obj, type):
            # by value: what the receiver cannot import by name (inline: a call per message)
            module = getattr(obj, "__module__", None)
            qualname = getattr(obj, "__qualname__", "")
            if module in (None, "__main__") or "<lambda>" in qualname or "<locals>" in qualname:
                return reduce_by_value(obj)
        return NotImplemented


_PLAIN_KEYS = (str, int, float, bool, bytes, type(None))


def _describe(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception as exc:  # noqa: BLE001 - the error names the culprit all the same
        text = f"<an object whose repr() raised {type(exc).__name__}>"
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{text} (type {type(obj).__module__}.{type(obj).__qualname__})"


def _find_unpicklable(obj: Any, path: str, depth: int = 0) -> str | None:
    """Locate the first element of ``obj`` that cannot be pickled, as a path."""
    items: Sequence[tuple[str, Any]] = ()
    if depth < 4 and isinstance(obj, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif depth < 4 and isinstance(obj, dict):
        items = [(f"{path}[{_describe(k) if type(k) not in _PLAIN_KEYS else repr(k)}]", v)
                 for k, v in obj.items()]
    for sub_path, value in items:
        try:
            _dump(value)
        except Exception:
            inner = _find_unpicklable(value, sub_path, depth + 1)
            return inner or f"{sub_path} = {_describe(value)}"
    return None


_per_thread = _PerThread()  # (after _WirePickler: made, with its pickler, for this thread now)

REUSED_PICKLER_LIMIT = 1024
"""A thread's pickler is reused only after payloads of at most this many bytes.

Its memo table never shrinks, and clearing it (after every message) costs time in
proportion to the largest size it ever had: one payload of 200,000 objects made every
later message pickled on that thread ~0.7 ms slower. A payload of ``n`` bytes memoizes
fewer than ``n / 2`` objects, so a pickler kept after at most this many bytes clears in
about a microsecond; after a bigger payload (or a failed one) the thread gets a fresh
pickler, which costs ~1 µs, little next to pickling that payload."""


def _dump(obj: Any, state: _ThreadState | None = None) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj`` with this thread's reusable pickler (``state``: the thread's, if
    the caller has it at hand); a fresh one when that is in use."""
    if state is None:
        state = _per_thread.state
    if state.busy:  # re-entered (a reducer pickling something): use a fresh pickler
        buffers: list[pickle.PickleBuffer] = []
        stream = io.BytesIO()
        _WirePickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
        return stream.getvalue(), buffers
    state.busy = True
    payload = b""  # stays empty if pickling fails (a pickle is never empty)
    try:
        state.pickler.memoized_saves = 0
        state.pickler.dump(obj)
        payload = state.stream.getvalue()
        buffers = list(state.buffers)
    finally:
        if 0 < len(payload) <= REUSED_PICKLER_LIMIT:
            state.stream.seek(0)
            state.stream.truncate()
            state.buffers.clear()
            state.pickler.clear_memo()
        else:
            state.renew()
        state.busy = False
    return payload, buffers


def _locate(obj: Any, what: str | Sequence[str]) -> str:
    if isinstance(what, str):
        return _find_unpicklable(obj, what) or _describe(obj)
    # ``what`` names the fields of a tuple payload, e.g. ("func", "args", "kwargs")
    for name, field in zip(what, obj):
        try:
            _dump(field)
        except Exception:
            return _find_unpicklable(field, name) or f"{name} = {_describe(field)}"
    return _describe(obj)


def dumps(obj: Any, what: str | Sequence[str] = "object") -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj`` into a payload and its out-of-band buffers.

    ``what`` names ``obj`` (or, as a sequence, the fields of a tuple ``obj``)
    in the error message.

    Raises:
        SerializationError: naming the element that cannot be pickled.
    """
    try:
        payload, buffers = _dump(obj)
    except Exception as exc:
        error = _pickling_error(obj, what, exc)
        if error is exc:
            raise
        raise error from exc
    return payload, list(map(_RAW, buffers)) if buffers else []


def _pickling_error(obj: Any, what: str | Sequence[str], exc: Exception) -> SerializationError:
    """The error to raise for ``obj`` that could not be pickled (``exc`` itself if it is one)."""
    if isinstance(exc, SerializationError):
        return exc
    culprit = _locate(obj, what)
    return SerializationError(f"cannot pickle {culprit}: {type(exc).__name__}: {exc}")


def loads(payload: Any, buffers: Sequence[Any] = ()) -> Any:
    """Unpickle a payload produced by :func:`dumps`.

    Raises:
        DeserializationError: when the bytes cannot be unpickled on this worker.
    """
    try:
        return pickle.loads(payload, buffers=buffers)
    except Exception as exc:
        raise _unpickling_error(exc) from exc


def _unpickling_error(exc: Exception) -> DeserializationError:
    return DeserializationError(f"cannot unpickle: {type(exc).__name__}: {exc}")
