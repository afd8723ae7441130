"""ClusterConfig: arguments over GENIE_* environment over defaults, and every way a value is refused.

Every test passes its own ``environ`` mapping (or patches ``os.environ`` with monkeypatch),
so nothing here depends on the environment the suite runs in.
"""

from __future__ import annotations

import pytest

from genie.config import BackendSpec, ClusterConfig, env_name, option_names
from genie.errors import ConfigError, GenieError
from genie.types import NodeRole

# -- precedence ------------------------------------------------------------------------------------

#: One option of each kind: (option, default, environment text, value it parses to, argument value).
KINDS = [
    pytest.param("master_addr", "127.0.0.1", "env-host", "env-host", "arg-host", id="str"),
    pytest.param("master_port", 5555, "6000", 6000, 7000, id="int"),
    pytest.param("heartbeat_interval", 10.0, "2.5", 2.5, 1.5, id="float"),
    pytest.param("enable_telemetry", True, "false", False, True, id="bool"),
]


@pytest.mark.parametrize(("option", "default", "env_text", "env_value", "arg_value"), KINDS)
def test_default_applies_when_neither_argument_nor_environment_sets_an_option(
    option, default, env_text, env_value, arg_value
):
    config = ClusterConfig.from_sources({})
    assert getattr(config, option) == default
    assert config.sources[option] == "default"


@pytest.mark.parametrize(("option", "default", "env_text", "env_value", "arg_value"), KINDS)
def test_environment_variable_overrides_the_default(option, default, env_text, env_value, arg_value):
    config = ClusterConfig.from_sources({env_name(option): env_text})
    assert getattr(config, option) == env_value
    assert type(getattr(config, option)) is type(default)
    assert config.sources[option] == f"environment variable {env_name(option)}"


@pytest.mark.parametrize(("option", "default", "env_text", "env_value", "arg_value"), KINDS)
def test_argument_overrides_the_environment_variable(option, default, env_text, env_value, arg_value):
    config = ClusterConfig.from_sources({env_name(option): env_text}, **{option: arg_value})
    assert getattr(config, option) == arg_value
    assert config.sources[option] == f"argument {option}"


def test_argument_none_means_not_given_so_the_environment_applies():
    config = ClusterConfig.from_sources({"GENIE_MASTER_PORT": "6001"}, master_port=None)
    assert config.master_port == 6001
    assert config.sources["master_port"] == "environment variable GENIE_MASTER_PORT"


def test_os_environ_is_read_when_no_mapping_is_given(monkeypatch):
    monkeypatch.setenv("GENIE_NODE_ROLE", "worker")
    monkeypatch.setenv("GENIE_MASTER_ADDR", "gpu-server")
    config = ClusterConfig.from_sources()
    assert config.node_role is NodeRole.WORKER
    assert config.master_addr == "gpu-server"
    assert config.sources["node_role"] == "environment variable GENIE_NODE_ROLE"


def test_every_option_has_a_source_and_the_documented_environment_variable():
    config = ClusterConfig.from_sources({"GENIE_BACKEND": "tcp"}, master_port=6000)
    assert set(config.sources) == set(option_names())
    assert config.sources["master_port"] == "argument master_port"
    assert config.sources["backend"] == "environment variable GENIE_BACKEND"
    assert {config.sources[n] for n in option_names() if n not in ("master_port", "backend")} == {"default"}
    assert env_name("master_port") == "GENIE_MASTER_PORT"
    assert env_name("heartbeat_interval") == "GENIE_HEARTBEAT_INTERVAL"


def test_documented_defaults():
    config = ClusterConfig.from_sources({})
    assert config.master_port == 5555
    assert config.heartbeat_interval == 10.0
    assert config.heartbeat_timeout == 60.0
    assert config.gpu_poll_interval == 5.0
    assert config.health_check_interval == 30.0
    assert config.timeout == 30.0
    assert config.node_role is NodeRole.CLIENT
    assert config.backend == BackendSpec("auto")
    assert config.log_level == "INFO"


