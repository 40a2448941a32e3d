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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import pytest

from dedupstore.entities import Entity, EntityStore
from dedupstore.errors import ConcurrencyConflict
from dedupstore.outbox import Handler, Message, OutboxProcessor, ProcessResult, message_key
from dedupstore.testing.interleavings import (
    Actor,
    InterleavingViolation,
    Scenario,
    explore,
    independent,
)
from tests.consume_worker import Late
from tests.outbox_backends import OutboxBackend, backend_params

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
MODES = ("inline", "deferred")

IN_PROCESS = ("memory", "sqlite")
FAST = (*IN_PROCESS, "postgres", "redis")
ALL = (*FAST, "dynamodb", "cosmos")

#: name -> (actors, messages, which actor crashes or None, backends per clean-up mode)
SCENARIOS: dict[str, tuple[tuple[Actor, ...], int, int | None, dict[str, tuple[str, ...]]]] = {
    "duplicates": ((ONE, ONE), 1, None, {"inline": ALL, "deferred": ALL}),
    "two-messages": ((ONE, OTHER), 2, None, {"inline": FAST, "deferred": ALL}),
    "duplicates+sweep": ((ONE, ONE, SWEEP), 1, None, {"inline": FAST, "deferred": ALL}),
    "batch+duplicate": ((BATCH, ONE), 2, None, {"inline": FAST, "deferred": ALL}),
    "crash-beside-duplicate": ((ONE, ONE), 1, 0, {"inline": FAST, "deferred": ALL}),
    "crash-sweep": ((ONE, SWEEP), 1, 1, {"inline": ALL, "deferred": ALL}),
    "crash-batch-beside-duplicate": ((BATCH, ONE), 2, 0, {"inline": IN_PROCESS, "deferred": FAST}),
    "crash-beside-other-message": ((ONE, OTHER), 2, 0, {"inline": IN_PROCESS, "deferred": FAST}),
    "kept-beside-duplicate": ((KEPT, OTHER), 2, None, {"inline": FAST, "deferred": FAST}),
    "kept-beside-other": (
        (KEPT, Actor("process", (2,))),
        3,
        None,
        {"inline": FAST, "deferred": FAST},
    ),
    "kept-batch-beside-duplicate": (
        (Actor("batch", (1, 2), after=(0,)), OTHER),
        3,
        None,
        {"inline": FAST, "deferred": FAST},
    ),
    "crash-kept-beside-duplicate": ((KEPT, OTHER), 2, 0, {"inline": FAST, "deferred": FAST}),
    # the batch consumer keeps the entity and gets the crashed one's redelivery
    "crash-beside-batch": ((ONE, BATCH_OTHER), 2, 0, {"inline": IN_PROCESS, "deferred": FAST}),
}

CASES = [
    pytest.param(
        name,
        cleanup,
        backend,
        marks=getattr(pytest.mark, backend),
        id=f"{name}-{cleanup}-{backend}",
    )
    for name, (_, _, _, where) in SCENARIOS.items()
    for cleanup in MODES
    for backend in where[cleanup]
]


@pytest.mark.parametrize(
    ("scenario", "cleanup", "outbox_backend"), CASES, indirect=["outbox_backend"]
)
@pytest.mark.timeout(1200)
def test_every_schedule_keeps_every_invariant(
    outbox_backend: OutboxBackend, cleanup: Literal["inline", "deferred"], scenario: str
) -> None:
    actors, messages, crash, _ = SCENARIOS[scenario]
    runs = explore(
        Scenario(actors, messages, cleanup),
        outbox_backend.entities,
        outbox_backend.dedup,
        crash_actor=crash,
    )
    assert runs >= 3, f"only {runs} schedules: the harness did not interleave"


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
    outgoing, _ = processor._apply(entity, message, handler)
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
                self._clean_up(entity, message.id)
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
                self._clean_up(entity, message.id)
                return ProcessResult(message.id, "processed" if applied else "duplicate")
            except ConcurrencyConflict:
                continue
        raise ConcurrencyConflict("gave up")


class RemoveBeforeAdd(OutboxProcessor):
    """BROKEN: takes the id out of the outbox before it is in the deduplication store."""

    def _clean_up(self, entity: Entity, mid: str) -> None:
        if self.cleanup == "inline":
            del entity.outbox[mid]
            self.entities.save(entity)
            self.dedup.add(mid)
        else:
            super()._clean_up(entity, mid)


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
        super().__init__(entities, _ForgetfulAmong(dedup), *args, **kwargs)


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
        super().__init__(entities, dedup, self._held, **kwargs)  # type: ignore[arg-type]

    def _clean_up(self, entity: Entity, mid: str) -> None:
        super()._clean_up(entity, mid)
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


