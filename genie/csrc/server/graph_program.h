// genie._C_plans' graph program: an admitted replay of a defined graph (genie.server.graphs) run node by node
// in C++ (graph_program.cpp says how). The Python loop spent about 15 us a node binding arguments, choosing
// intra-op threads and calling the op; here a node costs its kernel and a dispatcher call.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace genie_plans {

// Where a node's argument comes from: slot `slot` of the environment, or item `item` of the sequence there.
struct SlotRef {
  size_t slot;
  int64_t item;  // -1: the slot's value itself
};

// A tensor-list argument rebuilt per run (cat's tensors, index's indices): per element a reference, or None.
struct ListFill {
  size_t position;                              // in the stack
  bool optional;                                // Tensor?[] (elements may be None) rather than Tensor[]
  std::vector<std::optional<SlotRef>> elements;  // nullopt: a None element
};

struct GraphNode {
  std::optional<c10::OperatorHandle> op;  // null for a node Python runs
  std::optional<c10::DispatchKey> kernel;  // the composite kernel asked for, or the op's own dispatch
  std::vector<c10::IValue> stack;          // the argument stack, constants converted once
  std::vector<std::pair<size_t, SlotRef>> fills;
  std::vector<ListFill> lists;
  std::vector<size_t> release;  // slots whose last use is this node
  bool zero = false;            // the empty family: a fresh result is zeroed (genie.server.kernel.zero_fresh)
  bool python = false;          // run by the program's Python callable (validators, session draws, ...)
  size_t returns = 0;           // the schema's returns (Python nodes: how their result is converted)
  std::vector<c10::TypePtr> return_types;
  pybind11::object args;        // Python nodes: the argument templates (genie.wire.graph.Ref where a value goes)
  pybind11::object kwargs;
};

// A tensor of `dtype` over `storage` (a torch.UntypedStorage) with that offset, sizes and strides, bounds already
// checked (genie.server.codec.Descriptor.over): torch.empty(0).set_(...) without two Python calls.
pybind11::object tensor_over(pybind11::handle storage, pybind11::handle dtype, int64_t offset, pybind11::handle sizes,
                             pybind11::handle strides);

// The field names of genie.server.runner_api.GraphNodeSpec as read here, in order (GRAPH_NODE_FIELDS).
pybind11::tuple graph_node_fields();

class GraphProgram {
 public:
  // nodes: genie.server.runner_api.GraphNodeSpec per node; ref_type: genie.wire.graph.Ref; python_node: called as
  // python_node(index, args, kwargs) for the nodes Python runs; cpu: intra-op threads by the size rule.
  GraphProgram(pybind11::list nodes, size_t inputs, pybind11::handle ref_type, pybind11::object python_node,
               bool cpu);

  // Run every node over `env` (a list: the inputs, then None per node); afterwards the slots `wanted` hold
  // their values (tensors, tuples, lists) for the output rule. `held`: data pointers of the storages the
  // command used (an empty-family result over one is not zeroed; a set, handed to the Python nodes too). A
  // failing node raises the Python error its op raised; failed_node() and failed_arguments() then name it.
  // False, with nothing run, for an input of a kind the program does not hold (the Python loop runs it).
  bool run(pybind11::list env, pybind11::handle held, pybind11::handle wanted);

  size_t python_nodes() const;
  int64_t failed_node() const { return failed_node_; }
  // The failing node's (args, kwargs), for the error record's shapes; None before a failure.
  pybind11::object failed_arguments() const { return failed_arguments_; }

 private:
  c10::IValue value(const std::vector<c10::IValue>& env, const SlotRef& ref) const;
  torch::jit::Stack arguments(const GraphNode& node, const std::vector<c10::IValue>& env) const;
  // A plain node's call into its slot; false, with nothing run, when its device has no kernel (it is a Python
  // node from then on).
  bool run_plain(GraphNode& node, std::vector<c10::IValue>& env, size_t slot, const std::unordered_set<uintptr_t>& held);
  void run_python(size_t index, GraphNode& node, std::vector<c10::IValue>& env, size_t slot);
  pybind11::object build(pybind11::handle tmpl, const std::vector<c10::IValue>& env) const;

  std::vector<GraphNode> nodes_;
  size_t inputs_;
  pybind11::object ref_type_;
  pybind11::object python_node_;
  bool cpu_;
  int64_t failed_node_ = -1;
  pybind11::object failed_arguments_ = pybind11::none();
  pybind11::object held_ = pybind11::none();
};

}  // namespace genie_plans
