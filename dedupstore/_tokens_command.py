"""``dedupstore tokens orphans | delete | mint``: operating token mode (see :func:`add_parser`).

``orphans`` reports (never deletes) the tokens older than ``--older-than`` that no
outbox entry of the ``--entities`` stores and no letter of the ``--dead-letters``
destinations names (:func:`~dedupstore.token_admin.orphan_tokens`); ``delete`` deletes
named tokens once an operator has checked them (``--yes``); ``mint`` creates again the
tokens of consumed messages for a deliberate replay
(:func:`~dedupstore.token_admin.mint_again`): a dry run unless ``--yes``. Every argument
is checked before any I/O, and no command creates a store.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dedupstore.consumers._command import _target
from dedupstore.errors import ConfigurationError, InvalidMessageId
from dedupstore.ids import validate_ids, validate_message_id, validate_name
from dedupstore.options import parse_duration
from dedupstore.tokens import TOKEN_HEADER, TokenStore

__all__ = ["add_parser", "open_tokens", "run"]

_TOKENS_HELP = "the token store URL, or 'config' for the configured one (tokens_url)"


def add_parser(commands: Any) -> None:
    """Add the ``tokens`` command group to ``commands`` (argparse subparsers)."""
    group = commands.add_parser(
        "tokens",
        help="token mode: report orphan tokens, delete tokens, mint tokens again for a replay",
        description="Operate a token store (token mode): find tokens no message the library "
        "can see still needs, delete tokens an operator has checked, or create again the "
        "tokens of consumed messages to replay them on purpose.",
        epilog="Never creates a store: a missing file, table, database or container is an "
        "error ('no such store', exit 2).",
    )
    actions = group.add_subparsers(dest="tokens_command", required=True, metavar="ACTION")
    orphans = actions.add_parser(
        "orphans",
        help="report tokens older than a threshold that no outbox entry or dead letter names",
        description="List (one JSON line each, then the totals) the tokens minted more than "
        "--older-than ago that no outbox entry of the --entities stores and no letter of the "
        "--dead-letters destinations names. They are candidates, not garbage for sure: a "
        "message still in a broker's queue keeps its token too. Nothing is deleted.",
    )
    orphans.add_argument("--tokens", required=True, metavar="URL", help=_TOKENS_HELP)
    orphans.add_argument(
        "--entities",
        metavar="URL",
        action="append",
        default=[],
        help="an entity store whose outbox entries name tokens (senders and receivers; "
        "repeat for each, or 'config')",
    )
    orphans.add_argument(
        "--dispatcher",
        metavar="URL",
        help="with --dead-letters: the dispatcher the dead letters can be read back from",
    )
    orphans.add_argument(
        "--dead-letters",
        metavar="DEST",
        action="append",
        default=[],
        help="a dead-letter destination whose letters keep redrive tokens (repeat for each)",
    )
    orphans.add_argument(
        "--older-than",
        required=True,
        metavar="DURATION",
        help="only tokens minted longer ago than this, e.g. 7d, 12h, 3600 (seconds): longer "
        "than a message may wait in a queue",
    )
    orphans.add_argument("--endpoint", help="only the tokens of this receiving endpoint")
    delete = actions.add_parser(
        "delete",
        help="delete tokens by id (needs --yes): their messages are then dropped as duplicates",
    )
    delete.add_argument("ids", metavar="ID", nargs="+", help="token ids (see orphans)")
    delete.add_argument("--tokens", required=True, metavar="URL", help=_TOKENS_HELP)
    delete.add_argument(
        "--yes",
        action="store_true",
        help="confirm: a message whose token is deleted is dropped as a duplicate",
    )
    mint = actions.add_parser(
        "mint",
        help="create again the tokens of consumed messages, to replay them (dry run unless "
        "--yes); a replayed message is applied again",
        description="Create again the token that lets --endpoint process each named message "
        "once more. DANGER: a replayed message is applied again. Without --yes, print what "
        "would be minted and write nothing. A token that exists is refused (its message was "
        "not consumed).",
    )
    mint.add_argument("--tokens", required=True, metavar="URL", help=_TOKENS_HELP)
    mint.add_argument(
        "--endpoint", required=True, help="the receiving endpoint that is to process them again"
    )
    mint.add_argument(
        "--message",
        metavar="ID=NONCE",
        action="append",
        default=[],
        help="a message id and the nonce of its dedupstore-token header (repeat for each)",
    )
    mint.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help='JSON lines, one message each: {"id": ..., "nonce": ...} or {"id": ..., '
        '"headers": {"dedupstore-token": ...}} (\'-\': standard input)',
    )
    mint.add_argument(
        "--yes",
        action="store_true",
        help="confirm: mint the tokens (each named message will be applied again)",
    )


def open_tokens(url: str) -> TokenStore:
    """The token store at ``url`` ('config': the configured one), never created."""
    from dedupstore import open_token_store
    from dedupstore.cli import _replacing

    target, options = _replacing(*_target(url, tokens=True), {"must_exist": True})
    return open_token_store(target, **options)


def run(args: argparse.Namespace) -> int:
    """Run ``dedupstore tokens ACTION``; return the exit code."""
    if args.tokens_command == "orphans":
        return _orphans(args)
    if args.tokens_command == "delete":
        return _delete(args)
    return _mint(args)


def _orphans(args: argparse.Namespace) -> int:
    from dedupstore import open_dispatcher
    from dedupstore._dead_letters_command import _readable
    from dedupstore.cli import _open_entities
    from dedupstore.dead_letters import DeadLetterQueue
    from dedupstore.token_admin import orphan_tokens

    try:
        threshold = parse_duration(args.older_than)
    except ValueError as exc:
        raise ConfigurationError(f"--older-than: {exc}") from None
    if threshold is None:
        raise ConfigurationError("--older-than needs a duration, e.g. 7d")
    if args.endpoint is not None:
        validate_message_id(args.endpoint, "endpoint")
    for destination in args.dead_letters:
        validate_name(destination, "dead-letter destination")
    if bool(args.dead_letters) != bool(args.dispatcher):
        raise ConfigurationError(
            "--dead-letters and --dispatcher go together: the letters are read back "
            "through the dispatcher"
        )
    dispatcher_options = _readable(args.dispatcher) if args.dispatcher else {}
    opened: list[Any] = []
    try:
        tokens = open_tokens(args.tokens)
        opened.append(tokens)
        stores = []
        for url in args.entities:
            store = _open_entities(url)
            opened.append(store)
            stores.append(store)
        queues = []
        if args.dispatcher:
            dispatcher = open_dispatcher(args.dispatcher, **dispatcher_options)
            opened.append(dispatcher)
            queues = [DeadLetterQueue(dispatcher, d) for d in args.dead_letters]
        started = datetime.now(UTC).timestamp()
        found = 0
        for record in orphan_tokens(
            tokens,
            stores,
            older_than=threshold,
            letters=queues,
            endpoint=args.endpoint,
            now=started,
        ):
            found += 1
            shown = {
                "id": record.id,
                "endpoint": record.endpoint,
                "created": record.created,
                "created_at": datetime.fromtimestamp(record.created, UTC).isoformat(),
                "age_seconds": round(max(0.0, started - record.created), 3),
            }
            print(json.dumps(shown, ensure_ascii=False), flush=True)
        totals = {
            "orphans": found,
            "older_than_seconds": threshold.total_seconds(),
            "entity_stores": len(stores),
            "dead_letter_destinations": len(queues),
        }
        print(json.dumps(totals, sort_keys=True))
        if found and not stores:
            print(
                "dedupstore: no --entities given: tokens of entries in flight are reported "
                "too; give every entity store of the token store's senders and receivers",
                file=sys.stderr,
            )
        return 0
    finally:
        for client in reversed(opened):
            client.close()


def _delete(args: argparse.Namespace) -> int:
    ids = validate_ids(list(dict.fromkeys(args.ids)), "token id")
    if not args.yes:
        raise ConfigurationError(
            f"deleting {len(ids)} token(s) drops their messages as duplicates for good: "
            "check them (dedupstore tokens orphans), then add --yes to confirm"
        )
    with open_tokens(args.tokens) as tokens:
        present = tokens.present_among(ids)
        tokens.delete(ids)
    print(json.dumps({"asked": len(ids), "deleted": len(present)}))
    return 0


def _mint(args: argparse.Namespace) -> int:
    from dedupstore.token_admin import mint_again
    from dedupstore.tokens import validate_nonce

    endpoint = validate_message_id(args.endpoint, "endpoint")
    pairs: list[tuple[str, str]] = []
    for given in args.message:
        mid, sep, nonce = given.rpartition("=")
        if not sep or not mid:
            raise ConfigurationError(f"--message expects ID=NONCE, got {given!r:.80}")
        pairs.append((validate_message_id(mid), validate_nonce(nonce, mid)))
    if args.from_file is not None:
        pairs.extend(_read_messages(args.from_file))
    if not pairs:
        raise ConfigurationError("name the messages to mint again: --message ID=NONCE or --from")
    with open_tokens(args.tokens) as tokens:
        plan = mint_again(tokens, endpoint, pairs, confirm=args.yes)
    for replay in plan:
        shown = {
            "message": replay.message_id,
            "nonce": replay.nonce,
            "token": replay.token_id,
            "endpoint": replay.endpoint,
        }
        print(json.dumps(shown, ensure_ascii=False))
    print(json.dumps({"dry_run": not args.yes, "minted": len(plan) if args.yes else 0}))
    if not args.yes:
        print(
            f"dedupstore: dry run, nothing minted: add --yes to mint {len(plan)} token(s); "
            "each message replayed with its dedupstore-token header is applied again",
            file=sys.stderr,
        )
    return 0


def _read_messages(name: str) -> Iterator[tuple[str, str]]:
    """``(id, nonce)`` from JSON lines (``-``: stdin); a bad line raises naming it."""
    from dedupstore.tokens import validate_nonce

    if name == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(name).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"--from {name!r}: cannot read it ({exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--from {name!r} line {number}"
        try:
            item = json.loads(line)
        except ValueError:
            raise ConfigurationError(f"{where}: not JSON: {line[:80]!r}") from None
        if not isinstance(item, dict):
            raise ConfigurationError(f"{where}: expected a JSON object with id and nonce")
        headers = item.get("headers")
        nonce = item.get("nonce")
        if nonce is None and isinstance(headers, dict):
            nonce = headers.get(TOKEN_HEADER)
        try:
            mid = validate_message_id(item.get("id"))
            yield mid, validate_nonce(nonce, mid)
        except InvalidMessageId as exc:
            raise InvalidMessageId(f"{where}: {exc}") from None
