"""Metrics through the OpenTelemetry API, an optional dependency (``dedupstore[metrics]``).

The library records on the meter ``dedupstore`` of the global ``MeterProvider``
(``opentelemetry.metrics.get_meter``): configure a provider with the SDK as usual
and the instruments below report through it; until one is configured the API's
proxies record nothing. Without ``opentelemetry-api`` installed every function here
does nothing. No function here raises (beyond what the OpenTelemetry API raises,
which by its own contract is nothing).

The instruments' names (the constants below) and attributes are a contract; the table
in the operating guide (``docs/operating.md``, "Logs and metrics") says what each counts.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Iterable
from typing import Any, Protocol

__all__ = [
    "CONFLICTS",
    "CONSUMER_DELIVERIES",
    "CONSUMER_PENDING",
    "DISPATCH_FAILURES",
    "MESSAGES",
    "STORE_DURATION",
    "SWEEP_IDS",
    "TOKENS",
    "available",
    "count_conflicts",
    "count_deliveries",
    "count_dispatch_failure",
    "count_outcomes",
    "count_swept",
    "count_tokens",
    "record_store_call",
    "set_pending",
]

MESSAGES = "dedupstore.messages"
CONFLICTS = "dedupstore.conflicts"
DISPATCH_FAILURES = "dedupstore.dispatch.failures"
STORE_DURATION = "dedupstore.store.duration"
SWEEP_IDS = "dedupstore.sweep.ids"
TOKENS = "dedupstore.tokens"
CONSUMER_DELIVERIES = "dedupstore.consumer.deliveries"
CONSUMER_PENDING = "dedupstore.consumer.pending"

#: Bucket boundaries advised for ``dedupstore.store.duration`` (seconds): from an
#: in-process call (well under a millisecond) to a call that times out. Used by SDKs
#: that honour the advisory (opentelemetry-sdk 1.30 and later); a View overrides them.
DURATION_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class _HasOutcome(Protocol):
    @property
    def outcome(self) -> str: ...


class _Instruments:
    """The instruments, made once from the global meter."""

    def __init__(self, meter: Any) -> None:
        self.messages = meter.create_counter(
            MESSAGES, "{message}", "messages processed, by outcome and consumer"
        )
        self.conflicts = meter.create_counter(
            CONFLICTS, "{conflict}", "concurrency conflicts retried by the processor or the sweep"
        )
        self.dispatch_failures = meter.create_counter(
            DISPATCH_FAILURES, "{call}", "dispatcher calls that raised"
        )
        self.sweep_ids = meter.create_counter(
            SWEEP_IDS, "{id}", "ids moved by the sweep into the deduplication store"
        )
        self.tokens = meter.create_counter(
            TOKENS, "{token}", "tokens created, consumed or found missing, by consumer"
        )
        self.consumer_deliveries = meter.create_counter(
            CONSUMER_DELIVERIES, "{delivery}", "broker deliveries a consume loop handled, by event"
        )
        meter.create_observable_gauge(
            CONSUMER_PENDING,
            callbacks=[_observe_pending],
            unit="{delivery}",
            description="deliveries the broker holds for the consumer (pending or lag)",
        )
        description = "duration of each backend call, by backend, operation and error"
        try:
            self.store_duration = meter.create_histogram(
                STORE_DURATION,
                "s",
                description,
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            )
        except TypeError:  # opentelemetry-api before 1.30 has no advisory
            self.store_duration = meter.create_histogram(STORE_DURATION, "s", description)


#: ``(consumer, broker) -> pending`` as the consume loops last saw it (the gauge's values).
_pending: dict[tuple[str, str], int] = {}
_pending_lock = threading.Lock()  # not _lock: the SDK calls the gauge from its own thread


def _observe_pending(options: Any) -> Any:
    """The gauge's callback: one observation per consume loop that reported a value."""
    api = _api
    if api is None:  # pragma: no cover - the gauge exists only with the API
        return []
    with _pending_lock:
        values = list(_pending.items())
    return [
        api.Observation(value, {"consumer": consumer, "broker": broker})
        for (consumer, broker), value in values
    ]


