"""The async API's native drivers: a store whose primitives are steps runs them on its
connection's async twin (Redis: ``redis.asyncio``) on the loop, not in threads; a task
cancelled in the middle of such a call leaves what a retry repairs; each call keeps its
deadline against a server that never answers. And :func:`dedupstore.steps.fan`, the
fan-out both faces share."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from dedupstore import aio, open_store, steps
from dedupstore.errors import StoreUnavailable
from dedupstore.outbox import Message, message_key
from dedupstore.steps import Steps, arun, fan, io, run
from dedupstore.store import DeduplicationStore
from tests.proxy import TcpProxy
from tests.servers import Server


def _no_threads() -> Any:
    raise AssertionError("a native call went to the async face's threads")


def _ids(n: int, tag: str) -> list[str]:
    return [f"{tag}-{i}" for i in range(n)]


@pytest.mark.redis
def test_the_redis_store_runs_on_redis_asyncio_on_the_loop(
    redis_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add, add_many (three chunks, two in flight), has_been_processed, processed_among:
    every driver call awaited on the loop (the offload threads refuse any call)."""
    from dedupstore.backends.redis._aio import AsyncRedisConnection

    async def main() -> None:
        store = await aio.open_store(redis_server.url, endpoint=f"n-{uuid.uuid4().hex[:6]}")
        try:
            monkeypatch.setattr(steps, "_executor", _no_threads)
            ids = _ids(2500, "x")
            assert await store.add("one") is True
            assert await store.add("one") is False
            assert await store.add_many(ids) == set(ids)
            assert await store.add_many([*ids[:10], "two"]) == {"two"}
            assert await store.has_been_processed("two")
            assert await store.processed_among([*ids[-3:], "three"]) == set(ids[-3:])
            assert isinstance(store.sync._async_twin()._redis, AsyncRedisConnection)
        finally:
            monkeypatch.undo()
            await store.close()
        with pytest.raises(Exception, match="closed"):
            await store.add("after")

    asyncio.run(main())


def _held_send(
    where: str, connection: Any
) -> tuple[asyncio.Event, Callable[[], int], Callable[[], None]]:
    """Hold the connection's next request ``before`` it is sent or ``after`` the server
    answered it; the event is set once it is held; the counter tells the requests made."""
    real = connection._send
    entered = asyncio.Event()
    sent = 0
    held = True

    async def send(commands: Any, marks: list[bool]) -> Any:
        nonlocal sent, held
        if held and where == "before":
            held = False
            entered.set()
            await asyncio.Event().wait()  # until cancelled
        replies = await real(commands, marks)
        sent += 1
        if held and where == "after":
            held = False
            entered.set()
            await asyncio.Event().wait()
        return replies

    connection._send = send

    def restore() -> None:
        connection._send = real

    return entered, lambda: sent, restore


