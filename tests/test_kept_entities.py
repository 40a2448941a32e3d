"""A kept entity never hides an outbox entry from the consumer that kept it.

The processor keeps the entities it saved last and uses each one in place of a
load: a save under the kept version is refused if anyone saved the entity since.
A message found recorded in the deduplication store saves nothing, so nothing
checks the kept copy. Found with the RabbitMQ chaos test: a consumer records the
ids of a batch (``add_many``), is killed before the save that removes their entries,
and the redelivery reaches a consumer that kept the entity from before; it answered
``duplicate`` and acknowledged, and the entry stayed pending in the stored outbox
(a sweep without ``redispatch`` never empties it). A recorded message of a kept
entity is now looked up in a fresh load: its entry, if still there, is dispatched
again (same ids) and cleaned up.
"""

from __future__ import annotations

from typing import Any

import pytest

from dedupstore.entities import EntityStore
from dedupstore.ids import message_key, outgoing_id
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, sweep
from tests.outbox_backends import OutboxBackend, backend_params


def counter(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Counts the messages; one outgoing message each."""
    n = state.get("n", 0) + 1
    return {"n": n}, [Send("out", {"n": n, "mid": message.id})]


class Crash(Exception):
    """Injected: the consumer dies here."""


class CrashOnSave:
    """An entity store whose ``save_many``/``save`` number ``at`` (1-based) crashes
    before it writes anything."""

    def __init__(self, real: EntityStore, at: int) -> None:
        self._real, self._at, self._saves = real, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _count(self) -> None:
        self._saves += 1
        if self._saves == self._at:
            raise Crash(f"save {self._at}")

    def save(self, entity: Any) -> Any:
        self._count()
        return self._real.save(entity)

    def save_many(self, entities: Any) -> Any:
        self._count()
        return self._real.save_many(entities)


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
@pytest.mark.parametrize("mode", ["process", "batch"])
def test_a_recorded_message_of_a_kept_entity_is_looked_up_in_a_fresh_load(
    outbox_backend: OutboxBackend, mode: str
) -> None:
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    sent = InMemoryDispatcher()
    try:
        keeper = OutboxProcessor(entities, dedup, sent)
        assert keeper.process(Message("m0", "e", {}), counter).outcome == "processed"  # kept
        # another consumer applies m1, dispatches, records its id, and dies before
        # the save that removes its entry (the second save: the first saved the change)
        crashing = OutboxProcessor(CrashOnSave(entities, at=2), dedup, InMemoryDispatcher())  # type: ignore[arg-type]
        with pytest.raises(Crash):
            crashing.process_batch([Message("m1", "e", {})], counter)
        assert dedup.has_been_processed(message_key("e", "m1"))
        assert entities.load("e").pending == ["m1"]
        # m1 is redelivered to the consumer that kept "e" as it was before m1
        m1 = Message("m1", "e", {})
        if mode == "process":
            result = keeper.process(m1, counter)
        else:
            (result,) = keeper.process_batch([m1], counter)
        assert result.outcome == "redispatched"
        assert [m.id for m in sent.sent][-1] == outgoing_id(keeper.consumer, "e", "m1", 0)
        stored = entities.load("e")
        assert stored.outbox == {} and stored.state == {"n": 2}
        assert sweep(entities, dedup).ids_left == 0
        # and a duplicate whose entry is gone is still a duplicate, applied once
        assert keeper.process(m1, counter).outcome == "duplicate"
        (again,) = keeper.process_batch([Message("m0", "e", {})], counter)
        assert again.outcome == "duplicate"
        assert entities.load("e").state == {"n": 2}
    finally:
        entities.close()
        dedup.close()


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
def test_a_batch_asks_again_for_what_the_stale_kept_outbox_held(
    outbox_backend: OutboxBackend,
) -> None:
    """Deferred: the kept entity holds m1 as dispatched, a sweep has since moved it
    to the store. A batch of m1 and m2 (recorded since, by another consumer and the
    sweep) loads the entity for m2 and must then ask the store about m1, which the
    kept outbox had answered for: it is a duplicate, not applied again."""
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    try:
        keeper = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        for mid in ("m0", "m1"):
            assert keeper.process(Message(mid, "e", {}), counter).outcome == "processed"
        other = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        assert other.process(Message("m2", "e", {}), counter).outcome == "processed"
        assert sweep(entities, dedup).ids_moved == 3
        batch = [Message("m1", "e", {}), Message("m2", "e", {})]
        results = keeper.process_batch(batch, counter)
        assert [r.outcome for r in results] == ["duplicate", "duplicate"]
        assert entities.load("e").state == {"n": 3}
    finally:
        entities.close()
        dedup.close()
