"""One consumer of the randomised soak (``tests/test_outbox_soak.py``): a thread or a process.

It works through its own list of deliveries (duplicates included), with crashes
injected at random before or after any call to the stores or the dispatcher; a
crashed delivery goes to the back of its list (the broker's redelivery), and when it
comes alone its run is recorded first (``begin_attempt``), as the consume loop does. What it
dispatched is appended, one JSON line per message, to its own file.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dedupstore.entities import EntityStore, OutgoingMessage
from dedupstore.outbox import Message, OutboxProcessor, Send, message_key, outgoing_id, sweep
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenStore
from tests.outbox_backends import OutboxBackend


class Crash(Exception):
    """Injected failure."""


def soak_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Appends the message id; sends the list as it is now (outputs depend on the state)."""
    applied = [*state.get("applied", []), message.id]
    return {"applied": applied}, [Send("audit", {"mid": message.id, "applied": applied})]


async def async_soak_handler(
    state: dict[str, Any], message: Message
) -> tuple[dict[str, Any], list[Send]]:
    """:func:`soak_handler` as an ``async def`` (it yields to the loop once first)."""
    await asyncio.sleep(0)
    return soak_handler(state, message)


def soak_violations(
    owner: Mapping[str, str],
    entities: EntityStore,
    dedup: DeduplicationStore,
    sent: Iterable[Mapping[str, Any]],
    consumer: str = "default",
    tokens: TokenStore | None = None,
    letters: int = 0,
) -> list[str]:
    """Sweep, then check every invariant against the plain model of the input; the
    violations found (empty: all hold).

    ``owner`` maps each distinct input message id to its entity; ``sent`` holds every
    copy of every outgoing message (``OutgoingMessage.to_json()`` dicts). The model:
    each message applied once, to its entity; every outbox empty after the sweep, and
    no run of a message left recorded (``Entity.attempts``);
    every key recorded in the deduplication store; the outgoing ids exactly
    ``outgoing_id(consumer, entity, id, 0)`` of the input (none missing, no ghost),
    every copy of one id identical, each showing the state its message produced.

    With ``tokens`` (every input message carried a token): no key in the deduplication
    store instead, and no token left but the ``letters`` dead letters' (kept for their
    redrive).
    """
    violations: list[str] = []
    result = sweep(entities, dedup, tokens=tokens)
    if result.ids_left:
        violations.append(f"the sweep left {result.ids_left} ids")
    loaded = entities.load_many(sorted(set(owner.values())))
    applied: Counter[str] = Counter()
    for entity in loaded.values():
        if entity.outbox:
            violations.append(f"{entity.id} keeps {sorted(entity.outbox)[:5]} in its outbox")
        if entity.attempts:
            violations.append(f"{entity.id} keeps runs recorded for {sorted(entity.attempts)[:5]}")
        for mid in entity.state.get("applied", []):
            if owner.get(mid) != entity.id:
                violations.append(f"{mid} applied to {entity.id}, not to its entity")
            applied[mid] += 1
    lost = set(owner) - set(applied)
    if lost:
        violations.append(f"{len(lost)} messages lost (never applied), e.g. {sorted(lost)[:3]}")
    twice = sorted(mid for mid, n in applied.items() if n > 1)
    if twice:
        violations.append(f"{len(twice)} messages applied twice, e.g. {twice[:3]}")
    keys = [message_key(cid, mid) for mid, cid in owner.items()]
    recorded = dedup.processed_among(keys)
    if tokens is None and set(keys) - recorded:
        violations.append(f"{len(set(keys) - recorded)} ids not in the deduplication store")
    if tokens is not None:
        if recorded:
            violations.append(f"{len(recorded)} ids with a token in the deduplication store")
        left = sum(count.outstanding for count in tokens.outstanding().values())
        if left != letters:
            violations.append(f"{left} tokens left, expected {letters} (the dead letters')")
    first: dict[str, Mapping[str, Any]] = {}
    differing: set[str] = set()
    for message in sent:
        if first.setdefault(message["id"], message) != message:
            differing.add(message["id"])
    if differing:
        violations.append(f"{len(differing)} outgoing ids dispatched with two contents")
    expected = {outgoing_id(consumer, cid, mid, 0): (mid, cid) for mid, cid in owner.items()}
    missing, ghosts = set(expected) - set(first), set(first) - set(expected)
    if missing:
        violations.append(f"{len(missing)} outgoing messages missing")
    if ghosts:
        violations.append(f"{len(ghosts)} ghost outgoing messages (no such message applied)")
    wrong = 0
    for out_id, (mid, cid) in expected.items():
        entity = loaded.get(cid)
        history = entity.state.get("applied", []) if entity is not None else []
        if out_id in first and mid in history:
            wrong += first[out_id]["body"]["applied"] != history[: history.index(mid) + 1]
    if wrong:
        violations.append(f"{wrong} outgoing messages show a state their message did not make")
    return violations


