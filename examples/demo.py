"""The genie demo: a local server process, and this client doing real work on remote_accelerator:0.

Run it with ``scripts/demo``. It starts ``genie serve --port 0`` (any free port), connects,
multiplies matrices and trains a small model on the remote device, and checks
every result against the same work done on the local CPU.
"""

from __future__ import annotations

import time

import torch
from _nodes import Node  # examples/_nodes.py: the genie command as a child process

import genie


def train(device: str, steps: int = 5) -> tuple[torch.nn.Module, list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    data, target = torch.randn(64, 16), torch.randn(64, 1)
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = data.to(device), target.to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def main() -> None:
    server = Node("serve", "--port", "0", "--devices", "cpu")
    try:
        port = server.control_port
        print(f"started genie server (pid {server.pid}) on 127.0.0.1:{port}")
        t0 = time.perf_counter()
        state = genie.init_sync(master_addr="127.0.0.1", master_port=port)
        serving = [n for n in state.nodes if n["role"] != "client"]
        print(f"genie.init: {len(state.devices)} device(s) on {len(serving)} node(s), backend {state.backend}, "
              f"{(time.perf_counter() - t0) * 1000:.0f} ms")
        try:
            a = torch.randn(256, 256)
            x = a.to("remote_accelerator:0")
            print("x.device =", x.device)
            remote = (x @ x).cpu()
            local = a @ a
            print(f"matmul 256x256: max |remote - local| = {(remote - local).abs().max().item():.2e}")
            assert torch.allclose(remote, local, atol=1e-4)

            _, remote_losses = train("remote_accelerator:0")
            _, local_losses = train("cpu")
            for step, (r, c) in enumerate(zip(remote_losses, local_losses, strict=True)):
                print(f"train step {step}: loss remote {r:.6f}  cpu {c:.6f}")
            assert all(abs(r - c) < 1e-4 for r, c in zip(remote_losses, local_losses, strict=True))
            print("demo OK: remote results match the CPU")
        finally:
            genie.shutdown_sync()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
