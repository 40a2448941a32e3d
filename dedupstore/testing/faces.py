"""The async API under the sync suites: :func:`blocking` makes a client of
:mod:`dedupstore.aio` callable as the sync client it stands for, so that the contract
suites (:class:`~dedupstore.testing.DeduplicationStoreContract`,
:class:`~dedupstore.testing.EntityStoreContract`,
:class:`~dedupstore.testing.TokenStoreContract`) check the async API unchanged.

Each call of a coroutine method runs on one event loop kept in a thread of its own,
and the caller waits for it; an async iterator is read item by item the same way.
Only what the async client has is reached: a method the sync client has and the
async one lacks is an ``AttributeError``, not a silent call of the sync client.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["blocking", "wait_for"]

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def _portal() -> asyncio.AbstractEventLoop:
    """The event loop the blocking calls run on (started on first use)."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True, name="aio-portal").start()
        return _loop


def wait_for(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on the loop :func:`blocking` calls run on, and wait for its
    result (open an async client there, so that its connections live on that loop)."""
    return asyncio.run_coroutine_threadsafe(coroutine, _portal()).result()


_wait = wait_for


def _synced(value: Any) -> Any:
    """What a plain method of an async client returned, an async iterator read as a
    sync one."""
    return _items(value) if hasattr(value, "__anext__") else value


def _items(iterator: AsyncIterator[T]) -> Iterator[T]:
    while True:
        try:
            yield _wait(iterator.__anext__())  # type: ignore[arg-type]
        except StopAsyncIteration:
            return


class _Blocking:
    """An async client, called as the sync one (see :func:`blocking`)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._client, name, _MISSING)
        if value is _MISSING:
            sync = getattr(self._client, "sync", None)
            value = getattr(sync, name)  # an attribute the async client does not have
            if callable(value) and not isinstance(value, type):
                raise AttributeError(
                    f"{type(self._client).__name__} has no {name}() (the sync client has)"
                )
            return value
        if inspect.iscoroutinefunction(value):
            return lambda *args, **kwargs: _wait(value(*args, **kwargs))
        if inspect.ismethod(value):
            return lambda *args, **kwargs: _synced(value(*args, **kwargs))
        return value

    def __reduce__(self) -> tuple[Any, ...]:
        return blocking, (self._client,)

    def __contains__(self, message_id: object) -> bool:
        return bool(_wait(self._client.has_been_processed(message_id)))

    def __enter__(self) -> _Blocking:
        return self

    def __exit__(self, *exc: object) -> None:
        _wait(self._client.close())

    def __repr__(self) -> str:
        return f"blocking({self._client!r})"


_MISSING = object()


def blocking(client: Any) -> Any:
    """``client`` (a store or dispatcher of :mod:`dedupstore.aio`), callable as the sync
    client it stands for: each coroutine method awaited on a loop of its own thread. Its
    class is named after ``client``'s and has the sync client's class constants (the
    suites read ``type(store).max_batch``, ``expiry_clock``)."""
    sync = type(getattr(client, "sync", client))
    key = (type(client), sync)
    kind = _KINDS.get(key)
    if kind is None:
        constants: dict[str, Any] = {
            name: value
            for klass in reversed(sync.__mro__)
            for name, value in vars(klass).items()
            if not name.startswith("_") and isinstance(value, int | str | float)
        }
        # the hooks a suite inspects to learn what the backend can do
        constants.update({name: getattr(sync, name) for name in _HOOKS if hasattr(sync, name)})
        kind = _KINDS[key] = type(type(client).__name__, (_Blocking,), constants)
    return kind(client)


#: The private hooks the suites inspect on a store's class (whether a backend overrides).
_HOOKS = ("_endpoints",)
_KINDS: dict[tuple[type, type], type[_Blocking]] = {}
