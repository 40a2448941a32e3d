"""The thread demo: an at-least-once stream whose duplicates are recognised.

A broker delivers every message at least once: some twice or three times, some
copies at the same moment to several consumer threads. Each consumer claims a
message by recording its id (``add`` / ``add_many``) and handles it only when the
claim succeeded. The report shows each distinct message was claimed once.

Claim-then-handle is at-most-once per crash: a consumer that crashes after the
claim and before the handling loses the message (this demo injects no crash).
Exactly-once processing needs the outbox (entity state, outbox, then the id).
"""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO

from dedupstore.store import DeduplicationStore

__all__ = ["DemoReport", "run_demo"]


@dataclass
class DemoReport:
    """What the demo observed."""

    url: str
    endpoint: str
    distinct: int = 0
    delivered: int = 0
    concurrent_copies: int = 0
    processed: int = 0
    duplicates: int = 0
    handled: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def exactly_once(self) -> bool:
        """Every distinct message handled exactly once, and nothing else handled."""
        return (
            len(self.handled) == self.distinct
            and all(count == 1 for count in self.handled.values())
            and self.processed + self.duplicates == self.delivered
        )

    def render(self) -> str:
        """The human-readable report."""
        twice = sum(1 for count in self.handled.values() if count > 1)
        lost = self.distinct - len(self.handled)
        verdict = "yes" if self.exactly_once else f"NO ({twice} twice, {lost} never)"
        return "\n".join(
            [
                f"dedupstore demo: at-least-once stream on {self.url} (endpoint {self.endpoint})",
                f"  messages delivered:               {self.delivered:>7,}",
                f"  distinct messages:                {self.distinct:>7,}",
                f"  copies delivered concurrently:    {self.concurrent_copies:>7,}",
                f"  processed:                        {self.processed:>7,}",
                f"  recognised as duplicates:         {self.duplicates:>7,}",
                f"  each message claimed exactly once: {verdict}",
                f"  ({self.seconds:.2f} s)",
            ]
        )


def _deliveries(
    ids: list[str], rng: random.Random, burst: int, threads: int
) -> tuple[list[str], list[str]]:
    """Return (stream with redeliveries, ids delivered to every thread at once)."""
    stream: list[str] = []
    for mid in ids:
        copies = 1 + (rng.random() < 0.3) + (rng.random() < 0.1)
        stream.extend([mid] * copies)
    rng.shuffle(stream)
    concurrent = rng.sample(ids, min(burst, len(ids)))
    return stream, concurrent


def run_demo(
    store: DeduplicationStore,
    *,
    messages: int = 2000,
    threads: int = 4,
    burst: int = 100,
    seed: int | None = None,
    out: TextIO | None = None,
) -> DemoReport:
    """Feed ``messages`` distinct messages at least once through ``threads`` consumers.

    Returns the report; ``report.exactly_once`` is the verdict. Raises what the
    store raises (``StoreUnavailable`` when it cannot answer).
    """
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    ids = [f"order-{run}-{n:06d}" for n in range(messages)]
    stream, concurrent = _deliveries(ids, rng, burst, threads)
    report = DemoReport(url=store.url, endpoint=store.endpoint, distinct=messages)
    report.delivered = len(stream) + len(concurrent) * threads
    report.concurrent_copies = len(concurrent) * threads
    lock = threading.Lock()
    work: queue.Queue[list[str] | None] = queue.Queue()
    barrier = threading.Barrier(threads)

    def handle(mid: str) -> None:
        with lock:
            report.handled[mid] += 1

    def consume(index: int) -> None:
        # Phase 1: the same messages reach every consumer at the same moment.
        barrier.wait()
        for mid in concurrent:
            claimed = store.add(mid)
            if claimed:
                handle(mid)
            with lock:
                report.processed += claimed
                report.duplicates += not claimed
        # Phase 2: the redelivering stream, in small batches.
        while (batch := work.get()) is not None:
            claimed_ids = store.add_many(batch)
            for mid in batch:
                if mid in claimed_ids:
                    claimed_ids.discard(mid)
                    handle(mid)
                    with lock:
                        report.processed += 1
                else:
                    with lock:
                        report.duplicates += 1

    started = time.perf_counter()
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            consume(index)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            barrier.abort()

    workers = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for start in range(0, len(stream), 25):
        work.put(stream[start : start + 25])
    for _ in workers:
        work.put(None)
    for worker in workers:
        worker.join()
    report.seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    if out is not None:
        print(report.render(), file=out)
    return report
