"""genie on a GPU against native CUDA on the same host, in one run: how much slower is my model remotely?

Each workload runs three ways, each in its own client process: **native** (the model on ``cuda:0``
in the client), and through genie with the client on the same host over **shm** and **tcp**
(``genie serve --devices cuda:0``, process isolation as shipped). Ratios are genie / native from
the same run:

- GPT-2 small (124M, from a config) training step, bf16 autocast, fused AdamW, batch 8x512;
- ResNet-50 training step, batch 64, channels_last, bf16 autocast (torchvision, else timm);
- BERT-base inference, batch 32x128;
- GPT-2 small greedy decode with its KV cache, tokens/s;
- the GPT-2 step and BERT inference again under ``torch.compile`` (``backend="genie"`` remotely,
  inductor natively);
- the two compiled workloads once more on a node started with ``--compile-replays inductor`` (the node
  compiles each replayed graph with inductor, in the background; the client waits for those compiles,
  read from the node's log, before timing): ``[shm+inductor]`` rows;
- the GPT-2 step captured once and replayed: ``torch.accelerator.Graph`` remotely (one command a step;
  a CUDA graph on the server), ``torch.cuda.graph`` natively;
- 1 GiB upload (from the user's pageable tensor), download into a reused buffer (``dst.copy_(t)``) and
  ``.cpu()`` into new memory, against natively ``cudaMemcpy`` from and into pinned memory (the upload and
  ``dst.copy_`` into a pinned ``dst``) and ``.cpu()`` into new pageable memory, and over tcp against the raw
  channel: the same bytes sent one way over loopback TCP into a reused buffer (the target's baseline;
  measured before and after the runs, the better one used);
- session start (``genie.init`` and the first op) and the GPU memory a session adds (its worker's
  CUDA context and caches, read with nvidia-smi).

``--profile`` runs none of that: it profiles the op-by-op workloads (GPT-2 step, ResNet-50 step, BERT, decode)
natively under ``torch.profiler`` and on a node started with ``--profile-sessions`` (genie.server.profiles),
and prints the device's time per step on both sides, with the kernels whose time differs most: whether the
GPU waits for the node (genie's device time near native's, its wall far above) or runs more or other kernels.

``--quick`` (what scripts/gpu-check runs) takes fewer steps and smaller transfers; ``--tiny --device
cpu`` runs the same code with tiny models against a CPU server, to check the script on a machine
without a GPU before spending GPU time on it (about 4 minutes here; its figures mean nothing).
Results: a table on stdout and, with ``--json``, every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as c  # noqa: E402

#: Targets (issue 33), genie / native.
TARGETS = {"gpt2_train": 1.15, "gpt2_train_compiled": 1.05, "gpt2_train_graph": 1.05, "resnet50_train": 1.10, "bert_infer": 1.10,
           "bert_infer_compiled": 1.10}
#: The workloads run again on a node with --compile-replays inductor.
INDUCTOR_WORKLOADS = ("gpt2_train_compiled", "bert_infer_compiled")
DECODE_TARGET = 0.85  # tokens/s, genie / native
#: The workloads --profile runs (op by op: what the node runs is what a local run launches, op for op).
PROFILED = ("gpt2_train", "resnet50_train", "bert_infer", "decode")
TRANSFER_TARGET = 0.9  # against the raw channel


# -- workloads (run in a client process; ``dev`` is cuda:0, cpu or remote_accelerator:0) ---------------------

def _autocast(dev: str) -> Any:
    import torch

    return torch.autocast(device_type=torch.device(dev).type, dtype=torch.bfloat16)


def _node_log(a: argparse.Namespace) -> str:
    return Path(a.node_log).read_text(errors="replace") if a.node_log else ""


def _outcomes(a: argparse.Namespace) -> int:
    return c.inductor_outcomes(_node_log(a))


def _settle(a: argparse.Namespace, before: int, graphs: int) -> Any:
    """After the warm-up of a compiled workload on an inductor node: wait (at most 10 minutes) until the node has
    logged an outcome for ``graphs`` more graphs and finished every compile it queued (a model may give more graphs
    than its forward and backward: graph breaks; bench_graph timed a GPT while compiles still ran); nothing to wait
    for on other nodes. Prints how long it waited."""
    def wait() -> None:
        started = time.monotonic()
        while a.node_log and time.monotonic() < started + 600 and not c.inductor_settled(_node_log(a), before, graphs):
            time.sleep(1)
        if a.node_log:
            print(f"waited {time.monotonic() - started:.0f} s for the inductor node's compiles", file=sys.stderr,
                  flush=True)
    return wait


#: (client) the node's pid, whose processes' CPU time _timed counts per step (0: a native run, no node)
_NODE_PID = [0]


def _node_cpu() -> Any:
    """A function giving the CPU seconds the node and its session workers used so far (None off a genie run): where
    a step's time goes when the GPU waits (the node's launches, the client's Python, or neither)."""
    if not _NODE_PID[0]:
        return lambda: None
    import psutil

    root = psutil.Process(_NODE_PID[0])
    procs = [root, *root.children(recursive=True)]  # the session worker exists by now

    def used() -> float:
        total = 0.0
        for p in procs:
            # Every thread's run time in ns (/proc/PID/task/*/schedstat); psutil's times tick at 10 ms.
            tasks = glob.glob(f"/proc/{p.pid}/task/*/schedstat")
            for task in tasks:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int(Path(task).read_text().split()[0]) / 1e9
            if not tasks:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
        return total
    return used


