// The storage-id allocator of remote_accelerator: a storage here is only a number. The allocator hands out
// DataPtrs whose pointer encodes a *storage id* and never allocates memory, so views, aliasing, autograd
// and serialization work as on any device while the bytes stay on a genie server. It keeps the memory
// statistics torch.accelerator reads (c10::CachingDeviceAllocator::DeviceStats) for the storages held.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace genie {

// The allocator registered for PrivateUse1 (guard.cpp's install()).
c10::DeviceAllocator* remote_allocator();

// The storage id behind a storage's data pointer (0: an empty storage); raises for a pointer that is not one.
uint64_t id_of_pointer(const void* p);
// The same, for fastpath.cpp's host shadows (a data pointer it holds).
uint64_t storage_id_of_data(const void* data);
// A storage id no other storage of this process has.
uint64_t new_storage_id();
// The device of live storage `sid`, or `otherwise` when this process holds none of that id.
c10::DeviceIndex device_of_storage(uint64_t sid, c10::DeviceIndex otherwise);
// Storages freed since the last call, (global device index, storage id).
std::vector<std::pair<int, uint64_t>> take_freed_all();

// The bytes a layout reaches into its storage (0 for an empty tensor).
int64_t needed_bytes(c10::IntArrayRef size, c10::IntArrayRef stride, int64_t offset, int64_t itemsize);
// A tensor over storage `sid` of `nbytes` (one the server described; the id must have been handed out).
at::Tensor make_tensor(uint64_t sid, int64_t nbytes, int device, at::ScalarType dtype, std::vector<int64_t> size,
                       std::vector<int64_t> stride, int64_t offset);
// Resize a storage of the device to `nbytes`: every resize comes here (UntypedStorage.resize_ through the
// PrivateUse1 hook, Tensor.resize_ and grown out= arguments through genie.device.dispatch.set_layout). A storage
// with an id keeps it at every size (shrunk to 0 it still names the node's storage, for a later grow), and the
// node is told first (CMD_RESIZE through call_resize_hook); an empty storage without one (id 0) gets a fresh id,
// which the node makes zero-filled on first use. The memory statistics follow: a grown or shrunk storage is still
// one allocation, of its new size; an id's first bytes are a new allocation.
void resize_storage(c10::StorageImpl& storage, int64_t nbytes);

}  // namespace genie
