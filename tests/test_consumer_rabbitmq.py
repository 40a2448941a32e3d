"""The RabbitMQ broker (``dedupstore.backends.rabbitmq.consumer``) against a real broker.

What ``RabbitMQDispatcher`` publishes is read by a ``RabbitMQBroker`` of the same
queue with the default rules; the prefetch window bounds what one consumer holds;
a nack requeues; a consumer process SIGKILLed with deliveries in hand loses none
(the broker requeues them); quorum queues count deliveries, so ``max_deliveries``
sets a message aside. The chaos test is in ``test_consumer_chaos_rabbitmq.py``.

Every test of a consuming broker runs on both faces (the ``face`` fixture): pika's
``RabbitMQBroker`` under the sync ``Consumer``, and aio-pika's ``AioPikaBroker`` under
``AsyncConsumer`` (an ``AsyncOutboxProcessor`` on the same stores), each of their calls
awaited on one event loop of its own thread (``dedupstore.testing.faces``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from dedupstore import open_dispatcher
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.backends.rabbitmq.aio import AioPikaBroker
from dedupstore.backends.rabbitmq.consumer import RabbitMQBroker, RabbitMQToken
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError, StoreUnavailable
from dedupstore.outbox import Message, OutboxProcessor, Send
from tests.aio_faces import FACES, cancelled_in_flight, consumer_of, opened_broker, unwrapped
from tests.proxy import TcpProxy
from tests.servers import HOST, RabbitMQServer, Server, free_port
from tests.test_readme import example, run_python, runs, succeeded, user_env

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=FACES)
def face(request: Any) -> str:
    """pika's broker and ``Consumer``, or aio-pika's and ``AsyncConsumer``."""
    return str(request.param)


def _queue() -> str:
    return f"q-{uuid.uuid4().hex}"


def _msgs(queue: str, count: int, entity: str = "o1", first: int = 0) -> list[OutgoingMessage]:
    return [
        OutgoingMessage(f"m{n}", queue, {"n": n}, {"correlation_id": entity})
        for n in range(first, first + count)
    ]


def count(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Appends the id; forwards it downstream with the entity as correlation id."""
    applied = [*state.get("applied", []), message.id]
    send = Send("next", {"n": message.body["n"]}, {"correlation_id": message.correlation_id})
    return {"applied": applied}, [send]


def _processor(url: str, next_queue: str) -> tuple[OutboxProcessor, MemoryEntityStore]:
    name = uuid.uuid4().hex
    entities = MemoryEntityStore(f"memory://{name}")
    dispatcher = open_dispatcher(url, declare_queues=True)

    class Renamed:  # "next" goes to this test's own queue
        def dispatch(self, messages: list[OutgoingMessage]) -> None:
            dispatcher.dispatch(
                [
                    OutgoingMessage(
                        m.id,
                        next_queue if m.destination == "next" else m.destination,
                        m.body,
                        m.headers,
                    )
                    for m in messages
                ]
            )

    processor = OutboxProcessor(
        entities, MemoryDeduplicationStore(f"memory://{name}"), Renamed(), dead_letters="dlq"
    )
    return processor, entities


def test_a_pipeline_of_services_chains_through_rabbitmq(face: str, rabbitmq_server: Server) -> None:
    url, queue, following = rabbitmq_server.url, _queue(), _queue()
    with open_dispatcher(url, declare_queues=True) as upstream:
        upstream.dispatch(_msgs(queue, 10))
        upstream.dispatch(_msgs(queue, 1, first=4))  # a producer duplicate
    processor, entities = _processor(url, following)
    broker = opened_broker(face, url, queue=queue)
    try:
        kind = RabbitMQBroker if face == "sync" else AioPikaBroker
        assert isinstance(unwrapped(broker), kind)
        consumer = consumer_of(face, broker, processor, count, batch_size=4, wait=0.5)
        rounds = [consumer.run_once() for _ in range(4)]
        assert sum(r.acked for r in rounds) == 11
        assert not any(r.nacked for r in rounds)
        assert sum(r.outcomes.get("duplicate", 0) for r in rounds) == 1
        assert entities.load("o1").state["applied"] == [f"m{n}" for n in range(10)]
        assert broker.pending() == 0
        # the outputs are the next service's input, read with the same rules
        nxt = opened_broker(face, url, queue=following)
        try:
            got = _fetch_until(nxt, 10)
            assert len(got) == 10
            assert {d.headers["correlation_id"] for d in got} == {"o1"}
            assert all(d.deliveries == 1 for d in got)
            nxt.ack(got)
        finally:
            nxt.close()
    finally:
        broker.close()


