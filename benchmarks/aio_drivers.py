"""Async drivers against the bounded offload, for DynamoDB and SQLite: which to ship.

Run with ``python -m benchmarks.aio_drivers`` (or ``make bench-drivers``); it replaces
only its own section of RESULTS.md, between ``BEGIN`` and ``END`` (placed right after
the async-face section). On DynamoDB (moto's server, ``tests/servers.py``) and on SQLite
(a temporary file), ``TASKS`` (1,000) asyncio tasks share ``--writes`` single-id writes
of fresh ids, each variant in a fresh process and on a fresh table (file):

* **offload**: ``dedupstore.aio.open_store(url)`` then ``await store.add(id)``: the
  library as it ships, the sync driver (boto3, sqlite3) in the async face's
  ``OFFLOAD_THREADS`` threads. Runs with the project's ``.venv``.
* **native**: the same write done directly with the async library, the least a native
  implementation would do: aiobotocore, one conditional ``PutItem`` per id (the store's
  item, condition and ``ReturnValuesOnConditionCheckFailure``) on a client with as many
  connections as the offload has threads; aiosqlite, one connection (one thread) in WAL
  mode with ``synchronous=FULL``, one ``INSERT ... ON CONFLICT DO NOTHING`` per id in
  autocommit (each write its own transaction, committed before the call returns). Runs
  with ``.venv-drivers``: aiobotocore pins a botocore older than the project's, so it
  cannot live in ``.venv``; the bench makes that venv (``pip install aiobotocore
  aiosqlite``, pip choosing the botocore) when it is missing.
* **threads**: that same minimal write with the sync driver (boto3, sqlite3), in a pool of
  ``OFFLOAD_THREADS`` threads awaited from the tasks: the offload without the library
  around it, the driver-for-driver counterpart of the native probe. Runs with ``.venv``.
* on SQLite also **offload** and **threads** in one thread (``DEDUPSTORE_AIO_THREADS=1``):
  one writer, as aiosqlite's one connection is (``EXTRA_VARIANTS``).

``ROUNDS`` (``--rounds``) runs every variant once per round, in turn; the section reports
the median of each measure. The decision applies the rule (``SPEED_RULE``,
``MEMORY_RULE``) to the native probe against the shipped offload and against its
like-for-like variant (``PEER``): see :func:`decision`.

Measured in each child: writes per second over the run, each write's latency (from the
call to its return; p50 and p99), the peak resident set during the run minus the
resident set before it (the store open, one write done: ``aio_bench``'s measure), the
child's CPU per write, and, on DynamoDB, the CPU moto's server spent during the run (in
cores: near 1 it is saturated, and the run measures the server more than the client).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.aio_bench import _peak_mib, _rss_mib, write_section  # (stdlib only)

BEGIN, END = "<!-- aio-drivers-bench -->", "<!-- /aio-drivers-bench -->"
#: The section goes right after this marker (the async-face section's end).
AFTER = "<!-- /aio-bench -->"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PROJECT_VENV = ROOT / ".venv"
DRIVERS_VENV = ROOT / ".venv-drivers"
DRIVERS_PACKAGES = ("aiobotocore", "aiosqlite")
#: The concurrent tasks, and the writes they share by default.
TASKS, WRITES = 1000, 5000
#: Adopt the async library where it is at least this much faster, or at most this
#: fraction of the offload's memory.
SPEED_RULE, MEMORY_RULE = 1.2, 0.5
BACKENDS = ("dynamodb", "sqlite")
VARIANTS = ("offload", "native", "threads")
#: Variants run on one backend only: on SQLite, the threads bounded to one thread
#: (``DEDUPSTORE_AIO_THREADS=1``): the one writer aiosqlite's connection is, and the
#: shipped offload's (``SqliteConnection.offload_threads``).
EXTRA_VARIANTS = {"sqlite": ("threads1",)}
#: Where each variant runs.
VENV_OF = {"offload": "project", "native": "drivers", "threads": "project"}
VENV_OF |= {"threads1": "project"}
LABEL = {"threads1": "threads, 1 thread"}
#: Rounds by default, by backend: each runs every variant once, the section reports the
#: medians. SQLite's runs take seconds and swing with the machine's load; DynamoDB's take
#: half a minute each and are bound by moto's server (one round).
ROUNDS = {"dynamodb": 1, "sqlite": 5}
#: The async library of each backend.
LIBRARY = {"dynamodb": "aiobotocore", "sqlite": "aiosqlite"}
SYNC_DRIVER = {"dynamodb": "boto3", "sqlite": "sqlite3"}
REGION = "us-east-1"
#: The store's names (``backends/dynamodb/store.py``, ``backends/sqlite.py``).
ENDPOINT = "default"
_CONDITION = "attribute_not_exists(#p) OR #e <= :now"
_NAMES = {"#p": "pk", "#e": "expires_at"}
_COLUMNS = "endpoint TEXT NOT NULL, id TEXT NOT NULL, expires_at REAL, writer TEXT"

Write = Callable[[str], Awaitable[bool]]
Close = Callable[[], Awaitable[None]]


# -- the children: one variant each ------------------------------------------------


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process, or of process ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _put_request(table: str, message_id: str, token: str) -> dict[str, Any]:
    """The conditional PutItem the DynamoDB store sends for ``add`` (no retention)."""
    return {
        "TableName": table,
        "Item": {"pk": {"S": message_id}, "sk": {"S": ENDPOINT}, "writer": {"S": token}},
        "ConditionExpression": _CONDITION,
        "ExpressionAttributeNames": _NAMES,
        "ExpressionAttributeValues": {":now": {"N": repr(time.time())}},
        "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
    }


def _table_request(table: str) -> dict[str, Any]:
    """The store's table: ``pk`` (the id) HASH, ``sk`` (the endpoint) RANGE, on demand."""
    return {
        "TableName": table,
        "AttributeDefinitions": [
            {"AttributeName": "pk", "AttributeType": "S"},
            {"AttributeName": "sk", "AttributeType": "S"},
        ],
        "KeySchema": [
            {"AttributeName": "pk", "KeyType": "HASH"},
            {"AttributeName": "sk", "KeyType": "RANGE"},
        ],
        "BillingMode": "PAY_PER_REQUEST",
    }


