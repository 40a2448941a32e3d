"""The record of a run (``run_messages``, ``process_stream(results_path=)``) on real Spark.

A run writes each batch's result rows once, before any clean-up, so the record says
what the run did whichever attempt of a task got through: checked here against a
plain model of the input with a Python worker killed mid-task, batches that fail
after dispatching, a poison message among 10,000, a full replay, a run resumed
after it failed, and a stream restarted from its checkpoint.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import dedupstore
from dedupstore.errors import ConfigurationError
from dedupstore.ids import outgoing_id
from dedupstore.outbox import Message, Send
from dedupstore.spark import process_stream, run_messages
from dedupstore.spark._faults import FlakyDispatcher, _claim
from tests.test_dead_letters import deposit

SCHEMA = "id string, correlation_id string, amount long"


def _rows(n: int, entities: int, poison: int, copies: int) -> list[tuple[str, str, int]]:
    """``n`` deposits over ``entities`` accounts, one poison (negative), ``copies`` repeated."""
    rows = [(f"m{i}", f"acct-{i % entities}", -1 if i == poison else 1 + i % 5) for i in range(n)]
    return rows + rows[: copies * 7 : 7]


def _check_record(
    record: list[Any], rows: list[tuple[str, str, int]], poison: str | None, db: str, queue: str
) -> None:
    """The record, the states and the queue against the model of ``rows``."""
    assert len(record) == len(rows)
    by_key: dict[tuple[str, str], Counter[str]] = {}
    for r in record:
        by_key.setdefault((r["correlation_id"], r["message_id"]), Counter())[r["outcome"]] += 1
    model = Counter((cid, mid) for mid, cid, _ in rows)
    assert set(by_key) == set(model)
    for key, outcomes in by_key.items():
        first = "dead_lettered" if key[1] == poison else "processed"
        assert outcomes == Counter({first: 1, "duplicate": model[key] - 1}), key
    letters = [r for r in record if r["outcome"] == "dead_lettered"]
    errors = ["ValueError: a deposit cannot be negative: -1"] if poison else []
    assert [r["error"] for r in letters] == errors
    consumer = "default"
    for r in record:
        if r["outcome"] == "processed":
            assert r["outgoing_ids"] == [
                outgoing_id(consumer, r["correlation_id"], r["message_id"], 0)
            ]
        elif r["outcome"] == "dead_lettered":
            assert r["outgoing_ids"] == [
                outgoing_id(consumer, r["correlation_id"], r["message_id"], -1)
            ]
    with dedupstore.open_dispatcher(queue) as dispatcher:
        sent = {s.message.id: s.message for s in dispatcher.messages()}  # type: ignore[attr-defined]
    recorded = {i for r in record if r["outcome"] != "duplicate" for i in r["outgoing_ids"]}
    assert set(sent) == recorded
    letters = [m.body["message"]["id"] for m in sent.values() if m.destination == "dlq"]
    assert letters == ([poison] if poison else [])
    balances: Counter[str] = Counter()
    for mid, cid, amount in dict.fromkeys(rows):
        if mid != poison:
            balances[cid] += amount
    with dedupstore.open_entity_store(db) as entities:
        found = entities.load_many(sorted(balances))
    assert {cid: e.state["balance"] for cid, e in found.items()} == dict(balances)


@pytest.mark.sqlite
@pytest.mark.timeout(900)
@pytest.mark.parametrize("spark", ["local", "connect"], indirect=True)
@pytest.mark.parametrize("cleanup", ["deferred", "inline"])
def test_a_poison_message_among_ten_thousand_with_a_killed_worker_and_a_replay(
    spark: Any, tmp_path: Path, cleanup: str
) -> None:
    db, queue = f"sqlite:///{tmp_path}/stores.db", f"sqlite:///{tmp_path}/queue.db"
    marker = tmp_path / "killed"
    rows = _rows(10_000, 100, poison=4321, copies=300)
    df = spark.createDataFrame(rows, SCHEMA)
    # one worker killed after a dispatch, and a tenth of the batches fail after dispatching
    flaky = FlakyDispatcher(queue, fail=0.0, crash=0.1, kill_marker=str(marker), seed=3)
    args: dict[str, Any] = {
        "entities_url": db,
        "dedup_url": db,
        "cleanup": cleanup,
        "partitions": 4,
        "batch_size": 500,
        "dead_letters": "dlq",
    }
    results = tmp_path / "run-1"
    record = run_messages(df, deposit, results_path=str(results), dispatcher_url=flaky, **args)
    assert marker.exists()  # a worker really died mid-task, and Spark retried its task
    first = record.collect()
    _check_record(first, rows, "m4321", db, queue)
    assert sorted(record.collect()) == sorted(first)  # read again: nothing runs again
    assert (results / "_SUCCESS").exists()
    with pytest.raises(ConfigurationError, match="holds a finished run"):
        run_messages(df, deposit, results_path=str(results), dispatcher_url=queue, **args)
    replay = run_messages(
        df, deposit, results_path=str(tmp_path / "run-2"), dispatcher_url=queue, **args
    )
    assert Counter(r["outcome"] for r in replay.collect()) == Counter({"duplicate": len(rows)})
    _check_record(first, rows, "m4321", db, queue)  # the replay sent nothing new


class DepositWithABug:
    """``deposit``, failing on m77 until ``fixed`` exists: a bug, not poison (no dead letter)."""

    def __init__(self, fixed: str) -> None:
        self.fixed = fixed

    def __call__(
        self, state: dict[str, Any], message: Message
    ) -> tuple[dict[str, Any], list[Send]]:
        if message.id == "m77" and not os.path.exists(self.fixed):
            raise KeyError("a bug")
        return deposit(state, message)


@pytest.mark.sqlite
@pytest.mark.parametrize("spark", ["local"], indirect=True)
def test_a_failed_run_is_finished_by_running_it_again_on_its_path(
    spark: Any, tmp_path: Path
) -> None:
    db, queue = f"sqlite:///{tmp_path}/stores.db", f"sqlite:///{tmp_path}/queue.db"
    rows = _rows(2_000, 40, poison=-1, copies=50)
    df = spark.createDataFrame(rows, SCHEMA)
    args: dict[str, Any] = {
        "entities_url": db,
        "dedup_url": db,
        "dispatcher_url": queue,
        "partitions": 4,
        "batch_size": 50,
    }
    path = (tmp_path / "run").as_uri()  # a URI: the journal goes through pyarrow.fs
    handler = DepositWithABug(str(tmp_path / "fixed"))
    with pytest.raises(Exception, match="'m77' of entity 'acct-37'"):
        run_messages(df, handler, results_path=path, **args)
    assert not (tmp_path / "run" / "_SUCCESS").exists()
    assert list((tmp_path / "run").glob("batch=*/part-*.parquet"))  # some batches recorded
    (tmp_path / "fixed").touch()
    record = run_messages(df, handler, results_path=path, **args)
    _check_record(record.collect(), rows, None, db, queue)


@pytest.mark.sqlite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("spark", ["local"], indirect=True)
def test_a_stream_restarted_from_its_checkpoint_keeps_an_exact_record(
    spark: Any, tmp_path: Path
) -> None:
    db, queue = f"sqlite:///{tmp_path}/stores.db", f"sqlite:///{tmp_path}/queue.db"
    inbox, checkpoint, results = tmp_path / "in", tmp_path / "ckpt", tmp_path / "results"
    inbox.mkdir()
    rows = _rows(10_000, 30, poison=2222, copies=300)
    parts = [rows[:4000], rows[4000:8000], rows[8000:]]  # the last one has the copies
    for n, part in enumerate(parts):
        text = "\n".join(f'{{"id":"{m}","correlation_id":"{c}","amount":{a}}}' for m, c, a in part)
        (inbox / f".{n}.tmp").write_text(text + "\n")
        os.replace(inbox / f".{n}.tmp", inbox / f"part-{n}.json")
    flag = tmp_path / "die"
    flag.touch()
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(inbox))
    args: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "results_path": str(results),
        "trigger": {"availableNow": True},
        "dispatcher_url": DieOnFile(queue, str(flag), "m5500", str(tmp_path / "killed")),
        "entities_url": db,
        "dedup_url": db,
        "batch_size": 500,
        "retries": 0,
        "dead_letters": "dlq",
    }
    query = process_stream(stream, deposit, **args)
    with pytest.raises(Exception, match="injected"):
        query.awaitTermination()
    flag.unlink()
    query = process_stream(stream, deposit, **args)  # the same checkpoint: batch 1 replayed
    query.awaitTermination()
    assert query.exception() is None
    out = spark.read.parquet(str(results))
    assert sorted({r["batch_id"] for r in out.select("batch_id").collect()}) == [0, 1, 2]
    assert (tmp_path / "killed").exists()  # a worker died mid-task in the first micro-batch
    _check_record(out.collect(), rows, "m2222", db, queue)
    replay = run_messages(
        spark.createDataFrame(rows, SCHEMA),
        deposit,
        results_path=str(tmp_path / "replay"),
        dispatcher_url=queue,
        entities_url=db,
        dedup_url=db,
        dead_letters="dlq",
    )
    assert Counter(r["outcome"] for r in replay.collect()) == Counter({"duplicate": len(rows)})
    _check_record(out.collect(), rows, "m2222", db, queue)  # the replay sent nothing new


class DieOnFile:
    """Dispatches, then: kills its Python worker once (``kill_marker``), and fails while
    ``flag`` exists for a batch holding ``mid``'s outputs (the query dies)."""

    def __init__(self, url: str, flag: str, mid: str, kill_marker: str) -> None:
        self.url, self.flag, self.mid, self.kill_marker = url, flag, mid, kill_marker

    def __call__(self, messages: list[Any]) -> None:
        with dedupstore.open_dispatcher(self.url) as queue:
            queue.dispatch(messages)
        if _claim(self.kill_marker):
            os._exit(3)  # a worker killed mid-task: Spark retries the task
        mine = outgoing_id("default", f"acct-{int(self.mid[1:]) % 30}", self.mid, 0)
        if os.path.exists(self.flag) and any(m.id == mine for m in messages):
            raise RuntimeError("injected: the query dies after dispatching this micro-batch")
