// The runner's binding to the Python core: everything genie._C_plans reads of it, in one place
// (genie/server/runner_api.py lists the same from the Python side). Named tuples, read by position and
// checked; their field names, in order, are exported (SPEC_FIELDS ...) and a test compares them with the
// Python classes' _fields. Of the metrics' latency (genie.server.metrics.Latency) the public counts and sum
// are read and written here; nothing else of Python is looked up by name.
#pragma once

#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace genie_plans {

// A Python sequence of ints, and a torch.dtype's scalar type (runtime_error for anything else).
std::vector<int64_t> int_list(pybind11::handle seq);
at::ScalarType dtype_of(pybind11::handle obj);

// A session's store (genie.server.store.StoreTables): its maps, borrowed from the binding the runner keeps,
// and its quotas.
struct BoundStore {
  PyObject* storages = nullptr;
  PyObject* sizes = nullptr;
  PyObject* poisoned = nullptr;
  PyObject* freed = nullptr;
  int64_t max_storages = 0;
  int64_t max_bytes = 0;
};

// A session's metrics (genie.server.metrics.OkTally), borrowed likewise; ops is null when none are bound.
struct BoundMetrics {
  PyObject* ops = nullptr;
  PyObject* latency = nullptr;
  PyObject* counts = nullptr;
  std::vector<double> buckets;
  pybind11::object record_op = pybind11::none();
};

// What Runner.bind takes (a genie.server.runner_api.RunnerBinding), checked whole before anything is kept.
struct Binding {
  pybind11::object keep = pybind11::none();  // the RunnerBinding itself: it owns what the rest borrows
  BoundStore store;
  BoundMetrics metrics;
};
Binding read_binding(pybind11::handle binding);

// Count op `label` that ran (`ok`) or failed in `seconds`, as SessionMetrics.record_op counts it: a name the
// session counted before in place, through the tally; anything else by calling record_op.
void record_op(const BoundMetrics& metrics, pybind11::handle label, bool ok, double seconds);

// The field names of each tuple read here, as module attributes (SPEC_FIELDS, LAYOUT_FIELDS, BINDING_FIELDS,
// TABLES_FIELDS, TALLY_FIELDS).
void export_field_names(pybind11::module_& m);

}  // namespace genie_plans
