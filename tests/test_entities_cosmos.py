"""The Cosmos DB entity store against ``@vercel/cosmosdb-server`` (the emulator).

Emulator gaps handled here, in the test configuration, never in the library (see
also tests/test_cosmos.py):

* it reports default consistency "Session": stores open with
  ``allow_weak_consistency_for_emulator_only=true``, and a test checks that the
  entity store refuses the account without it;
* it serves plain HTTP and advertises unreachable regional endpoints:
  ``tls=false&endpoint_discovery=false``;
* it does not enforce Cosmos DB's 2 MiB request limit (it stores 8 MB items), so
  the size tests check the serialized size of the item the store sends instead;
* it keeps everything in memory and loses it on a restart, so the restart contract
  is replaced by a proxy that stops answering and resumes (same server, data kept);
* it slows down as a container grows: every test has a fresh container, and the
  large entities are few.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
from azure.core.exceptions import AzureError, ServiceRequestError, ServiceResponseError
from azure.cosmos import ContainerProxy, CosmosClient, PartitionKey
from azure.cosmos.exceptions import CosmosHttpResponseError

import dedupstore
from dedupstore.backends import cosmos as cosmos_backend
from dedupstore.backends.cosmos import (
    CosmosConnection,
    CosmosDeduplicationStore,
    CosmosEntityStore,
    create_container,
    create_entity_container,
    entity_document_id,
)
from dedupstore.backends.cosmos.entities import ITEM_OVERHEAD_BYTES, MAX_REQUEST_BYTES
from dedupstore.entities import (
    Entity,
    EntityRecord,
    EntityStore,
    OutgoingMessage,
    bucket_of,
    encode_entity,
)
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    ConsistencyError,
    EntityTooLarge,
    StoreUnavailable,
)
from dedupstore.store import DeduplicationStore
from dedupstore.testing.entities import EntityStoreContract, EntityStoreFactory
from tests.servers import CosmosEndpoint

pytestmark = pytest.mark.cosmos

DATABASE = "dedupstore-entity-tests"
#: Options every emulator store needs (see the module docstring).
EMULATOR_QUERY = "tls=false&endpoint_discovery=false&allow_weak_consistency_for_emulator_only=true"


def entity_url(netloc: str, database: str, container: str, extra: str = "") -> str:
    """The ``cosmos://`` URL of an entity container at ``netloc`` (host:port)."""
    query = f"{EMULATOR_QUERY}&retries=1&timeout=10" + (f"&{extra}" if extra else "")
    return f"cosmos://{netloc}/{database}/{container}?{query}"


def _netloc(server: CosmosEndpoint) -> str:
    return urlsplit(server.endpoint_url).netloc


@pytest.fixture(scope="module")
def raw_client(cosmos_server: CosmosEndpoint) -> Iterator[CosmosClient]:
    """A plain azure-cosmos client of the emulator, for setting up and inspecting."""
    client = CosmosClient(**cosmos_server.client_kwargs)
    client.create_database_if_not_exists(DATABASE)
    yield client
    client.close()


@pytest.fixture
def container_name(raw_client: CosmosClient) -> Iterator[str]:
    """A fresh entity container for this test, deleted afterwards."""
    name = f"e-{uuid.uuid4().hex[:12]}"
    create_entity_container(raw_client, DATABASE, name)
    yield name
    raw_client.get_database_client(DATABASE).delete_container(name)


@pytest.fixture
def raw_container(raw_client: CosmosClient, container_name: str) -> ContainerProxy:
    return raw_client.get_database_client(DATABASE).get_container_client(container_name)


@pytest.fixture
def url(cosmos_server: CosmosEndpoint, container_name: str) -> str:
    return entity_url(_netloc(cosmos_server), DATABASE, container_name)


