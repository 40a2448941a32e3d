"""Chaos on a FastStream subscriber made exactly-once: the Redis Streams chaos of
``tests/test_consumer_chaos.py`` (consumer processes SIGKILLed at random and replaced,
every message produced one to three times, the oversize poison message, the stores'
server and then the dispatcher's refusing connections for a while), with FastStream
services (``tests/faststream_worker.py``) in place of ``dedupstore consume``; the same
exact check against the plain model.

What differs is FastStream's: the input is in FastStream's envelope (the message id in
its ``message_id`` header, the entity in ``entity``), a killed consumer's entries are
claimed by the recovering subscribers (``min_idle_time`` 1 s), and an outage nacks a
delivery (it stays pending and is claimed again) instead of holding it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from faststream.redis import RedisBroker

from tests.consume_worker import PAUSE_FILE, PAUSE_FILE_ENV
from tests.servers import Server
from tests.test_consumer_chaos import DEAD_LETTERS, KILLS, OVERSIZE, ROOT, Chaos, _with

pytestmark = [pytest.mark.redis, pytest.mark.slow]


class FastStreamChaos(Chaos):
    """The chaos run, its consumers FastStream services."""

    def produce(self, count: int) -> int:
        if not self.owner:  # FastStream would create the group at "$", after the input
            self.admin.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        first = len(self.owner)
        fresh = {f"m{n}": f"e{self.rng.randrange(200)}" for n in range(first, first + count)}
        self.owner.update(fresh)
        # (the anti-test: one copy of each, so a delivery acked and then killed is lost
        # for sure: no other copy can make up for it)
        copies = (1,) if self.variant == "ack-first" else (1, 2, 2, 3)
        deliveries = [(m, c) for m, c in fresh.items() for _ in range(self.rng.choice(copies))]
        self.rng.shuffle(deliveries)
        entries: list[tuple[str, str, Any]] = []
        for mid, cid in deliveries:
            entries.append((mid, cid, {}))
            if mid in ("m10", "m1500"):  # the oversize message, with each copy of these
                entries.append((OVERSIZE[0], OVERSIZE[1], json.loads(OVERSIZE[2])))
        encoded = asyncio.run(_envelopes(self.url, entries))
        pipe = self.admin.pipeline(transaction=False)
        for data in encoded:
            pipe.xadd(self.stream, {"__data__": data})
        pipe.execute()
        return len(deliveries)

    def start(self, log_dir: Path) -> None:
        name = f"c{len(self.logs)}"
        self.names[name] = len(self.processes)
        out = self.out_proxy.url(self.url)
        log = log_dir / f"consumer-{len(self.logs)}.log"
        self.logs.append(log)
        command = [
            *(sys.executable, "-m", "tests.faststream_worker"),
            *("--broker", self.url, "--stream", self.stream, "--group", self.group),
            *("--consumer", name, "--entities", self.entities_url, "--store", self.store_url),
            *("--dispatcher", _with(out, key_prefix=self.out_prefix, dedupe_window=0)),
            *("--dead-letters", DEAD_LETTERS, "--cleanup", self.cleanup),
            *(("--ack-first",) if self.variant == "ack-first" else ()),
        ]
        # (the anti-test's worker marks its window while the pause file exists)
        env = {**os.environ, "PYTHONPATH": str(ROOT), PAUSE_FILE_ENV: str(log_dir / PAUSE_FILE)}
        with log.open("wb") as sink:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=sink)
        self.processes.append(process)


async def _envelopes(url: str, entries: list[tuple[str, str, Any]]) -> list[bytes]:
    """Each ``(id, entity, body)`` as FastStream's Redis publisher encodes it."""
    broker = RedisBroker(url)
    fmt = broker.message_format
    return [
        await fmt.encode(
            message=body,
            reply_to=None,
            headers={"message_id": mid, "entity": cid},
            correlation_id=mid,
        )
        for mid, cid, body in entries
    ]


@pytest.mark.timeout(300)
def test_faststream_subscribers_killed_at_random_change_nothing(
    redis_server: Server, tmp_path: Path
) -> None:
    run = FastStreamChaos(redis_server.url, "single", "inline", "", "faststream")
    try:
        run.run(tmp_path)
        assert run.killed >= KILLS
        assert run.violations() == []
    finally:
        run.close()


@pytest.mark.timeout(300)
def test_the_faststream_chaos_catches_a_subscriber_that_acks_first(
    redis_server: Server, tmp_path: Path
) -> None:
    """ANTI-TEST: a subscriber that acknowledges on receipt (``AckPolicy.ACK_FIRST``)
    loses the messages its killed consumers were running."""
    run = FastStreamChaos(redis_server.url, "single", "inline", "ack-first", "faststream-broken")
    try:
        run.run(tmp_path)
        assert any("lost" in v for v in run.violations()), run.violations()
    finally:
        run.close()
