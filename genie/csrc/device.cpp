// genie._C: the native half of the remote_accelerator device (PrivateUse1).
//
// Tensors on remote_accelerator:N are ordinary TensorImpls whose storage lives on
// a genie server. Locally a storage is only a number: the allocator hands out
// DataPtrs whose pointer encodes a *storage id* and never allocates memory, so
// views, aliasing, autograd and serialization work as on any device while the
// bytes stay remote. Nothing here ever dereferences a device pointer.
//
// One translation unit on purpose: every TU that includes torch headers costs
// about a minute of compile time on small machines.

#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Generator.h>
#include <torch/headeronly/version.h>

#include "wire.h"

#include <array>
#include <atomic>
#include <string>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace genie {
namespace {

using c10::DeviceIndex;
using c10::DeviceType;

// ---------------------------------------------------------------------------------------------
// Storage ids <-> pointers.
//
// The pointer of storage id `sid` is kTag | (sid << kShift): the top bit makes it a
// non-canonical (kernel-half) address on every 64-bit platform we run on, so it can never be
// mistaken for host memory, and the shift keeps ids 4 KiB apart so pointer arithmetic on a
// storage (data_ptr + offset) never reaches the next id's pointer for small offsets.
constexpr uint64_t kTag = 1ULL << 63;
constexpr int kShift = 12;
constexpr uint64_t kMaxId = (1ULL << (63 - kShift)) - 1;

inline void* pointer_of(uint64_t sid) {
  return reinterpret_cast<void*>(kTag | (sid << kShift));
}

inline uint64_t id_of_pointer(const void* p) {
  auto v = reinterpret_cast<uint64_t>(p);
  if (v == 0) return 0;
  TORCH_CHECK((v & kTag) != 0, "genie: not a remote_accelerator storage pointer");
  return (v & ~kTag) >> kShift;
}

std::atomic<uint64_t> g_next_id{1};
// Device count as set by Python (the cluster's device table). While priming autograd's engine
// the guard reports kMaxDevices so the engine makes a ready queue for every index we may use.
std::atomic<int> g_count{0};
std::atomic<bool> g_priming{false};
int g_max_devices = 16;
// The current device: a thread's own once it set one (set_device, device guards), else the process
// default that genie.init chooses by placement (so `remote_accelerator` with no index follows it).
// A thread's own choice belongs to one session: genie.init/shutdown bump g_session, and a choice made
// under an earlier session is ignored (a device index means nothing across clusters).
std::atomic<int> g_default_device{0};
std::atomic<uint64_t> g_session{0};
struct CurrentDevice {
  DeviceIndex own = -1;
  uint64_t session = 0;
  operator DeviceIndex() const {
    return own >= 0 && session == g_session.load() ? own : static_cast<DeviceIndex>(g_default_device.load());
  }
  CurrentDevice& operator=(DeviceIndex d) {
    own = d;
    session = g_session.load();
    return *this;
  }
  // What guards use: entering or leaving a guard on the device already current keeps a thread that
  // never chose one following the default.
  void enter(DeviceIndex d) {
    if (d >= 0 && d != static_cast<DeviceIndex>(*this)) *this = d;
  }
};
thread_local CurrentDevice tl_device;

// What torch.accelerator's memory API reads (c10::CachingDeviceAllocator::DeviceStats), kept per device
// for the storages this client holds. No caching here: every storage is one allocation, one segment and
// one active block, and what is reserved is what is allocated. Pools split at 1 MiB as CUDA's do.
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;
constexpr int64_t kSmallPoolBytes = 1 << 20;

void count_storage(DeviceStats& s, int64_t nbytes, bool added, bool counted = true) {
  const size_t pool = static_cast<size_t>(nbytes < kSmallPoolBytes ? StatType::SMALL_POOL : StatType::LARGE_POOL);
  for (size_t i : {static_cast<size_t>(StatType::AGGREGATE), pool}) {
    for (auto* bytes : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      if (added) {
        (*bytes)[i].increase(static_cast<size_t>(nbytes));
      } else {
        (*bytes)[i].decrease(static_cast<size_t>(nbytes));
      }
    }
    if (!counted && i == static_cast<size_t>(StatType::AGGREGATE)) continue;  // a resize: one block still
    for (auto* blocks : {&s.allocation, &s.segment, &s.active}) {
      if (added) {
        (*blocks)[i].increase(1);
      } else {
        (*blocks)[i].decrease(1);
      }
    }
  }
  if (counted) (added ? s.num_device_alloc : s.num_device_free) += 1;
}

struct Book {
  std::mutex mu;
  std::unordered_map<uint64_t, std::pair<int64_t, DeviceIndex>> live;  // sid -> (nbytes, device)
  std::vector<DeviceStats> stats;
  std::vector<std::pair<int, uint64_t>> freed;

