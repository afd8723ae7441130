"""Test sessions: one per plugin (core + that plugin only), the whole suite, and lint.

Each plugin session installs the core (``-e .``, which needs genie-tcp: ``pip install
genie`` must give a working system) and that one plugin, then runs the plugin's own
tests. Passing there proves the core never needs any other plugin.

    nox -s dpdk          # installs Debian's DPDK first when root (scripts/install-system-deps)
    nox -s tests         # the whole suite with every plugin
    nox -s lint          # ruff on everything, mypy on [tool.mypy] files (genie, plugins, tests, ...)
    nox -s opinfo        # PyTorch's OpInfo sweep against a real server, every case (a few minutes)
    nox -s ray           # genie-ray on a real local Ray cluster, inside a private network namespace (root)

torch is pinned to 2.13.0: other versions pull several GB of CUDA packages.
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.sessions = ["lint", "tcp", "shm", "dpdk", "gpudev", "rdma", "nvml"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
# The core builds genie._C against the session's torch: torch first, then --no-build-isolation.
CORE = ("--no-build-isolation", "-e", ".[test]", "-e", "plugins/genie_tcp")
BUILD = (TORCH, "setuptools>=70.1", "hatchling>=1.24", "editables>=0.5", "cffi>=1.15", "ninja>=1.11")  # hatchling: the plugins build with it; cffi: the dpdk shim; ninja: genie._C's files side by side
PLUGINS = ("tcp", "shm", "dpdk", "gpudev", "rdma", "nvml")
#: Plugins a plugin depends on (installed from this repository, not from an index).
PLUGIN_DEPENDS = {"gpudev": ("dpdk",)}
#: Python packages installed with --no-deps for a plugin (NIXL would otherwise pull another torch and GBs of
#: CUDA), and what they need in their place.
NO_DEPS = {"rdma": ("nixl-cu12==1.5.1",)}
NO_DEPS_NEEDS = {"rdma": ("numpy",)}
#: Debian packages (scripts/install-system-deps groups) a plugin's real probe paths need.
SYSTEM_DEPS = {"dpdk": "dpdk", "gpudev": "dpdk", "rdma": "rdma"}


def install_system_deps(session: nox.Session, group: str) -> None:
    """Run scripts/install-system-deps for ``group`` when root; say plainly what is skipped otherwise."""
    if not shutil.which("apt-get"):
        session.warn(f"no apt-get here: the {group} system packages are not installed; tests needing them skip")
        return
    if os.geteuid() != 0:
        session.warn(f"not root: not installing the {group} system packages; tests needing them skip "
                     "with the reason (run scripts/install-system-deps as root)")
        return
    session.run("scripts/install-system-deps", group, external=True)


def plugin_session(session: nox.Session, plugin: str) -> None:
    """Core + one plugin (+ the plugins it depends on), then that plugin's tests."""
    if plugin in SYSTEM_DEPS:
        install_system_deps(session, SYSTEM_DEPS[plugin])
    extra = [arg for dep in PLUGIN_DEPENDS.get(plugin, ()) for arg in ("-e", f"plugins/genie_{dep}")]
    if plugin != "tcp":  # CORE already has genie-tcp
        extra += ["-e", f"plugins/genie_{plugin}"]
    session.install(*BUILD)
    session.install(*CORE, *extra, *NO_DEPS_NEEDS.get(plugin, ()))
    if plugin in NO_DEPS:
        session.install("--no-deps", *NO_DEPS[plugin])
    # Entry points of other plugins must not leak in from elsewhere.
    session.run("python", "-c", "import importlib.metadata as m; "
                "print('genie entry points:', sorted(e.name for e in m.entry_points(group='genie')))")
    session.run("python", "-m", "pytest", "-q", f"plugins/genie_{plugin}/tests", *session.posargs)


@nox.session
def tcp(session: nox.Session) -> None:
    """genie + genie-tcp: the TCP transport's tests."""
    plugin_session(session, "tcp")


@nox.session
def shm(session: nox.Session) -> None:
    """genie + genie-shm: conformance on the rings, same-host checks, a real server end to end."""
    plugin_session(session, "shm")


@nox.session
def dpdk(session: nox.Session) -> None:
    """genie + genie-dpdk, with Debian's DPDK 22.11 so the real EAL success path runs."""
    plugin_session(session, "dpdk")


@nox.session
def gpudev(session: nox.Session) -> None:
    """genie + genie-gpudev (+ genie-dpdk, which it builds on): the absent-GPU path for real."""
    plugin_session(session, "gpudev")


@nox.session
def rdma(session: nox.Session) -> None:
    """genie + genie-rdma + NIXL (--no-deps): the data path over UCX tcp/shm, across namespaces when root."""
    plugin_session(session, "rdma")


