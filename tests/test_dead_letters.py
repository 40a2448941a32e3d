"""Poison messages: the error policy of ``OutboxProcessor`` (fail, or dead letters).

Without ``dead_letters`` a handler failure raises ``HandlerError`` naming the message
and the entity, and nothing is saved. With it, the message is set aside exactly once:
its key is recorded, one dead-letter message with a deterministic id carries the
original message, the error and the attempt count, the entity's state is untouched,
and a replay does not dead-letter it again.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections import Counter
from typing import Any

import pytest

from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.errors import ConfigurationError, HandlerError, StoreUnavailable
from dedupstore.ids import message_key, outgoing_id
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, sweep
from tests.outbox_backends import OutboxBackend, backend_params


def deposit(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Adds the amount; a negative amount is poison (the handler raises)."""
    amount = message.body["amount"]
    if amount < 0:
        raise ValueError(f"a deposit cannot be negative: {amount}")
    balance = state.get("balance", 0) + amount
    return {"balance": balance, "n": state.get("n", 0) + 1}, [Send("deposited", {"n": amount})]


def _memory() -> tuple[MemoryEntityStore, MemoryDeduplicationStore]:
    url = f"memory://{uuid.uuid4().hex}"
    return MemoryEntityStore(url), MemoryDeduplicationStore(url)


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_a_poison_message_is_dead_lettered_exactly_once(
    outbox_backend: OutboxBackend, cleanup: Any
) -> None:
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, cleanup=cleanup, dead_letters="dlq")
    good = [Message(f"m{n}", f"acct-{n % 3}", {"amount": n}) for n in range(1, 10)]
    bad = Message("bad-1", "acct-1", {"amount": -5})
    try:
        results = processor.process_batch([*good[:4], bad, *good[4:]], deposit)
        outcomes = [r.outcome for r in results]
        assert outcomes == ["processed"] * 4 + ["dead_lettered"] + ["processed"] * 5
        assert results[4].error == "ValueError: a deposit cannot be negative: -5"
        alone = processor.process(Message("bad-2", "acct-2", {"amount": -1}), deposit)
        assert alone.outcome == "dead_lettered"
        replay = processor.process_batch([bad, *good, Message("bad-2", "acct-2", {})], deposit)
        assert {r.outcome for r in replay} == {"duplicate"}
        assert processor.process(bad, deposit).outcome == "duplicate"
        sweep(entities, dedup)
        letters = [m for m in sent.sent if m.destination == "dlq"]
        assert [m.id for m in letters] == [
            outgoing_id(dedup.endpoint, "acct-1", "bad-1", -1),
            outgoing_id(dedup.endpoint, "acct-2", "bad-2", -1),
        ]
        assert letters[0].body == {
            "message": {
                "id": "bad-1",
                "correlation_id": "acct-1",
                "body": {"amount": -5},
                "headers": {},
            },
            "error": {"type": "ValueError", "text": "a deposit cannot be negative: -5"},
            "attempts": 1,
            "consumer": dedup.endpoint,
        }
        balances = {e.id: e.state for e in entities.load_many(["acct-0", "acct-1"]).values()}
        assert balances["acct-1"] == {"balance": 1 + 4 + 7, "n": 3}, "poison left no change"
        keys = {message_key("acct-1", "bad-1"), message_key("acct-2", "bad-2")}
        assert dedup.processed_among(keys) == keys
        assert len({m.id for m in sent.sent if m.destination == "deposited"}) == 9
    finally:
        entities.close()
        dedup.close()


@pytest.mark.memory
def test_one_poison_message_among_ten_thousand() -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, cleanup="deferred", dead_letters="dlq")
    messages = [Message(f"m{n}", f"acct-{n % 50}", {"amount": 1}) for n in range(10_000)]
    messages[6_789] = Message("m6789", "acct-39", {"amount": -1})
    for start in range(0, len(messages), 1000):
        processor.process_batch(messages[start : start + 1000], deposit)
    again = processor.process_batch(messages[6_000:7_000], deposit)
    assert {r.outcome for r in again} == {"duplicate"}
    assert sum(m.destination == "dlq" for m in sent.sent) == 1
    total = sum(e.state["n"] for e in entities.load_many([f"acct-{n}" for n in range(50)]).values())
    assert total == 9_999