  DeviceStats& at(DeviceIndex d) {
    if (static_cast<size_t>(d) >= stats.size()) stats.resize(d + 1);
    return stats[d];
  }
  void add(uint64_t sid, int64_t nbytes, DeviceIndex d) {
    std::lock_guard<std::mutex> g(mu);
    live[sid] = {nbytes, d};
    count_storage(at(d), nbytes, true);
  }
};

Book& book() {
  static Book* b = new Book();  // leaked: storages may die during interpreter teardown
  return *b;
}

uint64_t next_id() {
  uint64_t sid = g_next_id.fetch_add(1);
  TORCH_CHECK(sid <= kMaxId, "genie: storage ids exhausted");
  return sid;
}

void delete_storage(void* ctx) {
  auto sid = reinterpret_cast<uint64_t>(ctx);
  auto& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  auto it = b.live.find(sid);
  if (it == b.live.end()) return;
  auto [nbytes, d] = it->second;
  b.live.erase(it);
  count_storage(b.at(d), nbytes, false);
  b.freed.emplace_back(static_cast<int>(d), sid);
}

void no_delete(void*) {}

c10::DataPtr data_ptr_for(uint64_t sid, int64_t nbytes, DeviceIndex d) {
  c10::Device device(DeviceType::PrivateUse1, d);
  if (sid == 0) return c10::DataPtr(nullptr, nullptr, &no_delete, device);
  book().add(sid, nbytes, d);
  return c10::DataPtr(pointer_of(sid), reinterpret_cast<void*>(sid), &delete_storage, device);
}

void call_empty_cache_hook();

// A c10::DeviceAllocator, so torch.accelerator's memory API (memory_allocated, max_memory_allocated,
// memory_stats, reset_peak_memory_stats, empty_cache) works on the device as on CUDA.
struct RemoteAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    DeviceIndex d = tl_device;
    if (nbytes == 0) return data_ptr_for(0, 0, d);
    return data_ptr_for(next_id(), static_cast<int64_t>(nbytes), d);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "genie: remote_accelerator storages hold no local bytes; copy tensors with .copy_()");
  }
  bool initialized() override { return true; }
  // Nothing is cached on the device side: send the frees waiting (Python) and give back the host pool.
  void emptyCache(c10::MempoolId_t) override { call_empty_cache_hook(); }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // one ordered stream per device
  DeviceStats getDeviceStats(DeviceIndex d) override {
    auto& b = book();
    std::lock_guard<std::mutex> g(b.mu);
    return b.at(checked(d));
  }
  void resetAccumulatedStats(DeviceIndex d) override {
    auto& b = book();
    std::lock_guard<std::mutex> g(b.mu);
    auto& s = b.at(checked(d));
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
      for (auto& stat : *a) stat.reset_accumulated();
    }
    s.oversize_allocations.reset_accumulated();
    s.oversize_segments.reset_accumulated();
    s.num_alloc_retries = s.num_ooms = s.num_sync_all_streams = s.num_device_alloc = s.num_device_free = 0;
  }
  void resetPeakStats(DeviceIndex d) override {
    auto& b = book();
    std::lock_guard<std::mutex> g(b.mu);
    auto& s = b.at(checked(d));
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
      for (auto& stat : *a) stat.reset_peak();
    }
    s.oversize_allocations.reset_peak();
    s.oversize_segments.reset_peak();
  }

 private:
  static DeviceIndex checked(DeviceIndex d) { return d < 0 ? static_cast<DeviceIndex>(tl_device) : d; }
};

