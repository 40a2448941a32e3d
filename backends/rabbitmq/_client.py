"""What the RabbitMQ dispatcher and the RabbitMQ consumer broker share (pika): the URL
``amqp[s]://[user[:password]@]host[:port][/vhost]`` (:func:`parse_url`: the path is one
percent-encoded virtual host, ``/%2F`` or nothing for ``/``), :data:`CONNECTION_OPTIONS`, connecting
and aborting a connection within the call's deadline (:func:`connect`, :func:`expiring`), and pika's
errors (:func:`classify`): ``StoreUnavailable`` for a connection lost, refused or timed out, a
broker shutting down, a confirm nack; ``ConfigurationError`` for credentials, permissions, a missing
exchange or queue, a declaration that contradicts the existing one.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pika
import pika.exceptions as pe
from pika.adapters.blocking_connection import BlockingChannel
from pika.adapters.utils.connection_workflow import AMQPConnectorException

from dedupstore.backend import (
    ConfigurationError,
    ErrorKind,
    Option,
    Options,
    StoreUnavailable,
    StoreURL,
    capped,
    choice,
    connect_timeout_option,
    integer,
    optional,
    quiet_driver_logs,
    retries_option,
    text,
    time_left,
    timeout_option,
)

# pika logs a dozen lines for a refused connection; the caller gets one StoreUnavailable
quiet_driver_logs("pika")

__all__ = [
    "CONNECTION_OPTIONS",
    "SHORT_STRING_BYTES",
    "Expiry",
    "Link",
    "classify",
    "close_quietly",
    "connect",
    "expiring",
    "parse_url",
    "queue_arguments",
    "queue_type_option",
    "reply_code",
    "short_string",
    "vhost",
]

#: AMQP reply codes that mean "fix the configuration": access refused (403), not found (404),
#: resource locked (405, an exclusive queue), precondition failed (406, a declaration with other
#: arguments), not allowed (530).
_CONFIGURATION_CODES = frozenset({403, 404, 405, 406, 530})

CONNECTION_OPTIONS: tuple[Option, ...] = (
    timeout_option(
        5.0, "seconds one attempt may take, publishing and confirmations (or one fetch)"
    ),
    connect_timeout_option(5.0),
    retries_option(2, "how often an attempt is repeated after the connection was lost"),
    Option(
        "heartbeat",
        optional(integer(0, 3600)),
        None,
        "AMQP heartbeat in seconds (0: off; none: the broker's proposal)",
    ),
    Option("username", optional(text()), None, "user name (instead of the URL's)"),
    Option("password", optional(text()), None, "password (instead of the URL's)", secret=True),
    Option("ssl_ca_certs", optional(text()), None, "CA bundle file (amqps://)"),
)


#: The longest name AMQP 0-9-1 carries (a short string: exchange, queue, routing key).
SHORT_STRING_BYTES = 255


def short_string(what: str) -> Callable[[object], str]:
    """A name AMQP can carry: ``what`` names it in errors."""

    def convert(value: object) -> str:
        name: str = text(what=what)(value)
        if len(name.encode("utf-8")) > SHORT_STRING_BYTES:
            raise ValueError(f"{what} is longer than {SHORT_STRING_BYTES} UTF-8 bytes")
        return name

    return convert


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close ``connection`` if it is open, ignoring any error (it may be dead already)."""
    with contextlib.suppress(Exception):
        if connection.is_open:
            connection.close()


@dataclass(eq=False)
class Link:
    """One process's connection and its channel (a client's ``ProcessLocal`` value)."""

    connection: pika.BlockingConnection
    channel: BlockingChannel

    def close(self) -> None:
        close_quietly(self.connection)


def deadline_seconds(options: Options) -> float:
    """One call's bound, for the dispatcher and the broker alike:
    ``(retries + 1) x (connect_timeout + timeout)`` (each attempt may reconnect)."""
    return float((options["retries"] + 1) * (options["connect_timeout"] + options["timeout"]))


def vhost(url: StoreURL) -> str:
    """The virtual host named by the URL's path (``''``, ``/`` or ``/%2F``: ``/``)."""
    path = url.path[1:] if url.path.startswith("/") else url.path
    return unquote(path) if path else "/"


