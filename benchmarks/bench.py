"""Throughput and memory benchmark of every backend; writes benchmarks/RESULTS.md.

Run with ``make bench`` (starts the servers itself). For each backend, in one run
on one machine: ``add_many`` and ``processed_among`` ids/s on fresh UUID ids in
caller batches of 1k and 10k, a naive loop of single ``add`` calls, and the
server's own native write rate (Redis: ``redis-benchmark -P 64 -t set``; Postgres:
raw ``COPY`` of the same ids into an identical table). Only ratios measured in the
same run are compared: the machine is shared and noisy.

The outbox section (every backend, ``memory`` included): messages/s of
``OutboxProcessor.process`` and ``process_batch`` (batches of 100 and 1,000), with
inline and deferred clean-up, ``sweep`` ids/s after a deferred run, the store calls
each message costs, and on the same Redis, aws-lambda-powertools'
``idempotent_function`` with ``RedisCachePersistenceLayer``, in child processes in
the same ``--rounds`` as this tree's ``process`` and ``process_batch`` of 1,000.
PostgreSQL and Redis run in each server configuration of ``CONFIGS``: ``durable``
(Redis ``appendfsync always``; PostgreSQL ``fsync=on``, ``synchronous_commit=on``)
and ``fast`` (Redis ``appendfsync no``; PostgreSQL ``fsync=off``,
``synchronous_commit=off``); the ids tables use the first one.

This tree against the baseline commit (``BASELINE``, extracted with ``git archive``
into a temporary directory; a clear error if the clone lacks it): ``process_batch``
of 1,000 on ``memory://`` in process CPU time (``--cpu-rounds`` alternating
rounds), and ``process_batch`` of 1,000 and ``process`` on the same PostgreSQL and
Redis servers in wall-clock time (``--rounds``), each tree in child processes
(:mod:`benchmarks.cpu_compare`). Every target is printed as "ratio (target >= X):
met / NOT met", with the reasons the run can state for a missed one.

Flags for a quick run (``make bench BENCH_ARGS="..."``): ``--backends`` (ids
tables; ``''`` for none), ``--outbox-backends``, ``--configs durable|fast``,
``--ids``, ``--naive-ids``, ``--memory-sizes``, ``--outbox-messages``
(``process_batch`` runs), ``--outbox-single`` (``process`` and powertools runs),
``--rounds``, ``--cpu-rounds``, ``--baseline <commit>``, ``--skip-baseline``,
``--skip-powertools``, ``--skip-outbox``, ``--out`` (another file than RESULTS.md).

The token-mode section (issue 38; :mod:`benchmarks.tokens_bench`): the deduplication
data left after ``--tokens-sizes`` messages (10k, 100k, 1M) in retention mode and in
token mode, on SQLite, and the round trips (counted) and rates of ``process`` and
``process_batch`` in both modes, on stores that share a server and on separate ones;
``--tokens-layouts``, ``--tokens-batch``, ``--tokens-single``, ``--tokens-messages``,
``--skip-tokens``. ``--only tokens`` (or ``make bench-tokens``) runs that section alone
and replaces only its part of RESULTS.md; ``--only`` takes a comma-separated list of
``ids``, ``outbox``, ``tokens``, ``aio``.

The async-face section (issue 39; :mod:`benchmarks.aio_bench`): 100 threads of the sync
processor against 1,000 coroutines of the async one, on Redis and PostgreSQL: messages
per second, p50 and p99 latency per message, memory; ``--aio-messages``. ``--only aio``
(or ``make bench-aio``) runs it alone and replaces only its part.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from benchmarks import aio_bench, aio_drivers, tokens_bench
from benchmarks.cpu_compare import (
    THIS_TREE,
    Measured,
    Run,
    Stores,
    compare,
    extracted,
    paired,
    redis_requests,
)
from benchmarks.cpu_compare import workload as _workload
from dedupstore import DeduplicationStore, open_entity_store, open_store
from dedupstore.entities import EntityStore
from dedupstore.outbox import (
    InMemoryDispatcher,
    Message,
    OutboxProcessor,
    message_key,
    sweep,
)
from tests.servers import CosmosServer, MotoServer, PostgresServer, RedisServer

RESULTS = Path(__file__).with_name("RESULTS.md")
BACKENDS = ("sqlite", "postgres", "redis", "dynamodb", "cosmos")
OUTBOX_BACKENDS = ("memory", *BACKENDS)
#: Backends served by an emulator at ~100-2k requests/s: fewer ids and messages.
SLOW = frozenset({"dynamodb", "cosmos"})
#: Backends whose server runs in each configuration of ``CONFIGS``.
SERVERS = frozenset({"postgres", "redis"})
#: The commit the outbox is compared against: the last one before the package was
#: restructured (one namespace, public backend API, outbox split, plain value objects).
BASELINE = "45ec147"
#: ``process`` and ``process_batch`` against ``BASELINE``: within 5% on every backend.
BASELINE_GOAL = 0.95
#: The sections ``--only`` selects (all by default).
SECTIONS = ("ids", "outbox", "tokens", "aio")


@dataclass(frozen=True)
class ServerConfig:
    """How the Redis and PostgreSQL servers are started (keyword arguments)."""

    description: str
    redis: dict[str, Any]
    postgres: dict[str, Any]


CONFIGS = {
    "durable": ServerConfig(
        "Redis `appendonly yes`, `appendfsync always`; PostgreSQL `fsync=on`, "
        "`synchronous_commit=on` (every commit on disk before it is acknowledged)",
        {"appendonly": True, "appendfsync": "always"},
        {"durable": True},
    ),
    "fast": ServerConfig(
        "Redis `appendonly yes`, `appendfsync no`; PostgreSQL `fsync=off`, "
        "`synchronous_commit=off` (the stores' sessions still ask for synchronous commits, "
        "which without fsync do not wait for the disk)",
        {"appendonly": True, "appendfsync": "no"},
        {"durable": False},
    ),
}


@dataclass
class Result:
    """Measurements of one backend (in one server configuration, for ``SERVERS``)."""

    backend: str
    config: str = ""
    rates: dict[str, float] = field(default_factory=dict)
    native: tuple[str, float] | None = None
    memory: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Outbox messages/s (ids/s for ``sweep``) by measurement, e.g. ``process/inline``.
    outbox: dict[str, float] = field(default_factory=dict)
    #: Store primitive calls (load, save, add, find; one request each) per message.
    outbox_calls: dict[str, float] = field(default_factory=dict)
    #: Redis only: requests redis-py sent per message (pipelines count once).
    redis_requests: dict[str, float] = field(default_factory=dict)
    #: Batched runs: distinct entities in a batch, on average (messages of one entity
    #: in one batch share its load and save).
    outbox_entities: dict[str, float] = field(default_factory=dict)
    #: Messages per ``process`` run and per ``process_batch`` run.
    outbox_counts: tuple[int, int] = (0, 0)
    #: This tree against ``BASELINE`` by outbox run label (``batch 1000/inline``...).
    trees: dict[str, dict[str, Measured]] = field(default_factory=dict)
    #: The 1-minute load average after the outbox measurements.
    load: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.backend} ({self.config})" if self.config else self.backend


Opener = Callable[[], DeduplicationStore]


@dataclass
class Backend:
    """A running backend: fresh stores on it, and its server (``None`` if embedded).

    ``stores()`` names a fresh (entity store, deduplication store) pair on new tables /
    prefixes, which this process opens with ``pair()`` and a child process (another
    source tree) opens the same way.
    """

    dedup: Opener
    stores: Callable[[], Stores]
    server: Any

    def pair(self) -> tuple[EntityStore, DeduplicationStore]:
        s = self.stores()
        return (
            open_entity_store(s.entities_url, **s.entities_options),
            open_store(s.dedup_url, **s.dedup_options),
        )


@contextlib.contextmanager
def _backend(name: str, config: ServerConfig) -> Iterator[Backend]:
    """Start the backend's server (in ``config``); yield fresh stores on it."""
    run = uuid.uuid4().hex[:10]

    def tag() -> str:
        return uuid.uuid4().hex[:12]

    if name == "memory":

        def memory_pair() -> Stores:
            url = f"memory://bench-{tag()}"
            return Stores(url, url)

        yield Backend(lambda: open_store(f"memory://bench-{tag()}"), memory_pair, None)
    elif name == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:

            def sqlite_pair() -> Stores:
                url = f"sqlite:///{tmp}/outbox-{tag()}.db"  # entities have a table of their own
                return Stores(url, url)

            yield Backend(
                lambda: open_store(f"sqlite:///{tmp}/bench-{uuid.uuid4().hex}.db"),
                sqlite_pair,
                None,
            )
    elif name == "postgres":
        with PostgresServer(**config.postgres) as pg:

            def postgres_pair() -> Stores:
                t = tag()
                return Stores(
                    pg.url,
                    pg.url,
                    {"table": f"ent_{t}", "create": True},
                    {"table": f"dedup_{t}", "create": True},
                )

            yield Backend(
                lambda: open_store(pg.url, table=f"bench_{tag()}", create=True), postgres_pair, pg
            )
    elif name == "redis":
        with RedisServer(**config.redis) as redis:

            def redis_pair() -> Stores:
                t = tag()
                return Stores(
                    redis.url, redis.url, {"key_prefix": f"ent{t}:"}, {"key_prefix": f"dd{t}:"}
                )

            yield Backend(
                lambda: open_store(redis.url, key_prefix=f"b{uuid.uuid4().hex[:8]}:"),
                redis_pair,
                redis,
            )
    elif name == "dynamodb":
        with MotoServer() as moto:
            os.environ.update(moto.client_env)
            aws = {"region": "us-east-1", "endpoint_url": moto.endpoint_url, "create": True}

            def dynamodb_pair() -> Stores:
                t = tag()
                return Stores(f"dynamodb://ent-{run}-{t}", f"dynamodb://dd-{run}-{t}", aws, aws)

            yield Backend(
                lambda: open_store(f"dynamodb://bench-{run}-{uuid.uuid4().hex[:8]}", **aws),
                dynamodb_pair,
                moto,
            )
    elif name == "cosmos":
        with CosmosServer() as cosmos:
            host = cosmos.endpoint_url.removeprefix("http://")
            emulator = {
                "key": cosmos.key,
                "tls": False,
                "endpoint_discovery": False,
                "create": True,
                "allow_weak_consistency_for_emulator_only": True,
            }

            def cosmos_pair() -> Stores:
                t = tag()
                return Stores(
                    f"cosmos://{host}/bench/ent{t}",
                    f"cosmos://{host}/bench/dd{t}",
                    emulator,
                    emulator,
                )

            yield Backend(
                lambda: open_store(f"cosmos://{host}/bench/c{tag()}", **emulator),
                cosmos_pair,
                cosmos,
            )
    else:
        raise SystemExit(f"unknown backend {name!r}; choose from {', '.join(OUTBOX_BACKENDS)}")