def _sqlite_statements(table: str) -> tuple[str, str]:
    """The store's table (``PRIMARY KEY (endpoint, id)``, no rowid) and the minimal write."""
    create = f'CREATE TABLE IF NOT EXISTS "{table}" ({_COLUMNS}, PRIMARY KEY (endpoint, id)) '
    insert = (
        f'INSERT INTO "{table}" (endpoint, id, expires_at, writer) VALUES (?, ?, NULL, ?) '
        "ON CONFLICT (endpoint, id) DO NOTHING RETURNING id"
    )
    return create + "WITHOUT ROWID", insert


def _threads(backend: str) -> int:
    """The threads the shipped offload runs ``backend``'s calls in: its connection's own
    (``Connection.offload_threads``: SQLite's one per file) or the shared pool's."""
    from dedupstore.steps import OFFLOAD_THREADS

    if backend == "sqlite":
        from dedupstore.backends.sqlite import SqliteConnection

        return SqliteConnection.offload_threads or OFFLOAD_THREADS
    return OFFLOAD_THREADS


async def _open_offload(backend: str, target: str, tag: str) -> tuple[Write, Close]:
    from dedupstore import aio

    if backend == "dynamodb":
        url = f"dynamodb://drivers-{tag}"
        options: dict[str, Any] = {"region": REGION, "endpoint_url": target, "create": True}
        store = await aio.open_store(url, **options)
    else:
        store = await aio.open_store(f"sqlite:///{target}", table=f"d_{tag}", create=True)
    return store.add, store.close


