// What genie._C's two translation units share: msgpack for tensor descriptors (device.cpp) and the
// native op path that encodes whole commands (fastpath.cpp). See genie/wire/values.py for the format.
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "queue.h"

namespace genie {

// The wire code of a dtype (genie.wire.values.DTYPE_NAMES), -1 where it cannot cross the wire.
int wire_dtype_code(c10::ScalarType s);
// The wire code of a remote tensor's dtype; raises for other devices, math bits, unknown dtypes.
int wire_dtype(const at::Tensor& t);
// msgpack (the plain values: queue.h).
void pack_int_array(std::string& out, c10::IntArrayRef v);
// The EXT_TENSOR payload of a remote tensor: [storage_id, dtype, sizes, strides, offset, storage_nbytes].
void pack_tensor_payload(std::string& out, const at::Tensor& t);
// That payload as the msgpack extension value EXT_TENSOR (8), as Python's msgpack packs an ExtType.
void pack_tensor_ext(std::string& out, const at::Tensor& t);

// The native op path (fastpath.cpp): its Python functions on genie._C.
void init_fastpath(pybind11::module_& m);
void init_host_pool(pybind11::module_& m);  // host_pool.cpp
void init_graph(pybind11::module_& m);  // graph.cpp: torch.accelerator.Graph's implementation
void init_sdpa(pybind11::module_& m);   // sdpa.cpp: scaled_dot_product_attention's kernel choice

}  // namespace genie
