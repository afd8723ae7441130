"""The plugin manager and the ``genie --version`` / ``genie plugins`` commands.

Entry-point tests use **fake plugins**: real ``*.dist-info`` directories written into
``tmp_path`` (METADATA and an ``entry_points.txt`` in group ``genie``) next to plugin
modules also written there, with ``tmp_path`` put on ``sys.path``. importlib_metadata
discovers them exactly as it discovers an installed distribution. Every fake
distribution, entry point and module is named ``fake_*`` so none can be mistaken for
a real plugin, and the installed plugins are kept out with ``GENIE_PLUGINS`` where a
test must see only its fakes.

The CLI tests run ``python -m genie.cli`` as real subprocesses with every ``GENIE_*``
variable of the calling environment removed and a fresh capability cache.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import attrs
import importlib_metadata
import pytest

from genie import hookimpl
from genie.config import ClusterConfig
from genie.errors import DuplicateTransportError, PluginError
from genie.plugins import ENTRY_POINT_GROUP, PluginManager
from genie.types import NodeInfo, NodeRole, ProbeResult

REPO = Path(__file__).resolve().parents[1]
KNOWN_PLUGINS = ("tcp", "dpdk", "gpudev", "rdma", "nvml")
BUILTIN = "genie.builtin"


def installed_plugins() -> set[str]:
    """Names of the ``genie`` entry points installed in this interpreter (the real plugins)."""
    return {ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}


# -- fake distributions ------------------------------------------------------------------------------


@attrs.define
class FakeSite:
    """A directory on ``sys.path`` holding fake distributions (dist-info) and their plugin modules."""

    root: Path

    def add(self, dist: str, entry_points: dict[str, str], modules: dict[str, str], version: str = "0.1.0") -> Path:
        """Write distribution ``dist`` with ``entry_points`` (name -> module) and ``modules`` (name -> source)."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        return info


def transport_module(*names: str) -> str:
    """Source of a fake plugin module offering transports called ``names``."""
    classes = "".join(f"class T{i}:\n    name = {name!r}\n\n" for i, name in enumerate(names))
    listed = ", ".join(f"T{i}" for i in range(len(names)))
    return f"from genie import hookimpl\n\n{classes}@hookimpl\ndef genie_transports():\n    return [{listed}]\n"


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh fake site on ``sys.path``; fake modules imported from it are forgotten afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield FakeSite(root)
    for name in set(sys.modules) - before:
        if name.startswith("fake_"):
            del sys.modules[name]


def only(*names: str) -> dict[str, str]:
    return {"GENIE_PLUGINS": ",".join(names)}


# -- loading through entry points -----------------------------------------------------------------


def test_fake_entry_point_is_discovered_registered_and_recorded(fake_site: FakeSite):
    fake_site.add("fake-alpha", {"fake_alpha": "fake_alpha_plugin"},
                  {"fake_alpha_plugin": transport_module("fake_alpha_wire")}, version="1.2.3")
    pm = PluginManager(environ=only("fake_alpha"))
    assert set(pm.records) == {BUILTIN, "fake_alpha"}
    record = pm.records["fake_alpha"]
    assert (record.name, record.distribution, record.version, record.builtin) == (
        "fake_alpha", "fake-alpha", "1.2.3", False)
    assert record.path == str(fake_site.root / "fake_alpha_plugin.py")
    assert list(pm.transports()) == ["fake_alpha_wire"]
    assert pm.transport_owners == {"fake_alpha_wire": "fake_alpha"}
    assert pm.hooks_of("fake_alpha") == ["genie_transports"]


def test_autoload_without_a_filter_loads_fakes_alongside_every_installed_plugin(fake_site: FakeSite):
    fake_site.add("fake-alpha", {"fake_alpha": "fake_alpha_plugin"},
                  {"fake_alpha_plugin": transport_module("fake_alpha_wire")})
    real = installed_plugins() - {"fake_alpha"}
    pm = PluginManager(environ={})
    assert set(pm.records) == {BUILTIN, "fake_alpha", *real}
    assert "fake_alpha_wire" in pm.transports()