@pytest.mark.memory
def test_without_dead_letters_the_error_names_the_message_and_nothing_is_saved() -> None:
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    bad = Message("bad-1", "acct-1", {"amount": -5})
    with pytest.raises(HandlerError, match="'bad-1' of entity 'acct-1': ValueError") as caught:
        processor.process(bad, deposit)
    assert isinstance(caught.value.error, ValueError)
    assert (caught.value.message_id, caught.value.correlation_id) == ("bad-1", "acct-1")
    assert caught.value.__cause__ is caught.value.error
    with pytest.raises(HandlerError, match="'bad-1' of entity 'acct-1'"):
        processor.process_batch([Message("m1", "acct-1", {"amount": 1}), bad], deposit)
    assert entities.load("acct-1").version is None, "nothing of the batch was saved"
    assert not dedup.has_been_processed(message_key("acct-1", "bad-1"))


@pytest.mark.memory
@pytest.mark.parametrize(
    ("returned", "said"),
    [
        (None, "it returned NoneType None"),
        ({"state": 1}, "it returned dict"),
        (([], []), "its new state is list"),
        (({}, ["not a send"]), "it asked to send str"),
        (({"t": dt.datetime(2026, 1, 1)}, []), 'state["t"]: a datetime is not JSON-compatible'),
    ],
    ids=["none", "a-dict", "state-not-a-dict", "not-a-send", "not-json"],
)
def test_a_handler_that_breaks_its_contract_is_told_what_to_return(
    returned: Any, said: str
) -> None:
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    with pytest.raises(HandlerError, match="'m1' of entity 'acct-1'") as caught:
        processor.process(Message("m1", "acct-1", None), lambda state, message: returned)
    assert said in str(caught.value)
    assert "cannot unpack" not in str(caught.value)


@pytest.mark.memory
def test_a_store_error_from_a_handler_is_never_poison() -> None:
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), dead_letters="dlq")

    def calls_a_store(state: dict[str, Any], message: Message) -> Any:
        raise StoreUnavailable("the lookup table did not answer")

    with pytest.raises(StoreUnavailable):
        processor.process(Message("m1", "acct-1", None), calls_a_store)
    with pytest.raises(StoreUnavailable):
        processor.process_batch([Message("m1", "acct-1", None)], calls_a_store)
    assert entities.load("acct-1").version is None


@pytest.mark.memory
def test_handler_attempts_bound_the_reruns_and_are_recorded() -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq", handler_attempts=3)
    calls: list[str] = []

    def flaky(state: dict[str, Any], message: Message) -> Any:
        calls.append(message.id)
        if message.id == "always" or calls.count(message.id) < 2:
            raise RuntimeError("flaky")
        return {"ok": True}, []

    assert processor.process(Message("once", "a", None), flaky).outcome == "processed"
    assert calls.count("once") == 2
    assert processor.process(Message("always", "b", None), flaky).outcome == "dead_lettered"
    assert calls.count("always") == 3
    assert sent.sent[-1].body["attempts"] == 3


@pytest.mark.memory
def test_a_body_that_is_not_json_reaches_the_dead_letter_as_text() -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    message = Message("m1", "a", {"at": at, "amount": -1})
    assert processor.process(message, deposit).outcome == "dead_lettered"
    assert sent.sent[0].body["message"]["body"] == {"at": repr(at), "amount": -1}


@pytest.mark.memory
@pytest.mark.parametrize("bad", ["", "x\x00y", 5])
def test_a_bad_dead_letter_destination_is_a_configuration_error(bad: Any) -> None:
    entities, dedup = _memory()
    with pytest.raises(ConfigurationError, match="dead-letter destination"):
        OutboxProcessor(entities, dedup, InMemoryDispatcher(), dead_letters=bad)


