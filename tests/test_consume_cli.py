"""``dedupstore consume`` as a service, in a subprocess, against a real Redis server.

It reads what a ``RedisDispatcher`` wrote, processes it with the handler named on
the command line, and on SIGTERM exits 0 after the batch in flight, printing its
totals as JSON. Bad arguments exit 2 with one line on stderr, before reading.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from dedupstore import open_dispatcher, open_entity_store, open_store
from dedupstore.entities import OutgoingMessage
from tests.proxy import TcpProxy
from tests.servers import Server
from tests.soak_worker import soak_violations

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parent.parent


def _consume(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "dedupstore.cli", "consume", *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "face",
    [
        ("tests.soak_worker:soak_handler",),
        ("tests.soak_worker:async_soak_handler",),  # an async def handler: on asyncio
        ("tests.soak_worker:soak_handler", "--asyncio"),
    ],
    ids=["sync", "async-def", "asyncio-flag"],
)
def test_consume_runs_until_sigterm_and_exits_0(redis_server: Server, face: tuple[str]) -> None:
    tag = uuid.uuid4().hex[:8]
    url = redis_server.url
    upstream = open_dispatcher(url, key_prefix=f"cli{tag}:")
    owner = {f"m{n}": f"e{n % 7}" for n in range(200)}
    messages = [
        OutgoingMessage(mid, "orders", {}, {"correlation_id": cid}) for mid, cid in owner.items()
    ]
    upstream.dispatch(messages)
    admin = redis.Redis.from_url(url)
    for mid in ("m3", "m4"):  # producer duplicates (the dispatcher's window would drop them)
        admin.xadd(
            upstream.stream_key("orders"), {"id": mid, "correlation_id": owner[mid], "body": "{}"}
        )
    entities_url, store_url = f"{url}?key_prefix=cli{tag}e:", f"{url}?key_prefix=cli{tag}d:"
    process = _consume(
        *("--broker", f"{url}?destination=orders&group=billing&key_prefix=cli{tag}:"),
        *("--entities", entities_url, "--store", store_url),
        *("--dispatcher", f"{url}?key_prefix=cli{tag}o:"),
        *("--handler", *face, "--batch-size", "50"),
        *("--dead-letters", "dlq", "--wait", "0.2"),
    )
    try:
        stream = upstream.stream_key("orders")
        while True:  # until drained; bounded by the timeout
            groups = admin.xinfo_groups(stream)
            if groups and (groups[0]["pending"], groups[0]["lag"]) == (0, 0):
                break
            assert process.poll() is None, process.communicate()
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate()
        assert process.returncode == 0, err
        assert ("on asyncio" in err) == (face[0].endswith("async_soak_handler") or len(face) > 1)
        totals = json.loads(out.strip().splitlines()[-1])
        assert totals["acked"] == 202 and totals["nacked"] == 0
        assert totals["outcomes"] == {"processed": 200, "duplicate": 2}
        sent = [
            {
                "id": fields[b"id"].decode(),
                "destination": "audit",
                "body": json.loads(fields[b"body"]),
                "headers": json.loads(fields[b"headers"]),
            }
            for _, fields in admin.xrange(f"cli{tag}o:audit")
        ]
        with open_entity_store(entities_url) as entities, open_store(store_url) as dedup:
            assert soak_violations(owner, entities, dedup, sent) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        upstream.close()
        admin.close()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--handler", "tests.no_such_module:f"), "cannot import the handler's module"),
        (("--handler", "tests.soak_worker:nothing"), "has no 'nothing'"),
        (("--handler", "nocolon"), "must be 'module:function'"),
        (("--max-deliveries", "3"), "--dead-letters DEST"),
    ],
)
def test_consume_refuses_bad_arguments_with_exit_2(
    redis_server: Server, args: tuple[str, ...], error: str
) -> None:
    given = dict(zip(args[::2], args[1::2], strict=True))
    handler = given.pop("--handler", "tests.soak_worker:soak_handler")
    extra = [x for pair in given.items() for x in pair]
    process = _consume(
        *("--broker", f"{redis_server.url}?stream=s-{uuid.uuid4().hex}&group=g"),
        *("--entities", "memory://x", "--store", "memory://x", "--handler", handler),
        *("--no-dispatcher", "--allow-memory"),
        *extra,
    )
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2, (out, err)
    assert error in err and "Traceback" not in err, err


def _closed_port_broker(scheme: str) -> str:
    """A broker URL on a loopback port nobody listens on."""
    from tests.servers import HOST, free_port

    port = free_port()
    if scheme == "kafka":
        return f"kafka://{HOST}:{port}?topic=orders&group=billing&timeout=3"
    return f"amqp://guest:guest@{HOST}:{port}/%2F?queue=orders&connect_timeout=3"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("face", [(), ("--asyncio",)], ids=["sync", "asyncio"])
@pytest.mark.parametrize("scheme", ["kafka", "amqp"])
def test_an_unreachable_broker_fails_at_open_in_one_line(
    scheme: str, face: tuple[str, ...], tmp_path: Path
) -> None:
    """No broker on the port: exit 3 in one line, the driver's logs quiet (librdkafka
    printed every 50 ms and never exited; pika printed 14 lines before the error); on
    asyncio too (aio-pika, AIOConsumer)."""
    db = f"sqlite:///{tmp_path / 'd.db'}"
    process = _consume(
        *("--broker", _closed_port_broker(scheme), "--entities", db, "--store", db),
        *("--handler", "tests.soak_worker:soak_handler", "--no-dispatcher"),
        *("--start-timeout", "0", *face),
    )
    out, err = process.communicate(timeout=100)
    assert process.returncode == 3, (out, err)
    lines = err.strip().splitlines()
    assert lines[-1].startswith("dedupstore: store unavailable"), err
    assert len(lines) == 1, err  # nothing else: no driver log, no second copy of it
    assert "Traceback" not in err


def _start_in_outage(redis_server: Server, proxy: TcpProxy, *args: str) -> subprocess.Popen[str]:
    """``consume`` with its stores behind ``proxy`` (down), reading a fresh stream."""
    tag = uuid.uuid4().hex[:8]
    stores = proxy.url(redis_server.url)
    return _consume(
        *("--broker", f"{redis_server.url}?stream=s-{tag}&group=g"),
        *(
            "--entities",
            f"{stores}?key_prefix=out{tag}e:",
            "--store",
            f"{stores}?key_prefix=out{tag}d:",
        ),
        *("--handler", "tests.soak_worker:soak_handler", "--no-dispatcher", "--wait", "0.2"),
        *args,
    )


def _waiting_lines(process: subprocess.Popen[str], count: int) -> list[str]:
    """The first ``count`` 'cannot start yet' lines ``process`` writes on stderr."""
    assert process.stderr is not None
    lines: list[str] = []
    while len(lines) < count:
        line = process.stderr.readline()
        assert line, f"stderr ended; so far {lines}"
        if "cannot start yet" in line:
            lines.append(line)
    return lines


@pytest.mark.timeout(120)
def test_consume_started_during_a_store_outage_waits_it_out(redis_server: Server) -> None:
    """A consumer (re)started while its stores are down (a supervisor's restart in an
    outage) waits, one WARNING line per try, and then consumes; it used to exit 3 at
    once (a chaos run's replacement consumer died so)."""
    with TcpProxy.for_url(redis_server.url) as proxy:
        proxy.outage("refuse")
        process = _start_in_outage(redis_server, proxy)
        try:
            lines = _waiting_lines(process, 2)
            assert "WARNING" in lines[0] and "--start-timeout" in lines[0], lines
            assert process.poll() is None
            proxy.restore()
            assert process.stderr is not None
            while "dedupstore consume: broker" not in process.stderr.readline():
                assert process.poll() is None
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=60)
            assert process.returncode == 0, err
            assert json.loads(out.strip().splitlines()[-1])["failures"] == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.mark.timeout(120)
