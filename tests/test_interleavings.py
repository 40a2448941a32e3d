"""Every ordering of concurrent consumers and sweeps, and a crash at every step, on every backend.

The harness (:mod:`dedupstore.testing.interleavings`) forces the order of the calls;
the stores are the real backends. The anti-tests run the same harness on four
deliberately broken processors and require it to report the violated invariant.

Reduced on the emulators (DynamoDB on moto, Cosmos DB on cosmosdb-server, where
one schedule takes 70-100 ms against 5-15 ms on the others): they run every
schedule of every scenario in deferred mode and of the two smallest in inline
mode, but not the crash schedules of a batch beside a consumer or of two
consumers of different messages (see ``SCENARIOS``). Those crash scenarios (and a
consumer crashing beside a batch of another message) in inline mode (several
thousand schedules each) run on memory and SQLite only, to keep ``make test`` under
40 minutes; everything else runs on memory, SQLite,
PostgreSQL and Redis in both modes. The scenarios of a consumer that kept the entity
run on those four only: on DynamoDB and Cosmos DB (not joined) a kept entity takes
the memory and SQLite path, ``has_been_processed`` then the conditional save.

Token mode (``TOKEN_SCENARIOS``) has about 15 to 45 times the schedules of the same
scenario in retention mode where its calls are separate (four more per message: on
memory, whose stores do not join, and on Cosmos DB); on SQLite, PostgreSQL, Redis
and DynamoDB the token store shares the entity store's server and the token steps
ride in the entity store's requests (``load_and_read``, ``save_tokened``), so both
paths are explored. Every schedule of two
copies of a message with a token runs on memory, SQLite, PostgreSQL and Redis
(deferred; inline on the first two), the first 400 of them on DynamoDB and Cosmos DB;
a crash after every call of a sweep beside a consumer, and of a batch of a message
with a token and one without (hybrid), runs on all six; the costlier crash, kept-entity
and recorded-run scenarios run on one in-process backend per clean-up mode; two
consumers of a message with a token and one without run their first 3,000 schedules
on memory. Four anti-tests show the harness catches a token created again after
dispatch, deleted before the save, read before the load, and shared by two receivers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import pytest

from dedupstore import aio
from dedupstore import tokens as tokens_module
from dedupstore.entities import Entity, EntityStore
from dedupstore.errors import ConcurrencyConflict
from dedupstore.outbox import Handler, Message, OutboxProcessor, ProcessResult, message_key
from dedupstore.outbox import tokened as tokened_module
from dedupstore.outbox.tokened import minted
from dedupstore.steps import Steps, io, run
from dedupstore.testing.interleavings import (
    Actor,
    InterleavingViolation,
    Scenario,
    explore,
    independent,
)
from dedupstore.tokens import TokenChange
from tests.consume_worker import Late
from tests.outbox_backends import OutboxBackend, backend_params
from tests.outbox_backends import patient as outbox_patient

ONE = Actor("process", (0,))
OTHER = Actor("process", (1,))
BATCH = Actor("batch", (0, 1))
#: a batch of the other message only (so that it keeps the entity as it saved it)
BATCH_OTHER = Actor("batch", (1,))
SWEEP = Actor("sweep")
#: a consumer that processed m0 alone before the run: it holds the entity it saved
KEPT = Actor("process", (1,), after=(0,))
#: the same, and m0 is redelivered to it (the anti-test of the kept entity's check)
KEPT_AGAIN = Actor("process", (0,), after=(0,))
#: m0 as the consume loop runs a message a consumer died holding: its run recorded first
RETRY = Actor("retry", (0,))
MODES = ("inline", "deferred")

IN_PROCESS = ("memory", "sqlite")
FAST = (*IN_PROCESS, "postgres", "redis")
ALL = (*FAST, "dynamodb", "cosmos")


class Case(NamedTuple):
    """One scenario: its actors and messages, which actor crashes (or None), the
    backends per clean-up mode, the messages processed before the run, the token
    mode, and a bound on the schedules (None: all of them)."""

    actors: tuple[Actor, ...]
    messages: int
    crash: int | None
    where: Mapping[str, tuple[str, ...]]
    earlier: tuple[int, ...] = ()
    tokens: Literal["off", "all", "hybrid"] = "off"
    limit: int | None = None

    def scenario(self, cleanup: Literal["inline", "deferred"]) -> Scenario:
        return Scenario(self.actors, self.messages, cleanup, self.earlier, self.tokens)


BOTH_FAST: dict[str, tuple[str, ...]] = {"inline": FAST, "deferred": FAST}
#: a batch of m1 and m2 by a consumer that kept the entity as it saved m0 (stale:
#: another consumer processed m1 since), beside a consumer of m2
STALE_KEPT_BATCH = (Actor("batch", (1, 2), after=(0,)), Actor("process", (2,)))

SCENARIOS: dict[str, Case] = {
    "duplicates": Case((ONE, ONE), 1, None, {"inline": ALL, "deferred": ALL}),
    "two-messages": Case((ONE, OTHER), 2, None, {"inline": FAST, "deferred": ALL}),
    "duplicates+sweep": Case((ONE, ONE, SWEEP), 1, None, {"inline": FAST, "deferred": ALL}),
    "batch+duplicate": Case((BATCH, ONE), 2, None, {"inline": FAST, "deferred": ALL}),
    "crash-beside-duplicate": Case((ONE, ONE), 1, 0, {"inline": FAST, "deferred": ALL}),
    "crash-sweep": Case((ONE, SWEEP), 1, 1, {"inline": ALL, "deferred": ALL}),
    "crash-batch-beside-duplicate": Case(
        (BATCH, ONE), 2, 0, {"inline": IN_PROCESS, "deferred": FAST}
    ),
    "crash-beside-other-message": Case(
        (ONE, OTHER), 2, 0, {"inline": IN_PROCESS, "deferred": FAST}
    ),
    "kept-beside-duplicate": Case((KEPT, OTHER), 2, None, BOTH_FAST),
    "kept-beside-other": Case((KEPT, Actor("process", (2,))), 3, None, BOTH_FAST),
    "kept-batch-beside-duplicate": Case(
        (Actor("batch", (1, 2), after=(0,)), OTHER), 3, None, BOTH_FAST
    ),
    # the batch finds m1 recorded, so it reloads the entity: m2, unrecorded when it
    # asked, may have been applied and cleaned up before that load
    "stale-kept-batch-beside-other": Case(STALE_KEPT_BATCH, 3, None, BOTH_FAST, (1,)),
    "crash-kept-beside-duplicate": Case((KEPT, OTHER), 2, 0, BOTH_FAST),
    # the batch consumer keeps the entity and gets the crashed one's redelivery
    "crash-beside-batch": Case((ONE, BATCH_OTHER), 2, 0, {"inline": IN_PROCESS, "deferred": FAST}),
    # a run recorded in the entity (begin_attempt) beside a copy of the message, or a
    # batch; and crashed after any of its steps, the recorded run among them
    "retry-beside-duplicate": Case((RETRY, ONE), 1, None, BOTH_FAST),
    # (begin_attempt is a load and a save, the contract every backend passes: the
    # costlier schedules run on one in-process backend each; the soak runs it on all)
    "retry-beside-batch": Case(
        (RETRY, BATCH), 2, None, {"inline": ("memory",), "deferred": ("sqlite",)}
    ),
    "crash-retry-beside-duplicate": Case(
        (RETRY, ONE), 1, 0, {"inline": ("sqlite",), "deferred": ("memory",)}
    ),
}

#: Token mode adds four calls to a message's (the token read, the create, the made
#: marker, the delete) where the stores do not join (memory, Cosmos DB; folded into
#: the entity store's requests on the others), so its
#: schedules grow fast: every schedule of the scenarios below but the bounded ones, on
#: the backends listed.
TOKEN_SCENARIOS: dict[str, Case] = {
    "token-duplicates": Case(
        (ONE, ONE), 1, None, {"inline": IN_PROCESS, "deferred": FAST}, (), "all"
    ),
    # on the emulators (70-150 ms a schedule): the first 400 of its 1,302 schedules
    "token-duplicates-bounded": Case(
        (ONE, ONE), 1, None, {"inline": (), "deferred": ("dynamodb", "cosmos")}, (), "all", 400
    ),
    "token-crash-beside-duplicate": Case(
        (ONE, ONE), 1, 0, {"inline": ("memory",), "deferred": ("sqlite",)}, (), "all"
    ),
    "token-crash-sweep": Case((ONE, SWEEP), 1, 1, {"inline": ALL, "deferred": ALL}, (), "all"),
    "token-kept-beside-duplicate": Case(
        (KEPT, OTHER), 2, None, {"inline": ("memory",), "deferred": ("sqlite",)}, (), "all"
    ),
    "token-retry-beside-duplicate": Case(
        (RETRY, ONE), 1, None, {"inline": ("memory",), "deferred": ()}, (), "all"
    ),
    # one batch of a message with a token and one without, crashed after each call
    "hybrid-crash-batch": Case((BATCH,), 2, 0, {"inline": ALL, "deferred": ALL}, (), "hybrid"),
    "hybrid-crash-batch+sweep": Case(
        (BATCH, SWEEP), 2, 0, {"inline": FAST, "deferred": FAST}, (), "hybrid"
    ),
    # two consumers, one message with a token and one without: bounded (the first
    # 3,000 schedules of the depth-first order; all of them take tens of minutes)
    "hybrid-two-messages": Case(
        (ONE, OTHER), 2, None, {"inline": ("memory",), "deferred": ("memory",)}, (), "hybrid", 3000
    ),
}

#: every scenario, in retention mode and in token mode
EVERY_SCENARIO = {**SCENARIOS, **TOKEN_SCENARIOS}

CASES = [
    pytest.param(
        name,
        cleanup,
        backend,
        marks=getattr(pytest.mark, backend),
        id=f"{name}-{cleanup}-{backend}",
    )
    for name, case in EVERY_SCENARIO.items()
    for cleanup in MODES
    for backend in case.where[cleanup]
]


def _async_cases() -> list[Any]:
    """The async face: every scenario once, in one clean-up mode (alternating), on one
    backend of those the sync face runs it on there (rotating, so that every backend
    runs some): the same steps as the sync face, driven on an event loop."""
    cases = []
    turn = 0
    for index, (name, case) in enumerate(EVERY_SCENARIO.items()):
        modes = [m for m in (MODES[index % 2], MODES[1 - index % 2]) if case.where[m]]
        if not modes:
            continue
        cleanup = modes[0]
        where = case.where[cleanup]
        backend = where[turn % len(where)]
        turn += 1
        cases.append(
            pytest.param(
                name,
                cleanup,
                backend,
                marks=getattr(pytest.mark, backend),
                id=f"async-{name}-{cleanup}-{backend}",
            )
        )
    return cases


ASYNC_CASES = _async_cases()


@pytest.mark.parametrize(
    ("scenario", "cleanup", "outbox_backend"), CASES, indirect=["outbox_backend"]
)
@pytest.mark.timeout(1200)
def test_every_schedule_keeps_every_invariant(
    outbox_backend: OutboxBackend, cleanup: Literal["inline", "deferred"], scenario: str
) -> None:
    _explore_case(outbox_backend, cleanup, scenario, "sync")


@pytest.mark.parametrize(
    ("scenario", "cleanup", "outbox_backend"), ASYNC_CASES, indirect=["outbox_backend"]
)
@pytest.mark.timeout(1200)
def test_every_schedule_of_the_async_face_keeps_every_invariant(
    outbox_backend: OutboxBackend, cleanup: Literal["inline", "deferred"], scenario: str
) -> None:
    _explore_case(outbox_backend, cleanup, scenario, "async")


def test_the_async_face_runs_every_scenario_and_reaches_every_backend() -> None:
    names = {p.values[0] for p in ASYNC_CASES}
    assert names == set(EVERY_SCENARIO) - {
        n for n, c in EVERY_SCENARIO.items() if not any(c.where.values())
    }
    assert {p.values[2] for p in ASYNC_CASES} == set(ALL)


@pytest.mark.parametrize(
    "outbox_backend", backend_params(("redis", "postgres", "cosmos")), indirect=True
)
@pytest.mark.parametrize("scenario", ["duplicates", "token-crash-sweep"])
def test_the_async_face_explores_the_native_store_calls(
    outbox_backend: OutboxBackend, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a backend with an async driver, the async face's actors make their scheduled
    store calls as the store's own steps on their loops (the harness waits for the turn
    in a thread, then relays the call: ``_Turned.call_steps``), so the exploration checks
    the native calls, not a blocking stand-in: the async twin's requests are counted."""
    from dedupstore.backends.cosmos._aio import AsyncCosmosConnection
    from dedupstore.backends.postgres._aio import AsyncPostgresConnection
    from dedupstore.backends.redis._aio import AsyncRedisConnection

    twin = {
        "redis": AsyncRedisConnection,
        "postgres": AsyncPostgresConnection,
        "cosmos": AsyncCosmosConnection,
    }[outbox_backend.name]
    real = twin._bounded
    native = 0

    async def counted(self: Any, *args: Any) -> Any:
        nonlocal native
        native += 1
        return await real(self, *args)

    monkeypatch.setattr(twin, "_bounded", counted)
    cleanup = "deferred" if EVERY_SCENARIO[scenario].where["deferred"] else "inline"
    runs = _explore_case(outbox_backend, cleanup, scenario, "async", limit=20)
    assert native >= runs * 2, (native, runs)