async def _cancelled_then_retried(
    url: str, where: str, call: Callable[[Any], Coroutine[Any, Any, Any]], fresh: Any
) -> None:
    """``call(store)`` cancelled with its write held ``where``; then retried on the same
    store object: the retry reports the ids as recorded by it (``fresh``), once; another
    store object of the endpoint sees them recorded, not new."""
    endpoint = f"c-{uuid.uuid4().hex[:6]}"
    store = await aio.open_store(url, endpoint=endpoint)
    try:
        entered, requests, restore = _held_send(where, store.sync._async_twin()._redis)
        task = asyncio.create_task(call(store))
        await asyncio.wait_for(entered.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert requests() == (1 if where == "after" else 0)
        restore()
        assert await call(store) == fresh, "the retry on the same object"
        assert not await call(store), "a second retry"
        other = await aio.open_store(url, endpoint=endpoint)
        try:
            assert not await call(other), "another store object"
        finally:
            await other.close()
    finally:
        await store.close()


@pytest.mark.redis
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("kind", ["add", "add_many"])
def test_a_native_write_cancelled_in_flight_is_repaired_by_a_retry(
    redis_server: Server, where: str, kind: str
) -> None:
    """A task cancelled while its ``EVALSHA`` is in flight stops at once (a native call
    leaves no thread behind): before the request left, nothing was written; after the
    server ran it, the write landed and the answer is lost. Either way a retry of the
    same ids on the same store object reports them as recorded by it, exactly once."""
    ids = _ids(3, kind)

    async def call(store: Any) -> Any:
        return await (store.add("only") if kind == "add" else store.add_many(ids))

    fresh = True if kind == "add" else set(ids)
    asyncio.run(_cancelled_then_retried(redis_server.url, where, call, fresh))


@pytest.mark.redis
def test_the_cancellation_check_catches_a_store_that_forgets_its_tokens(
    redis_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ANTI-TEST: a store that does not keep the write tokens of a cancelled write (as if
    it handled only ``Exception``) reports its own landed write as someone else's."""
    monkeypatch.setattr(DeduplicationStore, "_remember", lambda self, ids, tokens: None)

    async def call(store: Any) -> Any:
        return await store.add("only")

    with pytest.raises(AssertionError, match="the retry on the same object"):
        asyncio.run(_cancelled_then_retried(redis_server.url, "after", call, True))


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_a_native_store_call_to_a_server_that_never_answers_ends_within_its_deadline(
    redis_server: Server,
) -> None:
    """Against a server that accepts and never answers, a native ``add`` raises
    ``StoreUnavailable`` within ``connect_timeout + (retries + 1) x timeout``; a retry
    after the server is back reports the id as recorded by it."""

    async def main(proxy: TcpProxy) -> None:
        url = proxy.url(redis_server.url)
        options = {"timeout": 0.5, "retries": 1, "connect_timeout": 0.5}
        store = await aio.open_store(url, endpoint=f"h-{uuid.uuid4().hex[:6]}", **options)
        try:
            assert await store.add("warm")
            await asyncio.to_thread(proxy.reset)
            await asyncio.to_thread(proxy.outage, "hang")
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.add("stalled")
            took = time.monotonic() - began
            assert took < 0.5 + 2 * 0.5 + 3.0, took  # the deadline, and slack for a busy machine
            await asyncio.to_thread(proxy.restore)
            assert await store.add("stalled") is True
        finally:
            await store.close()

    with TcpProxy.for_url(redis_server.url) as proxy:
        asyncio.run(main(proxy))


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


@pytest.mark.redis
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_the_processor_on_redis_makes_every_store_call_on_the_loop(
    redis_server: Server, cleanup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AsyncOutboxProcessor`` on Redis stores (joined: one server): ``process`` (a new
    message, its duplicate), ``process_batch`` and ``begin_attempt`` make every store
    call, joint ones included, on ``redis.asyncio`` (the offload threads refuse any
    call); the results are the sync face's."""
    from tests.test_aio import AsyncDispatcher, counting

    async def main() -> None:
        tag = uuid.uuid4().hex[:6]
        entities = await aio.open_entity_store(redis_server.url, key_prefix=f"e{tag}:")
        dedup = await aio.open_store(redis_server.url, key_prefix=f"d{tag}:")
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


class _NativeGate:
    """Counts the native calls of async Redis connections (each attempt goes through
    ``_bounded``); the ``hold``-th is held ``before`` its request leaves or ``after``
    the server answered it, until its task is cancelled."""

    def __init__(self, hold: int, where: str) -> None:
        self.calls, self.hold, self.where = 0, hold, where
        self.entered = asyncio.Event()

    def wrap(self, connection: Any) -> None:
        real = connection._bounded

        async def bounded(pending: Any) -> Any:
            self.calls += 1
            if self.calls != self.hold:
                return await real(pending)
            if self.where == "before":
                pending.close()  # never sent
            else:
                await real(pending)
            self.entered.set()
            await asyncio.Event().wait()  # until cancelled

        connection._bounded = bounded


@pytest.mark.redis
@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_a_task_cancelled_in_any_native_call_leaves_what_a_redelivery_completes(
    redis_server: Server, cleanup: str, where: str
) -> None:
    """For each native call a message's processing makes on Redis (the joint load and
    check, the joint save, the clean-up), a task cancelled while that call is held before
    its request left or after the server ran it: the redelivered message is applied
    exactly once, its outputs sent with the same ids, nothing left over; a third delivery
    is a duplicate."""
    from tests.test_aio import AsyncDispatcher, counting

    async def main() -> None:
        tag = uuid.uuid4().hex[:6]
        entities = await aio.open_entity_store(redis_server.url, key_prefix=f"e{tag}:")
        dedup = await aio.open_store(redis_server.url, key_prefix=f"d{tag}:")
        out = AsyncDispatcher()

        def processor() -> aio.AsyncOutboxProcessor:
            return aio.AsyncOutboxProcessor(entities, dedup, out, cleanup=cleanup)

        def gated(hold: int) -> _NativeGate:
            gate = _NativeGate(hold, where)
            for store in (entities, dedup):
                gate.wrap(store.sync._async_twin()._redis)
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
def test_a_cancelled_fan_cancels_its_tasks_and_waits_for_them() -> None:
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

        task = asyncio.create_task(arun(fan(_in_order, (item(i) for i in range(4)), 3)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(finished) == [0, 1, 2]  # the three in flight, ended; none started after

    asyncio.run(main())
