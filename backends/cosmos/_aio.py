"""The ``azure.cosmos.aio`` twin of :class:`~._client.CosmosConnection`:
:class:`AsyncCosmosConnection`, for the async face's Cosmos DB stores.

The same account settings (:func:`~._client.client_settings`: key, TLS, consistency, timeouts,
retries, endpoint discovery, compact UTF-8 writes), the same error rules
(``CosmosConnection.classify_error``: ``azure.cosmos.aio`` raises the same azure-core and Cosmos
exceptions) and the same method names and answers as the sync connection for what the stores'
primitives call (``read_many``, ``write``, ``container``), awaited, so that the primitives written
as steps (:mod:`dedupstore.steps`) run natively on the async face
(:meth:`CosmosConnection.async_twin <._client.CosmosConnection.async_twin>`). The token store's
calls and the maintenance calls (purge, count, scan) stay blocking: they run in the async face's
threads on the sync connection.

Transport: aiohttp (azure-core's ``AioHttpTransport``), a pool of :data:`ASYNC_POOL_SIZE`
connections (or ``max_concurrency + 4``, the sync pool's size, when larger), made on the running
loop at the first call (no I/O before: the account is read then, as the sync client reads it when
made). A reply is checked as the sync transport checks it (:func:`dedupstore.replies.cut_short`):
aiohttp reads a body up to its ``Content-Length`` and fails on a shorter one itself; the check
adds a reply without one (cut inside its headers).

Deadline: every request goes through :meth:`AsyncCosmosConnection._bounded`, which awaits it (and
the client's opening, at the first call) within the time left of the call's deadline
(``asyncio.timeout``): the SDK's attempts, their pauses and its throttling waits included, so a
call ends within ``connect_timeout + (retries + 1) x timeout`` (the sync connection lets a
throttling service's ``retry-after`` waits extend it). Past it: ``DeadlinePassed`` (a
``TimeoutError``: ``StoreUnavailable``). The SDK's own per-attempt timeouts (``connect_timeout``,
``timeout``) apply inside it as on the sync face.

One difference with the sync SDK, harmless here: ``azure.cosmos.aio`` resends a write after a
connection error even when the request may have reached the service (aiohttp's
``ServerDisconnectedError``); the stores settle such a resend by their write tokens, as they settle
a retry after ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

import aiohttp
from azure.core.exceptions import ServiceRequestError, ServiceResponseError
from azure.core.pipeline.transport import AioHttpTransport
from azure.cosmos.aio import CosmosClient
from azure.cosmos.exceptions import CosmosHttpResponseError

from dedupstore.backend import Client, DeadlinePassed, Options, StoreURL, cut_short, time_left

from ._client import (
    _names,
    account_key,
    client_settings,
    creation_error,
    endpoint_of,
    if_unchanged,
    refused_status,
    written,
)

if TYPE_CHECKING:
    from azure.cosmos.aio import ContainerProxy

__all__ = ["ASYNC_POOL_SIZE", "AsyncCosmosConnection"]

#: Connections of one async connection's aiohttp pool, at least (a request past it waits for a
#: connection, within its call's deadline).
ASYNC_POOL_SIZE: Final = 100

_T = TypeVar("_T")


def _close(pending: Awaitable[Any]) -> None:
    """Close ``pending`` if it is a coroutine never awaited (no warning: it never ran)."""
    if isinstance(pending, Coroutine):
        pending.close()


class _CheckedTransport(AioHttpTransport):  # type: ignore[misc]
    """aiohttp on a pool of ``pool_size`` connections, made on the running loop when first
    used; a reply that is not whole is a lost answer (:mod:`dedupstore.replies`), not an empty
    one."""

    session: aiohttp.ClientSession | None

    def __init__(self, pool_size: int) -> None:
        super().__init__(session_owner=True)
        self._pool_size = pool_size

    async def open(self) -> None:
        if self.session is None and not self._has_been_opened:
            # as azure-core makes its own session, with a pool of our size
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool_size),
                trust_env=self._use_env_settings,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
            )
        await super().open()

    async def send(self, request: Any, **kwargs: Any) -> Any:
        response = await super().send(request, **kwargs)
        if not kwargs.get("stream"):  # read whole (aiohttp checked the length it was given)
            raw = response.internal_response
            body = await raw.read()  # (the bytes read already, as received: no decompression)
            reason = cut_short(raw.status, raw.headers, len(body))
            if reason is not None:
                raise ServiceResponseError(f"Cosmos DB's reply was cut short: {reason}")
        return response


class AsyncCosmosConnection:
    """An ``azure.cosmos.aio.CosmosClient`` of the account, for one async client (see the
    module). No I/O until the first call."""

    def __init__(self, url: StoreURL, options: Options) -> None:
        self.url = url
        self.options = options
        self.endpoint = endpoint_of(url, options)
        secret = account_key(url, options)
        pool = max(ASYNC_POOL_SIZE, options["max_concurrency"] + 4)
        try:
            self.client = CosmosClient(
                self.endpoint,
                credential=secret,
                transport=_CheckedTransport(pool),
                **client_settings(options),
            )
        except BaseException as exc:
            error = creation_error(url, secret, exc)
            if error is not None:
                raise error from None
            raise
        self._containers: dict[str, ContainerProxy] = {}
        self._opened = False
        self._client_ready = asyncio.Lock()

    def container(self, client: Client) -> ContainerProxy:
        """The proxy of ``client``'s container (no I/O; one per container)."""
        path = client.store_url.path
        proxy = self._containers.get(path)
        if proxy is None:
            database_name, container_name = _names(client.store_url)
            database = self.client.get_database_client(database_name)
            proxy = self._containers[path] = database.get_container_client(container_name)
        return proxy

    async def read_many(self, client: Client, doc_ids: Mapping[str, str]) -> dict[str, Any]:
        """``CosmosConnection.read_many``: the items with ids ``doc_ids.values()`` under their
        keys; a lone id by a single-partition query, several by the SDK's read-many (at most
        ``max_concurrency`` queries in flight). Never a point read."""
        ids = list(doc_ids.values())
        if not ids:
            return {}
        container = self.container(client)
        if len(ids) == 1:

            async def query() -> list[Any]:
                pages = container.query_items(
                    "SELECT * FROM c WHERE c.id = @id",
                    parameters=[{"name": "@id", "value": ids[0]}],
                    partition_key=ids[0],
                )
                return [item async for item in pages]

            items: Any = await self._bounded(query())
        else:
            items = await self._bounded(
                container.read_items(
                    [(d, d) for d in ids], max_concurrency=self.options["max_concurrency"]
                )
            )
        found = {str(item["id"]): item for item in items}
        return {key: found[d] for key, d in doc_ids.items() if d in found}

    async def write(
        self, client: Client, item: dict[str, Any], etag: str | None = None
    ) -> tuple[int, str | None]:
        """``CosmosConnection.write``: create ``item`` (no ``etag``; 201) or replace it if its
        ``_etag`` is still ``etag`` (200), with the new ``_etag``; a refusal's status (409 on a
        create; 412 or 404 on a replace) and ``None``. Other errors propagate."""
        container = self.container(client)
        try:
            if etag is None:
                result = await self._bounded(container.create_item(item))
            else:
                result = await self._bounded(
                    container.replace_item(item["id"], item, **if_unchanged(etag))
                )
        except CosmosHttpResponseError as exc:
            return refused_status(exc, "write", etag), None
        return written(result, etag)

    async def delete(self, client: Client, doc_id: str, etag: str | None = None) -> int:
        """``CosmosConnection.delete``: 204, or a refusal's status (404; 412 with ``etag``).
        Other errors propagate."""
        container = self.container(client)
        try:
            await self._bounded(container.delete_item(doc_id, doc_id, **if_unchanged(etag)))
        except CosmosHttpResponseError as exc:
            return refused_status(exc, "delete", etag)
        return 204

    async def _bounded(self, pending: Awaitable[_T]) -> _T:
        """``pending`` (one SDK call, not started yet), awaited within the time left of the
        call's deadline, after the client's opening at the first call (its account read, within
        the same bound): every request of the async face goes through here. Past the deadline
        (or none left): ``DeadlinePassed``; an aiohttp error that escaped the SDK:
        ``ServiceRequestError`` (both ``StoreUnavailable``)."""
        try:
            left = time_left()
            if left is not None and left <= 0:
                raise DeadlinePassed
            bound = asyncio.timeout(left)
            try:
                async with bound:
                    if not self._opened:
                        await self._open()
                    return await pending
            except TimeoutError:
                if bound.expired():
                    raise DeadlinePassed from None
                raise
            except aiohttp.ClientError as exc:
                raise ServiceRequestError(str(exc), error=exc) from exc
        finally:
            _close(pending)  # (a no-op once awaited)

    async def _open(self) -> None:
        """Open the client once (its aiohttp session on this loop; the account read)."""
        async with self._client_ready:
            if not self._opened:
                await self.client.__aenter__()
                self._opened = True

    async def close(self) -> None:
        """Close the client (its aiohttp session)."""
        await self.client.close()
