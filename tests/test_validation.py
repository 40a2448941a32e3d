"""``check_options`` (the Spark driver's check) refuses whatever a constructor refuses without I/O.

Each case below is a URL and options that every class of the scheme (deduplication
store, entity store, dispatcher) refuses before any I/O. The hosts do not answer
(port 1), so a constructor that reached the network would raise ``StoreUnavailable``
(or time out), not the ``ConfigurationError`` expected; the constructor and
``check_options`` must raise the same message, both from ``Client._validate`` or the
option converters.
"""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from dedupstore import ConfigurationError
from dedupstore.client import Client
from dedupstore.registry import known, resolve

pytestmark = pytest.mark.memory

_KEY = "c3R1Yi1rZXk="  # base64, as a Cosmos DB key is; never sent anywhere
_PG = "postgresql://dedup@127.0.0.1:1/dedup?connect_timeout=1"
_REDIS = "redis://127.0.0.1:1"
_DYNAMO = "?region=us-east-1&endpoint_url=http://127.0.0.1:1"
_COSMOS = "cosmos://127.0.0.1:1"

#: (scheme, url, options, a fragment of the message).
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # a URL without a host: not "retry later" against a default host
    ("postgresql", "postgresql://", {}, "names no host"),
    ("postgresql", "postgres:///db", {}, "names no host"),
    ("postgresql", "postgresql://:5432/db", {}, "names no host"),
    ("redis", "redis://", {}, "names no host"),
    ("redis", "rediss:///0", {}, "names no host"),
    ("cosmos", "cosmos://", {}, "names the account host"),
    ("memory", "memory://user@name", {}, "expected 'memory://' or 'memory://<name>'"),
    ("memory", "memory://name#part", {}, "expected 'memory://' or 'memory://<name>'"),
    ("sqlite", "sqlite://host/x.db", {}, "has no host"),
    ("sqlite", "sqlite://", {}, "must name a database file"),
    ("postgresql", f"{_PG}&pool_min_size=5&pool_max_size=2", {}, "must not exceed"),
    ("postgresql", _PG, {"client": object()}, "psycopg_pool.ConnectionPool"),
    ("postgresql", f"{_PG}&table=a.b.c", {}, "'name' or 'schema.name'"),
    # refused by libpq's parser (not by the URL's): the password masked in the message
    ("postgresql", "postgresql://dedup@127.0.0.1:1/d%00b", {}, "forbidden value %00"),
    ("postgresql", "postgresql://u:p%ZZ@127.0.0.1:1/d", {}, 'percent-encoded token: "***"'),
    ("redis", f"{_REDIS}/notadb", {}, "the path must be a database number"),
    ("redis", f"{_REDIS}/0/1", {}, "the path must be a database number"),
    ("redis", f"{_REDIS}/0?ssl_ca_certs=/tmp/ca.pem", {}, "need a rediss:// URL"),
    ("redis", f"{_REDIS}/0", {"ssl_cert_reqs": "required"}, "need a rediss:// URL"),
    (
        "redis",
        f"{_REDIS}/0?wait_replicas=1&wait_timeout_ms=9000",
        {},
        "must be shorter than timeout",
    ),
    ("redis", f"{_REDIS}/0", {"client": object()}, "must be a redis.Redis"),
    ("dynamodb", f"dynamodb://ab{_DYNAMO}", {}, "the table name 3 to 255 characters"),
    ("dynamodb", f"dynamodb://a%20table{_DYNAMO}", {}, "the table name 3 to 255 characters"),
    ("dynamodb", f"dynamodb://table/extra{_DYNAMO}", {}, "dynamodb://<table>?region=..."),
    ("dynamodb", f"dynamodb://table{_DYNAMO}#part", {}, "dynamodb://<table>?region=..."),
    ("dynamodb", f"dynamodb://table{_DYNAMO}", {"aws_secret_access_key": "s"}, "together"),
    ("dynamodb", f"dynamodb://table{_DYNAMO}", {"aws_session_token": "t"}, "together"),
    ("dynamodb", f"dynamodb://table{_DYNAMO}", {"client": object()}, "a boto3 DynamoDB client"),
    # a resource, and a client of another service: no I/O to make either
    (
        "dynamodb",
        f"dynamodb://table{_DYNAMO}",
        {"client": boto3.resource("dynamodb", region_name="us-east-1")},
        "not a resource), got dynamodb.ServiceResource",
    ),
    (
        "dynamodb",
        f"dynamodb://table{_DYNAMO}",
        {"client": boto3.client("s3", region_name="us-east-1")},
        "a boto3 DynamoDB client (boto3.client('dynamodb'), not a resource), got S3",
    ),
    ("cosmos", "cosmos://user:pw@127.0.0.1:1/db/c", {"key": _KEY}, "no user or password"),
    ("cosmos", f"{_COSMOS}/db", {"key": _KEY}, "'cosmos://<host>[:port]/<database>/<cont"),
    ("cosmos", f"{_COSMOS}/db/c/x", {"key": _KEY}, "'cosmos://<host>[:port]/<database>/<cont"),
    ("cosmos", f"{_COSMOS}/db/c%3F", {"key": _KEY}, "bad Cosmos DB container name"),
    ("cosmos", f"{_COSMOS}/db/c", {"client": object()}, "azure.cosmos.CosmosClient"),
]


def _classes(scheme: str) -> list[type[Client]]:
    return [
        resolve(kind, scheme)
        for kind in ("store", "entity_store", "dispatcher")
        if scheme in known(kind)
    ]


@pytest.mark.parametrize(
    ("scheme", "url", "options", "fragment"),
    CASES,
    ids=[f"{case[0]}-{case[3][:30]}" for case in CASES],
)
def test_check_options_refuses_what_the_constructor_refuses(
    scheme: str, url: str, options: dict[str, Any], fragment: str
) -> None:
    for cls in _classes(scheme):
        with pytest.raises(ConfigurationError) as checked:
            cls.check_options(url, **options)
        with pytest.raises(ConfigurationError) as opened:
            cls(url, **options)
        assert fragment in str(checked.value), (cls, str(checked.value))
        assert str(opened.value) == str(checked.value), cls


@pytest.mark.parametrize(
    ("scheme", "url", "options"),
    [
        ("memory", "memory://name", {}),
        ("sqlite", "sqlite:///x.db", {}),
        ("postgresql", f"{_PG}&pool_min_size=2&pool_max_size=2", {}),
        # no host in the URL, libpq's socket directory as a parameter
        ("postgresql", "postgresql:///dedup?host=/nonexistent&connect_timeout=1", {}),
        ("redis", f"{_REDIS}/3?wait_replicas=1&wait_timeout_ms=900", {}),
        ("rediss", "rediss://127.0.0.1:1/?ssl_cert_reqs=required", {}),
        (
            "dynamodb",
            f"dynamodb://my-table.v1{_DYNAMO}",
            {"aws_access_key_id": "a"} | {"aws_secret_access_key": "s"},
        ),
        (  # a real boto3 DynamoDB client (made without I/O) passes the client check
            "dynamodb",
            f"dynamodb://my-table{_DYNAMO}",
            {"client": boto3.client("dynamodb", region_name="us-east-1")},
        ),
        ("cosmos", f"{_COSMOS}/db/c", {"key": _KEY}),
    ],
)
def test_check_options_accepts_a_good_configuration(
    scheme: str, url: str, options: dict[str, Any]
) -> None:
    for cls in _classes(scheme):
        cls.check_options(url, **options)
