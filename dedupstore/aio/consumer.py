"""The consume loop of the async API: :class:`AsyncConsumer` and :class:`AsyncBroker`.

:class:`AsyncConsumer` drives the very rounds :class:`~dedupstore.consumers.Consumer`
drives (:mod:`dedupstore.steps`), on the event loop, with the same guarantees: a
delivery is acknowledged only once it is done, an outage holds a delivery without
counting it, a message that killed its consumers is set aside after
``max_deliveries`` runs, a malformed delivery is set aside once, and :meth:`stop`
(SIGTERM, SIGINT) ends the loop after the round in flight.

It reads an :class:`AsyncBroker` (its calls awaited on the loop) or a sync
:class:`~dedupstore.consumers.Broker` (its calls run in the async face's threads).
"""

from __future__ import annotations

import asyncio
import importlib
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, Literal

from dedupstore.aio.processor import AsyncHandler, AsyncOutboxProcessor
from dedupstore.consumers._base import AsyncBroker, Broker, Delivery, MessageRules
from dedupstore.consumers._loop import ConsumeStats, _log, _Loop
from dedupstore.steps import arun, offload
from dedupstore.urls import StoreURL

__all__ = ["AsyncBroker", "AsyncConsumer", "OffloadedBroker", "open_broker"]


class OffloadedBroker(AsyncBroker):
    """A sync :class:`~dedupstore.consumers.Broker` as an :class:`AsyncBroker`: each call
    run in the async face's threads (:func:`dedupstore.steps.offload`), one at a time
    (the consume loop makes one call at a time), within the broker's own deadline."""

    def __init__(self, sync: Broker) -> None:
        """Wrap ``sync``, an open broker (no I/O)."""
        self.sync = sync
        self.kind = sync.kind

    async def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """:meth:`Broker.fetch <dedupstore.consumers.Broker.fetch>`, in a thread."""
        return await offload(self.sync.fetch, max_count, wait)

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """:meth:`Broker.ack <dedupstore.consumers.Broker.ack>`, in a thread."""
        await offload(self.sync.ack, deliveries)

    async def nack(self, deliveries: Sequence[Delivery]) -> None:
        """:meth:`Broker.nack <dedupstore.consumers.Broker.nack>`, in a thread."""
        await offload(self.sync.nack, deliveries)

    async def keep(self, deliveries: Sequence[Delivery]) -> None:
        """:meth:`Broker.keep <dedupstore.consumers.Broker.keep>`, in a thread."""
        await offload(self.sync.keep, deliveries)

    async def reclaim(self, max_count: int) -> list[Delivery]:
        """:meth:`Broker.reclaim <dedupstore.consumers.Broker.reclaim>`, in a thread."""
        return await offload(self.sync.reclaim, max_count)

    async def pending(self) -> int | None:
        """:meth:`Broker.pending <dedupstore.consumers.Broker.pending>`, in a thread."""
        return await offload(self.sync.pending)

    async def close(self) -> None:
        """Close the sync broker (in a thread)."""
        await offload(self.sync.close)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync, name)  # its queue, stream, group, consumer name...


#: The async brokers of schemes that have one: (module, class).
_NATIVE = {
    "amqp": ("dedupstore.backends.rabbitmq.aio", "AioPikaBroker"),
    "amqps": ("dedupstore.backends.rabbitmq.aio", "AioPikaBroker"),
    "kafka": ("dedupstore.backends.kafka", "AsyncKafkaBroker"),
    "redis": ("dedupstore.backends.redis.consumer", "AsyncRedisStreamsBroker"),
    "rediss": ("dedupstore.backends.redis.consumer", "AsyncRedisStreamsBroker"),
}


async def open_broker(url: str | StoreURL, /, **options: Any) -> AsyncBroker:
    """The broker a URL names, for the async consume loop (the URLs and options of
    :func:`dedupstore.consumers.open_broker`).

    ``amqp://`` and ``amqps://``: an :class:`~dedupstore.backends.rabbitmq.aio.AioPikaBroker`
    (aio-pika, on the event loop); ``kafka://``: an
    :class:`~dedupstore.backends.kafka.AsyncKafkaBroker` (confluent-kafka's
    ``AIOConsumer``); ``redis://`` and ``rediss://``: an
    :class:`~dedupstore.backends.redis.consumer.AsyncRedisStreamsBroker`
    (``redis.asyncio``); other schemes (a registered broker of your own): the sync
    broker, opened and called in the async face's threads (:class:`OffloadedBroker`).
    Raises what the sync ``open_broker`` raises (``ConfigurationError`` before any I/O,
    ``StoreUnavailable``).
    """
    parsed = StoreURL.parse(url) if isinstance(url, str) else url
    native = _NATIVE.get(parsed.scheme)
    if native is not None:
        module, name = native
        kind = getattr(importlib.import_module(module), name)
        broker: AsyncBroker = await kind(str(url), **options).open()
        return broker
    from dedupstore.consumers import open_broker as open_sync

    return OffloadedBroker(await offload(open_sync, url, **options))


