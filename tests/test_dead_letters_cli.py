"""Dead letters an operator can handle: read back, shown, redriven, purged.

``dedupstore dead-letters list | show | redrive | purge`` against the destinations that
can be read back (Redis Streams, the SQLite table queue, RabbitMQ), and
``OutboxProcessor.redrive`` taking a letter in the form the operator reads it (a
stream entry, a queue row, an AMQP body). The handler of a redriven message sees the
original message id; a letter is removed only once its redrive returned, and a
letter redriven twice is applied once.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest
import redis

from dedupstore import open_dispatcher, open_entity_store, open_store
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.cli import main
from dedupstore.consumers import Consumer, open_broker
from dedupstore.dead_letters import DeadLetterQueue, ReadMessage, letter_body, letter_kind
from dedupstore.dispatch import CallableDispatcher
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError, InvalidMessageId
from dedupstore.ids import outgoing_id
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send
from tests.servers import Server

#: What each handler of this module saw: (message id, headers).
SEEN: list[tuple[str, dict[str, str]]] = []


def deposit(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Adds the amount; a negative amount is poison."""
    SEEN.append((message.id, dict(message.headers)))
    amount = message.body["amount"]
    if amount < 0:
        raise ValueError(f"a deposit cannot be negative: {amount}")
    return {"balance": state.get("balance", 0) + amount}, [Send("deposited", {"n": amount})]


def fixed(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """The fix: a negative amount was meant positive."""
    body = {"amount": abs(message.body["amount"])}
    return deposit(state, Message(message.id, message.correlation_id, body, message.headers))


HANDLER = f"{__name__}:deposit"
FIXED = f"{__name__}:fixed"


@dataclass
class Where:
    """One destination that can be read back, with stores for the processor."""

    kind: str
    dispatcher: str
    entities: str
    store: str
    dlq: str
    #: the letter ``letter id`` as the operator reads it with the destination's own tools
    raw: Callable[[str], Any]


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    ]
)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    tag = uuid.uuid4().hex[:10]
    dlq = f"dlq-{tag}"
    stores = f"sqlite:///{tmp_path}/stores.db"
    if request.param == "redis":
        server: Server = request.getfixturevalue("redis_server")
        admin = redis.Redis.from_url(server.url)

        def from_stream(letter_id: str) -> Any:
            for entry in admin.xrange(f"dl{tag}o:{dlq}"):
                if entry[1][b"id"].decode() == letter_id:
                    return entry  # (entry id, fields) as XRANGE gives it
            raise AssertionError(f"no entry {letter_id}")

        yield Where(
            "redis",
            f"{server.url}?key_prefix=dl{tag}o:",
            f"{server.url}?key_prefix=dl{tag}e:",
            f"{server.url}?key_prefix=dl{tag}d:",
            dlq,
            from_stream,
        )
        admin.close()
    elif request.param == "sqlite":
        queue = f"sqlite:///{tmp_path}/queue.db"

        def from_table(letter_id: str) -> Any:
            with open_dispatcher(queue) as dispatcher:
                rows = [s for s in dispatcher.receive() if s.message.id == letter_id]  # type: ignore[attr-defined]
            return rows[0]  # a StoredMessage, as the table queue's reader gives it

        yield Where("sqlite", queue, stores, stores, dlq, from_table)
    else:
        server = request.getfixturevalue("rabbitmq_server")

        def from_queue(letter_id: str) -> Any:
            connection = pika.BlockingConnection(pika.URLParameters(server.url))
            try:
                channel = connection.channel()
                while True:
                    method, properties, body = channel.basic_get(dlq, auto_ack=False)
                    assert method is not None, f"no message {letter_id}"
                    if properties.message_id == letter_id:
                        return body  # the AMQP body, as a queue consumer receives it
            finally:
                connection.close()  # everything goes back to the queue

        yield Where(
            "rabbitmq",
            f"{server.url}?declare_queues=true",
            stores,
            stores,
            dlq,
            from_queue,
        )


def _processor(where: Where, endpoint: str = "default") -> OutboxProcessor:
    return OutboxProcessor(
        open_entity_store(where.entities),
        open_store(where.store, endpoint=endpoint),
        open_dispatcher(where.dispatcher),
        dead_letters=where.dlq,
    )