_UNTRIED: Any = object()
_lock = threading.Lock()
#: ``opentelemetry.metrics``, imported on first use (so ``import dedupstore`` does not
#: import it); ``None`` when it is not installed.
_api: Any = _UNTRIED
_instruments: _Instruments | None = None


def _import_api() -> Any:
    """Under ``_lock``: import the API once; ``None`` when it is not installed."""
    global _api
    if _api is _UNTRIED:
        try:
            _api = importlib.import_module("opentelemetry.metrics")
        except ImportError:  # the optional extra is not installed: every call is a no-op
            _api = None
    return _api


def _version() -> str | None:
    """The installed package's version (the meter's), ``None`` when not installed."""
    try:
        return importlib.metadata.version("dedupstore")
    except importlib.metadata.PackageNotFoundError:
        return None


def available() -> bool:
    """Whether the OpenTelemetry API is importable (else every call here is a no-op)."""
    with _lock:
        return _import_api() is not None


def _get() -> _Instruments | None:
    """The instruments, made on first use; ``None`` without the API."""
    global _instruments
    if _api is None:
        return None
    made = _instruments
    if made is None:
        with _lock:
            api = _import_api()
            if api is None:
                return None
            if _instruments is None:
                _instruments = _Instruments(api.get_meter("dedupstore", _version()))
            made = _instruments
    return made


def count_outcomes(consumer: str, results: Iterable[_HasOutcome]) -> None:
    """Add each result's outcome to ``dedupstore.messages`` (one add per outcome)."""
    made = _get()
    if made is None:
        return
    counts: dict[str, int] = {}
    for result in results:
        outcome = result.outcome
        counts[outcome] = counts.get(outcome, 0) + 1
    for outcome, n in counts.items():
        made.messages.add(n, {"outcome": outcome, "consumer": consumer})


def count_conflicts(consumer: str, source: str, n: int = 1) -> None:
    """Add ``n`` to ``dedupstore.conflicts`` (``source``: ``processor`` or ``sweep``)."""
    made = _get()
    if made is not None and n > 0:
        made.conflicts.add(n, {"consumer": consumer, "source": source})


def count_dispatch_failure(consumer: str, error: BaseException) -> None:
    """Add one to ``dedupstore.dispatch.failures``."""
    made = _get()
    if made is not None:
        made.dispatch_failures.add(1, {"consumer": consumer, "error": type(error).__name__})


def count_tokens(consumer: str, event: str, n: int) -> None:
    """Add ``n`` to ``dedupstore.tokens`` (``event``: ``created``, ``consumed``, or
    ``missing``: an incoming message whose token was absent, a duplicate)."""
    made = _get()
    if made is not None and n > 0:
        made.tokens.add(n, {"consumer": consumer, "event": event})


def count_swept(consumer: str, ids: int) -> None:
    """Add ``ids`` to ``dedupstore.sweep.ids``."""
    made = _get()
    if made is not None and ids > 0:
        made.sweep_ids.add(ids, {"consumer": consumer})


def record_store_call(backend: str, operation: str, seconds: float, error: str | None) -> None:
    """Record one backend call in ``dedupstore.store.duration``."""
    made = _get()
    if made is None:
        return
    attributes = {"backend": backend, "operation": operation}
    if error is not None:
        attributes["error"] = error
    made.store_duration.record(seconds, attributes)


def count_deliveries(consumer: str, broker: str, event: str, n: int) -> None:
    """Add ``n`` to ``dedupstore.consumer.deliveries`` for ``event`` (``fetched``, ...)."""
    made = _get()
    if made is not None and n > 0:
        made.consumer_deliveries.add(n, {"consumer": consumer, "broker": broker, "event": event})


def set_pending(consumer: str, broker: str, value: int | None) -> None:
    """What ``dedupstore.consumer.pending`` reports for this consumer (``None``: nothing)."""
    if _get() is None:
        return
    with _pending_lock:
        if value is None:
            _pending.pop((consumer, broker), None)
        else:
            _pending[(consumer, broker)] = value
