"""The Redis Streams broker (``dedupstore.backends.redis.consumer``) against a real Redis server.

A pipeline of dedupstore services chains: what ``RedisDispatcher`` writes is read
by a ``RedisStreamsBroker`` of the same destination with the default rules. Entries
a consumer left pending are reclaimed by another one (``lease=0`` makes every
pending entry claimable at once: no test waits for a lease), delivery counters
come from the group, nacked entries are claimed back and counted, and trimming is
the user's. The consume command and the chaos test are in ``test_consume_cli.py``
and ``test_consumer_chaos.py``.

Every test runs on both faces (the ``face`` fixture): ``RedisStreamsBroker`` (redis-py)
under ``Consumer``, and ``AsyncRedisStreamsBroker`` (``redis.asyncio``, the same steps)
under ``AsyncConsumer``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dedupstore import open_dispatcher, open_entity_store, open_store
from dedupstore.backends.redis.consumer import AsyncRedisStreamsBroker, RedisStreamsBroker
from dedupstore.errors import ConfigurationError
from dedupstore.outbox import Message, OutboxProcessor, Send
from dedupstore.testing.faces import blocking, wait_for
from tests.aio_faces import FACES, cancelled_in_flight, consumer_of, opened_broker, unwrapped
from tests.proxy import TcpProxy
from tests.servers import Server

pytestmark = pytest.mark.redis


@pytest.fixture(params=FACES)
def face(request: Any) -> str:
    """redis-py's broker and ``Consumer``, or ``redis.asyncio``'s and ``AsyncConsumer``."""
    return str(request.param)


def streams(face: str, url: str, **options: Any) -> Any:
    """The face's Redis Streams broker, called as the sync one."""
    if face == "sync":
        return RedisStreamsBroker(url, **options)
    return blocking(wait_for(AsyncRedisStreamsBroker(url, **options).open()))