async def _open_native(backend: str, target: str, tag: str, pool: int) -> tuple[Write, Close]:
    stack = contextlib.AsyncExitStack()
    if backend == "dynamodb":
        session = importlib.import_module("aiobotocore.session").get_session()
        config = importlib.import_module("aiobotocore.config").AioConfig(
            max_pool_connections=pool,
            retries={"mode": "standard"},
            parameter_validation=False,
        )
        client = await stack.enter_async_context(
            session.create_client(
                "dynamodb", region_name=REGION, endpoint_url=target, config=config
            )
        )
        table, token = f"drivers-{tag}", uuid.uuid4().hex
        await client.create_table(**_table_request(table))
        await client.get_waiter("table_exists").wait(TableName=table)
        failed = client.exceptions.ConditionalCheckFailedException

        async def put(message_id: str) -> bool:
            try:
                await client.put_item(**_put_request(table, message_id, token))
            except failed:
                return False
            return True

        return put, stack.aclose

    aiosqlite = importlib.import_module("aiosqlite")
    # autocommit: each INSERT is its own transaction, on disk (FULL) when the call returns
    db = await aiosqlite.connect(target, timeout=10.0, isolation_level=None)
    stack.push_async_callback(db.close)
    create, insert = _sqlite_statements(f"d_{tag}")
    mode = await db.execute_fetchall("PRAGMA journal_mode = WAL")
    assert str(next(iter(mode))[0]).lower() == "wal", mode
    await db.execute("PRAGMA synchronous = FULL")
    await db.execute(create)

    async def insert_one(message_id: str) -> bool:
        return bool(await db.execute_fetchall(insert, (ENDPOINT, message_id, tag)))

    return insert_one, stack.aclose


async def _open_threads(backend: str, target: str, tag: str, pool: int) -> tuple[Write, Close]:
    threads = ThreadPoolExecutor(pool, thread_name_prefix="probe")
    loop = asyncio.get_running_loop()
    call: Callable[[str], bool]
    if backend == "dynamodb":
        import boto3
        import botocore.exceptions
        from botocore.config import Config

        config = Config(
            max_pool_connections=pool, retries={"mode": "standard"}, parameter_validation=False
        )
        client = boto3.client("dynamodb", region_name=REGION, endpoint_url=target, config=config)
        table, token = f"drivers-{tag}", uuid.uuid4().hex
        client.create_table(**_table_request(table))
        client.get_waiter("table_exists").wait(TableName=table)

        def put(message_id: str) -> bool:
            try:
                client.put_item(**_put_request(table, message_id, token))
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException":
                    return False
                raise
            return True

        call = put
    else:
        import sqlite3

        create, insert = _sqlite_statements(f"d_{tag}")
        local = threading.local()

        def connection() -> sqlite3.Connection:
            conn: sqlite3.Connection | None = getattr(local, "conn", None)
            if conn is None:
                conn = sqlite3.connect(target, timeout=10.0, isolation_level=None)
                conn.execute("PRAGMA synchronous = FULL")
                local.conn = conn
            return conn

        first = connection()
        first.execute("PRAGMA journal_mode = WAL")
        first.execute(create)

        def insert_one(message_id: str) -> bool:
            return bool(connection().execute(insert, (ENDPOINT, message_id, tag)).fetchall())

        call = insert_one

    async def write(message_id: str) -> bool:
        return await loop.run_in_executor(threads, call, message_id)

    async def close() -> None:
        threads.shutdown(wait=True)

    return write, close


async def _drive(write: Write, writes: int, tasks: int, tag: str) -> tuple[list[float], int]:
    """``writes`` writes of fresh ids shared by ``tasks`` tasks: each write's latency, and
    how many ids were reported new (all of them, the ids being fresh)."""
    latencies: list[float] = []
    new = 0

    async def task(number: int) -> None:
        nonlocal new
        for k in range(number, writes, tasks):
            began = time.perf_counter()
            added = await write(f"{tag}-{k}")  # (``new += await ...`` would read first)
            latencies.append(time.perf_counter() - began)
            new += added

    await asyncio.gather(*(task(n) for n in range(tasks)))
    return latencies, new


