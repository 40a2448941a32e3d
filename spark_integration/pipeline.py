"""The improving outbox as Spark jobs: sweep, process, stream, drop processed.

Built on DataFrame APIs only (``mapInArrow``, a pandas UDF, ``repartition``,
``foreachBatch``), so every function runs unchanged on a classic session and on a
Spark Connect session. Each task opens its own clients from URLs (checked on the
driver first, without I/O) and closes them; nothing live is pickled and nothing is
kept on the driver. How columns become ids, order and bodies is
:mod:`dedupstore.spark._columns`, checked on the driver too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from dedupstore.calls import GC_BATCH_THRESHOLD, gc_relaxed
from dedupstore.errors import (
    ConfigurationError,
    EntityTooLarge,
    HandlerError,
    InvalidMessageId,
    format_error,
)
from dedupstore.ids import message_key, plain_ids, validate_message_id, validate_name
from dedupstore.outbox import (
    BeforeCleanup,
    Handler,
    Message,
    OutboxProcessor,
    ProcessResult,
    applied_among,
    recorded_consumer,
    sweep,
)
from dedupstore.stats import outbox_backlog
from dedupstore.urls import StoreURL

from . import _columns as C
from ._clients import ClientSpec, TaskClients
from .session import use_this_python

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

_log = logging.getLogger(__name__)

__all__ = [
    "PROCESS_SCHEMA",
    "RECORD_SCHEMA",
    "SWEEP_SCHEMA",
    "drop_processed",
    "process_messages",
    "process_stream",
    "run_messages",
    "sweep_outboxes",
]


def _schema(**columns: DataType) -> StructType:
    return StructType([StructField(name, kind) for name, kind in columns.items()])


#: One row per segment of :func:`sweep_outboxes`.
SWEEP_SCHEMA = _schema(
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

#: One row per message of :func:`process_messages`.
PROCESS_SCHEMA = _schema(
    message_id=StringType(),
    correlation_id=StringType(),
    outcome=StringType(),
    outgoing_ids=ArrayType(StringType()),
    attempts=IntegerType(),
    batch_attempts=IntegerType(),
    error=StringType(),
)

#: The files of :func:`run_messages`: :data:`PROCESS_SCHEMA` and where the row is in
#: its batch (a batch's files are in ``batch=<digest>`` under the results path).
RECORD_SCHEMA = StructType([*PROCESS_SCHEMA.fields, StructField("position", IntegerType())])

Cleanup = Literal["inline", "deferred"]


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


# ---------------------------------------------------------------------- the sweep


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
) -> DataFrame:
    """Move dispatched outbox ids into the deduplication store, one Spark task per segment.

    The ids go to ``endpoint``, else the one ``dedup_url`` or ``dedup_options`` name,
    else the consumer recorded with the entities. One more Spark job (a task per
    segment) first scans the non-empty outboxes for the consumers they record, so a
    mismatch is a ``ConfigurationError`` naming both before any write, and several
    consumers without an endpoint one listing them. (Each task refuses an entity of
    another consumer too, before anything of its batch is written: one recorded
    between the two jobs fails its task.)

    Each task opens its own clients from the URLs and runs
    :func:`dedupstore.outbox.sweep` on its segment: memory per task is bounded by
    ``batch_ids``, not by the segment. With ``redispatch_url``, entries still
    pending dispatch are dispatched first (outbox relay). Runs now (an action) and
    returns a small DataFrame, one row per segment (:data:`SWEEP_SCHEMA`: the
    counts of :class:`~dedupstore.outbox.SweepResult` plus the peak memory of the
    Python worker that ran it, since that worker started), sorted by segment.
    Safe to re-run, to run twice at once and beside live consumers.

    Raises ``ConfigurationError`` (bad URL, option or argument; before any I/O)
    and, through Spark, whatever a task raised after its retries.
    """
    segments = _positive_int("segments", segments)
    batch_ids = _positive_int("batch_ids", batch_ids)
    max_attempts = _positive_int("max_attempts", max_attempts)
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
    use_this_python(spark)  # a local master: the workers run this interpreter
    consumers = _recorded_consumers(spark, ents, segments)
    chosen = recorded_consumer(consumers, "endpoint", None if named is None else str(named))
    if named is None:
        dedup = replace(dedup, options={**dedup.options, "endpoint": chosen})

    def sweep_segments(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        for batch in batches:
            for segment in batch.column(0).to_pylist():
                with TaskClients(ents, dedup, relay) as task:
                    clients = task.get()
                    done = sweep(
                        clients.entities,
                        clients.dedup,
                        segment,
                        segments,
                        clients.dispatcher,
                        batch_ids=batch_ids,
                        max_attempts=max_attempts,
                    )
                row = {**vars(done), "worker_peak_rss_bytes": _peak_rss()}
                yield pa.RecordBatch.from_pylist([row], schema=to_arrow_schema(SWEEP_SCHEMA))

    plan = spark.range(0, segments, 1, segments).mapInArrow(sweep_segments, SWEEP_SCHEMA)
    rows = plan.collect()
    return spark.createDataFrame(rows, SWEEP_SCHEMA).orderBy("segment")


def _recorded_consumers(spark: SparkSession, ents: ClientSpec, segments: int) -> set[str]:
    """The consumers recorded on the non-empty outboxes of ``ents``: a task per segment."""
    schema = _schema(consumer=StringType())

    def consumers_of(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        for batch in batches:
            for segment in batch.column(0).to_pylist():
                with TaskClients(ents) as task:
                    found = outbox_backlog(task.get().entities, segment=segment, segments=segments)
                rows = [{"consumer": c} for c in sorted(found.consumers)]
                yield pa.RecordBatch.from_pylist(rows, schema=to_arrow_schema(schema))

    plan = spark.range(0, segments, 1, segments).mapInArrow(consumers_of, schema)
    return {row.consumer for row in plan.collect()}


def _peak_rss() -> int:
    """Peak resident memory of this Python worker so far, in bytes (Linux: ru_maxrss in KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ---------------------------------------------------------------------- processing


def _retrying(state: RetryCallState, size: int) -> None:
    """Log a batch about to run again after a transient error (WARNING)."""
    error = state.outcome.exception() if state.outcome is not None else None
    _log.warning(
        "a batch of %d message(s) failed on attempt %d (%s); running it again in %.2f s",
        size,
        state.attempt_number,
        "unknown error" if error is None else f"{type(error).__name__}: {format_error(error)}",
        state.next_action.sleep if state.next_action is not None else 0.0,
    )


def _transient(exc: BaseException) -> bool:
    """A batch that raised this may succeed when re-run (handler bugs never do)."""
    return isinstance(exc, Exception) and not isinstance(
        exc,
        ConfigurationError
        | HandlerError
        | InvalidMessageId
        | EntityTooLarge
        | TypeError
        | ValueError
        | KeyError,
    )


def process_messages(
    df: DataFrame,
    handler: Handler,
    *,
    entities_url: str,
    dedup_url: str,
    dispatcher_url: str | Callable[..., Any],
    cleanup: Cleanup = "deferred",
    id_col: str = "id",
    correlation_col: str = "correlation_id",
    order_col: str | None = None,
    headers_col: str | None = None,
    batch_size: int = 1000,
    partitions: int | None = None,
    retries: int = 3,
    max_attempts: int = 10,
    dead_letters: str | None = None,
    handler_attempts: int = 1,
    entities_options: Mapping[str, Any] | None = None,
    dedup_options: Mapping[str, Any] | None = None,
    dispatcher_options: Mapping[str, Any] | None = None,
) -> DataFrame:
    """Process a DataFrame of messages exactly once; one result row per input row.

    A message is identified by its correlation id (the entity) and its id: the text
    of ``correlation_col`` and of ``id_col``, by one rule from the column's type
    (strings as they are, integers as digits, timestamps as UTC
    ``2026-01-01T00:00:00.000000Z``, ...; never the session time zone; see
    :func:`dedupstore.spark._columns.id_text`); any other type (double, boolean,
    ...) is a ``ConfigurationError`` naming the column.

    Rows are repartitioned by the correlation id so one entity's messages are
    handled by one task: over ``partitions`` tasks when given; by default over
    ``spark.sql.shuffle.partitions`` hash partitions, which adaptive query execution
    (``spark.sql.adaptive.enabled``, on by default) merges into fewer tasks when they
    hold little data, so a small input does not pay for 200 tasks each opening its
    clients (merging keeps every partition whole, so an entity stays in one task).
    Within a task, in this order: with ``order_col`` (a number,
    a date or a timestamp), by its value, null values last, ties by the message id's
    text (bytewise); without it, in input order, the order in which ``df``'s
    partitions hold the rows (after a shuffle upstream it can change between
    evaluations, so give ``order_col`` when order matters). Each task opens its own
    clients and runs :meth:`~dedupstore.outbox.OutboxProcessor.process_batch` over
    ``batch_size`` messages at a time. A message's body is a dict of its row's other
    columns (the order column included), as plain Python values: maps as dicts,
    timestamps as UTC ``datetime``s (the Spark page of the docs lists every type);
    ``headers_col``, a ``map<string,string>``, becomes its headers (null values
    left out). A batch that raises is re-run up to ``retries`` times (every step is
    restartable), then the task fails and Spark retries it; a killed task or a full
    re-run of the same input changes nothing further (their messages come out
    ``duplicate`` or ``redispatched``).

    A handler that raises (or returns something else than ``(dict, sends)``) fails
    the task with ``HandlerError`` naming the message and the entity, and is not
    re-run; with ``dead_letters`` (a destination of the dispatcher) such a message
    is set aside exactly once instead, after ``handler_attempts`` runs: its result
    row says ``dead_lettered`` with the ``error``, one dead-letter message carries it,
    and the rest of the batch, task and job go on (see
    :class:`~dedupstore.outbox.OutboxProcessor`).

    Lazy, like any transformation: every action on the result runs the processing
    again (harmlessly); write or cache it once. Result columns: :data:`PROCESS_SCHEMA`
    (``message_id`` and ``correlation_id`` are the texts above).

    Raises ``ConfigurationError`` before any I/O for a bad URL, option, column,
    column type or argument, or a column named ``__dedupstore_*``; tasks raise
    ``InvalidMessageId`` for a null or invalid id, naming its column.
    """
    return _processing(
        df,
        handler,
        None,
        entities_url=entities_url,
        dedup_url=dedup_url,
        dispatcher_url=dispatcher_url,
        cleanup=cleanup,
        id_col=id_col,
        correlation_col=correlation_col,
        order_col=order_col,
        headers_col=headers_col,
        batch_size=batch_size,
        partitions=partitions,
        retries=retries,
        max_attempts=max_attempts,
        dead_letters=dead_letters,
        handler_attempts=handler_attempts,
        entities_options=entities_options,
        dedup_options=dedup_options,
        dispatcher_options=dispatcher_options,
    )


def _processing(
    df: DataFrame,
    handler: Handler,
    journal: _Journal | None,
    *,
    entities_url: str,
    dedup_url: str,
    dispatcher_url: str | Callable[..., Any],
    cleanup: Cleanup,
    id_col: str,
    correlation_col: str,
    order_col: str | None,
    headers_col: str | None,
    batch_size: int,
    partitions: int | None,
    retries: int,
    max_attempts: int,
    dead_letters: str | None,
    handler_attempts: int,
    entities_options: Mapping[str, Any] | None,
    dedup_options: Mapping[str, Any] | None,
    dispatcher_options: Mapping[str, Any] | None,
) -> DataFrame:
    """:func:`process_messages`; with a ``journal``, each batch's record goes there."""
    if not callable(handler):
        raise ConfigurationError(f"handler must be callable, got {handler!r}")
    if cleanup not in ("inline", "deferred"):
        raise ConfigurationError(f"cleanup must be 'inline' or 'deferred', got {cleanup!r}")
    batch_size = _positive_int("batch_size", batch_size)
    retries = _positive_int("retries", retries, 0)
    max_attempts = _positive_int("max_attempts", max_attempts)
    handler_attempts = _positive_int("handler_attempts", handler_attempts)
    if dead_letters is not None:
        validate_name(dead_letters, "dead-letter destination")
    if partitions is not None:
        partitions = _positive_int("partitions", partitions)
    to_python, rows = _entity_ordered(
        df, id_col, correlation_col, order_col, headers_col, partitions
    )
    ents = ClientSpec.checked("entities", entities_url, entities_options)
    dedup = ClientSpec.checked("dedup", dedup_url, dedup_options)
    out = ClientSpec.checked("dispatcher", dispatcher_url, dispatcher_options)

    processor_options: dict[str, Any] = {
        "cleanup": cleanup,
        "max_attempts": max_attempts,
        "dead_letters": dead_letters,
        "handler_attempts": handler_attempts,
        "run": None if journal is None else journal.run,
        # a Spark task's Python worker: its collector is relaxed during each batch
        "gc_threshold": GC_BATCH_THRESHOLD,
    }

    def process_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        with TaskClients(ents, dedup, out) as task:
            step = _BatchRunner(task, handler, processor_options, retries, journal)
            pending: list[Message] = []
            for batch in batches:
                done: list[pa.RecordBatch] = []
                with gc_relaxed():  # an Arrow batch's rows, as processing them (not a yield)
                    pending.extend(rows.messages(batch, step.invalid if dead_letters else None))
                    while len(pending) >= batch_size:
                        done.append(step.run(pending[:batch_size]))
                        del pending[:batch_size]
                yield from done
            if pending:
                yield step.run(pending)

    use_this_python(df.sparkSession)  # a local master: the workers run this interpreter
    return to_python.mapInArrow(process_partition, PROCESS_SCHEMA)


def _entity_ordered(
    df: DataFrame,
    id_col: str,
    correlation_col: str,
    order_col: str | None,
    headers_col: str | None,
    partitions: int | None,
) -> tuple[DataFrame, _Rows]:
    """The plan of :func:`process_messages` up to its Python tasks (checked on the
    driver, no I/O): the rows by entity in the tasks' order, only the columns a task
    reads, and how a task turns them into messages."""
    schema = df.schema
    columns = schema.fieldNames()
    C.check_names(columns)
    texts = {
        C.ID: C.id_text(schema, "id_col", id_col),
        C.CID: C.id_text(schema, "correlation_col", correlation_col),
    }
    from pyspark.sql import functions as F

    seq = C.order_key(schema, order_col) if order_col is not None else None
    if headers_col is not None:
        C.check_headers(schema, headers_col)
    body_cols = [c for c in columns if c not in (id_col, correlation_col, headers_col)]
    rows = _Rows(id_col, correlation_col, order_col, headers_col, C.body_reader(schema, body_cols))

    ordered = df.withColumns(
        {**texts, C.SEQ: seq if seq is not None else F.monotonically_increasing_id()}
    )
    if partitions is None:
        # spark.sql.shuffle.partitions hash partitions, which adaptive execution (on by
        # default) merges into fewer tasks when they are small: it merges whole
        # partitions, never splits one, so an entity's rows stay in one task
        by_entity = ordered.repartition(F.col(C.CID))
    else:  # an explicit count: adaptive execution keeps it
        by_entity = ordered.repartition(partitions, F.col(C.CID))
    # sorted within the task's partition (merged or not): each entity's rows together, in order
    shuffled = by_entity.sortWithinPartitions(
        F.col(C.CID), F.col(C.SEQ).asc_nulls_last(), F.col(C.ID)
    )
    # only what the task reads crosses to Python (a projection keeps the sorted order)
    wanted = [C.ID, C.CID, *([headers_col] if headers_col else []), *body_cols]
    to_python = shuffled.select([C.column(c) for c in wanted])

    return to_python, rows


class _Rows:
    """Turns one Arrow row of a :func:`process_messages` task into a :class:`Message`."""

    def __init__(
        self,
        id_col: str,
        correlation_col: str,
        order_col: str | None,
        headers_col: str | None,
        body: C.BodyReader,
    ) -> None:
        self.id_col = id_col
        self.correlation_col = correlation_col
        self.order_col = order_col
        self.headers_col = headers_col
        self.body = body

    def messages(
        self, batch: pa.RecordBatch, invalid: dict[tuple[str, str], str] | None = None
    ) -> list[Message]:
        """The messages of an Arrow batch's rows, in order, as :meth:`message` makes them.

        Column by column: each column becomes Python values once (``to_pylist``), the
        bodies are zipped from them, and the ids are checked in one pass; when an id
        is null or not a plain valid id, every row goes through :meth:`message`.
        """
        names = batch.schema.names
        columns = {name: batch.column(i).to_pylist() for i, name in enumerate(names)}
        ids, cids = columns[C.ID], columns[C.CID]
        if not plain_ids(ids) or not plain_ids(cids):
            return [
                self.message({name: columns[name][i] for name in names}, invalid)
                for i in range(batch.num_rows)
            ]
        bodies = self.body.rows(columns, batch.num_rows)
        if self.headers_col:
            headers = [C.headers_of(value) for value in columns[self.headers_col]]
        else:
            headers = [{} for _ in ids]
        return list(map(Message, ids, cids, bodies, headers))

    def message(
        self, row: Mapping[str, Any], invalid: dict[tuple[str, str], str] | None = None
    ) -> Message:
        """The row's message; ``InvalidMessageId`` for a null or invalid id, naming its column.

        With ``invalid`` (the task has ``dead_letters``), an invalid row becomes a
        stand-in message to dead-letter instead: its id is ``invalid-row:`` and a
        digest of the row (the same row gives the same id on every run), its entity
        the row's correlation id when that is valid (else :data:`INVALID_ENTITY`), its
        body the row's columns and both raw ids; ``invalid`` maps it to the error.
        """
        body = self.body(row)
        mid, cid = row[C.ID], row[C.CID]
        where = ""  # the row's order value, to find a row whose id is null
        if (mid is None or cid is None) and self.order_col in body:
            where = f", {self.order_col} {body[self.order_col]!r:.80}"
        try:
            mid, cid = C.message_ids(mid, cid, self.id_col, self.correlation_col, where)
        except InvalidMessageId as exc:
            if invalid is None:
                raise
            return _stand_in(body, mid, cid, str(exc), invalid)
        headers = C.headers_of(row[self.headers_col]) if self.headers_col else {}
        return Message(id=mid, correlation_id=cid, body=body, headers=headers)


#: The entity that holds the dead letters of rows whose correlation id is invalid.
INVALID_ENTITY = "__dedupstore_invalid_rows__"


def _stand_in(
    body: dict[str, Any],
    mid: str | None,
    cid: str | None,
    error: str,
    invalid: dict[tuple[str, str], str],
) -> Message:
    """The message that stands for an invalid row, to be dead-lettered (see ``_Rows``)."""
    content = {"body": body, "id": mid, "correlation_id": cid}
    digest = hashlib.sha256(
        json.dumps(content, sort_keys=True, default=repr).encode("utf-8", "surrogatepass")
    ).hexdigest()[:32]
    entity = INVALID_ENTITY
    if cid is not None:
        with contextlib.suppress(InvalidMessageId):
            entity = validate_message_id(cid)
    message = Message(id=f"invalid-row:{digest}", correlation_id=entity, body=content)
    invalid[(message.correlation_id, message.id)] = error
    return message


class _BatchRunner:
    """Runs batches of one task through its processor, re-running a batch on a transient error."""

    def __init__(
        self,
        task: TaskClients,
        handler: Handler,
        options: Mapping[str, Any],
        retries: int,
        journal: _Journal | None = None,
    ) -> None:
        self._task = task
        self._journal = journal
        self._batches = 0  # batches of this task so far: part of each batch's name
        self._handler = handler
        self._options = dict(options)
        self._retries = retries
        self._processor: OutboxProcessor | None = None
        self._schema = to_arrow_schema(PROCESS_SCHEMA)
        #: stand-ins of invalid rows -> their error: dead-lettered, never handled
        self.invalid: dict[tuple[str, str], str] = {}

    def _guarded(self, state: dict[str, Any], message: Message) -> Any:
        error = self.invalid.get((message.correlation_id, message.id))
        if error is not None:
            raise InvalidMessageId(error)
        return self._handler(state, message)

    def _process(
        self, messages: list[Message], record: BeforeCleanup | None
    ) -> list[ProcessResult]:
        if self._processor is None:
            clients = self._task.get()
            assert clients.dispatcher is not None
            self._processor = OutboxProcessor(
                clients.entities,
                clients.dedup,
                clients.dispatcher,
                **self._options,
            )
        return self._processor.process_batch(messages, self._guarded, before_cleanup=record)

    def run(self, messages: list[Message]) -> pa.RecordBatch:
        """The batch's result rows (with a journal: as first recorded there)."""
        import pyarrow as pa

        self._batches += 1
        if self._journal is None:
            results, attempts = self._results(messages, None)
            return _result_batch(messages, results, attempts, self._schema)
        batch = self._journal.batch_name(messages, self._batches)
        recorded = self._journal.read(batch)
        rows = self._rows(messages, _Recorder(self._journal, batch, messages, recorded))
        rows = [recorded.get(position, row) for position, row in enumerate(rows)]
        for row in rows:
            row.pop("position", None)
        return pa.RecordBatch.from_pylist(rows, schema=self._schema)

    def _rows(self, messages: list[Message], record: _Recorder | None) -> list[dict[str, Any]]:
        results, attempts = self._results(messages, record)
        return [_row(m, r, attempts) for m, r in zip(messages, results, strict=True)]

    def _results(
        self, messages: list[Message], record: _Recorder | None
    ) -> tuple[list[ProcessResult], int]:
        """The batch's results, and the attempts it took (transient errors re-run it)."""
        results: list[ProcessResult] = []
        attempts = 0
        for attempt in Retrying(
            stop=stop_after_attempt(self._retries + 1),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception(_transient),
            reraise=True,
            before_sleep=lambda state: _retrying(state, len(messages)),
        ):
            with attempt:
                attempts += 1
                if record is not None:
                    record.batch_attempts = attempts
                results = self._process(messages, record)
        return results, attempts


def _result_batch(
    messages: list[Message], results: list[ProcessResult], attempts: int, schema: pa.Schema
) -> pa.RecordBatch:
    """The result rows of a batch (:data:`PROCESS_SCHEMA`, as :func:`_row` gives them),
    built column by column."""
    import pyarrow as pa

    columns = [
        [r.message_id for r in results],
        [m.correlation_id for m in messages],
        [r.outcome for r in results],
        [[o.id for o in r.outgoing] for r in results],
        [r.attempts for r in results],
        [attempts] * len(results),
        [r.error for r in results],
    ]
    arrays = [pa.array(values, type=f.type) for values, f in zip(columns, schema, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _row(message: Message, result: ProcessResult, batch_attempts: int) -> dict[str, Any]:
    """The result row of one message (:data:`PROCESS_SCHEMA`)."""
    return {
        "message_id": result.message_id,
        "correlation_id": message.correlation_id,
        "outcome": result.outcome,
        "outgoing_ids": [o.id for o in result.outgoing],
        "attempts": result.attempts,
        "batch_attempts": batch_attempts,
        "error": result.error,
    }


# ---------------------------------------------------------------------- the record of a run


def run_messages(
    df: DataFrame, handler: Handler, *, results_path: str, **options: Any
) -> DataFrame:
    """Process ``df`` now, once, and return its exact record, read from ``results_path``.

    The eager form of :func:`process_messages` (same ``options``, same rules): the
    processing runs once, when called; each task writes the result rows of each of
    its batches to ``results_path`` as Parquet (under ``batch=<digest>``, with the
    row's ``position`` in its batch) after their outgoing messages are dispatched
    and before any clean-up, and a retried task, a task that crashed or a re-run of
    the same call keeps what was written first. So the record does not depend on
    which attempt of a task got through: a message this run applied says
    ``processed`` (or ``dead_lettered``, with its error) even when a crashed attempt
    applied it; ``duplicate`` and ``redispatched`` mean applied before this run. The
    run is named after ``results_path``: a call that failed (a task out of retries,
    the driver gone) is finished by calling again with the same path, which keeps
    every batch already recorded. Returns ``spark.read`` of the record
    (:data:`PROCESS_SCHEMA` columns); read it as often as you like, nothing runs
    again. ``results_path`` is any path or URI that both the driver and the
    executors reach through ``pyarrow.fs`` (a local or shared directory, ``hdfs://``,
    ``s3://``, ``gs://``).

    Exact for this run's own task attempts and re-runs. One gap: should another
    consumer clean up the entry of a message this run applied in an attempt that
    crashed before recording it (a sweep with ``redispatch``, the same message in
    another job), the retry records it ``redispatched`` or ``duplicate``.

    Raises ``ConfigurationError`` (what :func:`process_messages` raises, an unknown
    option, a ``results_path`` that holds a finished run: ``_SUCCESS``) before any
    I/O on the stores, and through Spark what a task raised.
    """
    journal = _Journal.at(results_path)
    if journal.finished():
        raise ConfigurationError(
            f"results_path {results_path!r} holds a finished run (_SUCCESS): read it with "
            "spark.read.parquet, or give a new path"
        )
    _run_journaled(df, handler, journal, options)
    return _read_record(df.sparkSession, results_path)


def _run_journaled(
    df: DataFrame, handler: Handler, journal: _Journal, options: Mapping[str, Any]
) -> None:
    """Run the processing of ``df`` into ``journal`` and mark it finished."""
    import inspect

    try:
        bound = inspect.signature(process_messages).bind(df, handler, **options)
    except TypeError as exc:
        raise ConfigurationError(f"run_messages: {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["df"], arguments["handler"]
    plan = _processing(df, handler, journal, **arguments)
    plan.groupBy().count().collect()  # every task runs; what they return is in the journal
    journal.finish()


def _read_record(spark: SparkSession, path: str) -> DataFrame:
    """The record at ``path`` (:data:`PROCESS_SCHEMA` columns)."""
    from pyspark.sql.types import StringType as S

    schema = StructType([*RECORD_SCHEMA.fields, StructField("batch", S())])
    return spark.read.schema(schema).parquet(path).select(PROCESS_SCHEMA.fieldNames())


class _Journal:
    """Where the tasks of :func:`run_messages` record each batch, once (Parquet files)."""

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/") or path
        digest = hashlib.sha256(self.path.encode("utf-8", "surrogatepass")).hexdigest()
        #: the processor's ``run``: the same for every attempt, call and re-run
        self.run = f"run-{digest[:32]}"
        self._fs: Any = None
        self._base = ""

    @classmethod
    def at(cls, path: str) -> _Journal:
        """The journal at ``path``; ``ConfigurationError`` for a path pyarrow cannot open."""
        if not isinstance(path, str) or not path:
            raise ConfigurationError(f"results_path must be a non-empty path, got {path!r}")
        journal = cls(path)
        try:
            journal._filesystem()
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"results_path {path!r}: {exc}") from None
        return journal

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "run": self.run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None:
            from pyarrow import fs

            if "://" in self.path:
                self._fs, self._base = fs.FileSystem.from_uri(self.path)
            else:
                import os

                self._fs, self._base = fs.LocalFileSystem(), os.path.abspath(self.path)
        return self._fs, self._base

    def finished(self) -> bool:
        """Whether a run completed here (its ``_SUCCESS`` file exists)."""
        from pyarrow import fs

        filesystem, base = self._filesystem()
        return bool(filesystem.get_file_info(f"{base}/_SUCCESS").type == fs.FileType.File)

    def finish(self) -> None:
        """Mark the run complete."""
        filesystem, base = self._filesystem()
        filesystem.create_dir(base, recursive=True)
        with filesystem.open_output_stream(f"{base}/_SUCCESS") as out:
            out.write(b"")

    def batch_name(self, messages: Sequence[Message], number: int) -> str:
        """A name for a task's ``number``-th batch, the same in every attempt of the task."""
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        digest = hashlib.sha256(f"{partition}:{number}".encode())
        for m in messages:
            digest.update(b"\0" + message_key(m.correlation_id, m.id).encode("utf-8", "replace"))
        return digest.hexdigest()[:32]

    def read(self, batch: str) -> dict[int, dict[str, Any]]:
        """The rows recorded for ``batch``, by position."""
        import pyarrow.parquet as pq
        from pyarrow import fs

        filesystem, base = self._filesystem()
        selector = fs.FileSelector(f"{base}/batch={batch}", allow_not_found=True)
        rows: dict[int, dict[str, Any]] = {}
        for info in sorted(filesystem.get_file_info(selector), key=lambda i: i.path):
            if info.is_file and info.base_name.startswith("part-"):
                for row in pq.read_table(info.path, filesystem=filesystem).to_pylist():
                    rows.setdefault(row["position"], row)
        return rows

    def write(self, batch: str, rows: list[dict[str, Any]]) -> None:
        """Record ``rows`` (with their ``position``) of ``batch`` in one file, atomically."""
        import uuid

        import pyarrow as pa
        import pyarrow.parquet as pq

        filesystem, base = self._filesystem()
        directory = f"{base}/batch={batch}"
        filesystem.create_dir(directory, recursive=True)
        positions = ",".join(str(row["position"]) for row in rows)
        name = hashlib.sha256(positions.encode()).hexdigest()[:16]
        table = pa.Table.from_pylist(rows, schema=to_arrow_schema(RECORD_SCHEMA))
        temporary = f"{directory}/_writing-{uuid.uuid4().hex}"
        pq.write_table(table, temporary, filesystem=filesystem)
        filesystem.move(temporary, f"{directory}/part-{name}.parquet")


class _Recorder:
    """The ``before_cleanup`` of one batch of :func:`run_messages`: records what is new."""

    def __init__(
        self,
        journal: _Journal,
        batch: str,
        messages: Sequence[Message],
        recorded: dict[int, dict[str, Any]],
    ) -> None:
        self._journal = journal
        self._batch = batch
        self._positions: dict[int, list[int]] = {}
        for position, message in enumerate(messages):
            self._positions.setdefault(id(message), []).append(position)
        self._recorded = recorded
        self.batch_attempts = 1

    def __call__(self, messages: Sequence[Message], results: Sequence[ProcessResult]) -> None:
        taken: dict[int, int] = {}
        rows: list[dict[str, Any]] = []
        for message, result in zip(messages, results, strict=True):
            n = taken.get(id(message), 0)
            taken[id(message)] = n + 1
            position = self._positions[id(message)][n]
            if position not in self._recorded:
                rows.append({**_row(message, result, self.batch_attempts), "position": position})
        if rows:
            self._journal.write(self._batch, rows)
            for row in rows:
                self._recorded[row["position"]] = row


# ---------------------------------------------------------------------- streaming


def process_stream(
    stream_df: DataFrame,
    handler: Handler,
    *,
    checkpoint: str,
    results_path: str | None = None,
    trigger: Mapping[str, Any] | None = None,
    query_name: str | None = None,
    **options: Any,
) -> StreamingQuery:
    """Start a streaming query that runs :func:`process_messages` on every micro-batch.

    ``checkpoint`` is the query's checkpoint location: after a stop or a crash the
    query restarts from it, and the micro-batch that was in flight is replayed,
    which is harmless (its messages come out ``duplicate`` or ``redispatched``).
    Without ``results_path`` the result rows are only counted.
    ``trigger`` is passed to ``DataStreamWriter.trigger`` (e.g.
    ``{"availableNow": True}``); ``options`` are those of :func:`process_messages`,
    checked now, by the same column rules, before the query starts. Returns the
    started query.

    With ``results_path`` each micro-batch is run as :func:`run_messages` into
    ``results_path/batch_id=<n>``: an exact record of what the micro-batch did, kept
    as first written when the micro-batch is replayed after a crash (a replayed
    micro-batch whose record is finished is not run again). Read it with
    ``spark.read.parquet(results_path)`` (``batch_id`` comes from the directories).

    Order (``order_col``, or input order) holds within one micro-batch only: across
    micro-batches, an entity's messages are processed in the order the micro-batches
    run, whatever their ``order_col`` values.
    """
    if not isinstance(checkpoint, str) or not checkpoint:
        raise ConfigurationError(f"checkpoint must be a non-empty path, got {checkpoint!r}")
    if not stream_df.isStreaming:
        raise ConfigurationError("process_stream needs a streaming DataFrame (spark.readStream)")
    process_messages(stream_df, handler, **options)  # checks every argument, no I/O

    if results_path is not None:
        _Journal.at(results_path)  # checked now

    def each_batch(batch_df: DataFrame, batch_id: int) -> None:
        if results_path is None:
            process_messages(batch_df, handler, **options).groupBy("outcome").count().collect()
            return
        journal = _Journal.at(f"{results_path.rstrip('/')}/batch_id={batch_id}")
        if not journal.finished():
            _run_journaled(batch_df, handler, journal, options)

    writer = stream_df.writeStream.foreachBatch(each_batch).option("checkpointLocation", checkpoint)
    if trigger:
        writer = writer.trigger(**trigger)
    if query_name:
        writer = writer.queryName(query_name)
    return writer.start()


# ---------------------------------------------------------------------- drop processed


def drop_processed(
    df: DataFrame,
    dedup_url: str,
    id_col: str = "id",
    correlation_col: str = "correlation_id",
    *,
    dedup_options: Mapping[str, Any] | None = None,
    entities_url: str | None = None,
    entities_options: Mapping[str, Any] | None = None,
) -> DataFrame:
    """``df`` without the rows whose message is recorded in the deduplication store.

    Under deferred clean-up a processed message's id waits in its entity's outbox
    until the sweep moves it: without ``entities_url`` such a row is kept (read only
    the deduplication store after a sweep). With it, a row whose id is in its entity's
    outbox is dropped too (:func:`dedupstore.outbox.applied_among`: one ``load_many``
    of the batch's entities, then one ``processed_among``; an entity recorded for
    another consumer than the store's endpoint fails the task with
    ``ConfigurationError``).

    A row's message is ``message_key(correlation id, message id)``, the key
    :class:`~dedupstore.outbox.OutboxProcessor` records, the two ids being the texts
    of ``correlation_col`` and ``id_col`` by the same rule as in
    :func:`process_messages` (so a row it processed is dropped here, under any
    session time zone). Only those two texts cross to Python, through a pandas UDF:
    one ``processed_among`` per Arrow batch of a partition (the store splits it into
    its own chunks); the other columns, of any type, stay in the JVM. Lazy; same
    schema as ``df``. A store that cannot answer fails the task: a row is never kept
    or dropped on a guess. Raises ``ConfigurationError`` before any I/O (a missing
    column, a refused id type, a column named ``__dedupstore_*``); tasks raise
    ``InvalidMessageId`` for a null or invalid id, naming its column.
    """
    from pyspark.sql import functions as F

    schema = df.schema
    C.check_names(schema.fieldNames(), repeated=())
    mid = C.id_text(schema, "id_col", id_col)
    cid = C.id_text(schema, "correlation_col", correlation_col)
    dedup = ClientSpec.checked("dedup", dedup_url, dedup_options)
    ents = (
        None
        if entities_url is None
        else ClientSpec.checked("entities", entities_url, entities_options)
    )
    processed = _processed_udf(dedup, id_col, correlation_col, ents)
    use_this_python(df.sparkSession)  # a local master: the workers run this interpreter
    return df.withColumn(C.DONE, processed(mid, cid)).where(~F.col(C.DONE)).drop(F.col(C.DONE))


def _processed_udf(
    dedup: ClientSpec, id_col: str, correlation_col: str, entities: ClientSpec | None = None
) -> Any:
    """A nondeterministic pandas UDF (iterator of batches): (message id, correlation id) -> done."""
    import pandas as pd  # type: ignore[import-untyped]
    from pyspark.sql.pandas.functions import pandas_udf

    def processed(batches: Any) -> Any:
        pairs = ((mids.tolist(), cids.tolist()) for mids, cids in batches)
        for flags in _processed_flags(pairs, dedup, id_col, correlation_col, entities):
            yield pd.Series(flags, dtype=bool)

    # real types, not the strings of `from __future__ import annotations`: pandas_udf
    # reads them to know it is an iterator UDF
    processed.__annotations__ = {
        "batches": Iterator[tuple[pd.Series, pd.Series]],
        "return": Iterator[pd.Series],
    }
    make: Any = pandas_udf  # its overloads know no iterator UDF built from hints
    return make(processed, BooleanType()).asNondeterministic()


def _processed_flags(
    batches: Iterable[tuple[Sequence[str | None], Sequence[str | None]]],
    dedup: ClientSpec,
    id_col: str,
    correlation_col: str,
    entities: ClientSpec | None = None,
) -> Iterator[list[bool]]:
    """One task of :func:`drop_processed`: one ``processed_among`` per non-empty batch
    (with ``entities``, :func:`~dedupstore.outbox.applied_among`)."""
    with TaskClients(entities, dedup) as task:
        for mids, cids in batches:
            if not mids:
                yield []
                continue
            ids = [
                C.message_ids(m, c, id_col, correlation_col)
                for m, c in zip(mids, cids, strict=True)
            ]
            clients = task.get()
            if entities is not None:
                applied = applied_among(clients.entities, clients.dedup, [(c, m) for m, c in ids])
                yield [(cid, mid) in applied for mid, cid in ids]
                continue
            keys = [message_key(cid, mid) for mid, cid in ids]
            done = clients.dedup.processed_among(keys)
            yield [key in done for key in keys]