def test_builtin_is_recorded_as_part_of_the_core(genie_pm: PluginManager):
    import genie

    record = genie_pm.records[BUILTIN]
    assert (record.distribution, record.version, record.builtin) == ("genie", genie.__version__, True)
    assert genie_pm.hooks_of(BUILTIN) == ["genie_event_sinks", "genie_health_checks", "genie_node_metrics"]


def test_loading_twice_is_harmless(fake_site: FakeSite):
    fake_site.add("fake-alpha", {"fake_alpha": "fake_alpha_plugin"},
                  {"fake_alpha_plugin": transport_module("fake_alpha_wire")})
    pm = PluginManager(environ=only("fake_alpha"))
    pm.load_entry_points(only={"fake_alpha"})
    assert set(pm.records) == {BUILTIN, "fake_alpha"}


def test_one_entry_point_name_from_two_distributions_is_an_error_naming_both(fake_site: FakeSite):
    # Skipping the second silently would let any distribution shadow (or be shadowed by) a plugin.
    fake_site.add("fake-twin-a", {"fake_twin": "fake_twin_a"}, {"fake_twin_a": transport_module("fake_a")})
    fake_site.add("fake-twin-b", {"fake_twin": "fake_twin_b"}, {"fake_twin_b": transport_module("fake_b")})
    with pytest.raises(PluginError) as info:
        PluginManager(environ=only("fake_twin"))
    message = str(info.value)
    assert "'fake_twin'" in message
    assert "fake-twin-a" in message and "fake-twin-b" in message


# -- duplicate transports -------------------------------------------------------------------------


def test_two_plugins_claiming_one_transport_name_raise_naming_both(fake_site: FakeSite):
    fake_site.add("fake-one", {"fake_one": "fake_one_plugin"}, {"fake_one_plugin": transport_module("fake_wire")})
    fake_site.add("fake-two", {"fake_two": "fake_two_plugin"},
                  {"fake_two_plugin": transport_module("fake_other", "fake_wire")})
    pm = PluginManager(environ=only("fake_one", "fake_two"))
    with pytest.raises(DuplicateTransportError) as info:
        pm.transports()
    message = str(info.value)
    assert "'fake_wire'" in message
    assert "'fake_one'" in message and "'fake_two'" in message
    assert isinstance(info.value, PluginError)


@pytest.mark.skipif("tcp" not in installed_plugins(), reason="genie-tcp is not installed")
def test_fake_plugin_claiming_tcp_clashes_with_genie_tcp(fake_site: FakeSite):
    fake_site.add("fake-tcp-clone", {"fake_tcp_clone": "fake_tcp_clone"}, {"fake_tcp_clone": transport_module("tcp")})
    pm = PluginManager(environ=only("tcp", "fake_tcp_clone"))
    with pytest.raises(DuplicateTransportError, match=r"'tcp'.*'(tcp|fake_tcp_clone)' and '(tcp|fake_tcp_clone)'"):
        pm.transports()


def test_transport_without_a_name_is_a_plugin_error(register_plugin, genie_pm: PluginManager):
    class Nameless:
        pass

    class Plugin:
        @hookimpl
        def genie_transports(self):
            return [Nameless]

    name = register_plugin(Plugin())
    with pytest.raises(PluginError, match=f"plugin {name!r} offers a transport .*Nameless.* without a name"):
        genie_pm.transports()


def test_transport_table_follows_register_and_unregister(register_plugin, genie_pm: PluginManager):
    class Wire:
        name = "fake_inline_wire"

    class Plugin:
        @hookimpl
        def genie_transports(self):
            return [Wire]

    assert genie_pm.transports() == {}
    name = register_plugin(Plugin())
    assert genie_pm.transports() == {"fake_inline_wire": Wire}
    genie_pm.unregister(name)
    assert genie_pm.transports() == {}


# -- import failures are never hidden ------------------------------------------------------------


