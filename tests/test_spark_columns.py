"""How the Spark functions read their columns: id text, order, names, bodies, headers.

Every Spark type as an id (its documented text, or refused on the driver), the same
rule in ``process_messages``, ``process_stream`` and ``drop_processed``, the session
time zone changing nothing, the order rule (ties by message id, nulls last), reserved
and duplicate column names, what a handler receives for each type, and null ids.
Classic ``local`` session, SQLite stores, one row or a few per type; the engines
(Connect, local-cluster) run the same functions in ``tests/test_spark.py``.
"""

from __future__ import annotations

import base64
import datetime as dt
import pickle
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from functools import reduce
from pathlib import Path
from typing import Any

import pytest

from dedupstore.entities import EntityStore
from dedupstore.errors import ConfigurationError, InvalidMessageId
from dedupstore.outbox import Message, Send
from dedupstore.registry import open_url
from dedupstore.spark import drop_processed, process_messages, process_stream

LOCAL = pytest.mark.parametrize("spark", ["local"], indirect=True)
pytestmark = pytest.mark.sqlite

#: Session settings that make every type of the table creatable (TIME, geospatial,
#: CHAR/VARCHAR kept as such in a DataFrame's schema).
EVERY_TYPE_CONF = {
    "spark.sql.timeType.enabled": "true",
    "spark.sql.geospatial.enabled": "true",
    "spark.sql.preserveCharVarcharTypeInfo": "true",
}

_POINT = "X'0101000000000000000000F03F0000000000000040'"

#: (column, Spark SQL expression, its id text; None: refused as an id column)
ID_TYPES: list[tuple[str, str, str | None]] = [
    ("t_string", "'a-1'", "a-1"),
    ("t_collated", "'Ab' COLLATE UTF8_LCASE", "Ab"),
    ("t_char", "CAST('ab' AS CHAR(4))", "ab  "),
    ("t_varchar", "CAST('ab' AS VARCHAR(4))", "ab"),
    ("t_byte", "CAST(-7 AS TINYINT)", "-7"),
    ("t_short", "CAST(300 AS SMALLINT)", "300"),
    ("t_int", "2147483647", "2147483647"),
    ("t_long", "CAST('-9223372036854775808' AS BIGINT)", "-9223372036854775808"),
    (
        "t_decimal",
        "CAST('12345678901234567890123456789012345678' AS DECIMAL(38,0))",
        "12345678901234567890123456789012345678",
    ),
    ("t_decimal_big", "CAST(1e37 AS DECIMAL(38,0))", "1" + "0" * 37),
    ("t_decimal_neg", "CAST(-5 AS DECIMAL(3,0))", "-5"),
    ("t_date", "DATE'0001-01-01'", "0001-01-01"),
    ("t_timestamp", "TIMESTAMP'2026-01-01 01:30:00.5+01:00'", "2026-01-01T00:30:00.500000Z"),
    ("t_timestamp_old", "TIMESTAMP_MICROS(-1)", "1969-12-31T23:59:59.999999Z"),
    ("t_timestamp_ntz", "TIMESTAMP_NTZ'2026-03-08 02:30:00.5'", "2026-03-08T02:30:00.500000"),
    ("t_binary", "X'0AFF'", "0aff"),
    ("t_boolean", "true", None),
    ("t_float", "CAST(1e7 AS FLOAT)", None),
    ("t_double", "1e7", None),
    ("t_decimal_scaled", "CAST(1.5 AS DECIMAL(10,2))", None),
    ("t_null", "NULL", None),
    ("t_interval_day", "INTERVAL '1 02' DAY TO HOUR", None),
    ("t_interval_year", "INTERVAL '1' YEAR", None),
    ("t_calendar_interval", "MAKE_INTERVAL(1, 2, 3, 4, 5, 6, 7.5)", None),
    ("t_time", "CAST('12:30:01.25' AS TIME)", None),
    ("t_variant", """PARSE_JSON('{"a": 1}')""", None),
    ("t_geometry", f"ST_GEOMFROMWKB({_POINT})", None),
    ("t_geography", f"ST_GEOGFROMWKB({_POINT})", None),
    ("t_array", "ARRAY('a')", None),
    ("t_map", "MAP('a', 'b')", None),
    ("t_struct", "NAMED_STRUCT('a', 'b')", None),
]

