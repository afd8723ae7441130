"""Overhead of the resource monitor, as CPU % of one core (process CPU time / wall time).

Runs the monitor with the installed plugins (as ``genie.init()`` would) on an anyio
loop with an event bus, and reports:

1. a baseline: the same loop and bus, idle, for the same wall time;
2. scaled-down runs at short intervals, where polls dominate, giving the CPU cost
   of one poll, extrapolated to the 5 s default;
3. a run at the real 5 s interval (``--duration`` seconds; the target is < 0.5 %).

    .venv/bin/python benchmarks/bench_monitor.py              # about 2 minutes
    .venv/bin/python benchmarks/bench_monitor.py --duration 30 --short 3
"""

from __future__ import annotations

import argparse
import time

import anyio

from genie.cluster.events import EventBus
from genie.cluster.monitor import ResourceMonitor
from genie.plugins import PluginManager
from genie.types import NodeInfo, NodeRole

TARGET_PERCENT = 0.5
DEFAULT_INTERVAL = 5.0


async def measure(pm: PluginManager, interval: float | None, duration: float) -> tuple[float, int]:
    """(CPU % of one core, polls) over ``duration`` s; ``interval`` None runs no monitor (baseline)."""
    bus = EventBus(pm=pm)
    monitor = ResourceMonitor(pm, NodeInfo("bench", "localhost", NodeRole.WORKER), bus=bus,
                              interval=interval or DEFAULT_INTERVAL)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        if interval is not None:
            tg.start_soon(monitor.run)
        await anyio.sleep(duration)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        tg.cancel_scope.cancel()
    return 100.0 * cpu / wall, monitor.polls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the 5 s-interval run (0 skips it)")
    parser.add_argument("--short", type=float, default=5.0, help="seconds of each scaled-down run")
    parser.add_argument("--intervals", default="0.02,0.05,0.1,0.5", help="scaled-down intervals, seconds")
    args = parser.parse_args()

    pm = PluginManager()
    hooks = [name for name in pm.records if "genie_node_metrics" in pm.hooks_of(name)]
    print(f"plugins answering genie_node_metrics: {', '.join(hooks)}")
    sample = ResourceMonitor(pm, NodeInfo("bench", "localhost", NodeRole.WORKER)).collect()
    print(f"snapshot keys: {', '.join(sorted(sample.metrics))}; GPUs: {len(sample.gpus)}")

    base, _ = anyio.run(measure, pm, None, args.short, backend="asyncio")
    print(f"baseline (idle loop + bus, {args.short:g} s): {base:.3f} % of one core")
    per_poll: list[float] = []
    for interval in (float(x) for x in args.intervals.split(",")):
        pct, polls = anyio.run(measure, pm, interval, args.short, backend="asyncio")
        cost_ms = max(pct - base, 0.0) / 100.0 * args.short / max(polls, 1) * 1000.0
        per_poll.append(cost_ms)
        print(f"interval {interval:>5g} s: {polls:4d} polls, {pct:6.3f} % CPU, {cost_ms:.3f} ms CPU per poll"
              f" -> at {DEFAULT_INTERVAL:g} s: {cost_ms / 1000.0 / DEFAULT_INTERVAL * 100.0:.4f} %")
    median_ms = sorted(per_poll)[len(per_poll) // 2]
    extrapolated = median_ms / 1000.0 / DEFAULT_INTERVAL * 100.0
    print(f"extrapolated to {DEFAULT_INTERVAL:g} s (median per-poll cost {median_ms:.3f} ms): "
          f"{extrapolated:.4f} % above baseline")
    if args.duration > 0:
        pct, polls = anyio.run(measure, pm, DEFAULT_INTERVAL, args.duration, backend="asyncio")
        ratio = pct / base if base > 0 else float("inf")
        print(f"measured at {DEFAULT_INTERVAL:g} s for {args.duration:g} s: {polls} polls, {pct:.3f} % of one core "
              f"(baseline {base:.3f} %, {pct - base:+.3f} % above it, ratio {ratio:.2f}x)")
        verdict = pct < TARGET_PERCENT
        print(f"target < {TARGET_PERCENT} % at {DEFAULT_INTERVAL:g} s: {'met' if verdict else 'MISSED'}")


if __name__ == "__main__":
    main()
