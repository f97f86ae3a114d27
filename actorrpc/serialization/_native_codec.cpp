// actorrpc.serialization._native_codec: the array forms of a tensor (``_tensors``) made
// and rebuilt without torch's Python layers or numpy (an optional extension, built
// against torch's headers where the build can import torch; see setup.py). Without it,
// or where it declines (returns None), ``_tensors`` does the same through numpy.
//
// Why: ``Tensor.numpy()`` runs four dispatcher operators (detach, to, resolve_conj,
// resolve_neg) and a reduced tensor that requires grad one more ``detach``; a rebuild runs
// ``np.frombuffer``, ``torch.from_numpy`` (``lift_fresh``) and ``requires_grad_``. Between
// messages, with cold caches, each costs several µs; an autograd iteration reduces and
// rebuilds five tensors on each side. Reading the tensor's fields and its data pointer
// costs none of that.
//
// ``reduce(tensor, is_parameter, in_band_limit)``: the reduction ``_tensors.reduce_tensor`` would make of
// a tensor in the array form (C-contiguous) or in the strided array form's one-element case
// (every stride 0: the gradient of a ``sum``), byte for byte the same wire form, with the
// data out of band through a buffer that keeps the tensor (and so its storage) alive, or
// copied in band up to ``in_band_limit`` bytes. None for anything else, and for any tensor
// whose dispatch keys differ from a plain dense CPU tensor's (conjugate or negative bits,
// functional or wrapped tensors, inference tensors, ...): numpy's path decides those.
//
// ``rebuild(code, shape, strides, flags, data)``: the tensor of the array form (``strides``
// None) or the strided array form (strides in elements), sharing ``data``'s memory (a
// writable buffer, kept alive by the tensor; released with the GIL held), as
// ``torch.from_numpy`` does. None (numpy's path, which raises its own errors) unless every
// check passes: a known dtype code, non-negative sizes and strides, data that holds every
// element the view reaches and is aligned for the dtype, a writable buffer, flags of a
// plain tensor (a Parameter takes the Python path), requires_grad only for floating or
// complex dtypes, and no torch dispatch mode or functionalization active (``from_numpy``'s
// ``lift_fresh`` matters there).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ops/from_blob.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <array>
#include <cstring>
#include <vector>