#: The types an order column may have (numbers, dates, timestamps); all others refused.
ORDERABLE = {
    "t_byte",
    "t_short",
    "t_int",
    "t_long",
    "t_decimal",
    "t_decimal_big",
    "t_decimal_neg",
    "t_date",
    "t_timestamp",
    "t_timestamp_old",
    "t_timestamp_ntz",
    "t_float",
    "t_double",
    "t_decimal_scaled",
}


@contextmanager
def _conf(spark: Any, settings: dict[str, str]) -> Iterator[None]:
    """Session settings for the block, restored after it."""
    saved = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def _every_type(spark: Any) -> Any:
    """One row, a column per Spark type of :data:`ID_TYPES`, plus an ML vector (a UDT)."""
    from pyspark.ml.linalg import Vectors

    select = ", ".join(f"{expr} AS {name}" for name, expr, _ in ID_TYPES)
    vector = spark.createDataFrame([(Vectors.dense([1.0, 2.0]),)], ["t_udt"])
    return spark.sql(f"SELECT {select}").crossJoin(vector)


def _stores(tmp_path: Path) -> dict[str, str]:
    db = f"sqlite:///{tmp_path}/stores.db"
    return {"entities_url": db, "dedup_url": db, "dispatcher_url": db}


def _entities(tmp_path: Path) -> EntityStore:
    return open_url("entity_store", f"sqlite:///{tmp_path}/stores.db")


