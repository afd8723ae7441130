// genie._C's op path: the PrivateUse1 fallback, and the signature cache that queues ops without Python.
//
// Every aten op on remote_accelerator without a kernel of its own reaches `fallback`. The first call
// of a signature (the op, and per argument its type and value, or a tensor's device, dtype, sizes,
// strides and offset) goes to Python (genie.device.dispatch.fallback): meta inference, the outputs,
// the command. When Python finds the op plain (fresh or in-place outputs, no random numbers, no
// round trip) it teaches the signature back (`fast_learn`: the outputs' layouts). Later calls with
// that signature are answered here: outputs allocated through the allocator (new storage ids), the
// command encoded as the msgpack Python would send, appended to its connection's queue. No GIL, no
// Python objects. Python drains a connection's queue, in order, before it queues anything itself
// and before every batch it sends, and tells the queue how much room the batch has left: a full
// queue is sent by Python's flush (genie.device.connection), and the op joins the next batch here.
//
// Python's view of arguments (positional up to the first trailing default, keyword-only ones by
// name unless defaulted) follows torch's own Python fallback (parseIValuesToPyArgsKwargs), so a
// command encoded here is the command Python sends for the same call.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "device/allocator.h"
#include "device/bindings.h"
#include "device/queue.h"
#include "device/tensor_wire.h"

namespace genie {

namespace {

namespace py = pybind11;
using c10::IValue;

// ---------------------------------------------------------------------------------------------
// Connection queues (queue.h): commands encoded here, waiting for the next batch.
struct Route {
  std::shared_ptr<Queue> queue;
  int local = 0;  // the device's index on its node
};

std::mutex g_mu;  // queues, routes, op facts, the signature cache
std::unordered_map<int64_t, std::shared_ptr<Queue>> g_queues;
int64_t g_next_queue = 1;
std::vector<Route> g_routes;  // by global device index

// ---------------------------------------------------------------------------------------------
// Per op: what the encoder needs, built once.
enum class ArgKind : uint8_t { plain, dtype, layout, memory_format };

struct OpFacts {
  std::string name;         // "aten::add.Tensor", as OpOverload.name()
  std::string name_packed;  // its msgpack str
  std::vector<ArgKind> kinds;
  size_t kwarg_only_start = 0;
  bool floats_by_type = false;  // float arguments key by type (Python: not OpInfo.float_values_matter)
  bool taught = false;          // Python has taught one signature (so floats_by_type is known)
  py::object* overload = nullptr;  // the Python OpOverload (leaked: outlives interpreter teardown)
  enum Copy : uint8_t { not_copy, copy_into, copy_from } copy = not_copy;  // copy_(self, src) / _copy_from(src, dst)
  bool item = false;  // _local_scalar_dense (.item()): a sync point the lane may answer
  bool fills = false;  // fill_.Scalar / zero_: overwrites its whole argument (host shadows, below)
  bool overwrites_self = false;  // every fill_ / zero_: its first argument's old values are never read
  std::vector<bool> writes;  // per argument: the schema marks it written (in place, out=)
  std::atomic<int8_t> shadow_use{-1};  // what host shadows do with it (ShadowUse, shadow_ops); -1: not looked up yet
};
std::unordered_map<const void*, OpFacts*> g_facts;  // by &op.schema() (operators live for the process)

ArgKind kind_of(const c10::Argument& a) {
  auto t = a.real_type();
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  switch (t->kind()) {
    case c10::TypeKind::ScalarTypeType: return ArgKind::dtype;
    case c10::TypeKind::LayoutType: return ArgKind::layout;
    case c10::TypeKind::MemoryFormatType: return ArgKind::memory_format;
    default: return ArgKind::plain;
  }
}

OpFacts* facts_of(const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_facts.find(key);
    if (it != g_facts.end()) return it->second;
  }
  auto* f = new OpFacts();  // leaked on purpose, as the operators themselves
  const auto& schema = op.schema();
  f->name = schema.name();
  if (!schema.overload_name().empty()) f->name += "." + schema.overload_name();
  pack_str(f->name_packed, f->name);
  if (f->name == "aten::copy_") f->copy = OpFacts::copy_into;
  if (f->name == "aten::_copy_from") f->copy = OpFacts::copy_from;
  f->item = f->name == "aten::_local_scalar_dense";
  f->fills = f->name == "aten::fill_.Scalar" || f->name == "aten::zero_";
  f->overwrites_self = schema.name() == "aten::fill_" || schema.name() == "aten::zero_";
  const auto& args = schema.arguments();
  // Batch norm updates its running statistics in place without its schema saying so (genie.device.shadows,
  // UNMARKED_WRITES: the same list).
  bool batch_norm = schema.name() == "aten::native_batch_norm" || schema.name() == "aten::cudnn_batch_norm" ||
                    schema.name() == "aten::miopen_batch_norm";
  for (const auto& a : args) {
    f->kinds.push_back(kind_of(a));
    bool unmarked = batch_norm && (a.name() == "running_mean" || a.name() == "running_var");
    f->writes.push_back((a.alias_info() != nullptr && a.alias_info()->isWrite()) || unmarked);
  }
  f->kwarg_only_start = args.size();
  while (f->kwarg_only_start > 0 && args[f->kwarg_only_start - 1].kwarg_only()) --f->kwarg_only_start;
  std::lock_guard<std::mutex> g(g_mu);
  auto [it, added] = g_facts.emplace(key, f);
  if (!added) delete f;
  return it->second;
}

// torch's rule: an argument equal to its schema default is left out of Python's args/kwargs.
bool is_default(const c10::Argument& a, const IValue& v) {
  const auto& d = a.default_value();
  if (!d.has_value() || v.isTensor()) return false;  // a default is never a defined tensor
  if (d->isNone() || v.isNone()) return d->isNone() && v.isNone();
  return *d == v;
}

// How many arguments Python gets by position: up to the keyword-only ones, less the trailing defaults.
size_t positional_count(const OpFacts& f, const std::vector<c10::Argument>& decl, c10::ArrayRef<IValue> args) {
  size_t n = f.kwarg_only_start;
  while (n > 0 && is_default(decl[n - 1], args[n - 1])) --n;
  return n;
}

// ---------------------------------------------------------------------------------------------
// Signatures and encoding, in one pass over the arguments.
struct Encoder {
  std::string key;   // the signature: op, then a tag and data per argument
  std::string body;  // the msgpack of args then kwargs
  int device = -1;   // the one remote device the tensors are on
  bool floats_by_type = false;

