"""The processing jobs: ``process_messages``, ``run_messages`` and ``process_stream``.

DataFrame APIs only (``mapInArrow``, ``repartition``, ``foreachBatch``), so they run
on a classic session and on Spark Connect alike; each task opens its own clients from
URLs checked on the driver (``_clients``); columns are read by the rules of
``_columns``. The other jobs' public names are re-exported here: the sweep
(``_sweep``), ``drop_processed`` (``_drop``) and the result schemas (``_record``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal

from pyspark.sql.pandas.types import to_arrow_schema
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
from dedupstore.ids import validate_name
from dedupstore.outbox import Handler, Message, OutboxProcessor, ProcessResult
from dedupstore.outbox.tokened import check_subscriptions

from . import _columns as C
from ._clients import ClientSpec, TaskClients, positive_int
from ._drop import drop_processed
from ._mint import MINT_SCHEMA, mint_tokens
from ._record import (
    PROCESS_SCHEMA,
    RECORD_SCHEMA,
    Journal,
    Recorder,
    read_record,
    result_batch,
    result_row,
)
from ._sweep import SWEEP_SCHEMA, sweep_outboxes
from .session import use_this_python

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.query import StreamingQuery

_log = logging.getLogger(__name__)

__all__ = [
    "MINT_SCHEMA",
    "PROCESS_SCHEMA",
    "RECORD_SCHEMA",
    "SWEEP_SCHEMA",
    "drop_processed",
    "mint_tokens",
    "process_messages",
    "process_stream",
    "run_messages",
    "sweep_outboxes",
]

Cleanup = Literal["inline", "deferred"]

#: The journal of the :func:`run_messages` call whose plan is being built, if any.
_JOURNAL: ContextVar[Journal | None] = ContextVar("_JOURNAL", default=None)


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
    tokens_url: str | None = None,
    tokens_options: Mapping[str, Any] | None = None,
    subscriptions: Mapping[str, Sequence[str]] | None = None,
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
    (``spark.sql.adaptive.enabled``, on by default) merges, whole, into fewer tasks
    when they hold little data (an entity stays in one task, and a small input does
    not open 200 tasks' clients).
    Within a task, with ``order_col`` (a number, a date or a timestamp), by its
    value, nulls last, ties by the message id's text (bytewise); without it, in the
    order in which ``df``'s partitions hold the rows (a shuffle upstream can change
    it between evaluations: give ``order_col`` when order matters). Each task runs
    :meth:`~dedupstore.outbox.OutboxProcessor.process_batch` over ``batch_size``
    messages at a time. A message's body is a dict of its row's other columns (the
    order column included) as plain Python values: maps as dicts, timestamps as UTC
    ``datetime`` objects (the Spark page of the docs lists every type);
    ``headers_col``, a ``map<string,string>``, becomes its headers (null values left
    out). A batch that raises is re-run up to ``retries`` times (every step is
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

    Token mode (see the Token mode page): with ``tokens_url``, the token store, a
    row whose ``headers_col`` carries a ``dedupstore-token`` (for example from
    :func:`mint_tokens`) is processed only while its token exists, and consumes it;
    rows without one go through the deduplication store (a hybrid job).
    ``subscriptions`` (destination -> receiving endpoints, needs ``tokens_url``)
    mints a token per receiver for every outgoing message to those destinations.

    Lazy, like any transformation: every action on the result runs the processing
    again (harmlessly); write or cache it once. Result columns: :data:`PROCESS_SCHEMA`
    (``message_id`` and ``correlation_id`` are the texts above).

    Raises ``ConfigurationError`` before any I/O for a bad URL, option, column,
    column type or argument, or a column named ``__dedupstore_*``; tasks raise
    ``InvalidMessageId`` for a null or invalid id, naming its column.
    """
    if subscriptions is not None and tokens_url is None:
        raise ConfigurationError("subscriptions need tokens_url (the token store to mint in)")
    subscribed = check_subscriptions(subscriptions)
    if not callable(handler):
        raise ConfigurationError(f"handler must be callable, got {handler!r}")
    if cleanup not in ("inline", "deferred"):
        raise ConfigurationError(f"cleanup must be 'inline' or 'deferred', got {cleanup!r}")
    batch_size = positive_int("batch_size", batch_size)
    retries = positive_int("retries", retries, 0)
    max_attempts = positive_int("max_attempts", max_attempts)
    handler_attempts = positive_int("handler_attempts", handler_attempts)
    if dead_letters is not None:
        validate_name(dead_letters, "dead-letter destination")
    if partitions is not None:
        partitions = positive_int("partitions", partitions)
    to_python, rows = _entity_ordered(
        df, id_col, correlation_col, order_col, headers_col, partitions
    )
    ents = ClientSpec.checked("entities", entities_url, entities_options)
    dedup = ClientSpec.checked("dedup", dedup_url, dedup_options)
    out = ClientSpec.checked("dispatcher", dispatcher_url, dispatcher_options)
    tokens = (
        None if tokens_url is None else ClientSpec.checked("tokens", tokens_url, tokens_options)
    )

    journal = _JOURNAL.get()  # run_messages: each batch's record goes there
    processor_options: dict[str, Any] = {
        "cleanup": cleanup,
        "max_attempts": max_attempts,
        "dead_letters": dead_letters,
        "handler_attempts": handler_attempts,
        "subscriptions": subscribed or None,
        "run": None if journal is None else journal.run,
        # a Spark task's Python worker: its collector is relaxed during each batch
        "gc_threshold": GC_BATCH_THRESHOLD,
    }

    def process_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        with TaskClients(ents, dedup, out, tokens) as task:
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
) -> tuple[DataFrame, C.Rows]:
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
    rows = C.Rows(id_col, correlation_col, order_col, headers_col, C.body_reader(schema, body_cols))

    ordered = df.withColumns(
        {**texts, C.SEQ: seq if seq is not None else F.monotonically_increasing_id()}
    )
    if partitions is None:  # adaptive execution may merge them, whole: an entity stays in one task
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


