// Random generators of remote_accelerator: a CPU generator tagged with the remote device. Its seed is what
// the server's generator for the same id is seeded with (the client sends CMD_SEED when `epoch` moves).
#pragma once

#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <cstdint>

namespace genie {

// The next generator id (0 is the default generators').
extern std::atomic<int64_t> g_next_generator;

struct RemoteGenerator final : at::CPUGeneratorImpl {
  int64_t id;
  std::atomic<int64_t> epoch{0};

  RemoteGenerator(c10::DeviceIndex d, int64_t gid) : at::CPUGeneratorImpl(at::default_rng_seed_val), id(gid) {
    device_ = c10::Device(c10::DeviceType::PrivateUse1, d);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
  void set_current_seed(uint64_t seed) override {
    at::CPUGeneratorImpl::set_current_seed(seed);
    epoch.fetch_add(1);
  }
  void set_state(const c10::TensorImpl& new_state) override {
    at::CPUGeneratorImpl::set_state(new_state);
    epoch.fetch_add(1);
  }

 private:
  RemoteGenerator* clone_impl() const override {
    auto* g = new RemoteGenerator(device_.index(), g_next_generator.fetch_add(1));
    g->set_current_seed(current_seed());
    return g;
  }
};

// The default generator of device `d` (made on first use).
const at::Generator& default_generator(c10::DeviceIndex d);

}  // namespace genie