def test_consume_gives_up_after_the_start_timeout_and_stops_on_sigterm_while_waiting(
    redis_server: Server,
) -> None:
    """After ``--start-timeout`` of tries it exits 3 (the last error in one line); a
    SIGTERM while it waits ends it at once with exit 0 and nothing printed on stdout."""
    with TcpProxy.for_url(redis_server.url) as proxy:
        proxy.outage("refuse")
        process = _start_in_outage(redis_server, proxy, "--start-timeout", "5s")
        out, err = process.communicate(timeout=60)
        assert process.returncode == 3, err
        assert err.strip().splitlines()[-1].startswith("dedupstore: store unavailable"), err
        assert "cannot start yet" in err and out == ""
        process = _start_in_outage(redis_server, proxy, "--start-timeout", "10m")
        _waiting_lines(process, 1)
        process.send_signal(signal.SIGTERM)
        # it would wait 10 minutes: ending within communicate's timeout shows it stopped
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert out == ""


def _bad_args(redis_server: Server, *args: str) -> tuple[int, str, str]:
    process = _consume(
        *("--broker", f"{redis_server.url}?stream=s-{uuid.uuid4().hex}&group=g"), *args
    )
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


@pytest.mark.parametrize(
    ("module", "error"),
    [
        ("x = (\n", "SyntaxError"),
        ("import no_such_module_at_all\n", "ModuleNotFoundError: No module named"),
        ("raise RuntimeError('boom at import')\n", "RuntimeError: boom at import"),
    ],
)
def test_a_handler_that_cannot_run_is_reported_in_one_line_with_exit_2(
    redis_server: Server, tmp_path: Path, module: str, error: str
) -> None:
    name = f"h_{uuid.uuid4().hex[:8]}"
    (ROOT / f"{name}.py").write_text(module)
    try:
        code, out, err = _bad_args(
            redis_server,
            *("--entities", f"{redis_server.url}?key_prefix=x:", "--store", redis_server.url),
            *("--handler", f"{name}:handle", "--no-dispatcher"),
        )
    finally:
        (ROOT / f"{name}.py").unlink()
    assert code == 2, (out, err)
    assert error in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


