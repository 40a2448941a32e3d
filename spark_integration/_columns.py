"""How the Spark functions read a DataFrame's columns: one rule per question.

* :func:`id_text`: the text of an id or correlation column, from its Spark type
  alone (never the session time zone), or ``ConfigurationError`` on the driver;
  ``process_messages``, ``process_stream`` and ``drop_processed`` all use it;
* :func:`order_key`: what ``order_col`` may be (a number, a date, a timestamp);
* :func:`check_names`: reserved (``__dedupstore_*``) and repeated column names;
* :func:`check_headers`, :func:`headers_of`: ``headers_col`` is a map of strings;
* :func:`body_reader`: a row's other columns as the handler's ``message.body``:
  plain Python values, maps as dicts at any depth, timestamps in UTC;
* :class:`Rows`: a task's Arrow rows as messages, each row's two ids checked by
  :func:`message_ids`.

Everything that inspects a type runs on the driver, before any job; the functions a
task runs are plain Python, pickled with the job.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql import types as T

from dedupstore.errors import ConfigurationError, InvalidMessageId
from dedupstore.ids import plain_ids, validate_message_id
from dedupstore.outbox import Message

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column

__all__ = [
    "CID",
    "DONE",
    "ID",
    "INVALID_ENTITY",
    "RESERVED_PREFIX",
    "SEQ",
    "Rows",
    "body_reader",
    "check_headers",
    "check_names",
    "column",
    "field_type",
    "headers_of",
    "id_text",
    "message_ids",
    "order_key",
    "schema",
]

#: Column names starting with this (in any case) are dedupstore's own.
RESERVED_PREFIX = "__dedupstore_"
ID, CID, SEQ = f"{RESERVED_PREFIX}id", f"{RESERVED_PREFIX}cid", f"{RESERVED_PREFIX}seq"
DONE = f"{RESERVED_PREFIX}done"

_DAY_US = 86_400_000_000
_SECOND_US = 1_000_000

#: Geospatial types, when this PySpark release has them (4.1 and later) -> their values' class.
_GEOSPATIAL: dict[type, Any] = {
    getattr(T, f"{name}Type"): getattr(T, name)
    for name in ("Geometry", "Geography")
    if hasattr(T, f"{name}Type")
}
#: Map key types whose Python values cannot be dict keys (unhashable).
_NOT_KEYS = (
    T.ArrayType,
    T.MapType,
    T.StructType,
    T.VariantType,
    T.UserDefinedType,
    *_GEOSPATIAL,
)

_TEXT = (T.StringType, T.CharType, T.VarcharType)
_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
_ORDERABLE = (*_INTEGRAL, T.FloatType, T.DoubleType, T.DecimalType, T.DateType)
_TIMESTAMPS = (T.TimestampType, T.TimestampNTZType)

#: What an id column may be, for the error message.
_ID_TYPES = (
    "string, char, varchar, tinyint, smallint, int, bigint, decimal(p,0), date, "
    "timestamp, timestamp_ntz or binary"
)


def schema(**columns: T.DataType) -> T.StructType:
    """A struct of these columns, in this order."""
    return T.StructType([T.StructField(name, kind) for name, kind in columns.items()])


def column(name: str) -> Column:
    """The top-level column ``name``, quoted (a dot or a backtick is part of the name)."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def check_names(names: Sequence[str], *, repeated: Iterable[str] | None = None) -> None:
    """Refuse reserved names, and names that occur twice among ``repeated`` (default all)."""
    for name in names:
        if name.lower().startswith(RESERVED_PREFIX):
            raise ConfigurationError(
                f"column {name!r}: names starting with {RESERVED_PREFIX!r} are reserved for "
                "dedupstore's own columns; rename it"
            )
    checked = set(names if repeated is None else repeated)
    for name in checked:
        if names.count(name) > 1:
            raise ConfigurationError(
                f"column {name!r} occurs twice in {list(names)}; a message body is a dict "
                "by column name, so rename or drop one"
            )


def field_type(schema: T.StructType, argument: str, name: str) -> T.DataType:
    """The type of the column ``name`` given as ``argument``; ConfigurationError if absent."""
    kinds = [f.dataType for f in schema.fields if f.name == name]
    if not kinds:
        raise ConfigurationError(f"{argument}={name!r} is not a column of {schema.fieldNames()}")
    if len(kinds) > 1:
        raise ConfigurationError(
            f"{argument}={name!r} names {len(kinds)} columns of {schema.fieldNames()}; "
            "rename them apart"
        )
    return kinds[0]