# ---------------------------------------------------------------------- Spark


@pytest.mark.sqlite
@pytest.mark.parametrize("spark", ["local", "connect"], indirect=True)
def test_process_messages_dead_letters_a_poison_row_and_goes_on(spark: Any, tmp_path: Any) -> None:
    from dedupstore import open_dispatcher
    from dedupstore.spark import process_messages

    db = f"sqlite:///{tmp_path}/stores.db"
    queue = f"sqlite:///{tmp_path}/queue.db"
    rows = [(f"m{n}", f"acct-{n % 4}", -1 if n == 13 else 1) for n in range(40)]
    df = spark.createDataFrame(rows, "id string, correlation_id string, amount long")
    args: dict[str, Any] = {
        "entities_url": db,
        "dedup_url": db,
        "dispatcher_url": queue,
        "partitions": 2,
        "batch_size": 7,
        "dead_letters": "dlq",
    }
    first = process_messages(df, deposit, **args).collect()
    outcomes = {r["message_id"]: (r["outcome"], r["error"]) for r in first}
    assert outcomes.pop("m13") == ("dead_lettered", "ValueError: a deposit cannot be negative: -1")
    assert set(outcomes.values()) == {("processed", None)}
    again = process_messages(df, deposit, **args).collect()
    assert {r["outcome"] for r in again} <= {"duplicate", "redispatched"}
    with open_dispatcher(queue) as dispatcher:
        letters = [s.message for s in dispatcher.messages() if s.message.destination == "dlq"]  # type: ignore[attr-defined]
    assert len(letters) == 1 and letters[0].body["message"]["id"] == "m13"
    without = {k: v for k, v in args.items() if k != "dead_letters"}
    poison = spark.createDataFrame([("p1", "acct-9", -3)], df.schema)
    with pytest.raises(Exception, match="'p1' of entity 'acct-9'"):
        process_messages(poison, deposit, **without).collect()


@pytest.mark.memory
@pytest.mark.parametrize("as_body", [False, True], ids=["letter", "body"])
def test_a_dead_letter_is_redriven_once_after_a_fix(as_body: bool) -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    bad = Message("bad-1", "acct-1", {"amount": -5}, {"trace": "t1"})
    assert processor.process(bad, deposit).outcome == "dead_lettered"
    letter = sent.sent[-1]

    def fixed(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        assert message.headers == {"trace": "t1", "dedupstore-redrive-of": "bad-1"}
        return deposit(state, Message(message.id, message.correlation_id, {"amount": 5}))

    given = letter.body if as_body else letter
    assert processor.redrive(given, fixed).outcome == "processed"
    assert processor.redrive(given, fixed).outcome == "duplicate"
    assert processor.process(bad, deposit).outcome == "duplicate"
    assert entities.load("acct-1").state == {"balance": 5, "n": 1}
    again = processor.redrive(given, deposit)  # not fixed: set aside again, once
    assert again.outcome == "duplicate"
    with pytest.raises(ConfigurationError, match="not a dead letter"):
        processor.redrive({"x": 1}, fixed)
    billing = MemoryDeduplicationStore(f"memory://{uuid.uuid4().hex}", endpoint="billing")
    with pytest.raises(ConfigurationError, match="belongs to consumer"):
        OutboxProcessor(entities, billing, sent).redrive(letter, fixed)


@pytest.mark.memory
def test_a_redrive_that_fails_again_is_dead_lettered_again() -> None:
    entities, dedup = _memory()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, dead_letters="dlq")
    processor.process(Message("bad-1", "acct-1", {"amount": -5}), deposit)
    first = sent.sent[-1]
    assert processor.redrive(first, deposit).outcome == "dead_lettered"
    second = sent.sent[-1]
    assert second.id == outgoing_id(dedup.endpoint, "acct-1", first.id, -1)
    assert second.body["message"]["headers"] == {"dedupstore-redrive-of": "bad-1"}
    assert processor.redrive(first, deposit).outcome == "duplicate"


