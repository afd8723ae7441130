// genie._C, sixth translation unit: which fused attention kernel F.scaled_dot_product_attention uses on
// remote_accelerator.
//
// ATen's scaled_dot_product_attention (CompositeImplicitAutograd) asks _fused_sdp_choice_stub, a
// DispatchStub, which kernel to call for the query's device type; a device type with no entry gets the
// math path, a dozen small ops (matmul, softmax, ...) the client then sends one by one. genie registers
// the PrivateUse1 entry and answers for the kind of server that holds the device (set_sdp_kinds):
//
// - a CPU server: exactly what a local CPU run chooses (the CPU stub itself, asked about the same
//   tensors: it reads shapes, strides, dtypes and flags only). Its flash choice makes ATen call
//   _scaled_dot_product_flash_attention_for_cpu, which the client sends as one op (and its backward as one).
// - a CUDA server: `overrideable`, ATen's entry for out-of-tree backends, when the call is one that
//   flash or memory-efficient attention serves on CUDA; the server runs the overrideable op with those
//   kernels (genie/server/sdpa.py). Other calls keep the math path.
// - anything else (unknown, not connected): math, as before.

#include <torch/extension.h>

#include <ATen/SDPBackend.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>

#include <array>
#include <atomic>

#include "device/bindings.h"

namespace genie {
namespace {

namespace py = pybind11;

constexpr int8_t kUnknown = 0, kCpu = 1, kCuda = 2;
std::array<std::atomic<int8_t>, 128> g_kinds{};

int64_t math() { return static_cast<int64_t>(at::SDPBackend::math); }

// The calls flash (fp16/bf16) or memory-efficient attention (float32, masks) serve on CUDA; the server
// picks between them by the same rule (genie/server/sdpa.py, kernel_for). Conservative: dense 4-dim
// inputs with unit last stride and equal head dims, no dropout (its random state stays the server's),
// no grouped-query attention.
bool cuda_fused(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p, bool enable_gqa) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || dropout_p != 0.0 || enable_gqa) return false;
  if (q.is_nested() || k.is_nested() || v.is_nested()) return false;
  auto dtype = q.scalar_type();
  if (k.scalar_type() != dtype || v.scalar_type() != dtype) return false;
  if (dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kFloat) return false;
  auto d = q.size(3);
  if (k.size(3) != d || v.size(3) != d || d % 8 != 0 || d > 256) return false;
  if (q.size(1) != k.size(1) || k.size(1) != v.size(1)) return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  return q.size(2) > 0 && k.size(2) > 0;
}

}  // namespace

int64_t choose(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
               std::optional<double> scale, bool enable_gqa) {
  auto index = query.device().index();
  int8_t kind = index >= 0 && index < static_cast<int>(g_kinds.size()) ? g_kinds[index].load() : kUnknown;
  if (kind == kCpu) {
    // The CPU choice, through its op (the stub's call path is not part of torch's exported API), on CPU
    // tensors with the same metadata. It reads sizes, strides, dtypes and flags only, never the data, so
    // they point at one byte of ours and own nothing.
    static char nowhere = 0;
    auto cpu = [](const at::Tensor& t) {
      return at::from_blob(&nowhere, t.sizes(), t.strides(), [](void*) {}, t.options().device(c10::kCPU))
          .set_requires_grad(t.requires_grad());
    };
    std::optional<at::Tensor> mask;
    if (attn_mask.has_value() && attn_mask->defined()) mask = cpu(*attn_mask);
    // A Python mode (torch.compile's FakeTensorMode tracing on remote tensors) must not see these stand-ins:
    // they are a question to the CPU kernel's chooser, not a computation.
    c10::impl::ExcludeDispatchKeyGuard no_python(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    return at::_fused_sdp_choice(cpu(query), cpu(key), cpu(value), mask, dropout_p, is_causal, scale, enable_gqa);
  }
  if (kind == kCuda && cuda_fused(query, key, value, dropout_p, enable_gqa)) {
    return static_cast<int64_t>(at::SDPBackend::overrideable);
  }
  return math();
}

}  // namespace genie

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &genie::choose)
}  // namespace at::native

namespace genie {

void init_sdpa(py::module_& m) {
  m.def("set_sdp_kinds", [](const std::vector<std::string>& kinds) {
    for (size_t i = 0; i < g_kinds.size(); ++i) {
      int8_t k = kUnknown;
      if (i < kinds.size()) k = kinds[i] == "cpu" ? kCpu : kinds[i] == "cuda" ? kCuda : kUnknown;
      g_kinds[i].store(k);
    }
  }, "The server device kind of each remote_accelerator index ('cpu', 'cuda', other), for the SDPA choice.");
  m.def("sdp_choice", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal, bool enable_gqa) {
    return choose(q, k, v, mask, dropout_p, is_causal, std::nullopt, enable_gqa);
  }, "The SDPBackend value scaled_dot_product_attention uses for these remote tensors (for tests and tools).");
}

}  // namespace genie