BROKEN = {
    "check-before-load": (CheckBeforeLoad, (ONE, ONE), 1, "inline", {"once", "honest-result"}),
    "dispatch-before-save": (DispatchBeforeSave, (ONE, ONE), 1, "deferred", {"ghost"}),
    "remove-before-add": (RemoveBeforeAdd, (ONE, ONE), 1, "inline", {"in-outbox-or-store"}),
    "save-without-token": (SaveWithoutToken, (ONE, OTHER), 2, "deferred", {"once", "ghost"}),
    "batch-ignores-the-store": (BatchIgnoresTheStore, (BATCH, ONE), 2, "inline", {"once"}),
    "batch-dispatch-before-save": (BatchDispatchBeforeSave, (BATCH, ONE), 2, "deferred", {"ghost"}),
    "kept-entity-unchecked": (KeptEntityUnchecked, (KEPT_AGAIN, OTHER), 2, "inline", {"once"}),
}


@pytest.mark.parametrize("outbox_backend", backend_params(("memory", "sqlite")), indirect=True)
@pytest.mark.parametrize("variant", list(BROKEN))
def test_the_harness_catches_a_broken_processor(
    outbox_backend: OutboxBackend, variant: str
) -> None:
    processor, actors, messages, cleanup, invariants = BROKEN[variant]
    with pytest.raises(InterleavingViolation) as caught:
        explore(
            Scenario(actors, messages, cleanup),  # type: ignore[arg-type]
            outbox_backend.entities,
            outbox_backend.dedup,
            processor=processor,
        )
    violation = caught.value
    assert violation.invariant in invariants, str(violation)
    assert violation.schedule and "schedule:" in str(violation)


class KeptHidesEntries(OutboxProcessor):
    """BROKEN: in a batch, a recorded message of a kept entity is a duplicate, the
    entity not loaded (its stored outbox may still hold the message's entry)."""

    def _recorded(
        self, messages: list[Message], entities: dict[str, Entity], taken: Any = ()
    ) -> tuple[list[str], set[str]]:
        return super()._recorded(messages, entities)


#: Broken variants only a crash shows: every schedule without one is right.
#: name -> (processor, actors, messages, the invariant reported, a text of the report)
CRASH_ONLY = {
    # a crash between the clean-up and the dispatch loses the outgoing message
    "dispatch-after-cleanup": (
        DispatchAfterCleanUp,
        (ONE, ONE),
        1,
        "same-output",
        "never dispatched",
    ),
    # a consumer records its message's id and crashes before the save removing the
    # entry; the redelivery goes to the batch consumer that kept the entity from before
    "kept-hides-entries": (KeptHidesEntries, (ONE, BATCH_OTHER), 2, "settled", "crash-after"),
}


@pytest.mark.parametrize("outbox_backend", backend_params(("memory", "sqlite")), indirect=True)
@pytest.mark.parametrize("variant", list(CRASH_ONLY))
def test_the_crashes_reach_a_bug_only_a_crash_shows(
    outbox_backend: OutboxBackend, variant: str
) -> None:
    factory, actors, messages, invariant, text = CRASH_ONLY[variant]
    scenario = Scenario(actors, messages, "inline")  # type: ignore[arg-type]
    entities, dedup = outbox_backend.entities, outbox_backend.dedup
    assert explore(scenario, entities, dedup, processor=factory) >= 3  # type: ignore[arg-type]
    with pytest.raises(InterleavingViolation) as caught:
        explore(scenario, entities, dedup, processor=factory, crash_actor=0)  # type: ignore[arg-type]
    assert caught.value.invariant == invariant, str(caught.value)
    assert text in str(caught.value)


def test_reads_commute_and_writes_to_either_store_do_not() -> None:
    """The reduction only skips orders of calls that cannot change any check."""
    assert independent("load", "has") and independent("load", "add")
    assert independent("has", "save") and independent("dispatch", "add")
    assert not independent("load", "save") and not independent("has", "add")
    assert not independent("save", "add"), "a state the per-step checks see would be skipped"
    assert not independent("dispatch", "save"), "the ghost check reads the saved state"
