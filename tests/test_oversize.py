"""No single message wedges a consumer: messages too large to process on any retry.

A message whose entity cannot hold its new state and outbox entry, whose outgoing
message (or headers) is over the dispatcher's bound, or whose dead letter would be, is
set aside exactly once with a BOUNDED dead letter when the processor has
``dead_letters`` (the original body, then headers, replaced by their size and SHA-256
digest when the letter does not fit), and the rest of its batch and every other entity
go on. Without ``dead_letters`` the processor raises a typed error naming the message
(``EntityTooLarge`` / ``MessageTooLarge``, with ``message_id`` and ``correlation_id``),
and nothing of it is saved.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter
from typing import Any

import pytest

from dedupstore import canonical
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.dispatch import CallableDispatcher
from dedupstore.errors import DeadLetterIncomplete, EntityTooLarge, MessageTooLarge
from dedupstore.ids import message_key, outgoing_id
from dedupstore.outbox import (
    InMemoryDispatcher,
    Message,
    OutboxProcessor,
    Send,
    bounded_letter,
    omitted,
    sweep,
)
from tests.outbox_backends import OutboxBackend, backend_params

#: The backends these tests run on (the limit and the rounds are the core's; these three
#: cover an in-process store, a file and a server).
BACKENDS = ("memory", "sqlite", "redis")


def keep_body(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """The issue's handler: it keeps the last body in the state (and counts)."""
    n = state.get("n", 0) + 1
    return {"n": n, "last": message.body}, [Send("kept", {"n": n})]


def _memory() -> tuple[MemoryEntityStore, MemoryDeduplicationStore]:
    url = f"memory://{uuid.uuid4().hex}"
    return MemoryEntityStore(url), MemoryDeduplicationStore(url)


def _digest(value: Any) -> dict[str, Any]:
    data = canonical.dumps(value).encode()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _the_batch(limit: int) -> tuple[list[Message], Message]:
    """32 messages: one larger than an entity for acct-0 (the last of its entity: a
    later one would replace the body it keeps before the batch saves), one before it,
    and 30 for 7 unrelated accounts (the issue's round)."""
    huge = Message("huge", "acct-0", {"blob": "x" * (limit + 1_000_000)}, {"trace": "t"})
    others = [Message(f"m{n}", f"acct-{1 + n % 7}", {"n": n}) for n in range(30)]
    return [Message("before", "acct-0", {"n": -1}), others[0], huge, *others[1:]], huge


@pytest.mark.parametrize("outbox_backend", backend_params(BACKENDS), indirect=True)
@pytest.mark.parametrize("mode", ["batch", "single"])
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_a_message_its_entity_cannot_hold_is_set_aside_bounded_and_the_rest_goes_on(
    outbox_backend: OutboxBackend, mode: str, cleanup: Any
) -> None:
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, cleanup=cleanup, dead_letters="dlq")
    messages, huge = _the_batch(entities.max_entity_bytes)
    try:
        if mode == "batch":
            results = processor.process_batch(messages, keep_body)
        else:
            results = [processor.process(m, keep_body) for m in messages]
        outcomes = {m.id: r.outcome for m, r in zip(messages, results, strict=True)}
        assert outcomes.pop("huge") == "dead_lettered"
        assert set(outcomes.values()) == {"processed"}, "every other message went on"
        error = results[2].error
        assert error is not None and error.startswith("EntityTooLarge: message 'huge'"), error
        letters = [m for m in sent.sent if m.destination == "dlq"]
        assert [m.id for m in letters] == [outgoing_id(dedup.endpoint, "acct-0", "huge", -1)]
        body = letters[0].body
        assert body["message"] == {
            "id": "huge",
            "correlation_id": "acct-0",
            "body_omitted": _digest(huge.body),
            "headers": {"trace": "t"},
        }
        assert body["error"]["type"] == "dedupstore.errors.EntityTooLarge"
        assert len(canonical.dumps(body)) <= processor.letter_bytes()
        states = entities.load_many([f"acct-{n}" for n in range(8)])
        assert states["acct-0"].state == {"n": 1, "last": {"n": -1}}, "set aside: no change"
        assert sum(e.state["n"] for e in states.values()) == 31
        after = Message("after", "acct-0", {"n": 1})
        assert processor.process_batch([after], keep_body)[0].outcome == "processed"
        assert entities.load("acct-0").state == {"n": 2, "last": {"n": 1}}
        # set aside exactly once: a replay is a duplicate, its letter not sent again
        replay = processor.process_batch(messages, keep_body)
        assert {r.outcome for r in replay} == {"duplicate"}
        assert processor.process(huge, keep_body).outcome == "duplicate"
        sweep(entities, dedup)
        assert dedup.has_been_processed(message_key("acct-0", "huge"))
        assert sum(m.destination == "dlq" for m in sent.sent) == 1
    finally:
        entities.close()
        dedup.close()


