"""The event bus: ordering, filtering, failing handlers and sinks, cross-thread publishing, history."""

from __future__ import annotations

import logging
import threading

import anyio
import anyio.lowlevel
import pytest

from genie.builtin import LoggingEventSink
from genie.cluster.events import EventBus
from genie.testing import wait_until_async
from genie.types import ClusterEvent, EventType

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def ev(kind: EventType = EventType.NODE_JOINED, source: str = "n1", **data: object) -> ClusterEvent:
    return ClusterEvent(kind, source, dict(data))


class ListSink:
    name = "list"

    def __init__(self) -> None:
        self.events: list[ClusterEvent] = []

    def handle(self, event: ClusterEvent) -> None:
        self.events.append(event)


async def test_sync_and_async_handlers_receive_events_in_publish_order() -> None:
    bus = EventBus()
    seen_sync: list[int] = []
    seen_async: list[int] = []

    async def slow_async(event: ClusterEvent) -> None:
        await anyio.lowlevel.checkpoint()  # yields to the loop: an async handler that lets others run
        seen_async.append(event.data["i"])

    bus.subscribe(lambda e: seen_sync.append(e.data["i"]))
    bus.subscribe(slow_async)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        for i in range(50):
            bus.publish(ev(i=i, source=f"n{i % 3}"))
        await bus.apublish(ev(i=50))
        bus.close()
    assert seen_sync == list(range(51))
    assert seen_async == list(range(51))


async def test_type_filter_delivers_only_the_requested_types() -> None:
    bus = EventBus()
    got: list[EventType] = []
    bus.subscribe(lambda e: got.append(e.type), types=[EventType.GPU_OVERHEATED])
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        await bus.apublish(ev(EventType.NODE_JOINED))
        await bus.apublish(ev(EventType.GPU_OVERHEATED))
        bus.close()
    assert got == [EventType.GPU_OVERHEATED]


async def test_raising_handler_and_sink_are_logged_and_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenSink:
        name = "broken"

        def handle(self, event: ClusterEvent) -> None:
            raise RuntimeError("sink boom")

    good_sink = ListSink()
    bus = EventBus(sinks=[BrokenSink(), good_sink])
    got: list[ClusterEvent] = []

    def broken_handler(event: ClusterEvent) -> None:
        raise ValueError("handler boom")

    async def broken_async(event: ClusterEvent) -> None:
        raise KeyError("async boom")

    bus.subscribe(broken_handler)
    bus.subscribe(broken_async)
    bus.subscribe(got.append)
    with caplog.at_level(logging.ERROR, logger="genie.events"):
        async with anyio.create_task_group() as tg:
            await tg.start(bus.run)
            await bus.apublish(ev())
            await bus.apublish(ev(source="n2"))
            bus.close()
    assert [e.source for e in got] == ["n1", "n2"]
    assert [e.source for e in good_sink.events] == ["n1", "n2"]
    messages = " ".join(r.getMessage() for r in caplog.records if r.name == "genie.events")
    assert "broken_handler" in messages and "broken_async" in messages and "'broken'" in messages


async def test_unsubscribe_and_context_manager_stop_delivery() -> None:
    bus = EventBus()
    a: list[ClusterEvent] = []
    b: list[ClusterEvent] = []
    sub_a = bus.subscribe(a.append)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        with bus.subscribe(b.append):
            await bus.apublish(ev(source="first"))
        sub_a.unsubscribe()
        sub_a.unsubscribe()  # idempotent
        await bus.apublish(ev(source="second"))
        bus.close()
    assert [e.source for e in a] == ["first"]
    assert [e.source for e in b] == ["first"]
    assert bus.subscriptions == ()


