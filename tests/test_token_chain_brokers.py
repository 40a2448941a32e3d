"""Token mode end to end over RabbitMQ and the SQLite table queue (issue 38, item 2).

The sibling of ``tests/test_token_chain.py`` (Redis Streams): service A takes orders
from a producer outside the protocol (retention mode, the boundary) and sends one
``shipments`` message per order, minting a token for service B; B reads them in
token mode. The token header must cross each broker's own transport (an AMQP header,
a column of the table queue) and reach B's processor: B applies each order once, a
copy of one of A's messages arriving after B consumed its token is a duplicate, and
after the drain no token is left and B's deduplication store holds nothing.

* RabbitMQ: both services are ``dedupstore consume`` processes (SQLite stores, the
  token store shared), on queues of a real broker.
* The SQLite table queue: there is no ``sqlite://`` broker (``dedupstore consume``
  cannot read the table queue), so A is an in-process processor dispatching to the
  table queue and B is the consume loop (``Consumer``) over a broker of this module
  that reads the table queue's rows (``SqliteDispatcher.receive``), as a reader of it
  does; re-reading every row from the start is the broker duplicate.

Each broker's dead letter of a token-mode message keeps the token: set aside, its
incoming token is exchanged for the redrive's, and ``redrive`` of the letter as read
back from the broker applies it once and consumes that token. (Kafka's are in
``tests/test_kafka.py``.)
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from dedupstore import open_dispatcher, open_entity_store, open_store, open_token_store
from dedupstore.backends.sqlite import SqliteDispatcher
from dedupstore.consumers import Broker, Consumer, Delivery, open_broker
from dedupstore.dead_letters import letter_body
from dedupstore.entities import OutgoingMessage
from dedupstore.outbox import Message, OutboxProcessor, Send
from dedupstore.tokens import TOKEN_HEADER
from tests.servers import Server
from tests.test_token_chain import a_handler, b_handler, consume, stopped


def poison(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """B before its fix: refuses every shipment."""
    raise ValueError(f"cannot ship {message.body['order']}")


def _until(done: Callable[[], bool], processes: Sequence[subprocess.Popen[str]] = ()) -> None:
    """Poll ``done``; bounded by the test's timeout. A process that exits fails the test."""
    while not done():
        for process in processes:
            assert process.poll() is None, process.communicate()
        time.sleep(0.05)


def _outstanding(url: str) -> dict[str, Any]:
    with open_token_store(url) as tokens:
        return dict(tokens.outstanding())


def _rows(path: Path, table: str) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def _shipped(entities_url: str, customers: set[str]) -> list[str]:
    with open_entity_store(entities_url) as entities:
        return [
            o for c in sorted(customers) for o in entities.load(f"b-{c}").state.get("orders", [])
        ]


# ---------------------------------------------------------------------------- RabbitMQ


def _ready(rabbitmq_channel: Any, queue: str) -> int:
    return int(rabbitmq_channel.queue_declare(queue, passive=True).method.message_count)