RemoteAllocator g_allocator;

// ---------------------------------------------------------------------------------------------
// Pinned host memory: ordinary malloc'd memory we remember, so is_pinned() answers true for it.
// Uploads read it like any host buffer; "pinned" only promises what the user asked for.
struct PinnedAllocator final : c10::Allocator {
  std::mutex mu;
  std::unordered_set<void*> ptrs;

  static void release(void* p) {
    auto& self = instance();
    {
      std::lock_guard<std::mutex> g(self.mu);
      self.ptrs.erase(p);
    }
    std::free(p);
  }
  static PinnedAllocator& instance();

  c10::DataPtr allocate(size_t nbytes) override {
    void* p = nbytes ? std::aligned_alloc(64, (nbytes + 63) / 64 * 64) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> g(mu);
      ptrs.insert(p);
    }
    return c10::DataPtr(p, p, &PinnedAllocator::release, c10::Device(DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &PinnedAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool contains(const void* p) {
    std::lock_guard<std::mutex> g(mu);
    return ptrs.count(const_cast<void*>(p)) != 0;
  }
};

PinnedAllocator& PinnedAllocator::instance() {
  static PinnedAllocator* a = new PinnedAllocator();
  return *a;
}

// ---------------------------------------------------------------------------------------------
// Synchronisation calls back into Python (the connection layer knows how to wait for a node).
std::mutex g_hook_mu;
py::object* g_sync_hook = nullptr;

void call_sync_hook(int device) {
  py::object hook;
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    if (g_sync_hook == nullptr) return;
  }
  py::gil_scoped_acquire gil;
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    hook = *g_sync_hook;
  }
  hook(device);
}

py::object* g_empty_cache_hook = nullptr;

// torch.accelerator.empty_cache(): Python sends the frees waiting and clears the host pool.
void call_empty_cache_hook() {
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    if (g_empty_cache_hook == nullptr) return;
  }
  py::gil_scoped_acquire gil;
  py::object hook;
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    hook = *g_empty_cache_hook;
  }
  hook();
}

