"""One connection object per server and process, shared by the clients of that server.

On every network backend, and on SQLite (whose "server" is the file: one
``sqlite3`` connection per thread), the deduplication store and the entity store of one
server (and, on Redis, the dispatcher) share one pool or driver client in a
process: reference counted, closed by the close of the last client, made anew in
a child after ``fork``; a ``client`` the user gives is never closed by us.
"""

from __future__ import annotations

import os
import pickle
import uuid
from typing import Any

import pytest
import redis

from dedupstore import client as client_module
from dedupstore.client import Client
from dedupstore.errors import StoreUnavailable
from dedupstore.registry import open_url
from tests.outbox_backends import OutboxBackend, backend_params

SHARING = ("postgres", "redis", "dynamodb", "cosmos", "sqlite")

#: A connection option no other client of the session has: clients left open by other
#: tests of the same process must not share (and so count) these tests' connections.
_ALONE = {"connect_timeout": 3 + uuid.uuid4().int % 10**6 / 10**7}


def _alone(backend: OutboxBackend) -> dict[str, Any]:
    """:data:`_ALONE` where the backend has servers (each SQLite test has files of its own)."""
    return {} if backend.name == "sqlite" else _ALONE


network = pytest.mark.parametrize("outbox_backend", backend_params(SHARING), indirect=True)


def _shared(client: Client) -> Any:
    """The connection object ``client`` uses in this process."""
    return client.connection


def _holders(client: Client) -> int:
    """How many open clients of this process hold ``client``'s connection."""
    handle = client._connection_handle
    slot = None if handle is None else client_module._shared.get(handle.key)
    return 0 if slot is None or slot.pid != os.getpid() else slot.refs


def _works(backend: OutboxBackend, *clients: Client) -> None:
    """A round trip on each client."""
    for c in clients:
        if hasattr(c, "add_many"):
            mid = uuid.uuid4().hex
            assert c.add_many([mid]) == {mid}  # type: ignore[attr-defined]
            assert c.processed_among([mid]) == {mid}  # type: ignore[attr-defined]
        else:
            eid = uuid.uuid4().hex
            assert c.load_many([eid])[eid].version is None  # type: ignore[attr-defined]


@network
def test_the_stores_of_one_server_share_one_connection(outbox_backend: OutboxBackend) -> None:
    entities, dedup, again = (
        outbox_backend.entities(**_alone(outbox_backend)),
        outbox_backend.dedup(**_alone(outbox_backend)),
        outbox_backend.dedup(**_alone(outbox_backend)),
    )
    shared = _shared(entities)
    assert _shared(dedup) is shared and _shared(again) is shared
    assert _holders(dedup) == 3
    _works(outbox_backend, entities, dedup, again)
    entities.close()
    dedup.close()
    assert _holders(again) == 1
    _works(outbox_backend, again)  # the last holder's connection is still open
    again.close()
    assert _holders(again) == 0  # the last close closed it: a new client makes a new one
    fresh = outbox_backend.dedup(**_alone(outbox_backend))
    try:
        assert _shared(fresh) is not shared
        _works(outbox_backend, fresh)
    finally:
        fresh.close()


@network
def test_other_connection_options_get_their_own_connection(
    outbox_backend: OutboxBackend,
) -> None:
    dedup = outbox_backend.dedup(**_alone(outbox_backend))
    slower = outbox_backend.dedup(timeout=29, **_alone(outbox_backend))
    try:
        assert _shared(slower) is not _shared(dedup)
        _works(outbox_backend, dedup, slower)
    finally:
        dedup.close()
        slower.close()


