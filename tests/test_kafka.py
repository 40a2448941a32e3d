"""The Kafka adapter (``dedupstore.backends.kafka.KafkaBroker``).

No real Kafka broker can be installed from the registries this project uses, so the
logic is tested with confluent-kafka's consumer replaced by a small fake (offsets
committed only after acks, never past a message not done; a nack seeks back to the
first offset not done; a rebalance commits what is done and makes in-flight
deliveries stale), and once over TCP against librdkafka's built-in mock cluster
(``test.mock.num.brokers``: the Kafka protocol, consumer groups and offset commits,
but not Kafka itself).

Every test runs on both faces (the ``face`` fixture): ``KafkaBroker`` under the sync
``Consumer``, and ``AsyncKafkaBroker`` under ``AsyncConsumer`` (the fake behind
``AIOConsumer``'s awaited surface, and over the mock cluster confluent-kafka's real
``AIOConsumer``).

Token mode (issue 38): a record's ``dedupstore-token`` header reaches the processor (the
fake consumer), and over the mock cluster two services chain in token mode, B's
messages produced by a ``CallableDispatcher`` (there is no Kafka dispatcher), with a
dead letter that keeps its token until it is redriven.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer, TopicPartition

from dedupstore import open_store, open_token_store
from dedupstore.backends.kafka import AsyncKafkaBroker, KafkaBroker, KafkaToken
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryDispatcher, MemoryEntityStore
from dedupstore.consumers import ConsumeStats, MessageRules, open_broker
from dedupstore.dead_letters import letter_body
from dedupstore.dispatch import CallableDispatcher
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError, StoreUnavailable
from dedupstore.outbox import Message, OutboxProcessor, Send
from dedupstore.testing.faces import blocking, wait_for
from dedupstore.tokens import TOKEN_HEADER, token_id
from tests.aio_faces import FACES, consumer_of, opened_broker, unwrapped

URL = "kafka://127.0.0.1:9?topic=orders&group=billing"


class _Error:
    def __init__(self, code: int) -> None:
        self._code = code

    def code(self) -> int:
        return self._code


class _Record:
    def __init__(self, partition: int, offset: int, error: int | None = None) -> None:
        self._partition, self._offset, self._error = partition, offset, error

    def error(self) -> _Error | None:
        return None if self._error is None else _Error(self._error)

    def topic(self) -> str:
        return "orders"

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return b'{"n": %d}' % self._offset

    def key(self) -> bytes:
        return b"o%d" % self._partition

    def headers(self) -> list[tuple[str, bytes]]:
        return [("id", b"p%d-m%d" % (self._partition, self._offset))]


class FakeConsumer:
    """confluent_kafka.Consumer's surface the adapter uses: partitions of ``size``
    records each, a position per partition, the commits and seeks it was sent."""

    def __init__(self, partitions: int = 2, size: int = 5) -> None:
        self.size = size
        self.position = dict.fromkeys(range(partitions), 0)
        self.commits: list[dict[int, int]] = []
        self.seeks: list[tuple[int, int]] = []
        self.on_assign: Callable[..., None] | None = None
        self.on_revoke: Callable[..., None] | None = None
        self.fail_next: Exception | None = None
        self.record: Callable[[int, int], _Record] = _Record  # what consume() hands out

    def subscribe(self, topics: list[str], on_assign: Any, on_revoke: Any) -> None:
        assert topics == ["orders"]
        self.on_assign, self.on_revoke = on_assign, on_revoke
        on_assign(self, [TopicPartition("orders", p) for p in self.position])

    def consume(self, num_messages: int, timeout: float) -> list[_Record]:
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        out: list[_Record] = []
        for partition in self.position:
            while self.position[partition] < self.size and len(out) < num_messages:
                out.append(self.record(partition, self.position[partition]))
                self.position[partition] += 1
        return out

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        assert asynchronous is False
        self.commits.append({tp.partition: tp.offset for tp in offsets})

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.partition, tp.offset))
        self.position[tp.partition] = tp.offset

    def close(self) -> None:
        raise AssertionError("a consumer given by the caller is not closed by the broker")


class AsyncFake:
    """A :class:`FakeConsumer` behind ``AIOConsumer``'s surface: every method awaited,
    the rebalance callbacks ``async def`` (as ``AIOConsumer`` calls them). The fake keeps
    sync callables of them, so that a test fires a rebalance as on the sync face."""

    def __init__(self, fake: FakeConsumer) -> None:
        self.fake = fake

    async def subscribe(self, topics: list[str], on_assign: Any, on_revoke: Any) -> None:
        def assign(_consumer: Any, partitions: list[Any]) -> None:
            _at_once(on_assign(self, partitions))  # called on the loop: nothing to await

        def revoke(_consumer: Any, partitions: list[Any]) -> None:
            wait_for(on_revoke(self, partitions))  # fired by the test, off the loop

        self.fake.subscribe(topics, assign, revoke)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.fake, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        return call


def _at_once(coroutine: Any) -> Any:
    """Run a coroutine that awaits nothing to its end."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the coroutine awaited something")


