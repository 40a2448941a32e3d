"""CPU time of ``process_batch`` on the in-process backend, this tree against others.

The processor's Python CPU is what limits ``process_batch`` (the stores answer far
faster), and the machine is shared: wall-clock rates of two runs cannot be
compared. This measures process CPU time (``time.process_time``) of the same work
as :mod:`benchmarks.bench`'s ``batch 1000/inline`` outbox run (its ``_workload``
and ``_handler``, on ``memory://`` stores) for several source trees, each in its
own Python process with ``PYTHONPATH`` set to that tree, in alternating rounds;
it reports the median of each tree and the ratios between them.

Usage (a baseline tree made with ``git worktree add <dir> <commit>``)::

    python -m benchmarks.cpu_compare --tree base=<dir> [--tree other=<dir> ...]

The tree this file belongs to is always measured, as ``this``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

THIS_TREE = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Measured:
    """The CPU seconds of each round of one tree, and the messages per round."""

    tree: str
    seconds: list[float]
    messages: int

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        """Messages per CPU second (median round)."""
        return self.messages / self.median


def _child(messages: int, batch: int, cleanup: str) -> dict[str, object]:
    """One measurement in this process (whose ``PYTHONPATH`` is the measured tree)."""
    import random

    import dedupstore
    from benchmarks.bench import _handler, _workload
    from dedupstore import open_entity_store, open_store
    from dedupstore.outbox import InMemoryDispatcher, OutboxProcessor

    def run(count: int) -> float:
        url = f"memory://cpu-{uuid.uuid4().hex[:12]}"
        workload = _workload(count, random.Random(count))
        dispatcher = InMemoryDispatcher()
        with open_entity_store(url) as entities, open_store(url) as dedup:
            processor = OutboxProcessor(entities, dedup, dispatcher, cleanup=cleanup)  # type: ignore[arg-type]
            gc.collect()
            started = time.process_time()
            outcomes = [
                r.outcome
                for start in range(0, count, batch)
                for r in processor.process_batch(workload[start : start + batch], _handler)
            ]
            seconds = time.process_time() - started
        if outcomes.count("processed") != count or len(dispatcher.sent) != count:
            raise SystemExit("not every message was processed once")
        return seconds

    run(min(messages, 2 * batch))  # warm-up: imports, caches
    return {"seconds": run(messages), "dedupstore": dedupstore.__file__}


def _measure_once(tree: Path, messages: int, batch: int, cleanup: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, __file__, "--child", str(messages), "--batch", str(batch)]
    out = subprocess.run(
        [*command, "--cleanup", cleanup],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    where = Path(str(report["dedupstore"])).resolve()
    if not where.is_relative_to(tree.resolve()):
        raise SystemExit(f"the run for {tree} imported dedupstore from {where}")
    return float(report["seconds"])


def compare(
    trees: dict[str, Path],
    *,
    rounds: int = 7,
    messages: int = 20_000,
    batch: int = 1000,
    cleanup: str = "inline",
) -> dict[str, Measured]:
    """CPU seconds of each tree over ``rounds`` alternating rounds (order rotated)."""
    names = list(trees)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for number in range(rounds):
        order = names[number % len(names) :] + names[: number % len(names)]
        for name in order:
            seconds[name].append(_measure_once(trees[name], messages, batch, cleanup))
        print(
            f"round {number + 1}/{rounds}: "
            + ", ".join(f"{n} {seconds[n][-1]:.3f} s" for n in names),
            file=sys.stderr,
            flush=True,
        )
    return {name: Measured(name, seconds[name], messages) for name in names}


def render(results: dict[str, Measured]) -> str:
    """A Markdown table: median CPU seconds, messages per CPU second, ratios."""
    names = list(results)
    lines = [
        "| tree | median CPU s | messages / CPU s | "
        + " | ".join(f"x {n}" for n in names if n != "this")
        + " |",
        "|---|---:|---:|" + "---:|" * (len(names) - 1),
    ]
    for name in names:
        r = results[name]
        ratios = [f"{r.rate / results[o].rate:.2f}" for o in names if o != "this"]
        lines.append(f"| {name} | {r.median:.3f} | {r.rate:,.0f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="name=path of a tree")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--cleanup", choices=("inline", "deferred"), default="inline")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(args.child, args.batch, args.cleanup)))
        return 0
    trees = {"this": THIS_TREE}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or name in trees:
            parser.error(f"--tree takes a new name=path, got {item!r}")
        trees[name] = Path(path)
    results = compare(
        trees, rounds=args.rounds, messages=args.messages, batch=args.batch, cleanup=args.cleanup
    )
    print(
        f"process_batch of {args.batch}, cleanup {args.cleanup}, memory://, "
        f"{args.messages:,} messages per round, median of {args.rounds} rounds (process CPU time)"
    )
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