def _tag() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def admin(redis_server: Server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def count(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Appends the id; forwards it downstream with the entity as correlation id."""
    applied = [*state.get("applied", []), message.id]
    send = Send("next", {"n": message.body["n"]}, {"correlation_id": message.correlation_id})
    return {"applied": applied}, [send]


def test_a_pipeline_of_services_chains_through_redis_streams(
    face: str, redis_server: Server, admin: redis.Redis
) -> None:
    tag = _tag()
    url = redis_server.url
    upstream = open_dispatcher(url, key_prefix=f"t{tag}:")
    entities = open_entity_store(url, key_prefix=f"e{tag}:")
    dedup = open_store(url, key_prefix=f"d{tag}:", endpoint="billing")
    downstream = open_dispatcher(url, key_prefix=f"t{tag}:")
    processor = OutboxProcessor(entities, dedup, downstream, dead_letters="dlq")
    broker = opened_broker(face, url, destination="orders", group="billing", key_prefix=f"t{tag}:")
    try:
        kind = RedisStreamsBroker if face == "sync" else AsyncRedisStreamsBroker
        assert isinstance(unwrapped(broker), kind)
        assert broker.stream == upstream.stream_key("orders") == f"t{tag}:orders"
        from dedupstore.entities import OutgoingMessage

        sent = [
            OutgoingMessage(f"m{n}", "orders", {"n": n}, {"correlation_id": f"o{n % 3}"})
            for n in range(10)
        ]
        upstream.dispatch(sent)
        admin.xadd(broker.stream, {"id": "m1", "body": '{"n": 1}', "correlation_id": "o1"})
        consumer = consumer_of(face, broker, processor, count, batch_size=4)
        rounds = [consumer.run_once() for _ in range(4)]
        assert sum(r.acked for r in rounds) == 11 and not any(r.nacked for r in rounds)
        assert sum(r.outcomes.get("duplicate", 0) for r in rounds) == 1
        states = entities.load_many(["o0", "o1", "o2"])
        assert states["o1"].state["applied"] == ["m1", "m4", "m7"]
        assert admin.xpending(broker.stream, "billing")["pending"] == 0
        assert broker.pending() == 0
        # the outputs are the next service's input, with the same rules
        nxt = opened_broker(face, url, destination="next", group="audit", key_prefix=f"t{tag}:")
        try:
            got = nxt.fetch(100, 0)
            assert len(got) == 10 and all(d.headers["correlation_id"] for d in got)
            assert all(d.deliveries == 1 for d in got)
        finally:
            nxt.close()
    finally:
        for client in (broker, upstream, downstream, entities, dedup):
            client.close()


def test_what_a_dead_consumer_left_is_reclaimed_with_its_delivery_count(
    face: str, redis_server: Server, admin: redis.Redis
) -> None:
    stream, group = f"s-{_tag()}", "g"
    for n in range(5):
        admin.xadd(stream, {"id": f"m{n}", "correlation_id": "a", "body": "{}"})
    dead = streams(face, redis_server.url, stream=stream, group=group, consumer="dead")
    alive = streams(face, redis_server.url, stream=stream, group=group, lease=0)
    try:
        held = dead.fetch(3, 0)
        assert [d.deliveries for d in held] == [1, 1, 1]
        dead.close()  # dies holding three entries
        reclaimed = alive.reclaim(10)
        assert [d.token for d in reclaimed] == [d.token for d in held]
        assert [d.deliveries for d in reclaimed] == [2, 2, 2]
        assert [d.headers["id"] for d in reclaimed] == ["m0", "m1", "m2"]
        fresh = alive.fetch(10, 0)
        assert [d.headers["id"] for d in fresh] == ["m3", "m4"]
        alive.nack(fresh[:1])
        again = alive.fetch(10, 0)  # the nacked one comes back first, counted
        assert [(d.headers["id"], d.deliveries) for d in again] == [("m3", 2)]
        alive.ack([*reclaimed, *fresh, *again])
        assert admin.xpending(stream, group)["pending"] == 0
        assert alive.reclaim(10) == []
    finally:
        alive.close()


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_an_outage_of_the_stores_server_sets_nothing_aside(
    face: str, redis_server: Server, admin: redis.Redis, mode: Any
) -> None:
    """The issue's case: the stores' Redis unreachable for many rounds, with
    max_deliveries=2 and dead letters. The deliveries are held by the consumer (their
    lease renewed, their delivery count still 1), nothing is dead-lettered, and once
    the server answers they are processed, in order, and acknowledged."""
    tag = _tag()
    stream = f"s-{tag}"
    for n in (1, 2, 3):
        admin.xadd(stream, {"id": f"m{n}", "correlation_id": "a", "body": f'{{"n": {n}}}'})
    admin.xadd(stream, {"correlation_id": "a", "body": "{}"})  # no id: malformed
    letters = open_dispatcher(redis_server.url, key_prefix=f"t{tag}:")
    broker = streams(face, redis_server.url, stream=stream, group="g", lease=60)
    with TcpProxy.for_url(redis_server.url) as proxy:
        url = proxy.url(redis_server.url)
        fast = {"timeout": 0.5, "retries": 0}
        entities = open_entity_store(url, key_prefix=f"e{tag}:", **fast)
        dedup = open_store(url, key_prefix=f"d{tag}:", endpoint="billing", **fast)
        processor = OutboxProcessor(entities, dedup, letters, dead_letters="dlq")
        try:
            consumer = consumer_of(face, broker, processor, count, max_deliveries=2, mode=mode)
            proxy.outage("refuse")
            proxy.reset()
            for round_ in range(5):
                stats = consumer.run_once()
                aside = 1 if round_ == 0 else 0  # the malformed one, once
                assert (stats.acked, stats.nacked, stats.held) == (aside, 0, 3)
                assert stats.set_aside == aside
            rows = admin.xpending_range(stream, "g", "-", "+", 10)
            assert [r["times_delivered"] for r in rows] == [1, 1, 1], "never redelivered"
            proxy.restore()
            done = consumer.run_once()
            assert (done.acked, done.nacked, done.held) == (3, 0, 0)
            assert done.outcomes == {"processed": 3}
            assert entities.load("a").state["applied"] == ["m1", "m2", "m3"]
            assert len(admin.xrange(letters.stream_key("dlq"))) == 1  # the malformed one
            assert admin.xpending(stream, "g")["pending"] == 0
        finally:
            for client in (broker, letters, entities, dedup):
                client.close()


def test_keep_renews_the_lease_without_counting_a_delivery(
    face: str, redis_server: Server, admin: redis.Redis
) -> None:
    stream = f"s-{_tag()}"
    admin.xadd(stream, {"id": "m1", "correlation_id": "a", "body": "{}"})
    broker = streams(face, redis_server.url, stream=stream, group="g", lease=60)
    try:
        (delivery,) = broker.fetch(10, 0)
        time.sleep(0.3)  # the entry idles 0.3 s
        (before,) = admin.xpending_range(stream, "g", "-", "+", 1)
        broker.keep([delivery])
        (after,) = admin.xpending_range(stream, "g", "-", "+", 1)
        assert before["time_since_delivered"] >= 300 > after["time_since_delivered"]
        assert after["times_delivered"] == 1
    finally:
        broker.close()


def test_a_consumer_restarted_under_its_name_takes_back_what_it_held_at_once(
    face: str, redis_server: Server, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer named ``c1`` died holding two entries; its next process under the
    same name takes them back at its first fetch (counted), not after the lease."""
    stream = f"s-{_tag()}"
    for n in (1, 2, 3):
        admin.xadd(stream, {"id": f"m{n}", "correlation_id": "a", "body": "{}"})
    first = streams(face, redis_server.url, stream=stream, group="g", consumer="c1")
    assert [d.headers["id"] for d in first.fetch(2, 0)] == ["m1", "m2"]
    first.close()  # died: nothing acknowledged
    again = streams(face, redis_server.url, stream=stream, group="g", consumer="c1", lease=600)
    try:
        with caplog.at_level("INFO", logger="dedupstore.consumers"):
            taken = again.fetch(10, 0)
        assert [(d.headers["id"], d.deliveries) for d in taken] == [("m1", 2), ("m2", 2)]
        assert "taking back 2 deliveries" in caplog.text
        assert [d.headers["id"] for d in again.fetch(10, 0)] == ["m3"]
    finally:
        again.close()


def test_deliveries_waiting_for_a_lease_are_logged(
    face: str, redis_server: Server, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    stream = f"s-{_tag()}"
    admin.xadd(stream, {"id": "m1", "correlation_id": "a", "body": "{}"})
    dead = streams(face, redis_server.url, stream=stream, group="g", consumer="dead")
    dead.fetch(1, 0)
    dead.close()
    time.sleep(1.1)  # idle beyond 1 s, a tenth of the lease at most
    alive = streams(face, redis_server.url, stream=stream, group="g", lease=10)
    try:
        with caplog.at_level("INFO", logger="dedupstore.consumers"):
            assert alive.reclaim(10) == []
        assert "1 deliveries held by dead" in caplog.text
        assert "wait for their lease (10.0 s)" in caplog.text
    finally:
        alive.close()


def test_the_group_start_and_creation_are_options(
    face: str, redis_server: Server, admin: redis.Redis
) -> None:
    stream = f"s-{_tag()}"
    admin.xadd(stream, {"id": "old", "correlation_id": "a", "body": "{}"})
    with pytest.raises(ConfigurationError, match="no such store: consumer group 'g'"):
        streams(face, redis_server.url, stream=stream, group="g", create=False)
    late = streams(face, redis_server.url, stream=stream, group="late", start="$")
    early = streams(face, redis_server.url, stream=stream, group="early")
    try:
        admin.xadd(stream, {"id": "new", "correlation_id": "a", "body": "{}"})
        assert [d.headers["id"] for d in late.fetch(10, 0)] == ["new"]
        assert early.pending() == 2  # lag: two entries not delivered yet
        assert [d.headers["id"] for d in early.fetch(10, 0)] == ["old", "new"]
        assert early.pending() == 2  # now pending
    finally:
        late.close()
        early.close()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"group": "g"}, "exactly one of destination"),
        ({"group": "g", "stream": "s", "destination": "d"}, "exactly one of destination"),
        ({"stream": "s"}, "group="),
        ({"stream": "s", "group": "g", "lease": "soon"}, "lease"),
    ],
)
def test_bad_options_are_refused_before_any_io(options: dict[str, Any], error: str) -> None:
    for kind in (RedisStreamsBroker, AsyncRedisStreamsBroker):  # (the async: no I/O at all)
        with pytest.raises(ConfigurationError, match=error):
            kind("redis://127.0.0.1:1/0", **options)  # nothing listens on port 1


