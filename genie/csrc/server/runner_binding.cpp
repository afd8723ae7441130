// The runner's binding to the Python core (runner_binding.h): the only C++ of genie._C_plans that reads
// Python objects of the core.

#include "server/runner_binding.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/python_arg_parser.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "server/native_plan.h"

namespace py = pybind11;

namespace genie_plans {

std::vector<int64_t> int_list(py::handle seq) {
  std::vector<int64_t> out;
  for (py::handle v : seq) out.push_back(v.cast<int64_t>());
  return out;
}

at::ScalarType dtype_of(py::handle obj) {
  if (!THPDtype_Check(obj.ptr())) throw std::runtime_error("not a torch.dtype");
  return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
}

namespace {

// genie.server.runner_api.NativeSpec
enum SpecField : size_t {
  kOpName, kOverload, kLabel, kDevice, kCallOuts, kWrites, kNewBytes, kMaxOpElements, kArgs, kKwargs, kArgFill,
  kKwFill, kFloatValues, kFloatFill, kInputs, kFreshSlots, kOutputs, kNestedFill, kSpecFields
};
const char* const kSpecNames[kSpecFields] = {
    "op_name", "overload", "label", "device", "call_outs", "writes", "new_bytes", "max_op_elements", "args",
    "kwargs", "arg_fill", "kw_fill", "float_values", "float_fill", "inputs", "fresh_slots", "outputs", "nested_fill"};
// genie.server.runner_api.Layout
enum LayoutField : size_t { kSlot, kNbytes, kOffset, kSizes, kStrides, kDtype, kLayoutFields };
const char* const kLayoutNames[kLayoutFields] = {"slot", "nbytes", "offset", "sizes", "strides", "dtype"};
// genie.server.runner_api.RunnerBinding
enum BindingField : size_t { kTables, kTally, kBindingFields };
const char* const kBindingNames[kBindingFields] = {"tables", "tally"};
// genie.server.store.StoreTables
enum TablesField : size_t { kStorages, kSizesMap, kPoisoned, kFreed, kMaxStorages, kMaxBytes, kTablesFields };
const char* const kTablesNames[kTablesFields] = {"storages", "sizes", "poisoned", "freed", "max_storages",
                                                 "max_bytes"};
// genie.server.metrics.OkTally; of its latency (genie.server.metrics.Latency) the public counts and sum
enum TallyField : size_t { kOps, kLatency, kBuckets, kRecordOp, kTallyFields };
const char* const kTallyNames[kTallyFields] = {"ops", "latency", "buckets", "record_op"};

py::tuple field_names(const char* const* names, size_t n) {
  py::tuple out(n);
  for (size_t i = 0; i < n; ++i) out[i] = py::str(names[i]);
  return out;
}

// `obj` as one of the binding's tuples of `n` fields (named `what` in the error).
py::tuple fields_of(py::handle obj, size_t n, const char* what) {
  if (!PyTuple_Check(obj.ptr()) || static_cast<size_t>(PyTuple_GET_SIZE(obj.ptr())) != n)
    throw std::runtime_error(std::string("genie: expected a ") + what + " (genie.server.runner_api)");
  return py::reinterpret_borrow<py::tuple>(obj);
}

// A genie.server.runner_api.Layout as native_plan.h's Input (an Output adds whether the client keeps it).
Input layout_of(py::handle obj) {
  py::tuple t = fields_of(obj, kLayoutFields, "Layout");
  return Input{t[kSlot].cast<size_t>(), t[kNbytes].cast<int64_t>(), t[kOffset].cast<int64_t>(),
                int_list(t[kSizes]), int_list(t[kStrides]), dtype_of(t[kDtype])};
}


// SessionMetrics.record_op for an op that ran ("ok") and whose name the session counted before, without a
// Python call (three per `.item()` round trip otherwise), as genie.server.metrics.OkTally says; false leaves
// it to record_op (a new name).
bool count_ok(const BoundMetrics& m, py::handle label, PyObject* ok_status, double seconds) {
  PyObject* key = PyTuple_Pack(2, label.ptr(), ok_status);
  if (key == nullptr) throw py::error_already_set();
  PyObject* count = PyDict_GetItemWithError(m.ops, key);  // borrowed
  if (count == nullptr) {
    Py_DECREF(key);
    if (PyErr_Occurred()) throw py::error_already_set();
    return false;
  }
  auto bump = [](PyObject* v) { return PyLong_FromLongLong(PyLong_AsLongLong(v) + 1); };
  PyObject* next = bump(count);
  int failed = next == nullptr || PyDict_SetItem(m.ops, key, next) != 0;
  Py_XDECREF(next);
  Py_DECREF(key);
  if (failed) throw py::error_already_set();
  auto bucket = static_cast<Py_ssize_t>(std::lower_bound(m.buckets.begin(), m.buckets.end(), seconds) - m.buckets.begin());
  if (bucket >= PyList_GET_SIZE(m.counts)) throw std::runtime_error("genie: latency buckets out of step");
  PyObject* in_bucket = bump(PyList_GET_ITEM(m.counts, bucket));
  if (in_bucket == nullptr) throw py::error_already_set();
  PyList_SetItem(m.counts, bucket, in_bucket);  // steals in_bucket, drops the old count
  static PyObject* sum_name = PyUnicode_InternFromString("sum");
  PyObject* sum = PyObject_GetAttr(m.latency, sum_name);
  PyObject* total = sum == nullptr ? nullptr : PyFloat_FromDouble(PyFloat_AsDouble(sum) + seconds);
  failed = total == nullptr || PyObject_SetAttr(m.latency, sum_name, total) != 0;
  Py_XDECREF(sum);
  Py_XDECREF(total);
  if (failed) throw py::error_already_set();
  return true;
}


}  // namespace

NativePlan::NativePlan(py::handle spec_object) {
  py::tuple spec = fields_of(spec_object, kSpecFields, "NativeSpec");
  auto name = spec[kOpName].cast<std::string>();
  auto overload = spec[kOverload].cast<std::string>();
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!handle) throw std::runtime_error("no operator " + name + "." + overload);
  op_.emplace(*handle);
  label_ = spec[kLabel];
  label_text_ = label_.cast<std::string>();
  clock_label_.assign(kClockLabel, '\0');
  std::memcpy(clock_label_.data(), label_text_.data(), std::min(label_text_.size(), kClockLabel));
  py::object device = spec[kDevice];
  if (!THPDevice_Check(device.ptr())) throw std::runtime_error("NativeSpec.device is not a torch.device");
  device_ = reinterpret_cast<THPDevice*>(device.ptr())->device;
  call_outs_ = spec[kCallOuts].cast<int64_t>();
  writes_ = spec[kWrites].cast<bool>();
  new_bytes_ = spec[kNewBytes].cast<int64_t>();
  max_op_elements_ = spec[kMaxOpElements].cast<int64_t>();

