"""The entity store contract on DynamoDB (moto's server), and what is specific to DynamoDB.

moto differs from DynamoDB in ways these tests keep in mind (see also
``tests/test_dynamodb.py``): it keeps its data in memory, so a restart loses every
table (the restart contract cannot run: a server-down test takes its place); it
checks the item size at 405,000 bytes where DynamoDB allows 409,600 (the size
limit is chosen under both); its parallel scan splits by the first byte of an MD5
of the key (at most 256 non-empty segments); it emulates no throttling, no lost
answers and no global tables, which are injected through botocore's event hooks.
"""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import botocore.exceptions
import pytest
import tenacity

import dedupstore
from dedupstore import calls as dedup_calls
from dedupstore.backends.dynamodb import DynamoDBDeduplicationStore, DynamoDBEntityStore
from dedupstore.backends.dynamodb.entities import MAX_ITEM_BYTES, MAX_SCAN_SEGMENTS
from dedupstore.entities import Entity, EntityStore, OutgoingMessage, encode_entity
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    ConsistencyError,
    EntityTooLarge,
    StoreUnavailable,
)
from dedupstore.ids import MAX_ID_BYTES
from dedupstore.registry import resolve
from dedupstore.testing.entities import EntityStoreContract, EntityStoreFactory
from tests.servers import DynamoDBEndpoint, MotoServer, free_port
from tests.test_dynamodb import (
    FAKE_KEY_ID,
    FAKE_SECRET,
    FAKE_TOKEN,
    Recorder,
    _client,
    _inject,
    _one_line,
    _url,
    _with_replicas,
    aws_environment,  # noqa: F401 - autouse: fake credentials from the environment only
)

pytestmark = pytest.mark.dynamodb


@pytest.fixture
def entity_url(dynamodb_server: DynamoDBEndpoint, raw_client: Any) -> Iterator[str]:
    """A fresh entity table for this test, created through ``create=True``."""
    table = f"entities-{uuid.uuid4().hex}"
    url = _url(dynamodb_server, table)
    DynamoDBEntityStore(url, create=True).close()
    yield url
    raw_client.delete_table(TableName=table)


@pytest.fixture
def raw_client(dynamodb_server: DynamoDBEndpoint) -> Any:
    """A plain boto3 client of the test endpoint."""
    return _client(dynamodb_server)


def _table(url: str) -> str:
    return url.split("://", 1)[1].split("?", 1)[0]


class TestDynamoDBEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self, entity_url: str) -> EntityStoreFactory:
        return lambda **options: DynamoDBEntityStore(entity_url, **options)


def _pending(entity: Entity, mid: str = "m-1") -> Entity:
    entity.outbox[mid] = [OutgoingMessage(f"{mid}/out", "shipping", {"n": 1})]
    return entity


# ---------------------------------------------------------------------- layout


