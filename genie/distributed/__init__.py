"""torch.distributed on remote devices: a c10d backend named ``genie`` for the ``remote_accelerator`` device.

Quick start, in each of the training processes (rank, world size and store as torch.distributed
always takes them)::

    import genie, genie.distributed, torch, torch.distributed as dist

    genie.init_sync(master_addr="gpu-master")
    dist.init_process_group("cpu:gloo,remote_accelerator:genie", rank=rank, world_size=2, store=store)
    t = torch.ones(4, device=f"remote_accelerator:{rank}")
    dist.all_reduce(t)                         # runs between the two nodes' session workers

Collectives on remote tensors move their data between the session workers that hold them, over a
gloo group those workers form (:mod:`genie.server.collectives`); the clients only send commands.
CPU tensors of the same process group go through an ordinary gloo group among the clients.
``import genie.distributed`` registers the backend (:func:`register`); what is supported is in
docs/multi-gpu.md.
"""

from __future__ import annotations

from genie.distributed.process_group import BACKEND_NAME, GenieProcessGroup, GenieWork, GenieWorks, register

__all__ = ["BACKEND_NAME", "GenieProcessGroup", "GenieWork", "GenieWorks", "register"]

register()
