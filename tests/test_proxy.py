"""The failure-test proxy itself: an outage that refuses keeps its port."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from tests.proxy import TcpProxy


@pytest.fixture
def echo() -> Iterator[int]:
    """A loopback server that echoes one read per connection; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(conn.recv(1024))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    listener.close()


def _round_trip(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"ping")
        return conn.recv(1024)


def test_a_refusing_outage_holds_its_port_so_restore_always_listens_again(echo: int) -> None:
    # The chaos run once failed in restore() with "address already in use": while
    # nothing listened, another connection had been given the port as its local one.
    with TcpProxy("127.0.0.1", echo) as proxy:
        assert _round_trip(proxy.port) == b"ping"
        proxy.outage("refuse")
        with pytest.raises(ConnectionRefusedError):
            _round_trip(proxy.port)
        intruder = socket.socket()
        try:
            with pytest.raises(OSError, match="in use"):
                intruder.bind(("127.0.0.1", proxy.port))
        finally:
            intruder.close()
        proxy.restore()
        assert _round_trip(proxy.port) == b"ping"
        proxy.outage("refuse")
        proxy.restore()
        assert _round_trip(proxy.port) == b"ping"


def test_closing_the_proxy_frees_its_port_even_in_an_outage(echo: int) -> None:
    proxy = TcpProxy("127.0.0.1", echo).start()
    port = proxy.port
    proxy.outage("refuse")
    proxy.close()
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
