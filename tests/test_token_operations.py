"""Operating token mode (issue 38): ``stats`` with a token store, the orphan report,
discarding a dead letter with its redrive token, the administrative "mint again", the
configuration key, and ``TokenStore.scan`` reading page by page.

Every test that involves a token store runs on every backend (the token store, the
entity store and the deduplication store of ``outbox_backend``); dead letters go to
the SQLite table queue, a destination that can be read back.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dedupstore import open_dispatcher, open_token_store
from dedupstore.backends.memory import MemoryTokenStore
from dedupstore.cli import main
from dedupstore.consumers._command import _close, open_processor
from dedupstore.dead_letters import DeadLetterQueue, redrive_token
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError, InvalidMessageId, TokenPresent
from dedupstore.ids import outgoing_id
from dedupstore.outbox import Message, OutboxProcessor, Send
from dedupstore.testing.contract import FakeClock
from dedupstore.token_admin import listed_tokens, mint_again, orphan_tokens
from dedupstore.tokens import TOKEN_HEADER, TokenStore, token_id
from tests.outbox_backends import OutboxBackend, backend_params

every_backend = pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "DEDUPSTORE_ENV",
        "DEDUPSTORE_URL",
        "DEDUPSTORE_CONFIG",
        "DEDUPSTORE_ENTITIES_URL",
        "DEDUPSTORE_TOKENS_URL",
    ):
        monkeypatch.delenv(var, raising=False)


class Broker:
    """A's dispatcher: keeps what it sends; refuses everything while ``down``."""

    def __init__(self) -> None:
        self.sent: list[OutgoingMessage] = []
        self.down = False

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        if self.down:
            raise ConnectionError("broker down")
        self.sent.extend(messages)