def test_plugin_whose_import_raises_importerror_is_a_plugin_error_naming_it(fake_site: FakeSite):
    fake_site.add("fake-broken", {"fake_broken": "fake_broken_plugin"},
                  {"fake_broken_plugin": "import fake_no_such_native_library\n"})
    with pytest.raises(PluginError) as info:
        PluginManager(environ=only("fake_broken"))
    err = info.value
    message = str(err)
    assert "plugin 'fake_broken'" in message
    assert "fake-broken" in message  # the distribution to fix or uninstall
    assert "'fake_broken_plugin'" in message  # the entry point's target
    assert "fake_no_such_native_library" in message
    assert "GENIE_PLUGINS" in message
    assert isinstance(err.__cause__, ImportError)
    assert err.__cause__.name == "fake_no_such_native_library"
    assert not isinstance(err, DuplicateTransportError)


def test_plugin_whose_import_raises_anything_else_is_also_a_plugin_error(fake_site: FakeSite):
    fake_site.add("fake-crashy", {"fake_crashy": "fake_crashy_plugin"},
                  {"fake_crashy_plugin": "raise RuntimeError('fake boom at import')\n"})
    with pytest.raises(PluginError, match="fake boom at import") as info:
        PluginManager(environ=only("fake_crashy"))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_broken_plugin_left_out_with_genie_plugins_does_not_stop_the_others(fake_site: FakeSite):
    fake_site.add("fake-broken", {"fake_broken": "fake_broken_plugin"},
                  {"fake_broken_plugin": "import fake_no_such_native_library\n"})
    fake_site.add("fake-alpha", {"fake_alpha": "fake_alpha_plugin"},
                  {"fake_alpha_plugin": transport_module("fake_alpha_wire")})
    pm = PluginManager(environ=only("fake_alpha"))
    assert set(pm.records) == {BUILTIN, "fake_alpha"}


# -- GENIE_PLUGINS, GENIE_DISABLE_PLUGIN_AUTOLOAD -----------------------------------------------


@pytest.fixture
def three_fakes(fake_site: FakeSite) -> FakeSite:
    for x in ("a", "b", "c"):
        fake_site.add(f"fake-{x}", {f"fake_{x}": f"fake_{x}_plugin"},
                      {f"fake_{x}_plugin": transport_module(f"fake_{x}_wire")})
    return fake_site


def test_genie_plugins_loads_only_the_named_plugins(three_fakes: FakeSite, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="genie.plugins"):
        pm = PluginManager(environ={"GENIE_PLUGINS": " fake_a , fake_c "})
    assert set(pm.records) == {BUILTIN, "fake_a", "fake_c"}
    assert sorted(pm.transports()) == ["fake_a_wire", "fake_c_wire"]
    assert not [r for r in caplog.records if r.name == "genie.plugins"]


