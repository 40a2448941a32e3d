"""Real database servers run as local processes on free loopback ports, for the tests.

Each ``LocalServer`` owns a temporary work dir (data, config, ``server.log``) that
survives ``kill()`` and ``restart()`` and is deleted by ``stop()``.  Every server runs in
its own session; ``stop()``/``kill()`` take down its whole process tree, and an atexit
hook kills whatever is still running when the interpreter exits.

``ExternalServer`` and its subclasses stand for instances the harness did not start
(pointed at through environment variables); they cannot be killed or restarted.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import importlib.util
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self, TypedDict

__all__ = [
    "COSMOS_EMULATOR_KEY",
    "HOST",
    "Boto3ClientKwargs",
    "CosmosEndpoint",
    "CosmosServer",
    "DynamoDBEndpoint",
    "ExternalCosmos",
    "ExternalDynamoDB",
    "ExternalServer",
    "ExternalServerError",
    "LocalServer",
    "MotoServer",
    "PostgresServer",
    "RabbitMQServer",
    "RedisServer",
    "Server",
    "ServerError",
    "ServerStartError",
    "free_port",
]

HOST = "127.0.0.1"
#: The servers the suite starts run at this niceness (``nice -n``), ahead of the tests' own
#: processes: the heaviest tests (chaos runs of several consumer processes, Spark's JVMs)
#: take the load of a 2-core machine to 20-35, where a PostgreSQL connect measured up to
#: 12 s at niceness 0; a store server on its own host answers its clients promptly. As an
#: unprivileged user ``nice`` keeps the niceness (it says so in the server's log).
SERVER_NICENESS = -5
REPO_ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = "run scripts/install-test-deps.sh"
#: The well-known master key of the Azure Cosmos DB emulator (cosmosdb-server accepts any key).
COSMOS_EMULATOR_KEY = (
    "C2y6yDjf5/R+ob0N8A7Cgv30VRDJIWEHLM+4QDU5DE2nQ9nDuVTqobD4b8mGGyPMbIZnqyMsEcaGQy67XIw/Jw=="
)
_LOG_TAIL_LINES = 40
_PORT_IN_USE_MARKERS = ("address already in use", "eaddrinuse")


class ServerError(RuntimeError):
    """A test server could not be started or controlled."""


class ServerStartError(ServerError):
    """A test server did not come up; the message carries the tail of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        self.log_tail = log_tail
        if log_tail:
            message = f"{message}\n--- server log (tail) ---\n{log_tail}"
        super().__init__(message)


class ExternalServerError(ServerError):
    """An operation that needs a server process the harness owns."""


_handed_out_ports: set[int] = set()
#: Server ports come from below the kernel's ephemeral range (which outgoing connections
#: and ``bind(0)`` draw from), so no client socket takes the port of a server that is
#: down between ``kill()`` and ``restart()``.
_SERVER_PORTS = range(15000, 32768)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_slice() -> range:
    """This process's share of the server ports: disjoint per pytest-xdist worker
    (``gw<i>`` of ``PYTEST_XDIST_WORKER_COUNT``), so no worker can start a server on, or
    expect nothing on, a port another worker's server uses or will restart on."""
    ports = range(_SERVER_PORTS.start, min(_SERVER_PORTS.stop, _ephemeral_low()))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = len(ports) // max(count, 1)
    return ports[index * size : (index + 1) * size]


_port_cursor: int | None = None


def free_port() -> int:
    """Return a loopback TCP port that is free now and not handed out before by this process.

    Ports come from this process's own slice (see ``_port_slice``), starting at a random
    place in it (other test runs on the machine draw from the same ranges); a slice too
    small for the kernel's range falls back to ``bind(0)``.
    """
    global _port_cursor
    ports = _port_slice()
    if len(ports) < 100:
        return _kernel_port()
    if _port_cursor is None:
        _port_cursor = random.SystemRandom().randrange(len(ports))
    for _ in range(len(ports)):
        port = ports[_port_cursor % len(ports)]
        _port_cursor += 1
        if port in _handed_out_ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        _handed_out_ports.add(port)
        return port
    raise ServerError(f"no free port left in {ports}")


def _kernel_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
        if port not in _handed_out_ports:
            _handed_out_ports.add(port)
            return port


