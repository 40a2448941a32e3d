"""The consume loop's logic (``dedupstore.consumers.Consumer``) on an in-memory broker.

The broker is a test double (a list of entries, a pending table with delivery
counts); the stores are the memory backend. What is checked: only what is done is
acknowledged, and only after it was processed; a failed round is left for
redelivery and done on the next; a delivery that is not a message, or that was
delivered too often, is set aside once under a deterministic id; ``stop()`` and
SIGTERM end the loop after the round in flight. The real brokers' tests (Redis
Streams) are in ``tests/test_consumer_redis.py``.

Every test runs on both faces (the ``face`` fixture): the sync
:class:`~dedupstore.consumers.Consumer`, and :class:`~dedupstore.aio.AsyncConsumer`
with an :class:`~dedupstore.aio.AsyncOutboxProcessor`, each call of the test's
consumer run by ``asyncio.run`` in the test's (main) thread, so the signal tests
reach the async face's handlers too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from dedupstore.aio import AsyncBroker, AsyncConsumer, AsyncOutboxProcessor
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.consumers import (
    MALFORMED_ENTITY,
    SET_ASIDE_POSITION,
    Broker,
    Delivery,
    MalformedDelivery,
    MessageRules,
)
from dedupstore.consumers import Consumer as SyncConsumer
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConcurrencyConflict, ConfigurationError, StoreUnavailable
from dedupstore.ids import message_key, outgoing_id
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send

pytestmark = pytest.mark.memory

#: The face the running test is on (set by the ``face`` fixture).
FACE = {"now": "sync"}


@pytest.fixture(autouse=True, params=["sync", "async", "async-broker"])
def face(request: Any) -> Any:
    """Each test on the sync face, then on the async one with the sync broker (its
    calls in threads), then with the broker behind an :class:`AsyncBroker`."""
    FACE["now"] = request.param
    yield request.param
    FACE["now"] = "sync"


class Awaited(AsyncBroker):
    """The test's broker behind the async broker interface (each call awaited)."""

    kind = "list"

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    async def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        return self.broker.fetch(max_count, wait)

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        self.broker.ack(deliveries)

    async def nack(self, deliveries: Sequence[Delivery]) -> None:
        self.broker.nack(deliveries)

    async def keep(self, deliveries: Sequence[Delivery]) -> None:
        self.broker.keep(deliveries)

    async def reclaim(self, max_count: int) -> list[Delivery]:
        return self.broker.reclaim(max_count)

    async def pending(self) -> int | None:
        return self.broker.pending()


class Driven:
    """An :class:`AsyncConsumer` called as the sync one: each coroutine method run by
    ``asyncio.run`` in the calling thread; the rest is the consumer's."""

    def __init__(self, inner: AsyncConsumer) -> None:
        self.inner = inner

    def run_once(self) -> Any:
        return asyncio.run(self.inner.run_once())

    def run(self, **kwargs: Any) -> Any:
        return asyncio.run(self.inner.run(**kwargs))

    def release(self) -> None:
        asyncio.run(self.inner.release())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def done(value: Any) -> Any:
    """What a processor's method returned, awaited when the face is async."""
    return asyncio.run(value) if asyncio.iscoroutine(value) else value


def Consumer(broker: Any, processor: Any, handler: Any, **options: Any) -> Any:
    """The consumer of the test's face."""
    if FACE["now"] == "sync":
        return SyncConsumer(broker, processor, handler, **options)
    if FACE["now"] == "async-broker" and isinstance(broker, Broker):
        broker = Awaited(broker)
    return Driven(AsyncConsumer(broker, processor, handler, **options))


