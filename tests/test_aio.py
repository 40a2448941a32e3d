"""The async API (:mod:`dedupstore.aio`) on every backend: the same steps as the sync
API (:mod:`dedupstore.steps`), driven on an event loop; async handlers, callbacks and
dispatchers; concurrent tasks; a task cancelled in the middle of any call."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dedupstore import aio, steps
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConcurrencyConflict, ConfigurationError, InvalidMessageId
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, ProcessResult, Send
from dedupstore.tokens import TOKEN_HEADER, new_nonce, token_id
from tests.outbox_backends import OutboxBackend, backend_params
from tests.test_readme import example, run_python, runs, succeeded

backends = pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)


async def counting(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """An async handler: counts each message it applied and forwards it."""
    await asyncio.sleep(0)  # it really is a coroutine the processor awaits
    seen = [*state.get("seen", []), message.id]
    return {"seen": seen}, [Send("out", {"of": message.id}), Send("log", {"n": len(seen)})]


class AsyncDispatcher:
    """A dispatcher of the user's whose ``dispatch`` is a coroutine function."""

    def __init__(self) -> None:
        self.sent: list[OutgoingMessage] = []
        self.loop_thread: set[bool] = set()

    async def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        await asyncio.sleep(0)
        self.loop_thread.add(threading.current_thread() is threading.main_thread())
        self.sent.extend(messages)


async def _open(backend: OutboxBackend, **dedup: Any) -> tuple[Any, Any, Any]:
    entities = await aio.open_entity_store(backend.entities_url, **backend.options)
    store = await aio.open_store(backend.dedup_url, **{**backend.options, **dedup})
    tokens = await aio.open_token_store(backend.tokens_url, **backend.options)
    return entities, store, tokens


# ------------------------------------------------------------------ one algorithm, two faces


@backends
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_concurrent_tasks_apply_each_message_once(
    outbox_backend: OutboxBackend, cleanup: str
) -> None:
    """40 messages of 4 entities, each delivered 3 times, all at once: every message
    applied once, its outputs sent, the deduplication store (after the sweep) holding
    every id and the outboxes empty; a sync processor then agrees it is all done."""

    async def main() -> None:
        entities, dedup, tokens = await _open(outbox_backend)
        out = AsyncDispatcher()
        processor = aio.AsyncOutboxProcessor(entities, dedup, out, cleanup=cleanup)  # type: ignore[arg-type]
        messages = [Message(f"m{i}", f"e{i % 4}", {"i": i}) for i in range(40)]
        results = await asyncio.gather(*(deliver(processor, m) for m in messages * 3))
        outcomes = Counter(r.outcome for r in results)
        assert set(outcomes) <= {"processed", "duplicate", "redispatched"}, outcomes
        # (a copy whose clean-up conflicted is redelivered: it finds its entry pending)
        done = {r.message_id for r in results if r.outcome in ("processed", "redispatched")}
        assert done == {m.id for m in messages}
        if cleanup == "deferred":
            swept = await aio.sweep(entities, dedup)
            assert swept.ids_left == 0 and swept.ids_moved == 40
        applied = Counter(
            mid
            for e in (await entities.load_many([f"e{i}" for i in range(4)])).values()
            for mid in e.state["seen"]
        )
        assert applied == Counter({m.id: 1 for m in messages})
        assert len({m.id for m in out.sent}) == 80
        assert {m.body["of"] for m in out.sent if m.destination == "out"} == done
        assert out.loop_thread == {True}, "an async dispatcher is awaited on the loop"
        assert len(await dedup.processed_among([_key(m) for m in messages])) == 40
        sync = OutboxProcessor(entities.sync, dedup.sync, InMemoryDispatcher())
        again = sync.process_batch(messages, lambda s, m: (s, []))
        assert {r.outcome for r in again} == {"duplicate"}
        for client in (entities, dedup, tokens):
            await client.close()

    asyncio.run(main())


async def deliver(processor: aio.AsyncOutboxProcessor, message: Message) -> ProcessResult:
    """Process ``message``; redelivered, as a broker would, while it conflicts."""
    while True:
        try:
            return await processor.process(message, counting)
        except ConcurrencyConflict:
            continue


def _key(message: Message) -> str:
    from dedupstore.ids import message_key

    return message_key(message.correlation_id, message.id)


