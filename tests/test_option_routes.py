"""Every option of every backend, through all three routes, with good and bad values.

For each backend the table below holds, per declared option, a good value as text
(as it arrives from a URL query, an environment variable or a TOML string), the
typed value it must become, and a bad value. Each good value opens a store on the
real server through the URL query, as a keyword argument and from a configuration
file; each bad value gives a one-line ``ConfigurationError`` naming the option and
the backend (exit 2 from the CLI), before any I/O. A test fails when a backend
declares an option this table does not cover.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from dedupstore import ConfigurationError, DeduplicationStore, open_store
from dedupstore.cli import main
from dedupstore.registry import resolve
from tests.servers import CosmosEndpoint, DynamoDBEndpoint, Server

#: option -> (good text, typed value it becomes, bad text). ``None`` as good text:
#: the option cannot be exercised against the test server (only the bad value is);
#: ``None`` as bad text: every text is a valid value (free text such as a user name).
Table = dict[str, tuple[str | None, Any, str | None]]

COMMON: Table = {
    "endpoint": ("orders", "orders", ""),
    "retention": ("30d", timedelta(days=30), "soon"),
}
NETWORK: Table = {
    "timeout": ("7.5", 7.5, "-1"),
    "connect_timeout": ("3s", 3.0, "nan"),
}

TABLES: dict[str, Table] = {
    "memory": {**COMMON},
    "sqlite": {
        **COMMON,
        "table": ("dedup_other", "dedup_other", "no spaces"),
        "timeout": ("5", 5.0, "inf"),
        "synchronous": ("normal", "NORMAL", "3"),
        "create": ("true", True, "maybe"),
    },
    "postgres": {
        **COMMON,
        **NETWORK,
        "table": ("public.dedup_routes", "public.dedup_routes", "a.b.c"),
        "create": ("true", True, "2"),
        "pool_min_size": ("0", 0, "-1"),
        "pool_max_size": ("3", 3, "zero"),
        "password": ("dedup", "dedup", ""),
    },
    "redis": {
        **COMMON,
        **NETWORK,
        "key_prefix": ("routes:", "routes:", "no-colon"),
        "retries": ("1", 1, "many"),
        "max_connections": ("4", 4, "0"),
        "wait_replicas": ("0", 0, "-2"),
        "wait_timeout_ms": ("500", 500, "0"),
        "username": ("default", "default", None),
        "password": (None, None, None),
        "ssl_ca_certs": (None, None, None),
        "ssl_cert_reqs": (None, None, "sometimes"),
    },
    "dynamodb": {
        **COMMON,
        **NETWORK,
        "max_clock_skew": ("30", 30.0, "-5"),
        "region": ("us-east-1", "us-east-1", ""),
        "endpoint_url": (None, None, "not a url"),
        "aws_access_key_id": (None, None, ""),
        "aws_secret_access_key": (None, None, ""),
        "aws_session_token": (None, None, ""),
        "retries": ("2", 2, "-1"),
        "create": ("true", True, "perhaps"),
        "allow_global_table": ("false", False, "nope"),
    },
    "cosmos": {
        **COMMON,
        **NETWORK,
        "max_clock_skew": ("30", 30.0, "-5"),
        "key": (None, None, ""),
        "tls": ("false", False, "2"),
        "endpoint_discovery": ("false", False, "sure"),
        "allow_weak_consistency_for_emulator_only": ("true", True, "yes please"),
        "create": ("true", True, "perhaps"),
        "max_concurrency": ("4", 4, "0"),
        "retries": ("1", 1, "-3"),
    },
}


@dataclass
class Target:
    """How to open a backend on its test server: a URL, and options every open needs."""

    url: str
    base: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def _memory(_: pytest.FixtureRequest, __: Path) -> Target:
    return Target(f"memory://{uuid.uuid4().hex}")


def _sqlite(_: pytest.FixtureRequest, tmp: Path) -> Target:
    return Target(f"sqlite:///{tmp}/routes.db")


def _postgres(request: pytest.FixtureRequest, _: Path) -> Target:
    server: Server = request.getfixturevalue("postgres_server")
    open_store(server.url, create=True).close()
    open_store(server.url, create=True, table="public.dedup_routes").close()
    return Target(server.url)


def _redis(request: pytest.FixtureRequest, _: Path) -> Target:
    server: Server = request.getfixturevalue("redis_server")
    return Target(server.url)


def _dynamodb(request: pytest.FixtureRequest, _: Path) -> Target:
    server: DynamoDBEndpoint = request.getfixturevalue("dynamodb_server")
    table = "routes-table"
    env = server.client_env
    monkeypatch = request.getfixturevalue("monkeypatch")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    open_store(
        f"dynamodb://{table}", create=True, endpoint_url=server.endpoint_url, region=server.region
    ).close()
    return Target(f"dynamodb://{table}", env=env)


def _cosmos(request: pytest.FixtureRequest, _: Path) -> Target:
    server: CosmosEndpoint = request.getfixturevalue("cosmos_server")
    host = server.endpoint_url.split("://", 1)[1].rstrip("/")
    base = {
        "tls": "false",
        "endpoint_discovery": "false",
        "allow_weak_consistency_for_emulator_only": "true",
    }
    url = f"cosmos://{host}/routes/records"
    open_store(url, key=server.key, create=True, **base).close()
    return Target(url, base=base, env={"COSMOS_KEY": server.key})


TARGETS: dict[str, Callable[[pytest.FixtureRequest, Path], Target]] = {
    "memory": _memory,
    "sqlite": _sqlite,
    "postgres": _postgres,
    "redis": _redis,
    "dynamodb": _dynamodb,
    "cosmos": _cosmos,
}
SCHEMES = {"postgres": "postgresql"}


def _cases(good: bool) -> list[Any]:
    cases = []
    for backend, table in TABLES.items():
        for option, (text, _, bad) in table.items():
            if (good and text is None) or (not good and bad is None):
                continue
            cases.append(
                pytest.param(
                    backend, option, id=f"{backend}-{option}", marks=getattr(pytest.mark, backend)
                )
            )
    return cases


@pytest.fixture
def target(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], Target]]:
    monkeypatch.chdir(tmp_path)
    for var in ("DEDUPSTORE_ENV", "DEDUPSTORE_URL", "DEDUPSTORE_CONFIG"):
        monkeypatch.delenv(var, raising=False)

    def make(backend: str) -> Target:
        made = TARGETS[backend](request, tmp_path)
        for key, value in made.env.items():
            monkeypatch.setenv(key, value)
        return made

    yield make


def _with_query(url: str, option: str, value: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{option}={quote(value, safe='')}"


def _open_by_route(
    route: str, target: Target, option: str, value: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> DeduplicationStore:
    base = {k: v for k, v in target.base.items() if k != option}
    if route == "url":
        return open_store(_with_query(target.url, option, value), **base)
    if route == "keyword":
        return open_store(target.url, **base, **{option: value})
    config = tmp / "routes.toml"
    lines = ["[routes]", f"url = {target.url!r}", "[routes.options]"]
    lines += [f"{k} = {v!r}" for k, v in {**base, option: value}.items()]
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setenv("DEDUPSTORE_CONFIG", str(config))
    monkeypatch.setenv("DEDUPSTORE_ENV", "routes")
    return open_store()


@pytest.mark.parametrize("route", ["url", "keyword", "config"])
@pytest.mark.parametrize(("backend", "option"), _cases(good=True))
def test_good_values_convert_on_every_route(
    backend: str,
    option: str,
    route: str,
    target: Callable[[str], Target],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text, expected, _ = TABLES[backend][option]
    with _open_by_route(route, target(backend), option, text, tmp_path, monkeypatch) as store:
        assert store.option(option) == expected
        mid = f"route-{uuid.uuid4()}"
        assert store.add(mid) is True
        assert store.has_been_processed(mid)


@pytest.mark.parametrize("route", ["url", "keyword", "config"])
@pytest.mark.parametrize(("backend", "option"), _cases(good=False))
def test_bad_values_are_one_line_configuration_errors(
    backend: str,
    option: str,
    route: str,
    target: Callable[[str], Target],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, bad = TABLES[backend][option]
    made = target(backend)
    with pytest.raises(ConfigurationError) as info:
        _open_by_route(route, made, option, bad, tmp_path, monkeypatch)
    message = str(info.value)
    assert option in message and "\n" not in message
    cls = resolve("store", SCHEMES.get(backend, backend))
    assert cls.__name__ in message


@pytest.mark.parametrize(("backend", "option"), _cases(good=False))
def test_bad_values_exit_2_from_the_cli(
    backend: str,
    option: str,
    target: Callable[[str], Target],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, _, bad = TABLES[backend][option]
    made = target(backend)
    url = _with_query(made.url, option, bad)
    for key, value in made.base.items():
        if key != option:
            url = _with_query(url, key, value)
    assert main(["has", url, "probe"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and option in err


@pytest.mark.parametrize("backend", sorted(TABLES))
def test_the_table_covers_every_declared_option(backend: str) -> None:
    cls = resolve("store", SCHEMES.get(backend, backend))
    declared = {name for name, option in cls.declared_options.items() if option.in_url}
    assert declared == set(TABLES[backend]), "add the new option to TABLES with good and bad values"


SAMPLE_URLS = {
    "memory": "memory://x",
    "sqlite": "sqlite:///unused/x.db",
    "postgres": "postgresql://127.0.0.1:1/x",
    "redis": "redis://127.0.0.1:1/0",
    "dynamodb": "dynamodb://table-x",
    "cosmos": "cosmos://127.0.0.1:1/db/c",
}


@pytest.mark.parametrize("backend", sorted(TABLES))
def test_constructor_and_open_store_accept_the_same_options(backend: str) -> None:
    """Both refuse an unknown option the same way, before any I/O (nothing listens there)."""
    cls = resolve("store", SCHEMES.get(backend, backend))
    url = SAMPLE_URLS[backend]
    for opener in (cls, open_store):
        with pytest.raises(ConfigurationError, match="unknown option 'surely_not_an_option'"):
            opener(url, surely_not_an_option=1)


@pytest.mark.parametrize("backend", sorted(TABLES))
def test_a_url_keyword_conflict_is_refused_on_every_backend(backend: str) -> None:
    """Refused before any I/O (nothing listens at the sample URLs)."""
    url = f"{SAMPLE_URLS[backend]}?endpoint=orders"
    with pytest.raises(ConfigurationError, match="both in the URL and as a keyword"):
        open_store(url, endpoint="billing")
