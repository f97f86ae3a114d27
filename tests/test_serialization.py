"""The wire pickler: tensors out of band, code by reference or by value.

Most tests call :func:`actorrpc.serialization.dumps`/``loads`` directly (no
group needed); the last few round-trip through the session group.
"""

from __future__ import annotations

import pickle
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

import actorrpc as rpc
from actorrpc.serialization import dumps, loads
from tests._cluster import run_script

pytestmark = pytest.mark.timeout(60)

DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def by_value(payload: bytes) -> bool:
    """Whether a pickled function/class was shipped by value (dill) rather than by name."""
    return b"dill" in payload


@pytest.fixture
def out_of_band(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer travels out of band, however small (to check what travels)."""
    from actorrpc.serialization import _tensors

    monkeypatch.setattr(_tensors, "IN_BAND_LIMIT", -1)


def roundtrip(obj):
    payload, buffers = dumps(obj)
    # the receiver gets separate frames: copy each buffer into its own bytes object
    return loads(payload, [bytearray(b) for b in buffers])


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(a, b)


def importable_function(x):
    return x + 1


def make_closure(n):
    def inner(x):
        return x * n

    return inner


# --- tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_roundtrips(dtype, out_of_band):
    t = sample(dtype)
    back = roundtrip(t)
    assert_same(t, back)
    payload, buffers = dumps(t)
    assert sum(b.nbytes for b in buffers) == t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_roundtrips_in_band(dtype):
    t = sample(dtype)
    payload, buffers = dumps(t)
    assert not buffers  # 15 elements: inside the payload
    assert_same(t, loads(payload, buffers))
    assert_same(t.t(), roundtrip(t.t()))  # strided as well


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_wide_unsigned_dtypes_roundtrip(dtype):
    t = torch.arange(10).to(dtype)
    assert_same(t, roundtrip(t))


def _form(t: torch.Tensor) -> str:
    from actorrpc.serialization import _tensors

    function, _ = _tensors.reduce_tensor(t)
    return {
        _tensors._rebuild_from_array: "array",
        _tensors._rebuild_from_strided_array: "strided array",
        _tensors._rebuild_tensor: "general",
    }[function]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_contiguous_tensors_of_numpy_dtypes_take_the_array_form(dtype):
    """The array form (fewer torch calls) for every C-contiguous tensor numpy can hold;
    the general form for the rest; both rebuild the same tensor, flags included."""
    t = sample(dtype) if dtype in DTYPES else torch.arange(15).to(dtype).reshape(3, 5)
    expected = "general" if dtype == torch.bfloat16 else "array"
    assert _form(t) == expected
    assert _form(t[1:]) == expected  # contiguous, at an offset into its storage
    assert _form(t.t()) == ("general" if dtype == torch.bfloat16 else "strided array")
    assert_same(t.t(), roundtrip(t.t()))
    assert_same(t[1:], roundtrip(t[1:]))
    if dtype.is_floating_point or dtype.is_complex:
        leaf = t.clone().requires_grad_(True)
        back = roundtrip(leaf)
        assert back.requires_grad and back.is_leaf and torch.equal(back.detach(), t)
        parameter = roundtrip(torch.nn.Parameter(t.clone(), requires_grad=False))
        assert type(parameter) is torch.nn.Parameter and not parameter.requires_grad


def test_zero_dim_integers_and_booleans_keep_their_value():
    """A 0-d integer array must not be read as a length (``bytearray(array)`` would)."""
    for value in (torch.tensor(7), torch.tensor(True), torch.tensor(-3, dtype=torch.int8)):
        payload, buffers = dumps(value)
        back = loads(payload, buffers)
        assert back.dtype == value.dtype and back.shape == () and back.item() == value.item()


def test_transposed_tensor_keeps_strides():
    t = torch.arange(12.0).reshape(3, 4).t()
    back = roundtrip(t)
    assert_same(t, back)
    assert back.stride() == t.stride() == (1, 4)
    assert not back.is_contiguous()


def test_permuted_and_expanded_tensors(out_of_band):
    p = torch.randn(2, 3, 4).permute(2, 0, 1)
    back = roundtrip(p)
    assert_same(p, back)
    assert back.stride() == p.stride()
    e = torch.randn(3, 1).expand(3, 1000)  # stride 0: only 3 elements travel
    payload, buffers = dumps(e)
    assert sum(b.nbytes for b in buffers) == 3 * 4
    assert_same(e, roundtrip(e))


def test_views_that_permute_or_broadcast_send_each_element_once_and_keep_strides(out_of_band):
    """The strided array form: the gradient of a sum (a scalar expanded), transposes,
    permutations with broadcast axes; a view with gaps goes contiguous instead."""
    cases = [
        torch.ones(()).expand(64, 64),
        torch.randn(5, 1, 3).expand(5, 4, 3).transpose(0, 2),
        torch.arange(10.0)[:, None].expand(10, 300).t(),
        torch.randn(30, 40, requires_grad=True).t(),
    ]
    for view, elements in zip(cases, (1, 15, 10, 1200)):
        assert _form(view) == "strided array"
        payload, buffers = dumps(view)
        assert len(payload) + sum(b.nbytes for b in buffers) < elements * 4 + 200
        back = loads(payload, buffers)
        assert_same(view, back)
        assert back.stride() == view.stride()
        assert back.requires_grad == view.requires_grad
    column = torch.arange(100.0).reshape(10, 10)[:, 3]  # gaps: its elements, copied
    assert _form(column) == "strided array" and roundtrip(column).is_contiguous()
    assert torch.equal(roundtrip(column), column)


def test_views_with_gaps_or_overlaps_send_no_more_than_their_span(out_of_band):
    """A broadcast of a view with gaps sends the view's elements once; sliding windows
    (elements that overlap) send the memory they span, not every window."""
    for view, most in (
        (torch.randn(1000, 100)[:, :1].expand(1000, 10_000), 1000),  # 10**7 elements
        (torch.randn(100)[::2].expand(7, 50), 50),
        (torch.randn(100_000).unfold(0, 256, 1), 100_000),  # 2.6 * 10**7 elements
        (torch.as_strided(torch.arange(20.0), (2, 2, 2), (5, 1, 1)), 8),
    ):
        payload, buffers = dumps(view)
        assert len(payload) + sum(b.nbytes for b in buffers) < most * 4 + 300
        assert torch.equal(loads(payload, buffers), view)


def test_strides_reaching_beyond_the_data_are_refused():
    from actorrpc.errors import DeserializationError
    from actorrpc.serialization import _tensors

    class Forged:  # a 4x4 float32 view over the 4 bytes of one element
        def __reduce__(self) -> tuple[Any, ...]:
            return _tensors._rebuild_from_strided_array, (0, (4, 4), (4, 1), 0, bytearray(4))

    with pytest.raises(DeserializationError, match="strides"):
        loads(pickle.dumps(Forged(), protocol=5))


def test_sliced_views_roundtrip():
    base = torch.arange(100.0).reshape(10, 10)
    for view in (base[2:5], base[:, 3], base[::2, 1::3], base[4], base[1:9:3, 2:8:2]):
        assert_same(view.contiguous(), roundtrip(view).contiguous())
        assert torch.equal(view, roundtrip(view))


def test_view_of_big_storage_sends_only_its_bytes(out_of_band):
    big = torch.zeros(1_000_000)  # 4 MB storage
    view = big[1000:1010]
    payload, buffers = dumps(view)
    assert sum(b.nbytes for b in buffers) == 10 * 4
    assert len(payload) < 1000
    back = loads(payload, buffers)
    assert torch.equal(back, view)
    assert back.untyped_storage().nbytes() == 40

    column = torch.zeros(1000, 1000)[:, 7]  # gappy view: 1000 elements over 4 MB
    payload, buffers = dumps(column)
    assert sum(b.nbytes for b in buffers) == 1000 * 4
    assert torch.equal(loads(payload, buffers), column)

    row_block = torch.zeros(1000, 1000)[10:12]  # contiguous slice: 2 rows
    payload, buffers = dumps(row_block)
    assert sum(b.nbytes for b in buffers) == 2 * 1000 * 4


def test_shared_storage_views_in_one_message():
    base = torch.arange(20.0)
    a, b = base[:10], base[10:]
    back = roundtrip({"a": a, "b": b, "again": a})
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b)
    assert torch.equal(back["again"], a)


def test_tensors_nested_in_containers():
    obj = {
        "list": [torch.ones(2), "text", 3, [torch.zeros(1, dtype=torch.int32)]],
        "tuple": (torch.arange(3), {"inner": torch.eye(2)}),
        "set": {1, 2},
        "none": None,
        7: b"bytes",
    }
    back = roundtrip(obj)
    assert torch.equal(back["list"][0], obj["list"][0])
    assert back["list"][1:3] == ["text", 3]
    assert_same(back["list"][3][0], obj["list"][3][0])
    assert torch.equal(back["tuple"][0], obj["tuple"][0])
    assert torch.equal(back["tuple"][1]["inner"], torch.eye(2))
    assert back["set"] == {1, 2} and back["none"] is None and back[7] == b"bytes"


def test_requires_grad_kept():
    leaf = torch.randn(3, requires_grad=True)
    back = roundtrip(leaf)
    assert back.requires_grad and back.is_leaf
    assert torch.equal(back.detach(), leaf.detach())
    non_leaf = leaf * 2
    back = roundtrip(non_leaf)
    assert back.requires_grad
    assert torch.equal(back.detach(), non_leaf.detach())
    assert not roundtrip(torch.randn(3)).requires_grad


def test_parameter_kept():
    param = torch.nn.Parameter(torch.randn(2, 3))
    back = roundtrip(param)
    assert isinstance(back, torch.nn.Parameter)
    assert back.requires_grad
    assert torch.equal(back.detach(), param.detach())
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    back = roundtrip(frozen)
    assert isinstance(back, torch.nn.Parameter) and not back.requires_grad


def test_module_state_dict_roundtrips():
    module = torch.nn.Linear(4, 3)
    back = roundtrip(module.state_dict())
    for key, value in module.state_dict().items():
        assert torch.equal(back[key], value)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_zero_size_tensors(shape):
    for dtype in (torch.float32, torch.int64, torch.bool):
        t = torch.empty(shape, dtype=dtype)
        back = roundtrip(t)
        assert back.shape == t.shape and back.dtype == dtype


def test_zero_dim_scalars():
    for t in (torch.tensor(3.5), torch.tensor(7), torch.tensor(True), torch.tensor(1 + 2j)):
        back = roundtrip(t)
        assert back.dim() == 0
        assert_same(t, back)
        assert back.item() == t.item()


def test_received_tensor_is_writable_and_independent():
    t = torch.arange(5.0)
    back = roundtrip(t)
    back += 1  # writable
    assert torch.equal(t, torch.arange(5.0))  # the sender's tensor is untouched


def test_conjugate_and_negative_views_roundtrip():
    c = torch.randn(4, dtype=torch.complex64)
    conj = c.conj()
    assert conj.is_conj()
    assert torch.equal(roundtrip(conj), conj)
    neg = torch._neg_view(torch.randn(3))
    assert neg.is_neg()
    assert torch.equal(roundtrip(neg), neg)


def test_no_tensor_data_in_payload():
    t = torch.randn(10 * 1024 * 1024 // 4)  # 10 MB
    payload, buffers = dumps({"weights": t, "step": 3})
    assert len(payload) < 2000, len(payload)
    assert sum(b.nbytes for b in buffers) == t.numel() * 4
    back = loads(payload, buffers)
    assert torch.equal(back["weights"], t) and back["step"] == 3


def test_buffers_are_zero_copy_views(out_of_band):
    t = torch.randn(1000)
    _, buffers = dumps(t)
    assert len(buffers) == 1
    assert isinstance(buffers[0], memoryview)
    t[0] = 12345.0  # a view of the tensor's memory, not a copy
    assert torch.frombuffer(bytearray(buffers[0]), dtype=torch.float32)[0].item() == 12345.0


def test_unpicklable_object_raises_serialization_error():
    import threading

    with pytest.raises(rpc.SerializationError) as info:
        dumps({"ok": 1, "bad": [0, threading.Lock()]}, "arguments")
    assert "['bad'][1]" in str(info.value)
    assert "lock" in str(info.value).lower()


def test_garbage_payload_raises_deserialization_error(out_of_band):
    with pytest.raises(rpc.DeserializationError):
        loads(b"not a pickle at all")
    with pytest.raises(rpc.DeserializationError):
        loads(pickle.dumps(1)[:-2])
    payload, buffers = dumps(torch.ones(3))
    with pytest.raises(rpc.DeserializationError):
        loads(payload, [])  # missing out-of-band buffer


def test_a_big_payload_does_not_leave_its_memo_to_later_messages():
    """A thread's reused pickler clears its memo table after every message, at a cost in
    proportion to the largest table it ever had: after a big (or failed) payload the
    thread gets a fresh pickler; after small ones it keeps the one it has."""
    from actorrpc.serialization._pickling import REUSED_PICKLER_LIMIT, _per_thread

    dumps(None)
    kept = _per_thread.state.pickler
    small, _ = dumps({"func": "noop", "args": (1, 2.0, "three"), "kwargs": {}})
    assert len(small) <= REUSED_PICKLER_LIMIT and _per_thread.state.pickler is kept
    big, _ = dumps([(float(i), "x", i) for i in range(20_000)])  # ~20,000 memoized tuples
    assert len(big) > REUSED_PICKLER_LIMIT and _per_thread.state.pickler is not kept
    renewed = _per_thread.state.pickler
    import threading

    with pytest.raises(rpc.SerializationError):
        dumps([(float(i), "x") for i in range(5_000)] + [threading.Lock()])
    assert _per_thread.state.pickler is not renewed  # a failed payload may have grown it too
    assert loads(*dumps((1, "two"))) == (1, "two")  # and the fresh one works
    assert loads(big) == [(float(i), "x", i) for i in range(20_000)]


# --- code by reference and by value -------------------------------------------------------


def test_small_tensors_travel_in_band_and_stay_writable():
    from actorrpc.serialization._tensors import IN_BAND_LIMIT

    small = torch.arange(IN_BAND_LIMIT // 4, dtype=torch.float32)  # exactly the limit
    payload, buffers = dumps((small, torch.ones(3)))
    assert not buffers and len(payload) > IN_BAND_LIMIT  # the bytes are in the payload
    back, three = loads(payload, buffers)
    assert torch.equal(back, small) and torch.equal(three, torch.ones(3))
    back[0] = 7.0  # its own, writable memory
    assert small[0] == 0.0
    larger = torch.arange(IN_BAND_LIMIT // 4 + 1, dtype=torch.float32)
    payload, buffers = dumps(larger)
    assert [b.nbytes for b in buffers] == [IN_BAND_LIMIT + 4] and len(payload) < 1000
    assert torch.equal(loads(payload, buffers), larger)


def test_importable_function_travels_by_reference():
    payload, buffers = dumps(importable_function)
    assert not buffers
    assert b"tests.test_serialization" in payload
    assert b"importable_function" in payload
    assert not by_value(payload)
    assert loads(payload) is importable_function
    payload, _ = dumps(torch.add)
    assert not by_value(payload) and len(payload) < 200


def test_importable_class_travels_by_reference():
    payload, _ = dumps(torch.nn.Linear)
    assert b"torch.nn" in payload and not by_value(payload)
    assert loads(payload) is torch.nn.Linear


def test_lambda_travels_by_value():
    payload, _ = dumps(lambda x: x * 2 + 1)
    assert by_value(payload)
    func = loads(payload)
    assert func(3) == 7


def test_closure_travels_by_value():
    closure = make_closure(4)
    payload, _ = dumps(closure)
    assert by_value(payload)
    assert loads(payload)(5) == 20


def test_main_style_function_and_class_travel_by_value():
    namespace = {"__name__": "__main__"}
    exec(
        textwrap.dedent(
            """
            import torch
            SCALE = 3

            def main_func(x):
                return torch.ones(2) * x * SCALE

            class MainClass:
                def value(self):
                    return "main-class"
            """
        ),
        namespace,
    )
    payload, _ = dumps(namespace["main_func"])
    assert by_value(payload)
    assert torch.equal(loads(payload)(2), torch.full((2,), 6.0))
    payload, _ = dumps(namespace["MainClass"])
    assert by_value(payload)
    assert loads(payload)().value() == "main-class"


def test_the_receivers_main_function_is_fingerprinted_once_while_it_stays(monkeypatch):
    from actorrpc.serialization import _by_value

    main = sys.modules["__main__"]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec("def shipped(x):\n    return x + 1\n", namespace)
    sent = namespace["shipped"]
    monkeypatch.setattr(main, "shipped", sent, raising=False)  # the receiver's own, the same
    payload, _ = dumps(sent)
    fingerprinted: list[Any] = []
    real = _by_value._code_fingerprint
    monkeypatch.setattr(_by_value, "_code_fingerprint",
                        lambda code: fingerprinted.append(code) or real(code))
    for _ in range(3):
        assert loads(payload) is sent  # the receiver's own definition, as with torch
    assert len(fingerprinted) == 1
    # redefined on the receiver (a notebook cell run again): fingerprinted afresh, and
    # as its code differs now, the caller's definition runs
    exec("def shipped(x):\n    return x + 2\n", namespace)
    monkeypatch.setattr(main, "shipped", namespace["shipped"])
    fingerprinted.clear()
    rebuilt = loads(payload)
    assert fingerprinted and rebuilt is not namespace["shipped"] and rebuilt(1) == 2
    namespace["shipped"].__code__ = sent.__code__  # its code replaced: fingerprinted afresh,
    fingerprinted.clear()
    assert loads(payload) is namespace["shipped"] and fingerprinted  # and the same now


def test_receiver_cache_maps_one_definition_to_one_object():
    func = lambda x: x - 1  # noqa: E731
    first = loads(dumps(func)[0])
    second = loads(dumps(func)[0])
    assert first is second  # one definition -> one object on the receiver
    assert first(1) == 0

    other = lambda x: x - 2  # noqa: E731 - a different definition
    assert loads(dumps(other)[0]) is not first

    # a re-defined function (same name, new code) replaces the old one
    namespace = {"__name__": "__main__"}
    exec("def g(x):\n    return x + 1\n", namespace)
    old = loads(dumps(namespace["g"])[0])
    exec("def g(x):\n    return x + 2\n", namespace)
    new = loads(dumps(namespace["g"])[0])
    assert old is not new
    assert (old(0), new(0)) == (1, 2)


def test_sender_cache_notices_changed_code():
    def f(x):
        return x + 1

    first = loads(dumps(f)[0])
    f.__code__ = (lambda x: x + 100).__code__
    second = loads(dumps(f)[0])
    assert (first(0), second(0)) == (1, 100)


# --- round trips through the group --------------------------------------------------------


def echo(obj):
    return obj


def describe(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.requires_grad, type(t).__name__)


def test_every_dtype_through_the_group(cluster):
    tensors = {str(dtype): sample(dtype, (4, 3)) for dtype in DTYPES}
    back = rpc.rpc_sync("worker1", echo, args=(tensors,))
    for key, t in tensors.items():
        assert_same(t, back[key])


def test_non_contiguous_through_the_group(cluster):
    t = torch.arange(24.0).reshape(4, 6).t()
    assert rpc.rpc_sync("worker1", describe, args=(t,)) == (
        torch.float32,
        (6, 4),
        (1, 6),
        False,
        "Tensor",
    )
    back = rpc.rpc_sync("worker2", echo, args=(t,))
    assert back.stride() == t.stride() and torch.equal(back, t)
    view = torch.arange(1_000_000.0)[500:510:2]
    assert torch.equal(rpc.rpc_sync("worker1", echo, args=(view,)), view)


def test_grad_and_parameter_through_the_group(cluster):
    param = torch.nn.Parameter(torch.randn(2, 2))
    leaf = torch.randn(3, requires_grad=True)
    assert rpc.rpc_sync("worker1", describe, args=(param,))[3:] == (True, "Parameter")
    assert rpc.rpc_sync("worker1", describe, args=(leaf,))[3:] == (True, "Tensor")
    back = rpc.rpc_sync("worker2", echo, args=([param, leaf, torch.tensor(2.0)],))
    assert isinstance(back[0], torch.nn.Parameter) and back[1].requires_grad
    assert back[2].dim() == 0 and back[2].item() == 2.0


def test_zero_size_through_the_group(cluster):
    back = rpc.rpc_sync("worker1", echo, args=((torch.empty(0), torch.empty(2, 0, 3)),))
    assert back[0].shape == (0,) and back[1].shape == (2, 0, 3)


def test_code_by_value_takes_project_modules_by_reference() -> None:
    """dill would ship a module it does not see as installed (this checkout) by value."""
    import actorrpc

    def make():
        def uses_the_package():
            return actorrpc.is_available()

        return uses_the_package

    payload, buffers = dumps(make())
    rebuilt = loads(payload, buffers)
    assert rebuilt() is True
    assert rebuilt.__closure__[0].cell_contents is actorrpc  # the module itself, by name


def _extension_codes_in(payload: bytes) -> list[int]:
    import pickletools

    return [arg for op, arg, _ in pickletools.genops(payload) if op.name.startswith("EXT")]


def test_tensor_rebuild_functions_travel_as_extension_codes(out_of_band) -> None:
    """Each wire form's rebuild function is a four-byte code, not a module and name."""
    from actorrpc.serialization._extension_codes import FIRST_CODE

    forms = [
        (torch.rand(4, 4), FIRST_CODE),  # the array form
        (torch.rand(4, 3).t(), FIRST_CODE + 1),  # the strided array form
        (torch.rand(5, dtype=torch.bfloat16), FIRST_CODE + 2),  # the general form
    ]
    for tensor, code in forms:
        payload, buffers = dumps(tensor)
        assert _extension_codes_in(payload) == [code], tensor
        assert b"actorrpc" not in payload and b"_rebuild" not in payload
        rebuilt = loads(payload, buffers)
        assert rebuilt.dtype == tensor.dtype and torch.equal(rebuilt, tensor)
        assert rebuilt.stride() == tensor.stride()


def test_this_process_maps_each_extension_code_to_its_rebuild_function_and_back() -> None:
    import copyreg

    from actorrpc.serialization import _tensors
    from actorrpc.serialization._extension_codes import (
        FIRST_CODE,
        check_extension_codes,
        registered_object,
    )

    functions = [_tensors._rebuild_from_array, _tensors._rebuild_from_strided_array,
                 _tensors._rebuild_tensor, registered_object]
    for index, function in enumerate(functions):
        key = (function.__module__, function.__qualname__)
        assert copyreg._extension_registry[key] == FIRST_CODE + index
        assert copyreg._inverted_registry[FIRST_CODE + index] == key
        assert registered_object(FIRST_CODE + index) is function
    check_extension_codes()


def _three_forms() -> list[torch.Tensor]:
    """One tensor of each wire form: array, strided array, general."""
    return [torch.rand(4, 4), torch.rand(4, 3).t(), torch.rand(5, dtype=torch.bfloat16)]


def test_a_message_of_many_tensors_names_each_rebuild_function_through_the_memo(
    out_of_band,
) -> None:
    """Extension codes are not memoized by pickle: from the third save of a rebuild
    function in one pickle on, it travels once as registered_object(code), then as memo
    references, instead of as its code for every tensor."""
    import pickletools

    from actorrpc.serialization._extension_codes import FIRST_CODE, MEMOIZED_AFTER

    assert MEMOIZED_AFTER == 2
    array, strided, general = FIRST_CODE, FIRST_CODE + 1, FIRST_CODE + 2
    by_reference = FIRST_CODE + 3
    tensors = [torch.rand(3, 2) for _ in range(6)] + _three_forms() + _three_forms()
    payload, buffers = dumps(tensors)
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(payload)]
    # two saves as codes (array), then each function once through registered_object ...
    assert _extension_codes_in(payload) == [array, array] + [by_reference] * 3
    calls = [i for i, op in enumerate(ops) if op == ("EXT4", by_reference)]
    assert [ops[i + 1][1] for i in calls] == [array, strided, general]
    # ... and as memo references after that: one reduction a tensor, one a call; the
    # memo references are the functions' and the second bfloat16 dtype's
    assert sum(1 for name, _ in ops if name == "REDUCE") == len(tensors) + len(calls)
    assert sum(1 for name, _ in ops if name in ("BINGET", "LONG_BINGET")) == (
        len(tensors) - 2 - len(calls) + 1
    )
    rebuilt = loads(payload, buffers)
    for original, back in zip(tensors, rebuilt):
        assert back.dtype == original.dtype and back.stride() == original.stride()
        assert torch.equal(back, original)
    # the count starts again with each pickle: one tensor after many is its code alone
    for form, code in zip(_three_forms(), (array, strided, general)):
        assert _extension_codes_in(dumps(form)[0]) == [code]
        assert _extension_codes_in(dumps([form, form.clone()])[0]) == [code, code]


