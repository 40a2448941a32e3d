"""Dispatchers opened by URL (memory, sqlite, redis), callables, and the dispatcher registry."""

from __future__ import annotations

import math
import multiprocessing
import pickle
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis

import dedupstore
from dedupstore import (
    ConfigurationError,
    InvalidMessageId,
    MessageTooLarge,
    StoreClosed,
    StoreUnavailable,
    open_dispatcher,
    register,
    registry,
)
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryDispatcher, MemoryEntityStore
from dedupstore.backends.redis import RedisDispatcher, sent_key, stream_key
from dedupstore.backends.sqlite import SqliteDispatcher
from dedupstore.dispatch import (
    CallableDispatcher,
    DispatchStats,
    EncodedMessage,
    URLDispatcher,
)
from dedupstore.entities import OutgoingMessage
from dedupstore.outbox import Dispatcher, InMemoryDispatcher, Message, OutboxProcessor, Send
from dedupstore.registry import known, resolve
from tests.servers import HOST, RedisServer, Server, free_port
from tests.test_redis import _ReplyDroppingProxy, _wait_for


def _msg(
    mid: str, destination: str = "shipping", body: Any = None, **headers: str
) -> OutgoingMessage:
    return OutgoingMessage(mid, destination, {"mid": mid} if body is None else body, headers)


def _batch(prefix: str, count: int, destination: str = "shipping") -> list[OutgoingMessage]:
    return [_msg(f"{prefix}-{i}", destination) for i in range(count)]


def _name() -> str:
    return uuid.uuid4().hex


#: Batches every dispatcher refuses before any I/O, with the error each raises.
_INVALID: list[tuple[Any, type[Exception]]] = [
    (iter([_msg("a")]), TypeError),  # not a sequence
    ("abc", TypeError),
    ([_msg("a"), {"id": "b"}], TypeError),
    ([_msg("a"), _msg("")], InvalidMessageId),
    ([_msg("a"), _msg("x\x00y")], InvalidMessageId),
    ([_msg("a"), _msg("b", destination="")], InvalidMessageId),
    ([_msg("a"), _msg("b", body={1, 2})], ValueError),
    ([_msg("a"), _msg("b", body=math.nan)], ValueError),
    ([_msg("a"), OutgoingMessage("b", "d", 1, {"k": 1})], ValueError),  # type: ignore[dict-item]
]


# ====================================================================== memory://


@pytest.mark.memory
class TestMemoryDispatcher:
    def test_named_queue_is_shared_per_name(self) -> None:
        name = _name()
        with (
            open_dispatcher(f"memory://{name}") as first,
            open_dispatcher(f"memory://{name}") as second,
            open_dispatcher(f"memory://{name}-other") as other,
        ):
            assert isinstance(first, MemoryDispatcher)
            first.dispatch([_msg("a"), _msg("b")])
            second.dispatch([_msg("c")])
            assert [m.id for m in first.sent] == ["a", "b", "c"]
            assert [m.id for m in second.sent] == ["a", "b", "c"]
            assert other.sent == []

    def test_redispatch_shows_in_sent_and_distinct_keeps_the_first(self) -> None:
        with MemoryDispatcher(f"memory://{_name()}") as dispatcher:
            batch = [_msg("a"), _msg("b")]
            dispatcher.dispatch(batch)
            dispatcher.dispatch([*batch, _msg("c")])
            assert [m.id for m in dispatcher.sent] == ["a", "b", "a", "b", "c"]
            assert [m.id for m in dispatcher.distinct()] == ["a", "b", "c"]
            assert dispatcher.distinct()[0] == _msg("a")
            dispatcher.clear()
            assert dispatcher.sent == []

    def test_messages_are_copies_after_a_json_round_trip(self) -> None:
        body: dict[str, Any] = {"items": (1, 2), "nested": {"k": "v"}}
        with MemoryDispatcher(f"memory://{_name()}") as dispatcher:
            dispatcher.dispatch([OutgoingMessage("a", "d", body, {"h": "1"})])
            body["nested"]["k"] = "changed"
            [sent] = dispatcher.sent
            assert sent.body == {"items": [1, 2], "nested": {"k": "v"}}
            assert sent.headers == {"h": "1"}

    def test_pickled_copy_reopens_the_same_queue(self) -> None:
        url = f"memory://{_name()}"
        with MemoryDispatcher(url) as dispatcher:
            copy = pickle.loads(pickle.dumps(dispatcher))
            assert copy is not dispatcher and copy.url == url
            copy.dispatch([_msg("from-copy")])
            assert [m.id for m in dispatcher.sent] == ["from-copy"]
            copy.close()

    @pytest.mark.parametrize(("batch", "error"), _INVALID)
    def test_invalid_batches_are_refused_whole_before_any_io(
        self, batch: Any, error: type[Exception]
    ) -> None:
        with MemoryDispatcher(f"memory://{_name()}") as dispatcher:
            with pytest.raises(error):
                dispatcher.dispatch(batch)
            assert dispatcher.sent == [], "a valid message before the bad one was sent"

    def test_closed_dispatcher_refuses_use(self) -> None:
        with MemoryDispatcher(f"memory://{_name()}") as dispatcher:
            dispatcher.dispatch([_msg("a")])
        assert dispatcher.closed
        with pytest.raises(StoreClosed):
            dispatcher.dispatch([_msg("b")])
        with pytest.raises(StoreClosed):
            _ = dispatcher.sent

    def test_bad_memory_url_is_a_configuration_error(self) -> None:
        with pytest.raises(ConfigurationError, match="memory://<name>"):
            MemoryDispatcher("memory://user@name:12")
        with pytest.raises(ConfigurationError, match="unknown option 'table'"):
            open_dispatcher("memory://x?table=t")

    def test_outbox_processor_dispatches_through_it(self) -> None:
        name = _name()
        dispatcher = open_dispatcher(f"memory://{name}")
        processor = OutboxProcessor(
            MemoryEntityStore(f"memory://{name}"),
            MemoryDeduplicationStore(f"memory://{name}"),
            dispatcher,
        )

        def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
            return {"n": state.get("n", 0) + 1}, [Send("shipping", {"for": message.id})]

        assert processor.process(Message("m-1", "order-1", {}), handler).outcome == "processed"
        assert processor.process(Message("m-1", "order-1", {}), handler).outcome == "duplicate"
        assert isinstance(dispatcher, MemoryDispatcher)
        [sent] = dispatcher.sent
        assert sent.body == {"for": "m-1"} and sent.destination == "shipping"