// ---------------------------------------------------------------------------------------------
// Device guard: N devices, a thread-local current device, one default stream per device.
// Events carry only their device; recording is free and waiting on one waits for that device.
struct Guard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(DeviceType::PrivateUse1, tl_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == DeviceType::PrivateUse1, "genie: expected a remote_accelerator device, got ", d);
    tl_device.enter(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { tl_device.enter(d.index()); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  DeviceIndex deviceCount() const noexcept override {
    int n = g_count.load();
    if (g_priming.load() && n < g_max_devices) n = g_max_devices;
    return static_cast<DeviceIndex>(n);
  }
  void record(void** event, const c10::Stream& stream, const DeviceIndex device_index,
              const c10::EventFlag) const override {
    DeviceIndex d = device_index >= 0 ? device_index : stream.device_index();
    *event = reinterpret_cast<void*>(static_cast<intptr_t>(d) + 1);
  }
  void block(void*, const c10::Stream&) const override {}  // one ordered stream per device
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& s) const override { call_sync_hook(s.device_index()); }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) call_sync_hook(static_cast<int>(reinterpret_cast<intptr_t>(event) - 1));
  }
  void synchronizeDevice(const DeviceIndex d) const override { call_sync_hook(d); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const DeviceIndex) const override {
    TORCH_CHECK(false, "genie: remote_accelerator events do not measure time (time on the host instead)");
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---------------------------------------------------------------------------------------------
// Generators: a CPU generator tagged with the remote device. Its seed is what the server's
// generator for the same id is seeded with (the client sends CMD_SEED when `epoch` moves).
std::atomic<int64_t> g_next_generator{1};

struct RemoteGenerator final : at::CPUGeneratorImpl {
  int64_t id;
  std::atomic<int64_t> epoch{0};

  RemoteGenerator(DeviceIndex d, int64_t gid) : at::CPUGeneratorImpl(at::default_rng_seed_val), id(gid) {
    device_ = c10::Device(DeviceType::PrivateUse1, d);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
  void set_current_seed(uint64_t seed) override {
    at::CPUGeneratorImpl::set_current_seed(seed);
    epoch.fetch_add(1);
  }
  void set_state(const c10::TensorImpl& new_state) override {
    at::CPUGeneratorImpl::set_state(new_state);
    epoch.fetch_add(1);
  }

 private:
  RemoteGenerator* clone_impl() const override {
    auto* g = new RemoteGenerator(device_.index(), g_next_generator.fetch_add(1));
    g->set_current_seed(current_seed());
    return g;
  }
};

std::mutex g_gen_mu;
std::vector<at::Generator>& default_generators() {
  static auto* v = new std::vector<at::Generator>();
  return *v;
}

const at::Generator& default_generator(DeviceIndex d) {
  TORCH_CHECK(d >= 0 && d < 127, "genie: bad remote_accelerator index ", static_cast<int>(d));
  std::lock_guard<std::mutex> g(g_gen_mu);
  auto& v = default_generators();
  while (v.size() <= static_cast<size_t>(d)) {
    v.push_back(at::make_generator<RemoteGenerator>(static_cast<DeviceIndex>(v.size()), 0));
  }
  return v[d];
}

// ---------------------------------------------------------------------------------------------
// PrivateUse1 hooks.
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_count.load() > 0; }
  const at::Generator& getDefaultGenerator(DeviceIndex d) const override {
    return default_generator(d < 0 ? tl_device : d);
  }
  at::Generator getNewGenerator(DeviceIndex d = -1) const override {
    return at::make_generator<RemoteGenerator>(d < 0 ? tl_device : d, g_next_generator.fetch_add(1));
  }
  at::Device getDeviceFromPtr(void* data) const override {
    uint64_t sid = id_of_pointer(data);
    auto& b = book();
    std::lock_guard<std::mutex> g(b.mu);
    auto it = b.live.find(sid);
    return c10::Device(DeviceType::PrivateUse1, it == b.live.end() ? tl_device : it->second.second);
  }
  bool isPinnedPtr(const void* data) const override { return PinnedAllocator::instance().contains(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &PinnedAllocator::instance(); }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return static_cast<DeviceIndex>(g_count.load()); }
  void setCurrentDevice(DeviceIndex d) const override { tl_device = d; }
  DeviceIndex getCurrentDevice() const override { return tl_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = tl_device;
    tl_device.enter(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage&, size_t) const override {
    TORCH_CHECK(false, "genie: UntypedStorage.resize_() is not supported on remote_accelerator; "
                       "use Tensor.resize_() (which keeps the server in step)");
  }
};

// ---------------------------------------------------------------------------------------------
// Metadata-only kernels: they never reach Python.
c10::DeviceIndex index_for(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) return device->index();
  return tl_device;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "genie: remote_accelerator supports strided tensors only");
  auto saved = tl_device;
  tl_device = index_for(device);
  auto out = at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                       c10::dtype_or_default(dtype), memory_format);
  tl_device = saved;
  return out;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "genie: remote_accelerator supports strided tensors only");
  auto saved = tl_device;
  tl_device = index_for(device);
  auto out = at::detail::empty_strided_generic(size, stride, &g_allocator,
                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                               c10::dtype_or_default(dtype));
  tl_device = saved;
  return out;
}

int64_t needed_bytes(c10::IntArrayRef size, c10::IntArrayRef stride, int64_t offset, int64_t itemsize) {
  int64_t last = offset;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] == 0) return 0;
    last += (size[i] - 1) * stride[i];
  }
  return (last + 1) * itemsize;
}

