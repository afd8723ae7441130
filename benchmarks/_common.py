"""Helpers shared by the benchmarks: a private network namespace, child processes, the result table.

Not a benchmark itself. Every process a benchmark starts goes through
:class:`Children` (or :class:`genie.cluster.launch.NodeProcess`), so it is
stopped whatever happens, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

NETNS_ENV = "GENIE_BENCH_NETNS"


def enter_private_netns(argv: Sequence[str] | None = None) -> None:
    """Re-exec this script in a private network namespace with only ``lo`` up, once.

    torch.distributed and torch.distributed.rpc resolve the host name and may send
    DNS or metadata queries off the machine; inside a namespace with nothing but
    loopback they cannot. The whole benchmark runs there, so genie and its anchors
    are measured alike. ``--no-netns`` on the command line, or an ``unshare`` that
    does not work here (not root), runs in place with a note on stderr.
    """
    argv = list(sys.argv if argv is None else argv)
    if os.environ.get(NETNS_ENV) == "1":
        return
    if "--no-netns" in argv:
        os.environ[NETNS_ENV] = "0"
        return
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    ok = False
    if unshare and ip:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            ok = subprocess.run([unshare, "-n", ip, "link", "set", "lo", "up"], capture_output=True,
                                timeout=10).returncode == 0
    if not ok or unshare is None:
        print("note: cannot enter a private network namespace (needs root, unshare and ip); running in place",
              file=sys.stderr)
        os.environ[NETNS_ENV] = "0"
        return
    os.environ[NETNS_ENV] = "1"
    # Names for loopback only: TensorPipe and Gloo otherwise pick an interface by resolving the host name.
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    script = os.path.abspath(argv[0])
    os.execv(unshare, [unshare, "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                       sys.executable, script, *argv[1:]])


#: What a node started with ``--compile-replays inductor`` logs of each graph it was asked to compile
#: (genie.server.inductor_replays), and what it logs when it queues a compile (each followed by one outcome:
#: compiled, or could not compile).
INDUCTOR_OUTCOMES = ("compiled by inductor in", "stays node by node under", "inductor could not compile")
INDUCTOR_QUEUED = "queued for inductor"
#: What a CUDA node's log (at INFO) says of each replayed graph's CUDA graph (genie.server.cuda_graphs).
CUDA_GRAPH_OUTCOMES = ("captured as a CUDA graph", "stays eager", "cannot be captured as a CUDA graph")


def inductor_outcomes(log: str) -> int:
    """How many graphs an inductor node's log has an outcome for."""
    return sum(log.count(o) for o in INDUCTOR_OUTCOMES)


def inductor_settled(log: str, outcomes_before: int, new_graphs: int = 1) -> bool:
    """Whether an inductor node's log shows at least ``new_graphs`` outcomes since ``outcomes_before`` and every
    compile it queued finished: a replay timed while a compile runs (in a thread of the same session worker) waits
    for the GIL, compiled ones included (docs/benchmarks.md, bench_graph)."""
    finished = log.count(INDUCTOR_OUTCOMES[0]) + log.count(INDUCTOR_OUTCOMES[2])
    return inductor_outcomes(log) - outcomes_before >= new_graphs and finished >= log.count(INDUCTOR_QUEUED)


def free_port() -> int:
    """A port found free and released: torch.distributed's anchors and --metrics-port (0 means off there); genie's nodes bind port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet(node: Any) -> None:
    """Drain a NodeProcess's output pipe, where it has one (older launchers piped it; newer log to a file)."""
    stream = getattr(getattr(node, "proc", None), "stdout", None)
    if stream is not None:
        drain(stream)


def drain(stream: Any, sink: list[str] | None = None) -> threading.Thread:
    """Keep reading a child's output pipe so the child never blocks on a full pipe."""
    def run() -> None:
        with contextlib.suppress(Exception):
            for line in stream:
                if sink is not None:
                    sink.append(line.rstrip())
                    del sink[:-200]

    t = threading.Thread(target=run, daemon=True, name="bench-drain")
    t.start()
    return t


