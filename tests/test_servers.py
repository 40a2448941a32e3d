"""The test harness itself: every server starts and answers real clients, and the ones
the harness owns keep committed data across a SIGKILL and restart."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid

import pytest

from tests.servers import (
    CosmosEndpoint,
    DynamoDBEndpoint,
    ExternalServer,
    ExternalServerError,
    PostgresServer,
    RabbitMQServer,
    RedisServer,
    Server,
    ServerStartError,
    _alive,
    _ephemeral_low,
    _port_slice,
    _wait_gone,
    free_port,
)


def _refuses_connections(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return True
    return False


#: A process whose main thread exits while another thread holds a listening socket.
_HALF_EXITED = """
import ctypes, socket, sys, threading
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
threading.Thread(target=threading.Event().wait).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_zombie_main_thread_with_running_threads_is_alive() -> None:
    # what a SIGKILLed beam.smp looks like while its threads exit: "Z", sockets held
    child = subprocess.Popen([sys.executable, "-c", _HALF_EXITED], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert _wait_gone({child.pid}, timeout=0.5) == {child.pid}
        assert not _refuses_connections("127.0.0.1", port)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not _alive(child.pid)
        assert _refuses_connections("127.0.0.1", port)
    finally:
        child.kill()
        child.wait()


def test_free_port_hands_out_distinct_ports() -> None:
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20


def test_each_xdist_worker_draws_ports_from_its_own_slice_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    slices = []
    for worker in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        slices.append(set(_port_slice()))
    assert all(len(ports) >= 1000 for ports in slices)
    assert len(set().union(*slices)) == sum(len(ports) for ports in slices)  # disjoint
    assert max(set().union(*slices)) < _ephemeral_low()


def test_external_server_cannot_be_killed_or_restarted() -> None:
    server = ExternalServer("redis", "redis://example.invalid:6379/0")
    with pytest.raises(ExternalServerError, match="environment variable"):
        server.kill()
    with pytest.raises(ExternalServerError):
        server.restart()


# --------------------------------------------------------------------------- redis


@pytest.mark.redis
def test_redis_answers(redis_server: Server) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    key = f"harness:{uuid.uuid4()}"
    try:
        assert client.ping()
        client.set(key, "v")
        assert client.get(key) == b"v"
    finally:
        client.delete(key)
        client.close()


@pytest.mark.redis
def test_redis_survives_kill_and_restart(own_redis_server: RedisServer) -> None:
    import redis

    server = own_redis_server
    url = server.url
    with redis.Redis.from_url(url) as client:
        client.set("before-crash", "kept")
    server.kill()
    assert not server.running
    assert _refuses_connections(server.host, server.port)

    server.restart()
    assert server.url == url
    with redis.Redis.from_url(server.url) as client:
        assert client.get("before-crash") == b"kept"


@pytest.mark.redis
def test_stop_removes_process_and_workdir() -> None:
    with RedisServer(appendonly=False) as server:
        workdir, port = server.workdir, server.port
        assert workdir.is_dir()
    assert not server.running
    assert not workdir.exists()
    assert _refuses_connections(server.host, port)


@pytest.mark.redis
def test_start_failure_reports_log_tail() -> None:
    class MisconfiguredRedis(RedisServer):
        def _command(self) -> list[str]:
            return [*super()._command(), "--no-such-directive", "x"]

    with pytest.raises(ServerStartError, match="no-such-directive") as info, MisconfiguredRedis():
        pass
    assert "exited with code" in str(info.value)


# --------------------------------------------------------------------------- rabbitmq


@pytest.mark.rabbitmq
def test_rabbitmq_answers(rabbitmq_server: Server) -> None:
    import pika

    queue = f"harness-{uuid.uuid4()}"
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_server.url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, auto_delete=True)
        channel.basic_publish("", queue, b"v")
        method, _, body = channel.basic_get(queue, auto_ack=True)
        assert method is not None
        assert body == b"v"
    finally:
        connection.close()


