"""The async face against threads (issue 39): the section ``aio`` of ``make bench``.

Run alone with ``python -m benchmarks.bench --only aio`` (it replaces only its own
section of RESULTS.md, between ``BEGIN`` and ``END``). On Redis and on PostgreSQL, the
same workload runs twice, each time in a fresh process:

* **threads**: the sync ``OutboxProcessor`` called by ``THREADS`` (100) threads;
* **coroutines**: ``dedupstore.aio.AsyncOutboxProcessor`` awaited by ``COROUTINES``
  (1,000) tasks on one event loop.

Workload: ``--aio-messages`` messages (each delivered once) over as many entities as
there are messages divided by 2, in an order that puts a message of an entity far from
the next one of the same entity (so that concurrent callers rarely meet on an entity:
the bench measures the calls, not conflicts); the handler adds one and sends one
message (an in-memory dispatcher: no broker in the measure). Each caller takes the next
message from a shared queue, so the concurrency is what is compared.

Measured: messages per second over the run, each message's latency (from its
``process`` call to its return: p50 and p99), and memory: the process's peak resident
set during the run minus its resident set before the callers started (the stores open,
one message processed), i.e. what the concurrency itself costs. The rates depend on the
machine; read them as ratios of one run.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import resource
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- aio-bench -->", "<!-- /aio-bench -->"
#: The callers of each variant (the issue's numbers).
THREADS, COROUTINES = 100, 1000
#: The target: the coroutines at least as fast as the threads, with a tenth of their memory.
SPEED_GOAL, MEMORY_GOAL = 1.0, 0.1


def _handler(state: dict[str, Any], message: Any) -> tuple[dict[str, Any], list[Any]]:
    from dedupstore.outbox import Send

    count = state.get("count", 0) + 1
    return {"count": count}, [Send("out", {"id": message.id, "count": count})]


def _messages(count: int) -> list[Any]:
    from dedupstore.outbox import Message

    entities = max(1, count // 2)
    return [Message(f"m{n}", f"e{n % entities}", {"n": n}) for n in range(count)]


def _rss_mib() -> float:
    """The resident set now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stores(backend: str, url: str) -> tuple[Any, Any]:
    from dedupstore import open_entity_store, open_store

    tag = uuid.uuid4().hex[:10]
    if backend == "redis":
        return open_entity_store(url, key_prefix=f"ae{tag}:"), open_store(
            url, key_prefix=f"ad{tag}:"
        )
    return open_entity_store(url, table=f"aent_{tag}", create=True), open_store(
        url, table=f"adedup_{tag}", create=True
    )


def _child(variant: str, backend: str, url: str, count: int, callers: int) -> dict[str, Any]:
    """One variant in this process: its rate, latencies and memory."""
    from dedupstore.outbox import InMemoryDispatcher, OutboxProcessor

    entities, dedup = _stores(backend, url)
    messages = _messages(count + 1)
    warm, messages = messages[0], messages[1:]
    latencies: list[float] = []
    if variant == "threads":
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
        processor.process(warm, _handler)
        base = _rss_mib()
        started = time.perf_counter()
        _threads(processor, messages, latencies, callers)
    else:
        from dedupstore.aio import AsyncOutboxProcessor

        class AsyncMemory(InMemoryDispatcher):
            """The threads' dispatcher, awaited: an async service's dispatcher runs on
            the loop (a sync one would cost each message a hop to a thread)."""

            async def dispatch(self, messages: Sequence[Any]) -> None:  # type: ignore[override]
                super().dispatch(messages)

        aprocessor = AsyncOutboxProcessor(entities, dedup, AsyncMemory())

        async def warm_up() -> None:
            await aprocessor.process(warm, _handler)

        loop = asyncio.new_event_loop()
        loop.run_until_complete(warm_up())
        base = _rss_mib()
        started = time.perf_counter()
        loop.run_until_complete(_coroutines(aprocessor, messages, latencies, callers))
        loop.close()
    elapsed = time.perf_counter() - started
    peak = _peak_mib()
    latencies.sort()
    entities.close()
    dedup.close()
    return {
        "rate": len(messages) / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
        "memory_mib": max(0.0, peak - base),
    }


