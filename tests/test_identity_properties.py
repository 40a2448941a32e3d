"""Property-based tests: message streams against a plain model of exactly-once.

Hypothesis generates deliveries of (consumer, entity, message id) with ids reused
across entities and consumers, duplicates, random batch splits (``process`` or
``process_batch``), sweeps, and crashes at any store or dispatcher call (before the
call, or after it: a lost acknowledgement). Crashed deliveries are redelivered, as a
broker would. After the input drains and a final replay and sweep, every invariant is
checked against the model:

* each message (consumer, entity, id) is applied exactly once to its entity;
* the outgoing ids are exactly those the model derives, every copy of one id is
  identical, and each output carries the state it came from (no ghost);
* no outbox entry is left, and every message is recorded under its key per consumer;
* no message is reported ``processed`` twice (exactly once when nothing crashed);
* with a run record (``run`` and ``before_cleanup``, a crashed batch retried whole as
  a Spark task is), every message is recorded applied exactly once, crashes or not.

In token mode (every delivery carries a token, or in hybrid mode those of m1 and m3)
the crashes reach the token store's calls too, the outputs to ``out`` get tokens for
a receiver that consumes them as they are dispatched, and: every first copy of an
output finds its token, no consumed token comes back, nothing of a tokened message
is in the deduplication store, and no token is left but a dead letter's (kept for its
redrive) and those no message carries of an attempt that died right after creating
them (the orphan report's).

Entity records are small here (a few KB) so batches run in rounds, and
``deferred_limit`` is tiny so the deferred clean-up moves ids inline. Full runs on the
in-process and SQLite backends; shorter ones on PostgreSQL and Redis. Anti-tests
show the harness catches a processor keyed by the bare message id and outgoing ids
that ignore the consumer.
"""

from __future__ import annotations

import hashlib
import importlib
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import dedupstore.outbox as outbox_module
from dedupstore import aio
from dedupstore.backends.memory import (
    MemoryDeduplicationStore,
    MemoryEntityStore,
    MemoryTokenStore,
)
from dedupstore.entities import Entity, EntityStore, OutgoingMessage
from dedupstore.ids import outgoing_id
from dedupstore.outbox import Message, OutboxProcessor, Send
from dedupstore.outbox.tokened import minted
from dedupstore.registry import open_url
from dedupstore.steps import Steps
from dedupstore.store import DeduplicationStore
from dedupstore.testing.interleavings import Face, OnLoop, _Creating, sweep_with
from dedupstore.tokens import TOKEN_HEADER, TokenStore, token_id
from tests.outbox_backends import OutboxBackend, _drop_postgres

ENTITIES = ("a", "b", "c")
IDS = ("m1", "m2", "m3", "m4")
CONSUMERS = ("billing", "shipping")
OPERATIONS = (
    "load",
    "load_many",
    "save",
    "save_many",
    "has_been_processed",
    "processed_among",
    "add",
    "add_many",
    "dispatch",
    "create",
    "present_among",
    "delete",
)
RECORD_BYTES = 2200


class Crash(Exception):
    """An injected crash: the caller stops here; the broker redelivers."""


class Faults:
    """Raises :class:`Crash` at the ``nth`` call of ``operation``, before or after it."""

    def __init__(self) -> None:
        self.armed: tuple[str, int, bool] | None = None
        self.calls: Counter[str] = Counter()
        #: the armed attempt created tokens; a crash came after it did
        self.created = False
        self.crashed_after_create = False

    def arm(self, crash: tuple[str, int, bool] | None) -> None:
        self.armed, self.calls, self.created = crash, Counter(), False

    def call(self, name: str, action: Callable[[], Any]) -> Any:
        self.calls[name] += 1
        hit = self.armed is not None and self.armed[:2] == (name, self.calls[name])
        if hit and self.armed is not None and not self.armed[2]:
            self.armed = None
            self.crashed_after_create |= self.created
            raise Crash(f"before {name}")
        result = action()
        self.created |= name == "create"
        if hit:
            self.armed = None
            self.crashed_after_create |= self.created
            raise Crash(f"after {name}")
        return result