def _explore_case(
    outbox_backend: OutboxBackend,
    cleanup: Literal["inline", "deferred"],
    scenario: str,
    face: Literal["sync", "async"],
    limit: int | None = None,
) -> int:
    """Explore the case's schedules (at most ``limit``, else the case's own limit) and
    return how many ran."""
    case = EVERY_SCENARIO[scenario]
    patient = outbox_patient(outbox_backend.name)  # (the harness checks the algorithm)
    runs = explore(
        case.scenario(cleanup),
        functools.partial(outbox_backend.entities, **patient),
        functools.partial(outbox_backend.dedup, **patient),
        crash_actor=case.crash,
        token_store=(
            functools.partial(outbox_backend.tokens, **patient) if case.tokens != "off" else None
        ),
        limit=case.limit if limit is None else limit,
        face=face,
    )
    assert runs >= 3, f"only {runs} schedules: the harness did not interleave"
    return runs


# ---------------------------------------------------------------------- broken variants


def _load_apply_save(
    processor: OutboxProcessor, message: Message, handler: Handler, *, check: bool
) -> tuple[Entity, list[Any] | None, bool]:
    """Steps 1-3, with or without the deduplication check after the load."""
    entity = processor.entities.load(message.correlation_id)
    if message.id in entity.outbox:
        return entity, entity.outbox[message.id], False
    if check and processor.dedup.has_been_processed(
        message_key(message.correlation_id, message.id)
    ):
        return entity, None, False
    outgoing, _ = run(processor._apply(entity, message, handler))
    return entity, outgoing, True


