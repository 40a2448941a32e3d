"""The outbox of this tree against other source trees, each in a child process.

Each measurement runs in its own Python process with ``PYTHONPATH`` set to the
measured tree (so ``dedupstore`` is that tree's), on stores given by URL and
options, with the same workload and handler (defined here, on the API every
measured tree shares: ``open_store``, ``open_entity_store``, ``OutboxProcessor``,
``Message``, ``Send``, ``InMemoryDispatcher``); the trees are measured in
alternating rounds and each reports its median. :mod:`benchmarks.bench` uses it
(``make bench`` compares this tree with the baseline commit, extracted by
:func:`extracted`) for:

* ``process_batch`` on the in-process ``memory://`` stores, in process CPU time
  (``time.process_time``): the processor's Python CPU is what limits it there, and
  on a shared machine wall-clock rates of two runs cannot be compared;
* ``process_batch`` and ``process`` on the same Redis or PostgreSQL server, in
  wall-clock time (the server does I/O);
* on Redis, aws-lambda-powertools' ``idempotent_function`` in the same rounds
  (:func:`compare`'s ``others``; its run is ``Run(kind="powertools")``).

Alone, CPU time on ``memory://`` (a baseline tree made with
``git worktree add <dir> <commit>``, or ``--commit`` to extract one)::

    python -m benchmarks.cpu_compare --tree base=<dir> [--commit <rev> ...]

The tree this file belongs to is always measured, as ``this``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from dedupstore.outbox import Message, Send

THIS_TREE = Path(__file__).resolve().parent.parent
Clock = Literal["cpu", "wall"]


def workload(count: int, rng: random.Random) -> list[Message]:
    """``count`` fresh messages spread at random over ``count // 10`` fresh entities."""
    entities = [f"order-{uuid.uuid4()}" for _ in range(max(1, count // 10))]
    return [Message(str(uuid.uuid4()), rng.choice(entities), {"amount": i}) for i in range(count)]


def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """Pure and small: a counter and the last message id; one outgoing message."""
    count = int(state.get("count", 0)) + 1
    return {"count": count, "last": message.id}, [
        Send("shipping", {"order": message.correlation_id, "n": count})
    ]


@dataclass(frozen=True)
class Stores:
    """A fresh (entity store, deduplication store) pair, as URL and options (JSON)."""

    entities_url: str
    dedup_url: str
    entities_options: dict[str, Any] = field(default_factory=dict)
    dedup_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """One measurement: ``batch`` ``None`` is one ``process`` call per message.

    ``kind="powertools"``: aws-lambda-powertools' ``idempotent_function`` instead, one
    call per message, on the Redis of the stores' deduplication URL (wall clock)."""

    messages: int
    batch: int | None = 1000
    cleanup: str = "inline"
    clock: Clock = "cpu"
    kind: Literal["outbox", "powertools"] = "outbox"


@contextlib.contextmanager
def redis_requests(enabled: bool = True) -> Iterator[list[int]]:
    """Count the requests redis-py sends in this process (a pipeline or a script call is one)."""
    sent = [0]
    if not enabled:
        yield sent
        return
    from redis.connection import AbstractConnection

    original: Callable[..., None] = AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sent[0] += 1
        original(self, command, check_health)

    AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def _same_collector(processor_class: type) -> dict[str, Any]:
    """The options that give every tree's processor the same collector setting: trees
    whose processor relaxed the collector during a batch by default (before
    ``gc_threshold``) are compared with this one opted in (``gc_threshold``), so the
    comparison measures the algorithm, not a default. ``RESULTS.md`` says what the
    default (the collector left alone) costs."""
    import inspect

    if "gc_threshold" not in inspect.signature(processor_class).parameters:
        return {}
    from dedupstore.calls import GC_BATCH_THRESHOLD

    return {"gc_threshold": GC_BATCH_THRESHOLD}


def _child(spec: dict[str, Any]) -> dict[str, object]:
    """One measurement in this process (whose ``PYTHONPATH`` is the measured tree)."""
    import dedupstore
    from dedupstore import open_entity_store, open_store
    from dedupstore.outbox import InMemoryDispatcher, OutboxProcessor

    run = Run(**spec["run"])
    stores = Stores(**spec["stores"])
    if run.kind == "powertools":
        return {**_powertools(run, stores.dedup_url), "dedupstore": dedupstore.__file__}
    clock = time.process_time if run.clock == "cpu" else time.perf_counter
    with (
        open_entity_store(stores.entities_url, **stores.entities_options) as entities,
        open_store(stores.dedup_url, **stores.dedup_options) as dedup,
    ):

        def measure(count: int) -> float:
            messages = workload(count, random.Random(count))
            dispatcher = InMemoryDispatcher()
            processor = OutboxProcessor(
                entities,  # type: ignore[arg-type]
                dedup,  # type: ignore[arg-type]
                dispatcher,
                cleanup=run.cleanup,
                **_same_collector(OutboxProcessor),
            )
            gc.collect()
            started = clock()
            if run.batch is None:
                outcomes = [processor.process(m, handler).outcome for m in messages]
            else:
                outcomes = [
                    r.outcome
                    for start in range(0, count, run.batch)
                    for r in processor.process_batch(messages[start : start + run.batch], handler)
                ]
            seconds = clock() - started
            if outcomes.count("processed") != count or len(dispatcher.sent) != count:
                raise SystemExit("not every message was processed once")
            return seconds

        measure(min(run.messages, 2 * (run.batch or 100)))  # warm-up: imports, caches
        return {"seconds": measure(run.messages), "dedupstore": dedupstore.__file__}


def _powertools(run: Run, url: str) -> dict[str, float]:
    """``idempotent_function`` with ``CachePersistenceLayer`` on the Redis at ``url``, one
    call per message of :func:`workload`, its function running :func:`handler` (on an empty
    state: there is none to load); every setting at powertools' defaults but the key (the
    message id). Seconds, and redis-py requests per message."""
    try:
        import redis
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
            CachePersistenceLayer,
        )
        from aws_lambda_powertools.utilities.typing import LambdaContext
    except ImportError as exc:
        raise SystemExit(f"{exc}: pip install -e '.[dev]' (aws-lambda-powertools[redis])") from exc

    class Invocation(LambdaContext):
        """Outside Lambda: a fixed 60 s budget, so in-progress records expire like in one."""

        @staticmethod
        def get_remaining_time_in_millis() -> int:
            return 60_000

    client = redis.Redis.from_url(url.split("?")[0])
    with warnings.catch_warnings():
        # 3.x deprecates the name RedisCachePersistenceLayer; CachePersistenceLayer is the
        # same class (an alias), so it warns too.
        warnings.simplefilter("ignore", DeprecationWarning)
        layer = CachePersistenceLayer(client=cast(Any, client))
    config = IdempotencyConfig(event_key_jmespath="id")
    config.register_lambda_context(Invocation())
    sent: list[Send] = []

    def work(message: dict[str, Any]) -> dict[str, Any]:
        incoming = Message(message["id"], message["correlation_id"], message["body"])
        state, sends = handler({}, incoming)
        sent.extend(sends)
        return {"state": state, "sends": [s.body for s in sends]}

    handle: Callable[..., dict[str, Any]] = idempotent_function(
        data_keyword_argument="message", persistence_store=layer, config=config
    )(work)

    def measure(count: int) -> tuple[float, int]:
        payloads = [
            {"id": m.id, "correlation_id": m.correlation_id, "body": m.body}
            for m in workload(count, random.Random(count))
        ]
        sent.clear()
        gc.collect()
        with redis_requests() as requests:
            started = time.perf_counter()
            for payload in payloads:
                handle(message=payload)
            seconds = time.perf_counter() - started
        again = handle(message=payloads[0])  # a duplicate: answered from Redis, not run
        if len(sent) != count or again["sends"] != [sent[0].body]:
            raise SystemExit("powertools: a message was not handled exactly once")
        return seconds, requests[0]

    try:
        measure(min(run.messages, 200))  # warm-up: imports, caches
        seconds, requests = measure(run.messages)
    finally:
        client.close()
    return {"seconds": seconds, "requests": requests / run.messages}


def measure_once(tree: Path, run: Run, stores: Stores) -> dict[str, float]:
    """Seconds of ``run`` by ``tree``'s dedupstore, in a child process (and the child's
    other figures: ``requests`` per message of a powertools run)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    spec = {"run": run.__dict__, "stores": stores.__dict__}
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    where = Path(str(report.pop("dedupstore"))).resolve()
    if not where.is_relative_to(tree.resolve()):
        raise SystemExit(f"the run for {tree} imported dedupstore from {where}")
    return {name: float(value) for name, value in report.items()}


@dataclass(frozen=True)
class Measured:
    """The seconds of each round of one tree (or other run), and the messages per round;
    ``requests``: redis-py requests per message, where the run counted them."""

    tree: str
    seconds: list[float]
    messages: int
    requests: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        """Messages per second (median round)."""
        return self.messages / self.median

    @property
    def spread(self) -> str:
        """The slowest and fastest rounds, in messages per second."""
        return f"{self.messages / max(self.seconds):,.0f}-{self.messages / min(self.seconds):,.0f}"


def paired(this: Measured, other: Measured) -> float:
    """How many times faster ``this`` ran than ``other`` (messages per second): the
    median over the rounds of each round's ratio (the runs of a round ran back to back,
    so a slow spell of the shared machine that spans a round slows both and cancels out)."""
    return statistics.median(
        (this.messages / t) / (other.messages / o)
        for t, o in zip(this.seconds, other.seconds, strict=True)
    )


def _memory_stores() -> Stores:
    url = f"memory://cpu-{uuid.uuid4().hex[:12]}"
    return Stores(url, url)


def compare(
    trees: dict[str, Path],
    run: Run,
    stores: Callable[[], Stores] | None = None,
    *,
    rounds: int = 7,
    others: Mapping[str, Run] | None = None,
) -> dict[str, Measured]:
    """Seconds of each tree over ``rounds`` alternating rounds (order rotated).

    ``stores()`` gives each measurement fresh stores (default: ``memory://`` ones).
    ``others``: more runs measured in the same rounds (by this tree), by name.
    """
    fresh = stores or _memory_stores
    runs = {name: (tree, run) for name, tree in trees.items()}
    runs.update({name: (THIS_TREE, other) for name, other in (others or {}).items()})
    names = list(runs)
    reports: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for number in range(rounds):
        order = names[number % len(names) :] + names[: number % len(names)]
        for name in order:
            reports[name].append(measure_once(*runs[name], fresh()))
        print(
            f"   round {number + 1}/{rounds}: "
            + ", ".join(f"{n} {reports[n][-1]['seconds']:.3f} s" for n in names),
            file=sys.stderr,
            flush=True,
        )
    measured = {}
    for name in names:
        counted = [r["requests"] for r in reports[name] if "requests" in r]
        measured[name] = Measured(
            name,
            [r["seconds"] for r in reports[name]],
            runs[name][1].messages,
            statistics.median(counted) if counted else None,
        )
    return measured


@contextlib.contextmanager
def extracted(commit: str) -> Iterator[Path]:
    """The source tree of ``commit`` (``git archive | tar -x``) in a temporary directory."""
    git = ["git", "-C", str(THIS_TREE)]
    found = subprocess.run(
        [*git, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, check=False
    )
    if found.returncode != 0:
        raise SystemExit(
            f"commit {commit} is not in this repository (a shallow clone? "
            "`git fetch --unshallow`); it is the baseline the benchmark compares against"
        )
    tmp = tempfile.mkdtemp(prefix=f"dedupstore-{commit}-")
    try:
        archive = subprocess.Popen([*git, "archive", commit], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tmp], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"git archive {commit} failed")
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render(results: dict[str, Measured], unit: str = "messages / CPU s") -> str:
    """A Markdown table: median seconds, messages per second, ratios to the others."""
    names = list(results)
    lines = [
        f"| tree | median s | {unit} | rounds (slowest-fastest) | "
        + " | ".join(f"x {n}" for n in names if n != "this")
        + " |",
        "|---|---:|---:|---:|" + "---:|" * (len(names) - 1),
    ]
    for name in names:
        r = results[name]
        ratios = [f"{paired(r, results[o]):.2f}" for o in names if o != "this"]
        lines.append(
            f"| {name} | {r.median:.3f} | {r.rate:,.0f} | {r.spread} | " + " | ".join(ratios) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tree", action="append", default=[], help="name=path of a tree")
    parser.add_argument("--commit", action="append", default=[], help="a commit to extract")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--cleanup", choices=("inline", "deferred"), default="inline")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    trees = {"this": THIS_TREE}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or name in trees:
            parser.error(f"--tree takes a new name=path, got {item!r}")
        trees[name] = Path(path)
    with contextlib.ExitStack() as stack:
        for commit in args.commit:
            trees[commit] = stack.enter_context(extracted(commit))
        results = compare(
            trees, Run(args.messages, args.batch, args.cleanup, "cpu"), rounds=args.rounds
        )
    print(
        f"process_batch of {args.batch}, cleanup {args.cleanup}, memory://, "
        f"{args.messages:,} messages per round, median of {args.rounds} rounds (process CPU time)"
    )
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