async def _child_run(
    variant: str, backend: str, target: str, writes: int, tasks: int, server: int | None
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:10]
    pool = int(os.environ.get("DEDUPSTORE_AIO_THREADS", "64"))
    variant = variant.removesuffix("1")  # the same, in one thread (``EXTRA_VARIANTS``)
    if variant == "offload":
        pool = _threads(backend)
        write, close = await _open_offload(backend, target, tag)
    elif variant == "native":
        write, close = await _open_native(backend, target, tag, pool)
    else:
        write, close = await _open_threads(backend, target, tag, pool)
    try:
        assert await write(f"warm-{tag}"), "the warm-up id was not new"
        base, cpu, served = _rss_mib(), _cpu_s(), _cpu_s(server) if server else 0.0
        started = time.perf_counter()
        latencies, new = await _drive(write, writes, tasks, tag)
        elapsed = time.perf_counter() - started
        cpu, peak = _cpu_s() - cpu, _peak_mib()
        served = _cpu_s(server) - served if server else 0.0
    finally:
        await close()
    if new != writes:
        raise SystemExit(f"{variant} on {backend}: {new} of {writes} fresh ids reported new")
    latencies.sort()
    return {
        "rate": writes / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
        "memory_mib": max(0.0, peak - base),
        "cpu_us": cpu / writes * 1e6,
        "server_cores": served / elapsed if server else None,
        "pool": pool,
    }


def child(argv: Sequence[str]) -> dict[str, Any]:
    """``VARIANT BACKEND TARGET WRITES TASKS [SERVER_PID]``: one variant, in this process."""
    variant, backend, target, writes, tasks = argv[:5]
    server = int(argv[5]) if len(argv) > 5 else None
    return asyncio.run(_child_run(variant, backend, target, int(writes), int(tasks), server))


# -- the parent: venvs, servers, children ----------------------------------------


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def project_python() -> Path:
    """The project's interpreter (``.venv``), else this one."""
    python = _venv_python(PROJECT_VENV)
    return python if python.exists() else Path(sys.executable)


def drivers_python(log: Callable[[str], None]) -> Path:
    """``.venv-drivers``'s interpreter, the venv made (``aiobotocore``, ``aiosqlite``,
    pip resolving botocore) if it is missing or lacks them."""
    python = _venv_python(DRIVERS_VENV)
    if not python.exists():
        log(f"creating {DRIVERS_VENV.name}")
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(DRIVERS_VENV)], check=True)
    probe = [str(python), "-c", "import aiobotocore, aiosqlite"]
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        log(f"installing {' '.join(DRIVERS_PACKAGES)} into {DRIVERS_VENV.name}")
        install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        done = subprocess.run([*install, *DRIVERS_PACKAGES], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"cannot install the drivers:\n{done.stderr[-3000:]}")
    return python


def versions(python: Path, packages: Sequence[str]) -> dict[str, str]:
    """The installed versions of ``packages`` in ``python``'s environment."""
    code = (
        "import json, sys\nfrom importlib.metadata import version\n"
        "print(json.dumps({p: version(p) for p in sys.argv[1:]}))"
    )
    done = subprocess.run(
        [str(python), "-c", code, *packages], capture_output=True, text=True, check=True
    )
    found: dict[str, str] = json.loads(done.stdout)
    return found


def _measure(
    python: Path,
    variant: str,
    backend: str,
    target: str,
    writes: int,
    tasks: int,
    server: int | None,
    env: dict[str, str],
) -> dict[str, Any]:
    command = [str(python), "-m", "benchmarks.aio_drivers", "--child", variant, backend, target]
    command += [str(writes), str(tasks)] + ([str(server)] if server else [])
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, cwd=ROOT, env={**os.environ, **env}
    )
    if done.returncode != 0:
        raise SystemExit(f"drivers bench: {variant} on {backend} failed:\n{done.stderr[-3000:]}")
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


@dataclass
class Measured:
    """One backend's variants (``VARIANTS``: their measures)."""

    backend: str
    variants: dict[str, dict[str, Any]]


