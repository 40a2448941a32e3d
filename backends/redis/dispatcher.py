"""The Redis Streams dispatcher: :class:`RedisDispatcher`.

Layout (``key_prefix`` ``dedupout:`` by default; keys: see :mod:`.redis._client`):

* one stream per destination, ``<key_prefix><destination>`` (the destination escaped: it holds no
  ``:``, so no stream key can be a marker key), one entry per message with the fields ``id``,
  ``body`` (canonical JSON) and ``headers`` (JSON);
* with ``dedupe_window``: one marker per message id, ``<key_prefix>sent:<id>`` (the id escaped), a
  string that expires after the window.

A dispatch is ONE ``EVALSHA``. The script checks every key's type before writing any (a key of
another type: ``ConfigurationError``, nothing written), then for each message whose marker is absent
runs ``XADD``, then ``SET <marker> 1 NX PX <window>`` (should Redis refuse a write half-way, say an
ACL without ``SET``, a message is appended without its marker, a later duplicate, rather than marked
and never appended): within the window a re-dispatch of an id appends nothing. ``maxlen`` trims each
stream approximately (``XADD ... MAXLEN ~ n``).

Lost answers: the script is retried (``retries``). With the window a retry is harmless (an attempt
that ran left markers); without it (``dedupe_window=0``) the script refuses a retry of an attempt
that may have run and the call raises ``StoreUnavailable`` (outcome unknown: dispatch again).
Receivers still deduplicate by the ``id`` field: the window is finite, and trimming and
consumer-group redelivery are independent of it: delivery is at least once.

Reading back (:class:`~dedupstore.dead_letters.ReadBack`, for ``dedupstore dead-letters``):
``read_back`` pages through a destination's stream with ``XRANGE`` (a missing stream holds nothing),
``remove`` deletes entries with ``XDEL`` by their entry ids.

Size bound: ``max_message_bytes`` 512 MiB, the default ``proto-max-bulk-len``; not read from the
server (``CONFIG`` is refused on most managed servers): a server configured lower needs the option.

Options: ``key_prefix``, ``dedupe_window`` (7 days; ``0``/``none``: off), ``maxlen`` (none),
``max_message_bytes`` and those of :mod:`.redis._client`, which also documents the errors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from dedupstore.backend import (
    Connected,
    EncodedMessage,
    Option,
    OptionSet,
    OutgoingMessage,
    ReadMessage,
    StoreUnavailable,
    URLDispatcher,
    integer,
    optional,
    seconds,
)

from ._client import CONNECTION_OPTIONS, RedisConnection, escape, key_prefix_option, text_of

__all__ = ["RedisDispatcher", "sent_key", "stream_key"]

# KEYS[1..n]: the stream of each message; KEYS[n+1..2n]: its marker key. ARGV[1]: the window in ms
# ('' = off); ARGV[2]: MAXLEN ('' = none); ARGV[3]: '1' when an earlier attempt may have run; then 3
# per message: id, body, headers. Returns the 1-based indexes of appended messages, or {-1} with
# nothing written (re-sent without a window: may duplicate). No keys: a permission probe.
_DISPATCH_SCRIPT = """
if #KEYS == 0 then return {} end
local window, maxlen = ARGV[1], ARGV[2]
if ARGV[3] == '1' and window == '' then return {-1} end
local n = #KEYS / 2
for i = 1, 2 * n do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  local wanted = 'stream'
  if i > n then wanted = 'string' end
  if kind ~= 'none' and kind ~= wanted then
    return redis.error_reply('WRONGTYPE key ' .. string.sub(KEYS[i], 1, 200) .. ' holds a '
      .. kind .. ', not a dedupstore ' .. wanted)
  end