def test_environment_text_is_parsed_for_every_kind():
    config = ClusterConfig.from_sources({
        "GENIE_MASTER_PORT": " 6000 ",
        "GENIE_PROBE_TIMEOUT": "0.25",
        "GENIE_ENABLE_HEARTBEAT": "off",
        "GENIE_ENABLE_HEALTH_CHECKS": "YES",
        "GENIE_LOG_LEVEL": "debug",
        "GENIE_NODE_ROLE": "server",
        "GENIE_BACKEND": "RDMA,tcp",
        "GENIE_DEVICES": "cuda:0,cuda:1",
    })
    assert config.master_port == 6000
    assert config.probe_timeout == 0.25
    assert config.enable_heartbeat is False
    assert config.enable_health_checks is True
    assert config.log_level == "DEBUG"
    assert config.log_level_number == 10
    assert config.node_role is NodeRole.SERVER
    assert config.backend.include == ("rdma", "tcp")
    assert config.devices == "cuda:0,cuda:1"


def test_config_is_frozen_and_hides_the_auth_token_from_repr():
    config = ClusterConfig.from_sources({}, auth_token="s3cret")
    with pytest.raises(AttributeError):
        config.master_port = 1  # type: ignore[misc]
    assert "s3cret" not in repr(config)


# -- refusals --------------------------------------------------------------------------------------


def _refused(environ: dict[str, str] | None = None, **arguments) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_sources(environ or {}, **arguments)
    return info.value


@pytest.mark.parametrize("port", [70000, -1, "abc", 5555.5, float("inf"), True])
def test_bad_master_port_argument_names_option_value_source_and_allowed(port):
    err = _refused(master_port=port)
    assert err.option == "master_port"
    assert err.value == port
    assert err.source == "argument master_port"
    message = str(err)
    assert "'master_port'" in message
    assert repr(port) in message
    assert "from argument master_port" in message
    assert "an integer port from 1 to 65535" in message


@pytest.mark.parametrize("text", ["70000", "abc", "", "5555.0", "-1"])
def test_bad_master_port_in_environment_names_the_variable(text):
    err = _refused({"GENIE_MASTER_PORT": text})
    assert (err.option, err.value) == ("master_port", text)
    assert err.source == "environment variable GENIE_MASTER_PORT"
    assert str(err) == (
        f"invalid value {text!r} for option 'master_port' (from environment variable GENIE_MASTER_PORT); "
        "allowed: an integer port from 1 to 65535 (0: any free port, for the master itself only)"
    )


@pytest.mark.parametrize("role", ["client", "worker"])
def test_master_port_0_is_refused_for_a_node_that_dials_the_master(role):
    err = _refused({"GENIE_MASTER_PORT": "0"}, node_role=role)
    assert (err.option, err.value, err.source) == ("master_port", "0", "environment variable GENIE_MASTER_PORT")
    assert f"a {role} needs the port the master reported" in str(err)


def test_master_port_0_lets_the_master_bind_any_free_port():
    assert ClusterConfig.from_sources({}, node_role="server", master_port=0).master_port == 0


def test_bad_environment_value_is_refused_even_when_an_argument_overrides_another_option():
    # The argument for master_port does not mask a bad GENIE_MASTER_ADDR.
    err = _refused({"GENIE_MASTER_ADDR": "  "}, master_port=6000)
    assert err.source == "environment variable GENIE_MASTER_ADDR"


def test_config_error_is_a_genie_error_and_a_value_error():
    err = _refused(master_port=0)
    assert isinstance(err, GenieError)
    assert isinstance(err, ValueError)


def test_unknown_role_is_refused():
    err = _refused(node_role="boss")
    assert (err.option, err.value) == ("node_role", "boss")
    assert "client, server or worker" in str(err)
    assert _refused({"GENIE_NODE_ROLE": "master"}).source == "environment variable GENIE_NODE_ROLE"


def test_role_accepts_the_enum():
    assert ClusterConfig.from_sources({}, node_role=NodeRole.WORKER).node_role is NodeRole.WORKER


@pytest.mark.parametrize("text", ["^", "rdma,,tcp", "auto,tcp", "rdma,rdma", "^dpdk,dpdk", "rdma,^tcp",
                                  "^^dpdk", "1rdma", "rd-ma", "tcp,", ",tcp", "^auto"])
def test_bad_backend_syntax_is_refused(text):
    err = _refused(backend=text)
    assert (err.option, err.value, err.source) == ("backend", text, "argument backend")
    assert "'auto', a backend name" in err.allowed


