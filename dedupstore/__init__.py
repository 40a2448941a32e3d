"""dedupstore: exactly-once message processing on top of at-least-once delivery.

A consumer records each processed message id in a strongly consistent
deduplication store chosen by URL::

    import dedupstore

    with dedupstore.open_store("sqlite:///.dedupstore/dedup.db", endpoint="orders") as store:
        if store.add(message.id):
            ...  # first time this id is recorded

Importing this package imports no backend and no database client library.
"""

from __future__ import annotations

from typing import Any

from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    InvalidMessageId,
    StoreUnavailable,
)
from dedupstore.registry import known_backends, register_backend
from dedupstore.store import DeduplicationStore

__all__ = [
    "ConcurrencyConflict",
    "ConfigurationError",
    "ConsistencyError",
    "DedupStoreError",
    "DeduplicationStore",
    "InvalidMessageId",
    "StoreUnavailable",
    "__version__",
    "known_backends",
    "open_store",
    "register_backend",
]

__version__ = "0.1.0"


def open_store(url: str | None = None, **options: Any) -> DeduplicationStore:
    """Open the deduplication store at ``url``.

    Without ``url``, the per-environment configuration decides (``DEDUPSTORE_URL``,
    ``dedupstore.toml`` or ``[tool.dedupstore]`` selected by ``DEDUPSTORE_ENV``), and
    with no configuration at all the embedded SQLite store in ``./.dedupstore/``.
    URL query parameters become options; keyword arguments override them. Common
    options: ``endpoint: str = "default"``, ``retention: timedelta | None = None``.

    Raises ``ConfigurationError`` (bad URL, unknown scheme or option, missing
    extra), ``ConsistencyError`` (store weaker than strongly consistent) and
    ``StoreUnavailable`` (the store does not answer).
    """
    from dedupstore.registry import open_url

    if url is None:
        from dedupstore.config import resolve_config

        resolved = resolve_config()
        return open_url(resolved.url, **{**resolved.options, **options})
    return open_url(url, **options)
