// genie._C_plans' graph program (graph_program.h): an admitted replay's nodes, run in C++.
//
// genie.server.graphs keeps each graph a client defined as validated nodes, and runs a replay's nodes in
// Python: the first replay of an input signature checked in full (genie.server.graph_gate), later ones
// admitted by that signature's gate. An admitted replay comes here, built once per graph from the same
// validated nodes (genie.server.runner_api.graph_node_spec; nothing is read from the network here):
//
// - a node whose op runs as a plain call (its own dispatch, or the composite kernel the client lowered it to;
//   no validator, no session-bound runner) gets its OperatorHandle and an argument stack with the constants
//   converted once, as torch converts a Python call's; references fill the stack per run (keywords such as
//   out= too), tensor lists (cat's tensors, index's indices) are rebuilt per run;
// - any other node is run by the program's Python callable (the python_node of genie.server.graphs._program),
//   with its arguments built from its templates: the same code the Python loop runs. So is a node whose device
//   has no kernel (torch's decomposition runs in Python), from then on;
// - per node, in the Python loop's order: intra-op threads by the size rule (runner.cpp's set_threads, on
//   a CPU device), the call, an empty-family result zeroed (genie.server.kernel.zero_fresh), the slots whose
//   last use it was dropped.
//
// The GIL is released across runs of plain nodes and taken back for a Python node, so another thread of
// the worker waiting for it (a compile) costs one hand-over per Python node, not one per node.

#include "server/graph_program.h"

#include <ATen/ATen.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/python_arg_parser.h>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "server/native_plan.h"
#include "server/runner.h"
#include "server/runner_binding.h"

namespace py = pybind11;

namespace genie_plans {
namespace {

// genie.server.runner_api.GraphNodeSpec
enum NodeField : size_t {
  kOpName, kOverload, kArgs, kKwargs, kRefs, kNested, kKwRefs, kRelease, kZero, kKernel, kNative, kNodeFields
};
const char* const kNodeNames[kNodeFields] = {"op_name", "overload", "args", "kwargs", "refs",   "nested",
                                             "kw_refs", "release",  "zero", "kernel", "native"};

// The composite kernels a node may ask for (genie.wire.graph.KERNELS, checked when the graph was defined).
std::optional<c10::DispatchKey> composite_kernel(const std::string& name) {
  if (name == "CompositeExplicitAutograd") return c10::DispatchKey::CompositeExplicitAutograd;
  if (name == "CompositeExplicitAutogradNonFunctional") return c10::DispatchKey::CompositeExplicitAutogradNonFunctional;
  return std::nullopt;
}

SlotRef slot_ref(py::handle ref) {
  return SlotRef{ref.attr("slot").cast<size_t>(), ref.attr("item").cast<int64_t>()};
}

void add_tensors(const c10::IValue& v, std::vector<at::Tensor>* out) {
  if (v.isTensor()) {
    out->push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) out->push_back(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) add_tensors(e, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) add_tensors(e, out);
  }
}

// The Python loop's rule (genie.server.kernel.serial_size): one intra-op thread when every input tensor is small.
bool serial_inputs(const torch::jit::Stack& stack) {
  std::vector<at::Tensor> tensors;
  for (const c10::IValue& v : stack) add_tensors(v, &tensors);
  return std::all_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.numel() < kSerialBelow; });
}

// genie.server.kernel.zero_fresh: every strided result over a storage the command did not use is zeroed whole.
void zero_fresh(const c10::IValue& result, const std::unordered_set<uintptr_t>& held) {
  std::vector<at::Tensor> tensors;
  add_tensors(result, &tensors);
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) continue;
    const c10::Storage& storage = t.storage();
    if (held.count(reinterpret_cast<uintptr_t>(storage.data())) || storage.nbytes() == 0) continue;
    at::Tensor raw = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(storage.device()));
    raw.set_(storage);
    raw.zero_();
  }
}

// A graph input as an IValue: tensors, numbers, None and lists of tensors (what genie.server.executor resolves
// a replay's inputs to); false for anything else, which the Python loop runs instead.
bool input_value(py::handle obj, c10::IValue* out) {
  if (THPVariable_Check(obj.ptr())) {
    *out = THPVariable_Unpack(obj.ptr());
  } else if (obj.is_none()) {
    *out = c10::IValue();
  } else if (PyBool_Check(obj.ptr())) {
    *out = obj.cast<bool>();
  } else if (PyLong_CheckExact(obj.ptr())) {
    *out = obj.cast<int64_t>();
  } else if (PyFloat_CheckExact(obj.ptr())) {
    *out = obj.cast<double>();
  } else if (PyList_CheckExact(obj.ptr()) || PyTuple_CheckExact(obj.ptr())) {
    c10::List<at::Tensor> tensors;
    for (py::handle e : obj) {
      if (!THPVariable_Check(e.ptr())) return false;
      tensors.push_back(THPVariable_Unpack(e.ptr()));
    }
    *out = std::move(tensors);
  } else {
    return false;
  }
  return true;
}

