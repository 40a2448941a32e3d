"""``dedupstore consume``: a consume loop as a service (:func:`add_parser`, :func:`run`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tenacity import wait_random_exponential

from dedupstore.calls import pause_before
from dedupstore.client import DRIVER_LOGGERS
from dedupstore.consumers._loop import Consumer, ConsumeStats, stopping_on_signals
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError, StoreUnavailable, format_error
from dedupstore.options import seconds
from dedupstore.outbox import Handler, OutboxProcessor, check_handler
from dedupstore.outbox.handlers import is_async_callable
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from dedupstore.aio import AsyncBroker, AsyncConsumer, AsyncOutboxProcessor


__all__ = [
    "add_dispatcher_arguments",
    "add_parser",
    "add_processor_arguments",
    "load_handler",
    "open_processor",
    "run",
]

_log = logging.getLogger("dedupstore.consumers")


def add_parser(commands: Any, positive: Callable[[str], int]) -> None:
    """Add the ``consume`` subcommand to ``commands`` (argparse subparsers)."""
    sub = commands.add_parser(
        "consume",
        help="run a consume loop as a service: read a broker, process exactly once",
        description="Read a broker, run each message through the outbox processor with "
        "your handler, acknowledge only what is done. Stops after the batch in flight "
        "on SIGTERM or SIGINT (exit 0) and prints the totals as JSON.",
    )
    sub.add_argument(
        "--broker",
        required=True,
        metavar="URL",
        help="broker URL with its options, e.g. "
        "'redis://host:6379/0?destination=orders&group=billing' (Redis Streams: "
        "destination=D reads the stream the dispatcher writes for D, dedupout:D with its "
        "default key_prefix; stream=KEY reads the stream KEY as is; the start line names it)",
    )
    add_processor_arguments(sub)
    add_dispatcher_arguments(sub)
    sub.add_argument("--batch-size", type=positive, default=100, help="default: 100")
    sub.add_argument("--mode", choices=("batch", "single"), default="batch")
    sub.add_argument(
        "--max-deliveries",
        type=int,
        default=None,
        metavar="N",
        help="set a message aside after N deliveries (default: 5 with --dead-letters, "
        "else never; 0: never)",
    )
    sub.add_argument(
        "--wait",
        type=_duration,
        default=1.0,
        help="how long a fetch waits for messages: seconds or a duration such as 500ms "
        "(default 1s)",
    )
    sub.add_argument(
        "--start-timeout",
        type=_duration,
        default=START_TIMEOUT,
        help="how long to keep trying a store, dispatcher or broker that cannot be reached "
        "at start, then exit 3: seconds or a duration such as 2m (default 60s; 0: one try)",
    )
    sub.add_argument(
        "--asyncio",
        action="store_true",
        help="run the loop on asyncio (dedupstore.aio.AsyncConsumer; chosen by itself for an "
        "async def handler): RabbitMQ through aio-pika, Kafka through AIOConsumer, Redis "
        "Streams through redis.asyncio; the stores' calls in threads",
    )
    sub.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="logging level on stderr (default: INFO)",
    )


def add_processor_arguments(sub: argparse.ArgumentParser) -> None:
    """The processor's arguments (``consume``, ``dead-letters redrive``): ``--entities``,
    ``--store``, ``--handler``, ``--endpoint``, ``--cleanup``, ``--tokens``,
    ``--subscription``, ``--allow-memory``; see :func:`open_processor`."""
    sub.add_argument(
        "--entities", required=True, metavar="URL", help="entity store URL, or 'config'"
    )
    sub.add_argument(
        "--store", required=True, metavar="URL", help="deduplication store URL, or 'config'"
    )
    sub.add_argument(
        "--handler",
        required=True,
        metavar="MODULE:FUNCTION",
        help="the handler, handler(state, message) -> (new_state, sends)",
    )
    sub.add_argument(
        "--endpoint",
        help="consumer name (the store's endpoint; default: the configured one with "
        "--store config, else 'default')",
    )
    sub.add_argument("--cleanup", choices=("inline", "deferred"), default="inline")
    sub.add_argument(
        "--tokens",
        metavar="URL",
        help="token mode: the token store, or 'config' for the configured one (tokens_url; a "
        "message with a dedupstore-token header is deduplicated by its token, one without by "
        "--store)",
    )
    sub.add_argument(
        "--subscription",
        metavar="DEST=ENDPOINT[,ENDPOINT...]",
        action="append",
        default=[],
        help="token mode: the receiving endpoints of destination DEST, each of which gets a "
        "token for every message sent to DEST (repeat for each destination)",
    )
    sub.add_argument(
        "--allow-memory",
        action="store_true",
        help="allow memory:// stores (their data lives in this process only and is lost "
        "when it ends: for tests)",
    )


def add_dispatcher_arguments(sub: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--dispatcher`` (or ``--no-dispatcher``) and ``--dead-letters``; with ``required``
    (``dead-letters``) both ``--dispatcher`` and ``--dead-letters`` must be given."""
    dead_help = "destination of dead letters: poison, malformed and too-often-delivered messages"
    if required:
        sub.add_argument("--dispatcher", metavar="URL", required=True, help="the dispatcher")
        sub.add_argument("--dead-letters", metavar="DEST", required=True, help=dead_help)
        return
    sending = sub.add_mutually_exclusive_group(required=True)
    sending.add_argument("--dispatcher", metavar="URL", help="where outgoing messages go")
    sending.add_argument(
        "--no-dispatcher",
        action="store_true",
        help="for a handler that never sends: one that does stops the loop (exit 2; what it "
        "sent stays in the outbox, dispatched by a later run or sweep with a dispatcher)",
    )
    sub.add_argument("--dead-letters", metavar="DEST", help=dead_help)


