"""pytest fixtures providing real database servers (see ``tests/servers.py``).

Session fixtures start one server each, or attach to an already-running instance when
its environment variable is set:

=====================  ==========================================================
fixture                environment variable
=====================  ==========================================================
``redis_server``       ``DEDUPSTORE_TEST_REDIS_URL``
``postgres_server``    ``DEDUPSTORE_TEST_POSTGRES_URL``
``dynamodb_server``    ``DEDUPSTORE_TEST_DYNAMODB_ENDPOINT``
``cosmos_server``      ``DEDUPSTORE_TEST_COSMOS_ENDPOINT`` (+ ``DEDUPSTORE_TEST_COSMOS_KEY``)
``rabbitmq_server``    ``DEDUPSTORE_TEST_RABBITMQ_URL``
=====================  ==========================================================

External instances cannot be killed or restarted; tests that crash a server use
``own_redis_server`` / ``own_postgres_server`` / ``own_rabbitmq_server``, a fresh process
per test.  A server that cannot start makes the tests using it error out (never skip),
with its log tail. ``rabbitmq_channel``: a pika channel on ``rabbitmq_server``, per test.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from tests.servers import (
    COSMOS_EMULATOR_KEY,
    CosmosEndpoint,
    CosmosServer,
    DynamoDBEndpoint,
    ExternalCosmos,
    ExternalDynamoDB,
    ExternalServer,
    MotoServer,
    PostgresServer,
    RabbitMQServer,
    RedisServer,
    Server,
)

__all__ = [
    "ENV_COSMOS_ENDPOINT",
    "ENV_COSMOS_KEY",
    "ENV_DYNAMODB_ENDPOINT",
    "ENV_POSTGRES_URL",
    "ENV_RABBITMQ_URL",
    "ENV_REDIS_URL",
    "cosmos_server",
    "dynamodb_server",
    "own_postgres_server",
    "own_rabbitmq_server",
    "own_redis_server",
    "postgres_server",
    "rabbitmq_channel",
    "rabbitmq_server",
    "redis_server",
]

ENV_REDIS_URL = "DEDUPSTORE_TEST_REDIS_URL"
ENV_POSTGRES_URL = "DEDUPSTORE_TEST_POSTGRES_URL"
ENV_DYNAMODB_ENDPOINT = "DEDUPSTORE_TEST_DYNAMODB_ENDPOINT"
ENV_COSMOS_ENDPOINT = "DEDUPSTORE_TEST_COSMOS_ENDPOINT"
ENV_COSMOS_KEY = "DEDUPSTORE_TEST_COSMOS_KEY"
ENV_RABBITMQ_URL = "DEDUPSTORE_TEST_RABBITMQ_URL"

S = TypeVar("S", bound=Server)


def _serve(env_var: str, external: Callable[[str], S], local: Callable[[], S]) -> Iterator[S]:
    """Yield the external server named by ``env_var`` if set, else a started local one."""
    address = os.environ.get(env_var, "").strip()
    if address:
        yield external(address)
        return
    with local() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Server]:
    """A Redis server for the session (AOF, ``appendfsync always``)."""
    yield from _serve(ENV_REDIS_URL, lambda url: ExternalServer("redis", url), RedisServer)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Server]:
    """A PostgreSQL server for the session; ``url`` carries user ``dedup``/``dedup``."""
    yield from _serve(ENV_POSTGRES_URL, lambda url: ExternalServer("postgres", url), PostgresServer)


@pytest.fixture(scope="session")
def dynamodb_server() -> Iterator[DynamoDBEndpoint]:
    """A DynamoDB endpoint (moto_server) with ``client_env`` / ``client_kwargs``."""
    yield from _serve(ENV_DYNAMODB_ENDPOINT, ExternalDynamoDB, MotoServer)


@pytest.fixture(scope="session")
def cosmos_server() -> Iterator[CosmosEndpoint]:
    """A Cosmos DB endpoint (cosmosdb-server over HTTP) with ``key`` / ``client_kwargs``."""
    key = os.environ.get(ENV_COSMOS_KEY, "").strip() or COSMOS_EMULATOR_KEY
    yield from _serve(ENV_COSMOS_ENDPOINT, lambda url: ExternalCosmos(url, key), CosmosServer)


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[Server]:
    """A RabbitMQ broker for the session; ``url`` is ``amqp://guest:guest@.../%2F``."""
    yield from _serve(ENV_RABBITMQ_URL, lambda url: ExternalServer("rabbitmq", url), RabbitMQServer)


@pytest.fixture
def rabbitmq_channel(rabbitmq_server: Server) -> Iterator[Any]:
    """A pika channel on the session's broker (to declare queues and read messages
    back), its connection closed after the test."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_server.url))
    try:
        yield connection.channel()
    finally:
        connection.close()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A fresh Redis process owned by this test (for kill/restart), whatever the env says."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_postgres_server() -> Iterator[PostgresServer]:
    """A fresh PostgreSQL cluster owned by this test (for kill/restart), whatever the env says."""
    with PostgresServer() as server:
        yield server


@pytest.fixture
def own_rabbitmq_server() -> Iterator[RabbitMQServer]:
    """A fresh RabbitMQ broker owned by this test (for kill/restart), whatever the env says."""
    with RabbitMQServer() as server:
        yield server
