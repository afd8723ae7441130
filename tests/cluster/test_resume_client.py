"""The real client through a dropped link: genie.init's session to a `genie serve` node resumes, loses nothing.

The node advertises a LinkEmulator's port for its data plane (as a node behind NAT would), so every
byte of the client's session crosses the emulator, which the test cuts, takes down or holds while a
client process (a driver reading steps from its stdin) works on ``remote_accelerator:0``. In-place
adds make "ran exactly once" visible in the values: a batch lost or run twice changes the sum.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from genie.cluster.launch import NodeProcess
from genie.testing import LinkEmulator, wait_until

ENV = {"GENIE_BACKEND": "tcp", "GENIE_LOG_LEVEL": "WARNING"}
NODE_WINDOW = 10.0

DRIVER = r'''
import json, sys, torch, genie
from genie.device.registry import table
genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=60)
dev = "remote_accelerator:0"
conn = table().connections()[0]

def say(**kw):
    print(json.dumps(kw), flush=True)

def go():
    assert sys.stdin.readline().strip() == "go"

def books():
    state = conn.resumable
    return {"sent": state.log.sent, "resumes": state.resumes, "lane": conn._lane}

def train(outage_at=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data, target = torch.randn(64, 16), torch.randn(64, 1)
    x, y = data.to(dev), target.to(dev)
    loss_value = None
    for step in range(24):
        if step == outage_at:
            say(step=step)
            go()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        loss_value = loss.item()
    return loss_value

say(ready=True, resumable=conn.resumable is not None)
for line in sys.stdin:
    step = line.strip()
    try:
        if step == "stream":
            x = torch.zeros(1000, device=dev)
            for _ in range(300):
                x.add_(1)
            say(streaming=True)
            go()
            for _ in range(300):
                x.add_(1)
            values = x.cpu()
            say(ok=bool((values == 600).all()), first=values[0].item(), **books())
        elif step in ("item", "fetch"):
            x = torch.arange(10.0, device=dev)
            x.add_(1)
            x.sum().item()  # everything before the request has run: the request goes alone
            say(asking=True)
            got = x.sum().item() if step == "item" else x.cpu().sum().item()
            say(got=got, **books())
        elif step == "train":
            plain = train()
            through = train(outage_at=8)
            say(plain=plain, through=through, **books())
        elif step == "lost":
            x = torch.ones(4, device=dev)
            x.add_(1)
            say(waiting=True)
            go()
            try:
                x.cpu()
                say(error=None)
            except Exception as exc:
                say(error=type(exc).__name__, message=str(exc))
        elif step == "quit":
            break
    except Exception as exc:
        say(error=type(exc).__name__, message=str(exc))
genie.shutdown_sync()
'''


class Driver:
    """A client process run step by step: ``step(name)``, ``answer()`` (one JSON line, bounded wait), ``go()``."""

    def __init__(self, control_port: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(control_port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        ready = self.answer(60)
        assert ready == {"ready": True, "resumable": True}, ready

    def step(self, name: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()

    def go(self) -> None:
        self.step("go")

    def answer(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"the client said nothing within {timeout:g} s; stderr:\n{self.stderr()}")
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the client exited ({self.proc.wait(5)}); stderr:\n{self.stderr()}")
            if line.startswith("{"):
                return dict(json.loads(line))

    def stderr(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-6000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.step("quit")
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def path() -> Iterator[tuple[NodeProcess, LinkEmulator]]:
    """A node whose data plane is reached through an emulated 20 ms round-trip link."""
    with LinkEmulator(("127.0.0.1", 1), delay=0.01) as data:
        with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--advertise-ports", str(data.port),
                         env={**ENV, "GENIE_RECONNECT_WINDOW": str(NODE_WINDOW), "GENIE_LOG_LEVEL": "INFO"},
                         ready_timeout=120) as node:
            data.target = ("127.0.0.1", node.data_port)
            yield node, data


@pytest.fixture(scope="module")
def client(path: tuple[NodeProcess, LinkEmulator]) -> Iterator[Driver]:
    driver = Driver(path[0].control_port, ENV)
    try:
        yield driver
    finally:
        driver.close()


def test_a_cut_among_fire_and_forget_batches_then_a_sync_point_loses_nothing_runs_nothing_twice(
        path: tuple[NodeProcess, LinkEmulator], client: Driver) -> None:
    link = path[1]
    client.step("stream")
    assert client.answer() == {"streaming": True}
    assert link.cut() == 1  # batches the emulator still holds are lost with the connection
    client.go()
    got = client.answer()
    assert got["ok"] and got["first"] == 600.0, got  # 600 adds: none lost, none run twice
    assert got["resumes"] >= 1, got


@pytest.mark.parametrize("how", ["item", "fetch"])
def test_a_cut_while_the_reply_is_in_flight_gets_the_reply_once(path: tuple[NodeProcess, LinkEmulator],
                                                                client: Driver, how: str) -> None:
    link = path[1]
    link.configure(delay=0.4)  # each way: the request, then the reply, spend 0.4 s in the emulator
    try:
        client.step(how)
        assert client.answer() == {"asking": True}
        up, down = link.stats().bytes_up, link.stats().bytes_down
        wait_until(lambda: link.stats().bytes_up > up, 5)  # the request reached the node...
        link.cut()
        assert link.stats().bytes_down == down  # ...and its reply had not reached the client
    finally:
        link.configure(delay=0.01)
    got = client.answer()
    assert got.get("got") == 55.0, got  # (arange(10) + 1).sum(): the add ran once, the request was answered once
    if how == "item":
        assert got["lane"], "the .item() went through genie._C's lane"


#: Longer than the client's whole backoff ramp (0.05 s doubling to genie.device.resume.MAX_BACKOFF, 0.5 s, in
#: 0.75 s), so it retries at the longest interval several times; well inside the node's window (NODE_WINDOW).
OUTAGE = 2.5


def test_a_training_loop_through_an_outage_ends_with_the_same_loss(path: tuple[NodeProcess, LinkEmulator],
                                                                   client: Driver) -> None:
    link = path[1]
    client.step("train")
    assert client.answer() == {"step": 8}
    started = time.monotonic()
    link.down(OUTAGE)
    client.go()
    got = client.answer(60)
    assert time.monotonic() - started >= OUTAGE  # it waited out the outage
    assert got["through"] == got["plain"], got  # exactly the same loss: no step lost or run twice
    assert got["resumes"] >= 1, got


def test_an_outage_longer_than_the_window_raises_remote_device_lost_naming_it(
        path: tuple[NodeProcess, LinkEmulator]) -> None:
    node, link = path
    driver = Driver(node.control_port, {**ENV, "GENIE_RECONNECT_WINDOW": "1.5"})  # the client's window is shorter
    try:
        driver.step("lost")
        assert driver.answer() == {"waiting": True}
        link.down()
        driver.go()
        got = driver.answer(30)
    finally:
        link.up()
        driver.close()
    assert got["error"] == "RemoteDeviceLost", got
    assert "reconnect window of 1.5 s" in got["message"], got


# -- the same over TLS: the node relays the session's plaintext to its worker, a resume through a new relay --


@pytest.fixture(scope="module")
def tls_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, LinkEmulator, dict[str, str]]]:
    """A TLS node behind an emulated 20 ms link, and the client environment that trusts it."""
    from tests.security.certs import make_pki

    pki = make_pki(tmp_path_factory.mktemp("pki"))
    with LinkEmulator(("127.0.0.1", 1), delay=0.01) as data:
        env = {**ENV, "GENIE_RECONNECT_WINDOW": str(NODE_WINDOW), "GENIE_LOG_LEVEL": "INFO",
               "GENIE_TLS_CERT": pki.server_cert, "GENIE_TLS_KEY": pki.server_key, "GENIE_TLS_CA": pki.ca}
        with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--advertise-ports", str(data.port),
                         env=env, ready_timeout=120) as node:
            data.target = ("127.0.0.1", node.data_port)
            yield node, data, {**ENV, "GENIE_TLS_CA": pki.ca}


def test_a_tls_session_resumes_after_a_cut_and_through_an_outage(
        tls_path: tuple[NodeProcess, LinkEmulator, dict[str, str]]) -> None:
    """A TLS session survives what a plain one does: the client redoes the TLS handshake, the node hands the
    new connection's plaintext to the same worker through a new relay; nothing lost, nothing run twice."""
    node, link, env = tls_path
    driver = Driver(node.control_port, env)
    try:
        driver.step("stream")
        assert driver.answer() == {"streaming": True}
        assert link.cut() == 1
        driver.go()
        got = driver.answer()
        assert got["ok"] and got["first"] == 600.0, got
        assert got["resumes"] >= 1 and not got["lane"], got  # TLS: no native lane, the Python path resumed
        driver.step("train")
        assert driver.answer() == {"step": 8}
        link.down(2.0)
        driver.go()
        trained = driver.answer(60)
        assert trained["through"] == trained["plain"], trained
        assert trained["resumes"] > got["resumes"], trained
    finally:
        driver.close()
