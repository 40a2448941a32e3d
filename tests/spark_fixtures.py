"""Spark for the tests: one session per engine for the whole test session.

The fixture ``spark`` is parametrized indirectly by engine name:

* ``local``: a classic session on ``local[2,3]`` (two threads; a failed task gets up
  to three attempts, so a killed Python worker is retried as on a cluster);
* ``connect``: a Spark Connect client session, talking to a Connect server that the
  harness starts from the installed PySpark (``sbin/start-connect-server.sh``) on a
  free loopback port. No ``sparkContext``, no RDDs on this side;
* ``cluster``: a classic session on ``local-cluster[2,1,1024]``: a standalone master
  and two workers, so tasks run in separate executor JVMs and Python workers.

Only one classic SparkContext can live in a process: tests are grouped by engine
(pytest orders tests by the parameter of a session fixture) and the previous engine
is stopped before the next starts. A session that cannot start fails the tests.
Under pytest-xdist each engine's tests are a group of their own (``tests/suite_rules.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import HOST, ServerStartError, free_port

ENGINES = ("local", "connect", "cluster")

#: Set by PySpark while a Spark Connect session lives: every ``pyspark`` in the process
#: and in its children then acts as a Connect client.
CONNECT_MODE = "SPARK_CONNECT_MODE_ENABLED"

#: Test-only AWS settings the executors inherit (moto accepts any credentials).
TEST_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def spark_home() -> Path:
    """The installed ``pyspark`` package directory: it is a Spark distribution."""
    import pyspark

    return Path(pyspark.__file__).parent


def session_spark_home(work: Path) -> Path:
    """A Spark home for the tests' own sessions: the installed PySpark's directory
    without ``python/`` (its zipped copy of ``pyspark``).

    Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on every Python worker's
    path; Python cannot cache bytecode for a zip, so each worker compiled PySpark's
    modules again and rescanned the zip at every task (about a third of the workers'
    CPU). Without it the workers import the same installed PySpark, compiled once.
    Nothing Spark computes changes; the tests that run Spark as a user does
    (``spark-submit`` from the venv, the README's job) use the real home.
    """
    home = work / "spark-home"
    home.mkdir()
    for entry in spark_home().iterdir():
        if entry.name != "python":
            (home / entry.name).symlink_to(entry)
    return home


def _worker_env(work: Path) -> dict[str, str]:
    env = {
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_HOME": str(session_spark_home(work)),
    }
    env.update(TEST_AWS_ENV)
    return env


class ConnectServer:
    """A Spark Connect server process on a free loopback port."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.log = log_dir / "connect-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``sc://`` address."""
        return f"sc://{HOST}:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        """Start the server and wait until its port accepts connections."""
        env = {
            **os.environ,
            **_worker_env(self.log.parent),
            "SPARK_LOCAL_IP": HOST,
            "SPARK_LOG_DIR": str(self.log.parent),
            "SPARK_PID_DIR": str(self.log.parent),
        }
        command = [
            "bash",
            str(Path(env["SPARK_HOME"]) / "sbin" / "start-connect-server.sh"),
            "--wait",
            "--master",
            "local[2,3]",
            "--conf",
            f"spark.connect.grpc.binding.address={HOST}",
            "--conf",
            f"spark.connect.grpc.binding.port={self.port}",
            "--conf",
            f"spark.driver.host={HOST}",
            "--conf",
            f"spark.driver.bindAddress={HOST}",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.sql.shuffle.partitions=4",
        ]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError("the Spark Connect server exited", self._tail())
            with socket.socket() as sock:
                sock.settimeout(1.0)
                if sock.connect_ex((HOST, self.port)) == 0:
                    return
            time.sleep(0.5)
        raise ServerStartError(f"no Spark Connect server on {self.url} in {timeout:.0f} s")

    def _tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server and its JVM."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def _classic(master: str, work: Path) -> Any:
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName("dedupstore-tests")
        .config("spark.driver.host", HOST)
        .config("spark.driver.bindAddress", HOST)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.worker.dir", str(work / "worker"))
        .config("spark.local.dir", str(work / "local"))
        .config("spark.executor.memory", "768m")
    )
    for key, value in TEST_AWS_ENV.items():
        builder = builder.config(f"spark.executorEnv.{key}", value)
    saved = dict(os.environ)
    os.environ.update(_worker_env(work))  # the JVM and its Python workers inherit it
    try:
        session = builder.getOrCreate()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    session.sparkContext.setLogLevel("ERROR")
    return session


@pytest.fixture(scope="session")
def spark(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A SparkSession of the engine named by the test's parameter (default ``local``)."""
    engine: str = getattr(request, "param", "local")
    work = tmp_path_factory.mktemp(f"spark-{engine}")
    if engine == "local":
        session = _classic("local[2,3]", work)
        yield session
        session.stop()
    elif engine == "cluster":
        session = _classic("local-cluster[2,1,1024]", work)
        yield session
        session.stop()
    elif engine == "connect":
        from pyspark.sql import SparkSession

        server = ConnectServer(work)
        saved = dict(os.environ)
        try:
            server.start()
            session = SparkSession.builder.remote(server.url).create()
            yield session
            session.stop()
        finally:
            server.stop()
            # PySpark marks the process "Connect mode" (CONNECT_MODE), which would turn
            # the next classic session, and every child process, into a client
            os.environ.clear()
            os.environ.update(saved)
    else:  # pragma: no cover - a typo in a parametrization
        raise ValueError(engine)


@pytest.fixture(autouse=True)
def _connect_mode_only_on_connect(request: pytest.FixtureRequest) -> Iterator[None]:
    """Hide Connect mode from every test not on the ``connect`` engine.

    The Connect session lives until its worker ends or needs another engine; meanwhile
    the worker may run other tests (pytest-xdist), whose classic code, ``spark-submit``
    or child processes must not become Connect clients.
    """
    callspec = getattr(request.node, "callspec", None)
    on_connect = callspec is not None and callspec.params.get("spark") == "connect"
    hidden = None if on_connect else os.environ.pop(CONNECT_MODE, None)
    try:
        yield
    finally:
        if hidden is not None:
            os.environ[CONNECT_MODE] = hidden