namespace {

// the array forms' dtype codes: positions in ``_tensors._ARRAY_DTYPES`` (the wire format)
constexpr std::array<c10::ScalarType, 14> kCodes = {
    c10::ScalarType::Float,  c10::ScalarType::Double,       c10::ScalarType::Half,
    c10::ScalarType::Long,   c10::ScalarType::Int,          c10::ScalarType::Short,
    c10::ScalarType::Char,   c10::ScalarType::Byte,         c10::ScalarType::Bool,
    c10::ScalarType::ComplexFloat, c10::ScalarType::ComplexDouble, c10::ScalarType::UInt16,
    c10::ScalarType::UInt32, c10::ScalarType::UInt64};
constexpr long kRequiresGrad = 1;
constexpr long kParameter = 2;

PyObject* rebuild_array = nullptr;    // _tensors._rebuild_from_array
PyObject* rebuild_strided = nullptr;  // _tensors._rebuild_from_strided_array
c10::DispatchKeySet plain_keys;  // a dense CPU tensor's (set by configure)

int code_of(c10::ScalarType type) {
  for (size_t i = 0; i < kCodes.size(); ++i) {
    if (kCodes[i] == type) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

// -- the buffer that carries a tensor's data out of band --------------------------------------

struct TensorBytes {
  PyObject_HEAD
  at::Tensor tensor;  // keeps the storage alive while any view of the buffer exists
  void* data;
  Py_ssize_t nbytes;
};

void tensor_bytes_dealloc(PyObject* self) {
  reinterpret_cast<TensorBytes*>(self)->tensor.~Tensor();
  Py_TYPE(self)->tp_free(self);
}

int tensor_bytes_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  auto* bytes = reinterpret_cast<TensorBytes*>(self);
  // writable, as the array ``Tensor.numpy()`` gives
  return PyBuffer_FillInfo(view, self, bytes->data, bytes->nbytes, 0, flags);
}

PyBufferProcs tensor_bytes_buffer = {tensor_bytes_getbuffer, nullptr};

PyTypeObject tensor_bytes_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* new_tensor_bytes(const at::Tensor& tensor, void* data, Py_ssize_t nbytes) {
  PyObject* self = tensor_bytes_type.tp_alloc(&tensor_bytes_type, 0);
  if (self == nullptr) {
    return nullptr;
  }
  auto* bytes = reinterpret_cast<TensorBytes*>(self);
  new (&bytes->tensor) at::Tensor(tensor);
  bytes->data = data;
  bytes->nbytes = nbytes;
  return self;
}

PyObject* shape_tuple(c10::IntArrayRef sizes) {
  PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  if (shape == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyObject* size = PyLong_FromLongLong(sizes[i]);
    if (size == nullptr) {
      Py_DECREF(shape);
      return nullptr;
    }
    PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(i), size);
  }
  return shape;
}

// -- reduce -------------------------------------------------------------------------------------

PyObject* reduce(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* object = nullptr;
  int is_parameter = 0;
  Py_ssize_t in_band_limit = 0;
  if (!PyArg_ParseTuple(args, "Opn", &object, &is_parameter, &in_band_limit)) {
    return nullptr;
  }
  if (rebuild_array == nullptr || !THPVariable_Check(object)) {
    Py_RETURN_NONE;
  }
  const at::Tensor& tensor = THPVariable_Unpack(object);
  if (tensor.key_set() != plain_keys || !tensor.has_storage()) {
    Py_RETURN_NONE;
  }
  const int code = code_of(tensor.scalar_type());
  if (code < 0) {
    Py_RETURN_NONE;
  }
  const long flags = (tensor.requires_grad() ? kRequiresGrad : 0) |
                     (is_parameter ? kParameter : 0);
  const Py_ssize_t itemsize = static_cast<Py_ssize_t>(tensor.itemsize());
  const int64_t numel = tensor.numel();
  c10::IntArrayRef sizes = tensor.sizes();
  if (tensor.is_contiguous()) {
    const Py_ssize_t nbytes = static_cast<Py_ssize_t>(numel) * itemsize;
    PyObject* data = nullptr;
    if (nbytes <= in_band_limit) {  // copied in band (see _tensors.IN_BAND_LIMIT)
      data = PyByteArray_FromStringAndSize(
          nbytes ? static_cast<const char*>(tensor.const_data_ptr()) : "", nbytes);
    } else {
      PyObject* bytes = new_tensor_bytes(tensor, tensor.data_ptr(), nbytes);
      if (bytes == nullptr) {
        return nullptr;
      }
      data = PyPickleBuffer_FromObject(bytes);
      Py_DECREF(bytes);
    }
    if (data == nullptr) {
      return nullptr;
    }
    PyObject* shape = shape_tuple(sizes);
    if (shape == nullptr) {
      Py_DECREF(data);
      return nullptr;
    }
    return Py_BuildValue("(O(iNlN))", rebuild_array, code, shape, flags, data);
  }
  if (numel == 0) {
    Py_RETURN_NONE;
  }
  for (int64_t stride : tensor.strides()) {
    if (stride != 0) {
      Py_RETURN_NONE;  // (numpy's path works out the parts of other strided views)
    }
  }
  // one element on every axis: it travels alone
  PyObject* data = PyByteArray_FromStringAndSize(
      static_cast<const char*>(tensor.const_data_ptr()), itemsize);
  if (data == nullptr) {
    return nullptr;
  }
  PyObject* shape = shape_tuple(sizes);
  PyObject* strides = shape == nullptr ? nullptr : PyTuple_New(PyTuple_GET_SIZE(shape));
  if (strides == nullptr) {
    Py_XDECREF(shape);
    Py_DECREF(data);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(strides); ++i) {
    PyTuple_SET_ITEM(strides, i, PyLong_FromLong(0));
  }
  return Py_BuildValue("(O(iNNlN))", rebuild_strided, code, shape, strides, flags, data);
  END_HANDLE_TH_ERRORS
}

// -- rebuild ------------------------------------------------------------------------------------

// the non-negative integers of a tuple, or false (an error cleared: numpy's path reports it)
bool read_counts(PyObject* tuple, std::vector<int64_t>& out) {
  if (!PyTuple_Check(tuple)) {
    return false;
  }
  const Py_ssize_t count = PyTuple_GET_SIZE(tuple);
  out.resize(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    const long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
    if (value < 0) {  // (-1 with an error set too)
      PyErr_Clear();
      return false;
    }
    out[static_cast<size_t>(i)] = value;
  }
  return true;
}

void release_buffer(void* view_pointer) {
  auto* view = static_cast<Py_buffer*>(view_pointer);
  PyGILState_STATE state = PyGILState_Ensure();  // (a tensor may be freed on any thread)
  PyBuffer_Release(view);
  PyGILState_Release(state);
  delete view;
}

PyObject* rebuild(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  int code = -1;
  PyObject* shape_object = nullptr;
  PyObject* strides_object = nullptr;
  long flags = 0;
  PyObject* data = nullptr;
  if (!PyArg_ParseTuple(args, "iOOlO", &code, &shape_object, &strides_object, &flags, &data)) {
    return nullptr;
  }
  if (code < 0 || code >= static_cast<int>(kCodes.size()) || (flags & ~kRequiresGrad) != 0 ||
      c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Functionalize)) {
    Py_RETURN_NONE;
  }
  const c10::ScalarType type = kCodes[static_cast<size_t>(code)];
  if ((flags & kRequiresGrad) && !c10::isFloatingType(type) && !c10::isComplexType(type)) {
    Py_RETURN_NONE;  // (requires_grad_ raises its own error)
  }
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  if (!read_counts(shape_object, sizes)) {
    Py_RETURN_NONE;
  }
  // (every product checked: a malformed message's sizes must not wrap around to a small
  // count that its data would seem to hold)
  int64_t numel = 1;
  for (int64_t size : sizes) {
    if (__builtin_mul_overflow(numel, size, &numel)) {
      Py_RETURN_NONE;
    }
  }
  if (strides_object == Py_None) {
    strides.resize(sizes.size());
    int64_t step = 1;
    for (size_t i = sizes.size(); i-- > 0;) {
      strides[i] = step;
      step *= std::max<int64_t>(sizes[i], 1);  // (no overflow: numel did not)
    }
  } else if (!read_counts(strides_object, strides) || strides.size() != sizes.size()) {
    Py_RETURN_NONE;
  }
  if (numel == 0) {
    Py_RETURN_NONE;
  }
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(type));
  int64_t span = 1;  // elements from the first to the last the view reaches
  for (size_t i = 0; i < sizes.size(); ++i) {
    int64_t reach = 0;
    if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &reach) ||
        __builtin_add_overflow(span, reach, &span)) {
      Py_RETURN_NONE;
    }
  }
  int64_t needed = 0;  // bytes the data must hold (exactly, for the array form)
  if (__builtin_mul_overflow(strides_object == Py_None ? numel : span, itemsize, &needed)) {
    Py_RETURN_NONE;
  }
  auto* view = new Py_buffer;
  if (PyObject_GetBuffer(data, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
    PyErr_Clear();  // (read-only, or not a buffer: numpy's path)
    delete view;
    Py_RETURN_NONE;
  }
  const bool fits = strides_object == Py_None ? view->len == needed : view->len >= needed;
  if (!fits || reinterpret_cast<uintptr_t>(view->buf) % static_cast<uintptr_t>(itemsize) != 0) {
    PyBuffer_Release(view);
    delete view;
    Py_RETURN_NONE;
  }
  at::Tensor tensor;
  try {
    tensor = at::from_blob(view->buf, sizes, strides,
                           [view](void*) { release_buffer(view); },
                           at::TensorOptions().dtype(type).device(at::kCPU));
  } catch (...) {
    PyBuffer_Release(view);
    delete view;
    throw;
  }
  if (flags & kRequiresGrad) {
    tensor.set_requires_grad(true);
  }
  return THPVariable_Wrap(std::move(tensor));
  END_HANDLE_TH_ERRORS
}