@pytest.mark.timeout(60)
def test_an_async_call_to_a_server_that_never_answers_ends_within_its_deadline(
    redis_server: Server, admin: redis.Redis
) -> None:
    """``redis.asyncio`` keeps the sync client's deadline: against a server that accepts
    and never answers, a fetch raises ``StoreUnavailable`` within
    ``connect_timeout + (retries + 1) x timeout``, and the broker works again after."""
    from dedupstore.errors import StoreUnavailable

    stream = f"s-{_tag()}"
    admin.xadd(stream, {"id": "m1", "correlation_id": "a", "body": "{}"})
    with TcpProxy.for_url(redis_server.url) as proxy:
        url = proxy.url(redis_server.url)
        options = {"stream": stream, "group": "g", "timeout": 0.5, "retries": 1}
        broker = blocking(
            wait_for(AsyncRedisStreamsBroker(url, connect_timeout=0.5, **options).open())
        )
        try:
            proxy.reset()
            proxy.outage("hang")
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                broker.fetch(10, 0.2)
            took = time.monotonic() - began
            assert took < 0.5 + 2 * 0.5 + 3.0, took  # the deadline, and slack for a busy machine
            proxy.restore()
            assert [d.headers["id"] for d in broker.fetch(10, 0.2)] == ["m1"]
        finally:
            broker.close()


