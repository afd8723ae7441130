// The command-key walker (genie.server.plans): shared by genie._C_keys (command_key) and genie._C_plans (the
// native plan runner), so both key a command the same way. Header-only: each extension is one translation unit.
//
// key_of(data, size, &key, &ids, &floats) walks one msgpack command and fills its key (the bytes with every
// tensor tag's storage id taken out, and for a CALL its request id and output storage ids; then the ids'
// aliasing pattern), the ids in order, and its floats in order: each float is taken out of the key too (its
// msgpack type stays), so an optimizer's changing scalars keep one key; a plan decides per op whether it
// fills them in per command or compares them (genie.server.plans). False when the bytes are not one
// well-formed msgpack value the walker can key (the caller then takes the full path, which says what is
// wrong).
//
// The bytes come from the network: every read is bounds-checked, nesting is capped, nothing is trusted.

#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "wire/msgpack.h"
#include "wire/wire_spec.h"

namespace genie_keys {

constexpr int kMaxDepth = 32;           // deeper commands take the full path
constexpr size_t kMaxTensors = 4096;     // more tensor tags than this: the full path
constexpr size_t kMaxFloats = 4096;      // more floats than this: the full path
constexpr uint8_t kExtTensor = static_cast<uint8_t>(genie_wire::kExtTensor);
constexpr uint8_t kExtInlineTensor = static_cast<uint8_t>(genie_wire::kExtInlineTensor);  // a fresh tensor each time: never keyed
constexpr uint8_t kMarker = genie_msgpack::kNeverUsed;  // the one byte msgpack never uses: a tensor tag in a key
constexpr uint64_t kMaxId = genie_wire::kMaxStorageId;

// Whether a command starts as a fixarray of `items` led by the fixint `code` (as Python packs every
// command C++ reads: fewer than 16 items, codes below 128).
inline bool starts_as(const uint8_t* data, size_t size, size_t items, uint8_t code) {
  return size >= 2 && data[0] == (genie_msgpack::kFixArray | items) && data[1] == code;
}

using namespace genie_msgpack;  // the type bytes

struct Walker {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  size_t copied = 0;  // bytes before this offset are in key already
  std::string key;
  std::vector<uint64_t> ids;
  std::vector<double> floats;
  size_t request_ids = 0;  // how many leading ids are not storage ids (a CALL's request id)

  bool need(size_t n) const { return n <= size - pos; }

  bool read_be(size_t n, uint64_t* out) {
    if (!need(n)) return false;
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v = (v << 8) | data[pos + i];
    pos += n;
    *out = v;
    return true;
  }

  bool skip(uint64_t n) {
    if (n > size - pos) return false;
    pos += static_cast<size_t>(n);
    return true;
  }

  // An ext value whose header starts at pending_header, whose type byte is at pos and payload has len bytes.
  bool ext(uint64_t len) {
    if (!need(1)) return false;
    uint8_t type = data[pos];
    pos += 1;
    if (len > size - pos) return false;
    if (type == kExtInlineTensor) return false;
    if (type != kExtTensor) {
      pos += static_cast<size_t>(len);
      return true;
    }
    // [storage_id, dtype, sizes, strides, offset, storage_nbytes]: a fixarray of 6 led by an unsigned id.
    const uint8_t* p = data + pos;
    if (len < 2 || p[0] != (genie_msgpack::kFixArray | genie_wire::kDescriptorItems)) return false;
    uint64_t id;
    genie_msgpack::Reader id_reader(p + 1, static_cast<size_t>(len) - 1);
    if (!id_reader.uint(&id) || id > kMaxId) return false;
    size_t id_len = static_cast<size_t>(len) - 1 - id_reader.left();
    if (ids.size() >= kMaxTensors) return false;
    ids.push_back(id);
    // The key: everything before this ext's header as is, then marker, the rest's length, the rest.
    size_t header_at = pending_header;
    key.append(reinterpret_cast<const char*>(data + copied), header_at - copied);
    uint64_t rest = len - 1 - id_len;
    key.push_back(static_cast<char>(kMarker));
    key.push_back(static_cast<char>(kExtTensor));
    for (int shift = 24; shift >= 0; shift -= 8) key.push_back(static_cast<char>((rest >> shift) & 0xff));
    key.append(reinterpret_cast<const char*>(p + 1 + id_len), static_cast<size_t>(rest));
    pos += static_cast<size_t>(len);
    copied = pos;
    return true;
  }

  size_t pending_header = 0;  // where the ext being walked starts (its header's first byte)

