"""The README and docs/ as written: every Python snippet runs, and the "two machines" section works.

Snippets of one file run in order in one fresh interpreter (later ones may use earlier
imports), with ``GENIE_MASTER_PORT`` pointing at a real ``genie serve`` on loopback. A snippet
preceded by ``<!-- snippet: skip (REASON) -->`` is skipped with that reason (hardware this
machine lacks, or an excerpt that is not a program); ``<!-- snippet: two-machines ... -->``
is run by :func:`test_the_two_machines_section_runs_on_loopback`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from genie.cluster.launch import NodeProcess
from tests.conftest import unused_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!--\s*snippet:\s*(?P<mark>.*?)\s*-->\s*\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```",
                    re.S | re.M)


@attrs.frozen
class Snippet:
    path: Path
    line: int
    lang: str
    code: str
    mark: str


def snippets(path: Path) -> list[Snippet]:
    text = path.read_text()
    return [Snippet(path, text.count("\n", 0, m.start("code")), m["lang"], m["code"], m["mark"] or "")
            for m in _BLOCK.finditer(text)]


def python_snippets(path: Path) -> list[Snippet]:
    return [s for s in snippets(path) if s.lang == "python"]


def run_python(code: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def master() -> Iterator[NodeProcess]:
    """The local server the README's first script expects (``genie serve --devices auto``)."""
    with NodeProcess("serve", "--port", "0", "--devices", "auto") as node:
        yield node


def test_every_snippet_is_found_and_every_python_one_is_runnable_or_marked() -> None:
    found = {p.name: python_snippets(p) for p in DOCS}
    assert len(found["README.md"]) == 2 and len(found["monitoring.md"]) >= 1
    for snippet in (s for group in found.values() for s in group):
        assert not snippet.mark or snippet.mark.startswith(("skip (", "two-machines")), snippet


@pytest.mark.parametrize("path", [p for p in DOCS if python_snippets(p)], ids=lambda p: p.name)
def test_python_snippets_run_as_written(path: Path, master: NodeProcess, tmp_path: Path) -> None:
    runnable = [s for s in python_snippets(path) if not s.mark]
    skipped = [s for s in python_snippets(path) if s.mark]
    if not runnable:
        pytest.skip("; ".join(f"{path.name}:{s.line}: {s.mark}" for s in skipped))
    script = "\n".join(f"# {path.name}:{s.line}\n{s.code}" for s in runnable)
    env = {**os.environ, "GENIE_MASTER_ADDR": "127.0.0.1", "GENIE_MASTER_PORT": str(master.control_port)}
    result = run_python(script, env, tmp_path)
    assert result.returncode == 0, f"{path.name} snippets failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    if path.name == "README.md":
        assert "checksum" in result.stdout and "genie profile" in result.stdout and "loss" in result.stdout


def _two_machines_commands() -> tuple[list[str], list[list[str]], Snippet]:
    """The token lines, the node command lines and the client snippet of the README's section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Two machines"):text.index("## Operating it")]
    blocks = [s for s in snippets(ROOT / "README.md") if s.code in section]
    token = [line for line in blocks[0].code.splitlines() if line.strip()]
    nodes = [shlex.split(line.split("#")[0]) for line in blocks[1].code.splitlines() if line.strip()]
    (client,) = [s for s in blocks if s.lang == "python"]
    return token, nodes, client


def test_the_two_machines_section_runs_on_loopback(tmp_path: Path) -> None:
    """Both "machines" are this one: gpu-a and gpu-b become 127.0.0.1, ports free ones; the commands
    are otherwise the README's, --host 0.0.0.0 and the token included."""
    token, nodes, client = _two_machines_commands()
    control, metrics = unused_port(), [unused_port(), unused_port()]  # the commands name them up front
    shell = "\n".join(token) + "\necho GENIE_AUTH_TOKEN_FILE=$GENIE_AUTH_TOKEN_FILE\n"
    made = subprocess.run(["bash", "-ec", shell], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    token_file = made.stdout.strip().rsplit("=", 1)[1]
    assert Path(token_file).stat().st_mode & 0o077 == 0
    env = {**os.environ, "GENIE_AUTH_TOKEN_FILE": token_file}
    env.pop("GENIE_AUTH_TOKEN", None)

    def local(argv: list[str], metrics_port: int) -> list[str]:
        out = [a.replace("gpu-a:5555", f"127.0.0.1:{control}").replace("gpu-a", "127.0.0.1") for a in argv[1:]]
        return [str(control) if a == "5555" else str(metrics_port) if a == "9464" else a for a in out]

    serve, worker, status = nodes
    assert serve[:2] == ["genie", "serve"] and "--host" in serve and worker[:2] == ["genie", "worker"]
    # Without the token, a node refuses a non-loopback --host (the README's warning holds).
    no_token = {k: v for k, v in env.items() if not k.startswith("GENIE_AUTH_TOKEN")}
    refused = subprocess.run([sys.executable, "-m", "genie.cli", *local(serve, metrics[0])], env=no_token,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "GENIE_AUTH_TOKEN" in refused.stderr
    with NodeProcess(*local(serve, metrics[0]), env=env) as a, \
            NodeProcess(*local(worker, metrics[1]), env=env):
        assert a.control_port == control
        shown = subprocess.run([sys.executable, "-m", "genie.cli", *local(status, 0)], env=env,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "2 nodes" in shown.stdout, shown.stderr
        code = client.code.replace('"gpu-a"', '"127.0.0.1"')
        result = run_python(code, {**env, "GENIE_MASTER_PORT": str(control)}, tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        assert result.stdout.strip().splitlines()[-1] == "[2.0, 2.0, 2.0, 2.0]"
        # and a client without the token is refused
        refused_client = run_python(code, {**no_token, "GENIE_MASTER_PORT": str(control)}, tmp_path)
        assert refused_client.returncode != 0 and "token" in refused_client.stderr.lower()
