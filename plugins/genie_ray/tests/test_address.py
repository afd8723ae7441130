"""genie-ray without a Ray cluster: the ``ray://`` address, the hooks it registers, the errors a user
meets before Ray is reached (bad options, Ray not installed). Runs in the main suite."""

from __future__ import annotations

import subprocess
import sys

import pytest
from genie_ray import genie_resolve_master, up
from genie_ray.cluster import DEFAULT_NAME, RayAddress

from genie.errors import ConfigError
from genie.plugins import PluginManager


@pytest.mark.parametrize(("text", "ray_address", "name"), [
    ("ray://", None, DEFAULT_NAME),
    ("ray://auto", None, DEFAULT_NAME),
    ("ray://10.0.0.1:6379", "10.0.0.1:6379", DEFAULT_NAME),
    ("ray://head.example:6379/lab", "head.example:6379", "lab"),
    ("ray:///lab", None, "lab"),
])
def test_ray_addresses_name_the_ray_cluster_and_the_genie_cluster(text: str, ray_address: str | None,
                                                                  name: str) -> None:
    assert RayAddress.parse(text) == RayAddress(ray_address, name)


@pytest.mark.parametrize("text", ["ray://head", "ray://head:port", "tcp://10.0.0.1:6379"])
def test_a_malformed_ray_address_is_a_config_error_saying_what_is_allowed(text: str) -> None:
    with pytest.raises(ConfigError, match=r"ray://"):
        RayAddress.parse(text)


def test_other_schemes_are_left_to_other_plugins() -> None:
    assert genie_resolve_master(address="lab://x", timeout=1.0) is None
    assert genie_resolve_master(address="10.0.0.1", timeout=1.0) is None


def test_the_entry_point_registers_the_lookup_and_the_subcommands() -> None:
    pm = PluginManager(environ={"GENIE_PLUGINS": "ray"})
    assert pm.records["ray"].distribution == "genie-ray"
    assert pm.hooks_of("ray") == ["genie_cli_commands", "genie_resolve_master"]
    shown = subprocess.run([sys.executable, "-m", "genie.cli", "ray", "--help"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert all(action in shown.stdout for action in ("up", "down", "status"))


def test_bad_options_are_refused_before_ray_is_reached() -> None:
    with pytest.raises(ConfigError, match="per_worker"):
        up(per_worker=0)
    with pytest.raises(ConfigError, match="'heartbeat_intervall'"):
        up(heartbeat_intervall=1.0)
    with pytest.raises(ConfigError, match="'devices'"):
        up(devices="tpu")
    with pytest.raises(ConfigError, match="'bind_addr'.*genie-ray sets it"):
        up(bind_addr="0.0.0.0")


def test_without_ray_installed_the_commands_say_what_to_install() -> None:
    # ``sys.modules["ray"] = None`` makes ``import ray`` fail as it does where Ray is not installed.
    script = "import sys; sys.modules['ray'] = None; from genie_ray.cli import main; sys.exit(main(['status']))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "genie-ray needs Ray: pip install" in done.stderr
