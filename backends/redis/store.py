"""The Redis deduplication store: :class:`RedisDeduplicationStore`.

One string key per (endpoint, id): ``<key_prefix><endpoint>:<id>`` (``key_prefix`` ``dedup:`` by
default), both parts escaped (see :mod:`.redis._client`). The value is ``dsv1:<token>``, the
write token of the call that recorded it.

Writes: one ``EVALSHA`` per chunk of 1000 ids (two chunks in flight). Redis runs a script
atomically: for each key, absent -> ``SET``; holding a token of this call (``request.mine``) ->
``SET`` again and reported as recorded; else left alone. A key under the prefix that dedupstore did
not write (another value or another type) makes the whole chunk fail with ``ConfigurationError``
before anything is written. Re-sending the script after a lost answer is therefore safe. Reads: one
``MGET`` per chunk of 2000 ids (``MGET`` sees a key of another type as absent;
``has_been_processed`` refuses it). ``count`` walks the database with ``SCAN MATCH
<key_prefix><endpoint>:*`` and an ``MGET`` per page (exact; see ``_count``).

Expiry is Redis's own (``expiry_clock = "server"``): a record with a retention is ``SET`` with
``PX`` = the retention in ms, and Redis never returns an expired key, so the clients' clocks do not
matter. ``purge_expired`` returns 0: Redis deletes expired keys itself.

Options: ``endpoint``, ``retention`` and those of :mod:`.redis._client`, which says when
``StoreUnavailable`` and ``ConfigurationError`` are raised. After ``StoreUnavailable`` the ids in
``recorded`` were recorded by the call, those in ``unknown`` may have been, and a retry of them on
the same store object (or the store's own) reports the latter as recorded by it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

from dedupstore.backend import Connected, DeduplicationStore, OptionSet, Steps, WriteRequest, io

from ._client import (
    CONNECTION_OPTIONS,
    RedisConnection,
    escape,
    foreign_value_error,
    key_prefix_option,
    unescape,
)

__all__ = ["ADD_SCRIPT", "RedisDeduplicationStore", "record_key"]

#: Every record value starts with this tag; anything else was not written by us.
_TAG = "dsv1:"
_TAG_BYTES = _TAG.encode()


def _is_record(value: bytes | str | None) -> bool:
    """Whether a ``GET`` answer is a record's value (tagged)."""
    if value is None:
        return False
    return value.startswith(_TAG_BYTES) if isinstance(value, bytes) else value.startswith(_TAG)


# KEYS: record keys. ARGV[1]: the new value; ARGV[2]: PX in ms ('' = no expiry); ARGV[3..]: the
# values that mean "written by this call" (its tokens, tagged). Returns the (1-based) indexes of the
# keys it recorded. No keys: a permission probe. One key (an add, a joined clean-up) is one SET NX
# when it is new (every redis.call costs the script more than the command it runs), else a GET
# (which refuses a key of another type); many keys are one MGET, one EXISTS and one MSET.
ADD_SCRIPT = """
if #KEYS == 0 then return {} end
if #KEYS == 1 then
  local key, px = KEYS[1], ARGV[2]
  local function set(...)  -- the new value, with the expiry if any
    if px == '' then return redis.call('SET', key, ARGV[1], ...) end
    return redis.call('SET', key, ARGV[1], 'PX', px, ...)
  end
  if set('NX') then return {1} end
  local value = redis.pcall('GET', key)
  if type(value) == 'table' then
    return redis.error_reply('WRONGTYPE key ' .. string.sub(key, 1, 200) .. ' holds a '
      .. redis.call('TYPE', key)['ok'] .. ', not a dedupstore record')
  end
  for i = 3, #ARGV do
    if value == ARGV[i] then  -- written by this call: written again, as for many keys
      set()
      return {1}
    end
  end
  if string.sub(value, 1, 5) ~= 'dsv1:' then
    return redis.error_reply('DEDUPSTORE key ' .. string.sub(key, 1, 200)
      .. ' holds a value dedupstore did not write')
  end
  return {}
end
local mine = {}
for i = 3, #ARGV do mine[ARGV[i]] = true end
local current = redis.call('MGET', unpack(KEYS))
local todo, absent = {}, {}
for i = 1, #KEYS do
  local value = current[i]
  if not value then
    todo[#todo + 1] = i
    absent[#absent + 1] = KEYS[i]
  elseif mine[value] then
    todo[#todo + 1] = i
  elseif string.sub(value, 1, 5) ~= 'dsv1:' then
    return redis.error_reply('DEDUPSTORE key ' .. string.sub(KEYS[i], 1, 200)
      .. ' holds a value dedupstore did not write')
  end
end
-- MGET answers nil for a key of another type, which SET would silently replace.
if #absent > 0 and redis.call('EXISTS', unpack(absent)) > 0 then
  for _, key in ipairs(absent) do
    local kind = redis.call('TYPE', key)['ok']
    if kind ~= 'none' then
      return redis.error_reply('WRONGTYPE key ' .. string.sub(key, 1, 200) .. ' holds a '
        .. kind .. ', not a dedupstore record')
    end
  end
end
if #todo > 0 then
  if ARGV[2] == '' then
    local pairs_ = {}
    for _, i in ipairs(todo) do
      pairs_[#pairs_ + 1] = KEYS[i]
      pairs_[#pairs_ + 1] = ARGV[1]
    end
    redis.call('MSET', unpack(pairs_))
  else
    for _, i in ipairs(todo) do
      redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
    end
  end
end
return todo
"""