def open_processor(
    args: argparse.Namespace,
    opened: list[Any],
    dispatcher_options: dict[str, Any] | None = None,
    *,
    on_loop: bool = False,
) -> tuple[OutboxProcessor | AsyncOutboxProcessor, Handler]:
    """The processor and the handler the arguments of :func:`add_processor_arguments` and
    :func:`add_dispatcher_arguments` name (the dispatcher opened with ``dispatcher_options``);
    what it opens is appended to ``opened`` (for the caller to close, last first). The
    handler is imported and ``memory://`` stores refused (without ``--allow-memory``)
    before any I/O. With ``on_loop`` (``consume``), an ``async def`` handler or
    ``--asyncio`` gives an :class:`~dedupstore.aio.AsyncOutboxProcessor` (on the same
    stores); otherwise an async handler is refused. Raises ``ConfigurationError``,
    ``StoreUnavailable``."""
    from dedupstore import open_dispatcher, open_entity_store, open_store
    from dedupstore.outbox import Dispatcher

    handler = load_handler(args.handler, awaitable=on_loop)
    kind: type[OutboxProcessor | AsyncOutboxProcessor] = OutboxProcessor
    if on_loop and (getattr(args, "asyncio", False) or is_async_callable(handler)):
        from dedupstore.aio import AsyncOutboxProcessor

        kind = AsyncOutboxProcessor
    if args.dead_letters and getattr(args, "no_dispatcher", False):
        raise ConfigurationError(
            "--dead-letters sends dead letters through the dispatcher: give --dispatcher URL"
        )
    entities_url, entities_options = _target(args.entities, entities=True)
    store_url, store_options = _target(args.store)
    endpoint = args.endpoint or store_options.pop("endpoint", None) or "default"
    store_options.pop("endpoint", None)
    for flag, url in (("--entities", entities_url), ("--store", store_url)):
        _in_memory(flag, url, args.allow_memory)
    if args.dispatcher:
        _in_memory("--dispatcher", args.dispatcher, args.allow_memory)
    entities = open_entity_store(entities_url, **entities_options)
    opened.append(entities)
    dedup = open_store(store_url, endpoint=endpoint, **store_options)
    opened.append(dedup)
    dispatcher: Dispatcher = _NoDispatcher()
    if args.dispatcher:
        dispatcher = open_dispatcher(args.dispatcher, **(dispatcher_options or {}))
        opened.append(dispatcher)
    tokens = None
    if getattr(args, "tokens", None):
        from dedupstore import open_token_store

        tokens_url, tokens_options = _target(args.tokens, tokens=True)
        _in_memory("--tokens", tokens_url, args.allow_memory)
        tokens = open_token_store(tokens_url, **tokens_options)
        opened.append(tokens)
    processor = kind(
        entities,
        dedup,
        dispatcher,
        cleanup=args.cleanup,
        dead_letters=args.dead_letters,
        tokens=tokens,
        subscriptions=parse_subscriptions(getattr(args, "subscription", [])),
    )
    return processor, handler


def parse_subscriptions(given: list[str]) -> dict[str, list[str]]:
    """``--subscription DEST=ENDPOINT[,ENDPOINT...]`` flags as destination -> endpoints;
    ``ConfigurationError`` naming a flag without ``=`` or without endpoints."""
    subscriptions: dict[str, list[str]] = {}
    for flag in given:
        destination, sep, endpoints = flag.partition("=")
        names = [e.strip() for e in endpoints.split(",") if e.strip()]
        if not sep or not destination or not names:
            raise ConfigurationError(
                f"--subscription {flag!r:.80}: expected DEST=ENDPOINT[,ENDPOINT...], e.g. "
                "orders=billing,shipping"
            )
        subscriptions.setdefault(destination, []).extend(names)
    return subscriptions


