"""Chaos on Redis Streams: consumer processes SIGKILLed at random and replaced.

Thousands of deliveries (each message sent one to three times by the producer,
spread over the stream) over many entities go into one stream; three consumer
processes (``dedupstore consume``, through ``tests/consume_worker.py``) read it
through one consumer group, with the entities, the deduplication store and the
outgoing stream on the same Redis. At random moments one of them is SIGKILLed and
a new one started, at least ten times; what a killed consumer held is reclaimed
by the others after the ``lease`` (1 s). Once the input has drained (nothing
pending, no lag), the survivors get SIGTERM (exit 0), and every invariant is
checked exactly against the plain model of the input by the soak's check
(``tests.soak_worker.soak_violations``): each message applied once to its entity,
the outgoing ids exactly the model's (nothing missing, no ghost), every copy of
one id identical (the dispatcher's dedupe window is off, so every re-dispatch is
in the stream), each output showing the state its message made, every id in the
deduplication store, every outbox empty after the sweep, nothing pending in the
group. In both modes (``batch``: ``process_batch``; ``single``: ``process``) and
both clean-ups.

Every kill lands while input is waiting: before a kill, 200 more messages are
produced when fewer than 200 deliveries are left (the model grows with them).

Halfway through the kills comes the outage phase: the stores' server (reached
through a TCP proxy, :class:`tests.proxy.TcpProxy`) refuses every connection for
``OUTAGE`` seconds, then the dispatcher's does. The consumers run with dead letters
and ``max_deliveries=2``, so an outage that counted against a message would set it
aside: the check requires no dead letter but one. That one is for the oversize
message in the input (``OVERSIZE``): one message whose 5 MB body the handler keeps in
its entity's state, which cannot hold it. It is delivered at least twice (with each
copy of two other messages), must be set aside as
exactly one bounded dead letter (its body replaced by size and digest), and its entity
and every other one must go on (``oversize_violations``).

The anti-tests run the same harness on two broken variants and require the check
to report what they break: a consumer that acknowledges before processing loses
messages; a processor that dispatches after its clean-up loses outgoing messages.

Sizes are reduced to stay near a minute on two shared cores: 2,000 messages or a
few hundred more (about 3,500 to 4,500 deliveries) over 200 entities per run, and
the handler pauses 2 ms per message so that a kill lands inside a batch.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from dedupstore import open_entity_store, open_store, open_token_store
from dedupstore.tokens import TOKEN_HEADER, new_nonce, token_id
from tests.consume_worker import PAUSE_FILE, PAUSE_FILE_ENV, VARIANT_ENV, window_marker
from tests.proxy import TcpProxy
from tests.servers import Server
from tests.soak_worker import soak_violations

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
MESSAGES, ENTITIES, CONSUMERS, KILLS, TOP_UP = 2000, 200, 3, 10, 200
#: The anti-tests' run: a broken variant pauses in its window (acknowledged and not
#: applied; cleaned up and not dispatched) until the last kill, so every kill lands in
#: it and one loss is all the check needs to see: three kills, over a quarter of the
#: input (the drain of 2,000 messages and ten kills took a minute per anti-test).
ANTI_KILLS, ANTI_MESSAGES = 3, 500


def planned(variant: str) -> tuple[int, int]:
    """The kills and the first input of a run: the anti-tests' shorter ones."""
    return (ANTI_KILLS, ANTI_MESSAGES) if variant else (KILLS, MESSAGES)


#: Seconds each server (the stores', then the dispatcher's) refuses connections.
OUTAGE = 10.0
#: The consumers' dead-letter destination, and how many runs make a message poison.
#: A random SIGKILL that lands while a consumer runs a message alone counts as one of
#: that message's deadly runs, exactly as a poison message's would (nothing tells them
#: apart): at 2, two of the ten kills landing in the same message's runs dead-lettered
#: a valid message (seen twice on RabbitMQ, whose requeue puts it first in the next
#: window). At 4 that takes four of the ten kills, while a consumer that counted its
#: failed rounds of an outage as deliveries would still pass 4 within the outage's 10 s.
DEAD_LETTERS, MAX_DELIVERIES = "dead", "4"
#: The oversize message: its id, its entity (one of the input's) and its body.
OVERSIZE = ("big", "e0", json.dumps({"keep": "x" * 5_000_000}))