def _timed(step: Any, steps: int, warmup: int, settle: Any = None) -> dict[str, Any]:
    for _ in range(warmup):
        step()
    if settle is not None:
        settle()
        step()
    walls = []
    node_cpu = _node_cpu()
    cpu0, node0 = time.process_time(), node_cpu()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    cpu1, node1 = time.process_time(), node_cpu()
    return {"seconds": statistics.median(walls), "samples": walls, "client_cpu_s": (cpu1 - cpu0) / steps,
            "node_cpu_s": None if node0 is None else (node1 - node0) / steps, "mean_s": sum(walls) / steps,
            "steps_run": warmup + steps + (settle is not None)}


def _gpt2_config(tiny: bool) -> Any:
    from transformers import GPT2Config

    if tiny:
        return GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=2)
    return GPT2Config()  # 124M


def gpt2_train(dev: str, a: argparse.Namespace, compiled: bool = False) -> dict[str, Any]:
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = _gpt2_config(a.tiny)
    model: Any = GPT2LMHeadModel(cfg).to(dev)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch, seq = (2, 64) if a.tiny else (8, 512)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq)).to(dev)
    run = _compile(model, dev, a) if compiled else model
    settle = _settle(a, _outcomes(a), 2) if compiled else None  # forward and backward

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(dev):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        loss.item()

    return _timed(step, a.steps, a.warmup + (2 if compiled else 0), settle)


def gpt2_train_graph(dev: str, a: argparse.Namespace) -> dict[str, Any]:
    """The GPT-2 training step captured once and replayed: torch.accelerator.Graph remotely (genie.Graph on a torch
    without it; one command per step), a CUDA graph natively (torch.cuda.graph, after a warm-up on a side stream as its docs ask); on a CPU
    device (the --device cpu dry run's native side) the step runs as it is."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = _gpt2_config(a.tiny)
    model: Any = GPT2LMHeadModel(cfg).to(dev)  # type: ignore[arg-type]
    # A CUDA graph captures the optimizer step only when its state lives on the device (capturable).
    capturable = torch.device(dev).type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capturable)
    batch, seq = (2, 64) if a.tiny else (8, 512)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq)).to(dev)

    def body() -> Any:
        opt.zero_grad(set_to_none=True)
        with _autocast(dev):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    kind = torch.device(dev).type
    if kind == "cpu":
        return _timed(lambda: body().item(), a.steps, a.warmup)
    if kind == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(a.warmup + 1):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph: Any = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = body()
    else:
        for _ in range(a.warmup + 1):
            body().item()  # the optimizer's state exists before the capture
        # torch.accelerator.Graph where this torch serves it (2.13 on), else genie.Graph: the same capture (the GPU
        # machine's image has torch 2.11)
        import genie
        from genie import _C

        graph = torch.accelerator.Graph() if hasattr(_C, "register_graph_impl") else genie.Graph()
        with graph:
            static_loss = body()

    def step() -> None:
        graph.replay()
        static_loss.item()

    return _timed(step, a.steps, 1)


def _hf_resnet(tiny: bool) -> Any:
    """transformers' ResNet-50 (its default config; a small bottleneck net when ``tiny``) returning logits."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = (ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]) if tiny
           else ResNetConfig())
    cfg.num_labels = 1000  # ImageNet's classes, as torchvision's

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = ResNetForImageClassification(cfg)

        def forward(self, x: Any) -> Any:
            return self.net(x).logits

    return Logits()


