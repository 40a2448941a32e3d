"""The ``redis.asyncio`` twin of :class:`~._client.RedisConnection`:
:class:`AsyncRedisConnection`, for the async face's Redis clients.

The same server settings (:data:`~._client.CONNECTION_OPTIONS`: timeouts, retries,
credentials, TLS, pool size (:data:`ASYNC_POOL_SIZE` by default: a task past it waits
for a connection, within its attempt's bound), ``wait_replicas``), the same error rules
(``RedisConnection.classify_error``: ``redis.asyncio`` raises redis-py's exceptions) and
the same method names as the sync connection (``read``, ``pipelined``, ``run_script``,
``write``; ``client`` is a ``redis.asyncio.Redis``), awaited, so that one driver logic
written as steps (:mod:`dedupstore.steps`) runs on both: the brokers'
(:class:`~.consumer.AsyncRedisStreamsBroker`) and the stores' primitives on the async
face (:meth:`RedisConnection.async_twin <._client.RedisConnection.async_twin>`).

Deadline: each attempt is bounded by ``timeout`` and by the time left of the call's
deadline (``asyncio.timeout``; connecting by ``connect_timeout``), attempts are retried
after a connection error or timeout with the library's backoff, never past the
deadline: a call ends within ``connect_timeout + (retries + 1) x timeout``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection as DriverConnection
from redis.asyncio.connection import ConnectionPool, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedupstore.backend import Client, Options, StoreURL, aretry, capped, time_left

from ._client import (
    _log_write_retry,
    _transient,
    confirmed,
    script_commands,
    server_kwargs,
    wait_command,
)

__all__ = ["ASYNC_POOL_SIZE", "AsyncRedisConnection"]

#: Connections of one async connection's pool when ``max_connections`` is not set.
ASYNC_POOL_SIZE = 100


def _close(pending: Awaitable[Any]) -> None:
    """Close ``pending`` if it is a coroutine never awaited (no warning: it never ran)."""
    if isinstance(pending, Coroutine):
        pending.close()


class AsyncRedisConnection:
    """A ``redis.asyncio.Redis`` on a pool of its own, for one async client (see the
    module). No I/O until the first call."""

    def __init__(self, url: StoreURL, options: Options) -> None:
        self._timeout = float(options["timeout"])
        # Many tasks share the pool: every call takes one of its connections through
        # _slots, so one past its size waits for a connection (within the call's
        # deadline, _bounded) instead of failing at once, as redis.asyncio's pool does.
        size = options["max_connections"] or ASYNC_POOL_SIZE
        self._slots = asyncio.Semaphore(size)
        pool = ConnectionPool(
            **server_kwargs(url, options),
            connection_class=SSLConnection if url.scheme == "rediss" else DriverConnection,
            socket_timeout=options["timeout"],
            socket_connect_timeout=options["connect_timeout"],
            max_connections=size,
            retry=Retry(NoBackoff(), 0),  # retried here (read)
        )
        self.client = aioredis.Redis(connection_pool=pool)
        self._attempts: int = options["retries"] + 1
        self._wait = wait_command(options)

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

    async def run_script(
        self,
        client: Client,
        source: str,
        keys: list[str],
        args: list[str],
        resent_args: list[str] | None = None,
    ) -> Any:
        """``RedisConnection.run_script``: ``client``'s write script ``source`` by
        :meth:`write` (then ``WAIT``); its answer."""
        commands, resent = script_commands(source, keys, args, resent_args)
        return (await self.write(client, commands, resent, script=source))[0]

    async def write(
        self,
        client: Client,
        commands: list[tuple[Any, ...]],
        resent: list[tuple[Any, ...]] | None = None,
        *,
        script: str = "",
    ) -> list[Any]:
        """``RedisConnection.write``: ``commands`` (then ``WAIT``) in one round trip,
        retried after a connection error or timeout (``resent`` once the request may have
        reached the server), the script loaded after ``NOSCRIPT``; their replies."""
        wait = self._wait
        sent: list[bool] = []

        async def attempt() -> list[Any]:
            request = [*(resent if sent and resent is not None else commands), *wait]
            try:
                replies: list[Any] = await self._bounded(self._send(request, sent))
            except NoScriptError:  # the script did not run: load it, send again at once
                if not script:
                    raise
                await self._bounded(self.client.script_load(script))
                replies = await self._bounded(self._send(request, sent))
            return replies

        replies = await aretry(
            attempt,
            attempts=self._attempts,
            retry_on=_transient,
            before_sleep=functools.partial(_log_write_retry, client, self._attempts),
        )
        return confirmed(client, replies, wait)

    async def _send(self, commands: list[tuple[Any, ...]], sent: list[bool]) -> list[Any]:
        """``commands`` in one pipeline (no transaction; one command alone: sent as it
        is); every reply read, the first error reply raised. Appends to ``sent`` once the
        request may reach the server."""
        if len(commands) == 1:
            sent.append(True)
            return [await self.client.execute_command(*commands[0])]  # type: ignore[no-untyped-call]
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        sent.append(True)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies

    async def _bounded(self, pending: Awaitable[Any]) -> Any:
        """``pending``, once one of the pool's connections is free (waiting within the
        call's deadline, as a blocking call waits for a thread), then awaited within
        ``timeout`` and the time left (a blocking command such as ``XREADGROUP ...
        BLOCK`` is bounded by its own block, capped below the timeout by the caller);
        past either, redis-py's ``TimeoutError`` (transient). So an attempt's timeout
        counts the request, not the wait for a connection under load."""
        try:
            async with asyncio.timeout(time_left()):
                await self._slots.acquire()
        except BaseException as exc:
            _close(pending)
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError("timed out waiting for a connection") from None
            raise
        try:
            bound = capped(self._timeout)  # no time left: DeadlinePassed, never retried
            async with asyncio.timeout(bound):
                return await pending
        except TimeoutError as exc:
            if isinstance(exc, RedisTimeoutError):
                raise
            raise RedisTimeoutError("timed out: the call's deadline passed") from None
        finally:
            _close(pending)  # (a no-op once awaited; never started if capped() raised)
            self._slots.release()

    async def close(self) -> None:
        """Disconnect the pool (a ``Redis`` given its pool leaves it open by default)."""
        await self.client.aclose(close_connection_pool=True)