  template <typename T>
  void put(T v) { key.append(reinterpret_cast<const char*>(&v), sizeof(T)); }

  // Scalars: the key's tag (and value: floats only unless keyed by type) and the msgpack value.
  void none() {
    put<char>('N');
    pack_nil(body);
  }

  void boolean(bool b) {
    put<char>(b ? 'b' : 'B');
    pack_bool(body, b);
  }

  void integer(int64_t i) {
    put<char>('i');
    put<int64_t>(i);
    pack_int(body, i);
  }

  void real(double d) {
    put<char>('f');
    if (!floats_by_type) put<double>(d);
    pack_double(body, d);
  }

  // A list argument: its tag and length in the key, its array header in the body.
  void begin_list(char tag, size_t n) {
    put<char>(tag);
    put<uint64_t>(n);
    pack_array_header(body, n);
  }

  // A one-byte tag (dtype, layout, memory format).
  void pack_ext1(int8_t type, uint8_t byte) {
    pack_ext_header(body, type, 1);
    body.push_back(static_cast<char>(byte));
  }

  // A Python number that C++ wrapped in a CPU tensor (`x + 1`): Python gets the number back
  // (torch::jit::toPyObject), so it crosses as a number.
  bool wrapped_number(const at::Tensor& t) {
    if (!t.device().is_cpu()) return false;
    switch (t.scalar_type()) {
      case at::kBool: boolean(*t.const_data_ptr<bool>()); return true;
      case at::kLong: integer(*t.const_data_ptr<int64_t>()); return true;
      case at::kDouble: real(*t.const_data_ptr<double>()); return true;
      default: return false;
    }
  }

  // A remote tensor (EXT_TENSOR 8); false for anything the signature cannot hold.
  bool tensor(const at::Tensor& t) {
    if (!t.defined()) {
      put<char>('U');
      pack_nil(body);
      return true;
    }
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) return wrapped_number(t);
    if (t.device().type() != c10::DeviceType::PrivateUse1 || t.layout() != c10::kStrided || t.is_conj() ||
        t.is_neg() || wire_dtype_code(t.scalar_type()) < 0)
      return false;
    int d = t.device().index();
    if (device >= 0 && d != device) return false;  // Python raises the mixed-device error
    device = d;
    put<char>('T');
    put<int8_t>(static_cast<int8_t>(t.scalar_type()));
    put<int64_t>(t.dim());
    for (auto s : t.sizes()) put<int64_t>(s);
    for (auto s : t.strides()) put<int64_t>(s);
    put<int64_t>(t.storage_offset());
    pack_tensor_ext(body, t);
    return true;
  }

  bool value(const IValue& v, ArgKind kind) {
    if (v.isNone()) {
      none();
      return true;
    }
    if (v.isTensor()) return tensor(v.toTensor());
    if (v.isBool()) {
      boolean(v.toBool());
      return true;
    }
    if (v.isInt()) {
      int64_t i = v.toInt();
      if (kind == ArgKind::plain) {
        integer(i);
        return true;
      }
      put<char>('i');  // a dtype, layout or memory format: the key holds its value, the body its wire code
      put<int64_t>(i);
      switch (kind) {
        case ArgKind::plain: break;  // handled above
        case ArgKind::dtype: {
          int code = wire_dtype_code(static_cast<c10::ScalarType>(i));
          if (code < 0) return false;
          pack_ext1(genie_wire::kExtDtype, static_cast<uint8_t>(code));
          return true;
        }
        case ArgKind::layout: {  // only strided is sent by ops that get here
          if (static_cast<c10::Layout>(i) != c10::kStrided) return false;
#define GENIE_STRIDED_CODE(code, name) (c10::Layout::name == c10::kStrided ? (code) : 0) +
          constexpr int strided = GENIE_WIRE_LAYOUTS(GENIE_STRIDED_CODE) 0;
#undef GENIE_STRIDED_CODE
          pack_ext1(genie_wire::kExtLayout, static_cast<uint8_t>(strided));
          return true;
        }
        case ArgKind::memory_format: {  // c10::MemoryFormat's value -> its wire code (wire_spec.h)
          static const auto codes = [] {
            std::array<int8_t, static_cast<size_t>(c10::MemoryFormat::NumOptions)> a{};
            a.fill(-1);
#define GENIE_MEMORY_FORMAT_CODE(code, name) a[static_cast<size_t>(c10::MemoryFormat::name)] = code;
            GENIE_WIRE_MEMORY_FORMATS(GENIE_MEMORY_FORMAT_CODE)
#undef GENIE_MEMORY_FORMAT_CODE
            return a;
          }();
          if (i < 0 || i >= static_cast<int64_t>(codes.size()) || codes[i] < 0) return false;
          pack_ext1(genie_wire::kExtMemoryFormat, static_cast<uint8_t>(codes[i]));
          return true;
        }
      }
      return false;
    }
    if (v.isDouble()) {
      real(v.toDouble());
      return true;
    }
    if (v.isString()) {
      const auto& s = v.toStringRef();
      put<char>('s');
      put<uint64_t>(s.size());
      key.append(s);
      pack_str(body, s);
      return true;
    }
    if (v.isIntList()) {
      auto l = v.toIntList();
      begin_list('I', l.size());
      for (int64_t x : l) {
        put<int64_t>(x);
        pack_int(body, x);
      }
      return true;
    }
    if (v.isDoubleList()) {
      auto l = v.toDoubleList();
      begin_list('F', l.size());
      for (double x : l) {
        put<double>(x);
        pack_double(body, x);
      }
      return true;
    }
    if (v.isBoolList()) {
      auto l = v.toBoolList();
      begin_list('L', l.size());
      for (bool x : l) {
        put<char>(x ? 1 : 0);
        pack_bool(body, x);
      }
      return true;
    }
    if (v.isTensorList()) {
      auto l = v.toTensorList();
      begin_list('V', l.size());
      for (const at::Tensor& t : l) {
        if (!t.defined() || !tensor(t)) return false;
      }
      return true;
    }
    if (v.isList()) {  // Tensor?[] (index, index_put_); a concrete SymInt[] is boxed as an int list (above)
      auto l = v.toListRef();
      begin_list('O', l.size());
      for (const IValue& e : l) {
        if (e.isNone()) {
          none();
        } else if (!e.isTensor() || !e.toTensor().defined() || !tensor(e.toTensor())) {
          return false;
        }
      }
      return true;
    }
    return false;  // devices, generators, complex numbers, symbolic sizes...: Python's path
  }

