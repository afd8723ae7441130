// The device guard and PrivateUse1 hooks of remote_accelerator (guard.h).

#include "device/guard.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/pybind11.h>

#include <mutex>

#include "device/allocator.h"
#include "device/generator.h"
#include "device/pinned_allocator.h"

namespace py = pybind11;

namespace genie {

std::atomic<int> g_count{0};
std::atomic<bool> g_priming{false};
int g_max_devices = 16;
std::atomic<int> g_default_device{0};
std::atomic<uint64_t> g_session{0};
thread_local CurrentDevice tl_device;

namespace {

using c10::DeviceIndex;
using c10::DeviceType;

// ---------------------------------------------------------------------------------------------
// Synchronisation calls back into Python (the connection layer knows how to wait for a node).
std::mutex g_hook_mu;
py::object* g_sync_hook = nullptr;
py::object* g_empty_cache_hook = nullptr;
py::object* g_resize_hook = nullptr;

}  // namespace

void call_sync_hook(int device) {
  py::object hook;
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    if (g_sync_hook == nullptr) return;
  }
  py::gil_scoped_acquire gil;
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    hook = *g_sync_hook;
  }
  hook(device);
}

// torch.accelerator.empty_cache(): Python sends the frees waiting and clears the host pool.
void call_empty_cache_hook() {
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    if (g_empty_cache_hook == nullptr) return;
  }
  py::gil_scoped_acquire gil;
  py::object hook;
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    hook = *g_empty_cache_hook;
  }
  hook();
}

// A storage resized here (allocator.cpp resize_storage): Python queues CMD_RESIZE in the device's op stream.
void call_resize_hook(int device, uint64_t storage_id, int64_t nbytes) {
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    TORCH_CHECK(g_resize_hook != nullptr, "genie: a remote_accelerator storage was resized before genie.device "
                "registered the device; import genie.device first");
  }
  py::gil_scoped_acquire gil;
  py::object hook;
  {
    std::lock_guard<std::mutex> g(g_hook_mu);
    hook = *g_resize_hook;
  }
  hook(device, storage_id, nbytes);
}

namespace {

// ---------------------------------------------------------------------------------------------
// Device guard: N devices, a thread-local current device, one default stream per device.
// Events carry only their device; recording is free and waiting on one waits for that device.
struct Guard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(DeviceType::PrivateUse1, tl_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == DeviceType::PrivateUse1, "genie: expected a remote_accelerator device, got ", d);
    tl_device.enter(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { tl_device.enter(d.index()); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  DeviceIndex deviceCount() const noexcept override {
    int n = g_count.load();
    if (g_priming.load() && n < g_max_devices) n = g_max_devices;
    return static_cast<DeviceIndex>(n);
  }
  void record(void** event, const c10::Stream& stream, const DeviceIndex device_index,
              const c10::EventFlag) const override {
    DeviceIndex d = device_index >= 0 ? device_index : stream.device_index();
    *event = reinterpret_cast<void*>(static_cast<intptr_t>(d) + 1);
  }
  void block(void*, const c10::Stream&) const override {}  // one ordered stream per device
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& s) const override { call_sync_hook(s.device_index()); }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) call_sync_hook(static_cast<int>(reinterpret_cast<intptr_t>(event) - 1));
  }
  void synchronizeDevice(const DeviceIndex d) const override { call_sync_hook(d); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const DeviceIndex) const override {
    TORCH_CHECK(false, "genie: remote_accelerator events do not measure time (time on the host instead)");
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---------------------------------------------------------------------------------------------
// PrivateUse1 hooks.
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_count.load() > 0; }
  const at::Generator& getDefaultGenerator(DeviceIndex d) const override {
    return default_generator(d < 0 ? tl_device : d);
  }
  at::Generator getNewGenerator(DeviceIndex d = -1) const override {
    return at::make_generator<RemoteGenerator>(d < 0 ? tl_device : d, g_next_generator.fetch_add(1));
  }
  at::Device getDeviceFromPtr(void* data) const override {
    return c10::Device(DeviceType::PrivateUse1, device_of_storage(id_of_pointer(data), tl_device));
  }
  bool isPinnedPtr(const void* data) const override { return PinnedAllocator::instance().contains(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &PinnedAllocator::instance(); }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return static_cast<DeviceIndex>(g_count.load()); }
  void setCurrentDevice(DeviceIndex d) const override { tl_device = d; }
  DeviceIndex getCurrentDevice() const override { return tl_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = tl_device;
    tl_device.enter(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  // UntypedStorage.resize_() (FSDP2 frees unsharded parameters with resize_(0) and regrows them with resize_(n)).
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage(*storage.unsafeGetStorageImpl(), static_cast<int64_t>(nbytes));
  }
};

// Sets one of the Python callbacks (kept for the process: they may outlive the interpreter's teardown order).
void set_hook(py::object** slot, const py::object& hook) {
  std::lock_guard<std::mutex> g(g_hook_mu);
  if (*slot == nullptr) *slot = new py::object();  // leaked on purpose
  **slot = hook;
}

}  // namespace

void set_sync_hook(const py::object& hook) { set_hook(&g_sync_hook, hook); }
void set_empty_cache_hook(const py::object& hook) { set_hook(&g_empty_cache_hook, hook); }
void set_resize_hook(const py::object& hook) { set_hook(&g_resize_hook, hook); }

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetAllocator(DeviceType::PrivateUse1, remote_allocator());
    at::RegisterPrivateUse1HooksInterface(new Hooks());
  });
}

}  // namespace genie
