"""One consumer of the randomised soak (``tests/test_outbox_soak.py``): a thread or a process.

It works through its own list of deliveries (duplicates included), with crashes
injected at random before or after any call to the stores or the dispatcher; a
crashed delivery goes to the back of its list (the broker's redelivery). What it
dispatched is appended, one JSON line per message, to its own file.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

from dedupstore.entities import OutgoingMessage
from dedupstore.outbox import Message, OutboxProcessor, Send
from tests.outbox_backends import OutboxBackend


class Crash(Exception):
    """Injected failure."""


def soak_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Appends the message id; sends the list as it is now (outputs depend on the state)."""
    applied = [*state.get("applied", []), message.id]
    return {"applied": applied}, [Send("audit", {"mid": message.id, "applied": applied})]


class _Flaky:
    """Delegates to ``real``; each call may crash before or after it runs."""

    def __init__(self, real: Any, rng: random.Random, rate: float) -> None:
        self._real, self._rng, self._rate = real, rng, rate

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._real, name)
        if not callable(target) or name.startswith("_"):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._rng.random() < self._rate:
                raise Crash(f"before {name}")
            result = target(*args, **kwargs)
            if self._rng.random() < self._rate:
                raise Crash(f"after {name}")
            return result

        return call


class _FileDispatcher:
    def __init__(self, path: Path) -> None:
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def dispatch(self, messages: list[OutgoingMessage]) -> None:
        with self._lock:
            for message in messages:
                self._file.write(json.dumps(message.to_json(), sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def run_consumer(
    backend: OutboxBackend,
    deliveries: list[tuple[str, str]],
    seed: int,
    crash_rate: float,
    cleanup: str,
    out: str,
) -> dict[str, int]:
    """Process every delivery (``(message id, entity id)``) until none is left; return counts."""
    rng = random.Random(seed)
    entities, dedup = backend.entities(), backend.dedup()
    dispatcher = _FileDispatcher(Path(out))
    processor = OutboxProcessor(
        _Flaky(entities, rng, crash_rate),  # type: ignore[arg-type]
        _Flaky(dedup, rng, crash_rate),  # type: ignore[arg-type]
        _Flaky(dispatcher, rng, crash_rate),  # type: ignore[arg-type]
        cleanup=cleanup,  # type: ignore[arg-type]
        max_attempts=50,
    )
    counts = {"processed": 0, "duplicate": 0, "redispatched": 0, "crashes": 0, "batches": 0}
    queue = list(deliveries)
    try:
        while queue:
            size = rng.choice((1, 1, 5, 20))
            chunk, queue = queue[:size], queue[size:]
            messages = [Message(mid, cid, None) for mid, cid in chunk]
            try:
                if len(messages) == 1:
                    results = [processor.process(messages[0], soak_handler)]
                else:
                    results = processor.process_batch(messages, soak_handler)
            except Crash:
                counts["crashes"] += 1
                queue.extend(chunk)  # redelivered later
                continue
            counts["batches"] += size > 1
            for result in results:
                counts[result.outcome] += 1
    finally:
        entities.close()
        dedup.close()
        dispatcher.close()
    return counts
