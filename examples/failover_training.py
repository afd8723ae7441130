"""Training that survives losing its worker: checkpoint to the CPU, resume on another node.

Start a master and two workers, then train (``--prefer w1`` starts on w1)::

    genie serve --port 5555 --devices cpu --node-id master &
    genie worker --master 127.0.0.1:5555 --devices cpu --node-id w1 &
    genie worker --master 127.0.0.1:5555 --devices cpu --node-id w2 &
    .venv/bin/python examples/failover_training.py --master 127.0.0.1:5555 --prefer w1 --step-delay 0.2

Kill w1 while it trains (``kill -9``): the next step raises ``RemoteDeviceLost``,
``genie.device()`` picks a healthy device on another node, and training resumes
there from the last checkpoint. A checkpoint is the model's and the optimizer's
``state_dict`` with every tensor moved to the CPU (``tensor.cpu()``), which works
with any device. At the end the script replays, from the checkpoint it resumed
from, an uninterrupted run on the same device and prints whether the final losses
match. Exit code 0 when they match, 1 when not, 2 when the master cannot be reached.
Without ``--master`` it uses GENIE_MASTER_ADDR / GENIE_MASTER_PORT.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch.utils._pytree import tree_map

import genie
from genie.errors import ConnectError, DeviceError, InitTimeoutError, RemoteDeviceLost


def to_cpu(obj: Any) -> Any:
    """A copy of a (nested) state_dict with every tensor on the CPU."""
    return tree_map(lambda v: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v, obj)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem (the same on every run)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    return x, (x @ torch.randn(8, 1, generator=g)).tanh() + 0.05 * torch.randn(256, 1, generator=g)


def fresh_checkpoint() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"step": 0, "model": to_cpu(model.state_dict()), "optimizer": to_cpu(opt.state_dict()), "loss": None}


def train(device: torch.device, checkpoint: dict[str, Any], steps: int, *, every: int = 5, delay: float = 0.0,
          on_checkpoint: Any = None, log: Any = None) -> float:
    """Train from ``checkpoint`` up to ``steps`` on ``device``; returns the final loss.

    Every ``every`` steps ``on_checkpoint`` gets a new CPU checkpoint.
    """
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    model.load_state_dict(checkpoint["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(checkpoint["optimizer"])
    x, y = (t.to(device) for t in data())
    loss_value = float("nan")
    for step in range(checkpoint["step"] + 1, steps + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        loss_value = loss.item()  # a sync point: a lost node shows up here at the latest
        if log is not None:
            log(step, loss_value)
        if on_checkpoint is not None and step % every == 0:
            on_checkpoint({"step": step, "model": to_cpu(model.state_dict()),
                           "optimizer": to_cpu(opt.state_dict()), "loss": loss_value})
        time.sleep(delay)
    return loss_value


def healthy_device(avoid: str, wait: float) -> torch.device:
    """genie.device() once it names a device off ``avoid`` (the lost node), within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            device = genie.device()
            node = genie.get_cluster_state().devices[device.index]["node_id"]
            if node != avoid:
                return device
        except DeviceError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise DeviceError(f"no device off node {avoid} became available within {wait:g} s")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default=None, help="HOST:PORT of the master (default: GENIE_MASTER_*)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    parser.add_argument("--prefer", default=None, help="node id (or device index/kind) to start on")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds between steps (to kill a worker)")
    args = parser.parse_args(argv)

    options: dict[str, Any] = {}
    if args.master:
        host, _, port = args.master.rpartition(":")
        options = {"master_addr": host or "127.0.0.1", "master_port": int(port)}
    try:
        state = genie.init_sync(**options)
    except (ConnectError, InitTimeoutError) as exc:
        print(f"failover_training: {exc}", file=sys.stderr)
        return 2
    try:
        prefer: Any = int(args.prefer) if args.prefer and args.prefer.isdigit() else args.prefer
        device = genie.device(prefer=prefer)
        latest = fresh_checkpoint()
        resumed_from: dict[str, Any] | None = None

        def keep(ckpt: dict[str, Any]) -> None:
            nonlocal latest
            latest = ckpt

        def show(step: int, loss: float) -> None:
            node = state.devices[device.index]["node_id"]
            print(f"step {step} loss {loss:.6f} on {device} (node {node})", flush=True)

        while True:
            try:
                final = train(device, latest, args.steps, every=args.every, delay=args.step_delay,
                              on_checkpoint=keep, log=show)
                break
            except RemoteDeviceLost as exc:
                lost = state.devices[device.index]["node_id"]
                print(f"lost {device} (node {lost}): {exc}", flush=True)
                device = healthy_device(lost, wait=30)
                resumed_from = latest
                print(f"resuming from step {latest['step']} on {device} "
                      f"(node {state.devices[device.index]['node_id']})", flush=True)
        print(f"final loss {final:.9f} on {device}", flush=True)
        if resumed_from is None:
            print("no failover happened", flush=True)
            return 0
        reference = train(device, resumed_from, args.steps, every=args.every)
        same = reference == final
        print(f"uninterrupted run from step {resumed_from['step']}: final loss {reference:.9f} -> "
              f"{'match' if same else 'MISMATCH'}", flush=True)
        return 0 if same else 1
    finally:
        genie.shutdown_sync()


if __name__ == "__main__":
    sys.exit(main())
