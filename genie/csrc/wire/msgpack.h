// msgpack for genie's C++: the few types the protocol uses (nil, bool, ints, floats, str, bin, array and map
// headers, ext), written as Python's msgpack packs the same values (the smallest form; use_bin_type) and read
// with every length checked against the bytes left (they come from the network). Header-only and torch-free:
// every extension and translation unit includes it instead of writing msgpack by hand.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace genie_msgpack {

// Type bytes (https://github.com/msgpack/msgpack/blob/master/spec.md#formats).
constexpr uint8_t kPositiveFixintMax = 0x7f;
constexpr uint8_t kFixMap = 0x80;      // | n, n < 16
constexpr uint8_t kFixArray = 0x90;    // | n, n < 16
constexpr uint8_t kFixStr = 0xa0;      // | n, n < 32
constexpr uint8_t kNil = 0xc0;
constexpr uint8_t kNeverUsed = 0xc1;
constexpr uint8_t kFalse = 0xc2;
constexpr uint8_t kTrue = 0xc3;
constexpr uint8_t kBin8 = 0xc4, kBin16 = 0xc5, kBin32 = 0xc6;
constexpr uint8_t kExt8 = 0xc7, kExt16 = 0xc8, kExt32 = 0xc9;
constexpr uint8_t kFloat32 = 0xca, kFloat64 = 0xcb;
constexpr uint8_t kUint8 = 0xcc, kUint16 = 0xcd, kUint32 = 0xce, kUint64 = 0xcf;
constexpr uint8_t kInt8 = 0xd0, kInt16 = 0xd1, kInt32 = 0xd2, kInt64 = 0xd3;
constexpr uint8_t kFixExt1 = 0xd4, kFixExt2 = 0xd5, kFixExt4 = 0xd6, kFixExt8 = 0xd7, kFixExt16 = 0xd8;
constexpr uint8_t kStr8 = 0xd9, kStr16 = 0xda, kStr32 = 0xdb;
constexpr uint8_t kArray16 = 0xdc, kArray32 = 0xdd;
constexpr uint8_t kMap16 = 0xde, kMap32 = 0xdf;
constexpr uint8_t kNegativeFixintMin = 0xe0;

// ---------------------------------------------------------------------------------------------
// Writing: each appends one value (or a container's header) to `out`.

// A type byte, then `x` big-endian in `bytes` bytes.
inline void pack_tagged(std::string& out, uint8_t tag, uint64_t x, int bytes) {
  out.push_back(static_cast<char>(tag));
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((x >> (8 * i)) & 0xff));
}

inline void pack_nil(std::string& out) { out.push_back(static_cast<char>(kNil)); }

inline void pack_bool(std::string& out, bool b) { out.push_back(static_cast<char>(b ? kTrue : kFalse)); }

inline void pack_uint(std::string& out, uint64_t v) {
  if (v <= kPositiveFixintMax) {
    out.push_back(static_cast<char>(v));
  } else if (v <= 0xff) {
    pack_tagged(out, kUint8, v, 1);
  } else if (v <= 0xffff) {
    pack_tagged(out, kUint16, v, 2);
  } else if (v <= 0xffffffffULL) {
    pack_tagged(out, kUint32, v, 4);
  } else {
    pack_tagged(out, kUint64, v, 8);
  }
}

inline void pack_int(std::string& out, int64_t v) {
  if (v >= 0) return pack_uint(out, static_cast<uint64_t>(v));
  if (v >= -32) {
    out.push_back(static_cast<char>(v));
    return;
  }
  auto bits = static_cast<uint64_t>(v);
  if (v >= INT8_MIN) pack_tagged(out, kInt8, bits, 1);
  else if (v >= INT16_MIN) pack_tagged(out, kInt16, bits, 2);
  else if (v >= INT32_MIN) pack_tagged(out, kInt32, bits, 4);
  else pack_tagged(out, kInt64, bits, 8);
}

inline void pack_double(std::string& out, double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  pack_tagged(out, kFloat64, bits, 8);
}