def test_bad_backend_syntax_in_environment_names_the_variable():
    err = _refused({"GENIE_BACKEND": "rdma,,tcp"})
    assert err.source == "environment variable GENIE_BACKEND"


def test_duplicate_backend_names_say_each_name_once():
    assert "each name once" in str(_refused(backend="tcp,rdma,tcp"))


@pytest.mark.parametrize(
    "option", ["heartbeat_interval", "heartbeat_timeout", "gpu_poll_interval", "health_check_interval",
               "health_check_timeout", "timeout", "connect_timeout", "probe_timeout", "op_timeout"]
)
@pytest.mark.parametrize("value", [0, -1.0, "nan"])
def test_intervals_and_timeouts_must_be_positive(option, value):
    err = _refused(**{option: value})
    assert err.option == option
    assert "positive number of seconds" in err.allowed


def test_negative_interval_from_environment():
    err = _refused({"GENIE_GPU_POLL_INTERVAL": "-5"})
    assert (err.option, err.source) == ("gpu_poll_interval", "environment variable GENIE_GPU_POLL_INTERVAL")


@pytest.mark.parametrize("timeout", [10.0, 5.0])
def test_heartbeat_timeout_must_be_longer_than_the_interval(timeout):
    err = _refused(heartbeat_interval=10, heartbeat_timeout=timeout)
    assert err.option == "heartbeat_timeout"
    assert err.source == "argument heartbeat_timeout"
    assert "longer than heartbeat_interval (10 s)" in str(err)


def test_heartbeat_relation_names_the_environment_source():
    err = _refused({"GENIE_HEARTBEAT_TIMEOUT": "5"})  # default interval is 10 s
    assert err.source == "environment variable GENIE_HEARTBEAT_TIMEOUT"


def test_health_check_timeout_may_equal_but_not_exceed_the_interval():
    ok = ClusterConfig.from_sources({}, health_check_interval=5, health_check_timeout=5)
    assert ok.health_check_timeout == 5
    err = _refused(health_check_interval=5, health_check_timeout=6)
    assert err.option == "health_check_timeout"
    assert "at most health_check_interval (5 s)" in str(err)


@pytest.mark.parametrize("text", ["maybe", "2", "", "enabled"])
def test_bad_bool_in_environment_is_refused(text):
    err = _refused({"GENIE_ENABLE_HEARTBEAT": text})
    assert (err.option, err.source) == ("enable_heartbeat", "environment variable GENIE_ENABLE_HEARTBEAT")
    assert err.allowed == "true or false"


@pytest.mark.parametrize("value", [1, 0, 1.0, "maybe"])
def test_bad_bool_argument_is_refused(value):
    assert _refused(enable_gpu_monitoring=value).option == "enable_gpu_monitoring"


@pytest.mark.parametrize("text", ["1", "true", "Yes", " on "])
def test_true_spellings(text):
    assert ClusterConfig.from_sources({"GENIE_ENABLE_HEARTBEAT": text}).enable_heartbeat is True


@pytest.mark.parametrize("text", ["0", "FALSE", "no", "off"])
def test_false_spellings(text):
    assert ClusterConfig.from_sources({"GENIE_ENABLE_HEARTBEAT": text}).enable_heartbeat is False


@pytest.mark.parametrize("level", ["VERBOSE", "warn", "", "10"])
def test_bad_log_level_is_refused(level):
    err = _refused(log_level=level)
    assert err.option == "log_level"
    assert err.allowed == "DEBUG, INFO, WARNING, ERROR, CRITICAL"


def test_unknown_option_argument_is_refused_listing_the_options():
    err = _refused(master_prot=5555)
    assert (err.option, err.value, err.source) == ("master_prot", 5555, "argument master_prot")
    assert "master_port" in err.allowed


def test_non_string_for_a_string_option_is_refused():
    assert _refused(master_addr=127).option == "master_addr"


@pytest.mark.parametrize("devices", ["auto", "cpu", "cpu,cpu", "cuda", "cuda:0,cuda:1", "cpu,cuda:3"])
def test_devices_syntax_accepted(devices):
    assert ClusterConfig.from_sources({}, devices=devices).devices == devices


@pytest.mark.parametrize("devices", ["", "gpu", "cpu,", "cuda:", "cuda:x", "auto,cpu", "CPU", "cpu cpu"])
def test_devices_syntax_refused(devices):
    err = _refused({"GENIE_DEVICES": devices})
    assert (err.option, err.source) == ("devices", "environment variable GENIE_DEVICES")


