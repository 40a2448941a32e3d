"""Unit tests of the core: ids, URLs, registry, configuration, open_store."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import dedupstore
from dedupstore import (
    ConcurrencyConflict,
    ConfigurationError,
    ConsistencyError,
    DeduplicationStore,
    DedupStoreError,
    InvalidMessageId,
    StoreUnavailable,
    open_store,
    register,
)
from dedupstore.config import DEFAULT_URL, resolve_config
from dedupstore.masking import mask_url
from dedupstore.options import parse_duration
from dedupstore.registry import known, resolve
from dedupstore.store import validate_message_id
from dedupstore.testing import INVALID_IDS

pytestmark = pytest.mark.sqlite


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory with no dedupstore environment variables."""
    monkeypatch.chdir(tmp_path)
    for var in ("DEDUPSTORE_ENV", "DEDUPSTORE_URL", "DEDUPSTORE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture
def populated(in_tmp: Path) -> Iterator[DeduplicationStore]:
    """A SQLite store holding two ids, to prove failed calls change nothing."""
    with open_store(f"sqlite:///{in_tmp}/unchanged.db") as store:
        store.add_many(["kept-1", "kept-2"])
        yield store


def _contents(store: DeduplicationStore) -> set[str]:
    import sqlite3

    with sqlite3.connect(f"{store._sqlite.path}") as conn:  # type: ignore[attr-defined]
        return {row[0] for row in conn.execute("SELECT id FROM dedup_records")}


# ---------------------------------------------------------------------- errors


def test_error_hierarchy() -> None:
    for cls in (ConfigurationError, ConsistencyError, InvalidMessageId, StoreUnavailable):
        assert issubclass(cls, DedupStoreError)
    assert issubclass(ConcurrencyConflict, DedupStoreError)
    assert issubclass(InvalidMessageId, ValueError)
    assert dedupstore.errors.StoreUnavailable is StoreUnavailable


# ---------------------------------------------------------------------- ids


@pytest.mark.parametrize(("why", "bad"), INVALID_IDS, ids=[w for w, _ in INVALID_IDS])
def test_invalid_ids_are_named_in_the_message(why: str, bad: object) -> None:
    with pytest.raises(InvalidMessageId) as info:
        validate_message_id(bad)
    message = str(info.value)
    expected = {
        "empty string": "empty",
        "NUL character": "NUL",
        "lone high surrogate": "surrogate",
        "lone low surrogate": "surrogate",
        "1025 UTF-8 bytes": "1025 bytes",
        "1026 UTF-8 bytes of 2-byte chars": "1026 bytes",
    }.get(why, "must be a str")
    assert expected in message


@pytest.mark.parametrize(("why", "bad"), INVALID_IDS, ids=[w for w, _ in INVALID_IDS])
def test_bad_ids_leave_the_store_unchanged(
    populated: DeduplicationStore, why: str, bad: object
) -> None:
    before = _contents(populated)
    for call in (populated.add, populated.has_been_processed):
        with pytest.raises(InvalidMessageId):
            call(bad)  # type: ignore[operator]
    with pytest.raises(InvalidMessageId):
        populated.add_many(["fresh-1", bad, "fresh-2"])  # type: ignore[list-item]
    assert _contents(populated) == before


def test_ids_up_to_1024_bytes_are_valid() -> None:
    assert validate_message_id("a" * 1024) == "a" * 1024
    assert validate_message_id("€" * 341) == "€" * 341  # 1023 bytes


# ---------------------------------------------------------------------- URLs


def test_mask_url_hides_passwords_and_keys() -> None:
    assert mask_url("postgresql://app:s3cret@db:5432/x") == "postgresql://app:***@db:5432/x"
    assert "abc" not in mask_url("cosmos://h/db/c?key=abc&tls=false")
    assert mask_url("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("30d", 2592000), ("1w", 604800)],
)
def test_parse_duration(text: str, expected: int) -> None:
    assert parse_duration(text) == timedelta(0, expected)


def test_parse_duration_none_and_bad() -> None:
    assert parse_duration(None) is None, "None keeps records forever"
    assert parse_duration("none") is None, "'none' keeps records forever"
    for bad in ("0", "-1", "soon", "5 parsecs"):
        with pytest.raises(ValueError):
            parse_duration(bad)


# ---------------------------------------------------------------------- open_store


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("not a url", "malformed store URL"),
        ("://nothing", "malformed store URL"),
        ("redis://localhost:notaport/0", "malformed store URL"),
        ("foo://x", "unknown store URL scheme 'foo'"),
        ("sqlite://host/x.db", "has no host"),
        ("sqlite://", "must name a database file"),
        ("memory://x?colour=blue", "unknown option 'colour' for MemoryDeduplicationStore"),
        ("sqlite:///x.db?colour=blue", "unknown option 'colour'"),
        ("sqlite:///x.db?timeout=soon", "bad value for option 'timeout'"),
        # the message says what the option is, in the user's terms (its declared doc)
        ("sqlite:///x.db?timeout=soon", "(seconds a call waits for another writer's lock)"),
    ],
)
def test_bad_urls(populated: DeduplicationStore, url: str, fragment: str) -> None:
    before = _contents(populated)
    with pytest.raises(ConfigurationError) as info:
        open_store(url)
    assert fragment in str(info.value)
    assert _contents(populated) == before