@pytest.fixture
def open_entities(cosmos_server: CosmosEndpoint, url: str) -> Iterator[EntityStoreFactory]:
    """Open entity stores on this test's container; closes them all at the end."""
    opened: list[EntityStore] = []

    def make(**options: Any) -> EntityStore:
        options.setdefault("key", cosmos_server.key)
        store = dedupstore.open_entity_store(url, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


class TestCosmosEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self, cosmos_server: CosmosEndpoint, url: str) -> EntityStoreFactory:
        def make(**options: Any) -> EntityStore:
            options.setdefault("key", cosmos_server.key)
            return CosmosEntityStore(url, **options)

        return make


def _message(n: int = 0) -> OutgoingMessage:
    return OutgoingMessage(f"out-{n}", "shipping", {"n": n}, {"h": "v"})


def _item(container: ContainerProxy, entity_id: str) -> dict[str, Any]:
    doc = entity_document_id(entity_id)
    items = list(
        container.query_items(
            "SELECT * FROM c WHERE c.id = @id",
            parameters=[{"name": "@id", "value": doc}],
            partition_key=doc,
        )
    )
    assert len(items) == 1
    return items[0]


# ---------------------------------------------------------------------- layout


def test_opens_by_url_as_the_cosmos_entity_store(open_entities: EntityStoreFactory) -> None:
    store = open_entities()
    assert type(store) is CosmosEntityStore
    assert isinstance(store._cosmos, cosmos_backend.CosmosConnection)  # type: ignore[attr-defined]
    option = CosmosEntityStore.declared_options["allow_weak_consistency_for_emulator_only"]
    assert option.doc.startswith("UNSAFE")


def test_one_item_per_entity_with_body_bucket_pending_token(
    open_entities: EntityStoreFactory, raw_container: ContainerProxy
) -> None:
    store = open_entities()
    eid = "order/42?#\\ é"
    entity = store.load(eid)
    entity.state = {"items": ["a"], "big": 2**63 - 1, "neg_zero": -0.0, "tiny": 5e-324}
    entity.outbox["m1"] = [_message()]
    store.save(entity)
    item = _item(raw_container, eid)
    assert item["id"] == entity_document_id(eid) and len(item["id"]) == 64
    assert item["entity_id"] == eid
    assert item["body"] == encode_entity(entity)  # the canonical JSON text, as a string
    assert item["bucket"] == bucket_of(eid) and item["pending"] is True
    assert isinstance(item["token"], str) and len(item["token"]) >= 16
    assert item["_etag"] == entity.version
    assert set(item) - {"_rid", "_self", "_etag", "_ts", "_attachments"} == {
        "id",
        "entity_id",
        "body",
        "bucket",
        "pending",
        "token",
    }
    loaded = store.load(eid)  # exact: a nested object would round 2**63-1 to a double
    assert loaded.state["big"] == 2**63 - 1 and str(loaded.state["neg_zero"]) == "-0.0"
    assert loaded.state == entity.state
    del loaded.outbox["m1"]
    store.save(loaded)
    again = _item(raw_container, eid)
    assert again["pending"] is False and again["token"] != item["token"]
    assert again["_etag"] == loaded.version != entity.version


def test_entity_ids_hash_apart_from_dedup_ids_and_each_other() -> None:
    ids = ["a", "A", "a ", "a/b", "a\\b", "x" * 1024, "\x01" * 1024, "é"]
    docs = {entity_document_id(eid) for eid in ids}
    assert len(docs) == len(ids)
    assert all(len(d) == 64 and set(d) <= set("0123456789abcdef") for d in docs)
    assert entity_document_id("m") != cosmos_backend.document_id("default", "m")


def test_an_item_of_other_data_is_refused_not_merged(
    open_entities: EntityStoreFactory, raw_container: ContainerProxy
) -> None:
    store = open_entities()
    raw_container.create_item(
        {"id": entity_document_id("victim"), "entity_id": "impostor", "body": "{}"}
    )
    with pytest.raises(ConfigurationError, match="shared with other data"):
        store.load("victim")
    with pytest.raises(ConfigurationError, match="shared with other data"):
        store.load_many(["other", "victim"])
    raw_container.create_item({"id": "foreign", "pending": True, "bucket": 0})
    with pytest.raises(ConfigurationError, match="not an entity item"):
        list(store.pending_outboxes())


