// genie._C_plans' runner (runner.h): the server's native plan runner (genie.server.plans, genie.server.executor).
//
// A command plan (genie.server.plans.CommandPlan) is made in Python from a command the full path ran and
// checked. A plan of the common shape (tensors as direct arguments, no validator) also gets a NativePlan:
// its op's OperatorHandle and an argument stack with the constants converted once.
// Runner.run walks a batch's commands from an index and runs every one whose key has a NativePlan, doing
// in C++ what genie.server.plans.run does in Python, in the same order and with the same checks (and FREEs
// of storages the staging pool would not take, as StorageStore.free does):
//
// - the command is keyed by the walker genie._C_keys uses (command_key.h);
// - each input storage must be live in the session's store and hold exactly the bytes its descriptor said
//   when the plan was checked; the storage count and byte quotas must leave room for the outputs;
// - the kernel runs through the dispatcher with the GIL released, under the op clock of a session worker;
// - each result is adopted when it is fresh, dense and laid out as described (or already is the described
//   storage, for in-place ops), with the store's fast adoption checks.
//
// Anything else stops the walk. Before the kernel ran, nothing was done and Python runs the command by its
// full path, which raises what it always raised. After it ran (an error, a result the full output rule must
// judge, a storage resized in place, a CALL's answer), the outcome goes back to Python, which finishes the
// command as genie.server.plans does. Nothing here reads a value from the network that the full path did
// not check: a NativePlan is built only from a plan, and the bytes are only keyed and matched.
//
// It reads the Python core only through genie.server.runner_api (the binding section below): tuples by
// position, never a private name.

#include "server/runner.h"

#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorOptions.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "server/command_key.h"
#include "server/runner_binding.h"
#include "wire/frame_io.h"

namespace py = pybind11;

