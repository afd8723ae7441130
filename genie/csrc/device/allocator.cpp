// The storage-id allocator of remote_accelerator (allocator.h). Nothing here ever dereferences a device
// pointer.

#include "device/allocator.h"

#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "device/guard.h"

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
// The most bytes a storage may have: the node's bound (genie/server/codec.py MAX_NBYTES), which it enforces by
// closing the connection, so a larger resize is refused here.
constexpr int64_t kMaxStorageBytes = int64_t{1} << 62;

inline void* pointer_of(uint64_t sid) {
  return reinterpret_cast<void*>(kTag | (sid << kShift));
}

}  // namespace

uint64_t id_of_pointer(const void* p) {
  auto v = reinterpret_cast<uint64_t>(p);
  if (v == 0) return 0;
  TORCH_CHECK((v & kTag) != 0, "genie: not a remote_accelerator storage pointer");
  return (v & ~kTag) >> kShift;
}

namespace {

std::atomic<uint64_t> g_next_id{1};


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

}  // namespace

c10::DeviceAllocator* remote_allocator() { return &g_allocator; }

uint64_t storage_id_of_data(const void* data) { return id_of_pointer(data); }

uint64_t new_storage_id() { return next_id(); }

c10::DeviceIndex device_of_storage(uint64_t sid, c10::DeviceIndex otherwise) {
  auto& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  auto it = b.live.find(sid);
  return it == b.live.end() ? otherwise : it->second.second;
}

std::vector<std::pair<int, uint64_t>> take_freed_all() {
  std::vector<std::pair<int, uint64_t>> out;
  auto& b = book();
  std::lock_guard<std::mutex> g(b.mu);
  out.swap(b.freed);
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

void resize_storage(c10::StorageImpl& storage, int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0 && nbytes <= kMaxStorageBytes, "genie: a remote_accelerator storage holds 0 to 2**62 bytes, "
              "not ", static_cast<uint64_t>(nbytes), "; resize it to a size in that range");
  uint64_t sid = id_of_pointer(storage.data());
  if (sid == 0) {
    // Never allocated (zero bytes): a fresh id, as CUDA allocates a new block. Nothing to tell the node: it
    // makes a storage zero-filled on its first use, as for any new one (docs/server.md).
    if (nbytes == 0) return;
    DeviceIndex d = storage.device().index();
    storage.set_data_ptr_noswap(data_ptr_for(next_id(), nbytes, d < 0 ? static_cast<DeviceIndex>(tl_device) : d));
    storage.set_nbytes(static_cast<size_t>(nbytes));
    return;
  }
  auto& b = book();
  DeviceIndex d;
  int64_t old;
  {
    std::lock_guard<std::mutex> g(b.mu);
    auto it = b.live.find(sid);
    TORCH_CHECK(it != b.live.end(), "genie: storage ", sid, " is not one this client holds");
    old = it->second.first;
    d = it->second.second;
  }
  if (nbytes == old) return;
  // The node first (CMD_RESIZE, queued in order with the device's ops): if that is refused here (a lost device,
  // a graph being captured), the storage stays as it was. The id stays the storage's at every size, 0 included.
  call_resize_hook(static_cast<int>(d), sid, nbytes);
  {
    std::lock_guard<std::mutex> g(b.mu);
    auto it = b.live.find(sid);
    TORCH_CHECK(it != b.live.end(), "genie: storage ", sid, " is not one this client holds");
    auto& s = b.at(d);
    count_storage(s, it->second.first, false, false);
    count_storage(s, nbytes, true, false);
    it->second.first = nbytes;
  }
  storage.set_nbytes(static_cast<size_t>(nbytes));
}

}  // namespace genie
