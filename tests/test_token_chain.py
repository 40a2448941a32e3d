"""Two services chained over Redis Streams in token mode, with ``dedupstore consume``.

Service A reads ``orders`` written by a producer outside the protocol (no tokens:
A deduplicates them in retention mode, the boundary) and sends one ``shipments``
message per order, minting a token for service B (``--subscription``). Service B
reads ``shipments`` in token mode. Producer duplicates, and a copy of one of A's
messages appended again after B consumed it (a broker duplicate), must change
nothing: B applies each order once, and after the drain no token is left and B's
deduplication store holds nothing.
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
from typing import Any

import pytest
import redis

from dedupstore import open_dispatcher, open_entity_store, open_token_store
from dedupstore.entities import OutgoingMessage
from dedupstore.outbox import Message, Send
from dedupstore.tokens import TOKEN_HEADER
from tests.servers import Server

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parent.parent


def a_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """A: records the order and ships it to its ``ship_to`` header's destination
    (default ``shipments``), B's entity being the customer."""
    seen = [*state.get("seen", []), message.id]
    to = message.headers.get("ship_to", "shipments")
    return {"seen": seen}, [
        Send(to, {"order": message.id}, {"correlation_id": f"b-{message.correlation_id}"})
    ]


def b_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """B: records each shipment's order."""
    return {"orders": [*state.get("orders", []), message.body["order"]]}, []


def consume(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "dedupstore.cli", "consume", *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def stopped(named: dict[str, subprocess.Popen[str]]) -> dict[str, Any]:
    """SIGTERM each consume process; name -> its totals line (each must exit 0)."""
    totals = {}
    for name, process in named.items():
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate()
        assert process.returncode == 0, err
        totals[name] = json.loads(out.strip().splitlines()[-1])
    return totals


def _drained(admin: redis.Redis, stream: str) -> bool:
    groups = admin.xinfo_groups(stream) if admin.exists(stream) else []
    return bool(groups) and (groups[0]["pending"], groups[0]["lag"]) == (0, 0)


def _wait(admin: redis.Redis, streams: list[str], processes: list[subprocess.Popen[str]]) -> None:
    while not all(_drained(admin, s) for s in streams):  # bounded by the test's timeout
        for process in processes:
            assert process.poll() is None, process.communicate()
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_two_services_apply_each_message_once_and_leave_no_deduplication_data(
    redis_server: Server,
) -> None:
    tag = uuid.uuid4().hex[:8]
    url = redis_server.url
    tokens_url = f"{url}?key_prefix=tk{tag}:"
    a_out, b_dedup = f"ao{tag}:", f"{url}?key_prefix=bd{tag}:"
    producer = open_dispatcher(url, key_prefix=f"in{tag}:")
    owner = {f"o{n}": f"c{n % 9}" for n in range(120)}
    orders = [OutgoingMessage(m, "orders", {}, {"correlation_id": c}) for m, c in owner.items()]
    producer.dispatch(orders)
    admin = redis.Redis.from_url(url)
    for mid in ("o3", "o4", "o5"):  # producer duplicates
        admin.xadd(
            producer.stream_key("orders"),
            {"id": mid, "correlation_id": owner[mid], "body": "{}"},
        )
    common = ("--batch-size", "20", "--wait", "0.2")
    a = consume(
        *("--broker", f"{url}?destination=orders&group=a&key_prefix=in{tag}:"),
        *("--entities", f"{url}?key_prefix=ae{tag}:", "--store", f"{url}?key_prefix=ad{tag}:"),
        *("--endpoint", "a", "--dispatcher", f"{url}?key_prefix={a_out}"),
        *("--handler", "tests.test_token_chain:a_handler", "--tokens", tokens_url),
        *("--subscription", "shipments=b", *common),
    )
    b = consume(
        *("--broker", f"{url}?destination=shipments&group=b&key_prefix={a_out}"),
        *("--entities", f"{url}?key_prefix=be{tag}:", "--store", b_dedup),
        *("--endpoint", "b", "--no-dispatcher", "--tokens", tokens_url),
        *("--handler", "tests.test_token_chain:b_handler", *common),
    )
    processes = [a, b]
    streams = [producer.stream_key("orders"), f"{a_out}shipments"]
    try:
        _wait(admin, streams, processes)
        # a broker duplicate of one of A's messages, after B consumed its token
        (first,) = admin.xrange(streams[1], count=1)
        assert TOKEN_HEADER in json.loads(first[1][b"headers"])
        admin.xadd(streams[1], first[1])
        _wait(admin, streams, processes)
        totals = stopped({"a": a, "b": b})
        assert totals["a"]["outcomes"] == {"processed": 120, "duplicate": 3}
        assert totals["b"]["outcomes"].get("processed") == 120
        assert totals["b"]["outcomes"].get("duplicate", 0) >= 1
        with open_entity_store(f"{url}?key_prefix=be{tag}:") as entities:
            shipped: list[str] = []
            for customer in sorted(set(owner.values())):
                shipped += entities.load(f"b-{customer}").state["orders"]
        assert sorted(shipped) == sorted(owner)  # each order applied once by B
        with open_token_store(tokens_url) as tokens:
            assert tokens.outstanding() == {}  # every token consumed
        assert list(admin.scan_iter(f"bd{tag}:*")) == []  # B recorded nothing
        assert list(admin.scan_iter(f"ad{tag}:*"))  # A, at the boundary, did
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
        producer.close()
        admin.close()
