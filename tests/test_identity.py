"""Message identity is (consumer, entity, message id); entity records stay bounded.

The cases a user found on real inputs: the same message id under two entities, two
consumers of one event, a hot entity in deferred mode, a batch whose outputs for one
entity do not fit in one record, and exact outcomes for copies inside one batch. The
identity cases run on every backend; the size cases on the in-process and SQLite
backends at full size, and on every backend with its own record limit.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedupstore import open_dispatcher
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.entities import (
    ENTITY_FRAME_BYTES,
    Entity,
    EntityStore,
    EntryMark,
    OutgoingMessage,
    decode_entity,
    encode_entity,
    entry_size,
    head_size,
    json_size,
)
from dedupstore.errors import ConfigurationError, EntityTooLarge
from dedupstore.ids import MAX_ID_BYTES, message_key, outgoing_id
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, sweep
from dedupstore.store import DeduplicationStore
from tests.outbox_backends import OutboxBackend, backend_params
from tests.test_outbox_memory import _Interfering


def ledger(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Adds the amount to the balance and announces it."""
    balance = state.get("balance", 0) + message.body
    return {"balance": balance, "n": state.get("n", 0) + 1}, [
        Send("ledger.posted", {"entity": message.correlation_id, "amount": message.body})
    ]


def _memory() -> tuple[MemoryEntityStore, MemoryDeduplicationStore]:
    url = f"memory://{uuid.uuid4().hex}"
    return MemoryEntityStore(url), MemoryDeduplicationStore(url)


# ---------------------------------------------------------------------- identity


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_the_same_id_under_two_entities_is_two_messages(
    outbox_backend: OutboxBackend, cleanup: Any
) -> None:
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, cleanup=cleanup)
    alice, bob = Message("txn-1", "alice", 100), Message("txn-1", "bob", 250)
    try:
        assert processor.process(alice, ledger).outcome == "processed"
        assert processor.process(bob, ledger).outcome == "processed"
        carol, dave = Message("txn-1", "carol", 7), Message("txn-1", "dave", 9)
        batch = processor.process_batch([carol, dave, carol], ledger)
        assert [r.outcome for r in batch] == ["processed", "processed", "duplicate"]
        assert sweep(entities, dedup).ids_left == 0
        again = [alice, bob, carol, dave]
        assert [processor.process(m, ledger).outcome for m in again] == ["duplicate"] * 4
        assert [r.outcome for r in processor.process_batch(again, ledger)] == ["duplicate"] * 4
        balances = {e.id: e.state["balance"] for e in entities.load_many(["alice", "bob"]).values()}
        assert balances == {"alice": 100, "bob": 250}
        ids = [m.id for m in sent.sent]
        assert len(set(ids)) == 4, "four processings, four distinct outgoing ids"
        assert set(ids) == {
            outgoing_id(dedup.endpoint, m.correlation_id, "txn-1", 0) for m in again
        }
        keys = {message_key(m.correlation_id, m.id) for m in again}
        assert dedup.processed_among(keys) == keys
        assert not dedup.has_been_processed("txn-1"), "the bare id is not the record"
    finally:
        entities.close()
        dedup.close()


@pytest.mark.sqlite
def test_two_entities_reach_a_table_queue_as_two_messages(tmp_path: Path) -> None:
    """process_batch of txn-1 under alice and bob: both events land, nothing stays pending."""
    url = f"sqlite:///{tmp_path}/s.db"
    from dedupstore import open_entity_store, open_store

    with (
        open_entity_store(url) as entities,
        open_store(url) as dedup,
        open_dispatcher(f"sqlite:///{tmp_path}/queue.db") as queue,
    ):
        processor = OutboxProcessor(entities, dedup, queue, cleanup="deferred")
        messages = [Message("txn-1", "alice", 100), Message("txn-1", "bob", 250)]
        assert [r.outcome for r in processor.process_batch(messages, ledger)] == ["processed"] * 2
        received = list(queue.messages())  # type: ignore[attr-defined]
        assert sorted(r.message.body["entity"] for r in received) == ["alice", "bob"]
        assert [r.mismatches for r in received] == [0, 0]
        result = sweep(entities, dedup)
        assert (result.ids_moved, result.ids_left) == (2, 0)
        assert all(not e.outbox for e in entities.load_many(["alice", "bob"]).values())
        replay = processor.process(Message("txn-1", "bob", 250), ledger)
        assert replay.outcome == "duplicate"
        assert entities.load("bob").state["balance"] == 250


