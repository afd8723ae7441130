// The device guard and the PrivateUse1 hooks of remote_accelerator: how many devices there are, which one
// is current on each thread, the guard torch calls to switch and synchronize devices, and the hooks
// interface (generators, pinned memory, device of a pointer, storage resizes). Synchronisation, empty_cache
// and storage resizes call back into Python through three hooks that genie.device sets.
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>

namespace pybind11 {
class object;
}

namespace genie {

// Device count as set by Python (the cluster's device table). While priming autograd's engine
// the guard reports g_max_devices so the engine makes a ready queue for every index we may use.
extern std::atomic<int> g_count;
extern std::atomic<bool> g_priming;
extern int g_max_devices;
// The current device: a thread's own once it set one (set_device, device guards), else the process
// default that genie.init chooses by placement (so `remote_accelerator` with no index follows it).
// A thread's own choice belongs to one session: genie.init/shutdown bump g_session, and a choice made
// under an earlier session is ignored (a device index means nothing across clusters).
extern std::atomic<int> g_default_device;
extern std::atomic<uint64_t> g_session;

struct CurrentDevice {
  c10::DeviceIndex own = -1;
  uint64_t session = 0;
  operator c10::DeviceIndex() const {
    return own >= 0 && session == g_session.load() ? own : static_cast<c10::DeviceIndex>(g_default_device.load());
  }
  CurrentDevice& operator=(c10::DeviceIndex d) {
    own = d;
    session = g_session.load();
    return *this;
  }
  // What guards use: entering or leaving a guard on the device already current keeps a thread that
  // never chose one following the default.
  void enter(c10::DeviceIndex d) {
    if (d >= 0 && d != static_cast<c10::DeviceIndex>(*this)) *this = d;
  }
};
extern thread_local CurrentDevice tl_device;

// Register the allocator and the hooks with c10 (idempotent).
void install();

// The Python callbacks: the connection layer waits for a node (sync), sends the frees waiting and
// clears the host pool (empty_cache), and queues CMD_RESIZE [device, storage id, new nbytes] in the device's
// op stream (resize; raises when it cannot: no hook yet, a lost device, a graph being captured).
void set_sync_hook(const pybind11::object& hook);
void set_empty_cache_hook(const pybind11::object& hook);
void set_resize_hook(const pybind11::object& hook);
void call_sync_hook(int device);
void call_empty_cache_hook();
void call_resize_hook(int device, uint64_t storage_id, int64_t nbytes);

}  // namespace genie