_SQLITE = ("--entities", "sqlite:///{db}", "--store", "sqlite:///{db}")


@pytest.mark.parametrize(
    ("args", "error"),
    [
        # no dispatcher: refused before anything is read (it saved a state change first)
        ((*_SQLITE,), "--dispatcher"),
        # memory:// stores: refused unless asked
        (("--entities", "memory://x", "--store", "sqlite:///{db}", "--no-dispatcher"), "memory"),
        (("--entities", "sqlite:///{db}", "--store", "memory://x", "--no-dispatcher"), "memory"),
        (
            (*_SQLITE, "--dispatcher", "memory://x"),
            "--allow-memory",
        ),
        (
            (*_SQLITE, "--no-dispatcher", "--dead-letters", "dlq"),
            "give --dispatcher URL",
        ),
        (
            (*_SQLITE, "--no-dispatcher", "--wait", "soon"),
            "--wait",
        ),
    ],
)
def test_consume_refuses_what_would_fail_later(
    redis_server: Server, tmp_path: Path, args: tuple[str, ...], error: str
) -> None:
    db = tmp_path / "d.db"
    code, out, err = _bad_args(
        redis_server,
        *(a.format(db=db) for a in args),
        *("--handler", "tests.soak_worker:soak_handler"),
    )
    assert code == 2, (out, err)
    assert error in err and "Traceback" not in err, err
    assert not db.exists(), "nothing opened"


@pytest.mark.timeout(120)
def test_consume_takes_config_and_durations_prints_a_start_line_and_totals_on_an_error(
    redis_server: Server, tmp_path: Path
) -> None:
    """``--entities config --store config`` (as every other command takes them), a
    ``--wait`` of ``200ms``; one start line naming what it reads; a handler that sends
    under ``--no-dispatcher`` ends the loop with exit 2, the totals printed still."""
    tag = uuid.uuid4().hex[:8]
    url = redis_server.url
    upstream = open_dispatcher(url, key_prefix=f"cfg{tag}:")
    upstream.dispatch([OutgoingMessage("m1", "orders", {}, {"correlation_id": "e1"})])
    upstream.close()
    (tmp_path / "dedupstore.toml").write_text(
        f'[default]\nurl = "sqlite:///{tmp_path / "d.db"}"\n'
        f'entities_url = "sqlite:///{tmp_path / "e.db"}"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "dedupstore.cli", "consume"),
            *("--broker", f"{url}?destination=orders&group=g&consumer=c1&key_prefix=cfg{tag}:"),
            *("--entities", "config", "--store", "config", "--endpoint", "accounts"),
            *("--handler", "tests.soak_worker:soak_handler", "--no-dispatcher"),
            *("--wait", "200ms", "--cleanup", "deferred"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = process.communicate(timeout=100)
    assert process.returncode == 2, (out, err)
    start = [line for line in err.splitlines() if line.startswith("dedupstore consume:")]
    assert len(start) == 1, err
    for part in (f"stream cfg{tag}:orders", "group g", "consumer c1", "endpoint accounts"):
        assert part in start[0], start
    assert "cleanup deferred" in start[0] and "dispatcher none" in start[0], start
    assert "--no-dispatcher was given" in err.splitlines()[-1] and "Traceback" not in err
    totals = json.loads(out.strip().splitlines()[-1])  # the failed round included
    assert (totals["rounds"], totals["fetched"]) == (1, 1), totals
    assert totals["acked"] == 0 and totals["nacked"] == 1 and "outcomes" in totals, totals