@pytest.mark.memory
def test_sweep_counts_pending_entries_as_left() -> None:
    """An entry still awaiting dispatch is not moved: ids_left says so."""
    entities, dedup = _memory()

    class Down:
        def dispatch(self, messages: Any) -> None:
            raise ConnectionError("broker down")

    processor = OutboxProcessor(entities, dedup, Down(), cleanup="deferred")
    with pytest.raises(ConnectionError):
        processor.process(Message("m1", "alice", 1), ledger)
    result = sweep(entities, dedup)
    assert (result.ids_moved, result.ids_left) == (0, 1)
    relayed = sweep(entities, dedup, redispatch=InMemoryDispatcher())
    assert (relayed.redispatched, relayed.ids_moved, relayed.ids_left) == (1, 1, 0)
    assert sweep(entities, dedup).ids_left == 0


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("memory", marks=pytest.mark.memory),
        pytest.param("sqlite", marks=pytest.mark.sqlite),
    ],
)
def test_two_consumers_of_one_event_emit_distinct_ids(kind: str, tmp_path: Path) -> None:
    """billing and shipping both handle order-placed-42: a saga receives both outputs.

    Each consumer has its own entity store and its own endpoint in one dedup store.
    """
    from dedupstore import open_entity_store, open_store

    event = Message("order-placed-42", "order-42", {"total": 10})
    saga = InMemoryDispatcher()
    expected = []
    shared = f"memory://{uuid.uuid4().hex}" if kind == "memory" else f"sqlite:///{tmp_path}/d.db"
    for consumer, destination in (("billing", "billing.invoiced"), ("shipping", "ship.planned")):
        own = (
            f"memory://{uuid.uuid4().hex}"
            if kind == "memory"
            else f"sqlite:///{tmp_path}/{consumer}.db"
        )

        def handle(state: dict[str, Any], m: Message, to: str = destination) -> Any:
            return {"seen": True}, [Send(to, m.body)]

        with open_entity_store(own) as entities, open_store(shared, endpoint=consumer) as dedup:
            processor = OutboxProcessor(entities, dedup, saga)
            assert processor.consumer == consumer
            assert processor.process(event, handle).outcome == "processed"
            assert processor.process(event, handle).outcome == "duplicate"
        expected.append(outgoing_id(consumer, "order-42", event.id, 0))
    assert [m.id for m in saga.sent] == expected
    assert len(set(expected)) == 2


@pytest.mark.memory
def test_outgoing_ids_differ_by_consumer_entity_id_and_position() -> None:
    base = outgoing_id("billing", "order-42", "order-placed-42", 0)
    assert base == outgoing_id("billing", "order-42", "order-placed-42", 0)
    others = {
        outgoing_id("shipping", "order-42", "order-placed-42", 0),
        outgoing_id("billing", "order-43", "order-placed-42", 0),
        outgoing_id("billing", "order-42", "order-placed-43", 0),
        outgoing_id("billing", "order-42", "order-placed-42", 1),
        # a separator inside a part cannot make two triples collide
        outgoing_id("billing", "order-4", "2order-placed-42", 0),
    }
    assert base not in others and len(others) == 5
    assert str(uuid.UUID(base)) == base


@pytest.mark.memory
def test_message_keys_are_unambiguous_and_bounded() -> None:
    assert message_key("alice", "txn-1") == "5:alice:txn-1"
    assert message_key("a:b", "c") != message_key("a", "b:c")
    assert message_key("1:a", "b") != message_key("1", "a:b")
    long = message_key("é" * 1024, "x" * 1024)
    assert long.startswith("#") and len(long.encode()) <= MAX_ID_BYTES
    assert long != message_key("é" * 1024, "x" * 1023)
    fits = message_key("a" * 500, "b" * 500)
    assert fits.startswith("500:") and len(fits) <= MAX_ID_BYTES


# ---------------------------------------------------------------------- sizes


