"""The RabbitMQ dispatcher (publisher confirms) against a real broker."""

from __future__ import annotations

import multiprocessing
import pickle
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from dedupstore import (
    ConfigurationError,
    MessageTooLarge,
    StoreUnavailable,
    open_dispatcher,
)
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.backends.rabbitmq import RabbitMQDispatcher
from dedupstore.entities import OutgoingMessage
from dedupstore.outbox import Message, OutboxProcessor, Send
from tests.proxy import TcpProxy
from tests.servers import HOST, RabbitMQServer, Server, free_port

pytestmark = pytest.mark.rabbitmq

#: Options of the dispatchers whose deadline is tested, and the deadline they make.
TIMEOUT, CONNECT_TIMEOUT, RETRIES = 1.0, 2.0, 1
DEADLINE = (RETRIES + 1) * (CONNECT_TIMEOUT + TIMEOUT)
#: Added to the bound: thread scheduling and Python on a shared, loaded machine.
SLACK = 3.0


def _msg(mid: str, destination: str, body: Any = None, **headers: str) -> OutgoingMessage:
    return OutgoingMessage(mid, destination, {"mid": mid} if body is None else body, headers)


def _queue() -> str:
    return f"q-{uuid.uuid4().hex}"


@pytest.fixture
def admin(rabbitmq_server: Server) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    """A plain pika channel on the broker, to declare queues and read them back."""
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_server.url))
    try:
        yield connection.channel()
    finally:
        connection.close()


def _drain(channel: Any, queue: str) -> list[tuple[Any, bytes]]:
    """Every message in ``queue`` now: (properties, body), acknowledged."""
    got = []
    while True:
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return got
        got.append((properties, body))


def _ids(channel: Any, queue: str) -> list[str]:
    return [properties.message_id for properties, _ in _drain(channel, queue)]


def test_dispatch_returns_once_confirmed_and_the_messages_are_in_the_queue(
    rabbitmq_server: Server, admin: Any
) -> None:
    queue = _queue()
    admin.queue_declare(queue, durable=True)
    with open_dispatcher(rabbitmq_server.url) as dispatcher:
        assert isinstance(dispatcher, RabbitMQDispatcher)
        dispatcher.dispatch([_msg("a", queue, {"n": [1, 2]}, trace="t-1"), _msg("b", queue)])
        dispatcher.dispatch([])  # no I/O, nothing sent
    [(first, body), (second, _)] = _drain(admin, queue)
    assert (first.message_id, second.message_id) == ("a", "b")
    assert body == b'{"n":[1,2]}'
    assert first.headers == {"trace": "t-1"}
    assert second.headers is None
    assert first.delivery_mode == 2  # persistent
    assert first.content_type == "application/json"


def test_declare_queues_makes_durable_queues_of_the_chosen_type(
    rabbitmq_server: Server, admin: Any
) -> None:
    classic, quorum = _queue(), _queue()
    with open_dispatcher(rabbitmq_server.url, declare_queues=True) as dispatcher:
        dispatcher.dispatch([_msg("c-1", classic)])
    with open_dispatcher(
        f"{rabbitmq_server.url}?declare_queues=true&queue_type=quorum"
    ) as dispatcher:
        dispatcher.dispatch([_msg("q-1", quorum)])
    assert _ids(admin, classic) == ["c-1"]
    assert _ids(admin, quorum) == ["q-1"]
    # the quorum queue is durable and of that type: redeclaring it otherwise is refused
    admin.queue_declare(quorum, durable=True, arguments={"x-queue-type": "quorum"})
    # a queue that exists with other arguments: PRECONDITION_FAILED, a configuration error
    with (
        open_dispatcher(rabbitmq_server.url, declare_queues=True) as dispatcher,
        pytest.raises(ConfigurationError, match="PRECONDITION_FAILED"),
    ):
        dispatcher.dispatch([_msg("c-2", quorum)])


def test_a_named_exchange_routes_by_destination(rabbitmq_server: Server, admin: Any) -> None:
    exchange, queue = f"x-{uuid.uuid4().hex}", _queue()
    admin.exchange_declare(exchange, "direct", durable=True)
    admin.queue_declare(queue, durable=True)
    admin.queue_bind(queue, exchange, routing_key="orders")
    with open_dispatcher(rabbitmq_server.url, exchange=exchange) as dispatcher:
        dispatcher.dispatch([_msg("o-1", "orders")])
        with pytest.raises(ConfigurationError, match=r"unroutable.*'elsewhere'.*bind"):
            dispatcher.dispatch([_msg("o-2", "elsewhere")])
    assert _ids(admin, queue) == ["o-1"]
    with pytest.raises(ConfigurationError, match="no exchange 'missing'"):
        open_dispatcher(rabbitmq_server.url, exchange="missing")


