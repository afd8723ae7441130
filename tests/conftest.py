"""Shared fixtures: real genie node processes on loopback, always stopped.

The kit itself (``wait_until``, ``refused_port``, ``LocalCluster`` and the ``genie_*`` fixtures)
is :mod:`genie.testing`, which third-party plugins use too; this file only adds this suite's own.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from genie.cluster.launch import NodeProcess
from genie.testing import refused_port, shared_server_devices, wait_until

__all__ = ["refused_port", "unused_port", "wait_until"]  # re-exported for the suite's modules

# The same examples every run: a property test that finds a slow or failing case finds it in every run
# (and in review), never only in the CI run that happened to draw it.
settings.register_profile("genie", derandomize=True)
settings.load_profile("genie")


#: Lines a worker's ``pytest_sessionfinish`` left in ``config.workeroutput`` for the summary (the opinfo gates').
SUMMARY_KEY = "genie_summary"  # written by tests/device/opinfo/conftest.py
_SUMMARY = pytest.StashKey[list[str]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``cpu_server`` tests are skipped when the shared server computes on a GPU: CUDA kernels round
    differently from CPU ones, and an out-of-range index is a device-side assert there, not an error."""
    devices = shared_server_devices()
    if "cuda" not in devices:
        return
    skip = pytest.mark.skip(reason=f"needs the shared server on CPU devices (GENIE_TEST_SERVER_DEVICES={devices})")
    for item in items:
        if item.get_closest_marker("cpu_server"):
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller: a worker ended
def pytest_testnodedown(node: Any, error: object) -> None:
    node.config.stash.setdefault(_SUMMARY, []).extend(node.workeroutput.get(SUMMARY_KEY, []))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The workers' summary lines (under pytest-xdist; a run without it prints its own)."""
    for line in config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _grad_mode_kept() -> Iterator[None]:
    """Each test starts with the grad mode it found. The server's executor switches grad off for its own
    thread (``Executor.run_batch``); the tests that drive an executor directly do so on pytest's thread, and
    every later test in that process would otherwise run without autograd."""
    import torch

    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


def unused_port() -> int:
    """A port found free and released, for the two places port 0 cannot serve.

    ``--metrics-port 0`` means "no metrics endpoint", so a metrics server cannot be asked for any
    free port (yet); and a command line that must name the master's port before the master runs
    (the README's two-machines commands). Everything else binds port 0 and reads the port back.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def cpu_server() -> Iterator[NodeProcess]:
    """A real `genie serve` process exposing two devices (remote_accelerator:0 and :1), on any free port.

    Two CPU devices, or the GPU twice under ``GENIE_TEST_SERVER_DEVICES=cuda:0,cuda:0`` (the name stays:
    most of the suite's modules ask for it).
    """
    with NodeProcess("serve", "--port", "0", "--devices", shared_server_devices(),
                     "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2") as server:
        yield server


@pytest.fixture(scope="module")
def remote(cpu_server: NodeProcess) -> Iterator[object]:
    """genie initialised against ``cpu_server`` for one test module (genie allows one init per process)."""
    import genie

    state = genie.init_sync(master_addr="127.0.0.1", master_port=cpu_server.control_port,
                            heartbeat_interval=0.2, heartbeat_timeout=2, timeout=20)
    try:
        yield state
    finally:
        genie.shutdown_sync()