@contextlib.contextmanager
def _target(backend: str) -> Iterator[tuple[Callable[[str], str], int | None, dict[str, str]]]:
    """Where a run writes (a function of its name), the server's pid, its env."""
    if backend == "dynamodb":
        from tests.servers import MotoServer

        with MotoServer() as moto:
            yield (lambda name: moto.endpoint_url), moto.pid, moto.client_env
    else:
        folder = tempfile.mkdtemp(prefix="aio-drivers-")
        try:
            yield (lambda name: str(Path(folder) / f"{name}.db")), None, {}
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One variant's rounds: the median of each measure, the range of the rate, the
    highest load."""
    summed: dict[str, Any] = {"rounds": len(runs)}
    for key, value in runs[0].items():
        values = [r[key] for r in runs if r.get(key) is not None]
        summed[key] = statistics.median(values) if value is not None and values else None
    rates = [r["rate"] for r in runs]
    summed["rate_min"], summed["rate_max"] = min(rates), max(rates)
    summed["load"] = max(r.get("load", 0.0) for r in runs)
    return summed


def run(
    writes: int,
    tasks: int,
    backends: Sequence[str],
    pythons: dict[str, Path],
    log: Callable[[str], None],
    rounds: dict[str, int] | None = None,
) -> list[Measured]:
    """Every variant on every backend, each in a fresh process (``pythons``: by venv), in
    ``rounds`` (by backend; ``ROUNDS``) that each run every variant once, in turn."""
    rounds = ROUNDS if rounds is None else rounds
    results = []
    for backend in backends:
        variants = (*VARIANTS, *EXTRA_VARIANTS.get(backend, ()))
        runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
        with _target(backend) as (target, server, env):
            for round_ in range(rounds.get(backend, 1)):
                for variant in variants:
                    log(f"== drivers: {backend} {variant} (round {round_ + 1})")
                    python = pythons[VENV_OF[variant]]
                    bound = {"DEDUPSTORE_AIO_THREADS": "1"} if variant.endswith("1") else {}
                    load = os.getloadavg()[0]  # other work on the machine skews the run
                    where = target(f"{variant}-{round_}")
                    measured = _measure(
                        python, variant, backend, where, writes, tasks, server, env | bound
                    )
                    measured["load"] = load
                    runs[variant].append(measured)
                    log(f"   {json.dumps(measured)}")
        results.append(Measured(backend, {v: summary(runs[v]) for v in variants}))
    return results


# -- the section -----------------------------------------------------------------


@dataclass(frozen=True)
class Ratios:
    """The native probe's measures divided by another variant's."""

    speed: float
    memory: float
    cpu: float

    @property
    def adopts(self) -> bool:
        """The decision rule: the async library where it is faster or markedly smaller."""
        return self.speed >= SPEED_RULE or self.memory <= MEMORY_RULE

    def __str__(self) -> str:
        return f"speed {self.speed:.2f}x, memory {self.memory:.2f}x, CPU/write {self.cpu:.2f}x"


def ratios(r: Measured, against: str = "offload") -> Ratios:
    """native / ``against``: writes/s, memory, client CPU per write."""
    native, other = r.variants["native"], r.variants[against]
    return Ratios(
        native["rate"] / other["rate"],
        native["memory_mib"] / max(other["memory_mib"], 0.1),
        native["cpu_us"] / other["cpu_us"],
    )


def _moto_busy(r: Measured) -> bool:
    """Whether moto's server bounded the runs: near one core busy in each (it serves one
    request at a time)."""
    cores = [m.get("server_cores") for m in r.variants.values()]
    return all(c is not None and c >= 0.8 for c in cores)


#: The like-for-like variant of each backend: the native probe's write, in the sync driver,
#: under the same bound of writes in flight (64 connections and 64 threads; aiosqlite's
#: one thread and one thread).
PEER = {"dynamodb": "threads", "sqlite": "threads1"}


def _peer(r: Measured) -> str | None:
    peer = PEER[r.backend]
    return peer if peer in r.variants else None


def _in(r: Measured, variant: str) -> str:
    """Where ``variant``'s writes run: in how many threads."""
    pool = r.variants[variant].get("pool", 64)
    return "in one thread" if pool == 1 else f"in {pool} threads"


def _pin(pins: dict[str, dict[str, str]]) -> str:
    drivers, project = pins["drivers"], pins["project"]
    return (
        f"aiobotocore {drivers.get('aiobotocore', '?')} pins botocore behind the released one "
        f"(pip chose botocore {drivers.get('botocore', '?')} for it; the project has "
        f"boto3/botocore {project.get('botocore', '?')}), so it cannot be installed beside "
        "the project's boto3: adopting it would hold boto3 back to aiobotocore's pin, release "
        "after release"
    )