def test_the_wire_pickler_names_a_rebuild_function_instead_of_asking_for_its_reduction() -> None:
    """A registered function's first saves in a pickle return its name from
    ``reducer_override``: pickle then writes its code without calling the function's
    ``__reduce_ex__`` (in a compiled build, two calls more per tensor); the bytes are the
    same as pickle's own reduction would give."""
    import io
    import pickletools

    from actorrpc.serialization import _tensors
    from actorrpc.serialization._extension_codes import FIRST_CODE
    from actorrpc.serialization._pickling import _WirePickler

    functions = [_tensors._rebuild_from_array, _tensors._rebuild_from_strided_array,
                 _tensors._rebuild_tensor]
    for index, function in enumerate(functions):
        pickler = _WirePickler(io.BytesIO(), protocol=5)
        assert pickler.reducer_override(function) == function.__qualname__
        stream = io.BytesIO()
        _WirePickler(stream, protocol=5).dump(function)
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(stream.getvalue())]
        assert ("EXT4", FIRST_CODE + index) in ops
        assert stream.getvalue() == pickle.dumps(function, protocol=5)
        assert pickle.loads(stream.getvalue()) is function


def test_registered_object_refuses_a_code_actorrpc_did_not_register() -> None:
    from actorrpc.serialization._extension_codes import FIRST_CODE, registered_object

    stranger = FIRST_CODE + 99
    with pytest.raises(pickle.UnpicklingError, match=f"{stranger:#x}"):
        registered_object(stranger)

    class CallsItWithAStranger:
        def __reduce__(self) -> tuple[Any, ...]:
            return registered_object, (stranger,)

    payload = pickle.dumps(CallsItWithAStranger(), 5)
    with pytest.raises(rpc.DeserializationError, match=f"extension code {stranger:#x}"):
        loads(payload)


