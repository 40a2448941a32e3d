"""The outbox backlog (``dedupstore.stats``), ``DeduplicationStore.count`` and ``dedupstore stats``.

Every backend: a backlog built by the processor (a dispatcher that refuses some
messages, so their entries stay pending; deferred clean-up, so dispatched entries
await the sweep) is counted exactly, field by field, whole and by segments; the
live ids of an endpoint are counted exactly, other endpoints and expired records
(not yet purged) left out. The command runs on every backend too, and on SQLite
its edge cases (configuration, a missing store).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from dedupstore.backends.memory import MemoryDeduplicationStore
from dedupstore.cli import main
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError, StoreClosed
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, sweep
from dedupstore.stats import PROGRESS_EVERY, Backlog, outbox_backlog
from dedupstore.store import DeduplicationStore
from dedupstore.testing.contract import FakeClock
from tests.outbox_backends import OutboxBackend, backend_params


def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Sends ``body["sends"]`` messages; those of a ``fail`` message cannot be dispatched."""
    sends = [
        Send("out", {"n": n, "fail": message.body["fail"]}) for n in range(message.body["sends"])
    ]
    return {"n": state.get("n", 0) + 1}, sends


class Refusing:
    """Dispatches, except the messages of a ``fail`` message (their entry stays pending)."""

    def __init__(self) -> None:
        self.sent: list[OutgoingMessage] = []

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        if any(m.body["fail"] for m in messages):
            raise ConnectionError("broker refuses")
        self.sent.extend(messages)


