"""``mint_tokens``: the ingest step of token mode, at the boundary of a Spark job.

A producer outside the protocol (files, a table, a topic of another system) cannot
mint tokens. This step mints them for a DataFrame's rows, once per *mint run*: a
run is named by its ``results_path``, each row's nonce is a hash of that name and
the row's message id, and the tokens are created before the run is marked finished
(``_SUCCESS``, written by Spark's job commit). So a task retried, a job re-run
after a crash, or a call again with the same path gives every row the same nonce,
and a finished run never creates a token again: a message processed since then
stays processed. Minting the same input under a new path is a deliberate replay.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.types import StringType

from dedupstore.errors import ConfigurationError, InvalidMessageId
from dedupstore.ids import validate_message_id
from dedupstore.tokens import TOKEN_HEADER, token_id

from . import _columns as C
from ._clients import ClientSpec, TaskClients
from ._record import Journal
from .session import use_this_python

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

__all__ = ["MINT_SCHEMA", "mint_tokens"]

#: The record of a mint run (one row per token-carrying row it minted for).
MINT_SCHEMA = C.schema(message_id=StringType(), nonce=StringType())

_NONCE = f"{C.RESERVED_PREFIX}nonce"
_FRESH = f"{C.RESERVED_PREFIX}fresh"


def mint_tokens(
    df: DataFrame,
    *,
    tokens_url: str,
    endpoints: Sequence[str],
    results_path: str,
    id_col: str = "id",
    headers_col: str = "headers",
    tokens_options: Mapping[str, Any] | None = None,
) -> DataFrame:
    """Mint a token for each row of ``df`` and each of ``endpoints``; return ``df``
    with the row's nonce in ``headers_col`` under ``dedupstore-token``.

    The message id is the text of ``id_col`` by the rule of
    :func:`process_messages`; ``headers_col`` is created as a
    ``map<string,string>`` or, if ``df`` has it, added to (it must be one). A row
    whose headers carry a token already keeps it and gets none minted (it was minted
    upstream). Rows sharing a message id share its nonce and tokens: copies of one
    message, the first to be processed consumes each receiver's token.

    Runs now (an action): every token is created, and the run's record
    (:data:`MINT_SCHEMA`, one row per row minted for) written to ``results_path``,
    before it returns. The nonces depend on ``results_path`` and the message id
    only, so a call that failed part-way is finished by calling again with the same
    path, and a call with the path of a finished run creates nothing (its tokens
    may be consumed already: creating them again would apply those messages
    twice). Minting the same input under another path mints new tokens: a replay,
    applied again by design. Keep one path per input (say, named after the input's
    own path or version).

    A row whose id is null or not a valid id gets no token (its nonce is recorded
    for a non-null one): :func:`process_messages` refuses such a row, naming its
    column, or with ``dead_letters`` sets it aside, as without tokens.

    The returned DataFrame is lazy and deterministic (the same nonce on every
    evaluation). Raises ``ConfigurationError`` before any I/O for a bad URL, option,
    endpoint, column or ``results_path``.
    """
    from pyspark.sql import functions as F

    if isinstance(endpoints, str) or not isinstance(endpoints, Sequence) or not endpoints:
        raise ConfigurationError(
            f"endpoints must be a non-empty list of receiving endpoints, got {endpoints!r:.80}"
        )
    try:
        receivers = tuple(dict.fromkeys(validate_message_id(e, "endpoint") for e in endpoints))
    except InvalidMessageId as exc:
        raise ConfigurationError(f"endpoints: {exc}") from None
    schema = df.schema
    C.check_names(schema.fieldNames(), repeated=())
    mid = C.id_text(schema, "id_col", id_col)
    has_headers = headers_col in schema.fieldNames()
    if has_headers:
        C.check_headers(schema, headers_col)
    elif not isinstance(headers_col, str) or not headers_col:
        raise ConfigurationError(f"headers_col must be a column name, got {headers_col!r}")
    tokens = ClientSpec.checked("tokens", tokens_url, tokens_options)
    journal = Journal.at(results_path)

    # the nonce: the run's name (a digest of its path) and the message id, hashed
    minted = F.when(
        mid.isNotNull(), F.substring(F.sha2(F.concat_ws("\0", F.lit(journal.run), mid), 256), 1, 32)
    )
    carried = F.col(headers_col).getItem(TOKEN_HEADER) if has_headers else F.lit(None)
    planned = df.withColumns({_FRESH: carried.isNull(), _NONCE: F.coalesce(carried, minted)})

    if not journal.finished():
        _check_only_spark_output(journal)

        def create(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            with TaskClients(tokens=tokens) as task:
                for batch in batches:
                    ids = batch.column(0).to_pylist()
                    nonces = batch.column(1).to_pylist()
                    if not ids:
                        continue
                    wanted: dict[str, str] = {}
                    for message_id, nonce in zip(ids, nonces, strict=True):
                        if nonce is None:
                            continue  # a null id: no token (process_messages refuses the row)
                        try:
                            message_id = validate_message_id(message_id)
                        except InvalidMessageId:
                            continue  # the same: refused, or set aside, by process_messages
                        for endpoint in receivers:
                            wanted[token_id(message_id, endpoint, nonce)] = endpoint
                    store = task.get().tokens
                    assert store is not None
                    store.create(wanted)  # create-if-absent: a retried task changes nothing
                    yield batch  # the record: (message_id, nonce)

        fresh = planned.where(F.col(_FRESH) & F.col(_NONCE).isNotNull()).select(
            mid.alias("message_id"), F.col(_NONCE).alias("nonce")
        )
        use_this_python(df.sparkSession)  # a local master: the workers run this interpreter
        # Spark's job commit writes _SUCCESS once every task created its tokens
        fresh.mapInArrow(create, MINT_SCHEMA).write.mode("overwrite").parquet(results_path)

    token = F.create_map(F.lit(TOKEN_HEADER), F.col(_NONCE))
    none = F.create_map().cast("map<string,string>")
    token = F.when(F.col(_NONCE).isNotNull(), token).otherwise(none)  # (a null id: no token)
    if has_headers:
        known = F.coalesce(F.col(headers_col), none)
        headers = F.map_concat(F.map_filter(known, lambda k, _: k != F.lit(TOKEN_HEADER)), token)
    else:
        headers = token
    return planned.withColumn(headers_col, headers).drop(_FRESH, _NONCE)


def _check_only_spark_output(journal: Journal) -> None:
    """``ConfigurationError`` unless the run's directory is absent or holds only what a
    Spark write leaves (an unfinished run): a mint never overwrites anything else."""
    from pyarrow import fs

    filesystem, base = journal.filesystem
    selector = fs.FileSelector(base, allow_not_found=True)
    for info in filesystem.get_file_info(selector):
        name = info.base_name
        if not (name.startswith(("part-", ".part-", "_temporary", "_SUCCESS", "._SUCCESS"))):
            raise ConfigurationError(
                f"results_path {journal.path!r} holds {name!r}, which no mint run wrote: give "
                "a new path, or the path of an earlier call of mint_tokens"
            )
