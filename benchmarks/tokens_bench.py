"""Token mode against retention mode (issue 38): the section ``tokens`` of ``make bench``.

Run alone with ``python -m benchmarks.bench --only tokens`` (it replaces only its own
section of RESULTS.md, between ``BEGIN`` and ``END``). Two parts, in one run:

* **What is left** (:func:`leftovers`): a stream of messages flows A -> B on SQLite
  files, in batches (``process_batch``): A takes the input at the boundary (retention
  mode, a deduplication store of its own) and sends one message per input to B; in
  token mode A subscribes B to them (``subscriptions``), so it mints B's tokens, and
  B consumes them. At each checkpoint (messages through B) the bench counts B's
  deduplication data: its deduplication store's rows (``count()``), the tokens left
  (``TokenStore.outstanding()``), and the bytes of the SQLite file that holds both
  (pages in use, and the file). Before B takes each batch, the tokens A minted and B
  has not consumed yet are counted too (the peak in flight).
* **Round trips and rates** (:func:`round_trips`): ``process`` and ``process_batch``
  (100 and 1,000) of the outbox section's workload, in retention mode and in three
  token modes (``relay``: the input carries a token and the outputs are subscribed,
  the docs' "Round trips" table; ``receive``: a token in, outputs not subscribed;
  ``send``: no token in, outputs subscribed), on stores that share a server (one
  SQLite file; one PostgreSQL; one Redis) and on separate servers (entities on
  PostgreSQL, the deduplication store and the tokens on Redis). Round trips are
  counted by design: calls of the stores' primitives (the entity store's, the
  deduplication store's, joint ones included, and the token store's ``_create``,
  ``_present``, ``_delete``), each one statement, script, pipeline or transaction;
  on Redis the requests redis-py sent are counted as well. Incoming tokens are minted
  before a run (the sender's work, not counted).

Everything counted is deterministic (the workloads' shapes come from a seeded
generator; single thread, so no conflicts); only the rates depend on the machine.
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.cpu_compare import handler as _handler
from benchmarks.cpu_compare import redis_requests
from dedupstore import open_entity_store, open_store, open_token_store
from dedupstore.entities import EntityStore, OutgoingMessage
from dedupstore.outbox import (
    InMemoryDispatcher,
    Message,
    OutboxProcessor,
    Outcome,
    Send,
    message_key,
)
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TOKEN_HEADER, TokenStore, new_nonce, token_id

BEGIN, END = "<!-- tokens-bench -->", "<!-- /tokens-bench -->"

#: (layout, whether its stores share a server, the servers it needs)
LAYOUTS: dict[str, tuple[bool, frozenset[str]]] = {
    "sqlite": (True, frozenset()),
    "sqlite+sqlite": (False, frozenset()),
    "postgres": (True, frozenset({"postgres"})),
    "redis": (True, frozenset({"redis"})),
    "postgres+redis": (False, frozenset({"postgres", "redis"})),
}
LAYOUT_TEXT = {
    "sqlite": (
        "one SQLite file (entities, deduplication store and tokens; the tokens joined, the "
        "deduplication store not)"
    ),
    "sqlite+sqlite": (
        "entities and deduplication store in one SQLite file, tokens in another (nothing joined)"
    ),
    "postgres": "one PostgreSQL server (entities, deduplication store and tokens joined)",
    "redis": "one Redis server (entities, deduplication store and tokens joined)",
    "postgres+redis": "entities on PostgreSQL; deduplication store and tokens on Redis",
}
#: mode -> (the input carries a token, the outputs are subscribed)
MODES: dict[str, tuple[bool, bool]] = {
    "retention": (False, False),
    "token relay": (True, True),
    "token receive": (True, False),
    "token send": (False, True),
}
#: (run label, batch size or None for one ``process`` call per message)
RUNS: tuple[tuple[str, int | None], ...] = (
    ("process", None),
    ("batch 100", 100),
    ("batch 1000", 1000),
)
#: Issue 38's targets for the round trips of token mode against retention mode.
SHARED_RATIO = 1.3
SEPARATE_EXTRA = 3.0
#: The receiving endpoint of the outputs when they are subscribed (nobody consumes
#: those tokens in the round-trip runs: they are the next hop's, in flight).
NEXT_HOP = "shipper"

_ENTITY_PRIMITIVES = (
    "_load",
    "_save",
    "_load_with",
    "_save_unless",
    "_save_with",
    "_load_with_token",
    "_save_tokens",
)
_DEDUP_PRIMITIVES = ("_add_new", "_add_one", "_find", "_contains_one")
_TOKEN_PRIMITIVES = ("_create", "_present", "_delete")
_JOINT = frozenset({"_load_with", "_save_unless", "_save_with"})
#: The joint calls of an entity store and a token store on one server.
_TOKEN_JOINT = frozenset({"_load_with_token", "_save_tokens"})


@dataclass(frozen=True)
class Left:
    """B's deduplication data after ``messages`` went through it, in one mode."""

    mode: str
    messages: int
    dedup_rows: int
    tokens: int
    bytes_in_use: int
    file_bytes: int