def resnet50_train(dev: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    try:
        import torchvision

        model = (torchvision.models.resnet18 if a.tiny else torchvision.models.resnet50)()
    except ImportError:
        try:
            import timm

            model = timm.create_model("resnet18" if a.tiny else "resnet50", pretrained=False)
        except ImportError:  # transformers' ResNet from its config (ResNetConfig() is ResNet-50): a CPU host's venv
            model = _hf_resnet(a.tiny)
    model = model.to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    shape = (4, 3, 64, 64) if a.tiny else (64, 3, 224, 224)
    x = torch.randn(shape).to(dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (shape[0],)).to(dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(dev):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()

    # Steady state, as a training run is after its first steps: genie drops the host shadow of each batch norm's
    # num_batches_tracked (written every step, never read) after 16 such writes (genie.device.shadows).
    return _timed(step, a.steps, a.warmup if a.tiny else max(a.warmup, 18))


def bert_infer(dev: str, a: argparse.Namespace, compiled: bool = False) -> dict[str, Any]:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = (BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=128) if a.tiny else BertConfig())
    model: Any = BertModel(cfg).to(dev).eval()  # type: ignore[arg-type]
    batch, seq = (4, 32) if a.tiny else (32, 128)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq)).to(dev)
    run = _compile(model, dev, a) if compiled else model
    settle = _settle(a, _outcomes(a), 1) if compiled else None

    def step() -> None:
        with torch.no_grad():
            run(input_ids=ids).last_hidden_state.sum().item()

    return _timed(step, a.steps, a.warmup + (2 if compiled else 0), settle)