@pytest.fixture(params=FACES)
def face(request: Any) -> str:
    """``KafkaBroker`` and ``Consumer``, or ``AsyncKafkaBroker`` and ``AsyncConsumer``."""
    return str(request.param)


def kafka_broker(face: str, url: str, consumer: FakeConsumer, **options: Any) -> Any:
    """The face's broker on the fake ``consumer``, called as the sync one."""
    if face == "sync":
        return KafkaBroker(url, consumer=consumer, **options)
    opening = AsyncKafkaBroker(url, consumer=AsyncFake(consumer), **options).open()
    return blocking(wait_for(opening))


@pytest.fixture
def fake() -> FakeConsumer:
    return FakeConsumer()


@pytest.fixture
def broker(face: str, fake: FakeConsumer) -> Iterator[Any]:
    opened = kafka_broker(face, URL, fake)
    yield opened
    opened.close()


def _by_offset(deliveries: list[Any], partition: int) -> list[Any]:
    return [d for d in deliveries if d.token.partition == partition]


def test_offsets_are_committed_only_after_acks_and_never_past_a_message_not_done(
    broker: KafkaBroker, fake: FakeConsumer
) -> None:
    got = broker.fetch(10, 0.0)
    assert len(got) == 10
    assert fake.commits == [], "committed before processing"
    first = got[0]
    assert first.token == KafkaToken("orders", 0, 0, 0)
    assert first.headers == {"id": "p0-m0", "key": "o0"}
    assert (first.body, first.deliveries) == (b'{"n": 0}', None)
    p0 = _by_offset(got, 0)
    broker.ack([p0[0], p0[1], p0[3]])  # offset 2 is not done yet
    assert fake.commits == [{0: 2}]
    broker.ack([p0[2]])
    assert fake.commits[-1] == {0: 4}
    broker.ack([p0[2]])  # again: nothing new to commit
    assert len(fake.commits) == 2
    broker.ack([*_by_offset(got, 1), p0[4]])
    assert fake.commits[-1] == {0: 5, 1: 5}


def test_a_nack_seeks_back_to_the_first_offset_not_done(
    broker: KafkaBroker, fake: FakeConsumer
) -> None:
    p0 = _by_offset(broker.fetch(10, 0.0), 0)
    broker.ack([p0[0], p0[3]])
    broker.nack([p0[2]])
    assert fake.seeks == [(0, 1)], "not back to the first offset not done (1)"
    broker.ack([p0[1], p0[4]])  # handed out before the seek: stale, ignored
    assert fake.commits == [{0: 1}]
    again = broker.fetch(10, 0.0)
    assert [d.token.offset for d in again] == [1, 2, 3, 4]
    assert {d.token.epoch for d in again} == {1}
    broker.ack(again)
    assert fake.commits[-1] == {0: 5}


def test_a_revocation_commits_what_is_done_and_makes_the_rest_stale(
    broker: KafkaBroker, fake: FakeConsumer
) -> None:
    p1 = _by_offset(broker.fetch(10, 0.0), 1)
    broker.ack([p1[0]])
    broker.ack([p1[2]])
    assert fake.commits == [{1: 1}]
    assert fake.on_revoke is not None
    fake.on_revoke(fake, [TopicPartition("orders", 1)])  # a rebalance takes partition 1
    broker.ack([p1[1]])  # in flight during the rebalance: the new owner redelivers it
    assert fake.commits == [{1: 1}], "committed past what the new owner must redeliver"


