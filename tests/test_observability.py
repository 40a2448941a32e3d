"""Logs and metrics: what an operator sees of the processor, the sweep and the stores.

The metrics are read back through the OpenTelemetry SDK (``InMemoryMetricReader``,
cumulative): one global ``MeterProvider`` is set for the session (the API allows
it once per process), and each test compares values before and after, under
attributes (a fresh consumer name) no other test uses.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from opentelemetry import metrics as otel_metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

from dedupstore import metrics, open_entity_store, open_store
from dedupstore.backends.memory import MemoryDeduplicationStore, MemoryEntityStore
from dedupstore.cli import SweepProgress, main
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConcurrencyConflict, StoreUnavailable
from dedupstore.outbox import (
    InMemoryDispatcher,
    Message,
    OutboxProcessor,
    Send,
    SweepResult,
    sweep,
)
from dedupstore.registry import Kind, resolve
from tests.outbox_backends import OutboxBackend, backend_params
from tests.servers import HOST, free_port

ROOT = Path(__file__).resolve().parent.parent

Key = tuple[str, frozenset[tuple[str, Any]]]


@pytest.fixture(scope="session")
def reader() -> InMemoryMetricReader:
    """The session's metric reader, on the global MeterProvider (set once per process)."""
    metric_reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[metric_reader])
    otel_metrics.set_meter_provider(provider)
    assert otel_metrics.get_meter_provider() is provider, "a global MeterProvider was set before"
    return metric_reader


def _points(reader: InMemoryMetricReader) -> dict[Key, float]:
    """Every data point of the ``dedupstore`` meter: a counter's value, a histogram's count."""
    points: dict[Key, float] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            if scope.scope.name != "dedupstore":
                continue
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    key = (metric.name, frozenset(dict(point.attributes or {}).items()))
                    histogram = isinstance(point, HistogramDataPoint)
                    points[key] = point.count if histogram else point.value
    return points


class Readings:
    """Metric values since this object was made."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        self.reader = reader
        self.before = _points(reader)

    def delta(self, name: str, **attributes: str) -> float:
        """The change of ``name`` under exactly these attributes."""
        key = (name, frozenset(attributes.items()))
        return _points(self.reader).get(key, 0) - self.before.get(key, 0)

    def changed(self, name: str) -> dict[frozenset[tuple[str, Any]], float]:
        """Every attribute set of ``name`` that changed, with its change."""
        now = _points(self.reader)
        return {
            attrs: value - self.before.get((metric, attrs), 0)
            for (metric, attrs), value in now.items()
            if metric == name and value != self.before.get((metric, attrs), 0)
        }


def deposit(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Adds the amount; a negative amount is poison (the handler raises)."""
    amount = message.body["amount"]
    if amount < 0:
        raise ValueError(f"a deposit cannot be negative: {amount}")
    return {"balance": state.get("balance", 0) + amount}, [Send("deposited", {"n": amount})]


def _memory(consumer: str) -> tuple[str, MemoryEntityStore, MemoryDeduplicationStore]:
    url = f"memory://{uuid.uuid4().hex}"
    return url, MemoryEntityStore(url), MemoryDeduplicationStore(url, endpoint=consumer)


class FailingOnce:
    """A dispatcher whose first call raises (nothing sent), then sends."""

    def __init__(self) -> None:
        self.sent = InMemoryDispatcher()
        self.failed = False

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("broker down")
        self.sent.dispatch(messages)


def _consumer() -> str:
    return f"c-{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------- the processor


