"""A TCP proxy on loopback that can break its connections, for failure tests.

:class:`TcpProxy` forwards every connection made to its port to a target address
(one asyncio loop in a daemon thread), and on demand

* :meth:`~TcpProxy.reset` resets every open connection: both sockets are closed
  with ``SO_LINGER`` 0, so the client and the server each get a TCP RST at once
  (nothing is flushed). With ``silent=True`` only the server gets it: the client's
  socket stays quiet until the client next sends, and that gets the RST, as
  from a host that rebooted or took over the server's address (a pooled
  connection then looks alive while idle);
* :meth:`~TcpProxy.outage` starts an outage: new connections are refused
  (``"refuse"``: nothing listens on the port), accepted and reset at once
  (``"reset"``), or accepted and never answered (``"hang"``: a frozen server);
  :meth:`~TcpProxy.restore` ends it, on the same port;
* :meth:`~TcpProxy.freeze` freezes every open connection: it stays open, but
  nothing sent either way arrives any more (a server that stopped answering on a
  live connection; with ``outage("hang")``, a server frozen altogether).
  :meth:`~TcpProxy.restore` resets the frozen connections (their byte streams
  lost data, so they cannot be resumed);
* :meth:`~TcpProxy.cut_replies` cuts every reply short: the proxy gathers the
  server's reply, forwards only its first ``keep(reply)`` bytes and closes the
  connection in order (FIN), as a server killed while writing it would;
  :meth:`~TcpProxy.restore` ends that.

Every method returns once the proxy is in the new state (the sockets are closed),
so a test can act on the client right after. ::

    with TcpProxy.for_url(server_url) as proxy:
        client = connect(proxy.url(server_url))
        ...
        proxy.reset()
        proxy.outage("refuse")
        ...  # calls fail
        proxy.restore()
        ...  # calls work again
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, Literal, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

__all__ = ["OutageMode", "TcpProxy"]

OutageMode = Literal["refuse", "reset", "hang"]

_HOST = "127.0.0.1"
_CHUNK = 64 * 1024
_COMMAND_TIMEOUT = 30.0
_RESET_LINGER = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends RST
#: A reply to cut ends when the server sends nothing more for this long.
_REPLY_QUIET = 0.05

T = TypeVar("T")


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close the socket under ``writer`` with a TCP RST (nothing flushed)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_LINGER)
    writer.transport.abort()


class _Link:
    """One proxied connection: the client's side and the target's (once connected)."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.target: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = asyncio.current_task()
        #: Reset silently: the client side is reset when the client next sends.
        self.forgotten = False
        #: Accepted during a "hang" outage: never forwarded.
        self.held = False
        #: Frozen: open, but what either side sends is dropped.
        self.frozen = False

    def abort(self, *, silent: bool = False) -> None:
        if silent:
            self.forgotten = True
        else:
            _abort(self.client)
        if self.target is not None:
            _abort(self.target)

    def close(self, writer: asyncio.StreamWriter) -> None:
        """End one side after the other ended (a forgotten client waits for its RST)."""
        if writer.transport.is_closing() or (writer is self.client and self.forgotten):
            return
        writer.close()


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``target_host:target_port``; break it on demand."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="test-tcp-proxy", daemon=True
        )
        self._server: asyncio.Server | None = None
        #: The port held (bound, not listening) during a "refuse" outage.
        self._held: socket.socket | None = None
        self._links: set[_Link] = set()
        self._mode: OutageMode | None = None
        self._cut: Callable[[bytes], int] | None = None
        self._port = 0
        #: Connections accepted so far (including those reset or held by an outage).
        self.accepted = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Listen on a free loopback port (:attr:`port`)."""
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening, reset every connection and stop the thread (idempotent)."""
        if not self._thread.is_alive():
            return
        self._call(self._shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_COMMAND_TIMEOUT)
        self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @classmethod
    def for_url(cls, url: str) -> Self:
        """A proxy (not started) to the host and port of ``url``."""
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"expected a URL with a host and a port, got {url!r}")
        return cls(parts.hostname, parts.port)

    @property
    def port(self) -> int:
        return self._port

    def url(self, url: str) -> str:
        """``url`` (``scheme://user:password@host:port/...``) pointed at this proxy."""
        parts = urlsplit(url)
        credentials, _, _ = parts.netloc.rpartition("@")
        netloc = f"{credentials}@{_HOST}:{self.port}" if credentials else f"{_HOST}:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    # ------------------------------------------------------------------ breaking things

    @property
    def open_connections(self) -> int:
        """How many connections are open through the proxy now."""
        return self._call(self._count())

    @property
    def held_connections(self) -> int:
        """How many connections a "hang" outage holds unanswered now."""
        return self._call(self._count(held_only=True))

    def reset(self, *, silent: bool = False) -> int:
        """Reset every open connection; return how many.

        Both ends get a RST now; with ``silent`` only the server does, and the
        client gets it in answer to the next bytes it sends.
        """
        return self._call(self._reset(silent=silent))

    def freeze(self) -> int:
        """Freeze every open connection (open, nothing forwarded); return how many.

        :meth:`restore` resets them. New connections are not affected: combine
        with ``outage("hang")`` for a server that stops answering altogether.
        """
        return self._call(self._freeze())

    def cut_replies(self, keep: Callable[[bytes], int]) -> None:
        """From now on every reply is cut: its first ``keep(reply)`` bytes, then FIN.

        The reply is what the server sends until it is quiet for 50 ms. The
        connection is then closed in order on the client's side (it reads the
        bytes kept, then end of file) and reset on the server's. :meth:`restore`
        ends it.
        """
        self._cut = keep

    def outage(self, mode: OutageMode = "refuse") -> None:
        """From now on new connections are refused, reset at once, or never answered."""
        self._call(self._set_mode(mode))

    def restore(self) -> None:
        """End the outage or the cutting: connections are forwarded again (hung and
        frozen ones are reset)."""
        self._cut = None
        self._call(self._set_mode(None))

    def fail_attempts(self, until: float, *, then_hold: float = 0.4) -> None:
        """In a "hang" outage, until the monotonic time ``until``: reset each connection
        attempt as soon as it is held (it fails at once); then hold those that come for
        ``then_hold`` s and :meth:`restore` (which fails them too). A client retrying with
        a backoff thus sees every attempt fail, its last ones just as the server comes back.
        """
        while time.monotonic() < until:
            if self.held_connections:
                self.reset()
            time.sleep(0.01)
        time.sleep(then_hold)
        self.restore()

    @contextlib.contextmanager
    def down(self, mode: OutageMode = "refuse", *, silent: bool = False) -> Iterator[None]:
        """Reset every connection and keep the proxy in an outage inside the block."""
        self.reset(silent=silent)
        self.outage(mode)
        try:
            yield
        finally:
            self.restore()

    # ------------------------------------------------------------------ in the loop

    @staticmethod
    async def _rest_of_reply(reader: asyncio.StreamReader) -> bytes:
        """What the server sends next until it is quiet for ``_REPLY_QUIET``."""
        rest = b""
        with contextlib.suppress(TimeoutError):
            while more := await asyncio.wait_for(reader.read(_CHUNK), _REPLY_QUIET):
                rest += more
        return rest

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_COMMAND_TIMEOUT)

    def _bound(self) -> socket.socket:
        """A socket bound to the proxy's port (a free one at first), not listening.

        ``SO_REUSEPORT`` lets it be bound while the listener still is: a "refuse"
        outage binds one before it closes the listener, so the port is never free
        (an outgoing connection of any process could otherwise be given it as its
        local port, and listening on it again would fail). Nothing listens on it,
        so connections to it are refused.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((_HOST, self._port))
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        return sock

    async def _listen(self) -> None:
        sock, self._held = self._held or self._bound(), None
        sock.listen(128)
        self._server = await asyncio.start_server(self._accept, sock=sock)
        self._port = sock.getsockname()[1]

    async def _stop_listening(self, *, hold: bool = False) -> None:
        # close() closes the listening socket at once; not wait_closed(), which
        # also waits for every accepted connection since Python 3.12.
        if hold and self._held is None:
            self._held = self._bound()
        if self._server is not None:
            self._server.close()
            self._server = None
        if not hold and self._held is not None:
            self._held.close()
            self._held = None

    async def _count(self, *, held_only: bool = False) -> int:
        return sum(not link.forgotten and (link.held or not held_only) for link in self._links)

    async def _reset(self, *, silent: bool = False, held_only: bool = False) -> int:
        links = [
            link
            for link in self._links
            if not (silent and link.forgotten) and (link.held or link.frozen or not held_only)
        ]
        for link in links:
            link.abort(silent=silent)
        await self._settle([] if silent else links)
        return len(links)

    async def _freeze(self) -> int:
        links = [link for link in self._links if not link.forgotten and not link.held]
        for link in links:
            link.frozen = True
        return len(links)

    async def _set_mode(self, mode: OutageMode | None) -> None:
        previous, self._mode = self._mode, mode
        if previous == "hang" or mode is None:  # held or frozen connections: end them
            await self._reset(held_only=True)
        if mode == "refuse" and previous != "refuse":
            await self._stop_listening(hold=True)
        elif mode != "refuse" and self._server is None:
            await self._listen()

    async def _shut(self) -> None:
        await self._stop_listening()
        await self._reset()

    async def _settle(self, links: list[_Link]) -> None:
        """Wait until the tasks of ``links`` are done and their sockets closed."""
        tasks = [link.task for link in links if link.task is not None]
        tasks = [t for t in tasks if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=_COMMAND_TIMEOUT)
        await asyncio.sleep(0)  # abort() closes the sockets in the next iteration
        await asyncio.sleep(0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = _Link(writer)
        self._links.add(link)
        try:
            if self._mode == "reset":
                link.abort()
                return
            if self._mode == "hang":
                link.held = True
                await reader.read()  # until the client or a reset ends it
                return
            try:
                target_reader, link.target = await asyncio.open_connection(*self.target)
            except OSError:
                link.abort()
                return
            await asyncio.gather(
                self._pump(link, reader, link.target),
                self._pump(link, target_reader, writer, replies=True),
            )
        except OSError:
            pass
        finally:
            self._links.discard(link)
            if link.forgotten:
                _abort(link.client)
            for side in (link.client, link.target):
                if side is not None:
                    link.close(side)

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        replies: bool = False,
    ) -> None:
        """Copy ``reader`` to ``writer`` until either ends; then close ``writer``.

        ``replies``: this is the server's side, whose replies :meth:`cut_replies` cuts.
        """
        try:
            while data := await reader.read(_CHUNK):
                if link.forgotten:  # the client sent to a forgotten connection: RST
                    _abort(link.client)
                    return
                if link.frozen:  # dropped: the other side waits for bytes that never come
                    continue
                cut = self._cut if replies else None
                if cut is not None:
                    data += await self._rest_of_reply(reader)
                    writer.write(data[: cut(data)])
                    await writer.drain()
                    if link.target is not None:
                        _abort(link.target)
                    return  # finally: FIN to the client after the bytes kept
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            link.close(writer)
