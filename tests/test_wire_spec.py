"""One wire spec for both languages (genie/wire/spec.py): the C++ header generated from it is the one
checked in, and bytes the C++ writes are the bytes Python writes and reads.

Python's side of the other seams is tested where it lives: genie._C_keys' walker on Python-encoded
commands (tests/server/test_plans.py), the lane's BATCH and its number replies against a real node
(tests/device/test_lane.py), the native plan runner's frames (tests/server/test_plans.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

from genie.wire import frame, messages, spec, values

HEADER_PATH = Path(__file__).resolve().parent.parent / "genie" / "csrc" / "wire" / "wire_spec.h"
D0 = "remote_accelerator:0"


def test_the_checked_in_header_is_generated_from_the_spec() -> None:
    generated = subprocess.run([sys.executable, "-m", "genie.wire.spec", "--header"], capture_output=True,
                               text=True, check=True, timeout=60).stdout
    assert generated == HEADER_PATH.read_text(), (
        "genie/csrc/wire/wire_spec.h differs from genie/wire/spec.py: regenerate it with "
        "`.venv/bin/python -m genie.wire.spec --header > genie/csrc/wire/wire_spec.h`, rebuild the extensions "
        "(pip install --no-build-isolation --no-deps -e .) and commit both")


def test_python_takes_every_number_from_the_spec() -> None:
    assert frame.MsgKind is spec.MsgKind and frame.HEADER is spec.HEADER and frame.MAGIC == spec.MAGIC
    assert values.DTYPE_NAMES is spec.DTYPE_NAMES and values.EXT_TENSOR == spec.EXT_TENSOR
    commands = {n: v for n, v in vars(spec).items() if n.startswith("CMD_")}
    assert {n: getattr(messages, n) for n in commands} == commands
    assert len(set(commands.values())) == len(commands), "two commands share a code"
    assert len({int(k) for k in spec.MsgKind}) == len(spec.MsgKind), "two frame kinds share a number"
    # Every name of the code tables is torch's (where this torch has it).
    assert all(getattr(torch, n, None) is None or isinstance(getattr(torch, n), torch.dtype) for n in spec.DTYPE_NAMES)
    assert values.MEMORY_FORMATS == [getattr(torch, n) for n in spec.MEMORY_FORMAT_NAMES]


def test_the_generator_refuses_other_arguments() -> None:
    assert spec.main([]) == 2


def test_the_extensions_refuse_numbers_other_than_the_ones_built_in() -> None:
    """An extension built from another spec than the Python it runs with says so instead of framing."""
    from genie import _C
    from genie._C_plans import Runner

    with pytest.raises(RuntimeError, match="wire_spec.h"):
        _C.set_dtype_code(torch.float32, values.dtype_code(torch.float64))
    _C.set_dtype_code(torch.float32, values.dtype_code(torch.float32))
    batch, reply, inline = int(spec.MsgKind.BATCH), int(spec.MsgKind.REPLY), int(spec.RecordKind.INLINE)
    with pytest.raises(ValueError, match="wire_spec.h"):
        _C.set_lane_wire(spec.PROTOCOL_VERSION, batch, reply, spec.CMD_FREE + 1, inline, spec.MAX_BODY_BYTES)
    with pytest.raises(ValueError, match="wire_spec.h"):
        Runner(1 << 16, 16).set_wire(spec.PROTOCOL_VERSION + 1, batch, reply, inline, spec.MAX_BODY_BYTES)


# -- through the built extensions, against a real node ------------------------------------------------

#: Python's reader of tagged values, resolving a tensor tag to its descriptor list as decoded.
_ext_hook = values.make_ext_hook(lambda desc: desc, lambda i: ("device", i), lambda g: ("generator", g))


@pytest.mark.usefixtures("remote")
def test_descriptors_cpp_writes_are_the_bytes_python_writes_for_every_dtype() -> None:
    """genie._C's descriptor (the c10 dtype table of wire_spec.h, msgpack.h's writer) against Python's
    encoding of the same list, byte for byte, and decoded by Python's reader."""
    from genie import _C

    base = torch.empty(4096, dtype=torch.uint8, device=D0)
    checked = 0
    for code, dtype in enumerate(values.DTYPES):
        if dtype is None or dtype.is_complex and dtype.itemsize < 8 or dtype in (torch.qint8, torch.quint8, torch.qint32):
            continue  # complex32 and the quantized dtypes make no remote tensors
        t = torch.empty(3, 5, dtype=dtype, device=D0)
        cases = [t, t.t(), t[1:, 2:], t[0, 0]]
        for case in cases:
            desc = _C.wire_desc(case)
            assert desc[1] == code == values.dtype_code(dtype), dtype
            payload = _C.wire_ext_payload(case)
            assert payload == msgpack.packb(desc), (dtype, desc)
            assert values.unpack_descriptor(payload) == desc
            # As an argument: the EXT_TENSOR tag Python packs decodes to the same descriptor.
            tag = msgpack.packb(values.tensor_ext(desc))
            assert msgpack.unpackb(tag, ext_hook=_ext_hook) == desc
        checked += 1
    assert checked >= 15
    # Sizes and strides past one byte, the 30-dimension descriptor of more than 255 bytes (ext 16).
    wide = base.as_strided([1] * 30, [2**40] * 30, 7)
    desc = _C.wire_desc(wide)
    assert len(_C.wire_ext_payload(wide)) > 255 and _C.wire_ext_payload(wide) == msgpack.packb(desc)


