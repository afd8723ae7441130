// Remote tensors on the wire (tensor_wire.h).

#include "device/tensor_wire.h"

#include <array>

#include "device/allocator.h"
#include "device/queue.h"
#include "wire/wire_spec.h"

namespace genie {

using c10::DeviceType;

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

}  // namespace genie
