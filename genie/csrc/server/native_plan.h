// What running one command signature natively needs: the op's dispatcher handle, an argument stack with
// the constants converted once, the input and output layouts the plan was checked with
// (genie.server.plans.CommandPlan has the full story). Plain data, which the runner reads.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace genie_plans {

constexpr size_t kClockLabel = 96;  // genie.server.isolation.clock: started_ns, then 96 bytes of op name
// Ops whose input tensors all have fewer elements than this run on one intra-op thread. Inputs only, on
// every path that runs an op (full path, plans, graph replays), so a result never depends on the path:
// a parallel reduction may differ from a serial one in its last bits.
constexpr int64_t kSerialBelow = int64_t(1) << 18;

struct Input {
  size_t slot;  // index in the command's storage ids
  int64_t nbytes;
  int64_t offset;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype;
};

struct Output {
  bool wanted;  // false: an output the client does not keep
  size_t slot;
  int64_t nbytes;
  int64_t offset;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype;
};

// A Tensor[] argument (cat's, stack's): its stack position and, element by element, the input it holds.
struct TensorListFill {
  size_t position;
  std::vector<size_t> inputs;
};

// What running one command signature natively needs (made from a genie.server.runner_api.NativeSpec).
class NativePlan {
 public:
  // Made from a genie.server.runner_api.NativeSpec (runner_binding.cpp, where the spec is read); raises when
  // the plan has a shape C++ does not run.
  explicit NativePlan(pybind11::handle spec);

  std::optional<c10::OperatorHandle> op_;
  pybind11::object label_;
  std::string label_text_;
  std::string clock_label_;
  c10::Device device_{c10::kCPU};
  int64_t call_outs_ = -1;  // a CALL's plan: how many output storage ids it gives
  bool writes_ = false;
  int64_t new_bytes_ = 0;
  int64_t max_op_elements_ = 0;
  std::vector<c10::IValue> stack_;
  std::vector<std::pair<size_t, size_t>> fills_;  // (stack position, input index)
  std::vector<TensorListFill> list_fills_;             // Tensor[] arguments, each element an input
  std::vector<Input> inputs_;
  std::vector<Output> outputs_;
  std::vector<size_t> fresh_slots_;  // ids that must be storages the session never made (out= run functional)
  struct FloatFill {
    size_t position;  // in the stack
    size_t index;     // in the command's floats
    bool wrapped;     // a number where a Tensor goes: a wrapped 0-dim double tensor, as torch makes it
  };
  std::vector<FloatFill> float_fills_;
  bool has_float_values_ = false;  // the floats decide metadata: only these values run by the plan
  std::vector<double> float_values_;
  size_t kept_outputs_ = 0;
  bool serial_ = false;  // small inputs on a CPU device: one intra-op thread (see kSerialBelow)
  bool decomposes_ = false;  // the device has no kernel: torch's decomposition runs, in Python
};

}  // namespace genie_plans