class CheckBeforeLoad(OutboxProcessor):
    """BROKEN: asks the deduplication store before loading the entity."""

    def process(self, message: Message, handler: Handler) -> ProcessResult:
        for _ in range(self.max_attempts):
            try:
                if self.dedup.has_been_processed(message_key(message.correlation_id, message.id)):
                    return ProcessResult(message.id, "duplicate")
                entity, outgoing, applied = _load_apply_save(self, message, handler, check=False)
                if applied:
                    self.entities.save(entity)
                if outgoing is not None:
                    self.dispatcher.dispatch(outgoing)
                run(self._clean_up(entity, message.id))
                return ProcessResult(message.id, "processed" if applied else "duplicate")
            except ConcurrencyConflict:
                continue
        raise ConcurrencyConflict("gave up")


class DispatchBeforeSave(OutboxProcessor):
    """BROKEN: dispatches the outgoing messages before the state change is saved."""

    def process(self, message: Message, handler: Handler) -> ProcessResult:
        for _ in range(self.max_attempts):
            try:
                entity, outgoing, applied = _load_apply_save(self, message, handler, check=True)
                if outgoing is None and message.id not in entity.outbox:
                    return ProcessResult(message.id, "duplicate")
                if outgoing is not None:
                    self.dispatcher.dispatch(outgoing)
                if applied:
                    self.entities.save(entity)
                run(self._clean_up(entity, message.id))
                return ProcessResult(message.id, "processed" if applied else "duplicate")
            except ConcurrencyConflict:
                continue
        raise ConcurrencyConflict("gave up")


