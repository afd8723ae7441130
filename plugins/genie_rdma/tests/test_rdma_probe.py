"""The rdma probe, for real through pyverbs, on a host without RDMA devices (this one and CI)."""

from __future__ import annotations

import os
import sys

import anyio
import pytest
from genie_rdma import verbs
from genie_rdma.transport import PRIORITY_RDMA, RdmaTransport, result_from_report

from genie.errors import BackendUnavailableError
from genie.plugins import PluginManager
from genie.transport.base import ProbeTarget
from genie.types import ProbeResult

interpreter, where = verbs.find_interpreter()
requires_pyverbs = pytest.mark.skipif(
    interpreter is None, reason=f"pyverbs not found ({where}): run scripts/install-system-deps "
                                "(apt install python3-pyverbs rdma-core)")
no_devices_here = pytest.mark.skipif(
    bool(os.listdir(verbs.SYSFS)) if os.path.isdir(verbs.SYSFS) else False,
    reason=f"{verbs.SYSFS} lists RDMA devices: the absent path is not what happens here")


def probe(timeout: float = 3.0) -> ProbeResult:
    async def body() -> ProbeResult:
        return await RdmaTransport().probe(ProbeTarget(timeout=timeout))

    return anyio.run(body)


@requires_pyverbs
@no_devices_here
def test_without_rdma_devices_pyverbs_reports_no_devices():
    result = probe()
    assert (result.available, result.reason_code) == (False, "no_devices"), result.reason
    assert result.reason.startswith("no RDMA devices")
    assert result.priority == PRIORITY_RDMA
    assert result.details["pyverbs"].endswith("pyverbs/__init__.py")


def test_an_interpreter_without_pyverbs_is_library_missing(monkeypatch):
    # This venv's own interpreter cannot import Debian's pyverbs (it does not see dist-packages).
    monkeypatch.setenv("GENIE_PYVERBS_PYTHON", sys.executable)
    if verbs.importlib.util.find_spec("pyverbs") is not None:
        pytest.skip("pyverbs is importable in this environment")
    result = probe()
    assert (result.available, result.reason_code) == (False, "library_missing")
    assert "apt install python3-pyverbs rdma-core" in result.reason
    assert "No module named 'pyverbs'" in result.reason


def test_no_interpreter_at_all_is_library_missing_without_a_subprocess(monkeypatch):
    monkeypatch.setattr(verbs, "find_interpreter", lambda: (None, "fake: nowhere"))
    result = probe()
    assert result.reason_code == "library_missing" and "fake: nowhere" in result.reason


def test_active_and_inactive_ports_are_told_apart():
    # Canned reports (fake devices): this host has no RDMA hardware to show either case for real.
    port = {"port": 1, "state": "PORT_DOWN", "active": False, "gid": "fe80::1", "link_layer": "Ethernet"}
    down = verbs.VerbsReport("done", devices=({"name": "fake_mlx5_0", "ports": [port]},))
    assert result_from_report(down, nixl=True, ucx_tls="").reason_code == "no_active_ports"
    up = verbs.VerbsReport("done", devices=({"name": "fake_mlx5_0", "ports": [dict(port, active=True)]},))
    result = result_from_report(up, nixl=True, ucx_tls="")
    assert (result.available, result.reason) == (True, "1 active port(s): fake_mlx5_0:1")
    assert result.details.get("data_path", True) is True
    without_nixl = result_from_report(up, nixl=False, ucx_tls="")
    assert without_nixl.details["data_path"] is False and "nixl-cu12" in without_nixl.details["data_path_note"]


def test_without_devices_ucx_tls_makes_nixl_over_ucx_available():
    none = verbs.VerbsReport("list", error="no devices")
    assert result_from_report(none, nixl=True, ucx_tls="").reason_code == "no_devices"
    assert "UCX_TLS" in result_from_report(none, nixl=True, ucx_tls="").reason
    over_tcp = result_from_report(none, nixl=True, ucx_tls="tcp")
    assert over_tcp.available and over_tcp.details["ucx_tls"] == "tcp"
    assert not over_tcp.figures  # nothing declared for UCX over tcp: only measurements may say how fast
    assert not result_from_report(none, nixl=False, ucx_tls="tcp").available


def test_the_fingerprint_lists_devices_and_pyverbs():
    fingerprint = RdmaTransport.host_fingerprint()
    assert set(fingerprint) >= {"interpreter", "pyverbs", "libibverbs", "devices", "ports"}


def test_connect_without_nixl_names_the_install_line(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_nixl(name, *args, **kwargs):
        if name.startswith("nixl_cu12"):
            raise ImportError("No module named 'nixl_cu12'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    with pytest.raises(BackendUnavailableError, match="pip install --no-deps nixl-cu12"):
        RdmaTransport().connect("127.0.0.1", 1, timeout=1.0)


def test_entry_point_registers_rdma():
    pm = PluginManager(environ={"GENIE_PLUGINS": "rdma"})
    assert pm.transports()["rdma"] is RdmaTransport
