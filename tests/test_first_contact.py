"""A fresh machine without DPDK's packages: the hardware suites skip, naming the fix, and nothing fails.

CI installs the system packages first (scripts/install-system-deps), so the rest of the suite
never sees a machine without them. This test runs the DPDK and gpudev plugin suites and the
plugin report's checks again, in a real pytest subprocess, as a newcomer's machine sees them:

- *no DPDK at all*: no ``librte_*`` in the searched directories (``GENIE_SYSTEM_LIBRARY_DIRS``
  empty, no ``LD_LIBRARY_PATH``) and the shim absent;
- *the runtime without libdpdk-dev*: the libraries where the system put them (if it did), the
  shim absent, as after ``apt install dpdk`` and an install of genie-dpdk that had no headers.

The shim is hidden by a ``sitecustomize`` whose file finder does not see ``genie_dpdk._shim``, as
after a build without libdpdk-dev (no spec, and ImportError on import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HIDE_SHIM = '''\
from importlib.machinery import FileFinder

_find_spec = FileFinder.find_spec


def _find_spec_without_shim(self, fullname, target=None):
    """genie_dpdk._shim was not built (no libdpdk-dev at install): no file, no spec."""
    if fullname == "genie_dpdk._shim":
        return None
    return _find_spec(self, fullname, target)


FileFinder.find_spec = _find_spec_without_shim
'''

SUITES = ["plugins/genie_dpdk", "plugins/genie_gpudev",
          "tests/test_plugins.py::test_plugins_reports_hardware_backends_unavailable_without_their_hardware"]


def run_suites(tmp_path: Path, *, hide_libraries: bool) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_SHIM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GENIE_"))}
    env.pop("LD_LIBRARY_PATH", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env["GENIE_CACHE_DIR"] = str(tmp_path / "cache")
    if hide_libraries:
        env["GENIE_SYSTEM_LIBRARY_DIRS"] = ""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:randomly", *SUITES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("hide_libraries", [True, False], ids=["no-dpdk-at-all", "runtime-without-libdpdk-dev"])
def test_dpdk_suites_skip_with_the_fix_on_a_machine_without_dpdk_packages(tmp_path: Path, hide_libraries: bool):
    done = run_suites(tmp_path, hide_libraries=hide_libraries)
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " failed" not in done.stdout and " error" not in done.stdout, tail
    assert "passed" in done.stdout and "skipped" in done.stdout, tail
    # Each skip names what to install.
    assert "apt install libdpdk-dev" in done.stdout, tail
    if hide_libraries:
        assert "install-system-deps" in done.stdout or "apt install dpdk" in done.stdout, tail