class ListBroker(Broker):
    """Entries in a list; a pending table with delivery counts; nack puts back in front."""

    kind = "list"

    def __init__(self, entries: Sequence[tuple[str | bytes, dict[str, str]]] = ()) -> None:
        self.ready: list[int] = []
        self.entries: dict[int, tuple[str | bytes, dict[str, str]]] = {}
        self.counts: dict[int, int] = {}
        self.pending_tokens: set[int] = set()
        self.acked: list[int] = []
        self.nacked: list[int] = []
        self.on_ack: Any = None
        for body, headers in entries:
            self.add(body, headers)

    def add(self, body: str | bytes, headers: dict[str, str]) -> int:
        token = len(self.entries) + 1
        self.entries[token] = (body, headers)
        self.ready.append(token)
        return token

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        taken, self.ready = self.ready[:max_count], self.ready[max_count:]
        out = []
        for token in taken:
            self.counts[token] = self.counts.get(token, 0) + 1
            self.pending_tokens.add(token)
            body, headers = self.entries[token]
            out.append(Delivery(token, body, headers, self.counts[token]))
        return out

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        if self.on_ack is not None:
            self.on_ack(deliveries)
        for d in deliveries:
            self.pending_tokens.discard(d.token)
            self.acked.append(d.token)

    def nack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            self.nacked.append(d.token)
        self.ready[:0] = [d.token for d in deliveries]

    def pending(self) -> int | None:
        return len(self.pending_tokens) + len(self.ready)

    def restart(self) -> None:
        """The consumer died: what it held comes again (counted at the next fetch)."""
        self.ready[:0] = sorted(self.pending_tokens - set(self.ready))


class Crash(BaseException):
    """What a consumer process killed by a message sees: nothing after it runs."""