def test_many_tensors_of_each_form_through_the_group(cluster):
    tensors = _three_forms() * 4 + [torch.rand(2, 2, requires_grad=True) for _ in range(3)]
    back = rpc.rpc_sync("worker1", echo, args=(tensors,))
    for original, received in zip(tensors, back):
        assert received.dtype == original.dtype and received.stride() == original.stride()
        assert received.requires_grad == original.requires_grad
        assert torch.equal(received.detach(), original.detach())


def test_an_extension_code_held_otherwise_is_named_with_what_holds_it() -> None:
    """A code taken by another global, and actorrpc's global moved to another code."""
    import copyreg

    from actorrpc.serialization import _tensors
    from actorrpc.serialization._extension_codes import FIRST_CODE, check_extension_codes

    key = (_tensors.__name__, "_rebuild_from_array")
    copyreg.remove_extension(*key, FIRST_CODE)
    try:
        copyreg.add_extension("textwrap", "dedent", FIRST_CODE)
        with pytest.raises(rpc.RendezvousError) as caught:
            check_extension_codes()
        message = str(caught.value)
        assert f"code {FIRST_CODE:#x} for {key[0]}._rebuild_from_array is held by " \
            "textwrap.dedent" in message, message
        assert "cannot join" in message and "copyreg.add_extension" in message
        copyreg.remove_extension("textwrap", "dedent", FIRST_CODE)
        copyreg.add_extension(*key, FIRST_CODE + 99)  # the global under another code
        with pytest.raises(rpc.RendezvousError, match=f"has code {FIRST_CODE + 99:#x}"):
            check_extension_codes()
        copyreg.remove_extension(*key, FIRST_CODE + 99)
        with pytest.raises(rpc.RendezvousError, match="is held by nothing"):  # removed
            check_extension_codes()
    finally:
        for other_key, code in ((("textwrap", "dedent"), FIRST_CODE), (key, FIRST_CODE + 99)):
            if copyreg._extension_registry.get(other_key) == code:
                copyreg.remove_extension(*other_key, code)
        copyreg.add_extension(*key, FIRST_CODE)
    check_extension_codes()


