"""The DynamoDB backend against moto's server mode, plus DynamoDB-specific checks.

Emulator gaps handled here (test configuration, not library code):

* moto serves requests on several threads without a lock, and cancels a transaction
  by restoring a deep copy of the whole table taken when the transaction began, which
  silently discards writes other threads committed meanwhile (seen: acknowledged
  puts lost). It also deep-copies the whole table once per item of a transaction,
  so a 100-item transaction on a 500-item table takes seconds. The suite therefore
  runs moto behind a WSGI wrapper that serves one request at a time and rolls a
  cancelled transaction back item by item (``tests/moto_serialized.py``, started by
  ``MotoServer``); real DynamoDB needs no such thing.
* moto accepts 26-item ``BatchWriteItem`` and ignores ``ClientRequestToken`` and TTL:
  ``test_requests_respect_real_dynamodb_limits`` checks the sizes the backend sends
  against the real limits, retention tests rely on the stored expiry only.
* moto does not emulate global tables, throttling or transaction conflicts: those
  answers are injected through botocore's event hooks.
* moto's IAM emulation answers a JSON-protocol client with an XML 403 body.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import boto3
import botocore.exceptions
import pytest
import tenacity

import dedupstore.backends.dynamodb._client as dynamodb_client
from dedupstore import (
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    StoreClosed,
    StoreUnavailable,
    calls,
    open_store,
)
from dedupstore.backends.dynamodb import DynamoDBDeduplicationStore, DynamoDBTokenStore
from dedupstore.client import Client
from dedupstore.store import MAX_ID_BYTES, DeduplicationStore
from dedupstore.testing import (
    DeduplicationStoreContract,
    FakeClock,
    MultiProcessContract,
    StoreFactory,
    TokenStoreContract,
    TokenStoreFactory,
)
from dedupstore.tokens import TokenCount, TokenStore
from tests.proxy import TcpProxy
from tests.servers import DynamoDBEndpoint, MotoServer, free_port

pytestmark = pytest.mark.dynamodb

FAKE_KEY_ID = "testing"
FAKE_SECRET = "fake-secret-Zq9"
FAKE_TOKEN = "fake-session-token-Xw7"


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials from the environment (the default chain), nothing else."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _url(server: DynamoDBEndpoint, table: str, **query: str) -> str:
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"dynamodb://{table}?region={server.region}&endpoint_url={server.endpoint_url}{extra}"


def _client(server: DynamoDBEndpoint) -> Any:
    return boto3.client(
        "dynamodb",
        endpoint_url=server.endpoint_url,
        region_name=server.region,
        aws_access_key_id=FAKE_KEY_ID,
        aws_secret_access_key=FAKE_SECRET,
    )


@pytest.fixture
def raw_client(dynamodb_server: DynamoDBEndpoint) -> Any:
    """A plain boto3 client of the test endpoint."""
    return _client(dynamodb_server)


@pytest.fixture
def table_url(dynamodb_server: DynamoDBEndpoint, raw_client: Any) -> Iterator[str]:
    """A fresh table for this test, created through ``create=True``."""
    table = f"dedup-{uuid.uuid4().hex}"
    url = _url(dynamodb_server, table)
    open_store(url, create=True).close()
    yield url
    raw_client.delete_table(TableName=table)


def _table(url: str) -> str:
    return url.split("://", 1)[1].split("?", 1)[0]


class TestDynamoDBStore(DeduplicationStoreContract, MultiProcessContract):
    @pytest.fixture
    def store_factory(self, table_url: str) -> StoreFactory:
        def make(**options: Any) -> DeduplicationStore:
            return open_store(table_url, **options)

        return make


@pytest.fixture
def token_url(dynamodb_server: DynamoDBEndpoint, raw_client: Any) -> Iterator[str]:
    """A fresh token table for this test, created through ``create=True``."""
    table = f"tokens-{uuid.uuid4().hex}"
    url = _url(dynamodb_server, table)
    DynamoDBTokenStore(url, create=True).close()
    yield url
    raw_client.delete_table(TableName=table)


class TestDynamoDBTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(self, token_url: str) -> TokenStoreFactory:
        def make(**options: Any) -> TokenStore:
            return DynamoDBTokenStore(token_url, **options)

        return make


# ---------------------------------------------------------------------- helpers


class Recorder:
    """Counts what the backend asks of DynamoDB, through botocore's event hooks."""

    def __init__(self, client: Any) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        client.meta.events.register("before-parameter-build.dynamodb.*", self._params)
        client.meta.events.register("before-send.dynamodb.*", self._send)

    def _params(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        self.calls.append((model.name, json.loads(json.dumps(params, default=repr))))

    def _send(self, request: Any, event_name: str, **_: Any) -> None:
        self.bodies.append((event_name.split(".")[-1], json.loads(request.body or b"{}")))

    def named(self, operation: str) -> list[dict[str, Any]]:
        return [params for name, params in self.calls if name == operation]


def _sizes(recorder: Recorder) -> dict[str, list[int]]:
    sizes: dict[str, list[int]] = {}
    for name, params in recorder.calls:
        if name == "TransactWriteItems":
            size = len(params["TransactItems"])
        elif name == "BatchWriteItem":
            size = sum(len(v) for v in params["RequestItems"].values())
        elif name == "BatchGetItem":
            size = sum(len(v["Keys"]) for v in params["RequestItems"].values())
        else:
            size = 1
        sizes.setdefault(name, []).append(size)
    return sizes


def _inject(client: Any, operation: str, answers: list[dict[str, Any] | None]) -> list[int]:
    """Answer the next calls of ``operation`` with ``answers`` (None: the real server).

    Each answer is a parsed response; one with an ``Error`` is raised as botocore would.
    Returns a list that receives one entry per intercepted call.
    """
    seen: list[int] = []

    class _Http:
        def __init__(self, status: int) -> None:
            self.status_code = status
            self.headers: dict[str, str] = {}

    def handler(**_: Any) -> tuple[_Http, dict[str, Any]] | None:
        seen.append(1)
        if not answers:
            return None
        answer = answers.pop(0)
        if answer is None:
            return None
        status = 400 if "Error" in answer else 200
        answer.setdefault("ResponseMetadata", {"HTTPStatusCode": status})
        return _Http(status), answer

    client.meta.events.register(f"before-call.dynamodb.{operation}", handler)
    return seen


def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "BACKOFF", tenacity.wait_none())


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, text
    return text


# ---------------------------------------------------------------------- layout


