"""Every call ends within its backend's documented deadline, whatever the server does.

Each network backend is reached through a :class:`~tests.proxy.TcpProxy`; after a
first successful call the proxy freezes the open connections (they stay open,
nothing arrives any more) and holds every new one unanswered (``outage("hang")``):
a server that stopped answering. A call must then raise ``StoreUnavailable``, and
work again once the proxy is restored.

No time is measured here. The bound is enforced the way the suite bounds every test
of a server that stops answering: by ``pytest-timeout``, here on the test function
alone (``func_only``), which holds nothing but the frozen call. Its limit is the
backend's documented deadline (asserted equal to ``_deadline_seconds()``, the one
the stores apply) plus a slack for a loaded machine: a call that outlives it fails
the test. Opening, the first call, restoring and the call that must work again
run in the fixture, outside that limit.

The same proxy also cuts every reply short (``TcpProxy.cut_replies``), as a server
killed while writing it would: reads must then raise ``StoreUnavailable`` (never
answer "not processed", a smaller set, a new entity, a shorter scan) and give their
first answers again once replies are whole; writes must report each new id
exactly once over a retry.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from dedupstore import open_dispatcher, open_entity_store, open_store
from dedupstore.client import Client
from dedupstore.entities import Entity, EntityStore, OutgoingMessage
from dedupstore.errors import StoreUnavailable
from dedupstore.store import DeduplicationStore
from tests.proxy import TcpProxy

#: Small timeouts keep the test short (1 s: at 0.5 s the calls after the outage timed out on
#: a loaded machine, 4 test workers on 2 cores); the deadline is computed from them.
TIMEOUT, CONNECT_TIMEOUT, RETRIES = 1.0, 1.0, 2
#: Added to the bound: thread scheduling and Python on a shared, loaded machine.
SLACK = 2.0


@dataclass
class Case:
    """A call to make during the outage: ``prepare()`` (before it) gives its argument."""

    name: str
    prepare: Callable[[], Any]
    call: Callable[[Any], object]


def _cases(store: DeduplicationStore, entities: EntityStore) -> dict[str, Case]:
    tag = uuid.uuid4().hex

    def loaded() -> Entity:
        entity = entities.load(f"entity-{tag}")
        entity.state["n"] = entity.state.get("n", 0) + 1
        return entity

    cases = [
        Case("add", lambda: f"id-{uuid.uuid4().hex}", store.add),
        Case("processed_among", lambda: [f"a-{tag}", f"b-{tag}"], store.processed_among),
        Case("load_many", lambda: [f"e1-{tag}", f"e2-{tag}"], entities.load_many),
        Case("save", loaded, entities.save),
    ]
    return {case.name: case for case in cases}


def _options() -> dict[str, Any]:
    return {"timeout": TIMEOUT, "connect_timeout": CONNECT_TIMEOUT, "retries": RETRIES}


#: Each backend's documented deadline with these options (README, module docstrings).
BOUNDS = {
    "redis": CONNECT_TIMEOUT + (RETRIES + 1) * TIMEOUT,
    "postgres": CONNECT_TIMEOUT + TIMEOUT + min(1.0, TIMEOUT / 2),
    "dynamodb": CONNECT_TIMEOUT + (RETRIES + 1) * TIMEOUT,
    "cosmos": CONNECT_TIMEOUT + (RETRIES + 1) * TIMEOUT,
}
CALLS = ("add", "processed_among", "load_many", "save")


@dataclass
class Opened:
    """A backend's stores behind a proxy: the calls to make during the outage."""

    proxy: TcpProxy
    clients: list[Client]
    cases: dict[str, Case]