class _Wrapped:
    def __init__(self, real: Any, faults: Faults) -> None:
        self._real, self._faults = real, faults

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in OPERATIONS:
            return attr
        return lambda *a, **k: self._faults.call(name, lambda: attr(*a, **k))


class Ledger:
    """The receivers: every dispatched copy, in order. With ``tokens``, the receiver
    ``down`` of ``out`` consumes each copy's token as it is dispatched."""

    def __init__(self, tokens: TokenStore | None = None) -> None:
        self.sent: list[OutgoingMessage] = []
        self.tokens = tokens
        self.consumed: set[str] = set()
        self.created: set[str] = set()  # every token a processor created

    def dispatch(self, messages: Any) -> None:
        if self.tokens is not None:
            for message in messages:
                if message.destination != "out":
                    continue
                token = token_id(message.id, "down", message.headers[TOKEN_HEADER])
                if token in self.consumed:
                    continue
                assert self.tokens.present_among([token]), f"{message.id} sent before its token"
                self.tokens.delete([token])
                self.consumed.add(token)
        self.sent.extend(messages)


def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Appends the id; one output with the history and a pad, a second on the first message."""
    applied = [*state.get("applied", []), message.id]
    pad = "x" * ((len(applied) * 397 + len(message.correlation_id) * 131) % 1400)
    sends = [Send("out", {"applied": applied, "pad": pad})]
    if len(applied) == 1:
        sends.append(Send("first", {"entity": message.correlation_id}))
    return {"applied": applied}, sends


def poisoned(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """:func:`handler`, but message m4 of entity c is poison: the handler raises."""
    if message.id == "m4" and message.correlation_id.startswith("c-"):
        raise ValueError(f"cannot take {message.id}")
    return handler(state, message)


def is_poison(cid: str, mid: str) -> bool:
    return mid == "m4" and cid.startswith("c-")


@dataclass(frozen=True)
class Step:
    size: int
    batch: bool
    crash: tuple[str, int, bool] | None
    sweep: bool


@dataclass(frozen=True)
class Scenario:
    deliveries: tuple[tuple[str, str, str], ...]
    steps: tuple[Step, ...]
    cleanup: dict[str, str]
    #: with ``dead_letters``, and the poison message m4 of entity c
    poison: bool = False
    #: batches only, each with a run record, a crashed batch retried at once and whole
    record: bool = False
    #: "all": every delivery carries a token; "hybrid": those of m1 and m3
    tokens: str = "off"

    @property
    def handler(self) -> Any:
        return poisoned if self.poison else handler


scenarios = st.builds(
    Scenario,
    deliveries=st.lists(
        st.tuples(st.sampled_from(CONSUMERS), st.sampled_from(ENTITIES), st.sampled_from(IDS)),
        min_size=1,
        max_size=40,
    ).map(tuple),
    steps=st.lists(
        st.builds(
            Step,
            size=st.integers(1, 12),
            batch=st.booleans(),
            crash=st.none()
            | st.tuples(st.sampled_from(OPERATIONS), st.integers(1, 3), st.booleans()),
            sweep=st.booleans(),
        ),
        max_size=12,
    ).map(tuple),
    cleanup=st.fixed_dictionaries({c: st.sampled_from(["inline", "deferred"]) for c in CONSUMERS}),
    poison=st.booleans(),
    record=st.booleans(),
    tokens=st.sampled_from(["off", "all", "hybrid"]),
)


@dataclass
class World:
    """One consumer's clients: its own entity store, its endpoint of the dedup store."""

    entities: EntityStore
    dedup: DeduplicationStore
    tokens: TokenStore | None = None


Factory = Callable[[str], World]


