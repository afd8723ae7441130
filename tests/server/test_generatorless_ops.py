"""Allow-listed random ops without a generator argument draw from the session's generator when a client names them.

The genie client decomposes dropout, attention and the ``rand`` family before they reach the wire; a raw client
(or a compiled graph) may still send them by name. Run as they are, their kernels would draw from the worker
process's generator: unseeded by CMD_SEED and shared by every session of that process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genie.errors import ForbiddenOpError
from genie.server import rng
from genie.server.allowlist import is_allowed
from genie.server.ops import registered_op_names
from tests.raw_client import Dev, RawClient, T, desc, op, seed

X = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0))
Q = torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(1))
MASK = torch.rand(8, 8, generator=torch.Generator().manual_seed(2)) > 0.3
BOOLS = torch.empty(X.shape, dtype=torch.bool)

#: name, args (T(1) is X, T(2) is Q, T(3) is MASK), kwargs, output descriptors (their likes), storage to compare
#: (the first output's)
CASES: list[tuple[str, list[Any], dict[str, Any], list[tuple[int, torch.Tensor]]]] = [
    ("aten::dropout", [T(1, X), 0.5, True], {}, [(10, X)]),
    ("aten::dropout_", [T(1, X), 0.5, True], {}, [(1, X)]),
    ("aten::alpha_dropout", [T(1, X), 0.5, True], {}, [(10, X)]),
    ("aten::alpha_dropout_.default", [T(1, X), 0.5, True], {}, [(1, X)]),
    ("aten::feature_alpha_dropout", [T(1, X), 0.5, True], {}, [(10, X)]),
    ("aten::feature_alpha_dropout_", [T(1, X), 0.5, True], {}, [(1, X)]),
    ("aten::native_dropout.out", [T(1, X), 0.5, True], {"out0": T(10, X), "out1": T(11, BOOLS)},
     [(10, X), (11, BOOLS)]),
    ("aten::scaled_dot_product_attention", [T(2, Q), T(2, Q), T(2, Q), T(3, MASK), 0.5], {}, [(10, Q)]),
    ("aten::rand", [[64]], {"device": Dev(0)}, [(10, torch.empty(64))]),
    ("aten::randn_like", [T(1, X)], {}, [(10, X)]),
    ("aten::randint.low", [0, 1000, [64]], {"device": Dev(0)}, [(10, torch.empty(64, dtype=torch.long))]),
    ("aten::randperm", [64], {"device": Dev(0)}, [(10, torch.empty(64, dtype=torch.long))]),
]


def _draw(c: RawClient, session_seed: int, name: str, args: list[Any], kwargs: dict[str, Any],
          outs: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    c.send_batch([seed(0, 0, session_seed), op(name, args, kwargs, [desc(sid, like) for sid, like in outs])],
                 uploads=[(1, 0, X), (2, 0, Q), (3, 0, MASK)])
    sid, like = outs[0]
    got = c.fetch(sid, like)
    assert c.sync().error is None
    return got


@pytest.fixture
def sessions(genie_serve, raw_clients):
    return lambda: raw_clients(genie_serve.port)


@pytest.mark.parametrize(("name", "args", "kwargs", "outs"), CASES, ids=[c[0] for c in CASES])
def test_generatorless_op_draws_from_the_sessions_generator(sessions, name, args, kwargs, outs):
    a, b, other = sessions(), sessions(), sessions()
    drawn_a = _draw(a, 3, name, args, kwargs, outs)
    drawn_b = _draw(b, 3, name, args, kwargs, outs)
    drawn_other = _draw(other, 4, name, args, kwargs, outs)
    assert torch.equal(drawn_a, drawn_b), f"{name}: two sessions seeded alike drew differently"
    assert not torch.equal(drawn_a, drawn_other), f"{name}: sessions seeded differently drew alike"


def _local(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


LOCAL = [
    ("aten::dropout", [X, 0.3, True], {}),
    ("aten::dropout_", [X, 0.3, True], {}),
    ("aten::alpha_dropout", [X, 0.3, True], {}),
    ("aten::feature_alpha_dropout_", [X, 0.3, True], {}),
    ("aten::feature_dropout", [X, 0.3, True], {}),
    ("aten::native_dropout.out", [X, 0.3, True], {"out0": torch.empty_like(X), "out1": torch.empty_like(BOOLS)}),
    ("aten::scaled_dot_product_attention", [Q, Q, Q, MASK, 0.4], {}),
    ("aten::scaled_dot_product_attention", [Q, Q, Q, None, 0.4, True], {"scale": 0.7}),
    ("aten::rand.out", [[3, 4]], {"out": torch.empty(3, 4)}),
    ("aten::randn", [[3, 4]], {}),
    ("aten::randint", [10, [3, 4]], {}),
    ("aten::rand_like", [X], {}),
    ("aten::randint_like", [X, 10], {}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), LOCAL, ids=[f"{c[0]}-{i}" for i, c in enumerate(LOCAL)])
def test_equivalent_gives_a_local_cpu_runs_numbers(name, args, kwargs):
    """The equivalent is the op's own composite with the generator handed down: on CPU a local run's numbers."""
    torch.manual_seed(5)
    expected = _local(name)(*map(_copy, args), **{k: _copy(v) for k, v in kwargs.items()})
    torch.manual_seed(99)  # the process's generator elsewhere: the equivalent must not read it
    got = rng.GENERATORLESS[name](torch.Generator().manual_seed(5), list(map(_copy, args)),
                                  {k: _copy(v) for k, v in kwargs.items()})
    expected, got = (r if isinstance(r, tuple) else (r,) for r in (expected, got))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


def test_no_draw_without_dropout_or_training():
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    assert torch.equal(rng.GENERATORLESS["aten::dropout"](g, [X, 0.5, False], {}), X)
    rng.GENERATORLESS["aten::scaled_dot_product_attention"](g, [Q, Q, Q, MASK, 0.0], {})
    assert torch.equal(g.get_state(), state)
    assert not rng.draws("aten::scaled_dot_product_attention", [Q, Q, Q, None, 0.0], {})
    assert rng.draws("aten::scaled_dot_product_attention", [Q, Q, Q, None, 0.1], {})


def test_every_allowed_random_op_without_a_generator_has_an_equivalent():
    """An allow-list addition of such an op fails here until it draws from the session's generator."""
    # The CPU flash kernel refuses dropout_p > 0 and so draws nothing (tests/device/test_attention_dropout.py).
    exempt = {"aten::_scaled_dot_product_flash_attention_for_cpu"}
    missing = []
    for name in sorted(registered_op_names()):
        if not name.startswith("aten::") or not is_allowed(name) or name in exempt:
            continue
        try:
            overload = _local(name)
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.nondeterministic_seeded in overload.tags and not rng.generator_arg(overload)[1] \
                and name not in rng.GENERATORLESS:
            missing.append(name)
    assert missing == []


def test_a_kernel_that_would_draw_from_the_process_generator_is_refused():
    run = rng._under_session(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    with pytest.raises(ForbiddenOpError, match="shared generator"):
        run(torch.Generator(), [Q, Q, Q, 0.5], {})
