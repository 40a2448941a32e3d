"""The Redis token store: :class:`RedisTokenStore`.

One string key per token, ``<key_prefix><id>`` (``key_prefix`` ``dedup_tokens:`` by default; the id
escaped as every key part is, see :mod:`.redis._client`: no hash tag), never with an expiry. The
value is ``dst1:`` and the JSON object ``{"endpoint": <receiving endpoint>, "created": <mint time,
epoch seconds>}``; a value without the tag under the prefix was not written by dedupstore.

Round trips, each per chunk of 1000 tokens (two chunks in flight), all on the primary:

* ``create``: one packet of ``SET <key> <value> NX`` per token (then ``WAIT`` when
  ``wait_replicas`` is set, as the deduplication store's writes): a token that exists is left as it
  is, so re-sending a chunk whose answer was lost is safe;
* ``present`` / ``present_among``: ``MULTI`` ``MGET`` ``EXISTS`` ``EXEC``, one atomic read: ``MGET``
  gives the values (a foreign one is ``ConfigurationError``), and ``EXISTS`` counting more keys than
  ``MGET`` found means a key of another type (``MGET`` answers nil for it): ``ConfigurationError``
  too, never a silent "absent", which would drop a message;
* ``delete``: one ``DEL`` of the chunk's keys (then ``WAIT``);
* ``outstanding``: ``SCAN MATCH <key_prefix>*`` (the prefix escaped for the glob) a page of about
  1000 keys at a time, an ``MGET`` per page, counted per endpoint in memory (the keys seen are held
  to count each once); ``SCAN`` walks every key of the database. A key of another type, or one
  deleted since the scan saw it, is not counted;
* ``scan``: the same ``SCAN`` and ``MGET`` per page, each token yielded as its page is read (the
  id is the key's tail, unescaped).

Strong consistency and durability: every read goes to the primary the URL names (there is no
replica-read option; opening refuses a replica with ``ConsistencyError``). Opening refuses a server
that may evict keys (``INFO memory``: ``maxmemory_policy`` must be ``noeviction``; ``INFO`` is
allowed on managed services where ``CONFIG`` is not): ``ConfigurationError`` naming the policy.
Changed after opening, ``health_warnings()`` says so, as it does for ``appendfsync`` and
asynchronous replication (set ``wait_replicas``).

Options: ``key_prefix`` and those of :mod:`.redis._client`, which says when ``StoreUnavailable``
and ``ConfigurationError`` are raised.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, ClassVar

from dedupstore.backend import (
    Connected,
    OptionSet,
    Steps,
    TokenRecord,
    TokenStore,
    io,
)

from ._client import (
    CONNECTION_OPTIONS,
    RedisConnection,
    escape,
    foreign_value_error,
    key_prefix_option,
    unescape,
)

__all__ = ["RedisTokenStore", "token_key", "token_value"]

#: Every token value starts with this tag; anything else was not written by us.
_TAG = "dst1:"
_TAG_BYTES = _TAG.encode()


def token_key(key_prefix: str, token_id: str) -> str:
    """Return the Redis key of token ``token_id``: injective, no ``:`` or braces in the id."""
    return key_prefix + escape(token_id)


def token_value(endpoint: str, created: float) -> str:
    """The value stored for a token of ``endpoint`` minted at ``created``."""
    return _TAG + json.dumps({"endpoint": endpoint, "created": created}, separators=(",", ":"))


class RedisTokenStore(TokenStore):
    """Token store on a Redis primary; thread- and process-safe (see the module)."""

    max_batch: ClassVar[int] = 1000
    # Python builds and parses one chunk while the server runs the other
    chunk_concurrency: ClassVar[int] = 2
    declared_options: ClassVar[OptionSet] = TokenStore.declared_options.extend(
        key_prefix_option("dedup_tokens:"), *CONNECTION_OPTIONS
    )
    _redis = Connected(RedisConnection)
    commands: ClassVar[str] = "+ping +info +set +mget +exists +multi +exec +del +wait +scan"
    unconfirmed: ClassVar[str] = (
        "the tokens are on the primary but their durability is unknown (creating or deleting "
        "them again completes the call)"
    )

    def _open(self) -> None:
        self._key_prefix: str = self.options["key_prefix"]
        self._redis.probe(self, "", no_eviction=True)

    def key(self, token_id: str) -> str:
        """The Redis key of token ``token_id`` (for the entity store's joint saves)."""
        return token_key(self._key_prefix, token_id)

    def _keys(self, ids: list[str]) -> list[str]:
        prefix = self._key_prefix
        return [prefix + escape(token_id) for token_id in ids]

    def _create(self, records: list[TokenRecord]) -> Steps[None]:
        """One packet: ``SET NX`` per token (then ``WAIT`` when configured)."""
        prefix = self._key_prefix
        commands: list[tuple[Any, ...]] = [
            ("SET", prefix + escape(r.id), token_value(r.endpoint, r.created), "NX")
            for r in records
        ]
        yield from io(self._redis.write, self, commands)

    def _present(self, ids: list[str]) -> Steps[set[str]]:
        """``MGET`` and ``EXISTS`` in one transaction (see the module)."""
        keys = self._keys(ids)

        def build(pipe: Any) -> None:
            pipe.mget(keys)
            pipe.exists(*keys)

        values, existing = yield from io(self._redis.pipelined, build, transaction=True)
        found = {
            token_id for token_id, value in zip(ids, values, strict=True) if self._is_token(value)
        }
        if int(existing) != len(found):
            raise foreign_value_error(
                self, f"{int(existing) - len(found)} key(s) of the batch hold another type"
            )
        return found

    def _delete(self, ids: list[str]) -> Steps[None]:
        """One ``DEL`` (then ``WAIT`` when configured)."""
        yield from io(self._redis.write, self, [("DEL", *self._keys(ids))])

    def _scan(self) -> Iterator[TokenRecord]:
        """``SCAN MATCH`` a page at a time, an ``MGET`` per page (see the module); each key
        once. A key of another type, or one deleted since the scan saw it, is left out."""
        skip = len(self._key_prefix)
        for key, value in self._redis.scan_values(self._key_prefix):
            if value is None:
                continue
            endpoint, created = self._decoded(value)
            name = key.decode("utf-8") if isinstance(key, bytes) else key
            yield TokenRecord(unescape(name[skip:]), endpoint, created)

    def is_token(self, value: bytes | str | None) -> bool:
        """Whether a ``GET`` answer is a token (the entity store's joint reads): None is
        not; a foreign value is ``ConfigurationError``."""
        return self._is_token(value)

    def _is_token(self, value: bytes | str | None) -> bool:
        """Whether an ``MGET`` answer is a token (a foreign value: ``ConfigurationError``)."""
        if value is None:
            return False
        ours = value.startswith(_TAG_BYTES) if isinstance(value, bytes) else value.startswith(_TAG)
        if not ours:
            raise foreign_value_error(self)
        return True

    def _decoded(self, value: bytes | str) -> tuple[str, float]:
        """The endpoint and mint time of a token's value (a foreign value:
        ``ConfigurationError``)."""
        self._is_token(value)
        try:
            fields = json.loads(value[len(_TAG) :])
            endpoint, created = fields["endpoint"], fields["created"]
        except (ValueError, TypeError, KeyError):
            raise foreign_value_error(self, "not a token's JSON") from None
        if not isinstance(endpoint, str) or not isinstance(created, int | float):
            raise foreign_value_error(self, "not a token's JSON")
        return endpoint, float(created)
