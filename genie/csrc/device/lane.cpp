// genie._C's lane: a sync point's round trip without Python's op path.
//
// `.item()` is the commonest sync point, and on a same-host node Python's path (the fallback, the
// request, the batch, the frame, two receives) cost more than the node's work and the wire together.
// Here, while Python holds nothing for the next batch (queue.h: `clean`, which it sets with the room),
// the batch is built from what the session's queue holds (its frees, the commands genie._C encoded,
// the request last), framed as genie.wire.frame frames it (inside an INLINE record where the channel
// is a record stream: genie.transport.record), sent on a duplicate of the channel's socket, and the
// reply frame read back whole, never a byte past it. The session lock (NodeConnection.lock, a
// SessionLock) is held throughout, so Python's own sends and receives never interleave with it.
//
// Everything about the reply is Python's: the connection's `lane_reply` checks the header, matches
// the request id, raises the node's errors and keeps the statistics and the batching policy, as for
// its own requests (genie.device.connection). A record only Python can read (a shared-memory ring
// record) is handed back to it with the bytes read so far (`lane_resume`); a failed send or receive
// goes to `lane_failed` with the frame sent, which resumes the session after a dropped link (or
// declares the node lost). The GIL is taken only for those calls.

#include "device/queue.h"

#include "wire/frame_io.h"

#include <Python.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace genie {

namespace py = pybind11;

LaneFd::~LaneFd() {
  if (fd >= 0) ::close(fd);
}

bool Queue::try_lock_session() {
  if (!session.try_lock()) return false;
  owner.store(std::this_thread::get_id());
  ++depth;
  return true;
}

void Queue::lock_session() {
  session.lock();
  owner.store(std::this_thread::get_id());
  ++depth;
}

void Queue::unlock_session() {
  if (--depth == 0) owner.store(std::thread::id());
  session.unlock();
}