def test_the_prefetch_window_bounds_what_a_consumer_holds(
    face: str, rabbitmq_server: Server, rabbitmq_channel: Any
) -> None:
    queue = _queue()
    with open_dispatcher(rabbitmq_server.url, declare_queues=True) as dispatcher:
        dispatcher.dispatch(_msgs(queue, 10))
    with opened_broker(face, rabbitmq_server.url, queue=queue, prefetch=3) as broker:
        first = _fetch_until(broker, 3)
        assert [d.headers["id"] for d in first] == ["m0", "m1", "m2"]
        assert broker.fetch(10, 0.2) == [], "more than the window was delivered"
        assert broker.pending() == 7
        broker.ack(first)
        second = _fetch_until(broker, 3)
        assert [d.headers["id"] for d in second] == ["m3", "m4", "m5"]
        broker.ack(second)


def _fetch_until(broker: Any, size: int) -> list[Any]:
    """Fetch until ``size`` deliveries came, at most 20 fetches: a fetch returns once the
    first delivery arrived, and the broker may send the rest in later frames."""
    got: list[Any] = []
    for _ in range(20):
        got += broker.fetch(10, 0.5)
        if len(got) >= size:
            break
    return got


def test_a_nack_requeues_and_a_classic_queue_only_says_redelivered(
    face: str,
    rabbitmq_server: Server,
) -> None:
    queue = _queue()
    with open_dispatcher(rabbitmq_server.url, declare_queues=True) as dispatcher:
        dispatcher.dispatch(_msgs(queue, 2))
    with opened_broker(face, rabbitmq_server.url, queue=queue) as broker:
        [one, two] = _fetch_until(broker, 2)
        assert (one.deliveries, one.token.redelivered) == (1, False)
        broker.nack([one])
        broker.ack([two])
        [again] = broker.fetch(10, 0.5)
        assert again.headers["id"] == "m0"
        assert again.token.redelivered
        assert again.deliveries is None  # a classic queue does not count
        broker.ack([again])
        broker.ack([again])  # idempotent: a second ack would make RabbitMQ close the channel
        broker.nack([one, two])  # settled already: nothing sent
        assert broker.fetch(10, 0.2) == []
        assert broker.pending() == 0


class Crash(BaseException):
    """What a consumer process killed by a message sees: nothing after it runs."""