@pytest.mark.sqlite
@pytest.mark.parametrize("spark", ["local"], indirect=True)
def test_invalid_rows_are_dead_lettered_with_dead_letters(spark: Any, tmp_path: Any) -> None:
    """A null or invalid id is set aside (once per distinct row) instead of failing the job."""
    from dedupstore.spark import process_messages
    from dedupstore.spark._columns import INVALID_ENTITY

    db = f"sqlite:///{tmp_path}/stores.db"
    rows = [("m1", "acct-1", 1), (None, "acct-1", 2), ("m2", None, 3), ("x" * 2000, "acct-2", 4)]
    df = spark.createDataFrame(rows, "id string, correlation_id string, amount long")
    args: dict[str, Any] = {
        "entities_url": db,
        "dedup_url": db,
        "dispatcher_url": f"sqlite:///{tmp_path}/queue.db",
        "partitions": 1,
        "dead_letters": "dlq",
    }
    first = sorted(process_messages(df, deposit, **args).collect(), key=lambda r: r["attempts"])
    by_outcome = Counter(r["outcome"] for r in first)
    assert by_outcome == Counter({"processed": 1, "dead_lettered": 3})
    errors = sorted(r["error"] for r in first if r["outcome"] == "dead_lettered")
    assert any("null message id" in e and "'acct-1'" in e for e in errors), errors
    assert any("null correlation id" in e and "'m2'" in e for e in errors), errors
    assert any("1024" in e for e in errors), errors
    entities = {r["correlation_id"] for r in first if r["outcome"] == "dead_lettered"}
    assert entities == {"acct-1", INVALID_ENTITY, "acct-2"}
    again = process_messages(df, deposit, **args).collect()
    assert {r["outcome"] for r in again} <= {"duplicate", "redispatched"}
    without = {k: v for k, v in args.items() if k != "dead_letters"}
    with pytest.raises(Exception, match=r"null (message|correlation) id"):
        process_messages(df, deposit, **without).collect()


@pytest.mark.parametrize("batch", [False, True], ids=["process", "process_batch"])
@pytest.mark.parametrize("first", [True, False], ids=["loaded-state", "state-of-the-batch"])
def test_a_handler_that_changes_its_state_then_fails_changes_nothing(
    batch: bool, first: bool
) -> None:
    """The handler may be given the entity's own decoded state (not a copy): what a
    failing attempt changed in it must not reach the next attempt, the next message
    or the saved entity."""
    entities, dedup = _memory()
    processor = OutboxProcessor(
        entities, dedup, InMemoryDispatcher(), dead_letters="dlq", handler_attempts=2
    )
    given: list[dict[str, Any]] = []

    def vandal(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        given.append(json.loads(json.dumps(state)))
        if message.body.get("poison"):
            state["balance"] = -1000
            state.setdefault("log", []).append("spoiled")
            raise ValueError("poison")
        return deposit(state, message)

    processor.process(Message("m1", "acct", {"amount": 5}), vandal)
    bad = Message("bad", "acct", {"amount": 0, "poison": True})
    later = [Message("m2", "acct", {"amount": 1}), Message("m3", "acct", {"amount": 2})]
    messages = [bad, *later] if first else [later[0], bad, later[1]]
    if batch:
        outcomes = [r.outcome for r in processor.process_batch(messages, vandal)]
    else:
        outcomes = [processor.process(m, vandal).outcome for m in messages]
    assert outcomes.count("dead_lettered") == 1 and outcomes.count("processed") == 2
    before_bad = {"balance": 5, "n": 1} if first else {"balance": 6, "n": 2}
    assert given[1 if first else 2 : 3 if first else 4] == [before_bad, before_bad]  # 2 attempts
    assert entities.load("acct").state == {"balance": 8, "n": 3}
