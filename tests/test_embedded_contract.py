"""The shipped contract suite against the embedded backends."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

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
