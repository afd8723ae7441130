"""The public lifecycle: init / shutdown (async and blocking), state queries.

One runtime per process. ``init`` twice raises AlreadyInitializedError;
``shutdown`` without init is a documented no-op (so cleanup code can always
call it); interpreter exit without shutdown stops the runtime through atexit.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import types
from collections.abc import Iterable
from typing import Any

import anyio.to_thread
import torch

# Imported with genie, not inside init(): the runtime's modules (device, wire, transports) are
# init's own cost, and paying them at ``import genie`` keeps init() itself in the tens of ms.
from genie.cluster.events import EventHandler, Subscription
from genie.cluster.runtime import Runtime
from genie.cluster.state import ClusterState
from genie.config import ClusterConfig
from genie.device.registry import set_table
from genie.errors import AlreadyInitializedError, NotInitializedError
from genie.types import EventType

log = logging.getLogger("genie")

_lock = threading.Lock()
_runtime: Runtime | None = None


def init_sync(master_addr: str | None = None, master_port: int | None = None, backend: str | None = None,
              node_id: str | None = None, node_role: str | None = None, timeout: float | None = None,
              **options: Any) -> ClusterState:
    """Connect this process to a genie cluster (blocking). Returns the ClusterState.

    Arguments win over ``GENIE_*`` environment variables; see :class:`genie.config.ClusterConfig`
    for every option. Raises ConfigError, ConnectError, InitTimeoutError (naming the phase) or
    AlreadyInitializedError.
    """
    global _runtime
    master_addr = _scheme_shorthand(master_addr, options)
    config = ClusterConfig.from_sources(
        master_addr=master_addr, master_port=master_port, backend=backend, node_id=node_id,
        node_role=node_role, timeout=timeout, **options,
    )
    logging.getLogger("genie").setLevel(config.log_level_number)
    with _lock:
        if _runtime is not None:
            raise AlreadyInitializedError(
                "genie.init() was already called in this process; call genie.shutdown() first"
            )
        runtime = Runtime(config)
        _runtime = runtime
    from genie.device.meta import warm_first_op

    warm_first_op()  # the first op's lazy torch imports, during init's network waits (genie.device.meta)
    try:
        return runtime.start()
    except BaseException:
        with _lock:
            _runtime = None
        raise


def _scheme_shorthand(master_addr: str | None, options: dict[str, Any]) -> str | None:
    """``genie.init(ray=True)`` is short for ``master_addr="ray://"``: one ``NAME=True`` that is no
    option of genie names the scheme of a plugin's master lookup (the ``genie_resolve_master`` hook,
    asked when the runtime starts; without such a plugin the error says which to install)."""
    from genie.config import option_names

    names = [name for name, value in options.items() if value is True and name not in option_names()]
    if master_addr is not None or len(names) != 1:
        return master_addr
    del options[names[0]]
    return f"{names[0]}://"


async def init(master_addr: str | None = None, master_port: int | None = None, backend: str | None = None,
               node_id: str | None = None, node_role: str | None = None, timeout: float | None = None,
               **options: Any) -> ClusterState:
    """Async twin of :func:`init_sync`: the work runs on genie's runtime thread; your loop stays free."""
    return await anyio.to_thread.run_sync(
        lambda: init_sync(master_addr, master_port, backend, node_id, node_role, timeout, **options)
    )


def shutdown_sync() -> None:
    """Disconnect and stop genie's runtime thread. A no-op when genie is not initialised."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is None:
        return
    set_table(None)
    runtime.stop()


async def shutdown() -> None:
    """Async twin of :func:`shutdown_sync`."""
    await anyio.to_thread.run_sync(shutdown_sync)


def is_initialized() -> bool:
    """True between a successful :func:`init` and :func:`shutdown`."""
    return _runtime is not None


def get_cluster_state() -> ClusterState:
    """The live ClusterState; NotInitializedError before init."""
    runtime = _runtime
    if runtime is None or runtime.state is None:
        raise NotInitializedError("genie is not initialised: call genie.init(master_addr=...) first")
    return runtime.state


def subscribe(handler: EventHandler, types: Iterable[EventType] | None = None) -> Subscription:
    """Call ``handler(event)`` for every cluster event (of ``types``, or all) from now on.

    Sync or async handlers; they run on genie's runtime thread and must be quick. The
    master's events (node joined/lost/recovered, GPU and health changes) are relayed to
    every client and worker. Returns a Subscription: call ``.unsubscribe()`` or use it as
    a context manager.
    """
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError("genie is not initialised: call genie.init(master_addr=...) before subscribe()")
    return runtime.bus.subscribe(handler, types)


def device(min_memory: int | None = None, prefer: str | int | None = None) -> torch.device:
    """The best ``remote_accelerator`` device for new work (``genie.device(...)``; the score is in
    :mod:`genie.cluster.placement` and docs/placement.md).

    :param min_memory: bytes the device must have free (where its node reports memory).
    :param prefer: a node id, a device index or a device kind to prefer while it is eligible.
    :raises NotInitializedError: before ``genie.init()``.
    :raises DeviceError: when no device is eligible, naming each one's reason.
    """
    runtime = _runtime
    if runtime is None or runtime.table is None:
        raise NotInitializedError("genie is not initialised as a client: call genie.init(master_addr=...) "
                                  "before genie.device()")
    return runtime.place(min_memory=min_memory, prefer=prefer).device


class _CallableDeviceModule(types.ModuleType):
    """``genie.device`` is both the device package and ``genie.device(min_memory=, prefer=)``."""

    def __call__(self, min_memory: int | None = None, prefer: str | int | None = None) -> torch.device:
        return device(min_memory=min_memory, prefer=prefer)


# The package's class changes once, here: ``genie.device.*`` stays the package, ``genie.device(...)`` places.
sys.modules["genie.device"].__class__ = _CallableDeviceModule


def current_runtime() -> Runtime | None:
    """The process's runtime, or None before init (for genie's own modules and tests)."""
    return _runtime


atexit.register(shutdown_sync)