@pytest.mark.rabbitmq
@pytest.mark.timeout(180)
def test_two_services_over_rabbitmq_apply_each_message_once_and_leave_no_deduplication_data(
    rabbitmq_server: Server, rabbitmq_channel: Any, tmp_path: Path
) -> None:
    url, tag = rabbitmq_server.url, uuid.uuid4().hex[:8]
    orders_q, ship_q = f"orders-{tag}", f"shipments-{tag}"
    for queue in (orders_q, ship_q):
        rabbitmq_channel.queue_declare(queue, durable=True)
    tokens_url = f"sqlite:///{tmp_path}/tokens.db"
    a_db, b_db, b_dedup = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "b-dedup.db"
    owner = {f"o{n}": f"c{n % 9}" for n in range(121)}  # o120 comes last, alone

    def orders(*ids: str) -> list[OutgoingMessage]:
        headers = {"ship_to": ship_q}
        return [
            OutgoingMessage(m, orders_q, {}, {**headers, "correlation_id": owner[m]}) for m in ids
        ]

    producer = open_dispatcher(url)
    producer.dispatch(orders(*list(owner)[:120]))
    producer.dispatch(orders("o3", "o4", "o5"))  # producer duplicates
    common = ("--batch-size", "20", "--wait", "0.2")
    a = consume(
        *("--broker", f"{url}?queue={orders_q}", "--endpoint", "a"),
        *("--entities", f"sqlite:///{a_db}", "--store", f"sqlite:///{a_db}"),
        *("--dispatcher", url, "--handler", "tests.test_token_chain:a_handler"),
        *("--tokens", tokens_url, "--subscription", f"{ship_q}=b", *common),
    )
    processes = [a]
    try:
        _until(lambda: _ready(rabbitmq_channel, ship_q) == 120, processes)
        # one of A's messages as RabbitMQ delivers it: the token is an AMQP header
        method, properties, body = rabbitmq_channel.basic_get(ship_q, auto_ack=False)
        nonce = properties.headers[TOKEN_HEADER]
        assert isinstance(nonce, str) and nonce
        rabbitmq_channel.basic_nack(method.delivery_tag, requeue=True)
        assert _outstanding(tokens_url)["b"].outstanding == 120
        b = consume(
            *("--broker", f"{url}?queue={ship_q}", "--endpoint", "b", "--no-dispatcher"),
            *("--entities", f"sqlite:///{b_db}", "--store", f"sqlite:///{b_dedup}"),
            *("--handler", "tests.test_token_chain:b_handler", "--tokens", tokens_url),
            *common,
        )
        processes.append(b)
        b_entities, customers = f"sqlite:///{b_db}", set(owner.values())
        _until(lambda: len(_shipped(b_entities, customers)) == 120, processes)
        _until(
            lambda: _outstanding(tokens_url) == {}, processes
        )  # B consumed them: it read the header
        # a broker duplicate of that message after B consumed its token, then one more
        # order: B reads the queue in order, so once o120 is applied the copy was run
        rabbitmq_channel.basic_publish("", ship_q, body, properties)
        producer.dispatch(orders("o120"))
        _until(lambda: "o120" in _shipped(b_entities, {owner["o120"]}), processes)
        _until(lambda: _outstanding(tokens_url) == {}, processes)
        totals = stopped({"a": a, "b": b})
        assert totals["a"]["outcomes"] == {"processed": 121, "duplicate": 3}
        assert totals["b"]["outcomes"].get("processed") == 121
        assert totals["b"]["outcomes"].get("duplicate", 0) >= 1  # the copy
        assert sorted(_shipped(b_entities, customers)) == sorted(owner)  # once each
        assert _outstanding(tokens_url) == {}  # every token consumed
        assert _rows(b_dedup, "dedup_records") == 0  # B recorded nothing
        assert _rows(a_db, "dedup_records") == 121  # A, at the boundary, did
        assert (_ready(rabbitmq_channel, orders_q), _ready(rabbitmq_channel, ship_q)) == (0, 0)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
        producer.close()


def _sender(entities: str, store: str, dispatcher: str, tokens: str, to: str) -> OutboxProcessor:
    return OutboxProcessor(
        open_entity_store(entities),
        open_store(store, endpoint="a"),
        open_dispatcher(dispatcher),
        tokens=open_token_store(tokens),
        subscriptions={to: ["b"]},
    )


def _receiver(entities: str, dispatcher: str, tokens: str, dead_letters: str) -> OutboxProcessor:
    return OutboxProcessor(
        open_entity_store(entities),
        open_store(entities, endpoint="b"),
        open_dispatcher(dispatcher),
        tokens=open_token_store(tokens),
        dead_letters=dead_letters,
    )


def _close(*processors: OutboxProcessor) -> None:
    for processor in processors:
        for client in (processor.entities, processor.dedup, processor.dispatcher, processor.tokens):
            client.close()  # type: ignore[union-attr]


def _redriven_once(b: OutboxProcessor, letter: object, tokens_url: str) -> None:
    """The letter as read back keeps the token header; its redrive applies it once and
    consumes the redrive's token."""
    original = letter_body(letter)["message"]
    assert TOKEN_HEADER in original["headers"], "the dead letter lost the token"
    assert _outstanding(tokens_url)["b"].outstanding == 1  # the redrive's token, exchanged
    assert b.redrive(letter, b_handler).outcome == "processed"
    assert _outstanding(tokens_url) == {}
    assert b.redrive(letter, b_handler).outcome == "duplicate"
    assert b.entities.load("b-c1").state == {"orders": ["o1"]}


@pytest.mark.rabbitmq
@pytest.mark.timeout(60)
def test_a_dead_letter_over_rabbitmq_keeps_its_token_until_redriven(
    rabbitmq_server: Server, rabbitmq_channel: Any, tmp_path: Path
) -> None:
    url, tag = rabbitmq_server.url, uuid.uuid4().hex[:8]
    ship_q, dlq = f"shipments-{tag}", f"dlq-{tag}"
    for queue in (ship_q, dlq):
        rabbitmq_channel.queue_declare(queue, durable=True)
    stores, tokens_url = f"sqlite:///{tmp_path}/stores.db", f"sqlite:///{tmp_path}/tokens.db"
    a = _sender(stores, stores, url, tokens_url, ship_q)
    b = _receiver(f"sqlite:///{tmp_path}/b.db", url, tokens_url, dlq)
    try:
        order = Message("o1", "c1", {}, {"ship_to": ship_q})
        assert a.process(order, a_handler).outcome == "processed"
        with open_broker(url, queue=ship_q) as broker:
            consumer = Consumer(broker, b, poison, max_deliveries=None, wait=0.5)
            stats = consumer.run_once()
            while not stats.acked:  # the first fetch may come before the delivery
                stats = consumer.run_once()
        assert stats.outcomes == {"dead_lettered": 1}
        method, _, letter = rabbitmq_channel.basic_get(dlq, auto_ack=True)  # the AMQP body
        assert method is not None
        _redriven_once(b, letter, tokens_url)
    finally:
        _close(a, b)