def _threads(processor: Any, messages: Sequence[Any], latencies: list[float], callers: int) -> None:
    work: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for message in messages:
        work.put(message)
    lock = threading.Lock()

    def worker() -> None:
        mine: list[float] = []
        while True:
            try:
                message = work.get_nowait()
            except queue.Empty:
                break
            began = time.perf_counter()
            processor.process(message, _handler)
            mine.append(time.perf_counter() - began)
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=worker) for _ in range(callers)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()


async def _coroutines(
    processor: Any, messages: Sequence[Any], latencies: list[float], callers: int
) -> None:
    work: asyncio.Queue[Any] = asyncio.Queue()
    for message in messages:
        work.put_nowait(message)

    async def worker() -> None:
        while not work.empty():
            message = work.get_nowait()
            began = time.perf_counter()
            await processor.process(message, _handler)
            latencies.append(time.perf_counter() - began)

    await asyncio.gather(*(worker() for _ in range(callers)))


@dataclass
class Measured:
    """One backend's two variants, and the coroutines at the threads' concurrency."""

    backend: str
    threads: dict[str, Any]
    coroutines: dict[str, Any]
    even: dict[str, Any]


def _measure(
    variant: str, backend: str, url: str, count: int, callers: int | None = None
) -> dict[str, Any]:
    if callers is None:
        callers = THREADS if variant == "threads" else COROUTINES
    command = [
        *(sys.executable, "-m", "benchmarks.aio_bench", variant, backend, url),
        *(str(count), str(callers)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"aio bench: {variant} on {backend} failed:\n{done.stderr[-3000:]}")
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


@contextmanager
def _servers(redis: dict[str, Any], postgres: dict[str, Any]) -> Iterator[dict[str, str]]:
    from tests.servers import PostgresServer, RedisServer

    with ExitStack() as stack:
        yield {
            "redis": stack.enter_context(RedisServer(**redis)).url,
            "postgres": stack.enter_context(PostgresServer(**postgres)).url,
        }


def run(
    count: int, redis: dict[str, Any], postgres: dict[str, Any], config: str
) -> tuple[list[Measured], str]:
    """Both variants on Redis and PostgreSQL (servers started here)."""
    results = []
    with _servers(redis, postgres) as urls:
        for backend in ("redis", "postgres"):
            print(f"== aio: {backend}", file=sys.stderr, flush=True)
            threads = _measure("threads", backend, urls[backend], count)
            coroutines = _measure("coroutines", backend, urls[backend], count)
            even = _measure("coroutines", backend, urls[backend], count, THREADS)
            results.append(Measured(backend, threads, coroutines, even))
    return results, config


def render(results: list[Measured], count: int, config: str, command: str) -> str:
    """The section (between ``BEGIN`` and ``END``)."""
    from dedupstore.steps import OFFLOAD_THREADS

    lines = [
        BEGIN,
        "## The async face against threads",
        "",
        f"`{command}`, section `aio` ({count:,} messages per run; servers in the `{config}` "
        f"configuration; each run in a fresh process): {THREADS} threads calling "
        f"`OutboxProcessor.process` against {COROUTINES:,} coroutines awaiting "
        "`AsyncOutboxProcessor.process`. Memory: the peak resident set during the run "
        "minus the resident set before it.",
        "",
        "| backend | callers | msgs/s | p50 ms | p99 ms | memory MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for name, m in (
            (f"{THREADS} threads", r.threads),
            (f"{COROUTINES:,} coroutines", r.coroutines),
            (f"{THREADS} coroutines", r.even),
        ):
            lines.append(
                f"| {r.backend} | {name} | {m['rate']:,.0f} | {m['p50_ms']:.1f} | "
                f"{m['p99_ms']:.1f} | {m['memory_mib']:.1f} |"
            )
    lines += ["", "Targets (the coroutines at least as fast, with a tenth of the memory):", ""]
    for r in results:
        speed = r.coroutines["rate"] / r.threads["rate"]
        memory = r.coroutines["memory_mib"] / max(r.threads["memory_mib"], 0.1)
        lines.append(
            f"- {r.backend}: speed {speed:.2f}x the threads' "
            f"({'met' if speed >= SPEED_GOAL else 'missed'}); memory {memory:.2f}x "
            f"({'met' if memory <= MEMORY_GOAL else 'missed'})"
        )
    lines += [
        "",
        f"At the threads' concurrency ({THREADS} messages in flight either way), what a "
        "coroutine costs against a thread:",
        "",
    ]
    for r in results:
        lines.append(
            f"- {r.backend}: speed {r.even['rate'] / r.threads['rate']:.2f}x the "
            f"threads'; memory {r.even['memory_mib'] / max(r.threads['memory_mib'], 0.1):.2f}x"
        )
    lines += [
        "",
        "How the calls run: the store calls are native on both backends (loads, saves "
        "and the joint calls awaited on the loop): on Redis `redis.asyncio`, its pool of "
        "100 connections; on PostgreSQL psycopg's `AsyncConnectionPool` of "
        "`pool_max_size` (10) connections, as many as the threads' sync pool, so both "
        "variants queue for the same 10 connections. No call goes to the async face's "
        f"{OFFLOAD_THREADS} threads. The coroutines' dispatcher is the threads' one with "
        "an `async def dispatch`, as an async service's is.",
        "",
        _speed_text(results),
        "",
        "Why the memory target is missed: it compares 1,000 messages in flight with 100. "
        "Per message in flight a coroutine holds less than a thread (the rows at the "
        "threads' concurrency above), but each still holds its message, entity, outgoing "
        "messages and the frames of its steps, so ten times as many in flight cost more "
        "in all; a tenth of the threads' memory would need less than a tenth of a "
        "thread's per message in flight, which a coroutine holding a message's work "
        "does not reach.",
        END,
    ]
    return "\n".join(lines)


def _speed_text(results: list[Measured]) -> str:
    """What decides the speed, and the reason for each backend that misses its target."""
    text = (
        "The speed: a store call of the async face costs the event loop's CPU, shared "
        "with the callers' other work and (here) with the servers on 2 cores. Profiled on "
        "Redis (cProfile), the largest item of the coroutines' path was tenacity's "
        "bookkeeping around each call's first attempt (its callbacks checked with "
        "`inspect` on every attempt); that attempt now runs outside it (a failed "
        "one is replayed to tenacity), as the sync retries' did already, so a call that "
        "succeeds pays for the retries nothing but a `try`."
    )
    reasons = {
        "redis": "`redis.asyncio` packs a request in Python and wakes a task per reply, "
        "where redis-py's sync client packs with hiredis in one C call",
        "postgres": "psycopg's async pool hands its 10 connections to 1,000 waiters "
        "through the loop, and the server's commits bound both variants alike",
    }
    for r in results:
        if r.coroutines["rate"] / r.threads["rate"] < SPEED_GOAL:
            text += (
                f" Missed in this run on {r.backend}: the bound is the CPU, and "
                f"{reasons.get(r.backend, 'the loop schedules every waiter')}; from run to "
                "run this ratio has moved on either side of 1 (the machine is shared)."
            )
    return text


def write(section: str, out: Path) -> None:
    """Replace (or add) this section of ``out``: before the token section if there is
    one, else before the Spark section, else at the end."""
    write_section(section, out, BEGIN, END)


def write_section(section: str, out: Path, begin: str, end: str, after: str = "") -> None:
    """Replace the part of ``out`` between ``begin`` and ``end`` by ``section``, or add it:
    right after the marker ``after`` if given and there, else before the token section,
    else before the Spark section, else at the end."""
    text = out.read_text(encoding="utf-8") if out.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        head, tail = text[: text.index(begin)], text[text.index(end) + len(end) :]
        text = head + section + tail
    elif after and after in text:
        at = text.index(after) + len(after)
        text = text[:at] + "\n\n" + section + text[at:]
    else:
        for marker in ("<!-- tokens-bench -->", "<!-- spark-bench -->"):
            if marker in text:
                at = text.index(marker)
                text = text[:at] + section + "\n\n" + text[at:]
                break
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    variant, backend, url, count, callers = sys.argv[1:6]
    print(json.dumps(_child(variant, backend, url, int(count), int(callers))))