class RemoveBeforeAdd(OutboxProcessor):
    """BROKEN: takes the id out of the outbox before it is in the deduplication store."""

    def _clean_up(self, entity: Entity, mid: str) -> Steps[None]:
        if self.cleanup == "inline":
            del entity.outbox[mid]
            self.entities.save(entity)
            self.dedup.add(mid)
        else:
            yield from super()._clean_up(entity, mid)


class _BlindSaves:
    """Saves whatever was stored since the load: the concurrency token is ignored."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def save(self, entity: Entity) -> Entity:
        entity.version = self._real.load(entity.id).version
        return self._real.save(entity)  # type: ignore[no-any-return]

    def save_many(self, entities: Sequence[Entity]) -> set[str]:
        for entity in entities:
            entity.version = self._real.load(entity.id).version
        return self._real.save_many(entities)  # type: ignore[no-any-return]


class SaveWithoutToken(OutboxProcessor):
    """BROKEN: saves without the concurrency token (last writer wins)."""

    def __init__(self, entities: EntityStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(_BlindSaves(entities), *args, **kwargs)  # type: ignore[arg-type]


class _ForgetfulAmong:
    """A deduplication store whose ``processed_among`` answers "none of them"."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def processed_among(self, ids: Any) -> set[str]:
        return set()