def deposit(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Adds the amount; a negative amount is poison (the handler raises)."""
    amount = message.body["amount"]
    if amount < 0:
        raise ValueError(f"a deposit cannot be negative: {amount}")
    applied = [*state.get("applied", []), message.id]
    return {"balance": state.get("balance", 0) + amount, "applied": applied}, [
        Send("deposited", {"id": message.id, "n": amount})
    ]


def entry(mid: str, cid: str, amount: int) -> tuple[str, dict[str, str]]:
    return json.dumps({"amount": amount}), {"id": mid, "correlation_id": cid}


def _processor(
    dead_letters: str | None = "dlq", dispatcher: Any = None
) -> tuple[OutboxProcessor, InMemoryDispatcher]:
    url = f"memory://{uuid.uuid4().hex}"
    sent = InMemoryDispatcher()
    kind = OutboxProcessor if FACE["now"] == "sync" else AsyncOutboxProcessor
    processor = kind(
        MemoryEntityStore(url),
        MemoryDeduplicationStore(url, endpoint="billing"),
        sent if dispatcher is None else dispatcher,
        dead_letters=dead_letters,
    )
    return processor, sent


def _recorded(processor: OutboxProcessor, mid: str, cid: str) -> bool:
    entity = processor.entities.load(cid)
    return mid in entity.outbox or processor.dedup.has_been_processed(message_key(cid, mid))


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_everything_done_is_acknowledged_after_it_was_processed(mode: Any) -> None:
    entries = [entry(f"m{n}", f"acct-{n % 3}", n) for n in range(1, 8)]
    entries.append(entry("m3", "acct-0", 3))  # a producer duplicate
    entries.append(entry("bad", "acct-1", -1))  # poison: dead-lettered by the processor
    broker = ListBroker(entries)
    processor, sent = _processor()

    def check(deliveries: Sequence[Delivery]) -> None:  # ack comes after processing
        for d in deliveries:
            _, headers = broker.entries[d.token]
            assert _recorded(processor, headers["id"], headers["correlation_id"]), d

    broker.on_ack = check
    consumer = Consumer(broker, processor, deposit, batch_size=4, mode=mode)
    rounds = [consumer.run_once() for _ in range(3)]
    assert sorted(broker.acked) == list(range(1, 10)) and broker.nacked == []
    assert sum(r.acked for r in rounds) == 9 and not any(r.failures for r in rounds)
    outcomes: dict[str, int] = {}
    for r in rounds:
        for k, v in r.outcomes.items():
            outcomes[k] = outcomes.get(k, 0) + v
    assert outcomes == {"processed": 7, "duplicate": 1, "dead_lettered": 1}
    balances = {cid: processor.entities.load(cid).state["balance"] for cid in ("acct-0", "acct-1")}
    assert balances == {"acct-0": 3 + 6, "acct-1": 1 + 4 + 7}
    assert [m.destination for m in sent.sent].count("dlq") == 1


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_a_round_the_store_cannot_answer_is_held_then_done_without_a_redelivery(
    mode: Any,
) -> None:
    broker = ListBroker([entry(f"m{n}", "acct", n) for n in range(1, 4)])
    processor, sent = _processor()
    real = processor.dedup.processed_among, processor.dedup.has_been_processed
    calls = {"n": 0}

    def down(*args: Any) -> Any:
        calls["n"] += 1
        raise StoreUnavailable("the store is down")

    processor.dedup.processed_among = down  # type: ignore[method-assign]
    processor.dedup.has_been_processed = down  # type: ignore[method-assign]
    consumer = Consumer(broker, processor, deposit, mode=mode)
    first = consumer.run_once()
    assert (first.acked, first.nacked, first.held, first.failures) == (0, 0, 3, 1)
    assert broker.acked == [] and broker.nacked == []
    assert calls["n"] >= 1 and processor.entities.load("acct").state == {}
    processor.dedup.processed_among, processor.dedup.has_been_processed = real  # type: ignore[method-assign]
    second = consumer.run_once()
    assert (second.acked, second.nacked, second.held, second.failures) == (3, 0, 0, 0)
    assert broker.counts == {1: 1, 2: 1, 3: 1}, "held, never delivered again"
    assert processor.entities.load("acct").state["applied"] == ["m1", "m2", "m3"]
    assert len(sent.sent) == 3


def test_the_loop_backs_off_after_a_failed_round_and_goes_on(monkeypatch: Any) -> None:
    broker = ListBroker([entry("m1", "acct", 1)])
    processor, _ = _processor()
    failures = iter([StoreUnavailable("down"), StoreUnavailable("down again")])
    real_fetch = broker.fetch

    def fetch(max_count: int, wait: float) -> list[Delivery]:
        error = next(failures, None)
        if error is not None:
            raise error
        return real_fetch(max_count, wait)

    broker.fetch = fetch  # type: ignore[method-assign]
    consumer = Consumer(broker, processor, deposit)
    pauses: list[int] = []

    def pause() -> None:
        pauses.append(consumer._failures)
        if broker.acked:
            consumer.stop()

    def after(stats: Any) -> Any:
        if broker.acked:
            consumer.stop()
        return stats

    target = getattr(consumer, "inner", consumer)  # the face's own methods are patched
    original = target.run_once
    if FACE["now"] == "sync":
        monkeypatch.setattr(target, "_pause", pause)
        monkeypatch.setattr(target, "run_once", lambda: after(original()))
    else:

        async def apause() -> None:
            pause()

        async def arun_once() -> Any:
            return after(await original())

        monkeypatch.setattr(target, "_pause", apause)
        monkeypatch.setattr(target, "run_once", arun_once)
    totals = consumer.run(install_signal_handlers=False)
    assert pauses == [1, 2], "one backoff per failed round, growing"
    assert totals.acked == 1 and totals.failures == 2


def test_a_delivery_that_is_not_a_message_is_set_aside_once_under_a_stable_id() -> None:
    broker = ListBroker(
        [
            ("{not json", {"id": "m1", "correlation_id": "acct"}),
            ('{"amount": 1}', {"correlation_id": "acct"}),  # no id
            (b"\xff\xfe", {"id": "m3", "correlation_id": "acct"}),  # not UTF-8
            entry("m4", "acct", 4),
        ]
    )
    processor, sent = _processor()
    consumer = Consumer(broker, processor, deposit)
    stats = consumer.run_once()
    assert (stats.acked, stats.set_aside, stats.nacked) == (4, 3, 0)
    letters = [m for m in sent.sent if m.destination == "dlq"]
    assert len(letters) == 3
    missing = next(m for m in letters if "delivery" in m.body and "'id'" in m.body["error"]["text"])
    assert missing.body["delivery"] == {
        "body": '{"amount": 1}',
        "headers": {"correlation_id": "acct"},
    }
    assert missing.body["error"]["type"] == "dedupstore.errors.MalformedDelivery"
    assert missing.body["consumer"] == "billing"
    # the same content again (a redelivery, a producer duplicate): the same id and bytes
    broker.add('{"amount": 1}', {"correlation_id": "acct"})
    broker.add(b"\xff\xfe", {"id": "m3", "correlation_id": "acct"})
    again = consumer.run_once()
    assert again.set_aside == 2
    later = [m for m in sent.sent if m.destination == "dlq"][3:]
    assert {m.id: m for m in later} == {m.id: m for m in letters if m.id in {x.id for x in later}}
    assert len({m.id for m in later}) == 2
    assert processor.entities.load("acct").state["applied"] == ["m4"]
    assert all(
        m.id != outgoing_id("billing", MALFORMED_ENTITY, "x", SET_ASIDE_POSITION) for m in letters
    )


def test_message_rules_name_the_token_and_what_is_wrong() -> None:
    rules = MessageRules()
    with pytest.raises(MalformedDelivery, match=r"delivery '1-0' is not a message: it has no 'id'"):
        rules.message(Delivery("1-0", "{}", {"correlation_id": "a"}))
    with pytest.raises(MalformedDelivery, match=r"'2-0'.*correlation id.*empty|'2-0'.*correlation"):
        rules.message(Delivery("2-0", "{}", {"id": "m", "correlation_id": ""}))
    with pytest.raises(MalformedDelivery, match=r"'3-0'.*not JSON"):
        rules.message(Delivery("3-0", "{", {"id": "m", "correlation_id": "a"}))
    custom = MessageRules(id=lambda d: f"k-{d.token}", correlation_id="acct", body="text")
    message = custom.message(Delivery(7, "hi", {"acct": "a", "x": "y"}))
    assert message == Message("k-7", "a", "hi", {"x": "y"})
    assert (
        MessageRules(body="bytes")
        .message(Delivery(1, "é", {"id": "m", "correlation_id": "a"}))
        .body
        == "é".encode()
    )
    with pytest.raises(ConfigurationError, match=r"MessageRules\.body"):
        MessageRules(body="xml")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"MessageRules\.id"):
        MessageRules(id="")


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_a_message_that_kills_every_consumer_running_it_is_dead_lettered_once(mode: Any) -> None:
    """The case ``max_deliveries`` exists for: each run of m1 kills its consumer. It is
    set aside after its runs alone exceed the limit; the rest of its batch, in flight in
    every crash, is processed once and set aside never."""
    broker = ListBroker([entry("m1", "acct", 1), *(entry(f"m{n}", "b", n) for n in range(2, 6))])
    processor, sent = _processor()
    runs: list[str] = []

    def killing(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        runs.append(message.id)
        if message.id == "m1":
            raise Crash
        return deposit(state, message)

    crashes = 0
    while True:
        consumer = Consumer(broker, processor, killing, max_deliveries=2, mode=mode)
        try:
            stats = consumer.run_once()
            break
        except Crash:
            crashes += 1
            broker.restart()  # a new consumer process
    assert crashes == 3 and runs.count("m1") == 3, "once in the batch, then twice alone"
    assert stats.outcomes == {"dead_lettered": 1, "processed": 4} and stats.isolated == 5
    assert sorted(broker.acked) == [1, 2, 3, 4, 5]
    assert processor.entities.load("b").state["balance"] == 2 + 3 + 4 + 5
    assert processor.entities.load("acct").attempts == {}, "the count goes with the letter"
    (letter,) = [m for m in sent.sent if m.destination == "dlq"]
    assert letter.id == outgoing_id("billing", "acct", "m1", -1)
    assert letter.body["message"] == {
        "id": "m1",
        "correlation_id": "acct",
        "body": {"amount": 1},
        "headers": {},
    }
    assert letter.body["error"]["type"].endswith("MaxDeliveriesExceeded")
    assert "max_deliveries=2" in letter.body["error"]["text"]
    # redelivered again (the ack was lost): recorded, so not a second dead letter
    broker.add(*entry("m1", "acct", 1))
    broker.counts[6] = 9
    again = Consumer(broker, processor, deposit, max_deliveries=2).run_once()
    assert again.acked == 1 and again.outcomes == {"duplicate": 1}
    assert {m.id for m in sent.sent if m.destination == "dlq"} == {letter.id}
    # the redrive applies it exactly once
    assert done(processor.redrive(letter, deposit)).outcome == "processed"
    assert done(processor.redrive(letter, deposit)).outcome == "duplicate"
    assert processor.entities.load("acct").state["balance"] == 1


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_consumers_that_crash_with_a_batch_in_flight_set_nothing_aside(mode: Any) -> None:
    """Three crashes in a row with the same messages in flight (counts reach 4, above
    max_deliveries=2), none caused by a message: each kills the process once, while
    one message or another runs. Everything is processed once; nothing is set aside."""
    broker = ListBroker([entry(f"m{n}", f"acct-{n % 2}", n) for n in range(1, 7)])
    processor, sent = _processor()
    calls: dict[str, int] = {}
    kills = {"m3", "m5", "m6"}  # the first run of each is killed: random crashes

    def crashing(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        calls[message.id] = calls.get(message.id, 0) + 1
        if message.id in kills and calls[message.id] == 1:
            raise Crash
        return deposit(state, message)

    crashes = 0
    while True:
        try:
            stats = Consumer(broker, processor, crashing, max_deliveries=2, mode=mode).run_once()
            break
        except Crash:
            crashes += 1
            broker.restart()
    assert crashes == 3 and broker.counts[5] == broker.counts[6] == 4
    assert "dead_lettered" not in stats.outcomes
    assert sorted(broker.acked) == [1, 2, 3, 4, 5, 6]
    assert not [m for m in sent.sent if m.destination == "dlq"]
    assert processor.entities.load("acct-1").state["balance"] == 1 + 3 + 5
    assert processor.entities.load("acct-0").state["balance"] == 2 + 4 + 6


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_an_outage_of_many_rounds_sets_nothing_aside_and_keeps_the_order(mode: Any) -> None:
    """The issue's case: the store down for many rounds with max_deliveries=2. Nothing
    is dead-lettered, nothing redelivered, and an entity's messages apply in order."""
    broker = ListBroker([entry(f"m{n}", "acct", n) for n in range(1, 5)])
    processor, sent = _processor()
    real = processor.entities.load_many, processor.entities.load
    down = {"on": True}

    def failing(real_call: Any) -> Any:
        def call(*args: Any) -> Any:
            if down["on"]:
                raise StoreUnavailable("the store is down")
            return real_call(*args)

        return call

    processor.entities.load_many = failing(real[0])  # type: ignore[method-assign]
    processor.entities.load = failing(real[1])  # type: ignore[method-assign]
    consumer = Consumer(broker, processor, deposit, max_deliveries=2, mode=mode, batch_size=3)
    for _ in range(8):
        stats = consumer.run_once()
        assert (stats.acked, stats.nacked, stats.held) == (0, 0, 3)
    assert broker.nacked == [] and broker.counts == {1: 1, 2: 1, 3: 1}
    down["on"] = False
    first, second = consumer.run_once(), consumer.run_once()
    assert (first.acked, second.acked, first.held + second.held) == (3, 1, 0)
    assert processor.entities.load("acct").state["applied"] == ["m1", "m2", "m3", "m4"]
    assert not [m for m in sent.sent if m.destination == "dlq"]


def test_a_message_applied_before_but_delivered_too_often_is_a_duplicate() -> None:
    """An ack lost again and again: the message was applied; it must not be dead-lettered
    (a redrive of that letter would apply it a second time)."""
    processor, sent = _processor()
    done(processor.process(Message("m1", "acct", {"amount": 1}), deposit))
    broker = ListBroker([entry("m1", "acct", 1)])
    broker.counts = {1: 7}
    stats = Consumer(broker, processor, deposit, max_deliveries=5).run_once()
    assert stats.acked == 1 and stats.outcomes == {"duplicate": 1}
    assert not [m for m in sent.sent if m.destination == "dlq"]
    assert processor.entities.load("acct").state["balance"] == 1


def test_a_poison_message_without_dead_letters_is_left_alone_and_the_rest_done() -> None:
    broker = ListBroker([entry("m1", "acct", 1), entry("bad", "acct", -1), entry("m3", "b", 3)])
    processor, _ = _processor(dead_letters=None)
    consumer = Consumer(broker, processor, deposit, max_deliveries=None)
    stats = consumer.run_once()
    assert (stats.acked, stats.nacked) == (2, 1) and broker.nacked == [2]
    assert processor.entities.load("acct").state["applied"] == ["m1"]


def test_max_deliveries_needs_dead_letters_and_options_are_checked() -> None:
    processor, _ = _processor(dead_letters=None)
    with pytest.raises(ConfigurationError, match="dead_letters"):
        Consumer(ListBroker(), processor, deposit)
    Consumer(ListBroker(), processor, deposit, max_deliveries=None)
    good, _ = _processor()
    for bad in (
        {"batch_size": 0},
        {"mode": "stream"},
        {"max_deliveries": 0},
        {"wait": -1},
        {"max_backoff": 0},
    ):
        with pytest.raises(ConfigurationError):
            Consumer(ListBroker(), good, deposit, **bad)
    with pytest.raises(ConfigurationError, match="Broker"):
        Consumer(object(), good, deposit)  # type: ignore[arg-type]


def test_dead_letters_that_cannot_be_dispatched_are_held_for_the_next_round() -> None:
    class Down:
        def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
            raise StoreUnavailable("the broker is down")

    broker = ListBroker([("{", {"id": "m1", "correlation_id": "acct"})])
    processor, _ = _processor(dispatcher=Down())
    stats = Consumer(broker, processor, deposit).run_once()
    assert (stats.acked, stats.nacked, stats.held, stats.set_aside) == (0, 0, 1, 0)


def test_a_configuration_error_leaves_the_round_and_ends_the_loop() -> None:
    broker = ListBroker([entry("m1", "acct", 1)])
    processor, _ = _processor()

    def broken(*args: Any) -> Any:
        raise ConfigurationError("no such table")

    processor.entities.load_many = broken  # type: ignore[method-assign]
    with pytest.raises(ConfigurationError, match="no such table"):
        Consumer(broker, processor, deposit).run(install_signal_handlers=False)
    assert broker.acked == [] and broker.nacked == [1]


@pytest.mark.parametrize("how", ["stop", "sigterm"])
def test_stop_ends_the_loop_after_the_round_in_flight(how: str) -> None:
    broker = ListBroker([entry(f"m{n}", "acct", n) for n in range(1, 10)])
    processor, _ = _processor()
    consumer: Consumer

    def stopping(state: dict[str, Any], message: Message) -> Any:
        if message.id == "m2":
            if how == "stop":
                consumer.stop()
            else:
                os.kill(os.getpid(), signal.SIGTERM)
        return deposit(state, message)

    consumer = Consumer(broker, processor, stopping, batch_size=4)
    before = signal.getsignal(signal.SIGTERM)
    totals = consumer.run(install_signal_handlers=True)
    assert signal.getsignal(signal.SIGTERM) is before, "the previous handler is restored"
    assert broker.acked == [1, 2, 3, 4] and broker.nacked == []
    assert totals.acked == 4 and totals.rounds == 1
    assert processor.entities.load("acct").state["applied"] == ["m1", "m2", "m3", "m4"]
    assert broker.ready == [5, 6, 7, 8, 9], "nothing fetched after the stop"


def test_durations_go_through_the_one_parser_and_async_handlers_are_refused() -> None:
    """``wait="1s"`` as URLs take it; an ``async def`` handler refused at construction."""
    from datetime import timedelta

    processor, _ = _processor()
    consumer = Consumer(ListBroker(), processor, deposit, wait="250ms", max_backoff="1m")
    assert (consumer.wait, consumer.max_backoff) == (0.25, 60.0)
    assert Consumer(ListBroker(), processor, deposit, wait="0s").wait == 0.0
    assert Consumer(ListBroker(), processor, deposit, wait=timedelta(seconds=2)).wait == 2.0
    for bad in ({"wait": "soon"}, {"wait": "-1s"}, {"max_backoff": "0s"}, {"wait": True}):
        with pytest.raises(ConfigurationError, match="seconds"):
            Consumer(ListBroker(), processor, deposit, **bad)  # type: ignore[arg-type]

    async def handler(state: dict[str, Any], message: Message) -> Any:
        return state, []

    if FACE["now"] != "sync":  # accepted, and awaited
        broker = ListBroker([entry("m1", "acct", 1)])
        assert Consumer(broker, processor, handler).run_once().outcomes == {"processed": 1}
        return
    with pytest.raises(ConfigurationError, match="sync OutboxProcessor cannot await it"):
        Consumer(ListBroker(), processor, handler)


def keeping(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Keeps the message's body in the state (a large body makes the entity too large)."""
    return {**state, message.id: message.body}, [Send("kept", {"id": message.id})]


@pytest.mark.parametrize("mode", ["batch", "single"])
@pytest.mark.parametrize("dead_letters", ["dlq", None])
def test_one_large_message_wedges_nothing(mode: Any, dead_letters: str | None) -> None:
    """The issue's case: a 5 MB message its entity cannot hold, among 31 deliveries for 7
    other accounts. With dead letters it is set aside once (a bounded letter) and all 32
    are acknowledged; without, only it is given back and the other 31 are done."""
    big = json.dumps({"blob": "x" * 5_000_000})
    entries: list[tuple[str | bytes, dict[str, str]]] = [
        (big, {"id": "big", "correlation_id": "acct-big"})
    ]
    entries += [entry(f"m{n}", f"acct-{n % 7}", n) for n in range(31)]
    broker = ListBroker(entries)
    processor, sent = _processor(dead_letters=dead_letters)
    consumer = Consumer(broker, processor, keeping, mode=mode, batch_size=32, max_deliveries=None)
    stats = consumer.run_once()
    if dead_letters:
        assert (stats.acked, stats.nacked) == (32, 0) and stats.held == 0
        assert stats.outcomes == {"processed": 31, "dead_lettered": 1}
        (letter,) = [m for m in sent.sent if m.destination == "dlq"]
        assert letter.body["message"]["body_omitted"]["bytes"] > 5_000_000
        assert len(json.dumps(letter.body)) < 100_000, "bounded"
    else:
        assert (stats.acked, stats.nacked) == (31, 1) and stats.held == 0
        assert broker.nacked == [1]
    for n in range(7):
        assert len(processor.entities.load(f"acct-{n}").state) == len(range(n, 31, 7))


def test_a_fatal_error_leaves_the_totals_of_the_round_it_ended() -> None:
    """The round that fails fatally counts in ``Consumer.totals`` (what the command
    prints): the batch before it acknowledged, the failing round given back."""
    broker = ListBroker([entry(f"m{n}", f"acct-{n > 2}", n) for n in range(1, 5)])
    processor, _ = _processor()
    real = processor.entities.load_many
    calls = {"n": 0}

    def second_fails(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConfigurationError("the table was dropped")
        return real(*args)

    processor.entities.load_many = second_fails  # type: ignore[method-assign]
    consumer = Consumer(broker, processor, deposit, batch_size=2)
    with pytest.raises(ConfigurationError, match="dropped"):
        consumer.run(install_signal_handlers=False)
    totals = consumer.totals
    assert (totals.rounds, totals.fetched, totals.acked, totals.nacked) == (2, 4, 2, 2)
    assert broker.acked == [1, 2] and sorted(broker.nacked) == [3, 4]


def test_what_was_done_when_the_acknowledgement_failed_is_acked_next_round() -> None:
    broker = ListBroker([entry("m1", "acct", 1), entry("m2", "acct", 2)])
    processor, sent = _processor()
    real_ack = broker.ack
    failures = {"left": 1}

    def ack(deliveries: Sequence[Delivery]) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise StoreUnavailable("the broker is down")
        real_ack(deliveries)

    broker.ack = ack  # type: ignore[method-assign]
    consumer = Consumer(broker, processor, deposit)
    with pytest.raises(StoreUnavailable):
        consumer.run_once()
    again = consumer.run_once()
    assert again.acked == 2 and sorted(broker.acked) == [1, 2]
    assert broker.counts == {1: 1, 2: 1}, "not delivered again"
    assert len(sent.sent) == 2, "not processed again"


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_a_suspect_held_by_an_outage_before_its_run_was_recorded_still_runs_alone(
    mode: Any,
) -> None:
    """A consumer died holding m1 (a later delivery counts 2): the next consumer runs it
    alone, its run recorded first. The store is down at that very step, so m1 is held;
    once the store is back it must still run alone, with its run recorded once (it ran
    in the batch, not isolated and never counted: a poison message could then kill the
    consumer again and again with the rest of its batch)."""
    broker = ListBroker([entry("m1", "acct", 1), entry("m2", "b", 2), entry("m3", "b", 3)])
    processor, sent = _processor()
    broker.fetch(3, 0.0)
    broker.restart()  # the first consumer died holding all three
    real = processor.begin_attempt
    calls: list[str] = []
    down = {"on": True}

    def begin_attempt(message: Message) -> int:
        calls.append(message.id)
        if down["on"]:
            raise StoreUnavailable("the store is down")
        return real(message)  # type: ignore[no-any-return]

    async def abegin_attempt(message: Message) -> int:
        calls.append(message.id)
        if down["on"]:
            raise StoreUnavailable("the store is down")
        return await real(message)  # type: ignore[no-any-return]

    patched = begin_attempt if FACE["now"] == "sync" else abegin_attempt
    processor.begin_attempt = patched  # type: ignore[method-assign]
    consumer = Consumer(broker, processor, deposit, max_deliveries=2, mode=mode)
    first = consumer.run_once()
    assert (first.acked, first.held) == (0, 3) and broker.nacked == []
    down["on"] = False
    second = consumer.run_once()
    assert second.acked == 3 and second.isolated == 3
    assert calls == ["m1", "m1", "m2", "m3"], "each run recorded once, before it ran"
    assert processor.entities.load("b").state["balance"] == 5
    assert not [m for m in sent.sent if m.destination == "dlq"]


@pytest.mark.parametrize("mode", ["batch", "single"])
def test_a_conflict_that_persists_is_held_not_set_aside(mode: Any) -> None:
    """Another writer wins every save of an entity for several rounds (the processor
    gives up after its bounded retries with ``ConcurrencyConflict``): not the message's
    fault, so it is held like an outage, never nacked or counted, never dead-lettered;
    once the saves go through it applies once."""
    broker = ListBroker([entry("m1", "acct", 1), entry("m2", "acct", 2)])
    processor, sent = _processor()
    entities = processor.entities
    real_save, real_save_many = entities.save, entities.save_many
    contended = {"on": True}

    def save(entity: Any) -> Any:
        if contended["on"]:
            raise ConcurrencyConflict(f"entity {entity.id!r} changed")
        return real_save(entity)

    def save_many(batch: Any) -> set[str]:
        return {e.id for e in batch} if contended["on"] else real_save_many(batch)

    entities.save = save  # type: ignore[method-assign]
    entities.save_many = save_many  # type: ignore[method-assign]
    consumer = Consumer(broker, processor, deposit, max_deliveries=2, mode=mode)
    for _ in range(4):
        stats = consumer.run_once()
        assert (stats.acked, stats.nacked, stats.held, stats.set_aside) == (0, 0, 2, 0)
    assert broker.nacked == [] and broker.counts == {1: 1, 2: 1}
    contended["on"] = False
    done = consumer.run_once()
    assert done.acked == 2 and done.outcomes == {"processed": 2}
    assert entities.load("acct").state["applied"] == ["m1", "m2"]
    assert not [m for m in sent.sent if m.destination == "dlq"]
