"""The cluster layer: state, membership, heartbeats, resource monitor, health checks and events.

Each component runs on genie's runtime thread (one anyio event loop) and is started
by its owner with ``await task_group.start(component.run)``; cancelling that task
group stops it.
"""
