// actorrpc.autograd._native: two steps of distributed autograd without torch's Python
// layers (an optional extension, built against torch's headers; see setup.py). Without it
// the same steps run through torch's public machinery (``_functions``).
//
// ``one_node_pass(output, inputs, grad_outputs)`` does what ``torch.autograd.grad((output,),
// inputs, grad_outputs, retain_graph=True, allow_unused=True)`` does when ``output``'s node is
// the only node that pass would run: every edge out of it leads to one of ``inputs``, whose
// gradients are then the node's outputs (summed where two edges lead to one input). The
// engine's bookkeeping for that (a graph task, its dependency count and execution info,
// a ready queue) costs 7-8 µs warm here and 20-30 µs in a pass between messages; calling
// the node costs under 1.
//
// Invariants that make it the engine's result (otherwise it returns None and the caller
// asks the engine):
// * The node is a C++ node (not a Python ``torch.autograd.Function``, whose backward may
//   do anything) with no hooks of any kind, and each input's node has no tensor pre-hooks
//   or retains_grad hooks (the engine runs those on a captured gradient): a node's hooks
//   can be registered by anyone holding it, so they are read from the node itself.
// * Nothing it runs can tell that no graph task is current: its type saves no tensors
//   (whose unpacking may run Python saved-tensor hooks) and is not ``CopySlices``
//   (``runnable_type``).
// * No input's node has edges of its own (a leaf's ``AccumulateGrad``, a native recv
//   node): an input above another would make the engine run the nodes between them.
// * Anomaly mode is off (the engine records and checks more), no pass is running on this
//   thread (a node's backward asking for one), and the node's inputs and the gradients
//   are CPU tensors (no streams to synchronise).
// * As in the engine: grad mode is off while the node runs, the gradients given for the
//   output and those the node returns are validated and cast by ``validate_outputs``
//   (shapes, dtypes), and the graph is kept (``retain_graph=True``: nothing released).
//   The GIL is released while the node runs, as the engine does.
//
// ``recv_outputs(tensors, context_id, message_id, sender)`` makes a message's recv
// function: a ``RecvRpcBackward`` C++ node tagged with the message, and for each received
// tensor a new tensor sharing its data and version counter (what ``detach`` makes, without
// a dispatch) whose grad_fn is that node.
// It does what ``RecvRpc.apply`` (``_nodes``) does, without a Python node, its context
// object and the Function machinery (~7 µs warm per message). The node has no next edges:
// a local pass never runs it (it asks for the gradient at its outputs, which must travel
// back to the sender), and a plain local backward that reaches it stops there, as
// ``RecvRpc.backward`` does. Its tag, ``(context_id, message_id, sender, num_outputs)``,
// is the attribute ``_actorrpc_recv`` (``_functions.recv_tag``).
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <ATen/ops/add.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <typeindex>
#include <unordered_map>
#include <vector>

#if !defined(ACTORRPC_TORCH_VERSION) || !defined(ACTORRPC_SOURCE_DIGEST)
#error "build with -DACTORRPC_TORCH_VERSION and -DACTORRPC_SOURCE_DIGEST (setup.py does)"
#endif

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::THPCppFunction;
using torch::autograd::THPCppFunction_Check;
using torch::autograd::variable_list;

// The node behind a Python node object (C++ or Python), or null.
Node* node_of(PyObject* obj) {
  if (THPCppFunction_Check(obj)) {
    return ((THPCppFunction*)obj)->cdata.get();
  }
  if (THPFunction_Check(obj)) {
    return ((THPFunction*)obj)->cdata.get();  // (null once its graph was freed)
  }
  return nullptr;
}

bool runs_hooks(Node* node) {
  return !node->pre_hooks().empty() || !node->tensor_pre_hooks().empty() ||
      !node->retains_grad_hooks().empty() || !node->post_hooks().empty();
}

bool has_capture_hooks(Node* node) {
  return !node->tensor_pre_hooks().empty() || !node->retains_grad_hooks().empty();
}