def _like_for_like(r: Measured) -> str:
    """The native probe against its like-for-like variant (``PEER``), if measured."""
    peer = _peer(r)
    if peer is None:
        return ""
    same = ratios(r, peer)
    bar = "meets" if same.adopts else "misses"
    return (
        f"against the same write by {SYNC_DRIVER[r.backend]} {_in(r, peer)} (the same bound) "
        f"it measured {same} ({bar} the rule's bar)"
    )


def decision(r: Measured, pins: dict[str, dict[str, str]]) -> str:
    """The decision line of ``r``'s backend, with its reasons: the rule (``SPEED_RULE``,
    ``MEMORY_RULE``) on the native probe against the offload as shipped, weighed with the
    dependency, and qualified by the probe against the same write in the sync driver under
    the same bound (``PEER``): the probe does the least a native store would, the shipped
    offload the whole library's work, so a gap only the first comparison shows is the
    library's (or its bound's), not the driver's."""
    vs, library = ratios(r), LIBRARY[r.backend]
    rule = f"the rule against the offload as shipped ({vs}" + (
        ")" if vs.adopts else f": neither >= {SPEED_RULE}x speed nor <= {MEMORY_RULE}x memory)"
    )
    met = f"{library} " + ("meets " if vs.adopts else "misses ") + rule
    like = _like_for_like(r)
    if r.backend == "dynamodb":
        native, offload = r.variants["native"], r.variants["offload"]
        reasons = [
            f"keep the bounded offload: {met}" + ("" if not vs.adopts else f", but {_pin(pins)}")
        ]
        peer = _peer(r)
        if peer is not None and not ratios(r, peer).adopts:
            like += (
                "; what it gains over the shipped offload is the library's work per write "
                "(below), which a native store would carry too"
            )
        if like:
            reasons.append(like)
        if _moto_busy(r):
            reasons.append(
                "the speeds are moto's more than the clients' (below); per write, aiobotocore "
                f"costs {vs.cpu:.2f}x the offload's client CPU, the measure moto does not bound"
            )
        if native["p99_ms"] > 2 * offload["p99_ms"]:
            reasons.append(
                f"its p99 ({native['p99_ms']:,.0f} ms) is "
                f"{native['p99_ms'] / offload['p99_ms']:.1f}x the offload's: aiohttp's pool lets "
                "a request take a connection just freed before the waiter woken for it runs, "
                "so some writes wait most of the run (a native store would need its own "
                "first-come bound)"
            )
        if not vs.adopts:
            reasons.append(f"and the dependency: {_pin(pins)}")
    else:
        reasons = [
            "keep the bounded offload, one writer thread per database file (the shipped "
            f"offload: `SqliteConnection.offload_threads` = {r.variants['offload']['pool']}); "
            f"against it {met}"
        ]
        if like:
            reasons.append(like)
        reasons.append(
            f"aiosqlite ({pins['drivers'].get('aiosqlite', '?')}) is itself a one-thread "
            "offload (one thread per connection, each call queued to it), so beside an "
            "offload of one thread per file it adds a queue in place of an executor, and its "
            "probe is a ceiling: an autocommit insert, where the store's write is `BEGIN "
            "IMMEDIATE`, an upsert and `COMMIT`, which on a connection shared by tasks would "
            "need a lock of its own; from run to run its margin over sqlite3 in one thread "
            "has fallen on either side of the rule's bar (the runs so far: below this "
            "section), which does not pay for a dependency. The one writer was the gain: 64 "
            "threads contended for the file's write lock (also below)"
        )
    return f"- **{r.backend}**: " + "; ".join(reasons) + "."


