"""``drop_processed``: a DataFrame's rows whose message is not recorded yet."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.types import BooleanType

from dedupstore.ids import message_key
from dedupstore.outbox import applied_among

from . import _columns as C
from ._clients import ClientSpec, TaskClients
from .session import use_this_python

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


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
    the deduplication store after a sweep); with it, it is dropped too
    (:func:`dedupstore.outbox.applied_among`: one ``load_many`` of the batch's
    entities, then one ``processed_among``; an entity recorded for another consumer
    than the store's endpoint fails the task with ``ConfigurationError``).

    A row's message is ``message_key(correlation id, message id)``, the key
    :class:`~dedupstore.outbox.OutboxProcessor` records, of the texts of
    ``correlation_col`` and ``id_col`` by the rule of :func:`process_messages` (so a
    row it processed is dropped here, under any session time zone). Only those two
    texts cross to Python, through a pandas UDF: one ``processed_among`` per Arrow
    batch of a partition; the other columns, of any type, stay in the JVM. Lazy;
    same schema as ``df``. A store that cannot answer fails the task: a row is never
    kept or dropped on a guess. Raises ``ConfigurationError`` before any I/O (a
    missing column, a refused id type, a column named ``__dedupstore_*``); tasks
    raise ``InvalidMessageId`` for a null or invalid id, naming its column.
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
