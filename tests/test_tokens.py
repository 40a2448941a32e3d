"""Token stores (token-based deduplication): the shipped contract on the embedded backends,
partial failures, and opening by URL."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest

from dedupstore import ConfigurationError, StoreUnavailable, open_token_store
from dedupstore.backends.memory import MemoryTokenStore
from dedupstore.backends.sqlite import SqliteTokenStore
from dedupstore.testing import TokenStoreContract, TokenStoreFactory
from dedupstore.tokens import TokenCount, TokenRecord, TokenStore


@pytest.mark.memory
class TestMemoryTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(self) -> TokenStoreFactory:
        url = f"memory://{uuid.uuid4().hex}"

        def make(**options: Any) -> TokenStore:
            return open_token_store(url, **options)

        return make


@pytest.mark.sqlite
class TestSqliteTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(self, tmp_path: Path) -> TokenStoreFactory:
        url = f"sqlite:///{tmp_path}/tokens.db"

        def make(**options: Any) -> TokenStore:
            return open_token_store(url, **options)

        return make


class _SmallConcurrentChunks(MemoryTokenStore):
    """Tiny chunks, several in flight: exercises the base class's chunk machinery."""

    max_batch = 7
    chunk_concurrency = 3


@pytest.mark.memory
class TestConcurrentChunksTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(self) -> TokenStoreFactory:
        url = f"memory://{uuid.uuid4().hex}"
        return lambda **options: _SmallConcurrentChunks(url, **options)


class _FailsOnce(_SmallConcurrentChunks):
    """The chunk holding ``"boom"`` fails once (before it writes or deletes anything)."""

    armed = True

    def _create(self, records: list[TokenRecord]) -> None:
        self._maybe_fail([r.id for r in records])
        super()._create(records)

    def _delete(self, ids: list[str]) -> None:
        self._maybe_fail(ids)
        super()._delete(ids)

    def _maybe_fail(self, ids: list[str]) -> None:
        if type(self).armed and "boom" in ids:
            type(self).armed = False
            raise StoreUnavailable("injected: the server went away")


@pytest.mark.memory
@pytest.mark.parametrize("operation", ["create", "delete"])
def test_a_batch_that_fails_part_way_says_what_it_completed(operation: str) -> None:
    store = _FailsOnce(f"memory://{uuid.uuid4().hex}")
    ids = [f"t-{n}" for n in range(60)] + ["boom"]
    _FailsOnce.armed = False  # whichever test of the class ran before in this process
    if operation == "delete":
        store.create(dict.fromkeys(ids, "e"))
    _FailsOnce.armed = True
    run = (
        (lambda: store.create(dict.fromkeys(ids, "e")))
        if operation == "create"
        else (lambda: store.delete(ids))
    )
    with pytest.raises(StoreUnavailable) as info:
        run()
    done, unknown = info.value.recorded, info.value.unknown
    assert "boom" in unknown and not done & unknown
    present = store.present_among(ids)
    assert (done <= present) if operation == "create" else done.isdisjoint(present)
    run()  # the same call again completes it
    assert store.present_among(ids) == (set(ids) if operation == "create" else set())


def test_open_token_store_knows_its_schemes() -> None:
    with pytest.raises(ConfigurationError, match=r"memory://.*sqlite://"):
        open_token_store("nosuch://x")


@pytest.mark.sqlite
def test_the_sqlite_table_holds_id_endpoint_and_mint_time(tmp_path: Path) -> None:
    path = tmp_path / "tokens.db"
    with open_token_store(f"sqlite:///{path}", clock=lambda: 1234.5) as tokens:
        assert isinstance(tokens, SqliteTokenStore)
        tokens.create({"t-1": "billing"})
        assert tokens.outstanding() == {"billing": TokenCount(1, 1234.5)}
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT id, endpoint, created FROM dedup_tokens").fetchall() == [
            ("t-1", "billing", 1234.5)
        ]


@pytest.mark.sqlite
def test_a_missing_token_table_is_refused_without_create(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/tokens.db"
    open_token_store(url).close()  # the file, with the default table
    with pytest.raises(ConfigurationError, match="other_tokens"):
        open_token_store(url, table="other_tokens", create=False).present("t-1")
