"""``genie discover`` as a real process, and a third-party plugin found through its entry point.

The third-party plugin is built here from its own pyproject.toml and installed with
pip into a temporary ``--target`` directory that only the child processes see
(PYTHONPATH), so the real importlib-metadata entry-point discovery finds it and
nothing is left in the virtual environment. Its backend is a fake named
``fakenet``; it moves no data.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKENET_INIT = '''
"""genie-fakenet: a fake third-party transport plugin for genie's tests (moves no data)."""

from genie import hookimpl
from genie.transport.base import Transport
from genie.types import Figure, ProbeResult


class FakenetTransport(Transport):
    """A fake backend with a high priority: always available, never connects."""

    name = "fakenet"
    default_priority = 900

    async def probe(self, target):
        return ProbeResult("fakenet", True, "ok", "fake third-party backend", 900,
                           {"latency": Figure(0.5, "us", measured=False)})

    def connect(self, host, port, *, timeout):
        raise OSError("fakenet is fake")

    def listen(self, host, port):
        raise OSError("fakenet is fake")


@hookimpl
def genie_transports():
    return [FakenetTransport]
'''

FAKENET_PYPROJECT = '''
[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[project]
name = "genie-fakenet"
version = "0.0.1"
description = "A fake third-party genie transport plugin (tests only)."
dependencies = ["genie==0.1.0"]

[project.entry-points.genie]
fakenet = "genie_fakenet"

[tool.hatch.build.targets.wheel]
packages = ["src/genie_fakenet"]
'''


def run_genie(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genie.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def fakenet_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the installed fake third-party plugin (for PYTHONPATH)."""
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("hatchling is not installed in this environment (pip install hatchling), "
                    "so the out-of-tree plugin cannot be built offline")
    root = tmp_path_factory.mktemp("fakenet")
    package = root / "genie-fakenet" / "src" / "genie_fakenet"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKENET_INIT))
    (root / "genie-fakenet" / "pyproject.toml").write_text(textwrap.dedent(FAKENET_PYPROJECT))
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(root / "genie-fakenet")],
        check=True, capture_output=True, timeout=120,
    )
    assert list(site.glob("genie_fakenet-0.0.1.dist-info/entry_points.txt"))
    return site


def test_discover_json_marks_every_figure_measured_or_declared(isolated_capability_cache):
    proc = run_genie("discover", "--json", env={"GENIE_CACHE_DIR": str(isolated_capability_cache)})
    doc = json.loads(proc.stdout)
    assert doc["backends"], proc.stderr
    for row in doc["backends"]:
        assert row["reason_code"]
        assert all(isinstance(f["measured"], bool) for f in row["figures"].values())
    assert proc.returncode == (0 if doc["selected"] else 1)
    if doc["selected"]:
        assert doc["selected"] == doc["candidates"][0]


def test_third_party_plugin_is_discovered_ranked_and_chosen(fakenet_site, isolated_capability_cache):
    env = {"PYTHONPATH": str(fakenet_site), "GENIE_CACHE_DIR": str(isolated_capability_cache)}
    doc = json.loads(run_genie("discover", "--json", env=env).stdout)
    rows = {r["name"]: r for r in doc["backends"]}
    assert rows["fakenet"]["available"] and rows["fakenet"]["priority"] == 900
    assert doc["selected"] == "fakenet" and doc["candidates"][0] == "fakenet"
    table = run_genie("discover", env=env).stdout
    assert "BACKEND" in table and "would choose fakenet" in table
    assert "latency=0.5 us (declared)" in table


def test_third_party_plugin_shows_in_genie_plugins(fakenet_site, isolated_capability_cache):
    env = {"PYTHONPATH": str(fakenet_site), "GENIE_CACHE_DIR": str(isolated_capability_cache)}
    doc = json.loads(run_genie("plugins", env=env).stdout)
    record = next(p for p in doc["plugins"] if p["name"] == "fakenet")
    assert record["distribution"] == "genie-fakenet" and record["version"] == "0.0.1"
    assert record["transports"]["fakenet"]["reason_code"] == "ok"


def test_an_explicit_backend_that_cannot_be_met_exits_1_with_every_reason(fakenet_site, isolated_capability_cache):
    env = {"PYTHONPATH": str(fakenet_site), "GENIE_CACHE_DIR": str(isolated_capability_cache),
           "GENIE_PLUGINS": "fakenet", "GENIE_BACKEND": "fakenet"}
    doc = json.loads(run_genie("discover", "--json", "--backend", "^fakenet", env=env).stdout)
    assert doc["selected"] is None
    assert "fakenet: excluded" in doc["error"]
    proc = run_genie("discover", "--backend", "nosuchnet", env=env)
    assert proc.returncode == 1 and "invalid value 'nosuchnet' for option 'backend'" in proc.stderr