// A value as the Python loop holds it: an undefined tensor (an output a backward op was asked not to make) is
// None, inside tuples and lists too.
py::object to_python(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return py::none();
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  }
  if (v.isTuple()) {
    const auto& elements = v.toTupleRef().elements();
    py::tuple out(elements.size());
    for (size_t k = 0; k < elements.size(); ++k) out[k] = to_python(elements[k]);
    return std::move(out);
  }
  if (v.isList()) {
    py::list out;
    for (const c10::IValue& e : v.toListRef()) out.append(to_python(e));
    return std::move(out);
  }
  return torch::jit::toPyObject(v);
}

}  // namespace

py::object tensor_over(py::handle storage, py::handle dtype, int64_t offset, py::handle sizes, py::handle strides) {
  if (!THPStorage_Check(storage.ptr()))
    throw std::invalid_argument("genie: tensor_over(storage, dtype, offset, sizes, strides) takes an UntypedStorage");
  const c10::Storage& s = THPStorage_Unpack(storage.ptr());
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype_of(dtype)).device(s.device()));
  t.set_(s, offset, int_list(sizes), int_list(strides));
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

py::tuple graph_node_fields() {
  py::tuple out(static_cast<size_t>(kNodeFields));
  for (size_t i = 0; i < kNodeFields; ++i) out[i] = py::str(kNodeNames[i]);
  return out;
}

GraphProgram::GraphProgram(py::list nodes, size_t inputs, py::handle ref_type, py::object python_node, bool cpu)
    : inputs_(inputs),
      ref_type_(py::reinterpret_borrow<py::object>(ref_type)),
      python_node_(std::move(python_node)),
      cpu_(cpu) {
  nodes_.reserve(nodes.size());
  for (py::handle entry : nodes) {
    if (!PyTuple_Check(entry.ptr()) || static_cast<size_t>(PyTuple_GET_SIZE(entry.ptr())) != kNodeFields)
      throw std::runtime_error("genie: expected a GraphNodeSpec (genie.server.runner_api)");
    auto spec = py::reinterpret_borrow<py::tuple>(entry);
    GraphNode node;
    auto name = spec[kOpName].cast<std::string>();
    auto handle = c10::Dispatcher::singleton().findSchema({name, spec[kOverload].cast<std::string>()});
    if (!handle) throw std::runtime_error("no operator " + name);
    const auto& schema = handle->schema();
    node.returns = schema.returns().size();
    for (const auto& r : schema.returns()) node.return_types.push_back(r.type());
    node.args = spec[kArgs];
    node.kwargs = spec[kKwargs];
    for (py::handle slot : spec[kRelease]) node.release.push_back(slot.cast<size_t>());
    node.zero = spec[kZero].cast<bool>();
    node.python = !spec[kNative].cast<bool>() || schema.is_vararg();
    auto kernel = spec[kKernel].cast<std::string>();
    if (!kernel.empty()) {
      node.kernel = composite_kernel(kernel);
      if (!node.kernel) node.python = true;
    }
    if (!node.python) {
      try {
        node.op.emplace(*handle);
        const auto& arguments = schema.arguments();
        py::list args = spec[kArgs];
        py::dict kwargs = spec[kKwargs];
        if (args.size() > arguments.size()) throw std::runtime_error("more arguments than the schema has");
        std::unordered_map<size_t, SlotRef> refs;
        for (py::handle r : spec[kRefs]) {
          auto t = r.cast<py::tuple>();
          refs.emplace(t[0].cast<size_t>(), SlotRef{t[1].cast<size_t>(), t[2].cast<int64_t>()});
        }
        std::unordered_map<size_t, py::object> nested;
        for (py::handle r : spec[kNested]) {
          auto t = r.cast<py::tuple>();
          nested.emplace(t[0].cast<size_t>(), t[1]);
        }
        std::unordered_map<std::string, py::object> keyword_refs;
        for (py::handle r : spec[kKwRefs]) {
          auto t = r.cast<py::tuple>();
          keyword_refs.emplace(t[0].cast<std::string>(), t[1]);
        }
        size_t keyword_refs_used = 0;
        for (size_t i = args.size(); i < arguments.size(); ++i) {
          auto found = keyword_refs.find(arguments[i].name());
          if (found == keyword_refs.end()) continue;
          if (py::isinstance(found->second, ref_type_))
            refs.emplace(i, slot_ref(found->second));
          else
            nested.emplace(i, found->second);
          ++keyword_refs_used;
        }
        if (keyword_refs_used != keyword_refs.size()) throw std::runtime_error("a keyword the schema does not have");
        std::string bare = name.substr(name.find("::") == std::string::npos ? 0 : name.find("::") + 2);
        torch::jit::ToIValueAllowNumbersAsTensors numbers(torch::should_allow_numbers_as_tensors(bare));
        size_t keywords = 0;
        for (size_t i = 0; i < arguments.size(); ++i) {
          const auto& argument = arguments[i];
          auto ref = refs.find(i);
          auto list = nested.find(i);
          bool keyword = i >= args.size();
          if (keyword && kwargs.contains(argument.name())) ++keywords;
          if (ref != refs.end()) {
            node.fills.emplace_back(i, ref->second);
            node.stack.emplace_back();
          } else if (list != nested.end()) {
            auto type = argument.type()->cast<c10::ListType>();
            if (!type) throw std::runtime_error("a reference inside a non-list argument");
            auto element = type->getElementType();
            bool optional = element->kind() == c10::TypeKind::OptionalType;
            if (!optional && element->kind() != c10::TypeKind::TensorType)
              throw std::runtime_error("a reference inside a list of " + element->str());
            ListFill fill{i, optional, {}};
            for (py::handle e : list->second) {
              if (py::isinstance(e, ref_type_)) {
                fill.elements.emplace_back(slot_ref(e));
              } else if (e.is_none() && optional) {
                fill.elements.emplace_back(std::nullopt);
              } else {
                throw std::runtime_error("a tensor list holding a constant");
              }
            }
            node.lists.push_back(std::move(fill));
            node.stack.emplace_back();
          } else if (!keyword) {
            node.stack.push_back(torch::jit::toIValue(args[i], argument.type()));
          } else if (kwargs.contains(argument.name())) {
            node.stack.push_back(torch::jit::toIValue(kwargs[py::str(argument.name())], argument.type()));
          } else if (argument.default_value()) {
            node.stack.push_back(*argument.default_value());
          } else {
            throw std::runtime_error("argument " + argument.name() + " has no value");
          }
        }
        if (keywords != kwargs.size()) throw std::runtime_error("a keyword argument the schema does not have");
      } catch (const py::error_already_set&) {
        PyErr_Clear();
        node.python = true;
      } catch (const std::exception&) {
        node.python = true;  // a shape the program does not run: Python runs the node, as the loop would
      }
      if (node.python) {
        node.op.reset();
        node.stack.clear();
        node.fills.clear();
        node.lists.clear();
      }
    }
    nodes_.push_back(std::move(node));
  }
}