def test_a_quorum_queue_counts_deliveries_and_max_deliveries_dead_letters(
    face: str, rabbitmq_server: Server, rabbitmq_channel: Any
) -> None:
    """m0 kills every consumer that runs it (its connection drops: RabbitMQ requeues,
    counted); m1, in flight in every crash, is processed once; m0 is dead-lettered
    after its runs alone exceed max_deliveries=2, without running the handler again."""
    url, queue = rabbitmq_server.url, _queue()
    rabbitmq_channel.queue_declare("dlq", durable=True)
    with open_dispatcher(url, declare_queues=True, queue_type="quorum") as dispatcher:
        dispatcher.dispatch(_msgs(queue, 2))
    processor, entities = _processor(url, _queue())
    runs: list[str] = []

    def killing(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        runs.append(message.id)
        if message.id == "m0":
            # a killed consumer; on asyncio, its task cancelled (nothing after it runs)
            raise Crash if face == "sync" else asyncio.CancelledError
        return count(state, message)

    crashes = 0
    while True:
        broker = opened_broker(face, url, queue=queue, queue_type="quorum")
        try:
            stats = consumer_of(
                face, broker, processor, killing, max_deliveries=2, wait=1.0
            ).run_once()
            if stats.acked == 2:
                break
        except (Crash, asyncio.CancelledError, concurrent.futures.CancelledError):
            crashes += 1
        finally:
            broker.close()  # the process is gone: what it held is requeued, counted
    assert crashes == 3 and runs.count("m0") == 3, "once in the batch, then twice alone"
    assert stats.outcomes == {"dead_lettered": 1, "processed": 1}
    assert entities.load("o1").state == {"applied": ["m1"]}
    method, _, body = rabbitmq_channel.basic_get("dlq", auto_ack=True)
    assert method is not None
    assert b"max_deliveries=2" in body
    with opened_broker(face, url, queue=queue, queue_type="quorum") as broker:
        assert broker.pending() == 0


def test_an_outage_of_the_stores_is_held_and_counts_no_delivery(
    face: str, rabbitmq_server: Server
) -> None:
    """The stores unreachable for many rounds with max_deliveries=2: the deliveries stay
    unacknowledged with the consumer (no requeue: x-delivery-count does not rise),
    nothing is dead-lettered, and they are processed once the stores answer."""
    url, queue = rabbitmq_server.url, _queue()
    with open_dispatcher(url, declare_queues=True, queue_type="quorum") as dispatcher:
        dispatcher.dispatch(_msgs(queue, 3))
    processor, entities = _processor(url, _queue())
    real = processor.dedup.processed_among, processor.dedup.has_been_processed

    def down(*args: Any) -> Any:
        raise StoreUnavailable("the store is down")

    processor.dedup.processed_among = down  # type: ignore[method-assign]
    processor.dedup.has_been_processed = down  # type: ignore[method-assign]
    with opened_broker(face, url, queue=queue, queue_type="quorum") as broker:
        consumer = consumer_of(face, broker, processor, count, max_deliveries=2, wait=1.0)
        for _ in range(5):
            stats = consumer.run_once()
            assert (stats.acked, stats.nacked) == (0, 0), "not requeued: not counted"
            assert stats.held == 3
        processor.dedup.processed_among, processor.dedup.has_been_processed = real  # type: ignore[method-assign]
        done = consumer.run_once()
        assert (done.acked, done.outcomes) == (3, {"processed": 3})
        assert entities.load("o1").state["applied"] == ["m0", "m1", "m2"]
        assert broker.pending() == 0


def _held_by_a_killed_consumer(url: str, queue: str, hold: int) -> None:
    """A consumer process fetches ``hold`` deliveries, says so, and is SIGKILLed."""
    code = (
        "import sys\n"
        "from dedupstore.consumers import open_broker\n"
        f"broker = open_broker({url!r}, queue={queue!r}, prefetch={hold})\n"
        "got = []\n"
        f"while len(got) < {hold}:\n"
        f"    got += broker.fetch({hold}, 1.0)\n"
        "print('holding', len(got), flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == f"holding {hold}\n".encode()
    finally:
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL


def test_what_a_killed_consumer_held_is_redelivered(face: str, rabbitmq_server: Server) -> None:
    url, queue = rabbitmq_server.url, _queue()
    with open_dispatcher(url, declare_queues=True) as dispatcher:
        dispatcher.dispatch(_msgs(queue, 8))
    _held_by_a_killed_consumer(url, queue, 5)
    with opened_broker(face, url, queue=queue) as survivor:
        got = _fetch_until(survivor, 8)
        assert sorted(d.headers["id"] for d in got) == [f"m{n}" for n in range(8)]
        redelivered = sorted(d.headers["id"] for d in got if d.token.redelivered)
        assert redelivered == [f"m{n}" for n in range(5)]
        survivor.ack(got)
        assert survivor.pending() == 0


def test_a_lost_connection_is_unavailable_then_reconnected(
    face: str,
    own_rabbitmq_server: RabbitMQServer,
) -> None:
    url, queue = own_rabbitmq_server.url, _queue()
    own_rabbitmq_server.declare_queues(queue)  # so that the kill below keeps it
    with open_dispatcher(url, declare_queues=True) as dispatcher:
        dispatcher.dispatch(_msgs(queue, 2))
    broker = opened_broker(
        face, url, queue=queue, prefetch=1, connect_timeout=2, timeout=2, retries=0
    )
    try:
        held = broker.fetch(1, 1.0)
        own_rabbitmq_server.kill()
        with pytest.raises(StoreUnavailable):
            broker.fetch(10, 0.5)
        own_rabbitmq_server.restart()
        broker.ack(held)  # a token of the lost channel: ignored (the broker requeued it)
        got = []
        for _ in range(2):  # one at a time: the window is 1
            [delivery] = _fetch_until(broker, 1)  # the restarted queue may take a while
            broker.ack([delivery])
            got.append(delivery)
        assert [d.headers["id"] for d in got] == ["m0", "m1"]
        assert got[0].token.redelivered, "held when the connection was lost: requeued"
        assert all(isinstance(d.token, RabbitMQToken) for d in got)
        assert {d.token.generation for d in got} == {held[0].token.generation + 1}
        assert broker.pending() == 0
    finally:
        broker.close()


@pytest.mark.timeout(120)
def test_a_broker_that_never_answers_is_unavailable_within_the_deadline(
    face: str, rabbitmq_server: Server
) -> None:
    """Against a broker that stops answering (its open connection frozen, new ones
    accepted and never answered), each call needing an answer raises ``StoreUnavailable``
    within ``(retries + 1) x (connect_timeout + timeout)``: ``pending`` on the frozen
    connection, then ``fetch`` connecting again; a fetch that gets nothing within its
    ``wait`` on a live-looking connection returns nothing. Once the broker answers again,
    the consumer connects again and gets what it held (requeued)."""
    url, queue = rabbitmq_server.url, _queue()
    with open_dispatcher(url, declare_queues=True) as dispatcher:
        dispatcher.dispatch(_msgs(queue, 1))
    deadline = (0 + 1) * (0.5 + 0.5)
    with TcpProxy.for_url(url) as proxy:
        broker = opened_broker(
            face, proxy.url(url), queue=queue, connect_timeout=0.5, timeout=0.5, retries=0
        )
        try:
            [held] = _fetch_until(broker, 1)
            proxy.freeze()
            proxy.outage("hang")
            began = time.monotonic()
            assert broker.fetch(10, 0.2) == []  # nothing arrives on a frozen connection
            with pytest.raises(StoreUnavailable):
                broker.pending()
            took = time.monotonic() - began
            assert took < 0.2 + deadline + 3.0, took  # slack for a busy machine
            proxy.reset()
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                broker.fetch(10, 0.2)  # connecting again: never answered
            took = time.monotonic() - began
            assert took < deadline + 3.0, took
            proxy.restore()
            got = _fetch_until(broker, 1)
            assert [d.headers["id"] for d in got] == [held.headers["id"]]
            assert got[0].token.redelivered, "held when the connection froze: requeued"
            broker.ack(got)
        finally:
            broker.close()


@pytest.mark.timeout(120)
def test_an_async_call_cancelled_in_flight_leaves_the_broker_whole(
    rabbitmq_server: Server,
) -> None:
    """A task cancelled inside an aio-pika call waiting for the broker's answer (the
    connection frozen) ends within the 2 s it gives a connection to close, not at its
    deadline; the next call connects again: what the lost connection held comes back
    redelivered with the rest, and an ack of the lost channel's token is ignored."""
    url, queue = rabbitmq_server.url, _queue()
    with open_dispatcher(url, declare_queues=True) as dispatcher:
        dispatcher.dispatch(_msgs(queue, 2))

    async def main(proxy: TcpProxy) -> None:
        broker = await AioPikaBroker(proxy.url(url), queue=queue, prefetch=1, timeout=5).open()
        try:
            held = await broker.fetch(1, 2.0)
            assert [d.headers["id"] for d in held] == ["m0"]
            await asyncio.to_thread(proxy.freeze)
            await cancelled_in_flight(broker.pending(), after=0.2, within=3.0)
            await asyncio.to_thread(proxy.restore)
            await broker.ack(held)  # a token of the dropped channel: ignored
            got = []
            for _ in range(20):
                fetched = await broker.fetch(1, 0.5)
                await broker.ack(fetched)
                got += fetched
                if len(got) == 2:
                    break
            assert [d.headers["id"] for d in got] == ["m0", "m1"]
            assert got[0].token.redelivered, "held when the call was cancelled: requeued"
            assert await broker.pending() == 0
        finally:
            await broker.close()

    with TcpProxy.for_url(url) as proxy:
        asyncio.run(main(proxy))


def test_a_missing_queue_without_create_is_no_such_store(
    face: str, rabbitmq_server: Server
) -> None:
    for options in ({"create": False}, {"must_exist": True}):
        with pytest.raises(ConfigurationError, match=r"no such store: queue 'q-"):
            opened_broker(face, rabbitmq_server.url, queue=_queue(), **options)


def test_bad_options_are_refused_before_any_io(
    face: str,
) -> None:
    nobody = f"amqp://{HOST}:{free_port()}/%2F"  # nothing listens: any I/O would be unavailable
    for options, match in [
        ({}, "needs queue="),
        ({"queue": "q", "prefetch": 0}, "prefetch"),
        ({"queue": "q", "queue_type": "stream"}, "classic, quorum"),
        ({"queue": "q" * 256}, "255 UTF-8 bytes"),
        ({"queue": "q", "lease": 1}, "unknown option"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            opened_broker(face, nobody, **options)
    with pytest.raises(ConfigurationError, match="one virtual host"):
        opened_broker(face, f"amqp://{HOST}:{free_port()}/a/b?queue=q")


@runs("asyncio-consumer")
def test_the_asyncio_consumer_example_runs(tmp_path: Path, rabbitmq_server: Server) -> None:
    env = user_env(AMQP_URL=rabbitmq_server.url)
    assert succeeded(run_python(example("asyncio-consumer"), tmp_path, env=env)) == [
        "3 {'processed': 2, 'duplicate': 1}",
        "{'balance': 750}",
    ]
