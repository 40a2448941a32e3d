"""The result rows of ``process_messages`` and the record of a ``run_messages`` run.

A run's record is Parquet files under its ``results_path``, one directory per batch
(``batch=<digest>``), written through ``pyarrow.fs`` by the tasks and read back by
the driver; what a batch recorded first is kept by every later attempt.
"""

from __future__ import annotations

import functools
import hashlib
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import ArrayType, IntegerType, StringType, StructField, StructType

from dedupstore.errors import ConfigurationError
from dedupstore.ids import message_key
from dedupstore.outbox import Message, ProcessResult

from ._columns import schema

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

#: One row per message of :func:`process_messages`.
PROCESS_SCHEMA = schema(
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


def result_row(message: Message, result: ProcessResult, batch_attempts: int) -> dict[str, Any]:
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


def result_batch(
    messages: list[Message], results: list[ProcessResult], attempts: int, schema: pa.Schema
) -> pa.RecordBatch:
    """The result rows of a batch (as :func:`result_row` gives them), built column by column."""
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


def read_record(spark: SparkSession, path: str) -> DataFrame:
    """The record at ``path`` (:data:`PROCESS_SCHEMA` columns)."""
    files = StructType([*RECORD_SCHEMA.fields, StructField("batch", StringType())])
    return spark.read.schema(files).parquet(path).select(PROCESS_SCHEMA.fieldNames())


class Journal:
    """Where the tasks of :func:`run_messages` record each batch, once (Parquet files)."""

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/") or path
        digest = hashlib.sha256(self.path.encode("utf-8", "surrogatepass")).hexdigest()
        #: the processor's ``run``: the same for every attempt, call and re-run
        self.run = f"run-{digest[:32]}"

    @classmethod
    def at(cls, path: str) -> Journal:
        """The journal at ``path``; ``ConfigurationError`` for a path pyarrow cannot open."""
        if not isinstance(path, str) or not path:
            raise ConfigurationError(f"results_path must be a non-empty path, got {path!r}")
        journal = cls(path)
        try:
            _ = journal._filesystem  # opened now: a path pyarrow cannot open is refused here
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"results_path {path!r}: {exc}") from None
        return journal

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "run": self.run}  # each process opens its own filesystem

    @property
    def filesystem(self) -> tuple[Any, str]:
        """The run directory's ``pyarrow`` filesystem and its path there."""
        return self._filesystem

    @functools.cached_property
    def _filesystem(self) -> tuple[Any, str]:
        from pyarrow import fs

        if "://" in self.path:
            found: tuple[Any, str] = fs.FileSystem.from_uri(self.path)
            return found
        return fs.LocalFileSystem(), os.path.abspath(self.path)

    def finished(self) -> bool:
        """Whether a run completed here (its ``_SUCCESS`` file exists)."""
        from pyarrow import fs

        filesystem, base = self._filesystem
        return bool(filesystem.get_file_info(f"{base}/_SUCCESS").type == fs.FileType.File)

    def finish(self) -> None:
        """Mark the run complete."""
        filesystem, base = self._filesystem
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

        filesystem, base = self._filesystem
        selector = fs.FileSelector(f"{base}/batch={batch}", allow_not_found=True)
        rows: dict[int, dict[str, Any]] = {}
        for info in sorted(filesystem.get_file_info(selector), key=lambda i: i.path):
            if info.is_file and info.base_name.startswith("part-"):
                for row in pq.read_table(info.path, filesystem=filesystem).to_pylist():
                    rows.setdefault(row["position"], row)
        return rows

    def write(self, batch: str, rows: list[dict[str, Any]]) -> None:
        """Record ``rows`` (with their ``position``) of ``batch`` in one file, atomically."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        filesystem, base = self._filesystem
        directory = f"{base}/batch={batch}"
        filesystem.create_dir(directory, recursive=True)
        positions = ",".join(str(row["position"]) for row in rows)
        name = hashlib.sha256(positions.encode()).hexdigest()[:16]
        table = pa.Table.from_pylist(rows, schema=to_arrow_schema(RECORD_SCHEMA))
        temporary = f"{directory}/_writing-{uuid.uuid4().hex}"
        pq.write_table(table, temporary, filesystem=filesystem)
        filesystem.move(temporary, f"{directory}/part-{name}.parquet")


class Recorder:
    """The ``before_cleanup`` of one batch of :func:`run_messages`: records what is new."""

    def __init__(
        self,
        journal: Journal,
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
                rows.append(
                    {**result_row(message, result, self.batch_attempts), "position": position}
                )
        if rows:
            self._journal.write(self._batch, rows)
            for row in rows:
                self._recorded[row["position"]] = row