def decode(dev: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = _gpt2_config(a.tiny)
    model: Any = GPT2LMHeadModel(cfg).to(dev).eval()  # type: ignore[arg-type]
    ids = torch.randint(0, cfg.vocab_size, (1, 32)).to(dev)
    new = 16 if a.quick or a.tiny else 64

    def step() -> None:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        out[0, -1].item()

    timed = _timed(step, max(2, a.steps // 2), 1)
    timed["tokens_per_s"] = new / timed["seconds"]
    return timed


def transfer(dev: str, a: argparse.Namespace) -> dict[str, Any]:
    """Upload, download into a preallocated buffer, and ``.cpu()`` into new memory, three rounds each (medians).

    Natively (cuda): the upload reads pinned memory and the download lands in a preallocated pinned buffer
    (``dst.copy_(on)``): both are what "cudaMemcpy pinned" means; ``.cpu()`` lands in new pageable memory.
    Remotely: the upload reads the user's pageable tensor, the download lands in a preallocated (reused)
    pageable buffer, and ``.cpu()`` in new memory as natively: the three results stay alive until the end,
    so no round reuses the memory of another (genie's host pool included).
    """
    import torch

    nbytes = (64 << 20) if a.tiny else ((256 << 20) if a.quick else (1 << 30))
    cuda = dev.startswith("cuda")
    host = torch.empty(nbytes, dtype=torch.uint8).random_()
    src = host.pin_memory() if cuda else host
    dst = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)  # touched once: a reused buffer
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    ups, intos, fresh, kept = [], [], [], []
    for _ in range(3):
        t0 = time.perf_counter()
        on = src.to(dev, non_blocking=True)
        sync()
        on.view(-1)[-1].item()  # remotely: the upload is done when the node answers
        t1 = time.perf_counter()
        dst.copy_(on, non_blocking=cuda)
        sync()
        t2 = time.perf_counter()
        kept.append(on.cpu())
        t3 = time.perf_counter()
        ups.append(t1 - t0)
        intos.append(t2 - t1)
        fresh.append(t3 - t2)
        del on
    assert torch.equal(dst[-4096:], host[-4096:]) and torch.equal(kept[-1][-4096:], host[-4096:])
    return {"bytes": nbytes, "up_s": statistics.median(ups), "down_into_s": statistics.median(intos),
            "down_fresh_s": statistics.median(fresh), "pinned": cuda}


def _compile(model: Any, dev: str, a: argparse.Namespace) -> Any:
    import torch

    return torch.compile(model, backend="genie" if dev.startswith("remote_accelerator") else "inductor")


WORKLOADS: dict[str, Any] = {
    "gpt2_train": gpt2_train,
    "gpt2_train_compiled": lambda dev, a: gpt2_train(dev, a, compiled=True),
    "gpt2_train_graph": gpt2_train_graph,
    "resnet50_train": resnet50_train,
    "bert_infer": bert_infer,
    "bert_infer_compiled": lambda dev, a: bert_infer(dev, a, compiled=True),
    "decode": decode,
    "transfer": transfer,
}


def run_client(a: argparse.Namespace) -> int:
    """One client process: native on ``--device`` or genie against ``--port``; one RESULT line per workload."""
    import torch

    from genie.server import profiles

    dev = a.device
    _NODE_PID[0] = a.node_pid
    if a.mode == "genie":
        import genie

        t0 = time.perf_counter()
        genie.init_sync(master_addr="127.0.0.1", master_port=a.port, timeout=120)
        t1 = time.perf_counter()
        dev = "remote_accelerator:0"
        torch.ones(4, device=dev).sum().item()
        c.emit({"name": "session", "init_s": t1 - t0, "first_op_s": time.perf_counter() - t1})
    for name in a.workloads.split(","):
        try:
            # --profile: natively, the workload under torch.profiler here (genie's: the node's session profile)
            with profiles.profiled(a.profile_dir if a.mode == "native" else None, f"native-{name}", [dev]):
                result = WORKLOADS[name](dev, a)
            result.pop("samples", None)
            c.emit({"name": name, "ok": True, **result})
        except Exception as exc:  # a failure is a result: report it and go on with the others
            c.emit({"name": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:600]}"})
    if a.mode == "genie":
        import genie

        c.emit({"name": "stats", **{k: v for k, v in genie.stats().items() if k != "sync_points"}})
        genie.shutdown_sync()
    c.emit({"name": "done"})
    return 0


# -- the parent ---------------------------------------------------------------------------------------------

def gpu_memory_used_mib() -> float | None:
    """GPU 0's used memory in MiB (nvidia-smi), or None where there is no NVIDIA GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    with contextlib.suppress(subprocess.SubprocessError, ValueError, OSError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.split()[0])
    return None


def _tune_raw(sock: socket.socket) -> None:
    """The socket options genie's tcp channel sets (genie.transport.stream)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)


def _raw_sender(port: int, nbytes: int) -> None:
    """The raw channel's sending process: ``nbytes`` from one buffer each time the receiver asks."""
    data = memoryview(bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        _tune_raw(sock)
        while sock.recv(1):
            sock.sendall(data)


def raw_tcp_rate(nbytes: int, rounds: int = 5) -> float:
    """Bytes per second of ``nbytes`` sent one way over loopback TCP (the raw channel under tcp): another
    process's ``sendall`` from one buffer (as genie's node is another process), received with ``MSG_WAITALL``
    into one preallocated buffer, socket options as genie's tcp channel sets them; the median of ``rounds``,
    each timed by the receiver from its request to the last byte."""
    import multiprocessing

    size = max(1, nbytes >> 20) << 20
    listener = socket.create_server(("127.0.0.1", 0))
    sender = multiprocessing.get_context("spawn").Process(target=_raw_sender, args=(listener.getsockname()[1], size),
                                                          daemon=True)
    sender.start()
    back = memoryview(bytearray(size))  # zeroed: its pages are touched before the first round
    times = []
    try:
        listener.settimeout(60)
        conn, _ = listener.accept()
        with conn:
            _tune_raw(conn)
            for _ in range(rounds):
                t0 = time.perf_counter()
                conn.sendall(b"x")
                got = 0
                while got < size:
                    n = conn.recv_into(back[got:], size - got, socket.MSG_WAITALL)
                    if not n:
                        raise ConnectionError("the raw TCP sender went away")
                    got += n
                times.append(time.perf_counter() - t0)
    finally:
        listener.close()
        sender.join(timeout=10)
        if sender.is_alive():
            sender.kill()
    return size / statistics.median(times)


def run_mode(kids: c.Children, a: argparse.Namespace, mode: str, port: int = 0,
             env: dict[str, str] | None = None, workloads: str = "", node_log: str = "",
             node_pid: int = 0, profile_dir: str = "") -> dict[str, dict[str, Any]]:
    argv = [sys.executable, os.path.abspath(__file__), "--role", "client", "--mode", mode, "--port", str(port),
            "--device", a.device, "--workloads", workloads or a.workloads, "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--node-log", node_log, "--node-pid", str(node_pid),
            "--profile-dir", profile_dir]
    argv += ["--quick"] * a.quick + ["--tiny"] * a.tiny
    proc = kids.start(argv, env=env)
    results: dict[str, dict[str, Any]] = {}
    while True:
        got = c.read_json_line(proc, a.client_timeout)
        if got["name"] == "done":
            break
        if got["name"] == "session":  # the session's worker holds its CUDA context now
            got["gpu_memory_mib"] = gpu_memory_used_mib()
        results[got.pop("name")] = got
    kids.stop(proc)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="parent", choices=("parent", "client"))
    p.add_argument("--mode", default="native", choices=("native", "genie"))
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--device", default="cuda:0", help="cuda:0 (the GPU), or cpu to check the script on a CPU host")
    p.add_argument("--backends", default="shm,tcp")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--quick", action="store_true", help="fewer steps, smaller transfers (scripts/gpu-check)")
    p.add_argument("--tiny", action="store_true", help="tiny models (checking the script, not measuring)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--client-timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--inductor-backend", default="shm",
                   help="the backend of the run on a --compile-replays inductor node ('' to skip it)")
    p.add_argument("--node-log", default="", help="(client) the inductor node's log, to wait for its compiles")
    p.add_argument("--node-pid", type=int, default=0, help="(client) the node's pid: its CPU time per step is counted")
    p.add_argument("--profile", action="store_true",
                   help="instead of the timed runs: the device time per step of " + ", ".join(PROFILED) + ", natively "
                        "(torch.profiler) and on a node started with --profile-sessions, kernel by kernel")
    p.add_argument("--profile-dir", default="", help="(client) where a native run writes its profile")
    p.add_argument("--profile-out", default="", help="(--profile) where the profiles' files stay")
    a = p.parse_args()
    a.steps = a.steps or (3 if a.tiny else 5 if a.quick else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 2 if a.quick else 3)
    if a.role == "client":
        return run_client(a)
    return run_parent(a)


def run_parent(a: argparse.Namespace) -> int:
    import torch

    from genie.cluster.launch import NodeProcess

    info = {"torch": torch.__version__, "device": a.device, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") and torch.cuda.is_available() else None,
            "quick": a.quick, "tiny": a.tiny, "steps": a.steps}
    print(f"bench_gpu: {info}", flush=True)
    report: dict[str, Any] = {"info": info, "runs": {}}
    if a.profile:
        with c.Children() as kids:
            report["profile"] = run_profiles(kids, a)
        print_profiles(report["profile"])
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1, default=str))
        return 0
    raw_bytes = (64 << 20) if a.tiny else ((256 << 20) if a.quick else (1 << 30))  # the transfer workload's size
    raw_before = raw_tcp_rate(raw_bytes) if "transfer" in a.workloads.split(",") else 0.0
    with c.Children() as kids:
        report["runs"]["native"] = run_mode(kids, a, "native")
        print("native done", flush=True)
        for backend in a.backends.split(","):
            env = {"GENIE_BACKEND": backend, "GENIE_LOG_LEVEL": "WARNING"}
            before = gpu_memory_used_mib()
            with NodeProcess("--log-level", "INFO", "serve", "--port", "0", "--devices", a.device, env=env,
                             ready_timeout=300) as node:
                idle = gpu_memory_used_mib()
                runs = run_mode(kids, a, "genie", node.control_port, env=env, node_pid=node.pid)
                runs["gpu_memory_mib"] = {"before_node": before, "node_idle": idle}
                runs["cuda_graphs"] = {o: node.log().count(o) for o in c.CUDA_GRAPH_OUTCOMES}
                report["runs"][backend] = runs
            print(f"genie over {backend} done", flush=True)
        compiled = [w for w in a.workloads.split(",") if w in INDUCTOR_WORKLOADS]
        if a.inductor_backend and compiled:
            env = {"GENIE_BACKEND": a.inductor_backend, "GENIE_LOG_LEVEL": "WARNING"}
            with NodeProcess("--log-level", "INFO", "serve", "--port", "0", "--devices", a.device,
                             "--compile-replays", "inductor", env=env, ready_timeout=300) as node:
                report["runs"][f"{a.inductor_backend}+inductor"] = run_mode(
                    kids, a, "genie", node.control_port, env=env, workloads=",".join(compiled),
                    node_log=node.log_path, node_pid=node.pid)
                text = node.log()
                report["runs"][f"{a.inductor_backend}+inductor"]["inductor_node"] = {
                    o: text.count(o) for o in (*c.INDUCTOR_OUTCOMES, c.INDUCTOR_QUEUED)}
            print(f"genie over {a.inductor_backend} with --compile-replays inductor done", flush=True)
    if raw_before:
        raw_after = raw_tcp_rate(raw_bytes)
        # The channel's rate: the better of before and after the runs (a busy moment understates it).
        report["raw_tcp_one_way"] = {"before_bytes_per_s": raw_before, "after_bytes_per_s": raw_after}
        report["raw_tcp_one_way_bytes_per_s"] = max(raw_before, raw_after)
    report["table"] = summarise(report, a)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