@dataclass
class Leftovers:
    """What :func:`leftovers` measured."""

    batch: int
    rows: list[Left] = field(default_factory=list)
    #: mode -> the most tokens in flight (minted by A, not consumed by B yet) seen
    peak: dict[str, int] = field(default_factory=dict)
    #: mode -> seconds of the whole stream (A and B)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Measured:
    """One round-trip run: ``calls`` store requests in all, ``requests`` sent by redis-py
    (None off Redis), over ``messages`` messages in ``batches`` calls."""

    layout: str
    mode: str
    run: str
    messages: int
    batches: int
    calls: int
    seconds: float
    requests: int | None = None
    by_primitive: tuple[tuple[str, int], ...] = ()
    #: The requests of the two minting steps (create the tokens, save them made) a
    #: batch, one each, split by the stores' limits (``TokenStore.max_batch`` tokens a
    #: create, ``EntityStore.max_save_batch`` entities a save): what token relay may add.
    minting: float = 0.0
    #: ``EntityStore.max_save_batch``, ``TokenStore.max_batch`` of the run's stores
    limits: tuple[int, int] = (0, 0)

    @property
    def joined(self) -> bool:
        """Whether the run used the joint calls of an entity and deduplication store."""
        return any(name.split(".")[-1] in _JOINT for name, _ in self.by_primitive)

    @property
    def folded(self) -> bool:
        """Whether the run used the joint calls of an entity and token store."""
        return any(name.split(".")[-1] in _TOKEN_JOINT for name, _ in self.by_primitive)

    @property
    def per_message(self) -> float:
        return self.calls / self.messages

    @property
    def per_batch(self) -> float:
        return self.calls / self.batches

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


@dataclass
class TokenResults:
    """Both parts, with how they were run."""

    left: Leftovers | None = None
    runs: list[Measured] = field(default_factory=list)
    single: int = 0
    batched: int = 0
    config: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------ counting


