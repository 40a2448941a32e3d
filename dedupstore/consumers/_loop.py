"""The consume loop: :class:`Consumer`."""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from types import FrameType
from typing import Any, Literal

from tenacity import wait_random_exponential

from dedupstore import canonical, metrics
from dedupstore.calls import pause_before
from dedupstore.consumers._base import Broker, Delivery, MessageRules, headers_of, shown_body
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    EntityTooLarge,
    HandlerError,
    MalformedDelivery,
    MessageTooLarge,
    StoreClosed,
    format_error,
)
from dedupstore.ids import outgoing_id
from dedupstore.options import seconds
from dedupstore.outbox import (
    LETTER_ERROR_CHARS,
    Handler,
    Message,
    OutboxProcessor,
    bounded_letter,
)
from dedupstore.outbox.letters import refusing
from dedupstore.outbox.processor import _Processor
from dedupstore.steps import Steps, io, run

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
#: One message's own failures (raised only without the processor's ``dead_letters``):
#: the batch is run message by message, so that only that message is given back.
_MESSAGE_ERRORS = (HandlerError, EntityTooLarge, MessageTooLarge)


@dataclass
class ConsumeStats:
    """What a round (or a whole run) of a :class:`Consumer` did.

    ``fetched``: new deliveries; ``reclaimed``: taken over from a dead consumer;
    ``acked``: done and acknowledged (processed, duplicate, redispatched,
    dead-lettered or set aside); ``nacked``: given back to the broker for
    redelivery (a message whose handler raised, without ``dead_letters``);
    ``held``: stopped by an outage (a store or dispatcher that could not answer, a
    conflict that persisted) and kept by this consumer for its next round, never
    given back (so no broker delivery count rises); ``set_aside``: malformed
    deliveries (dead-lettered by the consumer, then acked); ``isolated``:
    deliveries a consumer died holding, run alone with their run counted;
    ``failures``: rounds in which something was nacked or held; ``outcomes``: the
    processor's outcomes by name.
    """

    rounds: int = 0
    fetched: int = 0
    reclaimed: int = 0
    acked: int = 0
    nacked: int = 0
    held: int = 0
    set_aside: int = 0
    isolated: int = 0
    failures: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, other: ConsumeStats) -> None:
        """Add ``other``'s counts to these."""
        for count in fields(self):
            if count.name != "outcomes":
                setattr(self, count.name, getattr(self, count.name) + getattr(other, count.name))
        for outcome, n in other.outcomes.items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n