def oversize_violations(letters: list[dict[str, Any]]) -> list[str]:
    """The dead letters (their bodies) hold the oversize message's, bounded, and no other."""
    ids = {letter["message"]["id"] for letter in letters}
    if ids != {OVERSIZE[0]}:
        return [f"dead letters for {sorted(ids)[:5]}, expected only {OVERSIZE[0]!r}"]
    if any("body_omitted" not in letter["message"] for letter in letters):
        return ["the oversize message's dead letter carries its body: not bounded"]
    return []


#: What a consumer process prints once its stores and broker are open (it reads next).
START_LINE = "dedupstore consume: broker"


#: Seconds a victim has been consuming: a kill right after a start lands again and again
#: in the first message a new consumer runs alone (a dead consumer's), which then counts
#: as poison after ``max_deliveries`` runs (one RabbitMQ run dead-lettered one so).
WARM = 1.5


def pick_victim(run: Any, killing: Path) -> Any:
    """A live consumer process of ``run`` (a chaos run: its ``rng``, ``processes``,
    ``logs``, ``consuming_since`` and ``variant``) that has been consuming (its start
    line printed) for :data:`WARM` seconds, at random: a kill then lands in its work,
    however slowly a loaded machine starts processes (a kill of one still importing
    proves nothing; the anti-tests saw only such kills under load).
    ``run.consuming_since``: pid -> when its start line was first seen. A broken
    variant's victim waits in its broken window (``consume_worker.window_marker`` of the
    pause file ``killing``). Waits for one (bounded by the test's timeout)."""
    while True:
        alive = [
            (p, log) for p, log in zip(run.processes, run.logs, strict=True) if p.poll() is None
        ]
        assert alive, "every consumer exited:\n" + "\n".join(
            log.read_text(errors="replace")[-2000:] for log in run.logs
        )
        now = time.monotonic()
        since = run.consuming_since
        for process, log in alive:
            if process.pid not in since and START_LINE in log.read_text(errors="replace"):
                since[process.pid] = now
        warm = [p for p, _ in alive if now - since.get(p.pid, now) >= WARM]
        if run.variant:
            warm = [p for p in warm if window_marker(killing, p.pid).exists()]
        if warm:
            return run.rng.choice(warm)
        time.sleep(0.05)


def outage_phase(stores: TcpProxy, dispatcher: TcpProxy, seconds: float = OUTAGE) -> None:
    """The stores' server unreachable for ``seconds`` (new connections refused, open
    ones reset), then the dispatcher's."""
    for proxy in (stores, dispatcher):
        proxy.outage("refuse")
        proxy.reset()
        time.sleep(seconds)
        proxy.restore()


def _with(url: str, **query: Any) -> str:
    return url + ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in query.items())