def _counter(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    return {"n": state.get("n", 0) + 1}, [Send("out", {"n": state.get("n", 0) + 1})]


@pytest.mark.memory
def test_a_hot_entity_in_deferred_mode_never_outgrows_its_record() -> None:
    """200,000 messages for one account, deferred clean-up, no sweep."""
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
    total = 200_000
    for start in range(0, total, 1000):
        batch = [Message(f"txn-{n:032d}", "hot", None) for n in range(start, start + 1000)]
        assert all(r.outcome == "processed" for r in processor.process_batch(batch, _counter))
    entity = entities.load("hot")
    assert entity.state["n"] == total
    assert len(entity.outbox) <= processor.deferred_limit
    kept = set(entity.outbox)
    moved = {f"txn-{n:032d}" for n in range(total)} - kept
    keys = [message_key("hot", mid) for mid in moved]
    assert dedup.processed_among(keys) == set(keys), "every id left the outbox for the store"
    again = [Message(f"txn-{n:032d}", "hot", None) for n in range(0, total, 997)]
    assert {r.outcome for r in processor.process_batch(again, _counter)} == {"duplicate"}
    assert entities.load("hot").state["n"] == total


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
def test_deferred_limit_moves_dispatched_ids_inline(outbox_backend: OutboxBackend) -> None:
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    processor = OutboxProcessor(
        entities, dedup, InMemoryDispatcher(), cleanup="deferred", deferred_limit=5
    )
    try:
        for n in range(12):
            processor.process(Message(f"p{n}", "acct", None), _counter)
        assert len(entities.load("acct").outbox) <= 5
        batch = [Message(f"b{n}", "acct", None) for n in range(12)]
        processor.process_batch(batch, _counter)
        entity = entities.load("acct")
        assert len(entity.outbox) <= 5 and entity.state["n"] == 24
        sweep(entities, dedup)
        everything = [f"p{n}" for n in range(12)] + [f"b{n}" for n in range(12)]
        keys = {message_key("acct", m) for m in everything}
        assert dedup.processed_among(keys) == keys
        replay = [Message(mid, "acct", None) for mid in everything]
        assert {r.outcome for r in processor.process_batch(replay, _counter)} == {"duplicate"}
    finally:
        entities.close()
        dedup.close()


def _blob(size: int) -> Any:
    def handle(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        n = state.get("n", 0) + 1
        return {"n": n}, [Send("blobs", {"n": n, "blob": "x" * size})]

    return handle


@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
@pytest.mark.parametrize(
    ("count", "size"), [(1000, 5_000), (2, 3_000_000)], ids=["1000x5KB", "2x3MB"]
)
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("memory", marks=pytest.mark.memory),
        pytest.param("sqlite", marks=pytest.mark.sqlite),
    ],
)
def test_a_batch_whose_outputs_do_not_fit_runs_in_rounds(
    kind: str, count: int, size: int, cleanup: Any, tmp_path: Path
) -> None:
    if kind == "memory":
        entities: EntityStore
        dedup: DeduplicationStore
        entities, dedup = _memory()
    else:
        from dedupstore import open_entity_store, open_store

        url = f"sqlite:///{tmp_path}/s.db"
        entities, dedup = open_entity_store(url), open_store(url)
    sent = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, sent, cleanup=cleanup)
    messages = [Message(f"m{n}", "hot", None) for n in range(count)]
    results = processor.process_batch([*messages, messages[0]], _blob(size))
    assert [r.outcome for r in results] == ["processed"] * count + ["duplicate"]
    assert entities.load("hot").state["n"] == count
    assert [m.body["n"] for m in sent.sent] == list(range(1, count + 1)), "in order, once each"
    assert len({m.id for m in sent.sent}) == count
    sweep(entities, dedup)
    assert not entities.load("hot").outbox
    entities.close()
    dedup.close()


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
def test_rounds_fit_each_backends_own_limit(outbox_backend: OutboxBackend) -> None:
    """Ten outputs of a fifth of the record limit each, for one entity, in one batch."""
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    size = entities.max_entity_bytes // 5
    try:
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        messages = [Message(f"m{n}", "hot", None) for n in range(10)]
        assert {r.outcome for r in processor.process_batch(messages, _blob(size))} == {"processed"}
        assert entities.load("hot").state["n"] == 10
    finally:
        entities.close()
        dedup.close()