def run(
    scenario: Scenario,
    open_world: Factory,
    tag: str,
    *,
    redeliver: bool = True,
    face: Face = "sync",
) -> None:
    """Play ``scenario`` and check every invariant against the plain model, driving
    ``face``'s processor (the async one, each call on an event loop of its own).

    ``redeliver=False`` is a broken broker, for the anti-test: a crashed delivery is
    dropped instead of redelivered. Each consumer has its own entity store: the two
    use the same entity ids (an entity store holds one consumer's entities; a sweep
    moves every id it finds into its own endpoint).
    """
    tags = dict.fromkeys(CONSUMERS, tag)
    faults = Faults()
    worlds = {c: open_world(f"{c}-{tag}") for c in CONSUMERS}
    token_store = worlds[CONSUMERS[0]].tokens if scenario.tokens != "off" else None
    ledger = Ledger(token_store)
    try:
        incoming = _mint(scenario, worlds, tags, token_store)
        for world in worlds.values():
            world.entities.max_entity_bytes = RECORD_BYTES  # type: ignore[misc]
        made: Any = OutboxProcessor if face == "sync" else aio.AsyncOutboxProcessor
        processors = {
            c: made(
                _Wrapped(w.entities, faults),
                _Wrapped(w.dedup, faults),
                _Wrapped(ledger, faults),
                cleanup=scenario.cleanup[c],  # type: ignore[arg-type]
                deferred_limit=2,
                dead_letters="dead" if scenario.poison else None,
                run=f"run-{tag}" if scenario.record else None,
                **_token_options(token_store, ledger, faults),
            )
            for c, w in worlds.items()
        }
        if face == "async":
            processors = {c: OnLoop(p) for c, p in processors.items()}
        reports = _play(scenario, processors, worlds, faults, tags, redeliver, face)
        _check(scenario, processors, worlds, ledger, tags, reports, replay=redeliver, face=face)
        if token_store is not None:
            _check_tokens(scenario, worlds, ledger, tags, incoming, faults)
    finally:
        for world in worlds.values():
            world.entities.close()
            world.dedup.close()
            if world.tokens is not None:
                world.tokens.close()


def _token_options(tokens: TokenStore | None, ledger: Ledger, faults: Faults) -> dict[str, Any]:
    if tokens is None:
        return {}
    store = _Wrapped(_Creating(tokens, ledger.created), faults)
    return {"tokens": store, "subscriptions": {"out": ["down"]}}


def _tokened(scenario: Scenario, mid: str) -> bool:
    return scenario.tokens == "all" or (scenario.tokens == "hybrid" and mid in ("m1", "m3"))


def _nonce(consumer: str, cid: str, mid: str, tags: dict[str, str]) -> str:
    """The nonce of a delivery's token (the same on every copy of it)."""
    return hashlib.sha256(f"{consumer}/{cid}/{mid}/{tags[consumer]}".encode()).hexdigest()[:16]


def _mint(
    scenario: Scenario,
    worlds: dict[str, World],
    tags: dict[str, str],
    tokens: TokenStore | None,
) -> dict[tuple[str, str, str], str]:
    """Create the token of every delivery that carries one (its producer's part):
    ``(consumer, entity, id) -> token id``."""
    minted: dict[tuple[str, str, str], str] = {}
    if tokens is None:
        return minted
    for consumer, cid, mid in dict.fromkeys(scenario.deliveries):
        if _tokened(scenario, mid):
            endpoint = worlds[consumer].dedup.endpoint
            nonce = _nonce(consumer, cid, mid, tags)
            minted[(consumer, cid, mid)] = token_id(mid, endpoint, nonce)
    if minted:
        tokens.create({t: worlds[c].dedup.endpoint for (c, _, _), t in minted.items()})
    return minted


def _message(
    consumer: str, cid: str, mid: str, tags: dict[str, str], scenario: Scenario | None = None
) -> Message:
    headers = {}
    if scenario is not None and scenario.tokens != "off" and _tokened(scenario, mid):
        headers[TOKEN_HEADER] = _nonce(consumer, cid, mid, tags)
    return Message(mid, f"{cid}-{tags[consumer]}", None, headers)