def test_genie_plugins_warns_about_names_not_installed(three_fakes: FakeSite, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="genie.plugins"):
        pm = PluginManager(environ={"GENIE_PLUGINS": "fake_a,fake_ghost,fake_phantom"})
    assert set(pm.records) == {BUILTIN, "fake_a"}
    warnings = [r for r in caplog.records if r.name == "genie.plugins" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not installed: fake_ghost, fake_phantom" in warnings[0].getMessage()
    assert "fake_a" not in warnings[0].getMessage()


def test_genie_plugins_is_read_from_os_environ(three_fakes: FakeSite, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GENIE_PLUGINS", "fake_b")
    monkeypatch.delenv("GENIE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    assert set(PluginManager().records) == {BUILTIN, "fake_b"}


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_disable_plugin_autoload_leaves_only_builtins(three_fakes: FakeSite, value: str):
    pm = PluginManager(environ={"GENIE_DISABLE_PLUGIN_AUTOLOAD": value, "GENIE_PLUGINS": "fake_a"})
    assert set(pm.records) == {BUILTIN}
    assert pm.transports() == {}


def test_disable_plugin_autoload_from_os_environ_skips_even_a_broken_plugin(
    fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch
):
    fake_site.add("fake-broken", {"fake_broken": "fake_broken_plugin"},
                  {"fake_broken_plugin": "import fake_no_such_native_library\n"})
    monkeypatch.setenv("GENIE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert set(PluginManager().records) == {BUILTIN}
    assert "fake_broken_plugin" not in sys.modules


@pytest.mark.parametrize("value", ["", "0"])
def test_autoload_stays_on_when_the_variable_is_empty_or_zero(three_fakes: FakeSite, value: str):
    pm = PluginManager(environ={"GENIE_DISABLE_PLUGIN_AUTOLOAD": value, "GENIE_PLUGINS": "fake_a"})
    assert "fake_a" in pm.records


def test_autoload_argument_overrides_the_environment(three_fakes: FakeSite):
    assert set(PluginManager(autoload=False, environ={}).records) == {BUILTIN}
    on = PluginManager(autoload=True, environ={"GENIE_DISABLE_PLUGIN_AUTOLOAD": "1", "GENIE_PLUGINS": "fake_c"})
    assert set(on.records) == {BUILTIN, "fake_c"}


# -- GENIE_TRACE_PLUGINS -----------------------------------------------------------------------------


class SinkPlugin:
    """An inline plugin offering one event sink."""

    @hookimpl
    def genie_event_sinks(self):
        return ["fake-sink"]


def test_trace_plugins_logs_every_hook_call_on_the_trace_logger(caplog: pytest.LogCaptureFixture):
    pm = PluginManager(environ={"GENIE_TRACE_PLUGINS": "1", "GENIE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    pm.register(SinkPlugin(), name="fake_sink_plugin")
    with caplog.at_level(logging.DEBUG, logger="genie.plugins.trace"):
        sinks = pm.event_sinks()
    assert "fake-sink" in sinks
    traced = [r.getMessage() for r in caplog.records if r.name == "genie.plugins.trace"]
    assert any("genie_event_sinks" in m for m in traced), traced
    assert any("finish genie_event_sinks" in m and "fake-sink" in m for m in traced), traced
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "genie.plugins.trace")


class EveryHookPlugin:
    """An inline plugin implementing all five hooks, one of them failing."""

    @hookimpl
    def genie_transports(self):
        return []

    @hookimpl
    def genie_backend_priority(self, result):
        return None

    @hookimpl
    def genie_node_metrics(self, node):
        raise RuntimeError("sensor gone")

    @hookimpl
    def genie_health_checks(self):
        return []

    @hookimpl
    def genie_event_sinks(self):
        return []


def test_trace_plugins_traces_all_five_hooks_each_through_pluggy(caplog: pytest.LogCaptureFixture):
    pm = PluginManager(environ={"GENIE_TRACE_PLUGINS": "1", "GENIE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    pm.register(EveryHookPlugin(), name="every_hook")
    node = NodeInfo("n1", "host", NodeRole.WORKER)
    with caplog.at_level(logging.DEBUG, logger="genie.plugins.trace"):
        pm.transports()
        pm.backend_priority(result=probe_result(), config=ClusterConfig.from_sources({}))
        fragments = pm.node_metrics(node=node)
        pm.health_checks()
        pm.event_sinks()
    traced = " ".join(r.getMessage() for r in caplog.records if r.name == "genie.plugins.trace")
    for hook in ("genie_transports", "genie_backend_priority", "genie_node_metrics", "genie_health_checks",
                 "genie_event_sinks"):
        assert f"finish {hook} -->" in traced, (hook, traced)
    # the failing plugin costs only its own fragment; the built-in's host figures still come
    assert {"errors": {"every_hook": "RuntimeError: sensor gone"}} in fragments
    assert any("host" in f for f in fragments)


@pytest.mark.parametrize("environ", [{}, {"GENIE_TRACE_PLUGINS": "0"}, {"GENIE_TRACE_PLUGINS": ""}])
def test_no_trace_without_genie_trace_plugins(caplog: pytest.LogCaptureFixture, environ: dict[str, str]):
    pm = PluginManager(environ={**environ, "GENIE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    pm.register(SinkPlugin(), name="fake_sink_plugin")
    with caplog.at_level(logging.DEBUG, logger="genie.plugins.trace"):
        pm.event_sinks()
    assert not [r for r in caplog.records if r.name == "genie.plugins.trace"]


# -- typed hook calls --------------------------------------------------------------------------------


def probe_result() -> ProbeResult:
    return ProbeResult("fake_wire", True, priority=150)


def test_backend_priority_is_none_without_an_opinion(register_plugin, genie_pm: PluginManager):
    config = ClusterConfig.from_sources({})
    assert genie_pm.backend_priority(result=probe_result(), config=config) is None

    class Silent:
        @hookimpl
        def genie_backend_priority(self, result, config):
            return None

    register_plugin(Silent())
    assert genie_pm.backend_priority(result=probe_result(), config=config) is None


def test_backend_priority_is_firstresult_and_stops_at_the_first_answer(register_plugin, genie_pm: PluginManager):
    calls: list[str] = []

    class Late:
        @hookimpl(trylast=True)
        def genie_backend_priority(self, result, config):
            calls.append("late")
            return 1

    class Silent:
        @hookimpl
        def genie_backend_priority(self, result, config):
            calls.append("silent")
            return None

    class Boost:
        @hookimpl(tryfirst=True)
        def genie_backend_priority(self, result, config):
            calls.append("boost")
            return result.priority + 1000 if config.backend.text == "auto" else None

    for plugin in (Late(), Silent(), Boost()):
        register_plugin(plugin)
    config = ClusterConfig.from_sources({})
    assert genie_pm.backend_priority(result=probe_result(), config=config) == 1150
    assert calls == ["boost"]
    calls.clear()
    assert genie_pm.backend_priority(result=probe_result(), config=config.replace(backend="tcp")) == 1
    assert calls == ["boost", "silent", "late"]


def test_typed_wrappers_take_keyword_arguments_only(genie_pm: PluginManager):
    with pytest.raises(TypeError):
        genie_pm.backend_priority(probe_result(), ClusterConfig.from_sources({}))  # type: ignore[misc]


def test_node_metrics_collects_fragments_and_drops_empty_ones(register_plugin, genie_pm: PluginManager):
    genie_pm.unregister(BUILTIN)  # host metrics measure the real machine; this test pins the merging only
    seen: list[Any] = []

    class Gpus:
        @hookimpl
        def genie_node_metrics(self, node):
            seen.append(node)
            return {"gpus": [{"index": 0}]}

    class Nothing:
        @hookimpl
        def genie_node_metrics(self, node):
            return None

    class Empty:
        @hookimpl
        def genie_node_metrics(self, node):
            return {}

    for plugin in (Gpus(), Nothing(), Empty()):
        register_plugin(plugin)
    node = NodeInfo("n1", "host", NodeRole.WORKER)
    assert genie_pm.node_metrics(node=node) == [{"gpus": [{"index": 0}]}]
    assert seen == [node]


def test_node_metrics_include_the_builtin_host_fragment(genie_pm: PluginManager):
    fragments = genie_pm.node_metrics(node=NodeInfo("n1", "host", NodeRole.WORKER))
    assert any("host" in f for f in fragments)


def test_health_checks_and_event_sinks_are_flattened_across_plugins(register_plugin, genie_pm: PluginManager):
    from genie.builtin import LoggingEventSink

    class Many:
        @hookimpl
        def genie_health_checks(self):
            return ["fake-check-1", "fake-check-2"]

        @hookimpl
        def genie_event_sinks(self):
            return ["fake-sink-1"]

    class Nothing:
        @hookimpl
        def genie_health_checks(self):
            return None

        @hookimpl
        def genie_event_sinks(self):
            return []

    name = register_plugin(Many())
    register_plugin(Nothing())
    checks = genie_pm.health_checks()
    assert checks[-2:] == ["fake-check-1", "fake-check-2"] or checks[:2] == ["fake-check-1", "fake-check-2"]
    assert {type(c).__name__ for c in checks if not isinstance(c, str)} == {"MemoryPressureCheck", "DiskSpaceCheck"}
    sinks = genie_pm.event_sinks()
    assert "fake-sink-1" in sinks
    assert sum(isinstance(s, LoggingEventSink) for s in sinks) == 1
    assert len(sinks) == 2
    assert genie_pm.hooks_of(name) == ["genie_event_sinks", "genie_health_checks"]


def test_register_plugin_fixture_records_inline_plugins(register_plugin, genie_pm: PluginManager):
    name = register_plugin(SinkPlugin(), name="fake_inline")
    assert name == "fake_inline"
    record = genie_pm.records[name]
    assert (record.distribution, record.version, record.builtin) == ("", "", False)
    assert genie_pm.hooks_of(name) == ["genie_event_sinks"]


# -- genie --version / genie plugins as processes ------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m genie.cli ARGS`` with no inherited GENIE_* variable (plus ``env``).

    A fresh capability cache directory each time, so every probe runs for real.
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}
    with tempfile.TemporaryDirectory(prefix="genie-cache-") as cache:
        return subprocess.run([sys.executable, "-m", "genie.cli", *args], capture_output=True, text=True,
                              env={**clean, "GENIE_CACHE_DIR": cache, **(env or {})}, timeout=timeout, cwd=REPO,
                              check=False)


def test_version_lists_the_core_and_each_installed_plugin_with_version_and_path():
    import genie

    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"genie {genie.__version__} at {Path(genie.__file__).parent}"
    plugin_lines = lines[1:]
    by_name = {ep.name: ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert len(plugin_lines) == len(by_name)
    for name, ep in sorted(by_name.items()):
        prefix = f"  plugin {name}: {ep.dist.name} {ep.dist.version} at "
        [line] = [line for line in plugin_lines if line.startswith(prefix)]
        path = Path(line[len(prefix):])
        assert path.is_file()
        assert path.name == "__init__.py" and path.parent.name == ep.value.split(":")[0].split(".")[0]


def test_version_with_genie_plugins_lists_only_those():
    proc = run_cli("--version", env={"GENIE_PLUGINS": "tcp"})
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines()[1:]] == (
        ["  plugin tcp"] if "tcp" in installed_plugins() else [])


def test_version_with_a_broken_plugin_fails_naming_it(fake_site: FakeSite):
    fake_site.add("fake-broken", {"fake_broken": "fake_broken_plugin"},
                  {"fake_broken_plugin": "import fake_no_such_native_library\n"})
    proc = run_cli("--version", env={"PYTHONPATH": str(fake_site.root), "GENIE_PLUGINS": "fake_broken"})
    assert proc.returncode == 1
    assert "plugin 'fake_broken'" in proc.stderr and "fake-broken" in proc.stderr
    assert "fake_no_such_native_library" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def plugins_json() -> dict[str, Any]:
    proc = run_cli("plugins", "--timeout", "20")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plugins_lists_the_builtin_and_every_installed_plugin(plugins_json: dict[str, Any]):
    entries = {p["name"]: p for p in plugins_json["plugins"]}
    assert set(entries) == {BUILTIN, *installed_plugins()}
    assert entries[BUILTIN]["builtin"] is True
    for name in installed_plugins():
        entry = entries[name]
        assert entry["builtin"] is False
        assert entry["distribution"] == f"genie-{name}" if name in KNOWN_PLUGINS else entry["distribution"]
        assert entry["version"] == "0.1.0" if name in KNOWN_PLUGINS else entry["version"]
        assert Path(entry["path"]).is_file()
        assert entry["hooks"], f"{name} implements no hook"


def test_plugins_shows_all_five_plugins_of_this_repository(plugins_json: dict[str, Any]):
    missing = set(KNOWN_PLUGINS) - installed_plugins()
    if missing:
        pytest.skip(f"not installed here: {', '.join(sorted(missing))} (nox -s tests installs all five)")
    entries = {p["name"]: p for p in plugins_json["plugins"]}
    assert set(KNOWN_PLUGINS) <= set(entries)
    assert set(entries["tcp"]["transports"]) == {"tcp"}
    assert set(entries["dpdk"]["transports"]) == {"dpdk"}
    assert set(entries["gpudev"]["transports"]) == {"dpdk_gpudev"}
    assert set(entries["rdma"]["transports"]) == {"rdma"}
    assert entries["nvml"]["transports"] == {}
    assert entries["nvml"]["hooks"] == ["genie_health_checks", "genie_node_metrics"]


def test_plugins_probes_every_transport_and_tcp_is_available(plugins_json: dict[str, Any]):
    probes = {name: result for p in plugins_json["plugins"] for name, result in p["transports"].items()}
    assert "tcp" in probes, "genie-tcp must come with genie"
    assert probes["tcp"]["available"] is True
    for name, result in probes.items():
        assert result["name"] == name
        assert isinstance(result["available"], bool)
        assert result["reason"], f"{name} gives no reason"
        assert result["reason_code"]
        if not result["available"]:
            assert result["reason_code"] != "ok", f"{name} is unavailable but says ok"


def test_plugins_reports_hardware_backends_unavailable_without_their_hardware(plugins_json: dict[str, Any]):
    import torch

    probes = {name: result for p in plugins_json["plugins"] for name, result in p["transports"].items()}
    ib = Path("/sys/class/infiniband")
    if "rdma" in probes and not (ib.is_dir() and any(ib.iterdir())):
        assert probes["rdma"]["available"] is False
        assert probes["rdma"]["reason"]
    if "dpdk_gpudev" in probes and not torch.cuda.is_available():
        assert probes["dpdk_gpudev"]["available"] is False
        assert "CUDA" in probes["dpdk_gpudev"]["reason"]


def test_plugins_respects_genie_plugins_and_autoload_switch():
    proc = run_cli("plugins", env={"GENIE_PLUGINS": "tcp"})
    assert proc.returncode == 0, proc.stderr
    names = [p["name"] for p in json.loads(proc.stdout)["plugins"]]
    assert names == [BUILTIN, "tcp"] if "tcp" in installed_plugins() else [BUILTIN]
    proc = run_cli("plugins", env={"GENIE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert proc.returncode == 0, proc.stderr
    assert [p["name"] for p in json.loads(proc.stdout)["plugins"]] == [BUILTIN]


def test_plugins_with_a_broken_plugin_exits_1_naming_it(fake_site: FakeSite):
    fake_site.add("fake-broken", {"fake_broken": "fake_broken_plugin"},
                  {"fake_broken_plugin": "import fake_no_such_native_library\n"})
    proc = run_cli("plugins", env={"PYTHONPATH": str(fake_site.root), "GENIE_PLUGINS": "fake_broken"})
    assert proc.returncode == 1
    assert proc.stderr.startswith("genie plugins: error: plugin 'fake_broken'")
    assert "fake-broken" in proc.stderr


def test_a_failing_metrics_plugin_costs_only_its_own_fragment(genie_pm, register_plugin) -> None:
    from genie import hookimpl
    from genie.types import NodeInfo, NodeRole

    class Good:
        @hookimpl
        def genie_node_metrics(self, node):
            return {"good": {"node": node.node_id}}

    class Broken:
        @hookimpl
        def genie_node_metrics(self, node):
            raise RuntimeError("driver went away")

    register_plugin(Good(), name="good")
    register_plugin(Broken(), name="broken")
    fragments = genie_pm.node_metrics(node=NodeInfo("n1", "h", NodeRole.WORKER))
    assert {"good": {"node": "n1"}} in fragments
    assert {"errors": {"broken": "RuntimeError: driver went away"}} in fragments
