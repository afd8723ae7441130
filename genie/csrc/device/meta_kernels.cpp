// The metadata-only kernels of remote_accelerator (meta_kernels.h).

#include "device/meta_kernels.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/conj_physical.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/_copy_from.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <vector>

#include "device/allocator.h"
#include "device/guard.h"

namespace genie {
namespace {

using c10::DeviceType;

c10::DeviceIndex index_for(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) return device->index();
  return tl_device;
}

}  // namespace

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "genie: remote_accelerator supports strided tensors only");
  auto saved = tl_device;
  tl_device = index_for(device);
  auto out = at::detail::empty_generic(size, remote_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
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
  auto out = at::detail::empty_strided_generic(size, stride, remote_allocator(),
                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                               c10::dtype_or_default(dtype));
  tl_device = saved;
  return out;
}

namespace {

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
}  // namespace
}  // namespace genie
