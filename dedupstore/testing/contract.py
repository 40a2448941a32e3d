"""The deduplication store contract as pytest base classes.

Subclass :class:`DeduplicationStoreContract` (and :class:`MultiProcessContract` for
stores that live outside the process) and provide one fixture, ``store_factory``:
a callable ``(**options) -> DeduplicationStore`` where every call opens a NEW
client of the SAME fresh, empty storage, reserved for the current test. Options
passed by the suite are the common ones: ``endpoint``, ``retention``, and ``clock``
for stores whose ``expiry_clock`` is ``"client"`` (server-clock stores are tested
in real time with retentions of a few seconds).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest

from dedupstore.entities import EntityStore
from dedupstore.errors import ConfigurationError, InvalidMessageId, StoreClosed
from dedupstore.store import MAX_ID_BYTES, DeduplicationStore
from dedupstore.tokens import TokenStore

__all__ = [
    "HOSTILE_IDS",
    "INVALID_IDS",
    "DeduplicationStoreContract",
    "FakeClock",
    "MultiProcessContract",
    "StoreFactory",
    "Timeline",
    "closing_clients",
    "random_valid_ids",
    "run_concurrently",
]

StoreFactory = Callable[..., DeduplicationStore]
T = TypeVar("T")
C = TypeVar("C", bound=DeduplicationStore | EntityStore | TokenStore)


class FakeClock:
    """A settable wall clock (epoch seconds) for retention tests; picklable."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, delta: timedelta | float) -> None:
        """Move the clock forward by ``delta``."""
        self.now += delta.total_seconds() if isinstance(delta, timedelta) else delta


