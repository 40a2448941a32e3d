"""Exactly-once FastStream subscribers (:mod:`dedupstore.aio.faststream`) on FastStream's
Redis and RabbitMQ brokers, against the real servers: duplicates applied once, outputs
sent through the outbox, a poison message set aside, a store outage held and
redelivered, a delivery without a stable id rejected."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pika
import pytest
import redis
from faststream import Context

from dedupstore import aio
from dedupstore.aio.faststream import FastStreamDispatcher, exactly_once
from dedupstore.errors import StoreUnavailable
from dedupstore.outbox import Message, Send
from tests.servers import Server
from tests.test_readme import example, replaced, run_python, runs, succeeded

#: FastStream's injection of the delivery.
MESSAGE = Context("message")


async def _until(check: Callable[[], bool], what: str, seconds: float = 30) -> None:
    for _ in range(int(seconds / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _biller(tag: str) -> Callable[[dict[str, Any], Message], Awaitable[Any]]:
    async def bill(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        if message.body["amount"] < 0:
            raise ValueError("a negative amount")
        total = state.get("total", 0) + message.body["amount"]
        receipt = {"order": message.id, "total": total}
        return {"total": total, "orders": [*state.get("orders", []), message.id]}, [
            Send(f"receipts-{tag}", receipt)
        ]

    return bill


class _Flaky:
    """A deduplication store whose first ``failures`` reads fail (an outage)."""

    def __init__(self, real: Any, failures: int) -> None:
        self._real, self.failures = real, failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def has_been_processed(self, key: str) -> bool:
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("injected: the store is down")
        return bool(self._real.has_been_processed(key))


@pytest.mark.redis
def test_a_redis_streams_subscriber_is_exactly_once(redis_server: Server, tmp_path: Path) -> None:
    from faststream.redis import RedisBroker, StreamSub

    tag = uuid.uuid4().hex[:8]
    receipts: list[dict[str, Any]] = []

    async def main() -> None:
        broker = RedisBroker(redis_server.url)
        url = f"sqlite:///{tmp_path}/billing.db"
        entities = await aio.open_entity_store(url)
        dedup = await aio.open_store(url, endpoint="billing")
        processor = aio.AsyncOutboxProcessor(
            entities, dedup, FastStreamDispatcher(broker, to="stream"), dead_letters=f"dead-{tag}"
        )
        subscriber = broker.subscriber(
            stream=StreamSub(f"orders-{tag}", group="billing", consumer="c1")
        )
        subscriber(exactly_once(processor, entity=lambda body, _: body["customer"])(_biller(tag)))

        @broker.subscriber(stream=f"receipts-{tag}")
        async def collect(body: Any, message: Any = MESSAGE) -> None:
            receipts.append({"id": message.headers["message_id"], **body})

        async with broker:
            await broker.start()
            for _copy in range(2):  # every order delivered twice
                for i in range(1, 6):
                    await broker.publish(
                        {"customer": "c-7", "amount": i},
                        stream=f"orders-{tag}",
                        headers={"message_id": f"order-{i}"},
                    )
            await broker.publish(
                {"customer": "c-7", "amount": -1},
                stream=f"orders-{tag}",
                headers={"message_id": "order-bad"},
            )
            await _until(lambda: len({r["id"] for r in receipts}) == 5, "five receipts")
            client = redis.Redis.from_url(redis_server.url)
            await _until(lambda: client.xlen(f"dead-{tag}") == 1, "the dead letter")
            pending = client.xpending(f"orders-{tag}", "billing")
            await _until(
                lambda: client.xpending(f"orders-{tag}", "billing")["pending"] == 0,
                f"every delivery acknowledged ({pending})",
            )
            client.close()
        state = (await entities.load("c-7")).state
        assert state["total"] == 15 and sorted(state["orders"]) == [
            f"order-{i}" for i in range(1, 6)
        ]
        assert sorted(r["total"] for r in {r["id"]: r for r in receipts}.values())[-1] == 15
        for store in (entities, dedup):
            await store.close()

    asyncio.run(main())


@pytest.mark.rabbitmq
def test_a_rabbitmq_subscriber_holds_an_outage_and_rejects_a_delivery_without_an_id(
    rabbitmq_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    from faststream.rabbit import RabbitBroker, RabbitQueue

    tag = uuid.uuid4().hex[:8]
    receipts: list[str] = []

    async def main() -> None:
        broker = RabbitBroker(rabbitmq_server.url)
        entities = await aio.open_entity_store(f"memory://{tag}-e")
        dedup = _Flaky((await aio.open_store(f"memory://{tag}-d", endpoint="billing")).sync, 3)
        processor = aio.AsyncOutboxProcessor(
            entities, dedup, FastStreamDispatcher(broker, to="queue"), dead_letters=f"dead-{tag}"
        )
        handle = exactly_once(processor, entity=lambda body, _: body["customer"], outage_pause=0.05)
        broker.subscriber(RabbitQueue(f"orders-{tag}", auto_delete=True))(handle(_biller(tag)))

        @broker.subscriber(RabbitQueue(f"receipts-{tag}", auto_delete=True))
        async def collect(body: Any, message: Any = MESSAGE) -> None:
            receipts.append(message.raw_message.message_id)

        async with broker:
            await broker.start()
            for i in range(1, 4):
                for _copy in range(2):
                    await broker.publish(
                        {"customer": "c-1", "amount": i},
                        queue=f"orders-{tag}",
                        message_id=f"order-{i}",
                    )
            await _until(lambda: len(set(receipts)) == 3, "three receipts")
            assert dedup.failures == 0, "the outage was met"
            held = [r for r in caplog.records if "held (redelivered)" in r.getMessage()]
            assert len(held) == 3, "each failed delivery was held, none set aside"
            # a delivery published without a message id (not through FastStream)
            connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_server.url))
            connection.channel().basic_publish(
                "", f"orders-{tag}", b'{"customer": "c-1", "amount": 100}'
            )
            connection.close()
            await _until(
                lambda: any(
                    "without a stable message id" in r.getMessage() for r in caplog.records
                ),
                "the rejection",
            )
        state = (await entities.load("c-1")).state
        assert state["total"] == 6 and sorted(state["orders"]) == ["order-1", "order-2", "order-3"]

    asyncio.run(main())


@runs("faststream")
@pytest.mark.redis
def test_the_faststream_example_runs(tmp_path: Path, redis_server: Server) -> None:
    code = replaced(  # the test's server, and streams of this run only
        example("faststream"),
        'REDIS, APP = "redis://localhost:6379/0", "shop"',
        f'REDIS, APP = "{redis_server.url}", "shop-{uuid.uuid4().hex[:8]}"',
    )
    lines = succeeded(run_python(code, tmp_path))
    printed = [line for line in lines if not line.startswith("20")]  # (FastStream's log lines)
    assert printed == ["{'total': 10}"]
