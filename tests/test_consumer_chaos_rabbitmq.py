"""Chaos on RabbitMQ: consumer processes SIGKILLed at random and replaced.

The same harness as the Redis Streams chaos test (``test_consumer_chaos.py``), on a
RabbitMQ queue: thousands of deliveries (each message published one to three times
by the producer, spread over the queue, ``message_id`` the message id and the
entity in the ``correlation_id`` header) over many entities; three consumer
processes (``dedupstore consume`` through ``tests/consume_worker.py``) read the queue
with a ``RabbitMQBroker`` (manual acknowledgements, a prefetch window of 40; on the
async face, ``dedupstore consume`` on asyncio with aio-pika's ``AioPikaBroker``), keep
their entities and deduplication store on Redis, and publish their outputs with a
``RabbitMQDispatcher`` (publisher confirms) to an exchange of the run whose ``audit``
key is bound to a queue the check reads. At random moments one consumer is
SIGKILLed (one that has been up long enough to be consuming) and a new one
started, at least ten times; what a killed consumer held
(delivered, not acknowledged) is requeued by the broker and delivered to the others.

Draining: RabbitMQ tells over AMQP how many messages are ready, not how many are
delivered and unacknowledged. Once nothing is ready the consumers get SIGTERM
(each ends after its batch in flight; what it had prefetched is requeued when its
connection closes); once all have exited no delivery is outstanding, so a queue
with nothing ready is empty, else consumers are started again. Then every invariant
is checked exactly against the plain model of the input by the soak's check
(``tests.soak_worker.soak_violations``): each message applied once to its entity,
the outgoing ids exactly the model's (nothing missing, no ghost), every copy of one
id identical (every confirmed publish is in the audit queue), each output showing
the state its message made, every id in the deduplication store, every outbox empty
after the sweep, and the input queue empty. In both modes and both clean-ups, and on
the two broken variants the check must catch (acknowledge before processing: messages
lost; dispatch after clean-up: outgoing messages missing).

The input is a quorum queue, so deliveries are counted, and the consumers run with
dead letters and ``max_deliveries=2``. Halfway through the kills comes the outage
phase of the Redis Streams chaos test: the stores' Redis, then the dispatcher's
RabbitMQ (each reached through a TCP proxy) refuse every connection for ``OUTAGE``
seconds; the check requires no dead letter but the oversize message's, bounded.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pika
import pytest

from dedupstore import open_entity_store, open_store
from tests.consume_worker import PAUSE_FILE, PAUSE_FILE_ENV, VARIANT_ENV
from tests.proxy import TcpProxy
from tests.servers import Server
from tests.soak_worker import soak_violations
from tests.test_consumer_chaos import (
    CONSUMERS,
    DEAD_LETTERS,
    ENTITIES,
    KILLS,
    MAX_DELIVERIES,
    OVERSIZE,
    ROOT,
    TOP_UP,
    _with,
    outage_phase,
    oversize_violations,
    pick_victim,
    planned,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]


class RabbitChaos:
    """One run: the input in a queue, consumer processes, kills, the drain, the check."""

    def __init__(
        self,
        amqp_url: str,
        redis_url: str,
        mode: str,
        cleanup: str,
        variant: str,
        seed: str,
        face: str = "sync",
    ) -> None:
        self.amqp_url, self.mode, self.cleanup, self.variant = amqp_url, mode, cleanup, variant
        # an async def handler: the command runs on asyncio, reading through aio-pika
        self.handler = f"tests.consume_worker:{'async_' if face == 'async' else ''}slow_handler"
        self.rng = random.Random(seed)
        tag = uuid.uuid4().hex[:8]
        self.queue, self.exchange, self.audit = f"chaos{tag}-in", f"chaos{tag}", f"chaos{tag}-audit"
        # the stores and the dispatcher reach their servers through proxies (the outage)
        self.store_proxy = TcpProxy.for_url(redis_url).start()
        self.out_proxy = TcpProxy.for_url(amqp_url).start()
        stores = self.store_proxy.url(redis_url)
        self.entities_url = _with(stores, key_prefix=f"chaos{tag}e:")
        self.store_url = _with(stores, key_prefix=f"chaos{tag}d:")
        self.dead = f"chaos{tag}-dead"
        self.connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        self.channel = self.connection.channel()
        self.channel.queue_declare(self.queue, durable=True, arguments={"x-queue-type": "quorum"})
        self.channel.exchange_declare(self.exchange, "direct", durable=True)
        self.channel.queue_declare(self.audit, durable=True)
        self.channel.queue_bind(self.audit, self.exchange, routing_key="audit")
        self.channel.queue_declare(self.dead, durable=True)
        self.channel.queue_bind(self.dead, self.exchange, routing_key=DEAD_LETTERS)
        self.channel.confirm_delivery()
        self.owner: dict[str, str] = {}
        self.processes: list[subprocess.Popen[bytes]] = []
        self.killed = 0
        self.logs: list[Path] = []
        self.consuming_since: dict[int, float] = {}  # pid -> start line first seen

    def produce(self, count: int) -> int:
        """``count`` new messages, each one to three times, the copies spread out."""
        first = len(self.owner)
        fresh = {f"m{n}": f"e{self.rng.randrange(ENTITIES)}" for n in range(first, first + count)}
        self.owner.update(fresh)
        copies = (1, 2, 2, 3)
        deliveries = [(m, c) for m, c in fresh.items() for _ in range(self.rng.choice(copies))]
        self.rng.shuffle(deliveries)
        for mid, cid in deliveries:
            properties = pika.BasicProperties(
                message_id=mid, headers={"correlation_id": cid}, delivery_mode=2
            )
            self.channel.basic_publish("", self.queue, b"{}", properties, mandatory=True)
            if mid in ("m10", "m1500"):  # the oversize message, with each copy of these
                big, entity, body = OVERSIZE
                properties = pika.BasicProperties(
                    message_id=big, headers={"correlation_id": entity}, delivery_mode=2
                )
                self.channel.basic_publish(
                    "", self.queue, body.encode(), properties, mandatory=True
                )
        return len(deliveries)

    def wait_until_consuming(self) -> None:
        """Until every live consumer process consumes the queue (its stores opened)."""
        while True:
            live = sum(p.poll() is None for p in self.processes)
            declared = self.channel.queue_declare(self.queue, passive=True)
            if declared.method.consumer_count >= live:
                return
            time.sleep(0.05)

    def ready(self) -> int:
        """Messages ready in the input queue (delivered, unacknowledged ones not counted)."""
        return int(self.channel.queue_declare(self.queue, passive=True).method.message_count)

    def start(self, log_dir: Path) -> None:
        broker = _with(self.amqp_url, queue=self.queue, prefetch=40, queue_type="quorum")
        dispatcher = _with(self.out_proxy.url(self.amqp_url), exchange=self.exchange)
        log = log_dir / f"consumer-{len(self.logs)}.log"
        self.logs.append(log)
        command = [
            *(sys.executable, "-m", "tests.consume_worker"),
            *("--broker", broker, "--entities", self.entities_url, "--store", self.store_url),
            *("--dispatcher", dispatcher, "--handler", self.handler),
            *("--mode", self.mode, "--cleanup", self.cleanup, "--batch-size", "20"),
            *("--dead-letters", DEAD_LETTERS, "--max-deliveries", MAX_DELIVERIES),
            *("--wait", "0.2", "--log-level", "WARNING"),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            VARIANT_ENV: self.variant,
            PAUSE_FILE_ENV: str(log_dir / PAUSE_FILE),
        }
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
        self.processes.append(process)

    def _stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            code = process.wait()
            # 0: stopped by SIGTERM after its batch; a replacement still starting (its
            # handlers not installed yet, nothing in flight) dies of the SIGTERM itself
            assert code in (0, -signal.SIGKILL, -signal.SIGTERM), self._log_tail()

    def run(self, log_dir: Path) -> None:
        """Start the consumers, kill and replace one at random, drain, stop.

        The kills and the first input are :func:`planned`. A broken variant's pause
        (``PAUSE_FILE_ENV``) lasts until the last kill."""
        killing = log_dir / PAUSE_FILE
        killing.touch()
        kills, messages = planned(self.variant)
        self.produce(messages)
        for _ in range(CONSUMERS):
            self.start(log_dir)
        while self.killed < kills:
            time.sleep(self.rng.uniform(0.3, 0.8))
            if self.ready() < TOP_UP:  # every kill lands while there is work
                self.produce(TOP_UP)
            victim = pick_victim(self, killing)
            victim.send_signal(signal.SIGKILL)
            assert victim.wait() == -signal.SIGKILL
            self.killed += 1
            self.start(log_dir)
            if self.killed == kills // 2 and not self.variant:  # (the anti-tests: kills)
                if self.ready() < TOP_UP:  # the outage lands while there is work
                    self.produce(TOP_UP)
                self.wait_until_consuming()  # one that cannot open its stores exits
                outage_phase(self.store_proxy, self.out_proxy)
        killing.unlink()
        while True:  # drained: bounded by the test's timeout
            while self.ready():
                time.sleep(0.1)
            self._stop_all()
            if not self.ready():  # no consumer left: nothing is delivered and unacknowledged
                return
            for _ in range(CONSUMERS):
                self.start(log_dir)

    def _log_tail(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-2000:] for log in self.logs)

    def violations(self) -> list[str]:
        """The soak's check against the model, plus: the input queue is empty."""
        sent = []
        while True:
            method, properties, body = self.channel.basic_get(self.audit, auto_ack=True)
            if method is None:
                break
            sent.append(
                {
                    "id": properties.message_id,
                    "destination": method.routing_key,
                    "body": json.loads(body),
                    "headers": properties.headers or {},
                }
            )
        entities = open_entity_store(self.entities_url)
        dedup = open_store(self.store_url)
        try:
            found = soak_violations(self.owner, entities, dedup, sent)
        finally:
            entities.close()
            dedup.close()
        if ready := self.ready():
            found.append(f"the input queue holds {ready} messages")
        letters = []
        while True:
            method, _, body = self.channel.basic_get(self.dead, auto_ack=True)
            if method is None:
                break
            letters.append(json.loads(body))
        found += oversize_violations(letters)
        return found

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for name in (self.queue, self.audit, self.dead):
            self.channel.queue_delete(name)
        self.channel.exchange_delete(self.exchange)
        self.connection.close()
        self.store_proxy.close()
        self.out_proxy.close()


