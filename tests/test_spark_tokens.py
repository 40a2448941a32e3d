"""The Spark jobs in token mode, on real Spark and real stores.

``mint_tokens`` at the boundary, then ``process_messages`` / ``run_messages`` /
``process_stream`` consuming the tokens (minting their own outputs' tokens for the
subscribed endpoints) and ``sweep_outboxes`` deleting those of deferred entries.
Every backend on ``local``; Spark Connect and a local cluster on one backend each.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import dedupstore
from dedupstore.errors import ConfigurationError
from dedupstore.ids import message_key
from dedupstore.spark import (
    drop_processed,
    mint_tokens,
    process_messages,
    process_stream,
    run_messages,
    sweep_outboxes,
)
from dedupstore.spark.order_pipeline import INPUT_SCHEMA
from dedupstore.spark.orders import expected_outgoing, handle_order
from dedupstore.tokens import TOKEN_HEADER, token_id
from tests.outbox_backends import OutboxBackend
from tests.test_spark import _outcomes, _pairs, _workload

TOKEN_PAIRS = _pairs(
    [
        ("local", "sqlite"),
        ("local", "postgres"),
        ("local", "redis"),
        ("local", "dynamodb"),
        ("local", "cosmos"),
        ("connect", "sqlite"),
        ("cluster", "redis"),
    ]
)
#: The job's endpoint (its deduplication store's), and the receiver it mints for.
ENDPOINT, SHIPPING = "orders", "shipping"


def _args(backend: OutboxBackend, queue: str, **more: Any) -> dict[str, Any]:
    return {
        "entities_url": backend.entities_url,
        "dedup_url": backend.dedup_url,
        "tokens_url": backend.tokens_url,
        "entities_options": backend.options,
        "dedup_options": {**backend.options, "endpoint": ENDPOINT},
        "tokens_options": backend.options,
        "dispatcher_url": queue,
        "correlation_col": "order_id",
        "order_col": "seq",
        "headers_col": "headers",
        "batch_size": 20,
        **more,
    }


def _mint(df: Any, backend: OutboxBackend, path: Path) -> Any:
    return mint_tokens(
        df,
        tokens_url=backend.tokens_url,
        tokens_options=backend.options,
        endpoints=[ENDPOINT],
        results_path=str(path),
    )


def _outstanding(backend: OutboxBackend) -> dict[str, int]:
    with backend.tokens() as tokens:
        return {ep: count.outstanding for ep, count in tokens.outstanding().items()}


def _check_applied_once(backend: OutboxBackend, commands: list[dict[str, Any]]) -> None:
    """Each command applied once; none of their ids in the deduplication store."""
    with backend.entities() as entities:
        found = entities.load_many(sorted({c["order_id"] for c in commands}))
    applied = Counter(mid for e in found.values() for mid in e.state.get("applied", []))
    assert applied == Counter(c["id"] for c in commands)
    with backend.dedup(endpoint=ENDPOINT) as dedup:
        keys = [message_key(c["order_id"], c["id"]) for c in commands]
        assert dedup.processed_among(keys) == set()  # token mode records nothing there


def _sweep(spark: Any, backend: OutboxBackend, **more: Any) -> dict[str, int]:
    rows = sweep_outboxes(
        spark,
        backend.entities_url,
        backend.dedup_url,
        segments=2,
        entities_options=backend.options,
        dedup_options={**backend.options, "endpoint": ENDPOINT},
        **more,
    ).collect()
    return {k: sum(r[k] for r in rows) for k in ("entities_scanned", "ids_moved", "ids_left")}


def _dropped(df: Any, backend: OutboxBackend, *, entities: bool = False) -> Any:
    """``drop_processed`` of ``df``'s messages in token mode."""
    more: dict[str, Any] = {}
    if entities:
        more = {"entities_url": backend.entities_url, "entities_options": backend.options}
    return drop_processed(
        df.select("id", "order_id", "headers"),
        backend.dedup_url,
        "id",
        "order_id",
        dedup_options={**backend.options, "endpoint": ENDPOINT},
        headers_col="headers",
        tokens_url=backend.tokens_url,
        tokens_options=backend.options,
        **more,
    )


