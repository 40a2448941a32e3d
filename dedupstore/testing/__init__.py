"""Contract test suites, shipped for dedupstore's own backends and for yours.

A third-party backend passes or fails the same suite as the built-in ones::

    import pytest
    from dedupstore import open_store
    from dedupstore.testing import DeduplicationStoreContract, MultiProcessContract

    class TestMyStore(DeduplicationStoreContract, MultiProcessContract):
        @pytest.fixture
        def store_factory(self, tmp_path):
            url = f"mystore://{tmp_path}/db"
            return lambda **options: open_store(url, **options)

Requires pytest.
"""

from dedupstore.testing.contract import (
    HOSTILE_IDS,
    INVALID_IDS,
    DeduplicationStoreContract,
    FakeClock,
    MultiProcessContract,
    StoreFactory,
    Timeline,
    random_valid_ids,
)
from dedupstore.testing.tokens import TokenStoreContract, TokenStoreFactory

__all__ = [
    "HOSTILE_IDS",
    "INVALID_IDS",
    "DeduplicationStoreContract",
    "FakeClock",
    "MultiProcessContract",
    "StoreFactory",
    "Timeline",
    "TokenStoreContract",
    "TokenStoreFactory",
    "random_valid_ids",
]