class _BatchRunner:
    """Runs batches of one task through its processor, re-running a batch on a transient error."""

    def __init__(
        self,
        task: TaskClients,
        handler: Handler,
        options: Mapping[str, Any],
        retries: int,
        journal: Journal | None = None,
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

    def _process(self, messages: list[Message], record: Recorder | None) -> list[ProcessResult]:
        if self._processor is None:
            clients = self._task.get()
            assert clients.dispatcher is not None
            self._processor = OutboxProcessor(
                clients.entities,
                clients.dedup,
                clients.dispatcher,
                tokens=clients.tokens,
                **self._options,
            )
        return self._processor.process_batch(messages, self._guarded, before_cleanup=record)

    def run(self, messages: list[Message]) -> pa.RecordBatch:
        """The batch's result rows (with a journal: as first recorded there)."""
        import pyarrow as pa

        self._batches += 1
        if self._journal is None:
            results, attempts = self._results(messages, None)
            return result_batch(messages, results, attempts, self._schema)
        batch = self._journal.batch_name(messages, self._batches)
        recorded = self._journal.read(batch)
        record = Recorder(self._journal, batch, messages, recorded)
        results, attempts = self._results(messages, record)
        rows = [
            recorded.get(position, result_row(m, r, attempts))
            for position, (m, r) in enumerate(zip(messages, results, strict=True))
        ]
        for row in rows:
            row.pop("position", None)
        return pa.RecordBatch.from_pylist(rows, schema=self._schema)

    def _results(
        self, messages: list[Message], record: Recorder | None
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


def run_messages(
    df: DataFrame, handler: Handler, *, results_path: str, **options: Any
) -> DataFrame:
    """Process ``df`` now, once, and return its exact record, read from ``results_path``.

    The eager form of :func:`process_messages` (same ``options``, same rules): the
    processing runs once, when called; each task writes the result rows of each of
    its batches to ``results_path`` as Parquet (under ``batch=<digest>``, with the
    row's ``position`` in its batch) after their outgoing messages are dispatched
    and before any clean-up, and a retried task, a crashed one or a re-run of the
    same call keeps what was written first. So the record does not depend on which
    attempt got through: a message this run applied says ``processed`` (or
    ``dead_lettered``, with its error) even when a crashed attempt applied it;
    ``duplicate`` and ``redispatched`` mean applied before this run. The run is
    named after ``results_path``: a call that failed (a task out of retries, the
    driver gone) is finished by calling again with the same path. Returns
    ``spark.read`` of the record (:data:`PROCESS_SCHEMA` columns): reading it runs
    nothing again. ``results_path`` is any path or URI that the driver and the
    executors reach through ``pyarrow.fs`` (a local or shared directory,
    ``hdfs://``, ``s3://``, ``gs://``).

    Exact for this run's own task attempts and re-runs. One gap: should another
    consumer clean up the entry of a message this run applied in an attempt that
    crashed before recording it (a sweep with ``redispatch``, the same message in
    another job), the retry records it ``redispatched`` or ``duplicate``.

    Raises ``ConfigurationError`` (what :func:`process_messages` raises, an unknown
    option, a ``results_path`` that holds a finished run: ``_SUCCESS``) before any
    I/O on the stores, and through Spark what a task raised.
    """
    journal = Journal.at(results_path)
    if journal.finished():
        raise ConfigurationError(
            f"results_path {results_path!r} holds a finished run (_SUCCESS): read it with "
            "spark.read.parquet, or give a new path"
        )
    _run_journaled(df, handler, journal, options)
    return read_record(df.sparkSession, results_path)


def _run_journaled(
    df: DataFrame, handler: Handler, journal: Journal, options: Mapping[str, Any]
) -> None:
    """Run the processing of ``df`` into ``journal`` and mark it finished."""
    try:
        inspect.signature(process_messages).bind(df, handler, **options)
    except TypeError as exc:
        raise ConfigurationError(f"run_messages: {exc}") from None
    token = _JOURNAL.set(journal)
    try:
        plan = process_messages(df, handler, **options)
    finally:
        _JOURNAL.reset(token)
    plan.groupBy().count().collect()  # every task runs; what they return is in the journal
    journal.finish()


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
    harmlessly (its messages come out ``duplicate`` or ``redispatched``). ``trigger``
    goes to ``DataStreamWriter.trigger`` (e.g. ``{"availableNow": True}``);
    ``options`` are those of :func:`process_messages`, checked before the query
    starts (``ConfigurationError``). Returns the started query. Without
    ``results_path`` the result rows are only counted.

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
        Journal.at(results_path)  # checked now

    def each_batch(batch_df: DataFrame, batch_id: int) -> None:
        if results_path is None:
            process_messages(batch_df, handler, **options).groupBy("outcome").count().collect()
            return
        journal = Journal.at(f"{results_path.rstrip('/')}/batch_id={batch_id}")
        if not journal.finished():
            _run_journaled(batch_df, handler, journal, options)

    writer = stream_df.writeStream.foreachBatch(each_batch).option("checkpointLocation", checkpoint)
    if trigger:
        writer = writer.trigger(**trigger)
    if query_name:
        writer = writer.queryName(query_name)
    return writer.start()