// set_ over a storage must never resize it locally (there is nothing local to resize);
// the storage has to be large enough already.
at::Tensor& set_storage_offset_(at::Tensor& self, c10::Storage source, c10::SymInt storage_offset,
                                c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  auto sz = C10_AS_INTARRAYREF_SLOW(size);
  auto st = C10_AS_INTARRAYREF_SLOW(stride);
  int64_t off = storage_offset.expect_int();
  TORCH_CHECK(source.device_type() == DeviceType::PrivateUse1,
              "genie: set_() on a remote_accelerator tensor needs a remote_accelerator storage, got one on ",
              source.device());
  auto need = needed_bytes(sz, st, off, self.dtype().itemsize());
  TORCH_CHECK(need <= static_cast<int64_t>(source.nbytes()), "genie: set_() describes ", need,
              " bytes but the storage holds ", source.nbytes());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(sz, st, off);
  return self;
}

at::Tensor& set_storage_(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes()) / static_cast<int64_t>(self.dtype().itemsize());
  std::vector<c10::SymInt> size{c10::SymInt(n)};
  std::vector<c10::SymInt> stride{c10::SymInt(1)};
  return set_storage_offset_(self, std::move(source), c10::SymInt(0), size, stride);
}

// `module.to(device)` swaps parameter data in place (`param.data = moved`) only when the two
// tensors may share a TensorImpl type; c10 lists the built-in dense backends only, so without
// this tied weights would be untied and optimizers built before `.to()` would hold stale tensors.
bool shallow_copy_compatible(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.device().is_cpu() || t.device().is_privateuseone());
  };
  return self.unsafeGetTensorImpl()->key_set() == from.unsafeGetTensorImpl()->key_set() ||
         (dense(self) && dense(from));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", &shallow_copy_compatible);
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  m.impl("as_strided", &at::native::as_strided_tensorimpl);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
  m.impl("view_as_real", &at::native::view_as_real);
  m.impl("view_as_complex", &at::native::view_as_complex);
  m.impl("set_.source_Storage", &set_storage_);
  m.impl("set_.source_Storage_storage_offset", &set_storage_offset_);
}

// Copies of tensors with a math bit (conj / neg: lazy `x.conj()`, `x.conj().imag`, `mH`).
// ATen's copy_ resolves the bits in its CPU/CUDA copy kernels, but a copy that involves
// remote_accelerator goes through `_copy_from`, which is not a fallthrough of the Conjugate and
// Negative keys; their fallback then materializes the input with clone(), which is itself a
// copy_ -> _copy_from with the same bit set, and recursed until the client's stack overflowed
// (SIGSEGV in conj, fft.hfft/ihfft, linalg.vecdot/pinv on complex, several backward formulas).
// So both keys get a kernel: drop the bits from views of both tensors, apply the difference to
// the source on the source's own device (remote ops for a remote source), and copy plainly.
at::Tensor without_math_bits(const at::Tensor& t) {
  if (!t.is_conj() && !t.is_neg()) return t;
  at::Tensor plain = t.alias();
  plain._set_conj(false);
  plain._set_neg(false);
  return plain;
}

at::Tensor copy_from_with_math_bits(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor src = without_math_bits(self);
  // dst's logical value must equal self's: its physical data is self's with the bits that differ applied.
  if (self.is_conj() != dst.is_conj()) src = at::conj_physical(src);
  if (self.is_neg() != dst.is_neg()) src = at::neg(src);
  at::_copy_from(src, without_math_bits(dst), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize_with_math_bits(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from_with_math_bits(self, dst, false);
}

TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", &copy_from_with_math_bits);
  m.impl("_copy_from_and_resize", &copy_from_and_resize_with_math_bits);
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", &copy_from_with_math_bits);
  m.impl("_copy_from_and_resize", &copy_from_and_resize_with_math_bits);
}

// Autocast for remote_accelerator follows CUDA's lists (ATen's shared op lists).
// The shared lists name ATen types unqualified.
using at::Scalar;
using at::ScalarType;
using at::IntArrayRef;
using at::Tensor;
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
using at::DimnameList;  // torch 2.11's list names it unqualified too (a GPU machine's image has 2.11)
#endif
#define GENIE_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define GENIE_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define GENIE_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define GENIE_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(GENIE_LOW)
  AT_FORALL_FP32(GENIE_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(GENIE_FP32_SET_OPT_DTYPE)
  AT_FORALL_PROMOTE(GENIE_PROMOTE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
}
// Every other op runs in the dtypes it is given.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}
#undef GENIE_LOW
#undef GENIE_FP32
#undef GENIE_FP32_SET_OPT_DTYPE
#undef GENIE_PROMOTE

// ---------------------------------------------------------------------------------------------
// Python-facing helpers.
void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetAllocator(DeviceType::PrivateUse1, &g_allocator);
    at::RegisterPrivateUse1HooksInterface(new Hooks());
  });
}

