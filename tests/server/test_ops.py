"""Op resolution and the deny list."""

from __future__ import annotations

import pytest
import torch

from genie.errors import ForbiddenOpError
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
