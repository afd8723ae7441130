"""Types of genie._C_plans, the server's native plan runner (genie/csrc/server_plans.cpp)."""

from typing import Any

class NativePlan:
    """The native form of a genie.server.plans.CommandPlan (raises when it has a shape C++ does not run)."""

    def __init__(self, plan: Any) -> None: ...

class Runner:
    """One session's native plans and the loop that runs a batch's commands by them."""

    def __init__(self, max_keyed: int, max_freed: int) -> None: ...
    def add(self, key: bytes, plan: NativePlan | None, /) -> None: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def set_clock(self, address: int, /) -> None: ...
    def run(self, cmds: list[Any], start: int, store: Any, max_op_elements: int, metrics: Any, pool_min: int,
            quiet: bool, /) -> tuple[int, int, tuple[Any, ...] | None]: ...

#: Ops whose input tensors all have fewer elements run on one intra-op thread (2**18).
SERIAL_BELOW: int

def use_serial(serial: bool) -> None:
    """One intra-op thread on this thread (True) or its own count (False); only a change calls torch."""
