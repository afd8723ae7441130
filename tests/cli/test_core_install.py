"""``genie status`` and ``genie dashboard`` on the core install: a fresh venv with `pip install genie` only.

The venv is real: built with ``python -m venv`` and ``pip install`` of this repository (its
``genie-tcp`` dependency from plugins/, torch==2.13.0 from the local wheel pip is configured
with; the build requirements are installed first and the build is not isolated, so torch is installed
once); no test extras, no ``--no-deps``. Slow (about half a minute): marked ``slow``.

pip builds a local directory in place (``build/`` inside it), and setuptools skips an extension
whose built file is newer than all its sources. So the repository is copied to a temporary
directory (sources only, their times kept) with the extensions ``pip install -e .`` already
compiled here placed where the wheel build looks for them (their times kept too): the wheel is
built from the same sources and metadata, without compiling the C++ a second time (that took
minutes of a 2-core CI run). Where a source is newer than the extension built from it, setuptools
compiles it again, as for any stale build. The copy also keeps this test out of the working
tree's ``build/``, which a concurrent ``pip install -e .`` writes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from genie.cluster.launch import NodeProcess

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

#: Not sources: what builds, installs and tools leave in the repository (at any depth).
_GENERATED = {".git", ".venv", ".nox", ".whl", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache",
              ".pytest_cache", ".hypothesis"}


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in _GENERATED or n.endswith((".egg-info", ".so"))}


def _staged_source(dest: Path) -> Path:
    """This repository's sources copied to ``dest`` (times kept), with ``build/lib.<platform>/genie/``
    holding the extensions built in place here, where setuptools finds them up to date."""
    shutil.copytree(ROOT, dest, ignore=_ignore, symlinks=True)
    build_lib = dest / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "genie"
    build_lib.mkdir(parents=True)
    for built in (ROOT / "genie").glob("_C*.so"):
        shutil.copy2(built, build_lib / built.name)
    return dest


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = _staged_source(tmp_path_factory.mktemp("core-src") / "genie")
    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # --no-compile: no .pyc for all of torch up front (most of the install's CPU time); Python writes them on import.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    # The build requirements first, then no build isolation: an isolated build would install torch a second
    # time (into the build environment) only to compile genie._C against the same version. What ends up
    # installed is the same either way.
    done = subprocess.run([*pip, "torch==2.13.0", "setuptools>=70.1", "hatchling>=1.24"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    # genie pins genie-tcp==<same version>, which lives in this repository, not on an index.
    # GENIE_BUILD_NINJA=0: under ninja torch rebuilds every extension; setuptools' own check finds them up to date.
    done = subprocess.run([*pip, "--no-build-isolation", str(source / "plugins" / "genie_tcp"), str(source)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "GENIE_BUILD_NINJA": "0"})
    assert done.returncode == 0, done.stderr[-4000:]
    return venv


def test_the_core_install_has_no_test_tools(core_venv: Path) -> None:
    listed = subprocess.run([str(core_venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, timeout=120).stdout.lower()
    names = {line.split("==")[0].replace("_", "-") for line in listed.splitlines()}
    assert {"genie", "genie-tcp", "rich", "prometheus-client", "opentelemetry-exporter-prometheus"} <= names
    assert not {"pytest", "hypothesis", "genie-nvml", "genie-rdma"} & names


def test_genie_status_prints_tables_on_the_core_install(core_venv: Path) -> None:
    with NodeProcess("serve", "--port", "0", "--devices", "cpu") as master:
        result = subprocess.run([str(core_venv / "bin" / "genie"), "status", "--master",
                                 f"127.0.0.1:{master.control_port}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "1 nodes" in result.stdout and "devices (# is N of remote_accelerator:N)" in result.stdout
    assert "sessions" in result.stdout and "needs rich" not in result.stderr


def test_genie_dashboard_renders_on_the_core_install(core_venv: Path) -> None:
    script = ("from rich.console import Console\n"
              "from genie.cli.dashboard import Snapshot, render\n"
              "Console(width=120, record=True).print(render(Snapshot(master='m:1')))\n")
    result = subprocess.run([str(core_venv / "bin" / "python"), "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "waiting for the master at m:1" in result.stdout, result.stderr
