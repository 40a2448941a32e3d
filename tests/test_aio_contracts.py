"""The contract suites, unchanged, on the async API of every backend: each store of
:mod:`dedupstore.aio`, called through :func:`dedupstore.testing.faces.blocking`."""

from __future__ import annotations

from typing import Any

import pytest

from dedupstore import aio
from dedupstore.testing import DeduplicationStoreContract, StoreFactory, TokenStoreContract
from dedupstore.testing.entities import EntityStoreContract
from dedupstore.testing.faces import blocking
from tests.outbox_backends import OutboxBackend, backend_params

pytestmark = pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)


class TestAsyncDeduplicationStore(DeduplicationStoreContract):
    @pytest.fixture
    def store_factory(self, outbox_backend: OutboxBackend) -> StoreFactory:
        def make(**options: Any) -> Any:
            return blocking(aio.AsyncDeduplicationStore(outbox_backend.dedup(**options)))

        return make


class TestAsyncEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self, outbox_backend: OutboxBackend) -> Any:
        def make(**options: Any) -> Any:
            return blocking(aio.AsyncEntityStore(outbox_backend.entities(**options)))

        return make


class TestAsyncTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(self, outbox_backend: OutboxBackend) -> Any:
        def make(**options: Any) -> Any:
            return blocking(aio.AsyncTokenStore(outbox_backend.tokens(**options)))

        return make