class AsyncConsumer(_Loop):
    """:class:`~dedupstore.consumers.Consumer` for asyncio: the same rounds, options,
    statistics, errors and guarantees (see there), awaited.

    ``broker``: an :class:`AsyncBroker`, or a sync :class:`~dedupstore.consumers.Broker`
    (its calls then run in the async face's threads). ``processor``: an
    :class:`~dedupstore.aio.AsyncOutboxProcessor`; ``handler`` may be ``async def``.
    A task running :meth:`run` that is cancelled stops as a killed consumer does,
    except that the call in flight ends first (nothing written behind its back):
    what it had not acknowledged is redelivered, and the algorithm completes it
    exactly once.
    """

    _brokers = (AsyncBroker, Broker)
    _processor_class = AsyncOutboxProcessor

    broker: AsyncBroker | Broker
    processor: AsyncOutboxProcessor

    def __init__(
        self,
        broker: AsyncBroker | Broker,
        processor: AsyncOutboxProcessor,
        handler: AsyncHandler,
        *,
        rules: MessageRules | None = None,
        batch_size: int = 100,
        mode: Literal["batch", "single"] = "batch",
        max_deliveries: int | None = 5,
        wait: float | str | timedelta = 1.0,
        max_backoff: float | str | timedelta = 30.0,
    ) -> None:
        """The options of :class:`~dedupstore.consumers.Consumer`, and its
        ``ConfigurationError`` for a bad one (no I/O)."""
        super().__init__(
            broker,
            processor,
            handler,
            rules=rules,
            batch_size=batch_size,
            mode=mode,
            max_deliveries=max_deliveries,
            wait=wait,
            max_backoff=max_backoff,
        )
        self._woken: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    async def run(self, *, install_signal_handlers: bool = True) -> ConsumeStats:
        """Run rounds until :meth:`stop`; return the totals (see
        :meth:`Consumer.run <dedupstore.consumers.Consumer.run>`).

        With ``install_signal_handlers`` (on the main thread's loop), SIGTERM and
        SIGINT call :meth:`stop`; the previous handlers are restored on return.
        """
        loop = asyncio.get_running_loop()
        self._woken = (loop, asyncio.Event())
        try:
            with self._signals(loop, install_signal_handlers):
                return await arun(self._rounds())
        finally:
            self._woken = None

    def stop(self) -> None:
        """End :meth:`run` after the round in flight (processed and acknowledged). Safe
        from any thread and from a signal handler; a backoff in progress is cut short."""
        super().stop()
        woken = self._woken
        if woken is not None:
            loop, event = woken
            with suppress(RuntimeError):  # the loop closed: nothing waits
                loop.call_soon_threadsafe(event.set)

    async def run_once(self) -> ConsumeStats:
        """One round (see :meth:`Consumer.run_once
        <dedupstore.consumers.Consumer.run_once>`), awaited."""
        return await arun(self._run_once())

    async def release(self) -> None:
        """Give back to the broker what an outage left held (:meth:`run` does on return)."""
        await arun(self._release())

    async def _pause(self) -> None:
        assert self._woken is not None  # (called by run's rounds only)
        seconds = self._pause_seconds()
        event = self._woken[1]
        event.clear()
        if self._stopping.is_set():
            return
        with suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)

    @contextmanager
    def _signals(self, loop: asyncio.AbstractEventLoop, install: bool) -> Iterator[None]:
        """SIGTERM and SIGINT call :meth:`stop` in the block (on the main thread only),
        the previous handlers restored after it."""
        if not install or threading.current_thread() is not threading.main_thread():
            yield
            return
        said = f"consumer {self.consumer}: %s received; stopping after the batch in flight"
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.getsignal(sig) for sig in signals}

        def on_signal(sig: signal.Signals) -> None:
            _log.info(said, sig.name)
            self.stop()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous[sig])
