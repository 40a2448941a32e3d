"""What a Spark task needs to open its own clients: a URL and options, checked on the driver.

Nothing live crosses to the executors. The driver checks each URL and its options
(scheme known, client library installed, every option valid) without any I/O, and
ships a :class:`ClientSpec`; each task opens its own client from it and closes it.
The jobs' other arguments are checked on the driver too (:func:`positive_int`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

import dedupstore
from dedupstore import registry
from dedupstore.entities import EntityStore
from dedupstore.errors import ConfigurationError
from dedupstore.outbox import Dispatcher
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenStore
from dedupstore.urls import StoreURL

Kind = Literal["entities", "dedup", "dispatcher", "tokens"]

#: ClientSpec kind -> the registry's kind of plugin, what it is called, how a task opens it.
_KINDS: dict[str, tuple[registry.Kind, str, Callable[..., Any]]] = {
    "entities": ("entity_store", "entity store", dedupstore.open_entity_store),
    "dedup": ("store", "deduplication store", dedupstore.open_store),
    "dispatcher": ("dispatcher", "dispatcher", dedupstore.open_dispatcher),
    "tokens": ("token_store", "token store", dedupstore.open_token_store),
}


def positive_int(name: str, value: object, minimum: int = 1) -> int:
    """``value``, an int of at least ``minimum``; ``ConfigurationError`` if not."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class ClientSpec:
    """A client to open in each task: ``kind``, ``url`` (or a callable dispatcher), options."""

    kind: Kind
    url: str | Callable[..., Any]
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def checked(
        cls, kind: Kind, url: object, options: Mapping[str, Any] | None = None
    ) -> ClientSpec:
        """A spec whose URL and options are valid; ``ConfigurationError`` if not (no I/O).

        The URL is the backend's ``portable_url`` (a relative ``sqlite:///`` path made
        absolute here, on the driver, so tasks in another working directory open the
        same file). A ``process_local`` backend (``memory://``) is refused: Spark tasks
        run in separate Python workers.
        """
        options = dict(options or {})
        plugin_kind, what, _ = _KINDS[kind]
        if kind == "dispatcher" and callable(url) and not isinstance(url, str):
            if options:
                raise ConfigurationError("a callable dispatcher takes no options")
            return cls(kind, url, options)
        if not isinstance(url, str) or not url:
            raise ConfigurationError(f"the {what} URL must be a non-empty string, got {url!r}")
        parsed = StoreURL.parse(url)
        target: Any = registry.resolve(plugin_kind, parsed.scheme)
        if target.process_local:
            raise ConfigurationError(
                f"{parsed.masked!r}: this {what} lives in one process, and "
                "Spark tasks run in separate Python workers; use sqlite:/// on one machine or "
                "a server"
            )
        portable = target.portable_url(parsed)
        target.check_options(portable, **options)
        return cls(kind, portable.text, options)

    def open(self) -> Any:
        """Open the client (in a task)."""
        return _KINDS[self.kind][2](self.url, **self.options)


@dataclass(frozen=True)
class Opened:
    """The clients one task opened (``None`` for those it was not given)."""

    entities: EntityStore
    dedup: DeduplicationStore
    dispatcher: Dispatcher | None
    tokens: TokenStore | None = None


class TaskClients(ExitStack):
    """The clients of one task, opened at first use (an empty partition opens nothing).

    A context manager: every client opened is closed on the way out.
    """

    def __init__(
        self,
        entities: ClientSpec | None = None,
        dedup: ClientSpec | None = None,
        dispatcher: ClientSpec | None = None,
        tokens: ClientSpec | None = None,
    ) -> None:
        super().__init__()
        self._specs = (entities, dedup, dispatcher, tokens)
        self._opened: Opened | None = None

    def get(self) -> Opened:
        """The opened clients (opens them the first time)."""
        if self._opened is None:
            self._opened = Opened(*(self._open(spec) for spec in self._specs))
        return self._opened

    def _open(self, spec: ClientSpec | None) -> Any:
        if spec is None:
            return None
        client = spec.open()
        close = getattr(client, "close", None)
        if close is not None:
            self.callback(close)
        return client