@pytest.mark.parametrize(("spark", "outbox_backend"), TOKEN_PAIRS, indirect=True)
def test_minted_input_is_processed_once_and_leaves_no_tokens(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """Mint, process (duplicates dropped by their consumed tokens), sweep: each command
    applied once, its outputs dispatched with a token for the subscribed receiver,
    nothing in the deduplication store, and after the sweep only the outputs' tokens
    left. Minting again with the same path and processing again change nothing."""
    commands, rows = _workload(outbox_backend, orders=30)
    queue = f"sqlite:///{tmp_path}/outgoing.db"
    df = spark.createDataFrame(rows, INPUT_SCHEMA)
    minted = _mint(df, outbox_backend, tmp_path / "mint")
    distinct = len({r[0] for r in rows})
    assert _outstanding(outbox_backend) == {ENDPOINT: distinct}
    assert spark.read.parquet(str(tmp_path / "mint")).count() == len(rows)  # the mint's record

    assert _dropped(minted, outbox_backend).count() == len(rows)  # none processed yet

    args = _args(outbox_backend, queue, subscriptions={"orders.submitted": [SHIPPING]})
    first = _outcomes(process_messages(minted, handle_order, **args))
    assert first == Counter({"processed": len(commands), "duplicate": len(rows) - len(commands)})
    _check_applied_once(outbox_backend, commands)
    # deferred: the ids wait in the outboxes, their tokens too, until the sweep
    assert _dropped(minted, outbox_backend, entities=True).count() == 0
    assert _dropped(minted, outbox_backend).count() == len(rows)

    swept = _sweep(
        spark,
        outbox_backend,
        tokens_url=outbox_backend.tokens_url,
        tokens_options=outbox_backend.options,
    )
    # every entry cleared (its token deleted, no id added)
    assert swept["ids_left"] == 0 and swept["ids_moved"] == len(commands)
    assert _dropped(minted, outbox_backend).count() == 0
    with dedupstore.open_dispatcher(queue) as out:
        stored = [m.message for m in out.messages()]  # type: ignore[attr-defined]
    prefix = commands[0]["id"].split("/")[0] + "/"
    ours = [m for m in stored if m.headers.get("source", "").startswith(prefix)]
    assert {m.id for m in ours} == set(expected_outgoing(commands, ENDPOINT))
    submitted = [m for m in ours if m.destination == "orders.submitted"]
    assert submitted and all(TOKEN_HEADER in m.headers for m in submitted)
    assert not any(TOKEN_HEADER in m.headers for m in ours if m.destination != "orders.submitted")
    wanted = [token_id(m.id, SHIPPING, m.headers[TOKEN_HEADER]) for m in submitted]
    with outbox_backend.tokens() as tokens:
        assert tokens.present_among(wanted) == set(wanted)
    assert _outstanding(outbox_backend) == {SHIPPING: len(submitted)}  # the input's: consumed

    again = _mint(df, outbox_backend, tmp_path / "mint")  # a finished run: nothing created
    assert _outstanding(outbox_backend) == {SHIPPING: len(submitted)}
    rerun = _outcomes(process_messages(again, handle_order, **args))
    assert rerun == Counter({"duplicate": len(rows)})
    _check_applied_once(outbox_backend, commands)


@pytest.mark.parametrize(("spark", "outbox_backend"), _pairs([("local", "sqlite")]), indirect=True)
def test_a_mint_run_cut_short_is_finished_with_the_same_nonces(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """A mint whose job failed creates, when called again with the same path, the same
    tokens (the nonces depend on the path and the id); a new path mints new ones: a
    deliberate replay, applied again."""
    commands, rows = _workload(outbox_backend, orders=8)
    df = spark.createDataFrame(rows, INPUT_SCHEMA)
    path = tmp_path / "mint"
    path.mkdir()
    (path / "part-00000-leftover.parquet").write_bytes(b"not parquet")  # a failed write's
    first = _mint(df, outbox_backend, path).select("id", "headers").collect()
    nonces = {r["id"]: r["headers"][TOKEN_HEADER] for r in first}
    assert len(set(nonces.values())) == len(nonces)
    later = _mint(df, outbox_backend, path).select("id", "headers").collect()
    assert {r["id"]: r["headers"][TOKEN_HEADER] for r in later} == nonces
    assert _outstanding(outbox_backend) == {ENDPOINT: len(nonces)}

    queue = f"sqlite:///{tmp_path}/outgoing.db"
    args = _args(outbox_backend, queue, cleanup="inline")  # (deferred: the ids wait in the outbox)
    minted = _mint(df, outbox_backend, path)
    assert _outcomes(process_messages(minted, handle_order, **args))["processed"] == len(commands)
    replay = _mint(df, outbox_backend, tmp_path / "replay")
    again = _outcomes(process_messages(replay, handle_order, **args))
    assert again["processed"] == len(commands)  # minted again on purpose: applied again
    with outbox_backend.entities() as entities:
        found = entities.load_many(sorted({c["order_id"] for c in commands}))
    applied = Counter(mid for e in found.values() for mid in e.state.get("applied", []))
    assert set(applied.values()) == {2}


@pytest.mark.parametrize(("spark", "outbox_backend"), _pairs([("local", "sqlite")]), indirect=True)
def test_hybrid_input_and_run_messages_record_each_row(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """Half the orders minted, half not (the boundary): run_messages processes both in
    one job, the tokened through the token store and the rest through the
    deduplication store; a re-run of the record's path changes nothing."""
    from pyspark.sql import functions as F

    commands, rows = _workload(outbox_backend, orders=12)
    orders = sorted({r[1] for r in rows})
    df = spark.createDataFrame(rows, INPUT_SCHEMA)
    minted = _mint(df.where(df.order_id.isin(orders[::2])), outbox_backend, tmp_path / "mint")
    no_headers = F.create_map().cast("map<string,string>")
    plain = df.where(~df.order_id.isin(orders[::2])).withColumn("headers", no_headers)
    hybrid = minted.unionByName(plain)
    queue = f"sqlite:///{tmp_path}/outgoing.db"
    args = _args(outbox_backend, queue, cleanup="inline")
    record = run_messages(hybrid, handle_order, results_path=str(tmp_path / "run"), **args)
    assert _outcomes(record) == Counter(
        {"processed": len(commands), "duplicate": len(rows) - len(commands)}
    )
    with outbox_backend.entities() as entities:
        found = entities.load_many(orders)
    applied = Counter(mid for e in found.values() for mid in e.state.get("applied", []))
    assert applied == Counter(c["id"] for c in commands)
    keys = {message_key(c["order_id"], c["id"]): c["order_id"] for c in commands}
    with outbox_backend.dedup(endpoint=ENDPOINT) as dedup:
        recorded = dedup.processed_among(list(keys))
    assert {keys[k] for k in recorded} == set(orders[1::2])  # only the untokened half
    assert _outstanding(outbox_backend) == {}


def _write_json(directory: Path, name: str, rows: list[dict[str, Any]]) -> None:
    text = "\n".join(json.dumps(row) for row in rows)
    (directory / f".{name}.tmp").write_text(text + "\n")
    os.replace(directory / f".{name}.tmp", directory / f"{name}.json")


@pytest.mark.parametrize(("spark", "outbox_backend"), _pairs([("local", "sqlite")]), indirect=True)
@pytest.mark.timeout(600)
def test_a_stream_of_minted_messages_consumes_their_tokens(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """process_stream in token mode: files of minted rows (one of them delivered again
    in a later file) are processed once; the tokens are gone."""
    commands, rows = _workload(outbox_backend, orders=10)
    df = spark.createDataFrame(rows, INPUT_SCHEMA)
    minted = [r.asDict() for r in _mint(df, outbox_backend, tmp_path / "mint").collect()]
    orders = sorted({r["order_id"] for r in minted})
    inbox = tmp_path / "in"
    inbox.mkdir()
    _write_json(inbox, "part-0", [r for r in minted if orders.index(r["order_id"]) % 2 == 0])
    _write_json(inbox, "part-1", [r for r in minted if orders.index(r["order_id"]) % 2 == 1])
    _write_json(inbox, "part-2", [r for r in minted if r["order_id"] == orders[0]])
    schema = f"{INPUT_SCHEMA}, headers map<string,string>"
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(inbox))
    queue = f"sqlite:///{tmp_path}/outgoing.db"
    query = process_stream(
        stream,
        handle_order,
        checkpoint=str(tmp_path / "ckpt"),
        results_path=str(tmp_path / "results"),
        trigger={"availableNow": True},
        **_args(outbox_backend, queue, cleanup="inline"),
    )
    query.awaitTermination()
    assert query.exception() is None
    out = Counter(r["outcome"] for r in spark.read.parquet(str(tmp_path / "results")).collect())
    redelivered = sum(1 for r in minted if r["order_id"] == orders[0])
    assert out == Counter(
        {"processed": len(commands), "duplicate": len(rows) - len(commands) + redelivered}
    )
    _check_applied_once(outbox_backend, commands)
    assert _outstanding(outbox_backend) == {}


@pytest.mark.parametrize("spark", ["local"], indirect=True)
def test_token_arguments_are_refused_before_any_io(spark: Any, tmp_path: Path) -> None:
    df = spark.createDataFrame([("a", "e", 1)], "id string, correlation_id string, n int")
    db = tmp_path / "never.db"
    url = f"sqlite:///{db}"
    good = {"tokens_url": url, "endpoints": ["orders"], "results_path": str(tmp_path / "m")}
    for bad, match in [
        ({"endpoints": "orders"}, "endpoints must be a non-empty list"),
        ({"endpoints": []}, "endpoints must be a non-empty list"),
        ({"endpoints": [""]}, "endpoints"),
        ({"tokens_url": "nope://x"}, "nope"),
        ({"tokens_url": "memory://x"}, "lives in one process"),
        ({"results_path": ""}, "results_path"),
        ({"id_col": "missing"}, "missing"),
        ({"id_col": "n", "headers_col": "n"}, "headers"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            mint_tokens(df, **{**good, **bad})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("keep me")
    with pytest.raises(ConfigurationError, match=r"data\.csv"):
        mint_tokens(df, **{**good, "results_path": str(foreign)})
    assert (foreign / "data.csv").read_text() == "keep me"
    args = {"entities_url": url, "dedup_url": url, "dispatcher_url": url}
    with pytest.raises(ConfigurationError, match="subscriptions need tokens_url"):
        process_messages(df, handle_order, subscriptions={"x": ["y"]}, **args)
    with pytest.raises(ConfigurationError, match="subscri"):
        process_messages(df, handle_order, tokens_url=url, subscriptions={"x": "y"}, **args)
    with pytest.raises(ConfigurationError, match="lives in one process"):
        process_messages(df, handle_order, tokens_url="memory://x", **args)
    with pytest.raises(ConfigurationError, match="lives in one process"):
        sweep_outboxes(spark, url, url, segments=1, tokens_url="memory://x")
    with pytest.raises(ConfigurationError, match="go together"):
        drop_processed(df, url, headers_col="n")
    with pytest.raises(ConfigurationError, match="headers must be a map"):
        drop_processed(df, url, headers_col="n", tokens_url=url)
    assert not db.exists()


@pytest.mark.parametrize(("spark", "outbox_backend"), _pairs([("local", "sqlite")]), indirect=True)
def test_a_row_with_a_null_id_gets_no_token_and_is_set_aside(
    spark: Any, outbox_backend: OutboxBackend, tmp_path: Path
) -> None:
    """A bad row is set aside, not fatal: minting skips it (no token, no header), and
    process_messages with dead_letters sets it aside as without tokens."""
    commands, rows = _workload(outbox_backend, orders=6)
    bad = (None, rows[0][1], 99, "add_item", "sku-1", 1)
    df = spark.createDataFrame([*rows, bad], INPUT_SCHEMA)
    minted = _mint(df, outbox_backend, tmp_path / "mint")
    headers = [r["headers"] for r in minted.where(minted.id.isNull()).collect()]
    assert headers == [{}]
    assert spark.read.parquet(str(tmp_path / "mint")).count() == len(rows)
    queue = f"sqlite:///{tmp_path}/outgoing.db"
    args = _args(outbox_backend, queue, cleanup="inline", dead_letters="dead")
    outcomes = _outcomes(process_messages(minted, handle_order, **args))
    assert outcomes == Counter(
        {
            "processed": len(commands),
            "duplicate": len(rows) - len(commands),
            "dead_lettered": 1,
        }
    )
    assert _outstanding(outbox_backend) == {}


# (last: its command starts and stops a session of its own)
def test_the_spark_sweep_command_deletes_the_tokens_of_deferred_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dedupstore sweep --tokens``: without it an entity in token mode is refused,
    nothing written; with it its entry is cleared and its token deleted."""
    from dedupstore.cli import main
    from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor

    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path}/sw.db"
    nonce = "n1"
    with (
        dedupstore.open_entity_store(url) as entities,
        dedupstore.open_store(url, endpoint=ENDPOINT) as dedup,
        dedupstore.open_token_store(url) as tokens,
    ):
        tokens.create({token_id("dep-1", ENDPOINT, nonce): ENDPOINT})
        processor = OutboxProcessor(
            entities, dedup, InMemoryDispatcher(), cleanup="deferred", tokens=tokens
        )
        deposit = Message("dep-1", "acct-1", 100, {TOKEN_HEADER: nonce})
        credit = lambda state, m: ({"balance": state.get("balance", 0) + m.body}, [])  # noqa: E731
        assert processor.process(deposit, credit).outcome == "processed"
    cli = ["sweep", "--entities", url, "--store", url, "--segments", "2", "--master", "local[2]"]
    assert main(cli) != 0
    assert "token store" in capsys.readouterr().err
    with dedupstore.open_entity_store(url) as entities:
        assert entities.load("acct-1").outbox == {"dep-1": None}
    assert main([*cli, "--tokens", url]) == 0
    with (
        dedupstore.open_entity_store(url) as entities,
        dedupstore.open_store(url, endpoint=ENDPOINT) as dedup,
        dedupstore.open_token_store(url) as tokens,
    ):
        assert entities.load("acct-1").outbox == {} and dedup.count() == 0
        assert tokens.outstanding() == {}