# --------------------------------------------------------------------------- interface


class Server(abc.ABC):
    """What tests see of a server, whether the harness started it or not."""

    #: Short label used in messages and temp dir names.
    name: str = "server"

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The address clients connect to."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the server and wait until it answers (no-op when already running)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the server and delete its data."""

    @abc.abstractmethod
    def kill(self) -> None:
        """SIGKILL the server (a crash), keeping its data for ``restart()``."""

    @abc.abstractmethod
    def restart(self) -> None:
        """Start again on the same port with the same data."""

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class Boto3ClientKwargs(TypedDict):
    """Keyword arguments of ``boto3.client()`` / ``boto3.resource()``."""

    endpoint_url: str
    region_name: str
    aws_access_key_id: str
    aws_secret_access_key: str


class DynamoDBEndpoint(Server):
    """A DynamoDB-compatible endpoint with fake credentials."""

    region: ClassVar[str] = "us-east-1"

    @property
    def endpoint_url(self) -> str:
        """Same as ``url``."""
        return self.url

    @property
    def client_env(self) -> dict[str, str]:
        """Environment variables that point boto3 (and the CLI) at this endpoint."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL_DYNAMODB": self.endpoint_url,
        }

    @property
    def client_kwargs(self) -> Boto3ClientKwargs:
        """Keyword arguments for ``boto3.client("dynamodb", ...)`` / ``boto3.resource``."""
        return {
            "endpoint_url": self.endpoint_url,
            "region_name": self.region,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
        }


class CosmosEndpoint(Server):
    """A Cosmos DB-compatible endpoint."""

    key: str = COSMOS_EMULATOR_KEY

    @property
    def endpoint_url(self) -> str:
        """Same as ``url``."""
        return self.url

    @property
    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``azure.cosmos.CosmosClient(...)``.

        Endpoint discovery must be off: the emulator advertises ``https://`` locations.
        """
        return {
            "url": self.endpoint_url,
            "credential": self.key,
            "enable_endpoint_discovery": False,
        }


# --------------------------------------------------------------------------- externals