def run_profiles(kids: c.Children, a: argparse.Namespace) -> dict[str, Any]:
    """--profile: each of :data:`PROFILED` once natively under torch.profiler and once on a node started with
    ``--profile-sessions`` (the first of ``--backends``), each in a client process of its own (one session per
    workload). Per step (warm-up steps included, on both sides alike): the device's time without uploads, its
    device ops, the CPU time in ATen ops, and every device row's time. The profiles' files stay in
    ``--profile-out`` (a temporary directory by default)."""
    import tempfile

    from genie.cluster.launch import NodeProcess

    root = Path(a.profile_out or tempfile.mkdtemp(prefix="genie-bench-profiles-"))
    root.mkdir(parents=True, exist_ok=True)
    work = [w for w in PROFILED if w in a.workloads.split(",")]
    out: dict[str, Any] = {"backend": a.backends.split(",")[0], "files": str(root), "workloads": {}}
    for name in work:
        result = run_mode(kids, a, "native", workloads=name, profile_dir=str(root)).get(name, {})
        out["workloads"][name] = {"native": _per_step(result, root / f"native-{name}.json")}
    print("native profiles done", flush=True)
    env = {"GENIE_BACKEND": out["backend"], "GENIE_LOG_LEVEL": "WARNING"}
    sessions = root / "node"
    with NodeProcess("--log-level", "INFO", "serve", "--port", "0", "--devices", a.device, "--profile-sessions",
                     str(sessions), env=env, ready_timeout=300) as node:
        for name in work:
            before = set(sessions.glob("session-*.json"))
            result = run_mode(kids, a, "genie", node.control_port, env=env, workloads=name,
                              node_pid=node.pid).get(name, {})
            out["workloads"][name]["genie"] = _per_step(result, _new_profile(sessions, before))
    print(f"genie profiles over {out['backend']} done", flush=True)
    return out


