"""The ``redis.asyncio`` twin of :class:`~._client.RedisConnection`:
:class:`AsyncRedisConnection`, for the async face's Redis clients.

The same server settings (:data:`~._client.CONNECTION_OPTIONS`: timeouts, retries,
credentials, TLS, pool size), the same error rules (``RedisConnection.classify_error``:
``redis.asyncio`` raises redis-py's exceptions) and the same method names as the sync
connection (``read``, ``pipelined``; ``client`` is a ``redis.asyncio.Redis``), awaited,
so that one driver logic written as steps (:mod:`dedupstore.steps`) runs on both.

Deadline: each attempt is bounded by ``timeout`` and by the time left of the call's
deadline (``asyncio.timeout``; connecting by ``connect_timeout``), attempts are retried
after a connection error or timeout with the library's backoff, never past the
deadline: a call ends within ``connect_timeout + (retries + 1) x timeout``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection as DriverConnection
from redis.asyncio.connection import ConnectionPool, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedupstore.backend import Options, StoreURL, aretry, capped

from ._client import _transient, server_kwargs

__all__ = ["AsyncRedisConnection"]


class AsyncRedisConnection:
    """A ``redis.asyncio.Redis`` on a pool of its own, for one async client (see the
    module). No I/O until the first call."""

    def __init__(self, url: StoreURL, options: Options) -> None:
        self._timeout = float(options["timeout"])
        pool = ConnectionPool(
            **server_kwargs(url, options),
            connection_class=SSLConnection if url.scheme == "rediss" else DriverConnection,
            socket_timeout=options["timeout"],
            socket_connect_timeout=options["connect_timeout"],
            max_connections=options["max_connections"],
            retry=Retry(NoBackoff(), 0),  # retried here (read)
        )
        self.client = aioredis.Redis(connection_pool=pool)
        self._attempts: int = options["retries"] + 1

    async def read(self, fn: Callable[..., Awaitable[Any]], /, *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` (``redis.asyncio``), retried after a connection
        error or timeout; each attempt within ``timeout`` and the call's deadline."""
        call = functools.partial(fn, *args, **kwargs)
        return await aretry(
            lambda: self._bounded(call()), attempts=self._attempts, retry_on=_transient
        )

    async def pipelined(
        self, build: Callable[[Any], object], *, transaction: bool = False, **execute: Any
    ) -> list[Any]:
        """The replies of the commands ``build(pipe)`` queues, in one round trip (a read)."""

        async def attempt() -> list[Any]:
            pipe = self.client.pipeline(transaction=transaction)
            build(pipe)
            replies: list[Any] = await pipe.execute(**execute)
            return replies

        replies: list[Any] = await self.read(attempt)
        return replies

    async def _bounded(self, pending: Awaitable[Any]) -> Any:
        """``pending``, awaited within ``timeout`` and the time left (a blocking command
        such as ``XREADGROUP ... BLOCK`` is bounded by its own block, capped below the
        timeout by the caller); past it, redis-py's ``TimeoutError`` (transient)."""
        bound = capped(self._timeout)  # no time left: DeadlinePassed, never retried
        try:
            async with asyncio.timeout(bound):
                return await pending
        except TimeoutError as exc:
            if isinstance(exc, RedisTimeoutError):
                raise
            raise RedisTimeoutError("timed out: the call's deadline passed") from None

    async def close(self) -> None:
        """Disconnect the pool."""
        await self.client.aclose()
