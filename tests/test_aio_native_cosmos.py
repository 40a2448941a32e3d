"""The async API's native Cosmos DB driver: the Cosmos stores' primitives, written as steps,
run on ``azure.cosmos.aio`` (:class:`~dedupstore.backends.cosmos._aio.AsyncCosmosConnection`)
on the loop, not in threads; a task cancelled in the middle of a native write leaves what a
retry repairs; a call keeps its deadline against a server that never answers.

The Redis and PostgreSQL versions are in ``tests/test_aio_native.py``, whose helpers these
reuse: every request of an async twin goes through its ``_bounded(pending)``, where
``_NativeGate`` holds one. Emulator gaps (``tests/test_cosmos.py``): the stores open with
``allow_weak_consistency_for_emulator_only`` and ``endpoint_discovery=false``, over plain
HTTP (``tls=false``) as cosmosdb-server serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from azure.cosmos import CosmosClient
from azure.cosmos.exceptions import CosmosResourceNotFoundError

from dedupstore import aio, steps
from dedupstore.errors import ConcurrencyConflict, StoreUnavailable
from dedupstore.outbox import Message, message_key
from tests.proxy import TcpProxy
from tests.servers import CosmosEndpoint
from tests.test_aio_native import _ids, _NativeGate, _no_threads, recovered

pytestmark = pytest.mark.cosmos

DATABASE = "dedupstore-aio-native"


class _Cosmos:
    """This test's containers on the emulator (made by the stores, ``create=true``)."""

    def __init__(self, server: CosmosEndpoint) -> None:
        self.server = server
        self.containers: list[str] = []

    def url(self, role: str, netloc: str | None = None, **extra: Any) -> str:
        """The URL of a new container for ``role`` (through ``netloc``: a proxy)."""
        parts = urlsplit(self.server.endpoint_url)
        name = f"{role}-{uuid.uuid4().hex[:10]}"
        self.containers.append(name)
        query = (
            f"tls={'true' if parts.scheme == 'https' else 'false'}&endpoint_discovery=false"
            "&allow_weak_consistency_for_emulator_only=true&create=true"
        )
        query += "".join(f"&{key}={value}" for key, value in extra.items())
        return f"cosmos://{netloc or parts.netloc}/{DATABASE}/{name}?{query}"

    async def store(self, url: str) -> aio.AsyncDeduplicationStore:
        return await aio.open_store(url, key=self.server.key)

    async def entities(self, url: str) -> aio.AsyncEntityStore:
        return await aio.open_entity_store(url, key=self.server.key)


@pytest.fixture
def cosmos(cosmos_server: CosmosEndpoint) -> Iterator[_Cosmos]:
    made = _Cosmos(cosmos_server)
    yield made
    client = CosmosClient(**cosmos_server.client_kwargs)
    try:
        database = client.get_database_client(DATABASE)
        for name in made.containers:
            with contextlib.suppress(CosmosResourceNotFoundError):  # (never made)
                database.delete_container(name)
    finally:
        client.close()


def _twin(store: Any) -> Any:
    """The async twin connection of ``store`` (an async store) on the running loop."""
    return store.sync._async_twin().connection


def _twin_class() -> type:
    from dedupstore.backends.cosmos._aio import AsyncCosmosConnection

    return AsyncCosmosConnection


def test_the_cosmos_stores_run_on_azure_cosmos_aio_on_the_loop(
    cosmos: _Cosmos, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add, add_many (three chunks), has_been_processed, processed_among, and the entity
    store's load, save, load_many and save_many: every SDK call awaited on the loop (the
    offload threads refuse any call) on ``AsyncCosmosConnection``."""

    async def main() -> None:
        store = await cosmos.store(cosmos.url("d"))
        entities = await cosmos.entities(cosmos.url("e"))
        try:
            monkeypatch.setattr(steps, "_executor", _no_threads)
            ids = _ids(2100, "x")  # chunks of 1000, 1000 and 100
            assert await store.add("one") is True
            assert await store.add("one") is False
            assert await store.add_many(ids) == set(ids)
            assert await store.add_many([*ids[:10], "two"]) == {"two"}
            assert await store.has_been_processed("two")
            assert not await store.has_been_processed("three")
            assert await store.processed_among([*ids[-3:], "three"]) == set(ids[-3:])
            assert await store.processed_among(ids) == set(ids)  # 1000 ids a read-many
            assert isinstance(_twin(store), _twin_class())

            entity = await entities.load("a")
            assert entity.version is None
            entity.state["n"] = 1
            saved = await entities.save(entity)
            assert isinstance(saved.version, str)
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
            assert isinstance(_twin(entities), _twin_class())
        finally:
            monkeypatch.undo()
            await store.close()
            await entities.close()
        with pytest.raises(Exception, match="closed"):
            await store.add("after")

    asyncio.run(main())


@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_the_processor_on_cosmos_makes_every_store_call_on_the_loop(
    cosmos: _Cosmos, cleanup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AsyncOutboxProcessor`` on Cosmos DB stores: ``process`` (a new message, its
    duplicate) and ``process_batch`` make every store call on ``azure.cosmos.aio`` (the
    offload threads refuse any call); the results are the sync face's."""
    from tests.test_aio import AsyncDispatcher, counting

    async def main() -> None:
        entities = await cosmos.entities(cosmos.url("e"))
        dedup = await cosmos.store(cosmos.url("d"))
        out = AsyncDispatcher()
        processor = aio.AsyncOutboxProcessor(entities, dedup, out, cleanup=cleanup)
        monkeypatch.setattr(steps, "_executor", _no_threads)
        try:
            first = await processor.process(Message("m0", "e0", {}), counting)
            assert first.outcome == "processed"
            again = await processor.process(Message("m0", "e0", {}), counting)
            assert again.outcome == "duplicate"
            batch = [Message(f"b{i}", f"e{i % 3}", {}) for i in range(9)]
            results = await processor.process_batch([*batch, batch[0]], counting)
            assert [r.outcome for r in results[:9]] == ["processed"] * 9
            assert results[9].outcome == "duplicate"
            assert isinstance(_twin(dedup), _twin_class())
            assert isinstance(_twin(entities), _twin_class())
        finally:
            monkeypatch.undo()
        if cleanup == "deferred":
            await aio.sweep(entities, dedup)  # (the scan: blocking, in a thread)
        states = await entities.load_many(["e0", "e1", "e2"])
        assert sorted(states["e0"].state["seen"]) == ["b0", "b3", "b6", "m0"]
        assert all(not entity.outbox for entity in states.values())
        keys = [message_key(m.correlation_id, m.id) for m in [Message("m0", "e0", {}), *batch]]
        assert await dedup.processed_among(keys) == set(keys)
        assert len({m.id for m in out.sent}) == 2 * 10
        await entities.close()
        await dedup.close()

    asyncio.run(main())