def test_end_of_partition_is_skipped_and_kafka_errors_are_unavailable(
    broker: KafkaBroker, fake: FakeConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from confluent_kafka import KafkaException

    monkeypatch.setattr(
        fake,
        "consume",
        lambda num_messages, timeout: [_Record(0, 0, KafkaError._PARTITION_EOF), _Record(0, 1)],
    )
    assert [d.token.offset for d in broker.fetch(10, 0.0)] == [1]
    monkeypatch.undo()
    fake.fail_next = KafkaException(KafkaError(KafkaError._TRANSPORT))
    with pytest.raises(StoreUnavailable):
        broker.fetch(10, 0.0)


def test_bad_options_are_refused_before_any_io(monkeypatch: pytest.MonkeyPatch) -> None:
    for url, options, match in [
        ("kafka://127.0.0.1:9?group=g", {}, "needs topic="),
        ("kafka://127.0.0.1:9?topic=t", {}, "needs group="),
        ("kafka://?topic=t&group=g", {}, "bootstrap servers"),
        (URL, {"config": {"enable.auto.commit": True}}, "before processing"),
        (URL, {"config": {"enable.auto.offset.store": "true"}}, "before processing"),
        (URL, {"config": "x"}, "config"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            open_broker(url, **options)
        with pytest.raises(ConfigurationError, match=match):
            AsyncKafkaBroker(url, **options)  # the async broker: the same checks, no I/O
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'dedupstore\[kafka\]'"):
        open_broker(URL)


class _TokenedRecord(_Record):
    """A record a token-mode sender produced: its correlation id and the token header
    (``dedupstore-token``, nonce ``n<offset>``) among its headers, as bytes."""

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            *super().headers(),
            ("correlation_id", b"o1"),
            (TOKEN_HEADER, b"n%d" % self._offset),
        ]


def test_a_records_token_header_reaches_the_processor_in_token_mode(
    face: str, fake: FakeConsumer
) -> None:
    """The delivery's headers keep the token header as text, the message keeps it, and
    the processor deduplicates by the token: a record whose token was never minted (or
    is consumed already: the records again after a nack) is a duplicate, and nothing is
    recorded in the deduplication store."""
    probe = FakeConsumer()
    probe.record = _TokenedRecord
    with kafka_broker(face, URL, probe) as reader:
        delivery = reader.fetch(1, 0.0)[0]
    assert delivery.headers[TOKEN_HEADER] == "n0"
    assert MessageRules().message(delivery).headers == {TOKEN_HEADER: "n0", "key": "o0"}

    fake.record = _TokenedRecord
    name = uuid.uuid4().hex
    tokens = open_token_store(f"memory://{name}")
    ids = [f"p{p}-m{o}" for p in (0, 1) for o in range(5)]
    tokens.create({token_id(mid, "billing", f"n{mid[-1]}"): "billing" for mid in ids[:-1]})
    processor = OutboxProcessor(
        MemoryEntityStore(f"memory://{name}"),
        open_store(f"memory://{name}", endpoint="billing"),
        MemoryDispatcher(f"memory://{name}"),
        tokens=tokens,
    )
    with kafka_broker(face, URL, fake) as broker:
        consumer = consumer_of(face, broker, processor, count, batch_size=10, max_deliveries=None)
        stats = consumer.run_once()
        assert stats.outcomes == {"processed": 9, "duplicate": 1}  # p1-m4: no token minted
        assert tokens.outstanding() == {}
        fake.seek(TopicPartition("orders", 0, 0))  # every record again (a new owner, say)
        fake.seek(TopicPartition("orders", 1, 0))
        assert consumer.run_once().outcomes == {"duplicate": 10}
    assert processor.entities.load("o1").state["applied"] == ids[:-1]
    assert processor.dedup.processed_among(ids) == set()


# ---------------------------------------------------------------- librdkafka's mock cluster


def count(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    applied = [*state.get("applied", []), message.id]
    return {"applied": applied}, [Send("next", {"id": message.id})]


def _mock_topic(count: int) -> tuple[Any, str, str]:
    """A mock cluster (the producer that holds it: keep it while the test runs), its
    bootstrap servers and a new topic holding ``count`` messages of entity ``o1``
    (``m0``, ``m1``, ...) in partition 0."""
    producer = Producer({"test.mock.num.brokers": 1, "log_level": 0})
    [broker_md] = producer.list_topics(timeout=10).brokers.values()
    servers, topic = f"{broker_md.host}:{broker_md.port}", f"t-{uuid.uuid4().hex[:8]}"
    for n in range(count):
        headers = {"id": f"m{n}", "correlation_id": "o1"}
        producer.produce(topic, value=b'{"n": %d}' % n, headers=headers, partition=0)
    assert producer.flush(10) == 0
    return producer, servers, topic


@pytest.mark.timeout(120)
def test_over_the_kafka_protocol_a_restarted_consumer_resumes_after_what_was_acked(
    face: str,
) -> None:
    """librdkafka's mock cluster: produce, consume with the loop, close half way; a new
    consumer of the group starts at the committed offset (nothing lost, nothing
    applied twice: the redelivered message is a duplicate)."""
    cluster, servers, topic = _mock_topic(6)
    name = uuid.uuid4().hex
    processor = OutboxProcessor(
        MemoryEntityStore(f"memory://{name}"),
        MemoryDeduplicationStore(f"memory://{name}"),
        MemoryDispatcher(f"memory://{name}"),
    )
    fast = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "log_level": 0}

    def opened() -> Any:
        made = opened_broker(
            face, f"kafka://{servers}?topic={topic}&group=billing-{name}", config=dict(fast)
        )
        assert isinstance(unwrapped(made), KafkaBroker if face == "sync" else AsyncKafkaBroker)
        return made

    first = opened()
    consumer = consumer_of(
        face, first, processor, count, batch_size=4, max_deliveries=None, wait=1.0
    )
    done = 0
    while done < 4:
        done += consumer.run_once().acked
    assert first.pending() == 6 - done
    first.close()

    second = opened()
    consumer = consumer_of(
        face, second, processor, count, batch_size=10, max_deliveries=None, wait=1.0
    )
    # until the group gives the second consumer the partition: bounded by the test's
    # timeout (a consumer that never gets an assignment fails it there), not timed here
    while processor.entities.load("o1").state.get("applied", []) != [f"m{n}" for n in range(6)]:
        consumer.run_once()
    assert second.pending() == 0
    second.close()
    assert cluster.flush(1) == 0  # the mock cluster lived until here


@pytest.mark.timeout(120)
def test_over_the_kafka_protocol_an_outage_holds_records_and_commits_nothing_past_them(
    face: str,
) -> None:
    """librdkafka's mock cluster: the stores are down for several rounds. The records are
    held (not sought back, nothing committed past them, nothing set aside); once the
    stores answer they apply once each, in order, and the offset is committed."""
    cluster, servers, topic = _mock_topic(5)
    name = uuid.uuid4().hex
    sent = MemoryDispatcher(f"memory://{name}")
    processor = OutboxProcessor(
        MemoryEntityStore(f"memory://{name}"),
        MemoryDeduplicationStore(f"memory://{name}"),
        sent,
        dead_letters="dlq",
    )
    real = processor.entities.load_many
    down = {"on": True}

    def load_many(*args: Any, **kwargs: Any) -> Any:
        if down["on"]:
            raise StoreUnavailable("the entity store is down")
        return real(*args, **kwargs)

    processor.entities.load_many = load_many  # type: ignore[method-assign]
    fast = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "log_level": 0}
    url = f"kafka://{servers}?topic={topic}&group=g-{name}"
    broker = opened_broker(face, url, config=dict(fast))
    assert isinstance(unwrapped(broker), KafkaBroker if face == "sync" else AsyncKafkaBroker)
    consumer = consumer_of(
        face, broker, processor, count, batch_size=10, max_deliveries=None, wait=1.0
    )
    try:
        held = 0
        while held < 5:  # until the group assigned the partition and the round was fetched
            stats = consumer.run_once()
            assert stats.acked == stats.nacked == stats.set_aside == 0
            held = stats.held
        for _ in range(3):  # more rounds of the outage: the same records, held again
            stats = consumer.run_once()
            assert (stats.held, stats.acked, stats.nacked, stats.fetched) == (5, 0, 0, 0)
        assert broker.pending() == 5  # nothing committed
        down["on"] = False
        stats = consumer.run_once()
        assert (stats.acked, stats.held, stats.outcomes) == (5, 0, {"processed": 5})
        assert processor.entities.load("o1").state["applied"] == [f"m{n}" for n in range(5)]
        assert broker.pending() == 0
        assert not [m for m in sent.sent if m.destination == "dlq"]
    finally:
        broker.close()
        assert cluster.flush(1) == 0  # the mock cluster lived until here


def forward(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """A: forwards each message to B's entity ``b-<entity>``."""
    applied = [*state.get("applied", []), message.id]
    to_b = {"correlation_id": f"b-{message.correlation_id}"}
    return {"applied": applied}, [Send("shipments", {"order": message.id}, to_b)]


def ship(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """B: records each order."""
    return {"orders": [*state.get("orders", []), message.body["order"]]}, []


def ship_but_m5(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """B before its fix: refuses order ``m5``."""
    if message.body["order"] == "m5":
        raise ValueError("cannot ship m5")
    return ship(state, message)


@pytest.mark.timeout(120)
def test_over_the_kafka_protocol_two_services_in_token_mode_apply_each_message_once(
    face: str,
) -> None:
    """librdkafka's mock cluster: A (in process, its input without tokens: retention
    mode) sends B's messages through a Kafka dispatcher (a ``CallableDispatcher``
    producing one record per message, its id and headers as record headers); B reads
    them with the consume loop in token mode. B applies each once, a record produced
    again after B consumed its token is a duplicate, the dead letter of a record B
    refused keeps the token and its redrive applies it once; no token is left and B's
    deduplication store holds nothing."""
    cluster, servers, _ = _mock_topic(0)
    shipments, name = f"s-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    produced: list[tuple[bytes, dict[str, str]]] = []

    def produce(messages: list[OutgoingMessage]) -> None:
        for m in messages:
            assert m.destination == "shipments"
            value, headers = json.dumps(m.body).encode(), {"id": m.id, **m.headers}
            cluster.produce(shipments, value=value, headers=headers, partition=0)
            produced.append((value, headers))
        if cluster.flush(10):
            raise StoreUnavailable("records not delivered")

    tokens = open_token_store(f"memory://{name}")
    a = OutboxProcessor(
        MemoryEntityStore(f"memory://a{name}"),
        open_store(f"memory://a{name}", endpoint="a"),
        CallableDispatcher(produce),
        tokens=tokens,
        subscriptions={"shipments": ["b"]},
    )
    orders = [Message(f"m{n}", "o1", {}) for n in range(6)]
    assert {r.outcome for r in a.process_batch(orders, forward)} == {"processed"}
    assert all(TOKEN_HEADER in headers for _, headers in produced)  # on the record
    assert tokens.outstanding()["b"].outstanding == 6
    letters = MemoryDispatcher(f"memory://b{name}")
    b = OutboxProcessor(
        MemoryEntityStore(f"memory://b{name}"),
        open_store(f"memory://b{name}", endpoint="b"),
        letters,
        tokens=tokens,
        dead_letters="dlq",
    )
    fast = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "log_level": 0}
    url = f"kafka://{servers}?topic={shipments}&group=b-{name}"
    broker = opened_broker(face, url, config=fast)
    consumer = consumer_of(face, broker, b, ship_but_m5, max_deliveries=None, wait=1.0)
    totals = ConsumeStats()
    try:
        while totals.acked < 6:  # bounded by the test's timeout (the group's assignment)
            totals.add(consumer.run_once())
        assert totals.outcomes == {"processed": 5, "dead_lettered": 1}
        assert tokens.outstanding()["b"].outstanding == 1  # the redrive's token
        value, headers = produced[0]  # produced again: a producer retry
        cluster.produce(shipments, value=value, headers=headers, partition=0)
        assert cluster.flush(10) == 0
        while totals.acked < 7:
            totals.add(consumer.run_once())
        assert totals.outcomes == {"processed": 5, "dead_lettered": 1, "duplicate": 1}
        assert broker.pending() == 0
        (letter,) = [m for m in letters.sent if m.destination == "dlq"]
        assert TOKEN_HEADER in letter_body(letter)["message"]["headers"]
        assert b.redrive(letter, ship).outcome == "processed"
        assert tokens.outstanding() == {}
        assert b.redrive(letter, ship).outcome == "duplicate"
        assert b.entities.load("b-o1").state["orders"] == [f"m{n}" for n in (0, 1, 2, 3, 4, 5)]
        recorded = [headers["id"] for _, headers in produced] + [letter.id]
        assert b.dedup.processed_among(recorded) == set()  # B recorded nothing
    finally:
        broker.close()
        assert cluster.flush(1) == 0  # the mock cluster lived until here
