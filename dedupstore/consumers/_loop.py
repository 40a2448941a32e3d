"""The consume loop: :class:`Consumer`.

Each round (:meth:`Consumer.run_once`): reclaim what a dead consumer left, fetch new
deliveries (together at most ``batch_size``), set aside those that cannot become a
message (a dead letter, then acknowledged), run the others through the
:class:`~dedupstore.outbox.OutboxProcessor` (those delivered too often with a handler
that refuses them: dead-lettered unless already done), acknowledge what is done and
leave the rest for redelivery. :meth:`Consumer.run` repeats rounds until
:meth:`Consumer.stop` (or SIGTERM/SIGINT), backing off after a round that failed.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal, cast

from tenacity import RetryCallState, wait_random_exponential

from dedupstore import canonical, metrics
from dedupstore.consumers._base import Broker, Delivery, MessageRules, headers_of, shown_body
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    HandlerError,
    MalformedDelivery,
    StoreClosed,
    format_error,
)
from dedupstore.ids import outgoing_id
from dedupstore.outbox import (
    LETTER_ERROR_CHARS,
    Handler,
    Message,
    OutboxProcessor,
    bounded_letter,
)

__all__ = [
    "MALFORMED_ENTITY",
    "SET_ASIDE_POSITION",
    "ConsumeStats",
    "Consumer",
    "MaxDeliveriesExceeded",
]

_log = logging.getLogger("dedupstore.consumers")

#: The position in :func:`~dedupstore.ids.outgoing_id` of the dead letter a consumer
#: dispatches for a malformed delivery it sets aside (the processor's own dead
#: letters, a message delivered too often's included, are -1).
SET_ASIDE_POSITION = -2
#: The entity under which the dead letter of a malformed delivery is named.
MALFORMED_ENTITY = "__dedupstore_malformed__"


class MaxDeliveriesExceeded(Exception):
    """Why a message delivered more than ``max_deliveries`` times was dead-lettered."""


#: Errors that no retry fixes: the loop leaves the batch for redelivery and raises.
_FATAL = (ConfigurationError, ConsistencyError, StoreClosed)


@dataclass
class ConsumeStats:
    """What a round (or a whole run) of a :class:`Consumer` did.

    ``fetched``: new deliveries; ``reclaimed``: taken over from a dead consumer;
    ``acked``: done and acknowledged (processed, duplicate, redispatched,
    dead-lettered or set aside); ``nacked``: left for redelivery; ``set_aside``:
    malformed deliveries (dead-lettered by the consumer, then acked);
    ``failures``: rounds in which something was left for redelivery; ``outcomes``:
    the processor's outcomes by name.
    """

    rounds: int = 0
    fetched: int = 0
    reclaimed: int = 0
    acked: int = 0
    nacked: int = 0
    set_aside: int = 0
    failures: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, other: ConsumeStats) -> None:
        """Add ``other``'s counts to these."""
        for name in ("rounds", "fetched", "reclaimed", "acked", "nacked", "set_aside"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.failures += other.failures
        for outcome, n in other.outcomes.items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _seconds(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    number = float(value)
    if not (number > 0 if positive else number >= 0) or number == float("inf"):
        bound = "more than 0" if positive else "0 or more"
        raise ConfigurationError(f"{name} must be {bound} seconds, got {value!r}")
    return number


class Consumer:
    """Reads a :class:`~dedupstore.consumers.Broker` and processes exactly once.

    Guarantees: a delivery is acknowledged only once it is done, i.e. the
    processor returned for it (``processed``, ``duplicate``, ``redispatched``,
    ``dead_lettered``) or it was set aside (its dead letter dispatched); anything
    else (``StoreUnavailable``, a conflict that persisted, a dispatcher that
    raised, a crash) leaves it for redelivery, and the loop backs off (jittered
    exponential, at most ``max_backoff`` seconds). A delivery that
    ``rules`` cannot turn into a message is set aside once: one dead letter to the
    processor's ``dead_letters`` with a deterministic id (a redelivery dispatches
    the same id and bytes), then acknowledged. A message delivered more than
    ``max_deliveries`` times is handed to the processor with a handler that refuses
    it: a duplicate if an earlier delivery applied it, else dead-lettered by the
    processor exactly once (recorded in its entity, so ``redrive`` applies it once)
    without running the handler that may have killed the earlier consumers.
    ``mode="batch"`` runs ``process_batch`` over the
    round (a batch whose handler raises without ``dead_letters`` is run message by
    message, so only the poison one is left); ``"single"`` runs ``process`` per
    message. :meth:`stop` (and SIGTERM/SIGINT under :meth:`run`) ends the loop after
    the round in flight is processed and acknowledged.
    """

    def __init__(
        self,
        broker: Broker,
        processor: OutboxProcessor,
        handler: Handler,
        *,
        rules: MessageRules | None = None,
        batch_size: int = 100,
        mode: Literal["batch", "single"] = "batch",
        max_deliveries: int | None = 5,
        wait: float = 1.0,
        max_backoff: float = 30.0,
    ) -> None:
        """Raises ``ConfigurationError`` (no I/O) for a bad option, or for
        ``max_deliveries`` without ``dead_letters`` on the processor."""
        if not isinstance(broker, Broker):
            raise ConfigurationError(f"broker must be a Broker, got {type(broker).__name__}")
        if not isinstance(processor, OutboxProcessor):
            raise ConfigurationError(
                f"processor must be an OutboxProcessor, got {type(processor).__name__}"
            )
        if not callable(handler):
            raise ConfigurationError(f"handler must be callable, got {handler!r:.80}")
        rules = MessageRules() if rules is None else rules
        if not isinstance(rules, MessageRules):
            raise ConfigurationError(f"rules must be MessageRules, got {type(rules).__name__}")
        if mode not in ("batch", "single"):
            raise ConfigurationError(f"mode must be 'batch' or 'single', got {mode!r}")
        if max_deliveries is not None:
            _positive_int("max_deliveries", max_deliveries)
            if processor.dead_letters is None:
                raise ConfigurationError(
                    f"max_deliveries={max_deliveries} sets deliveries aside as dead letters: "
                    "give the processor dead_letters='<destination>', or max_deliveries=None"
                )
        self.broker = broker
        self.processor = processor
        self.handler = handler
        self.rules = rules
        self.batch_size = _positive_int("batch_size", batch_size)
        self.mode = mode
        self.max_deliveries = max_deliveries
        self.wait = _seconds("wait", wait)
        self.max_backoff = _seconds("max_backoff", max_backoff, positive=True)
        self._backoff = wait_random_exponential(multiplier=0.05, max=self.max_backoff)
        self._stopping = threading.Event()
        self._failures = 0  # consecutive rounds that left something for redelivery
        self._pending_read = float("-inf")

    @property
    def consumer(self) -> str:
        """The consumer's name (the processor's deduplication endpoint)."""
        return self.processor.consumer

    # ------------------------------------------------------------------ the loop

    def run(self, *, install_signal_handlers: bool = True) -> ConsumeStats:
        """Run rounds until :meth:`stop`; return the totals.

        With ``install_signal_handlers`` (in the main thread), SIGTERM and SIGINT
        call :meth:`stop` (the previous handlers are restored on return). Between
        rounds that left something for redelivery it sleeps a bounded backoff
        (:meth:`stop` cuts it short). A broker that cannot answer
        (``StoreUnavailable``) is retried the same way; ``ConfigurationError``,
        ``ConsistencyError`` and ``StoreClosed`` end the loop (raised).
        """
        totals = ConsumeStats()
        self._stopping.clear()
        with self._signals(install_signal_handlers):
            while not self._stopping.is_set():
                try:
                    totals.add(self.run_once())
                except _FATAL:
                    raise
                except Exception as exc:  # noqa: BLE001 - the broker failed: back off, go on
                    self._failures += 1
                    totals.failures += 1
                    _log.warning(
                        "consumer %s: the broker call failed (%s: %s); retrying",
                        self.consumer,
                        type(exc).__name__,
                        format_error(exc),
                    )
                if self._failures and not self._stopping.is_set():
                    self._pause()
        metrics.set_pending(self.consumer, self.broker.kind, None)
        return totals

    def stop(self) -> None:
        """End :meth:`run` after the round in flight (processed and acknowledged)."""
        self._stopping.set()

    def _pause(self) -> None:
        state = RetryCallState(cast(Any, None), None, (), {})  # the wait reads the attempt
        state.attempt_number = self._failures
        self._stopping.wait(self._backoff(state))

    @contextmanager
    def _signals(self, install: bool) -> Iterator[None]:
        if not install or threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
            _log.info(
                "consumer %s: %s received; stopping after the batch in flight",
                self.consumer,
                signal.Signals(signum).name,
            )
            self.stop()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # ------------------------------------------------------------------ one round

    def run_once(self) -> ConsumeStats:
        """One round: reclaim and fetch up to ``batch_size``, process, ack, nack.

        Raises what the broker raises from ``reclaim``, ``fetch``, ``ack`` or
        ``nack`` (what was not acknowledged is redelivered), and the errors no retry
        fixes (``ConfigurationError``, ``ConsistencyError``, ``StoreClosed``) after
        leaving the round for redelivery.
        """
        stats = ConsumeStats(rounds=1)
        kind = self.broker.kind
        reclaimed = self.broker.reclaim(self.batch_size)
        room = self.batch_size - len(reclaimed)
        fetched = self.broker.fetch(room, 0.0 if reclaimed else self.wait) if room > 0 else []
        stats.reclaimed, stats.fetched = len(reclaimed), len(fetched)
        metrics.count_deliveries(self.consumer, kind, "reclaimed", len(reclaimed))
        metrics.count_deliveries(self.consumer, kind, "fetched", len(fetched))
        deliveries = [*reclaimed, *fetched]
        if deliveries:
            done, left = self._handle(deliveries, stats)
            if done:
                self.broker.ack(done)
            if left:
                self.broker.nack(left)
            stats.acked, stats.nacked = len(done), len(left)
            metrics.count_deliveries(self.consumer, kind, "acked", len(done))
            metrics.count_deliveries(self.consumer, kind, "nacked", len(left))
            stats.failures = int(bool(left))
            self._failures = self._failures + 1 if left else 0
        self._report_pending()
        return stats

    def _handle(
        self, deliveries: list[Delivery], stats: ConsumeStats
    ) -> tuple[list[Delivery], list[Delivery]]:
        """Set aside, process; the deliveries done and those left for redelivery."""
        aside: list[tuple[Delivery, OutgoingMessage, str]] = []
        work: list[tuple[Delivery, Message]] = []
        exceeded: dict[tuple[str, str], int] = {}
        for delivery in deliveries:
            try:
                message = self.rules.message(delivery)
            except MalformedDelivery as exc:
                aside.append((delivery, *self._malformed_letter(delivery, exc)))
                continue
            count = delivery.deliveries
            limit = self.max_deliveries
            if limit is not None and count is not None and count > limit:
                # Not the consumer's to judge: the processor knows whether the message
                # was applied already (then a duplicate) and, if not, dead-letters it
                # exactly once, recorded in its entity (so a redrive applies it once).
                exceeded[(message.correlation_id, message.id)] = count
                _log.warning(
                    "consumer %s: message %r of entity %r was delivered %d times "
                    "(max_deliveries=%s); dead-lettered unless already done",
                    self.consumer,
                    message.id,
                    message.correlation_id,
                    count,
                    limit,
                )
            work.append((delivery, message))
        done: list[Delivery] = []
        left: list[Delivery] = []
        fatal: BaseException | None = None
        try:
            if aside:
                self._set_aside(aside, done, left, stats)
            if work:
                handler = self._refusing(exceeded) if exceeded else self.handler
                if self.mode == "batch":
                    self._batch(work, handler, done, left, stats)
                else:
                    self._single(work, handler, done, left, stats)
        except _FATAL as exc:
            fatal = exc
            settled = {id(d) for d in (*done, *left)}
            left.extend(d for d in deliveries if id(d) not in settled)
        if fatal is not None:
            if done:
                self.broker.ack(done)
            if left:
                self.broker.nack(left)
            raise fatal
        return done, left

    def _set_aside(
        self,
        aside: list[tuple[Delivery, OutgoingMessage, str]],
        done: list[Delivery],
        left: list[Delivery],
        stats: ConsumeStats,
    ) -> None:
        if self.processor.dead_letters is None:
            for delivery, _, reason in aside:
                _log.error(
                    "consumer %s: delivery %r cannot be processed (%s) and the processor has "
                    "no dead_letters to set it aside; left for redelivery",
                    self.consumer,
                    delivery.token,
                    reason,
                )
            left.extend(d for d, _, _ in aside)
            return
        try:
            self.processor.dispatcher.dispatch([letter for _, letter, _ in aside])
        except _FATAL:
            raise
        except Exception as exc:  # noqa: BLE001 - not sent: redelivered, set aside later
            metrics.count_dispatch_failure(self.consumer, exc)
            _log.warning(
                "consumer %s: dispatching %d dead letter(s) failed (%s: %s); left for redelivery",
                self.consumer,
                len(aside),
                type(exc).__name__,
                format_error(exc),
            )
            left.extend(d for d, _, _ in aside)
            return
        for delivery, letter, reason in aside:
            _log.warning(
                "consumer %s: delivery %r set aside to %s as dead letter %s: %s",
                self.consumer,
                delivery.token,
                self.processor.dead_letters,
                letter.id,
                reason,
            )
        done.extend(d for d, _, _ in aside)
        stats.set_aside += len(aside)
        metrics.count_deliveries(self.consumer, self.broker.kind, "set_aside", len(aside))

    def _batch(
        self,
        work: list[tuple[Delivery, Message]],
        handler: Handler,
        done: list[Delivery],
        left: list[Delivery],
        stats: ConsumeStats,
    ) -> None:
        try:
            results = self.processor.process_batch([m for _, m in work], handler)
        except HandlerError:  # no dead_letters: run them one by one, leave only the poison
            self._single(work, handler, done, left, stats)
            return
        except _FATAL:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever raised: not done, redelivered
            self._left(work, left, exc)
            return
        for result in results:
            stats.outcomes[result.outcome] = stats.outcomes.get(result.outcome, 0) + 1
        done.extend(d for d, _ in work)

    def _single(
        self,
        work: list[tuple[Delivery, Message]],
        handler: Handler,
        done: list[Delivery],
        left: list[Delivery],
        stats: ConsumeStats,
    ) -> None:
        for index, (delivery, message) in enumerate(work):
            try:
                result = self.processor.process(message, handler)
            except HandlerError as exc:
                _log.warning(
                    "consumer %s: %s; left for redelivery", self.consumer, format_error(exc)
                )
                left.append(delivery)
                continue
            except _FATAL:
                raise
            except Exception as exc:  # noqa: BLE001 - not done: leave it and the rest
                self._left(work[index:], left, exc)
                return
            stats.outcomes[result.outcome] = stats.outcomes.get(result.outcome, 0) + 1
            done.append(delivery)

    def _left(
        self, work: Sequence[tuple[Delivery, Message]], left: list[Delivery], exc: Exception
    ) -> None:
        _log.warning(
            "consumer %s: processing %d message(s) failed (%s: %s); left for redelivery",
            self.consumer,
            len(work),
            type(exc).__name__,
            format_error(exc),
        )
        left.extend(d for d, _ in work)

    # ------------------------------------------------------------------ dead letters

    def _letter(
        self, letter_id: str, body: dict[str, Any], parts: Sequence[tuple[str, str]]
    ) -> OutgoingMessage:
        """A dead letter of the consumer, bounded by the processor's rule
        (:func:`~dedupstore.outbox.bounded_letter` to its ``letter_bytes()``: ``parts``
        replaced by their size and digest while it is over)."""
        # without dead_letters the letter is never dispatched (see _set_aside)
        destination = self.processor.dead_letters or ""
        letter, _ = bounded_letter(
            {**body, "consumer": self.consumer}, parts, self.processor.letter_bytes()
        )
        return OutgoingMessage(letter_id, destination, letter)

    def _malformed_letter(
        self, delivery: Delivery, exc: MalformedDelivery
    ) -> tuple[OutgoingMessage, str]:
        """The dead letter of a delivery that is not a message: named by its content
        (the whole delivery, even when the letter carries only its size and digest)."""
        shown = {"body": shown_body(delivery.body), "headers": headers_of(delivery)}
        digest = hashlib.sha256(canonical.dumps(shown).encode()).hexdigest()
        letter_id = outgoing_id(self.consumer, MALFORMED_ENTITY, digest, SET_ASIDE_POSITION)
        reason = exc.reason
        if len(reason) > LETTER_ERROR_CHARS:
            reason = f"{reason[:LETTER_ERROR_CHARS]}... ({len(reason)} characters)"
        error = {"type": "dedupstore.errors.MalformedDelivery", "text": reason}
        parts = (("delivery", "body"), ("delivery", "headers"))
        return self._letter(letter_id, {"delivery": shown, "error": error}, parts), reason

    def _refusing(self, exceeded: dict[tuple[str, str], int]) -> Handler:
        """The handler, except for the messages delivered too often: it refuses those.

        The processor calls a handler only for a message not applied yet, so a
        message applied in an earlier delivery (whose acknowledgement was lost) stays
        a duplicate; one never applied is dead-lettered by the processor (its
        ``dead_letters`` are required with ``max_deliveries``) without running the
        user's handler, which may be what killed the earlier consumers.
        """
        limit, handler = self.max_deliveries, self.handler

        def refusing(state: dict[str, Any], message: Message) -> Any:
            count = exceeded.get((message.correlation_id, message.id))
            if count is None:
                return handler(state, message)
            raise MaxDeliveriesExceeded(
                f"message {message.id!r:.80} of entity {message.correlation_id!r:.80} was "
                f"delivered {count} times, more than max_deliveries={limit}, without being done"
            )

        return refusing

    # ------------------------------------------------------------------ metrics

    #: Seconds between two reads of the broker's pending count (for the gauge).
    pending_every = 5.0

    def _report_pending(self) -> None:
        if not metrics.available():
            return
        now = time.monotonic()
        if now - self._pending_read < self.pending_every:
            return
        self._pending_read = now
        try:
            value = self.broker.pending()
        except Exception as exc:  # noqa: BLE001 - only a metric: never fail the round
            _log.debug("consumer %s: reading the pending count failed: %s", self.consumer, exc)
            return
        metrics.set_pending(self.consumer, self.broker.kind, value)


def _as_json(value: Any) -> Any:
    """``value`` as JSON (bytes as text or hex; what is not JSON as its ``repr``)."""
    if isinstance(value, bytes):
        return shown_body(value)
    try:
        return canonical.normalized(value)[0]
    except (TypeError, ValueError):
        return {"repr": repr(value)}