async def _cancelled_then_retried(
    cosmos: _Cosmos,
    where: str,
    call: Callable[[Any], Coroutine[Any, Any, Any]],
    fresh: Any,
    held: str,
) -> None:
    """``call(store)`` cancelled with its first write (of the id ``held``) held ``where``
    (its other writes, one per id, in flight beside it: done or cancelled with it); then
    retried on the same store object: the retry reports the ids as recorded by it
    (``fresh``), once; another store object of the container sees them recorded, not new."""
    url = cosmos.url("c")
    store = await cosmos.store(url)
    try:
        assert not await store.has_been_processed("warm")  # (the connection made)
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
        other = await cosmos.store(url)
        try:
            assert not await call(other), "another store object"
        finally:
            await other.close()
    finally:
        await store.close()


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("kind", ["add", "add_many"])
def test_a_native_write_cancelled_in_flight_is_repaired_by_a_retry(
    cosmos: _Cosmos, where: str, kind: str
) -> None:
    """A task cancelled while its ``create_item`` is in flight stops at once (a native call
    leaves no thread behind): held before the request left, nothing was written; held after
    the service answered, the write landed and the answer is lost. Either way a retry of the
    same ids on the same store object reports them as recorded by it, exactly once."""
    ids = _ids(3, kind)

    async def call(store: Any) -> Any:
        return await (store.add("only") if kind == "add" else store.add_many(ids))

    fresh = True if kind == "add" else set(ids)
    held = "only" if kind == "add" else ids[0]  # (the first task reaches its request first)
    asyncio.run(_cancelled_then_retried(cosmos, where, call, fresh, held))


@pytest.mark.timeout(90)
def test_a_native_store_call_to_a_server_that_never_answers_ends_within_its_deadline(
    cosmos: _Cosmos,
) -> None:
    """Against a server that accepts and never answers, a native ``add`` raises
    ``StoreUnavailable`` within the store's deadline (``connect_timeout + (retries + 1) x
    timeout``); a retry after the server is back reports the id as recorded by it."""
    server_url = cosmos.server.endpoint_url

    async def main(proxy: TcpProxy) -> None:
        netloc = urlsplit(proxy.url(server_url)).netloc
        url = cosmos.url("h", netloc, timeout=0.5, retries=1, connect_timeout=0.5)
        store = await cosmos.store(url)
        try:
            assert await store.add("warm")
            assert isinstance(_twin(store), _twin_class())
            deadline = store.sync._deadline_seconds()
            assert deadline == 0.5 + 2 * 0.5
            await asyncio.to_thread(proxy.reset)
            await asyncio.to_thread(proxy.outage, "hang")
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.add("stalled")
            took = time.monotonic() - began
            assert took < deadline + 3.0, (took, deadline)  # slack for a busy machine
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.has_been_processed("stalled")
            took = time.monotonic() - began
            assert took < deadline + 3.0, (took, deadline)
            await asyncio.to_thread(proxy.restore)
            assert await recovered(store, "stalled") is True
        finally:
            await store.close()

    with TcpProxy.for_url(server_url) as proxy:
        asyncio.run(main(proxy))


@pytest.mark.timeout(90)
def test_a_native_read_whose_reply_is_cut_short_is_unavailable_not_absent(
    cosmos: _Cosmos,
) -> None:
    """A reply cut after its headers (a server killed while writing it) is a lost answer on
    the native path too: ``StoreUnavailable``, never "not processed"."""
    server_url = cosmos.server.endpoint_url

    async def main(proxy: TcpProxy) -> None:
        netloc = urlsplit(proxy.url(server_url)).netloc
        url = cosmos.url("r", netloc, timeout=2, retries=1)
        store = await cosmos.store(url)
        try:
            assert await store.add("there")
            assert isinstance(_twin(store), _twin_class())
            await asyncio.to_thread(proxy.cut_replies, lambda reply: reply.find(b"\r\n\r\n") + 4)
            with pytest.raises(StoreUnavailable):
                await store.has_been_processed("there")
            with pytest.raises(StoreUnavailable):
                await store.processed_among(["there", "else"])
            await asyncio.to_thread(proxy.restore)
            assert await store.has_been_processed("there")
        finally:
            await store.close()

    with TcpProxy.for_url(server_url) as proxy:
        asyncio.run(main(proxy))