def _close(processor: OutboxProcessor) -> None:
    for client in (processor.entities, processor.dedup, processor.dispatcher):
        client.close()  # type: ignore[attr-defined]


def _letters(where: Where, *args: str) -> list[str]:
    return ["--dispatcher", where.dispatcher, "--dead-letters", where.dlq, *args]


def _redrive(where: Where, *args: str, handler: str = FIXED) -> list[str]:
    return [
        "dead-letters",
        "redrive",
        *args,
        *_letters(where),
        *("--entities", where.entities, "--store", where.store, "--handler", handler),
    ]


def _list(where: Where, capsys: pytest.CaptureFixture[str]) -> list[list[str]]:
    capsys.readouterr()
    assert main(["dead-letters", "list", *_letters(where)]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split("\t") == ["letter", "message", "entity", "consumer", "size", "reason"]
    return [row.split("\t") for row in rows]


def _poison(where: Where, *messages: Message, endpoint: str = "default") -> list[str]:
    """Process ``messages`` (poison ones are dead-lettered); the letters' ids."""
    processor = _processor(where, endpoint)
    try:
        results = [processor.process(m, deposit) for m in messages]
    finally:
        _close(processor)
    return [
        outgoing_id(endpoint, m.correlation_id, m.id, -1)
        for m, r in zip(messages, results, strict=True)
        if r.outcome == "dead_lettered"
    ]


def _balance(where: Where, entity: str) -> Any:
    with open_entity_store(where.entities) as entities:
        return entities.load(entity).state.get("balance")


# ---------------------------------------------------------------------- the API


def test_redrive_takes_the_letter_as_read_back(where: Where) -> None:
    """The letter as XRANGE, the table queue's reader or basic_get gives it is redriven."""
    (letter_id,) = _poison(where, Message("bad-1", "acct-1", {"amount": -5}, {"trace": "t1"}))
    raw = where.raw(letter_id)
    processor = _processor(where)
    try:
        SEEN.clear()
        assert processor.redrive(raw, fixed).outcome == "processed"
        assert SEEN == [("bad-1", {"trace": "t1", "dedupstore-redrive-of": "bad-1"})]
        assert processor.redrive(where.raw(letter_id), fixed).outcome == "duplicate"
        assert processor.process(Message("bad-1", "acct-1", {"amount": -5}), deposit).outcome == (
            "duplicate"
        )
    finally:
        _close(processor)
    assert _balance(where, "acct-1") == 5


@pytest.mark.memory
@pytest.mark.parametrize(
    "form",
    ["letter", "body", "stream-fields", "str-fields", "json-text", "amqp-body", "shown"],
)
def test_every_form_of_a_letter_gives_its_body(form: str) -> None:
    body = {"message": {"id": "m", "correlation_id": "e"}, "error": {}, "consumer": "c"}
    text = json.dumps(body)
    letter = OutgoingMessage("l1", "dlq", body)
    given = {
        "letter": letter,
        "body": body,
        "stream-fields": {b"id": b"l1", b"body": text.encode(), b"headers": b"{}"},
        "str-fields": {"id": "l1", "body": text, "headers": "{}"},
        "json-text": text,
        "amqp-body": text.encode(),
        "shown": {"id": "l1", "destination": "dlq", "body": body, "headers": {}},
    }[form]
    assert letter_body(given) == body


@pytest.mark.memory
@pytest.mark.parametrize("bad", [{"x": 1}, b"not json", 5, None, {"body": "{}"}])
def test_what_is_not_a_dead_letter_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="not a dead letter"):
        letter_body(bad)


def _memory(endpoint: str = "default") -> tuple[MemoryEntityStore, MemoryDeduplicationStore]:
    url = f"memory://{uuid.uuid4().hex}"
    return MemoryEntityStore(url), MemoryDeduplicationStore(url, endpoint=endpoint)


