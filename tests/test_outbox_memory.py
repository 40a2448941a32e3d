"""The entity store contract and the outbox processor on the in-process backend."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, sweep
from dedupstore.testing.entities import EntityStoreContract, EntityStoreFactory

pytestmark = pytest.mark.memory


class TestMemoryEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self) -> EntityStoreFactory:
        url = f"memory://{uuid.uuid4().hex}"
        return lambda **options: MemoryEntityStore(url, **options)


def order_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Adds an item; the first item also announces "first item added" (seed 000)."""
    items = [*state.get("items", []), message.body]
    sends = [Send("shipping", {"item_added": message.body, "count": len(items)})]
    if len(items) == 1:
        sends.append(Send("billing", {"first_item_added": message.body}))
    return {"items": items, "applied": [*state.get("applied", []), message.id]}, sends


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
    assert dedup.processed_among([m.id for m in messages]) == {m.id for m in messages}
    ids = [m.id for m in dispatcher.sent]
    assert len(set(ids)) == 12 + 3  # one shipping event each, one billing event per order
