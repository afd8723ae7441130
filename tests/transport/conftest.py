"""Every transport test gets its own capability cache directory (never the user's)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_capability_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "genie-cache"
    monkeypatch.setenv("GENIE_CACHE_DIR", str(directory))
    monkeypatch.delenv("GENIE_CAPABILITY_CACHE", raising=False)
    monkeypatch.delenv("GENIE_BACKEND", raising=False)
    return directory
