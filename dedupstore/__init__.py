"""dedupstore: exactly-once message processing on top of at-least-once delivery.

A deduplication store is a strongly consistent set of processed message ids,
chosen by URL::

    import dedupstore

    with dedupstore.open_store("sqlite:///.dedupstore/dedup.db", endpoint="orders") as store:
        store.add("msg-1")                  # True: recorded now; False: already recorded

"``add`` returned True, now process the message" alone is at-most-once per crash (a
crash between the two loses the message). Exactly-once processing is the improving
outbox: the entity's outbox holds the message's outgoing messages until they are
dispatched, and only then does the id move to the deduplication store.

Importing this package imports no backend and no database client library.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, TypeVar

from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    EntityTooLarge,
    InvalidMessageId,
    StoreClosed,
    StoreUnavailable,
    format_error,
)
from dedupstore.registry import known_backends, register_backend, register_entity_backend
from dedupstore.store import DeduplicationStore

if TYPE_CHECKING:
    from dedupstore.entities import EntityStore
    from dedupstore.registry import Registry

T = TypeVar("T")

__all__ = [
    "ConcurrencyConflict",
    "ConfigurationError",
    "ConsistencyError",
    "DedupStoreError",
    "DeduplicationStore",
    "EntityTooLarge",
    "InvalidMessageId",
    "StoreClosed",
    "StoreUnavailable",
    "__version__",
    "format_error",
    "known_backends",
    "open_entity_store",
    "open_store",
    "register_backend",
    "register_entity_backend",
]

try:
    __version__ = version("dedupstore")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0+unknown"


def open_store(url: str | None = None, **options: Any) -> DeduplicationStore:
    """Open the deduplication store at ``url``.

    Without ``url``, the per-environment configuration decides (``DEDUPSTORE_URL``,
    ``dedupstore.toml`` or ``[tool.dedupstore]`` selected by ``DEDUPSTORE_ENV``), and
    with no configuration at all the embedded SQLite store in ``./.dedupstore/``.
    URL query parameters and keyword arguments are the backend's declared options
    (strings convert: ``"false"``, ``"5s"``); one given both ways with different
    values is refused. Common options: ``endpoint: str = "default"``,
    ``retention: timedelta | None = None``; each network backend has ``timeout``.

    Raises ``ConfigurationError`` (bad URL, unknown scheme or option, bad value,
    missing extra), ``ConsistencyError`` (store weaker than strongly consistent)
    and ``StoreUnavailable`` (the store does not answer).
    """
    from dedupstore.registry import stores

    return _open(stores, url, options, entities=False)


def open_entity_store(url: str | None = None, **options: Any) -> EntityStore:
    """Open the entity store at ``url`` (same schemes as :func:`open_store`).

    Without ``url``: the environment's ``entities_url`` and ``entities_options``
    (``DEDUPSTORE_ENTITIES_URL`` overrides), and with no configuration at all the
    embedded SQLite file in ``./.dedupstore/`` (its own table). Options work as
    for :func:`open_store`; each backend documents its own (table, prefix, timeouts).

    Raises ``ConfigurationError``, ``ConsistencyError`` and ``StoreUnavailable``.
    """
    from dedupstore.registry import entity_stores

    return _open(entity_stores, url, options, entities=True)


def _open(registry: Registry[T], url: str | None, options: dict[str, Any], *, entities: bool) -> T:
    if url is None:
        from dedupstore.config import resolve_config

        resolved = resolve_config(entities=entities)
        clash = sorted(set(resolved.options) & set(options))
        if clash:
            raise ConfigurationError(
                f"{', '.join(clash)} given both by {resolved.source} and as keyword "
                "argument(s); set each once"
            )
        return registry.open(resolved.url, **{**resolved.options, **options})
    return registry.open(url, **options)