def _notes(r: Measured) -> list[str]:
    """What else the numbers say about ``r``'s comparison."""
    notes = []
    rates = [m["rate"] for m in r.variants.values()]
    if r.backend == "dynamodb" and _moto_busy(r):
        cores = [float(m["server_cores"]) for m in r.variants.values()]
        notes.append(
            f"On DynamoDB the server is the bound: moto's server used {min(cores):.2f}-"
            f"{max(cores):.2f} cores during the runs (it serves one request at a time) and "
            f"the variants' rates are within {max(rates) / min(rates):.2f}x of each other, "
            "whichever driver and however many connections, so the speed column measures "
            "moto more than the clients. The clients differ in their CPU per write, which, "
            "on cores shared with the server, is what a faster endpoint turns into rate. "
            "Against DynamoDB itself (milliseconds a request, no one-at-a-time server) the "
            "in-flight bound (64 threads or 64 connections) and the client's CPU decide."
        )
    shipped, peer = ("offload", "threads1") if r.backend == "sqlite" else ("offload", "threads")
    if shipped in r.variants and peer in r.variants:
        library, minimal = r.variants[shipped], r.variants[peer]
        what = (
            "`BEGIN IMMEDIATE`, an upsert (expiry, the writer's token, `RETURNING`) and `COMMIT`"
            if r.backend == "sqlite"
            else "a conditional `PutItem` with the store's retries, deadline and outcome checks"
        )
        notes.append(
            f"The library's work per write on {r.backend}: {_in(r, peer)} the store's "
            f"write ({LABEL.get(shipped, shipped)}) runs at {library['rate']:,.0f} writes/s for "
            f"{library['cpu_us']:,.0f} µs of client CPU, the minimal one at "
            f"{minimal['rate']:,.0f} for {minimal['cpu_us']:,.0f} µs: the store's is {what} "
            "around the library's steps, and a native store would carry that work too"
            + (
                ", so the probe's rate is a ceiling for either way."
                if minimal["rate"] > library["rate"]
                else "; in this run the two are not told apart (the difference is within the "
                "run's noise)."
            )
        )
    return notes


def _rounds(r: Measured) -> int:
    return int(max(m.get("rounds", 1) for m in r.variants.values()))


