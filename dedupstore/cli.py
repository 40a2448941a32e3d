"""The ``dedupstore`` command.

Exit codes: 0 success; 1 ``has`` found an id not processed, or the demo saw a
message processed other than once; 2 bad input or configuration; 3 the store could
not answer. Expected errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from dedupstore import __version__, open_store
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    InvalidMessageId,
    StoreUnavailable,
)
from dedupstore.store import DeduplicationStore
from dedupstore.urls import parse_duration

__all__ = ["CHECK_ENDPOINT", "main"]

#: Endpoint reserved for the probe records of ``dedupstore check``.
CHECK_ENDPOINT = "__dedupstore_check__"

T = TypeVar("T")
_PASSWORD_IN_URL = re.compile(r"(://[^/\s:@]*:)[^@\s/]*@")


def _retention(value: str) -> timedelta | None:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedupstore",
        description="Exactly-once message processing: inspect and use deduplication stores.",
    )
    parser.add_argument("--version", action="version", version=f"dedupstore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_store(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "url", metavar="URL", help="store URL, or 'config' for the configured store"
        )
        sub.add_argument("--endpoint", help="consumer name (default: 'default' or configured)")
        return sub

    with_store("check", "open the store, check its consistency, round-trip a probe id")
    add = with_store("add", "record message ids; prints 'added' or 'duplicate' for each")
    add.add_argument("ids", metavar="ID", nargs="+")
    add.add_argument("--retention", type=_retention, help="e.g. 30d, 12h, 900s")
    has = with_store("has", "tell whether message ids were processed (exit 1 if any was not)")
    has.add_argument("ids", metavar="ID", nargs="+")
    with_store("purge", "delete this endpoint's expired records")
    commands.add_parser("config", help="show the resolved configuration (secrets masked)")
    demo = commands.add_parser(
        "demo", help="run the main job: an at-least-once stream processed exactly once"
    )
    demo.add_argument("--url", help="store URL (default: the configured or embedded store)")
    demo.add_argument("--messages", type=int, default=2000, help="distinct messages")
    demo.add_argument("--threads", type=int, default=4, help="concurrent consumers")
    demo.add_argument("--seed", type=int, default=None, help="random seed")
    return parser


def _open(url: str | None, endpoint: str | None, **options: Any) -> DeduplicationStore:
    if endpoint is not None:
        options["endpoint"] = endpoint
    return open_store(None if url in (None, "config") else url, **options)


def _timed(action: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = action()
    return result, (time.perf_counter() - started) * 1000


def _check(args: argparse.Namespace) -> int:
    store, open_ms = _timed(
        lambda: _open(args.url, args.endpoint or CHECK_ENDPOINT, retention=timedelta(minutes=10))
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
            return 3
        warnings = store.health_warnings()
        for warning in warnings:
            print(f"warning:   {warning}")
        print("ok" + (f" with {len(warnings)} warning(s)" if warnings else ""))
    return 0


def _add(args: argparse.Namespace) -> int:
    options = {} if args.retention is None else {"retention": args.retention}
    with _open(args.url, args.endpoint, **options) as store:
        ids = list(dict.fromkeys(args.ids))
        recorded = store.add_many(ids)
        for mid in ids:
            print(f"{mid}\t{'added' if mid in recorded else 'duplicate'}")
    return 0


def _has(args: argparse.Namespace) -> int:
    with _open(args.url, args.endpoint) as store:
        ids = list(dict.fromkeys(args.ids))
        found = store.processed_among(ids)
        for mid in ids:
            print(f"{mid}\t{'processed' if mid in found else 'not processed'}")
    return 0 if len(found) == len(ids) else 1


def _purge(args: argparse.Namespace) -> int:
    with _open(args.url, args.endpoint) as store:
        print(f"purged {store.purge_expired()} expired record(s) of endpoint {store.endpoint!r}")
    return 0


def _config(_: argparse.Namespace) -> int:
    from dedupstore.config import resolve_config

    shown = resolve_config().masked()
    shown["options"] = {
        k: (str(v) if isinstance(v, timedelta) else v) for k, v in shown["options"].items()
    }
    print(json.dumps(shown, indent=2, default=str))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from dedupstore.demo import run_demo

    if args.messages < 1 or args.threads < 1:
        raise ConfigurationError("--messages and --threads must be at least 1")
    endpoint = f"demo-{uuid.uuid4().hex[:12]}"
    with _open(args.url, endpoint) as store:
        report = run_demo(
            store, messages=args.messages, threads=args.threads, seed=args.seed, out=sys.stdout
        )
    return 0 if report.exactly_once else 1


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "check": _check,
    "add": _add,
    "has": _has,
    "purge": _purge,
    "config": _config,
    "demo": _demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ConfigurationError, ConsistencyError, InvalidMessageId) as exc:
        print(f"dedupstore: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:
        print(f"dedupstore: store unavailable: {_one_line(exc)}", file=sys.stderr)
        return 3
    except DedupStoreError as exc:
        print(f"dedupstore: error: {_one_line(exc)}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


def _one_line(exc: BaseException) -> str:
    """The error as one line, with any password in a URL masked (defence in depth)."""
    return _PASSWORD_IN_URL.sub(r"\1***@", " ".join(str(exc).split()))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