#: Valid ids that break naive key schemes; each must round-trip and never collide.
HOSTILE_IDS: tuple[str, ...] = (
    *("plain", "Plain", "PLAIN", "plain ", " plain", "plain\t", "plain\n"),  # case, spaces
    *("a/b", "a\\b", "a?b", "a#b", "a*b", "a:b", "a::b", "a%b"),  # separators
    *("%s", "%(id)s", "%2F", "a b"),  # format and percent-encoding syntax
    *("'", '"', "';", "'; DROP TABLE dedup_records; --", '"; DROP TABLE "dedup_records"; --'),
    *("*", "?", "[abc]", "[a-z]*?", "{hash}", "{hash}:tail", "a{b}c", "$1", "${HOME}"),
    *("..", ".", "/", "//", "\\", "#", "\r\n", "\x01\x02\x7f"),  # paths, control characters
    *("é", "e\u0301", "ß", "SS", "İ", "i̇"),  # composed, decomposed, case folding
    *("日本語のメッセージ", "🦄", "🦄🦄🦄 unicorns"),  # wide and astral characters
    *("\u200b", "\ufeffbom", "\U0010ffff"),  # invisible, byte order mark, the last code point
    *("null", "None", "0", "-1", "true"),  # what a careless decoder turns into a value
    *("x" * 255, "x" * 256, "y" * MAX_ID_BYTES, "é" * (MAX_ID_BYTES // 2)),  # lengths
    *("🦄" * (MAX_ID_BYTES // 4), "a/b?c#d*e:f\\g" * 50),
)

#: Values that must raise ``InvalidMessageId`` before any I/O, with why.
INVALID_IDS: tuple[tuple[str, object], ...] = (
    ("empty string", ""),
    ("None", None),
    ("int", 42),
    ("float", 1.5),
    ("bytes", b"msg-1"),
    ("NUL character", "msg\x00-1"),
    ("lone high surrogate", "msg-\ud800"),
    ("lone low surrogate", "\udfff"),
    ("1025 UTF-8 bytes", "z" * (MAX_ID_BYTES + 1)),
    ("1026 UTF-8 bytes of 2-byte chars", "é" * (MAX_ID_BYTES // 2 + 1)),
    ("tuple", ("a",)),
)


def random_valid_ids(count: int, seed: int = 1234) -> list[str]:
    """Return ``count`` distinct, valid, varied ids (ASCII, BMP, astral, long)."""
    rng = random.Random(seed)
    alphabets = [
        [chr(c) for c in range(0x20, 0x7F)],
        [chr(c) for c in range(0xA0, 0x800)],
        [chr(c) for c in range(0x3000, 0x9FFF, 7)],
        [chr(c) for c in range(0x1F300, 0x1FAFF, 3)],
    ]
    result: dict[str, None] = {}
    while len(result) < count:
        alphabet = rng.choice(alphabets)
        length = rng.choice([1, 2, 5, 16, 64, 200, 256])
        candidate = "".join(rng.choice(alphabet) for _ in range(length))
        while len(candidate.encode()) > MAX_ID_BYTES:
            candidate = candidate[:-1]
        result[candidate] = None
    return list(result)


def run_concurrently(task: Callable[[int], T], count: int) -> list[T]:
    """Run ``task(0..count-1)`` in threads released together; re-raise any error."""
    barrier = threading.Barrier(count)

    def start(index: int) -> T:
        barrier.wait(timeout=60)
        return task(index)

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(start, range(count)))


class Timeline:
    """Opens stores on a clock tests can move: a FakeClock, or real time (server clocks).

    ``unit`` is the retention the tests use: an hour on a fake clock, two seconds in
    real time (where :meth:`advance` sleeps).
    """

    def __init__(self, factory: StoreFactory, clock: FakeClock | None) -> None:
        self._factory = factory
        self._clock = clock
        self.fake = clock is not None
        self.unit = timedelta(hours=1) if self.fake else timedelta(seconds=2)

    def store(self, **options: object) -> DeduplicationStore:
        """A new client; client-clock stores get the fake clock."""
        if self._clock is not None:
            options["clock"] = self._clock
        return self._factory(**options)

    def advance(self, delta: timedelta) -> None:
        """Move the fake clock, or sleep."""
        if self._clock is not None:
            self._clock.advance(delta)
        else:
            time.sleep(delta.total_seconds())


def _unique(prefix: str = "m") -> str:
    return f"{prefix}-{uuid.uuid4()}"


def closing_clients(factory: Callable[..., C]) -> Iterator[Callable[..., C]]:
    """``factory``, every client it opens closed when the test ends (a fixture's body)."""
    opened: list[C] = []

    def open_client(**options: object) -> C:
        opened.append(factory(**options))
        return opened[-1]

    try:
        yield open_client
    finally:
        for client in opened:
            client.close()


class DeduplicationStoreContract:
    """The whole store contract of DESIGN.md section 2.

    Provide ``store_factory``; everything else is inherited.
    """

    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        """Open a new client of this test's fresh storage: override in the subclass."""
        raise NotImplementedError("provide a store_factory fixture")

    @pytest.fixture
    def clients(self, store_factory: StoreFactory) -> Iterator[StoreFactory]:
        """``store_factory``, every store it opens closed after the test."""
        yield from closing_clients(store_factory)

    @pytest.fixture
    def store(self, clients: StoreFactory) -> DeduplicationStore:
        """A store on the default endpoint, closed after the test."""
        return clients()

    @pytest.fixture
    def clock(self) -> FakeClock:
        """A settable clock, starting at the real time."""
        return FakeClock()

    # ------------------------------------------------------------------ basics

    def test_add_records_once(self, store: DeduplicationStore) -> None:
        mid = _unique()
        assert store.add(mid) is True
        assert store.add(mid) is False
        assert store.add(mid) is False

    def test_has_been_processed(self, store: DeduplicationStore) -> None:
        mid = _unique()
        assert store.has_been_processed(mid) is False
        assert (mid in store) is False
        store.add(mid)
        assert store.has_been_processed(mid) is True
        assert (mid in store) is True

    def test_add_many_returns_recorded_ids(self, store: DeduplicationStore) -> None:
        old, new = _unique("old"), [_unique("new") for _ in range(5)]
        store.add(old)
        assert store.add_many([old, *new]) == set(new)
        assert store.add_many([old, *new]) == set()

    def test_add_many_with_duplicates_inside_the_batch(self, store: DeduplicationStore) -> None:
        a, b = _unique(), _unique()
        assert store.add_many([a, b, a, a, b]) == {a, b}
        assert store.processed_among([a, b, a]) == {a, b}

    def test_empty_batches(self, store: DeduplicationStore) -> None:
        assert store.add_many([]) == set()
        assert store.add_many(iter(())) == set()
        assert store.processed_among([]) == set()

    def test_processed_among(self, store: DeduplicationStore) -> None:
        done = [_unique() for _ in range(10)]
        fresh = [_unique() for _ in range(10)]
        store.add_many(done)
        assert store.processed_among(done + fresh) == set(done)
        assert store.processed_among(fresh) == set()

    def test_add_many_accepts_any_iterable(self, store: DeduplicationStore) -> None:
        ids = [_unique() for _ in range(12)]
        assert store.add_many(m for m in ids[:3]) == set(ids[:3])
        assert store.add_many(tuple(ids[3:6])) == set(ids[3:6])
        assert store.add_many(set(ids[6:9])) == set(ids[6:9])
        assert store.add_many(dict.fromkeys(ids[9:]).keys()) == set(ids[9:])
        assert store.processed_among(iter(ids)) == set(ids)

    def test_batches_larger_than_the_backend_limit(self, store: DeduplicationStore) -> None:
        size = max(store.max_write_batch, store.max_read_batch) * 2 + 7
        ids = [f"big-{uuid.uuid4()}" for _ in range(size)]
        # the same id in two chunks must be reported once, by the first chunk
        batch = [*ids, ids[0], ids[-1], *ids[:5]]
        assert store.add_many(batch) == set(ids)
        assert store.processed_among([*ids, "absent-" + ids[0]]) == set(ids)
        assert store.add_many(iter(batch)) == set()

    def test_single_id_string_is_not_a_batch(self, store: DeduplicationStore) -> None:
        with pytest.raises(InvalidMessageId):
            store.add_many("abc")
        with pytest.raises(InvalidMessageId):
            store.processed_among("abc")
        assert store.processed_among(["a", "b", "c", "abc"]) == set()

    # ------------------------------------------------------------------ consistency

    def test_visible_to_another_client(self, clients: StoreFactory) -> None:
        writer, reader = clients(), clients()
        mid, batch = _unique(), [_unique() for _ in range(20)]
        assert not reader.has_been_processed(mid)
        writer.add(mid)
        assert reader.has_been_processed(mid)
        assert reader.add(mid) is False
        writer.add_many(batch)
        assert reader.processed_among(batch) == set(batch)

    def test_endpoint_isolation(self, clients: StoreFactory) -> None:
        orders, billing = clients(endpoint="orders"), clients(endpoint="billing")
        mid = _unique()
        assert orders.add(mid) is True
        assert billing.has_been_processed(mid) is False
        assert billing.add(mid) is True
        assert orders.add(mid) is False
        assert orders.endpoint == "orders"

    def test_endpoint_names_do_not_collide_with_ids(self, clients: StoreFactory) -> None:
        pairs = [("a", "b:c"), ("a:b", "c"), ("a/b", "c"), ("a", "b/c"), ("a\\", "b"), ("a", "\\b")]
        stores = {ep: clients(endpoint=ep) for ep, _ in pairs}
        for ep, mid in pairs:
            assert stores[ep].add(mid) is True, (ep, mid)
        for ep, mid in pairs:
            others = [m for e, m in pairs if e == ep and m != mid]
            assert stores[ep].processed_among([mid, *others, "b", "c"]) == {mid, *others}

    def test_default_endpoint_is_default(self, store: DeduplicationStore) -> None:
        assert store.endpoint == "default"

    def test_concurrent_add_first_writer_wins(self, clients: StoreFactory) -> None:
        ids = [_unique("race") for _ in range(40)]
        stores = [clients() for _ in range(6)]

        def run(index: int) -> list[str]:
            order = ids[:]
            random.Random(index).shuffle(order)
            return [m for m in order if stores[index].add(m)]

        results = run_concurrently(run, len(stores))
        winners = [m for r in results for m in r]
        assert sorted(winners) == sorted(ids), "each id must be recorded by exactly one add"

    def test_concurrent_add_many_first_writer_wins(self, clients: StoreFactory) -> None:
        ids = [_unique("race") for _ in range(300)]
        stores = [clients() for _ in range(4)]

        def run(index: int) -> set[str]:
            rng = random.Random(index)
            return stores[index].add_many(rng.sample(ids, 200) + rng.sample(ids, 50))

        results = run_concurrently(run, len(stores))
        union = set().union(*results)
        assert sum(len(r) for r in results) == len(union), "an id was reported by two callers"
        assert stores[0].processed_among(ids) == union

    def test_store_is_shared_by_threads(self, store: DeduplicationStore) -> None:
        ids = [_unique() for _ in range(60)]
        results = run_concurrently(lambda _: [m for m in ids if store.add(m)], 4)
        assert sorted(m for wins in results for m in wins) == sorted(ids)

    # ------------------------------------------------------------------ ids

    @pytest.mark.parametrize("mid", HOSTILE_IDS, ids=range(len(HOSTILE_IDS)))
    def test_hostile_id_round_trips(self, store: DeduplicationStore, mid: str) -> None:
        assert store.has_been_processed(mid) is False
        assert store.add(mid) is True
        assert store.has_been_processed(mid) is True
        assert store.processed_among([mid]) == {mid}
        assert store.add(mid) is False

    def test_hostile_ids_never_collide(self, store: DeduplicationStore) -> None:
        assert store.add_many(HOSTILE_IDS) == set(HOSTILE_IDS)
        assert store.processed_among(HOSTILE_IDS) == set(HOSTILE_IDS)
        for mid in HOSTILE_IDS:
            assert store.add(mid) is False
        near_misses = {m + "~" for m in HOSTILE_IDS if len(m.encode()) < MAX_ID_BYTES}
        assert store.processed_among(near_misses) == set()

    def test_varied_ids_round_trip_exactly(self, store: DeduplicationStore) -> None:
        ids = random_valid_ids(300)
        assert store.add_many(ids[:150]) == set(ids[:150])
        assert all(store.add(m) for m in ids[150:200])
        assert store.processed_among(ids) == set(ids[:200])
        assert all(store.has_been_processed(m) for m in ids[:200])

    def test_longest_valid_ids(self, store: DeduplicationStore) -> None:
        longest = ["q" * MAX_ID_BYTES, "é" * (MAX_ID_BYTES // 2), "🦄" * (MAX_ID_BYTES // 4)]
        for mid in longest:
            assert len(mid.encode()) == MAX_ID_BYTES
            assert store.add(mid) is True
        assert store.processed_among(longest) == set(longest)
        assert store.processed_among([m[:-1] for m in longest]) == set()

    def test_str_subclass_is_accepted_as_plain_str(self, store: DeduplicationStore) -> None:
        class Tagged(str):
            pass

        mid = Tagged(_unique())
        assert store.add(mid) is True
        (stored,) = store.processed_among([str(mid)])
        assert type(stored) is str

    @pytest.mark.parametrize(("why", "bad"), INVALID_IDS, ids=[w for w, _ in INVALID_IDS])
    def test_invalid_id_rejected_and_nothing_written(
        self, store: DeduplicationStore, why: str, bad: object
    ) -> None:
        good = _unique("good")
        calls: list[Callable[[], object]] = [
            lambda: store.add(bad),  # type: ignore[arg-type]
            lambda: store.has_been_processed(bad),  # type: ignore[arg-type]
            lambda: bad in store,
            lambda: store.add_many([good, bad]),  # type: ignore[list-item]
            lambda: store.add_many(m for m in [good, bad]),  # type: ignore[misc]
            lambda: store.processed_among([good, bad]),  # type: ignore[list-item]
        ]
        for call in calls:
            with pytest.raises(InvalidMessageId) as info:
                call()
            assert isinstance(info.value, ValueError)
            assert str(info.value), "the message must say what is wrong"
        assert store.has_been_processed(good) is False, "a batch with a bad id wrote something"
        assert store.add(good) is True

    def test_invalid_ids_are_rejected_before_any_io(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        store.close()
        # closed store: any I/O would fail differently; validation must come first
        with pytest.raises(InvalidMessageId):
            store.add("")
        with pytest.raises(InvalidMessageId):
            store.add_many(["ok", None])  # type: ignore[list-item]

    @pytest.mark.parametrize("endpoint", ["", None, 7, "a\x00b", "\ud800"])
    def test_invalid_endpoint_is_a_configuration_error(
        self, store_factory: StoreFactory, endpoint: object
    ) -> None:
        with pytest.raises(ConfigurationError):
            store_factory(endpoint=endpoint)

    def test_options_given_as_strings_convert(self, clients: StoreFactory) -> None:
        store = clients(endpoint="strings", retention="2h")
        assert store.retention == timedelta(hours=2)
        assert store.endpoint == "strings"

    @pytest.mark.parametrize("option", ["no_such_option", "create_schema_typo"])
    def test_unknown_option_is_a_configuration_error(
        self, store_factory: StoreFactory, option: str
    ) -> None:
        with pytest.raises(ConfigurationError, match=option):
            store_factory(**{option: "1"})

    @pytest.mark.parametrize(
        "retention",
        [timedelta(0), timedelta(seconds=-5), "soon", -1, "99999999999d", float("inf"), 10**20],
    )
    def test_invalid_retention_is_a_configuration_error(
        self, store_factory: StoreFactory, retention: object
    ) -> None:
        with pytest.raises(ConfigurationError):
            store_factory(retention=retention)

    # ------------------------------------------------------------------ retention
    # Client-clock stores get a FakeClock and hour-long retentions; server-clock stores
    # (the server judges expiry) get real time and retentions of a few seconds.

    @pytest.fixture
    def timeline(self, clients: StoreFactory, clock: FakeClock) -> Timeline:
        """Opens stores on a clock the test can move (fake, or real for server clocks)."""
        kind = type(clients()).expiry_clock
        return Timeline(clients, clock if kind == "client" else None)

    def test_without_retention_records_never_expire(self, timeline: Timeline) -> None:
        store = timeline.store()
        mid = _unique()
        store.add(mid)
        timeline.advance(timeline.unit * 200 * 24 * 365 if timeline.fake else timeline.unit * 1.3)
        assert store.has_been_processed(mid)
        assert store.purge_expired() == 0
        assert store.has_been_processed(mid)

    def test_retention_expires_records(self, timeline: Timeline) -> None:
        store = timeline.store(retention=timeline.unit)
        assert store.retention == timeline.unit
        mid, batch = _unique(), [_unique() for _ in range(5)]
        store.add(mid)
        store.add_many(batch)
        timeline.advance(timeline.unit * 0.5)
        assert store.has_been_processed(mid)
        assert store.processed_among(batch) == set(batch)
        assert store.add(mid) is False
        timeline.advance(timeline.unit * 0.75)
        assert not store.has_been_processed(mid)
        assert mid not in store
        assert store.processed_among([mid, *batch]) == set()

    def test_endpoints_lists_those_holding_live_records(self, timeline: Timeline) -> None:
        # names of any text (a Redis key escapes ':', '%', '{', '}'); others' records may be
        # in the store too: only these names are checked
        kept = [_unique("ep"), _unique("e:p%3A{x}"), _unique("é/\\*?[")]
        empty, short = _unique("empty"), _unique("short")
        stores = [timeline.store(endpoint=name) for name in kept]
        stores.append(timeline.store(endpoint=empty))
        stores.append(timeline.store(endpoint=short, retention=timeline.unit))
        for store in stores[:3]:
            store.add_many([_unique(), _unique()])
        stores[4].add(_unique())
        listed = stores[3].endpoints()
        if type(stores[3])._endpoints is DeduplicationStore._endpoints:
            assert listed is None, "a backend that cannot list its endpoints says None"
            return
        assert listed is not None
        assert {*kept, short} <= listed, "every endpoint with a record, not only its own"
        assert empty not in listed, "an endpoint without records is not listed"
        timeline.advance(timeline.unit * 1.25)
        listed = stores[0].endpoints()
        assert listed is not None and set(kept) <= listed
        assert short not in listed, "expired records do not count"

    def test_expired_record_is_recorded_again(self, timeline: Timeline) -> None:
        store = timeline.store(retention=timeline.unit)
        mid, batch = _unique(), [_unique() for _ in range(5)]
        store.add(mid)
        store.add_many(batch)
        timeline.advance(timeline.unit * 1.25)
        assert store.add(mid) is True
        assert store.add_many([*batch, mid]) == set(batch)
        assert store.processed_among([mid, *batch]) == {mid, *batch}
        timeline.advance(timeline.unit * 0.5)
        assert store.has_been_processed(mid), "re-recording must write a new expiry"

    def test_concurrent_re_add_of_expired_record(self, timeline: Timeline) -> None:
        ids = [_unique() for _ in range(20)]
        first = timeline.store(retention=timeline.unit)
        first.add_many(ids)
        timeline.advance(timeline.unit * 1.25)
        clients = [timeline.store(retention=timeline.unit) for _ in range(4)]
        results = run_concurrently(lambda i: [m for m in ids if clients[i].add(m)], len(clients))
        assert sorted(m for r in results for m in r) == sorted(ids)

    def test_a_reader_without_retention_sees_the_writers_expiry(self, timeline: Timeline) -> None:
        writer = timeline.store(retention=timeline.unit)
        reader = timeline.store()  # no retention of its own
        mid = _unique()
        writer.add(mid)
        assert reader.has_been_processed(mid)
        timeline.advance(timeline.unit * 1.25)
        assert not reader.has_been_processed(mid)
        assert reader.processed_among([mid]) == set()
        assert reader.add(mid) is True
        timeline.advance(timeline.unit * (24 * 3650 if timeline.fake else 1.3))
        assert reader.has_been_processed(mid), "a record without retention never expires"

    def test_purge_expired(self, timeline: Timeline) -> None:
        store = timeline.store(retention=timeline.unit)
        other = timeline.store(endpoint="other", retention=timeline.unit)
        old = [_unique("old") for _ in range(7)]
        store.add_many(old)
        other.add_many(old)
        timeline.advance(timeline.unit * 0.75)
        young = [_unique("young") for _ in range(3)]
        store.add_many(young)
        timeline.advance(timeline.unit * 0.5)
        purged = store.purge_expired()
        # a server that expires records itself (Redis) has nothing left to purge
        assert purged == len(old) or (not timeline.fake and purged == 0)
        assert store.purge_expired() == 0
        assert store.processed_among(old + young) == set(young)
        assert other.processed_among(old) == set()
        assert other.purge_expired() in ({len(old)} if timeline.fake else {0, len(old)})

    # ------------------------------------------------------------------ lifecycle

    def test_pickles_by_configuration(self, store: DeduplicationStore) -> None:
        mid = _unique()
        store.add(mid)
        clone = pickle.loads(pickle.dumps(store))
        try:
            assert clone is not store
            assert type(clone) is type(store)
            assert clone.endpoint == store.endpoint
            assert clone.has_been_processed(mid)
            assert clone.add(mid) is False
            fresh = _unique()
            assert clone.add(fresh) is True
            assert store.has_been_processed(fresh)
        finally:
            clone.close()

    def test_pickled_store_keeps_endpoint_and_retention(self, clients: StoreFactory) -> None:
        clone = pickle.loads(pickle.dumps(clients(endpoint="pickled", retention=timedelta(days=2))))
        assert clone.endpoint == "pickled"
        assert clone.retention == timedelta(days=2)
        clone.close()

    def test_close_is_idempotent_and_final(self, store_factory: StoreFactory) -> None:
        with store_factory() as store:
            store.add(_unique())
        assert store.closed
        store.close()
        for call in (
            lambda: store.add(_unique()),
            lambda: store.add_many([_unique()]),
            lambda: store.processed_among([_unique()]),
            lambda: store.has_been_processed(_unique()),
            store.purge_expired,
            store.health_warnings,
        ):
            with pytest.raises(StoreClosed):
                call()

    def test_repr_names_the_class_and_endpoint(self, clients: StoreFactory) -> None:
        store = clients(endpoint="repr-endpoint")
        assert type(store).__name__ in repr(store)
        assert "repr-endpoint" in repr(store)


# ---------------------------------------------------------------------- processes


def _process_worker(
    store_blob: bytes, ids: list[str], seed: int, use_batches: bool, out_path: str
) -> None:
    """Add ``ids`` in a random order; append each id this process recorded to a file."""
    store: DeduplicationStore = pickle.loads(store_blob)
    order = ids[:]
    random.Random(seed).shuffle(order)
    with open(out_path, "a", encoding="utf-8") as out:
        if use_batches:
            for start in range(0, len(order), 7):
                for mid in sorted(store.add_many(order[start : start + 7])):
                    out.write(mid + "\n")
                out.flush()
        else:
            for mid in order:
                if store.add(mid):
                    out.write(mid + "\n")
                    out.flush()
    store.close()


def _acknowledging_worker(store_blob: bytes, prefix: str, out_path: str) -> None:
    """Add ids forever, writing each acknowledged id to a file, until killed."""
    store: DeduplicationStore = pickle.loads(store_blob)
    with open(out_path, "a", encoding="utf-8") as out:
        n = 0
        while True:
            n += 1
            mid = f"{prefix}-{n}"
            if n % 3:
                store.add(mid)
                out.write(mid + "\n")
            else:
                store.add_many([mid, f"{mid}-b"])
                out.write(f"{mid}\n{mid}-b\n")
            out.flush()


class MultiProcessContract:
    """Cross-process guarantees, for stores that live outside the process.

    The stores from ``store_factory`` must pickle to the same storage (no
    ``client=`` objects). Uses the ``spawn`` start method.
    """

    process_count = 4

    def test_processes_first_writer_wins(self, store_factory: StoreFactory, tmp_path: Path) -> None:
        store = store_factory()
        ids = [_unique("proc") for _ in range(120)]
        blob = pickle.dumps(store)
        ctx = multiprocessing.get_context("spawn")
        outputs = [tmp_path / f"out-{i}.txt" for i in range(self.process_count)]
        procs = [
            ctx.Process(target=_process_worker, args=(blob, ids, i, i % 2 == 1, str(outputs[i])))
            for i in range(self.process_count)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        winners = [m for path in outputs for m in path.read_text("utf-8").splitlines()]
        assert sorted(winners) == sorted(ids), "each id must be recorded by exactly one process"
        assert store.processed_among(ids) == set(ids)
        store.close()

    def test_nothing_acknowledged_is_lost_after_sigkill(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        store = store_factory()
        blob = pickle.dumps(store)
        ctx = multiprocessing.get_context("spawn")
        outputs = [tmp_path / f"ack-{i}.txt" for i in range(self.process_count)]
        prefix = _unique("kill")
        procs = [
            ctx.Process(target=_acknowledging_worker, args=(blob, f"{prefix}-{i}", str(out)))
            for i, out in enumerate(outputs)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120

        def acknowledged() -> list[str]:
            return [
                line
                for out in outputs
                if out.exists()
                for line in out.read_text("utf-8").splitlines()
            ]

        while len(acknowledged()) < 40 * self.process_count and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in procs:
            assert p.pid is not None
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=30)
        acked = acknowledged()
        assert len(acked) >= 40 * self.process_count, "workers did not make progress"
        after = store_factory()
        assert after.processed_among(acked) == set(acked)
        assert after.add(f"{prefix}-after") is True
        after.close()
        store.close()