@network
def test_a_failed_open_releases_the_connection_it_made(
    outbox_backend: OutboxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base's open (``Client.__init__`` running ``_open`` under ``_opening``) gives
    back what a failing ``_open`` took, on every backend: no backend writes it."""
    entities = outbox_backend.entities(**_alone(outbox_backend))
    probe = outbox_backend.dedup(**_alone(outbox_backend))
    probe.close()
    cls = type(probe)
    real_open, held = cls._open, []

    def failing_open(self: Client) -> None:
        real_open(self)  # type: ignore[arg-type]
        held.append(_holders(self))
        raise StoreUnavailable("the server went away just after the open")

    try:
        assert _holders(entities) == 1
        with monkeypatch.context() as patch, pytest.raises(StoreUnavailable, match="went away"):
            patch.setattr(cls, "_open", failing_open)
            outbox_backend.dedup(**_alone(outbox_backend))
        assert held == [2]  # the failed open shared the entity store's connection...
        assert _holders(entities) == 1  # ...and gave it back
        dedup = outbox_backend.dedup(**_alone(outbox_backend))
        assert _holders(entities) == 2
        _works(outbox_backend, entities, dedup)
        dedup.close()
    finally:
        entities.close()


@network
def test_a_copy_unpickled_in_the_same_process_shares_the_connection(
    outbox_backend: OutboxBackend,
) -> None:
    dedup = outbox_backend.dedup(**_alone(outbox_backend))
    copy = pickle.loads(pickle.dumps(dedup))
    try:
        assert _shared(copy) is _shared(dedup)
        assert _holders(dedup) == 2
    finally:
        copy.close()
        dedup.close()


@network
def test_a_forked_child_makes_its_own_and_leaves_the_parents_alone(
    outbox_backend: OutboxBackend,
) -> None:
    entities, dedup = (
        outbox_backend.entities(**_alone(outbox_backend)),
        outbox_backend.dedup(**_alone(outbox_backend)),
    )
    _works(outbox_backend, entities, dedup)
    parent_id = id(_shared(dedup))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            mine = _shared(dedup)
            ok = id(mine) != parent_id and _shared(entities) is mine and _holders(dedup) == 2
            _works(outbox_backend, entities, dedup)
            entities.close()
            dedup.close()
            code = 0 if ok else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"\x00", "the child did not get a connection of its own"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert id(_shared(dedup)) == parent_id
    _works(outbox_backend, entities, dedup)  # the child's close left the parent's alone
    entities.close()
    dedup.close()


@pytest.mark.parametrize("outbox_backend", backend_params(("redis",)), indirect=True)
def test_the_redis_dispatcher_shares_the_stores_connection(
    outbox_backend: OutboxBackend,
) -> None:
    dedup = outbox_backend.dedup(**_alone(outbox_backend))
    url = outbox_backend.dedup_url.split("?")[0]
    dispatcher = open_url(
        "dispatcher", f"{url}?key_prefix=out{uuid.uuid4().hex[:8]}:", **_alone(outbox_backend)
    )
    try:
        assert _shared(dispatcher) is _shared(dedup)  # type: ignore[arg-type]
    finally:
        dispatcher.close()  # type: ignore[attr-defined]
        dedup.close()


@pytest.mark.redis
@pytest.mark.parametrize("outbox_backend", backend_params(("redis",)), indirect=True)
def test_a_given_client_is_shared_only_where_the_connection_options_agree(
    outbox_backend: OutboxBackend,
) -> None:
    """Clients given one ``redis.Redis`` share a connection only with the same retries
    and replica waits: those shape the connection's own calls (its retries, its WAIT)."""
    given = redis.Redis.from_url(outbox_backend.dedup_url.split("?")[0])
    one = outbox_backend.dedup(client=given, retries=0)
    two = outbox_backend.dedup(client=given, retries=0)
    more = outbox_backend.dedup(client=given, retries=3)
    try:
        assert _shared(one) is _shared(two)
        assert _shared(more) is not _shared(one)
        assert (_shared(one)._attempts, _shared(more)._attempts) == (1, 4)
        _works(outbox_backend, one, more)
    finally:
        for client in (one, two, more):
            client.close()
        assert given.ping(), "a given client is never closed"
        given.close()