def _open(
    backend: str, request: pytest.FixtureRequest, proxy_for: Callable[[str], TcpProxy]
) -> Opened:
    options = _options()
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        proxy = proxy_for(server.url)
        url, prefix = proxy.url(server.url), f"t-{uuid.uuid4().hex}:"
        store = open_store(url, key_prefix=f"{prefix}d:", **options)
        entities = open_entity_store(url, key_prefix=f"{prefix}e:", **options)
        dispatcher = open_dispatcher(url, key_prefix=f"{prefix}o:", **options)
        message = OutgoingMessage(f"m-{prefix}", "queue", {"n": 1})
        dispatch = Case("dispatch", lambda: [message], dispatcher.dispatch)  # type: ignore[attr-defined]
        cases = {**_cases(store, entities), "dispatch": dispatch}
        return Opened(proxy, [store, entities, dispatcher], cases)
    if backend == "postgres":
        server = request.getfixturevalue("postgres_server")
        proxy = proxy_for(server.url)
        url, suffix = proxy.url(server.url), uuid.uuid4().hex[:12]
        del options["retries"]  # PostgreSQL re-sends nothing that may have run: no retries
        store = open_store(url, table=f"deadline_d_{suffix}", create=True, **options)
        entities = open_entity_store(url, table=f"deadline_e_{suffix}", create=True, **options)
    elif backend == "dynamodb":
        server = request.getfixturevalue("dynamodb_server")
        proxy = proxy_for(server.endpoint_url)
        suffix = uuid.uuid4().hex[:12]
        query = (
            f"region={server.region}&endpoint_url={proxy.url(server.url)}"
            "&aws_access_key_id=testing&aws_secret_access_key=testing&create=true"
        )
        store = open_store(f"dynamodb://deadline-d-{suffix}?{query}", **options)
        entities = open_entity_store(f"dynamodb://deadline-e-{suffix}?{query}", **options)
    else:
        server = request.getfixturevalue("cosmos_server")
        proxy = proxy_for(server.endpoint_url)
        netloc = proxy.url(server.url).split("://", 1)[1].rstrip("/")
        query = (
            "tls=false&endpoint_discovery=false&create=true"
            "&allow_weak_consistency_for_emulator_only=true"
        )
        database, key = f"deadline-{uuid.uuid4().hex[:12]}", {"key": server.key}
        store = open_store(f"cosmos://{netloc}/{database}/d?{query}", **key, **options)
        entities = open_entity_store(f"cosmos://{netloc}/{database}/e?{query}", **key, **options)
    return Opened(proxy, [store, entities], _cases(store, entities))


@pytest.fixture(scope="module")
def opened(request: pytest.FixtureRequest) -> Iterator[Opened]:
    """The backend's stores (and dispatcher) behind a proxy, for every call of it."""
    backend: str = request.param
    proxies: list[TcpProxy] = []

    def proxy_for(url: str) -> TcpProxy:
        proxies.append(TcpProxy.for_url(url).__enter__())
        return proxies[-1]

    try:
        made = _open(backend, request, proxy_for)
        try:
            # every client applies the documented deadline (the same options: the same one)
            assert {c._deadline_seconds() for c in made.clients} == {BOUNDS[backend]}
            yield made
        finally:
            for client in made.clients:
                client.close()
    finally:
        for proxy in proxies:
            proxy.__exit__(None, None, None)


@pytest.fixture
def frozen(opened: Opened, request: pytest.FixtureRequest) -> Iterator[Case]:
    """The call's case, with the proxy frozen after a first call went through; after
    the test the proxy is restored and the call must work again."""
    case = opened.cases[request.param]
    case.call(case.prepare())  # a connection is open and has answered
    argument = case.prepare()
    opened.proxy.freeze()
    opened.proxy.outage("hang")
    try:
        yield Case(case.name, lambda: argument, case.call)
    finally:
        opened.proxy.restore()
    case.call(case.prepare())  # works again


def _params() -> list[Any]:
    params = []
    for backend, bound in BOUNDS.items():
        for name in (*CALLS, "dispatch") if backend == "redis" else CALLS:
            marks = [
                getattr(pytest.mark, backend),
                pytest.mark.timeout(bound + SLACK, func_only=True),
            ]
            params.append(pytest.param(backend, name, marks=marks, id=f"{backend}-{name}"))
    return params


@pytest.mark.parametrize(("opened", "frozen"), _params(), indirect=True)
def test_a_call_to_a_frozen_server_ends_within_its_deadline(opened: Opened, frozen: Case) -> None:
    """Only the frozen call runs here, under pytest-timeout's limit (deadline + slack)."""
    with pytest.raises(StoreUnavailable):
        frozen.call(frozen.prepare())


# --------------------------------------------------------------------------- cut replies

#: Where a reply is cut: a server killed while writing it. The client then reads
#: what was kept and an orderly end of file.
#: Every network backend, for the tests that need no bound of their own.
NETWORK_BACKENDS = [pytest.param(b, marks=getattr(pytest.mark, b), id=b) for b in BOUNDS]
CUTS: dict[str, Callable[[bytes], int]] = {
    "nothing": lambda reply: 0,
    "first-byte": lambda reply: 1,
    "half": lambda reply: len(reply) // 2,
    "all-but-one": lambda reply: len(reply) - 1,
    # HTTP: the status line and headers, no body; elsewhere a third of the reply
    "headers": lambda reply: (reply.find(b"\r\n\r\n") + 4) or len(reply) // 3,
}