inline void pack_str_header(std::string& out, size_t n) {
  if (n < 32) {
    out.push_back(static_cast<char>(kFixStr | n));
  } else if (n <= 0xff) {
    pack_tagged(out, kStr8, n, 1);
  } else if (n <= 0xffff) {
    pack_tagged(out, kStr16, n, 2);
  } else {
    if (n > 0xffffffffULL) throw std::length_error("genie: a string too long for msgpack");
    pack_tagged(out, kStr32, n, 4);
  }
}

inline void pack_str(std::string& out, const char* s, size_t n) {
  pack_str_header(out, n);
  out.append(s, n);
}

inline void pack_str(std::string& out, const std::string& s) { pack_str(out, s.data(), s.size()); }

inline void pack_bin_header(std::string& out, size_t n) {
  if (n <= 0xff) {
    pack_tagged(out, kBin8, n, 1);
  } else if (n <= 0xffff) {
    pack_tagged(out, kBin16, n, 2);
  } else {
    if (n > 0xffffffffULL) throw std::length_error("genie: bytes too long for msgpack");
    pack_tagged(out, kBin32, n, 4);
  }
}

inline void pack_bin(std::string& out, const std::string& b) {
  pack_bin_header(out, b.size());
  out.append(b);
}

inline void pack_array_header(std::string& out, size_t n) {
  if (n < 16) {
    out.push_back(static_cast<char>(kFixArray | n));
  } else if (n <= 0xffff) {
    pack_tagged(out, kArray16, n, 2);
  } else {
    pack_tagged(out, kArray32, n, 4);
  }
}

inline void pack_map_header(std::string& out, size_t n) {
  if (n < 16) {
    out.push_back(static_cast<char>(kFixMap | n));
  } else if (n <= 0xffff) {
    pack_tagged(out, kMap16, n, 2);
  } else {
    pack_tagged(out, kMap32, n, 4);
  }
}

// An ext value's header (its `n` payload bytes follow): fixext for 1, 2, 4, 8 and 16 bytes, as Python packs.
inline void pack_ext_header(std::string& out, int8_t type, size_t n) {
  switch (n) {
    case 1: out.push_back(static_cast<char>(kFixExt1)); break;
    case 2: out.push_back(static_cast<char>(kFixExt2)); break;
    case 4: out.push_back(static_cast<char>(kFixExt4)); break;
    case 8: out.push_back(static_cast<char>(kFixExt8)); break;
    case 16: out.push_back(static_cast<char>(kFixExt16)); break;
    default:
      if (n <= 0xff) pack_tagged(out, kExt8, n, 1);
      else if (n <= 0xffff) pack_tagged(out, kExt16, n, 2);
      else pack_tagged(out, kExt32, n, 4);
  }
  out.push_back(static_cast<char>(type));
}

// ---------------------------------------------------------------------------------------------
// Reading: a cursor over bytes from the network. Every read checks what is left and returns false (the
// cursor where it was, or past a partly read value: the caller gives up on the whole input) when the next
// value is not of the asked type or runs past the end.

inline uint64_t read_be(const uint8_t* p, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v = (v << 8) | p[i];
  return v;
}

struct Reader {
  const uint8_t* p;
  const uint8_t* end;

  Reader(const void* data, size_t n) : p(static_cast<const uint8_t*>(data)), end(p + n) {}

  size_t left() const { return static_cast<size_t>(end - p); }
  bool at_end() const { return p == end; }
  // The next type byte (false at the end).
  bool peek(uint8_t* type) const {
    if (p >= end) return false;
    *type = *p;
    return true;
  }

  // The big-endian number of `bytes` bytes after the type byte, which is consumed with it.
  bool tagged(size_t bytes, uint64_t* v) {
    if (left() < 1 + bytes) return false;
    *v = read_be(p + 1, bytes);
    p += 1 + bytes;
    return true;
  }

  // Consumes `type` when the next byte is it.
  bool take(uint8_t type) {
    if (p >= end || *p != type) return false;
    ++p;
    return true;
  }

  bool nil() { return take(kNil); }

  bool boolean(bool* b) {
    if (p >= end || (*p != kTrue && *p != kFalse)) return false;
    *b = *p++ == kTrue;
    return true;
  }

