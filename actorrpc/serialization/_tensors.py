"""How a dense CPU tensor is pickled: its data out of band (or copied in band when small).

Two wire forms, both rebuilt without copying the data again:

* The *array* form, for a C-contiguous tensor of a dtype numpy has (the common
  case): ``_rebuild_from_array(code, shape, flags, data)``, where ``code`` indexes
  :data:`_ARRAY_DTYPES` and ``flags`` holds requires_grad and "is a Parameter".
  Both ends go through numpy: ``Tensor.numpy()`` on the sender,
  ``np.frombuffer`` and ``torch.from_numpy`` on the receiver. Each torch call
  costs 5-20 µs when the caches are cold, as they are between messages (a cold
  ``tensor.dtype`` alone ~5 µs on the AMD host); this form makes about a third as
  many as the general one.
* The *strided array* form, for a view of a numpy dtype whose elements fill the
  memory it spans, in some order, some of them repeated (a transpose or
  permutation, a broadcast by ``expand`` as the gradient of a ``sum``):
  ``_rebuild_from_strided_array(code, shape, strides, flags, data)``, where
  ``strides`` are in elements and ``data`` holds the elements once, from the first
  one on. Made and rebuilt with numpy alone (a view broadcast on every axis sends its
  one element without further work). A view with gaps (a slice with steps,
  a column) sends only its own elements, copied together (strides of the copy);
  a view whose elements overlap (sliding windows) takes the general form.
* The *general* form, for any other dense strided CPU tensor (a dtype numpy lacks
  such as bfloat16): ``_rebuild_tensor(dtype, size, stride, requires_grad,
  is_parameter, data)``, where ``data`` holds exactly the bytes the view spans (a
  view of a large storage sends only its own elements).

Anything else (CUDA, sparse, quantized, conjugate or negative bits) is left to
torch's own reduction (:func:`reduce_tensor` returns ``NotImplemented``).

Where the optional extension ``_native_codec`` was built (C++ against torch's headers:
``setup.py``), the array form and the one-element case of the strided array form are
made and rebuilt there, byte for byte the same on the wire, without numpy or torch's
Python layers (``Tensor.numpy()`` alone runs four dispatcher operators); it declines
(returns None) whatever it does not handle, and the paths below take it. ``NATIVE``
switches it off (same-run A/Bs: ``benchmarks/ab_switch.py``).

The three rebuild functions travel as pickle extension codes, not by name
(:mod:`._extension_codes`).
"""

from __future__ import annotations

import logging
import pickle
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._native_modules import load_native
from ._extension_codes import register_extension_code

__all__ = ["IN_BAND_LIMIT", "NATIVE", "reduce_tensor"]

IN_BAND_LIMIT = 4096
"""Tensor data of at most this many bytes travels inside the pickle stream: a copy of a few
KiB costs less than a message frame of its own and its bookkeeping.

It is copied into a ``bytearray`` by the reducer rather than kept in band by the
``buffer_callback`` (a ``PickleBuffer`` pickled in band): that path crashed worker
processes in garbage collection under many threads (CPython 3.11; reproduced with 8
threads of ``rpc_async`` calls carrying small tensors and a low GC threshold, never
with the copy). Every ``PickleBuffer`` goes out of band."""

# The array form's dtype codes: positions in this tuple (part of the wire format).
_ARRAY_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(t)
    for t in (
        np.float32, np.float64, np.float16, np.int64, np.int32, np.int16, np.int8,
        np.uint8, np.bool_, np.complex64, np.complex128, np.uint16, np.uint32, np.uint64,
    )
)
if TYPE_CHECKING:  # (Any where numpy is not type-checked: setup.py's compiled build)
    from typing import TypeAlias

    _Array: TypeAlias = "np.ndarray[Any, Any]"

_ARRAY_CODES = {dtype: code for code, dtype in enumerate(_ARRAY_DTYPES)}
_REQUIRES_GRAD = 1
_PARAMETER = 2