class BatchIgnoresTheStore(OutboxProcessor):
    """BROKEN: ``process_batch`` never learns which ids the store already holds."""

    def __init__(self, entities: EntityStore, dedup: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(entities, _ForgetfulAmong(dedup), *args, **kwargs)  # type: ignore[arg-type]


class _DispatchingSaves:
    """An entity store whose ``save_many`` dispatches the pending outboxes first."""

    def __init__(self, real: Any, dispatcher: Any) -> None:
        self._real, self._dispatcher = real, dispatcher

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def save_many(self, entities: Sequence[Entity]) -> set[str]:
        pending = [m for e in entities for entry in e.outbox.values() for m in entry or []]
        if pending:
            self._dispatcher.dispatch(pending)
        return self._real.save_many(entities)  # type: ignore[no-any-return]


class BatchDispatchBeforeSave(OutboxProcessor):
    """BROKEN: ``process_batch`` dispatches the new outgoing messages before saving them."""

    def __init__(self, entities: EntityStore, dedup: Any, dispatcher: Any, **kwargs: Any) -> None:
        super().__init__(_DispatchingSaves(entities, dispatcher), dedup, dispatcher, **kwargs)  # type: ignore[arg-type]


class DispatchAfterCleanUp(OutboxProcessor):
    """BROKEN: dispatches only once the clean-up removed the entry; right unless it crashes."""

    def __init__(self, entities: EntityStore, dedup: Any, dispatcher: Any, **kwargs: Any) -> None:
        self._held = Late(dispatcher)
        super().__init__(entities, dedup, self._held, **kwargs)

    def _clean_up(self, entity: Entity, mid: str) -> Steps[None]:
        yield from super()._clean_up(entity, mid)
        self._held.flush()


class _KeptUnchecked:
    """Joint calls made of the plain ones, but the save of a kept entity does not
    check the message's id."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _joined(self, dedup: Any) -> bool:
        return True

    def _load_checked(self, entity_id: str, dedup: Any, key: str) -> tuple[Entity, bool]:
        return self._real.load(entity_id), dedup.has_been_processed(key)

    def _save_checked(self, entity: Entity, dedup: Any, key: str) -> bool:
        self._real.save(entity)
        return False

    def _save_recording(self, entity: Entity, dedup: Any, key: str) -> None:
        dedup.add(key)
        self._real.save(entity)


class KeptEntityUnchecked(OutboxProcessor):
    """BROKEN: takes a message missing from the outbox of the entity it kept for a new one."""

    def __init__(self, entities: EntityStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(_KeptUnchecked(entities), *args, **kwargs)  # type: ignore[arg-type]


class StaleAnswers(OutboxProcessor):
    """BROKEN: a batch that reloads the stale entities it kept keeps the answers the
    deduplication store gave before that load (a message applied and cleaned up in
    between is applied again)."""

    def _recorded(
        self, messages: list[Message], entities: dict[str, Entity], taken: Any = ()
    ) -> Steps[tuple[list[str], set[str]]]:
        yield from ()
        pairs = [(m, message_key(m.correlation_id, m.id)) for m in messages]
        fresh = [k for m, k in pairs if m.id not in entities[m.correlation_id].outbox]
        already = self.dedup.processed_among(fresh) if fresh else set()
        stale = {m.correlation_id for m, k in pairs if k in already} & set(taken)
        if stale:
            entities.update(self.entities.load_many(sorted(stale)))
        return [k for _, k in pairs], already


class AttemptOverwrites(OutboxProcessor):
    """BROKEN: records a run by writing the entity it loaded under the token of a second
    load (a blind write): a copy applied in between is lost."""

    def begin_attempt(self, message: Message) -> int:
        cid, mid = message.correlation_id, message.id
        entity = self.entities.load(cid)
        if mid in entity.outbox or self.dedup.has_been_processed(message_key(cid, mid)):
            return 0
        entity.attempts[mid] = entity.attempts.get(mid, 0) + 1
        entity.consumer = self.consumer
        while True:
            entity.version = self.entities.load(cid).version
            try:
                self.entities.save(entity)
            except ConcurrencyConflict:
                continue
            return entity.attempts[mid]


class AttemptsKept(OutboxProcessor):
    """BROKEN: applying a message leaves its recorded runs in the entity (a later
    crash of another consumer would count against it)."""

    def _apply(self, entity: Entity, *args: Any, **kwargs: Any) -> Any:
        attempts = dict(entity.attempts)
        applied = yield from super()._apply(entity, *args, **kwargs)
        entity.attempts = attempts
        return applied


class Broken(NamedTuple):
    """A broken processor, a scenario its schedules break, the invariants reported."""

    processor: Callable[..., OutboxProcessor]
    scenario: Scenario
    invariants: set[str]


BROKEN = {
    "check-before-load": Broken(
        CheckBeforeLoad, Scenario((ONE, ONE), 1, "inline"), {"once", "honest-result"}
    ),
    "dispatch-before-save": Broken(
        DispatchBeforeSave, Scenario((ONE, ONE), 1, "deferred"), {"ghost"}
    ),
    "remove-before-add": Broken(
        RemoveBeforeAdd, Scenario((ONE, ONE), 1, "inline"), {"in-outbox-or-store"}
    ),
    "save-without-token": Broken(
        SaveWithoutToken, Scenario((ONE, OTHER), 2, "deferred"), {"once", "ghost"}
    ),
    "batch-ignores-the-store": Broken(
        BatchIgnoresTheStore, Scenario((BATCH, ONE), 2, "inline"), {"once"}
    ),
    "batch-dispatch-before-save": Broken(
        BatchDispatchBeforeSave, Scenario((BATCH, ONE), 2, "deferred"), {"ghost"}
    ),
    "kept-entity-unchecked": Broken(
        KeptEntityUnchecked, Scenario((KEPT_AGAIN, OTHER), 2, "inline"), {"once"}
    ),
    "stale-answers": Broken(
        StaleAnswers, Scenario(STALE_KEPT_BATCH, 3, "inline", earlier=(1,)), {"once"}
    ),
    "attempt-overwrites": Broken(
        AttemptOverwrites,
        Scenario((RETRY, ONE), 1, "deferred"),
        {"once", "honest-result", "in-outbox-or-store", "ghost"},
    ),
    "attempts-kept": Broken(AttemptsKept, Scenario((RETRY, ONE), 1, "inline"), {"settled"}),
}


class AsyncRemoveBeforeAdd(aio.AsyncOutboxProcessor):
    """BROKEN, on the async face: takes the id out of the outbox before it is in the
    deduplication store."""

    def _clean_up(self, entity: Entity, mid: str) -> Steps[None]:
        if self.cleanup != "inline":
            return (yield from super()._clean_up(entity, mid))
        del entity.outbox[mid]
        yield from io(self.entities.save, entity)
        yield from io(self.dedup.add, message_key(entity.id, mid))


class AsyncSendFirst(aio.AsyncOutboxProcessor):
    """BROKEN, on the async face: a batch dispatches its new outgoing messages before it
    saves them."""

    def _save_applied_many(
        self, changed: dict[str, Entity], entries: dict[str, tuple[Entity, str]]
    ) -> Steps[set[str]]:
        pending = [m for e, mid in entries.values() for m in e.outbox[mid] or ()]
        if pending:
            yield from io(self.dispatcher.dispatch, pending)
        return (yield from super()._save_applied_many(changed, entries))


ASYNC_BROKEN = {
    "remove-before-add": Broken(
        AsyncRemoveBeforeAdd, Scenario((ONE, ONE), 1, "inline"), {"in-outbox-or-store"}
    ),
    "batch-dispatch-before-save": Broken(
        AsyncSendFirst, Scenario((BATCH, ONE), 2, "deferred"), {"ghost"}
    ),
}


@pytest.mark.parametrize("outbox_backend", backend_params(("memory", "sqlite")), indirect=True)
@pytest.mark.parametrize(
    ("face", "variant"), [*(("sync", v) for v in BROKEN), *(("async", v) for v in ASYNC_BROKEN)]
)
def test_the_harness_catches_a_broken_processor(
    outbox_backend: OutboxBackend, face: Literal["sync", "async"], variant: str
) -> None:
    """ANTI-TEST: a broken variant of either face's processor is caught."""
    broken = (BROKEN if face == "sync" else ASYNC_BROKEN)[variant]
    with pytest.raises(InterleavingViolation) as caught:
        explore(
            broken.scenario,
            outbox_backend.entities,
            outbox_backend.dedup,
            processor=broken.processor,
            face=face,
        )
    violation = caught.value
    assert violation.invariant in broken.invariants, str(violation)
    assert violation.schedule and "schedule:" in str(violation)


class KeptHidesEntries(OutboxProcessor):
    """BROKEN: in a batch, a recorded message of a kept entity is a duplicate, the
    entity not loaded (its stored outbox may still hold the message's entry)."""

    def _recorded(
        self, messages: list[Message], entities: dict[str, Entity], taken: Any = ()
    ) -> Steps[tuple[list[str], set[str]]]:
        return (yield from super()._recorded(messages, entities))


class CrashOnly(NamedTuple):
    """A broken processor only a crash shows: every schedule without one is right."""

    processor: Callable[..., OutboxProcessor]
    actors: tuple[Actor, ...]
    messages: int
    invariant: str
    text: str  # a text of the report


CRASH_ONLY = {
    # a crash between the clean-up and the dispatch loses the outgoing message
    "dispatch-after-cleanup": CrashOnly(
        DispatchAfterCleanUp, (ONE, ONE), 1, "same-output", "never dispatched"
    ),
    # a consumer records its message's id and crashes before the save removing the
    # entry; the redelivery goes to the batch consumer that kept the entity from before
    "kept-hides-entries": CrashOnly(
        KeptHidesEntries, (ONE, BATCH_OTHER), 2, "settled", "crash-after"
    ),
}


@pytest.mark.parametrize("outbox_backend", backend_params(("memory", "sqlite")), indirect=True)
@pytest.mark.parametrize("variant", list(CRASH_ONLY))
def test_the_crashes_reach_a_bug_only_a_crash_shows(
    outbox_backend: OutboxBackend, variant: str
) -> None:
    broken = CRASH_ONLY[variant]
    scenario = Scenario(broken.actors, broken.messages, "inline")
    entities, dedup = outbox_backend.entities, outbox_backend.dedup
    assert explore(scenario, entities, dedup, processor=broken.processor) >= 3
    with pytest.raises(InterleavingViolation) as caught:
        explore(scenario, entities, dedup, processor=broken.processor, crash_actor=0)
    assert caught.value.invariant == broken.invariant, str(caught.value)
    assert broken.text in str(caught.value)


def test_reads_commute_and_writes_to_either_store_do_not() -> None:
    """The reduction only skips orders of calls that cannot change any check."""
    assert independent("load", "has") and independent("load", "add")
    assert independent("has", "save") and independent("dispatch", "add")
    assert not independent("load", "save") and not independent("has", "add")
    assert not independent("save", "add"), "a state the per-step checks see would be skipped"
    assert not independent("dispatch", "save"), "the ghost check reads the saved state"


# ---------------------------------------------------------------------- token mode


class RecreatesMadeTokens(OutboxProcessor):
    """BROKEN: before each dispatch, creates the made tokens again ("make sure they
    exist"): a copy that dispatches after a receiver consumed one brings it back."""

    def _make(self, pairs: Sequence[tuple[Entity, str]], alone: bool = False) -> Steps[set[str]]:
        conflicts = yield from super()._make(pairs, alone)
        again: dict[str, str] = {}
        for entity, mid in pairs:
            tokens = entity.tokens.get(mid)
            if tokens and tokens.made and entity.id not in conflicts and entity.outbox.get(mid):
                again.update(minted(entity, mid, tokens.made))
        if again and self.tokens is not None:
            self.tokens.create(again)
        return conflicts


class _BrokenJointLoad:
    """The joint calls of an entity store and a token store on one server, broken:
    ``"delete"`` deletes the token as soon as the load finds it; ``"early"`` reads it
    before it loads the entity (two requests). Either way the save of the applied entry
    trusts that read instead of checking the token again (as the unfolded path does)."""

    def __init__(self, real: Any, how: Literal["delete", "early"]) -> None:
        self._real, self._how = real, how

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _load_tokened(self, entity_id: str, tokens: Any, token_id: str) -> tuple[Entity, bool]:
        if self._how == "early":
            present = bool(tokens.present_among([token_id]))
            return self._real.load(entity_id), present
        entity, present = self._real._load_tokened(entity_id, tokens, token_id)
        if present:
            tokens.delete([token_id])
        return entity, present

    def _save_tokened(
        self, entities: Sequence[Entity], tokens: Any, changes: Mapping[str, TokenChange]
    ) -> tuple[set[str], set[str]]:
        trusted = {eid: change._replace(require=None) for eid, change in changes.items()}
        return self._real._save_tokened(entities, tokens, trusted)  # type: ignore[no-any-return]


class DeletesTokenFirst(OutboxProcessor):
    """BROKEN: deletes the incoming token as soon as it found it, before its change
    and outputs are saved (a crash then loses the message)."""

    def __init__(self, entities: EntityStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(_BrokenJointLoad(entities, "delete"), *args, **kwargs)  # type: ignore[arg-type]

    def _recorded_by_token(self, tokens: Mapping[str, str]) -> Steps[set[str]]:
        missing = yield from super()._recorded_by_token(tokens)
        present = [t for k, t in tokens.items() if k not in missing]
        if present and self.tokens is not None:
            self.tokens.delete(present)
        return missing


class ReadsTokenBeforeLoad(OutboxProcessor):
    """BROKEN: reads the incoming token before it loads the entity (a copy that
    finishes in between leaves it a token it saw present and an outbox without
    the entry)."""

    early: set[str] | None = None

    def __init__(self, entities: EntityStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(_BrokenJointLoad(entities, "early"), *args, **kwargs)  # type: ignore[arg-type]

    def process(self, message: Message, handler: Handler) -> ProcessResult:
        token = self._token_of(message)
        key = message_key(message.correlation_id, message.id)
        self.early = None if token is None else run(super()._recorded_by_token({key: token}))
        return super().process(message, handler)

    def _recorded_by_token(self, tokens: Mapping[str, str]) -> Steps[set[str]]:
        if self.early is not None:
            return self.early
        return (yield from super()._recorded_by_token(tokens))


def _shared_token_id(message_id: str, endpoint: str, nonce: str) -> str:
    """BROKEN: one token per message, whoever receives it."""
    return _token_id(message_id, "everyone", nonce)


_token_id = tokens_module.token_id


class TokenBroken(NamedTuple):
    """A broken token-mode processor, its scenario, the invariants reported, and
    whether only a crash of actor 0 shows it."""

    processor: Callable[..., OutboxProcessor]
    scenario: Scenario
    invariants: set[str]
    crash: int | None = None


TOKEN_BROKEN = {
    "token-created-again-after-dispatch": TokenBroken(
        RecreatesMadeTokens, Scenario((ONE, ONE), 1, "inline", tokens="all"), {"recreated"}
    ),
    "token-deleted-before-dispatch": TokenBroken(
        DeletesTokenFirst, Scenario((ONE, ONE), 1, "inline", tokens="all"), {"once"}, crash=0
    ),
    "token-read-before-load": TokenBroken(
        ReadsTokenBeforeLoad,
        Scenario((ONE, ONE), 1, "inline", tokens="all"),
        {"once", "honest-result"},
    ),
    "one-token-shared-by-two-receivers": TokenBroken(
        OutboxProcessor,
        Scenario((ONE, ONE), 1, "inline", tokens="all"),
        {"token-before-dispatch"},
    ),
}


@pytest.mark.parametrize("outbox_backend", backend_params(("memory", "sqlite")), indirect=True)
@pytest.mark.parametrize("variant", list(TOKEN_BROKEN))
def test_the_harness_catches_a_broken_token_mode(
    outbox_backend: OutboxBackend, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = TOKEN_BROKEN[variant]
    if variant == "one-token-shared-by-two-receivers":  # senders and receivers alike
        monkeypatch.setattr(tokens_module, "token_id", _shared_token_id)
        monkeypatch.setattr(tokened_module, "token_id", _shared_token_id)
    explored = functools.partial(
        explore,
        broken.scenario,
        outbox_backend.entities,
        outbox_backend.dedup,
        processor=broken.processor,
        token_store=outbox_backend.tokens,
    )
    if broken.crash is not None:  # right unless it crashes
        assert explored(limit=300) >= 3
    with pytest.raises(InterleavingViolation) as caught:
        explored(crash_actor=broken.crash)
    assert caught.value.invariant in broken.invariants, str(caught.value)
