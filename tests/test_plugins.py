"""The one registry: every kind of plugin through the same code, entry points in
``dedupstore.<kind>``, install hints, and the examples of docs/plugins.md."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

import dedupstore
from dedupstore import ConfigurationError, registry
from dedupstore.cli import Command, main
from dedupstore.registry import KINDS, Kind, known, register, resolve
from tests.test_readme import example, run_python, runs, succeeded

pytestmark = pytest.mark.memory

#: kind -> a built-in name and the class it resolves to, and a class of another kind.
BUILT_IN: dict[str, tuple[str, str, str]] = {
    "store": (
        "memory",
        "dedupstore.backends.memory:MemoryDeduplicationStore",
        "dedupstore.backends.memory:MemoryEntityStore",
    ),
    "entity_store": (
        "sqlite",
        "dedupstore.backends.sqlite:SqliteEntityStore",
        "dedupstore.backends.sqlite:SqliteDeduplicationStore",
    ),
    "token_store": (
        "sqlite",
        "dedupstore.backends.sqlite:SqliteTokenStore",
        "dedupstore.backends.sqlite:SqliteDeduplicationStore",
    ),
    "dispatcher": (
        "memory",
        "dedupstore.backends.memory:MemoryDispatcher",
        "dedupstore.outbox:InMemoryDispatcher",
    ),
    "broker": (
        "redis",
        "dedupstore.backends.redis.consumer:RedisStreamsBroker",
        "dedupstore.backends.redis:RedisDispatcher",
    ),
    "command": (
        "sweep",
        "dedupstore.spark.cli:SweepCommand",
        "dedupstore.backends.memory:MemoryDispatcher",
    ),
}


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(__import__(module, fromlist=[name]), name)


class _Hello(Command):
    """A command plugin of the tests."""

    def add_parser(self, commands: Any, name: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = commands.add_parser(name, help="say hello")
        sub.add_argument("--to", default="world")
        return sub

    def run(self, args: argparse.Namespace) -> int:
        print(f"hello, {args.to}")
        return 0


@pytest.fixture
def scratch() -> Iterator[list[tuple[str, str]]]:
    """(kind, name) pairs a test registers, removed after it."""
    added: list[tuple[str, str]] = []
    yield added
    for kind, name in added:
        registry._registered[kind].pop(name, None)


def test_the_table_covers_every_kind() -> None:
    assert KINDS == ("store", "entity_store", "token_store", "dispatcher", "broker", "command")
    assert set(BUILT_IN) == set(KINDS)
    for kind in KINDS:
        assert registry.entry_point_group(kind) == f"dedupstore.{kind}"
    with pytest.raises(ValueError, match="unknown kind of plugin 'stores'"):
        known("stores")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kind of plugin"):
        register("backend", "x", "a:B")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_resolves_through_the_same_code(
    kind: Kind, scratch: list[tuple[str, str]]
) -> None:
    """Built-in, registered, clobbered, refused: the same steps and messages for each kind."""
    name, target, other = BUILT_IN[kind]
    assert known(kind)[name].target == target
    assert resolve(kind, name) is _load(target)
    # register, then the same target again (a no-op), then another one only with clobber
    scratch.append((kind, "mine"))
    register(kind, "mine", target)
    register(kind, "mine", target)
    assert resolve(kind, "mine") is _load(target)
    with pytest.raises(ValueError, match="clobber"):
        register(kind, "mine", other)
    register(kind, "mine", other, clobber=True)
    with pytest.raises(ConfigurationError, match=r"is not a .* subclass"):
        resolve(kind, "mine")
    with pytest.raises(ValueError, match=r"'package\.module:Class'"):
        register(kind, "bad", "no-colon")
    with pytest.raises(ValueError, match="lower-case name"):
        register(kind, "Upper", target)
    with pytest.raises(ConfigurationError, match=r"known .*: ") as info:
        resolve(kind, "nosuch")
    assert "nosuch" in str(info.value) and name in str(info.value)
    with pytest.raises(TypeError):
        known(kind)["x"] = known(kind)[name]  # type: ignore[index]


@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_point_in_dedupstore_kind_is_found_for_each_kind(
    kind: Kind, monkeypatch: pytest.MonkeyPatch, scratch: list[tuple[str, str]]
) -> None:
    name, target, _ = BUILT_IN[kind]
    group = registry.entry_point_group(kind)
    assert group == f"dedupstore.{kind}"
    offered = [
        EntryPoint("fromep", target, group),
        EntryPoint(name, "nowhere:Nothing", group),  # a built-in name: the table wins
    ]
    read: list[str] = []

    def entry_points(group: str) -> list[EntryPoint]:
        read.append(group)
        return [ep for ep in offered if ep.group == group]

    monkeypatch.setattr(registry, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_loaded", set())
    scratch.append((kind, "fromep"))
    assert resolve(kind, "fromep") is _load(target)
    assert "fromep" in known(kind)
    resolve(kind, "fromep")
    with pytest.raises(ConfigurationError):
        resolve(kind, "still-nosuch")
    assert read == [group], "read once per kind, and only this kind's group"
    assert known(kind)[name].target == target


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_requirement_names_the_extra_to_install(
    kind: Kind, scratch: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, target, _ = BUILT_IN[kind]
    scratch.append((kind, "needy"))
    register(kind, "needy", target, requires=("no_such_driver_mod",), extra="needy")
    with pytest.raises(ConfigurationError) as info:
        resolve(kind, "needy")
    message = str(info.value)
    assert "no_such_driver_mod" in message and "pip install 'dedupstore[needy]'" in message
    assert ("needy://" in message) == (kind != "command")


@pytest.mark.parametrize(
    ("kind", "name", "module", "extra"),
    [
        ("store", "redis", "redis", "redis"),
        ("entity_store", "postgres", "psycopg", "postgres"),
        ("dispatcher", "amqp", "pika", "rabbitmq"),
        ("broker", "kafka", "confluent_kafka", "kafka"),
        ("command", "sweep", "pyspark", "spark"),
    ],
)
def test_a_missing_built_in_driver_names_its_extra(
    kind: Kind, name: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert module in known(kind)[name].requires
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ConfigurationError, match=rf"pip install 'dedupstore\[{extra}\]'"):
        resolve(kind, name)


def test_a_missing_requirement_is_found_without_importing_it() -> None:
    code = textwrap.dedent(
        """
        import sys
        from dedupstore.registry import resolve
        resolve("command", "sweep")
        resolve("command", "demo")
        assert not [m for m in sys.modules if m.split(".")[0] == "pyspark"]
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-2000:]


