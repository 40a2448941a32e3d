"""The main job: an order pipeline on Spark, fed at least once, proven exactly once.

Run it with ``make demo``, ``python -m dedupstore.spark.order_pipeline`` or
``spark-submit spark_integration/order_pipeline.py``. Steps:

1. generate an order workload delivered at least once (duplicates, reordering), with
   a few poison messages (an ``add_item`` whose sku the handler refuses);
2. :func:`~dedupstore.spark.process_messages` with ``dead_letters`` and a
   :class:`FlakyDispatcher` that fails some dispatches, crashes some batches after
   dispatching and kills one Python worker (Spark retries its task; the report
   counts the failed attempt instead of logging it);
3. :func:`~dedupstore.spark.sweep_outboxes`;
4. replay the whole input once more;
5. check the invariants from the stores and the outgoing queue against a model
   computed from the input alone; print the report; exit 1 if any fails.

By default everything is embedded SQLite under ``.dedupstore/orders-demo/``; flags
pick other URLs. Every run uses fresh ids, so runs never see each other's data.
"""

from __future__ import annotations

import sys

if not __package__:  # run as a file (spark-submit .../order_pipeline.py): the package's module
    import runpy

    runpy.run_module("dedupstore.spark.order_pipeline", run_name="__main__", alter_sys=True)
    sys.exit(0)  # not reached: the module's main exits

import argparse
import os
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import ArrayType, IntegerType, StringType

import dedupstore
from dedupstore.outbox import Handler, outgoing_id

from ._columns import schema
from ._faults import FlakyDispatcher, injected_faults
from .orders import expected_outgoing, handle_order, is_poison, make_workload
from .pipeline import drop_processed, process_messages, sweep_outboxes
from .session import local_session, quiet_task_retries

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["FlakyDispatcher", "Report", "injected_faults", "main", "run"]

INPUT_SCHEMA = "id string, order_id string, seq int, type string, sku string, qty int"
DEFAULT_DIR = ".dedupstore/orders-demo"


# ---------------------------------------------------------------------- checks


@dataclass
class Check:
    """One line of the report: what was measured and whether it holds."""

    name: str
    value: Any
    expected: Any = None
    ok: bool = True


@dataclass
class Report:
    """What the job measured; :attr:`ok` when every invariant holds."""

    checks: list[Check] = field(default_factory=list)
    info: list[tuple[str, Any]] = field(default_factory=list)

    def check(self, name: str, value: Any, expected: Any) -> None:
        """Record an invariant ``value == expected``."""
        self.checks.append(Check(name, value, expected, value == expected))

    def note(self, name: str, value: Any) -> None:
        """Record a figure that is not an invariant."""
        self.info.append((name, value))

    @property
    def ok(self) -> bool:
        """Whether every invariant held."""
        return all(c.ok for c in self.checks)

    def render(self) -> str:
        """The report as text."""
        lines = ["", "Exactly-once report", "==================="]
        width = max(len(c.name) for c in self.checks) + 2
        for c in self.checks:
            mark = "ok  " if c.ok else "FAIL"
            want = "" if c.ok else f"   (expected {_fmt(c.expected)})"
            lines.append(f"  [{mark}] {c.name:<{width}} {_fmt(c.value)}{want}")
        lines.append("")
        lines.extend(f"         {name:<{width}} {_fmt(value)}" for name, value in self.info)
        lines += ["", "all invariants hold" if self.ok else "INVARIANTS FAILED"]
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# ---------------------------------------------------------------------- inspection


ENTITY_SCHEMA = schema(
    order_id=StringType(), applied=ArrayType(StringType()), outbox_entries=IntegerType()
)