_AGENT_WITH_A_TAKEN_CODE = """
import copyreg
import textwrap
copyreg.add_extension("textwrap", "dedent", 0x61637201)  # before actorrpc: its code is taken
import actorrpc as rpc
from actorrpc._ports import free_ports

# a group of two that never fills: the refusal must come before the rendezvous
options = rpc.ZmqRpcBackendOptions(
    init_method=f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}", init_timeout=20
)
try:
    rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options)
except rpc.RendezvousError as exc:
    print("refused:", exc)
"""


def test_init_rpc_refuses_a_process_whose_extension_codes_clash(tmp_path) -> None:
    output = run_script(tmp_path, _AGENT_WITH_A_TAKEN_CODE, timeout=60)
    assert "refused:" in output, output
    assert "code 0x61637201 for actorrpc.serialization._tensors._rebuild_from_strided_array " \
        "is held by textwrap.dedent" in output, output


_SMALL_TENSORS_UNDER_GC_PRESSURE = '''
import gc, os, sys, threading
import torch, torch.multiprocessing as mp
import actorrpc as rpc
from actorrpc._ports import free_ports

def scaled(i, t):
    return t * i

def main(rank, port):
    gc.set_threshold(10, 5, 5)  # collections all the time, on every thread
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=(
        rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")))
    if rank == 0:
        errors = []
        def caller(index):
            try:
                base = torch.full((2,), float(index))  # in band, both ways
                futures = [rpc.rpc_async(f"worker{1 + index % 2}", scaled, args=(i, base))
                           for i in range(1000)]
                for i, future in enumerate(futures):
                    assert torch.equal(future.wait(), base * i)
            except BaseException as exc:
                errors.append(exc)
        for _ in range(4):
            threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
            for thread in threads: thread.start()
            for thread in threads: thread.join()
        assert not errors, errors[:2]
        print("calls ok", flush=True)
    rpc.shutdown()

if __name__ == "__main__":
    mp.spawn(main, args=(free_ports("127.0.0.1", 1)[0],), nprocs=3)
'''


