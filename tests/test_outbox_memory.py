"""The entity store contract and the outbox processor on the in-process backend."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import threading
import uuid
from collections import Counter
from typing import Any

import pytest

from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.entities import OutgoingMessage, message_text
from dedupstore.errors import ConfigurationError, HandlerError, InvalidMessageId
from dedupstore.outbox import (
    InMemoryDispatcher,
    Message,
    OutboxProcessor,
    Send,
    message_key,
    sweep,
)
from dedupstore.outbox import cache as outbox_cache
from dedupstore.store import DeduplicationStore
from dedupstore.testing.entities import EntityStoreContract, EntityStoreFactory

pytestmark = pytest.mark.memory


class TestMemoryEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self) -> EntityStoreFactory:
        url = f"memory://{uuid.uuid4().hex}"
        return lambda **options: MemoryEntityStore(url, **options)


def recorded(dedup: DeduplicationStore, messages: list[Message]) -> bool:
    """Whether every message is recorded under its (entity, id) key."""
    keys = {message_key(m.correlation_id, m.id) for m in messages}
    return dedup.processed_among(keys) == keys


def order_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Adds an item; the first item also announces "first item added" (seed 000)."""
    items = [*state.get("items", []), message.body]
    sends = [Send("shipping", {"item_added": message.body, "count": len(items)})]
    if len(items) == 1:
        sends.append(Send("billing", {"first_item_added": message.body}))
    return {**state, "items": items, "applied": [*state.get("applied", []), message.id]}, sends


@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_process_and_process_batch_apply_each_message_once(cleanup: str) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities, dedup = MemoryEntityStore(url), MemoryDeduplicationStore(url)
    dispatcher = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, dispatcher, cleanup=cleanup)  # type: ignore[arg-type]
    messages = [Message(f"m{n}", f"order-{n % 3}", f"item-{n}") for n in range(12)]
    results = [processor.process(m, order_handler) for m in messages[:6]]
    assert [r.outcome for r in results] == ["processed"] * 6
    batch = processor.process_batch([*messages, *messages[:4]], order_handler)
    assert [r.outcome for r in batch] == ["duplicate"] * 6 + ["processed"] * 6 + ["duplicate"] * 4
    sweep(entities, dedup)
    for n in range(3):
        entity = entities.load(f"order-{n}")
        assert entity.outbox == {}
        assert sorted(entity.state["applied"]) == sorted(
            m.id for m in messages if m.correlation_id == entity.id
        )
    assert recorded(dedup, messages)
    ids = [m.id for m in dispatcher.sent]
    assert len(set(ids)) == 12 + 3  # one shipping event each, one billing event per order


class _Interfering(MemoryEntityStore):
    """Before the ``nth`` call of ``save_many``, another client saves the same entities."""

    nth = 1

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls = 0
        self.other = MemoryEntityStore(url)

    def save_many(self, entities: Any) -> set[str]:
        self.calls += 1
        if self.calls == self.nth:
            for entity in entities:
                rival = self.other.load(entity.id)
                rival.state = {**rival.state, "touched": rival.state.get("touched", 0) + 1}
                self.other.save(rival)
        conflicts: set[str] = super().save_many(entities)
        return conflicts


@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
@pytest.mark.parametrize("nth", [1, 2], ids=["state-save-conflicts", "cleanup-save-conflicts"])
def test_process_batch_retries_conflicting_entities_alone(cleanup: str, nth: int) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities, dedup = _Interfering(url), MemoryDeduplicationStore(url)
    entities.nth = nth
    dispatcher = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, dispatcher, cleanup=cleanup)  # type: ignore[arg-type]
    messages = [Message(f"m{n}", f"order-{n % 2}", f"item-{n}") for n in range(4)]
    results = processor.process_batch(messages, order_handler)
    assert [r.outcome for r in results] == ["processed"] * 4
    sweep(entities, dedup)
    for n in range(2):
        entity = entities.load(f"order-{n}")
        applied = [m.id for m in messages if m.correlation_id == entity.id]
        assert entity.state["applied"] == applied, "each change applied once, in order"
        assert entity.state["touched"] == 1, "the rival's change was kept"
        assert entity.outbox == {}
    assert recorded(dedup, messages)
    sent = {m.id: m for m in dispatcher.sent}
    assert len(sent) == 4 + 2, "one event per item, one first-item event per order"
    assert len(dispatcher.sent) == len(sent), "a conflict after dispatch does not send again"
    for message in dispatcher.sent:
        assert message == sent[message.id], "a re-dispatch is byte-identical"