@pytest.mark.memory
def test_the_handler_of_a_redriven_message_sees_the_original_id() -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    processor.process(Message("bad-1", "acct-1", {"amount": -5}), deposit)
    first = sent.sent[-1]
    SEEN.clear()
    assert processor.redrive(first, deposit).outcome == "dead_lettered"  # not fixed yet
    second = sent.sent[-1]
    assert processor.redrive(second, fixed).outcome == "processed"  # a letter of the redrive
    assert [mid for mid, _ in SEEN] == ["bad-1", "bad-1"]
    assert {h["dedupstore-redrive-of"] for _, h in SEEN} == {"bad-1"}
    assert entities.load("acct-1").state == {"balance": 5}
    assert processor.redrive(second, fixed).outcome == "duplicate"
    assert processor.redrive(first, fixed).outcome == "duplicate"


@pytest.mark.memory
def test_a_redrive_applies_on_the_entity_as_it_is_now() -> None:
    """The entity changed since the letter was set aside: the redrive runs on its state now."""
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    processor.process(Message("bad-1", "acct-1", {"amount": -5}), deposit)
    letter = sent.sent[-1]
    processor.process(Message("m2", "acct-1", {"amount": 10}), deposit)
    processor.process(Message("m3", "acct-1", {"amount": 100}), deposit)
    assert processor.redrive(letter, fixed).outcome == "processed"
    assert entities.load("acct-1").state == {"balance": 115}


@pytest.mark.memory
def test_redrive_refuses_what_it_cannot_redrive_before_any_write() -> None:
    entities, dedup = _memory("billing")
    sent = InMemoryDispatcher()
    letter = OutgoingMessage(
        "l1",
        "dlq",
        {
            "message": {"id": "m1", "correlation_id": "acct-1", "body": {"amount": 1}},
            "error": {"type": "ValueError", "text": "x"},
            "attempts": 1,
            "consumer": "shipping",
        },
    )
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    with pytest.raises(ConfigurationError, match="consumer 'shipping', not 'billing'"):
        processor.redrive(letter, fixed)
    malformed = {
        "delivery": {"body": "garbage", "headers": {}},
        "error": {"type": "dedupstore.errors.MalformedDelivery", "text": "no correlation id"},
        "consumer": "billing",
    }
    with pytest.raises(ConfigurationError, match="not a message \\(no correlation id\\)"):
        processor.redrive(malformed, fixed)
    assert entities.load("acct-1").version is None and sent.sent == []


@pytest.mark.memory
def test_the_letter_of_an_invalid_spark_row_is_not_redriven() -> None:
    """Spark's process_messages dead-letters a stand-in for a row with a null or invalid
    id (its guard raises InvalidMessageId): it never was a message."""
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")

    def guarded(state: dict[str, Any], message: Message) -> Any:
        raise InvalidMessageId("null message id in column 'id'")

    stand_in = Message("invalid-row:0f3a", "acct-1", {"body": {}, "id": None})
    assert processor.process(stand_in, guarded).outcome == "dead_lettered"
    assert letter_kind(letter_body(sent.sent[-1])) == "row"
    with pytest.raises(ConfigurationError, match=r"stands for a row .*\(null message id"):
        processor.redrive(sent.sent[-1], fixed)
    assert entities.load("acct-1").state == {}


@pytest.mark.memory
def test_a_destination_that_cannot_be_read_back_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="a CallableDispatcher dispatcher"):
        DeadLetterQueue(CallableDispatcher(lambda messages: None), "dlq")
    with (
        open_dispatcher("memory://letters") as memory,
        pytest.raises(ConfigurationError, match="memory:// dispatcher"),
    ):
        DeadLetterQueue(memory, "dlq")