  // The signature and the [args, kwargs] msgpack of a call; false when it cannot be cached.
  bool call(const OpFacts& f, const c10::FunctionSchema& schema, c10::ArrayRef<IValue> args) {
    key.clear();
    body.clear();
    device = -1;
    floats_by_type = f.floats_by_type;
    put<const void*>(&schema);
    const auto& decl = schema.arguments();
    size_t positional = positional_count(f, decl, args);
    pack_array_header(body, positional);
    for (size_t i = 0; i < positional; ++i) {
      if (!value(args[i], f.kinds[i])) return false;
    }
    put<char>('|');
    size_t keywords = 0;
    for (size_t i = f.kwarg_only_start; i < args.size(); ++i) keywords += is_default(decl[i], args[i]) ? 0 : 1;
    if (keywords >= 16) return false;
    pack_map_header(body, keywords);
    for (size_t i = f.kwarg_only_start; i < args.size(); ++i) {
      if (is_default(decl[i], args[i])) continue;
      pack_str(body, decl[i].name());
      put<uint64_t>(i);
      if (!value(args[i], f.kinds[i])) return false;
    }
    // Defaulted trailing arguments are in the key too (values Python never sees).
    for (size_t i = positional; i < f.kwarg_only_start; ++i) put<char>('d');
    return device >= 0;
  }
};

// ---------------------------------------------------------------------------------------------
// What Python taught about a signature: its outputs.
struct Out {
  // resized: an out= argument that arrives empty (torch.arange(n, device=...) passes one) and is given the
  // taught layout over a new storage id, as genie.device.dispatch.set_layout does (nothing to tell the node: an
  // id's first use makes its storage)
  enum Kind : uint8_t { fresh, inplace, undefined, resized } kind = fresh;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  int64_t span = 0;  // elements the storage needs (fresh outputs with an offset; resized ones)
  size_t arg = 0;    // in-place, resized: the argument it is
};
struct Signature {
  std::vector<Out> outs;
};
std::unordered_map<std::string, std::shared_ptr<const Signature>> g_signatures;
constexpr size_t kMaxSignatures = 1 << 15;

// The call Python is handling on this thread, so fast_learn knows which signature it teaches.
struct Teaching {
  const OpFacts* facts;
  std::string key;
  bool floats_by_type;
  std::shared_ptr<Signature> learned;
};
thread_local Teaching* tl_teaching = nullptr;

py::object* g_python_fallback = nullptr;  // genie.device.dispatch.fallback
py::object* g_resolve = nullptr;          // genie.device.dispatch.overload_of
std::atomic<uint64_t> g_hits{0}, g_misses{0};

// ---------------------------------------------------------------------------------------------
// Host shadows (genie.device.shadows): storages whose bytes the client also holds. A call goes to Python
// when it may write a shadowed storage (Python drops the shadow or applies the op to it), when it reads one
// and is a read or copy the shadows answer or follow, when Python can run it on the shadows of all its inputs
// (a derived shadow), and for a small fill_/zero_ while shadows are on (its whole storage becomes known).
// Everything else stays native: an op with one shadowed input among unshadowed ones, or arithmetic on floats,
// cannot be derived, and sending it to Python cost 60 to 80 us a call against 3 to 6 us here. With no
// shadow and shadows off this costs one relaxed load per op.
std::mutex g_shadow_mu;
std::unordered_set<uint64_t> g_shadowed;          // storage ids with a shadow
std::vector<uint64_t> g_shadow_freed;             // of those, the ones freed since Python last asked
std::atomic<size_t> g_shadow_count{0};
std::atomic<int64_t> g_shadow_fill_bytes{0};      // fill_/zero_ of a storage this small go to Python (0: off)
// What the shadows do with an op (genie.device.shadows): nothing; follow it (a read or a copy: any shadowed
// tensor sends it to Python); derive it in any dtype but complex (MOVE_OPS); derive it on integers only (INT_OPS).
enum ShadowUse : int8_t { use_none = 0, use_follow = 1, use_move = 2, use_int = 3 };
std::unordered_map<std::string, int8_t> g_shadow_ops;  // by schema name ("aten::eq")

bool shadowed_tensor(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1) return false;
  const void* data = t.storage().data();
  if (data == nullptr) return false;
  uint64_t sid = storage_id_of_data(data);
  std::lock_guard<std::mutex> g(g_shadow_mu);
  return g_shadowed.count(sid) != 0;
}