def _data(buffer: Any, nbytes: int) -> Any:
    """What carries ``nbytes`` of contiguous tensor data: an in-band copy or an
    out-of-band buffer (see :data:`IN_BAND_LIMIT`)."""
    # (through a memoryview: ``bytearray`` of a 0-d integer array would take its value
    # as a length)
    return bytearray(memoryview(buffer)) if nbytes <= IN_BAND_LIMIT else pickle.PickleBuffer(buffer)


def reduce_tensor(tensor: torch.Tensor) -> Any:
    """The reduction of a ``torch.Tensor`` or ``torch.nn.Parameter`` (exactly those types)."""
    if _native_reduce is not None and NATIVE:
        reduced = _native_reduce(tensor, type(tensor) is not torch.Tensor, IN_BAND_LIMIT)
        if reduced is not None:
            return reduced
    requires_grad = tensor.requires_grad
    try:  # refuses what is not a dense CPU tensor numpy can hold (either form's checks)
        array = (tensor.detach() if requires_grad else tensor).numpy()
    except (RuntimeError, TypeError):
        return _reduce_general(tensor)
    code = _ARRAY_CODES.get(array.dtype)
    if code is None:
        return _reduce_general(tensor)
    flags = _REQUIRES_GRAD if requires_grad else 0
    if type(tensor) is not torch.Tensor:
        flags |= _PARAMETER
    if not array.flags.c_contiguous:
        if not any(array.strides) and array.size:  # one element on every axis (a sum's
            # gradient): it travels alone, without working out the parts
            one = array[(_FIRST,) * array.ndim]
            strides = (0,) * array.ndim
            return _rebuild_from_strided_array, (code, array.shape, strides, flags,
                                                 bytearray(one.tobytes()))
        parts = _strided_parts(array)
        if parts is None:  # elements that overlap (sliding windows): the span travels
            return _reduce_general(tensor)
        elements, strides = parts
        data = _data(elements, elements.nbytes)
        return _rebuild_from_strided_array, (code, array.shape, strides, flags, data)
    return _rebuild_from_array, (code, array.shape, flags, _data(array, array.nbytes))


