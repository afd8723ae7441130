"""The entry point cache (genie.plugin_cache): hits while nothing is installed, misses when something is.

Real distributions' metadata written into ``tmp_path`` (a ``*.dist-info`` with ``entry_points.txt``)
and put on ``sys.path``; a private ``GENIE_CACHE_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genie import plugin_cache

GROUP = "genie_cache_test"


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path to install distributions into, a private cache, and a count of real discoveries."""
    where = tmp_path / "site"
    where.mkdir()
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv("GENIE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GENIE_CAPABILITY_CACHE", raising=False)
    yield where


@pytest.fixture
def discoveries(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = plugin_cache._discover

    def counted(group: str) -> Any:
        calls.append(group)
        return real(group)

    monkeypatch.setattr(plugin_cache, "_discover", counted)
    return calls


def _install(site: Path, dist: str, version: str, points: dict[str, str]) -> Path:
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    return info


def _names(found: list[plugin_cache.CachedEntryPoint]) -> dict[str, tuple[str, str | None]]:
    return {ep.name: (ep.value, ep.dist.version if ep.dist else None) for ep in found}


def test_a_second_discovery_is_served_from_the_cache_and_loads_the_same(site: Path, discoveries: list[str]) -> None:
    _install(site, "alpha", "1.0", {"alpha": "json:dumps"})
    first = plugin_cache.entry_points(GROUP)
    second = plugin_cache.entry_points(GROUP)
    assert discoveries == [GROUP]
    assert _names(first) == _names(second) == {"alpha": ("json:dumps", "1.0")}
    assert second[0].load() is json.dumps
    assert (Path(os.environ["GENIE_CACHE_DIR"]) / plugin_cache.FILE_NAME).exists()


def test_installing_upgrading_or_rewriting_entry_points_invalidates(site: Path, discoveries: list[str]) -> None:
    alpha = _install(site, "alpha", "1.0", {"alpha": "json:dumps"})
    plugin_cache.entry_points(GROUP)
    _install(site, "beta", "2.0", {"beta": "json:loads"})  # installed: a new dist-info
    assert set(_names(plugin_cache.entry_points(GROUP))) == {"alpha", "beta"}
    alpha.rename(site / "alpha-1.1.dist-info")  # upgraded: the version is in the directory's name
    (site / "alpha-1.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: alpha\nVersion: 1.1\n")
    assert _names(plugin_cache.entry_points(GROUP))["alpha"] == ("json:dumps", "1.1")
    points = site / "alpha-1.1.dist-info" / "entry_points.txt"  # an editable reinstall rewrites it in place
    points.write_text(f"[{GROUP}]\nalpha = json:load\n")
    st = points.stat()
    os.utime(points, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert _names(plugin_cache.entry_points(GROUP))["alpha"] == ("json:load", "1.1")
    assert discoveries == [GROUP] * 4


def test_files_written_beside_the_distributions_keep_the_cache(site: Path, discoveries: list[str]) -> None:
    """A script's directory is on sys.path and gets logs and checkpoints: that is not an install."""
    _install(site, "alpha", "1.0", {"alpha": "json:dumps"})
    plugin_cache.entry_points(GROUP)
    (site / "train.log").write_text("step 1\n")
    (site / "ckpt").mkdir()
    assert _names(plugin_cache.entry_points(GROUP)) == {"alpha": ("json:dumps", "1.0")}
    assert discoveries == [GROUP]


def test_a_tampered_cache_is_not_used(site: Path, discoveries: list[str]) -> None:
    _install(site, "alpha", "1.0", {"alpha": "json:dumps"})
    plugin_cache.entry_points(GROUP)
    path = Path(os.environ["GENIE_CACHE_DIR"]) / plugin_cache.FILE_NAME
    data = json.loads(path.read_text())
    data["groups"][GROUP] = [["alpha", "os.system('true')", "alpha", "1.0"]]
    path.write_text(json.dumps(data))
    assert _names(plugin_cache.entry_points(GROUP)) == {"alpha": ("json:dumps", "1.0")}
    assert discoveries == [GROUP, GROUP]


def test_switched_off_it_reads_the_metadata_every_time(site: Path, discoveries: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENIE_CAPABILITY_CACHE", "0")
    _install(site, "alpha", "1.0", {"alpha": "json:dumps"})
    plugin_cache.entry_points(GROUP)
    plugin_cache.entry_points(GROUP)
    assert discoveries == [GROUP, GROUP]
    assert not (Path(os.environ["GENIE_CACHE_DIR"]) / plugin_cache.FILE_NAME).exists()
    assert str(site) in sys.path
