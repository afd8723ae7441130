"""The cluster token on the data plane: HMAC challenge-response, mutual, never on the wire, refusals rate-limited."""

from __future__ import annotations

import logging
import stat
import time

import pytest
import torch

from genie.config import ClusterConfig
from genie.errors import AuthenticationError, ConfigError
from genie.security import RefusalLog, load_token
from genie.testing import wait_until
from genie.wire.frame import MsgKind
from tests.raw_client import RawClient, desc
from tests.security.conftest import TOKEN


def round_trip(conn, storage_id: int = 1) -> None:
    t = torch.arange(16, dtype=torch.float32)
    conn.upload(storage_id, 0, t, overwrite=False)
    assert torch.equal(conn.fetch(0, desc(storage_id, t), torch.empty(16)), t)


def test_right_token_opens_a_working_session(dp_server, connect):
    server = dp_server(auth_token=TOKEN)
    conn = connect(server.port, auth_token=TOKEN)
    round_trip(conn)
    assert server.stats()["sessions"] == 1


def test_missing_token_is_refused_with_a_clear_message_on_both_ends(dp_server, connect, caplog):
    server = dp_server(auth_token=TOKEN)
    with caplog.at_level(logging.WARNING, "genie"), pytest.raises(AuthenticationError) as err:
        connect(server.port)
    assert "wrong or missing cluster token; set GENIE_AUTH_TOKEN" in str(err.value)
    assert any("refused data-plane connection" in r.getMessage() and "no token" in r.getMessage()
               for r in caplog.records)
    # the refused session's thread ends just after the client hears REJECT
    wait_until(lambda: server.stats()["sessions"] == 0, 5, step=0.01, what="the refused session's end")


def test_wrong_token_is_refused_with_a_clear_message_on_both_ends(dp_server, connect, caplog):
    server = dp_server(auth_token=TOKEN)
    with caplog.at_level(logging.WARNING, "genie"), pytest.raises(AuthenticationError) as err:
        connect(server.port, auth_token="not-the-token")
    assert "wrong or missing cluster token; set GENIE_AUTH_TOKEN" in str(err.value)
    assert any("wrong token" in r.getMessage() for r in caplog.records)


def test_a_client_with_a_token_refuses_a_server_that_does_not_authenticate(dp_server, connect):
    server = dp_server()
    with pytest.raises(AuthenticationError, match="does not authenticate"):
        connect(server.port, auth_token=TOKEN)


def test_old_plaintext_token_field_is_never_accepted(dp_server):
    server = dp_server(auth_token=TOKEN)
    with RawClient(server.port) as c:
        kind, body = c.hello(token=TOKEN)
        assert kind == MsgKind.REJECT and body["code"] == "auth"


def test_token_file_works_and_must_not_be_world_readable(dp_server, connect, token_file):
    server = dp_server(auth_token_file=str(token_file))
    round_trip(connect(server.port, auth_token=TOKEN))
    round_trip(connect(server.port, auth_token_file=str(token_file)))
    token_file.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600") as err:
        load_token(ClusterConfig.from_sources({"GENIE_AUTH_TOKEN_FILE": str(token_file)}))
    assert "GENIE_AUTH_TOKEN_FILE" in str(err.value)
    assert TOKEN not in str(err.value)
    token_file.chmod(0o640)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o640
    assert load_token(ClusterConfig.from_sources({}, auth_token_file=str(token_file))) == TOKEN.encode()


def test_token_never_crosses_the_wire_nor_reaches_the_logs(dp_server, connect, recording_proxy, caplog):
    server = dp_server(auth_token=TOKEN, log_level="DEBUG")
    proxy = recording_proxy(server.port)
    with caplog.at_level(logging.DEBUG):
        round_trip(connect(proxy.port, auth_token=TOKEN))
        with pytest.raises(AuthenticationError):
            connect(proxy.port, auth_token=TOKEN[::-1])
        with pytest.raises(AuthenticationError):
            connect(proxy.port)
    assert len(proxy.recorded) > 200  # the capture saw the sessions
    for needle in (TOKEN.encode(), TOKEN[::-1].encode(), TOKEN.encode("utf-16-le")):
        assert needle not in proxy.recorded
    assert TOKEN not in caplog.text and TOKEN[::-1] not in caplog.text
    assert TOKEN not in repr(server.config) and TOKEN not in repr(server.security)


def test_refusals_under_a_flood_are_logged_at_a_bounded_rate(dp_server, connect, caplog):
    server = dp_server(auth_token=TOKEN)
    with caplog.at_level(logging.WARNING, "genie"):
        for _ in range(30):
            with pytest.raises(AuthenticationError):
                connect(server.port, auth_token="wrong")
    refusal_lines = [r for r in caplog.records if r.name == "genie.security"]
    assert 1 <= len(refusal_lines) <= 6, [r.getMessage() for r in refusal_lines]
    round_trip(connect(server.port, auth_token=TOKEN))  # and the node still serves the right token


def test_refusal_log_summarises_what_it_suppressed(caplog):
    limiter = RefusalLog(logging.getLogger("genie.test.refusals"), burst=2, interval=0.05)
    with caplog.at_level(logging.WARNING, "genie.test.refusals"):
        for i in range(10):
            limiter.warning("refused %d", i)
        time.sleep(0.06)  # not a wait: the rate window (0.05 s) elapsing is the behaviour under test
        limiter.warning("refused again")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["refused 0", "refused 1", "8 more refused connections were not logged in the last 0.05 s",
                        "refused again"]
    assert limiter.total == 11
