"""Each test starts without the shared EAL memo and with its own capability cache directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from genie_dpdk import eal


@pytest.fixture(autouse=True)
def fresh_probe_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("GENIE_CACHE_DIR", str(tmp_path / "genie-cache"))
    monkeypatch.delenv("GENIE_DPDK_EAL_ARGS", raising=False)
    monkeypatch.delenv("GENIE_DPDK_LIB_DIR", raising=False)
    eal.forget_report()
    yield
    eal.forget_report()