class Chaos:
    """One run: the input in a stream, consumer processes, kills, the drain, the check."""

    def __init__(
        self,
        redis_url: str,
        mode: str,
        cleanup: str,
        variant: str,
        seed: str,
        tokens: bool = False,
        face: str = "sync",
    ) -> None:
        self.url, self.mode, self.cleanup, self.variant = redis_url, mode, cleanup, variant
        self.handler = f"tests.consume_worker:{'async_' if face == 'async' else ''}slow_handler"
        self.rng = random.Random(seed)
        tag = uuid.uuid4().hex[:8]
        self.tag = tag
        self.stream, self.group = f"chaos{tag}:in", "billing"
        self.admin = redis.Redis.from_url(redis_url)
        self.owner: dict[str, str] = {}
        # the stores and the dispatcher reach Redis through proxies (the outage phase)
        self.store_proxy = TcpProxy.for_url(redis_url).start()
        self.out_proxy = TcpProxy.for_url(redis_url).start()
        stores = self.store_proxy.url(redis_url)
        self.entities_url = _with(stores, key_prefix=f"chaos{tag}e:")
        self.store_url = _with(stores, key_prefix=f"chaos{tag}d:")
        # token mode: the producer mints a token per message, every copy carries it
        self.tokens_url = _with(stores, key_prefix=f"chaos{tag}t:") if tokens else None
        self.nonces: dict[str, str] = {}
        self.out_prefix = f"chaos{tag}o:"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.orphaned: set[bytes] = set()  # the entries the last killed consumer held
        self.killed = 0
        self.logs: list[Path] = []
        self.consuming_since: dict[int, float] = {}  # pid -> start line first seen
        self.names: dict[str, int] = {}  # consumer name -> index in processes

    def produce(self, count: int) -> int:
        """``count`` new messages, each one to three times, the copies spread out."""
        first = len(self.owner)
        fresh = {f"m{n}": f"e{self.rng.randrange(ENTITIES)}" for n in range(first, first + count)}
        self.owner.update(fresh)
        copies = (1, 2, 2, 3)
        deliveries = [(m, c) for m, c in fresh.items() for _ in range(self.rng.choice(copies))]
        self.rng.shuffle(deliveries)
        self._mint([*fresh, OVERSIZE[0]])
        pipe = self.admin.pipeline(transaction=False)
        for mid, cid in deliveries:
            pipe.xadd(
                self.stream, {"id": mid, "correlation_id": cid, "body": "{}", **self._token(mid)}
            )
            if mid in ("m10", "m1500"):  # the oversize message, with each copy of these
                mid, cid, body = OVERSIZE
                pipe.xadd(
                    self.stream,
                    {"id": mid, "correlation_id": cid, "body": body, **self._token(mid)},
                )
        pipe.execute()
        return len(deliveries)

    def _mint(self, ids: list[str]) -> None:
        """Token mode: create the tokens of the messages ``ids`` not minted yet (the
        producer's part, at the boundary), for the consumers' endpoint."""
        if self.tokens_url is None:
            return
        fresh = {mid: new_nonce() for mid in ids if mid not in self.nonces}
        if not fresh:
            return
        self.nonces.update(fresh)
        # (straight to the server: the producer is not behind the stores' proxy)
        with open_token_store(_with(self.url, key_prefix=f"chaos{self.tag}t:")) as store:
            store.create({token_id(mid, "default", n): "default" for mid, n in fresh.items()})

    def _token(self, mid: str) -> dict[str, str]:
        """The entry field carrying ``mid``'s token (none in retention mode)."""
        return {TOKEN_HEADER: self.nonces[mid]} if mid in self.nonces else {}

    def start(self, log_dir: Path) -> None:
        name = f"c{len(self.logs)}"  # a name per process: what a killed one held is reclaimed
        self.names[name] = len(self.processes)
        broker = _with(self.url, stream=self.stream, group=self.group, lease=1, consumer=name)
        out = self.out_proxy.url(self.url)
        dispatcher = _with(out, key_prefix=self.out_prefix, dedupe_window=0)
        log = log_dir / f"consumer-{len(self.logs)}.log"
        self.logs.append(log)
        command = [
            *(sys.executable, "-m", "tests.consume_worker"),
            *("--broker", broker, "--entities", self.entities_url, "--store", self.store_url),
            *("--dispatcher", dispatcher, "--handler", self.handler),
            *("--mode", self.mode, "--cleanup", self.cleanup, "--batch-size", "20"),
            *("--dead-letters", DEAD_LETTERS, "--max-deliveries", MAX_DELIVERIES),
            *("--wait", "0.2", "--log-level", "WARNING"),
            *(("--tokens", self.tokens_url) if self.tokens_url else ()),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            VARIANT_ENV: self.variant,
            PAUSE_FILE_ENV: str(log_dir / PAUSE_FILE),
        }
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
        self.processes.append(process)

    def wait_until_consuming(self, within: float = 60.0) -> None:
        """Until every live consumer process has opened its stores: it printed its start
        line (printed once they are open), or the group shows it. Not the group alone:
        Redis 7.0 lists a consumer only once a read gave it an entry, and a replacement
        started while the others drain the stream may find nothing to read (this wait
        then timed out once, with the group at (0, 0)). After ``within`` seconds, fail
        naming those that are not up, with the group's view."""
        deadline = time.monotonic() + within
        while True:
            seen = {c["name"].decode() for c in self.admin.xinfo_consumers(self.stream, self.group)}
            live = {n for n, i in self.names.items() if self.processes[i].poll() is None}
            texts = {n: self.logs[self.names[n]].read_text(errors="replace") for n in live}
            started = {n for n, text in texts.items() if START_LINE in text}
            if live <= seen | started:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"consumers {sorted(live - seen - started)} never came up in {within:.0f} s "
                    f"(seen: {sorted(seen)}; group: {self.group_state()})\n{self._log_tail()}"
                )
            time.sleep(0.05)

    def group_state(self) -> tuple[int, int]:
        """(pending, lag) of the group; (-1, -1) before a consumer created it."""
        try:
            groups = self.admin.xinfo_groups(self.stream)
        except redis.ResponseError:
            return -1, -1
        for group in groups:
            if group["name"].decode() == self.group:
                return int(group["pending"]), int(group["lag"] or 0)
        return -1, -1

    def held_by(self, name: str) -> set[bytes]:
        """The ids of the entries consumer ``name`` holds pending (delivered, not acked)."""
        held = self.admin.xpending_range(self.stream, self.group, "-", "+", 10_000, name)
        return {entry["message_id"] for entry in held}

    def wait_for_reclaim(self) -> None:
        """Wait until every entry the last killed consumer held was acked by another.

        ``--max-deliveries 2``: a valid message delivered to two consumers that are both
        killed while running it is set aside as poison, by design (a crash counts as a
        delivery); the chaos kills one consumer at a time so that never happens. Bounded
        by the test's timeout."""
        while self.orphaned:
            pending = self.admin.xpending_range(self.stream, self.group, "-", "+", 100_000)
            self.orphaned &= {entry["message_id"] for entry in pending}
            if self.orphaned:
                time.sleep(0.05)

    def run(self, log_dir: Path) -> None:
        """Start the consumers, kill and replace one at random, drain, stop.

        The kills and the first input are :func:`planned`. A broken variant's pause
        (``PAUSE_FILE_ENV``) lasts until the last kill."""
        killing = log_dir / PAUSE_FILE
        killing.touch()
        kills, messages = planned(self.variant)
        self.produce(messages)
        for _ in range(CONSUMERS):
            self.start(log_dir)
        while self.group_state() == (-1, -1):
            time.sleep(0.05)
        while self.killed < kills:
            time.sleep(self.rng.uniform(0.1, 0.3))
            if self.group_state()[1] < TOP_UP:  # every kill lands while there is work
                self.produce(TOP_UP)
            if not self.variant:  # (a broken variant pauses in its batches until the end)
                self.wait_for_reclaim()  # no entry dies with two consumers (2 deliveries)
            victim = pick_victim(self, killing)
            victim.send_signal(signal.SIGKILL)
            assert victim.wait() == -signal.SIGKILL
            self.killed += 1
            name = next(n for n, i in self.names.items() if self.processes[i] is victim)
            self.orphaned = self.held_by(name)
            self.start(log_dir)
            if self.killed == kills // 2 and not self.variant:  # (the anti-tests: kills)
                if self.group_state()[1] < TOP_UP:  # the outage lands while there is work
                    self.produce(TOP_UP)
                self.wait_until_consuming()  # one that cannot open its stores exits
                outage_phase(self.store_proxy, self.out_proxy)
        killing.unlink()
        while self.group_state() != (0, 0):  # drained: bounded by the test's timeout
            time.sleep(0.1)
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            code = process.wait()
            # 0: stopped by SIGTERM after its batch; a replacement still starting (its
            # handlers not installed yet, nothing in flight) dies of the SIGTERM itself
            assert code in (0, -signal.SIGKILL, -signal.SIGTERM), self._log_tail()

    def _log_tail(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-2000:] for log in self.logs)

    def violations(self) -> list[str]:
        """The soak's check against the model, plus: nothing pending in the group."""
        sent = []
        for _, fields in self.admin.xrange(f"{self.out_prefix}audit"):
            sent.append(
                {
                    "id": fields[b"id"].decode(),
                    "destination": "audit",
                    "body": json.loads(fields[b"body"]),
                    "headers": json.loads(fields[b"headers"]),
                }
            )
        entities = open_entity_store(self.entities_url)
        dedup = open_store(self.store_url)
        tokens = open_token_store(self.tokens_url) if self.tokens_url else None
        try:
            # token mode: the oversize message's dead letter keeps its redrive's token
            found = soak_violations(
                self.owner, entities, dedup, sent, tokens=tokens, letters=1 if tokens else 0
            )
        finally:
            entities.close()
            dedup.close()
            if tokens is not None:
                tokens.close()
        pending, lag = self.group_state()
        if (pending, lag) != (0, 0):
            found.append(f"the group holds {pending} pending and {lag} undelivered entries")
        letters = self.admin.xrange(f"{self.out_prefix}{DEAD_LETTERS}")
        found += oversize_violations([json.loads(fields[b"body"]) for _, fields in letters])
        return found

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.admin.close()
        self.store_proxy.close()
        self.out_proxy.close()


