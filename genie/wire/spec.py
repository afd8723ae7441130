"""The wire spec: every number, prefix and layout both languages use, defined once.

Python imports these names (genie.wire.frame, values, messages, genie.transport.record); the C++ in
genie/csrc includes ``wire/wire_spec.h``, generated from this module and checked in::

    .venv/bin/python -m genie.wire.spec --header > genie/csrc/wire/wire_spec.h

tests/test_wire_spec.py regenerates the header and fails when the checked-in one differs. What the
numbers mean is described in docs/protocol.md, the one prose description of the protocol. This module
imports nothing from genie, so every layer may import it.
"""

from __future__ import annotations

import enum
import struct
import sys

# -- frames (genie.wire.frame) ---------------------------------------------------------------------

MAGIC = b"GN"
PROTOCOL_VERSION = 2
#: magic, protocol version, kind, body length, payload length (little-endian)
HEADER = struct.Struct("<2sBBIQ")
#: A body (msgpack) larger than this is refused before it is read.
MAX_BODY_BYTES = 16 << 20


class MsgKind(enum.IntEnum):
    """What a frame carries. Data plane 1-19, control plane 20-59."""

    HELLO = 1
    WELCOME = 2
    REJECT = 3
    BATCH = 10
    REPLY = 11
    GOODBYE = 12
    # control plane
    JOIN = 20
    JOINED = 21
    HEARTBEAT = 22
    HEARTBEAT_ACK = 23
    QUERY = 24
    QUERY_REPLY = 25
    SUBSCRIBE = 26
    EVENT = 27
    ERROR = 28
    # authentication, both planes (genie/wire/handshake.py); appended, numbers never reused
    CHALLENGE = 4
    AUTH = 5
    # a data-plane measurement (genie.cluster.linkfigures): an authenticated session's payload, sent back as it came
    ECHO = 6


# -- records (genie.transport.record: the control stream of shm, rdma and dpdk) --------------------

#: kind, length (little-endian)
RECORD = struct.Struct("<BQ")


class RecordKind(enum.IntEnum):
    """What a record carries."""

    INLINE = 1
    DATA = 2
    UPGRADE = 3
    UPGRADE_OK = 4
    UPGRADE_NO = 5


# -- commands (genie.wire.messages) ----------------------------------------------------------------

CMD_OP = 1
CMD_FREE = 3
CMD_FETCH = 4
CMD_CALL = 5
CMD_SYNC = 6
CMD_SEED = 7
CMD_RESIZE = 8
CMD_HAVE = 9
CMD_GRAPH = 10
CMD_REPLAY = 11
CMD_OPTIONS = 12
# torch.distributed on remote devices (genie.server.collectives): 40 and up, apart from the op stream's codes.
CMD_DIST_HOST = 40
CMD_DIST_JOIN = 41
CMD_COLLECTIVE = 42
CMD_DIST_WAIT = 43
CMD_DIST_LEAVE = 44
# Copies between remote devices (genie.server.peer_copy).
CMD_DEVICE_COPY = 50
CMD_PEER_OPEN = 51
CMD_PEER_RECV = 52
CMD_PEER_SEND = 53

#: The fields of the commands C++ builds or reads (a msgpack array of this many items, the code first).
COMMAND_FIELDS = {
    CMD_OP: ("code", "device", "op", "args", "kwargs", "outs"),
    CMD_FREE: ("code", "storage_ids"),
    CMD_CALL: ("code", "req", "device", "op", "args", "kwargs", "out_storage_ids"),
}

#: The keys of CMD_OPTIONS' map, each a bool; bit i of the native queue's option bits is the i-th.
SESSION_OPTIONS = ("deterministic", "warn_only")

#: A BATCH body's keys: uploads (their bytes are the payload, in order), content-cache hits, commands.
BATCH_UPLOADS = "uploads"
BATCH_CACHED = "cached"
BATCH_CMDS = "cmds"
#: A REPLY body: a msgpack array of these.
REPLY_FIELDS = ("req", "error", "result", "deferred")

# -- tagged values (genie.wire.values): msgpack extension codes ------------------------------------