end
local appended = {}
for i = 1, n do
  local at = 4 + (i - 1) * 3
  if window == '' or redis.call('EXISTS', KEYS[n + i]) == 0 then
    if maxlen == '' then
      redis.call('XADD', KEYS[i], '*', 'id', ARGV[at], 'body', ARGV[at + 1],
        'headers', ARGV[at + 2])
    else
      redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'id', ARGV[at],
        'body', ARGV[at + 1], 'headers', ARGV[at + 2])
    end
    if window ~= '' then
      redis.call('SET', KEYS[n + i], '1', 'NX', 'PX', window)
    end
    appended[#appended + 1] = i
  end
end
return appended
"""

_OFF = re.compile(r"\s*(0+(\.0*)?\s*(ms|s|m|h|d|w)?|off|false|no)\s*", re.IGNORECASE)


def _window(value: object) -> float | None:
    """``dedupe_window``: a duration in seconds, or ``0``/``None``/``'off'`` for none."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
        return None
    if isinstance(value, str) and _OFF.fullmatch(value):
        return None
    converted: float | None = optional(seconds())(value)
    return converted


def stream_key(key_prefix: str, destination: str) -> str:
    """The stream of ``destination``: ``<key_prefix><escaped destination>``."""
    return f"{key_prefix}{escape(destination)}"


def sent_key(key_prefix: str, message_id: str) -> str:
    """The dedupe-window marker of a message id: ``<key_prefix>sent:<escaped id>``."""
    return f"{key_prefix}sent:{escape(message_id)}"


class RedisDispatcher(URLDispatcher):
    """Outgoing messages as Redis Streams entries, one stream per destination (see the module)."""

    #: The default ``proto-max-bulk-len`` (see the module).
    max_message_bytes = 512 * 1024 * 1024
    receiver_dedup: ClassVar[str] = (
        "by the entry's id field: dedupe_window drops re-dispatches for a while, but "
        "delivery is at least once (window, trimming, consumer-group redelivery)"
    )
    declared_options: ClassVar[OptionSet] = URLDispatcher.declared_options.extend(
        key_prefix_option("dedupout:"),
        Option(
            "dedupe_window",
            _window,
            7 * 86400.0,
            "seconds during which a re-dispatched id is not appended again; 0: off",
        ),
        Option("maxlen", optional(integer(1)), None, "trim each stream to about this length"),
        *CONNECTION_OPTIONS,
    )
    _redis = Connected(RedisConnection)
    commands: ClassVar[str] = (
        "+ping +info +script|load +evalsha +wait, and in the script +type +exists +xadd +set"
    )
    unconfirmed: ClassVar[str] = (
        "the messages are on the primary but their durability is unknown (dispatch "
        "them again: receivers deduplicate by id)"
    )

    def _open(self) -> None:
        self._key_prefix: str = self.options["key_prefix"]
        window: float | None = self.options["dedupe_window"]
        self._window_ms = "" if window is None else str(max(1, round(window * 1000)))
        maxlen: int | None = self.options["maxlen"]
        self._maxlen = "" if maxlen is None else str(maxlen)
        self._redis.probe(self, _DISPATCH_SCRIPT)

    def stream_key(self, destination: str) -> str:
        """The Redis key of ``destination``'s stream (what receivers ``XREADGROUP``)."""
        return stream_key(self._key_prefix, destination)

    def _dispatch(self, batch: list[EncodedMessage]) -> None:
        keys = [stream_key(self._key_prefix, m.destination) for m in batch]
        keys += [sent_key(self._key_prefix, m.id) for m in batch]
        entries: list[str] = []
        for m in batch:
            entries += [m.id, m.body, m.headers]
        head = [self._window_ms, self._maxlen]
        reply = self._redis.run_script(
            self, _DISPATCH_SCRIPT, keys, [*head, "0", *entries], [*head, "1", *entries]
        )
        if reply and int(reply[0]) == -1:
            raise self.make_error(
                StoreUnavailable,
                "dispatch",
                "the answer to an earlier attempt was lost and dedupe_window is off, so the "
                "messages may or may not have been appended (not re-sent, to avoid duplicates); "
                "dispatch them again (receivers deduplicate by id)",
            )

    #: Entries per ``XRANGE`` of :meth:`read_back`.
    page_size: ClassVar[int] = 500

    def read_back(self, destination: str) -> list[ReadMessage]:
        """Every entry of ``destination``'s stream, oldest first (``XRANGE``, paged); the
        ``position`` is the entry id. Raises ``StoreUnavailable``."""
        self.check_open()
        key = self.stream_key(destination)
        out: list[ReadMessage] = []
        start = "-"
        with self.translating_errors("read"):
            while True:
                page = self._redis.read(self._redis.client.xrange, key, start, count=self.page_size)
                out += [_read(destination, entry) for entry in page]
                if len(page) < self.page_size:
                    return out
                start = f"({text_of(page[-1][0])}"

    def remove(self, destination: str, messages: Sequence[ReadMessage]) -> int:
        """``XDEL`` the entries (by position) from ``destination``'s stream; return how many
        were still there. Raises ``StoreUnavailable``."""
        self.check_open()
        positions = [m.position for m in messages]
        if not positions:
            return 0
        key = self.stream_key(destination)
        with self.translating_errors("remove"):
            return int(self._redis.read(self._redis.client.xdel, key, *positions))


def _read(destination: str, entry: Any) -> ReadMessage:
    """A stream entry as a :class:`ReadMessage` (fields as the dispatcher writes them)."""
    entry_id, fields = entry
    named = {text_of(k): v for k, v in fields.items()}
    raw = named.get("body", b"")
    text = text_of(raw)
    try:
        body = json.loads(text)
    except ValueError:
        body = text
    try:
        headers = json.loads(text_of(named.get("headers", b"{}")))
    except ValueError:
        headers = {}
    if not isinstance(headers, dict):
        headers = {}
    size = len(raw) if isinstance(raw, bytes) else len(text.encode("utf-8"))
    message = OutgoingMessage(text_of(named.get("id", b"")), destination, body, headers)
    return ReadMessage(message, size, text_of(entry_id))
