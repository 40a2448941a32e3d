"""The async API's native drivers: a store whose primitives are steps runs them on its
connection's async twin (Redis: ``redis.asyncio``; PostgreSQL: psycopg's
``AsyncConnectionPool``; Cosmos DB: ``azure.cosmos.aio``) on the loop, not in threads; a
task cancelled in the middle of such a call leaves what a retry repairs; each call keeps
its deadline against a server that never answers. And :func:`dedupstore.steps.fan`, the
fan-out both faces share.

Every async twin sends each request through one method, ``_bounded(..., pending)``
(``pending``: the request's awaitable, not yet started): :class:`_NativeGate` holds a
chosen request there, before it leaves or after the server answered it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
import warnings
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest

from dedupstore import aio, open_store, steps
from dedupstore.errors import ConcurrencyConflict, StoreUnavailable
from dedupstore.outbox import Message, message_key
from dedupstore.steps import Steps, arun, fan, io, run
from dedupstore.store import DeduplicationStore
from tests.aio_faces import cancelled_in_flight
from tests.proxy import TcpProxy
from tests.servers import CosmosEndpoint, Server


def _no_threads() -> Any:
    raise AssertionError("a native call went to the async face's threads")


async def recovered(store: Any, message_id: str) -> Any:
    """``store.add(message_id)`` after an outage, retried as a caller retries
    ``StoreUnavailable`` (a connection attempt made during the outage may fail the first
    retry within a short wait), for 10 s at most."""
    for _ in range(40):
        try:
            return await store.add(message_id)
        except StoreUnavailable:
            await asyncio.sleep(0.25)
    raise AssertionError("the store did not recover within 10 s")


def _ids(n: int, tag: str) -> list[str]:
    return [f"{tag}-{i}" for i in range(n)]


COSMOS_DATABASE = "dedupstore-aio-native"


@dataclass
class Native:
    """A backend with a native async driver, its server, and how a test keeps its data
    apart (Redis: a key prefix; PostgreSQL: tables of its own; Cosmos DB: containers of
    its own, made by the stores and deleted by the fixture). Emulator gaps
    (``tests/test_cosmos.py``): Cosmos DB stores open with
    ``allow_weak_consistency_for_emulator_only`` and ``endpoint_discovery=false``, over
    plain HTTP as cosmosdb-server serves it."""

    name: str
    server: Server
    made: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The server's URL (what a proxy stands in for)."""
        return self.server.url

    @property
    def cosmos(self) -> CosmosEndpoint:
        """The server, a Cosmos DB endpoint (on ``cosmos`` only)."""
        assert isinstance(self.server, CosmosEndpoint), self.name
        return self.server

    @property
    def many(self) -> int:
        """A batch of three chunks (two in flight) of the backend's stores."""
        return {"redis": 2500, "postgres": 4500, "cosmos": 2100}[self.name]

    def opening(
        self, role: str, tag: str, via: str | None = None, **options: Any
    ) -> tuple[str, dict[str, Any]]:
        """The URL and options of ``role``'s store of the test ``tag`` (through ``via``, a
        proxy's URL, if given)."""
        if self.name == "redis":
            return via or self.url, {"key_prefix": f"{role}{tag}:", **options}
        if self.name == "postgres":
            return via or self.url, {"table": f"native_{role}_{tag}", "create": True, **options}
        parts = urlsplit(via or self.url)
        container = f"{role}-{tag}"
        if container not in self.made:
            self.made.append(container)
        query = (
            f"tls={'true' if parts.scheme == 'https' else 'false'}&endpoint_discovery=false"
            "&allow_weak_consistency_for_emulator_only=true&create=true"
        )
        url = f"cosmos://{parts.netloc}/{COSMOS_DATABASE}/{container}?{query}"
        return url, {"key": self.cosmos.key, **options}

    async def store(
        self, tag: str, via: str | None = None, **options: Any
    ) -> aio.AsyncDeduplicationStore:
        url, given = self.opening("d", tag, via, **options)
        return await aio.open_store(url, **given)

    async def entities(self, tag: str) -> aio.AsyncEntityStore:
        url, given = self.opening("e", tag)
        return await aio.open_entity_store(url, **given)

    async def tokens(self, tag: str) -> aio.AsyncTokenStore:
        url, given = self.opening("t", tag)
        return await aio.open_token_store(url, **given)

    def twin_class(self) -> type:
        if self.name == "redis":
            from dedupstore.backends.redis._aio import AsyncRedisConnection

            return AsyncRedisConnection
        if self.name == "postgres":
            from dedupstore.backends.postgres._aio import AsyncPostgresConnection

            return AsyncPostgresConnection
        from dedupstore.backends.cosmos._aio import AsyncCosmosConnection

        return AsyncCosmosConnection

    def clean_up(self) -> None:
        """Delete the Cosmos DB containers the test's stores made."""
        if not self.made:
            return
        from azure.cosmos import CosmosClient
        from azure.cosmos.exceptions import CosmosResourceNotFoundError

        client = CosmosClient(**self.cosmos.client_kwargs)
        try:
            database = client.get_database_client(COSMOS_DATABASE)
            for name in self.made:
                with contextlib.suppress(CosmosResourceNotFoundError):  # (never made)
                    database.delete_container(name)
        finally:
            client.close()


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("cosmos", marks=pytest.mark.cosmos),
    ]
)
def native(request: pytest.FixtureRequest) -> Iterator[Native]:
    made = Native(request.param, request.getfixturevalue(f"{request.param}_server"))
    yield made
    made.clean_up()