# ====================================================================== the base class


class _Recording(URLDispatcher):
    """A backend that records its ``_dispatch`` calls (registered as ``recording://``)."""

    calls: ClassVar[list[list[str]]] = []

    def _dispatch(self, batch: list[EncodedMessage]) -> None:
        self.calls.append([m.id for m in batch])
        if any(m.id == "boom" for m in batch):
            raise ConnectionError("the wire broke")
        if any(m.id == "foreign" for m in batch):
            raise KeyError("not a driver error")

    def _close(self) -> None:
        """Nothing to release."""


@pytest.fixture
def recording() -> Iterator[type[_Recording]]:
    register("dispatcher", "recording", f"{__name__}:_Recording")
    _Recording.calls = []
    try:
        yield _Recording
    finally:
        registry._registered["dispatcher"].pop("recording", None)


@pytest.mark.memory
class TestURLDispatcherBase:
    def test_template_validates_skips_empty_and_translates_errors(
        self, recording: type[_Recording]
    ) -> None:
        with open_dispatcher("recording://x") as dispatcher:
            assert isinstance(dispatcher, _Recording)
            dispatcher.dispatch([])
            dispatcher.dispatch(())
            assert recording.calls == [], "an empty batch does I/O"
            for batch, error in _INVALID:
                with pytest.raises(error):
                    dispatcher.dispatch(batch)
            assert recording.calls == [], "an invalid batch reached the backend"
            dispatcher.dispatch((_msg("a"), _msg("a")))
            assert recording.calls == [["a", "a"]]
            with pytest.raises(StoreUnavailable, match="dispatch failed") as info:
                dispatcher.dispatch([_msg("boom")])
            assert isinstance(info.value.__cause__, ConnectionError)
            with pytest.raises(KeyError):  # a bug, not a driver error: passes unchanged
                dispatcher.dispatch([_msg("foreign")])
        with pytest.raises(StoreClosed):
            dispatcher.dispatch([])

    def test_the_protocol_is_shared(self, recording: type[_Recording]) -> None:
        import dedupstore.dispatch
        import dedupstore.outbox

        assert dedupstore.dispatch.Dispatcher is dedupstore.outbox.Dispatcher
        with open_dispatcher("recording://x") as dispatcher:
            assert isinstance(dispatcher, Dispatcher)
        assert isinstance(CallableDispatcher(print), Dispatcher)
        for cls in (URLDispatcher, CallableDispatcher, MemoryDispatcher, SqliteDispatcher):
            assert "id" in cls.receiver_dedup
        assert "id field" in RedisDispatcher.receiver_dedup


# ====================================================================== callables and objects

_collected: list[list[str]] = []


def _collect(messages: list[OutgoingMessage]) -> None:
    _collected.append([m.id for m in messages])


@pytest.mark.memory
class TestOpenDispatcher:
    def test_a_callable_is_wrapped_and_validated(self) -> None:
        got: list[list[OutgoingMessage]] = []
        dispatcher = open_dispatcher(got.append)
        assert isinstance(dispatcher, CallableDispatcher)
        dispatcher.dispatch([])
        for batch, error in _INVALID:
            with pytest.raises(error):
                dispatcher.dispatch(batch)
        assert got == []
        dispatcher.dispatch((_msg("a"), _msg("b")))
        assert got == [[_msg("a"), _msg("b")]] and isinstance(got[0], list)

    def test_callable_errors_pass_through(self) -> None:
        def failing(messages: list[OutgoingMessage]) -> None:
            raise RuntimeError("broker down")

        with open_dispatcher(failing) as dispatcher, pytest.raises(RuntimeError, match="broker"):
            dispatcher.dispatch([_msg("a")])

    def test_callable_dispatcher_pickles_when_the_callable_does(self) -> None:
        _collected.clear()
        copy = pickle.loads(pickle.dumps(open_dispatcher(_collect)))
        copy.dispatch([_msg("a")])
        assert _collected == [["a"]]
        with pytest.raises((pickle.PicklingError, AttributeError)):
            pickle.dumps(open_dispatcher(lambda messages: None))

    def test_closed_callable_dispatcher_refuses_use(self) -> None:
        with open_dispatcher(_collect) as dispatcher:
            pass
        with pytest.raises(StoreClosed):
            dispatcher.dispatch([_msg("a")])

    def test_an_object_with_dispatch_is_returned_as_is(self) -> None:
        ready = InMemoryDispatcher()
        assert open_dispatcher(ready) is ready

    @pytest.mark.parametrize("bad", [None, 42, b"memory://x", object()])
    def test_anything_else_is_a_configuration_error(self, bad: Any) -> None:
        with pytest.raises(ConfigurationError, match="open_dispatcher takes"):
            open_dispatcher(bad)

    def test_options_with_a_callable_are_refused(self) -> None:
        with pytest.raises(ConfigurationError, match="apply to a dispatcher URL"):
            open_dispatcher(_collect, table="x")
        with pytest.raises(ConfigurationError, match="apply to a dispatcher URL"):
            open_dispatcher(InMemoryDispatcher(), timeout=1)