def _new_profile(directory: Path, before: set[Path], timeout: float = 120.0) -> Path | None:
    """The session profile the node writes once the client has gone (None if none came within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = sorted(set(directory.glob("session-*.json")) - before)
        if fresh:
            return fresh[-1]
        time.sleep(0.2)
    return None


def _per_step(result: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """A workload's profile per step it ran (``steps_run``: warm-up and timed)."""
    if not result.get("ok") or path is None or not path.exists():
        return {"ok": False, "error": result.get("error") or f"no profile ({path or 'the node wrote none'})"}
    data = json.loads(path.read_text())
    steps = result["steps_run"]
    return {"ok": True, "steps": steps, "device_ms": (data["device_s"] - data["host_to_device_s"]) * 1e3 / steps,
            "uploads_ms": data["host_to_device_s"] * 1e3 / steps, "device_ops": data["kernels"] / steps,
            "cpu_op_ms": data["cpu_op_s"] * 1e3 / steps, "file": str(path), "wall_ms": result["seconds"] * 1e3,
            "rows": {r["name"]: r["self_device_us"] / 1e3 / steps for r in data["rows"]
                     if r["device"] != "cpu" and not r["name"].startswith("Memcpy HtoD")}}


def print_profiles(profile: dict[str, Any], rows: int = 8) -> None:
    """Device time per step, native against genie, and the device rows that differ most."""
    print(f"Device time per step, uploads apart (profiles in {profile['files']}; genie over {profile['backend']}):")
    for name, sides in profile["workloads"].items():
        n, g = sides.get("native", {}), sides.get("genie", {})
        if not (n.get("ok") and g.get("ok")):
            print(f"  {name}: failed: {g.get('error') or n.get('error')}")
            continue
        ratio = f"{g['device_ms'] / n['device_ms']:.2f}x" if n["device_ms"] else "-"
        print(f"  {name}: native {n['device_ms']:.2f} ms in {n['device_ops']:.0f} device ops, genie "
              f"{g['device_ms']:.2f} ms in {g['device_ops']:.0f} ({ratio}); a timed step's wall (profiled): native "
              f"{n['wall_ms']:.1f} ms, genie {g['wall_ms']:.1f} ms; CPU in ATen ops: native "
              f"{n['cpu_op_ms']:.2f} ms, the node's session {g['cpu_op_ms']:.2f} ms")
        names = set(n["rows"]) | set(g["rows"])
        differ = sorted(names, key=lambda k: abs(g["rows"].get(k, 0.0) - n["rows"].get(k, 0.0)), reverse=True)
        for key in differ[:rows]:
            print(f"    {g['rows'].get(key, 0.0):8.3f} ms genie {n['rows'].get(key, 0.0):8.3f} ms native  {key[:110]}")