def _ids(count: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(count)]


def _rate(count: int, action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return count / (time.perf_counter() - started)


def _batched(store: DeduplicationStore, ids: list[str], size: int, method: str) -> None:
    call = getattr(store, method)
    for start in range(0, len(ids), size):
        call(ids[start : start + size])


def _throughput(result: Result, opener: Opener, count: int, naive_count: int) -> None:
    for size in (1_000, 10_000):
        ids = _ids(count)
        with opener() as store:
            for method in ("add_many", "processed_among"):
                result.rates[f"{method}/{size // 1000}k"] = _rate(
                    count, functools.partial(_batched, store, ids, size, method)
                )
    naive_ids = _ids(naive_count)
    with opener() as store:
        result.rates["naive add loop"] = _rate(
            naive_count, lambda: [store.add(mid) for mid in naive_ids]
        )
    if naive_count < count:
        result.notes.append(f"naive loop measured on {naive_count:,} ids (rate, not total)")


def _peak_mib(store: DeduplicationStore, ids: Callable[[], Iterator[str]]) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        recorded = store.add_many(ids())
        assert not recorded, "ids were expected to be recorded already"
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def _memory(result: Result, opener: Opener, sizes: tuple[int, ...]) -> None:
    """Peak traced memory of add_many(generator) on already-recorded ids, per size."""
    for size in sizes:
        prefix = uuid.uuid4().hex[:8]

        def generate(n: int = size, p: str = prefix) -> Iterator[str]:
            return (f"{p}-{i:08d}" for i in range(n))

        with opener() as store:
            store.add_many(generate())  # record them; the measured pass returns nothing
            result.memory[f"{size:,}"] = _peak_mib(store, generate)


def _native_redis(server: RedisServer, count: int) -> tuple[str, float]:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise SystemExit("redis-benchmark not found: apt-get install redis-tools")
    host, port = server.url.removeprefix("redis://").split("/")[0].split(":")
    out = subprocess.run(
        [exe, "-h", host, "-p", port, "-P", "64", "-t", "set", "-n", str(count), "-q"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"SET: ([\d.]+) requests per second", out.replace("\r", "\n"))
    if not match:
        raise SystemExit(f"cannot parse redis-benchmark output: {out!r}")
    return "redis-benchmark -P 64 -t set", float(match.group(1))


def _native_postgres(server: PostgresServer, count: int) -> tuple[str, float]:
    import psycopg

    ids = _ids(count)
    with open_store(server.url, table="bench_template", create=True):
        pass
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_copy")
        conn.execute("CREATE TABLE bench_copy (LIKE bench_template INCLUDING ALL)")
        started = time.perf_counter()
        with conn.cursor() as cur, cur.copy("COPY bench_copy (endpoint, id) FROM STDIN") as copy:
            for mid in ids:
                copy.write_row(("default", mid))
        rate = count / (time.perf_counter() - started)
    return "raw COPY into an identical table", rate


# ---------------------------------------------------------------------- outbox

Cleanup = Literal["inline", "deferred"]
#: (label, clean-up, batch size or None for one ``process`` call per message).
OUTBOX_RUNS: tuple[tuple[str, Cleanup, int | None], ...] = (
    ("process/inline", "inline", None),
    ("process/deferred", "deferred", None),
    ("batch 100/inline", "inline", 100),
    ("batch 1000/inline", "inline", 1000),
    ("batch 100/deferred", "deferred", 100),
    ("batch 1000/deferred", "deferred", 1000),
)
#: The deferred run ``sweep`` is measured after.
SWEPT_RUN = "batch 1000/deferred"
#: (with the joint calls of stores on one server: ``_load_with``, ``_save_unless``,
#: ``_save_with``, each one request doing the work of an entity and a dedup primitive)
_ENTITY_PRIMITIVES = ("_load", "_save", "_load_with", "_save_unless", "_save_with")
_DEDUP_PRIMITIVES = ("_add_new", "_add_one", "_find", "_contains_one")


def _counting_calls(
    entities: EntityStore, dedup: DeduplicationStore
) -> contextlib.AbstractContextManager[Counter[str]]:
    """Count the store primitives called (outermost only: ``_add_one`` may call ``_add_new``).

    Each primitive is one request to the store (one statement, script, pipeline or
    API call; a DynamoDB or Cosmos entity save sends one request per entity).
    """
    return tokens_bench.counting_calls((entities, _ENTITY_PRIMITIVES), (dedup, _DEDUP_PRIMITIVES))


def _outbox_run(
    result: Result,
    backend: Backend,
    label: str,
    messages: list[Message],
    cleanup: Cleanup,
    batch: int | None,
) -> None:
    """Time one run on fresh stores; check it did the work; sweep after ``SWEPT_RUN``."""
    on_redis = result.backend == "redis"
    entities, dedup = backend.pair()
    with entities, dedup:
        dispatcher = InMemoryDispatcher()
        processor = OutboxProcessor(entities, dedup, dispatcher, cleanup=cleanup)
        with _counting_calls(entities, dedup) as calls, redis_requests(on_redis) as sent:
            outcomes, seconds = tokens_bench.timed_outcomes(processor, messages, batch)
        count = len(messages)
        if outcomes.count("processed") != count or len(dispatcher.sent) != count:
            raise SystemExit(f"{result.backend} {label}: not every message was processed once")
        keys = [message_key(m.correlation_id, m.id) for m in messages]
        if cleanup == "inline" and len(dedup.processed_among(keys)) != count:
            raise SystemExit(f"{result.backend} {label}: ids missing from the dedup store")
        result.outbox[label] = count / seconds
        if batch is not None:
            starts = range(0, count, batch)
            distinct = sum(len({m.correlation_id for m in messages[s : s + batch]}) for s in starts)
            result.outbox_entities[label] = distinct / len(starts)
        result.outbox_calls[label] = sum(calls.values()) / count
        if on_redis:
            result.redis_requests[label] = sent[0] / count
        if label == SWEPT_RUN:
            with _counting_calls(entities, dedup) as calls, redis_requests(on_redis) as sent:
                swept = sweep(entities, dedup)
            if swept.ids_moved != count or swept.ids_left:
                raise SystemExit(f"{result.backend} sweep: {swept}")
            result.outbox["sweep"] = count / swept.seconds
            result.outbox_calls["sweep"] = sum(calls.values()) / count
            if on_redis:
                result.redis_requests["sweep"] = sent[0] / count


def _outbox(
    result: Result, backend: Backend, count: int, single: int, args: argparse.Namespace
) -> None:
    rng = random.Random(args.seed)
    result.outbox_counts = (single, count)
    for label, cleanup, batch in OUTBOX_RUNS:
        messages = _workload(single if batch is None else count, rng)
        print(f"   outbox {label}: {len(messages):,} messages", file=sys.stderr, flush=True)
        _outbox_run(result, backend, label, messages, cleanup, batch)


#: The runs compared with the baseline (label, clock, on which backends): CPU time on
#: the in-process stores, wall-clock time on a server.
TREE_RUNS: tuple[tuple[str, Literal["cpu", "wall"], frozenset[str]], ...] = (
    ("batch 1000/inline", "cpu", frozenset({"memory"})),
    ("process/inline", "cpu", frozenset({"memory"})),
    ("batch 1000/inline", "wall", SERVERS),
    ("process/inline", "wall", SERVERS),
)


def _trees(
    result: Result, backend: Backend, baseline: Path | None, args: argparse.Namespace
) -> None:
    """This tree against the baseline tree on the same stores, each in child processes,
    and on Redis powertools in the same rounds (unless ``--skip-powertools``)."""
    single, count = result.outbox_counts
    for label, clock, backends in TREE_RUNS:
        if result.backend not in backends:
            continue
        _, cleanup, batch = next(run for run in OUTBOX_RUNS if run[0] == label)
        rounds = args.cpu_rounds if clock == "cpu" else args.rounds
        run = Run(single if batch is None else count, batch, cleanup, clock)
        trees = (
            {"this": THIS_TREE}
            if baseline is None
            else {"this": THIS_TREE, args.baseline: baseline}
        )
        others = {}
        if result.backend == "redis" and not args.skip_powertools:
            others["powertools"] = Run(single, None, clock="wall", kind="powertools")
        if len(trees) + len(others) < 2:
            continue
        print(
            f"   {label}: {', '.join([*trees, *others])} in {rounds} rounds",
            file=sys.stderr,
            flush=True,
        )
        result.trees[label] = compare(trees, run, backend.stores, rounds=rounds, others=others)
    powertools = result.trees.get("process/inline", {}).get("powertools")
    if powertools is not None:
        result.outbox["powertools"] = powertools.rate
        result.redis_requests["powertools"] = powertools.requests or 0.0


def _fmt(rate: float) -> str:
    return f"{rate:,.0f}"


def _render(results: list[Result], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Measured by `make bench` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} cores, in one run of {seconds:,.0f} s. Every server ran locally "
        "on loopback on the same shared machine, so compare the ratios inside one run, "
        "not absolute figures across runs.",
    ]
    dedup = [r for r in results if r.rates]
    if dedup:
        lines += ["", *_render_dedup(dedup, args)]
    outbox = [r for r in results if r.outbox]
    if outbox:
        lines += ["", *_render_outbox(outbox, args)]
    notes = [f"- {r.label}: {n}" for r in results for n in r.notes]
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def _render_dedup(results: list[Result], args: argparse.Namespace) -> list[str]:
    lines = [
        f"{args.ids:,} fresh UUID ids per measurement, passed to `add_many` / "
        "`processed_among` in caller batches of 1k and 10k (the backend splits them to "
        "its own limits). PostgreSQL and Redis run in the "
        f"`{args.configs.split(',')[0]}` configuration (see the outbox section).",
        "",
        "| backend | add_many 1k | add_many 10k | processed_among 1k | processed_among 10k "
        "| naive add loop | batch / naive | native rate | add_many / native "
        "| processed_among / native |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        best_add = max(r.rates["add_many/1k"], r.rates["add_many/10k"])
        best_read = max(r.rates["processed_among/1k"], r.rates["processed_among/10k"])
        naive = r.rates["naive add loop"]
        native = r.native[1] if r.native else None
        lines.append(
            f"| {r.label} | {_fmt(r.rates['add_many/1k'])} | {_fmt(r.rates['add_many/10k'])}"
            f" | {_fmt(r.rates['processed_among/1k'])} | {_fmt(r.rates['processed_among/10k'])}"
            f" | {_fmt(naive)} | {best_add / naive:,.1f}x"
            f" | {_fmt(native) if native else '-'}"
            f" | {f'{best_add / native:.2f}x' if native else '-'}"
            f" | {f'{best_read / native:.2f}x' if native else '-'} |"
        )
    lines += ["", "Rates are ids per second. Native rates:", ""]
    for r in results:
        if r.native:
            lines.append(f"- {r.label}: {r.native[0]}: {_fmt(r.native[1])} ids/s")
    lines += ["", "## Targets (ratios in this run)", ""]
    lines += _targets(results)
    memory = [r for r in results if r.memory]
    if memory:
        sizes = list(memory[0].memory)
        lines += [
            "",
            "## Peak memory of `add_many` over a generator",
            "",
            "Peak Python allocations (tracemalloc) while `add_many` consumes a generator "
            "of ids that are already recorded (so the returned set is empty and only the "
            "streaming itself is measured). It must not grow with the input.",
            "",
            "| backend | " + " | ".join(f"{s} ids" for s in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        for r in memory:
            lines.append(
                f"| {r.label} | " + " | ".join(f"{v:.1f} MiB" for v in r.memory.values()) + " |"
            )
    return lines


def _targets(results: list[Result]) -> list[str]:
    by_name = {r.backend: r for r in results}
    rows: list[str] = []

    def check(label: str, value: float, goal: float) -> None:
        verdict = "met" if value >= goal else "NOT met"
        rows.append(f"- {label}: {value:.2f}x (target >= {goal}x): {verdict}")

    for name in ("postgres", "redis", "dynamodb"):
        if name in by_name:
            r = by_name[name]
            best = max(r.rates["add_many/1k"], r.rates["add_many/10k"])
            check(f"{name} batch / naive", best / r.rates["naive add loop"], 20)
    if "redis" in by_name and by_name["redis"].native:
        r = by_name["redis"]
        assert r.native is not None
        check(
            "redis add_many / redis-benchmark SET",
            max(r.rates["add_many/1k"], r.rates["add_many/10k"]) / r.native[1],
            0.25,
        )
        check(
            "redis processed_among / redis-benchmark SET",
            max(r.rates["processed_among/1k"], r.rates["processed_among/10k"]) / r.native[1],
            0.5,
        )
    if "postgres" in by_name and by_name["postgres"].native:
        r = by_name["postgres"]
        assert r.native is not None
        check(
            "postgres add_many / raw COPY",
            max(r.rates["add_many/1k"], r.rates["add_many/10k"]) / r.native[1],
            0.3,
        )
    return rows


_OUTBOX_COLUMNS = [label for label, _, _ in OUTBOX_RUNS]


def _best_batch(r: Result, cleanup: Cleanup = "inline") -> float:
    return max(r.outbox[f"batch 100/{cleanup}"], r.outbox[f"batch 1000/{cleanup}"])


def _render_outbox(results: list[Result], args: argparse.Namespace) -> list[str]:
    head = " | ".join(label.replace("/", " ") for label in _OUTBOX_COLUMNS)
    align = "---:|" * len(_OUTBOX_COLUMNS)
    lines = [
        "## Outbox",
        "",
        "`OutboxProcessor` on each backend's entity store and deduplication store (fresh "
        "tables / key prefixes / containers for every run), one thread. Every run has fresh "
        "messages spread at random over a tenth as many fresh entities (about 10 messages "
        f"per entity, in random order; seed {args.seed}); the handler is pure and small "
        "(state: a counter and the last message id; one outgoing message) and the "
        "dispatcher is in memory. `process`: one call per message; `process_batch`: "
        "batches of 100 or 1,000 messages; cleanup `inline` moves each id to the "
        "deduplication store while processing, `deferred` leaves that to `sweep`, which is "
        "timed after the deferred batch-1,000 run (it moves all of that run's ids). Every "
        "run is checked afterwards: each message processed once with one outgoing message, "
        "inline ids in the deduplication store, every id swept.",
        "",
        "PostgreSQL and Redis run in each server configuration:",
        "",
        *(f"- {name}: {CONFIGS[name].description}" for name in args.configs.split(",")),
        "",
        f"| backend | messages (process / batched) | entities per batch (100 / 1000) | {head} "
        "| sweep | best batch / process (inline) | (deferred) |",
        f"|---|---:|---:|{align}---:|---:|---:|",
    ]
    for r in results:
        single, batched = r.outbox_counts
        cells = " | ".join(_fmt(r.outbox[label]) for label in _OUTBOX_COLUMNS)
        spread = " / ".join(
            f"{r.outbox_entities.get(f'batch {size}/inline', 0):,.0f}" for size in (100, 1000)
        )
        lines.append(
            f"| {r.label} | {single:,} / {batched:,} | {spread} | {cells}"
            f" | {_fmt(r.outbox['sweep'])}"
            f" | {_best_batch(r) / r.outbox['process/inline']:,.1f}x"
            f" | {_best_batch(r, 'deferred') / r.outbox['process/deferred']:,.1f}x |"
        )
    lines += [
        "",
        "Rates are messages per second (`sweep`: ids moved per second). Entities per batch: "
        "distinct entities in a batch, on average; a batch loads and saves each once, so "
        "the fewer messages per entity in a batch (the more messages a run spreads over "
        "its entities), the less a batch saves per message.",
        "",
        "### Store calls per message",
        "",
        "Calls of the stores' primitives (entity load and save, deduplication add and "
        "find, and where both stores share a server the joint calls that do the work of "
        "one of each) per message, counted during the timed runs. On PostgreSQL, Redis and "
        "SQLite each is one statement, script call or pipeline: one round trip (one "
        "transaction on SQLite). A DynamoDB or Cosmos entity save sends one request per "
        "entity, and a Cosmos `add_many` one per id, so there they undercount requests.",
        "",
        f"| backend | {head} | sweep (per id, scan not counted) |",
        f"|---|{align}---:|",
    ]
    for r in results:
        cells = " | ".join(f"{r.outbox_calls[label]:.3f}" for label in _OUTBOX_COLUMNS)
        lines.append(f"| {r.label} | {cells} | {r.outbox_calls['sweep']:.3f} |")
    for redis in (r for r in results if r.backend == "redis" and r.redis_requests):
        lines += [
            "",
            f"Requests redis-py sent per message on {redis.label} (a pipeline or a script "
            "call is one request, one round trip): "
            + ", ".join(
                f"{label.replace('/', ' ')} {value:.3f}"
                for label, value in redis.redis_requests.items()
            )
            + ".",
        ]
    compared = [r for r in results if any(args.baseline in t for t in r.trees.values())]
    if compared:
        lines += ["", *_render_trees(compared, args)]
    powertools = [r for r in results if "powertools" in r.outbox]
    if powertools:
        lines += ["", *_render_powertools(powertools, args)]
    lines += ["", "### Targets (outbox, ratios in this run)", ""]
    lines += _outbox_targets(results, args)
    return lines


def _render_trees(results: list[Result], args: argparse.Namespace) -> list[str]:
    base = args.baseline
    lines = [
        f"### This tree against {base}",
        "",
        f"The same runs by the source tree of commit {base} (extracted with `git archive`), "
        "on the same stores (fresh ones for each run, on the same server), each run in a "
        "child process whose `PYTHONPATH` is its tree, the same workload and handler, in "
        "alternating rounds (the two runs of a round back to back); the median round of each, "
        "and as the ratio the median of the rounds' ratios (a slow spell of the shared machine "
        "that spans a round slows both runs of it). On `memory://` the figure is process "
        "CPU time (the processor's Python CPU is all there is to measure, and the machine "
        "is shared); on the servers it is wall-clock time (they do I/O).",
        "",
        f"| backend | run | clock | rounds | this (messages/s) | {base} | "
        f"this, rounds (slowest-fastest) | {base}, rounds | this / {base} |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for label, trees in r.trees.items():
            if base not in trees:
                continue
            this, other = trees["this"], trees[base]
            clock = "CPU" if r.backend == "memory" else "wall"
            lines.append(
                f"| {r.label} | {label.replace('/', ' ')} | {clock} | {len(this.seconds)} "
                f"| {_fmt(this.rate)} | {_fmt(other.rate)} | {this.spread} | {other.spread} "
                f"| {paired(this, other):.2f}x |"
            )
    return lines


def _render_powertools(results: list[Result], args: argparse.Namespace) -> list[str]:
    from importlib.metadata import version

    r = results[0]
    rows = [
        ("powertools `idempotent_function`", "powertools"),
        ("`process`, inline", "process/inline"),
        ("`process`, deferred", "process/deferred"),
        ("`process_batch` 100, inline", "batch 100/inline"),
        ("`process_batch` 1000, inline", "batch 1000/inline"),
        ("`process_batch` 1000, deferred", "batch 1000/deferred"),
    ]
    lines = [
        "### Against aws-lambda-powertools on the same Redis",
        "",
        f"aws-lambda-powertools {version('aws-lambda-powertools')}: `idempotent_function` "
        "with `CachePersistenceLayer` (the new name of `RedisCachePersistenceLayer`, the "
        "same class), given a redis-py client of the same server, "
        "called once per message, one thread, on fresh messages of the `process` workload "
        f"({r.outbox_counts[0]:,} a round), each run in a child process, in the same "
        f"{args.rounds} alternating rounds as this tree's `process` inline and `process_batch` "
        "1000 inline (the rounds against the baseline): its rate is the median of the "
        "`process` rounds, and the ratio of those two runs the median of the rounds' ratios "
        "(a slow spell of the shared machine that spans a round slows both); the other runs "
        "are the single runs above, over that median. The decorated function runs the same "
        "handler (on an empty state: there is none to load) and appends its outgoing "
        'message to a list. Idempotency key: the message id (`event_key_jmespath="id"`); '
        "everything else at powertools' defaults: `expires_after_seconds=3600` (a record "
        "expires after an hour: a redelivery after that runs again), no local cache, md5, "
        "no payload validation. Outside Lambda it needs `config.register_lambda_context()` "
        "to set the in-progress expiry (without it, it warns on every call and an "
        "in-progress record of a crashed call blocks the message until it expires); the "
        "bench registers a fake context with 60 s remaining.",
        "",
        "| Redis | | messages/s | Redis requests / message | / powertools |",
        "|---|---|---:|---:|---:|",
    ]
    for r in results:
        for label, key in rows:
            lines.append(
                f"| {r.config} | {label} | {_fmt(_rate_of(r, key))} "
                f"| {r.redis_requests.get(key, 0):.3f} | {_over_powertools(r, key):.2f}x |"
            )
    lines += [
        "",
        "It guarantees far less: a `SET NX` of an in-progress record, the function, a `SET` "
        "of the result. There is no entity state (the function's state changes and the "
        "record are not written together), no outbox (a crash after the function's side "
        "effects and before the result is saved runs them again once the in-progress "
        "record expires; a crash after the `SET NX` blocks redeliveries until then), and "
        "records expire. The outbox also loads and saves the entity (under its version "
        "token) and keeps the outgoing messages until they are dispatched.",
    ]
    return lines


def _rate_of(r: Result, key: str) -> float:
    """The median of this tree's rounds (against the baseline or powertools) if measured,
    else the single run."""
    return r.trees[key]["this"].rate if key in r.trees else r.outbox[key]


def _over_powertools(r: Result, key: str) -> float:
    """``key``'s rate over powertools': the median of the rounds' ratios where both ran in
    the same rounds, else against the median of powertools' rounds."""
    trees = r.trees.get(key, {})
    if "powertools" in trees:
        return paired(trees["this"], trees["powertools"])
    return _rate_of(r, key) / r.outbox["powertools"]


#: Why a target can be missed, beside the shared machine (said with a missed one).
_HEAVIER_REQUESTS = (
    "`process` makes two requests a message on an entity it kept (the save that checks "
    "the id, the clean-up that records it and saves again; a first message of an entity "
    "also loads it), as many as powertools' `SET NX` and `SET`, but each is a Lua script "
    "(check the record, compare the version, write the entity's hash with its body as an "
    "argument): Redis spends 25 to 35 us on each (`SLOWLOG` on this machine; each "
    "`redis.call` in it 1.5 to 3 us) against about 1 us on a `SET`. Measured around runs "
    "outside this one (Redis' `INFO cpu` and the client's process time, per message): "
    "Redis CPU 165 to 205 us for `process` against 85 to 110 us for powertools on the fast "
    "server (290 to 325 us against 240 to 260 us on the durable one), client CPU 230 to "
    "265 us against 290 to 360 us: the client is the cheaper of the two, the server's "
    "scripts are what is missing"
)


def _outbox_targets(results: list[Result], args: argparse.Namespace) -> list[str]:
    rows: list[str] = []

    def check(label: str, value: float, goal: float, reasons: list[str]) -> None:
        verdict = "met" if value >= goal else "NOT met"
        rows.append(f"- {label}: {value:.2f}x (target >= {goal:g}x): {verdict}")
        if value < goal:
            rows.extend(f"  - {reason}" for reason in reasons)

    for r in results:
        shared = (
            f"the run was on {os.cpu_count()} cores shared by the client, the servers and "
            f"the rest of the machine (1-minute load average {r.load:.1f} after it)"
        )
        if r.backend in SERVERS:
            check(
                f"{r.label} process_batch / process (inline)",
                _best_batch(r) / r.outbox["process/inline"],
                10,
                [shared],
            )
            rows.append(
                f"- {r.label} process_batch / process (deferred, no target): "
                f"{_best_batch(r, 'deferred') / r.outbox['process/deferred']:.2f}x"
            )
        for label, trees in r.trees.items():
            if args.baseline not in trees:
                continue
            this, other = trees["this"], trees[args.baseline]
            name = f"{r.label} {label.replace('/', ' ')}, this / {args.baseline}"
            noise = f"rounds: this {this.spread}, {args.baseline} {other.spread} messages/s"
            check(name, paired(this, other), BASELINE_GOAL, [shared, noise])
        if "powertools" in r.outbox:
            base = r.outbox["powertools"]
            calls = (
                f"requests a message: powertools {r.redis_requests['powertools']:.2f}, "
                f"`process` {r.redis_requests['process/inline']:.2f}, `process_batch` 1000 "
                f"{r.redis_requests['batch 1000/inline']:.3f} (one round trip each"
                + (", each write waiting for its fsync)" if r.config == "durable" else ")")
            )
            per_request = (
                "requests a second: powertools "
                f"{base * r.redis_requests['powertools']:,.0f}, `process` "
                f"{_rate_of(r, 'process/inline') * r.redis_requests['process/inline']:,.0f}; "
                + _HEAVIER_REQUESTS
            )
            for key, goal in (("batch 1000/inline", 10), ("process/inline", 1)):
                paired_runs = r.trees.get(key, {})
                spread = (
                    [
                        f"rounds: this {paired_runs['this'].spread}, powertools "
                        f"{paired_runs['powertools'].spread} messages/s"
                    ]
                    if "powertools" in paired_runs
                    else []
                )
                check(
                    f"{r.label} {key.replace('/', ' ')} / powertools",
                    _over_powertools(r, key),
                    goal,
                    [
                        shared,
                        *spread,
                        calls,
                        *([per_request] if key.startswith("process") else []),
                    ],
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="deduplication stores")
    parser.add_argument("--ids", type=int, default=200_000)
    parser.add_argument("--naive-ids", type=int, default=20_000)
    parser.add_argument("--slow-ids", type=int, default=5_000, help="ids for dynamodb/cosmos")
    parser.add_argument("--memory-sizes", default="100000,1000000")
    parser.add_argument("--memory-backends", default="sqlite,postgres,redis")
    parser.add_argument("--outbox-backends", default=",".join(OUTBOX_BACKENDS))
    parser.add_argument(
        "--outbox-messages", type=int, default=20_000, help="messages per process_batch run"
    )
    parser.add_argument(
        "--outbox-single",
        type=int,
        default=5_000,
        help="messages per process run (and for powertools)",
    )
    parser.add_argument(
        "--outbox-slow", type=int, default=2_000, help="outbox messages for dynamodb/cosmos"
    )
    parser.add_argument("--skip-outbox", action="store_true")
    parser.add_argument("--skip-powertools", action="store_true")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="server configurations of postgres and redis (the first one for the ids tables)",
    )
    parser.add_argument("--baseline", default=BASELINE, help="the commit compared against")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds on servers (baseline, powertools)"
    )
    parser.add_argument("--cpu-rounds", type=int, default=7, help="rounds on memory:// (CPU)")
    parser.add_argument("--seed", type=int, default=20_240_601, help="entity of each message")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"sections to run, comma-separated: {', '.join(SECTIONS)} (only tokens: "
        "its part of --out is replaced, the rest kept)",
    )
    parser.add_argument("--skip-tokens", action="store_true")
    parser.add_argument(
        "--tokens-sizes",
        default="10000,100000,1000000",
        help="checkpoints of the stream of the token section's 'data left' part",
    )
    parser.add_argument("--tokens-batch", type=int, default=1000, help="batch of that stream")
    parser.add_argument(
        "--tokens-layouts",
        default=",".join(tokens_bench.LAYOUTS),
        help="stores of the token section's round trips",
    )
    parser.add_argument(
        "--tokens-single", type=int, default=1_000, help="messages per token-section process run"
    )
    parser.add_argument(
        "--tokens-messages",
        type=int,
        default=20_000,
        help="messages per token-section process_batch run",
    )
    parser.add_argument(
        "--aio-messages",
        type=int,
        default=10_000,
        help="messages per run of the aio section (threads against coroutines)",
    )
    args = parser.parse_args(argv)
    sections = {s for s in args.only.split(",") if s}
    if not sections or sections - set(SECTIONS):
        raise SystemExit(f"--only: choose from {', '.join(SECTIONS)}")
    if args.skip_tokens:
        sections.discard("tokens")
    if "ids" not in sections:
        args.backends = ""
    if "outbox" not in sections:
        args.skip_outbox = True
    sizes = tuple(int(s) for s in args.memory_sizes.split(",") if s)
    dedup_names = [b for b in args.backends.split(",") if b]
    outbox_names = [] if args.skip_outbox else [b for b in args.outbox_backends.split(",") if b]
    unknown = sorted(set(dedup_names + outbox_names) - set(OUTBOX_BACKENDS))
    if unknown:
        raise SystemExit(
            f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(OUTBOX_BACKENDS)}"
        )
    configs = [c for c in args.configs.split(",") if c]
    if not configs or set(configs) - set(CONFIGS):
        raise SystemExit(f"--configs: choose from {', '.join(CONFIGS)}")
    started = time.perf_counter()
    results = []
    with contextlib.ExitStack() as stack:
        baseline = (
            None
            if args.skip_baseline or not outbox_names
            else stack.enter_context(extracted(args.baseline))
        )
        for name in [b for b in OUTBOX_BACKENDS if b in dedup_names or b in outbox_names]:
            for config in configs if name in SERVERS else [""]:
                result = Result(name, config)
                print(f"== {result.label}", file=sys.stderr, flush=True)
                with _backend(name, CONFIGS[config or configs[0]]) as backend:
                    if name in dedup_names and config in ("", configs[0]):
                        _ids_section(result, backend, args, sizes)
                    if name in outbox_names:
                        _outbox_section(result, backend, args)
                        _trees(result, backend, baseline, args)
                        result.load = os.getloadavg()[0]
                print(f"   {result}", file=sys.stderr, flush=True)
                results.append(result)
    tokens = _tokens_section(args, configs[0], argv) if "tokens" in sections else None
    aio = _aio_section(args, configs[0], argv) if "aio" in sections else None
    if sections <= {"tokens", "aio"}:  # only these: their parts replaced, the rest kept
        if tokens is not None:
            tokens_bench.write(tokens, args.out)
        if aio is not None:
            aio_bench.write(aio, args.out)
        print(args.out.read_text(encoding="utf-8"))
        return 0
    kept = (
        _kept_section(args.out, tokens_bench.BEGIN, tokens_bench.END) if tokens is None else tokens
    )
    kept_aio = _kept_section(args.out, aio_bench.BEGIN, aio_bench.END) if aio is None else aio
    # (the drivers' section is run on its own: make bench-drivers)
    kept_drivers = _kept_section(args.out, aio_drivers.BEGIN, aio_drivers.END)
    text = _render(results, args, time.perf_counter() - started)
    args.out.write_text(text, encoding="utf-8")
    if kept:
        tokens_bench.write(kept, args.out)
    if kept_aio:
        aio_bench.write(kept_aio, args.out)
    if kept_drivers:
        aio_drivers.write(kept_drivers, args.out)
    print(args.out.read_text(encoding="utf-8"))
    return 0


def _aio_section(args: argparse.Namespace, config: str, argv: list[str] | None) -> str:
    """Run the async-face section (:mod:`benchmarks.aio_bench`); its Markdown."""
    results, config = aio_bench.run(
        args.aio_messages, CONFIGS[config].redis, CONFIGS[config].postgres, config
    )
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.bench", *given]) if given else "make bench"
    return aio_bench.render(results, args.aio_messages, config, command)


def _tokens_section(args: argparse.Namespace, config: str, argv: list[str] | None) -> str:
    """Run the token-mode section (:mod:`benchmarks.tokens_bench`); its Markdown."""
    results = tokens_bench.run(
        sizes=[int(s) for s in args.tokens_sizes.split(",") if s],
        left_batch=args.tokens_batch,
        layouts=[name for name in args.tokens_layouts.split(",") if name],
        single=args.tokens_single,
        batched=args.tokens_messages,
        seed=args.seed,
        config=config,
        redis=CONFIGS[config].redis,
        postgres=CONFIGS[config].postgres,
    )
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.bench", *given]) if given else "make bench"
    return tokens_bench.render(results, command)


def _kept_section(out: Path, begin: str, end: str) -> str | None:
    """The section of ``out`` between ``begin`` and ``end`` as it is (a run without that
    section keeps it)."""
    text = out.read_text(encoding="utf-8") if out.exists() else ""
    if begin not in text or end not in text:
        return None
    return text[text.index(begin) : text.index(end) + len(end)]


def _ids_section(
    result: Result, backend: Backend, args: argparse.Namespace, sizes: tuple[int, ...]
) -> None:
    """Deduplication ids/s, the server's native rate, peak memory."""
    name, slow = result.backend, result.backend in SLOW
    count = min(args.ids, args.slow_ids) if slow else args.ids
    naive = min(args.naive_ids, count // 10 if slow else count)
    if slow and count < args.ids:
        result.notes.append(
            f"{count:,} ids instead of {args.ids:,}: the emulator serves ~1-2k requests/s"
        )
    _throughput(result, backend.dedup, count, naive)
    if name == "redis":
        result.native = _native_redis(backend.server, args.ids)
    elif name == "postgres":
        result.native = _native_postgres(backend.server, args.ids)
    if name in args.memory_backends.split(","):
        _memory(result, backend.dedup, sizes)


def _outbox_section(result: Result, backend: Backend, args: argparse.Namespace) -> None:
    slow = result.backend in SLOW
    messages = min(args.outbox_messages, args.outbox_slow) if slow else args.outbox_messages
    single = min(args.outbox_single, messages // 5) if slow else args.outbox_single
    if slow and messages < args.outbox_messages:
        result.notes.append(
            f"outbox: {messages:,} messages per batched run and {single:,} per "
            f"process run instead of {args.outbox_messages:,} / "
            f"{args.outbox_single:,} (emulator)"
        )
    _outbox(result, backend, messages, single, args)


if __name__ == "__main__":
    sys.exit(main())
