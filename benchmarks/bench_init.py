"""How long ``genie.init`` takes against a local master, cold and warm, against torch.distributed (issue 3).

    .venv/bin/python benchmarks/bench_init.py               # about 1 minute on 2 cores
    .venv/bin/python benchmarks/bench_init.py --cold 3 --warm 10

A ``genie serve --devices cpu`` master runs on loopback for the whole run. Figures:

- cold, in a fresh process: the first ``genie.init_sync`` call only (imports already
  done), and the whole process (interpreter start, ``import torch``, ``import genie``,
  init, shutdown) measured from the parent;
- warm: ``init_sync``/``shutdown_sync`` repeated in one process (after a first one);
- cold with genie's lazily imported modules and its plugins imported before the clock
  starts: the anchors' children import ``torch.distributed`` and ``torch.distributed.rpc``
  before theirs, so this is the like-for-like comparison with them;
- genie's own per-phase durations (``ClusterState.phase_durations``);
- anchors in the same run, each world size 2 on loopback: ``init_process_group("gloo")``
  with a TCP store, and ``torch.distributed.rpc.init_rpc`` (TensorPipe). Both processes
  of an anchor import torch first; then rank 0 (the store's server, like genie's
  master) starts its init, and 0.3 s later rank 1; the figure is rank 1's init call,
  the joining side, like a genie client's. Cold is the first init in fresh processes, warm repeats it
  (destroy/shutdown in between, a new port each time).

The capability cache (``GENIE_CACHE_DIR``) is a private temporary one: a throwaway first
run fills it (its time is printed apart, as the once-per-host cost), so "cold" means a new
process on a host genie has run on before.

Target: genie's init <= 50 ms and below both anchors. The run is re-executed in a
private network namespace (``unshare -n``, only ``lo`` up) so the anchors cannot
look up names off the machine; ``--no-netns`` runs in place. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

TARGET_MS = 50.0
#: Seconds rank 0 of an anchor starts before rank 1 (its store is listening when rank 1 comes).
RANK0_HEAD_START = 0.3


# ---------------------------------------------------------------------------------------------
# children
# ---------------------------------------------------------------------------------------------

def child_genie(port: int, rounds: int, preimport: bool) -> int:
    """One fresh process: imports, then ``rounds`` init/shutdown pairs; the first is the cold one.

    ``preimport`` also imports the modules ``init`` imports lazily (and loads the plugins)
    before timing, to tell import cost from the work of init itself.
    """
    t_imports = time.perf_counter()
    import torch  # noqa: F401

    import genie
    import genie.api  # noqa: F401 - the face is lazy; its first use would load this inside the timed init

    if preimport:
        import genie.cluster.master  # noqa: F401
        import genie.cluster.membership  # noqa: F401
        import genie.cluster.runtime  # noqa: F401
        import genie.device.registration  # noqa: F401
        from genie.plugins import get_plugin_manager

        get_plugin_manager().transports()
    imports_s = time.perf_counter() - t_imports
    inits, phases = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state = genie.init_sync(master_addr="127.0.0.1", master_port=port)
        inits.append(time.perf_counter() - t0)
        phases.append(dict(state.phase_durations))
        genie.shutdown_sync()
    c.emit({"imports_s": imports_s, "inits": inits, "phases": phases})
    return 0


def child_anchor(kind: str, rank: int, ports: list[int]) -> int:
    """One rank of an anchor: import torch, say ready, wait for "go", then init/teardown once per port."""
    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    print("READY", flush=True)
    times = []
    for port in ports:
        if sys.stdin.readline().strip() != "go":
            return 1
        t0 = time.perf_counter()
        if kind == "gloo":
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            times.append(time.perf_counter() - t0)
            dist.barrier()  # both ranks are in before either tears down
            dist.destroy_process_group()
        else:
            opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4)
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
            times.append(time.perf_counter() - t0)
            rpc.shutdown()
        print("DONE", flush=True)
    del torch
    c.emit({"inits": times})
    return 0


# ---------------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------------

def run_genie_cold(kids: c.Children, port: int, runs: int,
                   preimport: bool = False) -> tuple[list[float], list[float], list[float], list[dict]]:
    """(first-init seconds, whole-process seconds, import seconds, phases) for ``runs`` fresh processes."""
    first, whole, imports, phases = [], [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = kids.start([sys.executable, os.path.abspath(__file__), "--role", "genie", "--genie-port", str(port),
                           "--rounds", "1", *(["--preimport"] if preimport else [])])
        res = c.read_json_line(proc, 120)
        proc.wait(30)
        whole.append(time.perf_counter() - t0)
        kids.stop(proc)
        first.append(res["inits"][0])
        imports.append(res["imports_s"])
        phases.append(res["phases"][0])
    return first, whole, imports, phases


def run_anchor(kids: c.Children, kind: str, rounds: int) -> list[float]:
    """Rank 1's init seconds (rank 0 started first), one per round (the first is cold)."""
    ports = [c.free_port() for _ in range(rounds)]
    me = [sys.executable, os.path.abspath(__file__), "--role", kind, "--ports", ",".join(map(str, ports))]
    ranks = [kids.start([*me, "--rank", str(r)], stdin=subprocess.PIPE) for r in (0, 1)]
    try:
        for p in ranks:
            _expect(p, "READY", 120)
        for _ in ports:
            # Rank 0 (the store's server) goes first, as genie's master is already up when a
            # client inits; the figure is rank 1's init, the joining side, like genie's client.
            for p in ranks:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
                time.sleep(RANK0_HEAD_START if p is ranks[0] else 0)
            for p in ranks:
                _expect(p, "DONE", 120)
        results = [c.read_json_line(p, 60)["inits"] for p in ranks]
        for p in ranks:
            p.wait(30)
        return results[1]
    finally:
        for p in ranks:
            kids.stop(p)