def test_key_is_the_id_and_the_endpoint_verbatim(table_url: str, raw_client: Any) -> None:
    """(endpoint, id) is the key itself: no encoding, hence no collision."""
    endpoints = ["a", "a:b", "1:a", "e" * MAX_ID_BYTES, "🦄" * (MAX_ID_BYTES // 4)]
    ids = ["b:c", "c", "2:b:c", "q" * MAX_ID_BYTES, "é" * (MAX_ID_BYTES // 2)]
    stores = [open_store(table_url, endpoint=ep) for ep in endpoints]
    try:
        for store in stores:
            assert store.add_many(ids) == set(ids)
            assert store.add(ids[0]) is False
        for store in stores:
            assert store.processed_among(ids) == set(ids)
        items = raw_client.scan(TableName=_table(table_url), ConsistentRead=True)["Items"]
        assert sorted((i["sk"]["S"], i["pk"]["S"]) for i in items) == sorted(
            (ep, mid) for ep in endpoints for mid in ids
        )
    finally:
        for store in stores:
            store.close()


def test_stored_attributes(table_url: str, raw_client: Any) -> None:
    clock = FakeClock(1_700_000_000.123456)
    with open_store(table_url, retention=timedelta(seconds=90.5), clock=clock) as store:
        store.add("with-retention")
        store.add_many(["batch-1", "batch-2"])
    with open_store(table_url) as store:
        store.add("forever")
    key = {"sk": {"S": "default"}}
    item = raw_client.get_item(
        TableName=_table(table_url), Key={"pk": {"S": "with-retention"}, **key}
    )["Item"]
    expires = clock.now + 90.5
    assert float(item["expires_at"]["N"]) == expires
    # native TTL waits max_clock_skew (60 s) past the expiry, like purge_expired
    assert int(item["ttl"]["N"]) == math.ceil(expires + 60)
    assert item["writer"]["S"]  # the write token of the call
    batch = raw_client.get_item(TableName=_table(table_url), Key={"pk": {"S": "batch-1"}, **key})
    assert float(batch["Item"]["expires_at"]["N"]) == expires
    forever = raw_client.get_item(TableName=_table(table_url), Key={"pk": {"S": "forever"}, **key})
    assert "expires_at" not in forever["Item"] and "ttl" not in forever["Item"]


def test_clock_far_in_the_future_needs_no_native_ttl(table_url: str) -> None:
    clock = FakeClock(4_000_000_000.0)  # year 2096: native TTL would never have fired
    with open_store(table_url, retention="1h", clock=clock) as store:
        store.add_many(["x", "y"])
        clock.advance(timedelta(hours=1))
        assert store.processed_among(["x", "y"]) == set()
        assert store.add("x") is True
        assert store.purge_expired() == 0  # y expired less than max_clock_skew ago
        clock.advance(timedelta(seconds=61))
        assert store.purge_expired() == 1
        assert store.processed_among(["x", "y"]) == {"x"}


# ---------------------------------------------------------------------- requests


def test_requests_respect_real_dynamodb_limits(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    """moto accepts oversized requests; the backend must never send them."""
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    clock = FakeClock()
    store = open_store(table_url, client=client, retention="1h", clock=clock)
    ids = [f"limit-{i}" for i in range(1030)]
    store.add_many(ids[:130])  # some already recorded in later chunks
    recorder.calls.clear()
    assert store.add_many([*ids, *ids[:40]]) == set(ids[130:])
    transactions = recorder.named("TransactWriteItems")
    # one round trip per chunk (11 chunks), plus one more for each chunk that mixes
    # recorded and fresh ids: chunk 2 (ids 100-199) and chunk 11 (ids 1000-1029, 0-39)
    assert len(transactions) == 11 + 2
    assert store.processed_among([*ids, "absent"]) == set(ids)
    clock.advance(timedelta(hours=2))
    assert store.purge_expired() == len(ids)
    sizes = _sizes(recorder)
    assert max(sizes["TransactWriteItems"]) <= 100
    assert max(sizes["BatchGetItem"]) <= 100
    assert max(sizes.get("BatchWriteItem", [0])) <= 25
    assert len(sizes["BatchGetItem"]) == math.ceil(1031 / 100)
    for name, params in recorder.calls:
        if name in ("GetItem", "Scan", "Query"):
            assert params.get("ConsistentRead") is True, name
        if name == "BatchGetItem":
            assert all(v.get("ConsistentRead") is True for v in params["RequestItems"].values())
    store.close()


def test_every_read_is_strongly_consistent(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    with open_store(table_url, client=client) as store:
        store.add("r")
        assert store.has_been_processed("r")
        assert "r" in store
        assert store.processed_among(["r", "s"]) == {"r"}
        store.purge_expired()
    reads = [(n, p) for n, p in recorder.calls if n in ("GetItem", "Scan", "BatchGetItem")]
    assert [n for n, _ in reads] == ["GetItem", "GetItem", "BatchGetItem", "Scan"]
    for name, params in reads:
        if name == "BatchGetItem":
            assert all(v["ConsistentRead"] is True for v in params["RequestItems"].values())
        else:
            assert params["ConsistentRead"] is True


def test_transactions_carry_a_client_request_token(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    with open_store(table_url, client=client) as store:
        store.add_many(["t1", "t2", "t3"])
        store.add_many(["t4", "t5"])
    tokens = [p.get("ClientRequestToken") for p in recorder.named("TransactWriteItems")]
    assert len(tokens) == 2 and all(tokens) and tokens[0] != tokens[1]


def _lose_first_success(client: Any, operation: str) -> list[int]:
    """Make botocore resend the first successful ``operation`` (its answer "was lost")."""
    forced: list[int] = []

    def handler(response: Any, attempts: int, **_: Any) -> int | None:
        if response is not None and response[0].status_code == 200 and not forced:
            forced.append(attempts)
            return 0
        return None

    client.meta.events.register(f"needs-retry.dynamodb.{operation}", handler)
    return forced


def test_retried_put_after_a_lost_answer_still_reports_the_write(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    client = _client(dynamodb_server)
    forced = _lose_first_success(client, "PutItem")
    with open_store(table_url, client=client) as store:
        assert store.add("lost-answer") is True
        assert forced == [1]
        assert store.add("lost-answer") is False


def test_retried_transaction_after_a_lost_answer_still_reports_the_writes(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    client = _client(dynamodb_server)
    forced = _lose_first_success(client, "TransactWriteItems")
    recorder = Recorder(client)
    ids = [f"lost-{i}" for i in range(30)]
    with open_store(table_url, client=client) as store:
        store.add("lost-0")  # recorded before: must not be reported
        assert store.add_many(ids) == set(ids[1:])
        assert forced == [1]
        assert store.add_many(ids) == set()
    tokens = [b["ClientRequestToken"] for n, b in recorder.bodies if n == "TransactWriteItems"]
    # first transaction (cancelled: lost-0 exists), the retry without lost-0, its resend
    # (identical, idempotency token included), then the final add_many
    assert len(tokens) == 4
    assert tokens[0] != tokens[1] == tokens[2] != tokens[3]


# ---------------------------------------------------------------------- injected answers


def _cancelled(*codes: str, item: dict[str, Any] | None = None) -> dict[str, Any]:
    reasons: list[dict[str, Any]] = []
    for code in codes:
        reason: dict[str, Any] = {"Code": code}
        if code == "ConditionalCheckFailed" and item is not None:
            reason["Item"] = item
        reasons.append(reason)
    return {
        "Error": {"Code": "TransactionCanceledException", "Message": "Transaction cancelled"},
        "CancellationReasons": reasons,
    }


def test_transaction_conflicts_are_retried(
    dynamodb_server: DynamoDBEndpoint, table_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_backoff(monkeypatch)
    client = _client(dynamodb_server)
    seen = _inject(
        client,
        "TransactWriteItems",
        [
            _cancelled("TransactionConflict", "None", "ThrottlingError"),
            _cancelled("None", "TransactionConflict", "None"),
        ],
    )
    with open_store(table_url, client=client) as store:
        assert store.add_many(["c1", "c2", "c3"]) == {"c1", "c2", "c3"}
        assert store.processed_among(["c1", "c2", "c3"]) == {"c1", "c2", "c3"}
    assert len(seen) == 3


def test_condition_failures_drop_only_those_ids(
    dynamodb_server: DynamoDBEndpoint, table_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _client(dynamodb_server)
    other = {"pk": {"S": "d2"}, "writer": {"S": "someone-else"}}
    seen = _inject(
        client,
        "TransactWriteItems",
        [_cancelled("None", "ConditionalCheckFailed", "None", item=other)],
    )
    with open_store(table_url, client=client) as store:
        assert store.add_many(["d1", "d2", "d3"]) == {"d1", "d3"}
    assert len(seen) == 2


def test_endless_conflicts_raise_store_unavailable(
    dynamodb_server: DynamoDBEndpoint, table_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_backoff(monkeypatch)
    client = _client(dynamodb_server)
    seen = _inject(
        client, "TransactWriteItems", [_cancelled("TransactionConflict", "None") for _ in range(50)]
    )
    with open_store(table_url, client=client) as store:
        with pytest.raises(StoreUnavailable, match="conflicts or throttling") as info:
            store.add_many(["e1", "e2"])
        assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
        assert store.processed_among(["e1", "e2"]) == set()
        assert len(seen) == dynamodb_client._MAX_BACKOFF_ROUNDS + 1
        conflict = {"Error": {"Code": "TransactionConflictException", "Message": "locked"}}
        seen = _inject(client, "PutItem", [json.loads(json.dumps(conflict)) for _ in range(50)])
        with pytest.raises(StoreUnavailable, match="TransactionConflictException") as info:
            store.add("e3")
        assert info.value.unknown == {"e3"}
        assert len(seen) == dynamodb_client._MAX_BACKOFF_ROUNDS + 1


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("ValidationError", ConfigurationError),
        ("ItemCollectionSizeLimitExceeded", ConfigurationError),
        ("SomeNewTransientReason", StoreUnavailable),
    ],
)
def test_unexpected_cancellation_reason_is_classified(
    dynamodb_server: DynamoDBEndpoint,
    table_url: str,
    reason: str,
    kind: type[DedupStoreError],
) -> None:
    client = _client(dynamodb_server)
    _inject(client, "TransactWriteItems", [_cancelled("None", reason)])
    with open_store(table_url, client=client) as store:
        with pytest.raises(kind, match=reason) as info:
            store.add_many(["v1", "v2"])
        assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
        assert info.value.unknown == {"v1", "v2"}
        _one_line(info.value)


def test_unprocessed_keys_are_retried(
    dynamodb_server: DynamoDBEndpoint, table_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_backoff(monkeypatch)
    client = _client(dynamodb_server)
    table = _table(table_url)
    with open_store(table_url, client=client) as store:
        store.add_many(["u1", "u2", "u3"])
        partial = {
            "Responses": {table: [{"pk": {"S": "u1"}}]},
            "UnprocessedKeys": {
                table: {
                    "Keys": [
                        {"pk": {"S": "u2"}, "sk": {"S": "default"}},
                        {"pk": {"S": "u4"}, "sk": {"S": "default"}},
                    ],
                    "ConsistentRead": True,
                }
            },
        }
        seen = _inject(client, "BatchGetItem", [partial])
        assert store.processed_among(["u1", "u2", "u4"]) == {"u1", "u2"}
        assert len(seen) == 2
        stuck = {**partial, "Responses": {table: []}}
        _inject(client, "BatchGetItem", [json.loads(json.dumps(stuck)) for _ in range(20)])
        with pytest.raises(StoreUnavailable, match="unprocessed"):
            store.processed_among(["u1", "u2", "u4"])


@pytest.mark.parametrize(
    "code",
    [
        "ProvisionedThroughputExceededException",
        "InternalServerError",
        "ThrottlingException",
        "RequestLimitExceeded",
        "ServiceUnavailable",
    ],
)
def test_throttling_and_server_errors_raise_store_unavailable(
    dynamodb_server: DynamoDBEndpoint, table_url: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retried ``retries`` times (the store's own retries), then ``StoreUnavailable``."""
    _no_backoff(monkeypatch)
    client = _client(dynamodb_server)
    with open_store(table_url, client=client, retries=1) as store:
        error = {"Error": {"Code": code, "Message": "slow down"}}
        calls: list[tuple[str, Callable[[], object]]] = [
            ("PutItem", lambda: store.add("t")),
            ("TransactWriteItems", lambda: store.add_many(["t1", "t2"])),
            ("GetItem", lambda: store.has_been_processed("t")),
            ("BatchGetItem", lambda: store.processed_among(["t1", "t2"])),
            ("Scan", store.purge_expired),
        ]
        for operation, call in calls:
            seen = _inject(client, operation, [json.loads(json.dumps(error))])
            call()  # one failure: retried
            assert len(seen) == 2
            _inject(client, operation, [json.loads(json.dumps(error)) for _ in range(2)])
            with pytest.raises(StoreUnavailable, match=code) as info:
                call()
            assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
            _one_line(info.value)


def test_rejected_request_is_a_configuration_error(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    client = _client(dynamodb_server)
    with open_store(table_url, client=client) as store:
        error = {"Error": {"Code": "ValidationException", "Message": "bad key"}}
        _inject(client, "GetItem", [error])
        with pytest.raises(ConfigurationError, match="ValidationException") as info:
            store.has_been_processed("x")
        message = _one_line(info.value)
        assert message.startswith(f"DynamoDBDeduplicationStore at {store.url}: "), message
        assert "bad key" in message, "the service's own words"
        assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)


def test_refused_credentials_during_a_call_are_a_configuration_error(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    client = _client(dynamodb_server)
    with open_store(table_url, client=client) as store:
        _inject(
            client,
            "GetItem",
            [{"Error": {"Code": "AccessDeniedException", "Message": "not allowed"}}],
        )
        with pytest.raises(ConfigurationError, match="AccessDeniedException") as info:
            store.has_been_processed("x")
        assert "IAM policy" in _one_line(info.value)


# ---------------------------------------------------------------------- opening


def test_missing_table_is_a_configuration_error(dynamodb_server: DynamoDBEndpoint) -> None:
    with pytest.raises(ConfigurationError) as info:
        open_store(_url(dynamodb_server, "no-such-table"))
    message = _one_line(info.value)
    assert "no-such-table" in message and dynamodb_server.region in message
    assert "create=True" in message


def test_create_option(dynamodb_server: DynamoDBEndpoint, raw_client: Any) -> None:
    table = f"created-{uuid.uuid4().hex}"
    url = _url(dynamodb_server, table, create="true")
    with open_store(url) as store:
        assert isinstance(store, DynamoDBDeduplicationStore)
        assert store.table == table
        assert store.add("first") is True
        assert store.health_warnings() == []
        store.create_table()  # idempotent
    description = raw_client.describe_table(TableName=table)["Table"]
    assert description["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
    assert {(k["AttributeName"], k["KeyType"]) for k in description["KeySchema"]} == {
        ("pk", "HASH"),
        ("sk", "RANGE"),
    }
    ttl = raw_client.describe_time_to_live(TableName=table)["TimeToLiveDescription"]
    assert ttl == {"TimeToLiveStatus": "ENABLED", "AttributeName": "ttl"}
    with open_store(url) as again:  # the table exists: create is a no-op
        assert again.add("first") is False
    raw_client.delete_table(TableName=table)


def test_table_without_ttl_gives_a_health_warning(
    dynamodb_server: DynamoDBEndpoint, raw_client: Any
) -> None:
    table = f"nottl-{uuid.uuid4().hex}"
    raw_client.create_table(
        TableName=table,
        AttributeDefinitions=[
            {"AttributeName": "pk", "AttributeType": "S"},
            {"AttributeName": "sk", "AttributeType": "S"},
        ],
        KeySchema=[
            {"AttributeName": "pk", "KeyType": "HASH"},
            {"AttributeName": "sk", "KeyType": "RANGE"},
        ],
        BillingMode="PAY_PER_REQUEST",
    )
    with open_store(_url(dynamodb_server, table)) as store:
        (warning,) = store.health_warnings()
        assert "TTL is not enabled" in warning
    raw_client.delete_table(TableName=table)


def test_wrong_key_schema_is_a_configuration_error(
    dynamodb_server: DynamoDBEndpoint, raw_client: Any
) -> None:
    table = f"wrong-{uuid.uuid4().hex}"
    raw_client.create_table(
        TableName=table,
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    with pytest.raises(ConfigurationError, match="key schema") as info:
        open_store(_url(dynamodb_server, table))
    assert table in _one_line(info.value)
    raw_client.delete_table(TableName=table)


def _with_replicas(client: Any) -> None:
    def add_replicas(parsed: dict[str, Any], **_: Any) -> None:
        parsed["Table"]["Replicas"] = [{"RegionName": "eu-west-1", "ReplicaStatus": "ACTIVE"}]

    client.meta.events.register("after-call.dynamodb.DescribeTable", add_replicas)


def test_global_table_is_refused(dynamodb_server: DynamoDBEndpoint, table_url: str) -> None:
    client = _client(dynamodb_server)
    _with_replicas(client)
    with pytest.raises(ConsistencyError, match="allow_global_table") as info:
        open_store(table_url, client=client)
    assert "eu-west-1" in _one_line(info.value)
    with open_store(table_url, client=client, allow_global_table=True) as store:
        assert store.add("g") is True
        assert any("replicas" in w for w in store.health_warnings())


def test_unknown_port_is_store_unavailable() -> None:
    url = f"dynamodb://t-unreachable?region=us-east-1&endpoint_url=http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnavailable) as info:
        open_store(url, connect_timeout=1, retries=0)
    assert isinstance(info.value.__cause__, botocore.exceptions.EndpointConnectionError)
    assert "t-unreachable" in _one_line(info.value)


def test_unknown_host_is_store_unavailable() -> None:
    url = "dynamodb://t-nowhere?region=us-east-1&endpoint_url=http://dynamodb.invalid:8000"
    with pytest.raises(StoreUnavailable) as info:
        open_store(url, connect_timeout=1, retries=0)
    assert isinstance(info.value.__cause__, botocore.exceptions.BotoCoreError)
    _one_line(info.value)


def test_wrong_credentials_are_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # moto checks every signature
    with MotoServer() as server:
        url = _url(server, "guarded")
        with pytest.raises(ConfigurationError, match="credentials") as info:
            open_store(url, aws_access_key_id="AKIAWRONGWRONG", aws_secret_access_key="nope")
    message = _one_line(info.value)
    assert "InvalidClientTokenId" in message and "nope" not in message
    assert "guarded" in message


def test_no_region_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="region") as info:
        open_store("dynamodb://some-table?endpoint_url=http://127.0.0.1:9")
    _one_line(info.value)


def test_no_credentials_is_a_configuration_error(
    dynamodb_server: DynamoDBEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigurationError, match="credentials") as info:
        open_store(_url(dynamodb_server, "some-table"))
    _one_line(info.value)


@pytest.mark.parametrize(
    ("url", "options", "fragment"),
    [
        ("dynamodb://ab?region=us-east-1", {}, "3 to 255"),
        ("dynamodb://bad%20name?region=us-east-1", {}, "3 to 255"),
        ("dynamodb://table/extra?region=us-east-1", {}, "dynamodb://<table>"),
        ("dynamodb://table:8000?region=us-east-1", {}, "dynamodb://<table>"),
        ("dynamodb://table?region=us-east-1&color=blue", {}, "unknown option"),
        ("dynamodb://table?region=us-east-1&retries=many", {}, "retries"),
        ("dynamodb://table?region=us-east-1&retries=-1", {}, "retries"),
        ("dynamodb://table?region=", {}, "region"),
        ("dynamodb://table?region=us-east-1&endpoint_url=localhost:8000", {}, "endpoint_url"),
        ("dynamodb://table?region=us-east-1", {"aws_access_key_id": ""}, "aws_access_key_id"),
        ("dynamodb://table?region=us-east-1&create=maybe", {}, "create"),
        ("dynamodb://table?region=us-east-1", {"timeout": 0}, "timeout"),
        ("dynamodb://table?region=us-east-1", {"timeout": "forever"}, "timeout"),
        ("dynamodb://table?region=us-east-1", {"retries": 1.5}, "retries"),
        ("dynamodb://table?region=us-east-1", {"max_clock_skew": -1}, "max_clock_skew"),
        ("dynamodb://table?region=us-east-1", {"allow_global_table": "perhaps"}, "allow_global"),
        ("dynamodb://table?region=us-east-1&timeout=5", {"timeout": 6}, "both in the URL"),
        # names never released are unknown options; the message lists the known ones
        ("dynamodb://table?region_name=us-east-1", {}, "unknown option 'region_name' .*region"),
        ("dynamodb://table?region=us-east-1&create_table=true", {}, "unknown option 'create_t"),
        ("dynamodb://table?region=us-east-1", {"read_timeout": 4}, "unknown option 'read_tim"),
        ("dynamodb://table?region=us-east-1", {"max_attempts": 3}, "unknown option 'max_atte"),
        ("dynamodb://table?region=us-east-1&client=x", {}, "unknown option 'client'"),
        ("dynamodb://table?aws_secret_access_key=s", {}, "together"),
    ],
)
def test_bad_configuration(url: str, options: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment) as info:
        open_store(url, **options)
    _one_line(info.value)


def test_secrets_never_shown(dynamodb_server: DynamoDBEndpoint, table_url: str) -> None:
    url = f"{table_url}&aws_secret_access_key={FAKE_SECRET}&aws_access_key_id={FAKE_KEY_ID}"
    store = open_store(url, aws_session_token=FAKE_TOKEN, endpoint="shown")
    clone = pickle.loads(pickle.dumps(store))
    text = repr(store) + store.url + repr(clone)
    assert FAKE_SECRET not in text and FAKE_TOKEN not in text
    assert "shown" in text and _table(table_url) in text
    clone.close()
    store.close()
    with pytest.raises(ConfigurationError) as info:
        open_store(
            _url(dynamodb_server, "missing-table"),
            aws_access_key_id=FAKE_KEY_ID,
            aws_secret_access_key=FAKE_SECRET,
            aws_session_token=FAKE_TOKEN,
        )
    assert FAKE_SECRET not in str(info.value) and FAKE_TOKEN not in str(info.value)


def test_string_options_convert_and_round_trip(
    dynamodb_server: DynamoDBEndpoint, table_url: str
) -> None:
    url = f"{table_url}&connect_timeout=2.5&timeout=4s&retries=3&create=false"
    with open_store(url, retention="1d", max_clock_skew="90", allow_global_table="false") as store:
        assert store.option("timeout") == 4.0 and store.option("retries") == 3
        assert store.option("connect_timeout") == 2.5 and store.option("create") is False
        assert store.option("max_clock_skew") == 90.0
        config = store._dynamodb.client.meta.config  # type: ignore[attr-defined]
        assert config.read_timeout == 4.0 and config.connect_timeout == 2.5
        # botocore retries nothing: the store does, within the call's deadline
        assert config.retries == {"mode": "standard", "total_max_attempts": 1}
        assert store._deadline_seconds() == 2.5 + 4 * 4.0  # type: ignore[attr-defined]
        clone = pickle.loads(pickle.dumps(store))
        assert store.add("alias") is True
        assert clone.has_been_processed("alias")
        assert clone.retention == timedelta(days=1)
        assert clone.option("max_clock_skew") == 90.0
        assert "retries=3" in repr(clone)
        clone.close()
    with open_store(table_url, timeout="5", retries="0", create="false") as store:
        assert store.option("timeout") == 5.0 and store.option("retries") == 0
        config = store._dynamodb.client.meta.config  # type: ignore[attr-defined]
        assert config.retries == {"mode": "standard", "total_max_attempts": 1}


def test_client_option_is_not_pickled(dynamodb_server: DynamoDBEndpoint, table_url: str) -> None:
    client = _client(dynamodb_server)
    with open_store(table_url, client=client) as store:
        store.add("via-client")
        clone = pickle.loads(pickle.dumps(store))
        assert clone.has_been_processed("via-client")
        clone.close()
    # closing the store must not close a client it was given
    assert client.describe_table(TableName=_table(table_url))["Table"]["TableName"]


# ---------------------------------------------------------------------- server failures


def test_server_stopped_mid_run_raises_store_unavailable() -> None:
    """Killing the endpoint makes every call raise, never answer "not processed"."""
    with MotoServer() as server:
        table = f"crash-{uuid.uuid4().hex}"
        url = _url(server, table, create="true")
        store = open_store(url, connect_timeout=1, timeout=2, retries=1)
        assert isinstance(store, DynamoDBDeduplicationStore)
        recorded = [f"kept-{i}" for i in range(150)]
        assert store.add_many(recorded) == set(recorded)

        progress = threading.Event()
        outcomes: list[BaseException | None] = [None, None]
        wrong: list[str] = []

        def writer() -> None:
            n = 0
            try:
                while True:
                    n += 1
                    batch = [f"w-{n}-{i}" for i in range(120)]
                    result = store.add_many(batch)
                    if result != set(batch):
                        wrong.append(f"add_many returned {len(result)} of {len(batch)}")
                    if n == 3:
                        progress.set()
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcomes[0] = exc

        def reader() -> None:
            try:
                while True:
                    found = store.processed_among(recorded)
                    if found != set(recorded):
                        wrong.append(f"processed_among returned {len(found)} of 150")
                    if not store.has_been_processed(recorded[0]):
                        wrong.append("has_been_processed returned False")
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcomes[1] = exc

        threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
        for thread in threads:
            thread.start()
        assert progress.wait(120), "the writer made no progress"
        server.kill()
        for thread in threads:
            thread.join(120)
        assert not wrong, wrong
        for outcome in outcomes:
            assert isinstance(outcome, StoreUnavailable), repr(outcome)
            assert isinstance(outcome.__cause__, botocore.exceptions.BotoCoreError)

        calls: list[Callable[[], object]] = [
            lambda: store.add("after-crash"),
            lambda: store.add_many(["after-1", "after-2"]),
            lambda: store.has_been_processed(recorded[0]),
            lambda: recorded[1] in store,
            lambda: store.processed_among(recorded),
            store.purge_expired,
            store.health_warnings,
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable) as info:
                call()
            cause = info.value.__cause__
            assert isinstance(cause, botocore.exceptions.EndpointConnectionError), repr(cause)
            _one_line(info.value)

        # moto keeps nothing across a restart: the same object reconnects by itself
        server.restart()
        with pytest.raises(ConfigurationError, match=table):
            store.add("after-restart")
        store.create_table()
        assert store.add("after-restart") is True
        assert store.processed_among(["after-restart", "absent"]) == {"after-restart"}
        store.close()


def test_stopped_server_raises_store_unavailable() -> None:
    with MotoServer() as server:
        url = _url(server, f"stopped-{uuid.uuid4().hex}", create="true")
        # The open (create the table, wait until active, enable TTL: several requests in one
        # deadline) gets the default timeouts: the test is of the calls after the stop, which
        # are refused at once, and a loaded machine once took the open past 3 s.
        store = open_store(url, retries=0)
        assert store.add("before") is True
        server.stop()
        with pytest.raises(StoreUnavailable) as info:
            store.add("after")
        assert info.value.unknown == {"after"}
        with pytest.raises(StoreUnavailable) as info:
            store.add_many(["a1", "a2"])
        assert info.value.unknown == {"a1", "a2"} and not info.value.recorded
        with pytest.raises(StoreUnavailable):
            store.has_been_processed("before")
        store.close()


def test_table_deleted_while_open_is_a_configuration_error(
    dynamodb_server: DynamoDBEndpoint, raw_client: Any
) -> None:
    table = f"deleted-{uuid.uuid4().hex}"
    store = open_store(_url(dynamodb_server, table, create="true"), retention="1h")
    assert store.add("before") is True
    raw_client.delete_table(TableName=table)
    calls: list[Callable[[], object]] = [
        lambda: store.add("x"),
        lambda: store.add_many(["x", "y"]),
        lambda: store.has_been_processed("before"),
        lambda: store.processed_among(["before", "x"]),
        store.purge_expired,
        store.health_warnings,
    ]
    for call in calls:
        with pytest.raises(ConfigurationError) as info:
            call()
        message = _one_line(info.value)
        assert table in message and "does not exist" in message and "create=True" in message
        assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
    store.close()
    # no call re-created the table (although the store was opened with create=true)
    with pytest.raises(raw_client.exceptions.ResourceNotFoundException):
        raw_client.describe_table(TableName=table)


def test_create_table_after_close_raises_store_closed(table_url: str) -> None:
    """The calls every store has are checked by the contract; this one is DynamoDB's own."""
    store = DynamoDBDeduplicationStore(table_url)
    store.close()
    with pytest.raises(StoreClosed):
        store.create_table()


# ---------------------------------------------------------------------- lost answers


def _lose_answers(
    monkeypatch: pytest.MonkeyPatch,
    store: Client,
    method: str,
    fail: set[int],
    error: Callable[[], Exception] = lambda: botocore.exceptions.ReadTimeoutError(
        endpoint_url="http://lost"
    ),
) -> list[int]:
    """Make the store's client perform the real call, then raise ``error()`` instead of
    answering, for the successful calls numbered in ``fail`` (1 = the first)."""
    client = store._dynamodb.client  # type: ignore[attr-defined]
    real = getattr(client, method)
    done: list[int] = []
    lock = threading.Lock()

    def wrapper(**kwargs: Any) -> Any:
        result = real(**kwargs)
        with lock:
            done.append(len(done) + 1)
            number = done[-1]
        if number in fail:
            raise error()
        return result

    monkeypatch.setattr(client, method, wrapper)
    return done


@pytest.mark.parametrize(
    "error",
    [
        lambda: botocore.exceptions.ReadTimeoutError(endpoint_url="http://lost"),
        lambda: botocore.exceptions.EndpointConnectionError(endpoint_url="http://lost"),
    ],
    ids=["read-timeout", "connection"],
)
def test_add_whose_answer_is_lost_is_recorded_by_the_retry(
    table_url: str, monkeypatch: pytest.MonkeyPatch, error: Callable[[], Exception]
) -> None:
    store, other = open_store(table_url, retries=0), open_store(table_url)
    _lose_answers(monkeypatch, store, "put_item", {1}, error)
    with pytest.raises(StoreUnavailable) as info:
        store.add("lost")
    assert info.value.unknown == {"lost"} and not info.value.recorded
    assert isinstance(info.value.__cause__, botocore.exceptions.BotoCoreError)
    assert other.add("lost") is False  # the failed call did write it
    assert store.add("lost") is True  # ... and its retry on the same object says so
    assert store.add("lost") is False
    assert other.add("lost") is False
    store.close()
    other.close()


def test_add_many_whose_answer_is_lost_is_recorded_by_the_retry(
    table_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = open_store(table_url, retries=0), open_store(table_url)
    assert other.add("taken") is True
    ids = ["taken", *(f"lost-{i}" for i in range(40))]
    _lose_answers(monkeypatch, store, "transact_write_items", {1})
    with pytest.raises(StoreUnavailable, match=r"(?i)timeout") as info:
        store.add_many(ids)
    assert info.value.unknown == set(ids) and not info.value.recorded
    assert isinstance(info.value.__cause__, botocore.exceptions.ReadTimeoutError)
    assert other.add_many(ids) == set()
    assert store.add_many([*ids, "fresh"]) == {*ids[1:], "fresh"}
    assert store.add_many(ids) == set()
    store.close()
    other.close()


def test_add_many_failing_part_way_reports_its_progress(
    table_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = open_store(table_url, retries=0), open_store(table_url)
    ids = [f"part-{i}" for i in range(650)]  # 7 chunks, up to 4 in flight
    _lose_answers(monkeypatch, store, "transact_write_items", {3})
    with pytest.raises(StoreUnavailable) as info:
        store.add_many(ids)
    recorded, unknown = set(info.value.recorded), set(info.value.unknown)
    assert len(recorded) >= 200 and len(unknown) == 100
    assert not recorded & unknown
    assert other.processed_among(recorded) == recorded
    retry = store.add_many(ids)
    assert retry | recorded == set(ids)
    assert not retry & recorded
    assert unknown <= retry  # performed before the failure: reported by the retry
    assert other.add_many(ids) == set()
    store.close()
    other.close()


# ---------------------------------------------------------------------- timeouts and clocks


@pytest.mark.timeout(60)
def test_server_that_never_answers_raises_store_unavailable() -> None:
    """A server that accepts connections but never replies: bounded by ``timeout`` (3 s:
    the call's one deadline also covers making the boto3 client, which on a loaded
    machine took most of 1 s, so the request was never sent and the deadline, not the
    silent server, ended the call)."""
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
    url = f"dynamodb://silent-table?region=us-east-1&endpoint_url=http://127.0.0.1:{port}"
    try:
        with pytest.raises(StoreUnavailable, match=r"(?i)timeout") as info:
            open_store(url, timeout=3, retries=0)
        assert isinstance(info.value.__cause__, botocore.exceptions.ReadTimeoutError)
        assert accepted, "the client never connected"
        _one_line(info.value)
    finally:
        stop.set()
        thread.join(10)
        for connection in accepted:
            connection.close()
        listener.close()


def test_purge_by_a_client_whose_clock_runs_ahead_keeps_live_records(table_url: str) -> None:
    clock = FakeClock(1_700_000_000.0)
    ahead = FakeClock(clock.now + 30)  # 30 s ahead: within max_clock_skew (60 s)
    writer = open_store(table_url, retention="1h", clock=clock)
    purger = open_store(table_url, retention="1h", clock=ahead)
    assert writer.add("skewed") is True
    for c in (clock, ahead):
        c.advance(3600 - 10)  # 10 s left for the writer, expired 20 s ago for the purger
    assert writer.has_been_processed("skewed")
    assert not purger.has_been_processed("skewed")
    assert purger.purge_expired() == 0
    assert writer.has_been_processed("skewed")
    assert writer.add("skewed") is False
    for c in (clock, ahead):
        c.advance(50)  # expired 70 s ago by the purger's clock
    assert purger.purge_expired() == 1
    assert writer.add("skewed") is True
    writer.close()
    purger.close()


def test_a_given_client_refuses_replies_cut_short(dynamodb_server: DynamoDBEndpoint) -> None:
    """A boto3 client passed as ``client=`` (here to two stores) gets the store's
    check of cut replies: a cut reply raises, never "not processed"."""
    table = f"given-{uuid.uuid4().hex}"
    with TcpProxy.for_url(dynamodb_server.endpoint_url) as proxy:
        given = boto3.client(
            "dynamodb",
            endpoint_url=proxy.url(dynamodb_server.endpoint_url),
            region_name=dynamodb_server.region,
            aws_access_key_id=FAKE_KEY_ID,
            aws_secret_access_key=FAKE_SECRET,
        )
        url = _url(dynamodb_server, table, create="true")
        with open_store(url, client=given, retries=1) as store, open_store(url, client=given):
            store.add("kept")
            proxy.cut_replies(lambda reply: reply.find(b"\r\n\r\n") + 4)  # headers only
            try:
                with pytest.raises(StoreUnavailable):
                    store.has_been_processed("kept")
            finally:
                proxy.restore()
            assert store.has_been_processed("kept")


def test_another_aws_environment_gets_a_client_of_its_own(
    table_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boto3 resolves what the options leave out (region, credentials, retries) from the
    ``AWS_*`` environment when it makes a client: stores opened under another one must
    not share a client made for the first."""
    with open_store(table_url) as first:
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
        with open_store(table_url) as second:
            assert second._dynamodb is not first._dynamodb  # type: ignore[attr-defined]
            assert second.add("m") is True
        monkeypatch.delenv("AWS_MAX_ATTEMPTS")
        with open_store(table_url) as third:
            assert third._dynamodb is first._dynamodb  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- token store


def test_token_items_hold_id_endpoint_and_mint_time(token_url: str, raw_client: Any) -> None:
    table = _table(token_url)
    minted = 1_700_000_000.123456
    endpoint = "🦄:billing/" + "e" * 900
    with DynamoDBTokenStore(token_url, clock=lambda: minted) as tokens:
        assert tokens.table == table and tokens.health_warnings() == []
        tokens.create({"t:1": endpoint, "t:2": "shipping"})
        assert tokens.outstanding() == {
            endpoint: TokenCount(1, minted),
            "shipping": TokenCount(1, minted),
        }
    items = raw_client.scan(TableName=table, ConsistentRead=True)["Items"]
    assert sorted(items, key=lambda i: i["id"]["S"]) == [
        {"id": {"S": "t:1"}, "endpoint": {"S": endpoint}, "created": {"N": repr(minted)}},
        {"id": {"S": "t:2"}, "endpoint": {"S": "shipping"}, "created": {"N": repr(minted)}},
    ]
    description = raw_client.describe_table(TableName=table)["Table"]
    assert description["KeySchema"] == [{"AttributeName": "id", "KeyType": "HASH"}]
    assert description["AttributeDefinitions"] == [{"AttributeName": "id", "AttributeType": "S"}]
    assert description["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
    ttl = raw_client.describe_time_to_live(TableName=table)["TimeToLiveDescription"]
    assert ttl["TimeToLiveStatus"] == "DISABLED", "tokens never expire"


def test_token_requests_are_conditional_puts_batch_gets_deletes_and_a_scan(
    dynamodb_server: DynamoDBEndpoint, token_url: str
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)
    table = _table(token_url)
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

    for operation in ("PutItem", "DeleteItem"):
        client.meta.events.register(f"before-send.dynamodb.{operation}", sent)
        client.meta.events.register(f"needs-retry.dynamodb.{operation}", answered)
    ids = [f"req-{i}" for i in range(230)]
    with DynamoDBTokenStore(token_url, client=client) as tokens:
        recorder.calls.clear()
        tokens.create(dict.fromkeys(ids, "billing"))
        tokens.create(dict.fromkeys(ids[:5], "billing"))  # exist: conditions fail, no error
        assert tokens.present_among([*ids, "absent"]) == set(ids)
        assert tokens.outstanding()["billing"].outstanding == 230
        tokens.delete([*ids, "absent"])
    names = [name for name, _ in recorder.calls]
    assert set(names) == {"PutItem", "BatchGetItem", "DeleteItem", "Scan"}, "no batch write"
    puts = recorder.named("PutItem")
    assert len(puts) == 230 + 5
    assert all(
        p["ConditionExpression"] == "attribute_not_exists(#i)"
        and p["ExpressionAttributeNames"] == {"#i": "id"}
        and set(p["Item"]) == {"id", "endpoint", "created"}
        for p in puts
    )
    assert 1 < peak <= DynamoDBTokenStore.write_concurrency, "writes run in parallel, bounded"
    gets = recorder.named("BatchGetItem")
    assert [len(g["RequestItems"][table]["Keys"]) for g in gets] == [100, 100, 31]
    assert all(g["RequestItems"][table]["ConsistentRead"] is True for g in gets)
    deletes = recorder.named("DeleteItem")
    assert sorted(d["Key"]["id"]["S"] for d in deletes) == sorted([*ids, "absent"])
    assert not any("ConditionExpression" in d for d in deletes)
    (scan,) = recorder.named("Scan")
    assert scan["ConsistentRead"] is True and "FilterExpression" not in scan
    assert scan["ProjectionExpression"] == "#i, #e, #c"


def test_token_outstanding_adds_up_every_page(
    dynamodb_server: DynamoDBEndpoint, token_url: str
) -> None:
    client = _client(dynamodb_server)
    recorder = Recorder(client)

    def one_item_per_page(params: dict[str, Any], **_: Any) -> None:
        params["Limit"] = 1

    client.meta.events.register("before-parameter-build.dynamodb.Scan", one_item_per_page)
    clock = FakeClock(1_000_000.0)
    with DynamoDBTokenStore(token_url, client=client, clock=clock) as tokens:
        tokens.create({"a": "billing", "b": "shipping"})
        clock.advance(5)
        tokens.create({"c": "billing", "d": "billing"})
        assert tokens.outstanding() == {
            "billing": TokenCount(3, 1_000_000.0),
            "shipping": TokenCount(1, 1_000_000.0),
        }
    assert len(recorder.named("Scan")) >= 4


def test_token_create_and_delete_whose_answers_are_lost_succeed_on_the_retry(
    token_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-sent put meets its own token: a failed condition, a success; a re-sent delete
    finds nothing to delete, a success."""
    tokens = DynamoDBTokenStore(token_url, retries=1, clock=lambda: 5.0)
    client = tokens._dynamodb.client  # type: ignore[attr-defined]
    sent: list[str] = []

    def counting(method: str) -> Callable[..., Any]:
        real = getattr(client, method)

        def call(**kwargs: Any) -> Any:
            sent.append(method)
            return real(**kwargs)

        return call

    for method in ("put_item", "delete_item"):
        monkeypatch.setattr(client, method, counting(method))
    put = _lose_answers(monkeypatch, tokens, "put_item", {1})
    tokens.create({"lost": "billing"})
    assert sent == ["put_item"] * 2 and len(put) == 1, "the re-sent put failed its condition"
    assert tokens.outstanding() == {"billing": TokenCount(1, 5.0)}
    deleted = _lose_answers(monkeypatch, tokens, "delete_item", {1})
    tokens.delete(["lost"])
    assert sent[2:] == ["delete_item"] * 2 and len(deleted) == 2
    assert not tokens.present("lost")
    tokens.close()


@pytest.mark.parametrize("operation", ["create", "delete"])
def test_token_batch_failing_part_way_reports_its_progress(
    dynamodb_server: DynamoDBEndpoint, token_url: str, operation: str
) -> None:
    client = _client(dynamodb_server)
    ids = [f"part-{i}" for i in range(150)]  # two chunks, one after the other
    with DynamoDBTokenStore(token_url, client=client, retries=0) as tokens:
        if operation == "delete":
            tokens.create(dict.fromkeys(ids, "e"))
        name = "PutItem" if operation == "create" else "DeleteItem"
        error = {"Error": {"Code": "InternalServerError", "Message": "down"}}
        answers: list[dict[str, Any] | None] = [None] * 100
        answers += [json.loads(json.dumps(error)) for _ in range(50)]
        _inject(client, name, answers)
        run = (
            (lambda: tokens.create(dict.fromkeys(ids, "e")))
            if operation == "create"
            else (lambda: tokens.delete(ids))
        )
        with pytest.raises(StoreUnavailable, match="InternalServerError") as info:
            run()
        assert info.value.recorded == set(ids[:100]) and info.value.unknown == set(ids[100:])
        answers.clear()  # the server answers again
        present = tokens.present_among(ids)
        assert (set(ids[:100]) <= present) if operation == "create" else present <= set(ids[100:])
        run()  # the same call again completes it
        assert tokens.present_among(ids) == (set(ids) if operation == "create" else set())


@pytest.mark.parametrize(
    "code", ["ProvisionedThroughputExceededException", "ThrottlingException", "InternalServerError"]
)
def test_token_calls_retry_throttling_then_raise_store_unavailable(
    dynamodb_server: DynamoDBEndpoint, token_url: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_backoff(monkeypatch)
    client = _client(dynamodb_server)
    with DynamoDBTokenStore(token_url, client=client, retries=1) as tokens:
        error = {"Error": {"Code": code, "Message": "slow down"}}
        calls: list[tuple[str, Callable[[], object]]] = [
            ("PutItem", lambda: tokens.create({"t": "e"})),
            ("BatchGetItem", lambda: tokens.present_among(["t", "u"])),
            ("DeleteItem", lambda: tokens.delete(["t"])),
            ("Scan", tokens.outstanding),
        ]
        for operation, call in calls:
            seen = _inject(client, operation, [json.loads(json.dumps(error))])
            call()  # one failure: retried
            assert len(seen) == 2
            _inject(client, operation, [json.loads(json.dumps(error)) for _ in range(2)])
            with pytest.raises(StoreUnavailable, match=code) as info:
                call()
            assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
            _one_line(info.value)


def test_token_unprocessed_keys_are_retried_boundedly(
    dynamodb_server: DynamoDBEndpoint, token_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_backoff(monkeypatch)
    client = _client(dynamodb_server)
    table = _table(token_url)
    with DynamoDBTokenStore(token_url, client=client) as tokens:
        tokens.create({"u1": "e", "u2": "e"})
        partial = {
            "Responses": {
                table: [{"id": {"S": "u1"}, "endpoint": {"S": "e"}, "created": {"N": "1"}}]
            },
            "UnprocessedKeys": {
                table: {"Keys": [{"id": {"S": "u2"}}, {"id": {"S": "u3"}}], "ConsistentRead": True}
            },
        }
        seen = _inject(client, "BatchGetItem", [json.loads(json.dumps(partial))])
        assert tokens.present_among(["u1", "u2", "u3"]) == {"u1", "u2"}
        assert len(seen) == 2
        stuck = {**partial, "Responses": {table: []}}
        _inject(client, "BatchGetItem", [json.loads(json.dumps(stuck)) for _ in range(20)])
        with pytest.raises(StoreUnavailable, match="unprocessed"):
            tokens.present_among(["u1", "u2", "u3"])


def test_token_store_refusals(
    dynamodb_server: DynamoDBEndpoint, table_url: str, token_url: str
) -> None:
    """A missing table (without ``create``), a deduplication table (its key schema), a
    global table, and the options of a deduplication store."""
    with pytest.raises(ConfigurationError, match="create=True") as info:
        DynamoDBTokenStore(_url(dynamodb_server, "no-such-tokens"))
    assert "no-such-tokens" in _one_line(info.value)
    with pytest.raises(ConfigurationError, match="key schema") as info:
        DynamoDBTokenStore(table_url)  # pk + sk: a deduplication table
    assert "a token table needs id (S, HASH)" in _one_line(info.value)
    for option, value in (("retention", "1d"), ("max_clock_skew", "1m"), ("endpoint", "e")):
        with pytest.raises(ConfigurationError, match=option):
            DynamoDBTokenStore(table_url, **{option: value})
    client = _client(dynamodb_server)
    _with_replicas(client)
    with pytest.raises(ConsistencyError, match="allow_global_table"):
        DynamoDBTokenStore(token_url, client=client)
    with DynamoDBTokenStore(token_url, client=client, allow_global_table=True) as tokens:
        tokens.create({"g": "e"})
        assert tokens.present("g")
        assert any("replicas" in w for w in tokens.health_warnings())


def test_token_create_table_after_close_raises_store_closed(token_url: str) -> None:
    tokens = DynamoDBTokenStore(token_url)
    tokens.create_table()  # idempotent
    tokens.close()
    with pytest.raises(StoreClosed):
        tokens.create_table()


def test_a_token_store_on_an_entity_table_never_takes_an_entity_for_a_token(
    dynamodb_server: DynamoDBEndpoint, raw_client: Any
) -> None:
    """An entity table has the token table's key: its items are refused, never read as
    tokens (a stale "present" would process a message twice)."""
    from dedupstore import open_entity_store
    from dedupstore.entities import Entity

    table = f"entities-{uuid.uuid4().hex}"
    url = _url(dynamodb_server, table)
    try:
        with open_entity_store(url, create=True) as entities:
            entities.save(Entity("order-1", {"n": 1}))
        with DynamoDBTokenStore(url) as tokens:
            for call in (lambda: tokens.present("order-1"), tokens.outstanding):
                with pytest.raises(ConfigurationError, match="not a token"):
                    call()
            assert tokens.present("order-2") is False
    finally:
        raw_client.delete_table(TableName=table)