@pytest.mark.memory
@pytest.mark.parametrize(
    ("url", "said"),
    [("memory://letters", "memory:// dispatcher"), ("kafka://h:9092", "scheme 'kafka'")],
)
def test_the_command_refuses_a_dispatcher_that_cannot_be_read_back(
    url: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for action in (["list"], ["show", "x"], ["purge", "--all", "--yes"]):
        args = ["dead-letters", *action, "--dispatcher", url, "--dead-letters", "dlq"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err


# ---------------------------------------------------------------------- the commands


def test_list_show_redrive_and_purge(where: Where, capsys: pytest.CaptureFixture[str]) -> None:
    ids = _poison(
        where,
        Message("m1", "acct-1", {"amount": 1}),
        Message("bad-1", "acct-1", {"amount": -5}),
        Message("bad-2", "acct-2", {"amount": -7}),
        Message("bad-3", "acct-3", {"amount": -9}),
    )
    rows = _list(where, capsys)
    assert [row[:4] for row in rows] == [
        [ids[0], "bad-1", "acct-1", "default"],
        [ids[1], "bad-2", "acct-2", "default"],
        [ids[2], "bad-3", "acct-3", "default"],
    ]
    assert rows[0][5] == "ValueError: a deposit cannot be negative: -5"
    assert int(rows[0][4]) > 0
    assert _list(where, capsys) == rows, "listing consumes nothing"

    assert main(["dead-letters", "show", ids[0], *_letters(where)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == ids[0] and shown["body"]["message"]["id"] == "bad-1"
    assert letter_body(shown) == shown["body"]

    # a letter redriven (by the API) but not removed: the command's redrive is a duplicate
    processor = _processor(where)
    try:
        assert processor.redrive(shown, fixed).outcome == "processed"
    finally:
        _close(processor)
    assert main(_redrive(where, ids[0])) == 0
    done = json.loads(capsys.readouterr().out)
    assert done == {
        "letter": ids[0],
        "message": "bad-1",
        "entity": "acct-1",
        "outcome": "duplicate",
    }
    assert _balance(where, "acct-1") == 1 + 5

    SEEN.clear()
    assert main(_redrive(where, ids[1])) == 0
    assert json.loads(capsys.readouterr().out)["outcome"] == "processed"
    assert SEEN[0][0] == "bad-2", "the handler sees the original message id"
    assert [row[0] for row in _list(where, capsys)] == [ids[2]]
    assert _balance(where, "acct-2") == 7
    assert main(_redrive(where, ids[1])) == 1, "removed once redriven"
    assert f"no dead letter {ids[1]!r}" in capsys.readouterr().err

    assert main(["dead-letters", "purge", ids[2], *_letters(where)]) == 2
    assert "--yes" in capsys.readouterr().err
    assert [row[0] for row in _list(where, capsys)] == [ids[2]]
    assert main(["dead-letters", "purge", ids[2], "--yes", *_letters(where)]) == 0
    assert json.loads(capsys.readouterr().out)["purged"] == 1
    assert _list(where, capsys) == []
    assert _balance(where, "acct-3") is None


def test_redrive_all_leaves_other_consumers_letters(
    where: Where, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = _poison(
        where,
        Message("bad-1", "acct-1", {"amount": -1}),
        Message("bad-2", "acct-1", {"amount": -2}),
    )
    theirs = _poison(where, Message("bad-9", "acct-9", {"amount": -9}), endpoint="shipping")
    # the handler still fails: each letter is set aside again, as a letter of its redrive
    assert main(_redrive(where, "--all", handler=HANDLER)) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["outcome"] for o in out[:2]] == ["dead_lettered", "dead_lettered"]
    assert out[2] == {"redriven": 2, "outcomes": {"dead_lettered": 2}, "left": 1}
    again = [row[0] for row in _list(where, capsys)]
    assert set(again) == {
        theirs[0],
        outgoing_id("default", "acct-1", ours[0], -1),
        outgoing_id("default", "acct-1", ours[1], -1),
    }
    assert main(_redrive(where, "--all")) == 0  # fixed
    captured = capsys.readouterr()
    assert f"left dead letter {theirs[0]} (of consumer 'shipping', not 'default')" in captured.err
    assert json.loads(captured.out.splitlines()[-1])["outcomes"] == {"processed": 2}
    assert _balance(where, "acct-1") == 3
    assert [row[0] for row in _list(where, capsys)] == theirs

    # one letter of another consumer, by id: refused, naming both; nothing removed
    assert main(_redrive(where, theirs[0])) == 2
    err = capsys.readouterr().err
    assert "consumer 'shipping', not 'default'" in err and "Traceback" not in err
    assert [row[0] for row in _list(where, capsys)] == theirs
    assert main(["dead-letters", "purge", "--all", "--yes", *_letters(where)]) == 0
    assert _list(where, capsys) == []


@pytest.mark.redis
def test_a_malformed_delivery_letter_is_listed_but_not_redriven(
    redis_server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The consume loop's letter of a delivery that never was a message."""
    tag = uuid.uuid4().hex[:10]
    url = redis_server.url
    where = Where(
        "redis",
        f"{url}?key_prefix=dl{tag}o:",
        f"sqlite:///{tmp_path}/stores.db",
        f"sqlite:///{tmp_path}/stores.db",
        "dlq",
        lambda _: None,
    )
    admin = redis.Redis.from_url(url)
    admin.xadd(f"in{tag}", {"id": "m1", "body": "{}"})  # no correlation id
    processor = _processor(where)
    broker = open_broker(f"{url}?stream=in{tag}&group=g")
    try:
        stats = Consumer(broker, processor, deposit, wait=0).run_once()
        assert stats.set_aside == 1
    finally:
        broker.close()
        _close(processor)
        admin.close()
    ((letter_id, mid, entity, consumer, _, reason),) = _list(where, capsys)
    assert (mid, entity, consumer) == ("-", "-", "default") and "correlation" in reason
    assert main(_redrive(where, letter_id)) == 2
    err = capsys.readouterr().err
    assert "set aside because it is not a message" in err and "purge" in err, err
    assert main(_redrive(where, "--all")) == 0
    assert f"left dead letter {letter_id}" in capsys.readouterr().err
    assert main(["dead-letters", "purge", letter_id, "--yes", *_letters(where)]) == 0
    assert _list(where, capsys) == []


def test_bad_arguments_exit_2_before_any_io(capsys: pytest.CaptureFixture[str]) -> None:
    nothing = "sqlite:////nonexistent-dir/queue.db"
    cases = [
        (["dead-letters", "show", "", "--dispatcher", nothing, "--dead-letters", "d"], "letter id"),
        (["dead-letters", "list", "--dispatcher", nothing, "--dead-letters", ""], "destination"),
        (
            [
                *("dead-letters", "redrive", "x", "--dispatcher", nothing, "--dead-letters", "d"),
                *("--entities", nothing, "--store", nothing, "--handler", "tests.no_such:f"),
            ],
            "cannot import the handler's module",
        ),
    ]
    for args, said in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    with pytest.raises(SystemExit):  # argparse: ID or --all, not both
        main(["dead-letters", "purge", "x", "--all", "--yes", "--dispatcher", nothing])


# ---------------------------------------------------------------------- the destinations


@pytest.mark.sqlite
def test_the_table_queue_never_gives_a_removed_rows_seq_again(tmp_path: Path) -> None:
    """A reader paging by seq past a removed newest row still sees the next one."""
    url = f"sqlite:///{tmp_path}/queue.db"
    with open_dispatcher(url) as queue:
        queue.dispatch([OutgoingMessage("a", "out", {}), OutgoingMessage("l", "dlq", {})])
        seen = queue.receive()  # type: ignore[attr-defined]
        (letter,) = queue.read_back("dlq")  # type: ignore[attr-defined]
        assert queue.remove("dlq", [letter]) == 1  # type: ignore[attr-defined]
        assert queue.remove("dlq", [letter]) == 0  # type: ignore[attr-defined]
        queue.dispatch([OutgoingMessage("b", "out", {})])
        later = queue.receive(after=seen[-1].seq)  # type: ignore[attr-defined]
        assert [s.message.id for s in later] == ["b"]
    with sqlite3.connect(tmp_path / "queue.db") as conn:
        assert [r[0] for r in conn.execute("SELECT id FROM dedup_outgoing ORDER BY seq")] == [
            "a",
            "b",
        ]


@pytest.mark.rabbitmq
def test_reading_a_rabbitmq_queue_back_keeps_its_messages_in_order(
    rabbitmq_server: Server,
) -> None:
    queue = f"dlq-{uuid.uuid4().hex}"
    with open_dispatcher(f"{rabbitmq_server.url}?declare_queues=true") as dispatcher:
        dispatcher.dispatch([OutgoingMessage(f"l{n}", queue, {"n": n}) for n in range(5)])
        for _ in range(3):
            read = dispatcher.read_back(queue)  # type: ignore[attr-defined]
            assert [r.message.id for r in read] == [f"l{n}" for n in range(5)]
        assert isinstance(read[0], ReadMessage) and read[0].message.body == {"n": 0}
        assert dispatcher.remove(queue, [read[1], read[3]]) == 2  # type: ignore[attr-defined]
        left = dispatcher.read_back(queue)  # type: ignore[attr-defined]
        assert [r.message.id for r in left] == ["l0", "l2", "l4"]
        with pytest.raises(ConfigurationError, match="no queue"):
            dispatcher.read_back(f"missing-{uuid.uuid4().hex}")  # type: ignore[attr-defined]
    with (
        open_dispatcher(rabbitmq_server.url, exchange="amq.direct") as routed,
        pytest.raises(ConfigurationError, match=r"exchange 'amq\.direct'"),
    ):
        routed.read_back(queue)  # type: ignore[attr-defined]


@pytest.mark.redis
def test_reading_a_redis_stream_back_pages_and_removes_every_copy(redis_server: Server) -> None:
    prefix = f"rb{uuid.uuid4().hex[:8]}:"
    with open_dispatcher(f"{redis_server.url}?key_prefix={prefix}&dedupe_window=0") as d:
        d.page_size = 3  # type: ignore[attr-defined]
        d.dispatch([OutgoingMessage(f"l{n}", "dlq", {"n": n}) for n in range(7)])
        d.dispatch([OutgoingMessage("l2", "dlq", {"n": 2})])  # a re-dispatch: a second copy
        queue = DeadLetterQueue(d, "dlq")
        read = d.read_back("dlq")  # type: ignore[attr-defined]
        assert [r.message.id for r in read] == [*(f"l{n}" for n in range(7)), "l2"]
        (copies,) = [letter for letter in queue.list() if letter.id == "l2"]
        assert len(copies.copies) == 2
        assert queue.delete([copies]) == 2
        assert "l2" not in {r.message.id for r in d.read_back("dlq")}  # type: ignore[attr-defined]
        assert d.read_back("nothing-here") == []  # type: ignore[attr-defined]


@pytest.mark.rabbitmq
def test_reading_a_quorum_queue_back_often_loses_nothing(
    rabbitmq_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quorum queue drops a message returned more than its delivery limit (20 by default
    on RabbitMQ 4): reading letters back returns them by closing the channel, which does
    not count as a failed delivery."""
    queue = f"dlq-{uuid.uuid4().hex}"
    url = f"{rabbitmq_server.url}?declare_queues=true&queue_type=quorum"
    with open_dispatcher(url) as dispatcher:
        dispatcher.dispatch([OutgoingMessage(f"l{n}", queue, {"n": n}) for n in range(3)])
    args = ["dead-letters", "list", "--dispatcher", url, "--dead-letters", queue]
    for _ in range(25):
        assert main(args) == 0
    rows = capsys.readouterr().out.splitlines()[-3:]
    assert [row.split("\t")[0] for row in rows] == ["l0", "l1", "l2"]


def keeping(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Keeps the body in the state: a large one does not fit in the entity."""
    return {**state, message.id: message.body}, []


@pytest.mark.sqlite
def test_a_bounded_letter_is_listed_but_not_redriven(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A letter too large to keep whole holds the original's size and digest only: the
    command lists it and refuses to redrive it (a redrive would run the handler on a
    placeholder), by id and with --all; purge removes it."""
    where = Where(
        "sqlite",
        f"sqlite:///{tmp_path}/queue.db",
        f"sqlite:///{tmp_path}/stores.db",
        f"sqlite:///{tmp_path}/stores.db",
        "dlq",
        lambda _: None,
    )
    processor = _processor(where)
    try:
        big = Message("big", "acct", {"blob": "x" * 5_000_000})
        assert processor.process(big, keeping).outcome == "dead_lettered"
    finally:
        _close(processor)
    ((letter_id, mid, entity, _, size, _),) = _list(where, capsys)
    assert (mid, entity) == ("big", "acct") and int(size) < 100_000
    assert main(_redrive(where, letter_id, handler=f"{__name__}:keeping")) != 0
    err = capsys.readouterr().err
    assert "cannot be redriven" in err and "digest" in err, err
    assert main(_redrive(where, "--all", handler=f"{__name__}:keeping")) == 0
    err = capsys.readouterr().err
    assert f"left dead letter {letter_id} (too large to keep whole" in err, err
    assert main(["dead-letters", "purge", letter_id, "--yes", *_letters(where)]) == 0
    assert _list(where, capsys) == []