namespace {

using genie_io::Io;
using genie_io::kHeader;

genie_io::Wire g_wire;

double monotonic() {  // time.perf_counter()'s clock on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The BATCH frame {"uploads": [], "cmds": [...frees' FREE..., request]}, as genie.device.connection packs it.
std::string batch_frame(const std::vector<std::string>& cmds, const std::vector<uint64_t>& frees,
                        const std::string& request, bool records) {
  std::string body;
  size_t total = request.size() + 64 + 9 * frees.size();
  for (const auto& c : cmds) total += c.size() + 5;
  body.reserve(total);
  pack_map_header(body, 2);
  pack_str(body, genie_wire::kBatchUploads);
  pack_array_header(body, 0);
  pack_str(body, genie_wire::kBatchCmds);
  pack_array_header(body, cmds.size() + (frees.empty() ? 0 : 1) + 1);
  for (const auto& c : cmds) pack_bin(body, c);
  if (!frees.empty()) {
    std::string free_cmd;
    pack_array_header(free_cmd, genie_wire::kCmdFreeItems);
    pack_uint(free_cmd, genie_wire::kCmdFree);
    pack_array_header(free_cmd, frees.size());
    for (auto sid : frees) pack_uint(free_cmd, sid);
    pack_bin(body, free_cmd);
  }
  pack_bin(body, request);
  std::string out;
  out.reserve(body.size() + kHeader + genie_io::kRecord);
  genie_io::frame_prefix(out, g_wire, genie_wire::kKindBatch, body.size(), records);
  out.append(body);
  return out;
}

// The value of a REPLY [req, nil, number, []] to request `req` with nothing else in it (no payload, no
// error, no deferred errors): what the node's runner sends for .item() (server/runner.cpp, number_reply).
struct Number {
  enum Kind : uint8_t { none, boolean, integer, unsigned_integer, real } kind = none;
  bool b = false;
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
};

Number number_reply(const std::string& f, uint64_t req) {
  Number n;
  if (f.size() < kHeader + 4 || genie_io::kind_of(f) != genie_wire::kKindReply || genie_io::payload_of(f) != 0)
    return n;
  genie_msgpack::Reader r(f.data() + kHeader, f.size() - kHeader);
  uint64_t items = 0, got = 0, deferred = 0;
  if (!r.array_header(&items) || items != genie_wire::kReplyItems || !r.uint(&got) || got != req || !r.nil())
    return n;
  Number v;
  if (r.boolean(&v.b)) {
    v.kind = Number::boolean;
  } else if (r.uint(&v.u)) {
    v.kind = Number::unsigned_integer;
  } else if (r.negative(&v.i)) {
    v.kind = Number::integer;
  } else if (r.real(&v.d)) {
    v.kind = Number::real;
  } else {
    return n;
  }
  if (!r.array_header(&deferred) || deferred != 0 || !r.at_end()) return n;
  return v;
}

py::object number_object(const Number& v) {
  switch (v.kind) {
    case Number::boolean: return py::bool_(v.b);
    case Number::integer: return py::int_(v.i);
    case Number::unsigned_integer: return py::int_(v.u);
    default: return py::float_(v.d);
  }
}

// genie.device.stats: the cache of code objects outside genie and torch, and what fills it for a new one.
PyObject* g_outside = nullptr;   // genie.device.stats._outside (a strong reference)
PyObject* g_classify = nullptr;  // genie.device.stats.is_outside (a strong reference)

// The first frame outside genie and torch, as genie.device.stats.caller_place finds it (with the GIL):
// (a strong reference to its code, its instruction offset); (nullptr, 0) when none.
std::pair<PyObject*, int> caller_place() {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyObject* code = reinterpret_cast<PyObject*>(PyFrame_GetCode(frame));  // new reference
    PyObject* known = PyDict_GetItemWithError(g_outside, code);            // borrowed
    int outside = 0;
    if (known != nullptr) {
      outside = known == Py_True;
    } else {
      PyObject* got = PyErr_Occurred() ? nullptr : PyObject_CallOneArg(g_classify, code);
      outside = got != nullptr && PyObject_IsTrue(got) == 1;
      Py_XDECREF(got);
      PyErr_Clear();
    }
    if (outside) {
      int offset = PyFrame_GetLasti(frame);
      Py_DECREF(frame);
      return {code, offset};
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  return {nullptr, 0};
}

// An .item() answered with a number, its books kept here (with the GIL and the session lock); false: the
// interval since the last sync point is one the batching policy measures, or the node is lost: Python's.
bool book_natively(Queue& q, size_t taken, double started) {
  if (g_outside == nullptr || q.book_ops_left < 0 || taken > static_cast<size_t>(q.book_ops_left)) return false;
  {
    std::lock_guard<std::mutex> g(q.mu);
    if (q.room_bytes == 0) return false;  // lost meanwhile (mark_lost): every op goes to Python now
    q.room_cmds = q.after_sync_cmds;
    q.room_bytes = q.after_sync_bytes;
    q.clean = true;  // nothing of Python's changed under the session lock; the frame was read to its end
    q.book_ops_left = q.book_ops_after_sync;
  }
  double now = monotonic();
  auto& b = q.books;
  b.trips += 1;
  b.ops += taken;
  b.wait += now - started;
  b.last_end = now;
  auto place = caller_place();
  for (auto& entry : b.places) {
    if (entry.first == place) {
      entry.second.first += 1;
      entry.second.second += now - started;
      Py_XDECREF(place.first);
      return true;
    }
  }
  b.places.push_back({place, {1, now - started}});  // keeps the code's reference
  return true;
}

// Runs Python's signal handlers after an interrupted wait; a handler's exception ends the session (the
// reply is still on its way: the stream is out of step) and is raised.
void check_signals(Queue& q) {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return;
  py::error_already_set pending;
  py::handle(q.conn).attr("mark_lost")("a sync point was interrupted before its reply came");
  throw pending;
}

// The session lock as Python sees it: NodeConnection.lock (threading.RLock's methods the client uses).
struct SessionLock {
  std::shared_ptr<Queue> q;
  bool acquire(bool blocking) {
    if (q->held_here()) {  // the holder again: at once
      q->lock_session();
      return true;
    }
    if (q->try_lock_session()) return true;
    if (!blocking) return false;
    py::gil_scoped_release nogil;  // the holder may be a lane waiting for the GIL
    q->lock_session();
    return true;
  }
};

}  // namespace

bool lane_request(const std::shared_ptr<Queue>& q, int device, uint64_t req, const std::string& request,
                  const std::function<void(py::handle)>& on_result) {
  if (g_wire.version == 0 || PyGILState_Check()) return false;  // holding the GIL: Python's path releases it
  if (q->held_here() || !q->try_lock_session()) return false;
  struct Unlock {
    Queue& q;
    ~Unlock() { q.unlock_session(); }
  } unlock{*q};
  std::shared_ptr<LaneFd> lane = q->lane;
  if (!lane) return false;
  {
    std::lock_guard<std::mutex> g(q->mu);
    if (!q->clean) return false;
  }
  // Frees first, then the queue, as Python's flush: an op that used a storage freed by now was queued
  // before the free, so it is among the commands taken after.
  std::vector<uint64_t> frees = take_frees(*q);
  std::vector<std::string> cmds;
  {
    std::lock_guard<std::mutex> g(q->mu);
    cmds.swap(q->cmds);
    q->bytes = 0;
    q->clean = false;  // until Python has finished the reply and set the room again
  }
  size_t taken = cmds.size();
  double started = monotonic();
  std::string frame = batch_frame(cmds, frees, request, q->lane_records);
  cmds.clear();
  int err = 0;
  Io io = genie_io::send_all(lane->fd, frame.data(), frame.size(), &err);
  genie_io::Frame reply;
  if (io == Io::ok) {
    io = genie_io::read_frame(lane->fd, q->lane_records, g_wire, &reply, &err, [&q] { check_signals(*q); });
  }
  py::gil_scoped_acquire gil;
  py::handle conn(q->conn);
  py::object result;
  if (io != Io::ok) {
    // The frame goes along: a session that resumes after a dropped link sends it again if the node never
    // received it whole (genie.device.resume); then Python reads the reply and returns the result.
    result = conn.attr("lane_failed")(req, started, taken, device,
                                      genie_io::io_text(io, err, reply.frame.empty() ? "sending" : "receiving"),
                                      py::bytes(frame));
    on_result(result);
    return true;
  }
  Number number;
  if (!reply.resume && reply.leftover.empty()) number = number_reply(reply.frame, req);
  if (number.kind != Number::none) {  // the usual answer: Python only keeps the books
    result = number_object(number);
    if (!book_natively(*q, taken, started)) conn.attr("lane_done")(taken, started);
  } else if (reply.resume) {
    result = conn.attr("lane_resume")(req, started, taken, device, py::bytes(reply.frame), reply.record_kind,
                                      reply.record_len);
  } else {
    const std::string& f = reply.frame;
    py::object body = genie_io::whole(f) ? py::object(py::bytes(f.data() + kHeader, f.size() - kHeader)) : py::none();
    result = conn.attr("lane_reply")(req, started, taken, device, py::bytes(reply.frame.data(), kHeader), body,
                                     py::bytes(reply.leftover));
  }
  on_result(result);
  return true;
}

void init_lane(py::module_& m, std::shared_ptr<Queue> (*queue_of)(int64_t)) {
  py::class_<SessionLock>(m, "SessionLock", "A session's lock (NodeConnection.lock), shared with the lane.")
      .def(py::init([queue_of](int64_t qid) { return SessionLock{queue_of(qid)}; }))
      .def("acquire", &SessionLock::acquire, py::arg("blocking") = true)
      .def("release", [](SessionLock& s) { s.q->unlock_session(); })
      .def("__enter__", [](SessionLock& s) { s.acquire(true); })
      .def("__exit__", [](SessionLock& s, py::args) {
        s.q->unlock_session();
        return false;
      });
  m.def("set_lane_wire", [](int version, int batch, int reply, int cmd_free, int inline_record, uint64_t max_body) {
    if (!genie_io::same_spec(version, batch, reply, inline_record) || cmd_free != genie_wire::kCmdFree)
      throw std::invalid_argument("genie: the wire's numbers differ between genie/wire/spec.py and the built genie._C: "
                                  "regenerate genie/csrc/wire/wire_spec.h (python -m genie.wire.spec --header) and rebuild");
    g_wire.version = static_cast<uint8_t>(version);
    g_wire.max_body = max_body;
  }, "Turn the lane on: the wire's numbers (protocol version, BATCH, REPLY, CMD_FREE, INLINE; checked against the "
     "built-in ones, wire_spec.h) and the longest body.");
  m.def("set_lane_places", [](py::dict outside, py::object classify) {  // each session start: the same objects
    PyObject* old_outside = g_outside;
    PyObject* old_classify = g_classify;
    g_outside = outside.inc_ref().ptr();
    g_classify = classify.inc_ref().ptr();
    Py_XDECREF(old_outside);
    Py_XDECREF(old_classify);
  }, "genie.device.stats' cache of code objects outside genie and torch, and the function that classifies one.");
  m.def("queue_books", [queue_of](int64_t qid) -> py::object {
    auto q = queue_of(qid);
    {
      py::gil_scoped_release nogil;
      q->lock_session();
    }
    Queue::Books books;
    std::swap(books, q->books);
    q->unlock_session();
    if (books.trips == 0) return py::none();
    py::list places;
    for (auto& [place, tally] : books.places) {
      py::object code = place.first ? py::reinterpret_steal<py::object>(place.first) : py::none();
      places.append(py::make_tuple(code, place.second, tally.first, tally.second));
    }
    return py::make_tuple(books.trips, books.ops, books.wait, books.last_end, places);
  }, "The round trips the lane kept the books of since the last call: (round trips, ops their batches took, "
     "seconds waited, when the last ended, [(code, offset, round trips, seconds), ...]), or None.");
  m.def("queue_lane", [queue_of](int64_t qid, int fd, bool records, py::object conn) {
    auto q = queue_of(qid);
    std::shared_ptr<LaneFd> lane;
    if (fd >= 0) {
      int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (dup < 0) throw std::runtime_error(std::string("genie: cannot duplicate the channel's socket: ") + std::strerror(errno));
      lane = std::make_shared<LaneFd>(dup);
    }
    {
      py::gil_scoped_release nogil;
      q->lock_session();
    }
    PyObject* old = q->conn;
    q->lane = lane;
    q->lane_records = records;
    q->conn = lane ? conn.inc_ref().ptr() : nullptr;
    q->lane_on.store(static_cast<bool>(lane));
    q->unlock_session();
    Py_XDECREF(old);
  }, py::arg("qid"), py::arg("fd"), py::arg("records"), py::arg("conn"),
     "Answer this session's .item() natively over a duplicate of socket `fd` (-1: stop), frames inside INLINE "
     "records when `records`; `conn` finishes each reply (lane_reply, lane_resume, lane_failed).");
}

}  // namespace genie