def _refusal(argument: str | None, name: str, kind: T.DataType, why: str) -> ConfigurationError:
    """``<argument>='<name>' has type <type>: <why>`` (``column '<name>'`` without argument)."""
    what = f"{argument}={name!r}" if argument else f"column {name!r}"
    return ConfigurationError(f"{what} has type {kind.simpleString()}: {why}")


# ---------------------------------------------------------------------- ids


def id_text(schema: T.StructType, argument: str, name: str) -> Column:
    """The canonical text of the id column ``name`` (``argument``: ``id_col``, ...).

    One rule, from the column's Spark type alone, never from the session time zone:

    ===========================  ==============================================
    string, char, varchar        the value as is (any collation: compared bytewise)
    tinyint ... bigint           decimal digits, ``-`` for negatives: ``-7``
    decimal(p,0)                 plain digits, no exponent: ``10000000000000000000``
    date                         ``YYYY-MM-DD``: ``2026-01-31``
    timestamp                    the instant in UTC, microseconds, ``Z``:
                                 ``2026-01-01T00:30:00.500000Z``
    timestamp_ntz                the wall-clock value the same way, no ``Z``:
                                 ``2026-03-08T02:30:00.500000``
    binary                       lowercase hex: ``0aff``
    ===========================  ==============================================

    Any other type raises ``ConfigurationError`` naming the column and its type:
    boolean, float and double (no exact text), decimals with a scale, void,
    intervals, time, variant, geospatial, arrays, maps, structs and UDTs. A null
    value gives null (the task raises ``InvalidMessageId``).
    """
    from pyspark.sql import functions as F

    kind = field_type(schema, argument, name)
    value = column(name)
    if isinstance(kind, _TEXT):
        return F.collate(value.cast("string"), "UTF8_BINARY")
    if isinstance(kind, (*_INTEGRAL, T.DateType)) or (
        isinstance(kind, T.DecimalType) and kind.scale == 0
    ):
        return value.cast("string")
    if isinstance(kind, T.TimestampType):
        return _micros_text(F.unix_micros(value), "Z")
    if isinstance(kind, T.TimestampNTZType):
        return _micros_text(_wall_micros(value), "")
    if isinstance(kind, T.BinaryType):
        return F.lower(F.hex(value))
    raise _refusal(
        argument,
        name,
        kind,
        f"an id column must be {_ID_TYPES} (see the table of docs/spark.md); cast it to one of "
        "those first, to a string if its values have their own exact text",
    )


def _wall_micros(value: Column) -> Column:
    """Microseconds from 1970-01-01 00:00 to a timestamp_ntz, from its fields alone.

    (``timestamp_diff`` and casts to ``timestamp`` go through the session time zone,
    which moves a wall-clock time that falls in a daylight-saving gap.)
    """
    from pyspark.sql import functions as F

    seconds = F.extract(F.lit("SECOND"), value)  # decimal(8,6): seconds and fraction
    return (
        F.unix_date(value.cast("date")).cast("long") * F.lit(_DAY_US)
        + F.hour(value).cast("long") * F.lit(3600 * _SECOND_US)
        + F.minute(value).cast("long") * F.lit(60 * _SECOND_US)
        + (seconds * F.lit(_SECOND_US)).cast("long")
    )


def _micros_text(micros: Column, suffix: str) -> Column:
    """``YYYY-MM-DDTHH:MM:SS.ffffff`` + ``suffix`` of microseconds since 1970-01-01 00:00."""
    from pyspark.sql import functions as F

    in_day = F.pmod(micros, F.lit(_DAY_US))
    # exact multiples: a double quotient is within rounding of an integer, never across one
    days = F.round((micros - in_day) / F.lit(_DAY_US)).cast("int")
    fraction = F.pmod(in_day, F.lit(_SECOND_US))
    seconds = F.round((in_day - fraction) / F.lit(_SECOND_US)).cast("int")

    def two(part: Column) -> Column:
        return F.lpad(part.cast("string"), 2, "0")

    return F.concat(
        F.date_from_unix_date(days).cast("string"),
        F.lit("T"),
        two(F.floor(seconds / F.lit(3600))),
        F.lit(":"),
        two(F.floor(F.pmod(seconds, F.lit(3600)) / F.lit(60))),
        F.lit(":"),
        two(F.pmod(seconds, F.lit(60))),
        F.lit("."),
        F.lpad(fraction.cast("string"), 6, "0"),
        F.lit(suffix),
    )