def _check_tokens(
    scenario: Scenario,
    worlds: dict[str, World],
    ledger: Ledger,
    tags: dict[str, str],
    incoming: dict[tuple[str, str, str], str],
    faults: Faults,
) -> None:
    """After the drain: no token left but the dead letters' (for their redrive) and, after
    a crash, the ones no message carries; nothing of a tokened message recorded."""
    tokens = ledger.tokens
    assert tokens is not None
    redrives = {
        token_id(
            outgoing_id(worlds[c].dedup.endpoint, f"{cid}-{tags[c]}", mid, -1),
            worlds[c].dedup.endpoint,
            _nonce(c, cid, mid, tags),
        )
        for (c, cid, mid) in incoming
        if scenario.poison and is_poison(f"{cid}-{tags[c]}", mid)
    }
    assert tokens.present_among(redrives) == redrives, "a dead letter lost its redrive's token"
    carried = {
        token_id(m.id, "down", m.headers[TOKEN_HEADER])
        for m in ledger.sent
        if m.destination == "out"
    }
    left = tokens.present_among({*incoming.values(), *ledger.created}) - redrives
    if faults.crashed_after_create:  # the orphans of an attempt that died making them
        left &= {*incoming.values(), *carried}
    assert not left, f"{len(left)} token(s) left after the drain"
    assert not tokens.present_among(ledger.consumed), "a consumed token exists again"
    for consumer, cid, mid in incoming:
        key = outbox_module.message_key(f"{cid}-{tags[consumer]}", mid)
        assert not worlds[consumer].dedup.processed_among([key]), f"{mid}: recorded with a token"


def _play(
    scenario: Scenario,
    processors: dict[str, OutboxProcessor],
    worlds: dict[str, World],
    faults: Faults,
    tags: dict[str, str],
    redeliver: bool,
    face: Face = "sync",
) -> Counter[tuple[str, str, str]]:
    """Deliver everything, redelivering what crashed; how often each message was
    reported applied (``processed`` or ``dead_lettered``)."""
    reports: Counter[tuple[str, str, str]] = Counter()
    queue = list(scenario.deliveries)
    steps: Iterator[Step] = iter(scenario.steps)
    while queue:
        step = next(steps, Step(5, True, None, False))
        taken, queue = queue[: step.size], queue[step.size :]
        for consumer in CONSUMERS:
            mine = [d for d in taken if d[0] == consumer]
            if not mine:
                continue
            faults.arm(step.crash)
            messages = [_message(*d, tags, scenario) for d in mine]
            if scenario.record:
                _record(processors[consumer], messages, scenario.handler, reports, consumer)
                faults.arm(None)
                continue
            done = 0
            try:
                if step.batch:
                    results = processors[consumer].process_batch(messages, scenario.handler)
                    _report(reports, consumer, results, messages)
                    done = len(mine)
                else:
                    for message in messages:
                        result = processors[consumer].process(message, scenario.handler)
                        _report(reports, consumer, [result], [message])
                        done += 1
            except Crash:
                if redeliver:
                    queue.extend(mine[done:])  # not acknowledged: redelivered later
            faults.arm(None)
        if step.sweep:
            for world in worlds.values():
                sweep_with(face, world.entities, world.dedup, world.tokens)
    return reports


def _record(
    processor: OutboxProcessor,
    messages: list[Message],
    handler: Any,
    reports: Counter[tuple[str, str, str]],
    consumer: str,
) -> None:
    """One batch with a run record, retried whole until it gets through (a Spark task
    retry); reports what the record says, each position as first recorded."""
    position = {id(m): n for n, m in enumerate(messages)}
    record: dict[int, Any] = {}

    def before_cleanup(done: Any, results: Any) -> None:
        for message, result in zip(done, results, strict=True):
            record.setdefault(position[id(message)], result)

    while True:
        try:
            processor.process_batch(messages, handler, before_cleanup=before_cleanup)
            break
        except Crash:
            continue
    _report(reports, consumer, [record[n] for n in range(len(messages))], messages)