  // The argument stack: every schema argument, constants converted as torch converts a Python call's.
  const auto& arguments = op_->schema().arguments();
  py::list args = spec[kArgs];
  py::dict kwargs = spec[kKwargs];
  if (args.size() > arguments.size()) throw std::runtime_error("more arguments than the schema has");
  std::unordered_map<size_t, size_t> positional_fill;  // argument position -> input index
  for (py::handle pair : spec[kArgFill]) {
    auto t = pair.cast<py::tuple>();
    positional_fill[t[0].cast<size_t>()] = t[1].cast<size_t>();
  }
  std::unordered_map<std::string, size_t> keyword_fill;
  for (py::handle pair : spec[kKwFill]) {
    auto t = pair.cast<py::tuple>();
    keyword_fill[t[0].cast<std::string>()] = t[1].cast<size_t>();
  }
  // Lists of tensors (cat's, stack's): every element a storage, the argument a Tensor[] (not Tensor?[]).
  std::unordered_map<size_t, TensorListFill> list_fill;  // argument position -> its elements' input indices
  size_t list_inputs = 0;
  for (py::handle entry : spec[kNestedFill]) {
    auto t = entry.cast<py::tuple>();
    auto position = t[0].cast<size_t>();
    auto inner = t[1].cast<py::list>();
    auto items = t[2].cast<py::list>();
    if (position >= arguments.size() || position >= args.size()) throw std::runtime_error("a list past the arguments");
    auto list_type = arguments[position].type()->cast<c10::ListType>();
    if (!list_type || list_type->getElementType()->kind() != c10::TypeKind::TensorType)
      throw std::runtime_error("a list of tensors for an argument of type " + arguments[position].type()->str());
    if (items.size() != inner.size()) throw std::runtime_error("a list of tensors and other values");
    TensorListFill fill{position, {}};
    for (size_t k = 0; k < items.size(); ++k) {
      auto item = items[k].cast<py::tuple>();
      if (item[0].cast<size_t>() != k) throw std::runtime_error("a list's tensors out of order");
      fill.inputs.push_back(item[1].cast<size_t>());
    }
    list_inputs += fill.inputs.size();
    list_fill.emplace(position, std::move(fill));
  }
  size_t keywords_used = 0;
  // Numbers where a Tensor is expected (x + 1) convert as torch's Python op call converts them.
  std::string bare = name.substr(name.find("::") == std::string::npos ? 0 : name.find("::") + 2);
  torch::jit::ToIValueAllowNumbersAsTensors numbers(torch::should_allow_numbers_as_tensors(bare));
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto& argument = arguments[i];
    auto fill = positional_fill.find(i);
    auto listed = list_fill.find(i);
    bool written = argument.alias_info() != nullptr && argument.alias_info()->isWrite();
    bool slot = (i < args.size() && (fill != positional_fill.end() || listed != list_fill.end())) ||
                (i >= args.size() && keyword_fill.count(argument.name()));
    // A constant is converted once and shared by every run: never one the op writes.
    if (written && !slot) throw std::runtime_error("a written argument that is not a storage");
    if (i < args.size()) {
      if (fill != positional_fill.end()) {
        fills_.emplace_back(i, fill->second);
        stack_.emplace_back();
      } else if (listed != list_fill.end()) {
        list_fills_.push_back(std::move(listed->second));
        stack_.emplace_back();
      } else {
        stack_.push_back(torch::jit::toIValue(args[i], argument.type()));
      }
      continue;
    }
    auto keyword = keyword_fill.find(argument.name());
    if (keyword != keyword_fill.end()) {
      fills_.emplace_back(i, keyword->second);
      stack_.emplace_back();
      ++keywords_used;
    } else if (kwargs.contains(argument.name())) {
      stack_.push_back(torch::jit::toIValue(kwargs[py::str(argument.name())], argument.type()));
      ++keywords_used;
    } else if (argument.default_value()) {
      stack_.push_back(*argument.default_value());
    } else {
      throw std::runtime_error("argument " + argument.name() + " has no value");
    }
  }
  if (keywords_used != kwargs.size())  // kwargs names its tensor slots too (their values are None)
    throw std::runtime_error("a keyword argument the schema does not have");

  // The command's floats: compared with the ones checked (float_values), or filled in per command
  // (float_fill: top-level float or Scalar arguments, and numbers where a Tensor goes, wrapped as torch
  // wraps them; a float inside a list leaves the plan to Python).
  py::object values = spec[kFloatValues];
  if (!values.is_none()) {
    has_float_values_ = true;
    for (py::handle v : values) float_values_.push_back(v.cast<double>());
  }
  size_t float_index = 0;
  for (py::handle entry : spec[kFloatFill]) {
    auto t = entry.cast<py::tuple>();
    if (t[1].cast<int64_t>() >= 0) throw std::runtime_error("a float inside a list");
    size_t position;
    if (py::isinstance<py::int_>(t[0])) {
      position = t[0].cast<size_t>();
    } else {
      auto name = t[0].cast<std::string>();
      position = arguments.size();
      for (size_t i = 0; i < arguments.size(); ++i)
        if (arguments[i].name() == name) position = i;
    }
    if (position >= arguments.size()) throw std::runtime_error("a float for an argument the schema does not have");
    auto type = arguments[position].type();
    if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
    bool wrapped = type->kind() == c10::TypeKind::TensorType;
    if (!wrapped && type->kind() != c10::TypeKind::FloatType && type->kind() != c10::TypeKind::NumberType)
      throw std::runtime_error("a float for an argument of type " + type->str());
    float_fills_.push_back(FloatFill{position, float_index++, wrapped});
  }

  for (py::handle entry : spec[kInputs]) {
    inputs_.push_back(layout_of(entry));
  }
  if (fills_.size() + list_inputs != inputs_.size()) throw std::runtime_error("inputs and argument slots differ");
  // An out= op run in its functional form: its out arguments' storages must be new ones.
  for (py::handle slot : spec[kFreshSlots]) fresh_slots_.push_back(slot.cast<size_t>());
  for (py::handle entry : spec[kOutputs]) {
    if (entry.is_none()) {
      outputs_.push_back(Output{false, 0, 0, 0, {}, {}, at::ScalarType::Undefined});
      continue;
    }
    Input out = layout_of(entry);
    outputs_.push_back(Output{true, out.slot, out.nbytes, out.offset, std::move(out.sizes), std::move(out.strides),
                              out.dtype});
    ++kept_outputs_;
  }
  int64_t largest = 0;
  auto count = [](const std::vector<int64_t>& sizes) {
    int64_t n = 1;
    for (int64_t d : sizes) n *= d;
    return n;
  };
  for (const auto& in : inputs_) largest = std::max(largest, count(in.sizes));
  serial_ = largest < kSerialBelow && device_.is_cpu();
}

