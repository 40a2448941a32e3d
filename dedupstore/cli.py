"""The ``dedupstore`` command.

Exit codes: 0 success (``consume``: stopped by SIGTERM/SIGINT; ``tokens mint``: a dry run
too); 1 ``has`` found an id
not processed, ``entities show`` found no such entity, ``dead-letters show/redrive/purge``
no such letter, or the demo saw an invariant fail;
2 fix your configuration or input (``ConfigurationError``, ``InvalidMessageId``,
``ConsistencyError``, ``StoreClosed``);
3 retry later (the store could not answer: ``StoreUnavailable``, or a
``ConcurrencyConflict`` that persisted). Expected errors print one line, never a
traceback.

Only ``add`` (and ``check`` when the URL or configuration says ``create=true``) may
create a store: the commands that read or clean up open theirs with ``must_exist=True``,
and a missing file, table, database or container is "no such store" (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from dedupstore import __version__, open_entity_store, open_store, registry
from dedupstore import _dead_letters_command as dead_letters_command
from dedupstore import _tokens_command as tokens_command
from dedupstore.config import NotConfigured
from dedupstore.consumers import _command as consume_command
from dedupstore.consumers._command import _duration, _target
from dedupstore.entities import EntityStore
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    DedupStoreError,
    StoreUnavailable,
    format_error,
)
from dedupstore.ids import message_key, validate_ids, validate_message_id
from dedupstore.masking import MASK, mask_options
from dedupstore.options import format_duration, parse_duration
from dedupstore.stats import Backlog, outbox_backlog
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenCount, TokenStore
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from dedupstore.outbox import SweepResult
    from dedupstore.registry import Kind

__all__ = [
    "CHECK_ENDPOINT",
    "EXIT_CONFIGURATION",
    "EXIT_RETRY",
    "NEVER_CREATES",
    "Command",
    "SweepProgress",
    "int_range",
    "main",
]

#: Endpoint reserved for the probe records of ``dedupstore check``.
CHECK_ENDPOINT = "__dedupstore_check__"
#: Exit code: fix the configuration or the input.
EXIT_CONFIGURATION = 2
#: Exit code: the store could not answer; retry later.
EXIT_RETRY = 3

T = TypeVar("T")

#: The epilog of a command that never creates a store.
NEVER_CREATES = (
    "Never creates a store: a missing file, table, database or container is an error "
    "('no such store', exit 2)."
)
_AT_MOST_ONCE = (
    "Recording an id and then processing the message is at-most-once per crash: a "
    "crash between the two loses the message. For exactly-once, process messages with "
    "dedupstore.outbox.OutboxProcessor."
)


class Command(ABC):
    """A subcommand of ``dedupstore`` that plugs in: the registry's ``command`` kind.

    Registered as ``"package.module:Class"`` under the subcommand's name (the built-in
    table, :func:`dedupstore.registry.register` or the ``dedupstore.command`` entry-point group)
    and made with no arguments. The command line imports a command's module only when
    that command runs, or when it lists the commands (``dedupstore --help``): keep heavy
    imports inside :meth:`run`. Errors :meth:`run` raises (``DedupStoreError``) print
    one line and exit 2 or 3, as for every command.
    """

    #: True: the command parses its own arguments; :meth:`run` gets everything after
    #: its name, unparsed, as ``args.argv`` (its parser here only lists it).
    raw_arguments: ClassVar[bool] = False

    @abstractmethod
    def add_parser(self, commands: Any, name: str) -> argparse.ArgumentParser:
        """Add the subcommand ``name`` to ``commands`` (argparse subparsers); return it."""

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int:
        """Run with the parsed arguments; return the exit code."""


class _Unavailable(Command):
    """A command plugin that cannot load: listed with why; running it raises why."""

    def __init__(self, error: ConfigurationError) -> None:
        self.error = error

    def add_parser(self, commands: Any, name: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(
            name, help=f"(unavailable: {format_error(self.error)})", add_help=False
        )
        return parser

    def run(self, args: argparse.Namespace) -> int:
        raise self.error


def _retention(value: str) -> timedelta | None:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_range(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high``, else a usage error (exit 2)."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {number}")
        return number

    return parse


def _parser(plugins: Mapping[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedupstore",
        description="Exactly-once message processing: inspect and use deduplication stores.",
        epilog="Exit codes: 0 ok, 1 not processed / invariant failed, 2 fix the configuration "
        "or input, 3 retry later (store unavailable).",
    )
    parser.add_argument("--version", action="version", version=f"dedupstore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_store(name: str, help_text: str, epilog: str | None = None) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text, epilog=epilog)
        sub.add_argument(
            "url", metavar="URL", help="store URL, or 'config' for the configured store"
        )
        sub.add_argument(
            "--endpoint", help="consumer name (default: the configured one, else 'default')"
        )
        return sub

    def with_entity(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("ids", metavar="ID", nargs="+")
        sub.add_argument(
            "--entity",
            metavar="CID",
            help="the entity (correlation id) the messages belong to: use the key the "
            "OutboxProcessor records, message_key(CID, ID); without it, the ids as given, "
            "as a store used alone records them",
        )

    with_store(
        "check",
        "open the store, check its consistency, round-trip a probe id",
        epilog="Never creates a store unless the URL or the configuration says create=true.",
    )
    add = with_store(
        "add",
        "record message ids; prints 'added' or 'duplicate' for each argument",
        epilog=f"{_AT_MOST_ONCE} Creates the store if the backend's 'create' option says so "
        "(SQLite: by default).",
    )
    with_entity(add)
    add.add_argument("--retention", type=_retention, help="e.g. 30d, 12h, 1h30m, 900s")
    has = with_store(
        "has",
        "tell whether message ids were processed (exit 1 if any was not)",
        epilog=f"{NEVER_CREATES} Under deferred clean-up a processed id stays in its "
        "entity's outbox until the sweep moves it: give --entity and --entities to look "
        "there too.",
    )
    with_entity(has)
    has.add_argument(
        "--entities",
        metavar="URL",
        help="with --entity: the entity store (or 'config'); an id in the entity's outbox "
        "(awaiting dispatch or the sweep) is processed too",
    )
    with_store("purge", "delete this endpoint's expired records", epilog=NEVER_CREATES)
    stats = commands.add_parser(
        "stats",
        help="the outbox backlog of an entity store and the ids recorded for an endpoint",
        description="Scan the entity store's non-empty outboxes (entries awaiting dispatch, "
        "outgoing messages, ids awaiting the sweep, the oldest pending entry, the consumers "
        "recorded with them), list the endpoints holding records in the deduplication store "
        "and count the live ids of one: --endpoint, else the configured one, else the one "
        "consumer recorded with the entities, else the one endpoint holding records, else "
        "'default'. Without --entities and --store, both configured stores (the entity "
        "store only if the configuration names one); with either, what they name.",
        epilog=f"{NEVER_CREATES} Costs a scan of the non-empty outboxes, and a count: one "
        "statement on SQLite and PostgreSQL, a query on Cosmos DB, a SCAN of the database "
        "on Redis, a scan of the table on DynamoDB; with a token store, a count of its "
        "tokens per endpoint (the same kind of read).",
    )
    stats.add_argument("--entities", metavar="URL", help="entity store URL, or 'config'")
    stats.add_argument("--store", metavar="URL", help="deduplication store URL, or 'config'")
    stats.add_argument(
        "--tokens",
        metavar="URL",
        help="token store URL, or 'config': its tokens outstanding per receiving endpoint "
        "and the oldest (without --entities, --store and --tokens: the configured one, if "
        "the configuration names one)",
    )
    stats.add_argument(
        "--endpoint",
        help="consumer name (default: the configured one, else the one recorded or present)",
    )
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    commands.add_parser(
        "config",
        help="show the resolved configuration (secrets masked, paths resolved)",
        description="Show the store and entity store the configuration selects: URLs "
        "(relative paths resolved against the configuration file), options, source.",
    )
    entities = commands.add_parser(
        "entities", help="inspect entity stores and move dispatched ids (the sweep)"
    )
    entity_commands = entities.add_subparsers(
        dest="entity_command", required=True, metavar="ACTION"
    )
    entity_url = "entity store URL, or 'config' for the configured one"
    show = entity_commands.add_parser(
        "show",
        help="print one entity as JSON: state, outbox, version (exit 1 if it does not exist)",
        epilog=NEVER_CREATES,
    )
    show.add_argument("url", metavar="URL", help=entity_url)
    show.add_argument("entity_id", metavar="ID")
    pending = entity_commands.add_parser(
        "pending",
        help="count the entities whose outbox is not empty (scans a segment)",
        epilog=NEVER_CREATES,
    )
    pending.add_argument("url", metavar="URL", help=entity_url)
    pending.add_argument("--list", action="store_true", help="also print each id and its entries")
    sweep = entity_commands.add_parser(
        "sweep",
        help="move the ids of dispatched outbox entries into the deduplication store",
        epilog=NEVER_CREATES,
    )
    sweep.add_argument("url", metavar="URL", help=entity_url)
    sweep.add_argument(
        "--dedup", metavar="URL", default="config", help="deduplication store (default: config)"
    )
    sweep.add_argument(
        "--endpoint",
        help="consumer name (default: the configured one, else the one recorded with the "
        "entities; an entity of another consumer is refused)",
    )
    sweep.add_argument(
        "--tokens",
        metavar="URL",
        help="the token store of a consumer in token mode, or 'config' (its entries' tokens "
        "are deleted instead of their ids moved; an entity holding them is refused without "
        "it)",
    )
    for sub in (pending, sweep):
        sub.add_argument("--segment", type=int_range(0, 999_999), default=0)
        sub.add_argument("--segments", type=int_range(1, 1_000_000), default=1)
    sweep.add_argument(
        "--batch-ids",
        type=int_range(1, 1_000_000),
        default=1000,
        help="ids moved per add_many/save round (default: 1000)",
    )
    sweep.add_argument(
        "--progress",
        type=_duration,
        default=2.0,
        metavar="SECONDS",
        help="print the running totals to stderr at most this often, and a last line when "
        "any was printed (default: 2; 0: after every batch)",
    )
    sweep.add_argument("--quiet", action="store_true", help="print no progress lines")
    consume_command.add_parser(commands, int_range(1, 1_000_000))
    dead_letters_command.add_parser(commands)
    tokens_command.add_parser(commands)
    for name, command in plugins.items():
        command.add_parser(commands, name)
    return parser


def _replacing(
    url: str, options: dict[str, Any], replace: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """``url`` and ``options`` with ``replace`` (values not ``None``) set wherever they were."""
    replace = {k: v for k, v in replace.items() if v is not None}
    parsed = StoreURL.parse(url)
    if any(key in replace for key, _ in parsed.query):
        parsed = parsed.with_query([(k, v) for k, v in parsed.query if k not in replace])
    return parsed.text, {**options, **replace}


def _open(url: str | None, *, must_exist: bool = True, **replace: Any) -> DeduplicationStore:
    """Open the deduplication store at ``url`` ('config': the configured one).

    Options given here (those not ``None``) win over the URL's and the configuration's.
    ``must_exist`` (the default): never create the store ("no such store" instead).
    """
    target, options = _replacing(*_target(url), {**replace, "must_exist": must_exist or None})
    return open_store(target, **options)


def _open_tokens(url: str | None) -> contextlib.AbstractContextManager[TokenStore | None]:
    """The token store at ``url`` ('config': the configured one; never created, closed on
    exit), or None without one."""
    if url is None:
        return contextlib.nullcontext()
    return tokens_command.open_tokens(url)


def _open_entities(url: str) -> EntityStore:
    """Open an existing entity store (never creates one)."""
    target, options = _replacing(*_target(url, entities=True), {"must_exist": True})
    return open_entity_store(target, **options)


def _sets(url: str | None, option: str) -> bool:
    """Whether the URL's query or the configured options set ``option`` (to any value)."""
    target, options = _target(url)
    return option in options or any(key == option for key, _ in StoreURL.parse(target).query)


