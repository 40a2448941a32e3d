"""A consumer process of the chaos test (``tests/test_consumer_chaos.py``).

``python -m tests.consume_worker <dedupstore consume arguments>`` runs the real
``dedupstore consume`` command, unless ``DEDUPSTORE_CHAOS_VARIANT`` names a broken
variant, which this module patches in first:

* ``ack-first``: the broker acknowledges what it fetched before it is processed;
* ``dispatch-after-cleanup``: the processor cleans up (the id recorded, the outbox
  entry removed or marked) before it dispatches the outgoing messages.

The handler, :func:`slow_handler`, is the soak's (``tests/soak_worker.py``) with a
pause, so that a batch takes long enough for a SIGKILL to land inside it;
:func:`async_slow_handler` is the same as an ``async def``, which runs the command on
asyncio (the async face).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dedupstore.outbox import Message, Send
from dedupstore.outbox.processor import _Processor
from tests.soak_worker import soak_handler

VARIANT_ENV = "DEDUPSTORE_CHAOS_VARIANT"
#: A file: the ``dispatch-after-cleanup`` variant pauses only while it exists (the chaos
#: tests remove it after their last kill, so the drain runs at full speed).
PAUSE_FILE_ENV = "DEDUPSTORE_CHAOS_PAUSE_FILE"
#: That file's name in a chaos run's log directory.
PAUSE_FILE = "killing"
#: Seconds the handler pauses per message.
PAUSE = float(os.environ.get("DEDUPSTORE_CHAOS_PAUSE", "0.002"))


def slow_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """The soak's handler (the same outputs for the same state), after a pause; a body
    with ``keep`` is kept in the state too, and stays there for the entity's later
    messages (the chaos tests' oversize message: its entity can never hold it, also
    when a later message of the same batch follows it)."""
    time.sleep(PAUSE)
    return _kept(state, message, soak_handler(state, message))


def _kept(
    state: dict[str, Any], message: Message, result: tuple[dict[str, Any], list[Send]]
) -> tuple[dict[str, Any], list[Send]]:
    new, sends = result
    if "kept" in state:
        new["kept"] = state["kept"]
    if isinstance(message.body, dict) and "keep" in message.body:
        new["kept"] = message.body["keep"]
    return new, sends


async def async_slow_handler(
    state: dict[str, Any], message: Message
) -> tuple[dict[str, Any], list[Send]]:
    """:func:`slow_handler` as an ``async def`` (its pause awaited): ``dedupstore
    consume`` then runs the async face (:class:`~dedupstore.aio.AsyncConsumer`)."""
    await asyncio.sleep(PAUSE)
    return _kept(state, message, soak_handler(state, message))


#: Seconds a broken variant waits in its window (acknowledged and not applied; cleaned
#: up and not sent) while the pause file exists: long beside a round's work, so that
#: almost every kill lands in the window (at 0.05 s, one run in a full suite saw none of
#: its 10 kills lose a message).
WINDOW = 0.2


def _in_window() -> bool:
    pausing = os.environ.get(PAUSE_FILE_ENV)
    return pausing is not None and os.path.exists(pausing)


def window_marker(pausing: str | os.PathLike[str], pid: int) -> Path:
    """The file that exists while the process ``pid`` waits in its broken window."""
    return Path(f"{os.fspath(pausing)}.{pid}")


@contextlib.contextmanager
def _marked_window() -> Iterator[None]:
    """While a broken variant waits in its window, :func:`window_marker` exists, so that
    the harness kills a consumer in it: every kill of an anti-test then lands in the
    window (at random moments, three kills under a loaded suite once all missed it)."""
    pausing = os.environ.get(PAUSE_FILE_ENV)
    marker = None if pausing is None else window_marker(pausing, os.getpid())
    if marker is not None:
        marker.touch()
    try:
        yield
    finally:
        if marker is not None:
            with contextlib.suppress(OSError):
                marker.unlink()


def pause_in_window() -> None:
    """While the chaos run kills (its pause file exists), wait :data:`WINDOW` in a marked
    window: what a broken variant does between its ack and the work it acked."""
    if _in_window():
        with _marked_window():
            time.sleep(WINDOW)


def _ack_first() -> None:
    """BROKEN: acknowledge every delivery as soon as it is fetched (every broker), then
    wait :data:`WINDOW` before applying them."""
    from dedupstore.backends.rabbitmq.consumer import RabbitMQBroker
    from dedupstore.backends.redis.consumer import RedisStreamsBroker

    for cls in (RedisStreamsBroker, RabbitMQBroker):
        fetch = cls.fetch

        def acking(self: Any, max_count: int, wait: float, fetch: Any = fetch) -> Any:
            deliveries = fetch(self, max_count, wait)
            self.ack(deliveries)
            if deliveries:
                pause_in_window()
            return deliveries

        cls.fetch = acking  # type: ignore[method-assign]

    from dedupstore.backends.rabbitmq.aio import AioPikaBroker
    from dedupstore.backends.redis.consumer import AsyncRedisStreamsBroker

    for acls in (AioPikaBroker, AsyncRedisStreamsBroker):
        afetch = acls.fetch

        async def aacking(self: Any, max_count: int, wait: float, afetch: Any = afetch) -> Any:
            deliveries = await afetch(self, max_count, wait)
            await self.ack(deliveries)
            if deliveries and _in_window():
                with _marked_window():
                    await asyncio.sleep(WINDOW)
            return deliveries

        acls.fetch = aacking  # type: ignore[method-assign]


class Late:
    """A dispatcher that holds what it is given until :meth:`flush`, which pauses
    ``pause`` seconds before it sends (the window a crash falls into: cleaned up, not
    yet sent; also used by ``tests/test_interleavings.py``, without a pause), while
    the file ``pausing`` exists if one is named."""

    def __init__(self, real: Any, pause: float = 0.0, pausing: str | None = None) -> None:
        self.real, self.held, self.pause, self.pausing = real, [], pause, pausing

    def dispatch(self, messages: Sequence[Any]) -> None:
        self.held.extend(messages)

    def flush(self) -> None:
        if self.held:
            if self.pausing is None or os.path.exists(self.pausing):
                with _marked_window():
                    time.sleep(self.pause)
            held, self.held = self.held, []
            self.real.dispatch(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _FlushAfterSave:
    """An entity store after whose every save the late dispatcher sends what it holds."""

    def __init__(self, real: Any, late: Late) -> None:
        self._real, self._late = real, late

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def save(self, entity: Any) -> Any:
        saved = self._real.save(entity)
        self._late.flush()
        return saved

    def save_many(self, entities: Any) -> Any:
        conflicts = self._real.save_many(entities)
        self._late.flush()
        return conflicts


def _dispatch_after_cleanup() -> None:
    """BROKEN: dispatches go out after the save that follows them (the clean-up), on
    both faces (their processors share ``_Processor.__init__``)."""
    init = _Processor.__init__

    def late_init(self: _Processor, entities: Any, dedup: Any, dispatcher: Any, **kw: Any) -> None:
        late = Late(dispatcher, pause=WINDOW, pausing=os.environ.get(PAUSE_FILE_ENV))
        init(self, _FlushAfterSave(entities, late), dedup, late, **kw)

    _Processor.__init__ = late_init  # type: ignore[method-assign]


VARIANTS = {"ack-first": _ack_first, "dispatch-after-cleanup": _dispatch_after_cleanup}


def main(argv: list[str]) -> int:
    """Apply the variant named in the environment, then run ``dedupstore consume``."""
    from dedupstore.cli import main as cli

    variant = os.environ.get(VARIANT_ENV, "")
    if variant:
        VARIANTS[variant]()
    return cli(["consume", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