async def test_publish_from_many_threads_keeps_each_sources_order() -> None:
    bus = EventBus()
    got: list[ClusterEvent] = []
    bus.subscribe(got.append)
    per_thread = 200

    def producer(source: str) -> None:
        for i in range(per_thread):
            bus.publish(ev(source=source, i=i))

    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        threads = [threading.Thread(target=producer, args=(f"t{k}",)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            await anyio.to_thread.run_sync(t.join, 5.0)
        await wait_until_async(lambda: bus.delivered >= 4 * per_thread, 5, what="every event delivered")
        bus.close()
    for k in range(4):
        assert [e.data["i"] for e in got if e.source == f"t{k}"] == list(range(per_thread))


async def test_events_published_before_run_are_delivered_once_it_starts() -> None:
    bus = EventBus()
    got: list[ClusterEvent] = []
    bus.subscribe(got.append)
    bus.publish(ev(source="early"))
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.close()
    assert [e.source for e in got] == ["early"]


async def test_sinks_come_from_the_event_sinks_hook(genie_pm, register_plugin) -> None:
    sink = ListSink()

    class Plugin:
        from genie.hookspecs import hookimpl

        @hookimpl
        def genie_event_sinks(self) -> list[object]:
            return [sink]

    register_plugin(Plugin())
    bus = EventBus(pm=genie_pm)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        await bus.apublish(ev())
        bus.close()
    assert len(sink.events) == 1
    assert any(isinstance(s, LoggingEventSink) for s in bus.sinks), "the core's logging sink ships as a built-in"


async def test_builtin_logging_sink_logs_each_event(genie_pm, caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus(pm=genie_pm)
    with caplog.at_level(logging.INFO, logger="genie.events"):
        async with anyio.create_task_group() as tg:
            await tg.start(bus.run)
            await bus.apublish(ev(EventType.GPU_OVERHEATED, "gpu-node", gpu=0))
            bus.close()
    assert any("gpu_overheated from gpu-node" in r.getMessage() for r in caplog.records)


async def test_recent_keeps_a_bounded_history_filterable_by_type() -> None:
    bus = EventBus(history=5)
    for i in range(8):
        bus.publish(ev(EventType.NODE_JOINED if i % 2 else EventType.NODE_LOST, i=i))
    assert [e.data["i"] for e in bus.recent()] == [3, 4, 5, 6, 7]
    assert [e.data["i"] for e in bus.recent(2)] == [6, 7]
    assert [e.data["i"] for e in bus.recent(types=[EventType.NODE_LOST])] == [4, 6]
    assert bus.recent(0) == []


async def test_backlog_over_max_pending_drops_the_oldest() -> None:
    bus = EventBus(max_pending=3)
    got: list[ClusterEvent] = []
    bus.subscribe(got.append)
    for i in range(5):
        bus.publish(ev(i=i))
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.close()
    assert [e.data["i"] for e in got] == [2, 3, 4]
    assert bus.dropped == 2


async def test_apublish_inside_a_handler_does_not_deadlock() -> None:
    bus = EventBus()
    got: list[EventType] = []

    async def chain(event: ClusterEvent) -> None:
        got.append(event.type)
        if event.type is EventType.NODE_LOST:
            await bus.apublish(ev(EventType.NODE_RECOVERED))

    bus.subscribe(chain)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        with anyio.fail_after(2):
            await bus.apublish(ev(EventType.NODE_LOST))
            await bus.apublish(ev(EventType.NODE_JOINED))
        bus.close()
    assert got == [EventType.NODE_LOST, EventType.NODE_RECOVERED, EventType.NODE_JOINED]


async def test_cancelling_the_task_group_stops_the_bus() -> None:
    bus = EventBus()
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        assert bus.running
        tg.cancel_scope.cancel()
    assert not bus.running


async def test_publish_after_close_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.close()
    with caplog.at_level(logging.WARNING, logger="genie.events"):
        bus.publish(ev())
    assert "after the bus closed" in caplog.text


async def test_close_from_another_thread_ends_run() -> None:
    bus = EventBus()
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            await tg.start(bus.run)
            await anyio.to_thread.run_sync(bus.close)


async def test_publish_rejects_non_events() -> None:
    with pytest.raises(TypeError):
        EventBus().publish({"type": "node_joined"})  # type: ignore[arg-type]


async def test_event_recorder_fixture_waits_for_a_type(event_recorder) -> None:
    bus = EventBus()
    recorder = event_recorder(bus)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        tg.start_soon(bus.apublish, ev(EventType.HEALTH_CHANGED))
        got = await recorder.wait_for(EventType.HEALTH_CHANGED, timeout=2)
        assert got.type is EventType.HEALTH_CHANGED
        with pytest.raises(AssertionError, match="expected 1 node_lost event"):
            await recorder.wait_for(EventType.NODE_LOST, timeout=0.05)
        await anyio.to_thread.run_sync(bus.publish, ev(EventType.NODE_LOST))
        await anyio.to_thread.run_sync(recorder.wait_for_blocking, EventType.NODE_LOST, 2.0)
        bus.close()
    assert recorder.of_type(EventType.NODE_LOST)[0].source == "n1"


async def test_apublish_while_closing_returns_instead_of_waiting_forever() -> None:
    bus = EventBus()
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.close()
        with anyio.fail_after(1):
            await bus.apublish(ev())
