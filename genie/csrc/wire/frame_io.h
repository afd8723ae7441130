// Frames on a socket without Python, for the client's lane (lane.cpp) and the node's native serving
// (server/runner.cpp): genie.wire.frame's frames, straight on the stream (tcp) or inside INLINE records
// (genie.transport.record: the shared-memory channel's small frames). Blocking sockets whose timeouts are
// the kernel's (SO_RCVTIMEO / SO_SNDTIMEO, genie_tcp.transport.kernel_timeouts). A frame is read whole and
// never a byte past it: what follows it in the last record is handed back (`leftover`), and a record of
// another kind (a ring record) stops the read with its header (`resume`), for the channel to go on.
#pragma once

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <string_view>
#include <vector>

#include "wire/msgpack.h"
#include "wire/wire_spec.h"

namespace genie_io {

// Whether this side frames, and its bound on bodies, set from Python once it checked the wire's numbers
// (genie/wire/spec.py) against the ones built in (wire_spec.h).
struct Wire {
  uint8_t version = 0;  // 0: not set, nothing is framed here
  uint64_t max_body = 0;
};

// Python passed the spec's numbers it runs with: false when the extension was built from another spec.
inline bool same_spec(int version, int batch, int reply, int inline_record) {
  return version == genie_wire::kProtocolVersion && batch == genie_wire::kKindBatch &&
         reply == genie_wire::kKindReply && inline_record == genie_wire::kRecordInline;
}

constexpr size_t kHeader = genie_wire::kHeaderBytes;  // magic, version, kind, body length u32, payload length u64
constexpr size_t kRecord = genie_wire::kRecordBytes;  // kind u8, length u64

inline uint64_t le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// The record header (where `records`) and frame header of a frame of `kind` with a body of `body_len`
// bytes and no payload, appended to `out`.
inline void frame_prefix(std::string& out, const Wire& w, uint8_t kind, size_t body_len, bool records) {
  if (records) {
    out.push_back(static_cast<char>(genie_wire::kRecordInline));
    put_le(out, kHeader + body_len, genie_wire::kRecordLenBytes);
  }
  out.append(genie_wire::kMagic, genie_wire::kMagicBytes);
  out.push_back(static_cast<char>(w.version));
  out.push_back(static_cast<char>(kind));
  put_le(out, body_len, genie_wire::kHeaderBodyLenBytes);
  put_le(out, 0, genie_wire::kHeaderPayloadLenBytes);
}

// What a blocking read or write ended with.
enum class Io { ok, closed, timeout, failed, interrupted };

inline Io io_error(int err) {
  if (err == EAGAIN || err == EWOULDBLOCK) return Io::timeout;
  if (err == EINTR) return Io::interrupted;
  return Io::failed;
}

inline Io send_all(int fd, const char* data, size_t n, int* err) {
  size_t done = 0;
  while (done < n) {
    ssize_t k = ::send(fd, data + done, n - done, MSG_NOSIGNAL);
    if (k < 0) {
      *err = errno;
      if (errno == EINTR) continue;  // nothing of the frame is lost: go on
      return io_error(errno);
    }
    done += static_cast<size_t>(k);
  }
  return Io::ok;
}

// Exactly n more bytes appended to `out`; `on_interrupt` runs after an interrupted wait (signal handlers),
// then the read goes on.
inline Io read_exact(int fd, std::string& out, size_t n, int* err, const std::function<void()>& on_interrupt) {
  size_t start = out.size();
  out.resize(start + n);
  size_t got = 0;
  while (got < n) {
    ssize_t k = ::recv(fd, &out[start + got], n - got, MSG_WAITALL);
    if (k > 0) {
      got += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) {
      if (on_interrupt) on_interrupt();
      continue;
    }
    out.resize(start + got);
    if (k == 0) return Io::closed;
    *err = errno;
    return io_error(errno);
  }
  return Io::ok;
}

// One frame as read: header and body (`frame`), or on `resume` the frame's bytes before a record of another
// kind, whose header follows.
struct Frame {
  std::string frame;
  std::string leftover;  // stream bytes of the last INLINE record past the frame
  bool resume = false;
  uint8_t record_kind = 0;
  uint64_t record_len = 0;
};

// One frame off `fd`. A header that is not genie's (magic, version) or announces a body over the bound ends
// the read after the header: the caller's Python names what is wrong with it.
inline Io read_frame(int fd, bool records, const Wire& w, Frame* r, int* err,
                     const std::function<void()>& on_interrupt) {
  size_t need = kHeader;
  auto header_read = [&]() {
    if (need == kHeader && r->frame.size() >= kHeader) {
      const char* h = r->frame.data();
      uint64_t body = le(h + genie_wire::kHeaderBodyLenAt, genie_wire::kHeaderBodyLenBytes);
      bool sane = std::memcmp(h, genie_wire::kMagic, genie_wire::kMagicBytes) == 0 &&
                  static_cast<uint8_t>(h[genie_wire::kHeaderVersionAt]) == w.version && body <= w.max_body;
      need = sane ? kHeader + body : kHeader;
    }
  };
  std::string record;
  while (r->frame.size() < need) {
    if (!records) {
      Io io = read_exact(fd, r->frame, need - r->frame.size(), err, on_interrupt);
      if (io != Io::ok) return io;
      header_read();
      continue;
    }
    record.clear();
    Io io = read_exact(fd, record, kRecord, err, on_interrupt);
    if (io != Io::ok) return io;
    uint8_t kind = static_cast<uint8_t>(record[0]);
    uint64_t length = le(record.data() + genie_wire::kRecordLenAt, genie_wire::kRecordLenBytes);
    if (kind != genie_wire::kRecordInline || length > w.max_body + kHeader) {
      r->resume = true;
      r->record_kind = kind;
      r->record_len = length;
      return Io::ok;
    }
    record.clear();
    io = read_exact(fd, record, length, err, on_interrupt);
    if (io != Io::ok) return io;
    size_t pos = 0;
    while (pos < record.size() && r->frame.size() < need) {
      size_t take = std::min(record.size() - pos, need - r->frame.size());
      r->frame.append(record, pos, take);
      pos += take;
      header_read();
    }
    if (pos < record.size()) r->leftover.assign(record, pos, std::string::npos);
  }
  return Io::ok;
}

// Whether read_frame read `frame`'s body (false: a header its checks refused, the read ended after it).
inline bool whole(const std::string& frame) {
  return frame.size() >= kHeader &&
         frame.size() == kHeader + le(frame.data() + genie_wire::kHeaderBodyLenAt, genie_wire::kHeaderBodyLenBytes);
}

// The kind of a frame read whole (or of its header).
inline uint8_t kind_of(const std::string& frame) { return static_cast<uint8_t>(frame[genie_wire::kHeaderKindAt]); }
// Its payload length.
inline uint64_t payload_of(const std::string& frame) {
  return le(frame.data() + genie_wire::kHeaderPayloadLenAt, genie_wire::kHeaderPayloadLenBytes);
}

// A BATCH body of commands only, {"uploads": [], "cmds": [bin, ...]} (keys in any order; an empty
// "cached" allowed): each command's (offset, length) in `body`. False for anything else (uploads, cache
// hits, another shape): Python's path decodes it and raises what it always raised.
inline bool batch_commands(const char* body, size_t n, std::vector<std::pair<size_t, size_t>>* cmds) {
  genie_msgpack::Reader r(body, n);
  uint64_t keys = 0;
  if (!r.map_header(&keys)) return false;
  bool saw_cmds = false;
  for (uint64_t k = 0; k < keys; ++k) {
    const char* name = nullptr;
    size_t len = 0;
    uint64_t count = 0;
    if (!r.str(&name, &len)) return false;
    std::string_view key(name, len);
    if (key == genie_wire::kBatchUploads || key == genie_wire::kBatchCached) {
      if (!r.array_header(&count) || count != 0) return false;
      continue;
    }
    if (key != genie_wire::kBatchCmds || saw_cmds) return false;
    saw_cmds = true;
    if (!r.array_header(&count) || count > r.left()) return false;
    cmds->reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      const char* data = nullptr;
      size_t size = 0;
      if (!r.bin(&data, &size)) return false;
      cmds->emplace_back(static_cast<size_t>(data - body), size);
    }
  }
  return saw_cmds && r.at_end();
}

inline std::string io_text(Io io, int err, const char* doing) {
  switch (io) {
    case Io::closed: return std::string("the peer closed the connection while this side was ") + doing;
    case Io::timeout: return std::string("timed out ") + doing;
    default: return std::string(doing) + " failed: " + std::strerror(err);
  }
}

}  // namespace genie_io
