"""The Cosmos DB backend against ``@vercel/cosmosdb-server`` (plus a stub for auth/consistency).

Emulator gaps handled here, in the test configuration, never in the library:

* cosmosdb-server reports default consistency "Session": every store the tests open
  passes ``allow_weak_consistency_for_emulator_only=true`` (and a test checks that
  opening WITHOUT it is refused). The Strong path is checked against a stub server.
* it serves plain HTTP and advertises unreachable ``https://`` regional endpoints:
  ``tls=false&endpoint_discovery=false``.
* it accepts any key: wrong-key handling is checked against a stub answering 401.
* it ignores TTL: the tests check the ``ttl`` written on items, and correctness never
  depends on native TTL (the contract's fake clock covers expiry).
* point reads of a missing item answer 500 unless they carry
  ``x-ms-documentdb-query-enablecrosspartition: true``: the store never point-reads
  (read-many queries, and a single-partition query for a lone id).
* ``create_item`` into a deleted container answers 500 (the service: 404), so the
  deleted-container tests check reads, purges and token counts, which answer 404 as the
  service does.
* it answers ``GROUP BY`` with aggregates only in part: the token store counts its
  tokens client-side anyway (one item per token crosses), so nothing is configured.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
from azure.core.exceptions import AzureError, ServiceRequestError, ServiceResponseError
from azure.cosmos import ContainerProxy, CosmosClient, PartitionKey
from azure.cosmos.exceptions import CosmosResourceNotFoundError

from dedupstore import DeduplicationStore, open_store
from dedupstore.backends import cosmos as cosmos_backend
from dedupstore.backends.cosmos import (
    DEFAULT_TOKEN_CONTAINER,
    CosmosDeduplicationStore,
    CosmosTokenStore,
    create_container,
    create_token_container,
    document_id,
    token_document_id,
)
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    StoreUnavailable,
)
from dedupstore.testing import (
    HOSTILE_IDS,
    DeduplicationStoreContract,
    FakeClock,
    MultiProcessContract,
    StoreFactory,
    TokenStoreContract,
    TokenStoreFactory,
)
from dedupstore.tokens import TokenCount
from tests.servers import CosmosEndpoint, CosmosServer

pytestmark = pytest.mark.cosmos

DATABASE = "dedupstore-tests"
#: Options every emulator store needs (see the module docstring).
EMULATOR_QUERY = "endpoint_discovery=false&allow_weak_consistency_for_emulator_only=true"


def store_url(server: CosmosEndpoint, database: str, container: str, extra: str = "") -> str:
    """The ``cosmos://`` URL of ``database``/``container`` on ``server``."""
    parts = urlsplit(server.endpoint_url)
    tls = "true" if parts.scheme == "https" else "false"
    query = f"tls={tls}&{EMULATOR_QUERY}&retries=1&timeout=10" + (f"&{extra}" if extra else "")
    return f"cosmos://{parts.netloc}/{database}/{container}?{query}"


@pytest.fixture(scope="module")
def raw_client(cosmos_server: CosmosEndpoint) -> Iterator[CosmosClient]:
    """A plain azure-cosmos client of the emulator, for setting up and inspecting."""
    client = CosmosClient(**cosmos_server.client_kwargs)
    client.create_database_if_not_exists(DATABASE)
    yield client
    client.close()


