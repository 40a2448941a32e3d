"""``dedupstore consume``: a consume loop as a service (see :func:`add_parser`).

It opens the broker, the entity store, the deduplication store and the dispatcher
from URLs, imports the handler (``module:function``, the current directory first on
the import path), runs :meth:`~dedupstore.consumers.Consumer.run` until SIGTERM or
SIGINT, and prints the totals as JSON when it ends (exit 0). Bad arguments exit 2
before any I/O where possible; a store or broker that cannot be reached at start
exits 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError

if TYPE_CHECKING:
    from dedupstore.outbox import Handler, OutboxProcessor

__all__ = [
    "add_dispatcher_arguments",
    "add_parser",
    "add_processor_arguments",
    "load_handler",
    "open_processor",
    "run",
]


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
        "'redis://host:6379/0?destination=orders&group=billing'",
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
        "--wait", type=float, default=1.0, help="seconds a fetch waits for messages (default 1)"
    )
    sub.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="logging level on stderr (default: INFO)",
    )


def add_processor_arguments(sub: argparse.ArgumentParser) -> None:
    """The processor's arguments (``consume``, ``dead-letters redrive``): ``--entities``,
    ``--store``, ``--handler``, ``--endpoint``, ``--cleanup``; see :func:`open_processor`."""
    sub.add_argument("--entities", required=True, metavar="URL", help="entity store URL")
    sub.add_argument("--store", required=True, metavar="URL", help="deduplication store URL")
    sub.add_argument(
        "--handler",
        required=True,
        metavar="MODULE:FUNCTION",
        help="the handler, handler(state, message) -> (new_state, sends)",
    )
    sub.add_argument("--endpoint", default="default", help="consumer name (the store's endpoint)")
    sub.add_argument("--cleanup", choices=("inline", "deferred"), default="inline")


def add_dispatcher_arguments(sub: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--dispatcher`` and ``--dead-letters`` (``required`` for ``dead-letters``)."""
    sub.add_argument(
        "--dispatcher",
        metavar="URL",
        required=required,
        help="where outgoing messages go (without it, a handler that sends stops the loop)",
    )
    sub.add_argument(
        "--dead-letters",
        metavar="DEST",
        required=required,
        help="destination of dead letters: poison, malformed and too-often-delivered messages",
    )


def open_processor(
    args: argparse.Namespace, opened: list[Any], dispatcher_options: dict[str, Any] | None = None
) -> tuple[OutboxProcessor, Handler]:
    """The processor and the handler the arguments of :func:`add_processor_arguments` and
    :func:`add_dispatcher_arguments` name (the dispatcher opened with ``dispatcher_options``);
    what it opens is appended to ``opened`` (for the caller to close, last first). Raises
    ``ConfigurationError``, ``StoreUnavailable``."""
    from dedupstore import open_dispatcher, open_entity_store, open_store
    from dedupstore.outbox import Dispatcher, OutboxProcessor

    handler = load_handler(args.handler)
    entities = open_entity_store(args.entities)
    opened.append(entities)
    dedup = open_store(args.store, endpoint=args.endpoint)
    opened.append(dedup)
    dispatcher: Dispatcher = _NoDispatcher()
    if args.dispatcher:
        dispatcher = open_dispatcher(args.dispatcher, **(dispatcher_options or {}))
        opened.append(dispatcher)
    processor = OutboxProcessor(
        entities, dedup, dispatcher, cleanup=args.cleanup, dead_letters=args.dead_letters
    )
    return processor, handler


def load_handler(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (the current directory first on the import path).

    Raises ``ConfigurationError`` naming what could not be found.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"--handler must be 'module:function', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import the handler's module {module_name!r}: {exc}"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigurationError(f"module {module_name!r} has no {attribute!r}") from None
    if not callable(target):
        raise ConfigurationError(f"the handler {spec!r} is not callable")
    handler: Callable[..., Any] = target
    return handler


class _NoDispatcher:
    """The dispatcher without ``--dispatcher``: a handler that sends is a configuration error."""

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        if messages:
            raise ConfigurationError(
                f"the handler sent {len(messages)} message(s) (to "
                f"{messages[0].destination!r}, ...) but no --dispatcher was given"
            )


def run(args: argparse.Namespace) -> int:
    """Run ``dedupstore consume``; return the exit code (0 after SIGTERM/SIGINT)."""
    from dedupstore.consumers import Consumer, open_broker

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
    try:
        processor, handler = open_processor(args, opened)
        broker = open_broker(args.broker)
        opened.append(broker)
        consumer = Consumer(
            broker,
            processor,
            handler,
            batch_size=args.batch_size,
            mode=args.mode,
            max_deliveries=limit or None,
            wait=args.wait,
        )
        totals = consumer.run()
    finally:
        for client in reversed(opened):
            client.close()
    print(json.dumps(dataclasses.asdict(totals), sort_keys=True))
    return 0