int8_t shadow_use(const OpFacts& f, const c10::OperatorHandle& op) {
  int8_t known = f.shadow_use.load(std::memory_order_relaxed);
  if (known >= 0) return known;
  int8_t use = use_none;
  {
    std::lock_guard<std::mutex> g(g_shadow_mu);
    auto it = g_shadow_ops.find(op.schema().name());
    if (it != g_shadow_ops.end()) use = it->second;
  }
  const_cast<OpFacts&>(f).shadow_use.store(use, std::memory_order_relaxed);
  return use;
}

// One call's tensors as the shadows see them (touches_shadow).
struct ShadowScan {
  int8_t use;
  bool written_shadowed = false;  // an argument the op writes has a shadow: Python must see the call
  bool any = false;               // a shadowed tensor among those it reads
  bool all = true;                // every remote tensor it reads (or updates in place) is shadowed
  bool exact = true;              // the dtypes and numbers let Python derive it (genie.device.shadows._derive)

  void tensor(const at::Tensor& t, bool written, bool target) {
    // An op the shadows neither follow nor derive needs only its written tensors looked up (a lock each).
    if (!t.defined() || (use == use_none && !written)) return;
    if (c10::isComplexType(t.scalar_type()) || (use == use_int && c10::isFloatingType(t.scalar_type()))) exact = false;
    if (t.device().type() != c10::DeviceType::PrivateUse1) return;
    bool shadowed = shadowed_tensor(t);
    if (written && shadowed) written_shadowed = true;
    if (!written) any = any || shadowed;
    if (!target) all = all && shadowed;  // an out= target needs none: Python makes its shadow
  }
  void value(const IValue& a, bool written, bool target) {
    if (a.isTensor()) {
      tensor(a.toTensor(), written, target);
    } else if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorList()) tensor(t, written, target);
    } else if (a.isOptionalTensorList()) {
      for (std::optional<at::Tensor> t : a.toOptionalTensorList()) {
        if (t.has_value()) tensor(*t, written, target);
      }
    } else if (a.isComplexDouble() || (use == use_int && a.isDouble())) {
      exact = false;
    } else if (a.isList()) {
      for (const IValue& v : a.toListRef()) value(v, written, target);
    }
  }
};