def summarise(report: dict[str, Any], a: argparse.Namespace) -> list[list[str]]:
    """Print the ratio table (genie / native per backend, with targets); return its rows."""
    native = report["runs"]["native"]
    rows: list[list[str]] = []
    table = c.Table()
    inductor = [f"{a.inductor_backend}+inductor"] if f"{a.inductor_backend}+inductor" in report["runs"] else []
    for backend in a.backends.split(",") + inductor:
        runs = report["runs"].get(backend, {})
        for name, target in TARGETS.items():
            if backend in inductor and name not in INDUCTOR_WORKLOADS:
                continue
            n, g = native.get(name, {}), runs.get(name, {})
            if not (n.get("ok") and g.get("ok")):
                why = g.get("error") or n.get("error") or "not run"
                table.add(f"{name} [{backend}]", "failed", "-", "-", f"<= {target}x", False if g else None)
                rows.append([name, backend, "failed", why])
                continue
            ratio = g["seconds"] / n["seconds"]
            table.add(f"{name} [{backend}]", c.fmt_ms(g["seconds"]), f"native {c.fmt_ms(n['seconds'])}",
                      f"{ratio:.2f}x", f"<= {target}x", ratio <= target)
            rows.append([name, backend, f"{ratio:.3f}", ""])
        n, g = native.get("decode", {}), runs.get("decode", {})
        if n.get("ok") and g.get("ok"):
            ratio = g["tokens_per_s"] / n["tokens_per_s"]
            table.add(f"decode tokens/s [{backend}]", f"{g['tokens_per_s']:.1f}", f"native {n['tokens_per_s']:.1f}",
                      f"{ratio:.2f}x", f">= {DECODE_TARGET}x", ratio >= DECODE_TARGET)
            rows.append(["decode", backend, f"{ratio:.3f}", ""])
        _transfer_rows(table, report, backend, native.get("transfer", {}), runs.get("transfer", {}))
        session, mem = runs.get("session", {}), runs.get("gpu_memory_mib", {})
        if session:
            table.add(f"session start [{backend}]", c.fmt_ms(session["init_s"] + session["first_op_s"]),
                      f"init {c.fmt_ms(session['init_s'])}", "-", "-", None)
        if mem.get("node_idle") is not None and mem.get("before_node") is not None:
            table.add(f"node idle GPU memory [{backend}]", f"{mem['node_idle'] - mem['before_node']:.0f} MiB", "-",
                      "-", "-", None)
            if session.get("gpu_memory_mib") is not None:
                table.add(f"one session's GPU memory [{backend}]",
                          f"{session['gpu_memory_mib'] - mem['node_idle']:.0f} MiB", "-", "-", "-", None)
    table.print(f"bench_gpu ({report['info']['device']}, torch {report['info']['torch']})")
    _print_cpu(report)
    return rows