def test_unroutable_raises_and_the_outbox_keeps_the_messages(
    rabbitmq_server: Server, admin: Any
) -> None:
    queue, name = _queue(), uuid.uuid4().hex
    entities = MemoryEntityStore(f"memory://{name}")
    processor = OutboxProcessor(
        entities, MemoryDeduplicationStore(f"memory://{name}"), open_dispatcher(rabbitmq_server.url)
    )

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return {"n": state.get("n", 0) + 1}, [Send(queue, {"for": message.id})]

    with pytest.raises(ConfigurationError, match=r"unroutable.*declare the queue"):
        processor.process(Message("m-1", "order-1", {}), handler)
    assert len(entities.load("order-1").outbox) == 1, "the outbox was cleaned up"
    admin.queue_declare(queue, durable=True)  # the topology fixed: dispatched again
    assert processor.process(Message("m-1", "order-1", {}), handler).outcome == "redispatched"
    assert not entities.load("order-1").outbox
    [(properties, body)] = _drain(admin, queue)
    assert body == b'{"for":"m-1"}'
    assert properties.message_id


def test_a_nack_is_unavailable(rabbitmq_server: Server, admin: Any) -> None:
    queue = _queue()
    admin.queue_declare(
        queue, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    with open_dispatcher(rabbitmq_server.url) as dispatcher:
        dispatcher.dispatch([_msg("n-1", queue)])
        with pytest.raises(StoreUnavailable, match=r"refused outgoing message 'n-2'.*nack"):
            dispatcher.dispatch([_msg("n-2", queue)])
        assert _ids(admin, queue) == ["n-1"]
        dispatcher.dispatch([_msg("n-3", queue)])  # the same object goes on
    assert _ids(admin, queue) == ["n-3"]


def test_bad_urls_and_options_are_refused_before_any_io() -> None:
    nobody = f"amqp://{HOST}:{free_port()}/%2F"  # nothing listens: any I/O would be unavailable
    for url, options, match in [
        (f"amqp://{HOST}:{free_port()}/a/b", {}, "one virtual host"),
        ("amqp:///%2F", {}, "a host is needed"),
        (nobody, {"exchange": "x" * 256}, "longer than 255"),
        (nobody, {"exchange": "x", "declare_queues": True}, "default exchange"),
        (nobody, {"queue_type": "stream"}, "classic, quorum"),
        (nobody, {"ssl_ca_certs": "/ca.pem"}, "amqps"),
        (nobody, {"timeout": -1}, "timeout"),
        (nobody, {"no_such_option": 1}, "unknown option"),
        (f"{nobody}?retries=many", {}, "retries"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            RabbitMQDispatcher.check_options(url, **options)
        with pytest.raises(ConfigurationError, match=match):
            open_dispatcher(url, **options)


def test_an_overlong_destination_is_refused_before_any_io(rabbitmq_server: Server) -> None:
    with (
        open_dispatcher(rabbitmq_server.url) as dispatcher,
        pytest.raises(ValueError, match="255 UTF-8 bytes of an AMQP routing key"),
    ):
        dispatcher.dispatch([_msg("a", _queue()), _msg("b", "d" * 256)])


def test_wrong_credentials_are_a_configuration_error(rabbitmq_server: Server) -> None:
    with pytest.raises(ConfigurationError) as info:
        open_dispatcher(rabbitmq_server.url, password="definitely-wrong")
    assert "definitely-wrong" not in str(info.value)


def test_unreachable_broker_is_unavailable(rabbitmq_server: Server) -> None:
    with pytest.raises(StoreUnavailable):
        open_dispatcher(f"amqp://{HOST}:{free_port()}/%2F", connect_timeout=2)


def _dispatch_in_child(dispatcher: RabbitMQDispatcher, queue: str) -> None:
    dispatcher.dispatch([_msg("from-child", queue)])


def test_pickled_copy_and_forked_child_use_their_own_connection(
    rabbitmq_server: Server, admin: Any
) -> None:
    queue = _queue()
    admin.queue_declare(queue, durable=True)
    with open_dispatcher(rabbitmq_server.url, retries=0) as dispatcher:
        dispatcher.dispatch([_msg("parent-1", queue)])
        copy = pickle.loads(pickle.dumps(dispatcher))
        copy.dispatch([_msg("copy", queue)])
        copy.close()
        child = multiprocessing.get_context("fork").Process(
            target=_dispatch_in_child, args=(dispatcher, queue)
        )
        child.start()
        child.join(60)
        assert child.exitcode == 0
        dispatcher.dispatch([_msg("parent-2", queue)])  # the parent's connection is intact
    assert _ids(admin, queue) == ["parent-1", "copy", "from-child", "parent-2"]


# ---------------------------------------------------------------- a broker that goes away


def _options() -> dict[str, Any]:
    return {"timeout": TIMEOUT, "connect_timeout": CONNECT_TIMEOUT, "retries": RETRIES}


@pytest.fixture
def stopped(own_rabbitmq_server: RabbitMQServer) -> Iterator[RabbitMQDispatcher]:
    """A dispatcher that has dispatched, on a broker that is then killed; after the
    test the broker restarts and the same dispatcher works again."""
    own_rabbitmq_server.declare_queues("kept")  # so that the kill keeps it
    dispatcher = open_dispatcher(own_rabbitmq_server.url, declare_queues=True, **_options())
    assert isinstance(dispatcher, RabbitMQDispatcher)
    assert dispatcher._deadline_seconds() == DEADLINE
    dispatcher.dispatch([_msg("before", "kept")])
    own_rabbitmq_server.kill()
    yield dispatcher
    own_rabbitmq_server.restart()
    dispatcher.dispatch([_msg("after", "kept")])
    dispatcher.close()
    connection = pika.BlockingConnection(pika.URLParameters(own_rabbitmq_server.url))
    try:
        ids = _ids(connection.channel(), "kept")
        assert ids == ["before", "after"], f"lost or duplicated across the crash: {ids}"
    finally:
        connection.close()


@pytest.mark.timeout(DEADLINE + SLACK, func_only=True)
def test_a_stopped_broker_is_unavailable_within_the_deadline(
    stopped: RabbitMQDispatcher,
) -> None:
    with pytest.raises(StoreUnavailable) as info:
        stopped.dispatch([_msg("during", "kept")])
    assert "\n" not in str(info.value)


@pytest.fixture
def frozen(rabbitmq_server: Server) -> Iterator[RabbitMQDispatcher]:
    """A dispatcher behind a proxy that freezes after a first dispatch (the broker stops
    answering on the open connection and new ones hang); restored after the test."""
    queue = _queue()
    with TcpProxy.for_url(rabbitmq_server.url) as proxy:
        dispatcher = open_dispatcher(
            proxy.url(rabbitmq_server.url), declare_queues=True, **_options()
        )
        assert isinstance(dispatcher, RabbitMQDispatcher)
        dispatcher.dispatch([_msg("before", queue)])
        proxy.freeze()
        proxy.outage("hang")
        try:
            yield dispatcher
        finally:
            proxy.restore()
        dispatcher.dispatch([_msg("after", queue)])
        dispatcher.close()


@pytest.mark.timeout(DEADLINE + SLACK, func_only=True)
def test_a_frozen_broker_is_unavailable_within_the_deadline(
    frozen: RabbitMQDispatcher,
) -> None:
    with pytest.raises(StoreUnavailable):
        frozen.dispatch([_msg("during", _queue())])


def test_a_message_over_the_brokers_bounds_is_refused_before_any_io(
    rabbitmq_server: Server, admin: Any
) -> None:
    """Headers travel in one frame (``frame_max``, 128 KiB): larger ones would close the
    connection on every attempt (a wedge), so they are refused, none of the batch sent;
    the body's bound is the broker's ``max_message_size`` (128 MiB on 3.x)."""
    queue = _queue()
    admin.queue_declare(queue, durable=True)
    with open_dispatcher(rabbitmq_server.url) as dispatcher:
        assert dispatcher.max_message_bytes == 128 * 1024 * 1024
        assert dispatcher.max_header_bytes == 127 * 1024
        heavy = _msg("heavy", queue, big="h" * 200_000)
        with pytest.raises(MessageTooLarge, match="headers of outgoing message 'heavy'") as e:
            dispatcher.dispatch([_msg("a", queue), heavy])
        assert (e.value.outgoing_id, e.value.bound) == ("heavy", 127 * 1024)
        assert _ids(admin, queue) == [], "none of the batch was sent"
        dispatcher.dispatch([_msg("b", queue, big="h" * 100_000)])  # within the frame
        assert _ids(admin, queue) == ["b"]
    with open_dispatcher(rabbitmq_server.url, max_message_bytes=1000) as lowered:
        assert lowered.max_message_bytes == 1000
        with pytest.raises(MessageTooLarge, match="'big' is 1010 bytes"):
            lowered.dispatch([_msg("a", queue), _msg("big", queue, {"b": "x" * 1000})])
        assert _ids(admin, queue) == []


def test_the_processor_sets_aside_what_the_broker_would_refuse(
    rabbitmq_server: Server, admin: Any
) -> None:
    queue, letters = _queue(), _queue()
    for name in (queue, letters):
        admin.queue_declare(name, durable=True)
    url = f"memory://{uuid.uuid4().hex}"
    with open_dispatcher(rabbitmq_server.url) as dispatcher:
        processor = OutboxProcessor(
            MemoryEntityStore(url), MemoryDeduplicationStore(url), dispatcher, dead_letters=letters
        )

        def tag(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
            return state, [Send(queue, {}, {"tag": "t" * message.body["size"]})]

        messages = [Message("big", "acct", {"size": 200_000}), Message("ok", "b", {"size": 1})]
        results = processor.process_batch(messages, tag)
    assert [r.outcome for r in results] == ["dead_lettered", "processed"]
    assert len(_ids(admin, queue)) == 1
    [(_, body)] = _drain(admin, letters)
    assert b"MessageTooLarge" in body