def render(
    results: list[Measured],
    writes: int,
    tasks: int,
    pins: dict[str, dict[str, str]],
    command: str,
) -> str:
    """The section (between ``BEGIN`` and ``END``)."""
    threads = next(iter(results)).variants["offload"]["pool"] if results else 64
    project = ", ".join(f"{p} {v}" for p, v in pins["project"].items())
    drivers = ", ".join(f"{p} {v}" for p, v in pins["drivers"].items())
    lines = [
        BEGIN,
        "## Async drivers against the offload (DynamoDB, SQLite)",
        "",
        f"`{command}` ({writes:,} single-id writes of fresh ids shared by {tasks:,} asyncio "
        "tasks; each variant in a fresh process, on a fresh table; DynamoDB: moto's server "
        "(`tests/servers.py`), SQLite: a temporary file, WAL, `synchronous=FULL`):",
        "",
        f"- **offload**: `aio.open_store(url)`, `await store.add(id)`: the library as it "
        f"ships, the sync driver in the async face's {threads} threads (SQLite's in one "
        f"thread of its file's own, `offload_threads`) (`.venv`: {project});",
        "- **native**: the same write straight on the async library, the least a native "
        f"implementation would do (`.venv-drivers`: {drivers}): aiobotocore, the store's "
        f"conditional `PutItem` per id, {threads} connections; aiosqlite, one connection, "
        "one autocommit `INSERT ... ON CONFLICT DO NOTHING` per id (its own transaction, "
        "committed when the call returns);",
        f"- **threads**: that minimal write with the sync driver (boto3 with {threads} "
        f"connections, sqlite3) in {threads} threads (`.venv`): the offload without the "
        "library around it, driver for driver with the native probe;",
        "- on SQLite also the offload and the threads bounded to one thread "
        "(`DEDUPSTORE_AIO_THREADS=1`): one writer, as aiosqlite's one connection is.",
        "",
        "Memory: the peak resident set during the run minus the resident set before it (the "
        "store open, one write done). Client CPU: the process's user + system time per "
        "write. Server: the CPU moto's server spent during the run, in cores. Rounds: "
        + ", ".join(f"{r.backend} {_rounds(r)}" for r in results)
        + " (each runs every variant once, in turn; the table gives each measure's median "
        "and the rate's range over the rounds).",
        "",
        "| backend | variant | driver | writes/s | p50 ms | p99 ms | memory MiB "
        "| client CPU µs/write | server cores |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for variant, m in r.variants.items():
            driver = LIBRARY[r.backend] if variant == "native" else SYNC_DRIVER[r.backend]
            cores = m.get("server_cores")
            rate = f"{m['rate']:,.0f}"
            if m.get("rounds", 1) > 1:
                rate += f" ({m['rate_min']:,.0f}-{m['rate_max']:,.0f})"
            lines.append(
                f"| {r.backend} | {LABEL.get(variant, variant)} | {driver} | {rate} | "
                f"{m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['memory_mib']:.1f} | "
                f"{m['cpu_us']:,.0f} | {'-' if cores is None else f'{cores:.2f}'} |"
            )
    loads = [m["load"] for r in results for m in r.variants.values() if "load" in m]
    if loads:
        machine = os.cpu_count() or 1
        lines += [
            "",
            f"Load (the 1-minute load average before each run): {min(loads):.1f}-"
            f"{max(loads):.1f} on {machine} cores"
            + (
                ": other work shared the machine during some runs; read their numbers with care."
                if max(loads) > machine + 1  # the bench itself keeps a child and moto busy
                else " (the bench itself keeps up to 2 busy: a client, and moto on DynamoDB)."
            ),
        ]
    lines += [
        "",
        "The native probe against each other variant (native / it; the rule: adopt at "
        f">= {SPEED_RULE}x speed or <= {MEMORY_RULE}x memory):",
        "",
        "| backend | native / | speed | memory | client CPU per write | by the rule |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        for variant in r.variants:
            if variant != "native":
                vs = ratios(r, variant)
                lines.append(
                    f"| {r.backend} | {LABEL.get(variant, variant)} | {vs.speed:.2f}x | "
                    f"{vs.memory:.2f}x | {vs.cpu:.2f}x | "
                    f"{'adopt' if vs.adopts else 'keep the offload'} |"
                )
    lines += [
        "",
        f"Decision (the rule: adopt the async library only where it is >= {SPEED_RULE}x as "
        f"fast as the offload or <= {MEMORY_RULE}x its memory; otherwise keep the bounded "
        "offload; applied to the offload as shipped, weighed with the library's dependency "
        "cost, and qualified by the probe against the same minimal write in the sync driver "
        "under the same bound: the probe does the least a native store would, the shipped "
        "offload the whole library's work, so a gap only the first comparison shows is the "
        "library's or its bound's, not the driver's):",
        "",
        *(decision(r, pins) for r in results),
    ]
    notes = [note for r in results for note in _notes(r)]
    for note in notes:
        lines += ["", note]
    lines.append(END)
    return "\n".join(lines)


def write(section: str, out: Path) -> None:
    """Replace (or add) this section of ``out``: right after the async-face section if
    there is one, else before the token section, else before the Spark section, else at
    the end."""
    write_section(section, out, BEGIN, END, after=AFTER)


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["--child"]:
        print(json.dumps(child(given[1:])))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.aio_drivers")
    parser.add_argument("--writes", type=int, default=WRITES, help="writes per variant")
    parser.add_argument("--tasks", type=int, default=TASKS, help="concurrent asyncio tasks")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds on every backend (default: ROUNDS)"
    )
    args = parser.parse_args(given)
    backends = [b for b in args.backends.split(",") if b]
    if not backends or set(backends) - set(BACKENDS):
        raise SystemExit(f"--backends: choose from {', '.join(BACKENDS)}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    started = time.perf_counter()
    pythons = {"project": project_python(), "drivers": drivers_python(log)}
    pins = {
        "project": versions(pythons["project"], ["boto3", "botocore"]),
        "drivers": versions(pythons["drivers"], ["aiobotocore", "botocore", "aiosqlite"]),
    }
    for venv, found in pins.items():
        log(f"{venv} venv ({pythons[venv]}): {json.dumps(found)}")
    rounds = ROUNDS if args.rounds is None else dict.fromkeys(BACKENDS, args.rounds)
    results = run(args.writes, args.tasks, backends, pythons, log, rounds)
    command = " ".join(["python -m benchmarks.aio_drivers", *given])
    section = render(results, args.writes, args.tasks, pins, command)
    if not args.no_write:
        write(section, args.out)
    print(section)
    log(f"took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