def _strided_parts(array: _Array) -> tuple[_Array, tuple[int, ...]] | None:
    """What the strided array form sends of a non-contiguous ``array``: a C-contiguous
    array holding its elements, each once, and ``array``'s strides (in elements) over it.

    Its broadcast axes (stride 0) are cut to one element. If the other elements fill
    the memory they span, they travel as they lie (ordered by stride) and the strides
    are ``array``'s own; if they leave gaps, they are copied together (the strides then
    are those of the copy, 0 on broadcast axes). None when the elements overlap so much
    that the memory they span is smaller than their number: the span travels then.
    """
    # (loops, not generators: each generator is a Python frame, and this runs per message)
    strides = array.strides
    itemsize = array.itemsize
    index: list[slice] = []
    for stride in strides:
        if stride < 0:
            return None
        index.append(_FIRST if stride == 0 else _ALL)
    once = array[tuple(index)]
    once_strides = once.strides
    order = sorted(range(once.ndim), key=once_strides.__getitem__, reverse=True)
    elements = once.transpose(order)
    if elements.flags.c_contiguous:
        return elements, tuple([stride // itemsize for stride in strides])
    span = 0
    for n, stride in zip(once.shape, once_strides):
        span += (n - 1) * stride
    if 1 + span // itemsize < once.size:
        return None
    compact = np.ascontiguousarray(once)
    element_strides = []
    for stride, compact_stride in zip(strides, compact.strides):
        element_strides.append(0 if stride == 0 else compact_stride // itemsize)
    return compact, tuple(element_strides)


_FIRST = slice(0, 1)
_ALL = slice(None)


def _finish(tensor: torch.Tensor, flags: int) -> torch.Tensor:
    if flags & _PARAMETER:
        return torch.nn.Parameter(tensor, requires_grad=bool(flags & _REQUIRES_GRAD))
    if flags & _REQUIRES_GRAD:
        tensor.requires_grad_(True)
    return tensor


def _rebuild_from_array(code: int, shape: tuple[int, ...], flags: int, data: Any) -> torch.Tensor:
    """The tensor of the array form (see the module docstring)."""
    if _native_rebuild is not None and NATIVE:
        rebuilt = _native_rebuild(code, shape, None, flags, data)
        if rebuilt is not None:
            return rebuilt  # type: ignore[no-any-return]
    tensor = torch.from_numpy(np.frombuffer(data, _ARRAY_DTYPES[code]).reshape(shape))
    return _finish(tensor, flags) if flags else tensor


def _rebuild_from_strided_array(
    code: int, shape: tuple[int, ...], strides: tuple[int, ...], flags: int, data: Any
) -> torch.Tensor:
    """The tensor of the strided array form (see the module docstring). numpy refuses
    strides that reach beyond ``data``."""
    if _native_rebuild is not None and NATIVE:
        rebuilt = _native_rebuild(code, shape, strides, flags, data)
        if rebuilt is not None:
            return rebuilt  # type: ignore[no-any-return]
    dtype = _ARRAY_DTYPES[code]
    itemsize = dtype.itemsize
    byte_strides = tuple(map(itemsize.__mul__, strides))  # (no Python frame)
    array: np.ndarray[Any, Any] = np.ndarray(shape, dtype, buffer=data, strides=byte_strides)
    tensor = torch.from_numpy(array)
    return _finish(tensor, flags) if flags else tensor


def _rebuild_tensor(
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...] | None,
    requires_grad: bool,
    is_parameter: bool,
    data: Any,
) -> torch.Tensor:
    """The tensor of the general form; ``stride`` None: contiguous."""
    raw = memoryview(data)
    if raw.nbytes == 0:
        empty = torch.empty(0, dtype=dtype)
        tensor = torch.as_strided(empty, size, stride or _contiguous_stride(size), 0)
    elif stride is None:
        tensor = torch.frombuffer(raw, dtype=dtype)
        if len(size) != 1:  # (a 1-d tensor has its shape already)
            tensor = tensor.view(size)
    else:
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
        tensor = torch.as_strided(flat, size, stride, 0)
    flags = (_REQUIRES_GRAD if requires_grad else 0) | (_PARAMETER if is_parameter else 0)
    return _finish(tensor, flags)


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    step = 1
    for n in reversed(size):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def _span(tensor: torch.Tensor) -> int:
    """Number of elements between the first and last element the view touches."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def _reduce_general(tensor: torch.Tensor) -> Any:
    if (
        not tensor.is_cpu
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return NotImplemented
    requires_grad = tensor.requires_grad
    detached = tensor.detach() if requires_grad else tensor  # (numpy() refuses grad tensors)
    raw: Any
    stride: tuple[int, ...] | None = None
    if detached.is_contiguous():  # a dtype numpy lacks (bfloat16 ...): its bytes
        raw = detached.reshape(-1).view(torch.uint8).numpy() if detached.numel() else b""
    else:
        if any(s < 0 for s in detached.stride()):
            return NotImplemented
        span = _span(detached)
        if span > detached.numel():
            detached = detached.contiguous()  # a gappy view: send only its elements
            span = detached.numel()
        stride = tuple(detached.stride())
        flat = torch.as_strided(detached, (span,), (1,), detached.storage_offset())
        raw = flat.view(torch.uint8).numpy() if span else b""
    view = memoryview(raw)
    return (
        _rebuild_tensor,
        (
            tensor.dtype,
            tuple(detached.shape),
            stride,
            requires_grad,
            type(tensor) is not torch.Tensor,
            _data(view.cast("B"), view.nbytes),
        ),
    )


NATIVE = True
_native_codec = load_native(f"{__package__}._native_codec", "tensors go through numpy",
                            logging.getLogger("actorrpc.serialization"))
_native_reduce: Any = None
_native_rebuild: Any = None
if _native_codec is not None:
    _native_codec.configure(_rebuild_from_array, _rebuild_from_strided_array)
    _native_reduce, _native_rebuild = _native_codec.reduce, _native_codec.rebuild

# (indexes are part of the wire format: see ``_extension_codes``)
register_extension_code(_rebuild_from_array, 0, memoized=True)
register_extension_code(_rebuild_from_strided_array, 1, memoized=True)
register_extension_code(_rebuild_tensor, 2, memoized=True)