@backends
def test_a_batch_with_an_async_before_cleanup_and_a_redrive(outbox_backend: OutboxBackend) -> None:
    """process_batch awaits an async ``before_cleanup`` before any clean-up; a message
    whose async handler fails is dead-lettered, then redriven once with a fixed one."""

    async def main() -> None:
        entities, dedup, tokens = await _open(outbox_backend)
        out = InMemoryDispatcher()  # a sync dispatcher: run in a thread
        processor = aio.AsyncOutboxProcessor(entities, dedup, out, dead_letters="dlq", run="run-1")
        seen: list[list[str]] = []

        async def before(messages: Sequence[Message], results: Sequence[ProcessResult]) -> None:
            await asyncio.sleep(0)
            stored = await entities.load_many([m.correlation_id for m in messages])
            # not cleaned up yet: every applied message still in its outbox
            seen.append(sorted(mid for e in stored.values() for mid in e.outbox))

        async def failing_on_bad(state: dict[str, Any], m: Message) -> Any:
            if m.body == "bad":
                raise ValueError("bad body")
            return await counting(state, m)

        batch = [Message(f"b{i}", f"e{i % 2}", "bad" if i == 3 else i) for i in range(6)]
        results = await processor.process_batch(batch, failing_on_bad, before_cleanup=before)
        assert [r.outcome for r in results].count("dead_lettered") == 1
        assert seen == [sorted(m.id for m in batch)]
        (letter,) = [m for m in out.sent if m.destination == "dlq"]
        redriven = await processor.redrive(letter, counting)
        assert redriven.outcome == "processed"
        assert (await processor.redrive(letter, counting)).outcome == "duplicate"
        state = (await entities.load("e1")).state
        assert state["seen"].count("b3") == 1  # the redrive ran under the original id
        applied = await aio.applied_among(
            entities, dedup, [(m.correlation_id, m.id) for m in batch]
        )
        assert len(applied) == 6
        for client in (entities, dedup, tokens):
            await client.close()

    asyncio.run(main())


@backends
def test_token_mode_and_begin_attempt(outbox_backend: OutboxBackend) -> None:
    """A boundary mints tokens for its subscribed outputs; the receiver, async, applies
    each once, a copy then being a duplicate by its missing token; no token is left."""

    async def main() -> None:
        tag = uuid.uuid4().hex[:6]
        entities, a_dedup, tokens = await _open(outbox_backend, endpoint=f"a-{tag}")
        b_dedup = await aio.open_store(
            outbox_backend.dedup_url, **{**outbox_backend.options, "endpoint": f"b-{tag}"}
        )
        a_out = InMemoryDispatcher()
        a = aio.AsyncOutboxProcessor(
            entities, a_dedup, a_out, tokens=tokens, subscriptions={"out": [f"b-{tag}"]}
        )
        b = aio.AsyncOutboxProcessor(entities, b_dedup, AsyncDispatcher(), tokens=tokens)
        await asyncio.gather(*(deliver(a, Message(f"in{i}", "a", i)) for i in range(5)))
        sent = {m.id: m for m in a_out.sent if m.destination == "out"}  # (redispatches)
        to_b = [Message(m.id, "b", m.body, dict(m.headers)) for m in sent.values()]
        assert len(to_b) == 5 and all(TOKEN_HEADER in m.headers for m in to_b)
        assert await b.begin_attempt(to_b[0]) == 1
        results = await asyncio.gather(*(deliver(b, m) for m in to_b + to_b))
        outcomes = Counter(r.outcome for r in results)
        assert outcomes["processed"] + outcomes["redispatched"] >= 5, outcomes
        assert set(outcomes) <= {"processed", "duplicate", "redispatched"}, outcomes
        state = (await entities.load("b")).state
        assert sorted(state["seen"]) == sorted(m.id for m in to_b)  # each applied once
        assert await b.begin_attempt(to_b[0]) == 0
        assert not any(c.outstanding for c in (await tokens.outstanding()).values())
        assert await aio.recorded_among(
            b_dedup,
            [("b", m.id) for m in to_b],
            tokens=tokens,
            token_ids={("b", m.id): b._token_of(m) or "" for m in to_b},
        ) == {("b", m.id) for m in to_b}
        for client in (entities, a_dedup, b_dedup, tokens):
            await client.close()

    asyncio.run(main())


# ------------------------------------------------------------------ cancellation


class _Gated(ThreadPoolExecutor):
    """The async face's threads, but the ``hold``-th call waits for ``release`` (after
    setting ``entered``); ``finished`` is set once that call returned or raised."""

    def __init__(self, hold: int) -> None:
        super().__init__(8, thread_name_prefix="gated")
        self.calls = 0
        self.hold = hold
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.calls += 1
        if self.calls != self.hold:
            return super().submit(fn, *args, **kwargs)

        def held() -> Any:
            self.entered.set()
            self.release.wait(30)
            try:
                return fn(*args, **kwargs)
            finally:
                self.finished.set()

        return super().submit(held)


