"""The stores and dispatchers of the async API, opened by the same URLs and options as
the sync ones (:func:`open_store`, :func:`open_entity_store`, :func:`open_token_store`,
:func:`open_dispatcher`).

Each wraps the sync client of its URL (:attr:`~AsyncClient.sync`): the same key layout,
the same options, errors, deadlines and guarantees, because it is the same client.

* **Native.** The deduplication and entity stores' calls are the sync store's steps
  (:mod:`dedupstore.steps`), awaited: where the backend writes a primitive as steps and
  has an async driver (Redis: ``redis.asyncio``), its driver calls are awaited on the
  loop, on the async twin of the store's connection (:meth:`Connection.async_twin
  <dedupstore.client.Connection.async_twin>`), each within the call's deadline
  (``asyncio.timeout``). A task cancelled in the middle of such a call stops at once;
  the write may or may not have landed, as with a lost answer, and the store's write
  tokens make a retry of the same ids on the same object report it as recorded by it.
* **Offloaded.** Every other call runs in the async face's threads
  (:func:`dedupstore.steps.offload`); a call whose task is cancelled waits for the call
  in flight to end (within the call's own deadline) before ``CancelledError`` reaches
  the caller, so it never leaves a write running behind the caller's back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Generic, TypeVar

import dedupstore
from dedupstore.client import Client
from dedupstore.dispatch import URLDispatcher
from dedupstore.entities import Entity, EntityStore
from dedupstore.steps import arun, offload
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenCount, TokenRecord, TokenStore

__all__ = [
    "AsyncClient",
    "AsyncDeduplicationStore",
    "AsyncDispatcher",
    "AsyncEntityStore",
    "AsyncTokenStore",
    "open_dispatcher",
    "open_entity_store",
    "open_store",
    "open_token_store",
]

S = TypeVar("S", bound=Client)
T = TypeVar("T")


class AsyncClient(Generic[S]):
    """What every async store and dispatcher has: its sync client, its URL, ``close``
    and ``async with``."""

    def __init__(self, sync: S) -> None:
        """Wrap ``sync``, an open client of the sync API (no I/O)."""
        self.sync = sync

    @property
    def url(self) -> str:
        """The client's URL, its secrets masked."""
        return self.sync.url

    def option(self, name: str) -> Any:
        """The value of the option ``name`` (converted)."""
        return self.sync.option(name)

    async def health_warnings(self) -> list[str]:
        """What the sync client's ``health_warnings`` reports (a configuration that
        weakens a guarantee). Raises ``StoreClosed``, ``StoreUnavailable``."""
        return await offload(self.sync.health_warnings)

    async def close(self) -> None:
        """Release what the client holds: its async connection on this loop (where the
        backend has one), and its connection when it was the last."""
        try:
            await self.sync.close_async_twins()
        finally:
            await offload(self.sync.close)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.sync.closed

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sync!r})"


async def _each(scan: Iterator[T]) -> AsyncIterator[T]:
    """The items of ``scan`` (a sync iterator that reads pages), each read in a thread."""
    while True:
        item = await offload(next, scan, None)
        if item is None:
            return
        yield item


class AsyncDeduplicationStore(AsyncClient[DeduplicationStore]):
    """:class:`~dedupstore.store.DeduplicationStore`'s calls, awaited: the same guarantees and
    errors, method for method; native where the backend's driver is (see the module)."""

    @property
    def endpoint(self) -> str:
        """The consumer name records are keyed under."""
        return self.sync.endpoint

    @property
    def retention(self) -> timedelta | None:
        """How long a record counts as processed; ``None`` means forever."""
        return self.sync.retention

    async def add(self, message_id: str) -> bool:
        """:meth:`DeduplicationStore.add <dedupstore.store.DeduplicationStore.add>`."""
        return await arun(self.sync._add_steps(message_id))

    async def add_many(self, message_ids: Iterable[str]) -> set[str]:
        """:meth:`DeduplicationStore.add_many <dedupstore.store.DeduplicationStore.add_many>`."""
        return await arun(self.sync._add_many_steps(message_ids))

    async def has_been_processed(self, message_id: str) -> bool:
        """:meth:`DeduplicationStore.has_been_processed
        <dedupstore.store.DeduplicationStore.has_been_processed>`."""
        return await arun(self.sync._has_been_processed_steps(message_id))

    async def processed_among(self, message_ids: Iterable[str]) -> set[str]:
        """:meth:`DeduplicationStore.processed_among
        <dedupstore.store.DeduplicationStore.processed_among>`."""
        return await arun(self.sync._processed_among_steps(message_ids))

    async def count(self) -> int | None:
        """:meth:`DeduplicationStore.count <dedupstore.store.DeduplicationStore.count>`."""
        return await offload(self.sync.count)

    async def endpoints(self) -> set[str] | None:
        """:meth:`DeduplicationStore.endpoints <dedupstore.store.DeduplicationStore.endpoints>`."""
        return await offload(self.sync.endpoints)

    async def purge_expired(self) -> int:
        """:meth:`DeduplicationStore.purge_expired
        <dedupstore.store.DeduplicationStore.purge_expired>`."""
        return await offload(self.sync.purge_expired)