EXT_DTYPE = 2
EXT_DEVICE = 3
EXT_LAYOUT = 4
EXT_MEMORY_FORMAT = 5
EXT_COMPLEX = 6
EXT_INLINE_TENSOR = 7
EXT_TENSOR = 8
EXT_GENERATOR = 9
#: Codes that must never be accepted again (EXT_HANDLE of protocol 1).
RETIRED_CODES = frozenset({1})

#: A tensor descriptor: a msgpack array of these (EXT_TENSOR's payload; a plain list in outs and replies).
DESCRIPTOR_FIELDS = ("storage_id", "dtype", "sizes", "strides", "storage_offset", "storage_nbytes")
#: Most dimensions of a descriptor (and of any shape on the wire).
MAX_DIMS = 64
#: Storage ids are 63-bit (0: an empty storage).
MAX_STORAGE_ID = (1 << 63) - 1


def is_int(value: object) -> bool:
    """True for a wire integer: an int that is not a bool (msgpack gives bools as ``bool``, a subclass of int)."""
    return isinstance(value, int) and not isinstance(value, bool)


# Code tables: the index is the wire code. Append only. Each entry: (torch's name, c10's enum name).
DTYPES_SPEC = (
    ("float32", "Float"), ("float64", "Double"), ("float16", "Half"), ("bfloat16", "BFloat16"),
    ("complex64", "ComplexFloat"), ("complex128", "ComplexDouble"), ("complex32", "ComplexHalf"),
    ("int8", "Char"), ("int16", "Short"), ("int32", "Int"), ("int64", "Long"), ("uint8", "Byte"),
    ("uint16", "UInt16"), ("uint32", "UInt32"), ("uint64", "UInt64"), ("bool", "Bool"),
    ("float8_e4m3fn", "Float8_e4m3fn"), ("float8_e5m2", "Float8_e5m2"), ("float8_e4m3fnuz", "Float8_e4m3fnuz"),
    ("float8_e5m2fnuz", "Float8_e5m2fnuz"), ("qint8", "QInt8"), ("quint8", "QUInt8"), ("qint32", "QInt32"),
)
LAYOUTS_SPEC = (
    ("strided", "Strided"), ("sparse_coo", "Sparse"), ("sparse_csr", "SparseCsr"), ("sparse_csc", "SparseCsc"),
    ("sparse_bsr", "SparseBsr"), ("sparse_bsc", "SparseBsc"), ("_mkldnn", "Mkldnn"), ("jagged", "Jagged"),
)
MEMORY_FORMATS_SPEC = (
    ("contiguous_format", "Contiguous"), ("channels_last", "ChannelsLast"), ("channels_last_3d", "ChannelsLast3d"),
    ("preserve_format", "Preserve"),
)
DTYPE_NAMES = tuple(name for name, _ in DTYPES_SPEC)
LAYOUT_NAMES = tuple(name for name, _ in LAYOUTS_SPEC)
MEMORY_FORMAT_NAMES = tuple(name for name, _ in MEMORY_FORMATS_SPEC)


# -- the C++ header ---------------------------------------------------------------------------------

