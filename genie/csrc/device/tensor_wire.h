// Remote tensors on the wire: the dtype codes of genie/wire/spec.py (wire/wire_spec.h) and the EXT_TENSOR
// descriptor [storage_id, dtype code, sizes, strides, storage_offset, storage_nbytes], built here because
// the op path needs two or three per op (genie/wire/values.py describes the format).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace genie {

// The wire code of a dtype (genie.wire.values.DTYPE_NAMES), -1 where it cannot cross the wire.
int wire_dtype_code(c10::ScalarType s);
// The wire code of a remote tensor's dtype; raises for other devices, math bits, unknown dtypes.
int wire_dtype(const at::Tensor& t);
// A msgpack array of sizes or strides (raises for a negative one).
void pack_int_array(std::string& out, c10::IntArrayRef v);
// The EXT_TENSOR payload of a remote tensor: [storage_id, dtype, sizes, strides, offset, storage_nbytes].
void pack_tensor_payload(std::string& out, const at::Tensor& t);
// That payload as the msgpack extension value EXT_TENSOR (8), as Python's msgpack packs an ExtType.
void pack_tensor_ext(std::string& out, const at::Tensor& t);

}  // namespace genie