def _report(
    reports: Counter[tuple[str, str, str]],
    consumer: str,
    results: list[Any],
    messages: list[Message],
) -> None:
    for result, message in zip(results, messages, strict=True):
        if result.outcome in ("processed", "dead_lettered"):
            reports[(consumer, message.correlation_id, message.id)] += 1


def _check(
    scenario: Scenario,
    processors: dict[str, OutboxProcessor],
    worlds: dict[str, World],
    ledger: Ledger,
    tags: dict[str, str],
    reports: Counter[tuple[str, str, str]],
    *,
    replay: bool,
    face: Face = "sync",
) -> None:
    model: dict[tuple[str, str], set[str]] = {}
    for consumer, cid, mid in scenario.deliveries:
        model.setdefault((consumer, f"{cid}-{tags[consumer]}"), set()).add(mid)
    # a final replay of everything, then a sweep: nothing new may happen
    for consumer, processor in processors.items():
        again = [
            _message(*d, tags, scenario) for d in scenario.deliveries if d[0] == consumer and replay
        ]
        if again:
            outcomes = {r.outcome for r in processor.process_batch(again, scenario.handler)}
            assert outcomes <= {"duplicate", "redispatched"}, f"replay of {consumer}: {outcomes}"
        world = worlds[consumer]
        result = sweep_with(face, world.entities, world.dedup, world.tokens)
        assert result.ids_left == 0, result
    sent: dict[str, OutgoingMessage] = {}
    for copy in ledger.sent:
        first = sent.setdefault(copy.id, copy)
        assert first == copy, f"{copy.id} dispatched as {first} and as {copy}"
    expected: set[str] = set()
    for (consumer, cid), mids in model.items():
        world = worlds[consumer]
        entity: Entity = world.entities.load(cid)
        applied = entity.state.get("applied", [])
        poison = {mid for mid in mids if scenario.poison and is_poison(cid, mid)}
        wanted = sorted(mids - poison)
        assert sorted(applied) == wanted, f"{consumer}/{cid} applied {applied}, not {wanted}"
        assert not entity.outbox, f"{consumer}/{cid} keeps {entity.outbox}"
        # the processor's own key function: an anti-test that breaks it must be caught
        # by the invariants on the entities and the outputs, not by this line
        keys = {
            outbox_module.message_key(cid, mid)
            for mid in mids
            if scenario.tokens == "off" or not _tokened(scenario, mid)
        }
        recorded = world.dedup.processed_among(keys) if keys else set()
        assert recorded == keys, f"{consumer}/{cid}: ids not recorded"
        endpoint = world.dedup.endpoint
        for mid in poison:  # set aside once: one dead letter, never applied
            letter = sent.get(outgoing_id(endpoint, cid, mid, -1))
            assert letter is not None, f"the dead letter of {consumer}/{cid}/{mid} was lost"
            assert letter.destination == "dead"
            assert letter.body["message"]["id"] == mid
            assert letter.body["error"] == {"type": "ValueError", "text": f"cannot take {mid}"}
            expected.add(letter.id)
        for position, mid in enumerate(applied):
            out = sent.get(outgoing_id(endpoint, cid, mid, 0))
            assert out is not None, f"the output of {consumer}/{cid}/{mid} was lost"
            assert out.body["applied"] == applied[: position + 1], "output from a wrong state"
            expected.add(out.id)
            if position == 0:
                expected.add(outgoing_id(endpoint, cid, mid, 1))
    assert set(sent) == expected, f"unexpected {set(sent) - expected}, lost {expected - set(sent)}"
    assert all(n == 1 for n in reports.values()), f"reported processed twice: {reports}"
    if scenario.record or not any(step.crash for step in scenario.steps):
        assert sum(reports.values()) == sum(len(m) for m in model.values()), "lost a report"


# ---------------------------------------------------------------------- the backends


def memory_worlds() -> Factory:
    shared = f"memory://{uuid.uuid4().hex}"
    return lambda name: World(
        MemoryEntityStore(f"memory://{uuid.uuid4().hex}"),
        MemoryDeduplicationStore(shared, endpoint=name),
        MemoryTokenStore(shared),
    )


