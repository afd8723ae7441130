// A session's native half, shared by fastpath.cpp (ops queued without Python) and lane.cpp (sync points
// answered without Python). No torch headers here: lane.cpp compiles in seconds without them.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "wire/msgpack.h"
#include "wire/wire_spec.h"

namespace genie {

// A descriptor the lane owns (a dup of the channel's socket): closed when the last user lets go, so a
// channel closed by another thread never leaves a sync point reading a number the process reused.
struct LaneFd {
  int fd;
  explicit LaneFd(int f) : fd(f) {}
  ~LaneFd();
  LaneFd(const LaneFd&) = delete;
  LaneFd& operator=(const LaneFd&) = delete;
};

// One data-plane session's queue (genie.device.connection.NodeConnection.qid).
struct Queue {
  std::mutex mu;  // the fields up to `frees`
  std::vector<std::string> cmds;  // commands encoded natively, waiting for the next batch
  size_t bytes = 0;
  // How many more commands / bytes may wait here before the batch must go (Python sets it after
  // each change of its own batch; 0 while the node is lost or unknown: every op goes to Python).
  size_t room_cmds = 0;
  size_t room_bytes = 0;
  // Python holds nothing for the next batch (no commands, uploads, cache questions or errors of its
  // own) and its channel is at rest: a native sync point may send this queue's commands alone.
  bool clean = false;
  std::vector<uint64_t> frees;  // storages of this session freed in this process, not yet sent
  // The lane keeps the books of an .item() itself while its batch's ops keep the interval since the last
  // sync point unmeasured (genie.device.flushing: the batching policy learns nothing from it): at most
  // `book_ops_left` ops (-1: Python books each). Then the room is `after_sync_*`, what Python sets after a
  // sync point, and the next interval may take `book_ops_after_sync`.
  int64_t book_ops_left = -1;
  int64_t book_ops_after_sync = -1;
  size_t after_sync_cmds = 0;
  size_t after_sync_bytes = 0;
  // The session options the node was last told (genie.device.connection: CMD_OPTIONS, bit 0 deterministic
  // algorithms, bit 1 warn only). While torch's own differ, every op goes to Python, which tells the node
  // first: an op queued after torch.use_deterministic_algorithms() runs under it.
  std::atomic<int> options{0};

  // The session lock (NodeConnection.lock): every send and receive of the session holds it.
  std::recursive_mutex session;
  std::atomic<std::thread::id> owner{};
  int depth = 0;  // under `session`
  std::atomic<uint64_t> next_request{1};

  // The native lane (under `session`): the channel's stream while it is at rest, and the connection
  // whose Python finishes each reply (a strong reference, changed with the GIL held).
  std::shared_ptr<LaneFd> lane;
  bool lane_records = false;  // frames travel inside INLINE records (genie.transport.record)
  std::atomic<bool> lane_on{false};  // `lane` is set (read without the lock: a hint, checked again under it)
  PyObject* conn = nullptr;
  // Round trips booked here, not yet folded into Python's books (under `session`; lane.cpp queue_books).
  struct Books {
    uint64_t trips = 0;
    uint64_t ops = 0;
    double wait = 0;
    double last_end = 0;
    std::vector<std::pair<std::pair<PyObject*, int>, std::pair<uint64_t, double>>> places;  // (code, offset)
  } books;

  bool held_here() const { return owner.load() == std::this_thread::get_id(); }
  bool try_lock_session();
  void lock_session();
  void unlock_session();
};

// The queue of remote device `device` (a global index) and the device's index on its node; false: none.
bool route_of(int device, std::shared_ptr<Queue>* q, int* local);
// Storages freed anywhere in this process, each handed to its session's queue; then `q`'s, taken.
std::vector<uint64_t> take_frees(Queue& q);

// msgpack as Python's msgpack packs the same values (msgpack.h, the one writer and reader of genie's C++).
using genie_msgpack::pack_array_header;
using genie_msgpack::pack_bin;
using genie_msgpack::pack_bool;
using genie_msgpack::pack_double;
using genie_msgpack::pack_ext_header;
using genie_msgpack::pack_int;
using genie_msgpack::pack_map_header;
using genie_msgpack::pack_nil;
using genie_msgpack::pack_str;
using genie_msgpack::pack_tagged;
using genie_msgpack::pack_uint;
// A storage id no other storage of this process has (allocator.cpp).
uint64_t new_storage_id();
// Storages freed since the last call, (global device index, storage id) (allocator.cpp).
std::vector<std::pair<int, uint64_t>> take_freed_all();

// lane.cpp: send `q`'s batch with `request` (a msgpack command, request id `req`) last and read the reply;
// `on_result` gets (with the GIL) what the Python connection's method that completes it returned. False,
// having sent nothing, when the lane cannot take it (no lane, Python holds work, another thread has the
// session, or this one does): the caller takes Python's path.
bool lane_request(const std::shared_ptr<Queue>& q, int device, uint64_t req, const std::string& request,
                  const std::function<void(pybind11::handle)>& on_result);
void init_lane(pybind11::module_& m, std::shared_ptr<Queue> (*queue_of)(int64_t));

}  // namespace genie