def message_ids(
    mid: str | None, cid: str | None, id_col: str, correlation_col: str, context: str = ""
) -> tuple[str, str]:
    """One row's (message id, correlation id) texts, checked; ``InvalidMessageId`` names the column.

    ``context`` (e.g. ``", seq 7"``) is added to a null id's message.
    """
    if mid is None and cid is None:
        where = f" ({context.removeprefix(', ')})" if context else ""
        raise InvalidMessageId(
            f"columns {id_col!r} and {correlation_col!r} hold a null message id and a null "
            f"correlation id{where}"
        )
    if mid is None:
        raise InvalidMessageId(
            f"column {id_col!r} holds a null message id (correlation id {cid!r:.80}{context})"
        )
    if cid is None:
        raise InvalidMessageId(
            f"column {correlation_col!r} holds a null correlation id "
            f"(message id {mid!r:.80}{context})"
        )
    return (
        validate_message_id(mid, f"message id in column {id_col!r}"),
        validate_message_id(cid, f"correlation id in column {correlation_col!r}"),
    )


# ---------------------------------------------------------------------- order


def order_key(schema: T.StructType, name: str) -> Column:
    """``order_col``, if it is a number, a date or a timestamp; else ConfigurationError."""
    kind = field_type(schema, "order_col", name)
    if not isinstance(kind, _ORDERABLE + _TIMESTAMPS):
        raise _refusal(
            "order_col",
            name,
            kind,
            "an order column must be a number, a date, a timestamp or a timestamp_ntz "
            "(a string would sort '10' before '9'); cast it",
        )
    return column(name)


# ---------------------------------------------------------------------- headers


def check_headers(schema: T.StructType, name: str) -> None:
    """``headers_col`` must be a ``map<string,string>``."""
    kind = field_type(schema, "headers_col", name)
    if not (
        isinstance(kind, T.MapType)
        and isinstance(kind.keyType, _TEXT)
        and isinstance(kind.valueType, _TEXT)
    ):
        raise _refusal(
            "headers_col",
            name,
            kind,
            "headers must be a map<string,string> (cast the values to string first)",
        )


def headers_of(value: Any) -> dict[str, str]:
    """A headers map as it arrives from Arrow (pairs, or None): a dict without null values."""
    if not value:
        return {}
    pairs = value.items() if isinstance(value, Mapping) else value
    return {str(k): str(v) for k, v in pairs if v is not None}


# ---------------------------------------------------------------------- bodies

Convert = Callable[[Any], Any]


def body_reader(schema: T.StructType, names: Sequence[str]) -> BodyReader:
    """A function from an Arrow row (``to_pylist``) to the body dict of ``names``.

    Checked on the driver: a type that cannot reach Python raises ConfigurationError
    naming the column and its type. See the table of docs/spark.md for what each type gives.
    """
    kinds = {f.name: f.dataType for f in schema.fields}
    converters = ((name, _converter(kinds[name], name, kinds[name])) for name in names)
    return BodyReader(tuple((n, c) for n, c in converters if c is not None), tuple(names))


@dataclass(frozen=True)
class _StructConverter:
    """Converts the non-null fields that have a converter, in a copy of a struct's dict."""

    fields: tuple[tuple[str, Convert], ...]

    def __call__(self, value: Mapping[str, Any]) -> dict[str, Any]:
        converted = dict(value)
        for name, convert in self.fields:
            if converted[name] is not None:
                converted[name] = convert(converted[name])
        return converted