def backend_worlds(backend: OutboxBackend) -> Factory:
    """Each consumer gets its own entity table (or key prefix) and its own endpoint.

    Examples share them: each example uses fresh entity ids (its tag).
    """

    def open_world(name: str) -> World:
        consumer = name.split("-")[0]
        url = backend.entities_url
        if backend.name in ("dynamodb", "cosmos"):  # a table / container per consumer
            url = url.replace("://ent-", f"://ent{consumer}-").replace("/ent-", f"/ent{consumer}-")
            entities = open_url("entity_store", url, **backend.options)
        elif backend.name == "sqlite":
            entities = open_url("entity_store", url, table=f"ent_{consumer}", **backend.options)
        else:
            url = url.replace("table=ent_", f"table=ent_{consumer}_")
            url = url.replace("key_prefix=ent", f"key_prefix=ent{consumer}")
            entities = open_url("entity_store", url, **backend.options)
        return World(entities, backend.dedup(endpoint=name), backend.tokens())

    return open_world


#: An anti-test's phases: generate until an example fails, and do not shrink it.
FIND_ONLY = (Phase.explicit, Phase.reuse, Phase.generate)
PROPERTY = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.mark.memory
@settings(PROPERTY, max_examples=1000)
@given(scenario=scenarios)
def test_every_stream_keeps_every_invariant_memory(scenario: Scenario) -> None:
    run(scenario, memory_worlds(), uuid.uuid4().hex[:8])


#: (face, backend, examples): the async face runs fewer (the steps are the same as the
#: sync face's; what differs is how each call is made), but on every server backend.
SERVER_RUNS = [
    ("sync", "sqlite", 300),
    ("sync", "postgres", 100),
    ("sync", "redis", 100),
    ("async", "sqlite", 60),
    ("async", "postgres", 30),
    ("async", "redis", 30),
    ("async", "dynamodb", 15),
    ("async", "cosmos", 15),
]


@pytest.mark.parametrize(
    ("face", "outbox_backend", "examples"),
    [
        pytest.param(face, name, n, marks=getattr(pytest.mark, name), id=f"{face}-{name}")
        for face, name, n in SERVER_RUNS
    ],
    indirect=["outbox_backend"],
)
def test_every_stream_keeps_every_invariant_on_servers(
    outbox_backend: OutboxBackend, examples: int, face: Face
) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(scenario=scenarios)
    def check(scenario: Scenario) -> None:
        run(scenario, backend_worlds(outbox_backend), uuid.uuid4().hex[:8], face=face)

    try:
        check()
    finally:
        if outbox_backend.name == "postgres":
            tag = outbox_backend.entities_url.split("table=ent_")[1].split("&")[0]
            server = outbox_backend.entities_url.split("?")[0]
            _drop_postgres(server, [f"ent_{c}_{tag}" for c in CONSUMERS])


@pytest.mark.memory
@settings(PROPERTY, max_examples=300)
@given(scenario=scenarios)
def test_every_stream_keeps_every_invariant_on_the_async_face_memory(scenario: Scenario) -> None:
    run(scenario, memory_worlds(), uuid.uuid4().hex[:8], face="async")


# ---------------------------------------------------------------------- anti-tests


@pytest.mark.memory
@pytest.mark.parametrize(
    ("target", "broken"),
    [
        ("message_key", lambda cid, mid: mid),
        ("outgoing_id", lambda _c, cid, mid, pos: outgoing_id("x", cid, mid, pos)),
        ("outgoing_id", lambda c, cid, mid, pos: outgoing_id(c, "x", mid, pos)),
    ],
    ids=["dedup-by-bare-id", "outgoing-ids-ignore-the-consumer", "outgoing-ids-ignore-the-entity"],
)
def test_the_harness_catches_identity_bugs(
    monkeypatch: pytest.MonkeyPatch, target: str, broken: Any
) -> None:
    # every module of the outbox package that calls it
    for name in ("batch", "handlers", "letters", "processor", "sweep"):
        module = importlib.import_module(f"dedupstore.outbox.{name}")
        if hasattr(module, target):
            monkeypatch.setattr(module, target, broken)
    _assert_the_harness_fails()