// Whether nodes of ``node``'s type may run here, outside a graph task: not if they save
// tensors (unpacking one may run Python, saved-tensor hooks such as non-reentrant
// ``torch.utils.checkpoint``'s, which would see no backward pass running: a recomputation
// per unpack instead of one per pass), nor ``CopySlices`` (it runs the function it
// wraps, which may be a Python node). A type saves tensors if its Python class has
// ``_raw_saved_*`` properties, as torch's generated nodes do for each saved tensor.
// Worked out once per type; the GIL guards the table.
bool runnable_type(Node* node) {
  static std::unordered_map<std::type_index, bool> known;
  const std::type_index key(typeid(*node));
  if (auto found = known.find(key); found != known.end()) {
    return found->second;
  }
  bool runnable = node->name() != "torch::autograd::CopySlices";
  if (runnable) {
    PyObject* wrapper = torch::autograd::functionToPyObject(
        c10::intrusive_ptr<Node>::reclaim_copy(node));
    if (wrapper == nullptr) {
      PyErr_Clear();
      runnable = false;
    } else {
      for (PyGetSetDef* property = Py_TYPE(wrapper)->tp_getset;
           property != nullptr && property->name != nullptr; ++property) {
        if (std::strncmp(property->name, "_raw_saved_", 11) == 0) {
          runnable = false;
          break;
        }
      }
      Py_DECREF(wrapper);
    }
  }
  known.emplace(key, runnable);
  return runnable;
}

// Where a tensor or a ``GradientEdge(node, output_nr, ...)`` asks for (or starts) a
// gradient; false if it is neither (the edge's function then stays null).
bool edge_of(PyObject* obj, Edge& edge) {
  if (THPVariable_Check(obj)) {
    edge = torch::autograd::impl::gradient_edge(THPVariable_Unpack(obj));
    return true;
  }
  if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) < 2) {
    return false;
  }
  Node* node = node_of(PyTuple_GET_ITEM(obj, 0));
  PyObject* number = PyTuple_GET_ITEM(obj, 1);
  if (node == nullptr || !PyLong_Check(number)) {
    return false;
  }
  long output_nr = PyLong_AsLong(number);
  if (output_nr < 0) {
    PyErr_Clear();
    return false;
  }
  edge = Edge(c10::intrusive_ptr<Node>::reclaim_copy(node), static_cast<uint32_t>(output_nr));
  return true;
}

bool all_on_cpu(const variable_list& tensors) {
  for (const auto& tensor : tensors) {
    if (tensor.defined() && !tensor.device().is_cpu()) {
      return false;
    }
  }
  return true;
}