def _c_string(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return '"' + "".join(chr(b) if 32 <= b < 127 and chr(b) not in '"\\' else f"\\x{b:02x}" for b in raw) + '"'


def _x_macro(name: str, table: tuple[tuple[str, str], ...]) -> list[str]:
    lines = [f"#define {name}(X) \\"]
    lines += [f"  X({code}, {c10}) /* {py} */ \\" for code, (py, c10) in enumerate(table)]
    return [*lines, ""]


def header() -> str:
    """The text of genie/csrc/wire/wire_spec.h."""
    if HEADER.format != "<2sBBIQ" or RECORD.format != "<BQ":
        raise AssertionError("the generator writes the header layouts field by field: teach it the new layout")
    out = [
        "// Generated by `python -m genie.wire.spec --header > genie/csrc/wire/wire_spec.h` from genie/wire/spec.py:",
        "// do not edit. tests/test_wire_spec.py fails when this file and the spec differ.",
        "#pragma once",
        "",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "namespace genie_wire {",
        "",
        "// Frames: magic, protocol version u8, kind u8, body length u32 LE, payload length u64 LE.",
        f"constexpr char kMagic[] = {_c_string(MAGIC)};",
        f"constexpr size_t kMagicBytes = {len(MAGIC)};",
        f"constexpr uint8_t kProtocolVersion = {PROTOCOL_VERSION};",
        f"constexpr size_t kHeaderBytes = {HEADER.size};",
        "constexpr size_t kHeaderVersionAt = 2;",
        "constexpr size_t kHeaderKindAt = 3;",
        "constexpr size_t kHeaderBodyLenAt = 4;",
        "constexpr size_t kHeaderBodyLenBytes = 4;",
        "constexpr size_t kHeaderPayloadLenAt = 8;",
        "constexpr size_t kHeaderPayloadLenBytes = 8;",
        f"constexpr uint64_t kMaxBodyBytes = {MAX_BODY_BYTES}ULL;",
        "",
        "// Frame kinds (genie.wire.spec.MsgKind).",
        *(f"constexpr uint8_t kKind{_camel(k.name)} = {int(k)};" for k in MsgKind),
        "",
        "// Records (genie.transport.record): kind u8, length u64 LE.",
        f"constexpr size_t kRecordBytes = {RECORD.size};",
        "constexpr size_t kRecordLenAt = 1;",
        "constexpr size_t kRecordLenBytes = 8;",
        *(f"constexpr uint8_t kRecord{_camel(k.name)} = {int(k)};" for k in RecordKind),
        "",
        "// Command codes.",
        *(f"constexpr uint8_t k{_camel(n)} = {v};" for n, v in _commands()),
        "// Items of the commands C++ builds or reads (a msgpack array, the code first).",
        *(f"constexpr size_t k{_camel(_command_name(code))}Items = {len(fields)};"
          for code, fields in COMMAND_FIELDS.items()),
        "",
        "// CMD_OPTIONS: bit i of a queue's option bits is SESSION_OPTIONS[i].",
        *(f"constexpr int kOption{_camel(n)} = {1 << i};" for i, n in enumerate(SESSION_OPTIONS)),
        "",
        "// BATCH body keys; REPLY body items.",
        f"constexpr char kBatchUploads[] = {_c_string(BATCH_UPLOADS)};",
        f"constexpr char kBatchCached[] = {_c_string(BATCH_CACHED)};",
        f"constexpr char kBatchCmds[] = {_c_string(BATCH_CMDS)};",
        f"constexpr size_t kReplyItems = {len(REPLY_FIELDS)};",
        "",
        "// msgpack extension codes of tagged values.",
        *(f"constexpr int8_t k{_camel(n)} = {v};" for n, v in _exts()),
        "",
        "// Tensor descriptors: [storage_id, dtype, sizes, strides, storage_offset, storage_nbytes].",
        f"constexpr size_t kDescriptorItems = {len(DESCRIPTOR_FIELDS)};",
        f"constexpr size_t kMaxDims = {MAX_DIMS};",
        f"constexpr uint64_t kMaxStorageId = {MAX_STORAGE_ID}ULL;",
        "",
        "// Code tables: X(wire code, c10 enum name), for c10::ScalarType, c10::Layout and c10::MemoryFormat.",
        *_x_macro("GENIE_WIRE_DTYPES", DTYPES_SPEC),
        *_x_macro("GENIE_WIRE_LAYOUTS", LAYOUTS_SPEC),
        *_x_macro("GENIE_WIRE_MEMORY_FORMATS", MEMORY_FORMATS_SPEC),
        "}  // namespace genie_wire",
        "",
    ]
    return "\n".join(out)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


def _commands() -> list[tuple[str, int]]:
    return [(n, v) for n, v in globals().items() if n.startswith("CMD_") and isinstance(v, int)]


def _command_name(code: int) -> str:
    return next(n for n, v in _commands() if v == code)


def _exts() -> list[tuple[str, int]]:
    return [(n, v) for n, v in globals().items() if n.startswith("EXT_") and isinstance(v, int)]


def main(argv: list[str]) -> int:
    if argv != ["--header"]:
        print("usage: python -m genie.wire.spec --header > genie/csrc/wire/wire_spec.h", file=sys.stderr)
        return 2
    sys.stdout.write(header())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
