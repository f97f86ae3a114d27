"""A call's function travels as the bytes that name it when it is importable
(``serialization/_function_refs.py``): made once by the caller, resolved once by the callee."""

from __future__ import annotations

import functools
import operator
import pickle
import sys
import types
from typing import Any

import pytest
import torch

import actorrpc as rpc
from actorrpc.agent import _agent
from actorrpc.serialization import _function_refs, dumps_for
from actorrpc.serialization._function_refs import function_reference, resolve_function_reference

pytestmark = pytest.mark.timeout(60)


def importable(x: Any) -> Any:
    return x


class _Callable:
    def __call__(self, x: Any) -> Any:
        return x

    def method(self, x: Any) -> Any:
        return x


def test_importable_functions_and_module_builtins_become_references_made_once() -> None:
    for func in (importable, operator.add, torch.add):
        reference = function_reference(func)
        assert type(reference) is bytes
        assert function_reference(func) is reference  # the same bytes: made once
        assert resolve_function_reference(reference) is func


def test_what_travels_by_value_or_is_no_function_stays_in_the_payload() -> None:
    def local(x: Any) -> Any:
        return x

    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec("def by_main(x):\n    return x", namespace)  # noqa: S102 - a __main__ function
    by_main = namespace["by_main"]
    assert by_main.__module__ == "__main__" and by_main.__qualname__ == "by_main"
    instance = _Callable()
    for func in (local, lambda x: x, by_main, instance, instance.method,
                 functools.partial(importable, 1), [].append, "not callable"):
        assert function_reference(func) is func


def test_a_callee_resolves_each_reference_once(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[bytes] = []
    real_loads = _function_refs.loads

    def counted(payload: bytes) -> Any:
        loaded.append(payload)
        return real_loads(payload)

    monkeypatch.setattr(_function_refs, "loads", counted)
    monkeypatch.setattr(_function_refs, "_resolved", {})
    reference = function_reference(importable)
    assert [resolve_function_reference(reference) for _ in range(3)] == [importable] * 3
    assert loaded == [reference]


def test_an_unimportable_or_uncallable_reference_fails_naming_it() -> None:
    missing = pickle.dumps(importable).replace(b"test_function_refs", b"no_such_mod_xyz123")
    with pytest.raises(rpc.DeserializationError, match="no_such_mod_xyz123"):
        resolve_function_reference(missing)
    with pytest.raises(rpc.DeserializationError, match="not callable"):
        resolve_function_reference(pickle.dumps(7))


def _a_cached_reference() -> tuple[Any, bytes]:
    """``importable`` and its reference, made and resolved (both tables hold them)."""
    reference = function_reference(importable)
    assert resolve_function_reference(reference) is importable
    return importable, reference


def test_a_rebound_function_is_called_as_its_module_has_it_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original, reference = _a_cached_reference()
    replacement = functools.partial(operator.neg)  # (what the module holds instead)

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "importable", replacement)  # as a reload or mock.patch does
    assert resolve_function_reference(reference) is replacement
    # the caller's stale function object is no longer a reference: pickled in the payload,
    # where plain pickling refuses it (not the object its module names)
    assert function_reference(original) is original
    with pytest.raises(rpc.SerializationError, match="func"):
        dumps_for(1, (original, (), {}, {}), ("func", "args", "kwargs", "meta"))


def test_a_reimported_module_or_a_renamed_function_ends_a_cached_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original, reference = _a_cached_reference()
    elsewhere = functools.partial(operator.pos)
    fresh = types.ModuleType(__name__)  # the module imported anew (its old dict still holds
    fresh.importable = elsewhere  # type: ignore[attr-defined]  # the cached function)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, __name__, fresh)
        assert resolve_function_reference(reference) is elsewhere
        assert function_reference(original) is original  # not what the module holds now
    assert resolve_function_reference(reference) is original  # (the old module again)
    assert function_reference(original) == reference
    with monkeypatch.context() as patch:
        patch.setattr(original, "__qualname__", "renamed_importable")
        assert function_reference(original) is original  # no longer under its name


def test_a_builtin_bound_to_an_object_stays_in_the_payload() -> None:
    holder = _Callable()
    bound = [1].count  # a builtin whose __self__ is a list
    assert function_reference(bound) is bound
    method = holder.method
    assert function_reference(method) is method


def test_a_call_of_a_function_that_cannot_be_pickled_names_it(cluster: list[str]) -> None:
    def hidden(x: Any) -> Any:
        return x

    hidden.__qualname__ = "no_such_name_here"  # its module does not hold it under that name
    hidden.__module__ = __name__
    assert function_reference(hidden) is hidden
    with pytest.raises(rpc.SerializationError, match="func"):
        rpc.rpc_sync("worker1", hidden, args=(1,))
    with pytest.raises(TypeError, match="not callable"):
        rpc.rpc_sync("worker1", b"not a function")  # bytes never pass for a reference


def test_both_tables_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_function_refs, "_TABLE_LIMIT", 2)
    monkeypatch.setattr(_function_refs, "_references", {})
    monkeypatch.setattr(_function_refs, "_resolved", {})
    for func in (importable, operator.add, operator.mul, torch.add, torch.mul):
        resolve_function_reference(function_reference(func))
        assert len(_function_refs._references) <= 2 and len(_function_refs._resolved) <= 2


def test_calls_carry_the_reference_and_run_the_function(
    cluster: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[Any] = []
    real_dumps_for = _agent.dumps_for

    def recorded(rank: int, payload: Any, what: Any = "arguments") -> Any:
        sent.append(payload)
        return real_dumps_for(rank, payload, what)

    monkeypatch.setattr(_agent, "dumps_for", recorded)
    assert rpc.rpc_sync("worker1", importable, args=(5,)) == 5
    assert rpc.rpc_async("worker1", operator.add, args=(2, 3)).wait() == 5
    assert rpc.remote("worker1", torch.add, args=(torch.ones(2), 1)).to_here().tolist() == [2, 2]
    assert rpc.rpc_sync("worker1", lambda x: x + 1, args=(1,)) == 2  # by value, as before
    firsts = [payload[0] for payload in sent]
    assert firsts[:3] == [function_reference(f) for f in (importable, operator.add, torch.add)]
    assert callable(firsts[3])
    # the callee resolved them once each, into its own table
    assert rpc.rpc_sync("worker1", _resolved_on_callee, args=(firsts[0],))


def _resolved_on_callee(reference: bytes) -> bool:
    entry = _function_refs._resolved.get(reference)
    return entry is not None and entry[2] is importable
