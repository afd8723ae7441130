"""Safe defaults: loopback unless told otherwise; a non-loopback bind needs a token or an explicit --insecure."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from genie.config import ClusterConfig
from genie.errors import ConfigError
from genie.security import ServerSecurity, check_bind, check_exposure, is_loopback
from tests.security.conftest import TOKEN

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}


def test_servers_bind_loopback_by_default():
    assert ClusterConfig.from_sources({}).bind_addr == "127.0.0.1"


@pytest.mark.parametrize(("addr", "loop"), [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.1.2.3", False), ("gpu-box.example", False)])
def test_is_loopback(addr, loop):
    assert is_loopback(addr) is loop


def test_non_loopback_without_token_is_refused_unless_insecure(caplog):
    exposed = ClusterConfig.from_sources({}, bind_addr="0.0.0.0")
    with pytest.raises(ConfigError, match="--insecure") as err:
        check_exposure(exposed, insecure=False)
    assert "GENIE_AUTH_TOKEN" in str(err.value)
    check_exposure(exposed, insecure=True)  # allowed; the servers it starts warn (test_preauth.py)
    check_exposure(exposed.replace(insecure=True), insecure=False)  # the option (GENIE_INSECURE) too
    with caplog.at_level(logging.WARNING, "genie.security"):
        check_bind("0.0.0.0", ServerSecurity(), insecure=True, what="data plane")
    assert "INSECURE" in caplog.text and "WITHOUT AUTHENTICATION" in caplog.text
    check_exposure(exposed.replace(auth_token=TOKEN), insecure=False)  # a token makes it fine
    check_exposure(ClusterConfig.from_sources({}), insecure=False)  # loopback is fine


def test_genie_serve_on_all_interfaces_without_token_refuses_to_start():
    done = subprocess.run([sys.executable, "-m", "genie.cli", "serve", "--host", "0.0.0.0", "--port", "5999",
                           "--devices", "cpu"], env=CLEAN_ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "--insecure" in out and "GENIE_AUTH_TOKEN" in out and "ready" not in out
