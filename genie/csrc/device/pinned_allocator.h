// Pinned host memory for remote_accelerator: ordinary malloc'd memory remembered, so is_pinned() answers
// true for it. Uploads read it like any host buffer; "pinned" only promises what the user asked for.
#pragma once

#include <c10/core/Allocator.h>

#include <cstdlib>
#include <mutex>
#include <unordered_set>

namespace genie {

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
    return c10::DataPtr(p, p, &PinnedAllocator::release, c10::Device(c10::DeviceType::CPU));
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

}  // namespace genie