uint64_t storage_id_of(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == DeviceType::PrivateUse1, "genie: storage_id() needs a remote_accelerator tensor, got ",
              t.device());
  return id_of_pointer(t.storage().data());
}

// (storage id, device index, sizes, strides, storage offset, storage nbytes) in one call:
// the per-op encoding path needs all of it.
py::tuple describe(const at::Tensor& t) {
  const auto& st = t.storage();
  return py::make_tuple(id_of_pointer(st.data()), static_cast<int>(t.device().index()), t.sizes().vec(),
                        t.strides().vec(), t.storage_offset(), static_cast<int64_t>(st.nbytes()));
}

at::Tensor make_tensor(uint64_t sid, int64_t nbytes, int device, at::ScalarType dtype, std::vector<int64_t> size,
                       std::vector<int64_t> stride, int64_t offset) {
  TORCH_CHECK(sid <= kMaxId && sid < g_next_id.load(), "genie: storage id ", sid, " was never handed out");
  TORCH_CHECK(nbytes >= 0, "genie: negative storage size");
  auto need = needed_bytes(size, stride, offset, c10::elementSize(dtype));
  TORCH_CHECK(need <= nbytes, "genie: the server described a tensor of ", need, " bytes over a storage of ", nbytes);
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                              data_ptr_for(nbytes ? sid : 0, nbytes, static_cast<DeviceIndex>(device)), nullptr,
                              false);
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      c10::scalarTypeToTypeMeta(dtype));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride, offset);
  return out;
}

void resize_storage(const at::Tensor& t, int64_t nbytes) {
  auto storage = t.storage();
  uint64_t sid = id_of_pointer(storage.data());
  TORCH_CHECK(sid != 0, "genie: cannot grow an empty storage in place");
  auto& b = book();
  {
    std::lock_guard<std::mutex> g(b.mu);
    auto it = b.live.find(sid);
    TORCH_CHECK(it != b.live.end(), "genie: unknown storage");
    auto& s = b.at(it->second.second);
    count_storage(s, it->second.first, false, false);
    count_storage(s, nbytes, true, false);
    it->second.first = nbytes;
  }
  storage.unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(nbytes));
}


// torch.cuda.memory_stats' flat form: "allocated_bytes.all.current", "active.large_pool.peak", ...
py::dict memory_stats(int device) {
  TORCH_CHECK(device >= 0 && device < 127, "genie: bad device index ", device);
  auto s = g_allocator.getDeviceStats(static_cast<DeviceIndex>(device));
  py::dict d;
  const char* pools[] = {"all", "small_pool", "large_pool"};
  auto put = [&](const std::string& name, const c10::CachingAllocator::StatArray& a) {
    for (size_t i = 0; i < a.size(); ++i) {
      std::string prefix = name + "." + pools[i] + ".";
      d[py::str(prefix + "current")] = a[i].current;
      d[py::str(prefix + "peak")] = a[i].peak;
      d[py::str(prefix + "allocated")] = a[i].allocated;
      d[py::str(prefix + "freed")] = a[i].freed;
    }
  };
  put("allocation", s.allocation);
  put("segment", s.segment);
  put("active", s.active);
  put("inactive_split", s.inactive_split);
  put("allocated_bytes", s.allocated_bytes);
  put("reserved_bytes", s.reserved_bytes);
  put("active_bytes", s.active_bytes);
  put("inactive_split_bytes", s.inactive_split_bytes);
  put("requested_bytes", s.requested_bytes);
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_sync_all_streams"] = s.num_sync_all_streams;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["max_split_size"] = s.max_split_size;
  d["num_storages.current"] = s.allocation[0].current;
  return d;
}