#: How long ``consume`` keeps trying what it cannot reach at start (``--start-timeout``).
START_TIMEOUT = 60.0

#: The pause between those tries: full jitter, 0.5 s doubling, at most 5 s.
_START_BACKOFF = wait_random_exponential(multiplier=0.5, max=5.0)


def _open_when_reachable(
    args: argparse.Namespace, opened: list[Any], stop: threading.Event, started: float
) -> tuple[OutboxProcessor | AsyncOutboxProcessor, Handler, Any] | None:
    """The processor, the handler and the broker, opened once all can be reached (the
    broker ``None`` for an async processor: the async loop opens its own).

    ``StoreUnavailable`` closes what did open and tries again after a backoff, for at
    most ``args.start_timeout`` seconds from ``started`` (then it is raised); ``stop``
    set (by a signal) returns ``None``. ``ConfigurationError`` is raised at once.
    """
    from dedupstore.consumers import open_broker

    attempt = 0
    while not stop.is_set():
        try:
            processor, handler = open_processor(args, opened, on_loop=True)
            broker = None
            if isinstance(processor, OutboxProcessor):
                broker = open_broker(args.broker)
                opened.append(broker)
            return processor, handler, broker
        except StoreUnavailable as exc:
            _close(opened)
            attempt += 1
            stop.wait(_start_pause(args, exc, attempt, started))
    return None


def _start_pause(
    args: argparse.Namespace, exc: StoreUnavailable, attempt: int, started: float
) -> float:
    """The pause before the next try to start after ``exc``; ``exc`` raised once
    ``--start-timeout`` is spent (one WARNING line per try)."""
    left = args.start_timeout - (time.monotonic() - started)
    pause = float(min(pause_before(attempt, _START_BACKOFF), left))
    if pause <= 0:
        raise exc
    _log.warning(
        "dedupstore consume: cannot start yet (%s); trying again in %.1f s "
        "(for %.0f s more: --start-timeout)",
        format_error(exc),
        pause,
        left,
    )
    return pause


async def _open_on_loop(
    args: argparse.Namespace, stop: threading.Event, started: float
) -> AsyncBroker | None:
    """The async loop's broker (``dedupstore.aio.open_broker``), tried again as
    :func:`_open_when_reachable` does; ``None`` when stopped while waiting."""
    from dedupstore.aio import open_broker as open_async_broker

    attempt = 0
    while not stop.is_set():
        try:
            return await open_async_broker(args.broker)
        except StoreUnavailable as exc:
            attempt += 1
            until = time.monotonic() + _start_pause(args, exc, attempt, started)
            while not stop.is_set() and time.monotonic() < until:
                await asyncio.sleep(min(0.1, until - time.monotonic()))
    return None


def _close(opened: list[Any]) -> None:
    """Close what was opened, last first, and forget it (every close is tried)."""
    clients = list(reversed(opened))
    opened.clear()
    failed: BaseException | None = None
    for client in clients:
        try:
            client.close()
        except Exception as exc:  # noqa: BLE001 - close the others; raised after
            failed = failed or exc
    if failed is not None:
        raise failed


def _duration(value: str) -> float:
    """An argparse ``type``: 0 or more seconds, ``1``, ``0.5``, ``"1s"``, ``"250ms"``."""
    try:
        return float(seconds(zero=True)(value))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds ({exc})") from None