class Children:
    """Child processes started with their own session; :meth:`stop_all` always ends every one."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
              stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
        proc = subprocess.Popen(list(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[str], timeout: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(Exception):
                    f.close()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()


def read_line(proc: subprocess.Popen[str], timeout: float, wanted: Any, what: str) -> str:
    """The first stdout line for which ``wanted(line)`` is true; raise with the child's stderr if none comes."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if wanted(line):
                return line
        elif proc.poll() is not None:
            break
    err = ""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(2)  # after EOF the child is exiting: let it finish so its stderr can be read
    if proc.poll() is not None and proc.stderr is not None:
        err = proc.stderr.read()[-4000:]
    raise RuntimeError(f"child {proc.args!r} gave no {what} within {timeout:g} s (rc={proc.poll()}): {err}")


def read_json_line(proc: subprocess.Popen[str], timeout: float, prefix: str = "RESULT ") -> dict[str, Any]:
    """Wait for a line ``RESULT {json}`` on the child's stdout; raise with its stderr if it never comes."""
    line = read_line(proc, timeout, lambda text: text.startswith(prefix), "result")
    return json.loads(line[len(prefix):])


def emit(result: dict[str, Any]) -> None:
    """What a child prints for :func:`read_json_line`."""
    print("RESULT " + json.dumps(result), flush=True)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks (and child cleanup) run."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def vm_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM / VmPeak of a process in bytes, from /proc/<pid>/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmPeak", "VmSize"):
                out[key] = int(rest.split()[0]) * 1024
    return out


@contextlib.contextmanager
def pinned(groups: Sequence[int], cpus: set[int]) -> Iterator[None]:
    """Pin this thread and every thread of every process in the process groups ``groups`` (children
    started with their own session: a node, its forkserver and its workers; an echo peer) to ``cpus``,
    as ``taskset -a -c`` would; each thread's own affinity is put back on exit."""
    tids = [(os.getpid(), threading.get_native_id())]
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) in groups:
                    tids += [(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")]
    before: list[tuple[int, set[int]]] = []
    try:
        for _, tid in tids:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                previous = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpus)
                before.append((tid, previous))
        yield
    finally:
        for tid, previous in before:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, previous)


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset VmHWM to the current RSS (``5`` into clear_refs, Linux >= 4.0); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Table:
    """The closing table: figure, value, baseline, ratio, target, met/missed."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str, str]] = []

    def add(self, figure: str, value: str, baseline: str, ratio: str, target: str, met: bool | None) -> None:
        verdict = "-" if met is None else ("met" if met else "MISSED")
        self.rows.append((figure, value, baseline, ratio, target, verdict))

    def print(self, title: str) -> None:
        head = ("figure", "value", "baseline", "ratio", "target", "met/missed")
        widths = [max(len(r[i]) for r in [head, *self.rows]) for i in range(len(head))]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        print("  ".join("-" * w for w in widths))
        for row in self.rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))

    @property
    def missed(self) -> list[str]:
        return [r[0] for r in self.rows if r[5] == "MISSED"]


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def fmt_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / (1 << 20):.0f} MiB/s"


class MachineLoad:
    """How busy the whole machine was between :meth:`start` and :meth:`report` (this benchmark included).

    The benchmarks share their cores with whatever else runs; a busy machine slows
    every figure, baselines included, and this line says how busy it was.
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._t0 = psutil.cpu_times()
        self._load0 = os.getloadavg()

    def report(self) -> str:
        t1 = self._psutil.cpu_times()
        busy0 = sum(self._t0) - self._t0.idle - getattr(self._t0, "iowait", 0)
        busy1 = sum(t1) - t1.idle - getattr(t1, "iowait", 0)
        total = sum(t1) - sum(self._t0)
        share = 100 * (busy1 - busy0) / total if total > 0 else float("nan")
        load1 = os.getloadavg()
        return (f"machine: {os.cpu_count()} CPUs {share:.0f} % busy during the run (all processes, this one "
                f"included); load average {self._load0[0]:.2f} at start, {load1[0]:.2f} at end")