def _expect(proc: subprocess.Popen[str], word: str, timeout: float) -> None:
    c.read_line(proc, timeout, lambda line: line.strip() == word, word)


def _interpreter_costs(runs: int = 3) -> tuple[float, float]:
    """Median seconds of ``python -c pass`` and ``python -c 'import torch'``, for scale."""
    def once(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t0

    return (statistics.median(once("pass") for _ in range(runs)),
            statistics.median(once("import torch") for _ in range(runs)))


def ms(v: float) -> str:
    return f"{v * 1000:.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=5, help="fresh processes for the cold figures")
    parser.add_argument("--warm", type=int, default=20, help="init/shutdown pairs in one process")
    parser.add_argument("--no-netns", action="store_true", help="run in place, not in a private network namespace")
    parser.add_argument("--role", default="parent", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ports", default="", help=argparse.SUPPRESS)
    parser.add_argument("--genie-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--preimport", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--as-is", action="store_true",
                        help="keep the environment's bytecode settings (default: children share a private, "
                             "pre-warmed __pycache__ so imports cost what they cost in an installed genie)")
    args = parser.parse_args()
    if args.role == "genie":
        return child_genie(args.genie_port, args.rounds, args.preimport)
    if args.role in ("gloo", "rpc"):
        return child_anchor(args.role, args.rank, [int(p) for p in args.ports.split(",")])
    c.enter_private_netns()
    if not args.as_is:
        # PYTHONDONTWRITEBYTECODE=1 (set on some development machines) makes every fresh process
        # compile genie from source, which no installed genie does: give the children a private
        # bytecode cache instead, warmed by the throwaway runs below.
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="genie-bench-pycache-")
    # A private capability cache, so other runs' probes (or a reinstall elsewhere) do not decide what is cold.
    cache_dir = tempfile.mkdtemp(prefix="genie-bench-cache-")
    os.environ["GENIE_CACHE_DIR"] = cache_dir
    with c.sigterm_raises(), c.Children() as kids:
        try:
            return run_parent(kids, args)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
            if not args.as_is:
                shutil.rmtree(os.environ["PYTHONPYCACHEPREFIX"], ignore_errors=True)


def run_parent(kids: c.Children, args: argparse.Namespace) -> int:
    from genie.cluster.launch import NodeProcess

    print(f"bench_init: {os.cpu_count()} CPUs, network namespace: "
          f"{'private' if os.environ.get(c.NETNS_ENV) == '1' else 'host'}; {args.cold} cold runs, {args.warm} warm; "
          f"bytecode: {'as the environment has it' if args.as_is else 'private pre-warmed cache'} "
          f"(PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')})")
    load = c.MachineLoad()
    with NodeProcess("serve", "--port", "0", "--devices", "cpu") as server:
        c.quiet(server)
        port = server.control_port  # --port 0: any free port, bound
        # The first run on an empty capability cache probes every backend for real (DPDK starts an
        # EAL in a subprocess): a once-per-host cost, reported apart. It also fills the bytecode cache.
        first_ever, _, _, first_ever_phases = run_genie_cold(kids, port, 1)
        bare_s, torch_s = _interpreter_costs()
        first, whole, imports, phases = run_genie_cold(kids, port, args.cold)
        pre_first, _, _, _ = run_genie_cold(kids, port, args.cold, preimport=True)
        proc = kids.start([sys.executable, os.path.abspath(__file__), "--role", "genie", "--genie-port", str(port),
                           "--rounds", str(args.warm + 1)])
        warm_res = c.read_json_line(proc, 120)
        proc.wait(30)
        kids.stop(proc)
    warm = warm_res["inits"][1:]
    warm_phases = warm_res["phases"][1:]

    gloo = run_anchor(kids, "gloo", max(2, min(args.warm, 5) + 1))
    rpc = run_anchor(kids, "rpc", max(2, min(args.warm, 5) + 1))
    # Cold anchors: the first init of fresh process pairs (one pair already gave one).
    gloo_cold, rpc_cold = [gloo[0]], [rpc[0]]
    for _ in range(max(0, min(args.cold, 3) - 1)):
        gloo_cold.append(run_anchor(kids, "gloo", 1)[0])
        rpc_cold.append(run_anchor(kids, "rpc", 1)[0])

    med = statistics.median
    print(f"python -c pass: {ms(bare_s)};  python -c 'import torch': {ms(torch_s)}  (for scale)")
    print(f"genie first init on this host (empty capability cache, cold bytecode): {ms(first_ever[0])}, discovery "
          f"phase {first_ever_phases[0].get('discovery', 0) * 1000:.1f} ms (once per host; not in the table)")
    print(f"genie cold, first init call in a fresh process: median {ms(med(first))} "
          f"(runs: {', '.join(ms(v) for v in first)})")
    print(f"genie cold, first init call with genie's lazily imported modules and plugins imported beforehand: "
          f"median {ms(med(pre_first))} (so about {ms(med(first) - med(pre_first))} of the cold call is imports)")
    print(f"genie cold, whole process (start, import torch+genie {ms(med(imports))}, init, shutdown, exit): "
          f"median {ms(med(whole))}")
    print(f"genie warm, init in a process that already ran one: median {ms(med(warm))}, "
          f"min {ms(min(warm))}, max {ms(max(warm))}")
    phase_names = list(phases[0])
    print("genie phases, median ms (cold | warm): " + ", ".join(
        f"{p} {med([ph.get(p, 0) for ph in phases]) * 1000:.1f} | {med([ph.get(p, 0) for ph in warm_phases]) * 1000:.1f}"
        for p in phase_names))
    print(f"gloo init_process_group (world 2): cold median {ms(med(gloo_cold))}, warm median {ms(med(gloo[1:]))}")
    print(f"rpc init_rpc (world 2): cold median {ms(med(rpc_cold))}, warm median {ms(med(rpc[1:]))}")

    table = c.Table()
    for label, value, anchors in (("cold init call", med(first), (med(gloo_cold), med(rpc_cold))),
                                  ("warm init call", med(warm), (med(gloo[1:]), med(rpc[1:])))):
        table.add(f"genie {label}", ms(value), "target 50 ms", f"{value * 1000 / TARGET_MS:.2f}x", "<= 50 ms",
                  value * 1000 <= TARGET_MS)
        table.add(f"genie {label}", ms(value), f"gloo {ms(anchors[0])}", f"{value / anchors[0]:.2f}x", "< 1x",
                  value < anchors[0])
        table.add(f"genie {label}", ms(value), f"rpc {ms(anchors[1])}", f"{value / anchors[1]:.2f}x", "< 1x",
                  value < anchors[1])
    value = med(pre_first)
    table.add("genie cold init, modules pre-imported", ms(value), "target 50 ms", f"{value * 1000 / TARGET_MS:.2f}x",
              "<= 50 ms", value * 1000 <= TARGET_MS)
    table.add("genie cold init, modules pre-imported", ms(value), f"gloo {ms(med(gloo_cold))}",
              f"{value / med(gloo_cold):.2f}x", "< 1x", value < med(gloo_cold))
    table.add("genie cold init, modules pre-imported", ms(value), f"rpc {ms(med(rpc_cold))}",
              f"{value / med(rpc_cold):.2f}x", "< 1x", value < med(rpc_cold))
    table.add("genie cold process (imports+init)", ms(med(whole)), f"python+torch {ms(torch_s)}",
              f"{med(whole) / torch_s:.2f}x", "-", None)
    print(load.report())
    table.print("bench_init summary")
    print("phases (cold medians): " + json.dumps({p: round(med([ph.get(p, 0) for ph in phases]) * 1000, 2)
                                                  for p in phase_names}))
    print(f"missed: {', '.join(sorted(set(table.missed))) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