# ------------------------------------------------------------------ the SQLite table queue


class TableQueueBroker(Broker):
    """The consume loop's broker over the rows of one destination of a SQLite table
    queue, read with its reader (``SqliteDispatcher.receive``) after a position that
    ``ack`` advances: what a reader of the table queue does (there is no ``sqlite://``
    broker). A delivery's headers are the row's headers plus ``id``."""

    kind = "sqlite-table"

    def __init__(self, url: str, destination: str) -> None:
        queue = open_dispatcher(url)
        assert isinstance(queue, SqliteDispatcher)
        self.queue, self.destination, self.after = queue, destination, 0

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        rows = self.queue.receive(max_count, self.after)
        return [
            Delivery(
                row.seq,
                json.dumps(row.message.body),
                {**row.message.headers, "id": row.message.id},
            )
            for row in rows
            if row.message.destination == self.destination
        ]

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self.after = max([self.after, *(d.token for d in deliveries)])

    def nack(self, deliveries: Sequence[Delivery]) -> None:
        """Nothing: the position stays, so they come again."""

    def close(self) -> None:
        self.queue.close()


def _drain(consumer: Consumer) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    while (stats := consumer.run_once()).fetched:
        assert not stats.nacked and not stats.held
        for outcome, n in stats.outcomes.items():
            outcomes[outcome] = outcomes.get(outcome, 0) + n
    return outcomes


@pytest.mark.sqlite
def test_two_services_over_the_sqlite_table_queue_apply_each_message_once(tmp_path: Path) -> None:
    queue_url, tokens_url = f"sqlite:///{tmp_path}/queue.db", f"sqlite:///{tmp_path}/tokens.db"
    a_db, b_db = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    owner = {f"o{n}": f"c{n % 9}" for n in range(120)}
    a = _sender(a_db, a_db, queue_url, tokens_url, "shipments")
    b = _receiver(b_db, queue_url, tokens_url, "dlq")
    try:
        orders = [Message(m, c, {}) for m, c in owner.items()]
        results = a.process_batch([*orders, *orders[3:6]], a_handler)  # producer duplicates
        assert sorted(r.outcome for r in results).count("duplicate") == 3
        with sqlite3.connect(tmp_path / "queue.db") as db:
            headers = [json.loads(h) for (h,) in db.execute("SELECT headers FROM dedup_outgoing")]
        assert len(headers) == 120 and all(TOKEN_HEADER in h for h in headers)  # the column
        assert _outstanding(tokens_url)["b"].outstanding == 120
        with TableQueueBroker(queue_url, "shipments") as broker:
            consumer = Consumer(broker, b, b_handler, batch_size=25, max_deliveries=None, wait=0)
            assert _drain(consumer) == {"processed": 120}
            assert _outstanding(tokens_url) == {}  # every token consumed
            broker.after = 0  # a reader that starts again from the first row: every copy
            assert _drain(consumer) == {"duplicate": 120}
        assert sorted(_shipped(b_db, set(owner.values()))) == sorted(owner)  # once each
        assert _rows(tmp_path / "b.db", "dedup_records") == 0  # B recorded nothing
        assert _rows(tmp_path / "a.db", "dedup_records") == 120  # A, at the boundary, did
    finally:
        _close(a, b)


@pytest.mark.sqlite
def test_a_dead_letter_in_the_sqlite_table_queue_keeps_its_token_until_redriven(
    tmp_path: Path,
) -> None:
    queue_url, tokens_url = f"sqlite:///{tmp_path}/queue.db", f"sqlite:///{tmp_path}/tokens.db"
    stores = f"sqlite:///{tmp_path}/stores.db"
    a = _sender(stores, stores, queue_url, tokens_url, "shipments")
    b = _receiver(f"sqlite:///{tmp_path}/b.db", queue_url, tokens_url, "dlq")
    try:
        assert a.process(Message("o1", "c1", {}), a_handler).outcome == "processed"
        with TableQueueBroker(queue_url, "shipments") as broker:
            consumer = Consumer(broker, b, poison, max_deliveries=None, wait=0)
            assert _drain(consumer) == {"dead_lettered": 1}
        with open_dispatcher(queue_url) as queue:
            (row,) = [s for s in queue.receive() if s.message.destination == "dlq"]  # type: ignore[attr-defined]
        _redriven_once(b, row, tokens_url)  # the row as the table queue's reader gives it
    finally:
        _close(a, b)