@pytest.fixture
def chaos(rabbitmq_server: Server, redis_server: Server, tmp_path: Path) -> Any:
    runs: list[RabbitChaos] = []

    def make(mode: str, cleanup: str, variant: str = "", face: str = "sync") -> RabbitChaos:
        run = RabbitChaos(
            rabbitmq_server.url,
            redis_server.url,
            mode,
            cleanup,
            variant,
            f"rabbitmq-{mode}-{cleanup}-{variant}-{face}",
            face,
        )
        runs.append(run)
        run.run(tmp_path)
        return run

    yield make
    for run in runs:
        run.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["batch", "single"])
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_rabbitmq_consumers_killed_at_random_change_nothing(
    chaos: Any, mode: str, cleanup: str
) -> None:
    run = chaos(mode, cleanup)
    assert run.killed >= KILLS
    assert run.violations() == []


@pytest.mark.timeout(240)
def test_async_rabbitmq_consumers_killed_at_random_change_nothing(chaos: Any) -> None:
    """The same chaos on the async face: ``dedupstore consume`` on asyncio (an ``async
    def`` handler), reading the queue through aio-pika (``AioPikaBroker``)."""
    run = chaos("batch", "inline", face="async")
    assert run.killed >= KILLS
    assert run.violations() == []
    starts = [log.read_text(errors="replace") for log in run.logs]
    assert any("on asyncio" in text for text in starts)


@pytest.mark.timeout(240)
def test_the_rabbitmq_chaos_check_catches_a_broken_async_consumer(chaos: Any) -> None:
    """The anti-test of the async face's broker: aio-pika's acknowledging on receipt."""
    run = chaos("batch", "inline", "ack-first", face="async")
    assert any("messages lost" in v for v in run.violations())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("variant", "cleanup", "expected"),
    [
        ("ack-first", "inline", "messages lost"),
        ("dispatch-after-cleanup", "deferred", "outgoing messages missing"),
    ],
)
def test_the_rabbitmq_chaos_check_catches_a_broken_consumer(
    chaos: Any, variant: str, cleanup: str, expected: str
) -> None:
    run = chaos("batch", cleanup, variant)
    found = run.violations()
    assert any(expected in v for v in found), found
