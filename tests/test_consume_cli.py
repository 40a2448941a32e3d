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
def test_consume_runs_until_sigterm_and_exits_0(redis_server: Server) -> None:
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
        *("--handler", "tests.soak_worker:soak_handler", "--batch-size", "50"),
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
        *extra,
    )
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2, (out, err)
    assert error in err and "Traceback" not in err, err