void reset_peak(int device) {
  TORCH_CHECK(device >= 0 && device < 127, "genie: bad device index ", device);
  g_allocator.resetPeakStats(static_cast<DeviceIndex>(device));
}

void reset_accumulated(int device) {
  TORCH_CHECK(device >= 0 && device < 127, "genie: bad device index ", device);
  g_allocator.resetAccumulatedStats(static_cast<DeviceIndex>(device));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Wire descriptors, built here because the fallback needs two or three per op:
// [storage_id, dtype code, sizes, strides, storage_offset, storage_nbytes].
namespace {
// The wire codes of genie/wire/spec.py (wire_spec.h); -1 where a dtype cannot cross the wire.
std::array<int, static_cast<size_t>(at::ScalarType::NumOptions)> g_dtype_codes = [] {
  std::array<int, static_cast<size_t>(at::ScalarType::NumOptions)> a{};
  a.fill(-1);
#define GENIE_DTYPE_CODE(code, name) a[static_cast<size_t>(at::ScalarType::name)] = code;
  GENIE_WIRE_DTYPES(GENIE_DTYPE_CODE)
#undef GENIE_DTYPE_CODE
  return a;
}();

}  // namespace

int wire_dtype_code(c10::ScalarType s) { return g_dtype_codes[static_cast<size_t>(s)]; }

int wire_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == DeviceType::PrivateUse1, "genie: not a remote_accelerator tensor (", t.device(), ")");
  TORCH_CHECK(!t.is_conj() && !t.is_neg(), "genie: a lazily conjugated/negated remote tensor cannot be sent: "
                                           "call .resolve_conj() / .resolve_neg() on it first");
  int code = g_dtype_codes[static_cast<size_t>(t.scalar_type())];
  TORCH_CHECK(code >= 0, "genie: dtype ", t.scalar_type(), " cannot cross the wire");
  return code;
}

py::list wire_desc(const at::Tensor& t) {
  int code = wire_dtype(t);
  const auto& st = t.storage();
  py::list l(6);
  l[0] = py::int_(id_of_pointer(st.data()));
  l[1] = py::int_(code);
  l[2] = py::cast(t.sizes().vec());
  l[3] = py::cast(t.strides().vec());
  l[4] = py::int_(t.storage_offset());
  l[5] = py::int_(static_cast<int64_t>(st.nbytes()));
  return l;
}

uint64_t new_storage_id() { return next_id(); }
uint64_t storage_id_of_data(const void* data) { return id_of_pointer(data); }  // fastpath.cpp's host shadows

std::vector<std::pair<int, uint64_t>> take_freed_all() {
  std::vector<std::pair<int, uint64_t>> out;
  auto& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  out.swap(b.freed);
  return out;
}

void pack_int_array(std::string& out, c10::IntArrayRef v) {
  pack_array_header(out, v.size());
  for (auto x : v) {
    TORCH_CHECK(x >= 0, "genie: negative size or stride cannot cross the wire");
    pack_uint(out, static_cast<uint64_t>(x));
  }
}

// The EXT_TENSOR payload (the msgpack of the descriptor list), appended to `out`.
void pack_tensor_payload(std::string& out, const at::Tensor& t) {
  int code = wire_dtype(t);
  const auto& st = t.storage();
  pack_array_header(out, genie_wire::kDescriptorItems);
  pack_uint(out, id_of_pointer(st.data()));
  pack_uint(out, static_cast<uint64_t>(code));
  pack_int_array(out, t.sizes());
  pack_int_array(out, t.strides());
  pack_uint(out, static_cast<uint64_t>(t.storage_offset()));
  pack_uint(out, static_cast<uint64_t>(st.nbytes()));
}

void pack_tensor_ext(std::string& out, const at::Tensor& t) {
  std::string payload;
  pack_tensor_payload(payload, t);
  pack_ext_header(out, genie_wire::kExtTensor, payload.size());
  out.append(payload);
}

