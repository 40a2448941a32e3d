"""The Redis entity store: :class:`RedisEntityStore`.

Layout (``key_prefix`` ``dedupent:`` by default; keys: see :mod:`.redis._client`):

* one hash per entity, ``<key_prefix>e:<id>`` (the id escaped), with the fields ``b`` (the canonical
  JSON body), ``v`` (the version: 1, 2, 3, ... per save), ``t`` (the random write token of the save
  that wrote it), ``p`` (``1`` while the outbox is not empty, else ``0``) and ``i`` (``1`` while the
  id is in its bucket's set);
* one set per bucket, ``<key_prefix>pending:<bucket>`` (``bucket_of(id)``, 0..4095), holding the ids
  of the entities of that bucket whose outbox is not empty, and of some whose outbox emptied since
  the last scan (see below);
* one set ``<key_prefix>pending-buckets`` of the buckets whose set is not empty (the scan's index).

Token: the version. A save is one ``EVALSHA`` per chunk of up to 500 entities and 16 MiB of bodies
(Redis runs a script atomically: a few ms for 500 small entities). For each entity the script
compares the stored version with the one the entity was loaded at (absent when ``None``) and either
writes body, version + 1, token and pending flag, or leaves it alone (a conflict). A pending entity
whose hash does not say ``i = 1`` also joins its bucket's set (and the bucket the index); an entity
whose outbox empties stays in the set: a save costs one read and one write of the hash, plus the
sets only when an entity becomes pending for the first time since it was pruned. Every key is
checked before any is written: a foreign key fails the whole chunk, nothing half-written. Loads: one
pipelined ``HMGET b v`` per id, 100 ids per round trip (a hash without those two fields loads as
absent; saving it is refused).

Lost answers: an entity whose hash already holds this save's token was written by an earlier attempt
and is reported as saved. A re-sent script that meets an entity whose version moved on cannot tell
"another client saved first" from "our lost attempt wrote it and someone saved on top": it writes
nothing and the save raises ``StoreUnavailable`` (outcome unknown: reload before saving again).

Scan: segment ``s`` of ``n`` reads the index (``SMEMBERS``) and walks the sets of its non-empty
buckets ``b % n == s`` with ``SSCAN`` (64 buckets per pipelined round trip), reading the bodies a
page of 100 ids at a time (one pipelined ``HMGET`` per id). The ids of a page whose entity is gone
or no longer pending are pruned by one script per page (:data:`_PRUNE_SCRIPT`), so the sets hold the
pending entities plus those that stopped being pending since the last scan of their bucket (ids
only). Memory: one page of bodies plus the ids of one round of buckets.

Size limit: 4 MiB of JSON per entity (``max_entity_bytes``): Redis takes values up to 512 MB, but an
entity is read whole by every load and scan, and a chunk travels in one command: 4 MiB keeps a page
of a scan and a script call within tens of MiB.

Options and errors: see :mod:`.redis._client` (after ``StoreUnavailable`` the outcome of a save is
unknown).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from dedupstore.backend import (
    Connected,
    DeduplicationStore,
    EntityRecord,
    EntityStore,
    OptionSet,
    Steps,
    StoreUnavailable,
    TokenStore,
    TokenWrites,
    WriteRequest,
    groups_by_size,
    io,
    write_token,
)

from ._client import (
    CONNECTION_OPTIONS,
    RedisConnection,
    escape,
    foreign_value_error,
    key_prefix_option,
)
from .store import ADD_SCRIPT, RedisDeduplicationStore
from .tokens import RedisTokenStore, token_value

__all__ = ["RedisEntityStore", "buckets_key", "entity_key", "pending_key"]

# KEYS[1..n]: the entity keys; KEYS[n+1..2n]: the pending set of each entity's bucket; KEYS[2n+1]:
# the set of buckets whose pending set is not empty (the scan's index). ARGV[1]: this save's write
# token; ARGV[2]: '1' when an earlier attempt of this very call may have run (its answer was lost);
# then 4 per entity: the expected version ('' = absent, else '=' .. version), '1'/'0' (pending), the
# id, the body. Returns {1, i, version, ...} for the entities saved (now, or by the earlier attempt:
# their hash holds this token), or {0} having written nothing when a re-sent call meets an entity
# that moved on (its lost attempt may have written it). No keys: a probe. A pending entity joins its
# bucket's set unless its hash says it is there (i = 1); only a scan's prune removes ids.
_SAVE_SCRIPT = """
if #KEYS == 0 then return {} end
local n = (#KEYS - 1) / 2
local index = KEYS[#KEYS]
local token, resent = ARGV[1], ARGV[2] == '1'
local result, todo, versions, joins = {1}, {}, {}, {}
local function foreign(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'hash' then
    return redis.error_reply('DEDUPSTORE key ' .. string.sub(key, 1, 200)
      .. ' holds a hash dedupstore did not write')
  end
  return redis.error_reply('WRONGTYPE key ' .. string.sub(key, 1, 200) .. ' holds a '
    .. kind .. ', not a dedupstore entity')
end
for i = 1, n do
  local key = KEYS[i]
  local at = 3 + (i - 1) * 4
  local expected, pending = ARGV[at], ARGV[at + 1] == '1'
  -- one call for a hash of ours; another only for an absent key (or a foreign one)
  local fields = redis.pcall('HMGET', key, 'v', 't', 'i')
  if fields['err'] then return foreign(key) end
  if not fields[1] and not fields[2] then
    if redis.call('EXISTS', key) == 1 then return foreign(key) end
    if expected == '' then
      todo[#todo + 1] = i
      versions[i] = 1
      joins[i] = pending
    end
  else
    local version = tonumber(fields[1])
    if not version then return foreign(key) end
    if fields[2] == token then
      result[#result + 1] = i
      result[#result + 1] = version
    elseif expected == '=' .. fields[1] then
      todo[#todo + 1] = i
      versions[i] = version + 1
      joins[i] = pending and fields[3] ~= '1'
    elseif resent then
      return {0}
    end
  end
end
-- every set written is checked before anything is written
local checked, gained = {}, {}
for _, i in ipairs(todo) do
  local set = KEYS[n + i]
  if joins[i] and not checked[set] then
    gained[#gained + 1] = string.match(set, '(%d+)$')
    for _, key in ipairs({set, index}) do  -- the index once per call
      if not checked[key] then
        checked[key] = true
        local kind = redis.call('TYPE', key)['ok']
        if kind ~= 'none' and kind ~= 'set' then
          return redis.error_reply('WRONGTYPE key ' .. string.sub(key, 1, 200) .. ' holds a '
            .. kind .. ', not a dedupstore pending set')
        end
      end
    end
  end
end
for _, i in ipairs(todo) do
  local at = 3 + (i - 1) * 4
  if joins[i] then
    redis.call('HSET', KEYS[i], 'b', ARGV[at + 3], 'v', versions[i], 't', token,
      'p', '1', 'i', '1')
    redis.call('SADD', KEYS[n + i], ARGV[at + 2])
  else
    redis.call('HSET', KEYS[i], 'b', ARGV[at + 3], 'v', versions[i], 't', token,
      'p', ARGV[at + 1])
  end
  result[#result + 1] = i
  result[#result + 1] = versions[i]
end
for first = 1, #gained, 1000 do
  redis.call('SADD', index, unpack(gained, first, math.min(first + 999, #gained)))
end
return result
"""


# KEYS[1..n]: entity keys; KEYS[n+1..2n]: the pending set each id was found in; KEYS[2n+1]: the
# index. ARGV[1..n]: the ids. Removes from its set each id whose entity is not pending (gone, or p
# is not 1: an entity of ours then forgets it is in the set), then the buckets left empty from the
# index; a foreign key is left alone. Returns the number of ids removed.
_PRUNE_SCRIPT = """
if #KEYS == 0 then return 0 end
local n = (#KEYS - 1) / 2
local index = KEYS[#KEYS]
local removed, shrunk, seen = 0, {}, {}
for i = 1, n do
  local pending = redis.pcall('HGET', KEYS[i], 'p')
  if type(pending) ~= 'table' and pending ~= '1' then
    local set = KEYS[n + i]
    removed = removed + redis.call('SREM', set, ARGV[i])
    if pending then redis.call('HDEL', KEYS[i], 'i') end
    if not seen[set] then
      seen[set] = true
      shrunk[#shrunk + 1] = set
    end
  end
end
local emptied = {}
for _, set in ipairs(shrunk) do
  if redis.call('SCARD', set) == 0 then
    emptied[#emptied + 1] = string.match(set, '(%d+)$')
  end
end
for first = 1, #emptied, 1000 do
  redis.call('SREM', index, unpack(emptied, first, math.min(first + 999, #emptied)))
end
return removed
"""


#: The deduplication store's write script, then the save script, in one. KEYS: the add's keys, then
#: the save's; ARGV: the number of the add's keys and of its arguments, its arguments, then the
#: save's. An add error returns before the save runs; it answers ``{add's answer, save's answer}``.
#: Redis runs it atomically: the record and the entity are written together or, on a save error (a
#: foreign key), the record alone, as two calls in turn would.
_JOINT_SCRIPT = f"""
local function add(KEYS, ARGV)
{ADD_SCRIPT}
end
local function save(KEYS, ARGV)
{_SAVE_SCRIPT}
end
local nkeys, nargs = tonumber(ARGV[1]), tonumber(ARGV[2])
local add_keys, add_args, save_keys, save_args = {{}}, {{}}, {{}}, {{}}
for i = 1, #KEYS do
  local into = i <= nkeys and add_keys or save_keys
  into[#into + 1] = KEYS[i]
end
for i = 3, #ARGV do
  local into = i - 2 <= nargs and add_args or save_args
  into[#into + 1] = ARGV[i]
end
local added = add(add_keys, add_args)
if added['err'] then return added end
local saved = save(save_keys, save_args)
if saved['err'] then return saved end
return {{added, saved}}
"""


#: The save script of one entity, unless the deduplication store holds the record of the message
#: applied to it. KEYS: the save's, then the record key; ARGV: the save's. Returns ``{2}`` having
#: written nothing when the record is there (unless the entity holds this call's token: the earlier
#: attempt of a re-sent call saved it), else the save's answer. GET refuses a key of another type; a
#: foreign value is refused here.
_SAVE_UNLESS_SCRIPT = f"""
local function save(KEYS, ARGV)
{_SAVE_SCRIPT}
end
if #KEYS == 0 then return {{}} end
local record = KEYS[#KEYS]
local value = redis.call('GET', record)
if value then
  if string.sub(value, 1, 5) ~= 'dsv1:' then
    return redis.error_reply('DEDUPSTORE key ' .. string.sub(record, 1, 200)
      .. ' holds a value dedupstore did not write')
  end
  if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash'
      or redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then
    return {{2}}
  end
end
local keys = {{}}
for i = 1, #KEYS - 1 do keys[i] = KEYS[i] end
return save(keys, ARGV)
"""


#: The save script with each entity's token writes (a token store on the same server). KEYS: the
#: save's (n entity keys, n pending sets, the index), then the token keys; ARGV: the number of the
#: save's keys and of its arguments, its arguments, then per entity: the index in KEYS of its
#: required token's key (0: none), the number of tokens to create and each one's key index and
#: value, the number to delete and their key indexes. An entity whose required token is absent is
#: left out of the save (unless its hash holds this call's write token: an earlier attempt saved
#: it); the tokens of an entity the save writes now are created (SET NX) and deleted after it.
#: Returns ``{the save's status, {i, version, ...}, {i of each entity refused for its token}}``.
_TOKENED_SCRIPT = f"""
local function save(KEYS, ARGV)
{_SAVE_SCRIPT}
end
local nkeys, nargs = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = (nkeys - 1) / 2
local token = ARGV[3]
local at, ops = 3 + nargs, {{}}
for i = 1, n do
  local op = {{require = tonumber(ARGV[at]), create = {{}}, delete = {{}}}}
  local count = tonumber(ARGV[at + 1])
  at = at + 2
  for c = 1, count do
    op.create[c] = {{tonumber(ARGV[at]), ARGV[at + 1]}}
    at = at + 2
  end
  count = tonumber(ARGV[at])
  at = at + 1
  for d = 1, count do
    op.delete[d] = tonumber(ARGV[at])
    at = at + 1
  end
  ops[i] = op
end
local mine, missing, gone = {{}}, {{}}, {{}}
for i = 1, n do
  local written = redis.pcall('HGET', KEYS[i], 't')
  mine[i] = type(written) == 'string' and written == token
  if not mine[i] and ops[i].require > 0 then
    local key = KEYS[ops[i].require]
    local value = redis.call('GET', key)
    if not value then
      missing[i] = true
      gone[#gone + 1] = i
    elseif string.sub(value, 1, 5) ~= 'dst1:' then
      return redis.error_reply('DEDUPSTORE key ' .. string.sub(key, 1, 200)
        .. ' holds a value dedupstore did not write')
    end
  end
end
local keys, args, back = {{}}, {{ARGV[3], ARGV[4]}}, {{}}
for i = 1, n do
  if not missing[i] then back[#back + 1] = i end
end
local m = #back
for j, i in ipairs(back) do
  keys[j] = KEYS[i]
  keys[m + j] = KEYS[n + i]
  for k = 0, 3 do args[#args + 1] = ARGV[5 + (i - 1) * 4 + k] end
end
keys[2 * m + 1] = KEYS[nkeys]
local saved = save(keys, args)
if saved['err'] then return saved end
local done = {{}}
for k = 2, #saved, 2 do
  local i = back[tonumber(saved[k])]
  done[#done + 1] = i
  done[#done + 1] = saved[k + 1]
  if not mine[i] then
    for _, c in ipairs(ops[i].create) do redis.call('SET', KEYS[c[1]], c[2], 'NX') end
    for _, d in ipairs(ops[i].delete) do redis.call('DEL', KEYS[d]) end
  end
end
return {{saved[1], done, gone}}
"""


#: Bodies per script call, in bytes (a call holds at least one entity).
_MAX_CALL_BYTES = 16 * 1024 * 1024
#: Pending sets read per pipelined round trip of the scan, and SSCAN's COUNT hint.
_BUCKETS_PER_ROUND = 64
_SSCAN_COUNT = 200


def entity_key(key_prefix: str, entity_id: str) -> str:
    """The Redis key of an entity's hash: ``<key_prefix>e:<escaped id>``."""
    return f"{key_prefix}e:{escape(entity_id)}"


def buckets_key(key_prefix: str) -> str:
    """The Redis key of the set of buckets that have pending entities (the scan's index)."""
    return f"{key_prefix}pending-buckets"


def pending_key(key_prefix: str, bucket: int) -> str:
    """The Redis key of a bucket's set of pending entity ids."""
    return f"{key_prefix}pending:{bucket}"


def _version(value: object) -> int | None:
    """A stored version as an int; ``None`` when it is not one (not our hash)."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return int(text) if isinstance(text, str) and text.isdigit() else None


def _body(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


class RedisEntityStore(EntityStore):
    """Entities on a Redis primary, one hash each; thread- and process-safe (see the module).

    Its loads and saves (joint ones too) are steps over ``self._redis``: redis-py on the
    sync API, ``redis.asyncio`` on the async one; the scan of pending outboxes runs there
    in a thread."""

    max_entity_bytes: ClassVar[int] = 4 * 1024 * 1024
    max_load_batch: ClassVar[int] = 100
    max_save_batch: ClassVar[int] = 500
    declared_options: ClassVar[OptionSet] = EntityStore.declared_options.extend(
        key_prefix_option("dedupent:"), *CONNECTION_OPTIONS
    )
    _redis = Connected(RedisConnection)
    joins = RedisDeduplicationStore
    token_joins = RedisTokenStore
    commands: ClassVar[str] = (  # with the deduplication and token stores' (the joined calls)
        "+ping +info +script|load +evalsha +wait +hmget +get +sscan +smembers, and in the "
        "script +type +hget +hmget +hset +hdel +sadd +srem +scard +exists +get +mget +set "
        "+mset +del"
    )
    unconfirmed: ClassVar[str] = (
        "the entities are saved on the primary but their durability is unknown (reload "
        "them before saving again)"
    )

    def _open(self) -> None:
        self._key_prefix: str = self.options["key_prefix"]
        self._redis.probe(self, _SAVE_SCRIPT)

    def _key(self, entity_id: str) -> str:
        return entity_key(self._key_prefix, entity_id)

    def _load(self, ids: list[str]) -> Steps[dict[str, tuple[str, Any]]]:
        """One pipelined ``HMGET`` per id, in one round trip."""
        replies = yield from io(
            self._redis.pipelined,
            lambda pipe: [pipe.hmget(self._key(eid), ["b", "v"]) for eid in ids],
        )
        loaded = {eid: self._loaded(eid, reply) for eid, reply in zip(ids, replies, strict=True)}
        return {eid: record for eid, record in loaded.items() if record is not None}

    def _loaded(self, entity_id: str, reply: list[Any]) -> tuple[str, int] | None:
        """``(body, version)`` from an ``HMGET b v`` answer; None for no entity."""
        body, stored = reply
        if body is None and stored is None:
            return None
        version = _version(stored)
        if body is None or version is None:
            raise foreign_value_error(self, f"{self._key(entity_id)[:200]!r} is not an entity")
        return _body(body), version

    def _load_with(
        self, dedup: DeduplicationStore, entity_id: str, key: str
    ) -> Steps[tuple[tuple[str, Any] | None, bool]]:
        """``HMGET`` of the entity and ``GET`` of the record, pipelined: one round trip."""
        assert isinstance(dedup, RedisDeduplicationStore)
        record_key = dedup.record_key(key)
        entity, record = yield from io(
            self._redis.pipelined,
            lambda pipe: (pipe.hmget(self._key(entity_id), ["b", "v"]), pipe.get(record_key)),
        )
        return self._loaded(entity_id, entity), dedup.counts_as_record(record)

    def _save_with(
        self, dedup: DeduplicationStore, request: WriteRequest, record: EntityRecord
    ) -> Steps[tuple[set[str], dict[str, Any]]]:
        """The deduplication store's script, then this store's, in one script run."""
        assert isinstance(dedup, RedisDeduplicationStore)
        add_keys, add_args = dedup.add_call(request)
        keys, args, resent = self._save_call([record], write_token())
        head = [str(len(add_keys)), str(len(add_args)), *add_args]
        added, saved = yield from io(
            self._redis.run_script, self, _JOINT_SCRIPT, add_keys + keys, head + args, head + resent
        )
        return dedup.added_ids(request, added), self._saved([record], saved)

    def _save_unless(
        self, dedup: DeduplicationStore, key: str, record: EntityRecord
    ) -> Steps[tuple[bool, dict[str, Any]]]:
        """``GET`` of the record, then (if absent) the save script, in one script run."""
        assert isinstance(dedup, RedisDeduplicationStore)
        keys, args, resent = self._save_call([record], write_token())
        keys.append(dedup.record_key(key))
        reply = yield from io(self._redis.run_script, self, _SAVE_UNLESS_SCRIPT, keys, args, resent)
        if reply and int(reply[0]) == 2:
            return True, {}
        return False, self._saved([record], reply)

    def _load_with_token(
        self, tokens: TokenStore, entity_id: str, token_id: str
    ) -> Steps[tuple[tuple[str, Any] | None, bool]]:
        """``HMGET`` of the entity and ``GET`` of the token, pipelined in that order: one
        round trip, the token read after the load."""
        assert isinstance(tokens, RedisTokenStore)
        token_key = tokens.key(token_id)
        entity, value = yield from io(
            self._redis.pipelined,
            lambda pipe: (pipe.hmget(self._key(entity_id), ["b", "v"]), pipe.get(token_key)),
        )
        return self._loaded(entity_id, entity), tokens.is_token(value)

    def _save_tokens(
        self,
        tokens: TokenStore,
        records: list[EntityRecord],
        writes: Mapping[str, TokenWrites],
    ) -> Steps[tuple[set[str], dict[str, Any]]]:
        """One script run per group of records (up to 16 MiB of bodies): the required tokens
        read, the save, then the token writes of the entities it wrote (:data:`_TOKENED_SCRIPT`)."""
        assert isinstance(tokens, RedisTokenStore)
        missing: set[str] = set()
        saved: dict[str, Any] = {}
        token = write_token()
        for group in groups_by_size(records, _MAX_CALL_BYTES, lambda r: r.size):
            keys, args, resent = self._save_call(group, token)
            head = [str(len(keys)), str(len(args))]
            ops: list[str] = []
            for record in group:
                change = writes.get(record.id)
                if change is None:
                    ops += ["0", "0", "0"]
                    continue
                if change.require is None:
                    ops.append("0")
                else:
                    keys.append(tokens.key(change.require))
                    ops.append(str(len(keys)))
                ops.append(str(len(change.create)))
                for made in change.create:
                    keys.append(tokens.key(made.id))
                    ops += [str(len(keys)), token_value(made.endpoint, made.created)]
                ops.append(str(len(change.delete)))
                for tid in change.delete:
                    keys.append(tokens.key(tid))
                    ops.append(str(len(keys)))
            status, pairs, gone = yield from io(
                self._redis.run_script,
                self,
                _TOKENED_SCRIPT,
                keys,
                head + args + ops,
                head + resent + ops,
            )
            saved.update(self._saved(group, [status, *pairs]))
            missing.update(group[int(i) - 1].id for i in gone)
        return missing, saved

    def _save(self, records: list[EntityRecord]) -> Steps[dict[str, Any]]:
        """One script call per group of records (up to 16 MiB of bodies)."""
        token = write_token()
        saved: dict[str, Any] = {}
        for group in groups_by_size(records, _MAX_CALL_BYTES, lambda r: r.size):
            keys, args, resent = self._save_call(group, token)
            reply = yield from io(self._redis.run_script, self, _SAVE_SCRIPT, keys, args, resent)
            saved.update(self._saved(group, reply))
        return saved

    def _save_call(
        self, records: list[EntityRecord], token: str
    ) -> tuple[list[str], list[str], list[str]]:
        """The keys and arguments of the save script, first sent and re-sent."""
        keys = [self._key(r.id) for r in records]
        keys += [pending_key(self._key_prefix, r.bucket) for r in records]
        keys.append(buckets_key(self._key_prefix))
        entries: list[str] = []
        for r in records:
            expected = "" if r.version is None else f"={r.version}"
            entries += [expected, "1" if r.pending else "0", r.id, r.body]
        return keys, [token, "0", *entries], [token, "1", *entries]

    def _saved(self, records: list[EntityRecord], reply: list[Any]) -> dict[str, int]:
        """``{id: new version}`` from the save script's answer."""
        if int(reply[0]) != 1:
            raise self.make_error(
                StoreUnavailable,
                "save",
                "the answer to an earlier attempt was lost and an entity has changed since, so "
                "whether this save wrote it is unknown; reload the entities before saving again",
            )
        pairs = reply[1:]
        return {records[int(pairs[k]) - 1].id: int(pairs[k + 1]) for k in range(0, len(pairs), 2)}

    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        """Pending ids by ``SSCAN`` of the segment's buckets, bodies a page at a time; the ids of
        entities no longer pending are pruned from the sets as they are met."""
        pending = ((eid, b) for b, ids in self._pending_ids(segment, segments) for eid in ids)
        while page := list(itertools.islice(pending, self.max_load_batch)):
            yield from self._read_page(page)

    def _pending_ids(self, segment: int, segments: int) -> Iterator[tuple[int, list[str]]]:
        """``(bucket, ids)`` from the pending sets of the segment's buckets, each id once."""
        members = self._redis.read(self._redis.client.smembers, buckets_key(self._key_prefix))
        buckets = sorted(b for b in (int(_body(m)) for m in members) if b % segments == segment)
        for start in range(0, len(buckets), _BUCKETS_PER_ROUND):
            group = buckets[start : start + _BUCKETS_PER_ROUND]
            replies = self._redis.pipelined(functools.partial(self._sscan_first, group))
            for bucket, (cursor, members) in zip(group, replies, strict=True):
                seen = {_body(m) for m in members}
                if seen:
                    yield bucket, list(seen)
                while int(cursor):
                    cursor, more = self._redis.read(
                        self._redis.client.sscan,
                        pending_key(self._key_prefix, bucket),
                        cursor,
                        count=_SSCAN_COUNT,
                    )
                    fresh = {_body(m) for m in more} - seen
                    if fresh:
                        seen |= fresh
                        yield bucket, list(fresh)

    def _sscan_first(self, buckets: list[int], pipe: Any) -> None:
        for bucket in buckets:
            pipe.sscan(pending_key(self._key_prefix, bucket), 0, count=_SSCAN_COUNT)

    def _read_page(self, page: list[tuple[str, int]]) -> Iterator[tuple[str, str, Any]]:
        """The pending entities of ``page`` (``(id, bucket)`` pairs); the others (gone, or saved
        since with an empty outbox) leave their bucket's set, atomically with a check that they are
        still not pending (:data:`_PRUNE_SCRIPT`)."""
        replies = self._redis.pipelined(
            lambda pipe: [pipe.hmget(self._key(eid), ["b", "v", "p"]) for eid, _ in page]
        )
        found: list[tuple[str, str, Any]] = []
        stale: list[tuple[str, int]] = []
        for (eid, bucket), (body, stored, pending) in zip(page, replies, strict=True):
            version = _version(stored)
            if body is not None and version is not None and pending in (b"1", "1"):
                found.append((eid, _body(body), version))
            elif (body is None and stored is None) or version is not None:
                stale.append((eid, bucket))
        if stale:
            keys = [self._key(eid) for eid, _ in stale]
            keys += [pending_key(self._key_prefix, bucket) for _, bucket in stale]
            keys.append(buckets_key(self._key_prefix))
            ids = [eid for eid, _ in stale]
            self._redis.run_script(self, _PRUNE_SCRIPT, keys, ids)
        yield from found
