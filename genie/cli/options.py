"""The options of every command that serves sessions: ``genie serve``, ``genie worker`` and
``python -m genie.server``.

One definition, so the three cannot drift apart: :func:`add_session_options` adds them to a
parser and :func:`session_config` turns the parsed arguments (with what the command adds) into
the :class:`~genie.config.ClusterConfig`. An option left out is ``None`` and falls back to
``GENIE_*`` and then the default (``ClusterConfig.from_sources``). Where a command gives an
option its own meaning (``--host``'s default, ``--backend``), it keeps its own definition.
It lives with the CLI, which imports nothing heavy at start (``genie.server`` imports torch).
"""

from __future__ import annotations

import argparse
from typing import Any

from genie.config import ClusterConfig

#: argparse dest -> ClusterConfig field of every option :func:`add_session_options` adds.
SESSION_OPTIONS = ("devices", "node_id", "insecure", "cache_bytes", "share_cache", "isolation", "op_deadline",
                   "cuda_mps", "compile_replays", "profile_sessions")


def add_session_options(p: argparse.ArgumentParser) -> None:
    """Add the devices served, the node id, exposure, weight cache and session isolation options."""
    p.add_argument("--devices", default=None, help="'auto' (every CUDA GPU, else one CPU device) or e.g. 'cpu,cpu'")
    p.add_argument("--node-id", default=None, help="stable node id (default: HOST-ROLE-PID)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="serve a non-loopback --host without a cluster token (GENIE_AUTH_TOKEN); anyone who can "
                        "reach the ports can then run code on this node's devices (GENIE_INSECURE)")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="host memory for the weight cache, kept across sessions (default 1 GiB; 0: none; "
                        "GENIE_CACHE_BYTES)")
    p.add_argument("--share-cache", action="store_true", default=None,
                   help="one weight cache scope for every client of the cluster token, not one per client "
                        "identity; see docs/SECURITY.md (GENIE_SHARE_CACHE)")
    p.add_argument("--isolation", choices=("process", "none"), default=None,
                   help="process (default): each client session in its own worker process; none: sessions in "
                        "threads of the node's process, for one trusted user (GENIE_ISOLATION)")
    p.add_argument("--cuda-mps", action="store_true", default=None,
                   help="share each GPU among the session workers through the host's CUDA MPS daemon (it must run: "
                        "nvidia-cuda-mps-control -d); refused where it does not (GENIE_CUDA_MPS)")
    p.add_argument("--compile-replays", choices=("off", "inductor"), default=None,
                   help="off (default): replayed graphs (torch.compile(backend='genie')) run node by node; inductor: "
                        "a graph's admitted replays run the kernels inductor generates for it on this node "
                        "(docs/compile.md; GENIE_COMPILE_REPLAYS)")
    p.add_argument("--profile-sessions", metavar="DIR", default=None,
                   help="run each session worker under torch.profiler and write its profile (session-N.txt and "
                        ".json: ops, kernels, the device's busy time) into DIR when the session ends; a diagnostic "
                        "mode, process isolation only (GENIE_PROFILE_SESSIONS)")
    p.add_argument("--op-deadline", type=float, default=None,
                   help="seconds one op may run before its session's worker is killed (default 300; "
                        "GENIE_OP_DEADLINE)")


def session_config(args: argparse.Namespace, **more: Any) -> ClusterConfig:
    """The configuration from the options of :func:`add_session_options` and ``more`` (the command's
    own: role, ports, heartbeats...); ``--insecure`` is checked by the servers themselves
    (genie.security.check_bind)."""
    return ClusterConfig.from_sources(**{name: getattr(args, name) for name in SESSION_OPTIONS}, **more)
