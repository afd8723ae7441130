// Random generators of remote_accelerator (generator.h).

#include "device/generator.h"

#include <mutex>
#include <vector>

namespace genie {

std::atomic<int64_t> g_next_generator{1};

namespace {

std::mutex g_gen_mu;
std::vector<at::Generator>& default_generators() {
  static auto* v = new std::vector<at::Generator>();
  return *v;
}

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex d) {
  TORCH_CHECK(d >= 0 && d < 127, "genie: bad remote_accelerator index ", static_cast<int>(d));
  std::lock_guard<std::mutex> g(g_gen_mu);
  auto& v = default_generators();
  while (v.size() <= static_cast<size_t>(d)) {
    v.push_back(at::make_generator<RemoteGenerator>(static_cast<c10::DeviceIndex>(v.size()), 0));
  }
  return v[d];
}

}  // namespace genie