def test_sweep_reloads_an_entity_that_changed_under_it() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities, dedup = _Interfering(url), MemoryDeduplicationStore(url)
    processor = OutboxProcessor(
        MemoryEntityStore(url), dedup, InMemoryDispatcher(), cleanup="deferred"
    )
    processor.process(Message("m1", "order-1", "x"), order_handler)
    result = sweep(entities, dedup)
    assert result.ids_moved == 1 and result.conflicts_retried == 1 and result.ids_left == 0
    entity = entities.load("order-1")
    assert entity.outbox == {} and entity.state["touched"] == 1
    assert dedup.has_been_processed(message_key("order-1", "m1"))


class _Counting:
    """Counts the calls made to the wrapped object's methods."""

    def __init__(self, inner: Any, calls: Counter[str]) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not callable(attribute):
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls[name] += 1
            return attribute(*args, **kwargs)

        return counted


@pytest.mark.parametrize("count", [100, 1000])
@pytest.mark.parametrize(
    ("cleanup", "expected"),
    [
        (
            "inline",
            {"load_many": 1, "processed_among": 1, "save_many": 2, "dispatch": 1, "add_many": 1},
        ),
        ("deferred", {"load_many": 1, "processed_among": 1, "save_many": 2, "dispatch": 1}),
    ],
)
def test_process_batch_makes_round_trips_per_batch_not_per_message(
    count: int, cleanup: str, expected: dict[str, int]
) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    calls: Counter[str] = Counter()
    entities = _Counting(MemoryEntityStore(url), calls)
    dedup = _Counting(MemoryDeduplicationStore(url), calls)
    dispatcher = _Counting(InMemoryDispatcher(), calls)
    processor = OutboxProcessor(entities, dedup, dispatcher, cleanup=cleanup)  # type: ignore[arg-type]
    calls.clear()  # what the processor asked when it was made (whether the stores join)
    messages = [Message(f"m{n}", f"order-{n % 37}", f"item-{n}") for n in range(count)]
    assert [r.outcome for r in processor.process_batch(messages, order_handler)] == [
        "processed"
    ] * count
    assert dict(calls) == expected


