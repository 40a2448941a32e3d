"""dedupstore for asyncio: the same algorithm, stores, options, errors and guarantees
as the sync API, awaited.

::

    from dedupstore import aio

    entities = await aio.open_entity_store("redis://localhost:6379/0")
    dedup = await aio.open_store("redis://localhost:6379/0", endpoint="billing")
    processor = aio.AsyncOutboxProcessor(entities, dedup, my_async_dispatcher)
    result = await processor.process(message, handler)  # handler: def or async def

The algorithm is written once (:mod:`dedupstore.steps`): :class:`AsyncOutboxProcessor`
drives the very steps :class:`~dedupstore.outbox.OutboxProcessor` drives. The guide's
"asyncio" page says how each backend's calls run.
"""

from __future__ import annotations

from dedupstore.aio.consumer import AsyncBroker, AsyncConsumer, OffloadedBroker, open_broker
from dedupstore.aio.processor import (
    AsyncBeforeCleanup,
    AsyncHandler,
    AsyncOutboxProcessor,
    applied_among,
    recorded_among,
    sweep,
)
from dedupstore.aio.stores import (
    AsyncClient,
    AsyncDeduplicationStore,
    AsyncDispatcher,
    AsyncEntityStore,
    AsyncTokenStore,
    open_dispatcher,
    open_entity_store,
    open_store,
    open_token_store,
)
from dedupstore.consumers._loop import ConsumeStats

__all__ = [
    "AsyncBeforeCleanup",
    "AsyncBroker",
    "AsyncClient",
    "AsyncConsumer",
    "AsyncDeduplicationStore",
    "AsyncDispatcher",
    "AsyncEntityStore",
    "AsyncHandler",
    "AsyncOutboxProcessor",
    "AsyncTokenStore",
    "ConsumeStats",
    "OffloadedBroker",
    "applied_among",
    "open_broker",
    "open_dispatcher",
    "open_entity_store",
    "open_store",
    "open_token_store",
    "recorded_among",
    "sweep",
]