# ====================================================================== the registry


@pytest.mark.memory
class TestRegistry:
    def test_builtin_schemes(self) -> None:
        view = known("dispatcher")
        assert view["memory"].target == "dedupstore.backends.memory:MemoryDispatcher"
        assert view["sqlite"].target == "dedupstore.backends.sqlite:SqliteDispatcher"
        for scheme in ("redis", "rediss"):
            assert view[scheme].target == "dedupstore.backends.redis:RedisDispatcher"
            assert view[scheme].extra == "redis"
        assert resolve("dispatcher", "redis") is RedisDispatcher

    def test_unknown_scheme(self) -> None:
        with pytest.raises(ConfigurationError, match=r"unknown dispatcher URL scheme 'kafka'"):
            open_dispatcher("kafka://broker:9092/topic")
        with pytest.raises(ConfigurationError, match="malformed"):
            open_dispatcher("no-scheme-here")

    def test_register_a_dispatcher(self) -> None:
        register("dispatcher", "mymem", "dedupstore.backends.memory:MemoryDispatcher")
        try:
            with pytest.raises(ValueError, match="clobber"):
                register("dispatcher", "mymem", "dedupstore.backends.sqlite:SqliteDispatcher")
            with open_dispatcher("mymem://x") as dispatcher:
                assert type(dispatcher) is MemoryDispatcher
            register(
                "dispatcher", "mymem", "dedupstore.backends.sqlite:SqliteDispatcher", clobber=True
            )
            assert resolve("dispatcher", "mymem") is SqliteDispatcher
        finally:
            registry._registered["dispatcher"].pop("mymem", None)
        with pytest.raises(ValueError):
            register("dispatcher", "bad", "no-colon")

    def test_registered_target_must_be_a_url_dispatcher(self) -> None:
        register("dispatcher", "notadispatcher", "dedupstore.outbox:InMemoryDispatcher")
        try:
            with pytest.raises(ConfigurationError, match="not a URLDispatcher subclass"):
                open_dispatcher("notadispatcher://x")
        finally:
            registry._registered["dispatcher"].pop("notadispatcher", None)

    def test_entry_points(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from importlib.metadata import EntryPoint

        group = registry.entry_point_group("dispatcher")
        assert group == "dedupstore.dispatcher"
        ep = EntryPoint("epdispatch", "dedupstore.backends.memory:MemoryDispatcher", group)
        monkeypatch.setattr(
            registry, "entry_points", lambda group: [ep] if group == ep.group else []
        )
        monkeypatch.setattr(registry, "_loaded", set())
        try:
            with open_dispatcher("epdispatch://x") as dispatcher:
                assert type(dispatcher) is MemoryDispatcher
        finally:
            registry._registered["dispatcher"].pop("epdispatch", None)

    def test_bad_options_are_refused_before_any_io(self, tmp_path: Path) -> None:
        closed_port = free_port()  # nothing listens: any I/O would be StoreUnavailable
        redis_url = f"redis://{HOST}:{closed_port}/0"
        bad_redis: list[tuple[str, dict[str, Any], str]] = [
            (f"{redis_url}?maxlen=0", {}, "maxlen"),
            (redis_url, {"dedupe_window": "soon"}, "dedupe_window"),
            (redis_url, {"dedupe_window": -5}, "dedupe_window"),
            (redis_url, {"key_prefix": "no-colon"}, "key_prefix"),
            (redis_url, {"timeout": "inf"}, "timeout"),
            (f"{redis_url}?table=x", {}, "table"),
            (f"{redis_url}?maxlen=5", {"maxlen": 6}, "maxlen"),
        ]
        for url, options, named in bad_redis:
            with pytest.raises(ConfigurationError, match=named):
                open_dispatcher(url, **options)
        db = tmp_path / "sub" / "queue.db"
        bad_sqlite: list[tuple[str, dict[str, Any], str]] = [
            (f"sqlite:///{db}?table=no spaces", {}, "table"),
            (f"sqlite:///{db}", {"nope": 1}, "nope"),
            (f"sqlite:///{db}", {"synchronous": "3"}, "synchronous"),
            ("sqlite://host/x.db", {}, "no host"),
            ("sqlite:///:memory:", {}, "must name a database file"),
        ]
        for url, options, named in bad_sqlite:
            with pytest.raises(ConfigurationError, match=named):
                open_dispatcher(url, **options)
        assert not db.parent.exists(), "a refused dispatcher touched the file system"

    def test_secrets_are_masked(self) -> None:
        url = f"redis://user:s3cret-password@{HOST}:{free_port()}/0?maxlen=zero"
        with pytest.raises(ConfigurationError) as info:
            open_dispatcher(url)
        assert "s3cret-password" not in str(info.value)
        with pytest.raises(StoreUnavailable) as unavailable:
            open_dispatcher(url.replace("zero", "5"), connect_timeout=0.5, retries=0)
        assert "s3cret-password" not in str(unavailable.value)
        assert "***" in str(unavailable.value)


# ====================================================================== sqlite://


def _dispatch_from_process(
    dispatcher: SqliteDispatcher, batches: list[list[OutgoingMessage]], barrier: Any
) -> None:
    """A worker process (spawned): wait for the others, then dispatch every batch."""
    barrier.wait(120)
    for batch in batches:
        dispatcher.dispatch(batch)
    dispatcher.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'queue' / 'outgoing.db'}"