def parse_url(url: StoreURL, options: Options) -> None:
    """Refuse, before any I/O, what no AMQP connection can be made of."""
    if url.scheme not in ("amqp", "amqps"):
        raise ConfigurationError(f"bad RabbitMQ URL {url.masked}: the scheme must be amqp or amqps")
    if not url.host:
        raise ConfigurationError(f"bad RabbitMQ URL {url.masked}: a host is needed")
    if "/" in url.path[1:]:
        raise ConfigurationError(
            f"bad RabbitMQ URL {url.masked}: the path is one virtual host; percent-encode a "
            "'/' in its name (the default vhost '/' is '/%2F')"
        )
    if url.fragment:
        raise ConfigurationError(f"bad RabbitMQ URL {url.masked}: a fragment means nothing here")
    if url.scheme != "amqps" and options["ssl_ca_certs"] is not None:
        raise ConfigurationError("ssl_ca_certs needs an amqps:// URL")


def connect(url: StoreURL, options: Options) -> pika.BlockingConnection:
    """A blocking connection; each step bounded by ``connect_timeout`` and the deadline."""
    user = options["username"] if options["username"] is not None else url.username
    password = options["password"] if options["password"] is not None else url.password
    bound = capped(float(options["connect_timeout"]))
    params: dict[str, Any] = {
        "host": url.host,
        "port": url.port or (5671 if url.scheme == "amqps" else 5672),
        "virtual_host": vhost(url),
        "credentials": pika.PlainCredentials(user or "guest", password or "guest"),
        "connection_attempts": 1,
        "socket_timeout": bound,
        "stack_timeout": bound,
        "blocked_connection_timeout": float(options["timeout"]),
        "client_properties": {"connection_name": "dedupstore"},
    }
    if options["heartbeat"] is not None:
        params["heartbeat"] = options["heartbeat"]
    if url.scheme == "amqps":
        context = ssl.create_default_context(cafile=options["ssl_ca_certs"])
        params["ssl_options"] = pika.SSLOptions(context, url.host)
    return pika.BlockingConnection(pika.ConnectionParameters(**params))


class Expiry:
    """Whether :func:`expiring` aborted the connection (the deadline passed)."""

    fired = False


@contextlib.contextmanager
def expiring(connection: pika.BlockingConnection, seconds: float) -> Iterator[Expiry]:
    """Abort ``connection`` if the block outlives ``seconds`` or the call's deadline.

    pika's blocking calls (a publish waiting for its confirm, a ``basic_get``) have no timeout of
    their own: a timer on the connection's I/O loop drops the TCP stream when the time is up, so the
    blocked call raises (``StreamLostError``; :attr:`Expiry.fired` says why) and the caller opens
    another connection."""
    left = time_left()
    delay = seconds if left is None else max(0.0, min(seconds, left))
    expiry = Expiry()
    impl = connection._impl  # the I/O loop runs its timers inside every blocking call

    def fire() -> None:
        # what pika's own heartbeat checker does when the broker falls silent
        expiry.fired = True
        with contextlib.suppress(Exception):
            impl._terminate_stream(pe.StreamLostError("no answer from the broker in time"))

    timer = impl.ioloop.call_later(delay, fire)
    try:
        yield expiry
    finally:
        with contextlib.suppress(Exception):
            impl.ioloop.remove_timeout(timer)


def queue_type_option(doc: str) -> Option:
    """The ``queue_type`` option (``classic`` or ``quorum``): the type of the queues that
    ``doc`` says the class declares (see :func:`queue_arguments`)."""
    return Option("queue_type", choice("classic", "quorum"), "classic", doc)


def queue_arguments(queue_type: str) -> dict[str, Any] | None:
    """The declaration arguments of a queue of ``queue_type``: none for ``classic`` (the default),
    so that a classic queue declared elsewhere without arguments is not refused as inequivalent."""
    return None if queue_type == "classic" else {"x-queue-type": queue_type}


def reply_code(exc: BaseException) -> int | None:
    """The AMQP reply code of a channel or connection closed by the broker."""
    if isinstance(exc, pe.ChannelClosedByBroker | pe.ConnectionClosedByBroker):
        return int(exc.reply_code)
    return None


def classify(exc: BaseException) -> ErrorKind:
    """pika's exception as a dedupstore error class (``None``: not pika's)."""
    if isinstance(
        exc, pe.ProbableAuthenticationError | pe.ProbableAccessDeniedError | pe.AuthenticationError
    ):
        return ConfigurationError
    code = reply_code(exc)
    if code is not None:
        return ConfigurationError if code in _CONFIGURATION_CODES else StoreUnavailable
    if isinstance(exc, pe.AMQPError | AMQPConnectorException | OSError | TimeoutError):
        # connection refused, lost or timed out; broker shutting down (320); a broken stream
        return StoreUnavailable
    return None
