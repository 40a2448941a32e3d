"""Randomised soak: many messages over many entities, consumers in threads and processes.

Every message is delivered one to three times; copies of one message go to
different consumers at about the same position of their lists, so duplicates run
concurrently. Each consumer mixes ``process`` and ``process_batch`` and crashes at
random before or after any call (then redelivers). Afterwards a sweep runs and every
count is checked exactly: each message applied once to its entity, in the
deduplication store, every outbox empty, each output dispatched with one id and one
byte string, showing the state its message produced. On PostgreSQL and Redis it runs
twice: with the two stores seen as separate (the steps one call each), and joined
(one request loads and checks, one saves and checks, one records and saves; the
crashes land before or after those too).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import random
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.outbox_backends import OutboxBackend, backend_params
from tests.soak_worker import run_consumer, soak_violations

#: the backends whose entity and deduplication stores can share one request
JOINED = ("postgres", "redis")

#: backend -> (messages, entities, threads, processes)
SIZES = {
    "memory": (3000, 300, 4, 0),  # in-process: no processes
    "sqlite": (3000, 300, 3, 2),
    "postgres": (3000, 300, 3, 2),
    "redis": (3000, 300, 3, 2),
    "dynamodb": (400, 40, 2, 1),
    "cosmos": (300, 30, 2, 1),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_randomised_soak_counts_exactly(
    outbox_backend: OutboxBackend, cleanup: str, tmp_path: Path
) -> None:
    _soak(outbox_backend, cleanup, tmp_path, joined=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("outbox_backend", backend_params(JOINED), indirect=True)
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_randomised_soak_on_joined_stores(
    outbox_backend: OutboxBackend, cleanup: str, tmp_path: Path
) -> None:
    """The same, through the calls that do the work of both stores in one request."""
    _soak(outbox_backend, cleanup, tmp_path, joined=True)


def _soak(outbox_backend: OutboxBackend, cleanup: str, tmp_path: Path, *, joined: bool) -> None:
    count, entity_count, threads, processes = SIZES[outbox_backend.name]
    rng = random.Random(f"{outbox_backend.name}-{cleanup}" + "-joined" * joined)
    tag = uuid.uuid4().hex[:8]
    owner = {f"m{n}-{tag}": f"e{rng.randrange(entity_count)}-{tag}" for n in range(count)}
    workers = threads + processes
    lists: list[list[tuple[str, str]]] = [[] for _ in range(workers)]
    for mid, cid in owner.items():
        copies = rng.choice((1, 2, 2, 3))
        chosen = rng.sample(range(workers), min(copies, workers))
        for worker in chosen:  # the copies land at about the same position: concurrent
            lists[worker].append((mid, cid))
    outs = [str(tmp_path / f"sent-{w}.jsonl") for w in range(workers)]
    args = [
        (outbox_backend, lists[w], rng.randrange(2**32), 0.03, cleanup, outs[w], joined)
        for w in range(workers)
    ]
    context = multiprocessing.get_context("spawn")
    with (
        concurrent.futures.ThreadPoolExecutor(threads) as pool,
        concurrent.futures.ProcessPoolExecutor(max(processes, 1), mp_context=context) as procs,
    ):
        futures = [pool.submit(run_consumer, *args[w]) for w in range(threads)]
        futures += [procs.submit(run_consumer, *args[w]) for w in range(threads, workers)]
        counts = [future.result() for future in futures]
    totals: Counter[str] = Counter()
    for item in counts:
        totals.update(item)
    assert totals["crashes"] > 0 and totals["batches"] > 0, totals
    assert totals["processed"] <= count, f"more 'processed' results than messages: {totals}"

    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    try:
        sent = [
            json.loads(line)
            for out in outs
            for line in Path(out).read_text(encoding="utf-8").splitlines()
        ]
        assert soak_violations(owner, entities, dedup, sent) == []
    finally:
        entities.close()
        dedup.close()