# ---------------------------------------------------------------------- scan


def test_the_scan_pages_with_continuation_and_streams(
    open_entities: EntityStoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_entities()
    ids = [f"p-{n}" for n in range(23)]
    loaded = store.load_many(ids)
    for eid in ids:
        loaded[eid].outbox["m"] = [_message()]
    quiet = store.load("quiet")
    quiet.state = {"q": 1}
    assert store.save_many([*loaded.values(), quiet]) == set()
    monkeypatch.setattr("dedupstore.backends.cosmos.entities._SCAN_PAGE", 5)
    pages: list[int] = []
    original = ContainerProxy.query_items

    def counting(self: ContainerProxy, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        by_page = result.by_page

        def pages_counted(*a: Any, **k: Any) -> Iterator[Any]:
            for page in by_page(*a, **k):
                items = list(page)
                pages.append(len(items))
                yield iter(items)

        result.by_page = pages_counted  # type: ignore[method-assign]
        return result

    with mock.patch.object(ContainerProxy, "query_items", counting):
        scan = store.pending_outboxes()
        first = next(scan)
        assert len(pages) == 1, "the first entity comes before the later pages are read"
        rest = [e.id for e in scan]
    assert sorted([first.id, *rest]) == sorted(ids)
    assert len(pages) >= 5 and max(pages) <= 5
    assert first.outbox == {"m": [_message()]} and first.version is not None
    stale = loaded[first.id]
    assert stale.version == first.version
    by_segment = [{e.id for e in store.pending_outboxes(s, 4)} for s in range(4)]
    assert set().union(*by_segment) == set(ids) and sum(map(len, by_segment)) == len(ids)
    assert all(bucket_of(eid) % 4 == s for s, seg in enumerate(by_segment) for eid in seg)


# ---------------------------------------------------------------------- size limit


def _sent_size(item: dict[str, Any]) -> int:
    """Bytes of ``item`` as the SDK sends it with compact UTF-8 item writes."""
    return len(json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def _entity_of_size(eid: str, size: int, fill: str) -> Entity:
    """An entity whose canonical JSON is exactly ``size`` UTF-8 bytes, mostly ``fill``."""
    entity = Entity(eid)
    entity.state = {"blob": ""}
    base = len(encode_entity(entity).encode("utf-8"))
    unit = len(json.dumps(fill, ensure_ascii=False).encode("utf-8")) - 2
    count, rest = divmod(size - base, unit)
    entity.state = {"blob": fill * count + "x" * rest}
    assert len(encode_entity(entity).encode("utf-8")) == size
    return entity


def test_the_size_limit_keeps_the_item_under_cosmos_2_mib() -> None:
    assert MAX_REQUEST_BYTES == 2 * 1024 * 1024
    assert CosmosEntityStore.max_entity_bytes == (MAX_REQUEST_BYTES - ITEM_OVERHEAD_BYTES) // 2
    assert CosmosEntityStore.max_entity_bytes == 1_040_384
    # the worst case: a body of quotes (each one doubles again inside the item), the
    # longest id escaped (control characters: 6 bytes each), a 22-character token
    eid = "\x01" * 1024
    entity = _entity_of_size(eid, CosmosEntityStore.max_entity_bytes, '"')
    record = EntityRecord(eid, encode_entity(entity), None, bucket_of(eid), False)
    item = CosmosEntityStore._item(record, "t" * 22)
    system = {"_rid": "x" * 28, "_self": "x" * 80, "_etag": "x" * 40, "_ts": 2**40}
    system["_attachments"] = "attachments/"
    assert _sent_size(item) + _sent_size(system) < MAX_REQUEST_BYTES
    # without compact UTF-8 writes, DEL and non-ASCII text would travel 6 bytes a byte
    spiky = _entity_of_size("e", CosmosEntityStore.max_entity_bytes, "\x7f")
    escaped = json.dumps({"body": encode_entity(spiky)}, separators=(",", ":"))
    assert len(escaped) > 5 * MAX_REQUEST_BYTES / 2


@pytest.mark.timeout(180)
def test_an_entity_at_the_limit_is_stored_and_one_byte_more_is_refused(
    open_entities: EntityStoreFactory, raw_container: ContainerProxy
) -> None:
    store = open_entities()
    limit = store.max_entity_bytes
    client = store._cosmos.client  # type: ignore[attr-defined]
    assert client.client_connection._enable_compact_utf8_item_writes is True
    for eid, fill in (("\x01" * 1024, '"'), ("unicode", "é\x7f🦄")):
        too_big = _entity_of_size(eid, limit + 1, fill)
        with pytest.raises(EntityTooLarge):
            store.save(too_big)
        assert store.load(eid).version is None, "nothing may be written"
        entity = _entity_of_size(eid, limit, fill)
        store.save(entity)
        item = _item(raw_container, eid)
        assert len(item["body"].encode("utf-8")) == limit
        assert _sent_size(item) < MAX_REQUEST_BYTES
        assert store.load(eid).state == entity.state
    assert len(list(store.pending_outboxes())) == 0


# ---------------------------------------------------------------------- options


def test_create_makes_the_entity_container(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    database = f"edb-{uuid.uuid4().hex[:8]}"
    url = entity_url(_netloc(cosmos_server), database, "entities", "create=true")
    try:
        with dedupstore.open_entity_store(url, key=cosmos_server.key) as store:
            entity = store.load("e")
            entity.outbox["m"] = None
            store.save(entity)
        container = raw_client.get_database_client(database).get_container_client("entities")
        properties = container.read()
        assert properties["partitionKey"]["paths"] == ["/id"]
        included = {p["path"] for p in properties["indexingPolicy"]["includedPaths"]}
        assert included == {"/pending/?", "/bucket/?"}
        with dedupstore.open_entity_store(url, key=cosmos_server.key) as again:  # idempotent
            assert [e.id for e in again.pending_outboxes()] == ["e"]
    finally:
        raw_client.delete_database(database)


def test_missing_database_or_container_without_create_is_a_configuration_error(
    cosmos_server: CosmosEndpoint, container_name: str
) -> None:
    netloc = _netloc(cosmos_server)
    with pytest.raises(ConfigurationError, match="database 'no-such-db' does not exist"):
        CosmosEntityStore(entity_url(netloc, "no-such-db", "c"), key=cosmos_server.key)
    with pytest.raises(ConfigurationError, match="create_entity_container") as info:
        CosmosEntityStore(entity_url(netloc, DATABASE, "no-such-container"), key=cosmos_server.key)
    assert "container 'no-such-container' does not exist" in str(info.value)


def test_a_container_with_another_partition_key_is_refused(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    name = f"pk-{uuid.uuid4().hex[:8]}"
    database = raw_client.get_database_client(DATABASE)
    database.create_container(name, partition_key=PartitionKey("/entity_id"))
    try:
        with pytest.raises(ConfigurationError, match="an entity container needs partition key"):
            CosmosEntityStore(
                entity_url(_netloc(cosmos_server), DATABASE, name), key=cosmos_server.key
            )
    finally:
        database.delete_container(name)


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("cosmos://127.0.0.1:1/db", {}, "cosmos://<host>"),
        ("cosmos://127.0.0.1:1/db/a%23b", {}, "container name"),
        ("cosmos://127.0.0.1:1/db/c?max_concurrency=0", {}, "max_concurrency"),
        ("cosmos://127.0.0.1:1/db/c?timeout=-1", {}, "timeout"),
        ("cosmos://127.0.0.1:1/db/c?create=perhaps", {}, "create"),
        ("cosmos://127.0.0.1:1/db/c", {"retries": -1}, "retries"),
        ("cosmos://127.0.0.1:1/db/c", {"connect_timeout": "soon"}, "connect_timeout"),
        ("cosmos://127.0.0.1:1/db/c", {"client": object()}, "client"),
        # the deduplication store's options are not the entity store's
        ("cosmos://127.0.0.1:1/db/c?retention=1d", {}, "unknown option 'retention'"),
        ("cosmos://127.0.0.1:1/db/c", {"endpoint": "orders"}, "unknown option 'endpoint'"),
        ("cosmos://127.0.0.1:1/db/c", {"max_clock_skew": 5}, "unknown option 'max_clock_skew'"),
    ],
)
def test_bad_options_are_configuration_errors_before_any_io(
    url: str, options: dict[str, Any], match: str
) -> None:
    # nothing listens on port 1: any I/O would be StoreUnavailable instead
    with pytest.raises(ConfigurationError, match=match) as info:
        dedupstore.open_entity_store(url, key="c2VjcmV0LWtleQ==", **options)
    # an I/O-free refusal: the Spark driver's check refuses it too, in the same words
    with pytest.raises(ConfigurationError) as checked:
        CosmosEntityStore.check_options(url, key="c2VjcmV0LWtleQ==", **options)
    assert str(checked.value) == str(info.value)
    assert "c2VjcmV0LWtleQ==" not in str(info.value)


def test_options_convert_in_the_url_and_as_keywords(
    cosmos_server: CosmosEndpoint, url: str
) -> None:
    bare = url.replace("&timeout=10", "")
    with CosmosEntityStore(
        f"{bare}&timeout=5s&connect_timeout=2&max_concurrency=4", key=cosmos_server.key
    ) as store:
        assert store.option("timeout") == 5.0 and store.option("connect_timeout") == 2.0
        assert store.option("max_concurrency") == 4 and store.option("create") is False
        policy = store._cosmos.client.client_connection.connection_policy
        assert policy.ReadTimeout == 5.0 and policy.RequestTimeout == 2.0
        assert store.load("x").version is None
    with CosmosEntityStore(bare, key=cosmos_server.key, timeout="5", max_concurrency="4") as kw:
        assert kw.option("timeout") == 5.0 and kw.option("max_concurrency") == 4


def test_a_given_client_must_write_compact_utf8(cosmos_server: CosmosEndpoint, url: str) -> None:
    escaping = CosmosClient(**cosmos_server.client_kwargs)
    compact = CosmosClient(**cosmos_server.client_kwargs, enable_compact_utf8_item_writes=True)
    try:
        with pytest.raises(ConfigurationError, match="enable_compact_utf8_item_writes=True"):
            CosmosEntityStore(url, client=escaping)
        with CosmosEntityStore(url, client=compact) as store:
            entity = store.load("c")
            entity.state = {"text": "é🦄"}
            store.save(entity)
            assert store.load("c").state == {"text": "é🦄"}
        assert list(compact.list_databases())  # a given client is not closed
    finally:
        escaping.close()
        compact.close()


def test_the_emulator_session_account_is_refused_without_the_unsafe_option(
    cosmos_server: CosmosEndpoint, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    strict = url.replace("&allow_weak_consistency_for_emulator_only=true", "")
    with pytest.raises(ConsistencyError, match=r"'Session'.*entity store needs 'Strong'"):
        CosmosEntityStore(strict, key=cosmos_server.key)
    with caplog.at_level(logging.WARNING, logger="dedupstore.backends.cosmos"):
        store = CosmosEntityStore(url, key=cosmos_server.key)
    assert any("UNSAFE" in r.message and "stale" in r.message for r in caplog.records)
    assert any("UNSAFE" in w for w in store.health_warnings())
    store.close()


def test_a_key_from_the_environment_is_not_pickled(
    cosmos_server: CosmosEndpoint, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COSMOS_KEY", cosmos_server.key)
    with CosmosEntityStore(url, max_concurrency=3) as store:
        entity = store.load("env")
        entity.state = {"a": 1}
        store.save(entity)
        data = pickle.dumps(store)
        assert cosmos_server.key.encode() not in data
        assert cosmos_server.key not in repr(store)
        clone = pickle.loads(data)  # reads COSMOS_KEY itself
        assert clone.option("max_concurrency") == 3
        assert clone.load("env").state == {"a": 1}
        clone.close()


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "host", ["no-such-account.invalid", "127.0.0.1:1"], ids=["unknown host", "closed port"]
)
def test_an_unreachable_service_is_a_one_line_store_unavailable(host: str) -> None:
    url = f"cosmos://{host}/db/c?tls=false&endpoint_discovery=false&retries=0&timeout=5"
    with pytest.raises(StoreUnavailable) as info:
        dedupstore.open_entity_store(url, key="c2VjcmV0LWtleQ==")
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, AzureError)


def test_a_deleted_container_is_a_configuration_error(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient
) -> None:
    name = f"gone-{uuid.uuid4().hex[:8]}"
    create_entity_container(raw_client, DATABASE, name)
    store = CosmosEntityStore(
        entity_url(_netloc(cosmos_server), DATABASE, name), key=cosmos_server.key
    )
    try:
        entity = store.load("a")
        entity.outbox["m"] = None
        store.save(entity)
        raw_client.get_database_client(DATABASE).delete_container(name)
        calls: list[Callable[[], object]] = [
            lambda: store.load("a"),  # never a stale "absent"
            lambda: store.load_many(["a", "b"]),
            lambda: list(store.pending_outboxes()),
            lambda: store.save(entity),  # a replace: 404, then the read-back fails loudly
        ]
        for call in calls:
            with pytest.raises(ConfigurationError, match=f"container '{name}'") as info:
                call()
            assert "\n" not in str(info.value)
    finally:
        store.close()


# ---------------------------------------------------------------------- lost answers


def _performed_then(method: str, outcome: Callable[[Any], Any], times: int = 1000) -> Any:
    """Patch ``ContainerProxy.<method>``: its first ``times`` calls perform the request,
    then ``outcome(resend)`` decides what the caller sees (raise: the answer is lost;
    ``resend()``: the request is sent again, as the SDK's retry would)."""
    original = getattr(ContainerProxy, method)
    lock, calls = threading.Lock(), [0]

    def patched(self: ContainerProxy, *args: Any, **kwargs: Any) -> Any:
        with lock:
            calls[0] += 1
            intercept = calls[0] <= times
        result = original(self, *args, **kwargs)
        if not intercept:
            return result
        return outcome(lambda: original(self, *args, **kwargs))

    return mock.patch.object(ContainerProxy, method, patched)


def _lose(_: Any) -> Any:
    raise ServiceResponseError("connection reset: the answer was lost")


def test_a_save_whose_answer_is_lost_raises_and_the_reload_shows_it(
    open_entities: EntityStoreFactory,
) -> None:
    store, other = open_entities(), open_entities()
    new = store.load("new")
    new.state = {"v": 1}
    with _performed_then("create_item", _lose), pytest.raises(StoreUnavailable) as info:
        store.save(new)
    assert isinstance(info.value.__cause__, ServiceResponseError)
    assert new.version is None, "no version for a save that raised"
    loaded = other.load("new")
    assert loaded.state == {"v": 1}, "the write happened: an error, never a wrong answer"
    loaded.state = {"v": 2}
    with _performed_then("replace_item", _lose), pytest.raises(StoreUnavailable):
        other.save(loaded)
    assert store.load("new").state == {"v": 2}
    with pytest.raises(ConcurrencyConflict):
        other.save(loaded)  # its version is the one before the lost write


def test_a_write_resent_after_it_succeeded_is_not_a_conflict(
    open_entities: EntityStoreFactory, raw_container: ContainerProxy
) -> None:
    """The SDK resends a write (a 503, say) that had in fact succeeded: 409/412."""
    store = open_entities()
    entities = store.load_many(["r1", "r2", "r3"])
    for n, entity in enumerate(entities.values()):
        entity.state = {"n": n}
    with _performed_then("create_item", lambda resend: resend()):
        assert store.save_many(list(entities.values())) == set()
    for eid, entity in entities.items():
        assert entity.version == _item(raw_container, eid)["_etag"]
        entity.state = {"n": "replaced"}
    with _performed_then("replace_item", lambda resend: resend()):
        assert store.save_many(list(entities.values())) == set()
    for eid, entity in entities.items():
        assert entity.version == _item(raw_container, eid)["_etag"]
        entity.state = {"n": "after"}
    assert store.save_many(list(entities.values())) == set()  # the versions are right
    assert {e.state["n"] for e in store.load_many(entities).values()} == {"after"}


def test_a_resend_that_finds_a_third_writer_reports_a_conflict(
    open_entities: EntityStoreFactory,
) -> None:
    """The documented residual: our first attempt landed, then someone else saved."""
    store, third = open_entities(), open_entities()
    entity = store.load("x")
    entity.state = {"by": "first"}
    store.save(entity)
    entity.state = {"by": "us"}

    def someone_then_resend(resend: Callable[[], Any]) -> Any:
        theirs = third.load("x")
        assert theirs.state == {"by": "us"}
        theirs.state = {"by": "third", "saw": theirs.state["by"]}
        third.save(theirs)
        return resend()

    with (
        _performed_then("replace_item", someone_then_resend, times=1),
        pytest.raises(ConcurrencyConflict),
    ):
        store.save(entity)
    assert store.load("x").state == {"by": "third", "saw": "us"}


def test_a_batch_failing_part_way_raises_and_writes_no_half_entity(
    open_entities: EntityStoreFactory,
) -> None:
    store = open_entities(max_concurrency=1)
    ids = [f"b{n}" for n in range(6)]
    loaded = store.load_many(ids)
    for eid in ids:
        loaded[eid].state = {"v": 1}
    original = ContainerProxy.create_item
    calls = [0]

    def third_never_sent(self: ContainerProxy, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise ServiceRequestError("connection refused")
        return original(self, *args, **kwargs)

    with (
        mock.patch.object(ContainerProxy, "create_item", third_never_sent),
        pytest.raises(StoreUnavailable),
    ):
        store.save_many(list(loaded.values()))
    after = store.load_many(ids)
    assert all(e.state in ({}, {"v": 1}) for e in after.values())
    assert after["b0"].state == after["b1"].state == {"v": 1}
    assert after["b2"].version is None  # the one never sent; later ones may have been
    for eid in ids:
        after[eid].state = {"v": 2}
    assert store.save_many(list(after.values())) == set()


def test_a_refused_item_is_entity_too_large_not_a_configuration_error(
    open_entities: EntityStoreFactory,
) -> None:
    store = open_entities()
    refused = CosmosHttpResponseError(  # type: ignore[no-untyped-call]
        status_code=413, message="Request size is too large"
    )
    with (
        mock.patch.object(ContainerProxy, "create_item", side_effect=refused),
        pytest.raises(EntityTooLarge, match="413"),
    ):
        store.save(Entity("big"))


# ---------------------------------------------------------------------- an endpoint that stops


class _PausableProxy:
    """A TCP proxy to the emulator that can stop answering and resume.

    While paused it accepts connections and reads requests but forwards nothing
    and answers nothing (a network partition, a hung gateway). ``resume`` resets
    every connection made before it (as a partition that heals leaves them dead)
    and forwards again.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.paused = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._track(client)
            if self.paused.is_set():
                continue  # held open, never answered, reset on resume
            upstream = socket.create_connection(self.target)
            self._track(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.paused.is_set():
                    time.sleep(0.05)  # hold the bytes; resume resets this connection
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _reset_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    def pause(self) -> None:
        self.paused.set()

    def resume(self) -> None:
        self._reset_all()
        self.paused.clear()

    def close(self) -> None:
        self.listener.close()
        self.paused.clear()
        self._reset_all()


@pytest.fixture
def proxy(cosmos_server: CosmosEndpoint) -> Iterator[_PausableProxy]:
    parts = urlsplit(cosmos_server.endpoint_url)
    assert parts.hostname is not None and parts.port is not None
    p = _PausableProxy((parts.hostname, parts.port))
    yield p
    p.close()


@pytest.mark.timeout(120)
def test_an_endpoint_that_stops_answering_is_store_unavailable_then_works_again(
    proxy: _PausableProxy, container_name: str, cosmos_server: CosmosEndpoint
) -> None:
    # Stands in for EntityStoreRestartContract: cosmosdb-server keeps its data in
    # memory, so a restart would lose the container. A proxy that stops answering
    # (and resets its connections when it resumes) checks the same things: every
    # call fails within its timeout with StoreUnavailable, never hangs or guesses,
    # and the same store object works again afterwards, its data and versions intact.
    url = entity_url(f"127.0.0.1:{proxy.port}", DATABASE, container_name)
    url = url.replace("retries=1&timeout=10", "retries=0&timeout=1&connect_timeout=1")
    store = CosmosEntityStore(url, key=cosmos_server.key)
    entity = store.load("e")
    entity.state, entity.outbox["m"] = {"n": 1}, [_message()]
    store.save(entity)
    proxy.pause()
    calls: list[Callable[[], object]] = [
        lambda: store.load("e"),
        lambda: store.save(Entity("new", {"n": 0})),
        lambda: store.save_many([Entity("n1"), Entity("n2")]),
        lambda: list(store.pending_outboxes()),
    ]
    for call in calls:  # bounded by the timeouts: the test's own timeout catches a hang
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert isinstance(info.value.__cause__, AzureError), repr(info.value.__cause__)
        assert "\n" not in str(info.value)
    proxy.resume()
    failures = 0
    while True:  # the first call may meet a reset connection: an error, never a guess
        try:
            loaded = store.load("e")
            break
        except StoreUnavailable:
            failures += 1
            assert failures < 3, "the store did not recover"
    assert loaded.state == {"n": 1} and loaded.version == entity.version
    stale = loaded.copy()
    loaded.state = {"n": 2}
    store.save(loaded)
    with pytest.raises(ConcurrencyConflict):
        store.save(stale)
    assert "e" in {e.id for e in store.pending_outboxes()}
    store.close()


def test_dedup_and_entity_stores_of_one_account_share_one_cosmos_client(
    cosmos_server: CosmosEndpoint, raw_client: CosmosClient, url: str
) -> None:
    """Each store holds a CosmosConnection (neither inherits one): the stores of one
    account, key and connection options share one CosmosClient, whatever container."""
    for cls, role in (
        (CosmosDeduplicationStore, DeduplicationStore),
        (CosmosEntityStore, EntityStore),
    ):
        assert cls.__bases__ == (role,) and cls.connection_class is CosmosConnection
        assert cls.schemes == ("cosmos",)
        assert {"key", "tls", "timeout", "connect_timeout", "retries", "create"} <= set(
            cls.declared_options
        )
    name = f"d-{uuid.uuid4().hex[:12]}"
    create_container(raw_client, DATABASE, name)
    dedup_url = entity_url(_netloc(cosmos_server), DATABASE, name)
    try:
        with (
            CosmosEntityStore(url, key=cosmos_server.key) as entities,
            CosmosDeduplicationStore(dedup_url, key=cosmos_server.key) as dedup,
            CosmosDeduplicationStore(dedup_url, key=cosmos_server.key, connect_timeout=4) as slower,
        ):
            assert dedup._cosmos is entities._cosmos and dedup._shares_connection_with(entities)
            assert slower._cosmos is not dedup._cosmos
            assert (
                dedup.add("m")
                and entities.load("e").version is None
                and slower.has_been_processed("m")
            )
    finally:
        raw_client.get_database_client(DATABASE).delete_container(name)
