"""Throughput and memory benchmark of every backend; writes benchmarks/RESULTS.md.

Run with ``make bench`` (starts the servers itself). For each backend, in one run
on one machine: ``add_many`` and ``processed_among`` ids/s on fresh UUID ids in
caller batches of 1k and 10k, a naive loop of single ``add`` calls, and the
server's own native write rate (Redis: ``redis-benchmark -P 64 -t set``; Postgres:
raw ``COPY`` of the same ids into an identical table). Only ratios measured in the
same run are compared: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dedupstore import DeduplicationStore, open_store
from tests.servers import CosmosServer, MotoServer, PostgresServer, RedisServer

RESULTS = Path(__file__).with_name("RESULTS.md")
BACKENDS = ("sqlite", "postgres", "redis", "dynamodb", "cosmos")


@dataclass
class Result:
    """Measurements of one backend."""

    backend: str
    rates: dict[str, float] = field(default_factory=dict)
    native: tuple[str, float] | None = None
    memory: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


Opener = Callable[[], DeduplicationStore]


@contextlib.contextmanager
def _backend(name: str) -> Iterator[tuple[Opener, Any]]:
    """Start the backend's server; yield (open a fresh store, the server)."""
    run = uuid.uuid4().hex[:10]
    if name == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield (lambda: open_store(f"sqlite:///{tmp}/bench-{uuid.uuid4().hex}.db")), None
    elif name == "postgres":
        with PostgresServer() as pg:
            yield (
                (lambda: open_store(pg.url, table=f"bench_{uuid.uuid4().hex[:12]}", create=True)),
                pg,
            )
    elif name == "redis":
        with RedisServer(appendonly=True, appendfsync="everysec") as redis:
            yield (lambda: open_store(redis.url, key_prefix=f"b{uuid.uuid4().hex[:8]}:")), redis
    elif name == "dynamodb":
        with MotoServer() as moto:
            os.environ.update(moto.client_env)
            yield (
                (
                    lambda: open_store(
                        f"dynamodb://bench-{run}-{uuid.uuid4().hex[:8]}",
                        region="us-east-1",
                        endpoint_url=moto.endpoint_url,
                        create=True,
                    )
                ),
                moto,
            )
    elif name == "cosmos":
        with CosmosServer() as cosmos:
            host = cosmos.endpoint_url.removeprefix("http://")
            yield (
                (
                    lambda: open_store(
                        f"cosmos://{host}/bench/c{uuid.uuid4().hex[:12]}",
                        key=cosmos.key,
                        tls=False,
                        endpoint_discovery=False,
                        create=True,
                        allow_weak_consistency_for_emulator_only=True,
                    )
                ),
                cosmos,
            )
    else:
        raise SystemExit(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")


def _ids(count: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(count)]


def _rate(count: int, action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return count / (time.perf_counter() - started)


def _batched(store: DeduplicationStore, ids: list[str], size: int, method: str) -> None:
    call = getattr(store, method)
    for start in range(0, len(ids), size):
        call(ids[start : start + size])


def _throughput(result: Result, opener: Opener, count: int, naive_count: int) -> None:
    for size in (1_000, 10_000):
        ids = _ids(count)
        with opener() as store:
            result.rates[f"add_many/{size // 1000}k"] = _rate(
                count, lambda s=store, i=ids, n=size: _batched(s, i, n, "add_many")
            )
            result.rates[f"processed_among/{size // 1000}k"] = _rate(
                count, lambda s=store, i=ids, n=size: _batched(s, i, n, "processed_among")
            )
    naive_ids = _ids(naive_count)
    with opener() as store:
        result.rates["naive add loop"] = _rate(
            naive_count, lambda: [store.add(mid) for mid in naive_ids]
        )
    if naive_count < count:
        result.notes.append(f"naive loop measured on {naive_count:,} ids (rate, not total)")


def _peak_mib(store: DeduplicationStore, ids: Callable[[], Iterator[str]]) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        recorded = store.add_many(ids())
        assert not recorded, "ids were expected to be recorded already"
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def _memory(result: Result, opener: Opener, sizes: tuple[int, ...]) -> None:
    """Peak traced memory of add_many(generator) on already-recorded ids, per size."""
    for size in sizes:
        prefix = uuid.uuid4().hex[:8]

        def generate(n: int = size, p: str = prefix) -> Iterator[str]:
            return (f"{p}-{i:08d}" for i in range(n))

        with opener() as store:
            store.add_many(generate())  # record them; the measured pass returns nothing
            result.memory[f"{size:,}"] = _peak_mib(store, generate)


def _native_redis(server: RedisServer, count: int) -> tuple[str, float]:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise SystemExit("redis-benchmark not found: apt-get install redis-tools")
    host, port = server.url.removeprefix("redis://").split("/")[0].split(":")
    out = subprocess.run(
        [exe, "-h", host, "-p", port, "-P", "64", "-t", "set", "-n", str(count), "-q"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"SET: ([\d.]+) requests per second", out.replace("\r", "\n"))
    if not match:
        raise SystemExit(f"cannot parse redis-benchmark output: {out!r}")
    return "redis-benchmark -P 64 -t set", float(match.group(1))


def _native_postgres(server: PostgresServer, count: int) -> tuple[str, float]:
    import psycopg

    ids = _ids(count)
    with open_store(server.url, table="bench_template", create=True):
        pass
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_copy")
        conn.execute("CREATE TABLE bench_copy (LIKE bench_template INCLUDING ALL)")
        started = time.perf_counter()
        with conn.cursor() as cur, cur.copy("COPY bench_copy (endpoint, id) FROM STDIN") as copy:
            for mid in ids:
                copy.write_row(("default", mid))
        rate = count / (time.perf_counter() - started)
    return "raw COPY into an identical table", rate


def _fmt(rate: float) -> str:
    return f"{rate:,.0f}"


def _render(results: list[Result], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Measured by `make bench` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} cores, in one run of {seconds:,.0f} s. Every server ran locally "
        "on loopback on the same shared machine, so compare the ratios inside one run, "
        "not absolute figures across runs.",
        "",
        f"{args.ids:,} fresh UUID ids per measurement, passed to `add_many` / "
        "`processed_among` in caller batches of 1k and 10k (the backend splits them to "
        "its own limits).",
        "",
        "| backend | add_many 1k | add_many 10k | processed_among 1k | processed_among 10k "
        "| naive add loop | batch / naive | native rate | add_many / native "
        "| processed_among / native |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        best_add = max(r.rates["add_many/1k"], r.rates["add_many/10k"])
        best_read = max(r.rates["processed_among/1k"], r.rates["processed_among/10k"])
        naive = r.rates["naive add loop"]
        native = r.native[1] if r.native else None
        lines.append(
            f"| {r.backend} | {_fmt(r.rates['add_many/1k'])} | {_fmt(r.rates['add_many/10k'])}"
            f" | {_fmt(r.rates['processed_among/1k'])} | {_fmt(r.rates['processed_among/10k'])}"
            f" | {_fmt(naive)} | {best_add / naive:,.1f}x"
            f" | {_fmt(native) if native else '-'}"
            f" | {f'{best_add / native:.2f}x' if native else '-'}"
            f" | {f'{best_read / native:.2f}x' if native else '-'} |"
        )
    lines += ["", "Rates are ids per second. Native rates:", ""]
    for r in results:
        if r.native:
            lines.append(f"- {r.backend}: {r.native[0]}: {_fmt(r.native[1])} ids/s")
    lines += ["", "## Targets (ratios in this run)", ""]
    lines += _targets(results)
    memory = [r for r in results if r.memory]
    if memory:
        sizes = list(memory[0].memory)
        lines += [
            "",
            "## Peak memory of `add_many` over a generator",
            "",
            "Peak Python allocations (tracemalloc) while `add_many` consumes a generator "
            "of ids that are already recorded (so the returned set is empty and only the "
            "streaming itself is measured). It must not grow with the input.",
            "",
            "| backend | " + " | ".join(f"{s} ids" for s in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        for r in memory:
            lines.append(
                f"| {r.backend} | " + " | ".join(f"{v:.1f} MiB" for v in r.memory.values()) + " |"
            )
    notes = [f"- {r.backend}: {n}" for r in results for n in r.notes]
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def _targets(results: list[Result]) -> list[str]:
    by_name = {r.backend: r for r in results}
    rows: list[str] = []

    def check(label: str, value: float, goal: float) -> None:
        verdict = "met" if value >= goal else "NOT met"
        rows.append(f"- {label}: {value:.2f}x (target >= {goal}x): {verdict}")

    for name in ("postgres", "redis", "dynamodb"):
        if name in by_name:
            r = by_name[name]
            best = max(r.rates["add_many/1k"], r.rates["add_many/10k"])
            check(f"{name} batch / naive", best / r.rates["naive add loop"], 20)
    if "redis" in by_name and by_name["redis"].native:
        r = by_name["redis"]
        assert r.native is not None
        check(
            "redis add_many / redis-benchmark SET",
            max(r.rates["add_many/1k"], r.rates["add_many/10k"]) / r.native[1],
            0.25,
        )
        check(
            "redis processed_among / redis-benchmark SET",
            max(r.rates["processed_among/1k"], r.rates["processed_among/10k"]) / r.native[1],
            0.5,
        )
    if "postgres" in by_name and by_name["postgres"].native:
        r = by_name["postgres"]
        assert r.native is not None
        check(
            "postgres add_many / raw COPY",
            max(r.rates["add_many/1k"], r.rates["add_many/10k"]) / r.native[1],
            0.3,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--ids", type=int, default=200_000)
    parser.add_argument("--naive-ids", type=int, default=20_000)
    parser.add_argument("--slow-ids", type=int, default=5_000, help="ids for dynamodb/cosmos")
    parser.add_argument("--memory-sizes", default="100000,1000000")
    parser.add_argument("--memory-backends", default="sqlite,postgres,redis")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.memory_sizes.split(",") if s)
    started = time.perf_counter()
    results = []
    for name in [b for b in args.backends.split(",") if b]:
        print(f"== {name}", file=sys.stderr, flush=True)
        result = Result(name)
        slow = name in ("dynamodb", "cosmos")
        count = min(args.ids, args.slow_ids) if slow else args.ids
        naive = min(args.naive_ids, count // 10 if slow else count)
        if slow and count < args.ids:
            result.notes.append(
                f"{count:,} ids instead of {args.ids:,}: the emulator serves ~1-2k requests/s"
            )
        with _backend(name) as (opener, server):
            _throughput(result, opener, count, naive)
            if name == "redis":
                result.native = _native_redis(server, args.ids)
            elif name == "postgres":
                result.native = _native_postgres(server, args.ids)
            if name in args.memory_backends.split(","):
                _memory(result, opener, sizes)
        print(f"   {result}", file=sys.stderr, flush=True)
        results.append(result)
    text = _render(results, args, time.perf_counter() - started)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