#: The calls of an entity store joined with its deduplication store (one request for both).
JOINED_CALLS = frozenset({"_load_checked", "_save_checked", "_save_recording"})


class _Flaky:
    """Delegates to ``real``; each call may crash before or after it runs.

    With ``joined``, the entity store's joined calls (:data:`JOINED_CALLS`) get the
    real deduplication store (so the processor finds the two joined where they are)
    and may crash like the others; without, the processor sees two separate stores.
    """

    def __init__(self, real: Any, rng: random.Random, rate: float, joined: bool = False) -> None:
        self._real, self._rng, self._rate, self._joins = real, rng, rate, joined

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._real, name)
        if not callable(target):
            return target
        if self._joins and name == "_joined":
            return lambda dedup: target(_unwrapped(dedup))
        if name.startswith("_") and not (self._joins and name in JOINED_CALLS):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_unwrapped(a) for a in args)
            if self._rng.random() < self._rate:
                raise Crash(f"before {name}")
            result = target(*args, **kwargs)
            if self._rng.random() < self._rate:
                raise Crash(f"after {name}")
            return result

        return call


def _unwrapped(value: Any) -> Any:
    return value._real if isinstance(value, _Flaky) else value


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
    joined: bool = False,
) -> dict[str, int]:
    """Process every delivery (``(message id, entity id)``) until none is left; return counts.

    ``joined``: the processor uses the joined calls where the backend has them.
    """
    rng = random.Random(seed)
    entities, dedup = backend.entities(), backend.dedup()
    dispatcher = _FileDispatcher(Path(out))
    processor = OutboxProcessor(
        _Flaky(entities, rng, crash_rate, joined),  # type: ignore[arg-type]
        _Flaky(dedup, rng, crash_rate),  # type: ignore[arg-type]
        _Flaky(dispatcher, rng, crash_rate),  # type: ignore[arg-type]
        cleanup=cleanup,  # type: ignore[arg-type]
        max_attempts=50,
    )
    if processor._joined != joined:
        raise AssertionError(f"the processor is {'not ' * joined}joined on {backend.name}")
    counts = {"processed": 0, "duplicate": 0, "redispatched": 0, "crashes": 0, "batches": 0}
    queue = list(deliveries)
    crashed: set[tuple[str, str]] = set()  # redelivered after a crash of this consumer
    try:
        while queue:
            size = rng.choice((1, 1, 5, 20))
            chunk, queue = queue[:size], queue[size:]
            messages = [Message(mid, cid, None) for mid, cid in chunk]
            try:
                if len(messages) == 1:
                    if chunk[0] in crashed:  # as the consume loop runs it: its run recorded
                        processor.begin_attempt(messages[0])
                    results = [processor.process(messages[0], soak_handler)]
                else:
                    results = processor.process_batch(messages, soak_handler)
            except Crash:
                counts["crashes"] += 1
                queue.extend(chunk)  # redelivered later
                crashed.update(chunk)
                continue
            counts["batches"] += size > 1
            for result in results:
                counts[result.outcome] += 1
    finally:
        entities.close()
        dedup.close()
        dispatcher.close()
    return counts