@pytest.fixture
def container_name(raw_client: CosmosClient) -> Iterator[str]:
    """A fresh dedup container for this test, deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    create_container(raw_client, DATABASE, name)
    yield name
    raw_client.get_database_client(DATABASE).delete_container(name)


@pytest.fixture
def url(cosmos_server: CosmosEndpoint, container_name: str) -> str:
    return store_url(cosmos_server, DATABASE, container_name)


@pytest.fixture
def open_cosmos(cosmos_server: CosmosEndpoint, url: str) -> Iterator[StoreFactory]:
    """Open stores on this test's container; closes them all at the end."""
    opened: list[DeduplicationStore] = []

    def make(**options: Any) -> DeduplicationStore:
        options.setdefault("key", cosmos_server.key)
        store = open_store(url, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


class TestCosmosStore(DeduplicationStoreContract, MultiProcessContract):
    @pytest.fixture
    def store_factory(self, cosmos_server: CosmosEndpoint, url: str) -> StoreFactory:
        def make(**options: Any) -> DeduplicationStore:
            options.setdefault("key", cosmos_server.key)
            return open_store(url, **options)

        return make


# ---------------------------------------------------------------------- consistency guard


def test_the_emulator_session_account_is_refused_without_the_unsafe_option(
    cosmos_server: CosmosEndpoint, container_name: str
) -> None:
    url = store_url(cosmos_server, DATABASE, container_name).replace(
        "&allow_weak_consistency_for_emulator_only=true", ""
    )
    with pytest.raises(ConsistencyError) as info:
        open_store(url, key=cosmos_server.key)
    message = str(info.value)
    assert "'Session'" in message and "Strong" in message
    assert "\n" not in message
    # the keyword form is honoured too, in every spelling
    for value in (False, "false", "0", 0):
        with pytest.raises(ConsistencyError):
            open_store(url, key=cosmos_server.key, allow_weak_consistency_for_emulator_only=value)
    # a keyword contradicting the URL is refused, not silently preferred
    with pytest.raises(ConfigurationError, match="both in the URL and as a keyword"):
        open_store(
            store_url(cosmos_server, DATABASE, container_name),
            key=cosmos_server.key,
            allow_weak_consistency_for_emulator_only=False,
        )
    with pytest.raises(ConfigurationError, match="expected true or false"):
        open_store(url, key=cosmos_server.key, allow_weak_consistency_for_emulator_only="maybe")


def test_the_unsafe_option_warns_at_every_open(
    open_cosmos: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dedupstore.backends.cosmos"):
        first, second = open_cosmos(), open_cosmos()
    unsafe = [r for r in caplog.records if r.levelno == logging.WARNING and "UNSAFE" in r.message]
    assert len(unsafe) == 2
    assert "'Session'" in unsafe[0].message
    assert any("UNSAFE" in w for w in first.health_warnings())
    assert first.add("m") is True and second.add("m") is False


def test_the_unsafe_option_is_documented_as_unsafe() -> None:
    option = CosmosDeduplicationStore.declared_options["allow_weak_consistency_for_emulator_only"]
    assert option.doc.startswith("UNSAFE")
    assert cosmos_backend.__doc__ is not None
    assert "**UNSAFE in production.**" in cosmos_backend.__doc__


# ---------------------------------------------------------------------- stub service

_STUB_KEY = "c3R1Yi1rZXktc3R1Yi1rZXktc3R1Yi1rZXk="


class _StubCosmos:
    """A minimal HTTP service speaking enough of Cosmos DB to open a store.

    ``consistency`` is the account's default level; ``status`` forces every answer
    (e.g. 401). Records the request headers it saw.
    """

    def __init__(self, consistency: str = "Strong", status: int | None = None) -> None:
        self.consistency = consistency
        self.status = status
        self.headers: list[dict[str, str]] = []
        #: Once set, requests are read and never answered (until ``close``).
        self.hang = threading.Event()
        self._closing = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                stub.headers.append({k.lower(): v for k, v in self.headers.items()})
                if stub.hang.is_set():
                    stub._closing.wait(60)
                    return
                status, body = stub.answer(self.path)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if self.status is not None:
            return self.status, {
                "code": "Unauthorized",
                "message": "The input authorization token can't serve the request.\r\nMore.",
            }
        if path.rstrip("/") == "":
            return 200, {
                "id": "stub",
                "_rid": "stub",
                "_self": "",
                "writableLocations": [
                    {"name": "Stub", "databaseAccountEndpoint": f"http://127.0.0.1:{self.port}/"}
                ],
                "readableLocations": [
                    {"name": "Stub", "databaseAccountEndpoint": f"http://127.0.0.1:{self.port}/"}
                ],
                "enableMultipleWriteLocations": False,
                "userConsistencyPolicy": {"defaultConsistencyLevel": self.consistency},
                "userReplicationPolicy": {"minReplicaSetSize": 1, "maxReplicasetSize": 4},
                "systemReplicationPolicy": {"minReplicaSetSize": 1, "maxReplicasetSize": 4},
                "readPolicy": {"primaryReadCoefficient": 1, "secondaryReadCoefficient": 1},
                "queryEngineConfiguration": "{}",
            }
        if path.rstrip("/") == "/dbs/db/colls/dedup":
            return 200, {
                "id": "dedup",
                "_rid": "AAAAAAAAAAA=",
                "_self": "dbs/AAAAAA==/colls/AAAAAAAAAAA=/",
                "_etag": "x",
                "partitionKey": {"paths": ["/id"], "kind": "Hash", "version": 2},
                "defaultTtl": -1,
            }
        return 404, {"code": "NotFound", "message": "no such resource"}

    @property
    def url(self) -> str:
        return f"cosmos://127.0.0.1:{self.port}/db/dedup?tls=false&endpoint_discovery=false"

    def close(self) -> None:
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Callable[..., _StubCosmos]]:
    stubs: list[_StubCosmos] = []

    def make(**kwargs: Any) -> _StubCosmos:
        stubs.append(_StubCosmos(**kwargs))
        return stubs[-1]

    yield make
    for s in stubs:
        s.close()


def test_a_strong_account_opens_and_requests_ask_for_strong(
    stub: Callable[..., _StubCosmos], caplog: pytest.LogCaptureFixture
) -> None:
    service = stub(consistency="Strong")
    with caplog.at_level(logging.WARNING, logger="dedupstore.backends.cosmos"):
        store = open_store(service.url, key=_STUB_KEY, retries=0)
    assert not caplog.records
    assert store.health_warnings() == []
    assert service.headers[-1].get("x-ms-consistency-level") == "Strong"
    store.close()


def test_a_forked_child_reads_the_accounts_consistency_itself(
    stub: Callable[..., _StubCosmos],
) -> None:
    """The child makes its own connection (no open of its own): its health check asks
    the account, never reports a level it has not read."""
    service = stub(consistency="Strong")
    store = open_store(service.url, key=_STUB_KEY, retries=0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write, json.dumps(store.health_warnings()).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 65536)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert json.loads(answer) == []
    assert store.health_warnings() == []
    store.close()


@pytest.mark.parametrize("level", ["BoundedStaleness", "Session", "ConsistentPrefix", "Eventual"])
def test_a_weaker_account_is_refused(stub: Callable[..., _StubCosmos], level: str) -> None:
    service = stub(consistency=level)
    with pytest.raises(ConsistencyError, match=f"'{level}'"):
        open_store(service.url, key=_STUB_KEY, retries=0)


def test_the_unsafe_option_on_a_strong_account_warns_that_it_is_useless(
    stub: Callable[..., _StubCosmos], caplog: pytest.LogCaptureFixture
) -> None:
    service = stub(consistency="Strong")
    with caplog.at_level(logging.WARNING, logger="dedupstore.backends.cosmos"):
        store = open_store(
            service.url, key=_STUB_KEY, retries=0, allow_weak_consistency_for_emulator_only=True
        )
    assert any("no effect" in r.message for r in caplog.records)
    store.close()


@pytest.mark.parametrize("status", [401, 403])
def test_a_rejected_key_is_a_one_line_configuration_error(
    stub: Callable[..., _StubCosmos], status: int
) -> None:
    service = stub(status=status)
    with pytest.raises(ConfigurationError) as info:
        open_store(service.url, key=_STUB_KEY, retries=0)
    message = str(info.value)
    assert "refused the credentials" in message and "option 'key' or COSMOS_KEY" in message
    assert f"HTTP {status}" in message and "key" in message
    assert "\n" not in message
    assert _STUB_KEY not in message


# ---------------------------------------------------------------------- configuration


def test_missing_database_and_container_are_named(
    cosmos_server: CosmosEndpoint, container_name: str
) -> None:
    with pytest.raises(ConfigurationError, match="database 'no-such-db' does not exist"):
        open_store(store_url(cosmos_server, "no-such-db", "c"), key=cosmos_server.key)
    with pytest.raises(ConfigurationError, match="container 'no-such-container' does not exist"):
        open_store(store_url(cosmos_server, DATABASE, "no-such-container"), key=cosmos_server.key)


def test_create_option_creates_database_and_container(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    database = f"db-{uuid.uuid4().hex[:8]}"
    url = store_url(cosmos_server, database, "dedup", "create=true")
    try:
        with open_store(url, key=cosmos_server.key) as store:
            assert store.add("m") is True
        properties = raw_client.get_database_client(database).get_container_client("dedup").read()
        assert properties["partitionKey"]["paths"] == ["/id"]
        assert properties["defaultTtl"] == -1
        with open_store(url, key=cosmos_server.key) as again:  # idempotent
            assert again.add("m") is False
    finally:
        raw_client.delete_database(database)


def test_a_container_with_another_partition_key_is_refused(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    name = f"pk-{uuid.uuid4().hex[:8]}"
    database = raw_client.get_database_client(DATABASE)
    database.create_container(name, partition_key=PartitionKey("/endpoint"))
    try:
        with pytest.raises(ConfigurationError, match="partition key path '/id'"):
            open_store(store_url(cosmos_server, DATABASE, name), key=cosmos_server.key)
    finally:
        database.delete_container(name)


def test_without_default_ttl_retention_gets_a_health_warning(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    name = f"nottl-{uuid.uuid4().hex[:8]}"
    database = raw_client.get_database_client(DATABASE)
    database.create_container(name, partition_key=PartitionKey("/id"))
    try:
        url = store_url(cosmos_server, DATABASE, name)
        with open_store(url, key=cosmos_server.key, retention=timedelta(days=1)) as store:
            assert any("default TTL" in w for w in store.health_warnings())
        with open_store(url, key=cosmos_server.key) as store:
            assert not any("default TTL" in w for w in store.health_warnings())
    finally:
        database.delete_container(name)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("cosmos://127.0.0.1:1/db", "cosmos://<host>"),
        ("cosmos://127.0.0.1:1/db/c/extra", "cosmos://<host>"),
        ("cosmos:///db/c", "names the account host"),
        ("cosmos://user:pw@127.0.0.1:1/db/c", "no user or password"),
        ("cosmos://127.0.0.1:1/db/a%23b", "container name"),
        ("cosmos://127.0.0.1:1/db/c?max_concurrency=0", "max_concurrency"),
        ("cosmos://127.0.0.1:1/db/c?timeout=-1", "timeout"),
        ("cosmos://127.0.0.1:1/db/c?tls=maybe", "tls"),
        ("cosmos://127.0.0.1:1/db/c?ssl=false", "unknown option 'ssl'"),
    ],
)
def test_bad_urls_are_configuration_errors(url: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        open_store(url, key=_STUB_KEY)


@pytest.mark.parametrize(
    "options",
    [
        {"max_concurrency": 0},
        {"max_concurrency": 2.5},
        {"retries": -1},
        {"timeout": 0},
        {"connect_timeout": "soon"},
        {"max_clock_skew": -5},
        {"tls": None},
        {"create": "perhaps"},
        {"client": object()},
    ],
)
def test_bad_keyword_options_are_configuration_errors(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        open_store("cosmos://127.0.0.1:1/db/c", key=_STUB_KEY, **options)


def test_the_key_comes_from_the_environment(
    cosmos_server: CosmosEndpoint, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COSMOS_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="COSMOS_KEY"):
        open_store(url)
    monkeypatch.setenv("COSMOS_KEY", cosmos_server.key)
    with open_store(url) as store:
        assert store.add("m") is True
        assert cosmos_server.key not in repr(store)


def test_a_key_that_is_not_base64_is_a_configuration_error(url: str) -> None:
    bad = "not-base64-secret!"
    with pytest.raises(ConfigurationError, match="not valid base64") as info:
        open_store(url, key=bad)
    assert bad not in str(info.value)


def test_secrets_never_appear_in_repr_or_errors(cosmos_server: CosmosEndpoint, url: str) -> None:
    key = cosmos_server.key
    with open_store(url, key=key) as store:
        assert key not in repr(store) and "***" in repr(store)
        assert key not in store.url
    with open_store(f"{url}&key={key}") as store:
        assert key not in repr(store) and key not in store.url
    unreachable = f"cosmos://127.0.0.1:1/db/c?tls=false&endpoint_discovery=false&key={key}"
    with pytest.raises(StoreUnavailable) as info:
        open_store(unreachable, retries=0)
    assert key not in str(info.value)


@pytest.mark.parametrize(
    "host", ["no-such-account.invalid", "127.0.0.1:1"], ids=["unknown host", "closed port"]
)
def test_unreachable_service_is_a_one_line_store_unavailable(host: str) -> None:
    url = f"cosmos://{host}/db/c?tls=false&endpoint_discovery=false&retries=0&timeout=5"
    with pytest.raises(StoreUnavailable) as info:
        open_store(url, key=_STUB_KEY)
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, AzureError)


# ---------------------------------------------------------------------- keys and items


def test_document_ids_are_valid_fixed_length_and_injective() -> None:
    pairs = [("a", "bc"), ("ab", "c"), ("a", "b/c"), ("a/b", "c"), ("", "abc"), ("abc", "")]
    ids = {document_id(ep, mid) for ep, mid in pairs}
    assert len(ids) == len(pairs)
    for mid in HOSTILE_IDS:
        doc = document_id("default", mid)
        assert len(doc) == 64 and set(doc) <= set("0123456789abcdef")


def test_restricted_characters_long_ids_trailing_spaces_and_case_never_collide(
    open_cosmos: StoreFactory,
) -> None:
    store = open_cosmos()
    base = "Order/42\\x?y#z"
    variants = [
        base,
        base.lower(),
        base.upper(),
        base + " ",
        base + "  ",
        " " + base,
        base.replace("/", "\\"),
        base.replace("#", "?"),
        "a" * 255,
        "a" * 256,
        "a" * 255 + " ",
        "A" * 256,
        "/" * 300,
        "\\" * 300,
        "?#" * 150,
        "%2F",
        "/",
    ]
    assert len(set(variants)) == len(variants)
    assert store.add_many(variants) == set(variants)
    for mid in variants:
        assert store.has_been_processed(mid)
        assert store.add(mid) is False
    others = [v + "!" for v in variants] + [v.strip() + "x" for v in variants]
    assert store.processed_among(others) == set()


def test_items_keep_the_original_id_and_endpoint(
    open_cosmos: StoreFactory, raw_client: CosmosClient, container_name: str
) -> None:
    store = open_cosmos(endpoint="orders/eu")
    mid = "trailing space / slash "
    store.add(mid)
    container = raw_client.get_database_client(DATABASE).get_container_client(container_name)
    doc = document_id("orders/eu", mid)
    (item,) = container.read_items([(doc, doc)])
    assert item["message_id"] == mid and item["endpoint"] == "orders/eu"
    assert item["expires_at"] is None and item["ttl"] == -1


def test_native_ttl_is_the_retention_plus_slack(
    open_cosmos: StoreFactory, raw_client: CosmosClient, container_name: str
) -> None:
    clock = FakeClock(start=4_000_000_000.0)  # far in the future: TTL must be relative
    store = open_cosmos(retention=timedelta(hours=2), clock=clock)
    store.add_many(["a", "b"])
    container = raw_client.get_database_client(DATABASE).get_container_client(container_name)
    items = container.read_items([(document_id("default", m),) * 2 for m in ("a", "b")])
    assert {item["ttl"] for item in items} == {2 * 3600 + 60}
    assert {item["expires_at"] for item in items} == {4_000_000_000.0 + 7200}


def test_a_hash_collision_is_detected_not_merged(
    open_cosmos: StoreFactory, raw_client: CosmosClient, container_name: str
) -> None:
    store = open_cosmos()
    container = raw_client.get_database_client(DATABASE).get_container_client(container_name)
    doc = document_id("default", "victim")
    container.create_item(
        {"id": doc, "endpoint": "default", "message_id": "impostor", "expires_at": None}
    )
    for call in (
        lambda: store.has_been_processed("victim"),
        lambda: store.processed_among(["other", "victim"]),
        lambda: store.add("victim"),
    ):
        with pytest.raises(ConfigurationError, match="shared with other data"):
            call()


def test_a_resent_write_is_recognised_as_this_calls_own(
    open_cosmos: StoreFactory, raw_client: CosmosClient, container_name: str
) -> None:
    """A create the transport resent after it succeeded answers 409: still ours."""
    store = open_cosmos()
    container = raw_client.get_database_client(DATABASE).get_container_client(container_name)
    token = "resent-token"
    container.create_item(
        {
            "id": document_id("default", "resent"),
            "endpoint": "default",
            "message_id": "resent",
            "expires_at": None,
            "write_token": token,
        }
    )
    with mock.patch("dedupstore.store.write_token", return_value=token):
        assert store.add("resent") is True
    assert store.add("resent") is False


def test_purge_does_not_delete_a_record_re_recorded_since_the_query(
    open_cosmos: StoreFactory,
) -> None:
    clock = FakeClock()
    store = open_cosmos(retention=timedelta(hours=1), clock=clock)
    store.add_many(["a", "b", "c"])
    clock.advance(timedelta(hours=2))
    assert store.add("a") is True  # re-recorded: live again
    assert store.purge_expired() == 2
    assert store.processed_among(["a", "b", "c"]) == {"a"}


def test_sequential_requests_with_max_concurrency_one(open_cosmos: StoreFactory) -> None:
    store = open_cosmos(max_concurrency=1)
    ids = [f"seq-{i}" for i in range(40)]
    assert store.add_many(ids) == set(ids)
    assert store.add_many(ids) == set()
    assert store.processed_among(ids) == set(ids)


def test_pickled_store_keeps_cosmos_options(open_cosmos: StoreFactory) -> None:
    store = open_cosmos(max_concurrency=3)
    clone = pickle.loads(pickle.dumps(store))
    try:
        assert "max_concurrency=3" in repr(clone)
        assert clone.add("p") is True
        assert store.add("p") is False
    finally:
        clone.close()


def _one_query(store: DeduplicationStore, hook: Callable[[Any, Any], None]) -> None:
    container = store._cosmos.container(store)  # type: ignore[attr-defined]
    query = "SELECT * FROM c WHERE c.id = @id"
    params = [{"name": "@id", "value": "x"}]
    list(container.query_items(query, parameters=params, partition_key="x", response_hook=hook))


@pytest.mark.parametrize("given", [False, True], ids=["own-client", "given-client"])
def test_threads_sharing_a_client_never_write_into_each_others_response_headers(
    open_cosmos: StoreFactory, cosmos_server: CosmosEndpoint, given: bool
) -> None:
    """The SDK keeps one ``last_response_headers`` per client and, after each request, writes
    throttle counts into it while the thread that put its own headers there may be reading them
    ("OrderedDict mutated during iteration" in a parallel read-many). B finishes its request
    while A's headers are the client's last: B's write must not land in A's."""
    given_client = CosmosClient(**cosmos_server.client_kwargs) if given else None
    try:
        store = open_cosmos(client=given_client) if given else open_cosmos()
        a_stored, b_done = threading.Event(), threading.Event()
        seen: dict[str, Any] = {}

        def hook_a(headers: Any, _: Any) -> None:  # runs once A's headers are the client's last
            a_stored.set()
            assert b_done.wait(10)
            seen["a"] = dict(headers)

        def hook_b(headers: Any, _: Any) -> None:  # B's own headers stored; B waits for A's
            assert a_stored.wait(10)

        b = threading.Thread(target=_one_query, args=(store, hook_b))
        b.start()
        a = threading.Thread(target=_one_query, args=(store, hook_a))
        a.start()
        b.join(20)
        b_done.set()
        a.join(20)
        assert "a" in seen
        assert "x-ms-throttle-retry-count" not in {k.lower() for k in seen["a"]}
    finally:
        if given_client is not None:
            given_client.close()


# ---------------------------------------------------------------------- failures


def test_server_killed_mid_run_raises_store_unavailable_then_recovers() -> None:
    with CosmosServer() as server:
        client = CosmosClient(**server.client_kwargs)
        create_container(client, DATABASE, "dedup")
        url = store_url(server, DATABASE, "dedup").replace("retries=1", "retries=0")
        store = open_store(url, key=server.key)
        assert store.add("before") is True
        server.kill()
        calls: list[Callable[[], object]] = [
            lambda: store.add("after"),
            lambda: store.add_many(["x", "y", "z"]),
            lambda: store.has_been_processed("before"),
            lambda: store.processed_among(["before", "x"]),
            lambda: store.purge_expired(),
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable) as info:
                call()
            assert isinstance(info.value.__cause__, AzureError), repr(info.value.__cause__)
            assert "\n" not in str(info.value)
        with pytest.raises(StoreUnavailable) as info:
            store.add_many(["u1", "u2"])
        assert info.value.unknown == {"u1", "u2"} and not info.value.recorded
        server.restart()  # cosmosdb-server keeps nothing across a restart: set up again
        create_container(client, DATABASE, "dedup")
        assert store.add("after") is True
        assert store.add_many(["x", "y"]) == {"x", "y"}
        assert store.processed_among(["after", "x", "before"]) == {"after", "x"}
        store.close()
        client.close()


# ---------------------------------------------------------------------- options


def test_string_options_convert_in_the_url_and_as_keywords(
    cosmos_server: CosmosEndpoint, url: str
) -> None:
    assert "&timeout=10" in url
    bare = url.replace("&timeout=10", "")
    extra = "timeout=5s&connect_timeout=2&create=false&max_clock_skew=90s&max_concurrency=4"
    with open_store(f"{bare}&{extra}", key=cosmos_server.key) as from_url:
        assert from_url.option("timeout") == 5.0 and from_url.option("connect_timeout") == 2.0
        assert from_url.option("create") is False and from_url.option("max_concurrency") == 4
        assert from_url.option("max_clock_skew") == 90.0
        client = from_url._cosmos.client  # type: ignore[attr-defined]
        policy = client.client_connection.connection_policy
        assert policy.ReadTimeout == 5.0 and policy.RequestTimeout == 2.0
        assert policy.DBAReadTimeout == 5.0 and policy.RetryOptions.MaxRetryAttemptCount == 1
        assert from_url.add("m") is True
    with open_store(
        bare,
        key=cosmos_server.key,
        timeout="5",
        create="false",
        tls="false",
        endpoint_discovery="0",
        max_concurrency="4",
        max_clock_skew="1m",
    ) as from_keywords:
        assert from_keywords.option("timeout") == 5.0 and from_keywords.option("create") is False
        assert from_keywords.option("max_clock_skew") == 60.0
        assert from_keywords.add("m") is False


@pytest.mark.parametrize(
    ("old", "new"), [("retry_total", "retries"), ("create_container", "create")]
)
def test_names_never_released_are_unknown_options(old: str, new: str) -> None:
    expected = rf"unknown option '{old}' .*known options: .*\b{new}\b"
    with pytest.raises(ConfigurationError, match=expected):
        open_store(f"cosmos://127.0.0.1:1/db/c?{old}=1", key=_STUB_KEY)
    with pytest.raises(ConfigurationError, match=expected):
        open_store("cosmos://127.0.0.1:1/db/c", key=_STUB_KEY, **{old: 1})


def test_a_key_from_the_environment_is_not_pickled(
    cosmos_server: CosmosEndpoint, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COSMOS_KEY", cosmos_server.key)
    with open_store(url) as store:
        assert store.add("env") is True
        data = pickle.dumps(store)
        assert cosmos_server.key.encode() not in data
        clone = pickle.loads(data)  # reads COSMOS_KEY itself
        assert clone.add("env") is False
        clone.close()


# ---------------------------------------------------------------------- error classes


def test_a_deleted_container_is_a_configuration_error(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    name = f"gone-{uuid.uuid4().hex[:8]}"
    create_container(raw_client, DATABASE, name)
    store = open_store(store_url(cosmos_server, DATABASE, name), key=cosmos_server.key)
    try:
        assert store.add_many(["a", "b"]) == {"a", "b"}
        raw_client.get_database_client(DATABASE).delete_container(name)
        calls: list[Callable[[], object]] = [
            lambda: store.has_been_processed("a"),  # never a stale "not processed"
            lambda: store.processed_among(["a", "b", "c"]),
            lambda: store.purge_expired(),
        ]
        for call in calls:
            with pytest.raises(ConfigurationError, match=f"container '{name}'") as info:
                call()
            assert "open with create=true" in str(info.value), "the fix"
            assert "\n" not in str(info.value)
    finally:
        store.close()
    # no call re-created the container
    with pytest.raises(CosmosResourceNotFoundError):
        raw_client.get_database_client(DATABASE).get_container_client(name).read()


# ---------------------------------------------------------------------- lost answers


def _lose_answers(fail: Callable[[int], bool]) -> Any:
    """Patch ``create_item``: call number n (from 1) whose ``fail(n)`` is true is
    performed, then its answer is lost (``ServiceResponseError``)."""
    original = ContainerProxy.create_item
    lock = threading.Lock()
    calls = [0]

    def create_item(self: ContainerProxy, *args: Any, **kwargs: Any) -> Any:
        with lock:
            calls[0] += 1
            number = calls[0]
        result = original(self, *args, **kwargs)
        if fail(number):
            raise ServiceResponseError("connection reset: the answer was lost")
        return result

    return mock.patch.object(ContainerProxy, "create_item", create_item)


def test_a_write_whose_answer_is_lost_is_settled_by_a_retry(open_cosmos: StoreFactory) -> None:
    store, other = open_cosmos(), open_cosmos()
    with _lose_answers(lambda n: True):
        with pytest.raises(StoreUnavailable) as info:
            store.add("lost")
        assert info.value.unknown == {"lost"} and not info.value.recorded
        assert isinstance(info.value.__cause__, ServiceResponseError)
        with pytest.raises(StoreUnavailable) as many:
            store.add_many(["l1", "l2", "l3"])
        assert many.value.unknown == {"l1", "l2", "l3"} and not many.value.recorded
    assert store.add("lost") is True  # written by the failed call: reported once
    assert store.add("lost") is False
    assert other.add("lost") is False
    assert store.add_many(["l1", "l2", "l3"]) == {"l1", "l2", "l3"}
    assert store.add_many(["l1", "l2", "l3"]) == set()
    assert other.add_many(["l1", "l2", "l3"]) == set()


def test_a_write_that_never_left_is_recorded_by_the_retry(open_cosmos: StoreFactory) -> None:
    store = open_cosmos()
    refused = ServiceRequestError("connection refused")
    with (
        mock.patch.object(ContainerProxy, "create_item", side_effect=refused),
        pytest.raises(StoreUnavailable) as info,
    ):
        store.add("never-sent")
    assert info.value.unknown == {"never-sent"}
    assert store.has_been_processed("never-sent") is False
    assert store.add("never-sent") is True


class _SmallBatchStore(CosmosDeduplicationStore):
    max_write_batch = 5


def test_a_batch_failing_part_way_reports_its_progress(
    cosmos_server: CosmosEndpoint, url: str
) -> None:
    ids = [f"chunked-{i}" for i in range(20)]  # 4 chunks of 5
    store = _SmallBatchStore(url, key=cosmos_server.key)
    other = _SmallBatchStore(url, key=cosmos_server.key)
    try:
        # the third chunk's first two creates are performed and their answers lost
        with _lose_answers(lambda n: n in (11, 12)), pytest.raises(StoreUnavailable) as info:
            store.add_many(ids)
        recorded, unknown = info.value.recorded, info.value.unknown
        assert recorded == set(ids[:10]) and unknown == set(ids[10:15])
        assert not recorded & unknown
        assert other.processed_among(recorded) == recorded
        retry = store.add_many(ids)
        assert retry | recorded == set(ids) and not retry & recorded
        assert other.add_many(ids) == set()
    finally:
        store.close()
        other.close()


# ---------------------------------------------------------------------- timeouts


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers; its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for connection in held:
        connection.close()


@pytest.mark.timeout(120)
def test_a_server_that_never_answers_is_store_unavailable(silent_server: int) -> None:
    url = f"cosmos://127.0.0.1:{silent_server}/db/c?tls=false&endpoint_discovery=false"
    with pytest.raises(StoreUnavailable, match="timed out") as info:
        open_store(url, key=_STUB_KEY, timeout=3, retries=0)  # the deadline covers the client too
    assert isinstance(info.value.__cause__, AzureError)


@pytest.mark.timeout(120)
def test_a_server_that_stops_answering_is_store_unavailable(
    stub: Callable[..., _StubCosmos],
) -> None:
    service = stub(consistency="Strong")
    with open_store(service.url, key=_STUB_KEY, timeout=1, retries=0) as store:
        service.hang.set()
        with pytest.raises(StoreUnavailable, match="timed out"):
            store.has_been_processed("m")
        with pytest.raises(StoreUnavailable, match="timed out") as info:
            store.add("m")
        assert info.value.unknown == {"m"}


# ---------------------------------------------------------------------- clock skew


def test_purge_spares_records_expired_less_than_max_clock_skew_ago(
    open_cosmos: StoreFactory,
) -> None:
    writer_clock = FakeClock(start=1_900_000_000.0)
    writer = open_cosmos(retention=timedelta(hours=1), clock=writer_clock)
    assert writer.add("skewed") is True
    # a client whose clock runs 30 s ahead sees the record expired 10 s ago ...
    ahead = FakeClock(start=writer_clock() + 3600 + 10)
    purger = open_cosmos(retention=timedelta(hours=1), clock=ahead)
    assert purger.purge_expired() == 0  # ... but the writer still counts it as live
    assert writer.has_been_processed("skewed")
    assert open_cosmos(clock=ahead, max_clock_skew="5s").purge_expired() == 1
    assert not writer.has_been_processed("skewed")
    assert writer.add("skewed") is True
    writer_clock.advance(timedelta(hours=1, seconds=61))
    assert open_cosmos(clock=writer_clock).purge_expired() == 1


# ---------------------------------------------------------------------- fork


@pytest.mark.timeout(120)
def test_a_forked_child_opens_its_own_client(open_cosmos: StoreFactory) -> None:
    store = open_cosmos()
    assert store.add_many(["p1", "p2"]) == {"p1", "p2"}
    parent_client = store._cosmos.client  # type: ignore[attr-defined]
    pid = os.fork()
    if pid == 0:  # the child: never touches the parent's client or sockets
        code = 1
        try:
            own = store._cosmos.client is not parent_client  # type: ignore[attr-defined]
            ok = own and store.add("c1") and not store.add("p1")
            code = (
                0 if ok and store.processed_among(["p1", "p2", "c1"]) == {"p1", "p2", "c1"} else 2
            )
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store._cosmos.client is parent_client  # type: ignore[attr-defined]
    assert store.add("c1") is False
    assert store.add_many(["p3", "p4"]) == {"p3", "p4"}


# ---------------------------------------------------------------------- token store


@pytest.fixture
def token_container_name(raw_client: CosmosClient) -> Iterator[str]:
    """A fresh token container for this test, deleted afterwards."""
    name = f"tok-{uuid.uuid4().hex[:12]}"
    create_token_container(raw_client, DATABASE, name)
    yield name
    raw_client.get_database_client(DATABASE).delete_container(name)


@pytest.fixture
def token_url(cosmos_server: CosmosEndpoint, token_container_name: str) -> str:
    return store_url(cosmos_server, DATABASE, token_container_name)


@pytest.fixture
def raw_tokens(raw_client: CosmosClient, token_container_name: str) -> ContainerProxy:
    return raw_client.get_database_client(DATABASE).get_container_client(token_container_name)


@pytest.fixture
def open_tokens(cosmos_server: CosmosEndpoint, token_url: str) -> Iterator[TokenStoreFactory]:
    """Open token stores on this test's container; closes them all at the end."""
    opened: list[CosmosTokenStore] = []

    def make(**options: Any) -> CosmosTokenStore:
        options.setdefault("key", cosmos_server.key)
        opened.append(CosmosTokenStore(token_url, **options))
        return opened[-1]

    yield make
    for tokens in opened:
        tokens.close()


class TestCosmosTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(
        self, cosmos_server: CosmosEndpoint, token_url: str
    ) -> TokenStoreFactory:
        def make(**options: Any) -> CosmosTokenStore:
            options.setdefault("key", cosmos_server.key)
            return CosmosTokenStore(token_url, **options)

        return make


def test_a_token_item_holds_its_id_endpoint_and_mint_time(
    open_tokens: TokenStoreFactory, raw_tokens: ContainerProxy
) -> None:
    tokens = open_tokens(clock=lambda: 1234.5)
    token = "order/42?x#y\\z "  # not a valid Cosmos DB id as it is
    tokens.create({token: "billing/eu"})
    doc = token_document_id(token)
    (item,) = raw_tokens.read_items([(doc, doc)])
    assert {k: v for k, v in item.items() if not k.startswith("_")} == {
        "id": doc,
        "token_id": token,
        "endpoint": "billing/eu",
        "created": 1234.5,
    }
    assert "ttl" not in item
    assert tokens.outstanding() == {"billing/eu": TokenCount(1, 1234.5)}
    assert len(doc) == 64 and set(doc) <= set("0123456789abcdef")
    # a namespace of its own: never the id of a deduplication or entity item
    assert doc not in {document_id("", token), document_id("default", token)}


def test_a_url_naming_only_the_database_opens_dedup_tokens(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    database = f"db-{uuid.uuid4().hex[:8]}"
    bare = store_url(cosmos_server, database, "x").replace(f"/{database}/x?", f"/{database}?")
    try:
        with pytest.raises(ConfigurationError, match=f"database '{database}' does not exist"):
            CosmosTokenStore(bare, key=cosmos_server.key)
        with CosmosTokenStore(f"{bare}&create=true", key=cosmos_server.key) as tokens:
            assert f"/{database}/{DEFAULT_TOKEN_CONTAINER}?" in tokens.url
            tokens.create({"t-1": "e"})
            clone = pickle.loads(pickle.dumps(tokens))
            try:
                assert clone.present("t-1")
            finally:
                clone.close()
        container = raw_client.get_database_client(database).get_container_client(
            DEFAULT_TOKEN_CONTAINER
        )
        properties = container.read()
        assert properties["partitionKey"]["paths"] == ["/id"]
        assert properties.get("defaultTtl") is None  # TTL off
        named = store_url(cosmos_server, database, DEFAULT_TOKEN_CONTAINER)
        with CosmosTokenStore(named, key=cosmos_server.key) as again:  # the same container
            assert again.present("t-1")
    finally:
        raw_client.delete_database(database)


def test_a_container_whose_items_expire_is_refused(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    database = raw_client.get_database_client(DATABASE)
    expiring, per_item = f"ttl-{uuid.uuid4().hex[:8]}", f"ttl1-{uuid.uuid4().hex[:8]}"
    database.create_container(expiring, partition_key=PartitionKey("/id"), default_ttl=3600)
    database.create_container(per_item, partition_key=PartitionKey("/id"), default_ttl=-1)
    try:
        with pytest.raises(ConfigurationError, match="default TTL of 3600 s") as info:
            CosmosTokenStore(store_url(cosmos_server, DATABASE, expiring), key=cosmos_server.key)
        assert "\n" not in str(info.value)
        # -1: only items carrying a ttl expire, and token items carry none
        with CosmosTokenStore(
            store_url(cosmos_server, DATABASE, per_item), key=cosmos_server.key
        ) as tokens:
            tokens.create({"t-1": "e"})
            assert tokens.present("t-1")
    finally:
        database.delete_container(expiring)
        database.delete_container(per_item)


def test_a_token_container_of_another_partition_key_is_refused(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    name = f"pk-{uuid.uuid4().hex[:8]}"
    database = raw_client.get_database_client(DATABASE)
    database.create_container(name, partition_key=PartitionKey("/endpoint"))
    try:
        with pytest.raises(ConfigurationError, match="partition key path '/id'"):
            CosmosTokenStore(store_url(cosmos_server, DATABASE, name), key=cosmos_server.key)
    finally:
        database.delete_container(name)


def test_the_token_store_refuses_the_session_emulator_without_the_unsafe_option(
    cosmos_server: CosmosEndpoint, token_container_name: str
) -> None:
    url = store_url(cosmos_server, DATABASE, token_container_name).replace(
        "&allow_weak_consistency_for_emulator_only=true", ""
    )
    with pytest.raises(ConsistencyError, match=r"'Session'.*token-based deduplication"):
        CosmosTokenStore(url, key=cosmos_server.key)


@pytest.mark.parametrize("level", ["Strong", "BoundedStaleness", "Session", "Eventual"])
def test_the_token_store_needs_a_strong_account(
    stub: Callable[..., _StubCosmos], level: str
) -> None:
    service = stub(consistency=level)
    if level != "Strong":
        with pytest.raises(ConsistencyError, match=f"'{level}'"):
            CosmosTokenStore(service.url, key=_STUB_KEY, retries=0)
        return
    with CosmosTokenStore(service.url, key=_STUB_KEY, retries=0) as tokens:
        assert tokens.health_warnings() == []
    assert service.headers[-1].get("x-ms-consistency-level") == "Strong"


def test_a_foreign_item_in_the_token_container_is_detected_not_merged(
    open_tokens: TokenStoreFactory, raw_tokens: ContainerProxy
) -> None:
    tokens = open_tokens()
    raw_tokens.create_item(
        {"id": token_document_id("victim"), "token_id": "impostor", "endpoint": "e", "created": 1}
    )
    for call in (
        lambda: tokens.present("victim"),
        lambda: tokens.present_among(["other", "victim"]),
        lambda: tokens.create({"victim": "e"}),  # 409: read back, not taken for the token
        tokens.outstanding,
    ):
        with pytest.raises(ConfigurationError, match="shared with other data"):
            call()
    raw_tokens.delete_item(token_document_id("victim"), token_document_id("victim"))
    # a deduplication item (a container shared with a deduplication store)
    doc = document_id("default", "m")
    raw_tokens.create_item({"id": doc, "endpoint": "default", "message_id": "m"})
    with pytest.raises(ConfigurationError, match="is not a token"):
        tokens.outstanding()


def test_a_token_create_whose_answer_was_lost_is_settled_by_a_retry(
    open_tokens: TokenStoreFactory,
) -> None:
    tokens, other = open_tokens(clock=lambda: 100.0), open_tokens(clock=lambda: 200.0)
    with _lose_answers(lambda n: True), pytest.raises(StoreUnavailable) as info:
        tokens.create({"l1": "e", "l2": "e"})
    assert info.value.unknown == {"l1", "l2"} and not info.value.recorded
    assert isinstance(info.value.__cause__, ServiceResponseError)
    assert other.present_among(["l1", "l2"]) == {"l1", "l2"}  # performed, answers lost
    other.create({"l1": "e", "l2": "e"})  # 409: exists, left as it is
    assert tokens.outstanding() == {"e": TokenCount(2, 100.0)}


def test_token_deletes_run_in_parallel_and_one_by_one(open_tokens: TokenStoreFactory) -> None:
    ids = [f"d-{i}" for i in range(40)]
    for concurrency in (1, 8):
        tokens = open_tokens(max_concurrency=concurrency)
        tokens.create(dict.fromkeys(ids, "e"))
        assert tokens.present_among(ids) == set(ids)
        tokens.delete(ids[::2])
        assert tokens.present_among(ids) == set(ids[1::2])
        tokens.delete(ids)  # half gone already: 404s are successes
        assert tokens.present_among(ids) == set()
        assert tokens.outstanding() == {}


def test_a_deleted_token_container_is_a_configuration_error(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    name = f"gone-{uuid.uuid4().hex[:8]}"
    create_token_container(raw_client, DATABASE, name)
    tokens = CosmosTokenStore(store_url(cosmos_server, DATABASE, name), key=cosmos_server.key)
    try:
        tokens.create({"a": "e", "b": "e"})
        raw_client.get_database_client(DATABASE).delete_container(name)
        calls: list[Callable[[], object]] = [
            lambda: tokens.present("a"),  # never a stale "absent"
            lambda: tokens.present_among(["a", "b", "c"]),
            tokens.outstanding,
        ]
        for call in calls:
            with pytest.raises(ConfigurationError, match=f"container '{name}'") as info:
                call()
            assert "create_token_container() or open with create=true" in str(info.value)
    finally:
        tokens.close()
    with pytest.raises(CosmosResourceNotFoundError):
        raw_client.get_database_client(DATABASE).get_container_client(name).read()
