// genie._C_plans' runner: one session's native plans and the loop that runs a batch's commands by them
// (runner.cpp says how), bound to the session's store and metrics through runner_binding.h.
#pragma once

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "server/native_plan.h"

namespace genie_plans {

// One intra-op thread on the calling thread (true) or its own count (false); a change only calls torch.
void set_threads(bool serial);

// Whether a kernel call's NotImplementedError says the device has no kernel for the op ("Could not run ..."):
// torch's decomposition then runs it, in Python.
bool no_kernel(const c10::NotImplementedError& error);

class Runner {
 public:
  // max_keyed: the longest command keyed (genie.server.plans.MAX_KEYED_BYTES); max_freed: freed ids the store
  // remembers before starting over (genie.server.store.MAX_REMEMBERED_FREES).
  Runner(size_t max_keyed, Py_ssize_t max_freed);
  ~Runner();

  // The native plan of a key; None drops the key's (its plan is one only Python runs now).
  void add(pybind11::bytes key, std::shared_ptr<NativePlan> plan);
  void clear();
  size_t size() const;
  // The wire's numbers serve() frames with (genie.wire.frame, genie.transport.record).
  void set_wire(int version, int batch, int reply, int inline_record, uint64_t max_body);
  // Where the op clock of a session worker lives (genie.server.isolation.clock.OpClock.address); 0: none.
  void set_clock(uintptr_t address);
  // Bind the session's store and metrics (a genie.server.runner_api.RunnerBinding).
  void bind(pybind11::handle binding);
  // Run a batch's commands from `start` while their plans allow (runner.cpp: Impl::run).
  pybind11::tuple run(pybind11::list cmds, Py_ssize_t start, int64_t bytes_used, int64_t max_op_elements,
                      int64_t pool_min, bool quiet);
  // Wait for the session's next frame on socket `fd` and run it here where it can (runner.cpp: Impl::serve).
  pybind11::tuple serve(int fd, bool records, int64_t bytes_used, int64_t max_op_elements, int64_t pool_min,
                        bool quiet, size_t max_commands);
  // The bytes the runs since the last call adopted (positive) and freed (negative).
  int64_t take_grown();
  // BATCH frames serve() read whole and took on.
  uint64_t served() const;
  // The last REPLY frame serve() sent, once (None when it sent none since the last call).
  pybind11::object take_reply();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace genie_plans