@contextlib.contextmanager
def counting_calls(
    *stores: tuple[object, tuple[str, ...]],
) -> Iterator[Counter[str]]:
    """Count the primitives ``names`` called on each ``(store, names)`` (outermost
    only; chunks run on other threads count one each): one round trip each."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    inside = threading.local()
    patched: list[tuple[object, str]] = []
    for store, names in stores:
        kind = type(store).__name__
        for name in names:
            original = getattr(store, name, None)
            if original is None:
                continue

            def counted(
                *args: Any, _original: Callable[..., Any] = original, _name: str = f"{kind}.{name}"
            ) -> Any:
                outer = not getattr(inside, "on", False)
                if outer:
                    with lock:
                        counts[_name] += 1
                    inside.on = True
                try:
                    return _original(*args)
                finally:
                    if outer:
                        inside.on = False

            setattr(store, name, counted)
            patched.append((store, name))
    try:
        yield counts
    finally:
        for store, name in patched:
            delattr(store, name)


# ------------------------------------------------------------------ workloads


def timed_outcomes(
    processor: OutboxProcessor, messages: list[Message], batch: int | None
) -> tuple[list[Outcome], float]:
    """Process ``messages`` with the bench's handler, one by one (``batch`` None) or in
    batches of ``batch``: their outcomes, and the seconds it took."""
    started = time.perf_counter()
    if batch is None:
        outcomes = [processor.process(m, _handler).outcome for m in messages]
    else:
        outcomes = [
            r.outcome
            for start in range(0, len(messages), batch)
            for r in processor.process_batch(messages[start : start + batch], _handler)
        ]
    return outcomes, time.perf_counter() - started


def workload(count: int, seed: int) -> list[Message]:
    """``count`` fresh messages over ``count // 10`` fresh entities, the entity of each
    drawn by ``random.Random(seed)``: two runs of one seed have the same shape (the
    same first loads and kept entities), so their counts compare exactly."""
    rng = random.Random(seed)
    entities = [f"order-{uuid.uuid4()}" for _ in range(max(1, count // 10))]
    return [Message(str(uuid.uuid4()), rng.choice(entities), {"amount": i}) for i in range(count)]


def receiver_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """B's handler in the stream: a counter; no outputs (the end of the chain)."""
    return {"count": int(state.get("count", 0)) + 1}, []


def delivered(out: OutgoingMessage) -> Message:
    """What B receives for A's output ``out`` (its entity: ``b-<order>``)."""
    return Message(out.id, f"b-{out.body['order']}", out.body, dict(out.headers))


def _sqlite_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the pages in use, bytes of the file and its WAL) of a SQLite file."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    files = [path, path.with_name(path.name + "-wal")]
    return (pages - free) * page, sum(p.stat().st_size for p in files if p.exists())


# ------------------------------------------------------------------ part (a)


def leftovers(
    sizes: Sequence[int], batch: int, seed: int, log: Callable[[str], None] = print
) -> Leftovers:
    """Stream ``max(sizes)`` messages A -> B in each mode; B's data at each size."""
    result = Leftovers(batch)
    total = max(sizes)
    for mode in ("retention", "token"):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            _stream(result, Path(tmp), mode, sorted(sizes), total, batch, seed, log)
            result.seconds[mode] = time.perf_counter() - started
    return result


