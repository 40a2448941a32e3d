"""The README's examples run as written and print what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.servers import Server

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.sqlite
def test_the_outbox_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(
        block for block in blocks if "OutboxProcessor(" in block and "open_broker(" not in block
    )
    script = tmp_path / "example.py"
    script.write_text(example, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["processed", "duplicate"]
    assert lines[2] == str(["processed"] * 6 + ["duplicate"])
    assert lines[3] == "0"


@pytest.mark.redis
def test_the_redis_streams_consumer_example_runs(tmp_path: Path, redis_server: Server) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(block for block in blocks if "REDIS, APP =" in block)
    assert 'REDIS, APP = "redis://localhost:6379/0", "shop"' in example
    example = example.replace(  # the test's server, and keys of this run only
        'REDIS, APP = "redis://localhost:6379/0", "shop"',
        f'REDIS, APP = "{redis_server.url}", "shop-{uuid.uuid4().hex[:8]}"',
    )
    script = tmp_path / "example.py"
    script.write_text(example, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(README.parent)}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["3", "{'total': 6}"]


@pytest.mark.rabbitmq
def test_the_rabbitmq_example_runs(tmp_path: Path, rabbitmq_server: Server) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(block for block in blocks if "open_broker(AMQP" in block)
    script = tmp_path / "example.py"
    script.write_text(example, encoding="utf-8")
    env = {**os.environ, "AMQP_URL": rabbitmq_server.url}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "3 {'processed': 2, 'duplicate': 1}",
        "{'balance': 750}",
    ]


@pytest.mark.redis
def test_the_hand_written_stream_entry_is_on_the_stream_the_broker_reads(
    redis_server: Server,
) -> None:
    """Issue 36: the README's `XADD orders ...` beside `destination=orders` was never read."""
    import shlex

    import redis

    from dedupstore.consumers import open_broker

    text = README.read_text(encoding="utf-8")
    line = re.search(r"beside `destination=(\w+)`:\n`(XADD [^`]+)`", text, re.S)
    assert line is not None, "the README's hand-written entry beside its destination"
    destination, command = line.group(1), shlex.split(line.group(2))
    group = f"g-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.delete(command[1])
        url = f"{redis_server.url}?destination={destination}&group={group}"
        with open_broker(url) as broker:
            client.execute_command(*command)
            deliveries = broker.fetch(10, 1.0)
        assert [d.headers.get("id") for d in deliveries] == ["m-1"]
        assert deliveries[0].headers.get("correlation_id") == "acct-1"
    finally:
        client.delete(command[1])
        client.close()
