"""``dedupstore dead-letters list | show | redrive | purge`` (see :func:`add_parser`).

The letters are read back from the destination they were dispatched to (``--dispatcher``
and ``--dead-letters``, as ``dedupstore consume`` takes them) through
:class:`~dedupstore.dead_letters.DeadLetterQueue`: Redis Streams, the SQLite table
queue and RabbitMQ queues can be read back; any other dispatcher is refused before
any I/O. ``redrive`` runs each letter through
:meth:`~dedupstore.outbox.OutboxProcessor.redrive` with the processor ``consume``
would build from the same arguments, and removes a letter only after its redrive
returned (a crash in between leaves it: redriving it again is a duplicate). ``purge``
discards letters through :meth:`~dedupstore.dead_letters.DeadLetterQueue.purge`: the
redrive token a letter keeps in token mode is deleted with it (``--tokens``), and a
letter that keeps one is refused without the token store unless ``--leave-tokens``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

from dedupstore.consumers import _command as consume_command
from dedupstore.dead_letters import DeadLetter, DeadLetterQueue, ReadBack, _unreadable
from dedupstore.errors import ConfigurationError
from dedupstore.ids import validate_message_id, validate_name
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from dedupstore.outbox import Handler, OutboxProcessor

__all__ = ["add_parser", "run"]

#: Letters redriven before the ones done are removed together (one read of a RabbitMQ
#: queue removes them all).
REMOVE_EVERY = 100


def add_parser(commands: Any) -> None:
    """Add the ``dead-letters`` command group to ``commands`` (argparse subparsers)."""
    group = commands.add_parser(
        "dead-letters",
        help="list, show, redrive or purge the dead letters of a destination",
        description="Read back the dead letters a processor or a consume loop dispatched "
        "(Redis Streams, the SQLite table queue, RabbitMQ), redrive them after a fix, or "
        "purge them.",
    )
    actions = group.add_subparsers(dest="letters_command", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "list", help="one line per letter: letter id, message id, entity, consumer, size, reason"
    )
    consume_command.add_dispatcher_arguments(listing, required=True)
    show = actions.add_parser("show", help="print one letter as JSON (what redrive takes)")
    show.add_argument("id", metavar="ID", help="the letter's id (see list)")
    consume_command.add_dispatcher_arguments(show, required=True)
    redrive = actions.add_parser(
        "redrive",
        help="process letters again with the (fixed) handler; remove each once redriven",
        description="Run each letter through the processor's redrive (exactly once: a "
        "letter redriven before is a duplicate), then remove it. With --all, letters of "
        "other consumers and of malformed deliveries are left in place and named on stderr.",
    )
    _which(redrive)
    consume_command.add_dispatcher_arguments(redrive, required=True)
    consume_command.add_processor_arguments(redrive)
    purge = actions.add_parser(
        "purge",
        help="remove letters for good, and their redrive tokens (needs --yes)",
        description="Remove letters for good. A letter set aside in token mode keeps a "
        "redrive token: give the token store (--tokens) to delete it with the letter; without "
        "it such a letter is refused (its token would be left forever) unless --leave-tokens.",
    )
    _which(purge)
    purge.add_argument("--yes", action="store_true", help="confirm: the letters are lost")
    purge.add_argument(
        "--tokens",
        metavar="URL",
        help="token mode: the token store (or 'config'); the redrive token of each purged "
        "letter is deleted from it",
    )
    purge.add_argument(
        "--leave-tokens",
        action="store_true",
        help="purge letters that keep a redrive token without deleting it (found later by "
        "'dedupstore tokens orphans')",
    )
    consume_command.add_dispatcher_arguments(purge, required=True)


def _which(sub: argparse.ArgumentParser) -> None:
    chosen = sub.add_mutually_exclusive_group(required=True)
    chosen.add_argument("id", metavar="ID", nargs="?", help="the letter's id (see list)")
    chosen.add_argument("--all", action="store_true", help="every letter of the destination")


def _readable(url: str) -> dict[str, Any]:
    """Refuse (no I/O) a dispatcher URL whose destinations cannot be read back; the
    options to open it with (``create=False`` where it could create a file or table)."""
    from dedupstore.registry import resolve

    parsed = StoreURL.parse(url)
    cls = resolve("dispatcher", parsed.scheme)
    if not issubclass(cls, ReadBack):
        raise _unreadable(f"{parsed.scheme}://")
    declared = set(cls.declared_options)
    if "create" in declared and not any(key == "create" for key, _ in parsed.query):
        return {"create": False}
    return {}


def _line(letter: DeadLetter) -> str:
    reason = " ".join(letter.reason.split())
    cells = [
        letter.id,
        letter.message_id or "-",
        letter.entity or "-",
        letter.consumer or "-",
        str(letter.size),
        reason[:200] + ("..." if len(reason) > 200 else ""),
    ]
    return "\t".join(cells)


def run(args: argparse.Namespace) -> int:
    """Run ``dedupstore dead-letters ACTION``; return the exit code (1: no such letter)."""
    from dedupstore import open_dispatcher

    validate_name(args.dead_letters, "dead-letter destination")
    chosen: str | None = getattr(args, "id", None)
    if chosen is not None:
        validate_message_id(chosen, "letter id")
    options = _readable(args.dispatcher)
    if args.letters_command == "purge" and not args.yes:
        raise ConfigurationError("purge removes dead letters for good: add --yes to confirm")
    if args.letters_command == "purge" and args.tokens is not None and args.leave_tokens:
        raise ConfigurationError(
            "--tokens deletes the letters' redrive tokens, --leave-tokens leaves them: give one"
        )
    if args.letters_command == "redrive":
        from dedupstore.outbox import OutboxProcessor

        consume_command.load_handler(args.handler)  # a bad handler is refused before any I/O
        opened: list[Any] = []
        try:
            # the processor's dispatcher is the letters' (never creating a file or table)
            processor, handler = consume_command.open_processor(args, opened, options)
            assert isinstance(processor, OutboxProcessor)  # (on_loop not asked)
            queue = DeadLetterQueue(processor.dispatcher, args.dead_letters)
            return _redrive(queue, processor, handler, chosen)
        finally:
            consume_command._close(opened)
    with open_dispatcher(args.dispatcher, **options) as dispatcher:
        queue = DeadLetterQueue(dispatcher, args.dead_letters)
        if args.letters_command == "list":
            print("letter\tmessage\tentity\tconsumer\tsize\treason")
            for letter in queue.list():
                print(_line(letter))
            return 0
        letters = queue.list() if chosen is None else _one(queue, chosen)
        if letters is None:
            return 1
        if args.letters_command == "show":
            print(json.dumps(letters[0].to_json(), indent=2, sort_keys=True, ensure_ascii=False))
            return 0
        from dedupstore._tokens_command import open_tokens

        tokens = None if args.tokens is None else open_tokens(args.tokens)
        try:
            purged = queue.purge(letters, tokens=tokens, leave_tokens=args.leave_tokens)
        finally:
            if tokens is not None:
                tokens.close()
        print(json.dumps(purged.to_json()))
        return 0


def _one(queue: DeadLetterQueue, letter_id: str) -> list[DeadLetter] | None:
    letter = queue.get(letter_id)
    if letter is None:
        print(f"dedupstore: no dead letter {letter_id!r} in {queue.destination!r}", file=sys.stderr)
        return None
    return [letter]


def _redrive(
    queue: DeadLetterQueue, processor: OutboxProcessor, handler: Handler, chosen: str | None
) -> int:
    letters = queue.list() if chosen is None else _one(queue, chosen)
    if letters is None:
        return 1
    outcomes: Counter[str] = Counter()
    skipped = 0
    done: list[DeadLetter] = []
    try:
        for letter in letters:
            if chosen is None and (
                letter.kind != "message" or letter.consumer != processor.consumer
            ):
                skipped += 1
                why = (
                    f"of consumer {letter.consumer!r}, not {processor.consumer!r}"
                    if letter.kind == "message"
                    else "too large to keep whole: it holds the original's size and digest "
                    "only; process the original again from its source, then purge it"
                    if letter.kind == "bounded"
                    else letter.reason
                )
                print(f"dedupstore: left dead letter {letter.id} ({why})", file=sys.stderr)
                continue
            result = processor.redrive(letter, handler)  # refuses a letter it cannot redrive
            done.append(letter)
            outcomes[result.outcome] += 1
            shown = {
                "letter": letter.id,
                "message": letter.message_id,
                "entity": letter.entity,
                "outcome": result.outcome,
            }
            if result.error is not None:
                shown["error"] = result.error
            print(json.dumps(shown, ensure_ascii=False))
            if len(done) >= REMOVE_EVERY:
                queue.delete(done)
                done = []
    except BaseException:
        if done:  # redriven: remove them, whatever stopped the rest (else a later redrive
            with contextlib.suppress(Exception):  # of them is a duplicate)
                queue.delete(done)
        raise
    if done:
        queue.delete(done)
    if chosen is None:
        totals = {"redriven": sum(outcomes.values()), "outcomes": dict(outcomes), "left": skipped}
        print(json.dumps(totals, sort_keys=True))
    return 0