def inspect_entities(
    order_ids: DataFrame, entities_url: str, column: str = "order_id"
) -> DataFrame:
    """One row per entity: the message ids its state applied and its outbox size.

    Runs in the tasks with ``load_many`` per Arrow batch; the demo's handler keeps
    the applied ids in ``state["applied"]``.
    """
    from ._clients import ClientSpec, TaskClients

    spec = ClientSpec.checked("entities", entities_url)

    def load(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        with TaskClients(entities=spec) as task:
            for batch in batches:
                ids = batch.column(column).to_pylist()
                if not ids:
                    continue
                found = task.get().entities.load_many(ids)
                rows = [
                    {
                        "order_id": eid,
                        "applied": list(found[eid].state.get("applied", [])),
                        "outbox_entries": len(found[eid].outbox),
                    }
                    for eid in ids
                ]
                yield pa.RecordBatch.from_pylist(rows, schema=to_arrow_schema(ENTITY_SCHEMA))

    return order_ids.select(column).distinct().mapInArrow(load, ENTITY_SCHEMA)


def read_outgoing(dispatcher_url: str) -> list[tuple[str, str, str, int, int]]:
    """``(id, destination, source message id, deliveries, mismatches)`` per outgoing message.

    Reads a ``sqlite:///`` table queue (the receiver's side of the demo). The source
    is the handler's ``source`` header, or for a dead letter (no headers) the id of
    the message its body carries.
    """
    queue: Any = dedupstore.open_dispatcher(dispatcher_url)
    with queue:
        if not hasattr(queue, "messages"):
            raise SystemExit(f"the report reads a sqlite:/// table queue, not {queue!r}")
        return [
            (
                m.message.id,
                m.message.destination,
                m.message.headers.get("source") or _carried_id(m.message.body),
                m.deliveries,
                m.mismatches,
            )
            for m in queue.messages()
        ]


def _carried_id(body: Any) -> str:
    """The id of the message a dead letter's body carries (``""`` for another body)."""
    carried = body.get("message") if isinstance(body, dict) else None
    return str(carried.get("id", "")) if isinstance(carried, dict) else ""


# ---------------------------------------------------------------------- the job


@dataclass(frozen=True)
class Settings:
    """The job's inputs (see ``--help``)."""

    orders: int = 5000
    entities_url: str = f"sqlite:///{DEFAULT_DIR}/entities.db"
    dedup_url: str = f"sqlite:///{DEFAULT_DIR}/dedup.db"
    dispatcher_url: str = f"sqlite:///{DEFAULT_DIR}/outgoing.db"
    cleanup: str = "deferred"
    segments: int = 4
    batch_size: int = 250
    duplicates: float = 0.2
    fail: float = 0.1
    crash: float = 0.1
    kill: bool = True
    seed: int = 7
    poison: int = 10
    dead_letters: str = "orders.dead-letters"


def _say(text: str) -> None:
    print(text, flush=True)


def run(
    spark: SparkSession, settings: Settings, workdir: str, handler: Handler = handle_order
) -> Report:
    """Run the pipeline and check it; the returned report says whether it held.

    ``handler`` is the order handler (another one only to show the checks catch a
    handler whose outputs differ from the order rules).
    """
    from pyspark.sql import functions as F

    run_id = uuid.uuid4().hex[:8]
    report = Report()
    _say(f"[1/5] generating {settings.orders:,} orders (run {run_id})")
    workload = make_workload(
        settings.orders,
        duplicates=settings.duplicates,
        seed=settings.seed,
        poison=settings.poison,
    )

    def of_this_run(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "id": f"{run_id}/{row['id']}", "order_id": f"{run_id}/{row['order_id']}"}

    rows = [of_this_run(row) for row in workload.delivered]
    commands = [of_this_run(row) for row in workload.commands]
    messages = spark.createDataFrame(rows, INPUT_SCHEMA).cache()
    messages.count()
    os.makedirs(workdir, exist_ok=True)
    kill = settings.kill
    if kill and task_attempts(spark) == 1:
        _say(
            "      (no worker is killed: a task gets one attempt on this master, so the kill "
            "would fail the job; give the attempts as in local[4,4])"
        )
        kill = False
    flaky = FlakyDispatcher(
        settings.dispatcher_url,
        settings.fail,
        settings.crash,
        os.path.abspath(os.path.join(workdir, f"killed-{run_id}")) if kill else None,
        settings.seed,
        os.path.abspath(os.path.join(workdir, f"faults-{run_id}")),
    )
    common: dict[str, Any] = {
        "entities_url": settings.entities_url,
        "dedup_url": settings.dedup_url,
        "cleanup": settings.cleanup,
        "correlation_col": "order_id",
        "order_col": "seq",
        "batch_size": settings.batch_size,
        "dead_letters": settings.dead_letters,
    }
    poison = [c for c in commands if is_poison(c)]

    _say(
        f"[2/5] process_messages: {len(rows):,} deliveries of {len(commands):,} messages "
        f"({len(poison):,} poison)"
    )
    started = time.perf_counter()
    with quiet_task_retries(spark, quiet=bool(flaky.kill_marker)) as retries:
        first = _outcomes(process_messages(messages, handler, dispatcher_url=flaky, **common))
    seconds = time.perf_counter() - started
    killed = bool(flaky.kill_marker) and os.path.exists(flaky.kill_marker or "")
    faults = injected_faults(flaky.faults or "")
    failed = retries.failed_attempts
    if killed or failed:
        _say(f"      {_retried(killed, failed)}")

    _say(f"[3/5] sweep_outboxes: {settings.segments} segments")
    swept = (
        sweep_outboxes(spark, settings.entities_url, settings.dedup_url, segments=settings.segments)
        .agg(
            F.sum("entities_scanned").alias("scanned"),
            F.sum("ids_moved").alias("moved"),
        )
        .first()
    )

    _say("[4/5] replaying the whole input")
    second = _outcomes(
        process_messages(messages, handler, dispatcher_url=settings.dispatcher_url, **common)
    )

    _say("[5/5] checking the stores and the outgoing queue against the input")
    with dedupstore.open_store(settings.dedup_url) as store:  # the consumer: the store's endpoint
        consumer = store.endpoint
    expected = expected_outgoing(commands, consumer, settings.dead_letters)
    expected_dead = {outgoing_id(consumer, c["order_id"], c["id"], -1) for c in poison}
    entities = inspect_entities(messages, settings.entities_url).cache()
    applied = entities.select(F.explode("applied").alias("id"))
    distinct_ids = messages.select("id").distinct()
    totals = entities.agg(
        F.sum(F.size("applied")).alias("applied"), F.sum("outbox_entries").alias("outbox")
    ).first()
    applied_total = int(totals["applied"] or 0)  # type: ignore[index]
    applied_distinct = applied.distinct().count()
    outgoing = read_outgoing(settings.dispatcher_url)
    ours = [o for o in outgoing if o[2].startswith(f"{run_id}/")]
    dead = [o for o in ours if o[1] == settings.dead_letters]
    dead_sources = {o[2] for o in dead}
    not_applied = {r["id"] for r in distinct_ids.join(applied, "id", "left_anti").collect()}
    lost = len(not_applied - dead_sources)  # neither applied nor set aside
    # a ghost: an outgoing message of a change never saved, or a dead letter of one saved
    sources = spark.createDataFrame(
        [(o[2], o[1] == settings.dead_letters) for o in ours] or [("", False)],
        "id string, dead boolean",
    )
    marked = sources.join(applied.withColumn("saved", F.lit(True)), "id", "left")
    saved = F.col("saved").isNotNull()
    ghosts = marked.where(F.when(F.col("dead"), saved).otherwise(~saved)).count() if ours else 0
    pairs = messages.select("id", "order_id").distinct()
    unrecorded = drop_processed(pairs, settings.dedup_url, correlation_col="order_id").count()

    report.check("messages in (deliveries)", len(rows), len(rows))
    report.check("distinct messages", distinct_ids.count(), len(commands))
    report.check("state changes applied", applied_total, len(commands) - len(poison))
    report.check("state changes applied twice", applied_total - applied_distinct, 0)
    report.check("lost messages", lost, 0)
    report.check("dead-lettered messages", len(dead), len(poison))
    report.check("dead letters = expected ids", {o[0] for o in dead} == expected_dead, True)
    report.check("dead-lettered changes applied", len(dead_sources - not_applied), 0)
    report.check("distinct outgoing ids", len({o[0] for o in ours}), len(expected))
    report.check("outgoing ids = expected set", {o[0] for o in ours} == set(expected), True)
    report.check("re-dispatches that differed", sum(o[4] for o in ours), 0)
    report.check("ghost messages", ghosts, 0)
    report.check("outbox entries left after the sweep", int(totals["outbox"] or 0), 0)  # type: ignore[index]
    report.check("ids in the dedup store", len(commands) - unrecorded, len(commands))
    replayed = second.get("processed", 0) + second.get("dead_lettered", 0)
    report.check("processed/dead-lettered on replay", replayed, 0)
    report.note("first run outcomes", _shown(first))
    report.note("replay outcomes", _shown(second))
    report.note("messages in batches re-run after a failure", first.get("batch_retries", 0))
    report.note(
        "injected: refused / crashed / poison",
        f"{faults['refused']:,} / {faults['crashed']:,} / {len(poison):,}",
    )
    report.note("outgoing deliveries (re-dispatches)", sum(o[3] for o in ours))
    if flaky.kill_marker:
        report.note("Python worker killed, task retried", killed)
    if failed is not None:
        report.note("failed task attempts (retried)", failed)
    report.note("sweep: entities / ids moved", f"{swept['scanned']:,} / {swept['moved']:,}")  # type: ignore[index]
    report.note("messages/s (first run)", len(rows) / seconds)
    return report


def task_attempts(spark: SparkSession) -> int | None:
    """How many attempts a task gets on this session (``None``: unknown, Spark Connect).

    ``local`` and ``local[n]`` give one (``local[n,f]``: ``f``); other masters
    ``spark.task.maxFailures`` (default 4).
    """
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return None
    master = str(spark.sparkContext.master)
    local = re.fullmatch(r"local(?:\[[^,\]]+(?:,\s*(\d+))?\])?", master)
    if local:
        return int(local.group(1) or 1)
    return int(spark.sparkContext.getConf().get("spark.task.maxFailures", "4") or 4)


def _retried(killed: bool, failed: int | None) -> str:
    """One line on the task attempts that failed and were retried in the first run."""
    if failed is None:  # not counted (Spark Connect)
        return "a Python worker was killed on purpose; Spark retried its task"
    attempts = f"{failed:,} failed task attempt{'s' if failed != 1 else ''}"
    if not killed:
        return f"{attempts}, retried by Spark (none killed on purpose: see the Spark log above)"
    if failed <= 1:
        return f"a Python worker was killed on purpose; Spark retried its task ({attempts})"
    return (
        f"a Python worker was killed on purpose; {attempts} retried by Spark: "
        f"{failed - 1:,} more than the kill (rerun with --no-kill to see their errors)"
    )


def _outcomes(results: DataFrame) -> dict[str, int]:
    from pyspark.sql import functions as F

    counts: dict[str, int] = {}
    for row in (
        results.groupBy("outcome")
        .agg(F.count("*").alias("n"), F.sum((F.col("batch_attempts") > 1).cast("int")).alias("r"))
        .collect()
    ):
        counts[row["outcome"]] = row["n"]
        counts["batch_retries"] = counts.get("batch_retries", 0) + int(row["r"] or 0)
    return counts


def _shown(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()) if k != "batch_retries")


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, str, str]:
    """Settings, the Spark master and the working directory from the command line."""
    d = Settings()
    p = argparse.ArgumentParser(
        prog="order_pipeline", description="The order pipeline on Spark, proven exactly once."
    )
    p.add_argument("--orders", type=int, default=d.orders, help="size: number of orders")
    for flag, dest, what in (
        ("entities", "entities_url", "entity store URL"),
        ("store", "dedup_url", "deduplication store URL"),
        ("dispatcher", "dispatcher_url", "dispatcher URL (sqlite, redis)"),
    ):
        p.add_argument(
            f"--{flag}", dest=dest, metavar=flag.upper(), default=getattr(d, dest), help=what
        )
    p.add_argument("--cleanup", choices=("deferred", "inline"), default=d.cleanup)
    p.add_argument("--segments", type=int, default=d.segments, help="sweep segments")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--duplicates", type=float, default=d.duplicates)
    p.add_argument("--fail", type=float, default=d.fail, help="first-attempt dispatch failures")
    p.add_argument("--crash", type=float, default=d.crash, help="crashes after dispatch")
    p.add_argument(
        "--no-kill", dest="kill", action="store_false", help="do not kill a Python worker"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--poison", type=int, default=d.poison, help="orders with one poison add_item (bad sku)"
    )
    p.add_argument("--dead-letters", default=d.dead_letters, help="the dead-letter destination")
    p.add_argument("--master", default="local[2,4]", help="Spark master (local: 4 task attempts)")
    p.add_argument("--workdir", default=DEFAULT_DIR)
    a = p.parse_args(argv)
    if a.orders < 1:
        p.error("--orders must be >= 1")
    if a.poison < 0:
        p.error("--poison must be >= 0")
    settings = Settings(**{f.name: getattr(a, f.name) for f in fields(Settings)})
    return settings, a.master, a.workdir


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; 0 if every invariant held, 1 if not."""
    settings, master, workdir = parse_args(argv)
    started = time.perf_counter()
    spark = local_session(master, "dedupstore-order-pipeline")
    try:
        report = run(spark, settings, workdir)
    finally:
        spark.stop()
    _say(report.render())
    _say(f"finished in {time.perf_counter() - started:,.0f} s")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
