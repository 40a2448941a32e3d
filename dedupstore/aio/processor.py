"""The outbox processor and the sweep of the async API: the sync API's steps
(:mod:`dedupstore.steps`), driven on the event loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast

from dedupstore.aio.stores import (
    AsyncClient,
    AsyncDeduplicationStore,
    AsyncEntityStore,
    AsyncTokenStore,
)
from dedupstore.entities import EntityStore
from dedupstore.outbox import Dispatcher, Message, ProcessResult, SweepResult
from dedupstore.outbox.processor import _Processor
from dedupstore.outbox.sweep import _applied_among, _recorded_among, _sweep
from dedupstore.steps import arun
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenStore

__all__ = [
    "AsyncBeforeCleanup",
    "AsyncHandler",
    "AsyncOutboxProcessor",
    "applied_among",
    "recorded_among",
    "sweep",
]


#: A handler of the async API: ``handler(state, message) -> (new_state, sends)``, or a
#: coroutine function returning that. Pure, deterministic: it awaits no I/O of its own.
AsyncHandler = Callable[[dict[str, Any], Message], Any]
#: ``before_cleanup(messages, results)``: a function, or a coroutine function.
AsyncBeforeCleanup = Callable[[Sequence[Message], Sequence[ProcessResult]], Any]


def _sync(part: Any) -> Any:
    """The sync client an async store wraps (a sync one as given: run in threads)."""
    return part.sync if isinstance(part, AsyncClient) else part


class AsyncOutboxProcessor(_Processor):
    """:class:`~dedupstore.outbox.OutboxProcessor` for asyncio: the same steps, in the
    same order, with the same arguments, results, errors and guarantees.

    The stores are those of :mod:`dedupstore.aio` (or sync ones: their calls then run
    in the async face's threads, as the async stores' do); the dispatcher is an
    :class:`~dedupstore.aio.AsyncDispatcher`, a sync dispatcher, or any object whose
    ``dispatch(messages)`` is an ``async def`` (awaited on the loop). Handlers and
    ``before_cleanup`` may be ``async def``: what they return is awaited. Every store
    call keeps its deadline (the store's ``timeout`` options). A task cancelled in the
    middle of a call waits for that call to end before ``CancelledError`` reaches it,
    so it leaves what a consumer stopped between two calls leaves: the redelivered
    message completes it, exactly once. Safe for any number of concurrent tasks.
    """

    _awaits = True

    def __init__(
        self,
        entities: AsyncEntityStore | EntityStore,
        dedup: AsyncDeduplicationStore | DeduplicationStore,
        dispatcher: Any,
        *,
        cleanup: Literal["inline", "deferred"] = "inline",
        max_attempts: int = 10,
        deferred_limit: int = 1000,
        dead_letters: str | None = None,
        handler_attempts: int = 1,
        run: str | None = None,
        entity_cache: int = 10_000,
        gc_threshold: int | None = None,
        tokens: AsyncTokenStore | TokenStore | None = None,
        subscriptions: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """The arguments of :class:`~dedupstore.outbox.OutboxProcessor`, and its
        ``ConfigurationError`` for a bad one (no I/O)."""
        super().__init__(
            _sync(entities),
            _sync(dedup),
            cast(Dispatcher, _sync(dispatcher)),
            cleanup=cleanup,
            max_attempts=max_attempts,
            deferred_limit=deferred_limit,
            dead_letters=dead_letters,
            handler_attempts=handler_attempts,
            run=run,
            entity_cache=entity_cache,
            gc_threshold=gc_threshold,
            tokens=_sync(tokens),
            subscriptions=subscriptions,
        )

    async def process(self, message: Message, handler: AsyncHandler) -> ProcessResult:
        """:meth:`OutboxProcessor.process <dedupstore.outbox.OutboxProcessor.process>`,
        awaited; ``handler`` may be ``async def``."""
        return await arun(self._process_one(message, handler))

    async def begin_attempt(self, message: Message) -> int:
        """:meth:`OutboxProcessor.begin_attempt
        <dedupstore.outbox.OutboxProcessor.begin_attempt>`, awaited."""
        return await arun(self._begin_attempt(message))

    async def process_batch(
        self,
        messages: Sequence[Message],
        handler: AsyncHandler,
        *,
        before_cleanup: AsyncBeforeCleanup | None = None,
    ) -> list[ProcessResult]:
        """:meth:`OutboxProcessor.process_batch
        <dedupstore.outbox.OutboxProcessor.process_batch>`, awaited; ``handler`` and
        ``before_cleanup`` may be ``async def``."""
        return await arun(self._process_batch(messages, handler, before_cleanup))

    async def redrive(self, letter: object, handler: AsyncHandler) -> ProcessResult:
        """:meth:`OutboxProcessor.redrive <dedupstore.outbox.OutboxProcessor.redrive>`,
        awaited; ``handler`` may be ``async def``."""
        return await arun(self._redrive(letter, handler))


async def sweep(
    entities: AsyncEntityStore | EntityStore,
    dedup: AsyncDeduplicationStore | DeduplicationStore,
    segment: int = 0,
    segments: int = 1,
    redispatch: Any = None,
    *,
    batch_ids: int = 1000,
    max_attempts: int = 10,
    progress: Callable[[SweepResult], Awaitable[object] | object] | None = None,
    tokens: AsyncTokenStore | TokenStore | None = None,
) -> SweepResult:
    """:func:`dedupstore.outbox.sweep`, awaited; ``progress`` may be ``async def``."""
    return await arun(
        _sweep(
            _sync(entities),
            _sync(dedup),
            segment,
            segments,
            _sync(redispatch),
            batch_ids=batch_ids,
            max_attempts=max_attempts,
            progress=progress,
            tokens=_sync(tokens),
        )
    )


async def applied_among(
    entities: AsyncEntityStore | EntityStore,
    dedup: AsyncDeduplicationStore | DeduplicationStore,
    messages: Iterable[tuple[str, str]],
    *,
    tokens: AsyncTokenStore | TokenStore | None = None,
    token_ids: Mapping[tuple[str, str], str] | None = None,
) -> set[tuple[str, str]]:
    """:func:`dedupstore.outbox.applied_among`, awaited."""
    return await arun(
        _applied_among(
            _sync(entities), _sync(dedup), messages, tokens=_sync(tokens), token_ids=token_ids
        )
    )


async def recorded_among(
    dedup: AsyncDeduplicationStore | DeduplicationStore,
    messages: Iterable[tuple[str, str]],
    *,
    tokens: AsyncTokenStore | TokenStore | None = None,
    token_ids: Mapping[tuple[str, str], str] | None = None,
) -> set[tuple[str, str]]:
    """:func:`dedupstore.outbox.recorded_among`, awaited."""
    return await arun(
        _recorded_among(_sync(dedup), messages, tokens=_sync(tokens), token_ids=token_ids)
    )