// Whether this call must go to Python for the shadows' sake (see above).
bool touches_shadow(const OpFacts& f, const c10::OperatorHandle& op, c10::ArrayRef<IValue> args) {
  if (f.fills && !args.empty() && args[0].isTensor()) {
    const at::Tensor& t = args[0].toTensor();
    int64_t limit = g_shadow_fill_bytes.load(std::memory_order_relaxed);
    if (limit > 0 && t.defined() && t.storage().nbytes() <= static_cast<size_t>(limit) &&
        !c10::isFloatingType(t.scalar_type()) && !c10::isComplexType(t.scalar_type()))
      return true;
  }
  if (g_shadow_count.load(std::memory_order_relaxed) == 0) return false;
  ShadowScan scan{shadow_use(f, op)};
  for (size_t i = 0; i < args.size(); ++i) {
    bool written = i < f.writes.size() && f.writes[i];
    // out= targets are keyword-only, a fill's is its first; an in-place op's self is read as well as written
    scan.value(args[i], written, written && (i >= f.kwarg_only_start || (i == 0 && f.overwrites_self)));
  }
  if (scan.written_shadowed) return true;
  switch (scan.use) {
    case use_follow: return scan.any;
    case use_move:
    case use_int: return scan.any && scan.all && scan.exact;
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------------
// The hit path: outputs, the command, the queue.

// The session queue of remote device `device` and the device's index on its node, when the batch has
// room for a command of about `bytes` more; false sends the op to Python. No lock is held after this
// while a tensor may be made or dropped: dropping one with a Python object takes the GIL, and Python
// threads hold the GIL while they take a queue's lock. The room is a soft bound (a batch may end a few
// commands over it when threads race); a lost node's room is 0 before its first failed op returns.
// torch's settings a session's node must share (Queue::options): deterministic algorithms, warn only.
int session_options() {
  auto& ctx = at::globalContext();
  return (ctx.deterministicAlgorithms() ? genie_wire::kOptionDeterministic : 0) |
         (ctx.deterministicAlgorithmsWarnOnly() ? genie_wire::kOptionWarnOnly : 0);
}

enum class Room : uint8_t { ok, none, full };

Room room_for(int device, size_t bytes, std::shared_ptr<Queue>* q, int* local) {
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (device >= static_cast<int>(g_routes.size()) || !g_routes[device].queue) return Room::none;
    *q = g_routes[device].queue;
    *local = g_routes[device].local;
  }
  if ((*q)->options.load(std::memory_order_relaxed) != session_options()) return Room::none;
  std::lock_guard<std::mutex> g((*q)->mu);
  if ((*q)->room_bytes == 0) return Room::none;  // lost, capturing a graph, or not connected yet
  return (*q)->cmds.size() < (*q)->room_cmds && (*q)->bytes + bytes + 64 < (*q)->room_bytes ? Room::ok : Room::full;
}

// The batch is full: Python sends it (NodeConnection.flush), as its own op path would, and this op joins the
// next batch natively rather than taking Python's whole op path (meta inference, encoding: 60 us and more)
// only to flush. Not from inside Python's own work on the session (this thread holds its lock), nor without
// the lane's connection; an error (a lost node) is left for Python's path to raise.
bool flush_full(Queue& q) {
  if (!q.lane_on.load() || q.held_here()) return false;
  py::gil_scoped_acquire gil;
  if (q.conn == nullptr) return false;
  try {
    py::handle(q.conn).attr("flush")();
  } catch (py::error_already_set&) {
    return false;
  }
  return true;
}

bool queue_for(int device, size_t bytes, std::shared_ptr<Queue>* q, int* local) {
  Room room = room_for(device, bytes, q, local);
  if (room == Room::full && flush_full(**q)) room = room_for(device, bytes, q, local);
  return room == Room::ok;
}

// [CMD_OP, local device, op, args, kwargs, outs] appended to `q`; `body` holds args and kwargs.
void enqueue(Queue& q, int local, const std::string& name_packed, const std::string& body,
             const std::vector<at::Tensor>& outs) {
  std::string cmd;
  cmd.reserve(body.size() + name_packed.size() + 64 * (outs.size() + 1));
  pack_array_header(cmd, genie_wire::kCmdOpItems);
  pack_uint(cmd, genie_wire::kCmdOp);
  pack_uint(cmd, static_cast<uint64_t>(local));
  cmd.append(name_packed);
  cmd.append(body);
  pack_array_header(cmd, outs.size());
  for (const auto& t : outs) {
    if (t.defined()) {
      pack_tensor_ext(cmd, t);
    } else {
      pack_nil(cmd);
    }
  }
  std::lock_guard<std::mutex> g(q.mu);
  q.bytes += cmd.size();
  q.cmds.push_back(std::move(cmd));
}

bool answer(const OpFacts& f, const c10::FunctionSchema& schema, const Signature& sig, Encoder& enc,
            torch::jit::Stack* stack, size_t nargs) {
  auto args = torch::jit::last(*stack, nargs);
  bool resizes = false;
  for (const auto& o : sig.outs) {
    if ((o.kind == Out::inplace || o.kind == Out::resized) && (o.arg >= nargs || !args[o.arg].isTensor())) return false;
    if (o.kind == Out::resized) {
      // Still a storage without bytes or id (the signature holds its sizes, not its storage), of the taught dtype.
      const at::Tensor& t = args[o.arg].toTensor();
      if (!t.defined() || t.scalar_type() != o.dtype || t.storage().nbytes() != 0 || id_of_pointer(t.storage().data()) != 0)
        return false;
      resizes = true;
    }
  }
  std::shared_ptr<Queue> q;
  int local = 0;
  if (!queue_for(enc.device, enc.body.size() + (resizes ? 64 : 0), &q, &local)) return false;
  if (resizes) {
    for (const auto& o : sig.outs) {
      if (o.kind != Out::resized) continue;
      const at::Tensor& t = args[o.arg].toTensor();
      resize_storage(*t.storage().unsafeGetStorageImpl(), o.span * static_cast<int64_t>(c10::elementSize(o.dtype)));
      t.unsafeGetTensorImpl()->set_sizes_and_strides(o.sizes, o.strides, o.offset);
    }
    // The command names the targets as they are now, as Python's path sends them after set_layout.
    if (!enc.call(f, schema, args)) return false;  // cannot happen (it encoded before); Python sends it then
  }
  std::vector<at::Tensor> outs;
  outs.reserve(sig.outs.size());
  auto opts = at::TensorOptions().device(c10::Device(c10::DeviceType::PrivateUse1, enc.device));
  for (const auto& o : sig.outs) {
    if (o.kind == Out::inplace || o.kind == Out::resized) {
      outs.push_back(args[o.arg].toTensor());
    } else if (o.kind == Out::undefined) {
      outs.emplace_back();
    } else if (o.offset == 0) {
      outs.push_back(at::empty_strided(o.sizes, o.strides, opts.dtype(o.dtype)));
    } else {
      outs.push_back(at::empty({o.span}, opts.dtype(o.dtype)).as_strided(o.sizes, o.strides, o.offset));
    }
  }
  enqueue(*q, local, f.name_packed, enc.body, outs);
  torch::jit::drop(*stack, nargs);
  for (auto& t : outs) torch::jit::push(*stack, std::move(t));
  return true;
}

// ---------------------------------------------------------------------------------------------
// The miss path: Python, as torch's own Python fallback calls it.
py::object to_python(const IValue& v, ArgKind kind) {
  if (v.isNone()) return py::none();
  switch (kind) {
    case ArgKind::dtype: return py::cast(static_cast<c10::ScalarType>(v.toInt()));
    case ArgKind::layout: return py::cast(static_cast<c10::Layout>(v.toInt()));
    case ArgKind::memory_format: return py::cast(static_cast<c10::MemoryFormat>(v.toInt()));
    default: return torch::jit::toPyObject(v);
  }
}

py::object overload_of(OpFacts& f, const c10::FunctionSchema& schema) {
  if (f.overload == nullptr) {
    TORCH_CHECK(g_resolve != nullptr, "genie: remote_accelerator ops need genie.device registered first");
    const auto& name = schema.name();
    auto sep = name.find("::");
    f.overload = new py::object((*g_resolve)(name.substr(0, sep), name.substr(sep + 2), schema.overload_name()));
  }
  return *f.overload;
}

void call_python(OpFacts& f, const c10::OperatorHandle& op, torch::jit::Stack* stack, Teaching* teaching) {
  const auto& schema = op.schema();
  const auto& decl = schema.arguments();
  size_t nargs = decl.size();
  auto arguments = torch::jit::pop(*stack, nargs);
  py::gil_scoped_acquire gil;
  TORCH_CHECK(g_python_fallback != nullptr, "genie: remote_accelerator ops need genie.device registered first");
  size_t positional = positional_count(f, decl, arguments);
  py::tuple args(positional + 1);
  args[0] = overload_of(f, schema);
  for (size_t i = 0; i < positional; ++i) args[i + 1] = to_python(arguments[i], f.kinds[i]);
  py::dict kwargs;
  for (size_t i = f.kwarg_only_start; i < nargs; ++i) {
    if (!is_default(decl[i], arguments[i])) kwargs[py::str(decl[i].name())] = to_python(arguments[i], f.kinds[i]);
  }
  Teaching* outer = tl_teaching;
  tl_teaching = teaching;
  py::object out;
  try {
    out = (*g_python_fallback)(*args, **kwargs);
  } catch (...) {
    tl_teaching = outer;
    throw;
  }
  tl_teaching = outer;
  const auto& returns = schema.returns();
  if (returns.empty()) {
    TORCH_CHECK(out.is_none(), "genie: ", f.name, " returns nothing, the fallback returned a value");
  } else if (returns.size() == 1) {
    torch::jit::push(*stack, torch::jit::toIValue(out, returns[0].real_type()));
  } else {
    auto seq = py::cast<py::sequence>(out);
    TORCH_CHECK(seq.size() == returns.size(), "genie: ", f.name, " returns ", returns.size(), " values, the fallback ",
                seq.size());
    for (size_t i = 0; i < returns.size(); ++i) torch::jit::push(*stack, torch::jit::toIValue(seq[i], returns[i].real_type()));
  }
}

// A copy between two tensors of one remote device (`clone`, a gradient's accumulation, `dst.copy_(src)`):
// genie.device.copies.copy_into's first rule, one server `copy_(dst, src)` whose output is dst, without
// Python. False: Python's path.
bool copy_natively(Encoder& enc, torch::jit::Stack* stack, size_t nargs, bool from) {
  auto args = torch::jit::last(*stack, nargs);
  if (!args[0].isTensor() || !args[1].isTensor()) return false;
  at::Tensor dst = from ? args[1].toTensor() : args[0].toTensor();  // owned: the stack's copy is dropped below
  at::Tensor src = from ? args[0].toTensor() : args[1].toTensor();
  if (!dst.defined() || !src.defined() || dst.numel() == 0 || dst.unsafeGetTensorImpl()->is_wrapped_number() ||
      src.unsafeGetTensorImpl()->is_wrapped_number())
    return false;
  enc.key.clear();
  enc.body.clear();
  enc.device = -1;
  pack_array_header(enc.body, 2);
  if (!enc.tensor(dst) || !enc.tensor(src)) return false;
  pack_map_header(enc.body, 0);  // no keyword arguments
  std::shared_ptr<Queue> q;
  int local = 0;
  if (!queue_for(enc.device, enc.body.size(), &q, &local)) return false;
  static const std::string copy_name = [] {
    std::string out;
    pack_str(out, "aten::copy_");
    return out;
  }();
  enqueue(*q, local, copy_name, enc.body, {dst});
  torch::jit::drop(*stack, nargs);
  torch::jit::push(*stack, std::move(dst));
  return true;
}

// `.item()` of a remote tensor answered by the lane (lane.cpp): the CALL Python's
// genie.device.dispatch._local_scalar sends, sent with the queue's batch and its reply read without
// Python's op path; Python's connection finishes the reply. False: Python's path (nothing was sent).
bool item_natively(const OpFacts& f, const c10::FunctionSchema& schema, torch::jit::Stack* stack, size_t nargs) {
  if (nargs != 1 || !stack->back().isTensor()) return false;
  at::Tensor t = stack->back().toTensor();
  if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1 || t.is_conj() || t.is_neg() ||
      wire_dtype_code(t.scalar_type()) < 0)
    return false;
  std::shared_ptr<Queue> q;
  int local = 0;
  if (!route_of(t.get_device(), &q, &local) || !q->lane_on.load(std::memory_order_relaxed)) return false;
  uint64_t req = q->next_request.fetch_add(1);
  std::string cmd;
  cmd.reserve(128);
  pack_array_header(cmd, genie_wire::kCmdCallItems);  // [CMD_CALL, req, local, op, [t], {}, [out id]]
  pack_uint(cmd, genie_wire::kCmdCall);
  pack_uint(cmd, req);
  pack_uint(cmd, static_cast<uint64_t>(local));
  cmd.append(f.name_packed);
  pack_array_header(cmd, 1);
  pack_tensor_ext(cmd, t);
  pack_map_header(cmd, 0);
  pack_array_header(cmd, 1);
  pack_uint(cmd, new_storage_id());
  IValue result;
  auto type = schema.returns()[0].real_type();
  if (!lane_request(q, t.get_device(), req, cmd, [&](py::handle r) { result = torch::jit::toIValue(r, type); })) return false;
  torch::jit::drop(*stack, nargs);
  torch::jit::push(*stack, std::move(result));
  return true;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  OpFacts& f = *facts_of(op);
  const auto& schema = op.schema();
  size_t nargs = schema.arguments().size();
  thread_local Encoder enc;
  if ((f.fills || g_shadow_count.load(std::memory_order_relaxed) > 0) &&
      touches_shadow(f, op, torch::jit::last(*stack, nargs))) {
    g_misses.fetch_add(1, std::memory_order_relaxed);
    return call_python(f, op, stack, nullptr);
  }
  if (f.item && item_natively(f, schema, stack, nargs)) {
    g_hits.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (f.copy != OpFacts::not_copy && copy_natively(enc, stack, nargs, f.copy == OpFacts::copy_from)) {
    g_hits.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  bool cacheable = enc.call(f, schema, torch::jit::last(*stack, nargs));
  if (cacheable) {
    std::shared_ptr<const Signature> sig;
    {
      std::lock_guard<std::mutex> g(g_mu);
      auto it = g_signatures.find(enc.key);
      if (it != g_signatures.end()) sig = it->second;
    }
    if (sig && answer(f, schema, *sig, enc, stack, nargs)) {
      g_hits.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  g_misses.fetch_add(1, std::memory_order_relaxed);
  if (!cacheable) return call_python(f, op, stack, nullptr);
  Teaching teaching{&f, enc.key, enc.floats_by_type, nullptr};
  call_python(f, op, stack, &teaching);
  if (teaching.learned && teaching.learned->outs.size() == schema.returns().size() &&
      f.floats_by_type == teaching.floats_by_type) {
    std::lock_guard<std::mutex> g(g_mu);
    if (g_signatures.size() >= kMaxSignatures) g_signatures.clear();  // AdamW-like value churn: start over
    g_signatures[teaching.key] = std::move(teaching.learned);
  }
}

// fast_learn(name, floats_by_type, outs): outs per return, (0, dtype, sizes, strides, offset, span) fresh,
// (1, argument position) in place, (2,) undefined, (3, argument position, dtype, sizes, strides, offset, span)
// an empty out= argument resized. Ignored unless it teaches the call this thread's
// fallback handed to Python (an op Python runs for another reason, nested, teaches nothing).
void fast_learn(const std::string& name, bool floats_by_type, py::list outs) {
  Teaching* t = tl_teaching;
  if (t == nullptr || t->facts->name != name || t->learned) return;
  auto* f = const_cast<OpFacts*>(t->facts);
  if (!f->taught) {
    f->floats_by_type = floats_by_type;
    f->taught = true;
  }
  auto sig = std::make_shared<Signature>();
  for (auto item : outs) {
    auto e = py::cast<py::tuple>(item);
    Out o;
    auto layout = [&](size_t at) {  // (dtype, sizes, strides, offset, span) from item `at` of the entry on
      o.dtype = reinterpret_cast<THPDtype*>(e[at].ptr())->scalar_type;
      o.sizes = py::cast<std::vector<int64_t>>(e[at + 1]);
      o.strides = py::cast<std::vector<int64_t>>(e[at + 2]);
      o.offset = py::cast<int64_t>(e[at + 3]);
      o.span = py::cast<int64_t>(e[at + 4]);
    };
    int kind = py::cast<int>(e[0]);
    if (kind == 0) {
      o.kind = Out::fresh;
      layout(1);
    } else if (kind == 1) {
      o.kind = Out::inplace;
      o.arg = py::cast<size_t>(e[1]);
    } else if (kind == 3) {
      o.kind = Out::resized;
      o.arg = py::cast<size_t>(e[1]);
      layout(2);
    } else {
      o.kind = Out::undefined;
    }
    sig->outs.push_back(std::move(o));
  }
  t->learned = std::move(sig);
}

std::shared_ptr<Queue> queue_of(int64_t id) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_queues.find(id);
  TORCH_CHECK(it != g_queues.end(), "genie: no op queue ", id);
  return it->second;
}

}  // namespace

bool route_of(int device, std::shared_ptr<Queue>* q, int* local) {
  std::lock_guard<std::mutex> g(g_mu);
  if (device < 0 || device >= static_cast<int>(g_routes.size()) || !g_routes[device].queue) return false;
  *q = g_routes[device].queue;
  *local = g_routes[device].local;
  return true;
}

std::vector<uint64_t> take_frees(Queue& q) {
  auto freed = take_freed_all();
  if (!freed.empty()) {
    std::lock_guard<std::mutex> g(g_mu);
    if (g_shadow_count.load(std::memory_order_relaxed) > 0) {
      std::lock_guard<std::mutex> gs(g_shadow_mu);
      for (const auto& [device, sid] : freed) {
        if (g_shadowed.erase(sid) != 0) g_shadow_freed.push_back(sid);
      }
      g_shadow_count.store(g_shadowed.size());
    }
    for (const auto& [device, sid] : freed) {  // a device no session has (after shutdown): its storage is gone
      if (device < 0 || device >= static_cast<int>(g_routes.size()) || !g_routes[device].queue) continue;
      auto& target = *g_routes[device].queue;
      std::lock_guard<std::mutex> gq(target.mu);
      target.frees.push_back(sid);
    }
  }
  std::vector<uint64_t> out;
  std::lock_guard<std::mutex> g(q.mu);
  out.swap(q.frees);
  return out;
}

void init_fastpath(py::module_& m) {
  m.def("set_python_fallback", [](py::object fallback, py::object resolve) {
    if (g_python_fallback == nullptr) {  // leaked: outlive interpreter teardown order
      g_python_fallback = new py::object();
      g_resolve = new py::object();
    }
    *g_python_fallback = std::move(fallback);
    *g_resolve = std::move(resolve);
  }, "The Python fallback (func, *args, **kwargs) and the OpOverload resolver (namespace, name, overload).");
  m.def("fast_teaching", [](const std::string& name) {
    return tl_teaching != nullptr && !tl_teaching->learned && tl_teaching->facts->name == name;
  }, "Whether this thread's fallback waits to learn a call of this op (then fast_learn teaches it).");
  m.def("shadow_mark", [](uint64_t sid, bool on) {
    std::lock_guard<std::mutex> g(g_shadow_mu);
    if (on) {
      g_shadowed.insert(sid);
    } else {
      g_shadowed.erase(sid);
    }
    g_shadow_count.store(g_shadowed.size());
  }, "Mark (on) or unmark a storage id as shadowed on the host: calls touching it go to Python.");
  m.def("shadow_clear", [] {
    std::lock_guard<std::mutex> g(g_shadow_mu);
    g_shadowed.clear();
    g_shadow_freed.clear();
    g_shadow_count.store(0);
  }, "Unmark every shadowed storage.");
  m.def("shadow_freed", [] {
    std::vector<uint64_t> out;
    std::lock_guard<std::mutex> g(g_shadow_mu);
    out.swap(g_shadow_freed);
    return out;
  }, "Shadowed storages freed since the last call (their marks are gone already).");
  m.def("shadow_fill_bytes", [](int64_t limit) { g_shadow_fill_bytes.store(limit); },
        "fill_/zero_ of an integer or bool storage of at most this many bytes go to Python (0: none).");
  m.def("shadow_ops", [](const std::vector<std::string>& follow, const std::vector<std::string>& move,
                         const std::vector<std::string>& integer) {
    {
      std::lock_guard<std::mutex> g(g_shadow_mu);
      g_shadow_ops.clear();
      for (const auto& n : follow) g_shadow_ops[n] = use_follow;
      for (const auto& n : move) g_shadow_ops[n] = use_move;
      for (const auto& n : integer) g_shadow_ops[n] = use_int;
    }
    std::lock_guard<std::mutex> g(g_mu);
    for (auto& [key, facts] : g_facts) facts->shadow_use.store(-1, std::memory_order_relaxed);
  }, py::arg("follow"), py::arg("move"), py::arg("integer"),
     "The ops (schema names) host shadows follow (reads and copies: a call with a shadowed tensor goes to Python) "
     "and derive, in any dtype but complex (move) or on integers only (integer): a call whose inputs are all "
     "shadowed goes to Python. A call that writes a shadowed storage always does.");
  m.def("fast_learn", &fast_learn, "Teach the call being handled: its outputs (see fastpath.cpp).");
  m.def("fast_forget", [] {
    std::lock_guard<std::mutex> g(g_mu);
    g_signatures.clear();
  }, "Forget every signature (a new session: servers of another kind answer some ops differently).");
  m.def("fast_counts", [] {
    std::lock_guard<std::mutex> g(g_mu);
    return py::make_tuple(g_hits.load(), g_misses.load(), g_signatures.size());
  }, "(ops answered here, ops handed to Python, signatures known).");
  m.def("queue_new", [] {
    std::lock_guard<std::mutex> g(g_mu);
    int64_t id = g_next_queue++;
    g_queues[id] = std::make_shared<Queue>();
    return id;
  });
  m.def("queue_drop", [](int64_t id) {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_queues.find(id);
    if (it == g_queues.end()) return;
    {
      std::lock_guard<std::mutex> gq(it->second->mu);
      it->second->room_cmds = it->second->room_bytes = 0;
    }
    g_queues.erase(it);
  });
  m.def("queue_take", [](int64_t id) -> py::object {
    auto q = queue_of(id);
    std::vector<std::string> cmds;
    {
      std::lock_guard<std::mutex> g(q->mu);
      if (q->cmds.empty()) return py::none();
      cmds.swap(q->cmds);
      q->bytes = 0;
    }
    py::list out(cmds.size());
    for (size_t i = 0; i < cmds.size(); ++i) out[i] = py::bytes(cmds[i]);
    return out;
  }, "The commands queued natively since the last call, in order (None when there are none).");
  m.def("queue_room", [](int64_t id, int64_t cmds, int64_t bytes, bool clean, int64_t book_ops_left,
                          int64_t book_ops_after_sync, int64_t after_sync_cmds, int64_t after_sync_bytes) {
    auto q = queue_of(id);
    std::lock_guard<std::mutex> g(q->mu);
    q->room_cmds = static_cast<size_t>(std::max<int64_t>(cmds, 0));
    q->room_bytes = static_cast<size_t>(std::max<int64_t>(bytes, 0));
    q->clean = clean;
    q->book_ops_left = clean ? book_ops_left : -1;
    q->book_ops_after_sync = book_ops_after_sync;
    q->after_sync_cmds = static_cast<size_t>(std::max<int64_t>(after_sync_cmds, 0));
    q->after_sync_bytes = static_cast<size_t>(std::max<int64_t>(after_sync_bytes, 0));
  }, py::arg("id"), py::arg("cmds"), py::arg("bytes"), py::arg("clean") = false, py::arg("book_ops_left") = -1,
     py::arg("book_ops_after_sync") = -1, py::arg("after_sync_cmds") = 0, py::arg("after_sync_bytes") = 0,
     "How many commands and bytes may wait natively before the batch must be sent (0: none), and whether "
     "Python holds nothing else for it (then the lane may send it); how many ops a lane round trip may take "
     "and keep its own books, and the room and allowance after one (queue.h).");
  m.def("queue_frees", [](int64_t id) {
    auto q = queue_of(id);
    return take_frees(*q);
  }, "Storages of this session freed in this process since the last call (the process's others go to their "
     "sessions' queues).");
  m.def("queue_request_id", [](int64_t id) { return queue_of(id)->next_request.fetch_add(1); },
        "The next request id of this session (shared with the lane).");
  m.def("queue_options", [](int64_t id, int options) { queue_of(id)->options.store(options); },
        "The session options the node was told last (bit 0 deterministic algorithms, bit 1 warn only): ops are "
        "queued natively only while torch's settings equal them.");
  m.def("session_options", &session_options, "torch's settings a node must share, as queue_options takes them.");
  m.def("queue_count", [](int64_t id) {
    auto q = queue_of(id);
    std::lock_guard<std::mutex> g(q->mu);
    return q->cmds.size();
  });
  m.def("set_routes", [](const std::vector<std::pair<int64_t, int>>& routes, int cmd_op, int cmd_call) {
    std::lock_guard<std::mutex> g(g_mu);
    TORCH_CHECK(cmd_op == genie_wire::kCmdOp && cmd_call == genie_wire::kCmdCall, "genie: CMD_OP and CMD_CALL are ",
                cmd_op, " and ", cmd_call, " in genie/wire/spec.py but ", int(genie_wire::kCmdOp), " and ",
                int(genie_wire::kCmdCall), " in the built genie._C: regenerate genie/csrc/wire/wire_spec.h and rebuild");
    g_routes.clear();
    for (const auto& [qid, local] : routes) {
      auto it = g_queues.find(qid);
      g_routes.push_back(Route{it == g_queues.end() ? nullptr : it->second, local});
    }
  }, "Per global device index: (its connection's queue, its index on its node); and the wire's CMD_OP and CMD_CALL, "
     "checked against the built-in ones (wire_spec.h).");
  m.def("whole_ops", [](const std::vector<std::string>& names) {
    // Kernels at PrivateUse1 for these aten ops (over their composite kernels), which are this fallback: so
    // they take the fast path too (a Python kernel there would go to Python every call).
    static std::vector<std::unique_ptr<torch::Library>> libraries;
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                std::optional<c10::DispatchKey>(c10::DispatchKey::PrivateUse1),
                                                __FILE__, __LINE__);
    for (const auto& name : names) lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    libraries.push_back(std::move(lib));
  }, "Register genie's fallback as the PrivateUse1 kernel of these aten ops (\"name\" or \"name.overload\"); once.");
  init_lane(m, &queue_of);
}

}  // namespace genie

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&genie::fallback>());
}