namespace genie_plans {
namespace {

constexpr uint64_t kMaxStorageId = (uint64_t(1) << 63) - 1;

// The calling thread's intra-op threads: one for a small op, its own count otherwise. On a CPU node a
// parallel region wakes the pool's sleeping threads (passive OpenMP: genie.server.isolation.supervisor),
// about 50 us across CPUs on a small VM, more than a small op's whole work: a 2-layer transformer step
// took 12.6 to 14 ms with the pool against 8.6 ms on one thread. at::set_num_threads is called only on
// a change (the count is per thread for OpenMP; the session's ops all run on its thread).
thread_local int tl_serial = -1;  // -1: not set yet on this thread
thread_local int tl_threads = 0;  // the thread's count before the first change

}  // namespace

void set_threads(bool serial) {
  if (tl_serial == static_cast<int>(serial)) return;
  if (tl_serial < 0) tl_threads = at::get_num_threads();
  at::set_num_threads(serial ? 1 : tl_threads);
  tl_serial = serial;
}

bool no_kernel(const c10::NotImplementedError& error) {
  return std::string(error.what_without_backtrace()).rfind("Could not run", 0) == 0;
}

namespace {

// A storage id as the key of the store's maps (a Python int, owned).
py::object id_key(uint64_t id) {
  PyObject* key = PyLong_FromUnsignedLongLong(id);
  if (key == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(key);
}

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace

struct Runner::Impl {
  // max_keyed: the longest command keyed (genie.server.plans.MAX_KEYED_BYTES); max_freed: freed ids the store
  // remembers before starting over (genie.server.store.MAX_REMEMBERED_FREES).
  Impl(size_t max_keyed, Py_ssize_t max_freed) : max_keyed_(max_keyed), max_freed_(max_freed) {}



  // The native plan of a key; None drops the key's (its plan is one only Python runs now).
  void add(py::bytes key, std::shared_ptr<NativePlan> plan) {
    if (plan)
      plans_[std::string(key)] = std::move(plan);
    else
      plans_.erase(std::string(key));
  }
  void clear() { plans_.clear(); }
  size_t size() const { return plans_.size(); }

  // The wire's numbers serve() frames with (genie.wire.frame, genie.transport.record).
  void set_wire(int version, int batch, int reply, int inline_record, uint64_t max_body) {
    if (!genie_io::same_spec(version, batch, reply, inline_record))
      throw std::invalid_argument("genie: the wire's numbers differ between genie/wire/spec.py and the built "
                                  "genie._C_plans: regenerate genie/csrc/wire/wire_spec.h (python -m genie.wire.spec "
                                  "--header) and rebuild");
    wire_.version = static_cast<uint8_t>(version);
    wire_.max_body = max_body;
  }

  // Wait for the session's next frame on socket `fd` (frames inside INLINE records when `records`; the GIL
  // released meanwhile) and run it here when it is a BATCH of commands only, at most `max_commands`, that
  // run() finishes (a CALL answered with a number: its REPLY sent here). Returns ("done", commands, ran);
  // else what Python takes on: ("batch", cmds, (index, ran, outcome)) where run() stopped, ("frame", head,
  // body or None, leftover) a frame read whole (Python's path checks and runs it; leftover: stream bytes
  // past it), ("resume", partial, kind, length) a record only the channel reads, ("io", why, text) the
  // socket ended (why: "closed", "timeout", "failed"). Other arguments as run()'s.
  py::tuple serve(int fd, bool records, int64_t bytes_used, int64_t max_op_elements, int64_t pool_min, bool quiet,
                  size_t max_commands) {
    using genie_io::Io;
    using genie_io::kHeader;
    genie_io::Frame frame;
    int err = 0;
    Io io;
    {
      py::gil_scoped_release nogil;
      io = genie_io::read_frame(fd, records, wire_, &frame, &err, {});
    }
    if (io != Io::ok) {
      const char* why = io == Io::closed ? "closed" : io == Io::timeout ? "timeout" : "failed";
      return py::make_tuple("io", why, genie_io::io_text(io, err, "receiving"));
    }
    if (frame.resume) return py::make_tuple("resume", py::bytes(frame.frame), frame.record_kind, frame.record_len);
    const std::string& f = frame.frame;
    bool whole = genie_io::whole(f);  // else the header failed read_frame's checks: Python names why
    size_t body_len = whole ? f.size() - kHeader : 0;
    std::vector<std::pair<size_t, size_t>> spans;
    if (!whole || genie_io::kind_of(f) != genie_wire::kKindBatch || genie_io::payload_of(f) != 0 ||
        !frame.leftover.empty() || !genie_io::batch_commands(f.data() + kHeader, body_len, &spans) ||
        spans.size() > max_commands) {
      py::object body = whole ? py::object(py::bytes(f.data() + kHeader, body_len)) : py::object(py::none());
      return py::make_tuple("frame", py::bytes(f.data(), std::min(f.size(), kHeader)), body, py::bytes(frame.leftover));
    }
    c10::AutoGradMode no_grad(false);  // what Executor.run_batch sets per batch
    bytes_ = bytes_used;
    ++served_;  // a BATCH read whole and taken on here: a resumed session counts it (genie.server.resume)
    py::list cmds(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      cmds[i] = py::bytes(f.data() + kHeader + spans[i].first, spans[i].second);
    }
    Py_ssize_t n = static_cast<Py_ssize_t>(spans.size());
    Py_ssize_t index = 0;
    size_t ran = 0;
    while (index < n) {
      py::tuple r = walk(cmds, index, max_op_elements, pool_min, quiet);
      index = r[0].cast<Py_ssize_t>();
      ran += r[1].cast<size_t>();
      py::object outcome = r[2];
      if (outcome.is_none() && index >= n) break;
      if (outcome.is_none() || py::str(outcome[py::int_(0)]).cast<std::string>() != "reply") {
        return py::make_tuple("batch", cmds, py::make_tuple(index, ran, outcome));
      }
      std::string reply;
      std::string body = outcome[py::int_(3)].cast<std::string>();
      genie_io::frame_prefix(reply, wire_, genie_wire::kKindReply, body.size(), records);
      reply.append(body);
      last_reply_ = reply;  // kept for a resend should the link drop before the client reads it
      io = genie_io::send_all(fd, reply.data(), reply.size(), &err);
      if (io != Io::ok) return py::make_tuple("io", "failed", genie_io::io_text(io, err, "sending"));
      ++index;
    }
    return py::make_tuple("done", n, ran);
  }

  // BATCH frames serve() read whole and took on (genie.server.resume counts a session's batches with them).
  uint64_t served() const { return served_; }
  // The last REPLY frame serve() sent, once (None when it sent none since the last call).
  py::object take_reply() {
    if (last_reply_.empty()) return py::none();
    py::bytes out(last_reply_);
    last_reply_.clear();
    return out;
  }

  // Where the op clock of a session worker lives (genie.server.isolation.clock.OpClock.address); 0: none.
  void set_clock(uintptr_t address) { clock_ = reinterpret_cast<char*>(address); }

  // Run cmds[start:] natively while their plans allow; returns (index, ran, outcome) where index is the
  // first command not finished here and ran counts the ops run. outcome is None when cmds[index] was not run
  // (or index is the end), ("python", key, ids) when it was keyed but has no native plan, else the outcome
  // of a command whose kernel ran: ("reply", None, None, body) (a CALL answered with a number: send body as
  // its REPLY) | ("call", key, ids, result, used) | ("outputs", key, ids, result, tensors, used) |
  // ("failed", key, ids, exception, tensors, used), where used maps the input storage ids to their storages.
  // pool_min: freed live storages this large go to the staging pool, so FREEs with one are Python's (0: every
  // FREE of a live storage is). quiet: no deferred errors wait for the next reply (a CALL may answer here).
  // bytes_used: the store's byte count now (StorageStore.bytes_used); what the run changes it by, take_grown()
  // says. The store and metrics are the bound ones (bind()).
  py::tuple run(py::list cmds, Py_ssize_t start, int64_t bytes_used, int64_t max_op_elements, int64_t pool_min,
                bool quiet) {
    bytes_ = bytes_used;
    return walk(cmds, start, max_op_elements, pool_min, quiet);
  }

  // Bind the session's store and metrics (a genie.server.runner_api.RunnerBinding, read in
  // runner_binding.cpp); kept until the next bind.
  void bind(py::handle binding) {
    Binding b = read_binding(binding);  // raises, keeping the binding there was, when it is not one
    binding_ = std::move(b.keep);
    store_ = b.store;
    metrics_ = std::move(b.metrics);
  }

  // The bytes the runs since the last call adopted (positive) and freed (negative), for the store to count
  // (StorageStore.count_native); counted even when a run raised.
  int64_t take_grown() {
    int64_t grown = grown_;
    grown_ = 0;
    return grown;
  }

  py::tuple walk(py::list cmds, Py_ssize_t start, int64_t max_op_elements, int64_t pool_min, bool quiet) {
    if (store_.storages == nullptr) throw std::runtime_error("genie: the runner was not bound to a store (Runner.bind)");
    int64_t bytes_before = bytes_;
    Py_ssize_t n = PyList_GET_SIZE(cmds.ptr());
    Py_ssize_t i = start;
    size_t ran = 0;
    py::object outcome = py::none();
    std::string key;
    std::vector<uint64_t> ids;
    std::vector<double> floats;
    // What changed the store's byte count is counted even when something below raises (the session then ends).
    struct Grown {
      int64_t& grown;
      const int64_t& bytes;
      int64_t before;
      ~Grown() { grown += bytes - before; }
    } count_grown{grown_, bytes_, bytes_before};
    for (; i < n; ++i) {
      PyObject* cmd = PyList_GET_ITEM(cmds.ptr(), i);
      if (!PyBytes_CheckExact(cmd)) break;
      auto data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(cmd));
      auto size = static_cast<size_t>(PyBytes_GET_SIZE(cmd));
      if (genie_keys::starts_as(data, size, genie_wire::kCmdFreeItems, genie_wire::kCmdFree)) {  // [CMD_FREE, [ids]]
        if (!free_command(data, size, pool_min)) break;
        continue;
      }
      // OP ([CMD_OP, ...], a fixarray of 6) and CALL ([CMD_CALL, ...], of 7) are keyed; the rest is Python's.
      if (size < 2 || size > max_keyed_ ||
          !(genie_keys::starts_as(data, size, genie_wire::kCmdOpItems, genie_wire::kCmdOp) ||
            genie_keys::starts_as(data, size, genie_wire::kCmdCallItems, genie_wire::kCmdCall)))
        break;
      if (!genie_keys::key_of(data, size, &key, &ids, &floats)) break;
      auto found = plans_.find(key);
      if (found == plans_.end() || found->second->decomposes_ || found->second->max_op_elements_ != max_op_elements) {
        outcome = py::make_tuple("python", py::bytes(key), id_tuple(ids), float_tuple(floats));
        break;
      }
      int result = run_one(*found->second, key, ids, floats, quiet, &outcome);
      if (result == kNotRun) {
        outcome = py::make_tuple("python", py::bytes(key), id_tuple(ids), float_tuple(floats));
        break;
      }
      ++ran;
      if (result == kOutcome) break;
    }
    return py::make_tuple(i, ran, outcome);
  }

  static constexpr int kDone = 0;     // ran and stored: nothing left for Python
  static constexpr int kNotRun = 1;   // nothing done: Python runs it by its full path
  static constexpr int kOutcome = 2;  // ran; Python finishes it from the outcome

  static py::tuple float_tuple(const std::vector<double>& floats) {
    py::tuple out(floats.size());
    for (size_t i = 0; i < floats.size(); ++i) out[i] = py::float_(floats[i]);
    return out;
  }

  static py::tuple id_tuple(const std::vector<uint64_t>& ids) {
    py::tuple out(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) out[i] = py::int_(ids[i]);
    return out;
  }

  // The live storage `id` of `nbytes` bytes on `device`, or nullptr (borrowed from the store's map).
  PyObject* live(uint64_t id, int64_t nbytes, const c10::Device& device) {
    py::object key = id_key(id);
    PyObject* storage = PyDict_GetItemWithError(store_.storages, key.ptr());
    PyObject* size = storage != nullptr ? PyDict_GetItemWithError(store_.sizes, key.ptr()) : nullptr;
    if (PyErr_Occurred()) throw py::error_already_set();
    if (storage == nullptr || size == nullptr || !THPStorage_Check(storage) || !PyLong_Check(size)) return nullptr;
    int overflow = 0;
    if (PyLong_AsLongLongAndOverflow(size, &overflow) != nbytes || overflow) return nullptr;
    const c10::Storage& st = THPStorage_Unpack(storage);
    if (static_cast<int64_t>(st.nbytes()) != nbytes || st.device() != device) return nullptr;
    return storage;
  }

  // A storage the session never had (not made, freed nor poisoned) on its first use, made zero-filled as
  // StorageStore.make makes it (the client makes tensors without a command: `x.to(torch.bfloat16)` is a copy_
  // into one); nullptr, with nothing made, for a bad id, a known one, or no room (the full path says why).
  // Borrowed from the store's map.
  PyObject* first_use(uint64_t id, int64_t nbytes, const c10::Device& device) {
    if (id == 0 || id > kMaxStorageId || nbytes < 0 || known(id)) return nullptr;
    if (PyDict_Size(store_.storages) + PyDict_Size(store_.poisoned) + 1 > store_.max_storages) return nullptr;
    if (store_.max_bytes && nbytes > 0 && bytes_ + nbytes > store_.max_bytes) return nullptr;
    at::Tensor zeros = at::zeros({nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
    py::object key = id_key(id);
    keep(key, zeros.storage());
    return PyDict_GetItem(store_.storages, key.ptr());
  }

  // Puts storage `st` in the store's maps under `key` (its storage and its byte size) and counts its bytes.
  void keep(const py::object& key, const c10::Storage& st) {
    auto wrapped = py::reinterpret_steal<py::object>(THPStorage_Wrap(st));
    if (!wrapped) throw py::error_already_set();
    py::int_ nbytes(static_cast<int64_t>(st.nbytes()));
    if (PyDict_SetItem(store_.storages, key.ptr(), wrapped.ptr()) != 0 ||
        PyDict_SetItem(store_.sizes, key.ptr(), nbytes.ptr()) != 0)
      throw py::error_already_set();
    bytes_ += static_cast<int64_t>(st.nbytes());
  }

  // A FREE (genie.server.store.StorageStore.free, with the staging pool's offer): false, with nothing done,
  // when Python must run it (an id that is not a plain unsigned int, a storage the pool may take).
  bool free_command(const uint8_t* data, size_t size, int64_t pool_min) {
    genie_msgpack::Reader r(data + 2, size - 2);  // after the command's array header and code
    uint64_t count = 0;
    if (!r.array_header(&count) || count > r.left()) return false;  // malformed: Python's decode says what
    std::vector<uint64_t> ids;
    for (uint64_t k = 0; k < count; ++k) {
      uint64_t id = 0;
      if (!r.uint(&id)) return false;
      ids.push_back(id);
    }
    if (!r.at_end()) return false;
    std::vector<std::pair<py::object, bool>> keys;  // (id, live)
    for (uint64_t id : ids) {
      py::object key = id_key(id);
      PyObject* storage = PyDict_GetItemWithError(store_.storages, key.ptr());
      if (storage == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (storage != nullptr &&
          (!THPStorage_Check(storage) || static_cast<int64_t>(THPStorage_Unpack(storage).nbytes()) >= pool_min))
        return false;  // the staging pool may want it: Python offers it
      keys.emplace_back(std::move(key), storage != nullptr);
    }
    for (auto& [key_object, is_live] : keys) {
      PyObject* key = key_object.ptr();
      bool ok = true;
      bool released = false;
      if (is_live && PyDict_Contains(store_.storages, key) == 1) {  // freed twice in one command: once
        PyObject* size_obj = PyDict_GetItemWithError(store_.sizes, key);
        int overflow = 0;
        bool sized = size_obj != nullptr && PyLong_Check(size_obj);
        int64_t nbytes = sized ? PyLong_AsLongLongAndOverflow(size_obj, &overflow) : 0;
        if (!sized && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a live storage without its size");
        ok = sized && !overflow && PyDict_DelItem(store_.storages, key) == 0 && PyDict_DelItem(store_.sizes, key) == 0;
        bytes_ -= nbytes;
        released = ok;
      } else {
        int poisoned = PyDict_Contains(store_.poisoned, key);
        ok = poisoned >= 0 && (poisoned == 0 || PyDict_DelItem(store_.poisoned, key) == 0);
        released = ok && poisoned == 1;
      }
      if (released) {
        if (PySet_GET_SIZE(store_.freed) >= max_freed_) ok = PySet_Clear(store_.freed) == 0;
        ok = ok && PySet_Add(store_.freed, key) == 0;
      }
      if (!ok) throw py::error_already_set();
    }
    return true;
  }

  // A CALL's REPLY body [req, None, number, []] as genie.server.codec.packb writes it, for a result that is a
  // plain number (the answer of .item()); false for anything else.
  static bool number_reply(uint64_t req, const c10::IValue& value, std::string* out) {
    genie_msgpack::pack_array_header(*out, genie_wire::kReplyItems);
    genie_msgpack::pack_uint(*out, req);
    genie_msgpack::pack_nil(*out);
    if (value.isBool()) {
      genie_msgpack::pack_bool(*out, value.toBool());
    } else if (value.isInt()) {
      genie_msgpack::pack_int(*out, value.toInt());
    } else if (value.isDouble()) {
      genie_msgpack::pack_double(*out, value.toDouble());
    } else {
      return false;
    }
    genie_msgpack::pack_array_header(*out, 0);
    return true;
  }

  // Whether the session made, freed or had poisoned storage `id`.
  bool known(uint64_t id) {
    py::object key = id_key(id);
    int found = PyDict_Contains(store_.storages, key.ptr());
    if (found == 0) found = PyDict_Contains(store_.poisoned, key.ptr());
    if (found == 0) found = PySet_Contains(store_.freed, key.ptr());
    if (found < 0) throw py::error_already_set();
    return found == 1;
  }

  static bool fits(const NativePlan& plan, const torch::jit::Stack& stack) {
    if (stack.size() != plan.outputs_.size()) return false;
    for (size_t k = 0; k < stack.size(); ++k) {
      const Output& out = plan.outputs_[k];
      if (!out.wanted || !stack[k].isTensor()) return false;
      const at::Tensor& t = stack[k].toTensor();
      if (!t.defined() || t.scalar_type() != out.dtype || t.sizes() != c10::IntArrayRef(out.sizes)) return false;
    }
    return true;
  }

  void clock_begin(const NativePlan& plan) {
    if (clock_ == nullptr) return;
    std::memcpy(clock_ + 8, plan.clock_label_.data(), kClockLabel);
    reinterpret_cast<std::atomic<int64_t>*>(clock_)->store(monotonic_ns(), std::memory_order_release);
  }

  void clock_end() {
    if (clock_ != nullptr) reinterpret_cast<std::atomic<int64_t>*>(clock_)->store(0, std::memory_order_release);
  }

  void record(const NativePlan& plan, bool ok, int64_t started) {
    if (metrics_.ops == nullptr) return;  // no metrics bound
    record_op(metrics_, plan.label_, ok, double(monotonic_ns() - started) / 1e9);
  }

  py::list py_tensors(const std::vector<at::Tensor>& tensors) {
    py::list out;
    for (const auto& t : tensors) out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
    return out;
  }

  py::dict used_dict(const NativePlan& plan, const std::vector<uint64_t>& ids, size_t base,
                     const std::vector<PyObject*>& used) {
    py::dict out;
    for (size_t k = 0; k < used.size(); ++k) out[py::int_(ids[base + plan.inputs_[k].slot])] = py::handle(used[k]);
    return out;
  }

  int run_one(const NativePlan& plan, const std::string& key, const std::vector<uint64_t>& ids,
              const std::vector<double>& floats, bool quiet, py::object* outcome) {
    if (plan.has_float_values_ &&
        (floats.size() != plan.float_values_.size() ||
         (!floats.empty() && std::memcmp(floats.data(), plan.float_values_.data(), floats.size() * sizeof(double)))))
      return kNotRun;  // other values than the plan was checked with: the full path
    if (plan.float_fills_.size() > floats.size()) return kNotRun;
    size_t base = plan.call_outs_ >= 0 ? 1 : 0;  // a CALL's ids are [req, tensors..., outputs...]
    size_t outputs = plan.call_outs_ >= 0 ? static_cast<size_t>(plan.call_outs_) : plan.kept_outputs_;
    std::vector<at::Tensor> tensors;
    std::vector<PyObject*> used;
    tensors.reserve(plan.inputs_.size());
    used.reserve(plan.inputs_.size());
    for (const auto& in : plan.inputs_) {
      if (base + in.slot >= ids.size()) return kNotRun;
      PyObject* storage = live(ids[base + in.slot], in.nbytes, plan.device_);
      if (storage == nullptr) storage = first_use(ids[base + in.slot], in.nbytes, plan.device_);
      if (storage == nullptr) return kNotRun;  // freed, poisoned, resized or no room: the full path says
      used.push_back(storage);
      auto t = at::detail::make_tensor<c10::TensorImpl>(
          c10::Storage(THPStorage_Unpack(storage)),
          c10::DispatchKeySet(c10::computeDispatchKey(in.dtype, c10::kStrided, plan.device_)),
          c10::scalarTypeToTypeMeta(in.dtype));
      t.unsafeGetTensorImpl()->set_sizes_and_strides(in.sizes, in.strides, in.offset);
      tensors.push_back(std::move(t));
    }
    for (size_t slot : plan.fresh_slots_) {  // what Executor._fresh_outs asks of them
      if (slot >= ids.size() || known(ids[slot])) return kNotRun;
    }
    if (PyDict_Size(store_.storages) + PyDict_Size(store_.poisoned) + static_cast<Py_ssize_t>(outputs) > store_.max_storages)
      return kNotRun;
    if (store_.max_bytes && plan.new_bytes_ > store_.max_bytes - bytes_) return kNotRun;

    torch::jit::Stack stack = plan.stack_;
    for (size_t k = 0; k < plan.fills_.size(); ++k) stack[plan.fills_[k].first] = tensors[plan.fills_[k].second];
    for (const auto& fill : plan.list_fills_) {
      c10::List<at::Tensor> list;
      list.reserve(fill.inputs.size());
      for (size_t input : fill.inputs) list.push_back(tensors[input]);
      stack[fill.position] = std::move(list);
    }
    for (const auto& fill : plan.float_fills_) {
      double value = floats[fill.index];
      if (fill.wrapped) {
        at::Tensor number = at::scalar_to_tensor(c10::Scalar(value));
        number.unsafeGetTensorImpl()->set_wrapped_number(true);
        stack[fill.position] = std::move(number);
      } else {
        stack[fill.position] = value;
      }
    }
    std::exception_ptr failure;
    bool decomposes = false;
    set_threads(plan.serial_);
    int64_t started = monotonic_ns();
    clock_begin(plan);
    {
      py::gil_scoped_release no_gil;
      try {
        plan.op_->callBoxed(stack);
      } catch (const c10::NotImplementedError& e) {
        if (no_kernel(e))
          decomposes = true;
        else
          failure = std::current_exception();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    clock_end();
    if (decomposes) {
      const_cast<NativePlan&>(plan).decomposes_ = true;  // from now on Python runs it (decomposition)
      return kNotRun;
    }
    if (failure) {
      record(plan, false, started);
      torch::translate_exception_to_python(failure);
      py::error_already_set error;  // takes the Python exception torch made of it
      *outcome = py::make_tuple("failed", py::bytes(key), id_tuple(ids), error.value(), py_tensors(tensors),
                                float_tuple(floats),
                                used_dict(plan, ids, base, used));
      return kOutcome;
    }
    record(plan, true, started);
    // The functional form's results must have the out arguments' dtypes and sizes (genie.server.outputs.
    // fits_outs); else the out= form runs after all, which Python's plan does (the functional run had no effect).
    if (!plan.fresh_slots_.empty() && !fits(plan, stack)) return kNotRun;
    bool resized = false;
    if (plan.writes_)
      for (size_t k = 0; k < used.size(); ++k)
        if (static_cast<int64_t>(THPStorage_Unpack(used[k]).nbytes()) != plan.inputs_[k].nbytes) resized = true;
    if (plan.call_outs_ >= 0 && !resized && quiet && stack.size() == 1) {
      std::string body;
      if (number_reply(ids[0], stack[0], &body)) {
        *outcome = py::make_tuple("reply", py::none(), py::none(), py::bytes(body));  // Python only sends it
        return kOutcome;
      }
    }
    if (plan.call_outs_ >= 0 || resized || !adopt(plan, ids, stack, used)) {
      py::object result = torch::jit::createPyObjectForStack(std::move(stack));
      if (plan.call_outs_ >= 0 && !resized)
        *outcome = py::make_tuple("call", py::bytes(key), id_tuple(ids), result, used_dict(plan, ids, base, used));
      else
        *outcome = py::make_tuple("outputs", py::bytes(key), id_tuple(ids), result, py_tensors(tensors),
                                  float_tuple(floats), used_dict(plan, ids, base, used));
      return kOutcome;
    }
    return kDone;
  }

  // The output rule's common cases (genie.server.plans._adopt): every kept result fresh, dense and laid out
  // as described, or already the described storage (in place); then adopted as StorageStore.adopt's fast
  // branch does. False, with nothing stored, when anything else holds: Python's rule decides.
  bool adopt(const NativePlan& plan, const std::vector<uint64_t>& ids, const torch::jit::Stack& stack,
             const std::vector<PyObject*>& used) {
    std::vector<const at::Tensor*> results;
    for (const auto& v : stack) {
      if (v.isTensor()) {
        results.push_back(&v.toTensor());
      } else if (v.isTensorList()) {
        return false;  // lists of results: the Python rule (rare on planned ops)
      } else {
        results.push_back(nullptr);
      }
    }
    if (results.size() != plan.outputs_.size()) return false;
    std::vector<std::pair<py::object, const at::Tensor*>> fresh;  // (id key, result) of each fresh result
    for (size_t k = 0; k < results.size(); ++k) {
      const Output& out = plan.outputs_[k];
      if (!out.wanted) continue;
      const at::Tensor* t = results[k];
      if (t == nullptr || !t->defined() || t->layout() != c10::kStrided || t->scalar_type() != out.dtype ||
          t->sizes() != c10::IntArrayRef(out.sizes) || t->strides() != c10::IntArrayRef(out.strides) ||
          t->storage_offset() != out.offset || !t->has_storage())
        return false;
      uint64_t id = ids[out.slot];
      const c10::Storage& st = t->storage();
      int64_t nbytes = static_cast<int64_t>(st.nbytes());
      if (!nbytes || id == 0 || id > kMaxStorageId) return false;
      py::object key = id_key(id);
      for (const auto& f : fresh)
        if (f.first.equal(key)) return false;
      PyObject* known = PyDict_GetItemWithError(store_.storages, key.ptr());
      if (known != nullptr) {
        if (!THPStorage_Check(known) || THPStorage_Unpack(known).data() != st.data())
          return false;  // a copy into the known storage: the full rule does it
        continue;        // in place
      }
      if (PyErr_Occurred()) throw py::error_already_set();
      for (PyObject* u : used) {
        const c10::Storage& held = THPStorage_Unpack(u);
        if (held.nbytes() && held.data() == st.data()) return false;  // the result lives in an input's storage
      }
      for (const auto& f : fresh)
        if (f.second->storage().data() == st.data()) return false;  // two results over one fresh storage
      if (nbytes != out.nbytes || t->numel() * static_cast<int64_t>(t->element_size()) != nbytes) return false;
      fresh.emplace_back(std::move(key), t);
    }
    // StorageStore.adopt's fast branch for all of them, or none (its slow branch raises the quota errors).
    int64_t count = PyDict_Size(store_.storages) + PyDict_Size(store_.poisoned);
    int64_t added = 0;
    for (const auto& f : fresh) added += static_cast<int64_t>(f.second->storage().nbytes());
    if (count + static_cast<int64_t>(fresh.size()) > store_.max_storages || (store_.max_bytes && bytes_ + added > store_.max_bytes))
      return false;
    bool poisoned = PyDict_Size(store_.poisoned) > 0;
    for (const auto& [key, t] : fresh) {
      keep(key, t->storage());
      if (poisoned && PyDict_DelItem(store_.poisoned, key.ptr()) != 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) throw py::error_already_set();
        PyErr_Clear();
      }
    }
    return true;
  }

  std::unordered_map<std::string, std::shared_ptr<NativePlan>> plans_;
  size_t max_keyed_;
  Py_ssize_t max_freed_;
  genie_io::Wire wire_;
  char* clock_ = nullptr;
  // The bound RunnerBinding (runner_binding.h), and borrowed from it: the store's maps and quotas, the
  // metrics' tally.
  py::object binding_ = py::none();
  BoundStore store_;
  int64_t bytes_ = 0;  // the store's byte count during a run (from run()'s or serve()'s bytes_used)
  int64_t grown_ = 0;  // what the runs changed it by since take_grown()
  BoundMetrics metrics_;
  uint64_t served_ = 0;     // BATCH frames serve() took on
  std::string last_reply_;  // the last REPLY frame serve() sent, until take_reply()
};

Runner::Runner(size_t max_keyed, Py_ssize_t max_freed) : impl_(std::make_unique<Impl>(max_keyed, max_freed)) {}
Runner::~Runner() = default;
void Runner::add(py::bytes key, std::shared_ptr<NativePlan> plan) { impl_->add(std::move(key), std::move(plan)); }
void Runner::clear() { impl_->clear(); }
size_t Runner::size() const { return impl_->size(); }
void Runner::set_wire(int version, int batch, int reply, int inline_record, uint64_t max_body) {
  impl_->set_wire(version, batch, reply, inline_record, max_body);
}
void Runner::set_clock(uintptr_t address) { impl_->set_clock(address); }
void Runner::bind(py::handle binding) { impl_->bind(binding); }
py::tuple Runner::run(py::list cmds, Py_ssize_t start, int64_t bytes_used, int64_t max_op_elements, int64_t pool_min,
                      bool quiet) {
  return impl_->run(std::move(cmds), start, bytes_used, max_op_elements, pool_min, quiet);
}
py::tuple Runner::serve(int fd, bool records, int64_t bytes_used, int64_t max_op_elements, int64_t pool_min, bool quiet,
                        size_t max_commands) {
  return impl_->serve(fd, records, bytes_used, max_op_elements, pool_min, quiet, max_commands);
}
int64_t Runner::take_grown() { return impl_->take_grown(); }
uint64_t Runner::served() const { return impl_->served(); }
py::object Runner::take_reply() { return impl_->take_reply(); }

}  // namespace genie_plans
