"""A FastStream service made exactly-once, for ``tests/test_faststream_chaos.py``: a
Redis Streams subscriber of a consumer group (and its recovering twin, which claims
what a killed consumer left pending) around :func:`dedupstore.aio.faststream.exactly_once`
with the soak's handler; the outputs and dead letters through a dispatcher by URL.

Prints the chaos harness's start line once the broker is started; SIGTERM stops the
broker (after the deliveries in flight) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub

from dedupstore import aio
from dedupstore.aio.faststream import exactly_once
from tests.consume_worker import pause_in_window, slow_handler

#: What the chaos harness waits for (tests/test_consumer_chaos.py's START_LINE).
START_LINE = "dedupstore consume: broker"


def _entity(body: Any, message: Any) -> str:
    return str(message.headers["entity"])


def _slower(state: dict[str, Any], message: Any) -> Any:
    """The handler of the broken variant: while the chaos run kills, it waits
    :data:`~tests.consume_worker.WINDOW` in a marked window (acked, not yet applied),
    so that each of the harness's kills lands in it."""
    pause_in_window()
    return slow_handler(state, message)


async def serve(args: argparse.Namespace) -> None:
    broker = RedisBroker(args.broker, graceful_timeout=30)
    entities = await aio.open_entity_store(args.entities)
    dedup = await aio.open_store(args.store)
    dispatcher = await aio.open_dispatcher(args.dispatcher)
    processor = aio.AsyncOutboxProcessor(
        entities, dedup, dispatcher, cleanup=args.cleanup, dead_letters=args.dead_letters
    )
    handle = exactly_once(processor, entity=_entity, outage_pause=0.2)
    # BROKEN (--ack-first, the anti-test): acknowledged as received, before processing
    policy = {"ack_policy": AckPolicy.ACK_FIRST} if args.ack_first else {}
    handler = _slower if args.ack_first else slow_handler
    reading = StreamSub(args.stream, group=args.group, consumer=args.consumer)
    broker.subscriber(stream=reading, **policy)(handle(handler))
    recovering = StreamSub(
        args.stream, group=args.group, consumer=args.consumer, min_idle_time=1000
    )
    broker.subscriber(stream=recovering, **policy)(handle(handler))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with broker:
        await broker.start()
        print(f"{START_LINE} {args.stream} (FastStream) consuming as {args.consumer}", flush=True)
        await stop.wait()
    for client in (entities, dedup, dispatcher):
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("broker", "stream", "group", "consumer", "entities", "store", "dispatcher"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--dead-letters", required=True)
    parser.add_argument("--cleanup", default="inline")
    parser.add_argument("--ack-first", action="store_true")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