def load_handler(spec: str, *, awaitable: bool = False) -> Callable[..., Any]:
    """Import ``module:function`` (the current directory first on the import path).

    Raises ``ConfigurationError`` naming what could not be found, a module that fails
    to import (whatever it raised: a ``SyntaxError``, an ``ImportError``, ...), and a
    handler that is not callable or (unless ``awaitable``) is an ``async def`` function.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"--handler must be 'module:function', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot import the handler's module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigurationError(f"module {module_name!r} has no {attribute!r}") from None
    if not callable(target):
        raise ConfigurationError(f"the handler {spec!r} is not callable")
    check_handler(target, awaitable=awaitable)
    handler: Callable[..., Any] = target
    return handler


class _NoDispatcher:
    """The dispatcher of ``--no-dispatcher``: a handler that sends is a configuration error."""

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        if messages:
            raise ConfigurationError(
                f"the handler sent {len(messages)} message(s) (to "
                f"{messages[0].destination!r}, ...) but --no-dispatcher was given; they "
                "stay in the outbox: run again with --dispatcher URL"
            )


def _target(
    url: str | None, entities: bool = False, tokens: bool = False
) -> tuple[str, dict[str, Any]]:
    """The URL and options to open: ``url`` as given, or the configured ones for 'config'
    (or ``None``): the store's, the entity store's (``entities``) or the token store's
    (``tokens``)."""
    if url is not None and url != "config":
        return url, {}
    from dedupstore.config import resolve_config

    resolved = resolve_config(entities=entities, tokens=tokens)
    return resolved.url, dict(resolved.options)


def _in_memory(flag: str, url: str, allowed: bool) -> None:
    """Refuse a ``memory://`` URL unless ``--allow-memory``: a service's data would
    vanish with its process (and exactly-once with it)."""
    if not allowed and StoreURL.parse(url).scheme == "memory":
        raise ConfigurationError(
            f"{flag} {url!r:.80} is a memory:// store: its data lives in this process only "
            "and is lost when it ends (then messages are processed again); give a durable "
            "store, or --allow-memory for a test"
        )


def _start_line(args: argparse.Namespace, broker: Any, consumer: Consumer | AsyncConsumer) -> str:
    """What the service reads and how it processes, as one line."""
    reads = [
        f"{what} {value}"
        for what in ("stream", "queue", "topic", "group", "consumer")
        if isinstance(value := getattr(broker, what, None), str)
    ]
    dispatcher = "none" if args.no_dispatcher else StoreURL.parse(args.dispatcher).masked
    return (
        f"dedupstore consume: broker {broker.kind} {StoreURL.parse(args.broker).masked}"
        f"{' (' + ', '.join(reads) + ')' if reads else ''}; endpoint {consumer.consumer}; "
        f"cleanup {args.cleanup}; mode {args.mode}; batch size {args.batch_size}; "
        f"dispatcher {dispatcher}; dead letters {args.dead_letters or 'none'}; "
        f"max deliveries {consumer.max_deliveries or 'never'}"
        f"{'' if isinstance(consumer, Consumer) else '; on asyncio'}"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``dedupstore consume``; return the exit code (0 after SIGTERM/SIGINT).

    Bad arguments are refused (exit 2) before any I/O; what cannot be reached at start
    is tried again for ``--start-timeout`` (then exit 3), a signal meanwhile exits 0.
    One start line on stderr, then the loop; the totals are printed (JSON, stdout)
    whenever the loop ran, also when it ended with an error (raised after the totals:
    the CLI prints it in one line).
    """

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level == "DEBUG":  # the drivers' own lines too
        for name in ("pika", "librdkafka", *DRIVER_LOGGERS):
            logging.getLogger(name).setLevel(logging.DEBUG)
    limit = args.max_deliveries
    if limit is None:
        limit = 5 if args.dead_letters else 0
    if limit < 0:
        raise ConfigurationError(f"--max-deliveries must be 0 or more, got {limit}")
    if limit and not args.dead_letters:
        raise ConfigurationError(
            f"--max-deliveries {limit} sets messages aside as dead letters: give "
            "--dead-letters DEST, or --max-deliveries 0"
        )
    opened: list[Any] = []
    consumer: Consumer | AsyncConsumer | None = None
    totals: ConsumeStats | None = None
    stop = threading.Event()

    def on_signal() -> None:  # one handler from start to end: no moment a signal kills
        stop.set()
        if consumer is not None:
            consumer.stop()

    said = "dedupstore consume: %s received; stopping (after the batch in flight)"
    with stopping_on_signals(on_signal, said):
        try:
            started = time.monotonic()
            reached = _open_when_reachable(args, opened, stop, started)
            if reached is None:  # stopped while waiting
                return 0
            processor, handler, broker = reached
            options: dict[str, Any] = {
                "batch_size": args.batch_size,
                "mode": args.mode,
                "max_deliveries": limit or None,
                "wait": args.wait,
            }
            if isinstance(processor, OutboxProcessor):
                consumer = Consumer(broker, processor, handler, **options)
                if stop.is_set():  # a signal before the consumer could take it
                    consumer.stop()
                print(_start_line(args, broker, consumer), file=sys.stderr, flush=True)
                totals = consumer.run(install_signal_handlers=False)
            else:
                from dedupstore.aio import AsyncConsumer

                async def on_loop() -> ConsumeStats | None:
                    """The broker opened on this loop (aio.open_broker), then the async
                    loop; the signal handlers above call stop(), which wakes it."""
                    nonlocal consumer
                    native = await _open_on_loop(args, stop, started)
                    if native is None:  # stopped while waiting
                        return None
                    try:
                        consumer = AsyncConsumer(native, processor, handler, **options)
                        if stop.is_set():
                            consumer.stop()
                        print(_start_line(args, native, consumer), file=sys.stderr, flush=True)
                        return await consumer.run(install_signal_handlers=False)
                    finally:
                        await native.close()

                totals = asyncio.run(on_loop())
        finally:
            try:
                _close(opened)
            finally:
                if consumer is not None:
                    shown = consumer.totals if totals is None else totals
                    print(json.dumps(dataclasses.asdict(shown), sort_keys=True), flush=True)
    return 0