def test_item_layout_and_table(entity_url: str, raw_client: Any) -> None:
    table = _table(entity_url)
    with dedupstore.open_entity_store(entity_url) as store:
        assert isinstance(store, DynamoDBEntityStore) and store.table == table
        entity = _pending(store.load("order-1"))
        entity.state = {"n": 1, "é": "🦄"}
        store.save(entity)
        first = raw_client.get_item(TableName=table, Key={"id": {"S": "order-1"}})["Item"]
        assert set(first) == {"id", "body", "version", "token", "pending"}
        assert first["body"] == {"S": encode_entity(entity)}
        assert first["version"] == {"N": "1"} and first["pending"] == {"BOOL": True}
        assert len(first["token"]["S"]) == 32
        entity.outbox["m-1"] = None  # dispatched: still in the outbox, still scanned
        store.save(entity)
        second = raw_client.get_item(TableName=table, Key={"id": {"S": "order-1"}})["Item"]
        assert second["pending"] == {"BOOL": True} and second["version"] == {"N": "2"}
        del entity.outbox["m-1"]
        store.save(entity)
        assert entity.version == 3
    item = raw_client.get_item(TableName=table, Key={"id": {"S": "order-1"}})["Item"]
    assert set(item) == {"id", "body", "version", "token"}, "no pending flag once empty"
    assert item["body"] == {"S": '{"outbox":{},"state":{"n":1,"é":"🦄"}}'}
    assert item["version"] == {"N": "3"} and item["token"] != first["token"]
    description = raw_client.describe_table(TableName=table)["Table"]
    assert description["KeySchema"] == [{"AttributeName": "id", "KeyType": "HASH"}]
    assert description["AttributeDefinitions"] == [{"AttributeName": "id", "AttributeType": "S"}]
    assert description["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"


def test_requests_are_conditional_puts_consistent_reads_and_parallel_scans(
    dynamodb_server: DynamoDBEndpoint, entity_url: str
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    in_flight, peak, lock = 0, 0, threading.Lock()

    def sent(**_: Any) -> None:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)

    def answered(**_: Any) -> None:
        nonlocal in_flight
        with lock:
            in_flight -= 1

    client.meta.events.register("before-send.dynamodb.PutItem", sent)
    client.meta.events.register("needs-retry.dynamodb.PutItem", answered)
    with DynamoDBEntityStore(entity_url, client=client) as store:
        recorder.calls.clear()
        ids = [f"req-{i}" for i in range(230)]
        loaded = store.load_many(ids)
        for eid in ids:
            _pending(loaded[eid])
        assert store.save_many(list(loaded.values())) == set()
        again = store.load_many(ids)
        for eid in ids[:5]:
            store.save(again[eid])
        found = [e.id for s in range(4) for e in store.pending_outboxes(s, 4)]
        assert sorted(found) == sorted(ids)
    names = [name for name, _ in recorder.calls]
    assert set(names) == {"BatchGetItem", "PutItem", "Scan"}, "no transaction, no batch write"
    gets = recorder.named("BatchGetItem")
    assert (
        len(gets) == 2 * 3
        and max(len(g["RequestItems"][_table(entity_url)]["Keys"]) for g in gets) <= 100
    )
    assert all(g["RequestItems"][_table(entity_url)]["ConsistentRead"] is True for g in gets)
    puts = recorder.named("PutItem")
    assert len(puts) == 230 + 5
    assert 1 < peak <= DynamoDBEntityStore.save_concurrency, "puts run in parallel, bounded"
    assert all(p["ReturnValuesOnConditionCheckFailure"] == "ALL_OLD" for p in puts)
    new = [p for p in puts if p["ConditionExpression"] == "attribute_not_exists(#i)"]
    update = [p for p in puts if p["ConditionExpression"] == "#v = :expected"]
    assert len(new) == 230 and len(update) == 5
    assert all(p["ExpressionAttributeValues"] == {":expected": {"N": "1"}} for p in update)
    scans = recorder.named("Scan")
    assert [(s["Segment"], s["TotalSegments"]) for s in scans] == [(s, 4) for s in range(4)]
    assert all(s["ConsistentRead"] is True and "FilterExpression" in s for s in scans)


def test_scan_pages_through_more_than_one_megabyte(
    dynamodb_server: DynamoDBEndpoint, entity_url: str
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    with DynamoDBEntityStore(entity_url, client=client) as store:
        ids = [f"big-{i}" for i in range(8)]
        loaded = store.load_many(ids)
        for eid in ids:
            _pending(loaded[eid]).state = {"blob": eid * 50_000}  # 250 KB each
        store.save_many(list(loaded.values()))
        quiet = store.load("quiet")
        quiet.state = {"blob": "q" * 300_000}
        store.save(quiet)
        recorder.calls.clear()
        seen = {e.id: e for e in store.pending_outboxes()}
        assert sorted(seen) == ids
        assert all(seen[eid].state == loaded[eid].state for eid in ids)
        assert len(recorder.named("Scan")) >= 3, "a page holds at most 1 MB"
        starts = [s.get("ExclusiveStartKey") for s in recorder.named("Scan")]
        assert starts[0] is None and all(starts[1:])


def test_segments_beyond_dynamodb_limit_are_refused(entity_url: str) -> None:
    with DynamoDBEntityStore(entity_url) as store:
        store.save(_pending(store.load("s")))
        assert [
            e.id for e in store.pending_outboxes(MAX_SCAN_SEGMENTS - 1, MAX_SCAN_SEGMENTS)
        ] == []
        with pytest.raises(ValueError, match="1000000 segments"):
            list(store.pending_outboxes(0, MAX_SCAN_SEGMENTS + 1))


# ---------------------------------------------------------------------- size limit


def _entity_of_size(eid: str, size: int) -> Entity:
    """A pending entity whose canonical JSON is exactly ``size`` bytes."""
    entity = _pending(Entity(eid))
    entity.state = {"blob": ""}
    entity.state = {"blob": "b" * (size - len(encode_entity(entity).encode()))}
    assert len(encode_entity(entity).encode()) == size
    return entity


def test_largest_entity_with_the_longest_id_is_stored(
    dynamodb_server: DynamoDBEndpoint, entity_url: str, raw_client: Any
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    limit = DynamoDBEntityStore.max_entity_bytes
    eid = "é" * (MAX_ID_BYTES // 2)  # the longest id: 1024 UTF-8 bytes
    with DynamoDBEntityStore(entity_url, client=client) as store:
        largest = _entity_of_size(eid, limit)
        store.save(largest)
        store.save(largest)  # again, at version 2: a longer version number
        assert store.load(eid).state == largest.state
        recorder.calls.clear()
        with pytest.raises(EntityTooLarge, match=str(limit)):
            store.save(_entity_of_size(eid, limit + 1))
        with pytest.raises(EntityTooLarge):
            store.save_many([Entity("small"), _entity_of_size("other", limit + 1)])
        assert recorder.calls == [], "refused before any request"
        assert store.load(eid).version == 2 and store.load("small").version is None
    # the stored item, counted as DynamoDB counts it (names + values), fits with room
    item = raw_client.get_item(TableName=_table(entity_url), Key={"id": {"S": eid}})["Item"]
    assert set(item) == {"id", "body", "version", "token", "pending"}
    assert limit < _item_size(item) < 405_000 < MAX_ITEM_BYTES
    # the worst case: a 38-digit version number takes 21 bytes
    assert limit + MAX_ID_BYTES + len("idbodyversiontokenpending") + 21 + 32 + 1 <= MAX_ITEM_BYTES


def _item_size(item: dict[str, Any]) -> int:
    """An item's size as DynamoDB counts it: UTF-8 names plus values (numbers: digits)."""
    size = 0
    for name, value in item.items():
        ((kind, raw),) = value.items()
        size += len(name.encode()) + (1 if kind == "BOOL" else len(str(raw).encode()))
    return size


# ---------------------------------------------------------------------- lost answers


def _lose_first_success(client: Any, before_resend: Callable[[], None] = lambda: None) -> list[int]:
    """Make botocore re-send the first successful PutItem, as after a lost answer.

    ``before_resend`` runs between the applied put and its re-send (a rival's save).
    """
    forced: list[int] = []

    def handler(response: Any, attempts: int, **_: Any) -> int | None:
        if response is not None and response[0].status_code == 200 and not forced:
            forced.append(attempts)
            before_resend()
            return 0
        return None

    client.meta.events.register("needs-retry.dynamodb.PutItem", handler)
    return forced


def _rival_saves(url: str, eid: str, state: dict[str, Any]) -> Callable[[], None]:
    def save() -> None:
        with DynamoDBEntityStore(url) as rival:
            entity = rival.load(eid)
            entity.state = state
            rival.save(entity)

    return save


def test_a_save_several_versions_behind_is_a_plain_conflict(entity_url: str) -> None:
    """Without a re-send, a failed condition is a conflict whatever the stored version."""
    with DynamoDBEntityStore(entity_url) as store:
        entity = store.load("behind")
        store.save(entity)
        stale, stale_new = store.load("behind"), store.load("other")
        for _ in range(3):
            store.save(entity)
        rival = store.load("other")
        store.save(rival)
        store.save(rival)
        with pytest.raises(ConcurrencyConflict):
            store.save(stale)  # expected 1, stored 4
        with pytest.raises(ConcurrencyConflict):
            store.save(stale_new)  # expected absent, stored 2
        assert store.save_many([stale, stale_new]) == {"behind", "other"}


@pytest.mark.parametrize("existing", [False, True], ids=["new", "update"])
def test_a_resent_put_that_was_applied_counts_as_written(
    dynamodb_server: DynamoDBEndpoint, entity_url: str, existing: bool
) -> None:
    client = _client(dynamodb_server)
    with DynamoDBEntityStore(entity_url, client=client) as store:
        entity = store.load("lost")
        if existing:
            store.save(entity)
        forced = _lose_first_success(client)
        entity.state = {"mine": True}
        store.save(entity)  # the re-send fails its condition on our own write: no conflict
        assert forced == [1]
        expected = 2 if existing else 1
        assert entity.version == expected
        assert store.load("lost") == Entity("lost", {"mine": True}, {}, expected)


def test_a_resent_put_overwritten_since_raises_store_unavailable(
    dynamodb_server: DynamoDBEndpoint, entity_url: str
) -> None:
    client = _client(dynamodb_server)
    with DynamoDBEntityStore(entity_url, client=client) as store:
        entity = store.load("overwritten")
        store.save(entity)
        _lose_first_success(client, _rival_saves(entity_url, "overwritten", {"rival": 1}))
        entity.state = {"mine": True}
        # ours was applied (version 2), the rival saved version 3 over it: whether the
        # re-sent put was ours cannot be told from the item, so no conflict is claimed
        with pytest.raises(StoreUnavailable, match="unknown") as info:
            store.save(entity)
        _one_line(info.value)
        assert store.load("overwritten") == Entity("overwritten", {"rival": 1}, {}, 3)


def test_a_resent_put_that_never_applied_is_a_conflict(
    dynamodb_server: DynamoDBEndpoint, entity_url: str
) -> None:
    client = _client(dynamodb_server)
    rival = _rival_saves(entity_url, "raced", {"rival": 1})
    failed: list[int] = []

    def drop_first_attempt(**_: Any) -> None:
        if not failed:  # the put never reaches the server; the rival saves meanwhile
            failed.append(1)
            rival()
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://dropped")

    with DynamoDBEntityStore(entity_url, client=client) as store:
        entity = store.load("raced")
        store.save(entity)
        client.meta.events.register("before-send.dynamodb.PutItem", drop_first_attempt)
        entity.state = {"mine": True}
        with pytest.raises(ConcurrencyConflict):  # the rival made the step 1 -> 2, not us
            store.save(entity)
        assert failed == [1]
        assert store.load("raced") == Entity("raced", {"rival": 1}, {}, 2)


def test_a_save_whose_answer_is_lost_raises_and_never_reports_a_wrong_outcome(
    entity_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = DynamoDBEntityStore(entity_url, retries=0), DynamoDBEntityStore(entity_url)
    client = store._dynamodb.client
    real = client.put_item

    def applied_then_lost(**kwargs: Any) -> Any:
        real(**kwargs)
        raise botocore.exceptions.ReadTimeoutError(endpoint_url="http://lost")

    monkeypatch.setattr(client, "put_item", applied_then_lost)
    entity = store.load("answer-lost")
    entity.state = {"mine": True}
    with pytest.raises(StoreUnavailable, match=r"(?i)timeout") as info:
        store.save(entity)
    assert isinstance(info.value.__cause__, botocore.exceptions.ReadTimeoutError)
    assert entity.version is None, "an unknown outcome does not move the version"
    assert other.load("answer-lost") == Entity("answer-lost", {"mine": True}, {}, 1)
    monkeypatch.undo()
    # saving the same object again: the store holds a newer version (ours): a conflict,
    # after which a reload shows the state the failed call wrote
    with pytest.raises(ConcurrencyConflict):
        store.save(entity)
    assert store.load("answer-lost").state == {"mine": True}
    store.close()
    other.close()


def test_save_many_failing_part_way_raises_and_keeps_what_was_written(
    entity_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DynamoDBEntityStore(entity_url, retries=0)
    client = store._dynamodb.client
    real = client.put_item

    def fail_one(**kwargs: Any) -> Any:
        if kwargs["Item"]["id"]["S"] == "part-3":
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://down")
        return real(**kwargs)

    ids = [f"part-{i}" for i in range(20)]
    entities = list(store.load_many(ids).values())
    for entity in entities:
        entity.state = {"id": entity.id}
    monkeypatch.setattr(client, "put_item", fail_one)
    with pytest.raises(StoreUnavailable) as info:
        store.save_many(entities)
    assert isinstance(info.value.__cause__, botocore.exceptions.EndpointConnectionError)
    monkeypatch.undo()
    after = store.load_many(ids)
    # the puts that started before the failure are written whole; none after it starts
    written = {eid for eid, e in after.items() if e.version is not None}
    assert "part-3" not in written and {"part-0", "part-1", "part-2"} <= written
    assert all(after[eid].state == {"id": eid} for eid in written)
    # a retry with the same objects: the written ones conflict (reload), the rest is saved
    assert store.save_many(entities) == written
    assert store.load("part-3") == Entity("part-3", {"id": "part-3"}, {}, 1)
    store.close()


# ---------------------------------------------------------------------- injected answers


@pytest.mark.parametrize(
    "code", ["ProvisionedThroughputExceededException", "ThrottlingException", "InternalServerError"]
)
def test_throttling_and_server_errors_raise_store_unavailable(
    dynamodb_server: DynamoDBEndpoint, entity_url: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request is retried once (``retries=1``), then ``StoreUnavailable``."""
    monkeypatch.setattr(dedup_calls, "BACKOFF", tenacity.wait_none())
    client = _client(dynamodb_server)
    with DynamoDBEntityStore(entity_url, client=client, retries=1) as store:
        error = {"Error": {"Code": code, "Message": "slow down"}}
        # (operation, requests the call makes, call): save_many sends two puts in parallel
        calls: list[tuple[str, int, Callable[[], object]]] = [
            ("PutItem", 1, lambda: store.save(Entity("t"))),
            ("PutItem", 2, lambda: store.save_many([Entity("t1"), Entity("t2")])),
            ("BatchGetItem", 1, lambda: store.load("t")),
            ("Scan", 1, lambda: list(store.pending_outboxes())),
        ]
        for operation, requests, call in calls:
            answers = [json.loads(json.dumps(error)) for _ in range(2 * requests)]
            _inject(client, operation, answers)
            with pytest.raises(StoreUnavailable, match=code) as info:
                call()
            assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
            _one_line(info.value)
            assert answers == [], "every injected answer was used"


def test_unprocessed_keys_are_asked_again_then_give_up(
    dynamodb_server: DynamoDBEndpoint, entity_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dedupstore.backends.dynamodb._client as dynamodb_client

    monkeypatch.setattr(dedup_calls, "BACKOFF", tenacity.wait_none())
    client = _client(dynamodb_server)
    table = _table(entity_url)
    with DynamoDBEntityStore(entity_url, client=client) as store:
        saved = store.load_many(["u1", "u2"])
        store.save_many(list(saved.values()))
        partial = {
            "Responses": {table: []},
            "UnprocessedKeys": {table: {"Keys": [{"id": {"S": "u1"}}, {"id": {"S": "u2"}}]}},
        }
        seen = _inject(client, "BatchGetItem", [partial])
        loaded = store.load_many(["u1", "u2", "u3"])
        assert [loaded[e].version for e in ("u1", "u2", "u3")] == [1, 1, None]
        assert len(seen) == 2
        stuck = [
            {**partial, "UnprocessedKeys": dict(partial["UnprocessedKeys"])} for _ in range(20)
        ]
        seen = _inject(client, "BatchGetItem", stuck)
        with pytest.raises(StoreUnavailable, match="unprocessed"):
            store.load("u1")
        assert len(seen) == dynamodb_client._MAX_BACKOFF_ROUNDS + 1


# ---------------------------------------------------------------------- opening and options


def test_open_by_url_with_create(dynamodb_server: DynamoDBEndpoint, raw_client: Any) -> None:
    table = f"created-{uuid.uuid4().hex}"
    url = _url(dynamodb_server, table, create="true")
    with dedupstore.open_entity_store(url) as store:
        assert isinstance(store, DynamoDBEntityStore) and store.option("create") is True
        store.save(_pending(store.load("first")))
        assert store.health_warnings() == []
        store.create_table()  # idempotent
    with dedupstore.open_entity_store(url) as again:
        assert again.load("first").version == 1
    ttl = raw_client.describe_time_to_live(TableName=table)["TimeToLiveDescription"]
    assert ttl["TimeToLiveStatus"] == "DISABLED", "entities never expire"
    raw_client.delete_table(TableName=table)


def test_missing_table_without_create_is_a_configuration_error(
    dynamodb_server: DynamoDBEndpoint,
) -> None:
    with pytest.raises(ConfigurationError) as info:
        dedupstore.open_entity_store(_url(dynamodb_server, "no-such-entities"))
    message = _one_line(info.value)
    assert "no-such-entities" in message and "create=True" in message and "id (S, HASH)" in message


def test_tables_of_the_other_kind_are_refused(
    dynamodb_server: DynamoDBEndpoint, entity_url: str
) -> None:
    """One URL cannot mix entities and deduplication records: the key schemas differ."""
    dedup_url = _url(dynamodb_server, f"dedup-{uuid.uuid4().hex}", create="true")
    dedupstore.open_store(dedup_url).close()
    with pytest.raises(ConfigurationError, match="an entity table needs id") as info:
        dedupstore.open_entity_store(dedup_url, create=True)
    assert "'pk': 'HASH'" in _one_line(info.value)
    with pytest.raises(ConfigurationError, match="a deduplication table needs pk"):
        DynamoDBDeduplicationStore(entity_url)


@pytest.mark.parametrize(
    ("query", "options", "fragment"),
    [
        ("", {"retention": "1d"}, "unknown option 'retention'"),
        ("", {"endpoint": "orders"}, "unknown option 'endpoint'"),
        ("&max_clock_skew=5", {}, "unknown option 'max_clock_skew'"),
        ("", {"clock": time.time}, "unknown option 'clock'"),
        ("&timeout=0", {}, "timeout"),
        ("&connect_timeout=never", {}, "connect_timeout"),
        ("&retries=-1", {}, "retries"),
        ("&create=maybe", {}, "create"),
        ("&allow_global_table=perhaps", {}, "allow_global_table"),
        ("&region_name=us-east-1", {}, "unknown option 'region_name'"),
        ("", {"aws_secret_access_key": FAKE_SECRET}, "together"),
    ],
)
def test_bad_options_fail_before_any_request(
    dynamodb_server: DynamoDBEndpoint, query: str, options: dict[str, Any], fragment: str
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    url = _url(dynamodb_server, "any-entities") + query
    with pytest.raises(ConfigurationError, match=fragment) as info:
        DynamoDBEntityStore(url, client=client, **options)
    assert FAKE_SECRET not in _one_line(info.value)
    assert recorder.calls == []


@pytest.mark.parametrize(
    "url",
    [
        "dynamodb://ab?region=us-east-1",
        "dynamodb://table/extra?region=us-east-1",
        "dynamodb://table?region=us-east-1&color=blue",
    ],
)
def test_bad_urls_are_configuration_errors(url: str) -> None:
    with pytest.raises(ConfigurationError):
        dedupstore.open_entity_store(url)


def test_options_convert_round_trip_and_bound_every_request(entity_url: str) -> None:
    url = f"{entity_url}&connect_timeout=2.5&timeout=4s&retries=3"
    with DynamoDBEntityStore(
        url,
        aws_access_key_id=FAKE_KEY_ID,
        aws_secret_access_key=FAKE_SECRET,
        aws_session_token=FAKE_TOKEN,
    ) as store:
        config = store._dynamodb.client.meta.config
        assert config.read_timeout == 4.0 and config.connect_timeout == 2.5
        # botocore retries nothing: the store does, within the call's deadline
        assert config.retries == {"mode": "standard", "total_max_attempts": 1}
        assert store._deadline_seconds() == 2.5 + 4 * 4.0
        store.save(store.load("opt"))
        clone = pickle.loads(pickle.dumps(store))
        assert clone.option("timeout") == 4.0 and clone.load("opt").version == 1
        text = repr(store) + store.url + repr(clone)
        assert FAKE_SECRET not in text and FAKE_TOKEN not in text
        clone.close()


def test_client_option_is_used_not_pickled_not_closed(
    dynamodb_server: DynamoDBEndpoint, entity_url: str
) -> None:
    client = _client(dynamodb_server)
    with DynamoDBEntityStore(entity_url, client=client) as store:
        assert store._dynamodb.client is client
        store.save(store.load("via-client"))
        clone = pickle.loads(pickle.dumps(store))
        assert clone._dynamodb.client is not client and clone.load("via-client").version == 1
        clone.close()
    assert client.describe_table(TableName=_table(entity_url))["Table"]["TableName"]


def test_global_table_is_refused_unless_allowed(
    dynamodb_server: DynamoDBEndpoint, entity_url: str
) -> None:
    client = _client(dynamodb_server)
    _with_replicas(client)
    with pytest.raises(ConsistencyError, match="allow_global_table") as info:
        DynamoDBEntityStore(entity_url, client=client)
    assert "eu-west-1" in _one_line(info.value)
    with DynamoDBEntityStore(entity_url, client=client, allow_global_table=True) as store:
        store.save(store.load("g"))
        assert any("replicas" in w for w in store.health_warnings())


# ---------------------------------------------------------------------- server failures


def test_unreachable_endpoint_is_store_unavailable() -> None:
    url = f"dynamodb://t-unreachable?region=us-east-1&endpoint_url=http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnavailable) as info:
        dedupstore.open_entity_store(url, connect_timeout=1, retries=0)
    assert isinstance(info.value.__cause__, botocore.exceptions.EndpointConnectionError)
    assert "t-unreachable" in _one_line(info.value)


@pytest.mark.timeout(60)
def test_server_that_never_answers_raises_within_the_timeout() -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    url = f"dynamodb://silent-entities?region=us-east-1&endpoint_url=http://127.0.0.1:{port}"
    try:
        with pytest.raises(StoreUnavailable, match=r"(?i)timeout") as info:
            DynamoDBEntityStore(url, timeout=3, retries=0)  # the deadline covers the client too
        assert isinstance(info.value.__cause__, botocore.exceptions.ReadTimeoutError)
        assert accepted, "the client never connected"
    finally:
        stop.set()
        thread.join(10)
        for connection in accepted:
            connection.close()
        listener.close()


def test_table_deleted_while_open_is_a_configuration_error(
    dynamodb_server: DynamoDBEndpoint, raw_client: Any
) -> None:
    table = f"deleted-{uuid.uuid4().hex}"
    store = DynamoDBEntityStore(_url(dynamodb_server, table, create="true"))
    store.save(store.load("before"))
    raw_client.delete_table(TableName=table)
    calls: list[Callable[[], object]] = [
        lambda: store.load("before"),
        lambda: store.save(Entity("x")),
        lambda: store.save_many([Entity("x"), Entity("y")]),
        lambda: list(store.pending_outboxes()),
    ]
    for call in calls:
        with pytest.raises(ConfigurationError, match="does not exist") as info:
            call()
        assert table in _one_line(info.value)
    store.close()


@pytest.mark.timeout(120)
def test_server_down_raises_within_the_timeout_and_the_store_recovers() -> None:
    """Stands in for ``EntityStoreRestartContract``: moto keeps its tables in memory,
    so a restarted moto_server has lost them (the contract expects the data back).
    Here the endpoint is killed: every call raises ``StoreUnavailable`` (the test's
    own timeout catches a hang), never a guess; then a new moto_server on the same
    port, with the table created again, serves the SAME store object."""
    with MotoServer() as server:
        url = _url(server, f"down-{uuid.uuid4().hex}", create="true")
        store = DynamoDBEntityStore(url, connect_timeout=1, timeout=2, retries=1)
        entity = _pending(store.load("e"))
        store.save(entity)
        server.kill()
        calls: list[Callable[[], object]] = [
            lambda: store.load("e"),
            lambda: store.save(entity),
            lambda: store.save_many([Entity("a"), Entity("b")]),
            lambda: list(store.pending_outboxes()),
            store.health_warnings,
        ]
        for call in calls:  # bounded by the timeouts: the test's own timeout catches a hang
            with pytest.raises(StoreUnavailable) as info:
                call()
            assert isinstance(info.value.__cause__, botocore.exceptions.BotoCoreError)
            _one_line(info.value)
        assert entity.version == 1
        server.restart()  # same port, empty: moto lost the table
        with pytest.raises(ConfigurationError, match="does not exist"):
            store.load("e")
        store.create_table()
        assert store.load("e") == Entity("e")
        fresh = _pending(store.load("e"))
        store.save(fresh)
        stale = store.load("e")
        fresh.state = {"n": 2}
        store.save(fresh)
        with pytest.raises(ConcurrencyConflict):
            store.save(stale)
        assert [e.id for e in store.pending_outboxes()] == ["e"]
        store.close()


def test_the_registry_maps_the_scheme_to_the_entity_store() -> None:
    assert issubclass(DynamoDBEntityStore, EntityStore)
    assert resolve("entity_store", "dynamodb") is DynamoDBEntityStore