@dataclass(frozen=True)
class BodyReader(_StructConverter):
    """Picklable: the converters of the columns that need one, and the column names."""

    names: tuple[str, ...]

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        return super().__call__({name: row[name] for name in self.names})

    def rows(self, columns: Mapping[str, list[Any]], count: int) -> list[dict[str, Any]]:
        """The bodies of ``count`` rows given as columns (``to_pylist`` of each):
        what calling this reader on each row gives."""
        names = self.names
        if not names:
            return [{} for _ in range(count)]
        values = {name: columns[name] for name in names}
        for name, convert in self.fields:
            values[name] = [None if v is None else convert(v) for v in values[name]]
        return [dict(zip(names, row, strict=True)) for row in zip(*values.values(), strict=True)]


def _utc(value: dt.datetime) -> dt.datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC)


def _converter(kind: T.DataType, name: str, top: T.DataType) -> Convert | None:
    """How to turn an Arrow value of ``kind`` into the handler's value; None: as it is."""
    if isinstance(kind, T.TimestampType):
        return _utc
    if isinstance(kind, T.ArrayType):
        return _array_converter(_converter(kind.elementType, name, top))
    if isinstance(kind, T.MapType):
        if isinstance(kind.keyType, _NOT_KEYS):
            raise _refusal(
                None,
                name,
                top,
                f"a map with {kind.keyType.simpleString()} keys cannot be a Python dict; "
                "turn it into an array of structs (map_entries) first",
            )
        return _map_converter(
            _converter(kind.keyType, name, top), _converter(kind.valueType, name, top)
        )
    if isinstance(kind, T.StructType):
        fields = [f.name for f in kind.fields]
        twice = sorted({f for f in fields if fields.count(f) > 1})
        if twice:
            raise _refusal(
                None, name, top, f"its struct repeats the field {twice[0]!r}; rename one"
            )
        inner = [(f.name, _converter(f.dataType, name, top)) for f in kind.fields]
        active = tuple((f, c) for f, c in inner if c is not None)
        return _StructConverter(active) if active else None
    if isinstance(kind, T.VariantType):
        return _variant
    for geospatial, value_class in _GEOSPATIAL.items():
        if isinstance(kind, geospatial):
            return functools.partial(_geospatial, value_class)
    if isinstance(kind, T.UserDefinedType):
        return _converter(kind.sqlType(), name, top)
    if isinstance(kind, T.YearMonthIntervalType | T.CalendarIntervalType):
        raise _refusal(
            None,
            name,
            top,
            f"{kind.simpleString()} values cannot reach a Python handler through Arrow; "
            "cast them to a string or split them into numbers first",
        )
    return None


def _array_converter(element: Convert | None) -> Convert | None:
    if element is None:
        return None

    def convert(values: list[Any]) -> list[Any]:
        return [None if v is None else element(v) for v in values]

    return convert


def _map_converter(key: Convert | None, value: Convert | None) -> Convert:
    def convert(pairs: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
        return {
            (k if key is None else key(k)): (v if value is None or v is None else value(v))
            for k, v in pairs
        }

    return convert


def _variant(value: Mapping[str, bytes]) -> Any:
    return T.VariantVal(value["value"], value["metadata"]).toPython()


def _geospatial(value_class: Any, value: Mapping[str, Any]) -> Any:
    return value_class(value["wkb"], value["srid"])


# ---------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Rows:
    """Turns the Arrow rows of a ``process_messages`` task into :class:`Message` objects."""

    id_col: str
    correlation_col: str
    order_col: str | None
    headers_col: str | None
    body: BodyReader

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
        ids, cids = columns[ID], columns[CID]
        if not plain_ids(ids) or not plain_ids(cids):
            return [
                self.message({name: columns[name][i] for name in names}, invalid)
                for i in range(batch.num_rows)
            ]
        bodies = self.body.rows(columns, batch.num_rows)
        if self.headers_col:
            headers = [headers_of(value) for value in columns[self.headers_col]]
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
        mid, cid = row[ID], row[CID]
        where = ""  # the row's order value, to find a row whose id is null
        if (mid is None or cid is None) and self.order_col in body:
            where = f", {self.order_col} {body[self.order_col]!r:.80}"
        try:
            mid, cid = message_ids(mid, cid, self.id_col, self.correlation_col, where)
        except InvalidMessageId as exc:
            if invalid is None:
                raise
            return _stand_in(body, mid, cid, str(exc), invalid)
        headers = headers_of(row[self.headers_col]) if self.headers_col else {}
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
    """The message that stands for an invalid row, to be dead-lettered (see :class:`Rows`)."""
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
