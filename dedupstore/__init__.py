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
from typing import TYPE_CHECKING, Any, TypeVar, overload

from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    ConsistencyError,
    DeadLetterIncomplete,
    DedupStoreError,
    EntityTooLarge,
    HandlerError,
    InvalidMessageId,
    InvalidValue,
    MessageTooLarge,
    StoreClosed,
    StoreUnavailable,
    TokenPresent,
    format_error,
)
from dedupstore.registry import register
from dedupstore.store import DeduplicationStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from dedupstore.dispatch import CallableDispatcher, URLDispatcher
    from dedupstore.entities import EntityStore, OutgoingMessage
    from dedupstore.outbox import Dispatcher
    from dedupstore.registry import Kind
    from dedupstore.tokens import TokenStore
    from dedupstore.urls import StoreURL

D = TypeVar("D", bound="Dispatcher")

__all__ = [
    "ConcurrencyConflict",
    "ConfigurationError",
    "ConsistencyError",
    "DeadLetterIncomplete",
    "DedupStoreError",
    "DeduplicationStore",
    "EntityTooLarge",
    "HandlerError",
    "InvalidMessageId",
    "InvalidValue",
    "MessageTooLarge",
    "StoreClosed",
    "StoreUnavailable",
    "TokenPresent",
    "__version__",
    "format_error",
    "open_dispatcher",
    "open_entity_store",
    "open_store",
    "open_token_store",
    "register",
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
    store: DeduplicationStore = _open("store", url, options, entities=False)
    return store


def open_entity_store(url: str | None = None, **options: Any) -> EntityStore:
    """Open the entity store at ``url`` (same schemes as :func:`open_store`).

    Without ``url``: the environment's ``entities_url`` and ``entities_options``
    (``DEDUPSTORE_ENTITIES_URL`` overrides), and with no configuration at all the
    embedded SQLite file in ``./.dedupstore/`` (its own table). Options work as
    for :func:`open_store`; each backend documents its own (table, prefix, timeouts).

    Raises ``ConfigurationError``, ``ConsistencyError`` and ``StoreUnavailable``.
    """
    entities: EntityStore = _open("entity_store", url, options, entities=True)
    return entities


def open_token_store(url: str | StoreURL, /, **options: Any) -> TokenStore:
    """Open the token store at ``url`` (token-based deduplication: a message may be
    processed only while its token exists; see :class:`~dedupstore.tokens.TokenStore`).

    The schemes of :func:`open_store` (default table, container or key prefix
    ``dedup_tokens``; a DynamoDB URL names its table); options as for it, without
    ``endpoint`` and ``retention``: a token names its receiving endpoint, and tokens
    never expire (Redis is refused unless its ``maxmemory-policy`` is ``noeviction``).

    Raises ``ConfigurationError`` (bad URL, unknown scheme or option, bad value,
    missing extra) and ``StoreUnavailable``.
    """
    from dedupstore.registry import open_url

    return open_url("token_store", url, **options)


@overload
def open_dispatcher(url_or_callable: str | StoreURL, /, **options: Any) -> URLDispatcher: ...
@overload
def open_dispatcher(url_or_callable: D, /) -> D: ...
@overload
def open_dispatcher(
    url_or_callable: Callable[[list[OutgoingMessage]], object], /
) -> CallableDispatcher: ...
def open_dispatcher(
    url_or_callable: str | StoreURL | Dispatcher | Callable[[list[OutgoingMessage]], object],
    /,
    **options: Any,
) -> Dispatcher:
    """A dispatcher for the outbox: from a URL, a callable or a ready dispatcher.

    A URL (``memory://<name>``, ``sqlite:///file.db``, ``redis://host:6379/0``, or a
    registered scheme) opens a :class:`~dedupstore.dispatch.URLDispatcher` with the
    declared ``options``; an object with a ``dispatch`` method is returned as is; any
    other callable ``fn(messages)`` is wrapped in a
    :class:`~dedupstore.dispatch.CallableDispatcher` (picklable if ``fn`` is).
    Delivery is at least once: receivers deduplicate by message id.

    Raises ``ConfigurationError`` before any I/O for anything else, for options
    given with a callable or dispatcher, and for a bad URL, unknown scheme or bad
    option; ``StoreUnavailable`` when the backend cannot be reached.
    """
    from dedupstore.dispatch import CallableDispatcher, Dispatcher
    from dedupstore.registry import open_url
    from dedupstore.urls import StoreURL

    if isinstance(url_or_callable, str | StoreURL):
        return open_url("dispatcher", url_or_callable, **options)
    kind = type(url_or_callable).__name__
    if options:
        raise ConfigurationError(
            f"options ({', '.join(sorted(options))}) apply to a dispatcher URL, not to a {kind}"
        )
    if isinstance(url_or_callable, Dispatcher) and callable(url_or_callable.dispatch):
        return url_or_callable
    if callable(url_or_callable):
        return CallableDispatcher(url_or_callable)
    raise ConfigurationError(
        f"open_dispatcher takes a URL, a callable fn(messages) or an object with a dispatch "
        f"method, got {kind}"
    )


def _open(kind: Kind, url: str | None, options: dict[str, Any], *, entities: bool) -> Any:
    from dedupstore.registry import open_url

    if url is None:
        from dedupstore.config import resolve_config

        resolved = resolve_config(entities=entities)
        clash = sorted(set(resolved.options) & set(options))
        if clash:
            raise ConfigurationError(
                f"{', '.join(clash)} given both by {resolved.source} and as keyword "
                "argument(s); set each once"
            )
        return open_url(kind, resolved.url, **{**resolved.options, **options})
    return open_url(kind, url, **options)