@pytest.mark.timeout(150)
def test_small_tensors_from_many_threads_survive_garbage_collection(tmp_path) -> None:
    # In-band tensor data once went through pickle's in-band PickleBuffer path, and the
    # workers crashed in garbage collection (SIGSEGV) in most runs of this script.
    output = run_script(tmp_path, _SMALL_TENSORS_UNDER_GC_PRESSURE, timeout=120)
    assert "calls ok" in output, output


def test_torch_functions_travel_as_one_name_and_other_builtins_as_before():
    """``torch.add`` pickles as ``_torch_function("add")`` (its own reduction is a getattr
    on a C class); builtins of other modules by name; bound builtin methods as pickle
    does, and never cached (the cache would keep their objects alive)."""
    import operator

    from actorrpc.serialization import _pickling

    payload, buffers = dumps(torch.add)
    assert b"_torch_function" in payload and b"_VariableFunctionsClass" not in payload
    for function in (torch.add, torch.cat, torch.nn.functional.relu, operator.add, len):
        payload, buffers = dumps(function)
        assert loads(payload, buffers) is function
    items = [1, 2]
    payload, buffers = dumps(items.append)
    appended = loads(payload, buffers)
    appended(3)  # a copy of the list got it
    assert items == [1, 2]
    assert all(getattr(f, "__self__", None) is None or isinstance(f.__self__, type(sys))
               for f in _pickling._builtin_reductions)