def _print_cpu(report: dict[str, Any]) -> None:
    """Where each timed step's wall goes on the host's CPUs: the client process's CPU per step and (genie runs) the
    node's, its session worker's included. A node busy for about the whole wall is what the GPU waits on."""
    lines = []
    for run, results in report["runs"].items():
        for name, r in results.items():
            if isinstance(r, dict) and r.get("ok") and r.get("client_cpu_s") is not None:
                node = r.get("node_cpu_s")
                lines.append(f"  {name} [{run}]: mean wall {c.fmt_ms(r['mean_s'])}, client CPU "
                             f"{c.fmt_ms(r['client_cpu_s'])}" + (f", node CPU {c.fmt_ms(node)}" if node is not None
                                                                 else ""))
    if lines:
        print("CPU per step (mean over the timed steps):\n" + "\n".join(lines), flush=True)
    graphs = [f"  [{run}]: " + ", ".join(f"{n} {o}" for o, n in results["cuda_graphs"].items())
              for run, results in report["runs"].items() if results.get("cuda_graphs")]
    if graphs:  # the node's log: every graph of every workload of that run (compiled and captured rows)
        print("CUDA graphs (captures and refusals in the node's log):\n" + "\n".join(graphs), flush=True)


#: The transfer rows: (the result's key, what genie's figure is, what native's figure is).
TRANSFER_ROWS = (
    ("up_s", "upload from pageable memory", "cudaMemcpy from pinned"),
    ("down_into_s", "download into a reused buffer", "cudaMemcpy into pinned"),
    ("down_fresh_s", "download .cpu() into new memory", ".cpu() into new pageable"),
)


def _transfer_rows(table: Any, report: dict[str, Any], backend: str, n: dict[str, Any], g: dict[str, Any]) -> None:
    """Each transfer figure against native's (on a cuda run) and, over tcp, against the raw channel one way: the
    upload and the download into a reused buffer against a reused buffer's raw receive (the target), ``.cpu()``
    shown against it without one (new memory costs its page population, raw or not)."""
    if not g.get("ok"):
        if g:
            table.add(f"transfer [{backend}]", "failed", "-", "-", "-", False)
        return
    native_ok = n.get("ok") and n.get("pinned")  # a cpu run's "native" copies nothing: no baseline
    raw = report.get("raw_tcp_one_way_bytes_per_s") or 0.0
    mib = g["bytes"] >> 20
    for key, what, native_what in TRANSFER_ROWS:
        rate = g["bytes"] / g[key]
        if native_ok:
            native_rate = n["bytes"] / n[key]
            table.add(f"{mib} MiB {what} [{backend}]", c.fmt_rate(rate),
                      f"{native_what} {c.fmt_rate(native_rate)}", f"{rate / native_rate:.2f}x", "-", None)
        else:
            table.add(f"{mib} MiB {what} [{backend}]", c.fmt_rate(rate), "no native baseline (cpu)", "-", "-", None)
        if backend == "tcp" and raw:
            targeted = key != "down_fresh_s"
            table.add(f"  vs raw TCP one way [{backend}]", c.fmt_rate(rate), f"raw {c.fmt_rate(raw)} (best of 2)",
                      f"{rate / raw:.2f}x", f">= {TRANSFER_TARGET}x" if targeted else "-",
                      rate / raw >= TRANSFER_TARGET if targeted else None)


if __name__ == "__main__":
    raise SystemExit(main())
