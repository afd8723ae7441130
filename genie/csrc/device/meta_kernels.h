// The metadata-only kernels of remote_accelerator, registered for PrivateUse1 (and the Conjugate and
// Negative keys' copies): empty tensors get storage ids from the allocator, views and set_ only move
// metadata. They never reach Python.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace genie {

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format);
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory);

}  // namespace genie