@pytest.fixture
def queue(sqlite_url: str) -> Iterator[SqliteDispatcher]:
    dispatcher = open_dispatcher(sqlite_url)
    assert isinstance(dispatcher, SqliteDispatcher)
    yield dispatcher
    dispatcher.close()


def _rows(path: Path, table: str = "dedup_outgoing") -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            f"SELECT id, destination, body, headers, deliveries, mismatches FROM {table} "
            "ORDER BY rowid"
        ).fetchall()


def _path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


@pytest.mark.sqlite
class TestSqliteDispatcher:
    def test_table_layout_and_idempotent_redispatch(
        self, queue: SqliteDispatcher, sqlite_url: str
    ) -> None:
        batch = [_msg("a", body={"z": 1, "a": [1, 2]}, trace="t1"), _msg("b", "billing")]
        queue.dispatch(batch)
        queue.dispatch(batch)
        queue.dispatch([batch[1]])
        assert _rows(_path(sqlite_url)) == [
            ("a", "shipping", '{"a":[1,2],"z":1}', '{"trace":"t1"}', 2, 0),
            ("b", "billing", '{"mid":"b"}', "{}", 3, 0),
        ]
        assert queue.stats() == DispatchStats(rows=2, deliveries=5, mismatches=0)
        assert queue.count() == 2
        with sqlite3.connect(_path(sqlite_url)) as conn:
            info = conn.execute("PRAGMA table_info(dedup_outgoing)").fetchall()
        assert {row[1]: row[5] for row in info}["seq"] == 1, "seq is the primary key"
        with sqlite3.connect(_path(sqlite_url)) as conn:
            indexes = conn.execute("PRAGMA index_list(dedup_outgoing)").fetchall()
            unique = [
                [c[2] for c in conn.execute(f"PRAGMA index_info('{index[1]}')")]
                for index in indexes
                if index[2]
            ]
        assert unique == [["id"]], "one row per message id"
        assert {row[1] for row in info} == {
            "seq",
            "id",
            "destination",
            "body",
            "headers",
            "deliveries",
            "mismatches",
            "first_at",
        }

    def test_mismatched_redispatch_is_counted_and_the_first_content_kept(
        self, queue: SqliteDispatcher, sqlite_url: str
    ) -> None:
        queue.dispatch([_msg("a", body={"v": 1})])
        queue.dispatch([_msg("a", body={"v": 1})])  # same content: no mismatch
        queue.dispatch([_msg("a", body={"v": 2})])  # another body
        queue.dispatch([_msg("a", "elsewhere", body={"v": 1})])  # another destination
        queue.dispatch([_msg("a", body={"v": 1}, extra="h")])  # other headers
        assert queue.stats() == DispatchStats(rows=1, deliveries=5, mismatches=3)
        [row] = queue.receive()
        assert row.message == _msg("a", body={"v": 1})
        assert (row.deliveries, row.mismatches) == (5, 3)

    def test_a_dispatch_is_one_transaction(self, queue: SqliteDispatcher, sqlite_url: str) -> None:
        with sqlite3.connect(_path(sqlite_url)) as conn:
            conn.execute(
                "CREATE TRIGGER poison BEFORE INSERT ON dedup_outgoing WHEN NEW.id = 'poison' "
                "BEGIN SELECT RAISE(ABORT, 'poisoned message'); END"
            )
        queue.dispatch([_msg("before")])
        with pytest.raises(StoreUnavailable, match="poisoned") as info:
            queue.dispatch([_msg("ok-1"), _msg("before"), _msg("poison"), _msg("ok-2")])
        assert isinstance(info.value.__cause__, sqlite3.Error)
        assert queue.stats() == DispatchStats(rows=1, deliveries=1, mismatches=0)
        assert [r.message.id for r in queue.receive()] == ["before"]

    def test_receive_pages_in_insertion_order(
        self, queue: SqliteDispatcher, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        ids = [f"m-{i}" for i in (5, 3, 9, 1, 7)]
        queue.dispatch([_msg(i) for i in ids[:2]])
        queue.dispatch([_msg(i) for i in ids[2:]])
        queue.dispatch([_msg(ids[0])])  # a re-dispatch keeps its place
        first = queue.receive(limit=2)
        assert [r.message.id for r in first] == ids[:2]
        assert first[0].seq < first[1].seq and first[0].deliveries == 2
        rest = queue.receive(limit=10, after=first[-1].seq)
        assert [r.message.id for r in rest] == ids[2:]
        assert queue.receive(after=rest[-1].seq) == []
        assert all(r.first_at > 1.6e9 for r in rest), "first_at is epoch seconds"
        monkeypatch.setattr(SqliteDispatcher, "page_size", 2)
        assert [r.message.id for r in queue.messages()] == ids
        assert [r.message.id for r in queue.messages(after=first[0].seq)] == ids[1:]
        for bad in ({"limit": 0}, {"limit": True}, {"after": -1}, {"after": "x"}):
            with pytest.raises(ValueError):
                queue.receive(**bad)

    def test_empty_and_invalid_batches_do_no_io(self, queue: SqliteDispatcher) -> None:
        queue.dispatch([])
        for batch, error in _INVALID:
            with pytest.raises(error):
                queue.dispatch(batch)
        assert queue.stats() == DispatchStats(0, 0, 0)

    def test_pickled_copy_reopens_the_same_file_from_anywhere(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        dispatcher = open_dispatcher("sqlite:///rel/queue.db", table="my_queue", timeout=3)
        try:
            data = pickle.dumps(dispatcher)
            assert isinstance(dispatcher, SqliteDispatcher)
            assert dispatcher.url.startswith(f"sqlite:///{tmp_path}")
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            monkeypatch.chdir(elsewhere)
            copy = pickle.loads(data)
            assert copy.option("table") == "my_queue" and copy.option("timeout") == 3.0
            copy.dispatch([_msg("from-copy")])
            copy.close()
            assert [r.message.id for r in dispatcher.receive()] == ["from-copy"]
            assert not (elsewhere / "rel").exists()
        finally:
            dispatcher.close()

    @pytest.mark.slow
    def test_processes_dispatching_overlapping_ids_at_once(self, queue: SqliteDispatcher) -> None:
        """Spawned processes (like Spark's Python workers) write overlapping ids together."""
        processes, batches, size = 3, 12, 10
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(processes)
        plans = []
        for p in range(processes):
            # process p dispatches ids [p*40, p*40 + 120): every id is shared with a neighbour
            ids = [f"id-{n}" for n in range(p * 40, p * 40 + batches * size)]
            plans.append(
                [[_msg(i) for i in ids[b * size : (b + 1) * size]] for b in range(batches)]
            )
        workers = [
            context.Process(target=_dispatch_from_process, args=(queue, plan, barrier))
            for plan in plans
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(240)
        assert [w.exitcode for w in workers] == [0] * processes
        expected = {m.id for plan in plans for batch in plan for m in batch}
        total = sum(len(batch) for plan in plans for batch in plan)
        assert queue.stats() == DispatchStats(len(expected), total, 0)
        assert {r.message.id for r in queue.messages()} == expected

    def test_forked_child_uses_its_own_connection(self, queue: SqliteDispatcher) -> None:
        queue.dispatch([_msg("parent-1")])  # the parent's connection exists now
        child = multiprocessing.get_context("fork").Process(
            target=queue.dispatch, args=([_msg("child"), _msg("parent-1")],)
        )
        child.start()
        child.join(120)
        assert child.exitcode == 0
        queue.dispatch([_msg("parent-2")])
        assert [r.message.id for r in queue.messages()] == ["parent-1", "child", "parent-2"]
        assert queue.stats() == DispatchStats(3, 4, 0)

    def test_locked_database_is_unavailable(self, sqlite_url: str) -> None:
        with open_dispatcher(sqlite_url, timeout=0.2) as dispatcher:
            blocker = sqlite3.connect(_path(sqlite_url), isolation_level=None)
            try:
                blocker.execute("BEGIN IMMEDIATE")
                with pytest.raises(StoreUnavailable, match="locked") as info:
                    dispatcher.dispatch([_msg("a")])
                assert isinstance(info.value.__cause__, sqlite3.OperationalError)
            finally:
                blocker.close()
            dispatcher.dispatch([_msg("a")])
            assert isinstance(dispatcher, SqliteDispatcher) and dispatcher.count() == 1

    def test_missing_or_foreign_table(self, sqlite_url: str, tmp_path: Path) -> None:
        open_dispatcher(sqlite_url).close()
        with pytest.raises(ConfigurationError, match="does not exist"):
            open_dispatcher(sqlite_url, table="other", create=False)
        path = _path(sqlite_url)
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE entities (id TEXT PRIMARY KEY, body TEXT)")
        with pytest.raises(
            ConfigurationError, match="not usable as a dispatcher table: it has no col"
        ):
            open_dispatcher(sqlite_url, table="entities")
        missing = tmp_path / "nowhere.db"
        with pytest.raises(ConfigurationError):
            open_dispatcher(f"sqlite:///{missing}", create=False)
        assert not missing.exists()

    def test_health_warnings_and_closing(self, sqlite_url: str) -> None:
        with open_dispatcher(sqlite_url, synchronous="NORMAL") as dispatcher:
            assert isinstance(dispatcher, SqliteDispatcher)
            assert any("synchronous=NORMAL" in w for w in dispatcher.health_warnings())
            assert "synchronous='NORMAL'" in repr(dispatcher)
        with pytest.raises(StoreClosed):
            dispatcher.dispatch([_msg("a")])
        with pytest.raises(StoreClosed):
            dispatcher.stats()


# ====================================================================== redis://


def _prefix() -> str:
    return f"test-out-{uuid.uuid4().hex}:"


def _calls(admin: redis.Redis, command: str) -> int:
    stats = admin.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def _entries(admin: redis.Redis, key: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in admin.xrange(key)]


@pytest.fixture
def admin(redis_server: Server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def streams(redis_server: Server) -> Iterator[RedisDispatcher]:
    dispatcher = open_dispatcher(redis_server.url, key_prefix=_prefix())
    assert isinstance(dispatcher, RedisDispatcher)
    yield dispatcher
    dispatcher.close()


@pytest.fixture
def proxy(redis_server: Server) -> Iterator[_ReplyDroppingProxy]:
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    p = _ReplyDroppingProxy(port)
    yield p
    p.close()


@pytest.mark.redis
class TestRedisDispatcher:
    def test_stream_layout(self, streams: RedisDispatcher, admin: redis.Redis) -> None:
        prefix = streams.option("key_prefix")
        assert streams.option("dedupe_window") == 7 * 86400
        streams.dispatch(
            [
                _msg("a:1", "orders:{eu}", body={"z": 1, "a": (1,)}, trace="t"),
                _msg("b", "billing"),
                _msg("c", "orders:{eu}"),
            ]
        )
        key = f"{prefix}orders%3A%7Beu%7D"
        assert streams.stream_key("orders:{eu}") == key == stream_key(prefix, "orders:{eu}")
        assert _entries(admin, key) == [
            {"id": "a:1", "body": '{"a":[1],"z":1}', "headers": '{"trace":"t"}'},
            {"id": "c", "body": '{"mid":"c"}', "headers": "{}"},
        ]
        assert _entries(admin, f"{prefix}billing") == [
            {"id": "b", "body": '{"mid":"b"}', "headers": "{}"}
        ]
        marker = f"{prefix}sent:a%3A1"
        assert sent_key(prefix, "a:1") == marker
        assert admin.get(marker) == b"1"
        assert 0 < admin.pttl(marker) <= 7 * 86400 * 1000
        assert admin.type(key) == b"stream"

    def test_redispatch_within_the_window_appends_nothing(
        self, streams: RedisDispatcher, admin: redis.Redis, redis_server: Server
    ) -> None:
        batch = _batch("r", 5)
        streams.dispatch(batch)
        streams.dispatch(batch)
        streams.dispatch([*batch[:2], _msg("new"), _msg("new")])
        key = streams.stream_key("shipping")
        assert [e["id"] for e in _entries(admin, key)] == [m.id for m in batch] + ["new"]
        other = open_dispatcher(redis_server.url, key_prefix=streams.option("key_prefix"))
        try:
            other.dispatch(batch)  # another client (another Spark task) sharing the prefix
        finally:
            other.close()
        assert admin.xlen(key) == 6

    def test_window_off_always_appends(self, redis_server: Server, admin: redis.Redis) -> None:
        prefix = _prefix()
        for off in (0, "0", "0s", "off", None):
            assert RedisDispatcher.declared_options["dedupe_window"].convert(off) is None
        with open_dispatcher(f"{redis_server.url}?dedupe_window=0", key_prefix=prefix) as d:
            d.dispatch([_msg("a"), _msg("a")])
            d.dispatch([_msg("a")])
        assert admin.xlen(f"{prefix}shipping") == 3
        assert admin.keys(f"{prefix}sent:*") == []

    def test_short_window_expires(self, redis_server: Server, admin: redis.Redis) -> None:
        prefix = _prefix()
        with open_dispatcher(redis_server.url, key_prefix=prefix, dedupe_window="50ms") as d:
            assert d.option("dedupe_window") == 0.05
            d.dispatch([_msg("a")])
            _wait_for(lambda: not admin.exists(f"{prefix}sent:a"), "the marker to expire")
            d.dispatch([_msg("a")])
        assert admin.xlen(f"{prefix}shipping") == 2, "after the window an id is appended again"

    def test_maxlen_trims_approximately(self, redis_server: Server, admin: redis.Redis) -> None:
        prefix = _prefix()
        with open_dispatcher(redis_server.url, key_prefix=prefix, maxlen=10) as d:
            for b in range(10):
                d.dispatch(_batch(f"t{b}", 100))
        length = admin.xlen(f"{prefix}shipping")
        assert 10 <= length < 1000
        last = admin.xrevrange(f"{prefix}shipping", count=1)[0][1]
        assert last[b"id"] == b"t9-99"

    def test_empty_and_invalid_batches_do_no_io(self, own_redis_server: RedisServer) -> None:
        with open_dispatcher(own_redis_server.url, key_prefix=_prefix()) as dispatcher:
            own_redis_server.kill()
            dispatcher.dispatch([])  # nothing to send: no I/O, so no error
            for batch, error in _INVALID:
                with pytest.raises(error):
                    dispatcher.dispatch(batch)

    def test_one_script_call_per_dispatch(self, own_redis_server: RedisServer) -> None:
        admin = redis.Redis.from_url(own_redis_server.url)
        try:
            with open_dispatcher(own_redis_server.url, key_prefix=_prefix()) as dispatcher:
                before = _calls(admin, "evalsha"), _calls(admin, "xadd")
                dispatcher.dispatch(
                    [*_batch("x", 300), *_batch("y", 200, "billing"), *_batch("x", 3)]
                )
                assert _calls(admin, "evalsha") - before[0] == 1
                assert _calls(admin, "xadd") - before[1] == 500
        finally:
            admin.close()

    def test_key_of_another_type_fails_the_call_before_any_write(
        self, streams: RedisDispatcher, admin: redis.Redis
    ) -> None:
        prefix = streams.option("key_prefix")
        admin.set(f"{prefix}billing", "not a stream")
        with pytest.raises(ConfigurationError, match="key_prefix must be reserved"):
            streams.dispatch([_msg("first"), _msg("second", "billing")])
        assert admin.xlen(f"{prefix}shipping") == 0
        assert not admin.exists(f"{prefix}sent:first")
        admin.hset(f"{prefix}sent:third", "x", "1")
        with pytest.raises(ConfigurationError, match="key_prefix must be reserved"):
            streams.dispatch([_msg("first"), _msg("third")])
        streams.dispatch([_msg("first")])
        assert admin.xlen(f"{prefix}shipping") == 1

    def test_forked_child_reconnects(self, streams: RedisDispatcher, admin: redis.Redis) -> None:
        streams.dispatch([_msg("parent-1")])  # the parent's pool has a connection now
        child = multiprocessing.get_context("fork").Process(
            target=streams.dispatch, args=([_msg("child"), _msg("parent-1")],)
        )
        child.start()
        child.join(120)
        assert child.exitcode == 0
        streams.dispatch([_msg("parent-2")])
        ids = [e["id"] for e in _entries(admin, streams.stream_key("shipping"))]
        assert ids == ["parent-1", "child", "parent-2"]

    def test_pickled_copy_reconnects(self, redis_server: Server, admin: redis.Redis) -> None:
        prefix = _prefix()
        with open_dispatcher(
            f"{redis_server.url}?maxlen=50", key_prefix=prefix, dedupe_window="1h"
        ) as dispatcher:
            copy = pickle.loads(pickle.dumps(dispatcher))
            assert isinstance(copy, RedisDispatcher)
            assert copy.option("key_prefix") == prefix and copy.option("maxlen") == 50
            assert copy.option("dedupe_window") == 3600
            copy.dispatch([_msg("a")])
            dispatcher.dispatch([_msg("a")])
            copy.close()
        assert admin.xlen(f"{prefix}shipping") == 1

    def test_lost_reply_is_retried_harmlessly_with_the_window(
        self, redis_server: Server, proxy: _ReplyDroppingProxy, admin: redis.Redis
    ) -> None:
        prefix = _prefix()
        url = f"redis://{HOST}:{proxy.port}/0"
        with open_dispatcher(url, key_prefix=prefix, timeout=0.5, retries=2) as dispatcher:
            proxy.drop_replies_on_open_connections()  # the next reply is lost; reconnects work
            dispatcher.dispatch([_msg("a"), _msg("b")])
            assert proxy.reply_dropped.is_set(), "the first attempt must have reached the server"
        assert [e["id"] for e in _entries(admin, f"{prefix}shipping")] == ["a", "b"]

    def test_lost_reply_without_the_window_is_unavailable_not_duplicated(
        self, redis_server: Server, proxy: _ReplyDroppingProxy, admin: redis.Redis
    ) -> None:
        prefix = _prefix()
        url = f"redis://{HOST}:{proxy.port}/0"
        with open_dispatcher(
            url, key_prefix=prefix, dedupe_window=0, timeout=0.5, retries=2
        ) as dispatcher:
            proxy.drop_replies_on_open_connections()
            with pytest.raises(StoreUnavailable, match="may or may not have been appended"):
                dispatcher.dispatch([_msg("a"), _msg("b")])
            assert proxy.reply_dropped.is_set()
            key = f"{prefix}shipping"
            assert [e["id"] for e in _entries(admin, key)] == ["a", "b"], "re-sent and duplicated"
            dispatcher.dispatch([_msg("c")])  # the next call works on a fresh connection
        assert [e["id"] for e in _entries(admin, key)] == ["a", "b", "c"]

    def test_unreachable_server_then_recovery(self, own_redis_server: RedisServer) -> None:
        prefix = _prefix()
        dispatcher = open_dispatcher(own_redis_server.url, key_prefix=prefix, retries=1)
        try:
            dispatcher.dispatch(_batch("before", 3))
            own_redis_server.kill()
            for call in (lambda: dispatcher.dispatch([_msg("during")]), dispatcher.health_warnings):
                with pytest.raises(StoreUnavailable) as info:
                    call()
                assert isinstance(info.value.__cause__, redis.ConnectionError)
                assert "\n" not in str(info.value)
            own_redis_server.restart()
            dispatcher.dispatch([*_batch("before", 3), _msg("after")])
            with redis.Redis.from_url(own_redis_server.url) as admin:
                ids = [e["id"] for e in _entries(admin, f"{prefix}shipping")]
            assert ids == ["before-0", "before-1", "before-2", "after"], (
                "acknowledged or duplicated"
            )
        finally:
            dispatcher.close()

    def test_unconfirmed_replication_is_unavailable(
        self, redis_server: Server, admin: redis.Redis
    ) -> None:
        prefix = _prefix()
        with (
            open_dispatcher(
                redis_server.url, key_prefix=prefix, wait_replicas=1, wait_timeout_ms=50
            ) as dispatcher,
            pytest.raises(StoreUnavailable, match="dispatch them again"),
        ):
            dispatcher.dispatch([_msg("a")])
        with open_dispatcher(redis_server.url, key_prefix=prefix) as again:
            again.dispatch([_msg("a")])  # on the primary already: the window skips it
        assert admin.xlen(f"{prefix}shipping") == 1

    def test_refuses_a_client_of_another_kind(self, redis_server: Server) -> None:
        with pytest.raises(ConfigurationError, match=r"client must be a redis\.Redis"):
            open_dispatcher(redis_server.url, client=object())

    def test_acl_without_xadd_is_a_configuration_error_and_marks_nothing(
        self, own_redis_server: RedisServer
    ) -> None:
        prefix = _prefix()
        admin = redis.Redis.from_url(own_redis_server.url)
        try:
            admin.acl_setuser(
                "sender", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-xadd"]
            )
            with open_dispatcher(
                own_redis_server.url, key_prefix=prefix, username="sender", password="pw"
            ) as dispatcher:
                with pytest.raises(ConfigurationError, match=r"may not run.*\+xadd") as info:
                    dispatcher.dispatch([_msg("a"), _msg("b")])
                assert isinstance(info.value.__cause__, redis.ResponseError)
                assert admin.keys(f"{prefix}*") == [], "a message was marked but not appended"
                admin.acl_setuser("sender", commands=["+xadd"])
                dispatcher.dispatch([_msg("a"), _msg("b")])
            assert admin.xlen(f"{prefix}shipping") == 2
        finally:
            admin.close()


def _sent(dispatcher: Any, admin: redis.Redis | None) -> list[str]:
    """The ids a dispatcher of the size tests has sent, read back from its backend."""
    if isinstance(dispatcher, MemoryDispatcher):
        return [m.id for m in dispatcher.sent]
    if isinstance(dispatcher, SqliteDispatcher):
        return [s.message.id for s in dispatcher.messages()]
    assert admin is not None
    return [e["id"] for e in _entries(admin, dispatcher.stream_key("shipping"))]


@pytest.mark.parametrize(
    ("scheme", "own"),
    [
        pytest.param("memory", None, marks=pytest.mark.memory, id="memory"),
        pytest.param("sqlite", 1_000_000_000, marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("redis", 512 * 1024 * 1024, marks=pytest.mark.redis, id="redis"),
    ],
)
def test_each_dispatcher_says_its_bound_and_refuses_a_message_over_it_before_any_io(
    scheme: str, own: int | None, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A message over the bound is ``MessageTooLarge`` naming it, its size and the bound;
    none of the batch is sent (the processor relies on it: never a half-sent batch)."""
    admin: redis.Redis | None = None
    if scheme == "memory":
        url, options = f"memory://{_name()}", {}
    elif scheme == "sqlite":
        url, options = f"sqlite:///{tmp_path / 'q.db'}", {}
    else:
        server: Server = request.getfixturevalue("redis_server")
        admin = request.getfixturevalue("admin")
        url, options = server.url, {"key_prefix": _prefix()}
    with open_dispatcher(url, **options) as dispatcher:
        assert dispatcher.max_message_bytes == own
        dispatcher.dispatch([_msg("fits", body={"b": "x" * 5000})])
    with open_dispatcher(url, max_message_bytes=2000, **options) as lowered:
        assert lowered.max_message_bytes == 2000
        big = _msg("big", body={"b": "x" * 2000})
        with pytest.raises(MessageTooLarge, match="'big' is 2010 bytes") as caught:
            lowered.dispatch([_msg("a"), big, _msg("c")])
        error = caught.value
        assert (error.outgoing_id, error.size, error.bound) == ("big", 2010, 2000)
        heavy = _msg("heavy", h="v" * 2000)
        with pytest.raises(MessageTooLarge, match="'heavy'"):
            lowered.dispatch([heavy])
        assert _sent(lowered, admin) == ["fits"], "nothing of a refused batch was sent"
        lowered.dispatch([_msg("d", body={"b": "x" * 1900})])
        assert _sent(lowered, admin) == ["fits", "d"]
    with pytest.raises(ConfigurationError, match="max_message_bytes"):
        open_dispatcher(url, max_message_bytes=0, **options)


@pytest.mark.memory
def test_a_callable_dispatcher_takes_its_destinations_bounds() -> None:
    calls: list[list[OutgoingMessage]] = []
    kafka_like = CallableDispatcher(calls.append, max_message_bytes=1_000_000)
    with pytest.raises(MessageTooLarge, match="accepts at most 1000000"):
        kafka_like.dispatch([_msg("a"), _msg("b", body="x" * 1_000_000)])
    assert calls == []
    for bad in (0, -1, True, "1"):
        with pytest.raises(ConfigurationError, match="max_header_bytes"):
            CallableDispatcher(calls.append, max_header_bytes=bad)
    assert CallableDispatcher(calls.append).max_message_bytes is None


@pytest.mark.memory
def test_public_names() -> None:
    assert dedupstore.open_dispatcher is open_dispatcher
    assert dedupstore.register is register
    assert {"open_dispatcher", "register"} <= set(dedupstore.__all__)
