"""Op resolution, the deny list and the allow-list."""

from __future__ import annotations

import pytest
import torch

from genie.errors import ForbiddenOpError
from genie.server.allowlist import entries, is_allowed, parse
from genie.server.ops import DENY_LIST, deny_reason, registered_op_names, resolve_op


def _matches(entry: str) -> list[str]:
    names = registered_op_names()
    if entry.endswith("*"):
        return [n for n in names if n.startswith(entry[:-1])]
    return [n for n in names if n == entry]


@pytest.mark.parametrize("entry", sorted(DENY_LIST))
def test_every_deny_list_entry_names_a_registered_op(entry):
    """A torch upgrade that renames a denied op must fail here, not silently re-allow it."""
    assert _matches(entry), f"deny-list entry {entry!r} matches no op registered in torch {torch.__version__}"


@pytest.mark.parametrize("entry", sorted(DENY_LIST))
def test_every_deny_list_entry_is_refused_with_its_reason(entry):
    assert DENY_LIST[entry].strip()
    for name in _matches(entry):
        with pytest.raises(ForbiddenOpError, match="refused by genie servers"):
            resolve_op(name)


@pytest.mark.parametrize("name", [
    "aten::from_file", "aten::_print", "aten::set_.source_Storage", "aten::_assert_async.msg",
    "aten::_cufft_clear_plan_cache", "aten::pin_memory", "aten::_pin_memory", "aten::record_stream",
])
def test_named_dangerous_ops_are_denied(name):
    assert deny_reason(name)
    with pytest.raises(ForbiddenOpError):
        resolve_op(name + ".default" if "." not in name else name)
    with pytest.raises(ForbiddenOpError):
        resolve_op(name)


def test_allowed_ops_resolve_to_overloads():
    assert resolve_op("aten::add.Tensor") is torch.ops.aten.add.Tensor
    assert resolve_op("aten::mm") is torch.ops.aten.mm.default
    assert resolve_op("aten::mm.default") is torch.ops.aten.mm.default
    assert resolve_op(torch.ops.aten.add.Tensor.name()) is torch.ops.aten.add.Tensor
    assert resolve_op("aten::set_.source_Tensor") is torch.ops.aten.set_.source_Tensor


@pytest.mark.parametrize("name", ["os::system", "builtins.eval", "eval", "torch.load", "aten.add.Tensor",
                                  "quantized::add", "profiler::_record_function_enter", "aten::add.Tensor; rm",
                                  "aten::__class__", "aten::add.__dict__", "", "aten::" + "x" * 300])
def test_names_outside_aten_and_prims_or_malformed_are_refused(name):
    with pytest.raises(ForbiddenOpError):
        resolve_op(name)


@pytest.mark.parametrize("name", ["aten::save", "aten::load", "aten::system", "prims::nonexistent"])
def test_unregistered_names_are_refused_naming_torch_version(name):
    with pytest.raises(ForbiddenOpError, match="not a registered torch op"):
        resolve_op(name)


@pytest.mark.parametrize("value", [None, 3, b"aten::add.Tensor", ["aten::add.Tensor"]])
def test_non_string_names_are_refused(value):
    with pytest.raises(ForbiddenOpError, match="must be a string"):
        resolve_op(value)


# -- the allow-list (genie/server/allowed_ops.txt) ------------------------------------------------------


def _allow_entries() -> list[str]:
    exact, packets = entries()
    return sorted(exact) + sorted(p + ".*" for p in packets)


@pytest.mark.parametrize("entry", _allow_entries())
def test_every_allow_list_entry_names_a_registered_op(entry):
    """A torch upgrade that renames or drops an allowed op must fail here, not leave a stale entry."""
    names = registered_op_names()
    if entry.endswith(".*"):
        assert any(n == entry[:-2] or n.startswith(entry[:-1]) for n in names), \
            f"allow-list packet {entry!r} has no op registered in torch {torch.__version__}"
    else:
        assert entry in names, f"allow-list entry {entry!r} is not registered in torch {torch.__version__}"


def test_allow_list_keeps_denied_ops_out():
    for name in registered_op_names():
        if deny_reason(name):
            with pytest.raises(ForbiddenOpError, match="refused by genie servers"):
                resolve_op(name)


def test_private_ops_are_listed_one_packet_at_a_time():
    """No wildcard reaches private ops wholesale: each ``_`` packet is its own reviewed line."""
    exact, packets = entries()
    assert all("*" not in p for p in packets)
    assert {"aten::_fused_adamw_", "aten::_foreach_add_", "aten::_softmax"} <= packets
    assert "aten::_foreach_copy_" not in packets and "aten::_stack" not in packets


@pytest.mark.parametrize("name", ["aten::_stack", "aten::_efficientzerotensor", "aten::quantize_per_channel",
                                  "aten::_sobol_engine_draw",
                                  "aten::_foreach_copy_", "aten::_nested_tensor_from_mask_left_aligned"])
def test_unlisted_ops_are_forbidden_naming_the_op_and_how_to_ask(name):
    assert not is_allowed(name)
    with pytest.raises(ForbiddenOpError, match=r"not on this server's allow-list.*open an issue"):
        resolve_op(name)


@pytest.mark.parametrize("name", ["aten::add.Tensor", "aten::add.out", "aten::add_.Tensor", "aten::mm",
                                  "aten::addmm.out", "aten::_softmax.out", "aten::_fused_adamw_",
                                  "aten::native_layer_norm", "aten::scaled_dot_product_attention",
                                  "aten::repeat_interleave.self_int"])
def test_ops_models_use_are_allowed(name):
    assert is_allowed(name)
    resolve_op(name)


def test_allow_list_parser_rejects_malformed_lines_and_reads_comments():
    exact, packets = parse("# group\naten::mm.default  # why\naten::add.*\n\n")
    assert exact == {"aten::mm"} and packets == {"aten::add"}
    with pytest.raises(ValueError, match="line 1"):
        parse("add Tensor\n")