def _sweep_endpoint(
    given: str | None, dedup_url: str, entities: EntityStore, segment: int, segments: int
) -> str | None:
    """The endpoint a sweep moves ids to: ``--endpoint``, else the configured one (None:
    let the store's options say), else the one consumer recorded on the segment's
    outboxes (one scan; ``ConfigurationError`` listing them when there are several)."""
    if given is not None or _sets(dedup_url, "endpoint"):
        return given
    from dedupstore.outbox import recorded_consumer

    backlog = outbox_backlog(entities, segment=segment, segments=segments)
    return recorded_consumer(backlog.consumers, "--endpoint")


def _keys(args: argparse.Namespace) -> dict[str, str]:
    """Each ID argument -> the id to look up: itself, or ``message_key(--entity, ID)``.

    Validates the ids and the entity before any I/O (``InvalidMessageId``).
    """
    ids = validate_ids(args.ids)
    if args.entity is None:
        return {mid: mid for mid in ids}
    entity = validate_message_id(args.entity, "entity id (--entity)")
    return {mid: message_key(entity, mid) for mid in ids}


def _timed(action: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = action()
    return result, (time.perf_counter() - started) * 1000


def _check(args: argparse.Namespace) -> int:
    must_exist = not _sets(args.url, "create")  # a health check must not make the store it checks
    store, open_ms = _timed(
        lambda: _open(
            args.url,
            must_exist=must_exist,
            endpoint=args.endpoint or CHECK_ENDPOINT,
            retention=timedelta(minutes=10),
        )
    )
    with store:
        print(f"store:     {type(store).__name__} {store.url}")
        print(f"open:      {open_ms:8.1f} ms (connection, consistency guard)")
        probe = f"probe-{uuid.uuid4()}"
        added, add_ms = _timed(lambda: store.add(probe))
        seen, has_ms = _timed(lambda: store.has_been_processed(probe))
        again, re_ms = _timed(lambda: store.add(probe))
        print(f"add:       {add_ms:8.1f} ms")
        print(f"read:      {has_ms:8.1f} ms")
        print(f"re-add:    {re_ms:8.1f} ms")
        if not (added and seen and not again):
            print(
                f"dedupstore: error: probe round trip failed (add={added}, read={seen}, "
                f"re-add={again}): the store is not behaving as a deduplication store",
                file=sys.stderr,
            )
            return EXIT_CONFIGURATION  # retrying would not make it one
        warnings = store.health_warnings()
        for warning in warnings:
            print(f"warning:   {warning}")
        print("ok" + (f" with {len(warnings)} warning(s)" if warnings else ""))
    return 0


def _add(args: argparse.Namespace) -> int:
    keys = _keys(args)
    with _open(
        args.url, must_exist=False, endpoint=args.endpoint, retention=args.retention
    ) as store:
        recorded = store.add_many(keys[mid] for mid in args.ids)
        for mid in args.ids:
            print(f"{mid}\t{'added' if keys[mid] in recorded else 'duplicate'}")
            recorded.discard(keys[mid])  # a repeated argument is a duplicate of the first
    return 0


def _has(args: argparse.Namespace) -> int:
    keys = _keys(args)
    if args.entities is not None and args.entity is None:
        raise ConfigurationError("--entities needs --entity (the entity whose outbox to read)")
    with _open(args.url, endpoint=args.endpoint) as store:
        if args.entities is None:
            found = store.processed_among(keys.values())
        else:
            from dedupstore.outbox import applied_among

            with _open_entities(args.entities) as entities:
                applied = applied_among(entities, store, [(args.entity, mid) for mid in keys])
            found = {keys[mid] for _, mid in applied}
        for mid in args.ids:
            print(f"{mid}\t{'processed' if keys[mid] in found else 'not processed'}")
    missing = not all(keys[mid] in found for mid in args.ids)
    if missing and args.entity is not None and args.entities is None:
        print(
            "dedupstore: note: only the deduplication store was read; under deferred clean-up "
            "a processed id waits in its entity's outbox until the sweep: add --entities URL",
            file=sys.stderr,
        )
    return 1 if missing else 0


def _purge(args: argparse.Namespace) -> int:
    with _open(args.url, endpoint=args.endpoint) as store:
        print(f"purged {store.purge_expired()} expired record(s) of endpoint {store.endpoint!r}")
    return 0


def _describe(url: str, options: dict[str, Any], kind: Kind) -> tuple[str, dict[str, Any]]:
    """The backend's class name and its resolved URL-settable options, secrets masked."""
    parsed = StoreURL.parse(url)
    if parsed.scheme not in registry.known(kind):
        registry.resolve(kind, parsed.scheme)  # unknown: the ConfigurationError names the known
    try:
        cls: Any = registry.resolve(kind, parsed.scheme)
    except ConfigurationError as exc:  # a missing client library: show what the file says
        shown = mask_options({k: _plain(v) for k, v in options.items()})
        return f"not loaded ({format_error(exc)})", shown
    declared = cls.declared_options.resolve(cls.__name__, parsed, options)
    return cls.__name__, {
        name: (MASK if cls.declared_options[name].secret else _plain(value))
        for name, value in declared.items()
        if cls.declared_options[name].in_url
    }


def _config(_: argparse.Namespace) -> int:
    from dedupstore.config import resolve_config

    resolved = resolve_config()
    shown = resolved.masked()
    shown["backend"], shown["options"] = _describe(resolved.url, resolved.options, "store")
    others: tuple[tuple[str, Kind], ...] = (("entities", "entity_store"), ("tokens", "token_store"))
    for prefix, kind in others:
        try:
            other = resolve_config(entities=prefix == "entities", tokens=prefix == "tokens")
        except NotConfigured:
            shown[f"{prefix}_url"], shown[f"{prefix}_backend"] = None, "not configured"
            shown[f"{prefix}_options"] = {}
            continue
        shown[f"{prefix}_url"] = other.masked()["url"]
        shown[f"{prefix}_backend"], shown[f"{prefix}_options"] = _describe(
            other.url, other.options, kind
        )
        if other.source != resolved.source:
            shown[f"{prefix}_source"] = other.source
    print(json.dumps(shown, indent=2, default=str))
    return 0


def _entities(args: argparse.Namespace) -> int:
    if args.entity_command == "show":
        with _open_entities(args.url) as store:
            entity = store.load(args.entity_id)
            where = store.url
        if entity.version is None:
            print(f"dedupstore: entity {entity.id!r} does not exist in {where}", file=sys.stderr)
            return 1
        outbox = {
            mid: None if entry is None else [m.to_json() for m in entry]
            for mid, entry in entity.outbox.items()
        }
        shown = {"id": entity.id, "version": entity.version, "state": entity.state}
        print(json.dumps({**shown, "outbox": outbox}, indent=2, ensure_ascii=False, default=str))
        return 0
    segment, segments = args.segment, args.segments
    if segment >= segments:
        raise ConfigurationError(f"--segment must be below --segments ({segments}), got {segment}")
    if args.entity_command == "pending":
        count = entries = 0
        with _open_entities(args.url) as store:
            for entity in store.pending_outboxes(segment, segments):
                count += 1
                entries += len(entity.outbox)
                if args.list:
                    print(
                        f"{entity.id}\tpending={len(entity.pending)}\t"
                        f"dispatched={len(entity.dispatched)}"
                    )
        print(f"{count} entities with {entries} outbox entries (segment {segment} of {segments})")
        return 0
    from dedupstore.outbox import sweep

    report = None if args.quiet else SweepProgress(args.progress)
    with _open_entities(args.url) as store:
        endpoint = _sweep_endpoint(args.endpoint, args.dedup, store, segment, segments)
        with _open(args.dedup, endpoint=endpoint) as dedup, _open_tokens(args.tokens) as tokens:
            result = sweep(
                store,
                dedup,
                segment,
                segments,
                batch_ids=args.batch_ids,
                progress=report,
                tokens=tokens,
            )
    if report is not None:
        report.finish(result)
    print(json.dumps(dataclasses.asdict(result), indent=2))
    return 0 if result.ids_left == 0 else EXIT_RETRY


def _stats(args: argparse.Namespace) -> int:
    # Neither --entities nor --store: both configured stores; else what they name
    # (--endpoint alone names the configured store).
    explicit = args.entities is not None or args.store is not None or args.tokens is not None
    entities_url = args.entities if explicit else "config"
    store_url = args.store
    if store_url is None and (args.endpoint is not None or not explicit):
        store_url = "config"
    shown: dict[str, Any] = {"entities": None, "store": None, "tokens": None}
    notes: list[str] = []
    progress = _scan_progress if not args.json and sys.stderr.isatty() else None
    consumers: frozenset[str] = frozenset()
    if entities_url is not None:
        try:
            entities = _open_entities(entities_url)
        except NotConfigured as exc:
            if explicit:
                raise
            notes.append(f"no entity store: {format_error(exc)} (give --entities URL)")
        else:
            with entities:
                try:
                    backlog = outbox_backlog(entities, progress=progress)
                finally:
                    if progress is not None:
                        print("\r\033[K", end="", file=sys.stderr)  # erase the progress line
                consumers = backlog.consumers
                oldest = backlog.oldest_pending_at
                age = None if oldest is None else max(0.0, time.time() - oldest.timestamp())
                shown["entities"] = {
                    "backend": type(entities).__name__,
                    "url": entities.url,
                    **backlog.to_json(),
                    "oldest_pending_age_seconds": None if age is None else round(age, 3),
                }
    if store_url is not None:
        endpoint = args.endpoint
        chosen = endpoint is not None or _sets(store_url, "endpoint")
        if not chosen and len(consumers) == 1:
            (endpoint,), chosen = consumers, True
        store = _open(store_url, endpoint=endpoint)
        try:
            present = store.endpoints()
            if not chosen and present is not None and len(present) == 1:
                (only,) = present
                if only != store.endpoint:
                    store.close()
                    store = _open(store_url, endpoint=only)
            shown["store"] = {
                "backend": type(store).__name__,
                "url": store.url,
                "endpoint": store.endpoint,
                "ids": store.count(),
                "endpoints": None if present is None else sorted(present),
            }
        finally:
            store.close()
    tokens_url = args.tokens if explicit else _configured_tokens()
    if tokens_url is not None:
        with tokens_command.open_tokens(tokens_url) as tokens:
            counts = tokens.outstanding()
            shown["tokens"] = _token_stats(tokens, counts, time.time())
    if args.json:
        print(json.dumps(shown, indent=2, ensure_ascii=False))
        return 0
    _print_stats(shown)
    for note in notes:
        print(note)
    return 0


def _configured_tokens() -> str | None:
    """'config' when the configuration names a token store (``tokens_url``), else None."""
    from dedupstore.config import resolve_config

    try:
        resolved = resolve_config(tokens=True)
    except NotConfigured:
        return None
    return None if resolved.source == "embedded default" else "config"


def _token_stats(tokens: TokenStore, counts: dict[str, TokenCount], now: float) -> dict[str, Any]:
    """What ``stats`` shows of a token store: the tokens outstanding per receiving endpoint
    and the oldest's mint time and age (the minting client's clock)."""
    endpoints = {
        endpoint: {
            "outstanding": count.outstanding,
            "oldest_at": datetime.fromtimestamp(count.oldest, UTC).isoformat(),
            "oldest_age_seconds": round(max(0.0, now - count.oldest), 3),
        }
        for endpoint, count in sorted(counts.items())
    }
    oldest = min((count.oldest for count in counts.values()), default=None)
    return {
        "backend": type(tokens).__name__,
        "url": tokens.url,
        "outstanding": sum(count.outstanding for count in counts.values()),
        "oldest_age_seconds": None if oldest is None else round(max(0.0, now - oldest), 3),
        "endpoints": endpoints,
    }


def _scan_progress(backlog: Backlog) -> None:
    """Where the scan is, on one line of a terminal (erased when it ends)."""
    print(f"\rscanned {backlog.entities_scanned:,} entities", end="", file=sys.stderr)


def _print_stats(shown: dict[str, Any]) -> None:
    """``dedupstore stats`` for people: one line per figure."""
    rows: list[tuple[str, object]] = []
    ents = shown["entities"]
    if ents is not None:
        oldest = "none pending"
        if ents["oldest_pending_at"] is not None:
            age = format_duration(timedelta(seconds=int(ents["oldest_pending_age_seconds"])))
            oldest = f"{ents['oldest_pending_at']} ({age} ago)"
        rows += [
            ("entities:", f"{ents['backend']} {ents['url']}"),
            ("  scanned (outbox not empty)", f"{ents['entities_scanned']:,}"),
            ("  with entries pending", f"{ents['entities_pending']:,}"),
            ("  messages pending dispatch", f"{ents['messages_pending']:,}"),
            ("  outgoing messages pending", f"{ents['outgoing_pending']:,}"),
            ("  ids awaiting the sweep", f"{ents['ids_awaiting_sweep']:,}"),
            ("  oldest pending entry", oldest),
            ("  consumers recorded", ", ".join(ents["consumers"]) or "none"),
            ("  with token-mode entries", f"{ents['entities_tokened']:,}"),
        ]
    store = shown["store"]
    if store is not None:
        ids, present = store["ids"], store["endpoints"]
        rows += [
            ("store:", f"{store['backend']} {store['url']}"),
            (
                "  endpoints with records",
                "not listable on this backend" if present is None else ", ".join(present) or "none",
            ),
            ("  endpoint", store["endpoint"]),
            ("  live ids", "not countable on this backend" if ids is None else f"{ids:,}"),
        ]
    toks = shown.get("tokens")
    if toks is not None:
        rows += [
            ("tokens:", f"{toks['backend']} {toks['url']}"),
            ("  tokens outstanding", f"{toks['outstanding']:,}"),
        ]
        for endpoint, count in toks["endpoints"].items():
            age = format_duration(timedelta(seconds=int(count["oldest_age_seconds"])))
            rows.append(
                (
                    f"  endpoint {endpoint}",
                    f"{count['outstanding']:,} (oldest {count['oldest_at']}, {age} ago)",
                )
            )
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


class SweepProgress:
    """The progress lines of ``dedupstore entities sweep``, on stderr.

    Called with the running totals after each batch (``sweep(progress=...)``): prints
    a line when ``interval`` seconds passed since the start or the last line (every
    batch for 0); :meth:`finish` prints the totals once more if any line was printed,
    so a short sweep prints nothing here (its result is on stdout).
    """

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.last = clock()
        self.printed = 0

    def __call__(self, result: SweepResult) -> None:
        now = self.clock()
        if now - self.last >= self.interval:
            self._print("sweeping", result)
            self.last = now

    def finish(self, result: SweepResult) -> None:
        """The last line (the final totals), only if a progress line was printed."""
        if self.printed:
            self._print("swept", result)

    def _print(self, verb: str, result: SweepResult) -> None:
        self.printed += 1
        print(
            f"dedupstore: {verb} segment {result.segment} of {result.segments}: "
            f"{result.entities_scanned:,} entities scanned, {result.ids_moved:,} ids moved, "
            f"{result.conflicts_retried:,} conflicts retried, {result.ids_left:,} ids left, "
            f"{result.seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def _plain(value: object) -> object:
    """A value as ``dedupstore config`` shows it: durations as text ('30d', '1h30m')."""
    return format_duration(value) if isinstance(value, timedelta) else value


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "check": _check,
    "add": _add,
    "has": _has,
    "purge": _purge,
    "config": _config,
    "stats": _stats,
    "entities": _entities,
    "consume": consume_command.run,
    "dead-letters": dead_letters_command.run,
    "tokens": tokens_command.run,
}


def exit_code(exc: DedupStoreError) -> int:
    """The exit code for an error: 3 means retry later, 2 fix the configuration or input."""
    return EXIT_RETRY if isinstance(exc, StoreUnavailable | ConcurrencyConflict) else 2


def _plugins(arguments: Sequence[str]) -> dict[str, Command]:
    """The command plugins to load for ``arguments``: none for a built-in command, the
    one named, else (``--help``, ``--version``, no or an unknown command) all of them,
    those that cannot load listed as unavailable."""
    first = arguments[0] if arguments else ""
    if first in _COMMANDS:
        return {}
    names = registry.known("command")
    if first in names:
        return {first: registry.resolve("command", first)()}
    plugins: dict[str, Command] = {}
    for name in names:
        if name in _COMMANDS:
            raise ConfigurationError(
                f"the command plugin {name!r} ({names[name].target}) has the name of a "
                "built-in command"
            )
        try:
            plugins[name] = registry.resolve("command", name)()
        except ConfigurationError as exc:
            plugins[name] = _Unavailable(exc)
    return plugins


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        plugins = _plugins(arguments)
        plugin = plugins.get(arguments[0]) if arguments else None
        if plugin is not None and plugin.raw_arguments:  # the rest belongs to the command
            return plugin.run(argparse.Namespace(command=arguments[0], argv=arguments[1:]))
        args = _parser(plugins).parse_args(arguments)
        if args.command in plugins:
            return plugins[args.command].run(args)
        return _COMMANDS[args.command](args)
    except DedupStoreError as exc:
        code = exit_code(exc)
        label = "store unavailable (retry later)" if code == EXIT_RETRY else "error"
        print(f"dedupstore: {label}: {format_error(exc)}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
