"""The Redis Streams broker (``backends.redis.consumer``) against a real Redis server.

A pipeline of dedupstore services chains: what ``RedisDispatcher`` writes is read
by a ``RedisStreamsBroker`` of the same destination with the default rules. Entries
a consumer left pending are reclaimed by another one (``lease=0`` makes every
pending entry claimable at once: no test waits for a lease), delivery counters
come from the group, nacked entries are claimed back and counted, and trimming is
the user's. The consume command and the chaos test are in ``test_consume_cli.py``
and ``test_consumer_chaos.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from backends.redis.consumer import RedisStreamsBroker
from dedupstore import open_dispatcher, open_entity_store, open_store
from dedupstore.consumers import Consumer, open_broker
from dedupstore.errors import ConfigurationError
from dedupstore.outbox import Message, OutboxProcessor, Send
from tests.servers import Server

pytestmark = pytest.mark.redis


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
    redis_server: Server, admin: redis.Redis
) -> None:
    tag = _tag()
    url = redis_server.url
    upstream = open_dispatcher(url, key_prefix=f"t{tag}:")
    entities = open_entity_store(url, key_prefix=f"e{tag}:")
    dedup = open_store(url, key_prefix=f"d{tag}:", endpoint="billing")
    downstream = open_dispatcher(url, key_prefix=f"t{tag}:")
    processor = OutboxProcessor(entities, dedup, downstream, dead_letters="dlq")
    broker = open_broker(url, destination="orders", group="billing", key_prefix=f"t{tag}:")
    try:
        assert isinstance(broker, RedisStreamsBroker)
        assert broker.stream == upstream.stream_key("orders") == f"t{tag}:orders"
        from dedupstore.entities import OutgoingMessage

        sent = [
            OutgoingMessage(f"m{n}", "orders", {"n": n}, {"correlation_id": f"o{n % 3}"})
            for n in range(10)
        ]
        upstream.dispatch(sent)
        admin.xadd(broker.stream, {"id": "m1", "body": '{"n": 1}', "correlation_id": "o1"})
        consumer = Consumer(broker, processor, count, batch_size=4)
        rounds = [consumer.run_once() for _ in range(4)]
        assert sum(r.acked for r in rounds) == 11 and not any(r.nacked for r in rounds)
        assert sum(r.outcomes.get("duplicate", 0) for r in rounds) == 1
        states = entities.load_many(["o0", "o1", "o2"])
        assert states["o1"].state["applied"] == ["m1", "m4", "m7"]
        assert admin.xpending(broker.stream, "billing")["pending"] == 0
        assert broker.pending() == 0
        # the outputs are the next service's input, with the same rules
        nxt = open_broker(url, destination="next", group="audit", key_prefix=f"t{tag}:")
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
    redis_server: Server, admin: redis.Redis
) -> None:
    stream, group = f"s-{_tag()}", "g"
    for n in range(5):
        admin.xadd(stream, {"id": f"m{n}", "correlation_id": "a", "body": "{}"})
    dead = RedisStreamsBroker(redis_server.url, stream=stream, group=group, consumer="dead")
    alive = RedisStreamsBroker(redis_server.url, stream=stream, group=group, lease=0)
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


def test_a_message_nacked_too_often_is_set_aside(redis_server: Server, admin: redis.Redis) -> None:
    tag = _tag()
    stream = f"s-{tag}"
    admin.xadd(stream, {"id": "m1", "correlation_id": "a", "body": '{"n": 1}'})
    admin.xadd(stream, {"correlation_id": "a", "body": "{}"})  # no id: malformed
    entities = open_entity_store(redis_server.url, key_prefix=f"e{tag}:")
    dedup = open_store(redis_server.url, key_prefix=f"d{tag}:", endpoint="billing")
    letters = open_dispatcher(redis_server.url, key_prefix=f"t{tag}:")
    processor = OutboxProcessor(entities, dedup, letters, dead_letters="dlq")
    broker = RedisStreamsBroker(redis_server.url, stream=stream, group="g")
    calls = {"n": 0}
    real = dedup.processed_among

    def down(keys: Any) -> Any:
        calls["n"] += 1
        from dedupstore.errors import StoreUnavailable

        raise StoreUnavailable("down")

    dedup.processed_among = down  # type: ignore[method-assign]
    try:
        consumer = Consumer(broker, processor, count, max_deliveries=2)
        first = consumer.run_once()
        assert (first.set_aside, first.nacked) == (1, 1)
        second = consumer.run_once()
        assert second.nacked == 1
        third = consumer.run_once()  # the third delivery of m1: set aside
        assert (third.set_aside, third.acked, third.nacked) == (1, 1, 0)
        dedup.processed_among = real  # type: ignore[method-assign]
        dlq = admin.xrange(letters.stream_key("dlq"))
        assert len(dlq) == 2
        assert admin.xpending(stream, "g")["pending"] == 0
        assert entities.load("a").state == {}
    finally:
        for client in (broker, letters, entities, dedup):
            client.close()


def test_the_group_start_and_creation_are_options(redis_server: Server, admin: redis.Redis) -> None:
    stream = f"s-{_tag()}"
    admin.xadd(stream, {"id": "old", "correlation_id": "a", "body": "{}"})
    with pytest.raises(ConfigurationError, match="no such store: consumer group 'g'"):
        RedisStreamsBroker(redis_server.url, stream=stream, group="g", create=False)
    late = RedisStreamsBroker(redis_server.url, stream=stream, group="late", start="$")
    early = RedisStreamsBroker(redis_server.url, stream=stream, group="early")
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
    with pytest.raises(ConfigurationError, match=error):
        RedisStreamsBroker("redis://127.0.0.1:1/0", **options)  # nothing listens on port 1