@dataclass
class _Fates:
    """A round's deliveries by fate: ``done`` (acked), ``left`` (given back: nacked),
    ``kept`` (held for the next round); ``stats``: the round's."""

    stats: ConsumeStats
    done: list[Delivery] = field(default_factory=list)
    left: list[Delivery] = field(default_factory=list)
    kept: list[Delivery] = field(default_factory=list)

    def processed(self, delivery: Delivery, outcome: str) -> None:
        self.stats.outcomes[outcome] = self.stats.outcomes.get(outcome, 0) + 1
        self.done.append(delivery)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _seconds(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` through the library's one duration parser (``1.5``, ``"1s"``,
    ``"250ms"``, a ``timedelta``; 0 too unless ``positive``)."""
    try:
        return float(seconds(zero=not positive)(value))
    except (TypeError, ValueError) as exc:
        bound = "more than 0" if positive else "0 or more"
        raise ConfigurationError(
            f"{name} must be {bound} seconds (a number, or a duration such as '1s' or "
            f"'250ms'), got {value!r:.80}: {exc}"
        ) from None


@contextmanager
def stopping_on_signals(stop: Callable[[], None] | None, said: str) -> Iterator[None]:
    """In the block, SIGTERM and SIGINT call ``stop`` (logged at INFO: ``said`` with the
    signal's name); the previous handlers are restored after it. Nothing is installed
    when ``stop`` is ``None`` or outside the main thread (only it can install them)."""
    if stop is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        _log.info(said, signal.Signals(signum).name)
        stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Loop:
    """The consume loop's rounds, written once as steps (:mod:`dedupstore.steps`):
    :class:`Consumer` drives them in its thread, :class:`dedupstore.aio.AsyncConsumer`
    on the event loop. A face supplies :meth:`run_once`, :meth:`release` and
    :meth:`_pause` (a plain or an ``async def`` method each)."""

    #: What the face accepts as a broker (checked in ``__init__``).
    _brokers: tuple[type, ...] = (Broker,)
    #: The processor class the face needs (named in the error).
    _processor_class: type = OutboxProcessor
    #: The broker read (a face narrows its type).
    broker: Any
    #: The outbox processor (the face's: its methods are the loop's calls).
    processor: Any

    def __init__(
        self,
        broker: Any,
        processor: _Processor,
        handler: Any,
        *,
        rules: MessageRules | None,
        batch_size: int,
        mode: Literal["batch", "single"],
        max_deliveries: int | None,
        wait: float | str | timedelta,
        max_backoff: float | str | timedelta,
    ) -> None:
        if not isinstance(broker, self._brokers):
            names = " or ".join(kind.__name__ for kind in self._brokers)
            raise ConfigurationError(f"broker must be a {names}, got {type(broker).__name__}")
        if not isinstance(processor, self._processor_class):
            raise ConfigurationError(
                f"processor must be an {self._processor_class.__name__}, got "
                f"{type(processor).__name__}"
            )
        processor._check_handler(handler)
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
        self._held: list[Delivery] = []  # an outage stopped them: run first next round
        self._alone_ids: set[int] = set()  # id() of held suspects: they run alone again
        self._counted: set[int] = set()  # id() of held deliveries whose run was recorded
        self._unacked: list[Delivery] = []  # done, but their ack failed: acked next round
        self._round = ConsumeStats()  # the round in flight: added to the totals if it fails
        #: what the last :meth:`run` did (so far, while it runs)
        self.totals = ConsumeStats()

    @property
    def consumer(self) -> str:
        """The consumer's name (the processor's deduplication endpoint)."""
        return str(self.processor.consumer)

    def stop(self) -> None:
        """End :meth:`run` after the round in flight (processed and acknowledged); called
        before :meth:`run` (from a signal handler, another thread), the run does no round."""
        self._stopping.set()

    # The face's own: plain methods (the sync face) or ``async def`` (the async one).
    def run_once(self) -> Any:
        """One round (the face's)."""
        raise NotImplementedError

    def release(self) -> Any:
        """Give back what is held (the face's)."""
        raise NotImplementedError

    def _pause(self) -> Any:
        raise NotImplementedError

    def _pause_seconds(self) -> float:
        return pause_before(self._failures, self._backoff)

    # ------------------------------------------------------------------ the loop

    def _rounds(self) -> Steps[ConsumeStats]:
        """The steps of ``run``: the face's ``run_once`` until stopped, its ``_pause``
        after a round that failed; what is held is given back at the end."""
        self.totals = totals = ConsumeStats()
        try:
            while not self._stopping.is_set():
                try:
                    totals.add((yield from io(self.run_once)))
                except _FATAL:
                    totals.add(self._round)  # what the failed round did before
                    raise
                except Exception as exc:  # noqa: BLE001 - the broker failed: back off
                    self._failures += 1
                    totals.failures += 1
                    _log.warning(
                        "consumer %s: the broker call failed (%s: %s); retrying",
                        self.consumer,
                        type(exc).__name__,
                        format_error(exc),
                    )
                if self._failures and not self._stopping.is_set():
                    yield from io(self._pause)
        finally:
            self._stopping.clear()  # the next run starts afresh
            yield from io(self.release)
            metrics.set_pending(self.consumer, self.broker.kind, None)
        return totals

    def _release(self) -> Steps[None]:
        held, self._held = self._held, []
        if held:
            try:
                yield from io(self.broker.nack, held)
            except Exception as exc:  # noqa: BLE001 - redelivered after the lease anyway
                _log.warning(
                    "consumer %s: giving back %d held deliveries failed (%s)",
                    self.consumer,
                    len(held),
                    format_error(exc),
                )

    # ------------------------------------------------------------------ one round

    def _run_once(self) -> Steps[ConsumeStats]:
        """The steps of ``run_once``."""
        self._round = stats = ConsumeStats(rounds=1)
        kind = self.broker.kind
        if self._unacked:  # done in a round whose acknowledgement failed: not run again
            yield from io(self.broker.ack, self._unacked)
            stats.acked, self._unacked = len(self._unacked), []
        held, self._held = self._held, []
        try:
            if held:
                yield from io(self.broker.keep, held)  # still this consumer's: lease renewed
            room = self.batch_size - len(held)
            reclaimed = (yield from io(self.broker.reclaim, room)) if room > 0 else []
            room -= len(reclaimed)
            busy = held or reclaimed
            fetched = (
                (yield from io(self.broker.fetch, room, 0.0 if busy else self.wait))
                if room > 0
                else []
            )
        except BaseException:
            self._held = held  # still held: the broker failed, not the deliveries
            raise
        stats.reclaimed, stats.fetched = len(reclaimed), len(fetched)
        metrics.count_deliveries(self.consumer, kind, "reclaimed", len(reclaimed))
        metrics.count_deliveries(self.consumer, kind, "fetched", len(fetched))
        deliveries = [*held, *reclaimed, *fetched]
        if deliveries:
            done, left, kept = yield from self._handle(deliveries, stats, {id(d) for d in held})
            self._held = kept
            if done:
                try:
                    yield from io(self.broker.ack, done)
                except BaseException:
                    self._unacked = done  # acknowledged first thing next round
                    raise
            if left:
                yield from io(self.broker.nack, left)
            stats.acked += len(done)
            stats.nacked, stats.held = len(left), len(kept)
            metrics.count_deliveries(self.consumer, kind, "acked", len(done))
            metrics.count_deliveries(self.consumer, kind, "nacked", len(left))
            metrics.count_deliveries(self.consumer, kind, "held", len(kept))
            stats.failures = int(bool(left or kept))
            self._failures = self._failures + 1 if left or kept else 0
        yield from self._report_pending()
        return stats

    def _handle(
        self, deliveries: list[Delivery], stats: ConsumeStats, held: set[int]
    ) -> Steps[tuple[list[Delivery], list[Delivery], list[Delivery]]]:
        """Set aside, run alone, process: the deliveries done, those given back
        (nack), and those an outage stopped (held for the next round)."""
        aside: list[tuple[Delivery, OutgoingMessage, str]] = []
        alone: list[tuple[Delivery, Message]] = []
        work: list[tuple[Delivery, Message]] = []
        for delivery in deliveries:
            try:
                message = self.rules.message(delivery)
            except MalformedDelivery as exc:
                aside.append((delivery, *self._malformed_letter(delivery, exc)))
                continue
            if self._suspect(delivery, held):
                alone.append((delivery, message))
                self._alone_ids.add(id(delivery))
            else:
                work.append((delivery, message))
        fates = _Fates(stats)
        fatal: BaseException | None = None
        try:
            if aside:
                yield from self._set_aside(aside, fates)
            if alone:  # first: a consumer died holding them, so they are the older
                yield from self._alone(alone, fates)
            if fates.kept:  # an outage: the rest waits too, in order behind what it stopped
                self._hold(work, fates.kept, None)
            elif work:
                if self.mode == "batch":
                    yield from self._batch(work, fates)
                else:
                    yield from self._single(work, self.handler, fates)
        except _FATAL as exc:
            fatal = exc
            settled = {id(d) for d in (*fates.done, *fates.left)}
            fates.left.extend(d for d in deliveries if id(d) not in settled)
            fates.kept = []
        done, left, kept = fates.done, fates.left, fates.kept
        kept_ids = {id(d) for d in kept}
        self._counted &= kept_ids  # a recorded run stays recorded while held
        self._alone_ids &= kept_ids  # and a suspect stays one (even if not yet recorded)
        if fatal is not None:
            stats.acked, stats.nacked = len(done), len(left)
            if done:
                yield from io(self.broker.ack, done)
            if left:
                yield from io(self.broker.nack, left)
            raise fatal
        return done, left, kept

    def _suspect(self, delivery: Delivery, held: set[int]) -> bool:
        """Whether a consumer died holding ``delivery`` (its broker count is above 1,
        and not because this consumer holds it through an outage): then it runs alone,
        its run counted (only where ``max_deliveries`` applies)."""
        count = delivery.deliveries
        if self.max_deliveries is None or count is None or count <= 1:
            return False
        return id(delivery) not in held or id(delivery) in self._alone_ids

    def _alone(self, alone: list[tuple[Delivery, Message]], fates: _Fates) -> Steps[None]:
        """Run each delivery alone: its run recorded in its entity first; once the
        recorded runs exceed ``max_deliveries``, the handler refuses it."""
        limit = self.max_deliveries
        assert limit is not None
        for index, (delivery, message) in enumerate(alone):
            handler = self.handler
            try:
                if id(delivery) not in self._counted:
                    runs = yield from io(self.processor.begin_attempt, message)
                    self._counted.add(id(delivery))
                    if runs > limit:
                        # The processor runs a handler only for a message not applied yet:
                        # one applied by an earlier run stays a duplicate; the others are
                        # dead-lettered without running the handler that killed consumers.
                        refused = MaxDeliveriesExceeded(
                            f"message {message.id!r:.80} of entity "
                            f"{message.correlation_id!r:.80}: {runs - 1} runs of its handler "
                            f"ended with their consumer dead, more than max_deliveries={limit} "
                            "allows; set aside without running it again"
                        )
                        handler = refusing(handler, {(message.correlation_id, message.id): refused})
                        _log.warning(
                            "consumer %s: message %r of entity %r was being run by a consumer "
                            "that died, %d times (max_deliveries=%d); dead-lettered unless "
                            "already done",
                            self.consumer,
                            message.id,
                            message.correlation_id,
                            runs - 1,
                            limit,
                        )
                    elif runs:
                        _log.info(
                            "consumer %s: message %r of entity %r (delivery %s, %d deliveries) "
                            "was held by a consumer that stopped; running it alone, run %d of "
                            "at most %d",
                            self.consumer,
                            message.id,
                            message.correlation_id,
                            delivery.token,
                            delivery.deliveries,
                            runs,
                            limit,
                        )
                if (yield from self._one(delivery, message, handler, fates)):
                    fates.stats.isolated += 1
            except _FATAL:
                raise
            except Exception as exc:  # noqa: BLE001 - an outage: held with the rest
                self._hold(alone[index:], fates.kept, exc)
                return

    def _set_aside(
        self, aside: list[tuple[Delivery, OutgoingMessage, str]], fates: _Fates
    ) -> Steps[None]:
        if self.processor.dead_letters is None:
            for delivery, _, reason in aside:
                _log.error(
                    "consumer %s: delivery %r cannot be processed (%s) and the processor has "
                    "no dead_letters to set it aside; left for redelivery",
                    self.consumer,
                    delivery.token,
                    reason,
                )
            fates.left.extend(d for d, _, _ in aside)
            return
        try:
            yield from io(self.processor.dispatcher.dispatch, [letter for _, letter, _ in aside])
        except _FATAL:
            raise
        except Exception as exc:  # noqa: BLE001 - not sent: held, set aside next round
            metrics.count_dispatch_failure(self.consumer, exc)
            _log.warning(
                "consumer %s: dispatching %d dead letter(s) failed (%s: %s); held for the "
                "next round",
                self.consumer,
                len(aside),
                type(exc).__name__,
                format_error(exc),
            )
            fates.kept.extend(d for d, _, _ in aside)
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
        fates.done.extend(d for d, _, _ in aside)
        fates.stats.set_aside += len(aside)
        metrics.count_deliveries(self.consumer, self.broker.kind, "set_aside", len(aside))

    def _batch(self, work: list[tuple[Delivery, Message]], fates: _Fates) -> Steps[None]:
        try:
            messages = [m for _, m in work]
            results = yield from io(self.processor.process_batch, messages, self.handler)
        except _MESSAGE_ERRORS:  # one message's own failure: one by one, only it is left
            yield from self._single(work, self.handler, fates)
            return
        except _FATAL:
            raise
        except Exception as exc:  # noqa: BLE001 - an outage: held, run again next round
            self._hold(work, fates.kept, exc)
            return
        for (delivery, _), result in zip(work, results, strict=True):
            fates.processed(delivery, result.outcome)

    def _single(
        self, work: list[tuple[Delivery, Message]], handler: Handler, fates: _Fates
    ) -> Steps[None]:
        for index, (delivery, message) in enumerate(work):
            try:
                yield from self._one(delivery, message, handler, fates)
            except _FATAL:
                raise
            except Exception as exc:  # noqa: BLE001 - an outage: hold it and the rest
                self._hold(work[index:], fates.kept, exc)
                return

    def _one(
        self, delivery: Delivery, message: Message, handler: Handler, fates: _Fates
    ) -> Steps[bool]:
        """Process one message: done (True), or given back when it fails on its own
        (``_MESSAGE_ERRORS``: False). Raises what an outage or a fatal error raises."""
        try:
            result = yield from io(self.processor.process, message, handler)
        except _MESSAGE_ERRORS as exc:
            _log.warning(
                "consumer %s: %s; given back for redelivery", self.consumer, format_error(exc)
            )
            fates.left.append(delivery)
            return False
        fates.processed(delivery, result.outcome)
        return True

    def _hold(
        self,
        work: Sequence[tuple[Delivery, Message]],
        kept: list[Delivery],
        exc: Exception | None,
    ) -> None:
        if exc is not None:
            _log.warning(
                "consumer %s: processing %d message(s) stopped (%s: %s); held for the next "
                "round (an outage is never counted against a message)",
                self.consumer,
                len(work),
                type(exc).__name__,
                format_error(exc),
            )
        kept.extend(d for d, _ in work)

    # ------------------------------------------------------------------ dead letters

    def _malformed_letter(
        self, delivery: Delivery, exc: MalformedDelivery
    ) -> tuple[OutgoingMessage, str]:
        """The dead letter of a delivery that is not a message: named by its content
        (the whole delivery, even when the letter carries only its size and digest),
        bounded by the processor's rule (:func:`~dedupstore.outbox.bounded_letter`)."""
        shown = {"body": shown_body(delivery.body), "headers": headers_of(delivery)}
        digest = hashlib.sha256(canonical.dumps(shown).encode()).hexdigest()
        letter_id = outgoing_id(self.consumer, MALFORMED_ENTITY, digest, SET_ASIDE_POSITION)
        reason = exc.reason
        if len(reason) > LETTER_ERROR_CHARS:
            reason = f"{reason[:LETTER_ERROR_CHARS]}... ({len(reason)} characters)"
        error = {"type": "dedupstore.errors.MalformedDelivery", "text": reason}
        body = {"delivery": shown, "error": error, "consumer": self.consumer}
        parts = (("delivery", "body"), ("delivery", "headers"))
        letter, _ = bounded_letter(body, parts, self.processor.letter_bytes())
        # without dead_letters the letter is never dispatched (see _set_aside)
        return OutgoingMessage(letter_id, self.processor.dead_letters or "", letter), reason

    # ------------------------------------------------------------------ metrics

    #: Seconds between two reads of the broker's pending count (for the gauge).
    pending_every = 5.0

    def _report_pending(self) -> Steps[None]:
        if not metrics.available():
            return
        now = time.monotonic()
        if now - self._pending_read < self.pending_every:
            return
        self._pending_read = now
        try:
            value = yield from io(self.broker.pending)
        except Exception as exc:  # noqa: BLE001 - only a metric: never fail the round
            _log.debug("consumer %s: reading the pending count failed: %s", self.consumer, exc)
            return
        metrics.set_pending(self.consumer, self.broker.kind, value)


class Consumer(_Loop):
    """Reads a :class:`~dedupstore.consumers.Broker` and processes exactly once.

    Guarantees: a delivery is acknowledged only once it is done, i.e. the
    processor returned for it (``processed``, ``duplicate``, ``redispatched``,
    ``dead_lettered``) or it was set aside (its dead letter dispatched).

    **Outages are never poison.** A delivery that an outage stopped
    (``StoreUnavailable`` from a store or the dispatcher, a conflict that
    persisted, any error that is not the message's own) is *held*: this consumer
    keeps it (:meth:`Broker.keep <dedupstore.consumers.Broker.keep>` keeps its lease)
    and runs it first in its next round, after a jittered exponential backoff (at
    most ``max_backoff`` seconds), in order before later deliveries of its entity.
    It is never given back to the broker, so no broker delivery count rises with an
    outage, however long.

    **A message that kills its consumer is set aside.** A delivery whose broker
    count is above 1 was held by a consumer that died (or lost its lease). Before
    running it, the loop records the run in the message's entity
    (:meth:`OutboxProcessor.begin_attempt
    <dedupstore.outbox.OutboxProcessor.begin_attempt>`) and runs it alone, with no
    other handler running in this process, so a crash counts only against the
    message that was running. Once a message's recorded runs would exceed
    ``max_deliveries``, it is handed to the processor with a handler that refuses
    it: a duplicate if an earlier run applied it, else dead-lettered by the
    processor exactly once (recorded in its entity, so ``redrive`` applies it once)
    without running the handler that killed the earlier consumers. A crash with a
    batch merely in flight, or an outage, counts nothing. Brokers that do not count
    deliveries (Kafka) isolate nothing: ``max_deliveries`` does not apply there.

    A delivery that ``rules`` cannot turn into a message is set aside once: one
    dead letter to the processor's ``dead_letters`` with a deterministic id (a
    redelivery dispatches the same id and bytes), then acknowledged.
    ``mode="batch"`` runs ``process_batch`` over the round (a batch with a message
    that fails on its own, a handler that raises or an entity that cannot hold it,
    without ``dead_letters``, is run message by message, so only that message is
    given back, with ``nack``); ``"single"`` runs ``process`` per message.
    :meth:`stop` (and SIGTERM/SIGINT under :meth:`run`) ends the loop after the
    round in flight is processed and acknowledged; what is held then is given back.
    The loop's rounds are written once (:mod:`dedupstore.steps`):
    :class:`dedupstore.aio.AsyncConsumer` runs the same on the event loop.
    """

    broker: Broker
    processor: OutboxProcessor

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
        wait: float | str | timedelta = 1.0,
        max_backoff: float | str | timedelta = 30.0,
    ) -> None:
        """``wait`` and ``max_backoff``: seconds, or durations such as ``"1s"`` or
        ``"250ms"`` (as URLs take them). Raises ``ConfigurationError`` (no I/O) for a
        bad option, an async handler, or ``max_deliveries`` without ``dead_letters`` on
        the processor."""
        super().__init__(
            broker,
            processor,
            handler,
            rules=rules,
            batch_size=batch_size,
            mode=mode,
            max_deliveries=max_deliveries,
            wait=wait,
            max_backoff=max_backoff,
        )

    def run(self, *, install_signal_handlers: bool = True) -> ConsumeStats:
        """Run rounds until :meth:`stop`; return the totals.

        With ``install_signal_handlers`` (in the main thread), SIGTERM and SIGINT
        call :meth:`stop` (the previous handlers are restored on return). Between
        rounds that left something for redelivery it sleeps a bounded backoff
        (:meth:`stop` cuts it short). A broker that cannot answer
        (``StoreUnavailable``) is retried the same way; ``ConfigurationError``,
        ``ConsistencyError`` and ``StoreClosed`` end the loop (raised); ``totals``
        then holds what the run did, the round that failed included. What an outage
        left held when the loop ends is given back (:meth:`release`).
        """
        said = f"consumer {self.consumer}: %s received; stopping after the batch in flight"
        with stopping_on_signals(self.stop if install_signal_handlers else None, said):
            return run(self._rounds())

    def release(self) -> None:
        """Give back to the broker what an outage left held (:meth:`run` does on
        return); a broker that cannot answer redelivers them anyway (after the lease)."""
        run(self._release())

    def _pause(self) -> None:
        self._stopping.wait(self._pause_seconds())

    def run_once(self) -> ConsumeStats:
        """One round: take again what an outage held, reclaim, fetch (at most
        ``batch_size`` together); set aside the malformed, run alone (counted) what a
        dead consumer held, process the rest; ack what is done, nack what failed on its
        own, hold what an outage stopped for the next round.

        Raises what the broker raises from ``reclaim``, ``fetch``, ``ack`` or
        ``nack`` (what was not acknowledged is redelivered), and the errors no retry
        fixes (``ConfigurationError``, ``ConsistencyError``, ``StoreClosed``) after
        leaving the round for redelivery.
        """
        return run(self._run_once())