PyObject* one_node_pass(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* output = nullptr;
  PyObject* inputs = nullptr;
  PyObject* grad_outputs = nullptr;
  if (!PyArg_ParseTuple(args, "OO!O!", &output, &PyTuple_Type, &inputs, &PyTuple_Type,
                        &grad_outputs)) {
    return nullptr;
  }
  if (torch::autograd::AnomalyMode::is_enabled() || PyTuple_GET_SIZE(grad_outputs) != 1 ||
      torch::autograd::get_current_graph_task_id() != -1) {  // (inside a node's backward)
    Py_RETURN_NONE;
  }
  Edge root;
  if (!edge_of(output, root) || !root.function || !THPVariable_Check(
          PyTuple_GET_ITEM(grad_outputs, 0))) {
    Py_RETURN_NONE;
  }
  Node* node = root.function.get();
  PyObject* wrapper = node->pyobj_slot()->load_pyobj();  // (a Python node: its THPFunction)
  if ((wrapper != nullptr && THPFunction_Check(wrapper)) || runs_hooks(node) ||
      root.input_nr >= node->num_inputs() || !runnable_type(node)) {
    Py_RETURN_NONE;
  }
  for (uint32_t i = 0; i < node->num_inputs(); ++i) {
    if (!node->input_metadata(i).device().is_cpu()) {
      Py_RETURN_NONE;
    }
  }
  // Each of the node's edges leads to one of ``inputs`` (or nowhere): where its gradient goes.
  const Py_ssize_t count = PyTuple_GET_SIZE(inputs);
  std::vector<Edge> wanted(count);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!edge_of(PyTuple_GET_ITEM(inputs, i), wanted[i]) || !wanted[i].function) {
      Py_RETURN_NONE;
    }
    Node* input_node = wanted[i].function.get();
    if (input_node == node || has_capture_hooks(input_node)) {
      Py_RETURN_NONE;
    }
    if (!input_node->next_edges().empty()) {
      Py_RETURN_NONE;  // an input above another: the engine would run the nodes between
    }
    for (Py_ssize_t j = 0; j < i; ++j) {  // (an input asked for twice: the engine's case)
      if (wanted[j] == wanted[i]) {
        Py_RETURN_NONE;
      }
    }
  }
  const auto& next = node->next_edges();
  if (next.empty()) {
    Py_RETURN_NONE;  // a leaf's AccumulateGrad (it would write ``.grad``), or a dead end
  }
  std::vector<Py_ssize_t> positions(next.size(), -1);
  for (size_t e = 0; e < next.size(); ++e) {
    if (!next[e].is_valid()) {
      continue;
    }
    for (Py_ssize_t i = 0; i < count; ++i) {
      if (wanted[i].function == next[e].function && wanted[i].input_nr == next[e].input_nr) {
        positions[e] = i;
        break;
      }
    }
    if (positions[e] < 0) {
      Py_RETURN_NONE;  // the pass goes on below this node: the engine's work
    }
  }
  variable_list root_grads{THPVariable_Unpack(PyTuple_GET_ITEM(grad_outputs, 0))};
  if (!all_on_cpu(root_grads)) {
    Py_RETURN_NONE;
  }
  std::vector<at::Tensor> results(count);
  {
    pybind11::gil_scoped_release no_gil;
    torch::autograd::validate_outputs({root}, root_grads, [](const std::string& msg) {
      return msg;  // (the engine's words for a root)
    });
    variable_list node_inputs(node->num_inputs());
    node_inputs[root.input_nr] = std::move(root_grads[0]);
    at::AutoGradMode grad_mode(false);
    variable_list grads = (*node)(std::move(node_inputs));
    torch::autograd::validate_outputs(next, grads, [node](const std::string& msg) {
      return "Function " + node->name() + " returned an " + msg;
    });
    for (size_t e = 0; e < next.size(); ++e) {
      if (positions[e] >= 0 && grads[e].defined()) {
        auto& slot = results[positions[e]];
        if (!slot.defined()) {
          slot = std::move(grads[e]);
        } else {  // (the engine's order: a dense gradient first where the other is sparse)
          slot = slot.is_sparse() && !grads[e].is_sparse() ? at::add(grads[e], slot)
                                                           : at::add(slot, grads[e]);
        }
      }
    }
  }
  PyObject* tuple = PyTuple_New(count);
  if (tuple == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = results[i].defined() ? THPVariable_Wrap(results[i]) : Py_NewRef(Py_None);
    if (item == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, i, item);
  }
  return tuple;
  END_HANDLE_TH_ERRORS
}

struct RecvRpcBackward : public Node {
  RecvRpcBackward(int64_t context_id, int64_t message_id, int64_t sender)
      : context_id(context_id), message_id(message_id), sender(sender) {}

  variable_list apply(variable_list&& /*grads*/) override {
    return {};  // (no next edges: a plain local backward stops here, nothing is sent)
  }

  std::string name() const override {
    return "RecvRpcBackward";
  }

  // compiled autograd: nothing to collect (its backward depends on none of its fields)
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}

  variable_list apply_with_saved(const variable_list& /*inputs*/,
                                 torch::dynamo::autograd::SwapSavedVariables& /*saved*/) override {
    return {};
  }

  const int64_t context_id;
  const int64_t message_id;
  const int64_t sender;
};

PyTypeObject recv_node_type;  // (filled in by _initFunctionPyTypeObject at import)

PyObject* recv_tag(PyObject* self, void* /*closure*/) {
  HANDLE_TH_ERRORS
  auto* node = static_cast<RecvRpcBackward*>(((THPCppFunction*)self)->cdata.get());
  return Py_BuildValue("(LLLI)", static_cast<long long>(node->context_id),
                       static_cast<long long>(node->message_id),
                       static_cast<long long>(node->sender), node->num_inputs());
  END_HANDLE_TH_ERRORS
}