# -- where bytes go and come from (dumps_for / loads_from) ------------------------------------

_UNDONE: list[str] = []


class _Registers:
    """Pickling it registers an undo with the current target (as an RRef's fork does)."""

    def __init__(self, key: str) -> None:
        self.key = key


def _reduce_registers(obj: _Registers) -> Any:
    from actorrpc.serialization import current_pickle_target

    target = current_pickle_target()
    assert target is not None and target.worker_id == 3
    target.add_undo(obj.key, lambda: _UNDONE.append(obj.key))
    return _rebuild_registers, (obj.key,)


def _rebuild_registers(key: str) -> str:
    from actorrpc.serialization import current_unpickle_source

    source = current_unpickle_source()
    assert source is not None and source.worker_id == 5
    source.taken_over.append(key)
    if key == "refuse":
        raise ValueError("refused on purpose")
    return key


@pytest.fixture
def registering_reducer(monkeypatch: pytest.MonkeyPatch) -> None:
    from actorrpc.serialization import _pickling

    monkeypatch.setitem(_pickling._reducers, _Registers, _reduce_registers)
    _UNDONE.clear()


def test_dumps_for_makes_a_target_only_when_something_registers() -> None:
    from actorrpc.serialization import current_pickle_target, dumps_for

    body, buffers, target = dumps_for(3, (1, "x", None, torch.ones(2)), "arguments")
    assert target is None and loads(body, buffers)[1] == "x"
    assert current_pickle_target() is None