def _assert_the_harness_fails(
    *,
    redeliver: bool = True,
    among: st.SearchStrategy[Scenario] = scenarios,
    examples: int = 300,
) -> None:
    """Some scenario generated ``among`` breaks an invariant (for an anti-test). Found
    is enough: no shrinking to the smallest such scenario."""

    @settings(PROPERTY, max_examples=examples, report_multiple_bugs=False, phases=FIND_ONLY)
    @given(scenario=among)
    def check(scenario: Scenario) -> None:
        run(scenario, memory_worlds(), uuid.uuid4().hex[:8], redeliver=redeliver)

    with pytest.raises(AssertionError):
        check()


@pytest.mark.memory
@pytest.mark.parametrize("broken", ["run-ignored", "record-after-cleanup"])
def test_the_harness_catches_a_run_record_that_depends_on_the_attempt(
    monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    """Outcomes that ignore the run, or a record written after the clean-up, lose reports."""
    if broken == "run-ignored":
        monkeypatch.setattr(OutboxProcessor, "_found", lambda self, e, mid: ("redispatched", None))
    else:
        original = OutboxProcessor.process_batch

        def late(self: OutboxProcessor, messages: Any, handler: Any, **kw: Any) -> Any:
            results = original(self, messages, handler)
            if kw.get("before_cleanup"):
                kw["before_cleanup"](messages, results)
            return results

        monkeypatch.setattr(OutboxProcessor, "process_batch", late)
    # it takes a crash right after the clean-up's save: rarer than the other bugs
    record = scenarios.map(lambda s: replace(s, record=True))
    _assert_the_harness_fails(among=record, examples=1000)


@pytest.mark.memory
def test_the_harness_catches_a_lost_redelivery() -> None:
    """A broker that drops a crashed delivery (acknowledged before processing) loses it."""
    _assert_the_harness_fails(redeliver=False)


@pytest.mark.memory
def test_the_harness_catches_dead_letters_without_a_stable_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead letter whose id changes on every run is sent again as another message."""
    original = OutboxProcessor._dead_letter

    def unstable(self: OutboxProcessor, message: Message, exc: Exception, attempts: int) -> Any:
        letter = original(self, message, exc, attempts)
        return OutgoingMessage(str(uuid.uuid4()), letter.destination, letter.body)

    monkeypatch.setattr(OutboxProcessor, "_dead_letter", unstable)
    _assert_the_harness_fails()


@pytest.mark.memory
@pytest.mark.parametrize("broken", ["created-again-after-dispatch", "deleted-before-the-save"])
def test_the_harness_catches_token_bugs(monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    """Tokens made again before every dispatch bring back consumed ones; an incoming
    token deleted as soon as it is read loses the message when the attempt dies."""
    if broken == "created-again-after-dispatch":
        original_make = OutboxProcessor._make

        def make(self: OutboxProcessor, pairs: Any, alone: bool = False) -> Steps[set[str]]:
            conflicts = yield from original_make(self, pairs, alone)
            for entity, mid in pairs:
                tokens = entity.tokens.get(mid)
                if tokens and tokens.made and entity.outbox.get(mid) and self.tokens:
                    self.tokens.create(minted(entity, mid, tokens.made))
            return conflicts

        monkeypatch.setattr(OutboxProcessor, "_make", make)
    else:
        original_read = OutboxProcessor._recorded_by_token

        def read(self: OutboxProcessor, tokens: Any) -> Steps[set[str]]:
            missing = yield from original_read(self, tokens)
            if self.tokens is not None:
                self.tokens.delete([t for k, t in tokens.items() if k not in missing])
            return missing

        monkeypatch.setattr(OutboxProcessor, "_recorded_by_token", read)
    tokened = scenarios.map(lambda s: replace(s, tokens="all"))
    _assert_the_harness_fails(among=tokened, examples=1000)