@pytest.fixture
def chaos(redis_server: Server, tmp_path: Path) -> Any:
    runs: list[Chaos] = []

    def make(
        mode: str, cleanup: str, variant: str = "", tokens: bool = False, face: str = "sync"
    ) -> Chaos:
        seed = f"{mode}-{cleanup}-{variant}-{tokens}-{face}"
        run = Chaos(redis_server.url, mode, cleanup, variant, seed, tokens, face)
        runs.append(run)
        run.run(tmp_path)
        return run

    yield make
    for run in runs:
        run.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["batch", "single"])
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_consumers_killed_at_random_change_nothing(chaos: Any, mode: str, cleanup: str) -> None:
    run = chaos(mode, cleanup)
    assert run.killed >= KILLS
    assert run.violations() == []


@pytest.mark.timeout(240)
def test_consumers_killed_at_random_change_nothing_in_token_mode(chaos: Any) -> None:
    """The same chaos, every message carrying a token: nothing left in either store."""
    run = chaos("batch", "inline", tokens=True)
    assert run.killed >= KILLS
    assert run.violations() == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "cleanup"), [("batch", "inline"), ("single", "deferred")])
def test_async_consumers_killed_at_random_change_nothing(
    chaos: Any, mode: str, cleanup: str
) -> None:
    """The same chaos with an ``async def`` handler: the consumers run the async face
    (``dedupstore consume`` on asyncio, :class:`~dedupstore.aio.AsyncConsumer`)."""
    run = chaos(mode, cleanup, face="async")
    assert run.killed >= KILLS
    assert run.violations() == []
    starts = [log.read_text(errors="replace") for log in run.logs]
    assert all("on asyncio" in text for text in starts if START_LINE in text)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("variant", "cleanup", "expected"),
    [
        ("ack-first", "inline", "messages lost"),
        ("dispatch-after-cleanup", "deferred", "outgoing messages missing"),
    ],
)
def test_the_chaos_check_catches_a_broken_async_consumer(
    chaos: Any, variant: str, cleanup: str, expected: str
) -> None:
    """The anti-tests on the async face: ``redis.asyncio``'s broker acknowledging on
    receipt; its processor dispatching after the clean-up."""
    run = chaos("batch", cleanup, variant, face="async")
    assert any(expected in v for v in run.violations())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("variant", "cleanup", "expected"),
    [
        ("ack-first", "inline", "messages lost"),
        ("dispatch-after-cleanup", "deferred", "outgoing messages missing"),
    ],
)
def test_the_chaos_check_catches_a_broken_consumer(
    chaos: Any, variant: str, cleanup: str, expected: str
) -> None:
    run = chaos("batch", cleanup, variant)
    found = run.violations()
    assert any(expected in v for v in found), found
