"""Each test gets its own capability cache directory and no pyverbs interpreter override."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENIE_CACHE_DIR", str(tmp_path / "genie-cache"))
    monkeypatch.delenv("GENIE_PYVERBS_PYTHON", raising=False)
