// genie._C, third translation unit: large downloads land in reused host memory (what `.cpu()` allocates).
//
// `remote.cpu()` is ATen's composite `_to_copy`: a fresh CPU tensor from the default allocator, then a copy
// the device receives straight into it. A fresh 64 MiB block is new memory: the kernel zeroes every page on
// its first touch, which cost as much as the transfer itself (on the development machine, `.cpu()` of
// 64 MiB took 36 ms against 18 ms into a tensor the caller reused). CUDA keeps freed pinned host blocks for
// the same reason (its caching host allocator). Here, a device-to-CPU `_to_copy` of at least kMinBytes that
// `.cpu()`/`.to("cpu")` would give a plain contiguous tensor gets its storage from HostPool: an allocator whose
// freed blocks wait (at most kMaxBlocks of them, kMaxBytes together) for the next download of a size that
// fits. The result is an ordinary resizable CPU tensor. Every other `_to_copy` runs ATen's composite, as
// before. `_C.host_pool_clear()` (torch.remote_accelerator.empty_cache) gives the blocks back to the system.

#include <torch/extension.h>

#include <ATen/NativeFunctions.h>
#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "device/bindings.h"

namespace genie {
namespace {

constexpr size_t kMinBytes = size_t(4) << 20;   // smaller downloads: the default allocator, as before
constexpr size_t kMaxBlocks = 4;                // freed blocks kept at most
constexpr size_t kMaxBytes = size_t(256) << 20; // and at most this many bytes of them (a bigger block is freed)
constexpr size_t kAlign = 64;

struct Block {
  void* data;
  size_t size;
};

class HostPool final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t n) override {
    Block* block = take(n);
    if (block == nullptr) {
      void* data = nullptr;
      if (posix_memalign(&data, kAlign, n == 0 ? kAlign : n) != 0 || data == nullptr)
        TORCH_CHECK_WITH(OutOfMemoryError, false, "genie: could not allocate ", n, " bytes of host memory");
      block = new Block{data, n};
    }
    return {block->data, block, &HostPool::release, at::Device(at::kCPU)};
  }

  at::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // The kept block that fits n best (at least n, at most twice n), or null.
  Block* take(size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    size_t best = kept_.size();
    for (size_t i = 0; i < kept_.size(); ++i)
      if (kept_[i]->size >= n && kept_[i]->size <= 2 * n && (best == kept_.size() || kept_[i]->size < kept_[best]->size))
        best = i;
    if (best == kept_.size()) return nullptr;
    Block* block = kept_[best];
    kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
    bytes_ -= block->size;
    ++reused_;
    return block;
  }

  static void release(void* ctx) { pool().give(static_cast<Block*>(ctx)); }

  void give(Block* block) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (kept_.size() < kMaxBlocks && bytes_ + block->size <= kMaxBytes) {
        kept_.push_back(block);
        bytes_ += block->size;
        return;
      }
    }
    std::free(block->data);
    delete block;
  }

  size_t clear() {
    std::vector<Block*> gone;
    {
      std::lock_guard<std::mutex> g(mu_);
      gone.swap(kept_);
      bytes_ = 0;
    }
    size_t freed = 0;
    for (Block* block : gone) {
      freed += block->size;
      std::free(block->data);
      delete block;
    }
    return freed;
  }

  std::tuple<size_t, size_t, uint64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {kept_.size(), bytes_, reused_};
  }

  static HostPool& pool() {
    static HostPool* instance = new HostPool();  // leaked: tensors may die after static destructors ran
    return *instance;
  }

 private:
  std::mutex mu_;
  std::vector<Block*> kept_;
  size_t bytes_ = 0;
  uint64_t reused_ = 0;
};

// `_to_copy` of a device tensor: to a contiguous CPU tensor of the same dtype through the pool when large,
// else ATen's composite (dtype changes, layouts, pinned memory, math bits, other devices, small tensors).
at::Tensor to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                   std::optional<at::Device> device, std::optional<bool> pin_memory, bool non_blocking,
                   std::optional<at::MemoryFormat> memory_format) {
  auto format = memory_format.value_or(at::MemoryFormat::Preserve);
  size_t nbytes = static_cast<size_t>(self.numel()) * self.element_size();
  bool pooled = device.has_value() && device->is_cpu() && (!dtype || *dtype == self.scalar_type()) &&
                (!layout || *layout == at::kStrided) && !pin_memory.value_or(false) && nbytes >= kMinBytes &&
                !self.is_conj() && !self.is_neg() &&
                (format == at::MemoryFormat::Contiguous || (format == at::MemoryFormat::Preserve && self.is_contiguous()));
  if (!pooled)
    return at::native::_to_copy(self, dtype, layout, device, pin_memory, non_blocking, memory_format);
  HostPool& pool = HostPool::pool();
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                       pool.allocate(nbytes), &pool, /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(storage)),
                                                            c10::DispatchKeySet(c10::DispatchKey::CPU), self.dtype());
  out.unsafeGetTensorImpl()->set_sizes_contiguous(self.sizes());
  out.copy_(self, non_blocking);
  return out;
}

}  // namespace

void init_host_pool(pybind11::module_& m) {
  m.def("host_pool_clear", [] { return HostPool::pool().clear(); },
        "Give the freed download blocks back to the system; returns how many bytes.");
  m.def("host_pool_stats", [] { return HostPool::pool().stats(); },
        "(blocks kept, bytes kept, downloads that reused a block).");
}

}  // namespace genie

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_copy", &genie::to_copy);
}