def test_a_bad_destination_is_refused_before_the_save() -> None:
    """A handler's destination breaks the id rules: nothing is saved that could never be sent."""
    url = f"memory://{uuid.uuid4().hex}"
    entities, dedup = MemoryEntityStore(url), MemoryDeduplicationStore(url)
    dispatcher = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, dispatcher)

    def nowhere(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return state, [Send("", {"lost": True})]

    named = "'m1' of entity 'order-1'.*destination"
    with pytest.raises(HandlerError, match=named) as caught:
        processor.process(Message("m1", "order-1", "x"), nowhere)
    assert isinstance(caught.value.error, InvalidMessageId)
    with pytest.raises(HandlerError, match="'m2' of entity 'order-2'"):
        processor.process_batch([Message("m2", "order-2", "x")], nowhere)
    assert entities.load("order-1").version is None and entities.load("order-2").version is None
    assert dispatcher.sent == []


def test_the_sweep_relays_pending_entries_in_one_dispatch_per_batch() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities, dedup = MemoryEntityStore(url), MemoryDeduplicationStore(url)

    class Refusing:
        def dispatch(self, messages: Any) -> None:
            raise RuntimeError("broker down")

    processor = OutboxProcessor(entities, dedup, Refusing(), cleanup="deferred")  # type: ignore[arg-type]
    messages = [Message(f"m{n}", f"order-{n}", f"item-{n}") for n in range(50)]
    with pytest.raises(RuntimeError):
        processor.process_batch(messages, order_handler)
    calls: Counter[str] = Counter()
    relay = InMemoryDispatcher()
    result = sweep(entities, dedup, redispatch=_Counting(relay, calls), batch_ids=20)  # type: ignore[arg-type]
    assert result.redispatched == 50 and result.ids_moved == 50
    assert calls["dispatch"] == 3  # batches of 20, 20 and 10 ids, not one call per entity
    assert len({m.id for m in relay.sent}) == len(relay.sent) == 100
    assert recorded(dedup, messages)


def test_an_outgoing_body_is_decoded_from_its_text_when_first_read() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    dispatcher = InMemoryDispatcher()
    processor = OutboxProcessor(MemoryEntityStore(url), MemoryDeduplicationStore(url), dispatcher)

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return state, [Send("out", {"pair": (1, 2), "n": message.body, "s": "é"})]

    (result,) = processor.process_batch([Message("m1", "e1", 7)], handler)
    (sent,) = result.outgoing
    with pytest.raises(AttributeError):  # its slot is empty: not decoded yet
        OutgoingMessage.body.__get__(sent)  # type: ignore[attr-defined]
    assert message_text(sent) == (
        f'{{"body":{{"n":7,"pair":[1,2],"s":"é"}},"destination":"out","headers":{{}},"id":"{sent.id}"}}'
    )
    body = sent.body
    assert body == {"pair": [1, 2], "n": 7, "s": "é"}  # as a reload shows it
    assert sent.body is body  # decoded once
    assert sent == OutgoingMessage(sent.id, "out", {"pair": [1, 2], "n": 7, "s": "é"})
    (copied,) = pickle.loads(pickle.dumps([dispatcher.sent[0]]))
    assert copied == sent and copied.body == body
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        sent.nothing  # noqa: B018
    assert not hasattr(OutgoingMessage("i", "d", 1), "nothing")


def _fresh_processor() -> OutboxProcessor:
    """A processor on new in-process stores, dispatching in memory."""
    url = f"memory://{uuid.uuid4().hex}"
    return OutboxProcessor(
        MemoryEntityStore(url), MemoryDeduplicationStore(url), InMemoryDispatcher()
    )


def test_an_outgoing_message_the_processor_made_shows_only_its_fields() -> None:
    """The texts it keeps are slots outside the dataclass: not fields, not in asdict or repr."""
    processor = _fresh_processor()

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return state, [Send("out", {"n": message.body}, {"h": "v"})]

    (result,) = processor.process_batch([Message("m1", "e1", 7)], handler)
    (sent,) = result.outgoing
    with pytest.raises(AttributeError):  # its body is not decoded yet: pickling decodes it
        OutgoingMessage.body.__get__(sent)  # type: ignore[attr-defined]
    copied = pickle.loads(pickle.dumps(sent))
    assert [f.name for f in dataclasses.fields(sent)] == ["id", "destination", "body", "headers"]
    assert dataclasses.asdict(sent) == sent.to_json()
    assert repr(sent) == (
        f"OutgoingMessage(id={sent.id!r}, destination='out', body={{'n': 7}}, headers={{'h': 'v'}})"
    )
    assert dataclasses.asdict(result)["outgoing"] == (sent.to_json(),)
    made = OutgoingMessage(sent.id, "out", {"n": 7}, {"h": "v"})  # keeps no texts
    assert made == sent and message_text(made) == message_text(sent)
    assert copied == sent and pickle.loads(pickle.dumps(sent)) == sent
    # a copy keeps no texts: they read as on a message the processor did not make, and
    # its text is composed again, the same
    for plain in (copied, made):
        assert (plain._body_text, plain._headers_text, plain._text) == (None, "{}", None)
        assert message_text(plain) == message_text(sent) and plain._text is None


def test_concurrent_first_reads_of_an_outgoing_body_get_one_value() -> None:
    processor = _fresh_processor()

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return state, [Send("out", {"n": message.body, "list": [1, 2]})]

    for n in range(20):
        (result,) = processor.process_batch([Message(f"m{n}", "e1", n)], handler)
        (sent,) = result.outgoing
        start = threading.Barrier(8)
        bodies: list[Any] = []

        threads = [
            threading.Thread(target=_read_body, args=(sent, start, bodies)) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert bodies == [{"n": n, "list": [1, 2]}] * 8
        assert all(body is sent.body for body in bodies)  # decoded once, whoever read first


def _read_body(sent: OutgoingMessage, start: threading.Barrier, bodies: list[Any]) -> None:
    start.wait()
    bodies.append(sent.body)


def test_a_batch_leaves_few_objects_for_the_cyclic_collector() -> None:
    """What a batch leaves alive and tracked by the collector is walked by its next young
    collection (and again by an older one): per message, its result, its outgoing tuple
    and message, no dict of theirs; an entity whose outbox emptied keeps untracked dicts."""
    processor = _fresh_processor()

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return {"n": state.get("n", 0) + 1}, [Send("out", {"n": message.body})]

    batches = [[Message(f"m{b}-{i}", f"e{i % 100}", i) for i in range(1000)] for b in range(2)]
    processor.process_batch(batches[0], handler)  # the entities exist and are kept
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        old = gc.get_objects()  # held: no new object can take the id of a freed old one
        before = {id(o) for o in old}
        results = processor.process_batch(batches[1], handler)
        new = [o for o in gc.get_objects() if id(o) not in before]
        del old
    finally:
        if enabled:
            gc.enable()
    kinds = Counter(type(o).__name__ for o in new)
    assert len(results) == 1000
    assert kinds["ProcessResult"] == 1000 and kinds["OutgoingMessage"] == 1000
    assert kinds["dict"] < 50, kinds  # neither the results' nor the messages' nor the outboxes'
    assert len(new) < 4 * 1000, kinds


# ---------------------------------------------------------------------- the kept entity


def _counted(cleanup: str = "inline", **options: Any) -> tuple[OutboxProcessor, Counter[str]]:
    """A processor on fresh in-process stores whose calls are counted."""
    url = f"memory://{uuid.uuid4().hex}"
    calls: Counter[str] = Counter()
    entities = _Counting(MemoryEntityStore(url), calls)
    dedup = _Counting(MemoryDeduplicationStore(url), calls)
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup=cleanup, **options)  # type: ignore[arg-type]
    calls.clear()
    return processor, calls


@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_process_saves_the_entity_it_kept_without_loading_it(cleanup: str) -> None:
    processor, calls = _counted(cleanup)
    for n in range(5):
        assert processor.process(Message(f"m{n}", "e", n), order_handler).outcome == "processed"
    assert calls["load"] == 1, "the entity is loaded for its first message only"
    calls.clear()
    # a redelivery to the processor that keeps the entity is still a duplicate; inline,
    # found recorded, it loads the entity (the stored outbox may still hold the entry:
    # see test_kept_entities.py); deferred, the kept outbox holds it (dispatched)
    assert processor.process(Message("m2", "e", 2), order_handler).outcome == "duplicate"
    assert calls["save"] == 0 and calls["load"] == (1 if cleanup == "inline" else 0)
    assert calls["has_been_processed"] == (1 if cleanup == "inline" else 0)
    assert processor.entities.load("e").state["applied"] == [f"m{n}" for n in range(5)]


def test_an_entity_saved_by_another_processor_conflicts_then_loads() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities, dedup = MemoryEntityStore(url), MemoryDeduplicationStore(url)
    one, other = (OutboxProcessor(entities, dedup, InMemoryDispatcher()) for _ in range(2))
    for n in range(6):  # each processor's kept entity is stale at its next message
        processor = one if n % 2 == 0 else other
        result = processor.process(Message(f"m{n}", "e", n), order_handler)
        assert result.outcome == "processed" and result.attempts == (1 if n < 2 else 2)
    for n in range(6):  # and a kept entity that is stale still finds the duplicate
        assert one.process(Message(f"m{n}", "e", n), order_handler).outcome == "duplicate"
    assert entities.load("e").state["applied"] == [f"m{n}" for n in range(6)]
    assert recorded(dedup, [Message(f"m{n}", "e", n) for n in range(6)])


def test_entity_cache_0_loads_every_time_and_a_bad_size_is_refused() -> None:
    processor, calls = _counted(entity_cache=0)
    for n in range(3):
        processor.process(Message(f"m{n}", "e", n), order_handler)
    assert calls["load"] == 3
    for bad in (-1, True, 1.5, "10"):
        with pytest.raises(ConfigurationError, match="entity_cache"):
            OutboxProcessor(
                processor.entities, processor.dedup, InMemoryDispatcher(), entity_cache=bad
            )  # type: ignore[arg-type]


@pytest.mark.parametrize("bound", ["entities", "bytes"])
def test_the_kept_entities_are_bounded(bound: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three entities: at most two kept (or about 2,500 bytes of their ~1,000-byte
    states kept): the third drops the first."""
    if bound == "bytes":
        monkeypatch.setattr(outbox_cache, "_CACHE_BYTES", 2_500)
    processor, calls = _counted(**({"entity_cache": 2} if bound == "entities" else {}))
    for n in range(3):
        processor.process(Message(f"m{n}", f"e{n}", "x" * 1_000), order_handler)
    calls.clear()
    processor.process(Message("again-2", "e2", 0), order_handler)
    processor.process(Message("again-1", "e1", 0), order_handler)
    assert calls["load"] == 0
    processor.process(Message("again-0", "e0", 0), order_handler)
    assert calls["load"] == 1


def test_an_entity_larger_than_a_kept_one_may_be_is_loaded_each_time() -> None:
    processor, calls = _counted()
    processor.process(Message("big-1", "big", "x" * 300_000), order_handler)
    calls.clear()
    processor.process(Message("big-2", "big", "y"), order_handler)
    assert calls["load"] == 1


def test_an_entity_holding_a_pending_entry_is_not_kept() -> None:
    processor, calls = _counted()

    class Failing(InMemoryDispatcher):
        def dispatch(self, messages: Any) -> None:
            raise RuntimeError("broker down")

    failing = OutboxProcessor(processor.entities, processor.dedup, Failing())
    with pytest.raises(RuntimeError):
        failing.process(Message("m0", "e", 0), order_handler)  # m0 stays pending
    processor.process(Message("m1", "e", 1), order_handler)  # saved with m0 pending
    assert processor.entities.load("e").pending == ["m0"]
    calls.clear()
    processor.process(Message("m2", "e", 2), order_handler)
    assert calls["load"] == 1, "not kept: it holds outgoing messages"


def test_an_entity_is_not_kept_after_a_failure() -> None:
    processor, calls = _counted()
    processor.process(Message("m0", "e", 0), order_handler)

    def failing(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        state["items"].append("changed in place")  # then fails: nothing of it is saved
        raise RuntimeError("boom")

    with pytest.raises(HandlerError):
        processor.process(Message("m1", "e", 1), failing)
    calls.clear()
    assert processor.process(Message("m2", "e", 2), order_handler).outcome == "processed"
    assert calls["load"] == 1
    assert processor.entities.load("e").state["items"] == [0, 2]


def test_process_batch_takes_and_keeps_entities_as_process_does() -> None:
    processor, calls = _counted()
    processor.process(Message("m0", "e", 0), order_handler)
    processor.process_batch([Message("m1", "e", 1), Message("n1", "f", 1)], order_handler)
    assert calls["load_many"] == 1 and calls["load"] == 1, "f loaded, e kept"
    calls.clear()
    batch = [Message("m0", "e", 0), Message("m2", "e", 2), Message("n2", "f", 2)]
    outcomes = [r.outcome for r in processor.process_batch(batch, order_handler)]
    assert outcomes == ["duplicate", "processed", "processed"]
    # m0 found recorded: "e" is loaded (its stored outbox may hold m0's entry), "f" not
    assert calls["load_many"] == 1 and calls["load"] == 0 and calls["processed_among"] == 1
    calls.clear()
    batch = [Message("m2b", "e", 2), Message("n2b", "f", 2)]
    assert {r.outcome for r in processor.process_batch(batch, order_handler)} == {"processed"}
    assert calls["load_many"] == 0 and calls["load"] == 0
    assert processor.process(Message("m3", "e", 3), order_handler).attempts == 1
    assert calls["load"] == 0
    # another processor saved "e": the batch's save of it conflicts, it is retried alone
    other = OutboxProcessor(processor.entities, processor.dedup, InMemoryDispatcher())
    other.process(Message("m4", "e", 4), order_handler)
    calls.clear()
    batch = [Message("m5", "e", 5), Message("m4", "e", 4), Message("n3", "f", 3)]
    results = processor.process_batch(batch, order_handler)
    assert [r.outcome for r in results] == ["processed", "duplicate", "processed"]
    # m4 is recorded: "e" is loaded for it, so the batch's save of "e" does not conflict;
    # "e" moved since it was kept, so m5 is asked about again, after that load
    assert calls["load_many"] == 1 and calls["load"] == 0 and calls["processed_among"] == 2
    other.process(Message("m6", "e", 6), order_handler)
    calls.clear()
    results = processor.process_batch([Message("m7", "e", 7)], order_handler)
    assert [r.outcome for r in results] == ["processed"]
    assert calls["load"] == 1, "the kept e is stale: its save conflicts, retried alone"
    applied = ["m0", "m1", "m2", "m2b", "m3", "m4", "m5", "m6", "m7"]
    assert processor.entities.load("e").state["applied"] == applied
    assert processor.entities.load("f").state["applied"] == ["n1", "n2", "n2b", "n3"]


def test_a_batch_relaxes_the_collector_only_when_asked_to() -> None:
    """By default a batch leaves the process's collector alone; with ``gc_threshold``
    the young threshold is raised during the batch and put back after."""
    import gc

    from dedupstore.calls import GC_BATCH_THRESHOLD

    before = gc.get_threshold()
    seen: list[int] = []

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        seen.append(gc.get_threshold()[0])
        return order_handler(state, message)

    options: list[dict[str, Any]] = [
        {},
        {"gc_threshold": None},
        {"gc_threshold": GC_BATCH_THRESHOLD},
    ]
    for given in options:
        processor, _ = _counted(**given)
        seen.clear()
        batch = [Message(f"m{n}", f"e{n % 2}", n) for n in range(4)]
        assert [r.outcome for r in processor.process_batch(batch, handler)] == ["processed"] * 4
        assert seen == [given.get("gc_threshold") or before[0]] * 4
        assert gc.get_threshold() == before
        processor.process(Message("m9", "e9", 9), handler)  # one message: as it is
        assert seen[-1] == before[0]
    for bad in (0, -1, True, "yes", 1.5):
        with pytest.raises(ConfigurationError, match="gc_threshold"):
            OutboxProcessor(
                processor.entities, processor.dedup, InMemoryDispatcher(), gc_threshold=bad
            )


# ---------------------------------------------------------------------- inputs checked


def _stores() -> tuple[MemoryEntityStore, MemoryDeduplicationStore]:
    url = f"memory://{uuid.uuid4().hex}"
    return MemoryEntityStore(url), MemoryDeduplicationStore(url)


class _NotCallable:
    dispatch = "not a method"


@pytest.mark.parametrize(
    ("parts", "named"),
    [
        (
            lambda e, d: (d, e, InMemoryDispatcher()),
            "entities must be an EntityStore.*got MemoryDedup",
        ),
        (
            lambda e, d: (e, e, InMemoryDispatcher()),
            "dedup must be a Deduplication.*got MemoryEntity",
        ),
        (lambda e, d: (e, d, None), "dispatcher must have a callable dispatch"),
        (lambda e, d: (e, d, object()), "dispatcher must have a callable dispatch"),
        (lambda e, d: (e, d, _NotCallable()), "dispatcher must have a callable dispatch"),
        (lambda e, d: ("memory://x", d, InMemoryDispatcher()), "got str 'memory://x'"),
        (lambda e, d: (e, "memory://x", InMemoryDispatcher()), "dedup must be a Dedup"),
        (lambda e, d: (e, d, "redis://localhost"), "got str 'redis://localhost'"),
    ],
)
def test_the_processor_checks_its_parts_at_construction(parts: Any, named: str) -> None:
    """Swapped stores, no dispatcher, a URL instead of an opened store: refused when the
    processor is made (ConfigurationError naming the argument and what it got), not
    with an AttributeError after a state change was saved."""
    entities, dedup = _stores()
    with pytest.raises(ConfigurationError, match=named):
        OutboxProcessor(*parts(entities, dedup))


async def _async_handler(state: dict[str, Any], message: Message) -> Any:
    return state, []


class _AsyncCall:
    async def __call__(self, state: dict[str, Any], message: Message) -> Any:
        return state, []


@pytest.mark.parametrize("handler", [_async_handler, _AsyncCall()], ids=["function", "object"])
def test_an_async_handler_is_refused_before_anything_is_saved(handler: Any) -> None:
    entities, dedup = _stores()
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), dead_letters="dlq")
    with pytest.raises(ConfigurationError, match="sync OutboxProcessor cannot await it"):
        processor.process(Message("m1", "e1", {}), handler)
    with pytest.raises(ConfigurationError, match="sync OutboxProcessor cannot await it"):
        processor.process_batch([Message("m2", "e1", {})], handler)
    assert entities.load("e1").version is None


def _keyed(state: Any, body: Any) -> Any:
    def handler(s: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return state, [Send("out", body)]

    return handler


@pytest.mark.parametrize(
    ("state", "body", "path"),
    [
        ({7: "seven"}, {}, r"state\[7\]"),
        ({"a": {"b": [1, {(1, 2): 0}]}}, {}, r'state\["a"\]\["b"\]\[1\]\[\(1, 2\)\]'),
        ({"ok": 1}, {"a": [{3: "x"}]}, r'sends\[0\]\.body\["a"\]\[0\]\[3\]'),
        ({"ok": 1}, [{None: 1}], r"sends\[0\]\.body\[0\]\[None\]"),
    ],
)
def test_keys_that_are_not_str_are_refused_naming_their_path(
    state: Any, body: Any, path: str
) -> None:
    """``{7: "seven"}`` would be stored as ``{"7": ...}`` and reload differently: refused
    (InvalidValue, a TypeError) naming where, before any write."""
    from dedupstore.errors import InvalidValue

    entities, dedup = _stores()
    dispatcher = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, dispatcher)
    for run in (processor.process, lambda m, h: processor.process_batch([m], h)):
        with pytest.raises(HandlerError) as caught:
            run(Message("m1", "e1", {}), _keyed(state, body))  # type: ignore[operator]
        assert isinstance(caught.value.error, InvalidValue), caught.value.error
        assert isinstance(caught.value.error, TypeError)
        assert caught.value.error is not None
        assert __import__("re").search(path, str(caught.value.error)), caught.value.error
    assert entities.load("e1").version is None and dispatcher.sent == []


def test_an_entity_or_message_saved_directly_refuses_keys_that_are_not_str() -> None:
    from dedupstore.errors import InvalidValue

    entities, _ = _stores()
    entity = entities.load("e1")
    entity.state = {"a": {1: "x"}}
    with pytest.raises(InvalidValue, match=r'entity .e1.: state\["a"\]\[1\]'):
        entities.save(entity)
    assert entities.load("e1").version is None
    with pytest.raises(InvalidValue, match=r"body\[2\]"):
        message_text(OutgoingMessage("o1", "out", {2: "x"}))


def test_send_and_message_fields_are_typed_at_construction() -> None:
    from dedupstore.errors import InvalidValue

    with pytest.raises(InvalidMessageId, match="destination"):
        Send(5, {})  # type: ignore[arg-type]
    for headers in (None, [("a", "b")], "a=b", {"a": 1}, {1: "a"}):
        with pytest.raises(InvalidValue, match="headers"):
            Send("out", {}, headers)  # type: ignore[arg-type]
        with pytest.raises(InvalidValue, match="headers"):
            Message("m1", "e1", {}, headers)  # type: ignore[arg-type]
    with pytest.raises(InvalidMessageId, match="message id"):
        Message(5, "e1", {})  # type: ignore[arg-type]
    with pytest.raises(InvalidMessageId, match="correlation id"):
        Message("m1", b"e1", {})  # type: ignore[arg-type]
    # what is right stays accepted
    assert Send("out", {"a": 1}, {"k": "v"}).headers == {"k": "v"}
    assert Message("m1", "e1", [1], {"k": "v"}).body == [1]


@dataclasses.dataclass
class _Point:
    x: int
    y: int


def test_dataclass_and_pydantic_bodies_and_states_are_refused_with_a_hint() -> None:
    """Not converted silently (the canonical bytes of a model's dump may change with the
    model's library): refused, naming what to pass instead."""
    import pydantic

    from dedupstore.errors import InvalidValue

    class Model(pydantic.BaseModel):
        x: int

    cases = [
        ({"p": _Point(1, 2)}, {}, r'state\["p"\]: a dataclass .*dataclasses.asdict\(value\)'),
        ({}, Model(x=1), r"sends\[0\]\.body: a pydantic model .*model_dump\("),
        ({}, {"m": [Model(x=1)]}, r'sends\[0\]\.body\["m"\]\[0\]: .*model_dump\('),
    ]
    for state, body, hint in cases:
        entities, dedup = _stores()
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
        with pytest.raises(HandlerError) as caught:
            processor.process(Message("m1", "e1", {}), _keyed(state, body))
        assert isinstance(caught.value.error, InvalidValue)
        assert __import__("re").search(hint, str(caught.value.error)), caught.value.error
        assert entities.load("e1").version is None


# ---------------------------------------------------------------------- the consumer's identity


def _credit(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    return {"balance": state.get("balance", 0) + message.body}, [Send("audit", message.body)]


def _consumers(url: str) -> tuple[MemoryEntityStore, OutboxProcessor, OutboxProcessor]:
    """One entity store, and the processors of consumers `accounts` and `billing` on it."""
    entities = MemoryEntityStore(url)
    accounts = OutboxProcessor(
        entities,
        MemoryDeduplicationStore(url, endpoint="accounts"),
        InMemoryDispatcher(),
        cleanup="deferred",
    )
    billing = OutboxProcessor(
        entities,
        MemoryDeduplicationStore(url, endpoint="billing"),
        InMemoryDispatcher(),
        cleanup="deferred",
        dead_letters="dead",
    )
    return entities, accounts, billing


@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_the_consumer_is_recorded_with_every_entity_it_saves(cleanup: str) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities = MemoryEntityStore(url)
    dedup = MemoryDeduplicationStore(url, endpoint="accounts")
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup=cleanup)  # type: ignore[arg-type]
    processor.process(Message("m1", "acct-1", 5), _credit)
    processor.process_batch([Message("m2", "acct-2", 5), Message("m3", "acct-1", 5)], _credit)
    for eid in ("acct-1", "acct-2"):
        assert entities.load(eid).consumer == "accounts"
        body = entities._load([eid])[eid][0]
        assert body.startswith('{"consumer":"accounts","outbox":{'), body


@pytest.mark.parametrize("call", ["process", "process_batch", "redrive", "kept"])
def test_an_entity_of_another_consumer_is_refused_before_any_write(call: str) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    entities, accounts, billing = _consumers(url)
    accounts.process(Message("m1", "acct-1", 100), _credit)
    watched = "acct-1"
    before = entities.load(watched)
    message = Message("m2", "acct-1", 100)
    sent = billing.dispatcher.sent  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError) as refused:
        if call == "process":
            billing.process(message, _credit)
        elif call == "process_batch":
            # another entity of the batch, before it, is not saved either
            billing.process_batch([Message("m0", "fresh", 1), message], _credit)
        elif call == "redrive":
            letter = {"consumer": "billing", "message": {"id": "m9", "correlation_id": "acct-1"}}
            billing.redrive(letter, _credit)
        else:  # an entity billing kept from its own save, then taken over by accounts
            billing.process(Message("b1", "shared", 1), _credit)
            entities.save(dataclasses.replace(entities.load("shared"), consumer="accounts"))
            watched, sent[:] = "shared", []
            before = entities.load(watched)
            billing.process(Message("b2", "shared", 1), _credit)
    text = str(refused.value)
    assert "'accounts'" in text and "'billing'" in text, text
    assert "acct-1" in text or "shared" in text, text
    assert entities.load(watched) == before, "nothing saved"
    assert entities.load("fresh").version is None
    assert sent == []
    assert billing.dedup.count() == 0, "nothing added"


def test_an_entity_without_a_consumer_belongs_to_whichever_touches_it() -> None:
    from dedupstore.entities import Entity

    url = f"memory://{uuid.uuid4().hex}"
    entities, accounts, billing = _consumers(url)
    entities.save(Entity("old", {"balance": 1}, {"m0": None}))  # written without a consumer
    assert entities.load("old").consumer is None
    assert accounts.process(Message("m1", "old", 2), _credit).outcome == "processed"
    assert entities.load("old").consumer == "accounts"
    assert billing.process_batch([Message("m1", "older", 2)], _credit)[0].outcome == "processed"
    assert entities.load("older").consumer == "billing"


def test_the_sweep_refuses_an_entity_of_another_consumer_before_writing_its_batch() -> None:
    from dedupstore.entities import Entity

    url = f"memory://{uuid.uuid4().hex}"
    entities, accounts, billing = _consumers(url)
    entities.save(Entity("unclaimed", {}, {"u1": None}))
    accounts.process(Message("m1", "acct-1", 100), _credit)
    with pytest.raises(ConfigurationError) as refused:
        sweep(entities, billing.dedup)
    text = str(refused.value)
    assert "'accounts'" in text and "'billing'" in text and "acct-1" in text, text
    assert billing.dedup.count() == 0
    assert entities.load("unclaimed").outbox == {"u1": None}, "nothing of its batch written"
    assert entities.load("acct-1").outbox == {"m1": None}
    # under its own consumer: both move, and the unclaimed entity is claimed
    assert sweep(entities, accounts.dedup).ids_moved == 2
    assert accounts.dedup.processed_among(
        [message_key("acct-1", "m1"), message_key("unclaimed", "u1")]
    ) == {message_key("acct-1", "m1"), message_key("unclaimed", "u1")}
    assert entities.load("unclaimed").consumer == "accounts"
    assert accounts.process(Message("m1", "acct-1", 100), _credit).outcome == "duplicate"
    assert entities.load("acct-1").state == {"balance": 100}