def record_key(key_prefix: str, endpoint: str, message_id: str) -> str:
    """Return the Redis key of (endpoint, id): injective, no ``:`` or braces in the parts."""
    return f"{key_prefix}{escape(endpoint)}:{escape(message_id)}"


class RedisDeduplicationStore(DeduplicationStore):
    """Deduplication store on a Redis primary; thread- and process-safe (see the module).

    Its adds and reads are steps over ``self._redis``: redis-py on the sync API,
    ``redis.asyncio`` on the async one (:class:`~dedupstore.aio.AsyncDeduplicationStore`);
    ``count`` and ``endpoints`` (maintenance scans) run there in a thread."""

    expiry_clock = "server"
    # The script unpack()s 2 values per key: Lua's stack allows about 8000.
    max_write_batch: ClassVar[int] = 1000
    max_read_batch: ClassVar[int] = 2000
    # Python builds and parses one chunk while the server runs the other (atomically each)
    chunk_concurrency: ClassVar[int] = 2
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        key_prefix_option("dedup:"), *CONNECTION_OPTIONS
    )
    _redis = Connected(RedisConnection)
    commands: ClassVar[str] = (
        "+ping +info +script|load +evalsha +get +mget +wait +scan (count), and in the script "
        "+exists +type +set +mset"
    )
    unconfirmed: ClassVar[str] = (
        "the records are on the primary but their durability is unknown (retrying on this "
        "store object reports them as recorded by it)"
    )

    def _open(self) -> None:
        self._key_base = f"{self.options['key_prefix']}{escape(self.endpoint)}:"
        # PX = the retention in whole ms, rounded up (at least 1).
        self._px = (
            "" if self.retention is None else str(-(-self.retention // timedelta(milliseconds=1)))
        )
        self._redis.probe(self, ADD_SCRIPT)

    def _add_new(self, request: WriteRequest) -> Steps[set[str]]:
        """One script run (plus ``WAIT`` when configured) for the whole chunk."""
        keys, args = self.add_call(request)
        answer = yield from io(self._redis.run_script, self, ADD_SCRIPT, keys, args)
        return self.added_ids(request, answer)

    def add_call(self, request: WriteRequest) -> tuple[list[str], list[str]]:
        """The keys and arguments of the write script for ``request`` (public for the
        entity store's joint script, :mod:`.redis.entities`)."""
        keys = self._record_keys(request.ids)
        args = [_TAG + request.token, self._px, *(_TAG + token for token in request.mine)]
        return keys, args

    @staticmethod
    def added_ids(request: WriteRequest, indexes: list[Any]) -> set[str]:
        """The ids the write script's answer says it recorded."""
        return {request.ids[int(i) - 1] for i in indexes}

    def _find(self, ids: list[str], now: float) -> Steps[set[str]]:
        """One ``MGET``; Redis never returns an expired key."""
        keys = self._record_keys(ids)
        values = yield from io(self._redis.read, self._redis.client.mget, keys)
        return {mid for mid, value in zip(ids, values, strict=True) if self.counts_as_record(value)}

    def _contains_one(self, message_id: str, now: float) -> Steps[bool]:
        key = self.record_key(message_id)
        return self.counts_as_record((yield from io(self._redis.read, self._redis.client.get, key)))

    def record_key(self, message_id: str) -> str:
        """The key of ``message_id``'s record (the entity store's joint scripts use it too)."""
        return self._key_base + escape(message_id)

    def _record_keys(self, message_ids: list[str]) -> list[str]:
        """:meth:`record_key` of each id (one call for a batch: this is its hot path)."""
        base = self._key_base
        return [base + escape(mid) for mid in message_ids]

    def counts_as_record(self, value: bytes | str | None) -> bool:
        """Whether a ``GET`` answer is a record (a foreign value: ``ConfigurationError``)."""
        if value is None:
            return False
        ours = value.startswith(_TAG_BYTES) if isinstance(value, bytes) else value.startswith(_TAG)
        if not ours:
            raise foreign_value_error(self)
        return True

    def _purge(self, now: float) -> int:
        """Nothing to do: Redis deletes expired records itself (native expiry)."""
        return 0

    def _count(self, now: float) -> int:
        """Exact: the endpoint's keys share the ``SCAN MATCH`` prefix and no other key of
        dedupstore's does (the endpoint is escaped: it holds no ``:``); ``MGET`` keeps the records
        (a key of another type reads as absent, a foreign string value is ``ConfigurationError``)
        and drops keys that expired since the scan saw them. Cost: ``SCAN`` walks every key of
        the database (filtering on the server); see :meth:`.RedisConnection.scan_values`."""
        return sum(
            self.counts_as_record(value) for _, value in self._redis.scan_values(self._key_base)
        )

    def _endpoints(self, now: float) -> set[str]:
        """Exact, as :meth:`_count`, over ``<key_prefix>*``: each record key's endpoint is
        the escaped part before its first ``:`` after the prefix (keys of another type or
        value, or with no ``:`` there, are not records)."""
        prefix = self.options["key_prefix"]
        found: set[str] = set()
        for key, value in self._redis.scan_values(prefix):
            name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            endpoint, colon, _ = name[len(prefix) :].partition(":")
            if colon and endpoint not in found and _is_record(value):
                found.add(endpoint)
        return {unescape(endpoint) for endpoint in found}
