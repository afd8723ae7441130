// genie._C: the native half of the remote_accelerator device (PrivateUse1), its one bindings file.
//
// Tensors on remote_accelerator:N are ordinary TensorImpls whose storage lives on a genie server; locally
// a storage is only a number (allocator.h). The device's parts, one concept per file pair: allocator,
// pinned_allocator (host memory), guard (the device guard and the PrivateUse1 hooks), generator,
// meta_kernels, autocast; the op path without Python (fastpath.cpp, queue.h) and its sync points
// (lane.cpp), host_pool.cpp, graph.cpp, sdpa.cpp; tensor_wire for descriptors. This file only binds them.

#include <torch/extension.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/Generator.h>

#include <algorithm>
#include <string>

#include "device/allocator.h"
#include "device/bindings.h"
#include "device/generator.h"
#include "device/guard.h"
#include "device/tensor_wire.h"

namespace genie {
namespace {

using c10::DeviceIndex;
using c10::DeviceType;

uint64_t storage_id_of(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == DeviceType::PrivateUse1, "genie: storage_id() needs a remote_accelerator tensor, got ",
              t.device());
  return id_of_pointer(t.storage().data());
}

// (storage id, device index, sizes, strides, storage offset, storage nbytes) in one call:
// the per-op encoding path needs all of it.
py::tuple describe(const at::Tensor& t) {
  const auto& st = t.storage();
  return py::make_tuple(id_of_pointer(st.data()), static_cast<int>(t.device().index()), t.sizes().vec(),
                        t.strides().vec(), t.storage_offset(), static_cast<int64_t>(st.nbytes()));
}

// torch.cuda.memory_stats' flat form: "allocated_bytes.all.current", "active.large_pool.peak", ...
py::dict memory_stats(int device) {
  TORCH_CHECK(device >= 0 && device < 127, "genie: bad device index ", device);
  auto s = remote_allocator()->getDeviceStats(static_cast<DeviceIndex>(device));
  py::dict d;
  const char* pools[] = {"all", "small_pool", "large_pool"};
  auto put = [&](const std::string& name, const c10::CachingAllocator::StatArray& a) {
    for (size_t i = 0; i < a.size(); ++i) {
      std::string prefix = name + "." + pools[i] + ".";
      d[py::str(prefix + "current")] = a[i].current;
      d[py::str(prefix + "peak")] = a[i].peak;
      d[py::str(prefix + "allocated")] = a[i].allocated;
      d[py::str(prefix + "freed")] = a[i].freed;
    }
  };
  put("allocation", s.allocation);
  put("segment", s.segment);
  put("active", s.active);
  put("inactive_split", s.inactive_split);
  put("allocated_bytes", s.allocated_bytes);
  put("reserved_bytes", s.reserved_bytes);
  put("active_bytes", s.active_bytes);
  put("inactive_split_bytes", s.inactive_split_bytes);
  put("requested_bytes", s.requested_bytes);
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_sync_all_streams"] = s.num_sync_all_streams;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["max_split_size"] = s.max_split_size;
  d["num_storages.current"] = s.allocation[0].current;
  return d;
}

void reset_peak(int device) {
  TORCH_CHECK(device >= 0 && device < 127, "genie: bad device index ", device);
  remote_allocator()->resetPeakStats(static_cast<DeviceIndex>(device));
}

void reset_accumulated(int device) {
  TORCH_CHECK(device >= 0 && device < 127, "genie: bad device index ", device);
  remote_allocator()->resetAccumulatedStats(static_cast<DeviceIndex>(device));
}

// [storage_id, dtype code, sizes, strides, storage_offset, storage_nbytes] of a remote tensor.
py::list wire_desc(const at::Tensor& t) {
  int code = wire_dtype(t);
  const auto& st = t.storage();
  py::list l(6);
  l[0] = py::int_(id_of_pointer(st.data()));
  l[1] = py::int_(code);
  l[2] = py::cast(t.sizes().vec());
  l[3] = py::cast(t.strides().vec());
  l[4] = py::int_(t.storage_offset());
  l[5] = py::int_(static_cast<int64_t>(st.nbytes()));
  return l;
}

py::bytes wire_ext_payload(const at::Tensor& t) {
  std::string out;
  out.reserve(48);
  pack_tensor_payload(out, t);
  return py::bytes(out);
}

RemoteGenerator* remote_generator(py::handle obj) {
  auto gen = THPGenerator_Unwrap(obj.ptr());
  TORCH_CHECK(gen.device().type() == DeviceType::PrivateUse1, "genie: not a remote_accelerator generator");
  return static_cast<RemoteGenerator*>(gen.unsafeGetGeneratorImpl());
}

}  // namespace
}  // namespace genie

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace genie;
  m.doc() = "genie's native remote_accelerator device (PrivateUse1): allocator, guard, hooks, metadata kernels";
  init_fastpath(m);
  init_host_pool(m);
  init_graph(m);
  init_sdpa(m);
  m.def("install", &install, "Register the allocator and hooks (idempotent).");
  m.def("set_device_count", [](int n) {
    TORCH_CHECK(n >= 0 && n < 127, "genie: bad device count ", n);
    g_count.store(n);
  });
  m.def("device_count", [] { return g_count.load(); });
  m.def("set_max_devices", [](int n) { g_max_devices = std::max(1, std::min(n, 126)); });
  m.def("set_priming", [](bool on) { g_priming.store(on); });
  m.def("current_device", [] { return static_cast<int>(static_cast<DeviceIndex>(tl_device)); });
  m.def("set_default_device", [](int d) {
    TORCH_CHECK(d >= 0 && d < 127, "genie: bad device index ", d);
    g_default_device.store(d);
  });
  m.def("new_session", [] { g_session.fetch_add(1); }, "Forget every thread's own current device.");
  m.def("set_current_device", [](int d) {
    TORCH_CHECK(d >= 0 && d < 127, "genie: bad device index ", d);
    tl_device = static_cast<DeviceIndex>(d);
  });
  m.def("storage_id", &storage_id_of);
  m.def("describe", &describe);
  m.def("new_storage_id", [] { return new_storage_id(); });
  m.def("set_dtype_code", [](py::handle dtype, int code) {
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "genie: set_dtype_code needs a torch.dtype");
    auto s = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
    TORCH_CHECK(wire_dtype_code(s) == code, "genie: the wire code of ", s, " is ", code,
                " in genie/wire/spec.py but ", wire_dtype_code(s), " in the built genie._C: "
                "regenerate genie/csrc/wire/wire_spec.h (python -m genie.wire.spec --header) and rebuild");
  }, "Check a dtype's wire code against the one built in (wire_spec.h).");
  m.def("wire_desc", &wire_desc, "[storage_id, dtype code, sizes, strides, offset, storage_nbytes] of a remote tensor.");
  m.def("wire_ext_payload", &wire_ext_payload, "The msgpack bytes of wire_desc(t) (the EXT_TENSOR payload).");
  m.def("make_tensor", &make_tensor);
  m.def("memory_stats", &memory_stats);
  m.def("reset_peak_memory_stats", &reset_peak);
  m.def("reset_accumulated_memory_stats", &reset_accumulated);
  m.def("set_empty_cache_hook", [](py::object hook) { set_empty_cache_hook(hook); });
  m.def("set_sync_hook", [](py::object hook) { set_sync_hook(hook); });
  m.def("set_resize_hook", [](py::object hook) { set_resize_hook(hook); },
        "The callback (device, storage id, new nbytes) that queues CMD_RESIZE for a storage resized here.");
  m.def("default_generator", [](int d) {
    return py::reinterpret_steal<py::object>(THPGenerator_Wrap(default_generator(static_cast<c10::DeviceIndex>(d))));
  });
  m.def("generator_info", [](py::handle g) {
    auto* r = remote_generator(g);
    return py::make_tuple(r->id, r->current_seed(), r->epoch.load());
  });
}