size_t GraphProgram::python_nodes() const {
  return static_cast<size_t>(std::count_if(nodes_.begin(), nodes_.end(), [](const GraphNode& n) { return n.python; }));
}

c10::IValue GraphProgram::value(const std::vector<c10::IValue>& env, const SlotRef& ref) const {
  const c10::IValue& v = env.at(ref.slot);
  if (ref.item < 0) return v;
  if (v.isTuple()) return v.toTupleRef().elements().at(static_cast<size_t>(ref.item));
  if (v.isList()) return v.toListRef().at(static_cast<size_t>(ref.item));
  throw std::runtime_error("genie: a reference to an item of a value that is not a sequence");
}

torch::jit::Stack GraphProgram::arguments(const GraphNode& node, const std::vector<c10::IValue>& env) const {
  torch::jit::Stack stack = node.stack;
  for (const auto& fill : node.fills) stack[fill.first] = value(env, fill.second);
  for (const auto& list : node.lists) {
    if (list.optional) {
      c10::List<std::optional<at::Tensor>> out;
      for (const auto& e : list.elements)
        out.push_back(e ? std::optional<at::Tensor>(value(env, *e).toTensor()) : std::nullopt);
      stack[list.position] = std::move(out);
    } else {
      c10::List<at::Tensor> out;
      for (const auto& e : list.elements) out.push_back(value(env, *e).toTensor());
      stack[list.position] = std::move(out);
    }
  }
  return stack;
}

py::object GraphProgram::build(py::handle tmpl, const std::vector<c10::IValue>& env) const {
  if (py::isinstance(tmpl, ref_type_)) return to_python(value(env, slot_ref(tmpl)));
  if (PyList_CheckExact(tmpl.ptr())) {
    py::list out;
    for (py::handle e : tmpl) out.append(build(e, env));
    return std::move(out);
  }
  if (PyDict_CheckExact(tmpl.ptr())) {
    py::dict out;
    for (auto item : py::reinterpret_borrow<py::dict>(tmpl)) out[item.first] = build(item.second, env);
    return std::move(out);
  }
  return py::reinterpret_borrow<py::object>(tmpl);
}

