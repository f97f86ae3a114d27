"""The tensor codec's native steps (``actorrpc/serialization/_native_codec.cpp``).

Built where torch is importable at build time (CI's compiled stage builds it in place;
with ``ACTORRPC_EXPECT_COMPILED=1`` it is required); the pure-Python stage runs without
it and these tests skip there. Each test compares the native reduction or rebuild with
numpy's path (``_tensors.NATIVE = False``) on the same tensor: the same wire form, byte
for byte, where it runs; ``None`` (numpy's path) where it must decline.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actorrpc.serialization import _tensors, dumps, loads

pytestmark = pytest.mark.timeout(60)

_reduce = _tensors._native_reduce
_rebuild = _tensors._native_rebuild
needs_native = pytest.mark.skipif(_reduce is None, reason="the native codec is not built here")

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.uint16,
    torch.uint32, torch.uint64,
]


def test_the_native_codec_is_built_where_expected() -> None:
    if os.environ.get("ACTORRPC_EXPECT_COMPILED") != "1":
        pytest.skip("only the compiled stage (an in-place build that sees torch) requires it")
    assert _tensors._native_codec is not None, "the native codec was not built or loaded"


def _sample(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    values = torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 7 + 1
    return values.reshape(shape).to(dtype)


def _python_reduce(tensor: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as patch:
        patch.setattr(_tensors, "NATIVE", False)
        return _tensors.reduce_tensor(tensor)


def _wire(reduction: Any) -> tuple[Any, ...]:
    """A reduction with its data as bytes (in band: a bytearray; out of band: the buffer)."""
    function, args = reduction
    data = args[-1]
    raw = data.raw().tobytes() if isinstance(data, pickle.PickleBuffer) else bytes(data)
    return (function, *args[:-1], type(data), raw)


@needs_native
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (40, 40)], ids=str)
def test_the_wire_form_is_numpys_byte_for_byte(
    dtype: torch.dtype, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = _sample(dtype, *shape)
    native = _reduce(tensor, False, _tensors.IN_BAND_LIMIT)
    assert native is not None
    assert _wire(native) == _wire(_python_reduce(tensor, monkeypatch))


@needs_native
@pytest.mark.parametrize("kind", ["requires_grad", "parameter", "expanded", "contiguous_slice"])
def test_flags_and_the_one_element_form_match(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "requires_grad":
        tensor = torch.rand(64, 64, requires_grad=True)
    elif kind == "parameter":
        tensor = torch.nn.Parameter(torch.rand(3, 3))
    elif kind == "expanded":  # the gradient of a sum
        tensor = torch.ones(()).expand(64, 64)
    else:
        tensor = torch.rand(10, 10)[2:5]
    native = _reduce(tensor, type(tensor) is not torch.Tensor, _tensors.IN_BAND_LIMIT)
    assert native is not None
    assert _wire(native) == _wire(_python_reduce(tensor, monkeypatch))


@needs_native
@pytest.mark.parametrize("kind", [
    "transposed", "sliced_with_steps", "bfloat16", "conjugate", "negative", "sparse",
    "quantized", "inference", "not_a_tensor",
])
def test_what_it_leaves_to_numpys_path(kind: str) -> None:
    base = torch.rand(4, 6)
    tensor: Any
    if kind == "transposed":
        tensor = base.t()
    elif kind == "sliced_with_steps":
        tensor = base[:, ::2]
    elif kind == "bfloat16":
        tensor = base.to(torch.bfloat16)
    elif kind == "conjugate":
        tensor = torch.rand(3, dtype=torch.complex64).conj()
    elif kind == "negative":
        tensor = torch.rand(3, dtype=torch.complex64).conj().imag
    elif kind == "sparse":
        tensor = base.to_sparse()
    elif kind == "quantized":
        tensor = torch.quantize_per_tensor(base, 0.1, 0, torch.quint8)
    elif kind == "inference":
        with torch.inference_mode():
            tensor = torch.rand(3)
    else:
        tensor = [1, 2, 3]
    assert _reduce(tensor, False, _tensors.IN_BAND_LIMIT) is None
    if isinstance(tensor, torch.Tensor) and kind not in ("sparse", "quantized", "negative",
                                                          "conjugate"):
        back = loads(*dumps(tensor))  # numpy's path carries it
        assert torch.equal(back, tensor)


@needs_native
def test_the_out_of_band_buffer_keeps_the_tensor_alive() -> None:
    tensor = torch.arange(4096, dtype=torch.float32)
    _, args = _reduce(tensor, False, _tensors.IN_BAND_LIMIT)
    buffer = args[-1]
    assert isinstance(buffer, pickle.PickleBuffer)
    expected = tensor.numpy().tobytes()
    del tensor, args
    gc.collect()
    assert buffer.raw().tobytes() == expected
    with memoryview(buffer) as view:  # writable, as numpy()'s array is
        assert not view.readonly


@needs_native
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_a_rebuild_shares_the_data_as_from_numpy_does(dtype: torch.dtype) -> None:
    original = _sample(dtype, 3, 5)
    data = bytearray(original.numpy().tobytes())
    code = _DTYPES.index(dtype)
    tensor = _rebuild(code, (3, 5), None, 0, data)
    assert tensor is not None and tensor.dtype == dtype and torch.equal(tensor, original)
    assert tensor.is_leaf and not tensor.requires_grad and tensor.is_contiguous()
    assert tensor.data_ptr() == _address(data)  # no copy


def _address(data: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))


@needs_native
def test_a_rebuilt_tensor_keeps_its_buffer_until_it_is_freed() -> None:
    data = bytearray(torch.arange(6, dtype=torch.float32).numpy().tobytes())
    tensor = _rebuild(0, (2, 3), None, 0, data)
    tensor += 1  # (the data's own memory, as with from_numpy)
    assert bytes(data) == torch.arange(1, 7, dtype=torch.float32).numpy().tobytes()
    with pytest.raises(BufferError):  # exported while the tensor lives
        data.extend(b"x")
    done = threading.Event()

    def free() -> None:  # (freed on another thread: the release takes the GIL there)
        nonlocal tensor
        del tensor
        done.set()

    threading.Thread(target=free).start()
    assert done.wait(10)
    gc.collect()
    data.extend(b"x")


@needs_native
def test_requires_grad_and_the_strided_form_rebuild_as_numpys_path(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    leaf = torch.rand(8, 8, requires_grad=True)
    for tensor in (leaf, torch.ones(()).expand(5, 4), torch.full((), 2.0).expand(3, 1, 2)):
        function, args = _tensors.reduce_tensor(tensor)
        data = args[-1]
        data = bytearray(data.raw()) if isinstance(data, pickle.PickleBuffer) else data
        native = function(*args[:-1], data)
        with monkeypatch.context() as patch:
            patch.setattr(_tensors, "NATIVE", False)
            python = function(*args[:-1], bytearray(data))
        assert torch.equal(native, python) and native.stride() == python.stride()
        assert native.requires_grad == python.requires_grad == tensor.requires_grad
        assert native.is_leaf


@needs_native
@pytest.mark.parametrize("case", [
    "read_only", "misaligned", "too_short", "too_long", "negative_size", "parameter",
    "integer_requiring_grad", "unknown_code", "empty", "strides_beyond_data",
    "not_a_buffer", "sizes_wrapping_around", "strides_wrapping_around",
])
def test_rebuilds_it_leaves_to_numpys_path(case: str) -> None:
    good = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    code, shape, strides, flags, data = 0, (2, 3), None, 0, bytearray(good)
    data_any: Any = data
    if case == "read_only":
        data_any = good
    elif case == "misaligned":
        data_any = memoryview(bytearray(b"\0" + good))[1:]
    elif case == "too_short":
        data_any = bytearray(good[:-4])
    elif case == "too_long":
        data_any = bytearray(good + b"\0" * 4)
    elif case == "negative_size":
        shape = (-2, 3)
    elif case == "parameter":
        flags = 3
    elif case == "integer_requiring_grad":
        code, flags = 3, 1
        data_any = bytearray(torch.arange(6).numpy().tobytes())
    elif case == "unknown_code":
        code = 99
    elif case == "empty":
        shape, data_any = (0, 3), bytearray()
    elif case == "strides_beyond_data":
        strides = (3, 2)
    elif case == "sizes_wrapping_around":  # (the product is 6 modulo 2**64: what the data holds)
        shape = ((6 + 3 * 2**64) // 9, 9)
    elif case == "strides_wrapping_around":
        shape, strides = (2, 3), (2**62, 1)
    else:
        data_any = 12
    assert _rebuild(code, shape, strides, flags, data_any) is None


@needs_native
def test_a_dispatch_mode_takes_numpys_path() -> None:
    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    data = bytearray(torch.arange(6, dtype=torch.float32).numpy().tobytes())
    with Counting():
        assert _rebuild(0, (2, 3), None, 0, data) is None
    assert _rebuild(0, (2, 3), None, 0, data) is not None


@needs_native
def test_a_message_of_tensors_round_trips_through_both_paths(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    value = {
        "leaf": torch.rand(64, 64, requires_grad=True),
        "grad": torch.ones(()).expand(64, 64),
        "small": torch.arange(5),
        "view": torch.rand(6, 6).t(),
        "parameter": torch.nn.Parameter(torch.rand(2)),
    }
    for native_sender in (True, False):
        for native_receiver in (True, False):
            monkeypatch.setattr(_tensors, "NATIVE", native_sender)
            payload, buffers = dumps(value)
            monkeypatch.setattr(_tensors, "NATIVE", native_receiver)
            back = loads(payload, [bytearray(b) for b in buffers])
            for key, tensor in value.items():
                assert type(back[key]) is type(tensor), key
                assert torch.equal(back[key], tensor.detach()), key
                assert back[key].requires_grad == tensor.requires_grad, key

