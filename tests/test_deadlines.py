"""Every call ends within its backend's documented deadline, whatever the server does.

Each network backend is reached through a :class:`~tests.proxy.TcpProxy`; after a
first successful call the proxy freezes the open connections (they stay open,
nothing arrives any more) and holds every new one unanswered (``outage("hang")``):
a server that stopped answering. A call must then raise ``StoreUnavailable``
within the deadline its backend documents (plus a generous slack for a loaded
machine: this checks a documented bound, it measures no performance), and work
again once the proxy is restored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dedupstore import open_dispatcher, open_entity_store, open_store
from dedupstore.client import Client
from dedupstore.entities import Entity, EntityStore, OutgoingMessage
from dedupstore.errors import StoreUnavailable
from dedupstore.store import DeduplicationStore
from tests.proxy import TcpProxy
from tests.servers import CosmosEndpoint, DynamoDBEndpoint, Server

#: Small timeouts keep the test short; the deadline is computed from them.
TIMEOUT, CONNECT_TIMEOUT, RETRIES = 0.5, 0.5, 2
#: Added to the bound: thread scheduling and Python on a shared, loaded machine.
SLACK = 2.0


@dataclass
class Case:
    """A call to make during the outage: ``prepare()`` (before it) gives its argument."""

    name: str
    prepare: Callable[[], Any]
    call: Callable[[Any], object]


def _cases(store: DeduplicationStore, entities: EntityStore) -> list[Case]:
    tag = uuid.uuid4().hex

    def loaded() -> Entity:
        entity = entities.load(f"entity-{tag}")
        entity.state["n"] = entity.state.get("n", 0) + 1
        return entity

    return [
        Case("add", lambda: f"id-{uuid.uuid4().hex}", store.add),
        Case("processed_among", lambda: [f"a-{tag}", f"b-{tag}"], store.processed_among),
        Case("load_many", lambda: [f"e1-{tag}", f"e2-{tag}"], entities.load_many),
        Case("save", loaded, entities.save),
    ]


def _check_deadline(proxy: TcpProxy, clients: list[Client], cases: list[Case]) -> None:
    """Each case fails within every client's deadline during the outage, then works."""
    bounds = {client._deadline_seconds() for client in clients}
    assert len(bounds) == 1, bounds  # the same options give the same deadline
    bound = bounds.pop()
    assert bound is not None
    for case in cases:
        case.call(case.prepare())  # a connection is open and has answered
        argument = case.prepare()
        proxy.freeze()
        proxy.outage("hang")
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                case.call(argument)
            elapsed = time.monotonic() - started
        finally:
            proxy.restore()
        assert elapsed <= bound + SLACK, f"{case.name}: {elapsed:.2f} s > {bound:.2f} s"
        case.call(case.prepare())  # works again


def _options() -> dict[str, Any]:
    return {"timeout": TIMEOUT, "connect_timeout": CONNECT_TIMEOUT, "retries": RETRIES}


@pytest.fixture
def closing() -> Iterator[list[Client]]:
    opened: list[Client] = []
    yield opened
    for client in opened:
        client.close()


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_redis(redis_server: Server, closing: list[Client]) -> None:
    with TcpProxy.for_url(redis_server.url) as proxy:
        url, prefix = proxy.url(redis_server.url), f"t-{uuid.uuid4().hex}:"
        store = open_store(url, key_prefix=f"{prefix}d:", **_options())
        entities = open_entity_store(url, key_prefix=f"{prefix}e:", **_options())
        dispatcher = open_dispatcher(url, key_prefix=f"{prefix}o:", **_options())
        closing += [store, entities, dispatcher]
        assert store._deadline_seconds() == CONNECT_TIMEOUT + (RETRIES + 1) * TIMEOUT
        message = OutgoingMessage(f"m-{prefix}", "queue", {"n": 1})
        dispatch = Case("dispatch", lambda: [message], dispatcher.dispatch)  # type: ignore[attr-defined]
        _check_deadline(proxy, [store, entities, dispatcher], [*_cases(store, entities), dispatch])


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_postgres(postgres_server: Server, closing: list[Client]) -> None:
    with TcpProxy.for_url(postgres_server.url) as proxy:
        url, suffix = proxy.url(postgres_server.url), uuid.uuid4().hex[:12]
        options = {"timeout": TIMEOUT, "connect_timeout": CONNECT_TIMEOUT, "create": True}
        store = open_store(url, table=f"deadline_d_{suffix}", **options)
        entities = open_entity_store(url, table=f"deadline_e_{suffix}", **options)
        closing += [store, entities]
        assert store._deadline_seconds() == CONNECT_TIMEOUT + TIMEOUT + min(1.0, TIMEOUT / 2)
        _check_deadline(proxy, [store, entities], _cases(store, entities))


@pytest.mark.dynamodb
@pytest.mark.timeout(120)
def test_dynamodb(dynamodb_server: DynamoDBEndpoint, closing: list[Client]) -> None:
    with TcpProxy.for_url(dynamodb_server.endpoint_url) as proxy:
        suffix = uuid.uuid4().hex[:12]
        query = (
            f"region={dynamodb_server.region}&endpoint_url={proxy.url(dynamodb_server.url)}"
            "&aws_access_key_id=testing&aws_secret_access_key=testing&create=true"
        )
        store = open_store(f"dynamodb://deadline-d-{suffix}?{query}", **_options())
        entities = open_entity_store(f"dynamodb://deadline-e-{suffix}?{query}", **_options())
        closing += [store, entities]
        assert store._deadline_seconds() == CONNECT_TIMEOUT + (RETRIES + 1) * TIMEOUT
        _check_deadline(proxy, [store, entities], _cases(store, entities))


@pytest.mark.cosmos
@pytest.mark.timeout(120)
def test_cosmos(cosmos_server: CosmosEndpoint, closing: list[Client]) -> None:
    with TcpProxy.for_url(cosmos_server.endpoint_url) as proxy:
        netloc = proxy.url(cosmos_server.url).split("://", 1)[1].rstrip("/")
        query = (
            "tls=false&endpoint_discovery=false&create=true"
            "&allow_weak_consistency_for_emulator_only=true"
        )
        database = f"deadline-{uuid.uuid4().hex[:12]}"
        key = {"key": cosmos_server.key}
        store = open_store(f"cosmos://{netloc}/{database}/d?{query}", **key, **_options())
        entities = open_entity_store(f"cosmos://{netloc}/{database}/e?{query}", **key, **_options())
        closing += [store, entities]
        assert store._deadline_seconds() == CONNECT_TIMEOUT + (RETRIES + 1) * TIMEOUT
        _check_deadline(proxy, [store, entities], _cases(store, entities))