@pytest.mark.memory
@pytest.mark.parametrize("batch", [False, True], ids=["process", "process_batch"])
def test_a_message_that_does_not_fit_alone_names_itself(batch: bool) -> None:
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    processor.process(Message("small", "acct", None), _blob(10))
    huge = Message("huge-1", "acct", None)
    with pytest.raises(EntityTooLarge, match="'huge-1' of entity 'acct'"):
        if batch:
            processor.process_batch([huge], _blob(entities.max_entity_bytes))
        else:
            processor.process(huge, _blob(entities.max_entity_bytes))
    entity = entities.load("acct")
    assert entity.state == {"n": 1} and not entity.outbox, "nothing of it was written"


@pytest.mark.memory
def test_process_moves_dispatched_ids_to_make_room() -> None:
    """Deferred entries left by an earlier run do not make a fitting message too large."""
    entities, dedup = _memory()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
    long_ids = [f"{n:04d}" + "i" * 1000 for n in range(600)]  # ~600 KB of dispatched ids
    for mid in long_ids:
        processor.process(Message(mid, "acct", None), _counter)
    assert entities.load("acct").outbox, "some dispatched ids are kept (deferred)"
    big = entities.max_entity_bytes - 60_000  # fits alone, not beside the kept ids
    assert processor.process(Message("big", "acct", None), _blob(big)).outcome == "processed"
    assert list(entities.load("acct").outbox) == ["big"], "the kept ids moved to the store"
    keys = [message_key("acct", mid) for mid in long_ids]
    assert dedup.processed_among(keys) == set(keys)


# ---------------------------------------------------------------------- outcomes


def _conflicts(url: str, nth: int) -> MemoryEntityStore:
    """The ``nth`` ``save_many`` (1: the state save, 2: the clean-up) meets a rival save."""
    store = _Interfering(url)
    store.nth = nth
    return store


@pytest.mark.memory
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
@pytest.mark.parametrize("nth", [1, 2], ids=["state-save-conflicts", "cleanup-save-conflicts"])
def test_copies_in_one_batch_have_exact_outcomes_after_a_conflict(cleanup: Any, nth: int) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities, dedup = _conflicts(url, nth), MemoryDeduplicationStore(url)
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup=cleanup)
    m1, m2 = Message("m1", "acct", 5), Message("m2", "acct", 7)
    results = processor.process_batch([m1, m1, m2, m1, m2], ledger)
    assert [r.outcome for r in results] == [
        "processed",
        "duplicate",
        "processed",
        "duplicate",
        "duplicate",
    ]
    assert entities.load("acct").state["balance"] == 12


@pytest.mark.memory
def test_copies_of_a_pending_message_are_redispatched_once() -> None:
    entities, dedup = _memory()

    class FailOnce:
        calls = 0

        def dispatch(self, messages: Any) -> None:
            FailOnce.calls += 1
            if FailOnce.calls == 1:
                raise ConnectionError("down")

    processor = OutboxProcessor(entities, dedup, FailOnce(), cleanup="deferred")
    with pytest.raises(ConnectionError):
        processor.process(Message("m1", "acct", 5), ledger)
    again = processor.process_batch([Message("m1", "acct", 5)] * 3, ledger)
    assert [r.outcome for r in again] == ["redispatched", "duplicate", "duplicate"]


# ---------------------------------------------------------------------- exact sizes

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_ids = st.text(min_size=1, max_size=6).filter(lambda t: "\x00" not in t and t.isprintable())
_entries = st.none() | st.lists(
    st.builds(OutgoingMessage, id=_ids, destination=_ids, body=_json), max_size=2
)


_marks = st.none() | st.builds(EntryMark, at=st.integers(10**12, 10**13 - 1), run=st.none() | _ids)