@pytest.mark.usefixtures("registering_reducer")
def test_dumps_for_returns_what_pickling_registered_and_undoes_it_on_failure() -> None:
    from actorrpc.errors import SerializationError
    from actorrpc.serialization import current_pickle_target, dumps_for

    _, _, target = dumps_for(3, [_Registers("a"), _Registers("b")])
    assert target is not None and target.worker_id == 3 and target.has_undo
    assert current_pickle_target() is None  # restored after the call
    with pytest.raises(SerializationError):
        dumps_for(3, (_Registers("c"), threading.Lock()), ("first", "second"))
    assert "c" in _UNDONE and current_pickle_target() is None


@pytest.mark.usefixtures("registering_reducer")
def test_loads_from_reports_what_it_took_over_before_a_failure() -> None:
    from actorrpc.errors import DeserializationError
    from actorrpc.serialization import current_unpickle_source, dumps_for, loads_from

    plain, _, _ = dumps_for(3, (1, 2))
    assert loads_from(5, plain) == ((1, 2), None)  # nothing asked for a source
    body, buffers, _ = dumps_for(3, [_Registers("a")])
    value, source = loads_from(5, body, buffers)
    assert value == ["a"] and source is not None and source.taken_over == ["a"]
    body, buffers, _ = dumps_for(3, [_Registers("kept"), _Registers("refuse")])
    with pytest.raises(DeserializationError) as failure:
        loads_from(5, body, buffers)
    assert failure.value.taken_over == ("kept", "refuse")
    assert current_unpickle_source() is None