def test_unknown_keyword_option(in_tmp: Path) -> None:
    with pytest.raises(ConfigurationError, match="colour"):
        open_store("sqlite:///x.db", colour="blue")


def test_a_url_keyword_conflict_is_refused(in_tmp: Path) -> None:
    with pytest.raises(ConfigurationError, match="both in the URL and as a keyword"):
        open_store("sqlite:///x.db?endpoint=a&retention=1h", endpoint="b")
    with open_store("sqlite:///x.db?endpoint=a&retention=1h", endpoint="a") as store:
        assert store.endpoint == "a"  # the same value twice is no conflict
        assert store.retention == timedelta(hours=1)


def test_missing_extra_names_the_pip_install(
    populated: DeduplicationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _contents(populated)
    monkeypatch.setitem(sys.modules, "redis", None)  # makes `import redis` fail
    with pytest.raises(ConfigurationError) as info:
        open_store("redis://localhost:6379/0")
    assert "pip install 'dedupstore[redis]'" in str(info.value)
    assert _contents(populated) == before


def test_default_store_is_sqlite_under_dot_dedupstore(in_tmp: Path) -> None:
    with open_store() as store:
        assert type(store).__name__ == "SqliteDeduplicationStore"
        assert store.add("x")
    assert (in_tmp / ".dedupstore" / "dedup.db").is_file()
    assert DEFAULT_URL.startswith("sqlite:///.dedupstore/")


def test_import_loads_no_backend_or_client() -> None:
    code = textwrap.dedent(
        """
        import sys, dedupstore
        bad = [m for m in sys.modules if m.split('.')[0] in
               {'redis', 'psycopg', 'psycopg_pool', 'boto3', 'botocore', 'azure',
                'pyspark', 'sqlite3', 'filelock'}
               or m.startswith(('dedupstore.backends', 'dedupstore.spark'))]
        print(bad)
        assert not bad, bad
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- registry


def test_registry_view_is_read_only() -> None:
    assert "sqlite" in known("store") and "postgresql" in known("store")
    with pytest.raises(TypeError):
        known("store")["x"] = known("store")["sqlite"]  # type: ignore[index]


def test_register_a_store(in_tmp: Path) -> None:
    register("store", "mymem", "dedupstore.backends.memory:MemoryDeduplicationStore")
    try:
        with pytest.raises(ValueError, match="clobber"):
            register("store", "mymem", "dedupstore.backends.sqlite:SqliteDeduplicationStore")
        register(
            "store", "mymem", "dedupstore.backends.sqlite:SqliteDeduplicationStore", clobber=True
        )
        assert resolve("store", "mymem").__name__ == "SqliteDeduplicationStore"
    finally:
        from dedupstore import registry

        registry._registered["store"].pop("mymem", None)
    with pytest.raises(ValueError):
        register("store", "bad", "no-colon")


def test_registered_target_must_be_a_store() -> None:
    register("store", "notastore", "dedupstore.errors:DedupStoreError")
    try:
        with pytest.raises(ConfigurationError, match="not a DeduplicationStore"):
            resolve("store", "notastore")
    finally:
        from dedupstore import registry

        registry._registered["store"].pop("notastore", None)


def test_backends_load_through_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    from dedupstore import registry

    ep = EntryPoint(
        "epmem",
        "dedupstore.backends.memory:MemoryDeduplicationStore",
        registry.entry_point_group("store"),
    )
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == ep.group else [])
    monkeypatch.setattr(registry, "_loaded", set())
    try:
        with open_store("epmem://x") as store:
            assert type(store).__name__ == "MemoryDeduplicationStore"
    finally:
        registry._registered["store"].pop("epmem", None)


# ---------------------------------------------------------------------- configuration


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_config_file_selects_environment(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(
        in_tmp / "dedupstore.toml",
        """
        default_env = "dev"
        [dev]
        url = "sqlite:///dev.db"
        endpoint = "orders"
        [test]
        url = "memory://${SUITE}"
        retention = "2h"
        [test.options]
        """,
    )
    resolved = resolve_config()
    assert (resolved.url, resolved.environment) == (f"sqlite:///{in_tmp / 'dev.db'}", "dev")
    with open_store() as store:
        assert store.endpoint == "orders"
    monkeypatch.setenv("DEDUPSTORE_ENV", "test")
    monkeypatch.setenv("SUITE", "ci")
    with open_store() as store:
        assert store.url == "memory://ci"
        assert store.retention == timedelta(hours=2)
    monkeypatch.setenv("DEDUPSTORE_URL", "memory://override")
    with open_store() as store:
        assert store.url == "memory://override"


def test_pyproject_tool_table(in_tmp: Path) -> None:
    _write(
        in_tmp / "pyproject.toml",
        """
        [project]
        name = "app"
        [tool.dedupstore.default]
        url = "memory://from-pyproject"
        """,
    )
    sub = in_tmp / "pkg"
    sub.mkdir()
    import os

    os.chdir(sub)
    assert resolve_config().url == "memory://from-pyproject"


@pytest.mark.parametrize(
    ("text", "env", "fragment"),
    [
        ("[dev]\nurl='memory://'\ncolour='blue'\n", {"DEDUPSTORE_ENV": "dev"}, "'colour'"),
        ("colour = 'blue'\n[dev]\nurl='memory://'\n", {}, "'colour'"),
        ("[dev]\nurl='memory://'\n", {"DEDUPSTORE_ENV": "prod"}, "no environment 'prod'"),
        ("[dev]\nurl='memory://'\n", {}, "environments: dev"),
        ("[dev]\nurl='redis://u:${NOPE_UNSET}@h'\n", {"DEDUPSTORE_ENV": "dev"}, "NOPE_UNSET"),
        ("[dev]\nurl='memory://'\nretention='soon'\n", {"DEDUPSTORE_ENV": "dev"}, "retention"),
        ("[dev]\nendpoint='x'\n", {"DEDUPSTORE_ENV": "dev"}, "no 'url'"),
        ("[dev\n", {}, "cannot read"),
    ],
)
def test_config_errors_say_which(
    populated: DeduplicationStore,
    in_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    env: dict[str, str],
    fragment: str,
) -> None:
    before = _contents(populated)
    _write(in_tmp / "dedupstore.toml", text)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigurationError) as info:
        open_store()
    assert fragment in str(info.value)
    assert _contents(populated) == before


def test_config_never_shows_secrets(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(
        in_tmp / "dedupstore.toml",
        """
        [default]
        url = "postgresql://app:${DB_PASSWORD}@db.example/app"
        [default.options]
        password = "${DB_PASSWORD}"
        """,
    )
    monkeypatch.setenv("DB_PASSWORD", "hunter2-very-secret")
    resolved = resolve_config()
    assert "hunter2" in resolved.url
    assert "hunter2" not in repr(resolved)
    assert "hunter2" not in str(resolved.masked())


def test_dollar_dollar_is_a_literal_dollar(in_tmp: Path) -> None:
    _write(in_tmp / "dedupstore.toml", "[default]\nurl = 'memory://a$$b'\n")
    assert resolve_config().url == "memory://a$b"


def test_repr_masks_password_options() -> None:
    from dedupstore.backends.memory import MemoryDeduplicationStore
    from dedupstore.options import Option, text

    class WithPassword(MemoryDeduplicationStore):
        declared_options = MemoryDeduplicationStore.declared_options.extend(
            Option("password", text(), None, "a secret", secret=True)
        )

    for store in (
        WithPassword("memory://r", password="hunter2"),
        WithPassword("memory://r?password=hunter2"),
    ):
        assert "hunter2" not in repr(store)
        assert "hunter2" not in store.url
        assert "***" in repr(store)
    with pytest.raises(ConfigurationError) as info:
        WithPassword("memory://r", password=12345678)
    assert "12345678" not in str(info.value)


def test_pickled_sqlite_store_reopens_the_same_file_from_another_directory(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    with open_store("sqlite:///relative/dir/dedup.db") as store:
        store.add("seen-before")
        blob = pickle.dumps(store)
    elsewhere = in_tmp / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pickle.loads(blob) as clone:
        assert clone.has_been_processed("seen-before")
    assert not (elsewhere / "relative").exists()


def test_the_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    import dedupstore

    assert dedupstore.__version__ == version("dedupstore")


def test_a_short_secret_masks_whole_words_only() -> None:
    from dedupstore.backends.memory import MemoryDeduplicationStore
    from dedupstore.options import Option, text

    class WithPassword(MemoryDeduplicationStore):
        declared_options = MemoryDeduplicationStore.declared_options.extend(
            Option("password", text(), None, "a secret", secret=True)
        )

    short = WithPassword("memory://s", password="e")
    assert short.scrub("the user e was refused") == "the user *** was refused"
    long = WithPassword("memory://s", password="correct-horse")
    assert long.scrub("auth correct-horse-battery") == "auth ***-battery"
    assert "e" in short.describe_error(RuntimeError("every letter stays"))


def test_entities_url_per_environment(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dedupstore import open_entity_store

    monkeypatch.delenv("DEDUPSTORE_ENTITIES_URL", raising=False)
    _write(
        in_tmp / "dedupstore.toml",
        """
        default_env = "dev"
        [dev]
        url = "sqlite:///dev.db"
        entities_url = "sqlite:///dev.db"
        [dev.entities_options]
        table = "orders"
        [bare]
        url = "memory://x"
        [clash]
        entities_url = "sqlite:///c.db?table=a"
        [clash.entities_options]
        table = "b"
        """,
    )
    resolved = resolve_config(entities=True)
    assert (resolved.url, resolved.options) == (
        f"sqlite:///{in_tmp / 'dev.db'}",
        {"table": "orders"},
    )
    with open_entity_store() as entities:
        assert entities.option("table") == "orders"
        entities.save(entities.load("e1"))
    with pytest.raises(ConfigurationError, match="given both"):
        open_entity_store(table="other")
    monkeypatch.setenv("DEDUPSTORE_ENV", "bare")
    with pytest.raises(ConfigurationError, match="no 'entities_url'"):
        open_entity_store()
    assert open_store().url == "memory://x"  # the store side does not need it
    monkeypatch.setenv("DEDUPSTORE_ENTITIES_URL", "memory://ents")
    with open_entity_store() as entities:
        assert entities.url == "memory://ents"
    monkeypatch.delenv("DEDUPSTORE_ENTITIES_URL")
    monkeypatch.setenv("DEDUPSTORE_ENV", "clash")
    with pytest.raises(ConfigurationError, match="set both in the URL's query"):
        open_entity_store()


def test_entity_registry_is_lazy_and_extensible() -> None:
    assert (
        known("entity_store")["postgres"].target
        == "dedupstore.backends.postgres:PostgresEntityStore"
    )
    register("entity_store", "mymem", "dedupstore.backends.memory:MemoryEntityStore")
    from dedupstore import open_entity_store

    with open_entity_store("mymem://one") as store:
        assert type(store).__name__ == "MemoryEntityStore"
    with pytest.raises(ConfigurationError, match="not a EntityStore subclass"):
        register("entity_store", "wrong", "dedupstore.backends.memory:MemoryDeduplicationStore")
        open_entity_store("wrong://x")


def test_the_error_prefix_is_written_in_one_place() -> None:
    """'<Class> at <url>:' comes from Client.make_error only, never typed by hand."""
    root = Path(__file__).resolve().parent.parent
    typed = [
        str(path.relative_to(root))
        for folder in ("dedupstore", "backends", "spark_integration")
        for path in sorted((root / folder).rglob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if " at {self.url}:" in line
    ]
    assert typed == ["dedupstore/client.py"], typed  # in Client.make_error
