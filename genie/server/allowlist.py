"""The op allow-list: which registered aten/prims ops a client may run (genie/server/allowed_ops.txt).

The data file lists op names, one a line, grouped under ``#`` comments that say
why each group is there (core ATen IR; variants of core ops; ops the model,
training and OpInfo suites send; reviewed private ops). An entry is an exact
registered name (``aten::add.Tensor``; a default overload is written without a
suffix, ``aten::mm``) or a whole packet, ``aten::add.*`` (every overload of
``aten::add``). Anything else resolves to :class:`~genie.errors.ForbiddenOpError`
naming the op and how to ask for it (:func:`refusal`).

``scripts/allowed-ops`` regenerates the file's suite groups from recordings
(``GENIE_RECORD_OPS``, see :mod:`genie.server.ops`); each addition is reviewed
before it is committed. A test checks every entry still names a registered op
of the pinned torch, so a rename is noticed.
"""

from __future__ import annotations

import functools
from pathlib import Path

#: The data file beside this module.
ALLOWED_OPS_FILE = Path(__file__).with_name("allowed_ops.txt")

#: Where a refused op's message sends people who need it.
HOW_TO_ASK = ("if a model needs it, open an issue naming the op and the model: ops are added to "
              "genie/server/allowed_ops.txt after review")


def parse(text: str) -> tuple[frozenset[str], frozenset[str]]:
    """(exact names, packet names) from allow-list text; ``#`` starts a comment."""
    exact: set[str] = set()
    packets: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if " " in line or "::" not in line:
            raise ValueError(f"allowed_ops.txt line {number}: {raw!r} is not an op name like 'aten::add.Tensor'")
        if line.endswith(".*"):
            packets.add(line[:-2])
        else:
            exact.add(line[: -len(".default")] if line.endswith(".default") else line)
    return frozenset(exact), frozenset(packets)


@functools.cache
def entries() -> tuple[frozenset[str], frozenset[str]]:
    """The parsed data file (read once per process)."""
    return parse(ALLOWED_OPS_FILE.read_text(encoding="utf-8"))


def is_allowed(registered: str) -> bool:
    """Whether a registered op name (``aten::mm``, ``aten::add.Tensor``) is on the allow-list."""
    exact, packets = entries()
    return registered in exact or registered.split(".", 1)[0] in packets


def refusal(name: str) -> str:
    """The message for an op that is registered but not allowed."""
    return f"op {name!r} is not on this server's allow-list of reviewed ops; {HOW_TO_ASK}"