// (torch's own nodes' properties and methods, as THP_FUNCTION_DEFAULT_* list them, less
// ``_set_sequence_nr``, which torch's headers do not declare)
PyGetSetDef recv_node_properties[] = {
    {(char*)"next_functions", torch::autograd::THPCppFunction_next_functions, nullptr, nullptr,
     nullptr},
    {(char*)"requires_grad", torch::autograd::THPCppFunction_requires_grad, nullptr, nullptr,
     nullptr},
    {(char*)"metadata", torch::autograd::THPCppFunction_metadata, nullptr, nullptr, nullptr},
    {(char*)"_input_metadata", torch::autograd::THPCppFunction_input_metadata, nullptr,
     nullptr, nullptr},
    {(char*)"_actorrpc_recv", recv_tag, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef recv_node_methods[] = {
    {(char*)"_register_hook_dict", torch::autograd::THPCppFunction_register_hook_dict, METH_O,
     nullptr},
    {(char*)"register_hook", torch::autograd::THPCppFunction_register_hook, METH_O, nullptr},
    {(char*)"register_prehook", torch::autograd::THPCppFunction_register_prehook, METH_O,
     nullptr},
    {(char*)"name", torch::autograd::THPCppFunction_name, METH_NOARGS, nullptr},
    {(char*)"_sequence_nr", torch::autograd::THPCppFunction_sequence_nr, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyObject* recv_outputs(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* tensors = nullptr;
  long long context_id = 0;
  long long message_id = 0;
  long long sender = 0;
  if (!PyArg_ParseTuple(args, "O!LLL", &PyTuple_Type, &tensors, &context_id, &message_id,
                        &sender)) {
    return nullptr;
  }
  const Py_ssize_t count = PyTuple_GET_SIZE(tensors);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!THPVariable_Check(PyTuple_GET_ITEM(tensors, i))) {
      PyErr_Format(PyExc_TypeError, "recv_outputs: item %zd is not a tensor", i);
      return nullptr;
    }
  }
  auto node = c10::make_intrusive<RecvRpcBackward>(context_id, message_id, sender);
  PyObject* outputs = PyTuple_New(count);
  if (outputs == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    // what ``detach()`` makes, without its dispatch: a non-differentiable view (the same
    // data and metadata, the received tensor's version counter, fixed metadata) with an
    // autograd history of its own
    const at::Tensor& received = THPVariable_Unpack(PyTuple_GET_ITEM(tensors, i));
    at::Tensor output(received.unsafeGetTensorImpl()->shallow_copy_and_detach(
        torch::autograd::impl::version_counter(received),
        /*allow_tensor_metadata_change=*/false));
    torch::autograd::set_history(output, node);
    PyObject* wrapped = THPVariable_Wrap(std::move(output));
    if (wrapped == nullptr) {
      Py_DECREF(outputs);
      return nullptr;
    }
    PyTuple_SET_ITEM(outputs, i, wrapped);
  }
  PyObject* node_object = torch::autograd::functionToPyObject(node);
  if (node_object == nullptr) {
    Py_DECREF(outputs);
    return nullptr;
  }
  return Py_BuildValue("(NN)", outputs, node_object);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"one_node_pass", one_node_pass, METH_VARARGS,
     "one_node_pass(output, inputs, grad_outputs): the gradients at inputs of a pass over "
     "output's node alone, or None where the engine must run it"},
    {"recv_outputs", recv_outputs, METH_VARARGS,
     "recv_outputs(tensors, context_id, message_id, sender): (outputs, node), the received "
     "tensors' new tensors and their RecvRpcBackward node"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__native() {
  PyObject* created = PyModule_Create(&module);
  if (created == nullptr) {
    return nullptr;
  }
  if (recv_node_type.tp_name == nullptr) {  // (once per process)
    torch::autograd::_initFunctionPyTypeObject(recv_node_type, "RecvRpcBackward",
                                               recv_node_properties, recv_node_methods);
    torch::autograd::registerCppFunction(typeid(RecvRpcBackward), &recv_node_type);
  }
  // the torch it was built against (its structures are read directly) and the digest of
  // this file: the loader refuses the module under any other torch, or beside another
  // version of this file (``_functions._load_native``)
  if (PyModule_AddStringConstant(created, "TORCH_VERSION", ACTORRPC_TORCH_VERSION) < 0 ||
      PyModule_AddStringConstant(created, "SOURCE_DIGEST", ACTORRPC_SOURCE_DIGEST) < 0 ||
      PyModule_AddObjectRef(created, "RecvRpcBackward", (PyObject*)&recv_node_type) < 0) {
    Py_DECREF(created);
    return nullptr;
  }
  return created;
}
