// Pinned host memory for remote_accelerator (pinned_allocator.h).

#include "device/pinned_allocator.h"

namespace genie {

PinnedAllocator& PinnedAllocator::instance() {
  static PinnedAllocator* a = new PinnedAllocator();
  return *a;
}

}  // namespace genie