  bool value(int depth) {
    if (depth > kMaxDepth || !need(1)) return false;
    size_t start = pos;
    uint8_t b = data[pos++];
    uint64_t n;
    if (b <= kPositiveFixintMax || b >= kNegativeFixintMin || b == kNil || b == kFalse || b == kTrue) return true;
    if ((b & 0xf0) == kFixMap) return items(2 * uint64_t(b & 0x0f), depth);
    if ((b & 0xf0) == kFixArray) return items(b & 0x0f, depth);
    if ((b & 0xe0) == kFixStr) return skip(b & 0x1f);
    switch (b) {
      case kBin8: return read_be(1, &n) && skip(n);
      case kBin16: return read_be(2, &n) && skip(n);
      case kBin32: return read_be(4, &n) && skip(n);
      case kExt8: pending_header = start; return read_be(1, &n) && ext(n);
      case kExt16: pending_header = start; return read_be(2, &n) && ext(n);
      case kExt32: pending_header = start; return read_be(4, &n) && ext(n);
      case kFloat32: return take_float(start, 4);
      case kFloat64: return take_float(start, 8);
      case kUint8: case kInt8: return skip(1);
      case kUint16: case kInt16: return skip(2);
      case kUint32: case kInt32: return skip(4);
      case kUint64: case kInt64: return skip(8);
      case kFixExt1: pending_header = start; return ext(1);
      case kFixExt2: pending_header = start; return ext(2);
      case kFixExt4: pending_header = start; return ext(4);
      case kFixExt8: pending_header = start; return ext(8);
      case kFixExt16: pending_header = start; return ext(16);
      case kStr8: return read_be(1, &n) && skip(n);
      case kStr16: return read_be(2, &n) && skip(n);
      case kStr32: return read_be(4, &n) && skip(n);
      case kArray16: return read_be(2, &n) && items(n, depth);
      case kArray32: return read_be(4, &n) && items(n, depth);
      case kMap16: return read_be(2, &n) && items(2 * n, depth);
      case kMap32: return read_be(4, &n) && items(2 * n, depth);
      default: return false;  // kNeverUsed
    }
  }

  // A float32 (n = 4) or float64 (n = 8) whose type byte is at start: its value to floats, its type to the key.
  bool take_float(size_t start, size_t n) {
    uint64_t bits;
    if (floats.size() >= kMaxFloats || !read_be(n, &bits)) return false;
    if (n == 4) {
      uint32_t narrow = static_cast<uint32_t>(bits);
      float f;
      std::memcpy(&f, &narrow, sizeof f);
      floats.push_back(static_cast<double>(f));
    } else {
      double d;
      std::memcpy(&d, &bits, sizeof d);
      floats.push_back(d);
    }
    key.append(reinterpret_cast<const char*>(data + copied), start - copied);
    key.push_back(static_cast<char>(kMarker));
    key.push_back(static_cast<char>(data[start]));
    copied = pos;
    return true;
  }

  // An unsigned int taken out of the key like a storage id (a CALL's request id and output storage ids).
  bool blank_uint() {
    if (!need(1)) return false;
    size_t start = pos;
    uint64_t v;
    genie_msgpack::Reader r(data + pos, size - pos);
    if (!r.uint(&v) || v > kMaxId) return false;
    pos = size - r.left();
    if (ids.size() >= kMaxTensors) return false;
    ids.push_back(v);
    key.append(reinterpret_cast<const char*>(data + copied), start - copied);
    key.push_back(static_cast<char>(kMarker));
    key.push_back(0);
    copied = pos;
    return true;
  }

  // [CMD_CALL, req, device, op, args, kwargs, [out storage ids]] after its first two bytes: req and the
  // output ids are taken out too (a request id changes with every call).
  bool call_command() {
    pos = 2;
    if (!blank_uint()) return false;
    request_ids = 1;  // the first id is the request's, not a storage's
    for (int i = 0; i < 4; ++i)
      if (!value(1)) return false;
    uint64_t n;
    genie_msgpack::Reader r(data + pos, size - pos);
    if (!r.array_header(&n)) return false;
    pos = size - r.left();
    if (n > size - pos) return false;
    for (uint64_t i = 0; i < n; ++i)
      if (!blank_uint()) return false;
    return true;
  }

  bool items(uint64_t count, int depth) {
    // Every item takes at least one byte: a count beyond what is left is malformed (and bounds the loop).
    if (count > size - pos) return false;
    for (uint64_t i = 0; i < count; ++i)
      if (!value(depth + 1)) return false;
    return true;
  }
};


// A command's key and ids (see the top of this file); false when it cannot be keyed.
inline bool key_of(const uint8_t* data, size_t size, std::string* key_out, std::vector<uint64_t>* ids_out,
                   std::vector<double>* floats_out) {
  Walker w;
  w.data = data;
  w.size = size;
  w.key.reserve(size + 16);
  // A CALL (a fixarray of 7 led by CMD_CALL, 5) has its request and output ids taken out as well.
  bool call = starts_as(data, size, genie_wire::kCmdCallItems, genie_wire::kCmdCall);
  if (!(call ? w.call_command() : w.value(0)) || w.pos != w.size) return false;
  w.key.append(reinterpret_cast<const char*>(w.data + w.copied), w.size - w.copied);
  // The aliasing pattern: per id, 0xffff for storage 0, 0xfffe for a request id, else the index of the
  // first storage id equal to it.
  w.key.push_back(static_cast<char>(kMarker));
  size_t count = w.ids.size();
  for (size_t i = 0; i < count; ++i) {
    size_t first = 0xffff;
    if (i < w.request_ids) {
      first = 0xfffe;  // a request id: never part of the aliasing pattern
    } else if (w.ids[i] != 0) {
      first = i;
      for (size_t j = w.request_ids; j < i; ++j)
        if (w.ids[j] == w.ids[i]) {
          first = j;
          break;
        }
    }
    w.key.push_back(static_cast<char>((first >> 8) & 0xff));
    w.key.push_back(static_cast<char>(first & 0xff));
  }
  key_out->swap(w.key);
  ids_out->swap(w.ids);
  floats_out->swap(w.floats);
  return true;
}

}  // namespace genie_keys