C = TypeVar("C", bound=Client)


def _relaxed(client: C) -> C:
    """Another client of ``client``'s store, with the backend's default deadline."""
    options = client.options.pickled_keywords()
    for name in ("timeout", "connect_timeout", "retries"):
        options.pop(name, None)
    return type(client)(client.store_url.text, **options)


def _reads(store: DeduplicationStore, entities: EntityStore) -> dict[str, Callable[[], object]]:
    """Reads whose every shorter answer is wrong: each must raise while replies are
    cut, and give its first answer again once they are whole."""
    tag = uuid.uuid4().hex
    recorded = [f"cut-{tag}-{i}" for i in range(150)]  # two chunks on every backend
    kept = {f"ent-{tag}-{i}": Entity(f"ent-{tag}-{i}", {"n": i}) for i in range(3)}
    kept[f"ent-{tag}-0"].outbox["in-1"] = [OutgoingMessage(f"out-{tag}", "queue", {"n": 1})]
    # written by clients of the default deadlines: the data is the test's set-up, and 150
    # writes in 1 s timeouts fail on a loaded machine (the emulators answer one at a time)
    with _relaxed(store) as writer, _relaxed(entities) as entity_writer:
        writer.add_many(recorded)
        entity_writer.save_many(list(kept.values()))

    def load_state() -> object:
        return entities.load(f"ent-{tag}-0").state

    def load_many_states() -> object:
        return {eid: e.state for eid, e in entities.load_many(kept).items()}

    def pending() -> object:  # a scan: a cut page must not look like the last one
        return {e.id for e in entities.pending_outboxes() if e.id in kept}

    return {
        "has_been_processed": lambda: store.has_been_processed(recorded[0]),
        "processed_among": lambda: store.processed_among(recorded),
        "count": store.count,
        "load": load_state,
        "load_many": load_many_states,
        "pending_outboxes": pending,
    }


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("opened", NETWORK_BACKENDS, indirect=True)
def test_a_reply_cut_short_is_never_taken_for_an_answer(opened: Opened, cut: str) -> None:
    """A reply cut short (headers without their body, half a body, nothing) makes
    the call raise ``StoreUnavailable``: never "not processed", a smaller set, a
    new entity. Once replies are whole again, the same answers come back."""
    store, entities = opened.clients[0], opened.clients[1]
    assert isinstance(store, DeduplicationStore) and isinstance(entities, EntityStore)
    reads = _reads(store, entities)
    answers = {name: read() for name, read in reads.items()}
    assert answers["has_been_processed"] is True and answers["count"] is not None
    assert len(answers["processed_among"]) == 150 and answers["pending_outboxes"]  # type: ignore[arg-type]
    opened.proxy.cut_replies(CUTS[cut])
    try:
        for name, read in reads.items():
            try:
                answer = read()
            except StoreUnavailable:
                continue
            pytest.fail(f"{name} answered {answer!r:.200} from replies cut short")
    finally:
        opened.proxy.restore()
    assert {name: read() for name, read in reads.items()} == answers


@pytest.mark.parametrize("cut", ["half", "all-but-one", "headers"])
@pytest.mark.parametrize("opened", NETWORK_BACKENDS, indirect=True)
def test_a_write_whose_reply_is_cut_is_reported_new_exactly_once(opened: Opened, cut: str) -> None:
    """``add`` and ``add_many`` whose replies are cut either answer or raise
    ``StoreUnavailable``; retried on the same object once replies are whole, each
    new id is reported new exactly once over both calls."""
    store = opened.clients[0]
    assert isinstance(store, DeduplicationStore)
    tag = uuid.uuid4().hex
    one, many = f"w-{tag}", [f"w-{tag}-{i}" for i in range(5)]
    first: dict[str, bool] = {}
    opened.proxy.cut_replies(CUTS[cut])
    try:
        with contextlib.suppress(StoreUnavailable):
            first[one] = store.add(one)
        try:
            new = store.add_many(many)
            first.update((mid, mid in new) for mid in many)
        except StoreUnavailable as exc:
            first.update((mid, True) for mid in exc.recorded)
    finally:
        opened.proxy.restore()
    new_again = store.add_many(many)
    again = {one: store.add(one), **{mid: mid in new_again for mid in many}}
    for mid in [one, *many]:
        assert [first.get(mid, False), again[mid]].count(True) == 1, mid