def test_open_url_opens_url_kinds_only() -> None:
    with registry.open_url("store", "memory://x") as store:
        assert type(store).__name__ == "MemoryDeduplicationStore"
    with pytest.raises(ValueError, match="not opened by URL"):
        registry.open_url("command", "sweep://x")


def test_a_command_plugin_runs_and_is_listed(
    scratch: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.append(("command", "hello"))
    dedupstore.register("command", "hello", f"{__name__}:_Hello")
    assert main(["hello", "--to", "you"]) == 0
    assert capsys.readouterr().out == "hello, you\n"
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert "hello say hello" in listed and "the Spark sweep" in listed, listed


def test_a_command_plugin_that_cannot_load_is_listed_and_refused(
    scratch: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.append(("command", "needy"))
    register("command", "needy", f"{__name__}:_Hello", requires=("no_such_driver_mod",), extra="x")
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    assert "needy (unavailable: the needy command needs" in listed, listed
    assert main(["needy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dedupstore: error: the needy command needs the no_such_driver_mod")
    assert "pip install 'dedupstore[x]'" in err


def test_a_command_plugin_may_not_take_a_built_in_name(
    scratch: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    scratch.append(("command", "add"))
    register("command", "add", f"{__name__}:_Hello")
    assert main(["--help"]) == 2
    assert "has the name of a built-in command" in capsys.readouterr().err
    assert main(["add", "memory://x", "m-1"]) == 0  # the built-in runs
    assert capsys.readouterr().out == "m-1\tadded\n"


# ---------------------------------------------------------------------- docs/plugins.md


@runs("plugins-register")
def test_the_register_example(tmp_path: Path) -> None:
    lines = succeeded(run_python(example("plugins-register"), tmp_path))
    assert lines == [
        "MemoryDeduplicationStore True False",
        "kafka",
        "unknown store URL scheme 'nosuch'",
    ]


@runs("plugins-command")
def test_the_command_example(tmp_path: Path) -> None:
    assert succeeded(run_python(example("plugins-command"), tmp_path)) == ["hello, plugins", "0"]
