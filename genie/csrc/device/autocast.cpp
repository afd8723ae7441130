// Autocast for remote_accelerator: CUDA's lists (ATen's shared op lists) for AutocastPrivateUse1; every
// other op runs in the dtypes it is given. Registration only: nothing here is called by name, so it has
// no header.

#include <ATen/autocast_mode.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

namespace genie {
namespace {

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

}  // namespace
}  // namespace genie