async def cancel_in_call(
    hold: int, call: Coroutine[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run ``call`` as a task whose ``hold``-th offloaded call is held; cancel the task
    while that call is in flight; check the cancellation is heard only once the call
    ended (``CancelledError`` raised, the call finished)."""
    gate = _Gated(hold)
    monkeypatch.setattr(steps, "_executor", lambda: gate)
    task = asyncio.create_task(call)
    try:
        await asyncio.to_thread(gate.entered.wait, 30)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done(), "cancelled before the call in flight ended"
    finally:
        gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.finished.is_set()


@backends
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_a_task_cancelled_in_any_call_leaves_what_a_redelivery_completes(
    outbox_backend: OutboxBackend, cleanup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For each call a message's processing makes (loads, checks, saves, the dispatch,
    the clean-up), a task cancelled while that call is in flight: the cancellation
    reaches it only once the call ended, and the redelivered message is then applied
    exactly once, its outputs sent (again, same ids), nothing left over."""

    asyncio.run(_cancel_in_each_call(outbox_backend, cleanup, monkeypatch))


@backends
def test_a_task_cancelled_in_any_call_of_token_mode_leaves_no_token_behind_or_back(
    outbox_backend: OutboxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token mode (a message with a token, outputs subscribed): for each call of its
    processing, a task cancelled while that call is in flight; the redelivery applies
    it once, consumes its token, and leaves exactly one made token per subscribed
    output (none created again once its receiver could have consumed it)."""

    async def main() -> None:
        tag = uuid.uuid4().hex[:6]
        entities, dedup, tokens = await _open(outbox_backend, endpoint=f"b-{tag}")
        out = InMemoryDispatcher()

        def processor() -> aio.AsyncOutboxProcessor:
            return aio.AsyncOutboxProcessor(
                entities, dedup, out, tokens=tokens, subscriptions={"out": [f"r-{tag}"]}
            )

        def tokened(n: int) -> Message:
            nonce = new_nonce()
            return Message(f"m{n}", f"e{n}", n, {TOKEN_HEADER: nonce})

        async def minted_for(message: Message) -> None:
            await tokens.create(
                {token_id(message.id, f"b-{tag}", message.headers[TOKEN_HEADER]): f"b-{tag}"}
            )

        probe = tokened(0)
        await minted_for(probe)
        counter = _Gated(hold=0)  # counts the calls of one message's processing
        monkeypatch.setattr(steps, "_executor", lambda: counter)
        await processor().process(probe, counting)
        calls = counter.calls
        for hold in range(1, calls + 1):
            message = tokened(hold)
            await minted_for(message)
            await cancel_in_call(hold, processor().process(message, counting), monkeypatch)
            monkeypatch.setattr(steps, "_executor", lambda: counter)
            again = await processor().process(message, counting)
            assert again.outcome in ("processed", "redispatched", "duplicate"), again
            entity = await entities.load(message.correlation_id)
            assert entity.state["seen"] == [message.id], (hold, entity.state)
            assert not entity.outbox and not entity.tokens, (hold, entity.outbox)
            incoming = token_id(message.id, f"b-{tag}", message.headers[TOKEN_HEADER])
            assert not await tokens.present(incoming), "the incoming token was consumed"
            sent = {m.id: m for m in out.sent if m.body.get("of") == message.id}
            subscribed = [m for m in sent.values() if m.destination == "out"]
            assert len(subscribed) == 1, (hold, sent)
            made = subscribed[0].headers[TOKEN_HEADER]
            assert await tokens.present(token_id(subscribed[0].id, f"r-{tag}", made))
            assert (await processor().process(message, counting)).outcome == "duplicate"
        for client in (entities, dedup, tokens):
            await client.close()

    asyncio.run(main())


@pytest.mark.memory
def test_the_cancellation_test_catches_a_call_left_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ANTI-TEST: an offload that lets the cancellation through at once (its call still
    running in its thread) is caught."""

    async def hasty(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(steps._executor(), lambda: fn(*args, **kwargs))

    monkeypatch.setattr(steps, "offload", hasty)
    backend = OutboxBackend("memory", *(f"memory://{uuid.uuid4().hex}",) * 2, {})
    backend.tokens_url = backend.dedup_url
    with pytest.raises(AssertionError, match="cancelled before the call in flight ended"):
        asyncio.run(_cancel_in_each_call(backend, "inline", monkeypatch))


async def _cancel_in_each_call(
    outbox_backend: OutboxBackend, cleanup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenario of the cancellation test."""
    entities, dedup, tokens = await _open(outbox_backend)
    out = InMemoryDispatcher()
    processor = aio.AsyncOutboxProcessor(entities, dedup, out, cleanup=cleanup)  # type: ignore[arg-type]
    counter = _Gated(hold=0)
    monkeypatch.setattr(steps, "_executor", lambda: counter)
    await processor.process(Message("probe", "probe", 0), counting)
    calls = counter.calls
    # (a backend whose store calls are native makes fewer here: the dispatcher's at least;
    # tests/test_aio_native.py cancels its native calls)
    assert calls >= 1, calls
    for hold in range(1, calls + 1):
        cid = f"e{hold}"
        message = Message(f"m{hold}", cid, hold)
        await cancel_in_call(hold, processor.process(message, counting), monkeypatch)
        monkeypatch.setattr(steps, "_executor", lambda: counter)
        again = await aio.AsyncOutboxProcessor(entities, dedup, out, cleanup=cleanup).process(
            message, counting
        )
        assert again.outcome in ("processed", "redispatched", "duplicate"), again
        if cleanup == "deferred":
            await aio.sweep(entities, dedup)
        entity = await entities.load(cid)
        assert entity.state["seen"] == [message.id], (hold, entity.state)
        assert not entity.outbox, (hold, entity.outbox)
        assert await dedup.has_been_processed(_key(message))
        sent = {m.id for m in out.sent if m.body.get("of") == message.id}
        assert len(sent) == 1, (hold, sent)
        third = await processor.process(message, counting)
        assert third.outcome == "duplicate"
    for client in (entities, dedup, tokens):
        await client.close()


# ------------------------------------------------------------------ the faces, unit


@pytest.mark.memory
def test_the_two_faces_take_the_same_steps() -> None:
    """One generator of calls, driven by run and by arun: the same answers, errors
    thrown into the step that asked, the user's awaitables awaited by arun only."""
    log: list[str] = []

    def store_call(x: int) -> int:
        log.append(f"io {x}")
        if x < 0:
            raise ValueError("negative")
        return x * 2

    async def async_call(x: int) -> int:
        log.append(f"aio {x}")
        return x + 1

    def the_steps(handler: Any) -> steps.Steps[tuple[int, int, str]]:
        doubled = yield from steps.io(store_call, 2)
        try:
            yield from steps.io(store_call, -1)
        except ValueError as exc:
            caught = str(exc)
        handled = yield from steps.user(handler, doubled)
        return doubled, handled, caught

    assert steps.run(the_steps(lambda x: x + 10)) == (4, 14, "negative")
    assert asyncio.run(steps.arun(the_steps(lambda x: x + 10))) == (4, 14, "negative")
    assert asyncio.run(steps.arun(the_steps(async_call))) == (4, 5, "negative")
    with pytest.raises(TypeError, match="returned an awaitable to the sync API"):
        steps.run(the_steps(async_call))
    assert log.count("io 2") == 4


@pytest.mark.memory
def test_bad_input_is_refused_before_any_call() -> None:
    """The async face checks as the sync one does, before any I/O."""

    async def main() -> None:
        entities = await aio.open_entity_store(f"memory://{uuid.uuid4().hex}")
        dedup = await aio.open_store(f"memory://{uuid.uuid4().hex}")
        with pytest.raises(ConfigurationError, match="cleanup must be"):
            aio.AsyncOutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="later")  # type: ignore[arg-type]
        processor = aio.AsyncOutboxProcessor(entities, dedup, InMemoryDispatcher())
        with pytest.raises(InvalidMessageId):
            await processor.process(Message("", "e", 1), counting)
        with pytest.raises(ConfigurationError, match="handler must be callable"):
            await processor.process(Message("m", "e", 1), "not a handler")  # type: ignore[arg-type]
        assert (await entities.load("e")).version is None  # nothing written
        with pytest.raises(InvalidMessageId):
            await dedup.add("")

    asyncio.run(main())


@pytest.mark.memory
def test_a_cancelled_offloaded_call_ends_before_the_cancellation_is_heard() -> None:
    """offload: a cancelled caller waits for its thread's call, even if cancelled again."""
    ended = threading.Event()

    def slow() -> str:
        ended.wait(0.3)
        ended.set()
        return "done"

    async def main() -> None:
        task = asyncio.create_task(steps.offload(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()  # twice: still waits
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()

    asyncio.run(main())


@runs("asyncio")
@pytest.mark.sqlite
def test_the_asyncio_example_runs(tmp_path: Path) -> None:
    assert succeeded(run_python(example("asyncio"), tmp_path)) == ["3", "{'total': 6}", "3"]