  // A non-negative integer (positive fixint or uint 8 to 64).
  bool uint(uint64_t* v) {
    if (p >= end) return false;
    uint8_t t = *p;
    if (t <= kPositiveFixintMax) {
      *v = t;
      ++p;
      return true;
    }
    if (t < kUint8 || t > kUint64) return false;
    return tagged(size_t(1) << (t - kUint8), v);
  }

  // A negative fixint or int 8 to 64, sign-extended (non-negative forms: uint()).
  bool negative(int64_t* v) {
    if (p >= end) return false;
    uint8_t t = *p;
    if (t >= kNegativeFixintMin) {
      *v = static_cast<int8_t>(t);
      ++p;
      return true;
    }
    if (t < kInt8 || t > kInt64) return false;
    size_t width = size_t(1) << (t - kInt8);
    uint64_t raw;
    if (!tagged(width, &raw)) return false;
    int shift = static_cast<int>(64 - 8 * width);
    *v = static_cast<int64_t>(raw << shift) >> shift;
    return true;
  }

  // A float 32 or 64, as a double.
  bool real(double* d) {
    if (p >= end || (*p != kFloat32 && *p != kFloat64)) return false;
    uint64_t raw;
    if (*p == kFloat32) {
      if (!tagged(4, &raw)) return false;
      uint32_t bits = static_cast<uint32_t>(raw);
      float f;
      std::memcpy(&f, &bits, 4);
      *d = f;
    } else {
      if (!tagged(8, &raw)) return false;
      std::memcpy(d, &raw, 8);
    }
    return true;
  }

  // A container's header: its item count (a map's count is of pairs). The count is not checked against the
  // bytes left: each item takes at least one, so callers compare it with left().
  bool array_header(uint64_t* n) {
    if (p >= end) return false;
    uint8_t t = *p;
    if ((t & 0xf0) == kFixArray) {
      *n = t & 0x0f;
      ++p;
      return true;
    }
    if (t == kArray16) return tagged(2, n);
    if (t == kArray32) return tagged(4, n);
    return false;
  }

  bool map_header(uint64_t* n) {
    if (p >= end) return false;
    uint8_t t = *p;
    if ((t & 0xf0) == kFixMap) {
      *n = t & 0x0f;
      ++p;
      return true;
    }
    if (t == kMap16) return tagged(2, n);
    if (t == kMap32) return tagged(4, n);
    return false;
  }

  // A str's bytes (pointing into the input).
  bool str(const char** s, size_t* n) {
    if (p >= end) return false;
    uint8_t t = *p;
    uint64_t len;
    if ((t & 0xe0) == kFixStr) {
      len = t & 0x1f;
      ++p;
    } else if (t == kStr8 || t == kStr16 || t == kStr32) {
      if (!tagged(size_t(1) << (t - kStr8), &len)) return false;
    } else {
      return false;
    }
    return span(len, s, n);
  }

  // A bin's bytes (pointing into the input).
  bool bin(const char** b, size_t* n) {
    if (p >= end) return false;
    uint8_t t = *p;
    if (t != kBin8 && t != kBin16 && t != kBin32) return false;
    uint64_t len;
    if (!tagged(size_t(1) << (t - kBin8), &len)) return false;
    return span(len, b, n);
  }

  // An ext value: its type and payload (pointing into the input).
  bool ext(int8_t* type, const char** data, size_t* n) {
    if (p >= end) return false;
    uint8_t t = *p;
    uint64_t len;
    if (t >= kFixExt1 && t <= kFixExt16) {
      len = uint64_t(1) << (t - kFixExt1);
      ++p;
    } else if (t >= kExt8 && t <= kExt32) {
      if (!tagged(size_t(1) << (t - kExt8), &len)) return false;
    } else {
      return false;
    }
    if (p >= end) return false;
    *type = static_cast<int8_t>(*p++);
    return span(len, data, n);
  }

 private:
  bool span(uint64_t len, const char** s, size_t* n) {
    if (len > left()) return false;
    *s = reinterpret_cast<const char*>(p);
    *n = static_cast<size_t>(len);
    p += len;
    return true;
  }
};

}  // namespace genie_msgpack
