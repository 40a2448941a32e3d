"""The psycopg async twin of :class:`~._client.PostgresConnection`:
:class:`AsyncPostgresConnection`, for the async face's PostgreSQL clients.

The same server settings (the libpq connection string of ``_client.conninfo``:
keepalives, ``tcp_user_timeout``, ``connect_timeout``, the credentials; each new
connection pins ``synchronous_commit`` and ``statement_timeout``), the same pool sizes
(``pool_min_size``, ``pool_max_size``: a ``psycopg_pool.AsyncConnectionPool`` of its own,
filled from its first use on), the same rules for re-sending (``read`` and ``write`` with
``resend``: on another connection when one breaks under it; any other write once, on a
connection that just answered an empty query; a write the server rolled back retried,
3 attempts in all) and the same error classification (``PostgresConnection.
classify_error``: psycopg's async connections raise the same exceptions), with the same
method names, awaited, so that one driver logic written as steps
(:mod:`dedupstore.steps`) runs on both faces.

Deadline: the wait for a connection is bounded by the pool's timeout (``connect_timeout``)
and the call's deadline; each statement by the server's ``statement_timeout`` and by an
alarm on the event loop (:meth:`AsyncPostgresConnection._bounded`) that shuts the
connection's socket down shortly after ``timeout`` or at the call's deadline, whichever
comes first (a frozen server still accepts TCP): the call ends within ``connect_timeout +
timeout + min(1 s, timeout / 2)``, as on the sync face. A task cancelled in a statement
stops once psycopg has asked the server to cancel it and heard back (bounded by the same
alarm); the statement may or may not have been applied, as with a lost answer, and the
stores' write tokens and versions make a retry tell which.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, Self, TypeVar

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from dedupstore.backend import Client, Options, StoreURL, aretry

from ._client import (
    CONFIGURE,
    WRITE_ATTEMPTS,
    StatementTimeout,
    _shut_down,
    alarm_delay,
    configure_params,
    conninfo,
    pool_timeout,
    rolled_back,
    server_closed,
    timed_out,
    wait_until,
    watchdog_delay,
)

if TYPE_CHECKING:
    AsyncPgConnection = psycopg.AsyncConnection[TupleRow]

__all__ = ["AsyncPostgresConnection"]

T = TypeVar("T")


class _OwnAsyncPool(AsyncConnectionPool["AsyncPgConnection"]):
    """``_client._OwnPool`` for the event loop: opened at its first use (on the running
    loop), noting its last failed connection attempt: ``(monotonic time, error)``."""

    def __init__(self, info: str, **kwargs: Any) -> None:
        self.last_failure: tuple[float, psycopg.Error] | None = None
        self._open_task: asyncio.Task[None] | None = None
        pool = self

        class RecordingConnection(psycopg.AsyncConnection[TupleRow]):
            @classmethod
            async def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
                try:
                    return await super().connect(conninfo, **kwargs)
                except psycopg.Error as exc:
                    pool.last_failure = (time.monotonic(), exc)
                    raise

        RecordingConnection.__qualname__ = RecordingConnection.__name__
        super().__init__(info, connection_class=RecordingConnection, open=False, **kwargs)

    async def getconn(self, timeout: float | None = None) -> AsyncPgConnection:
        task = self._open_task
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            # (opened once; an opening that failed is made again by the next call)
            # The pool's workers (which make every connection from then on) start in a
            # context of their own: a task copies the context it is made in, and this one
            # is a call's, whose deadline would bound (and, once passed, fail) every
            # connection the workers make after it.
            task = self._open_task = asyncio.get_running_loop().create_task(
                self.open(wait=False), context=contextvars.Context()
            )
        if not task.done():  # (the calls that came meanwhile wait for it too;
            await asyncio.shield(task)  # a cancelled one leaves it opening)
        return await super().getconn(timeout)

    async def reconnect_failed(self) -> None:
        """As ``_client._OwnPool.reconnect_failed``: calls waiting for a connection when
        psycopg_pool gives up retrying one get another attempt at once."""
        async with self._lock:
            if self._waiting:
                self._maybe_grow_pool()
        await super().reconnect_failed()


class AsyncPostgresConnection:
    """A psycopg ``AsyncConnectionPool`` of its own, for one async client (see the
    module). No I/O until the first call."""

    def __init__(self, url: StoreURL, options: Options) -> None:
        self.timeout: float = options["timeout"]
        self.watchdog_delay = watchdog_delay(options)
        connect_timeout: float = options["connect_timeout"]
        self.pool = _OwnAsyncPool(
            conninfo(url, options),
            kwargs={"autocommit": True},
            min_size=options["pool_min_size"],
            max_size=options["pool_max_size"],
            configure=self._configure,
            timeout=connect_timeout,
            reconnect_timeout=connect_timeout / 2,  # as the sync pool's (see there)
            name="dedupstore-aio",
        )

    async def _configure(self, conn: AsyncPgConnection) -> None:
        """A new connection's settings (in the pool's worker, not a call's request)."""
        await self._alarmed(conn, conn.execute(CONFIGURE, configure_params(self.timeout)))

    @contextlib.asynccontextmanager
    async def pooled(
        self, client: Client, *, verify: bool = True
    ) -> AsyncIterator[AsyncPgConnection]:
        """``PostgresConnection.pooled``: a live pooled connection, one the server closed
        discarded, with ``verify`` one that answers an empty query."""
        pool = self.pool
        began, until = wait_until(pool)
        while True:
            try:
                conn = await pool.getconn(timeout=until - time.monotonic())
            except PoolTimeout as exc:
                raise pool_timeout(client, pool, began, until, exc)  # noqa: B904 (its cause set)
            try:
                alive = not server_closed(conn) and (not verify or await self._answers(conn))
            except BaseException:
                await pool.putconn(conn)
                raise
            if alive:
                break
            await conn.close()  # the pool replaces it
            await pool.putconn(conn)
        try:
            yield conn
        finally:
            await pool.putconn(conn)

    async def _answers(self, conn: AsyncPgConnection) -> bool:
        try:
            await self._bounded(conn, AsyncConnectionPool.check_connection(conn))
        except StatementTimeout:
            raise
        except psycopg.Error:
            return False
        return True

    async def execute(
        self, conn: AsyncPgConnection, query: Any, params: Any = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement and fetch its rows, bounded by :meth:`_bounded`."""

        async def fetch() -> list[tuple[Any, ...]]:
            cursor = await conn.execute(query, params)
            return await cursor.fetchall() if cursor.description is not None else []

        rows: list[tuple[Any, ...]] = await self._bounded(conn, fetch())
        return rows

    async def _bounded(self, conn: AsyncPgConnection, pending: Awaitable[T]) -> T:
        """``pending``, a call's round trip on ``conn``, under :meth:`_alarmed`: the one
        place every request of the calls of the twin goes through."""
        return await self._alarmed(conn, pending)

    async def _alarmed(self, conn: AsyncPgConnection, pending: Awaitable[T]) -> T:
        """``pending``, a round trip on ``conn``, awaited under an alarm that shuts the
        connection's socket down shortly after ``timeout`` (or at the call's deadline):
        a psycopg error after that is raised as ``StatementTimeout`` and the connection
        closed."""
        delay = alarm_delay(self.watchdog_delay)
        task = asyncio.current_task()
        fired = recancelled = False

        def fire() -> None:
            nonlocal fired, recancelled
            fired = True
            with contextlib.suppress(OSError):
                _shut_down(conn)
            if task is not None and task.cancelling():
                # cancelled already: psycopg waits for the server's answer to its cancel
                # request, on a connection of its own (up to 5 s); cut that wait short
                recancelled = True
                task.cancel()

        alarm = asyncio.get_running_loop().call_later(delay, fire)
        try:
            try:
                return await pending
            finally:
                alarm.cancel()
                if fired:  # the socket is shut down, even if the answer came
                    await conn.close()
        except asyncio.CancelledError:
            if recancelled and task is not None:
                task.uncancel()  # the alarm's: the caller's cancellation is what remains
            raise
        except psycopg.Error as exc:
            if task is not None and task.cancelling():
                # psycopg's wait for its statement, cut short by the alarm: the
                # cancellation is what the caller hears
                if recancelled:
                    task.uncancel()
                raise asyncio.CancelledError from exc
            if fired:
                raise timed_out(delay, self.timeout) from exc
            raise

    async def run(
        self, client: Client, query: Any, params: Any, *, resend: bool
    ) -> list[tuple[Any, ...]]:
        """``PostgresConnection.run``: one statement on a pooled connection, re-sent on
        another one when it breaks under it with ``resend`` (never after a timeout)."""
        broke = False

        async def attempt() -> list[tuple[Any, ...]]:
            nonlocal broke
            broke = False
            async with self.pooled(client, verify=not resend) as conn:
                try:
                    return await self.execute(conn, query, params)
                except psycopg.OperationalError:
                    broke = server_closed(conn)
                    raise

        def resendable(exc: BaseException) -> bool:
            return resend and broke and not isinstance(exc, StatementTimeout)

        return await aretry(attempt, attempts=None, retry_on=resendable)

    async def read(self, client: Client, query: bytes, params: Any) -> list[tuple[Any, ...]]:
        """``PostgresConnection.read``, awaited."""
        return await self.run(client, query, params, resend=True)

    async def write(
        self, client: Client, query: bytes, params: Any, *, resend: bool = False
    ) -> list[tuple[Any, ...]]:
        """``PostgresConnection.write``, awaited."""
        return await aretry(
            lambda: self.run(client, query, params, resend=resend),
            attempts=WRITE_ATTEMPTS,
            retry_on=rolled_back,
        )

    async def close(self) -> None:
        """Close the pool (its connections and workers: the client's keeper calls this
        when the loop ends, since psycopg_pool's workers swallow a cancellation)."""
        await self.pool.close(timeout=5.0)
