// What each part of genie._C adds to the module (device/bindings.cpp defines it and calls each).
#pragma once

#include <pybind11/pybind11.h>

namespace genie {

void init_fastpath(pybind11::module_& m);   // fastpath.cpp: ops queued without Python (and lane.cpp's)
void init_host_pool(pybind11::module_& m);  // host_pool.cpp: large .cpu() results from reused host blocks
void init_graph(pybind11::module_& m);      // graph.cpp: torch.accelerator.Graph's implementation
void init_sdpa(pybind11::module_& m);       // sdpa.cpp: scaled_dot_product_attention's kernel choice

}  // namespace genie