@pytest.mark.memory
@pytest.mark.parametrize("batch", [False, True], ids=["process", "process_batch"])
def test_without_dead_letters_the_error_names_the_message_and_nothing_is_saved(
    batch: bool,
) -> None:
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    messages, huge = _the_batch(entities.max_entity_bytes)
    with pytest.raises(EntityTooLarge, match="'huge' of entity 'acct-0'") as caught:
        if batch:
            processor.process_batch(messages, keep_body)
        else:
            processor.process(huge, keep_body)
    assert (caught.value.message_id, caught.value.correlation_id) == ("huge", "acct-0")
    assert entities.load("acct-0").version is None, "nothing of it was saved"
    assert not dedup.has_been_processed(message_key("acct-0", "huge"))
    rest = [m for m in messages if m is not huge]  # what a caller does: isolate it, go on
    assert {r.outcome for r in processor.process_batch(rest, keep_body)} == {"processed"}


@pytest.mark.memory
@pytest.mark.parametrize("batch", [False, True], ids=["process", "process_batch"])
def test_a_failing_handler_on_a_huge_body_gets_a_bounded_letter(batch: bool) -> None:
    """The handler fails (no size problem of its own), but the message's body is larger
    than the entity: the dead letter cannot carry it whole."""
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    huge = Message("huge", "acct", {"blob": "y" * (entities.max_entity_bytes + 10)})
    small = Message("small", "acct", {"blob": "ok"})

    def refuse(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        if message.id == "huge":
            raise ValueError(f"too big to handle: {message.body}")  # the error repeats it
        return keep_body(state, message)

    if batch:
        results = processor.process_batch([huge, small], refuse)
    else:
        results = [processor.process(huge, refuse), processor.process(small, refuse)]
    assert [r.outcome for r in results] == ["dead_lettered", "processed"]
    (letter,) = [m for m in sent.sent if m.destination == "dlq"]
    assert letter.body["message"]["body_omitted"] == _digest(huge.body)
    assert letter.body["error"]["type"] == "ValueError"
    text = letter.body["error"]["text"]
    assert len(text) < 1100 and text.endswith("characters)"), "the error text is cut"
    assert results[0].error is not None and len(results[0].error) < 1200
    # a body that fits is carried whole, as before
    processor.process(Message("fits", "acct", {"blob": "z" * 1000}), refuse)
    assert processor.process(Message("huge", "acct-2", {"small": 1}), refuse).outcome == (
        "dead_lettered"
    )
    assert sent.sent[-1].body["message"]["body"] == {"small": 1}


@pytest.mark.memory
@pytest.mark.parametrize("batch", [False, True], ids=["process", "process_batch"])
def test_many_outgoing_messages_that_together_exceed_the_entity(batch: bool) -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    fifth = "f" * (entities.max_entity_bytes // 5)

    def fan_out(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        count = message.body["count"]
        return {"n": state.get("n", 0) + 1}, [Send("out", {"blob": fifth})] * count

    messages = [Message("ten", "acct", {"count": 10}), Message("two", "acct", {"count": 2})]
    if batch:
        results = processor.process_batch(messages, fan_out)
    else:
        results = [processor.process(m, fan_out) for m in messages]
    assert [r.outcome for r in results] == ["dead_lettered", "processed"]
    assert "EntityTooLarge" in (results[0].error or "")
    assert entities.load("acct").state == {"n": 1}
    assert sum(m.destination == "out" for m in sent.sent) == 2


@pytest.mark.memory
@pytest.mark.parametrize("batch", [False, True], ids=["process", "process_batch"])
@pytest.mark.parametrize("where", ["body", "headers"])
def test_an_outgoing_message_over_the_dispatchers_bound(batch: bool, where: str) -> None:
    """Checked when the handler's outputs are made: the message is set aside (or named,
    without dead letters) before anything of it is saved or sent."""
    entities, dedup = _memory()
    calls: list[list[Any]] = []
    bounded = CallableDispatcher(calls.append, max_message_bytes=2000, max_header_bytes=500)

    def send(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        size = message.body["size"]
        headers = {"h": "v" * size} if where == "headers" else {}
        body = {"blob": "b" * size} if where == "body" else {}
        return {"n": state.get("n", 0) + 1}, [Send("out", body, headers)]

    big = {"body": 3000, "headers": 1000}[where]
    messages = [Message("big", "acct", {"size": big}), Message("small", "acct", {"size": 10})]
    processor = OutboxProcessor(entities, dedup, bounded, dead_letters="dlq")
    if batch:
        results = processor.process_batch(messages, send)
    else:
        results = [processor.process(m, send) for m in messages]
    assert [r.outcome for r in results] == ["dead_lettered", "processed"]
    assert "MessageTooLarge: message 'big' of entity 'acct'" in (results[0].error or "")
    assert entities.load("acct").state == {"n": 1}
    sent = [m for batch_ in calls for m in batch_]
    assert [m.destination for m in sent] == ["dlq", "out"]
    assert sent[0].body["message"]["body"] == {"size": big}, "the incoming message fits"

    strict = OutboxProcessor(*_memory(), bounded)
    with pytest.raises(MessageTooLarge, match="'big' of entity 'acct'") as caught:
        if batch:
            strict.process_batch(messages, send)
        else:
            strict.process(messages[0], send)
    error = caught.value
    assert (error.message_id, error.correlation_id) == ("big", "acct")
    assert error.bound == {"body": 2000, "headers": 500}[where] and error.size > error.bound
    assert error.outgoing_id == outgoing_id(strict.consumer, "acct", "big", 0)
    assert strict.entities.load("acct").version is None, "nothing of it was saved"


@pytest.mark.memory
def test_a_dead_letter_is_bounded_to_what_the_dispatcher_accepts() -> None:
    entities, dedup = _memory()
    calls: list[list[Any]] = []
    bounded = CallableDispatcher(calls.append, max_message_bytes=3000)
    processor = OutboxProcessor(entities, dedup, bounded, dead_letters="dlq")
    assert processor.letter_bytes() == 2998

    def fail(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        raise ValueError("no")

    body = {"blob": "q" * 5000}  # fits an entity easily, not the dispatcher
    headers = {"big": "h" * 5000}
    result = processor.process(Message("m1", "acct", body, headers), fail)
    assert result.outcome == "dead_lettered"
    (letter,) = calls[-1]
    assert letter.body["message"]["body_omitted"] == _digest(body)
    assert letter.body["message"]["headers_omitted"] == _digest(headers)
    # a dispatcher that cannot take even the bounded letter: the message is named
    tiny = OutboxProcessor(
        *_memory(), CallableDispatcher(calls.append, max_message_bytes=100), dead_letters="dlq"
    )
    with pytest.raises(MessageTooLarge, match="'m1' of entity 'acct' cannot be set aside"):
        tiny.process(Message("m1", "acct", body), fail)
    assert tiny.entities.load("acct").version is None


@pytest.mark.memory
@pytest.mark.parametrize("batch", [False, True], ids=["process", "process_batch"])
def test_an_entity_too_full_for_even_a_bounded_letter_names_the_message(batch: bool) -> None:
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), dead_letters="dlq")
    room = entities.max_entity_bytes - 200  # the state leaves no room for any letter

    def fill(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        if message.body == "fill":
            return {"blob": "s" * room}, []
        raise ValueError("poison")

    processor.process(Message("fill", "acct", "fill"), fill)
    with pytest.raises(EntityTooLarge, match="'bad' of entity 'acct' cannot be set aside") as e:
        if batch:
            processor.process_batch([Message("bad", "acct", "x")], fill)
        else:
            processor.process(Message("bad", "acct", "x"), fill)
    assert (e.value.message_id, e.value.correlation_id) == ("bad", "acct")


@pytest.mark.memory
def test_a_bounded_dead_letter_is_not_redriven() -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    _, huge = _the_batch(entities.max_entity_bytes)
    assert processor.process(huge, keep_body).outcome == "dead_lettered"
    letter = sent.sent[-1]
    with pytest.raises(DeadLetterIncomplete, match=f"dead letter {letter.id} of message 'huge'"):
        processor.redrive(letter, keep_body)
    with pytest.raises(ValueError, match="holds only the size and SHA-256 digest"):
        processor.redrive(letter.body, keep_body)


@pytest.mark.memory
def test_bounded_letter_is_the_one_rule() -> None:
    body = {"message": {"body": "b" * 100, "headers": {"h": "v" * 100}}, "error": {}}
    parts = (("message", "body"), ("message", "headers"))
    whole, text = bounded_letter(body, parts, 10_000)
    assert whole == body and text == canonical.dumps(body)
    cut, text = bounded_letter(body, parts, 250)  # (253 bytes whole, 248 without the body)
    assert cut["message"] == {"body_omitted": omitted("b" * 100), "headers": {"h": "v" * 100}}
    both, _ = bounded_letter(body, parts, 10)
    assert set(both["message"]) == {"body_omitted", "headers_omitted"}
    forced, _ = bounded_letter(body, parts, None, whole=False)
    assert forced == both
    assert body["message"]["body"] == "b" * 100, "the caller's value is not changed"
    assert omitted("é") == {"bytes": 4, "sha256": hashlib.sha256(b'"\xc3\xa9"').hexdigest()}
    assert Counter(bounded_letter(body, parts, None)[0]) == Counter(body)


@pytest.mark.memory
def test_the_consume_loops_dead_letter_of_a_malformed_delivery_is_bounded() -> None:
    """A delivery that is not a message, larger than a letter may be: the consume loop's
    letter follows the processor's rule (its body replaced by size and digest), keeps
    its id (named by the whole content), and the round goes on."""
    from dedupstore.consumers import Consumer
    from tests.test_consumers import ListBroker, deposit, entry

    huge = "{" + "x" * 5_000_000  # not JSON: malformed
    broker = ListBroker([(huge, {"id": "m1", "correlation_id": "acct"}), entry("m2", "acct", 2)])
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    stats = Consumer(broker, processor, deposit).run_once()
    assert (stats.acked, stats.set_aside, stats.nacked) == (2, 1, 0)
    (letter,) = [m for m in sent.sent if m.destination == "dlq"]
    assert letter.body["delivery"] == {
        "body_omitted": _digest(huge),
        "headers": {"id": "m1", "correlation_id": "acct"},
    }
    assert len(canonical.dumps(letter.body)) <= processor.letter_bytes()
    broker.add(huge, {"id": "m1", "correlation_id": "acct"})
    assert Consumer(broker, processor, deposit).run_once().set_aside == 1
    assert [m.id for m in sent.sent if m.destination == "dlq"] == [letter.id] * 2, "same id"


@pytest.mark.sqlite
@pytest.mark.parametrize("spark", ["local"], indirect=True)
def test_spark_sets_aside_an_oversize_message_and_processes_every_other_entity(
    spark: Any, tmp_path: Any
) -> None:
    """``process_messages`` and ``run_messages`` with one message larger than an entity
    among normal ones: it is dead-lettered (bounded), every other entity is processed,
    the task does not fail, and the run's record says so."""
    from dedupstore import open_dispatcher
    from dedupstore.spark import process_messages, run_messages

    db = f"sqlite:///{tmp_path}/stores.db"
    queue = f"sqlite:///{tmp_path}/queue.db"
    rows = [
        ("m0", "acct-0", "x"),
        ("m1", "acct-1", "x"),
        ("huge", "acct-0", "x" * 5_000_000),  # the last of its entity (see _the_batch)
        ("m2", "acct-2", "x"),
        ("m3", "acct-1", "x"),
    ]
    df = spark.createDataFrame(rows, "id string, correlation_id string, blob string")
    args: dict[str, Any] = {
        "entities_url": db,
        "dedup_url": db,
        "dispatcher_url": queue,
        "partitions": 1,
        "dead_letters": "dlq",
    }
    first = {r["message_id"]: r for r in process_messages(df, keep_body, **args).collect()}
    assert first["huge"]["outcome"] == "dead_lettered"
    assert first["huge"]["error"].startswith("EntityTooLarge: message 'huge' of entity 'acct-0'")
    assert {r["outcome"] for k, r in first.items() if k != "huge"} == {"processed"}
    with open_dispatcher(queue) as dispatcher:
        letters = [s.message for s in dispatcher.messages() if s.message.destination == "dlq"]  # type: ignore[attr-defined]
    assert len(letters) == 1 and "body_omitted" in letters[0].body["message"]

    more = spark.createDataFrame(
        [("huge2", "acct-5", "y" * 5_000_000), ("n1", "acct-6", "y"), ("n2", "acct-7", "y")],
        df.schema,
    )
    record = run_messages(more, keep_body, results_path=str(tmp_path / "run"), **args)
    outcomes = {r["message_id"]: r["outcome"] for r in record.collect()}
    assert outcomes == {"huge2": "dead_lettered", "n1": "processed", "n2": "processed"}