@pytest.mark.memory
@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    state=st.dictionaries(st.text(max_size=5), _json, max_size=4),
    outbox=st.dictionaries(_ids, st.tuples(_entries, _marks), max_size=4),
    consumer=st.none() | _ids | st.sampled_from(['a"b', "c\\d", "é", '","outbox":{},"state":']),
)
def test_entity_sizes_add_up_to_the_encoded_length(
    state: dict[str, Any], outbox: dict[str, Any], consumer: str | None
) -> None:
    """What process_batch's rounds measure is exactly what a store checks; marks and the
    consumer round-trip (the decoder's fast path included)."""
    marks = {mid: mark for mid, (entry, mark) in outbox.items() if mark and entry is not None}
    entity = Entity(
        "e", state, {mid: entry for mid, (entry, _) in outbox.items()}, None, marks, consumer
    )
    entries = [entry_size(mid, entry, marks.get(mid)) for mid, (entry, _) in outbox.items()]
    frame = ENTITY_FRAME_BYTES + head_size(entity)
    total = frame + json_size(state) + sum(entries) + max(len(entries) - 1, 0)
    text = encode_entity(entity)
    assert total == len(text.encode("utf-8"))
    assert decode_entity("e", text, None) == entity


@pytest.mark.memory
def test_entries_are_marked_with_their_time_and_run_and_a_run_says_what_it_did() -> None:
    import time

    entities, dedup = _memory()
    refused = {"m2"}

    class Refusing(InMemoryDispatcher):
        def dispatch(self, messages: Any) -> None:
            if any(m.body.get("n") in refused for m in messages):
                raise ConnectionError("the broker is down")
            super().dispatch(messages)

    out = Refusing()
    processor = OutboxProcessor(
        entities, dedup, out, cleanup="deferred", run="run-1", dead_letters="dlq"
    )
    before = int(time.time() * 1000)
    with pytest.raises(ConnectionError):
        processor.process(Message("m2", "e", {"n": "m2"}), echo)
    after = int(time.time() * 1000)
    entity = entities.load("e")
    assert entity.pending == ["m2"] and entity.marks["m2"].run == "run-1"
    assert (
        before <= entity.marks["m2"].at <= after and entity.pending_since() == entity.marks["m2"].at
    )
    # the same run finds its own entry: what it did, not "redispatched"; another run: redispatched
    refused.clear()
    other = OutboxProcessor(entities, dedup, out, cleanup="deferred", run="run-2")
    assert processor.process(Message("m2", "e", {"n": "m2"}), echo).outcome == "processed"
    assert entities.load("e").marks == {}  # dispatched: no mark is kept
    # a record written before any clean-up; when it fails, nothing is cleaned up
    seen: list[tuple[str, str]] = []

    def failing(messages: Any, results: Any) -> None:
        seen.extend((m.id, r.outcome) for m, r in zip(messages, results, strict=True))
        raise OSError("the record could not be written")

    batch = [Message("m3", "e", {"n": "m3"}), Message("bad", "e", {"n": -1})]
    with pytest.raises(OSError):
        processor.process_batch(batch, echo, before_cleanup=failing)
    assert seen == [("m3", "processed"), ("bad", "dead_lettered")]
    assert sorted(entities.load("e").pending) == ["bad", "m3"]
    assert [r.outcome for r in other.process_batch(batch, echo)] == ["redispatched"] * 2
    assert [r.outcome for r in processor.process_batch(batch, echo)] == ["duplicate"] * 2
    with pytest.raises(ConfigurationError, match="run"):
        OutboxProcessor(entities, dedup, out, run="")


def echo(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Sends its body back; a negative ``n`` is poison."""
    if message.body["n"] == -1:
        raise ValueError("negative")
    return state, [Send("out", message.body)]


@pytest.mark.sqlite
def test_the_sweep_command_exits_3_while_an_entry_awaits_dispatch(tmp_path: Path) -> None:
    from dedupstore import open_entity_store, open_store
    from dedupstore.cli import main

    url = f"sqlite:///{tmp_path}/s.db"

    class Down:
        def dispatch(self, messages: Any) -> None:
            raise ConnectionError("broker down")

    with (
        open_entity_store(url) as entities,
        open_store(url) as dedup,
        pytest.raises(ConnectionError),
    ):
        OutboxProcessor(entities, dedup, Down(), cleanup="deferred").process(
            Message("m1", "alice", 1), ledger
        )
    assert main(["entities", "sweep", url, "--dedup", url]) == 3