def handle_sequence(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    state.setdefault("seen", []).append(message.id)
    return state, []


def record_body(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Keeps what the handler received (pickled: the state itself must be JSON)."""
    kept = pickle.dumps((message.body, dict(message.headers)))
    state.setdefault("received", []).append(base64.b64encode(kept).decode())
    return state, []


def _received(entities: EntityStore, cid: str) -> list[tuple[dict[str, Any], dict[str, str]]]:
    state = entities.load(cid).state
    return [pickle.loads(base64.b64decode(text)) for text in state["received"]]


def _refused(call: Callable[[], Any], column: str, type_name: str) -> None:
    """``call`` raises ConfigurationError naming ``column`` and its type."""
    with pytest.raises(ConfigurationError) as info:
        call()
    text = str(info.value)
    assert repr(column) in text and type_name in text, text


# ---------------------------------------------------------------------- ids


@LOCAL
def test_every_spark_type_as_an_id_gives_its_documented_text_or_is_refused(
    spark: Any, tmp_path: Path
) -> None:
    """The table: each type is either the documented text or a ConfigurationError on the driver."""
    stores = _stores(tmp_path)
    with _conf(spark, EVERY_TYPE_CONF):
        df = _every_type(spark)
        kinds = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        refused = [name for name, _, text in ID_TYPES if text is None] + ["t_udt"]
        for name in refused:
            for role in ("id_col", "correlation_col"):
                other = "correlation_col" if role == "id_col" else "id_col"
                args: dict[str, Any] = {role: name, other: "t_string"}
                kind = kinds[name]
                _refused(
                    lambda a=args: process_messages(df, record_body, **a, **stores), name, kind
                )
                _refused(lambda a=args: drop_processed(df, stores["dedup_url"], **a), name, kind)

        from dedupstore.spark._columns import id_text

        accepted = {name: text for name, _, text in ID_TYPES if text is not None}
        for zone in ("UTC", "Pacific/Chatham"):  # +13:45: no rule can depend on it
            with _conf(spark, {"spark.sql.session.timeZone": zone}):
                texts = [id_text(df.schema, "id_col", name).alias(name) for name in accepted]
                row = df.select(texts).first()
            assert {name: row[name] for name in accepted} == accepted, zone
    assert not (tmp_path / "stores.db").exists()  # every refusal came before any I/O


#: Accepted id types, two rows (n = 0, 1): (column, expression of n, text of n)
AGREEING: list[tuple[str, str, Callable[[int], str]]] = [
    ("t_string", "CONCAT('a-', n)", lambda n: f"a-{n}"),
    ("t_collated", "CONCAT('B', n) COLLATE UTF8_LCASE", lambda n: f"B{n}"),
    ("t_char", "CAST(CONCAT('c', n) AS CHAR(3))", lambda n: f"c{n} "),
    ("t_varchar", "CAST(CONCAT('v', n) AS VARCHAR(3))", lambda n: f"v{n}"),
    ("t_byte", "CAST(n - 7 AS TINYINT)", lambda n: str(n - 7)),
    ("t_short", "CAST(n + 300 AS SMALLINT)", lambda n: str(n + 300)),
    ("t_int", "CAST(n + 70000 AS INT)", lambda n: str(n + 70000)),
    ("t_long", "n - 9000000000", lambda n: str(n - 9000000000)),
    (
        "t_decimal",
        "CAST('10000000000000000000' AS DECIMAL(38,0)) + n",
        lambda n: str(10**19 + n),
    ),
    (
        "t_date",
        "DATE_ADD(DATE'2026-01-31', CAST(n AS INT))",
        lambda n: (dt.date(2026, 1, 31) + dt.timedelta(days=n)).isoformat(),
    ),
    (
        "t_timestamp",
        "TIMESTAMP_MICROS(1767225600000000 + n)",
        lambda n: f"2026-01-01T00:00:00.00000{n}Z",
    ),
    (
        "t_timestamp_ntz",
        "MAKE_TIMESTAMP_NTZ(2026, 3, 8, 2, 30, CAST(n AS DECIMAL(8,6)))",
        lambda n: f"2026-03-08T02:30:0{n}.000000",
    ),
    ("t_binary", "UNHEX(CONCAT('0A0', n))", lambda n: f"0a0{n}"),
]


@LOCAL
def test_process_messages_and_drop_processed_agree_on_every_accepted_type(
    spark: Any, tmp_path: Path
) -> None:
    """A row processed by process_messages is dropped by drop_processed, under any time zone."""
    from pyspark.sql import functions as F

    stores = _stores(tmp_path)
    with _conf(spark, EVERY_TYPE_CONF):
        select = ", ".join(f"{expr} AS {name}" for name, expr, _ in AGREEING)
        df = spark.sql(f"SELECT n, {select} FROM (SELECT id AS n FROM range(2))")
        pairs = [(c, AGREEING[(i + 1) % len(AGREEING)][0]) for i, (c, _, _) in enumerate(AGREEING)]
        text = {name: fn for name, _, fn in AGREEING}

        def processed(frame: Any) -> list[Any]:
            runs = [
                process_messages(
                    frame,
                    handle_sequence,
                    id_col=mid,
                    correlation_col=cid,
                    cleanup="inline",
                    partitions=1,
                    **stores,
                ).withColumn("type", F.lit(mid))
                for mid, cid in pairs
            ]
            return reduce(lambda a, b: a.unionByName(b), runs).collect()

        def kept() -> set[tuple[str, int]]:
            runs = [
                drop_processed(df, stores["dedup_url"], mid, cid).select(
                    F.lit(mid).alias("type"), "n"
                )
                for mid, cid in pairs
            ]
            return {
                (r["type"], r["n"]) for r in reduce(lambda a, b: a.unionByName(b), runs).collect()
            }

        first = processed(df.where("n = 0"))
        assert {(r["type"], r["message_id"], r["correlation_id"], r["outcome"]) for r in first} == {
            (mid, text[mid](0), text[cid](0), "processed") for mid, cid in pairs
        }
        assert kept() == {(mid, 1) for mid, _ in pairs}
        with _conf(spark, {"spark.sql.session.timeZone": "Pacific/Chatham"}):
            again = processed(df.where("n = 0"))
            assert Counter(r["outcome"] for r in again) == Counter({"duplicate": len(pairs)})
            assert kept() == {(mid, 1) for mid, _ in pairs}


def record_instant(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    at = message.body["at"]
    state.setdefault("at", []).append([message.id, at.isoformat(), str(at.tzinfo)])
    return state, []


@LOCAL
def test_timestamp_ids_replayed_under_another_session_time_zone_are_duplicates(
    spark: Any, tmp_path: Path
) -> None:
    """Same instants, another spark.sql.session.timeZone: every message is a duplicate."""
    stores = _stores(tmp_path)
    start = dt.datetime(2026, 3, 8, 6, 30, tzinfo=dt.UTC)  # 01:30 in New York, DST that night
    rows = [
        (start + dt.timedelta(minutes=30 * k), dt.datetime(2026, 3, 8, 2, 30 + k), start)
        for k in range(4)
    ]
    args: dict[str, Any] = {"cleanup": "inline", "partitions": 2, **stores}
    outcomes = []
    for zone in ("UTC", "America/New_York", "Asia/Kolkata"):
        with _conf(spark, {"spark.sql.session.timeZone": zone}):
            df = spark.createDataFrame(
                rows, "id timestamp, correlation_id timestamp_ntz, at timestamp"
            )
            results = process_messages(df, record_instant, **args).collect()
        outcomes.append(Counter(r["outcome"] for r in results))
        assert {r["message_id"] for r in results} == {
            (start + dt.timedelta(minutes=30 * k)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            for k in range(4)
        }
    assert outcomes == [
        Counter({"processed": 4}),
        Counter({"duplicate": 4}),
        Counter({"duplicate": 4}),
    ]
    with _entities(tmp_path) as entities:
        for k in range(4):
            cid = f"2026-03-08T02:{30 + k}:00.000000"
            assert entities.load(cid).state["at"][0][1:] == [start.isoformat(), "UTC"]


@LOCAL
def test_process_stream_applies_the_same_column_rules_before_starting(
    spark: Any, tmp_path: Path
) -> None:
    stores = _stores(tmp_path)
    schema = "id double, correlation_id string, n string, __dedupstore_seq int, h string"
    stream = spark.readStream.schema(schema).json(str(tmp_path))
    go: dict[str, Any] = {"checkpoint": str(tmp_path / "ckpt"), **stores}
    plain = stream.drop("__dedupstore_seq")
    _refused(lambda: process_stream(plain, handle_sequence, **go), "id", "double")
    fine = plain.withColumn("id", plain.id.cast("long"))
    _refused(lambda: process_stream(fine, handle_sequence, order_col="n", **go), "n", "string")
    _refused(lambda: process_stream(fine, handle_sequence, headers_col="h", **go), "h", "string")
    with pytest.raises(ConfigurationError, match="__dedupstore_seq"):
        process_stream(stream.withColumn("id", stream.id.cast("long")), handle_sequence, **go)
    assert not spark.streams.active
    assert not (tmp_path / "stores.db").exists()


# ---------------------------------------------------------------------- order


@LOCAL
def test_order_col_must_be_a_number_a_date_or_a_timestamp(spark: Any, tmp_path: Path) -> None:
    stores = _stores(tmp_path)
    with _conf(spark, EVERY_TYPE_CONF):
        df = _every_type(spark)
        kinds = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        for name in kinds:
            one = df.select(df.t_string.alias("mid"), df.t_int.alias("cid"), name)
            call = lambda d=one, n=name: process_messages(  # noqa: E731
                d, handle_sequence, id_col="mid", correlation_col="cid", order_col=n, **stores
            )
            if name in ORDERABLE:
                call()  # lazy: accepted, nothing runs
            else:
                _refused(call, name, kinds[name])
    assert not (tmp_path / "stores.db").exists()


@LOCAL
def test_ties_in_order_col_follow_the_message_id_and_nulls_come_last(
    spark: Any, tmp_path: Path
) -> None:
    """Whatever the upstream order: (order value, message id text), null order values last."""
    seqs = [2, 1, None, 1, 1, None, 3, 1]
    rows = [
        (f"e{e}-m{len(seqs) - k}", f"e{e}", seq)  # ids against the input order: m8 first
        for e in range(3)
        for k, seq in enumerate(seqs)
    ]
    rows += [("m10", "e9", 1), ("m9", "e9", 1)]  # by text: "m10" before "m9"
    df = spark.createDataFrame(rows, "id string, correlation_id string, seq int").coalesce(1)
    results = process_messages(
        df, handle_sequence, order_col="seq", batch_size=3, partitions=2, **_stores(tmp_path)
    ).collect()
    assert len(results) == len(rows)

    def key(row: tuple[str, str, int | None]) -> tuple[bool, int, str]:
        return (row[2] is None, row[2] or 0, row[0])

    with _entities(tmp_path) as entities:
        for cid in ("e0", "e1", "e2", "e9"):
            expected = [r[0] for r in sorted((r for r in rows if r[1] == cid), key=key)]
            assert entities.load(cid).state["seen"] == expected, cid
    assert expected == ["m10", "m9"]


# ---------------------------------------------------------------------- names


@LOCAL
def test_reserved_and_duplicate_column_names_are_refused(spark: Any, tmp_path: Path) -> None:
    stores = _stores(tmp_path)
    base = spark.createDataFrame([("m", "e", 1)], "id string, correlation_id string, n int")
    for name in ("__dedupstore_seq", "__dedupstore_id", "__DEDUPSTORE_CID", "__dedupstore_mine"):
        df = base.withColumn(name, base.n)
        with pytest.raises(ConfigurationError, match=re.escape(repr(name))):
            process_messages(df, handle_sequence, **stores)
        with pytest.raises(ConfigurationError, match=re.escape(repr(name))):
            drop_processed(df, stores["dedup_url"])
    twice = base.select("id", "correlation_id", "n", base.n.alias("n"))
    with pytest.raises(ConfigurationError, match=r"'n'.*twice"):
        process_messages(twice, handle_sequence, **stores)
    both = base.select("id", base.id.alias("id"), "correlation_id")
    with pytest.raises(ConfigurationError, match="'id'"):
        drop_processed(both, stores["dedup_url"])
    with pytest.raises(ConfigurationError, match="correlation_col='nope' is not a column"):
        drop_processed(base, stores["dedup_url"], "id", "nope")
    assert not (tmp_path / "stores.db").exists()


# ---------------------------------------------------------------------- bodies


@LOCAL
def test_a_handler_receives_plain_python_values_for_every_type(spark: Any, tmp_path: Path) -> None:
    """Maps as dicts (nested too), timestamps as UTC datetimes whatever the session zone."""
    from pyspark.sql.types import Geography, Geometry

    utc = dt.UTC
    ts = "TIMESTAMP'2026-01-01 01:30:00.5+01:00'"
    body_sql = {
        "s": "'text'",
        "ch": "CAST('ab' AS CHAR(4))",
        "b": "true",
        "i8": "CAST(-7 AS TINYINT)",
        "i64": "CAST(9000000000 AS BIGINT)",
        "f": "CAST(1.5 AS FLOAT)",
        "d": "2.5D",
        "dec": "CAST(1.5 AS DECIMAL(10,2))",
        "bin": "X'0AFF'",
        "day": "DATE'2026-01-31'",
        "ts": ts,
        "ntz": "TIMESTAMP_NTZ'2026-03-08 02:30:00.5'",
        "tm": "CAST('12:30:01.25' AS TIME)",
        "di": "INTERVAL '1 02' DAY TO HOUR",
        "nul": "NULL",
        "arr": "ARRAY(1, NULL, 3)",
        "m": "MAP('a', 1, 'b', NULL)",
        "m_ts": f"MAP({ts}, 'at', TIMESTAMP_MICROS(0), 'epoch')",
        "st": f"NAMED_STRUCT('x', MAP('k', {ts}), 'y', ARRAY(MAP('p', 1)), "
        "'z', CAST(NULL AS MAP<STRING, INT>))",
        "arr_m": "ARRAY(MAP('a', ARRAY(MAP('b', 2))), MAP())",
        "v": """PARSE_JSON('{"a": 1, "b": [true, null]}')""",
        "g": f"ST_GEOMFROMWKB({_POINT})",
        "gg": f"ST_GEOGFROMWKB({_POINT})",
    }
    select = ", ".join(f"{expr} AS `{name}`" for name, expr in body_sql.items())
    with _conf(spark, {**EVERY_TYPE_CONF, "spark.sql.session.timeZone": "America/New_York"}):
        df = spark.sql(
            f"SELECT 'm1' AS `msg.id`, 'body' AS cid, MAP('k', 'v', 'n', NULL) AS h, {select} "
            "UNION ALL SELECT 'm2', 'body', NULL, " + ", ".join("NULL" for _ in body_sql)
        )
        process_messages(
            df, record_body, id_col="msg.id", correlation_col="cid", headers_col="h",
            cleanup="inline", partitions=1, **_stores(tmp_path),
        ).collect()  # fmt: skip
    with _entities(tmp_path) as entities:
        (body, headers), (nulls, no_headers) = _received(entities, "body")
    instant = dt.datetime(2026, 1, 1, 0, 30, 0, 500000, tzinfo=utc)
    geometry, geography = body.pop("g"), body.pop("gg")
    wkb = bytes.fromhex(_POINT[2:-1])
    assert isinstance(geometry, Geometry) and isinstance(geography, Geography)
    assert (bytes(geometry.getBytes()), geometry.getSrid()) == (wkb, 0)
    assert (bytes(geography.getBytes()), geography.getSrid()) == (wkb, 4326)
    assert body == {
        "s": "text",
        "ch": "ab  ",
        "b": True,
        "i8": -7,
        "i64": 9000000000,
        "f": 1.5,
        "d": 2.5,
        "dec": Decimal("1.50"),
        "bin": b"\n\xff",
        "day": dt.date(2026, 1, 31),
        "ts": instant,
        "ntz": dt.datetime(2026, 3, 8, 2, 30, 0, 500000),
        "tm": dt.time(12, 30, 1, 250000),
        "di": dt.timedelta(days=1, hours=2),
        "nul": None,
        "arr": [1, None, 3],
        "m": {"a": 1, "b": None},
        "m_ts": {instant: "at", dt.datetime(1970, 1, 1, tzinfo=utc): "epoch"},
        "st": {"x": {"k": instant}, "y": [{"p": 1}], "z": None},
        "arr_m": [{"a": [{"b": 2}]}, {}],
        "v": {"a": 1, "b": [True, None]},
    }
    assert list(body) == [k for k in body_sql if k not in ("g", "gg")]  # the column order
    for value in (body["ts"], *body["m_ts"], body["st"]["x"]["k"]):
        assert value.tzinfo is utc  # not the session's America/New_York
    assert body["ntz"].tzinfo is None
    assert headers == {"k": "v"}  # a null header value is left out
    assert nulls == dict.fromkeys(body_sql)
    assert no_headers == {}


@LOCAL
def test_body_and_headers_types_that_cannot_arrive_are_refused(spark: Any, tmp_path: Path) -> None:
    stores = _stores(tmp_path)
    df = spark.sql(
        "SELECT 'm' AS id, 'e' AS correlation_id, INTERVAL '1' YEAR AS ym, "
        "MAKE_INTERVAL(1, 2) AS ci, ARRAY(INTERVAL '2' MONTH) AS ym_list, "
        "MAP(ARRAY(1), 'x') AS list_keys, MAP('k', 1) AS h_int, 'k=v' AS h_text, "
        "NAMED_STRUCT('a', 1, 'a', 2) AS same_fields"
    )
    kinds = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    body_cols = ("ym", "ci", "ym_list", "list_keys", "same_fields")
    for name in body_cols:
        one = df.select("id", "correlation_id", name)
        _refused(lambda d=one: process_messages(d, record_body, **stores), name, kinds[name])
    ok = df.select("id", "correlation_id", "h_int", "h_text")
    for name in ("h_int", "h_text"):
        _refused(
            lambda n=name: process_messages(ok, record_body, headers_col=n, **stores),
            name,
            kinds[name],
        )
    assert not (tmp_path / "stores.db").exists()


# ---------------------------------------------------------------------- null ids


@LOCAL
def test_a_null_id_fails_the_task_naming_the_column_and_the_row(spark: Any, tmp_path: Path) -> None:
    stores = _stores(tmp_path)
    df = spark.createDataFrame(
        [("m1", "alice", 1), (None, "bob", 7)], "msg string, account string, seq int"
    )
    args: dict[str, Any] = {"id_col": "msg", "correlation_col": "account", "partitions": 1}
    null_id = r"column 'msg' holds a null message id \(correlation id 'bob', seq 7\)"
    with pytest.raises(Exception, match=null_id):
        process_messages(df, handle_sequence, order_col="seq", **args, **stores).collect()
    nulls = spark.createDataFrame([("m1", "alice"), ("m2", None)], "msg string, account string")
    null_cid = r"column 'account' holds a null correlation id \(message id 'm2'\)"
    with pytest.raises(Exception, match=null_cid):
        drop_processed(nulls, stores["dedup_url"], "msg", "account").collect()


def test_null_and_empty_ids_name_their_columns() -> None:
    """The task's own check, in this process: every combination, no Spark job."""
    from dedupstore.spark._columns import message_ids

    cases = [
        ((None, "a"), r"column 'msg' holds a null message id \(correlation id 'a'\)"),
        (("m", None), r"column 'acct' holds a null correlation id \(message id 'm'\)"),
        ((None, None), r"columns 'msg' and 'acct' hold a null message id and a null correlation"),
        (("", "a"), r"message id in column 'msg' must not be empty"),
        (("m", "a\x00"), r"correlation id in column 'acct' .*NUL"),
    ]
    for (mid, cid), pattern in cases:
        with pytest.raises(InvalidMessageId, match=pattern):
            message_ids(mid, cid, "msg", "acct")
    assert message_ids("m", "a", "msg", "acct") == ("m", "a")


def post_amount(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    balance = state.get("balance", 0) + message.body["amount"]
    return {"balance": balance}, [Send("ledger.posted", {"amount": message.body["amount"]})]


@LOCAL
def test_the_same_id_under_two_entities_is_two_messages_in_spark(
    spark: Any, tmp_path: Path
) -> None:
    """Per-account sequence numbers: txn 1 of alice and txn 1 of bob are both applied."""
    stores = _stores(tmp_path)
    rows = [(1, "alice", 100), (1, "bob", 250), (2, "alice", 5), (1, "alice", 100)]
    df = spark.createDataFrame(rows, "id long, correlation_id string, amount long")
    args: dict[str, Any] = {"cleanup": "deferred", "partitions": 2, **stores}
    first = process_messages(df, post_amount, **args).collect()
    outcomes = sorted((r["correlation_id"], r["message_id"], r["outcome"]) for r in first)
    assert outcomes == [
        ("alice", "1", "duplicate"),
        ("alice", "1", "processed"),
        ("alice", "2", "processed"),
        ("bob", "1", "processed"),
    ]
    outgoing = [i for r in first for i in r["outgoing_ids"] if r["outcome"] == "processed"]
    assert len(set(outgoing)) == 3, "alice's and bob's txn 1 have distinct outgoing ids"
    from dedupstore import open_entity_store, open_store
    from dedupstore.outbox import sweep

    with (
        open_entity_store(stores["entities_url"]) as entities,
        open_store(stores["dedup_url"]) as dedup,
    ):
        assert sweep(entities, dedup).ids_left == 0
        balances = {e.id: e.state["balance"] for e in entities.load_many(["alice", "bob"]).values()}
    assert balances == {"alice": 105, "bob": 250}
    assert drop_processed(df, stores["dedup_url"]).count() == 0
    fresh = spark.createDataFrame([(1, "carol", 1)], "id long, correlation_id string, amount long")
    assert drop_processed(df.unionByName(fresh), stores["dedup_url"]).count() == 1
    again = process_messages(df, post_amount, **args).collect()
    assert {r["outcome"] for r in again} == {"duplicate"}