void GraphProgram::run_python(size_t index, GraphNode& node, std::vector<c10::IValue>& env, size_t slot) {
  py::object args = build(node.args, env);
  py::object kwargs = build(node.kwargs, env);
  failed_arguments_ = py::make_tuple(args, kwargs);
  py::object result = python_node_(index, args, kwargs, held_);
  failed_arguments_ = py::none();
  if (node.returns == 0) {
    env[slot] = c10::IValue();
  } else if (node.returns == 1) {
    env[slot] = torch::jit::toIValue(result, node.return_types[0]);
  } else {
    auto items = py::reinterpret_borrow<py::sequence>(result);
    if (items.size() != node.returns) throw std::runtime_error("genie: a node returned another number of values");
    std::vector<c10::IValue> elements;
    for (size_t k = 0; k < node.returns; ++k) elements.push_back(torch::jit::toIValue(items[k], node.return_types[k]));
    env[slot] = c10::ivalue::Tuple::create(std::move(elements));
  }
}

bool GraphProgram::run_plain(GraphNode& node, std::vector<c10::IValue>& env, size_t slot,
                             const std::unordered_set<uintptr_t>& held) {
  torch::jit::Stack stack = arguments(node, env);
  if (cpu_) set_threads(serial_inputs(stack));
  try {
    if (node.kernel)
      node.op->callBoxedForDispatchKey(*node.kernel, stack);  // OpOverload._op_dk's call
    else
      node.op->callBoxed(stack);
  } catch (const c10::NotImplementedError& e) {
    if (node.kernel || !no_kernel(e)) throw;  // a composite kernel has no decomposition to fall to
    node.python = true;  // no kernel on this device: torch's decomposition, in Python, from now on
    return false;
  }
  if (node.returns == 0)
    env[slot] = c10::IValue();
  else if (node.returns == 1)
    env[slot] = std::move(stack[0]);
  else
    env[slot] = c10::ivalue::Tuple::create(std::vector<c10::IValue>(stack.begin(), stack.end()));
  if (node.zero) zero_fresh(env[slot], held);
  return true;
}

bool GraphProgram::run(py::list env_list, py::handle held, py::handle wanted) {
  std::vector<c10::IValue> env(inputs_ + nodes_.size());
  for (size_t i = 0; i < inputs_; ++i)
    if (!input_value(env_list[i], &env[i])) return false;
  std::unordered_set<uintptr_t> held_ptrs;
  for (py::handle p : held) held_ptrs.insert(p.cast<uintptr_t>());
  held_ = py::reinterpret_borrow<py::object>(held);
  failed_node_ = -1;
  failed_arguments_ = py::none();
  size_t slot = inputs_;
  std::exception_ptr failure;
  {
    py::gil_scoped_release no_gil;  // across plain nodes; a Python node takes it back for its call
    for (size_t i = 0; i < nodes_.size(); ++i, ++slot) {
      GraphNode& node = nodes_[i];
      try {
        if (node.python || !run_plain(node, env, slot, held_ptrs)) {
          py::gil_scoped_acquire gil;
          run_python(i, node, env, slot);
        }
      } catch (...) {
        failed_node_ = static_cast<int64_t>(i);
        failure = std::current_exception();
        break;
      }
      for (size_t dead : node.release) env[dead] = c10::IValue();
    }
  }
  if (failure) {
    if (failed_arguments_.is_none() && !nodes_[failed_node_].python) {
      // The failing plain node's arguments, as the Python loop's error record names their shapes.
      GraphNode& node = nodes_[failed_node_];
      py::list args;
      try {
        for (const c10::IValue& v : arguments(node, env)) args.append(to_python(v));
      } catch (...) {  // a reference that failed itself: the record names no shapes
        args = py::list();
      }
      failed_arguments_ = py::make_tuple(args, py::dict());
    }
    held_ = py::none();
    try {
      std::rethrow_exception(failure);
    } catch (const py::error_already_set&) {
      throw;
    } catch (...) {
      torch::translate_exception_to_python(std::current_exception());
      throw py::error_already_set();
    }
  }
  held_ = py::none();
  for (py::handle w : wanted) {
    auto s = w.cast<size_t>();
    if (s >= inputs_ && s < env.size()) env_list[s] = to_python(env[s]);
  }
  return true;
}

}  // namespace genie_plans
