"""``genie serve`` as a bare data-plane server (superseded by the cluster runtime's ``genie serve``
in :mod:`genie.cli.node`; kept only until that lands). The implementation lives in
:mod:`genie.server.__main__` (``python -m genie.server``)."""

from __future__ import annotations

from typing import Any

from genie.server.__main__ import add_arguments, serve


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve this host's devices on the data plane")
    add_arguments(p)
    p.set_defaults(func=serve)
