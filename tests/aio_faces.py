"""The async consume loop under the sync tests of the brokers: :func:`consumer_of` and
:func:`opened_broker` make the face's broker and loop, called as the sync ones (each
coroutine awaited on the one event loop of ``dedupstore.testing.faces``, where the
async brokers' connections live)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from dedupstore.aio import AsyncConsumer, AsyncOutboxProcessor
from dedupstore.aio import open_broker as open_async_broker
from dedupstore.consumers import Consumer, open_broker
from dedupstore.outbox import OutboxProcessor
from dedupstore.testing.faces import blocking, wait_for

#: The faces a broker test runs on: the sync loop, and the async loop on the async broker.
FACES = ["sync", "async"]


def opened_broker(face: str, url: str, **options: Any) -> Any:
    """The face's broker of ``url`` (``open_broker``, or ``dedupstore.aio.open_broker``
    on the faces' loop), called as the sync one."""
    if face == "sync":
        return open_broker(url, **options)
    return blocking(wait_for(open_async_broker(url, **options)))


def unwrapped(broker: Any) -> Any:
    """The broker itself, out of its blocking wrapper."""
    return getattr(broker, "_client", broker)


def consumer_of(
    face: str, broker: Any, processor: OutboxProcessor, handler: Any, **options: Any
) -> Any:
    """The face's consume loop on ``broker`` (as :func:`opened_broker` made it), called as
    the sync one; on the async face an ``AsyncOutboxProcessor`` on the processor's
    stores, dispatcher and options."""
    if face == "sync":
        return Consumer(broker, processor, handler, **options)
    async_processor = AsyncOutboxProcessor(
        processor.entities,
        processor.dedup,
        processor.dispatcher,
        cleanup=processor.cleanup,
        dead_letters=processor.dead_letters,
        tokens=processor.tokens,
        subscriptions=processor.subscriptions,
    )
    return blocking(AsyncConsumer(unwrapped(broker), async_processor, handler, **options))


async def cancelled_in_flight(
    call: Coroutine[Any, Any, Any], *, after: float, within: float
) -> None:
    """Run ``call`` as a task and cancel it ``after`` seconds (in the middle of a request
    the test holds unanswered): it must end with ``CancelledError`` within ``within``
    seconds of the cancel, not at its deadline."""
    task = asyncio.create_task(call)
    await asyncio.sleep(after)
    began = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    took = time.monotonic() - began
    assert took < within, f"the cancelled call ended {took:.2f} s after its cancel"
