"""The sweep as a Spark job: one task per segment of the entities' outboxes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructType,
)

from dedupstore.errors import ConfigurationError
from dedupstore.outbox import recorded_consumer, sweep
from dedupstore.stats import outbox_backlog
from dedupstore.urls import StoreURL

from ._clients import ClientSpec, TaskClients, positive_int
from ._columns import schema
from .session import use_this_python

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, Row, SparkSession

#: One row per segment of :func:`sweep_outboxes`.
SWEEP_SCHEMA = schema(
    segment=IntegerType(),
    segments=IntegerType(),
    entities_scanned=LongType(),
    ids_moved=LongType(),
    conflicts_retried=LongType(),
    redispatched=LongType(),
    ids_left=LongType(),
    seconds=DoubleType(),
    worker_peak_rss_bytes=LongType(),
)


def sweep_outboxes(
    spark: SparkSession,
    entities_url: str,
    dedup_url: str,
    *,
    segments: int,
    redispatch_url: str | Callable[..., Any] | None = None,
    entities_options: Mapping[str, Any] | None = None,
    dedup_options: Mapping[str, Any] | None = None,
    redispatch_options: Mapping[str, Any] | None = None,
    batch_ids: int = 1000,
    max_attempts: int = 10,
    endpoint: str | None = None,
    tokens_url: str | None = None,
    tokens_options: Mapping[str, Any] | None = None,
) -> DataFrame:
    """Move dispatched outbox ids into the deduplication store, one Spark task per segment.

    The ids go to ``endpoint``, else the one ``dedup_url`` or ``dedup_options`` name,
    else the consumer recorded with the entities. A first Spark job (a task per
    segment) scans the non-empty outboxes for the consumers they record: a mismatch
    is a ``ConfigurationError`` naming both before any write, and several consumers
    without an endpoint one listing them (each task refuses an entity of another
    consumer too, before writing anything of its batch).

    Each task opens its own clients and runs :func:`dedupstore.outbox.sweep` on its
    segment, in memory bounded by ``batch_ids``, not by the segment. With
    ``redispatch_url``, entries still pending dispatch are dispatched first (outbox
    relay). With ``tokens_url`` (the consumer's token store), entries written in
    token mode have their tokens deleted instead of their ids moved (without it, a
    task that meets such an entity fails with ``ConfigurationError``, nothing of its
    batch written); an entry whose outgoing tokens are not made yet is left to its
    message's redelivery. Runs now (an action) and returns a small DataFrame, one row per segment,
    sorted by segment (:data:`SWEEP_SCHEMA`: the counts of
    :class:`~dedupstore.outbox.SweepResult` and the peak memory of the Python worker
    that ran it, since it started). Safe to re-run, to run twice at once and beside
    live consumers.

    Raises ``ConfigurationError`` (bad URL, option or argument; before any I/O)
    and, through Spark, whatever a task raised after its retries.
    """
    segments = positive_int("segments", segments)
    batch_ids = positive_int("batch_ids", batch_ids)
    max_attempts = positive_int("max_attempts", max_attempts)
    ents = ClientSpec.checked("entities", entities_url, entities_options)
    if endpoint is not None:
        dedup_options = {**(dedup_options or {}), "endpoint": endpoint}
    dedup = ClientSpec.checked("dedup", dedup_url, dedup_options)
    named = dedup.options.get("endpoint")
    if named is None:
        query = [v for k, v in StoreURL.parse(str(dedup.url)).query if k == "endpoint"]
        named = query[-1] if query else None
    relay = (
        ClientSpec.checked("dispatcher", redispatch_url, redispatch_options)
        if redispatch_url is not None
        else None
    )
    tokens = (
        None if tokens_url is None else ClientSpec.checked("tokens", tokens_url, tokens_options)
    )
    use_this_python(spark)  # a local master: the workers run this interpreter

    def consumers_of(segment: int) -> list[dict[str, Any]]:
        with TaskClients(ents) as task:
            found = outbox_backlog(task.get().entities, segment=segment, segments=segments)
        return [{"consumers": sorted(found.consumers), "tokened": found.entities_tokened}]

    scanned = schema(consumers=ArrayType(StringType()), tokened=LongType())
    recorded = _per_segment(spark, segments, scanned, consumers_of)
    consumers = {consumer for row in recorded for consumer in row.consumers}
    tokened = sum(row.tokened for row in recorded)
    if tokened and tokens is None:
        raise ConfigurationError(
            f"{tokened} entities hold entries written in token mode: their sweep needs the "
            "token store (tokens_url); nothing was written"
        )
    chosen = recorded_consumer(consumers, "endpoint", None if named is None else str(named))
    if named is None:
        dedup = replace(dedup, options={**dedup.options, "endpoint": chosen})

    def sweep_segment(segment: int) -> list[dict[str, Any]]:
        with TaskClients(ents, dedup, relay, tokens) as task:
            clients = task.get()
            done = sweep(
                clients.entities,
                clients.dedup,
                segment,
                segments,
                clients.dispatcher,
                batch_ids=batch_ids,
                max_attempts=max_attempts,
                tokens=clients.tokens,
            )
        return [{**vars(done), "worker_peak_rss_bytes": _peak_rss()}]

    rows = _per_segment(spark, segments, SWEEP_SCHEMA, sweep_segment)
    return spark.createDataFrame(rows, SWEEP_SCHEMA).orderBy("segment")


def _per_segment(
    spark: SparkSession,
    segments: int,
    schema: StructType,
    rows_of: Callable[[int], list[dict[str, Any]]],
) -> list[Row]:
    """``rows_of(segment)`` of every segment, one Spark task per segment; collected."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        for batch in batches:
            for segment in batch.column(0).to_pylist():
                yield pa.RecordBatch.from_pylist(rows_of(segment), schema=to_arrow_schema(schema))

    return spark.range(0, segments, 1, segments).mapInArrow(run, schema).collect()


def _peak_rss() -> int:
    """Peak resident memory of this Python worker so far, in bytes (Linux: ru_maxrss in KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