// -- configuration ------------------------------------------------------------------------------

PyObject* configure(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* array = nullptr;
  PyObject* strided = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &array, &strided)) {
    return nullptr;
  }
  Py_XSETREF(rebuild_array, Py_NewRef(array));
  Py_XSETREF(rebuild_strided, Py_NewRef(strided));
  plain_keys = at::empty({1}, at::TensorOptions().dtype(at::kFloat)).key_set();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(rebuild_from_array, rebuild_from_strided_array)"},
    {"reduce", reduce, METH_VARARGS,
     "reduce(tensor, is_parameter, in_band_limit): the array form's reduction of tensor, or "
     "None"},
    {"rebuild", rebuild, METH_VARARGS,
     "rebuild(code, shape, strides, flags, data): the array form's tensor, or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_codec", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__native_codec() {
  if (tensor_bytes_type.tp_name == nullptr) {  // (once per process)
    tensor_bytes_type.tp_name = "actorrpc.serialization._native_codec.TensorBytes";
    tensor_bytes_type.tp_basicsize = sizeof(TensorBytes);
    tensor_bytes_type.tp_flags = Py_TPFLAGS_DEFAULT;
    tensor_bytes_type.tp_dealloc = tensor_bytes_dealloc;
    tensor_bytes_type.tp_as_buffer = &tensor_bytes_buffer;
    tensor_bytes_type.tp_doc = "A tensor's data as a buffer (it keeps the tensor alive).";
  }
  if (PyType_Ready(&tensor_bytes_type) < 0) {
    return nullptr;
  }
  PyObject* created = PyModule_Create(&module);
  if (created == nullptr) {
    return nullptr;
  }
  // the torch it was built against (its structures are read directly) and the digest of
  // this file: the loader refuses the module under any other torch, or beside another
  // version of this file (``actorrpc._native_modules``)
  if (PyModule_AddStringConstant(created, "TORCH_VERSION", ACTORRPC_TORCH_VERSION) < 0 ||
      PyModule_AddStringConstant(created, "SOURCE_DIGEST", ACTORRPC_SOURCE_DIGEST) < 0 ||
      PyModule_AddObjectRef(created, "TensorBytes", (PyObject*)&tensor_bytes_type) < 0) {
    Py_DECREF(created);
    return nullptr;
  }
  return created;
}
