"""The shipped contract suite against the embedded backends."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from backends.memory import MemoryDeduplicationStore
from dedupstore import DeduplicationStore, open_store
from dedupstore.testing import DeduplicationStoreContract, MultiProcessContract, StoreFactory


@pytest.mark.memory
class TestMemoryStore(DeduplicationStoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        url = f"memory://{uuid.uuid4().hex}"

        def make(**options: Any) -> DeduplicationStore:
            return open_store(url, **options)

        return make


@pytest.mark.sqlite
class TestSqliteStore(DeduplicationStoreContract, MultiProcessContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> StoreFactory:
        url = f"sqlite:///{tmp_path}/dedup.db"

        def make(**options: Any) -> DeduplicationStore:
            return open_store(url, **options)

        return make


class _SmallConcurrentChunks(MemoryDeduplicationStore):
    """Tiny chunks, several in flight: exercises the base class's chunk machinery."""

    max_write_batch = 7
    max_read_batch = 5
    chunk_concurrency = 3


@pytest.mark.memory
class TestConcurrentChunksStore(DeduplicationStoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        url = f"memory://{uuid.uuid4().hex}"
        return lambda **options: _SmallConcurrentChunks(url, **options)


@pytest.mark.memory
def test_a_failing_chunk_fails_the_call_after_the_others_finish() -> None:
    from dedupstore import StoreUnavailable

    class Flaky(_SmallConcurrentChunks):
        def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
            if "boom" in ids:
                raise StoreUnavailable("injected")
            return super()._add_new(ids, now, expires_at)

    store = Flaky(f"memory://{uuid.uuid4().hex}")
    ids = [f"id-{n}" for n in range(100)]
    with pytest.raises(StoreUnavailable):
        store.add_many([*ids[:50], "boom", *ids[50:]])
    store.close()
    assert store.closed