@pytest.mark.rabbitmq
def test_rabbitmq_survives_kill_and_restart(own_rabbitmq_server: RabbitMQServer) -> None:
    import pika

    server = own_rabbitmq_server
    url = server.url
    # (a queue declared an instant before a SIGKILL can be lost with it: see
    # declare_queues. What a kill must keep is the durable queue and the persistent
    # message it confirmed.)
    server.declare_queues("before-crash")
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.basic_publish(
        "", "before-crash", b"kept", pika.BasicProperties(delivery_mode=2), mandatory=True
    )
    server.kill()
    assert not server.running
    assert _refuses_connections(server.host, server.port)

    server.restart()
    assert server.url == url
    connection = pika.BlockingConnection(pika.URLParameters(server.url))
    try:
        method, _, body = connection.channel().basic_get("before-crash", auto_ack=True)
        assert method is not None
        assert body == b"kept"
    finally:
        connection.close()


@pytest.mark.rabbitmq
def test_rabbitmq_stop_leaves_no_process() -> None:
    with RabbitMQServer() as server:
        workdir, port, epmd_port = server.workdir, server.port, server.epmd_port
    assert not workdir.exists()
    assert _refuses_connections(server.host, port)
    assert _refuses_connections(server.host, epmd_port)  # its own epmd went with it


# --------------------------------------------------------------------------- postgres


@pytest.mark.postgres
def test_postgres_answers(postgres_server: Server) -> None:
    import psycopg

    with psycopg.connect(postgres_server.url, connect_timeout=10) as conn:
        row = conn.execute("SELECT 1").fetchone()
    assert row == (1,)


@pytest.mark.postgres
def test_postgres_rejects_wrong_password(postgres_server: Server) -> None:
    import psycopg
    from psycopg.conninfo import make_conninfo

    wrong = make_conninfo(postgres_server.url, password="definitely-wrong")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong, connect_timeout=10).close()


@pytest.mark.postgres
def test_postgres_survives_kill_and_restart(own_postgres_server: PostgresServer) -> None:
    import psycopg

    server = own_postgres_server
    url = server.url
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT current_user, current_database()").fetchone() == (
            "dedup",
            "dedup",
        )
        conn.execute("CREATE TABLE crash_check (value text)")
        conn.execute("INSERT INTO crash_check VALUES ('kept')")
    server.kill()
    assert not server.running
    assert _refuses_connections(server.host, server.port)

    server.restart()  # crash recovery replays the WAL
    assert server.url == url
    with psycopg.connect(server.url) as conn:
        assert conn.execute("SELECT value FROM crash_check").fetchall() == [("kept",)]


# --------------------------------------------------------------------------- dynamodb


@pytest.mark.dynamodb
def test_dynamodb_answers(dynamodb_server: DynamoDBEndpoint) -> None:
    import boto3

    client = boto3.client("dynamodb", **dynamodb_server.client_kwargs)
    table = f"harness-{uuid.uuid4().hex}"
    client.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    try:
        # (paged: other tests of the session hold more than one page of tables)
        pages = client.get_paginator("list_tables").paginate()
        assert table in [name for page in pages for name in page["TableNames"]]
        client.put_item(TableName=table, Item={"pk": {"S": "a"}})
        item = client.get_item(TableName=table, Key={"pk": {"S": "a"}}, ConsistentRead=True)
        assert item["Item"] == {"pk": {"S": "a"}}
    finally:
        client.delete_table(TableName=table)


# --------------------------------------------------------------------------- cosmos


@pytest.mark.cosmos
def test_cosmos_answers(cosmos_server: CosmosEndpoint) -> None:
    from azure.cosmos import CosmosClient, PartitionKey

    client = CosmosClient(**cosmos_server.client_kwargs)
    database_id = f"harness-{uuid.uuid4().hex}"
    database = client.create_database(database_id)
    try:
        container = database.create_container("items", partition_key=PartitionKey(path="/pk"))
        container.create_item({"id": "a", "pk": "p", "value": 1})
        assert container.read_item("a", partition_key="p")["value"] == 1
        assert database_id in [db["id"] for db in client.list_databases()]
    finally:
        client.delete_database(database_id)