Binding read_binding(py::handle binding) {
  py::tuple b = fields_of(binding, kBindingFields, "RunnerBinding");
  py::tuple tables = fields_of(b[kTables], kTablesFields, "StoreTables");
  if (!PyDict_Check(tables[kStorages].ptr()) || !PyDict_Check(tables[kSizesMap].ptr()) ||
      !PyDict_Check(tables[kPoisoned].ptr()) || !PySet_Check(tables[kFreed].ptr()))
    throw std::runtime_error("genie: StoreTables holds dicts of storages, sizes and poisoned ids, a set of freed");
  int64_t max_storages = tables[kMaxStorages].cast<int64_t>();
  int64_t max_bytes = tables[kMaxBytes].cast<int64_t>();
  std::vector<double> buckets;
  PyObject* ops = nullptr;
  PyObject* latency = nullptr;
  PyObject* counts = nullptr;
  py::object record_op = py::none();
  if (!b[kTally].is_none()) {
    py::tuple tally = fields_of(b[kTally], kTallyFields, "OkTally");
    for (py::handle v : tally[kBuckets]) buckets.push_back(v.cast<double>());
    latency = tally[kLatency].ptr();
    py::object latency_counts = tally[kLatency].attr("counts");
    if (!PyDict_Check(tally[kOps].ptr()) || !PyList_Check(latency_counts.ptr()) ||
        static_cast<size_t>(PyList_GET_SIZE(latency_counts.ptr())) != buckets.size() + 1 ||
        !PyCallable_Check(tally[kRecordOp].ptr()))
      throw std::runtime_error("genie: OkTally holds a dict of ops, a latency with a count per bucket and one "
                               "more, and record_op");
    ops = tally[kOps].ptr();
    counts = latency_counts.ptr();
    record_op = tally[kRecordOp];
  }
  Binding out;
  out.keep = py::reinterpret_borrow<py::object>(binding);
  out.store = BoundStore{tables[kStorages].ptr(), tables[kSizesMap].ptr(), tables[kPoisoned].ptr(),
                         tables[kFreed].ptr(),   max_storages,            max_bytes};
  out.metrics.ops = ops;
  out.metrics.latency = latency;
  out.metrics.counts = counts;
  out.metrics.buckets = std::move(buckets);
  out.metrics.record_op = record_op;
  return out;
}