def _behind_a_proxy(
    native: Native, test: Callable[[Any, TcpProxy], Coroutine[Any, Any, None]], **options: Any
) -> None:
    """``test(store, proxy)`` in ``asyncio.run()``, on a deduplication store of ``native``
    (data of its own, ``options``) reached through a proxy; the store closed after it
    (and on Cosmos DB, its container deleted)."""

    async def main(proxy: TcpProxy) -> None:
        store = await native.store(_tag(), via=proxy.url(native.url), **options)
        try:
            await test(store, proxy)
        finally:
            await store.close()

    try:
        with TcpProxy.for_url(native.url) as proxy:
            asyncio.run(main(proxy))
    finally:
        native.clean_up()


def _tag() -> str:
    return uuid.uuid4().hex[:6]


def _twin(store: Any) -> Any:
    """The async twin connection of ``store`` (an async store) on the running loop."""
    return store.sync._async_twin().connection


def test_the_store_runs_on_its_async_driver_on_the_loop(
    native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add, add_many (three chunks, two in flight), has_been_processed, processed_among:
    every driver call awaited on the loop (the offload threads refuse any call)."""

    async def main() -> None:
        store = await native.store(_tag())
        try:
            await store.has_been_processed("warm")  # (PostgreSQL: the table made)
            monkeypatch.setattr(steps, "_executor", _no_threads)
            ids = _ids(native.many, "x")
            assert await store.add("one") is True
            assert await store.add("one") is False
            assert await store.add_many(ids) == set(ids)
            assert await store.add_many([*ids[:10], "two"]) == {"two"}
            assert await store.has_been_processed("two")
            assert await store.processed_among([*ids[-3:], "three"]) == set(ids[-3:])
            assert isinstance(_twin(store), native.twin_class())
        finally:
            monkeypatch.undo()
            await store.close()
        with pytest.raises(Exception, match="closed"):
            await store.add("after")

    asyncio.run(main())


def test_the_token_store_runs_on_its_async_driver_on_the_loop(
    native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """create (three chunks), present, present_among, delete: every driver call awaited
    on the loop (the offload threads refuse any call)."""

    async def main() -> None:
        tokens = await native.tokens(_tag())
        try:
            await tokens.present("warm")  # (PostgreSQL: the table made)
            monkeypatch.setattr(steps, "_executor", _no_threads)
            made = {tid: "ep" for tid in _ids(native.many, "t")}
            await tokens.create(made)
            await tokens.create({"t-0": "ep", "lone": "other"})  # t-0 exists: unchanged
            assert await tokens.present("lone")
            assert await tokens.present_among([*list(made)[-3:], "nope"]) == set(list(made)[-3:])
            await tokens.delete([*made, "never"])
            assert await tokens.present_among([*made, "lone"]) == {"lone"}
            assert isinstance(_twin(tokens), native.twin_class())
        finally:
            monkeypatch.undo()
            await tokens.close()

    asyncio.run(main())


def test_the_entity_store_runs_on_its_async_driver_on_the_loop(
    native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load, save (new, then a stale version refused), load_many and save_many: every
    driver call awaited on the loop (the offload threads refuse any call)."""

    async def main() -> None:
        entities = await native.entities(_tag())
        try:
            await entities.load("warm")  # (PostgreSQL: the table made)
            monkeypatch.setattr(steps, "_executor", _no_threads)
            entity = await entities.load("a")
            assert entity.version is None
            entity.state["n"] = 1
            saved = await entities.save(entity)
            assert saved.version is not None
            stale = await entities.load("a")
            assert stale.state == {"n": 1} and stale.version == saved.version
            stale.state["n"] = 2
            await entities.save(stale)
            saved.state["n"] = 3
            with pytest.raises(ConcurrencyConflict):
                await entities.save(saved)
            many = [await entities.load(f"m{i}") for i in range(5)]
            for i, one in enumerate(many):
                one.state["i"] = i
            assert await entities.save_many(many) == set()
            loaded = await entities.load_many([f"m{i}" for i in range(5)] + ["a"])
            assert [loaded[f"m{i}"].state["i"] for i in range(5)] == list(range(5))
            assert loaded["a"].state == {"n": 2}
            assert isinstance(_twin(entities), native.twin_class())
        finally:
            monkeypatch.undo()
            await entities.close()

    asyncio.run(main())


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("kind", ["create", "delete"])
def test_a_native_token_write_cancelled_in_flight_is_repaired_by_a_retry(
    native: Native, where: str, kind: str
) -> None:
    """A token create or delete cancelled before its request left or after the server ran
    it (on Cosmos DB, one request per token: the first one's held, the others in flight
    beside it): the retry completes it (both are idempotent), and another store object
    sees the tokens created (or gone)."""

    async def main() -> None:
        tag = _tag()
        tokens = await native.tokens(tag)
        other = await native.tokens(tag)
        made = {tid: "ep" for tid in _ids(3, kind)}
        try:
            await tokens.create(made if kind == "delete" else {"warm": "ep"})
            gate = _NativeGate(1, where)
            gate.wrap(_twin(tokens))
            write = tokens.create(made) if kind == "create" else tokens.delete(list(made))
            task = asyncio.create_task(write)
            await asyncio.wait_for(gate.entered.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.restore()
            expected = set(made) if (kind == "create") == (where == "after") else set()
            if native.name == "cosmos":  # one request per token: the held one's is known,
                expected &= {f"{kind}-0"}  # those beside it may have landed or not
                present = await other.present_among(list(made)) & {f"{kind}-0"}
            else:  # one request for all
                present = await other.present_among(list(made))
            assert present == expected, "what the cut write did"
            await (tokens.create(made) if kind == "create" else tokens.delete(list(made)))
            expected = set(made) if kind == "create" else set()
            assert await other.present_among(list(made)) == expected
        finally:
            await tokens.close()
            await other.close()

    asyncio.run(main())


def test_token_mode_makes_every_store_call_on_the_loop(
    native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A boundary in token mode (its outputs subscribed: tokens minted with the save) and
    its receiver (a message's token checked and consumed with the save): every store
    call, token store's included, on the async driver."""
    from tests.test_aio import AsyncDispatcher, counting

    async def main() -> None:
        tag = _tag()
        entities = await native.entities(tag)
        tokens = await native.tokens(tag)
        a_dedup = await native.store(tag, endpoint=f"a-{tag}")
        b_dedup = await native.store(tag, endpoint=f"b-{tag}")
        await entities.load("warm")  # (PostgreSQL: the tables made)
        await tokens.present("warm")
        await a_dedup.has_been_processed("warm")
        await b_dedup.has_been_processed("warm")
        a_out = AsyncDispatcher()
        a = aio.AsyncOutboxProcessor(
            entities, a_dedup, a_out, tokens=tokens, subscriptions={"out": [f"b-{tag}"]}
        )
        b = aio.AsyncOutboxProcessor(entities, b_dedup, AsyncDispatcher(), tokens=tokens)
        monkeypatch.setattr(steps, "_executor", _no_threads)
        try:
            for i in range(3):
                assert (await a.process(Message(f"in{i}", "a", i), counting)).outcome == "processed"
            to_b = [
                Message(m.id, "b", m.body, dict(m.headers))
                for m in a_out.sent
                if m.destination == "out"
            ]
            assert len(to_b) == 3
            outcomes = [(await b.process(m, counting)).outcome for m in [*to_b, to_b[0]]]
            assert outcomes == ["processed"] * 3 + ["duplicate"], outcomes
        finally:
            monkeypatch.undo()
        assert sorted((await entities.load("b")).state["seen"]) == sorted(m.id for m in to_b)
        assert not any(c.outstanding for c in (await tokens.outstanding()).values())
        for client in (entities, tokens, a_dedup, b_dedup):
            await client.close()

    asyncio.run(main())


def test_a_store_used_on_loop_after_loop_keeps_one_twin(
    native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync store awaited through the async face from one ``asyncio.run()`` after
    another (no async ``close()``): each loop gets a twin of its own (one bound to an
    ended loop cannot serve), closed as its loop ends its tasks (its sockets released
    there, not left to the garbage collector), and those of ended loops are dropped."""
    closed: list[int] = []  # (ids, not the objects: those must be collected)
    twin_class = native.twin_class()
    real_close = twin_class.close

    async def close(self: Any) -> None:
        closed.append(id(self))
        await real_close(self)

    monkeypatch.setattr(twin_class, "close", close)
    url, options = native.opening("l", _tag())
    sync = open_store(url, **options)
    store = aio.AsyncDeduplicationStore(sync)
    gc.collect()  # (what earlier tests left: not this test's to judge)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        try:
            for i in range(3):
                assert asyncio.run(store.add(f"run-{i}")) is True
                assert len(sync.__dict__["_twins"]) == 1
                assert len(closed) == i + 1, "the ended loop's twin was not closed"
            assert asyncio.run(store.processed_among(["run-0", "run-2"])) == {"run-0", "run-2"}
            assert len(closed) == 4
        finally:
            sync.close()
        gc.collect()  # what was left open warns as it is collected
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks

    async def closed_once() -> None:  # an async close() closes its loop's twin once
        again = aio.AsyncDeduplicationStore(open_store(url, **options))
        assert await again.has_been_processed("run-1")
        await again.close()
        await asyncio.sleep(0)

    closed.clear()
    asyncio.run(closed_once())
    assert len(closed) == 1


# (what a driver leaves on the closed loop complains as it is collected: psycopg_pool's
# workers, "Event loop is closed"; the user's to see, as with a pool of their own)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_loop_closed_without_ending_its_tasks_leaves_the_store_working(
    native: Native, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop run with ``run_until_complete`` and closed without ending its tasks (no
    ``asyncio.run()``): its twin's keeper stays pending, as any task of it does (asyncio
    logs it as destroyed while pending once collected), and nothing can close its
    connection on a closed loop; the store goes on, on a twin of the next loop's own."""
    gc.collect()  # (what earlier tests left: not this test's to judge)
    caplog.clear()
    url, options = native.opening("c", _tag())
    sync = open_store(url, **options)
    store = aio.AsyncDeduplicationStore(sync)
    try:
        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(store.add("closed-loop")) is True
        finally:
            loop.close()
        del loop
        gc.collect()
        assert asyncio.run(store.add("closed-loop")) is False
        assert asyncio.run(store.add("next-loop")) is True
        assert len(sync.__dict__["_twins"]) == 1
    finally:
        sync.close()
    gc.collect()
    destroyed = [r.getMessage() for r in caplog.records]
    assert any("pending" in t and "dedupstore-aio-twin-keeper" in t for t in destroyed), destroyed


@pytest.mark.sqlite
def test_sqlite_calls_run_in_one_writer_thread_per_file(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite has no async driver worth its dependency (``make bench-drivers``): its
    stores' calls run in one thread of their file's own (one writer, none contending for
    the write lock), not in the async face's shared pool, however many tasks call; the
    results are the sync face's."""
    import threading

    from dedupstore.backends.sqlite import SqliteConnection

    threads: set[str] = set()
    real = SqliteConnection.thread_connection

    def recorded(self: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(self)

    async def main() -> None:
        url = f"sqlite:///{tmp_path}/one.db"
        store = await aio.open_store(url, endpoint="one")
        entities = await aio.open_entity_store(url)
        monkeypatch.setattr(steps, "_executor", _no_threads)
        monkeypatch.setattr(SqliteConnection, "thread_connection", recorded)
        try:
            added = await asyncio.gather(*(store.add(f"m{i}") for i in range(200)))
            assert added == [True] * 200
            assert await store.add_many(_ids(12_000, "x")) == set(_ids(12_000, "x"))
            assert await store.processed_among(["m0", "m199", "none"]) == {"m0", "m199"}
            entity = await entities.load("e")
            entity.state["n"] = 1
            await entities.save(entity)
            assert (await entities.load("e")).state == {"n": 1}
        finally:
            monkeypatch.undo()
        assert len(threads) == 1 and threads.pop().startswith("dedupstore-aio-own"), threads
        await store.close()
        await entities.close()

    asyncio.run(main())


class _NativeGate:
    """Counts the requests of async twin connections (each attempt goes through
    ``_bounded``, its request's awaitable last); the ``hold``-th is held ``before`` it
    leaves or ``after`` the server answered it, until its task is cancelled."""

    def __init__(self, hold: int, where: str) -> None:
        self.calls, self.hold, self.where = 0, hold, where
        self.sent = 0
        self.entered = asyncio.Event()
        self._restore: list[Callable[[], None]] = []

    def wrap(self, connection: Any) -> None:
        real = connection._bounded

        async def bounded(*args: Any) -> Any:
            self.calls += 1
            pending = args[-1]
            if self.calls != self.hold:
                self.sent += 1
                return await real(*args)
            if self.where == "before":
                pending.close()  # never sent
            else:
                await real(*args)
                self.sent += 1
            self.entered.set()
            await asyncio.Event().wait()  # until cancelled

        connection._bounded = bounded
        self._restore.append(lambda: vars(connection).pop("_bounded", None))

    def restore(self) -> None:
        for undo in self._restore:
            undo()


async def _cancelled_then_retried(
    native: Native,
    where: str,
    call: Callable[[Any], Coroutine[Any, Any, Any]],
    fresh: Any,
    held: str,
) -> None:
    """``call(store)`` cancelled with its first request (a write of the id ``held``) held
    ``where`` (on Cosmos DB, its other writes, one per id, in flight beside it: done or
    cancelled with it); then retried on the same store object: the retry reports the ids
    as recorded by it (``fresh``), once; another store object of the endpoint sees them
    recorded, not new."""
    tag = _tag()
    store = await native.store(tag)
    try:
        assert not await store.has_been_processed("warm")  # (the connections made)
        gate = _NativeGate(1, where)
        gate.wrap(_twin(store))
        task = asyncio.create_task(call(store))
        await asyncio.wait_for(gate.entered.wait(), 30)
        task.cancel()
        await asyncio.wait([task], timeout=15)
        if not task.done():  # it waits for its held request: release it, then fail
            for other_task in asyncio.all_tasks() - {task, asyncio.current_task()}:
                other_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            pytest.fail("the cancelled call waited for its held request instead of cancelling it")
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.restore()
        # the held write: never sent, or landed with its answer lost
        assert await store.has_been_processed(held) is (where == "after")
        assert await call(store) == fresh, "the retry on the same object"
        assert not await call(store), "a second retry"
        other = await native.store(tag)
        try:
            assert not await call(other), "another store object"
        finally:
            await other.close()
    finally:
        await store.close()


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("kind", ["add", "add_many"])
def test_a_native_write_cancelled_in_flight_is_repaired_by_a_retry(
    native: Native, where: str, kind: str
) -> None:
    """A task cancelled while its write is in flight stops at once (a native call leaves
    no thread behind): before the request left, nothing was written; after the server
    ran it, the write landed and the answer is lost. Either way a retry of the same ids
    on the same store object reports them as recorded by it, exactly once."""
    ids = _ids(3, kind)

    async def call(store: Any) -> Any:
        return await (store.add("only") if kind == "add" else store.add_many(ids))

    fresh = True if kind == "add" else set(ids)
    held = "only" if kind == "add" else ids[0]  # (Cosmos DB: the first task's request first)
    asyncio.run(_cancelled_then_retried(native, where, call, fresh, held))


@pytest.mark.redis
def test_the_cancellation_check_catches_a_store_that_forgets_its_tokens(
    redis_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ANTI-TEST: a store that does not keep the write tokens of a cancelled write (as if
    it handled only ``Exception``) reports its own landed write as someone else's."""
    monkeypatch.setattr(DeduplicationStore, "_remember", lambda self, ids, tokens: None)

    async def call(store: Any) -> Any:
        return await store.add("only")

    native = Native("redis", redis_server)
    with pytest.raises(AssertionError, match="the retry on the same object"):
        asyncio.run(_cancelled_then_retried(native, "after", call, True, "only"))


@pytest.mark.timeout(90)
def test_a_native_store_call_to_a_server_that_never_answers_ends_within_its_deadline(
    native: Native,
) -> None:
    """Against a server that accepts and never answers, a native ``add`` and a native read
    raise ``StoreUnavailable`` within the store's deadline (Redis and Cosmos DB:
    ``connect_timeout + (retries + 1) x timeout``; PostgreSQL: ``connect_timeout + timeout
    + min(1 s, timeout / 2)``); a retry after the server is back reports the id as
    recorded by it."""

    options: dict[str, Any] = {"timeout": 0.5, "connect_timeout": 0.5}
    if native.name != "postgres":
        options["retries"] = 1

    async def test(store: Any, proxy: TcpProxy) -> None:
        assert await store.add("warm")
        assert isinstance(_twin(store), native.twin_class())
        deadline = store.sync._deadline_seconds()
        await asyncio.to_thread(proxy.reset)
        await asyncio.to_thread(proxy.outage, "hang")
        for call in (store.add, store.has_been_processed):
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await call("stalled")
            took = time.monotonic() - began
            assert took < deadline + 3.0, (call, took, deadline)  # slack: a busy machine
        await asyncio.to_thread(proxy.restore)
        assert await recovered(store, "stalled") is True

    _behind_a_proxy(native, test, **options)


@pytest.mark.cosmos
@pytest.mark.timeout(90)
def test_a_native_cosmos_read_whose_reply_is_cut_short_is_unavailable_not_absent(
    cosmos_server: CosmosEndpoint,
) -> None:
    """A reply cut after its headers (a server killed while writing it) is a lost answer on
    the native path too: ``StoreUnavailable``, never "not processed"."""
    native = Native("cosmos", cosmos_server)

    async def test(store: Any, proxy: TcpProxy) -> None:
        assert await store.add("there")
        assert isinstance(_twin(store), native.twin_class())
        await asyncio.to_thread(proxy.cut_replies, lambda reply: reply.find(b"\r\n\r\n") + 4)
        with pytest.raises(StoreUnavailable):
            await store.has_been_processed("there")
        with pytest.raises(StoreUnavailable):
            await store.processed_among(["there", "else"])
        await asyncio.to_thread(proxy.restore)
        assert await store.has_been_processed("there")

    _behind_a_proxy(native, test, timeout=2, retries=1)


@pytest.mark.postgres
@pytest.mark.timeout(60)
def test_the_async_pool_makes_connections_long_after_its_first_call(
    postgres_server: Server,
) -> None:
    """The async pool's workers make every connection after its first call's: they are
    not bound by that call's deadline (a task copies the context it is made in). Once it
    has passed, connections the server lost are replaced and calls go on."""
    native = Native("postgres", postgres_server)

    async def test(store: Any, proxy: TcpProxy) -> None:
        assert await store.add("first")  # the pool and its workers made in this call
        await asyncio.sleep(store.sync._deadline_seconds() + 0.5)  # its deadline passed
        await asyncio.to_thread(proxy.reset)  # every connection lost
        assert await recovered(store, "later") is True
        assert await store.processed_among(["first", "later"]) == {"first", "later"}

    _behind_a_proxy(native, test, timeout=0.5, connect_timeout=0.5)


@pytest.mark.postgres
@pytest.mark.timeout(60)
def test_an_async_pool_whose_opening_failed_opens_again(
    postgres_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async pool opens once, in the first call; if that opening fails, the next
    attempt opens it again (it does not find a pool never opened: ``PoolClosed``)."""
    import psycopg
    import psycopg_pool

    native = Native("postgres", postgres_server)
    opened = psycopg_pool.AsyncConnectionPool.open
    openings: list[bool] = []

    async def failing_once(self: Any, *args: Any, **kwargs: Any) -> None:
        openings.append(True)
        if len(openings) == 1:
            raise psycopg.OperationalError("injected: the first opening fails")
        await opened(self, *args, **kwargs)

    monkeypatch.setattr(psycopg_pool.AsyncConnectionPool, "open", failing_once)

    async def test(store: Any, proxy: TcpProxy) -> None:
        assert await recovered(store, "first") is True
        assert await store.processed_among(["first"]) == {"first"}
        assert len(openings) == 2

    _behind_a_proxy(native, test)


@pytest.mark.postgres
@pytest.mark.timeout(60)
def test_a_statement_cancelled_against_a_frozen_server_ends_at_its_alarm(
    postgres_server: Server,
) -> None:
    """A task cancelled while its statement waits on a server that never answers: psycopg
    asks the server to cancel the statement (a new connection, never answered either) and
    waits for that (up to 5 s); the statement's alarm cuts the wait (shortly after
    ``timeout``), and the caller hears its cancellation, not a timeout; a caller's own
    ``asyncio.timeout`` still raises ``TimeoutError``. The store goes on once the server
    answers again."""
    native = Native("postgres", postgres_server)

    async def test(store: Any, proxy: TcpProxy) -> None:
        assert await store.add("warm")
        await asyncio.to_thread(proxy.freeze)
        await asyncio.to_thread(proxy.outage, "hang")
        # its statement sent and unanswered at 0.3 s; the alarm at about timeout + 0.5 s
        await cancelled_in_flight(store.add("cut"), after=0.3, within=1 + 3.0)
        began = time.monotonic()
        with pytest.raises(TimeoutError):  # the caller's own timeout: still its own
            async with asyncio.timeout(0.3):
                await store.add("timed")
        took = time.monotonic() - began
        assert took < 1 + 3.0, took
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        await asyncio.to_thread(proxy.restore)
        assert await recovered(store, "after") is True
        assert await store.add("cut") in (True, False)  # applied or not: a retry tells

    _behind_a_proxy(native, test, timeout=1)


@pytest.mark.redis
def test_a_native_write_waits_for_its_replicas_as_the_sync_one_does(
    redis_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait_replicas`` on the native path (the script and ``WAIT`` in one pipeline):
    without replicas, ``StoreUnavailable`` saying the durability is unknown, for one id
    and for a batch; the records are on the primary all the same."""
    from dedupstore.errors import StoreUnavailable as Unavailable

    async def main() -> None:
        prefix = f"w{uuid.uuid4().hex[:6]}:"
        store = await aio.open_store(
            redis_server.url, key_prefix=prefix, wait_replicas=1, wait_timeout_ms=50
        )
        other = await aio.open_store(redis_server.url, key_prefix=prefix)
        monkeypatch.setattr(steps, "_executor", _no_threads)
        try:
            with pytest.raises(Unavailable, match="durability is unknown"):
                await store.add("waited")
            with pytest.raises(Unavailable, match="0 of 1 replicas"):
                await store.add_many(["waited-1", "waited-2"])
            ids = ["waited", "waited-1", "waited-2"]
            assert await other.processed_among(ids) == set(ids)
            assert await store.has_been_processed("waited")
        finally:
            monkeypatch.undo()
            await store.close()
            await other.close()

    asyncio.run(main())


@pytest.mark.redis
def test_a_store_given_a_sync_client_runs_its_calls_in_threads(redis_server: Server) -> None:
    """``client=`` (a ready ``redis.Redis``) has no async twin: the async store offloads."""
    import redis

    given = redis.Redis.from_url(redis_server.url)
    sync = open_store(redis_server.url, client=given, endpoint=f"g-{uuid.uuid4().hex[:6]}")
    store = aio.AsyncDeduplicationStore(sync)

    async def main() -> None:
        assert sync._async_twin() is sync
        assert await store.add("a") is True
        await store.close()

    asyncio.run(main())
    given.close()


@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_the_processor_makes_every_store_call_on_the_loop(
    native: Native, cleanup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AsyncOutboxProcessor`` on one server's stores (joined): ``process`` (a new
    message, its duplicate), ``process_batch`` and ``begin_attempt`` make every store
    call, joint ones included, on the async driver (the offload threads refuse any
    call); the results are the sync face's."""
    from tests.test_aio import AsyncDispatcher, counting

    async def main() -> None:
        tag = _tag()
        entities = await native.entities(tag)
        dedup = await native.store(tag)
        await entities.load("warm")  # (PostgreSQL: the tables made)
        await dedup.has_been_processed("warm")
        out = AsyncDispatcher()
        processor = aio.AsyncOutboxProcessor(entities, dedup, out, cleanup=cleanup)
        monkeypatch.setattr(steps, "_executor", _no_threads)
        try:
            assert await processor.begin_attempt(Message("m0", "e0", {})) == 1
            first = await processor.process(Message("m0", "e0", {}), counting)
            assert first.outcome == "processed"
            again = await processor.process(Message("m0", "e0", {}), counting)
            assert again.outcome == "duplicate"
            batch = [Message(f"b{i}", f"e{i % 3}", {}) for i in range(9)]
            results = await processor.process_batch([*batch, batch[0]], counting)
            assert [r.outcome for r in results[:9]] == ["processed"] * 9
            assert results[9].outcome == "duplicate"
        finally:
            monkeypatch.undo()
        if cleanup == "deferred":
            await aio.sweep(entities, dedup)
        states = await entities.load_many(["e0", "e1", "e2"])
        assert sorted(states["e0"].state["seen"]) == ["b0", "b3", "b6", "m0"]
        assert all(not entity.outbox for entity in states.values())
        keys = [message_key(m.correlation_id, m.id) for m in [Message("m0", "e0", {}), *batch]]
        assert await dedup.processed_among(keys) == set(keys)
        assert len({m.id for m in out.sent}) == 2 * 10
        await entities.close()
        await dedup.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_a_task_cancelled_in_any_native_call_leaves_what_a_redelivery_completes(
    native: Native, cleanup: str, where: str
) -> None:
    """For each native request a message's processing makes (Redis: the joint load and
    check, the joint save, the clean-up; PostgreSQL: the same statements and the empty
    query that checks a connection before a write that is sent once), a task cancelled
    while that request is held before it left or after the server ran it: the
    redelivered message is applied exactly once, its outputs sent with the same ids,
    nothing left over; a third delivery is a duplicate."""
    from tests.test_aio import AsyncDispatcher, counting

    async def main() -> None:
        tag = _tag()
        entities = await native.entities(tag)
        dedup = await native.store(tag)
        out = AsyncDispatcher()

        def processor() -> aio.AsyncOutboxProcessor:
            return aio.AsyncOutboxProcessor(entities, dedup, out, cleanup=cleanup)

        gates: list[_NativeGate] = []

        def gated(hold: int) -> _NativeGate:
            for old in gates:
                old.restore()
            gate = _NativeGate(hold, where)
            for store in (entities, dedup):
                gate.wrap(_twin(store))
            gates.append(gate)
            return gate

        await processor().process(Message("warm", "warm", 0), counting)  # connections made
        counter = gated(0)
        await processor().process(Message("probe", "probe", 0), counting)
        calls = counter.calls
        assert calls >= 2, calls
        held = 0
        for hold in range(1, calls + 1):
            message = Message(f"m{hold}", f"e{hold}", hold)
            gate = gated(hold)
            task = asyncio.create_task(processor().process(message, counting))
            entered = asyncio.ensure_future(gate.entered.wait())
            await asyncio.wait({task, entered}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            if gate.entered.is_set():
                held += 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:  # fewer calls than the probe's (a probe's attempt retried on a loaded
                entered.cancel()  # machine counts twice): done whole, checked the same
                assert task.done(), f"call {hold} neither reached nor the message done"
            gated(0)
            again = await processor().process(message, counting)
            assert again.outcome in ("processed", "redispatched", "duplicate"), (hold, again)
            if cleanup == "deferred":
                await aio.sweep(entities, dedup)
            entity = await entities.load(message.correlation_id)
            assert entity.state["seen"] == [message.id], (hold, entity.state)
            assert not entity.outbox, (hold, entity.outbox)
            assert await dedup.has_been_processed(message_key(message.correlation_id, message.id))
            sent = {m.id for m in out.sent if m.body.get("of") == message.id}
            assert len(sent) == 1, (hold, sent)
            assert (await processor().process(message, counting)).outcome == "duplicate"
        assert held >= 2, (held, calls)
        await entities.close()
        await dedup.close()

    asyncio.run(main())


# ------------------------------------------------------------------ fan, unit


def _fan_case(fail_at: int | None, log: list[str]) -> Steps[list[int]]:
    def item(i: int) -> Steps[int]:
        log.append(f"start {i}")
        yield from io(lambda: None)
        if i == fail_at:
            raise ValueError(f"item {i}")
        yield from io(lambda: None)
        log.append(f"end {i}")
        return i * 10

    def items() -> Any:
        for i in range(5):
            yield item(i)

    return (yield from fan(_in_order, items(), 2))


def _in_order(fn: Callable[[Any], Any], items: Any, *, concurrency: int) -> list[Any]:
    """A deterministic sync fan-out for the unit test: one by one, stop at a failure."""
    return [fn(item) for item in items]


@pytest.mark.memory
@pytest.mark.parametrize("fail_at", [None, 0, 3])
def test_fan_gives_the_same_results_and_first_error_on_both_faces(fail_at: int | None) -> None:
    sync_log: list[str] = []
    async_log: list[str] = []
    if fail_at is None:
        assert run(_fan_case(None, sync_log)) == [0, 10, 20, 30, 40]
        assert asyncio.run(arun(_fan_case(None, async_log))) == [0, 10, 20, 30, 40]
        assert sorted(async_log) == sorted(sync_log)
        return
    with pytest.raises(ValueError, match=f"item {fail_at}"):
        run(_fan_case(fail_at, sync_log))
    with pytest.raises(ValueError, match=f"item {fail_at}"):
        asyncio.run(arun(_fan_case(fail_at, async_log)))
    # no item starts after the failure; every started one ends (or is the failed one)
    started = {int(e.split()[1]) for e in async_log if e.startswith("start")}
    ended = {int(e.split()[1]) for e in async_log if e.startswith("end")}
    assert max(started) <= fail_at + 1
    assert started - ended == {fail_at}


@pytest.mark.memory
@pytest.mark.parametrize("items", [4, 2])
def test_a_cancelled_fan_cancels_its_tasks_and_waits_for_them(items: int) -> None:
    """Cancelled while an item waits to start (4 items, 3 at once) or once every item
    started (2): the tasks in flight are cancelled and waited for; none starts after."""
    finished: list[int] = []
    gate = asyncio.Event

    async def main() -> None:
        hold = gate()

        async def slow(i: int) -> int:
            try:
                await hold.wait()
            finally:
                finished.append(i)
            return i

        def item(i: int) -> Steps[int]:
            return (yield from io(slow, i))

        task = asyncio.create_task(arun(fan(_in_order, (item(i) for i in range(items)), 3)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        # those in flight, ended; none started after
        assert sorted(finished) == list(range(min(items, 3)))

    asyncio.run(main())
