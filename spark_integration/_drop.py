"""``drop_processed``: a DataFrame's rows whose message is not recorded yet."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.types import BooleanType

from dedupstore.errors import ConfigurationError
from dedupstore.outbox import applied_among, recorded_among
from dedupstore.tokens import TOKEN_HEADER, token_id, validate_nonce

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
    headers_col: str | None = None,
    tokens_url: str | None = None,
    tokens_options: Mapping[str, Any] | None = None,
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

    Token mode: with ``headers_col`` and ``tokens_url``, a row whose headers carry a
    ``dedupstore-token`` is dropped when its token for the store's endpoint is gone
    (consumed, or exchanged for a dead letter's: the processor would drop it too) or,
    with ``entities_url``, when its id is in its entity's outbox; the deduplication
    store is not asked about it. ``headers_col`` without ``tokens_url`` is a
    ``ConfigurationError`` (such rows cannot be told apart otherwise).
    """
    from pyspark.sql import functions as F

    schema = df.schema
    C.check_names(schema.fieldNames(), repeated=())
    mid = C.id_text(schema, "id_col", id_col)
    cid = C.id_text(schema, "correlation_col", correlation_col)
    if (headers_col is None) != (tokens_url is None):
        raise ConfigurationError("drop_processed: headers_col and tokens_url go together")
    dedup = ClientSpec.checked("dedup", dedup_url, dedup_options)
    ents = (
        None
        if entities_url is None
        else ClientSpec.checked("entities", entities_url, entities_options)
    )
    tokens = None
    nonce = F.lit(None).cast("string")
    if headers_col is not None and tokens_url is not None:
        C.check_headers(schema, headers_col)
        tokens = ClientSpec.checked("tokens", tokens_url, tokens_options)
        nonce = F.col(headers_col).getItem(TOKEN_HEADER)
    processed = _processed_udf(dedup, id_col, correlation_col, ents, tokens)
    use_this_python(df.sparkSession)  # a local master: the workers run this interpreter
    done = processed(mid, cid, nonce)
    return df.withColumn(C.DONE, done).where(~F.col(C.DONE)).drop(F.col(C.DONE))


def _processed_udf(
    dedup: ClientSpec,
    id_col: str,
    correlation_col: str,
    entities: ClientSpec | None = None,
    tokens: ClientSpec | None = None,
) -> Any:
    """A nondeterministic pandas UDF (iterator of batches): (message id, correlation id,
    token nonce or null) -> done."""
    import pandas as pd  # type: ignore[import-untyped]
    from pyspark.sql.pandas.functions import pandas_udf

    def processed(batches: Any) -> Any:
        rows = ((m.tolist(), c.tolist(), n.tolist()) for m, c, n in batches)
        for flags in _processed_flags(rows, dedup, id_col, correlation_col, entities, tokens):
            yield pd.Series(flags, dtype=bool)

    # real types, not the strings of `from __future__ import annotations`: pandas_udf
    # reads them to know it is an iterator UDF
    processed.__annotations__ = {
        "batches": Iterator[tuple[pd.Series, pd.Series, pd.Series]],
        "return": Iterator[pd.Series],
    }
    make: Any = pandas_udf  # its overloads know no iterator UDF built from hints
    return make(processed, BooleanType()).asNondeterministic()


def _processed_flags(
    batches: Iterable[tuple[Sequence[str | None], Sequence[str | None], Sequence[str | None]]],
    dedup: ClientSpec,
    id_col: str,
    correlation_col: str,
    entities: ClientSpec | None = None,
    tokens: ClientSpec | None = None,
) -> Iterator[list[bool]]:
    """One task of :func:`drop_processed`: per non-empty batch (message ids, correlation
    ids, the rows' token nonces or None), :func:`~dedupstore.outbox.applied_among` with
    ``entities``, else :func:`~dedupstore.outbox.recorded_among`: one read per store."""
    with TaskClients(entities, dedup, tokens=tokens) as task:
        for mids, cids, nonces in batches:
            if not mids:
                yield []
                continue
            ids = [
                C.message_ids(m, c, id_col, correlation_col)
                for m, c in zip(mids, cids, strict=True)
            ]
            carried = {  # checked before any I/O
                (cid, mid): validate_nonce(nonce, mid)
                for (mid, cid), nonce in zip(ids, nonces, strict=True)
                if tokens is not None and nonce is not None
            }
            clients = task.get()
            endpoint = clients.dedup.endpoint
            token_ids = {pair: token_id(pair[1], endpoint, n) for pair, n in carried.items()}
            pairs = [(cid, mid) for mid, cid in ids]
            if entities is not None:
                applied = applied_among(
                    clients.entities,
                    clients.dedup,
                    pairs,
                    tokens=clients.tokens,
                    token_ids=token_ids,
                )
            else:
                applied = recorded_among(
                    clients.dedup, pairs, tokens=clients.tokens, token_ids=token_ids
                )
            yield [pair in applied for pair in pairs]