@nox.session
def nvml(session: nox.Session) -> None:
    """genie + genie-nvml: GPU metrics and checks."""
    plugin_session(session, "nvml")


#: Ray for the genie-ray session: it does not depend on torch, so the pinned torch stays.
RAY = "ray[default]==2.60.0"


@nox.session
def ray(session: nox.Session) -> None:
    """genie + genie-ray + Ray: a real local Ray cluster of several raylets (ray.cluster_utils).

    Ray's processes reach for addresses off this machine (usage reports, DNS), so pytest runs
    inside a private network namespace with loopback only (``unshare -n``, root). Elsewhere the
    tests skip, saying so. Not in the default sessions: a few minutes on 2 cores.
    """
    session.install(*BUILD)
    session.install(*CORE, "-e", "plugins/genie_ray", RAY, TORCH)
    session.run("python", "-c", "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)")
    if os.geteuid() != 0 or not shutil.which("unshare"):
        session.warn("not root or no unshare: the Ray tests skip (they need a private network namespace)")
        session.run("python", "-m", "pytest", "-q", "plugins/genie_ray/tests", *session.posargs)
        return
    python = os.path.join(session.bin, "python")
    session.run("unshare", "-n", "sh", "-c",
                f'ip link set lo up && exec "{python}" -m pytest -q plugins/genie_ray/tests "$@"', "sh",
                *session.posargs, external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite with every plugin installed."""
    for group in sorted(set(SYSTEM_DEPS.values())):
        install_system_deps(session, group)
    plugins = [arg for p in PLUGINS for arg in ("-e", f"plugins/genie_{p}")]
    session.install(*BUILD)
    session.install("--no-build-isolation", "-e", ".[test]", *plugins, *(n for p in PLUGINS for n in NO_DEPS_NEEDS.get(p, ())))
    session.install("--no-deps", *(n for p in PLUGINS for n in NO_DEPS.get(p, ())))
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def opinfo(session: nox.Session) -> None:
    """PyTorch's OpInfo database on remote_accelerator against a real server, every case (GENIE_OPINFO=full).

    Prints the pass rate per dtype and kind and writes build/opinfo/report-full.json. Pass
    ``-- --update-expected`` to regenerate tests/device/opinfo/expected_failures.toml.
    """
    session.install(TORCH, *CORE)
    session.run("python", "-m", "pytest", "-q", "tests/device/opinfo", *session.posargs,
                env={"GENIE_OPINFO": "full"})


@nox.session
def completeness(session: nox.Session) -> None:
    """Issue 29's completeness gates in full: OpInfo (every dtype), ModuleInfo (float32 and float64),
    optim_db, random ops and AMP (tests/device/opinfo, GENIE_OPINFO=full), then the model zoo
    (tests/device/test_model_zoo.py). Prints the pass rate per gate, kind and dtype and writes
    build/opinfo/report-full.json; refusals are judged by tests/device/deny_list.toml.
    """
    session.install(BUILD[0], "setuptools>=70.1")
    session.install(*CORE)
    session.run("python", "-m", "pytest", "-q", "tests/device/opinfo", *session.posargs,
                env={"GENIE_OPINFO": "full"})
    session.run("python", "-m", "pytest", "-q", "tests/device/test_model_zoo.py", "--durations=10")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on everything, mypy on the files pyproject's [tool.mypy] names (genie, plugins, tests, benchmarks)."""
    session.install("ruff", "mypy", "types-psutil", *BUILD)
    session.install(*CORE)
    session.run("ruff", "check", ".")
    session.run("mypy")


@nox.session
def fuzz(session: nox.Session) -> None:
    """Coverage-guided fuzzing (atheris) of frames and handshakes against a live in-process server.

    ``nox -s fuzz`` runs three minutes; pass libFuzzer flags after ``--`` (``-max_total_time=600``, a corpus dir).
    """
    session.install(*BUILD)
    session.install(*CORE, "atheris")
    args = session.posargs or ["-max_total_time=180", "-print_final_stats=1"]
    session.run("python", "fuzz/fuzz_frames.py", *args)


@nox.session
def fuzz_ops(session: nox.Session) -> None:
    """The schema-driven op fuzzer (tests/security/fuzz_ops.py): every allowed op, edge-case arguments, a real server.

    ``nox -s fuzz_ops`` runs 15 minutes with a fresh seed; pass ``-- --seconds N --seed S --op NAME``.
    """
    session.install(TORCH, *CORE)
    args = session.posargs or ["--seconds", "900"]
    session.run("python", "-m", "tests.security.fuzz_ops", *args)