@pytest.mark.timeout(60)
def test_an_async_call_cancelled_in_flight_leaves_the_broker_whole(
    redis_server: Server, admin: redis.Redis
) -> None:
    """A task cancelled while its ``redis.asyncio`` command waits for the reply (the
    server paused by ``CLIENT PAUSE``) ends at once, not at its deadline; the reply that
    arrives after the pause is never read as a later call's answer; and the broker goes
    on: a cancelled ``pending`` is followed by a right fetch, a cancelled ``ack`` by an
    ack that settles it (acks are idempotent), and nothing stays pending."""
    import asyncio

    stream = f"s-{_tag()}"
    for i in range(2):
        admin.xadd(stream, {"id": f"m{i}", "correlation_id": "a", "body": "{}"})

    async def cancelled_in_a_pause(call: Any) -> None:
        await asyncio.to_thread(admin.execute_command, "CLIENT", "PAUSE", 1000, "ALL")
        await cancelled_in_flight(call, after=0.2, within=0.5)
        await asyncio.sleep(1.0)  # the pause is over: the held reply was sent

    async def main() -> None:
        broker = await AsyncRedisStreamsBroker(
            redis_server.url, stream=stream, group="g", timeout=5
        ).open()
        try:
            [first] = await broker.fetch(1, 0.5)
            await cancelled_in_a_pause(broker.pending())
            [second] = await broker.fetch(1, 0.5)
            assert [first.headers["id"], second.headers["id"]] == ["m0", "m1"]
            assert await broker.pending() == 2
            await cancelled_in_a_pause(broker.ack([first]))
            await broker.ack([first, second])
            assert await broker.pending() == 0
            assert await broker.fetch(10, 0.2) == []
        finally:
            await broker.close()

    asyncio.run(main())
