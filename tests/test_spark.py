"""The Spark integration on real Spark and real stores.

Engines (see ``tests/spark_fixtures.py``): ``local`` (``local[2,3]``), ``connect``
(a Spark Connect server started by the harness) and ``cluster``
(``local-cluster[2,1,1024]``: separate executor JVMs and Python workers). The
pipeline, the sweep and ``drop_processed`` run on all three; the backend matrix,
failures, streaming and the jobs run on ``local``.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import pytest

import dedupstore
from dedupstore.backends.sqlite import SqliteDeduplicationStore
from dedupstore.errors import ConfigurationError
from dedupstore.ids import message_key
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send
from dedupstore.spark import drop_processed, process_messages, process_stream, sweep_outboxes
from dedupstore.spark._clients import ClientSpec, TaskClients
from dedupstore.spark._drop import _processed_flags
from dedupstore.spark.order_pipeline import INPUT_SCHEMA, FlakyDispatcher, Settings, run
from dedupstore.spark.orders import PRICES, expected_outgoing, handle_order, make_workload
from tests.outbox_backends import OutboxBackend
from tests.spark_fixtures import TEST_AWS_ENV

EMULATORS = ("dynamodb", "cosmos")


def _pairs(pairs: list[tuple[str, str]]) -> list[Any]:
    return [
        pytest.param(engine, backend, marks=getattr(pytest.mark, backend), id=f"{engine}-{backend}")
        for engine, backend in pairs
    ]


PIPELINE_PAIRS = _pairs(
    [
        ("local", "sqlite"),
        ("local", "postgres"),
        ("local", "redis"),
        ("local", "dynamodb"),
        ("local", "cosmos"),
        ("connect", "sqlite"),
        ("connect", "redis"),
        ("cluster", "sqlite"),
        ("cluster", "postgres"),
    ]
)
ENGINE_PAIRS = _pairs(
    [("local", "sqlite"), ("local", "redis"), ("connect", "sqlite"), ("cluster", "redis")]
)
LOCAL_SERVERS = _pairs([("local", "sqlite"), ("local", "postgres"), ("local", "redis")])


# ---------------------------------------------------------------------- helpers


def _workload(backend: OutboxBackend, orders: int = 40) -> tuple[list[dict[str, Any]], list[Any]]:
    """(commands, delivered rows) with ids unique to this test."""
    workload = make_workload(orders if backend.name not in EMULATORS else 12, seed=orders)
    tag = uuid.uuid4().hex[:8]

    def tagged(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "id": f"{tag}/{row['id']}", "order_id": f"{tag}/{row['order_id']}"}

    commands = [tagged(r) for r in workload.commands]
    delivered = [tagged(r) for r in workload.delivered]
    rows = [(r["id"], r["order_id"], r["seq"], r["type"], r["sku"], r["qty"]) for r in delivered]
    return commands, rows


def _urls(backend: OutboxBackend) -> dict[str, Any]:
    return {
        "entities_url": backend.entities_url,
        "dedup_url": backend.dedup_url,
        "entities_options": backend.options,
        "dedup_options": backend.options,
    }


def _outcomes(results: Any) -> Counter[str]:
    return Counter({r["outcome"]: r["count"] for r in results.groupBy("outcome").count().collect()})


def _sweep(spark: Any, backend: OutboxBackend, segments: int = 3, **kw: Any) -> dict[str, int]:
    result = sweep_outboxes(
        spark,
        backend.entities_url,
        backend.dedup_url,
        segments=segments,
        entities_options=backend.options,
        dedup_options=backend.options,
        **kw,
    )
    rows = result.collect()
    assert [r["segment"] for r in rows] == list(range(segments))
    keys = ("entities_scanned", "ids_moved", "redispatched", "ids_left")
    return {k: sum(r[k] for r in rows) for k in keys}


def _assert_exactly_once(
    backend: OutboxBackend, commands: list[dict[str, Any]], queue_url: str, *, swept: bool
) -> None:
    """Each command applied once, the outgoing queue is the expected set, ids where they belong."""
    orders = sorted({c["order_id"] for c in commands})
    with backend.entities() as entities:
        found = entities.load_many(orders)
    applied = Counter(mid for e in found.values() for mid in e.state.get("applied", []))
    assert applied == Counter(c["id"] for c in commands)
    with dedupstore.open_dispatcher(queue_url) as queue:
        stored = list(queue.messages())  # type: ignore[attr-defined]
    prefix = commands[0]["id"].split("/")[0] + "/"
    ours = [m for m in stored if m.message.id and m.message.headers["source"].startswith(prefix)]
    assert {m.message.id for m in ours} == set(expected_outgoing(commands))
    assert sum(m.mismatches for m in ours) == 0
    keys = [message_key(c["order_id"], c["id"]) for c in commands]
    with backend.dedup() as dedup:
        recorded = dedup.processed_among(keys)
    in_outbox = {message_key(e.id, mid) for e in found.values() for mid in e.outbox}
    assert set(keys) <= recorded | in_outbox  # every processed message is in one of the two
    if swept:
        assert recorded == set(keys)
        assert not in_outbox


# ---------------------------------------------------------------------- on every engine


@pytest.mark.parametrize(("spark", "outbox_backend"), PIPELINE_PAIRS, indirect=True)
def test_process_sweep_replay_drop_exactly_once(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """The whole pipeline: process, sweep, replay everything, drop processed; nothing doubles."""
    commands, rows = _workload(outbox_backend)
    queue = f"sqlite:///{tmp_path}/outgoing.db"
    df = spark.createDataFrame(rows, INPUT_SCHEMA)
    args: dict[str, Any] = {
        "dispatcher_url": queue,
        "correlation_col": "order_id",
        "order_col": "seq",
        "batch_size": 25,
        **_urls(outbox_backend),
    }
    first = _outcomes(process_messages(df, handle_order, **args))
    assert first == Counter({"processed": len(commands), "duplicate": len(rows) - len(commands)})
    _assert_exactly_once(outbox_backend, commands, queue, swept=False)

    swept = _sweep(spark, outbox_backend)
    assert swept["ids_moved"] == len(commands) and swept["ids_left"] == 0
    _assert_exactly_once(outbox_backend, commands, queue, swept=True)

    replay = _outcomes(process_messages(df, handle_order, **args))
    assert replay == Counter({"duplicate": len(rows)})
    assert _sweep(spark, outbox_backend)["ids_moved"] == 0
    _assert_exactly_once(outbox_backend, commands, queue, swept=True)

    pairs = df.select("id", "order_id")
    dropped = drop_processed(
        pairs, outbox_backend.dedup_url, "id", "order_id", dedup_options=outbox_backend.options
    )
    assert dropped.count() == 0


@pytest.mark.parametrize(("spark", "outbox_backend"), ENGINE_PAIRS, indirect=True)
def test_drop_processed_keeps_exactly_the_new_rows(
    spark: Any, outbox_backend: OutboxBackend
) -> None:
    """Keys of (entity, id), ids of any accepted type: here bigint ids of timestamp entities."""
    base = uuid.uuid4().int % 10**12 * 1000
    days = [dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(days=d) for d in range(3)]
    rows = [(base + n, days[n % 3], n) for n in range(300)]
    entity = {d: d.strftime("%Y-%m-%dT%H:%M:%S.%fZ") for d in days}
    with outbox_backend.dedup() as dedup:
        dedup.add_many([message_key(entity[d], str(i)) for i, d, n in rows if n % 3 == 0])
        # the bare id, or the id under another entity, is another message
        dedup.add_many([str(i) for i, d, n in rows if n % 3 == 1])
        dedup.add_many([message_key(entity[days[0]], str(i)) for i, d, n in rows if n % 3 == 2])
    df = spark.createDataFrame(rows, "msg bigint, day timestamp, n int")
    kept = drop_processed(
        df, outbox_backend.dedup_url, "msg", "day", dedup_options=outbox_backend.options
    )
    assert kept.columns == ["msg", "day", "n"]
    assert sorted(r["n"] for r in kept.collect()) == [n for n in range(300) if n % 3]


def _seed(
    backend: OutboxBackend, entities: int, per_entity: int, *, fail_dispatch: bool
) -> list[str]:
    """Entities whose outboxes hold dispatched entries (or pending ones when dispatch fails)."""

    class Refusing:
        def dispatch(self, messages: Any) -> None:
            raise RuntimeError("broker down")

    tag = uuid.uuid4().hex[:6]
    messages = [
        Message(f"{tag}-m{e}-{k}", f"{tag}-e{e}", {"n": k})
        for e in range(entities)
        for k in range(per_entity)
    ]

    def count(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        state["n"] = state.get("n", 0) + 1
        return state, [Send("counted", {"id": message.id})]

    dispatcher = Refusing() if fail_dispatch else InMemoryDispatcher()
    with backend.entities() as ents, backend.dedup() as dedup:
        processor = OutboxProcessor(ents, dedup, dispatcher, cleanup="deferred")  # type: ignore[arg-type]
        for start in range(0, len(messages), 200):
            try:
                processor.process_batch(messages[start : start + 200], count)
            except RuntimeError:
                assert fail_dispatch
    return [message_key(m.correlation_id, m.id) for m in messages]  # what the store records


@pytest.mark.parametrize(("spark", "outbox_backend"), ENGINE_PAIRS, indirect=True)
def test_sweep_relays_pending_entries_then_moves_them(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    ids = _seed(outbox_backend, 30, 3, fail_dispatch=True)
    queue = f"sqlite:///{tmp_path}/relay.db"
    done = _sweep(spark, outbox_backend, segments=4, redispatch_url=queue)
    assert done["redispatched"] == len(ids) and done["ids_moved"] == len(ids)
    with dedupstore.open_dispatcher(queue) as relay:
        assert relay.stats().rows == len(ids)  # type: ignore[attr-defined]
    with outbox_backend.dedup() as dedup:
        assert dedup.processed_among(ids) == set(ids)
    with outbox_backend.entities() as ents:
        assert list(ents.pending_outboxes()) == []


# ---------------------------------------------------------------------- local only


@pytest.mark.parametrize(("spark", "outbox_backend"), LOCAL_SERVERS, indirect=True)
def test_sweeps_twice_at_once_beside_live_consumers(
    spark: Any, outbox_backend: OutboxBackend
) -> None:
    """Two sweeps at once while a consumer keeps processing; then one more sweep moves the rest."""
    seeded = _seed(outbox_backend, 60, 4, fail_dispatch=False)
    entity_ids = sorted({key.split(":")[1] for key in seeded})  # keys "<n>:<entity>:<id>"
    live_ids: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def consumer() -> None:
        try:
            with outbox_backend.entities() as ents, outbox_backend.dedup() as dedup:
                processor = OutboxProcessor(ents, dedup, InMemoryDispatcher(), cleanup="deferred")
                n = 0
                while not stop.is_set() or n < 20:
                    mid = f"live-{uuid.uuid4().hex[:6]}-{n}"
                    # the same entities the sweeps are cleaning: conflicts on both sides
                    eid = entity_ids[n % len(entity_ids)]
                    processor.process(Message(mid, eid, {}), handle_live)
                    live_ids.append(message_key(eid, mid))
                    n += 1
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=consumer)
    worker.start()
    results: list[dict[str, int]] = []
    sweeps = [
        threading.Thread(target=lambda: results.append(_sweep(spark, outbox_backend, segments=3)))
        for _ in range(2)
    ]
    for t in sweeps:
        t.start()
    for t in sweeps:
        t.join()
    stop.set()
    worker.join()
    assert not errors
    assert len(results) == 2
    _sweep(spark, outbox_backend, segments=2)
    everything = seeded + live_ids
    with outbox_backend.dedup() as dedup:
        assert dedup.processed_among(everything) == set(everything)
    with outbox_backend.entities() as ents:
        assert list(ents.pending_outboxes()) == []


def handle_live(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    state["live"] = state.get("live", 0) + 1
    return state, [Send("live", {"id": message.id})]


@pytest.mark.parametrize(("spark", "outbox_backend"), LOCAL_SERVERS, indirect=True)
@pytest.mark.parametrize("cleanup", ["deferred", "inline"])
def test_a_killed_task_is_retried_and_a_rerun_changes_nothing(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path, cleanup: str
) -> None:
    """Every batch crashes after dispatching; the first crash kills its Python worker."""
    commands, rows = _workload(outbox_backend, orders=60)
    queue = f"sqlite:///{tmp_path}/outgoing.db"
    marker = tmp_path / "killed"
    flaky = FlakyDispatcher(queue, fail=0.0, crash=1.0, kill_marker=str(marker), seed=1)
    df = spark.createDataFrame(rows, INPUT_SCHEMA)
    args: dict[str, Any] = {
        "correlation_col": "order_id",
        "order_col": "seq",
        "batch_size": 20,
        "cleanup": cleanup,
        **_urls(outbox_backend),
    }
    first = _outcomes(process_messages(df, handle_order, dispatcher_url=flaky, **args))
    assert marker.exists()  # a worker really died, and Spark retried its task
    assert sum(first.values()) == len(rows)
    rerun = _outcomes(process_messages(df, handle_order, dispatcher_url=queue, **args))
    assert rerun == Counter({"duplicate": len(rows)})
    if cleanup == "deferred":
        _sweep(spark, outbox_backend)
    _assert_exactly_once(outbox_backend, commands, queue, swept=True)


def _connections_of_a_task(specs: list[ClientSpec | None]) -> Any:
    """A partition function: (worker pid, clients opened, distinct connection objects)."""

    def task(rows: Iterable[Any]) -> Iterable[tuple[int, int, int]]:
        with TaskClients(*specs) as clients:
            opened = clients.get()
            used = [c for c in (opened.entities, opened.dedup, opened.dispatcher) if c]
            yield (
                os.getpid(),
                len(used),
                len({id(c.connection) for c in used}),
            )

    return task


@pytest.mark.parametrize(
    ("spark", "outbox_backend"),
    _pairs([("local", "postgres"), ("cluster", "redis")]),
    indirect=True,
)
def test_the_clients_of_a_task_share_one_connection_per_server(
    spark: Any, outbox_backend: OutboxBackend
) -> None:
    """In each task, the entity store, the deduplication store and (Redis) the
    dispatcher of one server hold one connection object between them: one pool per
    server and Python worker, not one per client."""
    backend = outbox_backend
    specs: list[ClientSpec | None] = [
        ClientSpec.checked("entities", backend.entities_url, backend.options),
        ClientSpec.checked("dedup", backend.dedup_url, backend.options),
        ClientSpec.checked("dispatcher", backend.entities_url) if backend.name == "redis" else None,
    ]
    clients = sum(spec is not None for spec in specs)
    rows = spark.sparkContext.parallelize(range(4), 4)
    seen = rows.mapPartitions(_connections_of_a_task(specs)).collect()
    assert len(seen) == 4 and os.getpid() not in {pid for pid, _, _ in seen}  # in the workers
    assert {(opened, connections) for _, opened, connections in seen} == {(clients, 1)}


@pytest.mark.parametrize(
    ("spark", "outbox_backend"), _pairs([("local", "sqlite"), ("cluster", "sqlite")]), indirect=True
)
def test_each_entity_sees_its_messages_in_order(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """Input order without an order column; the column's order, against the input, with one."""
    # ids out of step with the input order, ranks against it; the input spans partitions,
    # so on the cluster the shuffle's fetch order differs from the input order
    rows = [(f"m{(n * 7919) % 400:04d}", f"e{n % 7}", 400 - n) for n in range(400)]
    df = spark.createDataFrame(rows, "id string, correlation_id string, rank int")
    order = {r[0]: i for i, r in enumerate(rows)}
    rank = {r[0]: r[2] for r in rows}
    from pyspark.sql import functions as F

    for order_col, tag, key in ((None, "in", order.__getitem__), ("rank", "by", rank.__getitem__)):
        results = process_messages(
            df.withColumns(
                {
                    "id": F.concat(F.lit(f"{tag}-"), df.id),
                    "correlation_id": F.concat(df.correlation_id, F.lit(f"-{tag}")),
                }
            ),
            handle_sequence,
            dispatcher_url=f"sqlite:///{tmp_path}/q.db",
            order_col=order_col,
            batch_size=16,
            **_urls(outbox_backend),
        ).collect()
        assert Counter(r["outcome"] for r in results) == Counter({"processed": 400})
        with outbox_backend.entities() as ents:
            for e in range(7):
                seen = ents.load(f"e{e}-{tag}").state["seen"]
                assert len(seen) == len(set(seen)) == len(range(e, 400, 7))
                seen = [mid.split("-", 1)[1] for mid in seen]
                assert seen == sorted(seen, key=key), (order_col, e)


