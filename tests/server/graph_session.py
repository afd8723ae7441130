"""A graph defined and replayed in one in-process executor (CMD_GRAPH, then CMD_REPLAY through its batch path,
over a fake channel): what the graph tests drive."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from genie.server import graphs
from genie.server.executor import Executor
from genie.server.store import StorageStore
from genie.wire.frame import FrameHeader, MsgKind
from genie.wire.graph import Ref, encode_definition
from genie.wire.messages import CMD_GRAPH, CMD_REPLAY
from tests.raw_client import T, desc, encode_value, pack, pack_body, seed
from tests.transport.transport_fakes import FakeChannel

_reqs = itertools.count(1)
_moved_ids = itertools.count(1000)


def _run(ex: Executor, *cmds: bytes) -> None:
    body = pack_body({"uploads": [], "cmds": list(cmds)})
    ex.run_batch(FrameHeader(MsgKind.BATCH, len(body), 0), body)


class Session:
    """One executor with a graph defined over input storages 1.. (their tensors given), outputs into 100..; its
    one device ``device`` (a CUDA one only on a GPU host)."""

    def __init__(self, nodes: list[list[Any]], inputs: list[torch.Tensor], outputs: list[Ref],
                 like: list[torch.Tensor], *, program: bool, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.store = StorageStore(max_bytes=1 << 30)
        self.ex = Executor(FakeChannel("test"), self.store, [self.device])
        self.like = like
        self.inputs = [T(i + 1, t) for i, t in enumerate(inputs)]
        for i, t in enumerate(inputs):
            self.store.put(i + 1, t.clone().to(self.device).untyped_storage())
        definition = encode_definition(len(inputs), nodes, [*outputs], encode_value)
        _run(self.ex, pack([CMD_GRAPH, next(_reqs), 0, 7, definition]))
        self.graph = graphs.session_graphs(self.ex).graphs[7]
        if not program:
            self.graph.program = False  # the Python loop runs every replay

    def set_input(self, i: int, t: torch.Tensor) -> None:
        storage = self.store.get(i + 1)
        assert storage is not None
        storage.copy_(t.to(self.device).untyped_storage())

    def move_input(self, i: int, t: torch.Tensor) -> None:
        """Give input ``i`` as a new storage (a new id, new memory), as a client's next step gives new activations."""
        storage_id = next(_moved_ids)
        self.store.put(storage_id, t.clone().to(self.device).untyped_storage())
        self.inputs[i] = T(storage_id, t)

    def input(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Input ``i``'s data as the session holds it now."""
        storage = self.store.get(self.inputs[i].value[0])
        assert storage is not None
        return torch.empty(0, dtype=like.dtype, device=self.device).set_(storage, 0, like.shape, like.stride()).cpu()

    def seed(self, value: int) -> None:
        """Reseed the session's default generator of its device (CMD_SEED)."""
        _run(self.ex, seed(0, 0, value))

    def replay(self, outputs_at: int = 100) -> list[torch.Tensor] | dict[str, Any]:
        """The outputs (into storages ``outputs_at``..: a failed replay poisons its outputs' storages), or the
        deferred error the replay left."""
        outs = [desc(outputs_at + k, t) for k, t in enumerate(self.like)]
        _run(self.ex, pack([CMD_REPLAY, 0, 7, self.inputs, outs]))
        if self.ex.deferred:
            return self.ex.deferred.pop(0)
        got = []
        for k, t in enumerate(self.like):
            storage = self.store.get(outputs_at + k)
            assert storage is not None
            got.append(torch.empty(0, dtype=t.dtype, device=self.device).set_(storage, 0, t.shape, t.stride())
                       .clone().cpu())
        return got