void record_op(const BoundMetrics& metrics, py::handle label, bool ok, double elapsed) {
  if (metrics.ops == nullptr) return;  // no metrics bound
  static PyObject* ok_status = PyUnicode_InternFromString("ok");
  static PyObject* error_status = PyUnicode_InternFromString("error");
  if (ok && count_ok(metrics, label, ok_status, elapsed)) return;
  PyObject* seconds = PyFloat_FromDouble(elapsed);
  PyObject* done = seconds == nullptr ? nullptr
                                      : PyObject_CallFunctionObjArgs(metrics.record_op.ptr(), label.ptr(),
                                                                     ok ? ok_status : error_status, seconds, nullptr);
  Py_XDECREF(seconds);
  if (done == nullptr) throw py::error_already_set();
  Py_DECREF(done);
}

void export_field_names(py::module_& m) {
  m.attr("SPEC_FIELDS") = field_names(kSpecNames, kSpecFields);
  m.attr("LAYOUT_FIELDS") = field_names(kLayoutNames, kLayoutFields);
  m.attr("BINDING_FIELDS") = field_names(kBindingNames, kBindingFields);
  m.attr("TABLES_FIELDS") = field_names(kTablesNames, kTablesFields);
  m.attr("TALLY_FIELDS") = field_names(kTallyNames, kTallyFields);
}

}  // namespace genie_plans
