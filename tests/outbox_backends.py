"""A deduplication store and an entity store of one backend, fresh for one test.

The fixture ``outbox_backend`` is parametrized over every backend (marks included);
each test gets factories that open new clients of the same fresh pair of
tables / key prefixes / containers, on the real servers of the session.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from dedupstore.client import Client, ProcessLocal
from dedupstore.entities import EntityStore
from dedupstore.registry import open_url
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenStore
from tests.servers import RedisServer

BACKENDS = ("memory", "sqlite", "postgres", "redis", "dynamodb", "cosmos")


@dataclass
class OutboxBackend:
    """Factories of clients of one fresh entity store, deduplication store and token
    store."""

    name: str
    entities_url: str
    dedup_url: str
    options: dict[str, Any]
    tokens_url: str = ""

    def entities(self, **options: Any) -> EntityStore:
        """A new entity store client."""
        return open_url("entity_store", self.entities_url, **{**self.options, **options})

    def dedup(self, **options: Any) -> DeduplicationStore:
        """A new deduplication store client."""
        return open_url("store", self.dedup_url, **{**self.options, **options})

    def tokens(self, **options: Any) -> TokenStore:
        """A new token store client."""
        return open_url("token_store", self.tokens_url, **{**self.options, **options})


def backend_params(names: tuple[str, ...] = BACKENDS) -> list[Any]:
    """``pytest.param`` per backend, with its mark."""
    return [pytest.param(name, marks=getattr(pytest.mark, name), id=name) for name in names]


def _aws(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="session")
def unsynced_redis_server() -> Iterator[RedisServer]:
    """A Redis server with ``appendfsync no``: for the algorithm's tests, not durability ones."""
    with RedisServer(appendfsync="no") as server:
        yield server


@pytest.fixture
def outbox_backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[OutboxBackend]:
    """The backend named by the test's parameter, on fresh storage."""
    name: str = request.param
    tag = uuid.uuid4().hex[:12]
    cleanup: list[Callable[[], None]] = []
    if name == "memory":
        backend = OutboxBackend(name, f"memory://{tag}", f"memory://{tag}", {}, f"memory://{tag}")
    elif name == "sqlite":
        # synchronous=OFF: these tests check the algorithm, not the disk (power loss
        # is not simulated); it keeps thousands of schedules fast.
        url = f"sqlite:///{tmp_path}/outbox.db"
        backend = OutboxBackend(name, url, url, {"synchronous": "OFF"}, url)
    elif name == "postgres":
        server = request.getfixturevalue("postgres_server")
        backend = OutboxBackend(
            name,
            f"{server.url}?table=ent_{tag}&create=true",
            f"{server.url}?table=dedup_{tag}&create=true",
            {},
            f"{server.url}?table=tok_{tag}&create=true",
        )
        cleanup.append(
            lambda: _drop_postgres(server.url, [f"ent_{tag}", f"dedup_{tag}", f"tok_{tag}"])
        )
    elif name == "redis":
        server = request.getfixturevalue("unsynced_redis_server")
        backend = OutboxBackend(
            name,
            f"{server.url}?key_prefix=ent{tag}:",
            f"{server.url}?key_prefix=dd{tag}:",
            {},
            f"{server.url}?key_prefix=tk{tag}:",
        )
    elif name == "dynamodb":
        _aws(monkeypatch)
        server = request.getfixturevalue("dynamodb_server")
        query = f"region={server.region}&endpoint_url={server.endpoint_url}&create=true"
        backend = OutboxBackend(
            name,
            f"dynamodb://ent-{tag}?{query}",
            f"dynamodb://dd-{tag}?{query}",
            {},
            f"dynamodb://tk-{tag}?{query}",
        )
    elif name == "cosmos":
        server = request.getfixturevalue("cosmos_server")
        netloc = urlsplit(server.endpoint_url).netloc
        tls = "true" if server.endpoint_url.startswith("https") else "false"
        query = (
            f"tls={tls}&endpoint_discovery=false&allow_weak_consistency_for_emulator_only=true"
            "&create=true"
        )
        base = f"cosmos://{netloc}/dedupstore-outbox-tests"
        backend = OutboxBackend(
            name,
            f"{base}/ent-{tag}?{query}",
            f"{base}/dd-{tag}?{query}",
            {"key": server.key},
            f"{base}/tk-{tag}?{query}",
        )
    else:  # pragma: no cover - a typo in a parametrization
        raise ValueError(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulator's weak-consistency warning
        # create the storage once, before any race (patient: a loaded machine once took
        # over PostgreSQL's 5 s connect_timeout here, in two workers at once)
        backend.entities(**patient(name)).close()
        backend.dedup(**patient(name)).close()
    yield backend
    for step in cleanup:
        step()


def _drop_postgres(url: str, tables: list[str]) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        for table in tables:
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')


def own_connection(client: Client) -> Any:
    """Give ``client`` a connection no other client shares, and return it: a test may
    then patch the connection's methods without reaching any other client."""
    kind = client.connection_class
    assert kind is not None and client._connection_handle is not None
    client._connection_handle.close()
    url, opts = client.store_url, client.options
    client._connection_handle = ProcessLocal(
        lambda: kind(url, opts), kind.close, key=("own", id(client))
    )
    return client.connection


#: Seconds a store call (and a connect) of an exhaustive exploration may take.
PATIENT_TIMEOUT = 60


def patient(name: str) -> dict[str, float]:
    """The options that make a backend's clients patient in an exhaustive exploration,
    which checks the algorithm, not deadlines: on a loaded 2-core machine a server
    stalled for seconds twice in thousands of schedules (a Redis save re-sent, a
    PostgreSQL statement cut at 10 s), and full runs timed out opening a PostgreSQL
    store at its 5 s ``connect_timeout``. The same for every client of a run, so the
    stores of one server still join. None for memory; no ``connect_timeout`` for SQLite."""
    options: dict[str, float] = {}
    if name != "memory":
        options["timeout"] = PATIENT_TIMEOUT
    if name not in ("memory", "sqlite"):
        options["connect_timeout"] = PATIENT_TIMEOUT
    return options