def _ms(moment: float) -> datetime:
    """``moment`` (epoch seconds) truncated to the millisecond, as a mark stores it."""
    return datetime.fromtimestamp(math.floor(moment * 1000) / 1000, UTC)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DEDUPSTORE_ENV", "DEDUPSTORE_URL", "DEDUPSTORE_CONFIG", "DEDUPSTORE_ENTITIES_URL"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------- every backend


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
def test_backlog_and_count_are_exact(
    outbox_backend: OutboxBackend,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup(endpoint="orders")
    deferred = OutboxProcessor(entities, dedup, Refusing(), cleanup="deferred")
    inline = OutboxProcessor(entities, dedup, Refusing())
    try:
        assert outbox_backlog(entities) == Backlog(), "an empty store has no backlog"
        assert dedup.count() == 0

        def deliver(processor: OutboxProcessor, mid: str, cid: str, sends: int, fail: bool) -> None:
            message = Message(mid, cid, {"sends": sends, "fail": fail})
            if fail:
                with pytest.raises(ConnectionError):
                    processor.process(message, handler)
            else:
                assert processor.process(message, handler).outcome == "processed"

        deliver(deferred, "m1", "alice", 2, False)  # dispatched: awaits the sweep
        before = time.time()
        deliver(deferred, "m2", "alice", 3, True)  # the oldest pending entry
        after = time.time()
        time.sleep(0.01)
        later = time.time()
        deliver(deferred, "m3", "alice", 1, True)
        deliver(deferred, "m1", "bob", 1, False)
        deliver(deferred, "m1", "carol", 0, False)  # nothing to send: dispatched at once
        deliver(deferred, "m1", "dave", 2, True)
        deliver(inline, "m1", "erin", 1, False)  # moved at once: its outbox is empty

        backlog = outbox_backlog(entities)
        oldest = backlog.oldest_pending_at
        assert oldest is not None and oldest.utcoffset() == timedelta(0)
        assert _ms(before) <= oldest <= _ms(after) < _ms(later), (before, oldest, after)
        assert backlog == Backlog(
            entities_scanned=4,  # alice, bob, carol, dave
            entities_pending=2,  # alice, dave
            messages_pending=3,  # alice m2 and m3, dave m1
            outgoing_pending=6,  # 3 + 1 + 2
            ids_awaiting_sweep=3,  # alice m1, bob m1, carol m1
            oldest_pending_at=oldest,
            consumers=frozenset({"orders"}),  # the consumer recorded with each entity
        )
        assert datetime.fromisoformat(backlog.to_json()["oldest_pending_at"]) == oldest
        seen: list[Backlog] = []
        assert outbox_backlog(entities, segments=3, progress=seen.append) == backlog
        assert len(seen) == 3 and seen[-1] == backlog, "progress after each segment"
        parts = [outbox_backlog(entities, segment=s, segments=3) for s in range(3)]
        assert parts[0].merged(parts[1]).merged(parts[2]) == backlog
        assert dedup.count() == 1, "erin m1; the others are still in outboxes"

        # the command reads the same through fresh clients, and creates nothing
        if "key" in outbox_backend.options:
            monkeypatch.setenv("COSMOS_KEY", outbox_backend.options["key"])
        argv = ["stats", "--entities", outbox_backend.entities_url]
        argv += ["--store", outbox_backend.dedup_url, "--endpoint", "orders", "--json"]
        assert main(argv) == 0, capsys.readouterr().err
        shown = json.loads(capsys.readouterr().out)
        assert {k: shown["entities"][k] for k in backlog.to_json()} == backlog.to_json()
        assert shown["entities"]["oldest_pending_age_seconds"] >= 0.01
        assert (shown["store"]["endpoint"], shown["store"]["ids"]) == ("orders", 1)
        assert "orders" in shown["store"]["endpoints"]

        relay = sweep(entities, dedup, redispatch=InMemoryDispatcher())
        assert (relay.redispatched, relay.ids_moved, relay.ids_left) == (3, 6, 0)
        assert outbox_backlog(entities) == Backlog()
        assert dedup.count() == 7
    finally:
        entities.close()
        dedup.close()


@pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)
def test_count_leaves_out_other_endpoints_and_expired_records(
    outbox_backend: OutboxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expired records count as absent before any purge; on every clock."""
    with outbox_backend.dedup() as probe:
        server_clock = probe.expiry_clock == "server"
    clock = FakeClock()
    unit = timedelta(seconds=2) if server_clock else timedelta(hours=1)

    def store(endpoint: str, **options: Any) -> DeduplicationStore:
        if not server_clock:
            options["clock"] = clock
        return outbox_backend.dedup(endpoint=endpoint, **options)

    # endpoints whose names are patterns (a glob, a LIKE) must match only themselves
    short, forever = store("ep*", retention=unit), store("ep*")
    other, similar = store("ep1"), store("ep[*]:x%")
    bulk = 150 if outbox_backend.name == "cosmos" else 2500  # several pages of a Redis SCAN
    if outbox_backend.name == "dynamodb":  # pages of 700 items: the count adds pages up
        client: Any = other._dynamodb.client  # type: ignore[attr-defined]
        scan = client.scan
        monkeypatch.setattr(client, "scan", lambda **request: scan(**request, Limit=700))
    try:
        assert short.add_many(["a:1", "a*2", "{a}3", "a%4"]) == {"a:1", "a*2", "{a}3", "a%4"}
        assert forever.add_many(["a:1", "b", "c"]) == {"b", "c"}, "a:1 is live: not re-recorded"
        assert other.add_many([f"o{n}" for n in range(bulk)]) == {f"o{n}" for n in range(bulk)}
        assert similar.add("ep*")
        assert [s.count() for s in (short, forever, other, similar)] == [6, 6, bulk, 1]
        if server_clock:
            time.sleep(unit.total_seconds() + 0.5)
        else:
            clock.advance(unit + timedelta(seconds=1))
        assert not forever.has_been_processed("a:1"), "expired: as if absent"
        assert [s.count() for s in (short, forever, other, similar)] == [2, 2, bulk, 1]
        short.purge_expired()
        assert (short.count(), forever.count()) == (2, 2), "a purge changes nothing counted"
        assert short.add("a:1") is True
        assert forever.count() == 3
    finally:
        for s in (short, forever, other, similar):
            s.close()
    with pytest.raises(StoreClosed):
        short.count()


@pytest.mark.parametrize("outbox_backend", backend_params(("redis",)), indirect=True)
def test_redis_count_skips_other_types_and_refuses_foreign_values(
    outbox_backend: OutboxBackend,
) -> None:
    import redis

    store = outbox_backend.dedup(endpoint="e")
    prefix = store.option("key_prefix")
    admin = redis.Redis.from_url(outbox_backend.dedup_url.split("?")[0])
    try:
        store.add_many(["x", "y"])
        admin.hset(f"{prefix}e:a-hash", "f", "v")  # another type reads as absent (MGET)
        admin.set(f"{prefix}e2:z", "dsv1:token")  # another endpoint
        assert store.count() == 2
        admin.set(f"{prefix}e:foreign", "not ours")
        with pytest.raises(ConfigurationError, match="did not write"):
            store.count()
    finally:
        store.close()
        admin.close()


# ---------------------------------------------------------------------- API edges


@pytest.mark.memory
def test_a_backend_that_cannot_count_answers_none(capsys: pytest.CaptureFixture[str]) -> None:
    class NoCount(MemoryDeduplicationStore):
        _count = DeduplicationStore._count

    url = f"memory://{uuid.uuid4().hex}"
    with NoCount(url) as store:
        store.add("a")
        assert store.count() is None
    with MemoryDeduplicationStore(url) as store:
        assert store.count() == 1


@pytest.mark.memory
def test_bad_segments_are_refused() -> None:
    from dedupstore.backends.memory import MemoryEntityStore

    with MemoryEntityStore(f"memory://{uuid.uuid4().hex}") as entities:
        for kwargs in ({"segments": 0}, {"segment": 3, "segments": 3}, {"segment": -1}):
            with pytest.raises(ValueError, match="segment"):
                outbox_backlog(entities, **kwargs)


@pytest.mark.memory
def test_progress_reports_every_so_many_entities() -> None:
    from dedupstore.backends.memory import MemoryEntityStore

    url = f"memory://{uuid.uuid4().hex}"
    with MemoryEntityStore(url) as entities, MemoryDeduplicationStore(url) as dedup:
        processor = OutboxProcessor(entities, dedup, Refusing(), cleanup="deferred")
        batch = [
            Message("m", f"e{n}", {"sends": 1, "fail": False}) for n in range(PROGRESS_EVERY + 5)
        ]
        processor.process_batch(batch, handler)
        seen: list[int] = []
        backlog = outbox_backlog(entities, progress=lambda b: seen.append(b.entities_scanned))
    assert seen == [PROGRESS_EVERY, PROGRESS_EVERY + 5]
    assert backlog.ids_awaiting_sweep == backlog.entities_scanned == PROGRESS_EVERY + 5
    assert backlog.oldest_pending_at is None and backlog.messages_pending == 0


# ---------------------------------------------------------------------- the command


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _backlog_on_sqlite(url: str) -> None:
    from dedupstore import open_entity_store, open_store

    with open_entity_store(url) as entities, open_store(url, endpoint="orders") as dedup:
        processor = OutboxProcessor(entities, dedup, Refusing(), cleanup="deferred")
        for cid, fail in (("alice", True), ("bob", False)):
            with pytest.raises(ConnectionError) if fail else contextlib.nullcontext():
                processor.process(Message("m1", cid, {"sends": 2, "fail": fail}), handler)
        OutboxProcessor(entities, dedup, Refusing()).process(
            Message("m1", "carol", {"sends": 1, "fail": False}), handler
        )


@pytest.mark.sqlite
def test_stats_json_and_text_on_sqlite(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = "sqlite:///stats.db"
    _backlog_on_sqlite(url)
    assert main(["stats", "--entities", url, "--store", url, "--endpoint", "orders", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    at = datetime.fromisoformat(shown["entities"].pop("oldest_pending_at"))
    age = shown["entities"].pop("oldest_pending_age_seconds")
    assert at.utcoffset() == timedelta(0) and age >= 0
    absolute = f"sqlite:///{in_tmp / 'stats.db'}"
    assert shown == {
        "entities": {
            "backend": "SqliteEntityStore",
            "url": absolute,
            "entities_scanned": 2,
            "entities_pending": 1,
            "messages_pending": 1,
            "outgoing_pending": 2,
            "ids_awaiting_sweep": 1,
            "consumers": ["orders"],
            "entities_tokened": 0,
        },
        "store": {
            "backend": "SqliteDeduplicationStore",
            "url": absolute,
            "endpoint": "orders",
            "ids": 1,
            "endpoints": ["orders"],
        },
        "tokens": None,  # no token store named (token mode: --tokens)
    }
    assert main(["stats", "--entities", url, "--store", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["entities:", "SqliteEntityStore", absolute]
    figures = {line.rsplit("  ", 1)[0].strip(): line.rsplit("  ", 1)[1] for line in lines[1:]}
    assert figures["messages pending dispatch"] == "1"
    assert figures["ids awaiting the sweep"] == "1"
    assert figures["oldest pending entry"].endswith(" ago)")
    assert figures["consumers recorded"] == "orders"
    assert figures["endpoints with records"] == "orders"
    # no --endpoint: the consumer recorded with the entities, not 'default'
    assert (figures["endpoint"], figures["live ids"]) == ("orders", "1")
    assert main(["stats", "--entities", url, "--store", url, "--endpoint", "default"]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = {line.rsplit("  ", 1)[0].strip(): line.rsplit("  ", 1)[1] for line in lines[1:]}
    assert (figures["endpoint"], figures["live ids"]) == ("default", "0")
    # one of the two, as asked
    assert main(["stats", "--store", url, "--endpoint", "orders", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["entities"] is None and shown["store"]["ids"] == 1
    assert main(["stats", "--entities", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["store"] is None and shown["entities"]["entities_scanned"] == 2


@pytest.mark.sqlite
def test_stats_lists_the_endpoints_present(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: `stats` showed "live ids 0" for `default` while other endpoints held data."""
    from dedupstore import open_store

    url = "sqlite:///present.db"
    with open_store(url, endpoint="orders") as orders, open_store(url, endpoint="x:y") as other:
        orders.add_many(["a", "b"])
        other.add("c")
        assert orders.endpoints() == {"orders", "x:y"}
    assert main(["stats", "--store", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["store"]
    assert shown["endpoints"] == ["orders", "x:y"] and shown["endpoint"] == "default"
    assert main(["stats", "--store", url]) == 0
    assert "endpoints with records  orders, x:y" in capsys.readouterr().out
    # one endpoint holding records: that one is counted
    only = "sqlite:///only.db"
    with open_store(only, endpoint="orders") as orders:
        orders.add("a")
    assert main(["stats", "--store", only, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["store"]
    assert (shown["endpoint"], shown["ids"], shown["endpoints"]) == ("orders", 1, ["orders"])


@pytest.mark.sqlite
def test_stats_uses_the_configuration(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _backlog_on_sqlite("sqlite:///conf.db")
    config = in_tmp / "dedupstore.toml"
    config.write_text("[default]\nurl = 'sqlite:///conf.db'\nendpoint = 'orders'\n")
    assert main(["stats", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["entities"] is None, "the configuration names no entity store"
    assert shown["store"]["ids"] == 1
    assert main(["stats"]) == 0
    out = capsys.readouterr().out
    assert "live ids" in out and "no entity store" in out and "entities_url" in out
    config.write_text(config.read_text() + "entities_url = 'sqlite:///conf.db'\n")
    assert main(["stats", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["entities"]["messages_pending"] == 1 and shown["store"]["ids"] == 1
    assert main(["stats", "--entities", "config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["store"] is None


@pytest.mark.sqlite
def test_stats_creates_no_store(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats"]) == 2, "no configuration: the embedded default, which does not exist"
    assert "no such store" in capsys.readouterr().err
    for argv in (["--entities", "sqlite:///typo.db"], ["--store", "sqlite:///typo.db"]):
        assert main(["stats", *argv, "--json"]) == 2
        err = capsys.readouterr().err
        assert "no such store" in err and str(in_tmp / "typo.db") in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(in_tmp.iterdir()) == [], "nothing may be created"