@pytest.mark.memory
def test_outcomes_dispatch_failures_and_dead_letters(
    reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = _consumer()
    _, entities, dedup = _memory(consumer)
    dispatcher = FailingOnce()
    processor = OutboxProcessor(entities, dedup, dispatcher, dead_letters="dlq")
    readings = Readings(reader)
    # the first dispatch fails: m0 is applied, its outgoing message stays in the outbox
    with pytest.raises(RuntimeError, match="broker down"):
        processor.process(Message("m0", "acct-0", {"amount": 5}), deposit)
    assert readings.delta(metrics.DISPATCH_FAILURES, consumer=consumer, error="RuntimeError") == 1
    assert readings.changed(metrics.MESSAGES) == {}, "a call that raised counts no outcome"
    m1, m2 = Message("m1", "acct-1", {"amount": 1}), Message("m2", "acct-2", {"amount": 2})
    bad = Message("bad-1", "acct-1", {"amount": -3})
    with caplog.at_level(logging.WARNING, logger="dedupstore"):
        results = processor.process_batch(
            [m1, m2, m1, bad, Message("m0", "acct-0", {"amount": 5})], deposit
        )
    assert [r.outcome for r in results] == [
        "processed",
        "processed",
        "duplicate",
        "dead_lettered",
        "redispatched",
    ]
    assert [r.outcome for r in processor.process_batch([m1, m2], deposit)] == ["duplicate"] * 2
    letter = next(m for m in dispatcher.sent.sent if m.destination == "dlq")
    fixed = processor.redrive(letter, lambda state, message: (state, []))
    assert fixed.outcome == "processed"

    def outcome(name: str) -> float:
        return readings.delta(metrics.MESSAGES, outcome=name, consumer=consumer)

    assert (outcome("processed"), outcome("duplicate")) == (3, 3)
    assert (outcome("redispatched"), outcome("dead_lettered")) == (1, 1)
    assert len(readings.changed(metrics.MESSAGES)) == 4, "no other attribute set"
    assert readings.delta(metrics.DISPATCH_FAILURES, consumer=consumer, error="RuntimeError") == 1
    dead = [r for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert len(dead) == 1 and dead[0].levelno == logging.WARNING
    assert dead[0].name == "dedupstore.outbox"
    text = dead[0].getMessage()
    assert "'bad-1'" in text and "'acct-1'" in text and consumer in text
    assert "ValueError: a deposit cannot be negative: -3" in text


@pytest.mark.memory
def test_a_failed_dispatch_is_logged(
    reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = _consumer()
    _, entities, dedup = _memory(consumer)
    processor = OutboxProcessor(entities, dedup, FailingOnce())
    with caplog.at_level(logging.WARNING, logger="dedupstore"), pytest.raises(RuntimeError):
        processor.process_batch([Message("m", "e", {"amount": 1})], deposit)
    (record,) = [r for r in caplog.records if "dispatching" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "1 outgoing message(s) failed" in record.getMessage()
    assert "RuntimeError: broker down" in record.getMessage()


def _interfering(other: MemoryEntityStore) -> Any:
    """A handler that, the first time it sees a message, has ``other`` save its entity.

    The processor's save then conflicts (someone saved since its load) and is retried.
    """
    seen: set[str] = set()

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        if message.id not in seen:
            seen.add(message.id)
            other.save(other.load(message.correlation_id))
        return {"n": state.get("n", 0) + 1}, []

    return handler


@pytest.mark.memory
def test_conflicts_retried_by_the_processor_are_counted(
    reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = _consumer()
    url, entities, dedup = _memory(consumer)
    other = MemoryEntityStore(url)
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    readings = Readings(reader)
    with caplog.at_level(logging.DEBUG, logger="dedupstore.outbox"):
        result = processor.process(Message("m1", "e1", None), _interfering(other))
    assert result.attempts == 2
    assert readings.delta(metrics.CONFLICTS, consumer=consumer, source="processor") == 1
    assert any("concurrency conflict" in r.getMessage() for r in caplog.records)
    results = processor.process_batch(
        [Message("m2", "e2", None), Message("m3", "e3", None)], _interfering(other)
    )
    assert [r.outcome for r in results] == ["processed", "processed"]
    assert readings.delta(metrics.CONFLICTS, consumer=consumer, source="processor") == 3
    loaded = entities.load_many(["e1", "e2", "e3"])
    assert [e.state for e in loaded.values()] == [{"n": 1}] * 3, "applied once each"
    # a conflict that is not retried (the last attempt) is not counted
    last = OutboxProcessor(entities, dedup, InMemoryDispatcher(), max_attempts=1)
    with pytest.raises(ConcurrencyConflict):
        last.process(Message("m4", "e4", None), _interfering(other))
    assert readings.delta(metrics.CONFLICTS, consumer=consumer, source="processor") == 3


# ---------------------------------------------------------------------- the sweep


class SavingBehind:
    """A deduplication store whose first ``add_many`` lets ``other`` save entity ``eid``."""

    def __init__(self, dedup: MemoryDeduplicationStore, other: MemoryEntityStore, eid: str):
        self.dedup, self.other, self.eid, self.done = dedup, other, eid, False

    @property
    def endpoint(self) -> str:
        return self.dedup.endpoint

    def add_many(self, ids: Iterable[str]) -> set[str]:
        if not self.done:
            self.done = True
            self.other.save(self.other.load(self.eid))
        return self.dedup.add_many(ids)


@pytest.mark.memory
def test_the_sweep_counts_ids_and_conflicts_and_reports_progress(
    reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = _consumer()
    url, entities, dedup = _memory(consumer)
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
    processor.process_batch([Message(f"m{n}", f"e{n}", {"amount": n}) for n in range(5)], deposit)
    readings = Readings(reader)
    seen: list[SweepResult] = []
    behind = SavingBehind(dedup, MemoryEntityStore(url), "e0")
    with caplog.at_level(logging.INFO, logger="dedupstore.outbox"):
        result = sweep(entities, cast(Any, behind), batch_ids=2, progress=seen.append)
    assert (result.ids_moved, result.conflicts_retried, result.ids_left) == (5, 1, 0)
    assert [r.ids_moved for r in seen] == [2, 4, 5], "once per batch, running totals"
    assert [r.entities_scanned for r in seen] == [2, 4, 5]
    assert all(r.seconds > 0 for r in seen) and seen[-1] is not result
    assert readings.delta(metrics.SWEEP_IDS, consumer=consumer) == 5
    assert readings.delta(metrics.CONFLICTS, consumer=consumer, source="sweep") == 1
    done = [r for r in caplog.records if "done" in r.getMessage()]
    assert len(done) == 1 and done[0].levelno == logging.INFO
    assert "5 ids moved" in done[0].getMessage()


@pytest.mark.memory
def test_a_failed_redispatch_in_the_sweep_is_counted(reader: InMemoryMetricReader) -> None:
    consumer = _consumer()
    _, entities, dedup = _memory(consumer)
    processor = OutboxProcessor(entities, dedup, FailingOnce())
    with pytest.raises(RuntimeError):
        processor.process(Message("m", "e", {"amount": 1}), deposit)  # stays pending
    readings = Readings(reader)
    with pytest.raises(RuntimeError, match="broker down"):
        sweep(entities, dedup, redispatch=FailingOnce())
    assert readings.delta(metrics.DISPATCH_FAILURES, consumer=consumer, error="RuntimeError") == 1
    assert readings.delta(metrics.SWEEP_IDS, consumer=consumer) == 0


# ---------------------------------------------------------------------- store calls

_OPERATIONS = {
    "load",
    "save",
    "has_been_processed",
    "processed_among",
    "add",
    "add_many",
    "scan",
    "purge_expired",
}


@pytest.mark.parametrize(
    "outbox_backend", backend_params(("memory", "sqlite", "redis")), indirect=True
)
def test_every_store_call_is_timed(
    reader: InMemoryMetricReader, outbox_backend: OutboxBackend
) -> None:
    consumer = _consumer()
    with outbox_backend.entities() as entities, outbox_backend.dedup(endpoint=consumer) as dedup:
        readings = Readings(reader)
        deferred = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        deferred.process(Message("m1", "e1", {"amount": 1}), deposit)
        deferred.process_batch([Message(f"m{n}", f"e{n}", {"amount": n}) for n in (2, 3)], deposit)
        assert sweep(entities, dedup).ids_moved == 3
        inline = OutboxProcessor(entities, dedup, InMemoryDispatcher())
        inline.process(Message("m4", "e4", {"amount": 4}), deposit)
        joined = entities._joined(dedup)
        if joined:  # process() made joint calls: the single calls are timed here
            assert dedup.add("by-hand") and dedup.has_been_processed("by-hand")
        dedup.purge_expired()
        calls = readings.changed(metrics.STORE_DURATION)
    by_operation = {dict(attrs)["operation"]: n for attrs, n in calls.items()}
    expected = _OPERATIONS | ({"load_and_check", "add_and_save"} if joined else set())
    assert set(by_operation) >= expected, sorted(by_operation)
    assert joined == (outbox_backend.name == "redis")
    assert all(n >= 1 for n in by_operation.values())
    backends = {dict(attrs)["backend"] for attrs in calls}
    assert backends == {outbox_backend.name}
    assert not any("error" in dict(attrs) for attrs in calls)


@pytest.mark.memory
def test_a_failed_store_call_carries_its_error_class(
    reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    class Unreachable(MemoryEntityStore):
        def _load(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
            raise ConnectionError("connection refused")

    readings = Readings(reader)
    with caplog.at_level(logging.INFO, logger="dedupstore"), pytest.raises(StoreUnavailable):
        Unreachable(f"memory://{uuid.uuid4().hex}").load("e")
    attributes = {"backend": "memory", "operation": "load", "error": "StoreUnavailable"}
    assert readings.delta(metrics.STORE_DURATION, **attributes) == 1
    (record,) = [r for r in caplog.records if r.name == "dedupstore.client"]
    assert record.levelno == logging.INFO and "load failed" in record.getMessage()


SECRET = "pw-Sup3rSecret-9f27"


@pytest.mark.redis
def test_no_secret_reaches_a_log_record(
    reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:{SECRET}@{HOST}:{free_port()}/0"
    readings = Readings(reader)
    with caplog.at_level(logging.DEBUG), pytest.raises(StoreUnavailable):
        open_store(url, connect_timeout=1, retries=0)
    attributes = {"backend": "redis", "operation": "open", "error": "StoreUnavailable"}
    assert readings.delta(metrics.STORE_DURATION, **attributes) == 1
    ours = [r for r in caplog.records if r.name.startswith(("dedupstore", "backends"))]
    assert any("redis://:***@" in r.getMessage() for r in ours), [r.getMessage() for r in ours]
    for record in caplog.records:
        shown = logging.Formatter().format(record)
        assert SECRET not in shown and SECRET not in repr(record.args), shown


# ---------------------------------------------------------------------- without OpenTelemetry


@pytest.mark.memory
def test_without_the_api_every_call_is_a_no_op(
    reader: InMemoryMetricReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = _consumer()
    _, entities, dedup = _memory(consumer)
    monkeypatch.setattr(metrics, "_api", None)
    assert not metrics.available()
    readings = Readings(reader)
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
    assert processor.process(Message("m", "e", {"amount": 1}), deposit).outcome == "processed"
    assert sweep(entities, dedup).ids_moved == 1
    assert readings.changed(metrics.MESSAGES) == {}
    assert readings.changed(metrics.STORE_DURATION) == {}
    assert readings.changed(metrics.SWEEP_IDS) == {}


@pytest.mark.memory
def test_the_library_works_when_opentelemetry_cannot_be_imported() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # "import opentelemetry" raises ImportError

        from dedupstore import metrics, open_entity_store, open_store
        from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, sweep

        assert not metrics.available()
        with open_entity_store("memory://x") as entities, open_store("memory://x") as dedup:
            processor = OutboxProcessor(
                entities, dedup, InMemoryDispatcher(), cleanup="deferred", dead_letters="dlq"
            )
            def handler(state, message):
                if message.body < 0:
                    raise ValueError("poison")
                return {"n": state.get("n", 0) + 1}, [Send("out", message.body)]
            batch = [Message("m1", "e", 1), Message("m1", "e", 1), Message("m2", "e", -1)]
            print([r.outcome for r in processor.process_batch(batch, handler)])
            print(sweep(entities, dedup, progress=lambda r: None).ids_moved)
        """
    )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['processed', 'duplicate', 'dead_lettered']", "2"]


# ---------------------------------------------------------------------- the sweep command


def _three_entities(url: str) -> None:
    """Three entities with one dispatched id each (deferred clean-up), default endpoint."""
    with open_entity_store(url) as entities, open_store(url) as dedup:
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        batch = [Message(f"m{n}", f"order-{n}", {"amount": n}) for n in range(3)]
        processor.process_batch(batch, deposit)


@pytest.mark.sqlite
def test_the_sweep_command_prints_progress_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/sweep.db"
    _three_entities(url)
    args = ["entities", "sweep", url, "--dedup", url, "--batch-ids", "1", "--progress", "0"]
    assert main(args) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 4, lines
    for n, line in enumerate(lines[:3], start=1):
        assert line.startswith(
            f"dedupstore: sweeping segment 0 of 1: {n} entities scanned, {n} ids moved, "
            "0 conflicts retried, 0 ids left, "
        ), line
    assert lines[3].startswith("dedupstore: swept segment 0 of 1: 3 entities scanned, 3 ids")
    assert '"ids_moved": 3' in captured.out


@pytest.mark.sqlite
@pytest.mark.parametrize("options", [[], ["--quiet", "--progress", "0"]], ids=["short", "quiet"])
def test_a_short_or_quiet_sweep_prints_no_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    url = f"sqlite:///{tmp_path}/sweep.db"
    _three_entities(url)
    assert main(["entities", "sweep", url, "--dedup", url, "--batch-ids", "1", *options]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and '"ids_moved": 3' in captured.out


def test_progress_lines_are_at_most_one_per_interval(capsys: pytest.CaptureFixture[str]) -> None:
    ticks = iter([0.0, 1.0, 2.5, 3.0, 4.4, 5.0])
    report = SweepProgress(2.0, clock=lambda: next(ticks))
    for moved in range(1, 6):
        report(SweepResult(ids_moved=moved, entities_scanned=moved, seconds=float(moved)))
    report.finish(SweepResult(ids_moved=5, entities_scanned=5, seconds=5.5))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "sweeping segment 0 of 1",
        "sweeping segment 0 of 1",
        "swept segment 0 of 1",
    ]
    assert ["2 ids moved" in lines[0], "5 ids moved" in lines[1]] == [True, True]


def test_the_sweep_command_refuses_a_negative_interval(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["entities", "sweep", "sqlite:///x.db", "--progress", "-1"])
    assert info.value.code == 2
    assert "expected 0 or more seconds" in capsys.readouterr().err


# ---------------------------------------------------------------------- consume loops


@pytest.mark.memory
def test_a_consume_loop_counts_deliveries_and_reports_pending(
    reader: InMemoryMetricReader,
) -> None:
    from dedupstore.consumers import Consumer
    from tests.test_consumers import ListBroker, entry

    consumer = _consumer()
    _, entities, dedup = _memory(consumer)
    broker = ListBroker([entry("m1", "acct", 1), ("{", {"id": "m2", "correlation_id": "a"})])
    broker.add(*entry("m3", "acct", 3))
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), dead_letters="dlq")
    readings = Readings(reader)
    loop = Consumer(broker, processor, deposit, batch_size=2)
    loop.run_once()
    loop.run_once()
    name = metrics.CONSUMER_DELIVERIES
    counts = {
        event: readings.delta(name, consumer=consumer, broker="list", event=event)
        for event in ("fetched", "reclaimed", "acked", "nacked", "set_aside")
    }
    assert counts == {"fetched": 3, "reclaimed": 0, "acked": 3, "nacked": 0, "set_aside": 1}
    pending = readings.changed(metrics.CONSUMER_PENDING)
    assert pending == {frozenset({"consumer": consumer, "broker": "list"}.items()): 1}


def test_every_built_in_scheme_is_named_by_its_backend_in_metrics() -> None:
    """Every class a scheme opens lists that scheme, and the metrics name the backend by
    the first (``rediss`` counts as ``redis``, ``postgres`` as ``postgresql``); only the
    in-process ``memory://`` classes say their data lives in one process."""
    stored = ("memory", "sqlite", "postgresql", "postgres", "redis", "rediss", "dynamodb", "cosmos")
    built_in: dict[Kind, tuple[str, ...]] = {  # (other tests register schemes too)
        "store": stored,
        "entity_store": stored,
        "dispatcher": ("memory", "sqlite", "redis", "rediss", "amqp", "amqps"),
        "broker": ("redis", "rediss", "amqp", "amqps", "kafka"),
    }
    for kind, schemes in built_in.items():
        for scheme in schemes:
            opened: Any = resolve(kind, scheme)
            assert scheme in opened.schemes, (kind, scheme, opened)
            assert opened.process_local == (scheme == "memory"), (kind, scheme)
    assert resolve("store", "rediss").schemes[0] == "redis"
    assert resolve("entity_store", "postgres").schemes[0] == "postgresql"