@pytest.mark.parametrize(("spark", "outbox_backend"), _pairs([("local", "sqlite")]), indirect=True)
def test_a_task_processes_with_the_garbage_collector_relaxed(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """Each handler call in a task sees the young threshold of ``gc_relaxed``, and the
    worker's thresholds are put back between Arrow batches (read by a plain UDF)."""
    import gc

    from pyspark.sql import functions as F

    from dedupstore.calls import GC_BATCH_THRESHOLD

    rows = [(f"m{n}", f"e{n % 3}") for n in range(30)]
    df = spark.createDataFrame(rows, "id string, correlation_id string")
    results = process_messages(
        df,
        handle_threshold,
        dispatcher_url=f"sqlite:///{tmp_path}/q.db",
        batch_size=4,
        **_urls(outbox_backend),
    ).collect()
    assert Counter(r["outcome"] for r in results) == Counter({"processed": 30})
    with outbox_backend.entities() as ents:
        seen = {t for e in range(3) for t in ents.load(f"e{e}").state["thresholds"]}
    assert seen == {GC_BATCH_THRESHOLD}
    after = F.udf(lambda _: gc.get_threshold()[0], "int")
    assert {r[0] for r in df.select(after(df.id)).distinct().collect()} == {gc.get_threshold()[0]}


def handle_threshold(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    import gc

    state.setdefault("thresholds", []).append(gc.get_threshold()[0])
    return state, []


def handle_sequence(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    state.setdefault("seen", []).append(message.id)
    return state, []


def _write_json(directory: Path, name: str, rows: list[tuple[Any, ...]]) -> None:
    import json

    keys = ("id", "order_id", "seq", "type", "sku", "qty")
    text = "\n".join(json.dumps(dict(zip(keys, row, strict=True))) for row in rows)
    (directory / f".{name}.tmp").write_text(text + "\n")
    os.replace(directory / f".{name}.tmp", directory / f"{name}.json")


class StopOnFile:
    """Dispatches, then fails while ``flag`` exists if the batch holds ``poison``."""

    def __init__(self, url: str, flag: str, poison: str) -> None:
        self.url, self.flag, self.poison = url, flag, poison

    def __call__(self, messages: list[Any]) -> None:
        with dedupstore.open_dispatcher(self.url) as queue:
            queue.dispatch(messages)
        if os.path.exists(self.flag) and any(
            m.headers.get("source") == self.poison for m in messages
        ):
            raise RuntimeError("injected: the query dies after dispatching this micro-batch")


@pytest.mark.parametrize(("spark", "outbox_backend"), _pairs([("local", "sqlite")]), indirect=True)
@pytest.mark.timeout(600)
def test_stream_stopped_mid_way_restarts_from_its_checkpoint(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    commands, rows = _workload(outbox_backend, orders=45)
    inbox, checkpoint, results = tmp_path / "in", tmp_path / "ckpt", tmp_path / "results"
    inbox.mkdir()
    # a micro-batch orders an entity's messages, the stream cannot: each file holds whole
    # orders, and the last one redelivers every third order (in any file order, an order's
    # commands arrive complete the first time)
    orders = sorted({r[1] for r in rows})
    thirds = [[r for r in rows if orders.index(r[1]) % 2 == i] for i in range(2)]
    thirds.append([r for r in rows if orders.index(r[1]) % 3 == 0])
    queue = f"sqlite:///{tmp_path}/outgoing.db"
    flag = tmp_path / "fail"
    flag.touch()
    poison = thirds[1][0][0]
    stream = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(str(inbox))
    args: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "results_path": str(results),
        "trigger": {"availableNow": True},
        "dispatcher_url": StopOnFile(queue, str(flag), poison),
        "correlation_col": "order_id",
        "order_col": "seq",
        "batch_size": 10,
        "retries": 0,
        **_urls(outbox_backend),
    }
    for n, part in enumerate(thirds):
        _write_json(inbox, f"part-{n}", part)
    query = process_stream(stream, handle_order, **args)
    with pytest.raises(Exception, match="injected"):
        query.awaitTermination()
    flag.unlink()
    query = process_stream(stream, handle_order, **args)  # same checkpoint
    query.awaitTermination()
    assert query.exception() is None
    out = spark.read.parquet(str(results))
    by_batch = Counter(r["batch_id"] for r in out.select("batch_id").collect())
    assert len(by_batch) == 3  # the second micro-batch ran twice, its results written once
    outcomes = Counter(r["outcome"] for r in out.collect())
    # an exact record: the replayed micro-batch says what the failed attempts applied
    delivered = sum(len(part) for part in thirds)
    assert outcomes == Counter({"processed": len(commands), "duplicate": delivered - len(commands)})
    _sweep(spark, outbox_backend)
    _assert_exactly_once(outbox_backend, commands, queue, swept=True)


@pytest.mark.parametrize("spark", ["local"], indirect=True)
def test_bad_arguments_are_refused_before_any_io(spark: Any, tmp_path: Path) -> None:
    df = spark.createDataFrame([("a", "e", 1)], "id string, correlation_id string, n int")
    db = tmp_path / "never.db"
    good = {
        "entities_url": f"sqlite:///{db}",
        "dedup_url": f"sqlite:///{db}",
        "dispatcher_url": f"sqlite:///{db}",
    }
    cases: list[tuple[dict[str, Any], str]] = [
        ({"entities_url": "memory://x"}, "separate Python workers"),
        ({"dedup_url": "nosuch://x"}, "unknown store URL scheme"),
        ({"dispatcher_url": "sqlite:///x.db?nosuch=1"}, "nosuch"),
        ({"cleanup": "later"}, "cleanup"),
        ({"batch_size": 0}, "batch_size"),
        ({"order_col": "missing"}, "not a column"),
        ({"entities_options": {"timeout": "soon"}}, "timeout"),
    ]
    for change, fragment in cases:
        with pytest.raises(ConfigurationError, match=fragment):
            process_messages(df, handle_sequence, **{**good, **change})
    with pytest.raises(ConfigurationError, match="segments"):
        sweep_outboxes(spark, good["entities_url"], good["dedup_url"], segments=0)
    with pytest.raises(ConfigurationError, match="not a column"):
        drop_processed(df, good["dedup_url"], "nope")
    with pytest.raises(ConfigurationError, match="correlation_col='order_id' is not a column"):
        drop_processed(df, good["dedup_url"], "id", "order_id")
    with pytest.raises(ConfigurationError, match="streaming"):
        process_stream(df, handle_sequence, checkpoint=str(tmp_path / "c"), **good)
    assert not db.exists()


class CountingSqliteStore(SqliteDeduplicationStore):
    """Counts ``processed_among`` calls across instances (the test's own process only)."""

    calls: ClassVar[list[int]] = []

    def processed_among(self, message_ids: Iterable[str]) -> set[str]:
        ids = list(message_ids)
        CountingSqliteStore.calls.append(len(ids))
        return super().processed_among(ids)


@pytest.mark.sqlite
def test_drop_processed_asks_the_store_once_per_batch(tmp_path: Path) -> None:
    """The task function itself, in this process: one look-up per non-empty Arrow batch."""
    dedupstore.register("store", "countsqlite", f"{__name__}:CountingSqliteStore", clobber=True)
    url = f"countsqlite:///{tmp_path}/count.db"
    with dedupstore.open_store(f"sqlite:///{tmp_path}/count.db") as store:
        store.add_many([message_key(f"e{n % 7}", f"m{n}") for n in range(0, 3000, 2)])
    batches = [
        (
            [f"m{n}" for n in range(start, start + 1000)],
            [f"e{n % 7}" for n in range(start, start + 1000)],
            [None] * 1000,  # no token nonces
        )
        for start in (0, 1000, 2000)
    ]
    CountingSqliteStore.calls.clear()
    spec = ClientSpec.checked("dedup", url)
    asked = iter([batches[0], ([], [], []), *batches[1:]])
    flags = list(_processed_flags(asked, spec, "id", "cid"))
    assert CountingSqliteStore.calls == [1000, 1000, 1000]
    assert [len(f) for f in flags] == [1000, 0, 1000, 1000]
    assert [n for n, done in enumerate(f for fs in flags for f in fs) if not done] == list(
        range(1, 3000, 2)
    )


def handle_order_without_first_item(
    state: dict[str, Any], message: Message
) -> tuple[dict[str, Any], list[Send]]:
    """A handler that breaks the order rules: it never announces a first item."""
    state, sends = handle_order(state, message)
    return state, [s for s in sends if s.destination != "marketing.first-item-added"]


@pytest.mark.parametrize("spark", ["local"], indirect=True)
@pytest.mark.sqlite
def test_the_demo_report_fails_when_the_outputs_are_wrong(spark: Any, tmp_path: Path) -> None:
    """The report is not a constant: outputs that differ from the rules fail it."""
    db = f"sqlite:///{tmp_path}/demo.db"
    settings = Settings(
        orders=40, entities_url=db, dedup_url=db, dispatcher_url=db, kill=False, batch_size=50
    )
    good = run(spark, settings, str(tmp_path))
    assert good.ok
    bad = run(spark, settings, str(tmp_path), handle_order_without_first_item)
    failed = {c.name for c in bad.checks if not c.ok}
    assert not bad.ok
    assert failed == {"distinct outgoing ids", "outgoing ids = expected set"}
    assert "INVARIANTS FAILED" in bad.render()


def handle_order_accepting_poison(
    state: dict[str, Any], message: Message
) -> tuple[dict[str, Any], list[Send]]:
    """A handler that applies what it should refuse: a poison add_item as the first sku."""
    if message.body["type"] == "add_item" and message.body["sku"] not in PRICES:
        message = Message(message.id, message.correlation_id, {**message.body, "sku": "sku-000"})
    return handle_order(state, message)


@pytest.mark.parametrize("spark", ["local"], indirect=True)
@pytest.mark.sqlite
def test_the_demo_report_fails_when_poison_is_applied(spark: Any, tmp_path: Path) -> None:
    """The dead-letter checks are not constants either: poison applied fails them."""
    db = f"sqlite:///{tmp_path}/demo.db"
    settings = Settings(
        orders=40, entities_url=db, dedup_url=db, dispatcher_url=db, kill=False, batch_size=50
    )
    bad = run(spark, settings, str(tmp_path), handle_order_accepting_poison)
    failed = {c.name for c in bad.checks if not c.ok}
    caught = {
        "state changes applied",
        "dead-lettered messages",
        "dead letters = expected ids",
        "outgoing ids = expected set",
    }
    # the count of outgoing ids may happen to match (an item-added for a dead letter)
    assert caught <= failed <= caught | {"distinct outgoing ids"}


# ---------------------------------------------------------------------- the jobs


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **TEST_AWS_ENV, "PYSPARK_PYTHON": sys.executable}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)


@pytest.mark.sqlite
@pytest.mark.slow
def test_the_demo_job_reports_every_invariant_holding(tmp_path: Path) -> None:
    result = _run(
        [sys.executable, "-m", "dedupstore.spark.order_pipeline", "--orders", "300"], tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all invariants hold" in result.stdout
    assert "[FAIL]" not in result.stdout
    killed = [line for line in result.stdout.splitlines() if "Python worker killed" in line]
    assert killed and killed[0].rstrip().endswith("yes")
    # the deliberate kill is said in one line, with no stack trace on either stream
    said = "a Python worker was killed on purpose; Spark retried its task (1 failed task attempt)"
    assert said in result.stdout
    for text in (result.stdout, result.stderr):
        assert "Exception in task" not in text and "\tat org.apache" not in text
        assert "Lost task" not in text
    dead = [line for line in result.stdout.splitlines() if "dead-lettered messages" in line]
    assert dead and dead[0].split()[-1] == "10"
    # the injected faults are counts in the report, not a WARNING line each
    for text in (result.stdout, result.stderr):
        assert "InjectedFailure" not in text and "unknown sku" not in text
    counted = [line for line in result.stdout.splitlines() if "injected: refused" in line]
    assert counted and counted[0].split()[-1] == "10"  # refused / crashed / poison
    assert (tmp_path / ".dedupstore" / "orders-demo" / "entities.db").is_file()


@pytest.mark.sqlite
@pytest.mark.slow
def test_the_job_runs_under_spark_submit_and_the_cli_sweeps(tmp_path: Path) -> None:
    # the README's line: the venv's spark-submit, the venv not activated, only the
    # driver's Python named (spark-submit picks it before any code of ours runs); the
    # library gives the local workers the same interpreter
    submit = str(Path(sys.executable).with_name("spark-submit"))  # .venv/bin/spark-submit
    job = Path(__file__).resolve().parents[1] / "spark_integration" / "order_pipeline.py"
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    result = subprocess.run(
        [submit, "--master", "local[2,3]", str(job), "--orders", "120", "--no-kill"],
        cwd=tmp_path,
        env={**env, **TEST_AWS_ENV, "PYSPARK_DRIVER_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all invariants hold" in result.stdout
    backend = OutboxBackend(
        "sqlite", f"sqlite:///{tmp_path}/e.db", f"sqlite:///{tmp_path}/d.db", {}
    )
    ids = _seed(backend, 20, 2, fail_dispatch=False)
    exe = shutil.which("dedupstore") or str(Path(sys.executable).with_name("dedupstore"))
    cli = [exe, "sweep", "--entities", backend.entities_url, "--store", backend.dedup_url]
    result = _run([*cli, "--segments", "3", "--master", "local[2]"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ids moved {len(ids)}" in result.stdout
    with backend.dedup() as dedup:
        assert dedup.processed_among(ids) == set(ids)


@pytest.mark.sqlite
@pytest.mark.slow
def test_the_spark_sweep_command_moves_ids_to_the_consumer_recorded_or_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: the Spark `dedupstore sweep` had no endpoint: ids went to `default`."""
    from dedupstore.cli import main

    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path}/sw.db"
    with (
        dedupstore.open_entity_store(url) as entities,
        dedupstore.open_store(url, endpoint="accounts") as dedup,
    ):
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        deposit = Message("dep-1", "acct-1", 100)
        credit = lambda state, m: ({"balance": state.get("balance", 0) + m.body}, [])  # noqa: E731
        assert processor.process(deposit, credit).outcome == "processed"
    cli = ["sweep", "--entities", url, "--store", url, "--segments", "2", "--master", "local[2]"]
    assert main([*cli, "--endpoint", "default"]) == 2, "refused before any write"
    err = capsys.readouterr().err
    assert "'accounts'" in err and "'default'" in err, err
    with dedupstore.open_entity_store(url) as entities:
        assert entities.load("acct-1").outbox == {"dep-1": None}
    assert main(cli) == 0
    assert "ids moved 1" in capsys.readouterr().out
    with (
        dedupstore.open_entity_store(url) as entities,
        dedupstore.open_store(url, endpoint="accounts") as dedup,
    ):
        assert dedup.count() == 1 and entities.load("acct-1").outbox == {}
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        assert processor.process(deposit, credit).outcome == "duplicate"
        assert entities.load("acct-1").state == {"balance": 100}


@pytest.mark.sqlite
def test_drop_processed_with_the_entity_store_drops_ids_awaiting_the_sweep(tmp_path: Path) -> None:
    """Issue 36: under deferred clean-up a processed id waits in its entity's outbox; the
    task function itself, in this process."""
    url = f"sqlite:///{tmp_path}/d.db"
    with (
        dedupstore.open_entity_store(url) as entities,
        dedupstore.open_store(url, endpoint="accounts") as dedup,
    ):
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        credit = lambda state, m: ({"n": state.get("n", 0) + 1}, [])  # noqa: E731
        processor.process(Message("m1", "acct-1", 1), credit)  # in the outbox
        processor.process(Message("m2", "acct-2", 1), credit)
        sweep_ids = dedup.add(message_key("acct-3", "m3"))  # in the store
        assert sweep_ids
    batch = (["m1", "m2", "m3", "m4"], ["acct-1", "acct-2", "acct-3", "acct-1"], [None] * 4)
    dedup_spec = ClientSpec.checked("dedup", url, {"endpoint": "accounts"})
    alone = list(_processed_flags(iter([batch]), dedup_spec, "id", "cid"))
    assert alone == [[False, False, True, False]], "the store alone misses the outboxes"
    ents = ClientSpec.checked("entities", url)
    both = list(_processed_flags(iter([batch]), dedup_spec, "id", "cid", ents))
    assert both == [[True, True, True, False]]
    other = ClientSpec.checked("dedup", url, {"endpoint": "billing"})
    with pytest.raises(ConfigurationError, match="'accounts'"):
        list(_processed_flags(iter([batch]), other, "id", "cid", ents))
