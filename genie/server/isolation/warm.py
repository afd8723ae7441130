"""Imported by the zygote only (multiprocessing's forkserver preloads it): the pre-flight's first-use imports.

The first pre-flight of a process imports about 550 modules (torch's meta and decomposition tables, sympy; not
dynamo, :mod:`genie.lazy_dynamo`): about a second of a core on a small VM. Paid here, once per node, every worker
forked afterwards has them already (its pages shared with the zygote's), so a session's first op pays nothing.
Only modules are imported and a meta run made (no kernel runs on a CPU tensor, no thread starts): the zygote stays
fit to fork. Where this fails, each worker pays the warm-up on a thread of its own instead
(:func:`genie.server.isolation.worker._prewarm`).
"""

from __future__ import annotations

from genie.server.isolation.worker import warm_preflight

warm_preflight()