class AsyncEntityStore(AsyncClient[EntityStore]):
    """:class:`~dedupstore.entities.EntityStore`'s calls, awaited: the same guarantees
    and errors, method for method; native where the backend's driver is (see the module)."""

    @property
    def max_entity_bytes(self) -> int:
        """The largest entity record (bytes of canonical JSON) the store holds."""
        return self.sync.max_entity_bytes

    async def load(self, entity_id: str) -> Entity:
        """:meth:`EntityStore.load <dedupstore.entities.EntityStore.load>`."""
        return await arun(self.sync._load_steps(entity_id))

    async def load_many(self, entity_ids: Iterable[str]) -> dict[str, Entity]:
        """:meth:`EntityStore.load_many <dedupstore.entities.EntityStore.load_many>`."""
        return await arun(self.sync._load_many_steps(entity_ids))

    async def save(self, entity: Entity) -> Entity:
        """:meth:`EntityStore.save <dedupstore.entities.EntityStore.save>`."""
        return await arun(self.sync._save_steps(entity))

    async def save_many(self, entities: Sequence[Entity]) -> set[str]:
        """:meth:`EntityStore.save_many <dedupstore.entities.EntityStore.save_many>`."""
        return await arun(self.sync._save_many_steps(entities))

    def pending_outboxes(self, segment: int = 0, segments: int = 1) -> AsyncIterator[Entity]:
        """:meth:`EntityStore.pending_outboxes
        <dedupstore.entities.EntityStore.pending_outboxes>`, page by page:
        ``async for entity in store.pending_outboxes()``."""
        return _each(self.sync.pending_outboxes(segment, segments))


class AsyncTokenStore(AsyncClient[TokenStore]):
    """:class:`~dedupstore.tokens.TokenStore`'s calls, awaited: the same guarantees and
    errors, method for method."""

    async def create(self, tokens: Mapping[str, str]) -> None:
        """:meth:`TokenStore.create <dedupstore.tokens.TokenStore.create>`."""
        await arun(self.sync._create_steps(tokens))

    async def present(self, token_id: str) -> bool:
        """:meth:`TokenStore.present <dedupstore.tokens.TokenStore.present>`."""
        return bool(await arun(self.sync._present_among_steps([token_id])))

    async def present_among(self, token_ids: Iterable[str]) -> set[str]:
        """:meth:`TokenStore.present_among <dedupstore.tokens.TokenStore.present_among>`."""
        return await arun(self.sync._present_among_steps(token_ids))

    async def delete(self, token_ids: Iterable[str]) -> None:
        """:meth:`TokenStore.delete <dedupstore.tokens.TokenStore.delete>`."""
        await arun(self.sync._delete_steps(token_ids))

    async def outstanding(self) -> dict[str, TokenCount]:
        """:meth:`TokenStore.outstanding <dedupstore.tokens.TokenStore.outstanding>`."""
        return await offload(self.sync.outstanding)

    def scan(
        self, *, endpoint: str | None = None, created_before: float | None = None
    ) -> AsyncIterator[TokenRecord]:
        """:meth:`TokenStore.scan <dedupstore.tokens.TokenStore.scan>`, page by page:
        ``async for record in tokens.scan()``; its arguments checked at the call."""
        return _each(self.sync.scan(endpoint=endpoint, created_before=created_before))


class AsyncDispatcher(AsyncClient[URLDispatcher]):
    """A dispatcher opened by URL (:func:`open_dispatcher`), awaited: the same
    guarantees and errors as its sync dispatcher."""

    @property
    def max_message_bytes(self) -> int | None:
        """The largest message body the destination takes (None: no bound)."""
        return self.sync.max_message_bytes

    @property
    def max_header_bytes(self) -> int | None:
        """The largest headers the destination takes (None: no bound)."""
        return self.sync.max_header_bytes

    async def dispatch(self, messages: Sequence[Any]) -> None:
        """Send ``messages`` (outgoing messages); as the sync dispatcher's ``dispatch``."""
        await offload(self.sync.dispatch, messages)


async def open_store(url: str | None = None, **options: Any) -> AsyncDeduplicationStore:
    """:func:`dedupstore.open_store`, awaited: the same URLs, options and errors."""
    return AsyncDeduplicationStore(await offload(dedupstore.open_store, url, **options))


async def open_entity_store(url: str | None = None, **options: Any) -> AsyncEntityStore:
    """:func:`dedupstore.open_entity_store`, awaited: the same URLs, options and errors."""
    return AsyncEntityStore(await offload(dedupstore.open_entity_store, url, **options))


async def open_token_store(url: str, /, **options: Any) -> AsyncTokenStore:
    """:func:`dedupstore.open_token_store`, awaited: the same URLs, options and errors."""
    return AsyncTokenStore(await offload(dedupstore.open_token_store, url, **options))


async def open_dispatcher(url: str, /, **options: Any) -> AsyncDispatcher:
    """:func:`dedupstore.open_dispatcher` of a URL, awaited: the same URLs, options and
    errors. (A dispatcher of your own needs no opening: give the processor any object
    with a ``dispatch(messages)`` method, ``async def`` or not.)"""
    return AsyncDispatcher(await offload(dedupstore.open_dispatcher, url, **options))