def forward(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """A: forwards its input to ``b-in``."""
    return {"n": state.get("n", 0) + 1}, [Send("b-in", {"order": message.correlation_id})]


def apply(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """B: counts what it applied; an order named ``poison`` fails."""
    if message.body["order"].startswith("poison"):
        raise ValueError("poison")
    return {"applied": state.get("applied", 0) + 1}, []


class Chain:
    """A (boundary) sends to endpoint B in token mode; B's dead letters go to ``dlq`` of
    a SQLite table queue."""

    def __init__(self, backend: OutboxBackend, tmp_path: Path) -> None:
        self.backend = backend
        self.tag = uuid.uuid4().hex[:8]
        self.b = f"B-{self.tag}"
        self.queue_url = f"sqlite:///{tmp_path}/queue-{self.tag}.db"
        self.tokens: TokenStore = backend.tokens()
        self.entities = backend.entities()
        self.broker = Broker()
        self.a = OutboxProcessor(
            self.entities,
            backend.dedup(endpoint=f"A-{self.tag}"),
            self.broker,
            tokens=self.tokens,
            subscriptions={"b-in": [self.b]},
        )
        self.queue = open_dispatcher(self.queue_url)
        self.receiver = OutboxProcessor(
            backend.entities(),
            backend.dedup(endpoint=self.b),
            self.queue,
            tokens=self.tokens,
            dead_letters="dlq",
        )

    def send(self, order: str) -> OutgoingMessage:
        """A takes input for ``order`` and dispatches one message to B; that message."""
        before = len(self.broker.sent)
        self.a.process(Message(f"in-{order}", order, {}), forward)
        (out,) = self.broker.sent[before:]
        return out

    def delivered(self, out: OutgoingMessage) -> Message:
        return Message(out.id, f"b-{out.body['order']}", out.body, dict(out.headers))

    def token_of(self, out: OutgoingMessage) -> str:
        return token_id(out.id, self.b, out.headers[TOKEN_HEADER])

    def letters(self) -> DeadLetterQueue:
        return DeadLetterQueue(self.queue, "dlq")

    def close(self) -> None:
        for processor in (self.a, self.receiver):
            processor.entities.close()  # type: ignore[attr-defined]
            processor.dedup.close()
        self.queue.close()
        self.tokens.close()


@pytest.fixture
def chain(
    outbox_backend: OutboxBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Chain]:
    if "key" in outbox_backend.options:  # the command line reads the Cosmos DB key from here
        monkeypatch.setenv("COSMOS_KEY", outbox_backend.options["key"])
    made = Chain(outbox_backend, tmp_path)
    yield made
    made.close()


def _out(capsys: pytest.CaptureFixture[str]) -> list[Any]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


# ---------------------------------------------------------------------- stats


@every_backend
def test_stats_shows_tokens_outstanding_per_endpoint_and_the_oldest(
    outbox_backend: OutboxBackend,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if "key" in outbox_backend.options:
        monkeypatch.setenv("COSMOS_KEY", outbox_backend.options["key"])
    now = time.time()
    clock = FakeClock(now - 100)
    with outbox_backend.tokens(clock=clock) as tokens:
        tokens.create({"tk-1": "ep-a", "tk-2": "ep-a"})
        clock.advance(90)
        tokens.create({"tk-3": "ep-a", "tk-4": "ep-b"})
    assert main(["stats", "--tokens", outbox_backend.tokens_url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["entities"] is None and shown["store"] is None, "only what was named"
    toks = shown["tokens"]
    assert toks["outstanding"] == 4 and 100 <= toks["oldest_age_seconds"] < 160
    assert sorted(toks["endpoints"]) == ["ep-a", "ep-b"]
    a, b = toks["endpoints"]["ep-a"], toks["endpoints"]["ep-b"]
    assert a["outstanding"] == 3 and 100 <= a["oldest_age_seconds"] < 160
    assert b["outstanding"] == 1 and 10 <= b["oldest_age_seconds"] < 70
    assert a["oldest_at"].startswith(time.strftime("%Y-", time.gmtime(now - 100)))
    assert main(["stats", "--tokens", outbox_backend.tokens_url]) == 0
    text = capsys.readouterr().out
    assert any(line.split() == ["tokens", "outstanding", "4"] for line in text.splitlines())
    assert "endpoint ep-a" in text and "3 (oldest " in text and " ago)" in text


# ---------------------------------------------------------------------- orphans


@every_backend
def test_orphans_are_old_tokens_no_entry_or_letter_names(
    chain: Chain, capsys: pytest.CaptureFixture[str]
) -> None:
    in_flight = chain.send("o1")  # dispatched: its token is named nowhere now
    chain.broker.down = True
    with pytest.raises(ConnectionError):
        chain.a.process(Message("in-o2", "o2", {}), forward)  # pending, its tokens made
    chain.broker.down = False
    poison = chain.send("poison-3")
    assert chain.receiver.process(chain.delivered(poison), apply).outcome == "dead_lettered"
    (letter,) = chain.letters().list()
    redrive = redrive_token(letter)
    assert redrive is not None and redrive.endpoint == chain.b
    chain.tokens.create({"tk-leaked": chain.b})
    pending = listed_tokens(chain.entities.load("o2"))
    assert len(pending) == 1 and chain.tokens.present_among(pending) == pending
    later = time.time() + 3600

    def orphans(**given: Any) -> set[str]:
        return {r.id for r in orphan_tokens(chain.tokens, older_than=60, now=later, **given)}

    leaked = {chain.token_of(in_flight), "tk-leaked"}
    assert orphans(entities=[chain.entities], letters=[chain.letters()]) == leaked
    assert orphans(entities=[chain.entities]) == leaked | {redrive.id}
    assert orphans(letters=[chain.letters()]) == leaked | pending
    assert orphans(entities=[chain.entities], endpoint="nobody") == set()
    young = orphan_tokens(chain.tokens, [chain.entities], older_than=3600)
    assert list(young) == [], "nothing is older than an hour yet"
    assert chain.tokens.present_among([*leaked, redrive.id, *pending]) == {
        *leaked,
        redrive.id,
        *pending,
    }, "the report deletes nothing"

    time.sleep(1.1)
    argv = ["tokens", "orphans", "--tokens", chain.backend.tokens_url]
    argv += ["--entities", chain.backend.entities_url, "--older-than", "1s"]
    argv += ["--dispatcher", chain.queue_url, "--dead-letters", "dlq"]
    assert main(argv) == 0, capsys.readouterr().err
    *rows, totals = _out(capsys)
    assert {row["id"] for row in rows} == leaked
    assert all(row["endpoint"] == chain.b and row["age_seconds"] >= 1 for row in rows)
    assert totals == {
        "orphans": 2,
        "older_than_seconds": 1.0,
        "entity_stores": 1,
        "dead_letter_destinations": 1,
    }
    assert main([*argv[:4], "--older-than", "1s"]) == 0  # no entity store, no letters
    *rows, totals = _out(capsys)
    assert {row["id"] for row in rows} == leaked | pending | {redrive.id}


def test_orphan_arguments_are_refused_before_any_io() -> None:
    store = MemoryTokenStore(f"memory://{uuid.uuid4().hex}")
    store.close()
    for bad, error in (
        ({"older_than": 0}, ConfigurationError),
        ({"older_than": -5}, ConfigurationError),
        ({"older_than": "1d"}, ConfigurationError),
        ({"older_than": float("nan")}, ConfigurationError),
        ({"older_than": 60, "endpoint": ""}, InvalidMessageId),
        ({"older_than": 60, "now": "later"}, ConfigurationError),
        ({"older_than": 60, "entities": [object()]}, ConfigurationError),
        ({"older_than": 60, "letters": [object()]}, ConfigurationError),
    ):
        with pytest.raises(error):
            orphan_tokens(store, **bad)


# ---------------------------------------------------------------------- dead letters


@every_backend
def test_purging_a_dead_letter_deletes_its_redrive_token(
    chain: Chain, capsys: pytest.CaptureFixture[str]
) -> None:
    letter_ids = []
    for n in range(3):
        out = chain.send(f"poison-{n}")
        assert chain.receiver.process(chain.delivered(out), apply).outcome == "dead_lettered"
        letter_ids.append(outgoing_id(chain.b, f"b-poison-{n}", out.id, -1))
    letters = {letter.id: letter for letter in chain.letters().list()}
    assert sorted(letters) == sorted(letter_ids)
    redrives = {lid: redrive_token(letters[lid]) for lid in letter_ids}
    ids = [r.id for r in redrives.values() if r is not None]
    assert len(ids) == 3 and chain.tokens.present_among(ids) == set(ids)
    purge = ["dead-letters", "purge", "--yes", "--dispatcher", chain.queue_url]
    purge += ["--dead-letters", "dlq"]

    # without the token store: refused, nothing purged, nothing deleted
    first = letter_ids[0]
    assert main([*purge, first]) == 2
    err = capsys.readouterr().err
    assert first in err and "redrive token" in err and "--tokens" in err
    assert len(chain.letters().list()) == 3 and chain.tokens.present_among(ids) == set(ids)

    # with it: the letter and its token go
    assert main([*purge, first, "--tokens", chain.backend.tokens_url]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "purged": 1,
        "messages_removed": 1,
        "tokens_deleted": 1,
        "tokens_left": [],
    }
    gone = redrives[first]
    assert gone is not None and not chain.tokens.present(gone.id)
    assert chain.tokens.present_among(ids) == set(ids) - {gone.id}

    # the library API
    second = letter_ids[1]
    queue = chain.letters()
    with pytest.raises(ConfigurationError, match="redrive token"):
        queue.purge([queue.get(second)])  # type: ignore[list-item]
    purged = queue.purge([queue.get(second)], tokens=chain.tokens)  # type: ignore[list-item]
    assert (purged.letters, purged.tokens_deleted) == (1, 1)
    assert queue.get(second) is None

    # leaving the token on purpose
    third = letter_ids[2]
    assert main([*purge, "--all", "--leave-tokens"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_left"] == [third]
    left = redrives[third]
    assert left is not None and chain.tokens.present_among(ids) == {left.id}
    assert chain.letters().list() == []


def test_purge_refuses_tokens_and_leave_tokens_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = f"sqlite:///{tmp_path}/nothing/queue.db"
    argv = ["dead-letters", "purge", "--all", "--yes", "--dispatcher", queue]
    argv += ["--dead-letters", "dlq", "--tokens", queue, "--leave-tokens"]
    assert main(argv) == 2
    assert "--leave-tokens" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


# ---------------------------------------------------------------------- mint again


@every_backend
def test_minting_again_lets_one_deliberate_replay_through(
    chain: Chain, capsys: pytest.CaptureFixture[str]
) -> None:
    out = chain.send("o1")
    message = chain.delivered(out)
    assert chain.receiver.process(message, apply).outcome == "processed"
    assert chain.receiver.process(message, apply).outcome == "duplicate"
    nonce, token = out.headers[TOKEN_HEADER], chain.token_of(out)

    plan = mint_again(chain.tokens, chain.b, {out.id: nonce})  # a dry run
    assert [(r.message_id, r.nonce, r.token_id, r.endpoint) for r in plan] == [
        (out.id, nonce, token, chain.b)
    ]
    assert not chain.tokens.present(token), "a dry run writes nothing"

    mint = ["tokens", "mint", "--tokens", chain.backend.tokens_url, "--endpoint", chain.b]
    mint += ["--message", f"{out.id}={nonce}"]
    assert main(mint) == 0
    captured = capsys.readouterr()
    assert "dry run" in captured.err and "applied again" in captured.err
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert lines == [
        {"message": out.id, "nonce": nonce, "token": token, "endpoint": chain.b},
        {"dry_run": True, "minted": 0},
    ]
    assert not chain.tokens.present(token)

    assert main([*mint, "--yes"]) == 0
    assert _out(capsys)[-1] == {"dry_run": False, "minted": 1}
    assert chain.tokens.present(token)
    # a token that exists is refused, naming the message, and nothing changes
    with pytest.raises(TokenPresent, match=out.id) as info:
        mint_again(chain.tokens, chain.b, [(out.id, nonce)], confirm=True)
    assert info.value.message_ids == (out.id,) and info.value.token_ids == (token,)
    assert main([*mint, "--yes"]) == 2
    assert out.id in capsys.readouterr().err

    # the replay is applied again, once
    assert chain.receiver.process(message, apply).outcome == "processed"
    assert chain.receiver.process(message, apply).outcome == "duplicate"
    assert chain.receiver.entities.load(message.correlation_id).state == {"applied": 2}
    assert not chain.tokens.present(token)


def test_mint_again_refuses_bad_input_before_any_io(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = MemoryTokenStore(f"memory://{uuid.uuid4().hex}")
    store.close()  # any I/O would raise StoreClosed
    for bad, error in (
        ({"m-1": "not a nonce!"}, InvalidMessageId),
        ({"": "abc"}, InvalidMessageId),
        ({}, ConfigurationError),
        ("m-1=abc", ConfigurationError),
        ([("m-1",)], ConfigurationError),
    ):
        with pytest.raises(error):
            mint_again(store, "ep", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidMessageId):
        mint_again(store, "", {"m-1": "abc"})
    with pytest.raises(ConfigurationError):
        mint_again(store, "ep", {"m-1": "abc"}, confirm="yes")  # type: ignore[arg-type]

    nowhere = f"sqlite:///{tmp_path}/nothing/tokens.db"
    lines = tmp_path / "replay.jsonl"
    lines.write_text('{"id": "m-1", "nonce": "abc"}\n{"id": "m-2"}\n')
    cases = [
        (["--message", "m-1=not a nonce!"], "dedupstore-token"),
        (["--message", "m-1"], "ID=NONCE"),
        ([], "--message"),
        (["--from", str(lines)], "line 2"),
        (["--from", str(tmp_path / "missing.jsonl")], "cannot read"),
    ]
    for extra, said in cases:
        argv = ["tokens", "mint", "--tokens", nowhere, "--endpoint", "ep", *extra, "--yes"]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    assert not (tmp_path / "nothing").exists(), "nothing opened, nothing created"


@pytest.mark.sqlite
def test_mint_reads_json_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/tokens.db"
    open_token_store(url).close()
    lines = tmp_path / "replay.jsonl"
    lines.write_text(
        '{"id": "m-1", "nonce": "abc"}\n\n{"id": "m=2", "headers": {"dedupstore-token": "n2"}}\n'
    )
    assert main(["tokens", "mint", "--tokens", url, "--endpoint", "ep", "--from", str(lines)]) == 0
    rows = _out(capsys)
    assert [(r.get("message"), r.get("nonce")) for r in rows[:2]] == [("m-1", "abc"), ("m=2", "n2")]
    argv = ["tokens", "mint", "--tokens", url, "--endpoint", "ep", "--message", "m=2=n2", "--yes"]
    assert main(argv) == 0
    with open_token_store(url) as tokens:
        assert tokens.present(token_id("m=2", "ep", "n2"))
        assert not tokens.present(token_id("m-1", "ep", "abc"))


# ---------------------------------------------------------------------- delete


@pytest.mark.sqlite
def test_delete_needs_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/tokens.db"
    with open_token_store(url) as tokens:
        tokens.create({"tk-1": "ep", "tk-2": "ep"})
    assert main(["tokens", "delete", "tk-1", "tk-9", "--tokens", url]) == 2
    assert "--yes" in capsys.readouterr().err
    with open_token_store(url) as tokens:
        assert tokens.present_among(["tk-1", "tk-2"]) == {"tk-1", "tk-2"}
    assert main(["tokens", "delete", "tk-1", "tk-9", "--tokens", url, "--yes"]) == 0
    assert json.loads(capsys.readouterr().out) == {"asked": 2, "deleted": 1}
    with open_token_store(url) as tokens:
        assert tokens.present_among(["tk-1", "tk-2"]) == {"tk-2"}
    nowhere = f"sqlite:///{tmp_path}/nothing/tokens.db"
    assert main(["tokens", "delete", "", "--tokens", nowhere, "--yes"]) == 2
    assert "token id" in capsys.readouterr().err
    assert main(["tokens", "orphans", "--tokens", nowhere, "--older-than", "0"]) == 2
    assert "positive" in capsys.readouterr().err
    assert main(["tokens", "orphans", "--tokens", nowhere, "--older-than", "1d"]) == 2
    assert "no such store" in capsys.readouterr().err
    argv = ["tokens", "orphans", "--tokens", url, "--older-than", "1d", "--dead-letters", "d"]
    assert main(argv) == 2
    assert "--dispatcher" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


# ---------------------------------------------------------------------- configuration


@pytest.mark.sqlite
def test_the_configuration_names_the_token_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    url = "sqlite:///conf.db"
    with open_token_store(url) as tokens:
        tokens.create({"tk-1": "ep-a"})
    config = tmp_path / "dedupstore.toml"
    config.write_text(f"[default]\nurl = '{url}'\nendpoint = 'orders'\n")
    from dedupstore import open_store

    open_store(url, endpoint="orders").close()
    assert main(["stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] is None, "none configured"
    assert main(["tokens", "orphans", "--tokens", "config", "--older-than", "1d"]) == 2
    assert "tokens_url" in capsys.readouterr().err

    config.write_text(config.read_text() + "tokens_url = 'sqlite:///conf.db'\n")
    monkeypatch.chdir(tmp_path / "sub")  # relative to the file, not to the directory
    assert main(["stats", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["store"]["endpoint"] == "orders"
    assert shown["tokens"]["url"] == f"sqlite:///{tmp_path / 'conf.db'}"
    assert shown["tokens"]["endpoints"]["ep-a"]["outstanding"] == 1
    assert main(["stats", "--store", "config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] is None, "only what is named"
    assert main(["stats", "--tokens", "config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"]["outstanding"] == 1
    assert main(["config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tokens_url"].endswith("conf.db") and shown["tokens_backend"] == (
        "SqliteTokenStore"
    )
    assert main(["tokens", "delete", "tk-1", "--tokens", "config", "--yes"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 1

    # consume / dead-letters redrive open the configured token store with --tokens config
    args = argparse.Namespace(
        handler="tests.test_token_operations:apply",
        dead_letters=None,
        no_dispatcher=True,
        dispatcher=None,
        entities=url.replace("conf", str(tmp_path / "conf")),
        store="config",
        endpoint=None,
        allow_memory=False,
        tokens="config",
        cleanup="inline",
        subscription=[],
    )
    opened: list[Any] = []
    try:
        processor, _ = open_processor(args, opened)
        assert isinstance(processor.tokens, TokenStore)
        assert processor.tokens.url == f"sqlite:///{tmp_path / 'conf.db'}"
    finally:
        _close(opened)

    # the environment variable wins, as for the other stores
    other = f"sqlite:///{tmp_path / 'other.db'}"
    open_token_store(other).close()
    monkeypatch.setenv("DEDUPSTORE_TOKENS_URL", other)
    assert main(["stats", "--tokens", "config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"]["url"] == other
    config.write_text(config.read_text() + "tokens_retention = '1d'\n")
    assert main(["stats", "--json"]) == 2
    assert "tokens_retention" in capsys.readouterr().err


# ---------------------------------------------------------------------- scan


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("memory", marks=pytest.mark.memory),
        pytest.param("sqlite", marks=pytest.mark.sqlite),
    ],
)
def test_scan_reads_a_page_at_a_time(url: str, tmp_path: Path) -> None:
    target = (
        f"memory://{uuid.uuid4().hex}" if url == "memory" else f"sqlite:///{tmp_path}/tokens.db"
    )
    with open_token_store(target) as tokens:
        tokens.__dict__["page_size"] = 5
        ids = [f"tk-{n:02}" for n in range(20)]
        tokens.create(dict.fromkeys(ids, "ep"))
        listing = tokens.scan()
        first = next(listing)
        tokens.delete([i for i in ids if i != first.id])
        rest = list(listing)
        assert len(rest) <= 4, "the pages after the first were read after the delete"