@pytest.mark.usefixtures("remote")
def test_commands_cpp_queues_are_the_bytes_python_writes_and_decode_with_pythons_reader() -> None:
    """Ops queued natively (fastpath.cpp: OP commands with a dtype, floats, ints, None, descriptors of
    every length) decoded by genie.wire's reader to the spec's codes and fields, and packed again by
    Python's msgpack to the very same bytes (C++ writes each value in the form Python writes it)."""
    from genie import _C
    from genie.device import registry

    x = torch.ones(2, 3, 4, 5, device=D0)
    w = torch.ones(40, device=D0)  # a 0-dim view of its 160 bytes: an 8-byte descriptor (fixext 8)
    conn = registry.table().devices[0].connection
    for round_ in range(3):  # Python's path teaches the signatures; the later rounds are queued natively
        conn.sync()
        # Held (it is reentrant), the session's lock keeps the runtime's idle flusher (try_flush, every 20 ms)
        # from sending the queue before the test takes it: on a loaded CI machine it once sent cumsum's command.
        with conn.lock:
            before = _C.fast_counts()[0]
            y = x.cumsum(1, dtype=torch.float64).add_(x, alpha=0.5)
            w[3].mul_(-200)
            m = x.amax(dim=[1, 3], keepdim=True)
            native = _C.fast_counts()[0] - before
            if round_ == 2:
                taken = _C.queue_take(conn.qid)
    assert native >= 4, "the signatures were not queued natively"
    assert taken, "nothing was queued natively"
    del y, m  # their commands were taken from the queue: the node never ran them
    decoded = [msgpack.unpackb(c, ext_hook=_ext_hook, raw=False) for c in taken]
    assert all(c[0] == spec.CMD_OP and len(c) == len(spec.COMMAND_FIELDS[spec.CMD_OP]) for c in decoded)
    ops = {c[2]: c for c in decoded}
    assert ops["aten::cumsum.out"][1] == 0 and ops["aten::cumsum.out"][4]["dtype"] == torch.float64
    add = ops["aten::add.out"]
    assert add[4]["alpha"] == 0.5
    assert [a[1] for a in add[3]] == [values.dtype_code(torch.float64), values.dtype_code(torch.float32)]
    assert ops["aten::amax.out"][3][1:] == [[1, 3], True]
    raw = [msgpack.unpackb(c, ext_hook=msgpack.ExtType, raw=False) for c in taken]
    assert [msgpack.packb(c, use_bin_type=True) for c in raw] == taken
    # Which descriptors take msgpack's fixext forms (1, 2, 4, 8 or 16 bytes) depends on the storage ids this
    # process has reached (w's is an 8-byte one early in a run, longer after other tests): the equality above
    # checks whichever forms were sent.
    w.zero_()  # the mul_ taken from the queue never ran: the node's bytes and the client's agree again
    conn.sync()


def _exts(value: object) -> list[msgpack.ExtType]:
    if isinstance(value, msgpack.ExtType):
        return [value]
    if isinstance(value, list):
        return [e for v in value for e in _exts(v)]
    if isinstance(value, dict):
        return [e for v in value.values() for e in _exts(v)]
    return []