@pytest.mark.parametrize(("option", "value"), [("data_port", 65536), ("data_port", -1),
                                               ("max_frame_bytes", 4095), ("max_session_handles", 0),
                                               ("max_session_bytes", -1), ("node_id", "bad id"),
                                               ("node_id", "x" * 129), ("bind_addr", " ")])
def test_other_bounds(option, value):
    assert _refused(**{option: value}).option == option


# -- replace ---------------------------------------------------------------------------------------


def test_replace_changes_one_option_and_keeps_the_rest():
    config = ClusterConfig.from_sources({"GENIE_BACKEND": "^dpdk"}, node_role="worker", master_port=6000)
    copy = config.replace(node_id="n1")
    assert copy.node_id == "n1"
    assert copy.node_role is NodeRole.WORKER
    assert copy.master_port == 6000
    assert copy.backend == BackendSpec.parse("^dpdk")
    assert config.node_id == ""  # the original is untouched


def test_replace_keeps_where_unchanged_options_came_from():
    config = ClusterConfig.from_sources({"GENIE_BACKEND": "tcp"}, master_port=6000)
    copy = config.replace(node_id="n1")
    assert copy.sources["backend"] == "environment variable GENIE_BACKEND"
    assert copy.sources["master_port"] == "argument master_port"
    assert copy.sources["heartbeat_interval"] == "default"
    assert copy.sources["node_id"] == "argument node_id"


def test_replace_validates_again():
    config = ClusterConfig.from_sources({})
    err = _refused_replace(config, master_port=0)
    assert err.source == "argument master_port"
    assert _refused_replace(config, heartbeat_interval=100).option == "heartbeat_timeout"
    assert _refused_replace(config, no_such_option=1).option == "no_such_option"


def test_replace_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("GENIE_MASTER_PORT", "7000")
    config = ClusterConfig.from_sources({})
    assert config.replace(node_id="n").master_port == 5555


def _refused_replace(config: ClusterConfig, **changes) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config.replace(**changes)
    return info.value


# -- BackendSpec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["auto", "", "  ", "AUTO"])
def test_auto_includes_and_excludes_nothing_and_is_not_explicit(text):
    spec = BackendSpec.parse(text)
    assert spec == BackendSpec("auto")
    assert (spec.include, spec.exclude, spec.explicit) == ((), (), False)


def test_single_name_is_explicit():
    spec = BackendSpec.parse("rdma")
    assert (spec.include, spec.exclude, spec.explicit) == (("rdma",), (), True)


def test_ordered_list_keeps_the_order_and_is_explicit():
    spec = BackendSpec.parse(" dpdk_gpudev , TCP ")
    assert spec.include == ("dpdk_gpudev", "tcp")
    assert spec.explicit


def test_exclusions_are_not_explicit():
    spec = BackendSpec.parse("^dpdk,rdma")
    assert (spec.include, spec.exclude, spec.explicit) == ((), ("dpdk", "rdma"), False)


def test_parse_reports_the_source_it_is_given():
    with pytest.raises(ConfigError) as info:
        BackendSpec.parse("^", source="environment variable GENIE_BACKEND")
    assert info.value.source == "environment variable GENIE_BACKEND"


def test_check_known_accepts_installed_backends():
    BackendSpec.parse("rdma,tcp").check_known({"tcp", "rdma", "dpdk"})
    BackendSpec.parse("^dpdk").check_known({"tcp", "dpdk"})
    BackendSpec.parse("auto").check_known(set())


@pytest.mark.parametrize("text", ["infiniband", "tcp,infiniband", "^infiniband"])
def test_check_known_refuses_a_backend_no_plugin_provides(text):
    with pytest.raises(ConfigError) as info:
        BackendSpec.parse(text).check_known({"tcp", "rdma"}, source="environment variable GENIE_BACKEND")
    err = info.value
    assert (err.option, err.value, err.source) == ("backend", text, "environment variable GENIE_BACKEND")
    assert err.allowed == "installed backends: rdma, tcp"


def test_check_known_with_nothing_installed_says_none():
    with pytest.raises(ConfigError, match="installed backends: none"):
        BackendSpec.parse("tcp").check_known(set())