class _Unnameable:
    """Neither pickles nor shows itself: naming the culprit fails too."""

    def __reduce__(self) -> Any:
        raise TypeError("no pickling")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


@pytest.mark.usefixtures("registering_reducer")
def test_a_culprit_that_cannot_be_shown_is_still_named_and_its_forks_undone() -> None:
    from actorrpc.errors import SerializationError
    from actorrpc.serialization import current_pickle_target, dumps_for

    with pytest.raises(SerializationError, match="second = <an object whose repr"):
        dumps_for(3, (_Registers("e"), _Unnameable()), ("first", "second"))
    assert "e" in _UNDONE and current_pickle_target() is None
    with pytest.raises(SerializationError, match="cannot pickle <an object whose repr"):
        dumps({_Unnameable(): 1})  # a dict that cannot be shown either
    with pytest.raises(SerializationError, match=r"object\[<an object whose repr.*_thread.lock"):
        dumps({_UnshownKey(): threading.Lock()})  # the path to the culprit names its key


class _UnshownKey:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_serialization_error_from_a_reducer_is_raised_as_it_is() -> None:
    from actorrpc.errors import SerializationError

    class Refuses:
        def __reduce__(self) -> Any:
            raise SerializationError("refused by its reducer")

    with pytest.raises(SerializationError, match="refused by its reducer") as caught:
        dumps([Refuses()])
    assert caught.value.__cause__ is not caught.value