namespace {
py::bytes wire_ext_payload(const at::Tensor& t) {
  std::string out;
  out.reserve(48);
  pack_tensor_payload(out, t);
  return py::bytes(out);
}

RemoteGenerator* remote_generator(py::handle obj) {
  auto gen = THPGenerator_Unwrap(obj.ptr());
  TORCH_CHECK(gen.device().type() == DeviceType::PrivateUse1, "genie: not a remote_accelerator generator");
  return static_cast<RemoteGenerator*>(gen.unsafeGetGeneratorImpl());
}

}  // namespace
}  // namespace genie

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace genie;
  m.doc() = "genie's native remote_accelerator device (PrivateUse1): allocator, guard, hooks, metadata kernels";
  init_fastpath(m);
  init_host_pool(m);
  init_graph(m);
  init_sdpa(m);
  m.def("install", &install, "Register the allocator and hooks (idempotent).");
  m.def("set_device_count", [](int n) {
    TORCH_CHECK(n >= 0 && n < 127, "genie: bad device count ", n);
    g_count.store(n);
  });
  m.def("device_count", [] { return g_count.load(); });
  m.def("set_max_devices", [](int n) { g_max_devices = std::max(1, std::min(n, 126)); });
  m.def("set_priming", [](bool on) { g_priming.store(on); });
  m.def("current_device", [] { return static_cast<int>(static_cast<DeviceIndex>(tl_device)); });
  m.def("set_default_device", [](int d) {
    TORCH_CHECK(d >= 0 && d < 127, "genie: bad device index ", d);
    g_default_device.store(d);
  });
  m.def("new_session", [] { g_session.fetch_add(1); }, "Forget every thread's own current device.");
  m.def("set_current_device", [](int d) {
    TORCH_CHECK(d >= 0 && d < 127, "genie: bad device index ", d);
    tl_device = static_cast<DeviceIndex>(d);
  });
  m.def("storage_id", &storage_id_of);
  m.def("describe", &describe);
  m.def("new_storage_id", [] { return next_id(); });
  m.def("set_dtype_code", [](py::handle dtype, int code) {
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "genie: set_dtype_code needs a torch.dtype");
    auto s = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
    TORCH_CHECK(g_dtype_codes[static_cast<size_t>(s)] == code, "genie: the wire code of ", s, " is ", code,
                " in genie/wire/spec.py but ", g_dtype_codes[static_cast<size_t>(s)], " in the built genie._C: "
                "regenerate genie/csrc/wire_spec.h (python -m genie.wire.spec --header) and rebuild");
  }, "Check a dtype's wire code against the one built in (wire_spec.h).");
  m.def("wire_desc", &wire_desc, "[storage_id, dtype code, sizes, strides, offset, storage_nbytes] of a remote tensor.");
  m.def("wire_ext_payload", &wire_ext_payload, "The msgpack bytes of wire_desc(t) (the EXT_TENSOR payload).");
  m.def("make_tensor", &make_tensor);
  m.def("resize_storage", &resize_storage);
  m.def("memory_stats", &memory_stats);
  m.def("reset_peak_memory_stats", &reset_peak);
  m.def("reset_accumulated_memory_stats", &reset_accumulated);
  m.def("set_empty_cache_hook", [](py::object hook) {
    std::lock_guard<std::mutex> g(g_hook_mu);
    if (g_empty_cache_hook == nullptr) g_empty_cache_hook = new py::object();  // leaked, as the sync hook
    *g_empty_cache_hook = std::move(hook);
  });
  m.def("set_sync_hook", [](py::object hook) {
    std::lock_guard<std::mutex> g(g_hook_mu);
    if (g_sync_hook == nullptr) g_sync_hook = new py::object();  // leaked: outlives interpreter teardown order
    *g_sync_hook = std::move(hook);
  });
  m.def("default_generator", [](int d) {
    return py::reinterpret_steal<py::object>(THPGenerator_Wrap(default_generator(static_cast<c10::DeviceIndex>(d))));
  });
  m.def("generator_info", [](py::handle g) {
    auto* r = remote_generator(g);
    return py::make_tuple(r->id, r->current_seed(), r->epoch.load());
  });
}