class ExternalServer(Server):
    """A server the harness did not start; ``start``/``stop`` do nothing."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self._url = url

    @property
    def url(self) -> str:
        return self._url

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def kill(self) -> None:
        raise self._not_owned("kill")

    def restart(self) -> None:
        raise self._not_owned("restart")

    def _not_owned(self, operation: str) -> ExternalServerError:
        return ExternalServerError(
            f"cannot {operation} the {self.name} server at {self.url}: it was provided through "
            "an environment variable, not started by the test harness"
        )


class ExternalDynamoDB(DynamoDBEndpoint, ExternalServer):
    """An already-running DynamoDB-compatible endpoint."""

    def __init__(self, endpoint_url: str) -> None:
        super().__init__("dynamodb", endpoint_url)


class ExternalCosmos(CosmosEndpoint, ExternalServer):
    """An already-running Cosmos DB endpoint."""

    def __init__(self, endpoint_url: str, key: str = COSMOS_EMULATOR_KEY) -> None:
        super().__init__("cosmos", endpoint_url)
        self.key = key


# --------------------------------------------------------------------------- processes


_live_servers: set[LocalServer] = set()


class LocalServer(Server):
    """A server process owned by the harness; subclasses provide the command and probe."""

    #: Signal for a graceful stop, sent to ``_main_pid()``.
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM
    stop_timeout: ClassVar[float] = 20.0

    def __init__(self, *, startup_timeout: float = 60.0) -> None:
        self.host = HOST
        self.port = 0  # chosen on the first start, kept by restart()
        self.startup_timeout = startup_timeout
        #: Seconds the last start took until the server answered.
        self.startup_seconds: float | None = None
        self._workdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # -- hooks for subclasses

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The command line that runs the server in the foreground."""

    @abc.abstractmethod
    def _is_ready(self) -> bool:
        """Whether the server answers requests (must not raise)."""

    def _initialize(self) -> None:
        """Prepare a fresh work dir (called once, before the first start)."""

    def _environment(self) -> dict[str, str] | None:
        """The server's environment (None: this process's)."""
        return None

    def _main_pid(self) -> int:
        """The process that receives ``stop_signal``."""
        return self._require_proc().pid

    def _after_kill(self) -> None:
        """Tidy up after all server processes were SIGKILLed."""

    def _workdir_parent(self) -> str | None:
        """Where the work dir is created (None: the default temp dir)."""
        return None

    def _choose_ports(self) -> None:
        """Pick the ports of a first start (again on each attempt; kept by restart())."""
        self.port = free_port()

    # -- public API

    @property
    def workdir(self) -> Path:
        """The temporary directory holding the server's data and log."""
        if self._workdir is None:
            raise ServerError(f"{self.name} server has no work dir (not started, or stopped)")
        return self._workdir

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Pid of the process the harness spawned (may be a wrapper such as runuser)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        if self.running:
            return
        first_start = self._workdir is None
        if first_start:
            self._workdir = Path(
                tempfile.mkdtemp(prefix=f"dedupstore-{self.name}-", dir=self._workdir_parent())
            )
            _live_servers.add(self)
            try:
                self._initialize()
            except BaseException:
                self._discard_workdir()
                raise
        attempts = 3 if first_start else 1  # a fresh port may be grabbed by someone else
        for attempt in range(1, attempts + 1):
            if first_start:
                self._choose_ports()
            try:
                self._launch()
                return
            except ServerStartError as exc:
                port_taken = any(m in exc.log_tail.lower() for m in _PORT_IN_USE_MARKERS)
                if not port_taken or attempt == attempts:
                    raise

    def stop(self) -> None:
        self._terminate(graceful=True)
        self._discard_workdir()

    def kill(self) -> None:
        if not self.running:
            raise ServerError(f"{self.name} server is not running")
        self._kill_processes()
        self._proc = None
        _check_port_released(self.name, self.host, self.port)
        self._after_kill()

    def restart(self) -> None:
        if self._workdir is None:
            raise ServerError(f"{self.name} server was never started or has been stopped")
        self._terminate(graceful=True)
        self.start()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines the server printed since its latest launch."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except (OSError, ServerError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} {self.url if self.port else '(no port yet)'} {state}>"

    # -- process management

    def _require_proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise ServerError(f"{self.name} server is not running")
        return self._proc

    def _launch(self) -> None:
        command = ["nice", "-n", str(SERVER_NICENESS), *self._command()]
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        began = time.monotonic()
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self._environment(),
                start_new_session=True,
            )
        deadline = began + self.startup_timeout
        delay = 0.02
        while not self._is_ready():
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise ServerStartError(
                    f"{self.name} server exited with code {code} before answering on port "
                    f"{self.port}; command: {shlex.join(command)}",
                    self.log_tail(),
                )
            if time.monotonic() > deadline:
                self._kill_processes()
                self._proc = None
                raise ServerStartError(
                    f"{self.name} server did not answer on port {self.port} within "
                    f"{self.startup_timeout:.0f} s; command: {shlex.join(command)}",
                    self.log_tail(),
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        self.startup_seconds = time.monotonic() - began

    def _terminate(self, *, graceful: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        if graceful and proc.poll() is None:
            # The server's processes may outlive the one spawned (a launcher that
            # exits first leaves them to init): wait for each, then kill what is left,
            # so no old server still answers on the port when a new one starts.
            tree = _server_processes(proc.pid)
            give_up = time.monotonic() + self.stop_timeout
            with contextlib.suppress(ProcessLookupError, ServerError):
                os.kill(self._main_pid(), self.stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.stop_timeout)
            _wait_gone(tree, max(0.0, give_up - time.monotonic()))
            if proc.poll() is not None:  # the tree below it is not _kill_processes' to find
                for pid in tree:
                    if _alive(pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                _require_gone(self.name, tree)
        self._kill_processes()
        self._proc = None

    def _kill_processes(self) -> None:
        """SIGKILL the spawned process, its process group and all its descendants."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return  # reaped: its pid may belong to someone else now
        pids = _freeze_tree(proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _require_gone(self.name, pids - {proc.pid})

    def _discard_workdir(self) -> None:
        _live_servers.discard(self)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session id) of a process, or None when it is gone."""
    return _read_stat_of(f"/proc/{pid}")


def _read_stat_of(directory: str) -> tuple[str, int, int] | None:
    """(state, ppid, session id) from ``directory``/stat (a process or one of its threads)."""
    try:
        stat = Path(f"{directory}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[3])


def _server_processes(root: int) -> set[int]:
    """The descendants of ``root`` and the other processes of its session (``root``
    was started in a new session: a server process reparented to init stays in it),
    from one scan of ``/proc``."""
    children: dict[int, list[int]] = {}
    found: set[int] = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _read_stat(pid := int(entry.name))) is not None:
            children.setdefault(stat[1], []).append(pid)
            if stat[2] == root and pid != root:
                found.add(pid)
    stack = [root, *found]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _freeze_tree(root: int) -> set[int]:
    """SIGSTOP ``root`` and its descendants until no new ones appear; return them all."""
    frozen: set[int] = set()
    while new := ({root} | _server_processes(root)) - frozen:
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen |= new
    return frozen


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until the processes have exited (see :func:`_alive`); those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid for pid in pids if _alive(pid)}
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether a process still runs: a zombie main thread whose other threads are still
    exiting (a SIGKILLed beam.smp flushing a file) still holds the process's sockets."""
    stat = _read_stat(pid)
    if stat is None:
        return False
    if stat[0] not in "ZX":
        return True
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(
        (t := _read_stat_of(f"/proc/{pid}/task/{task}")) and t[0] not in "ZX" for task in tasks
    )


#: How long SIGKILLed server processes may take to exit (a process in uninterruptible
#: sleep, an fsync on a loaded disk, dies only when the call returns).
_EXIT_TIMEOUT = 60.0


def _require_gone(name: str, pids: set[int]) -> None:
    """Wait for SIGKILLed processes to exit; raise, naming them, if some do not."""
    alive = _wait_gone(pids, _EXIT_TIMEOUT)
    if alive:
        shown = ", ".join(f"{pid} ({_described(pid)})" for pid in sorted(alive))
        raise ServerError(
            f"{name} server processes outlived SIGKILL by {_EXIT_TIMEOUT:.0f} s: {shown}"
        )


def _described(pid: int) -> str:
    """A process's state, kernel wait channel and command line, as far as readable."""
    parts = []
    for name in ("stat", "wchan", "cmdline"):
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode()
            parts.append(text.rsplit(")", 1)[1].split()[0] if name == "stat" else text.strip())
    return " ".join(parts)[:200]


def _check_port_released(name: str, host: str, port: int) -> None:
    """After all of a server's processes exited, nothing may listen on its port: if
    something does, raise naming the processes that hold it."""
    listening, holders = _listeners(port)
    if listening:
        shown = ", ".join(f"{pid} ({_described(pid)})" for pid in sorted(holders)) or "?"
        raise ServerError(f"{name} server killed, but port {host}:{port} is still held by {shown}")


def _listeners(port: int) -> tuple[bool, set[int]]:
    """Whether a TCP socket listens on ``port``, and the pids of the processes holding it
    (as far as their open files can be read)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    holders = set()
    if inodes:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    for fd in os.scandir(f"/proc/{entry.name}/fd"):
                        with contextlib.suppress(OSError):
                            if os.readlink(fd.path) in inodes:
                                holders.add(int(entry.name))
    return bool(inodes), holders


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_live_servers):
        with contextlib.suppress(OSError, ServerError):
            server._terminate(graceful=False)
        server._discard_workdir()


# --------------------------------------------------------------------------- probes


def _which(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise ServerStartError(f"{program!r} not found on PATH; {INSTALL_HINT}")
    return path


def _http_answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status counts)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- servers


class RedisServer(LocalServer):
    """Debian's ``redis-server``, AOF persistence on by default (``appendfsync always``)."""

    name = "redis"

    def __init__(
        self,
        appendonly: bool = True,
        appendfsync: str = "always",
        *,
        requirepass: str | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        super().__init__(startup_timeout=startup_timeout)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.requirepass = requirepass

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _command(self) -> list[str]:
        return [
            _which("redis-server"),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--logfile", "",
            *(["--requirepass", self.requirepass] if self.requirepass else []),
        ]  # fmt: skip

    def _is_ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                answer = sock.recv(64)
                # "-LOADING" while reading the AOF; "-NOAUTH" once up with a password
                return answer.startswith((b"+PONG", b"-NOAUTH"))  # "-LOADING" while reading the AOF
        except OSError:
            return False


def _pg_bindir() -> Path:
    """The PostgreSQL server binaries: ``pg_config --bindir``, else the newest Debian one."""
    candidates: list[Path] = []
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True
        ).stdout
        candidates.append(Path(out.strip()))
    candidates += sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    raise ServerStartError(
        f"PostgreSQL server binaries (initdb, postgres) not found; {INSTALL_HINT}"
    )


#: Per bindir, the data dir of a pristine cluster that every PostgresServer copies.
_pg_templates: dict[str, Path] = {}


class PostgresServer(LocalServer):
    """A private PostgreSQL cluster: superuser ``dedup``/``dedup`` owning database ``dedup``.

    Unix-socket connections are trusted; TCP connections need the password
    (scram-sha-256).  As root, everything runs as the ``postgres`` user via ``runuser``.
    """

    name = "postgres"
    stop_signal = signal.SIGINT  # fast shutdown; SIGTERM would wait for clients to leave
    os_user: ClassVar[str] = "postgres"
    user: ClassVar[str] = "dedup"
    password: ClassVar[str] = "dedup"
    database: ClassVar[str] = "dedup"

    def __init__(self, *, durable: bool = True, startup_timeout: float = 60.0) -> None:
        """``durable=False``: ``fsync=off`` and ``synchronous_commit=off`` (benchmarks only)."""
        super().__init__(startup_timeout=startup_timeout)
        self.durable = durable
        self._bindir: Path | None = None

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{self.database}"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def socket_dir(self) -> Path:
        return self.workdir / "socket"

    @property
    def bindir(self) -> Path:
        if self._bindir is None:
            self._bindir = _pg_bindir()
        return self._bindir

    @staticmethod
    def _as_root() -> bool:
        return os.geteuid() == 0

    def _workdir_parent(self) -> str | None:
        # The postgres user must be able to traverse every parent of the data dir.
        return "/tmp" if self._as_root() else None

    def _as_os_user(self, command: list[str]) -> list[str]:
        return ["runuser", "-u", self.os_user, "--", *command] if self._as_root() else command

    def _run(self, command: list[str], stdin: str | None = None) -> None:
        result = subprocess.run(
            self._as_os_user(command),
            input=stdin,
            capture_output=True,
            text=True,
            cwd=self.workdir,
            timeout=self.startup_timeout,
            check=False,
        )
        if result.returncode != 0:
            raise ServerStartError(
                f"{shlex.join(command)} failed with code {result.returncode}",
                (result.stdout + result.stderr)[-4000:],
            )

    def _initialize(self) -> None:
        # A copy of this process's pristine cluster (made once: initdb and CREATE DATABASE
        # cost seconds, a copy a fraction of one), by the OS user so that it owns the copy.
        template = self._template()
        self.data_dir.mkdir(mode=0o700)
        self.socket_dir.mkdir(mode=0o700)
        if self._as_root():
            self.workdir.chmod(0o755)
            for path in (self.data_dir, self.socket_dir):
                shutil.chown(path, self.os_user, self.os_user)
        self._run(["cp", "-a", f"{template}/.", str(self.data_dir)])

    def _template(self) -> Path:
        """The data dir of a cluster that was initialized and never started, per process."""
        key = str(self.bindir)
        if key not in _pg_templates:
            where = Path(
                tempfile.mkdtemp(prefix="dedupstore-pgtemplate-", dir=self._workdir_parent())
            )
            atexit.register(shutil.rmtree, where, True)
            _pg_templates[key] = where / "data"
            self._init_cluster(where, _pg_templates[key])
        return _pg_templates[key]

    def _init_cluster(self, where: Path, data_dir: Path) -> None:
        bindir = self.bindir
        pwfile = where / "pwfile"
        pwfile.write_text(self.password + "\n")
        pwfile.chmod(0o600)
        data_dir.mkdir(mode=0o700)
        if self._as_root():
            where.chmod(0o755)
            for path in (data_dir, pwfile):
                shutil.chown(path, self.os_user, self.os_user)
        self._run([
            str(bindir / "initdb"),
            "--pgdata", str(data_dir),
            "--username", self.user,
            "--pwfile", str(pwfile),
            "--auth-local", "trust",
            "--auth-host", "scram-sha-256",
            "--encoding", "UTF8",
            "--locale", "C",
            "--no-instructions",
        ])  # fmt: skip
        pwfile.unlink()
        # Single-user mode creates the database without a running server or a client.
        self._run(
            [str(bindir / "postgres"), "--single", "-D", str(data_dir), "postgres"],
            stdin=f'CREATE DATABASE "{self.database}";\n',
        )

    def _command(self) -> list[str]:
        return self._as_os_user([
            str(self.bindir / "postgres"),
            "-D", str(self.data_dir),
            "-p", str(self.port),
            "-c", f"listen_addresses={self.host}",
            "-c", f"unix_socket_directories={self.socket_dir}",
            "-c", f"fsync={'on' if self.durable else 'off'}",
            "-c", f"synchronous_commit={'on' if self.durable else 'off'}",
            "-c", "full_page_writes=on",
            "-c", "max_connections=200",
        ])  # fmt: skip

    def _is_ready(self) -> bool:
        command = [
            str(self.bindir / "pg_isready"), "--quiet", "--timeout=2",
            "--host", self.host, "--port", str(self.port),
            "--dbname", self.database, "--username", self.user,
        ]  # fmt: skip
        try:
            return subprocess.run(command, check=False, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _main_pid(self) -> int:
        # As root the spawned process is runuser; signal the postmaster itself.
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        return super()._main_pid()

    def _after_kill(self) -> None:
        # All server processes are dead, but the killed postmaster may linger as a zombie
        # until init reaps it; a lock file naming that pid makes the next postmaster refuse
        # to start ("lock file ... already exists"), so remove the stale locks and sockets.
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)
        for path in self.socket_dir.glob(".s.PGSQL.*"):
            path.unlink(missing_ok=True)


class MotoServer(DynamoDBEndpoint, LocalServer):
    """moto's DynamoDB server (in-memory; a restart loses all data), one request at a time.

    See ``tests/moto_serialized.py`` for why stock ``moto_server`` is not used.
    """

    name = "dynamodb"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _command(self) -> list[str]:
        if importlib.util.find_spec("moto") is None:
            raise ServerStartError(f"moto is not installed in {sys.executable}; {INSTALL_HINT}")
        launcher = Path(__file__).with_name("moto_serialized.py")
        return [sys.executable, str(launcher), self.host, str(self.port)]

    def _is_ready(self) -> bool:
        return _http_answers(f"{self.url}/moto-api/")


class CosmosServer(CosmosEndpoint, LocalServer):
    """``@vercel/cosmosdb-server`` from the repo's ``node_modules``, over plain HTTP.

    In-memory (a restart loses all data); accepts any key.
    """

    name = "cosmos"
    package: ClassVar[str] = "@vercel/cosmosdb-server"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def entry_point(cls) -> Path:
        """The package's CLI script (its ``bin`` entry)."""
        package_dir = REPO_ROOT / "node_modules" / cls.package
        try:
            manifest = json.loads((package_dir / "package.json").read_text())
        except OSError as exc:
            raise ServerStartError(
                f"{cls.package} is not installed ({exc}); {INSTALL_HINT}"
            ) from exc
        bin_entry = manifest["bin"]
        relative = bin_entry if isinstance(bin_entry, str) else next(iter(bin_entry.values()))
        return package_dir / relative

    def _command(self) -> list[str]:
        return [
            _which("node"), str(self.entry_point()),
            "--host", self.host, "--port", str(self.port), "--no-ssl",
        ]  # fmt: skip

    def _is_ready(self) -> bool:
        return _http_answers(f"{self.url}/")


_RABBITMQ_SCRIPT = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
#: The AMQP 0-9-1 protocol header a client opens with; a broker answers Connection.Start.
_AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
#: Starts epmd on its own port in the server's process tree (the one Erlang would start
#: itself daemonizes and escapes stop()/kill()), waits until it answers, runs the broker
#: script (which turns SIGTERM into a clean shutdown), and stops epmd once the broker has
#: exited: a graceful stop leaves nothing behind.
_RABBITMQ_LAUNCHER = """
epmd -port "$ERL_EPMD_PORT" -address 127.0.0.1 &
epmd_pid=$!
tries=0
until epmd -port "$ERL_EPMD_PORT" -names >/dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -gt 200 ]; then
        echo "epmd did not start on port $ERL_EPMD_PORT"
        kill "$epmd_pid"
        exit 1
    fi
    sleep 0.05
done
"$0" &
broker_pid=$!
trap 'kill -TERM "$broker_pid" 2>/dev/null' TERM INT
wait "$broker_pid"
code=$?
wait "$broker_pid" 2>/dev/null  # a trapped signal ends the first wait early
kill "$epmd_pid" 2>/dev/null
exit "$code"
"""


class RabbitMQServer(LocalServer):
    """Debian's ``rabbitmq-server`` on free ports: AMQP, distribution and its own epmd.

    Everything lives in the work dir: the node's database (``RABBITMQ_MNESIA_BASE``),
    logs, an empty config file and env file, and ``HOME`` (the Erlang cookie). The node
    is ``rabbit-<amqp port>@localhost``; user ``guest``/``guest`` on vhost ``/``
    (loopback connections only). A kill and restart keep the durable queues and the
    persistent messages they confirmed, but not always a queue declared an instant
    before the kill (RabbitMQ answers declare-ok before its metadata is on disk).
    Runs as the current user (root included).
    """

    name = "rabbitmq"
    stop_timeout = 30.0
    user: ClassVar[str] = "guest"
    password: ClassVar[str] = "guest"

    def __init__(self, *, startup_timeout: float = 120.0) -> None:
        super().__init__(startup_timeout=startup_timeout)
        self.dist_port = 0
        self.epmd_port = 0

    @property
    def url(self) -> str:
        return f"amqp://{self.user}:{self.password}@{self.host}:{self.port}/%2F"

    @property
    def nodename(self) -> str:
        return f"rabbit-{self.port}@localhost"

    def declare_queues(self, *queues: str, queue_type: str = "classic") -> None:
        """Declare durable ``queues`` (as the dispatcher and the broker of ``queue_type``
        do) and restart gracefully, so that a later kill keeps them: RabbitMQ answers
        declare-ok before its metadata store has the record on disk."""
        import pika

        from dedupstore.backends.rabbitmq._client import queue_arguments

        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            channel = connection.channel()
            for queue in queues:
                channel.queue_declare(queue, durable=True, arguments=queue_arguments(queue_type))
        finally:
            connection.close()
        self.restart()

    def _choose_ports(self) -> None:
        # all three again when one was taken (the log names EADDRINUSE for any of them)
        self.port, self.dist_port, self.epmd_port = free_port(), free_port(), free_port()

    def _initialize(self) -> None:
        for sub in ("home", "mnesia", "log"):
            (self.workdir / sub).mkdir()
        (self.workdir / "rabbitmq.conf").write_text(
            "loopback_users.guest = true\n"
            # the harness's machines are small: no disk-space alarm blocking publishers
            "disk_free_limit.absolute = 1MB\n"
            "vm_memory_high_watermark.relative = 0.8\n"
        )
        (self.workdir / "rabbitmq-env.conf").write_text("")
        (self.workdir / "enabled_plugins").write_text("[].\n")

    def _command(self) -> list[str]:
        script = _RABBITMQ_SCRIPT if _RABBITMQ_SCRIPT.is_file() else Path(_which("rabbitmq-server"))
        _which("epmd")
        return ["sh", "-c", _RABBITMQ_LAUNCHER, str(script)]

    def _environment(self) -> dict[str, str]:
        work = self.workdir
        return {
            **os.environ,
            "HOME": str(work / "home"),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": self.host,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": self.host,
            "RABBITMQ_MNESIA_BASE": str(work / "mnesia"),
            "RABBITMQ_LOG_BASE": str(work / "log"),
            "RABBITMQ_LOGS": "-",  # to stdout: server.log
            "RABBITMQ_CONFIG_FILE": str(work / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(work / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(work / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(work / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(work / "rabbitmq.pid"),
            # the harness starts epmd itself (_RABBITMQ_LAUNCHER)
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-start_epmd false",
        }

    def _is_ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=2) as sock:
                sock.sendall(_AMQP_HEADER)
                # a method frame (type 1) on channel 0: Connection.Start
                return sock.recv(8).startswith(b"\x01\x00\x00")
        except OSError:
            return False
