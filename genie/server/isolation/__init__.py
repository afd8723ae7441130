"""Process isolation of data-plane sessions (issue 11): a worker process per session.

- :mod:`~genie.server.isolation.supervisor`: the node's side (start, watch, kill, report);
- :mod:`~genie.server.isolation.worker`: a worker's body (one Session over a handed-over socket);
- :mod:`~genie.server.isolation.zygote`: workers forked from a forkserver that imported torch once;
- :mod:`~genie.server.isolation.clock`: the shared op clock the deadline is read from;
- :mod:`~genie.server.isolation.cgroups`: a cgroup v2 group per worker, when the node may make one.

See docs/SECURITY.md for what it guarantees.
"""
