// genie._C, fifth translation unit: torch.accelerator.Graph on remote_accelerator.
//
// torch 2.13 builds torch.accelerator.Graph over at::GraphImplInterface and finds each device type's
// implementation in at::GraphImplRegistry, keyed by c10::DeviceTypeName(type, /*lower_case=*/false)
// (ATen/core/GraphImplInterface.h). The key of PrivateUse1 is the renamed backend's name, so registration
// happens after the rename (genie.device.registration calls register_graph_impl), not at static init.
//
// Capture and replay are about the op stream, which is Python's (genie.device.graphs): this class only
// forwards each call to the Python object the factory makes for it. That is the whole of its work; the
// per-op path never comes here.

#include <torch/extension.h>

#include "device/bindings.h"

// torch before 2.13 has no graph registry (a GPU image's older torch): genie._C then has no
// register_graph_impl, and genie.device.graphs says so instead of registering.
#if __has_include(<ATen/core/GraphImplInterface.h>)
#define GENIE_HAS_GRAPH_IMPL 1
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/GraphImplInterface.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/DeviceType.h>

#include <cstring>

#include <memory>
#include <mutex>
#include <string>
#endif

namespace genie {
#ifdef GENIE_HAS_GRAPH_IMPL
namespace {

namespace py = pybind11;

std::mutex g_graph_mu;
py::object* g_graph_factory = nullptr;  // leaked on purpose: graphs may die during interpreter teardown

class RemoteGraphImpl final : public at::GraphImplInterface {
 public:
  explicit RemoteGraphImpl(const at::GraphImplArgs& args) {
    py::gil_scoped_acquire gil;
    py::object factory;
    {
      std::lock_guard<std::mutex> g(g_graph_mu);
      TORCH_CHECK(g_graph_factory != nullptr, "genie: no graph implementation registered");
      factory = *g_graph_factory;
    }
    graph_ = new py::object(factory(args.keep_graph));
  }

  ~RemoteGraphImpl() override {
    if (graph_ == nullptr) return;
    if (!Py_IsInitialized()) return;  // after teardown: nothing left to release (the object leaks)
    py::gil_scoped_acquire gil;
    delete graph_;
  }

  void capture_begin(at::MempoolId_t pool, at::GraphCaptureMode mode) override {
    py::gil_scoped_acquire gil;  // torch's binding released it, and the tuple below is a Python object
    call("capture_begin", py::make_tuple(static_cast<int64_t>(pool.first), static_cast<int64_t>(pool.second)),
         static_cast<int>(mode));
  }
  void capture_end() override { call("capture_end"); }
  void instantiate() override { call("instantiate"); }
  void replay() override { call("replay"); }
  void reset() override { call("reset"); }
  at::MempoolId_t pool() const override {
    py::gil_scoped_acquire gil;
    auto t = graph_->attr("pool")().cast<py::tuple>();
    return {t[0].cast<c10::CaptureId_t>(), t[1].cast<c10::CaptureId_t>()};
  }
  void enable_debug_mode() override { call("enable_debug_mode"); }
  void debug_dump(const std::string& path) override { call("debug_dump", path); }

 private:
  template <typename... A>
  void call(const char* name, A&&... args) const {
    py::gil_scoped_acquire gil;
    graph_->attr(name)(std::forward<A>(args)...);  // a Python exception propagates as itself
  }

  py::object* graph_ = nullptr;
};

// torch.accelerator.Graph's __enter__ calls torch.accelerator.empty_host_cache(), which asks the device
// type's HostAllocator; a PrivateUse1 backend without one crashed there (a null allocator). This one hands
// out the device's pinned host memory (the hooks' allocator) and keeps no cache of its own.
struct RemoteHostAllocator final : public at::HostAllocator {
  at::DataPtr allocate(size_t n) override {
    return at::detail::getPrivateUse1Hooks().getPinnedMemoryAllocator()->allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  bool record_event(void*, void*, c10::Stream) override { return false; }  // nothing is cached to protect
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

RemoteHostAllocator g_host_allocator;

}  // namespace

void init_graph(pybind11::module_& m) {
  m.def("register_graph_impl", [](py::object factory) {
    {
      std::lock_guard<std::mutex> g(g_graph_mu);
      if (g_graph_factory == nullptr) g_graph_factory = new py::object();
      *g_graph_factory = std::move(factory);
    }
    auto key = c10::DeviceTypeName(c10::DeviceType::PrivateUse1, /*lower_case=*/false);
    at::setHostAllocator(c10::DeviceType::PrivateUse1, &g_host_allocator);
    if (!at::GraphImplRegistry()->Has(key)) {
      at::GraphImplRegistry()->Register(key, [](at::GraphImplArgs args) -> std::unique_ptr<at::GraphImplInterface> {
        return std::make_unique<RemoteGraphImpl>(args);
      });
    }
    return key;
  }, "Make torch.accelerator.Graph on remote_accelerator call factory(keep_graph) for its implementation "
     "(an object with capture_begin, capture_end, instantiate, replay, reset, pool, enable_debug_mode, "
     "debug_dump); returns the registry key.");
}
#else
void init_graph(pybind11::module_&) {}
#endif

}  // namespace genie