def _stream(
    result: Leftovers,
    tmp: Path,
    mode: str,
    sizes: list[int],
    total: int,
    batch: int,
    seed: int,
    log: Callable[[str], None],
) -> None:
    token_mode = mode == "token"
    data = tmp / "b-dedup.db"  # B's deduplication store and the tokens: B's dedup data
    with contextlib.ExitStack() as stack:
        a_entities = stack.enter_context(open_entity_store(f"sqlite:///{tmp}/a-entities.db"))
        a_dedup = stack.enter_context(open_store(f"sqlite:///{tmp}/a-dedup.db", endpoint="A"))
        b_entities = stack.enter_context(open_entity_store(f"sqlite:///{tmp}/b-entities.db"))
        b_dedup = stack.enter_context(open_store(f"sqlite:///{data}", endpoint="B"))
        tokens = stack.enter_context(open_token_store(f"sqlite:///{data}")) if token_mode else None
        a_out = InMemoryDispatcher()
        a = OutboxProcessor(
            a_entities,
            a_dedup,
            a_out,
            tokens=tokens,
            subscriptions={"shipping": ["B"]} if token_mode else None,
        )
        b = OutboxProcessor(b_entities, b_dedup, InMemoryDispatcher(), tokens=tokens)
        rng = random.Random(seed)
        entities = [f"order-{uuid.uuid4()}" for _ in range(max(1, total // 10))]
        peak, done, checkpoints = 0, 0, list(sizes)
        while done < total:
            size = min(batch, total - done)
            messages = [
                Message(str(uuid.uuid4()), rng.choice(entities), {"amount": done + i})
                for i in range(size)
            ]
            outcomes = [r.outcome for r in a.process_batch(messages, _handler)]
            sent = list(a_out.sent)
            a_out.sent.clear()
            if tokens is not None:
                peak = max(peak, _outstanding(tokens, "B"))
            to_b = [delivered(m) for m in sent]
            if token_mode and not all(TOKEN_HEADER in m.headers for m in to_b):
                raise SystemExit("tokens: A sent a message to B without a token")
            outcomes += [r.outcome for r in b.process_batch(to_b, receiver_handler)]
            if outcomes.count("processed") != 2 * size or len(to_b) != size:
                raise SystemExit(f"tokens ({mode}): not every message was processed once")
            done += size
            if checkpoints and done >= checkpoints[0]:
                checkpoints.pop(0)
                in_use, file_bytes = _sqlite_bytes(data)
                rows = b_dedup.count() or 0
                left = _outstanding(tokens, "B") if tokens is not None else 0
                result.rows.append(Left(mode, done, rows, left, in_use, file_bytes))
                log(f"   tokens left ({mode}) after {done:,}: {rows:,} rows, {left:,} tokens")
        if token_mode:
            if tokens is not None and tokens.outstanding():
                raise SystemExit(f"tokens: left after the drain: {tokens.outstanding()}")
            if b_dedup.count():
                raise SystemExit("tokens: B recorded ids in token mode")
        elif b_dedup.count() != total:
            raise SystemExit("tokens: B's deduplication store misses ids")
        result.peak[mode] = peak


def _outstanding(tokens: TokenStore, endpoint: str) -> int:
    count = tokens.outstanding().get(endpoint)
    return 0 if count is None else count.outstanding


# ------------------------------------------------------------------ part (b)


@dataclass(frozen=True)
class Servers:
    """URLs of the running servers (None: not started)."""

    postgres: str | None = None
    redis: str | None = None


def _stores(
    layout: str, servers: Servers, tmp: Path
) -> tuple[EntityStore, DeduplicationStore, TokenStore]:
    """Fresh stores of ``layout`` (new tables, key prefixes or file)."""
    tag = uuid.uuid4().hex[:10]
    if layout == "sqlite":
        url = f"sqlite:///{tmp}/rt-{tag}.db"
        return open_entity_store(url), open_store(url), open_token_store(url)
    if layout == "sqlite+sqlite":
        url = f"sqlite:///{tmp}/rt-{tag}.db"
        return open_entity_store(url), open_store(url), open_token_store(f"{url[:-3]}-tk.db")
    pg, redis = servers.postgres, servers.redis
    if layout == "postgres" and pg:
        return (
            open_entity_store(pg, table=f"ent_{tag}", create=True),
            open_store(pg, table=f"dedup_{tag}", create=True),
            open_token_store(pg, table=f"tok_{tag}", create=True),
        )
    if layout == "redis" and redis:
        return (
            open_entity_store(redis, key_prefix=f"ent{tag}:"),
            open_store(redis, key_prefix=f"dd{tag}:"),
            open_token_store(redis, key_prefix=f"tk{tag}:"),
        )
    if layout == "postgres+redis" and pg and redis:
        return (
            open_entity_store(pg, table=f"ent_{tag}", create=True),
            open_store(redis, key_prefix=f"dd{tag}:"),
            open_token_store(redis, key_prefix=f"tk{tag}:"),
        )
    raise SystemExit(f"tokens: layout {layout!r} needs servers it was not given")


def measure(
    layout: str, servers: Servers, tmp: Path, mode: str, run: str, count: int, seed: int
) -> Measured:
    """One run on fresh stores: count its round trips, time it, check it."""
    incoming, subscribed = MODES[mode]
    batch = dict(RUNS)[run]
    messages = workload(count, seed)
    entities, dedup, tokens = _stores(layout, servers, tmp)
    with entities, dedup, tokens:
        consumer = dedup.endpoint
        if incoming:  # minted by the sender, before the run (not counted)
            nonces = [new_nonce() for _ in messages]
            messages = [
                Message(m.id, m.correlation_id, m.body, {TOKEN_HEADER: n})
                for m, n in zip(messages, nonces, strict=True)
            ]
            pairs = zip(messages, nonces, strict=True)
            tokens.create({token_id(m.id, consumer, n): consumer for m, n in pairs})
        dispatcher = InMemoryDispatcher()
        processor = OutboxProcessor(
            entities,
            dedup,
            dispatcher,
            tokens=tokens if incoming or subscribed else None,
            subscriptions={"shipping": [NEXT_HOP]} if subscribed else None,
        )
        on_redis = "redis" in layout
        with (
            counting_calls(
                (entities, _ENTITY_PRIMITIVES),
                (dedup, _DEDUP_PRIMITIVES),
                (tokens, _TOKEN_PRIMITIVES),
            ) as calls,
            redis_requests(on_redis) as sent,
        ):
            outcomes, seconds = timed_outcomes(processor, messages, batch)
        _check(layout, mode, run, messages, outcomes, dispatcher, dedup, tokens)
    size = batch or 1
    chunks = [messages[start : start + size] for start in range(0, count, size)]
    save_limit, token_limit = entities.max_save_batch, tokens.max_batch
    minting = sum(
        -(-len(c) // token_limit) + -(-len({m.correlation_id for m in c}) // save_limit)
        for c in chunks
    )
    return Measured(
        layout,
        mode,
        run,
        count,
        len(chunks),
        sum(calls.values()),
        seconds,
        sent[0] if on_redis else None,
        tuple(sorted(calls.items())),
        minting / len(chunks),
        (save_limit, token_limit),
    )


def _check(
    layout: str,
    mode: str,
    run: str,
    messages: list[Message],
    outcomes: Sequence[str],
    dispatcher: InMemoryDispatcher,
    dedup: DeduplicationStore,
    tokens: TokenStore,
) -> None:
    """Each message processed once; its token consumed (or its id recorded); the
    outputs' tokens left for the next hop, one each, and nothing else."""
    incoming, subscribed = MODES[mode]
    count, where = len(messages), f"tokens {layout} {mode} {run}"
    if outcomes.count("processed") != count or len(dispatcher.sent) != count:
        raise SystemExit(f"{where}: not every message was processed once")
    stamped = sum(TOKEN_HEADER in m.headers for m in dispatcher.sent)
    if stamped != (count if subscribed else 0):
        raise SystemExit(f"{where}: {stamped} outputs carry a token")
    keys = [message_key(m.correlation_id, m.id) for m in messages]
    recorded = len(dedup.processed_among(keys))
    if recorded != (0 if incoming else count):
        raise SystemExit(f"{where}: {recorded} ids in the deduplication store")
    left = {e: c.outstanding for e, c in tokens.outstanding().items()}
    if left != ({NEXT_HOP: count} if subscribed else {}):
        raise SystemExit(f"{where}: tokens left {left}")


def round_trips(
    layouts: Sequence[str],
    servers: Servers,
    single: int,
    batched: int,
    seed: int,
    log: Callable[[str], None] = print,
) -> list[Measured]:
    """Every mode and run on every layout."""
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            # a warm-up run, not recorded: connections, tables, imports
            measure(layout, servers, Path(tmp), "token relay", "process", 50, seed)
            for mode in MODES:
                for run, batch in RUNS:
                    count = single if batch is None else batched
                    log(f"   tokens {layout} {mode} {run}: {count:,} messages")
                    measured.append(measure(layout, servers, Path(tmp), mode, run, count, seed))
    return measured


# ------------------------------------------------------------------ running


@contextlib.contextmanager
def _servers(
    layouts: Sequence[str], redis: dict[str, Any], postgres: dict[str, Any]
) -> Iterator[Servers]:
    needed = set().union(*(LAYOUTS[name][1] for name in layouts)) if layouts else set()
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        if "postgres" in needed:
            from tests.servers import PostgresServer

            urls["postgres"] = stack.enter_context(PostgresServer(**postgres)).url
        if "redis" in needed:
            from tests.servers import RedisServer

            urls["redis"] = stack.enter_context(RedisServer(**redis)).url
        yield Servers(urls.get("postgres"), urls.get("redis"))


def run(
    *,
    sizes: Sequence[int],
    left_batch: int,
    layouts: Sequence[str],
    single: int,
    batched: int,
    seed: int,
    config: str = "",
    redis: dict[str, Any] | None = None,
    postgres: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> TokenResults:
    """Both parts (``sizes`` empty: no leftovers; ``layouts`` empty: no round trips)."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--tokens-layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    started = time.perf_counter()
    results = TokenResults(single=single, batched=batched, config=config)
    if sizes:
        say("== tokens: what is left")
        results.left = leftovers(sizes, left_batch, seed, say)
    if layouts:
        say("== tokens: round trips")
        with _servers(layouts, redis or {}, postgres or {}) as servers:
            results.runs = round_trips(layouts, servers, single, batched, seed, say)
    results.seconds = time.perf_counter() - started
    return results


# ------------------------------------------------------------------ rendering


def _find(runs: Sequence[Measured], layout: str, mode: str, run: str) -> Measured | None:
    return next((m for m in runs if m.layout == layout and m.mode == mode and m.run == run), None)


def render(results: TokenResults, command: str) -> str:
    """The section (between ``BEGIN`` and ``END``)."""
    lines = [
        BEGIN,
        "## Token mode against retention mode",
        "",
        f"Measured by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, in one run of {results.seconds:,.0f} s "
        "(`benchmarks/tokens_bench.py`; alone: `python -m benchmarks.bench --only tokens`, "
        "which replaces only this section).",
    ]
    if results.left is not None:
        lines += ["", *_render_left(results.left)]
    if results.runs:
        lines += ["", *_render_runs(results)]
    lines.append(END)
    return "\n".join(lines)


def _render_left(left: Leftovers) -> list[str]:
    sizes = sorted({r.messages for r in left.rows})
    lines = [
        "### Deduplication data left",
        "",
        "One stream of messages A -> B on SQLite files, each side `process_batch` in "
        f"batches of {left.batch:,} (A a batch, then B the batch A sent; one thread), "
        "counted at each checkpoint once B has taken that many messages. A takes the "
        "input at the boundary in retention mode (its own deduplication store, in a file "
        "not counted here: the same in both modes) and sends one message per input to "
        "B; in token mode A subscribes B (`subscriptions`), so A mints one token per "
        "message and B consumes it. Counted: B's deduplication store rows (`count()`), "
        "the tokens left (`TokenStore.outstanding()`), and the SQLite file holding both "
        "(pages in use, and the file with its WAL: SQLite keeps freed pages for reuse, so "
        "the file stays at its peak). Retention mode keeps every id (a retention longer "
        "than the run); token mode keeps only what is in flight, and nothing once B has "
        "taken every message. The stream is checked: every message processed once by A "
        "and by B, every message to B carries a token, nothing left after the drain.",
        "",
        "| messages through B | mode | dedup rows | tokens left | bytes in use | file bytes |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for size in sizes:
        for row in (r for r in left.rows if r.messages == size):
            lines.append(
                f"| {size:,} | {row.mode} | {row.dedup_rows:,} | {row.tokens:,} "
                f"| {row.bytes_in_use:,} | {row.file_bytes:,} |"
            )
    peak = left.peak.get("token", 0)
    lines += [
        "",
        f"Tokens in flight (minted by A, not yet consumed by B), at most {peak:,} over the "
        f"stream (counted before B took each batch: one batch of A's output). Seconds for "
        "the whole stream (A and B): "
        + ", ".join(f"{mode} {seconds:,.0f}" for mode, seconds in left.seconds.items())
        + ".",
    ]
    return lines


def _render_runs(results: TokenResults) -> list[str]:
    runs = results.runs
    layouts = list(dict.fromkeys(m.layout for m in runs))
    lines = [
        "### Round trips and rates",
        "",
        f"The outbox section's workload (fresh messages over a tenth as many entities, "
        f"about 10 per entity, the same shape in every mode), `process` on {results.single:,} "
        f"messages and `process_batch` of 100 and 1,000 on {results.batched:,}, inline "
        "clean-up, the default entity cache (an entity's later messages skip its load: "
        "0.1 load a message), fresh stores for every run, one thread"
        + (f"; servers in the `{results.config}` configuration" if results.config else "")
        + ". Layouts:",
        "",
        *(f"- {name}: {LAYOUT_TEXT[name]}" for name in layouts),
        "",
        "Modes: `retention` (no token store); `token relay` (the input carries a token, "
        f"the output is subscribed: one token minted for `{NEXT_HOP}`; the docs' "
        '"Round trips" table); `token receive` (a token in, the output not subscribed); '
        "`token send` (no token in, the output subscribed). Round trips: calls of the "
        "stores' primitives, each one statement, script, pipeline or transaction (entity "
        "load and save, deduplication add and find, the joint calls of joined stores (with "
        "the deduplication store, or with the token store: the load that reads the token, "
        "the save that creates and deletes tokens), token create, read and delete). The "
        "incoming tokens are minted before each run (the "
        "sender's work). Every run is checked: each message processed once, its token "
        "consumed or its id recorded, one token left per subscribed output.",
        "",
        "| layout | mode | process: round trips / message | batch 100: / batch "
        "| batch 1000: / batch | process msg/s | batch 100 msg/s | batch 1000 msg/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in layouts:
        for mode in MODES:
            p, b1, b2 = (_find(runs, layout, mode, run) for run, _ in RUNS)
            if p is None or b1 is None or b2 is None:
                continue
            lines.append(
                f"| {layout} | {mode} | {p.per_message:.3f} | {b1.per_batch:.2f} "
                f"| {b2.per_batch:.2f} | {p.rate:,.0f} | {b1.rate:,.0f} | {b2.rate:,.0f} |"
            )
    redis = [m for m in runs if m.requests is not None]
    if redis:
        lines += [
            "",
            "Requests redis-py sent (a pipeline, transaction or script call is one; per "
            "message for `process`, per batch otherwise): "
            + "; ".join(
                f"{m.layout} {m.mode} {m.run} "
                f"{(m.requests or 0) / (m.messages if m.run == 'process' else m.batches):.2f}"
                for m in redis
            )
            + ".",
        ]
    lines += ["", "Token mode over retention mode, same layout and run:", ""]
    lines += [
        "| layout | mode | process: round trips ratio (extra / message) | batch 100: ratio "
        "(extra / batch) | batch 1000: ratio (extra / batch) | process: msg/s ratio "
        "| batch 1000: msg/s ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for layout in layouts:
        base = {run: _find(runs, layout, "retention", run) for run, _ in RUNS}
        for mode in (m for m in MODES if m != "retention"):
            this = {run: _find(runs, layout, mode, run) for run, _ in RUNS}
            if any(v is None for v in [*base.values(), *this.values()]):
                continue
            cells = []
            for run, batch in RUNS:
                t, r = this[run], base[run]
                assert t is not None and r is not None
                extra = (
                    t.per_message - r.per_message if batch is None else t.per_batch - r.per_batch
                )
                cells.append(f"{t.calls / r.calls:.2f}x ({extra:+.2f})")
            p, bp = this["process"], base["process"]
            q, bq = this["batch 1000"], base["batch 1000"]
            assert p is not None and bp is not None and q is not None and bq is not None
            lines.append(
                f"| {layout} | {mode} | {' | '.join(cells)} | {p.rate / bp.rate:.2f}x "
                f"| {q.rate / bq.rate:.2f}x |"
            )
    lines += ["", "#### Targets (issue 38, round trips counted in this run)", ""]
    lines += targets(runs)
    return lines


_NOT_FOLDED = (
    "not folded: the token store does not share the entity store's connection, so the "
    "token read is a request of its own beside the load, the create and the save that "
    "marks the nonce made are two more, the delete one more beside the save that removes "
    "the entry"
)
_FOLDED_YET_MORE = (
    "folded, and still more requests than retention mode's: the joint requests of this "
    "layout do not cover every step"
)
_NOT_JOINED = (
    "and a message with a token leaves the joined path: retention mode here checks the "
    "id within the entity's save and records it within the clean-up's save (the joint "
    "requests of stores on one server), token mode asks the token store on its own"
)


def targets(runs: Sequence[Measured]) -> list[str]:
    """Each target of issue 38 on each layout, met or not, with the reason."""
    rows: list[str] = []
    layouts = list(dict.fromkeys(m.layout for m in runs))

    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    for layout in layouts:
        shared = LAYOUTS[layout][0]
        base = {run: _find(runs, layout, "retention", run) for run, _ in RUNS}
        relay = {run: _find(runs, layout, "token relay", run) for run, _ in RUNS}
        for run, _batch in RUNS:
            t, r = relay[run], base[run]
            if t is None or r is None:
                continue
            if shared:
                ratio = t.calls / r.calls
                rows.append(
                    f"- {layout} (shared) token relay / retention, {run}: {ratio:.2f}x the "
                    f"round trips (target <= {SHARED_RATIO:g}x): {verdict(ratio <= SHARED_RATIO)}"
                )
                if ratio > SHARED_RATIO and not t.folded:
                    rows.append(f"  - {_NOT_FOLDED}" + (f", {_NOT_JOINED}" if r.joined else ""))
                elif ratio > SHARED_RATIO:
                    rows.append(f"  - {_FOLDED_YET_MORE}")
            else:
                extra = t.per_message - r.per_message
                rows.append(
                    f"- {layout} (separate) token relay - retention, {run}: {extra:+.3f} round "
                    f"trips a message (target <= +{SEPARATE_EXTRA:g}): "
                    f"{verdict(extra <= SEPARATE_EXTRA)}"
                )
        batched = [(relay[run], base[run]) for run, batch in RUNS if batch is not None]
        if any(t is None or r is None for t, r in batched):
            continue
        parts, met = [], True
        for t, r in batched:
            assert t is not None and r is not None
            extra = t.per_batch - r.per_batch
            met = met and extra <= t.minting + 1e-9
            size = t.messages / t.batches
            parts.append(
                f"{extra:+.2f} a batch of {size:,.0f} ({extra / size:+.4f} a message; "
                f"its two minting steps: {t.minting:.2f} requests)"
            )
        save_limit, token_limit = batched[-1][0].limits if batched[-1][0] else (0, 0)
        rows.append(
            f"- {layout} batches keep their per-batch round trips: token relay adds "
            + " and ".join(parts)
            + f" (target: no more than one request per step a batch, split only by the "
            f"stores' limits, {save_limit:,} entities a save and {token_limit:,} tokens a "
            f"call): {verdict(met)}"
        )
    return rows


def write(section: str, out: Path) -> None:
    """Replace (or add) this section of ``out``, leaving the rest as it is: before the
    Spark section if there is one, else at the end."""
    text = out.read_text(encoding="utf-8") if out.exists() else "# Benchmark results\n"
    if BEGIN in text and END in text:
        head, tail = text[: text.index(BEGIN)], text[text.index(END) + len(END) :]
        text = head + section + tail
    elif "<!-- spark-bench -->" in text:
        at = text.index("<!-- spark-bench -->")
        text = text[:at] + section + "\n\n" + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text, encoding="utf-8")
