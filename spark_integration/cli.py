"""The Spark commands of ``dedupstore``: ``sweep`` and ``demo``.

They plug into the command line as the registry's ``command`` plugins
(``dedupstore.spark.cli:SweepCommand``, ``dedupstore.spark.cli:DemoCommand``), as
backends plug into the registry. Importing this module imports no pyspark: listing the
commands (``dedupstore --help``) does not need Spark, and :meth:`~SweepCommand.run`
imports the jobs when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from dedupstore import open_entity_store, open_store, open_token_store
from dedupstore.cli import EXIT_RETRY, NEVER_CREATES, Command, int_range

__all__ = ["DemoCommand", "SweepCommand"]


class SweepCommand(Command):
    """``dedupstore sweep``: :func:`~dedupstore.spark.sweep_outboxes`, one task per segment.

    Prints one row per segment and the totals; exit 0 when no id is left, 3 (retry
    later) when some are. Never creates a store: both must exist, checked before Spark
    starts.
    """

    def add_parser(self, commands: Any, name: str) -> argparse.ArgumentParser:
        """Add the sweep's subcommand ``name`` and its options."""
        sub: argparse.ArgumentParser = commands.add_parser(
            name,
            help="the Spark sweep: one task per segment moves dispatched ids into the store",
            epilog=NEVER_CREATES,
        )
        sub.add_argument("--entities", required=True, metavar="URL", help="entity store URL")
        sub.add_argument("--store", required=True, metavar="URL", help="dedup store URL")
        sub.add_argument(
            "--endpoint",
            help="consumer name (default: the store URL's, else the one recorded with the "
            "entities; an entity of another consumer is refused)",
        )
        sub.add_argument("--segments", type=int_range(1, 100_000), default=8)
        sub.add_argument(
            "--redispatch",
            metavar="URL",
            help="dispatch entries still pending first (outbox relay)",
        )
        sub.add_argument("--batch-ids", type=int_range(1, 1_000_000), default=1000)
        sub.add_argument(
            "--tokens",
            metavar="URL",
            help="the token store of a consumer in token mode (its entries' tokens are deleted)",
        )
        sub.add_argument(
            "--master", default="local[*]", help="Spark master (ignored under spark-submit)"
        )
        return sub

    def run(self, args: argparse.Namespace) -> int:
        """Sweep; print the rows and the totals; 0 if no id is left, else 3."""
        # before Spark starts (a task's error would reach us wrapped by Spark), and in each task
        existing = {"must_exist": True}
        open_entity_store(args.entities, **existing).close()
        open_store(
            args.store, **existing, **({"endpoint": args.endpoint} if args.endpoint else {})
        ).close()
        if args.tokens:
            open_token_store(args.tokens, **existing).close()
        from . import pipeline, session

        spark = session.local_session(args.master, "dedupstore-sweep")
        try:
            result = pipeline.sweep_outboxes(
                spark,
                args.entities,
                args.store,
                segments=args.segments,
                redispatch_url=args.redispatch,
                entities_options=existing,
                dedup_options=existing,
                batch_ids=args.batch_ids,
                endpoint=args.endpoint,
                tokens_url=args.tokens,
                tokens_options=existing if args.tokens else None,
            )
            rows = [row.asDict() for row in result.collect()]
        finally:
            spark.stop()
        columns = ["segment", "entities_scanned", "ids_moved", "conflicts_retried", "ids_left"]
        print("  ".join(f"{c:>17}" for c in [*columns, "seconds"]))
        for row in rows:
            print("  ".join(f"{row[c]:>17}" for c in columns) + f"  {row['seconds']:>17.2f}")
        totals = {c: sum(row[c] for row in rows) for c in columns[1:]}
        print("total: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in totals.items()))
        return 0 if totals["ids_left"] == 0 else EXIT_RETRY


class DemoCommand(Command):
    """``dedupstore demo``: the order pipeline job (:mod:`dedupstore.spark.order_pipeline`).

    Everything after ``demo`` is the job's own arguments (``dedupstore demo --help``
    lists them); the exit code is the job's (1: an invariant failed; 2: a usage error).
    """

    raw_arguments = True

    def add_parser(self, commands: Any, name: str) -> argparse.ArgumentParser:
        """List ``name`` among the commands (the job parses its own arguments)."""
        sub: argparse.ArgumentParser = commands.add_parser(
            name,
            help="run the main job: the order pipeline on Spark (options: dedupstore demo --help)",
            add_help=False,
        )
        return sub

    def run(self, args: argparse.Namespace) -> int:
        """Run the job with ``args.argv``; return its exit code."""
        from . import order_pipeline

        try:
            return int(order_pipeline.main(args.argv))
        except SystemExit as exc:  # the job's argument parser: --help (0) or a usage error (2)
            return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
