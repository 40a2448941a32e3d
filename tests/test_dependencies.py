"""What the package imports is what ``pyproject.toml`` declares.

A module-level import of a third-party package must come from a requirement of the
part it belongs to: the core (``dedupstore``, the memory and SQLite backends) from
``project.dependencies``, a backend package from its extra, ``spark_integration`` from
the ``spark`` extra (each with what those requirements bring). And the core works
with nothing else installed: a child process that can import only the standard
library and the core's requirements imports ``dedupstore`` and processes a message.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import subprocess
import sys
import textwrap
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
#: Modules imported only on first use or for type checking, by design (each has its own test).
LAZY = {"dedupstore/metrics.py", "dedupstore/testing"}
#: The extra each part of the package needs (None: the core's dependencies).
PARTS: dict[str, str | None] = {
    "dedupstore": None,
    "backends/memory.py": None,
    "backends/sqlite.py": None,
    "backends/postgres": "postgres",
    "backends/redis": "redis",
    "backends/dynamodb": "dynamodb",
    "backends/cosmos": "cosmos",
    "backends/rabbitmq": "rabbitmq",
    "backends/kafka.py": "kafka",
    "spark_integration": "spark",
    "dedupstore/aio/faststream.py": "faststream",
}


@cache
def _providers() -> dict[str, set[str]]:
    """Top-level import name -> the (normalised) distributions that provide it."""
    return {
        module: {canonicalize_name(dist) for dist in dists}
        for module, dists in metadata.packages_distributions().items()
    }


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with what those require in turn (with
    the extras asked for: ``redis[hiredis]`` brings hiredis, ``redis`` alone does not)."""
    seen: set[tuple[str, str]] = set()  # (distribution, extra or '')
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "dedupstore":  # an extra that names others ('all'): their requirements
            for extra in req.extras:
                todo += [Requirement(r) for r in PYPROJECT["optional-dependencies"][extra]]
            continue
        extras = {"", *req.extras} - {e for n, e in seen if n == name}
        if not extras:
            continue
        seen.update((name, extra) for extra in extras)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return {name for name, _ in seen}


def _module_imports(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported (not inside functions, not
    under ``if TYPE_CHECKING``), third-party only."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                # an import in ``try`` whose ``except ImportError`` falls back is optional
                optional = any(
                    isinstance(h.type, ast.Name)
                    and h.type.id in ("ImportError", "ModuleNotFoundError")
                    for h in node.handlers
                )
                if not optional:
                    visit(node.body)

    visit(tree.body)
    own = {"dedupstore", "__future__"}
    return {n for n in names if n not in sys.stdlib_module_names and n not in own}


def _files(part: str) -> list[Path]:
    path = ROOT / part
    files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    inner = [p for p in PARTS if p.startswith(f"{part}/")]  # parts of their own
    return [
        f
        for f in files
        if not any(f.relative_to(ROOT).as_posix().startswith(x) for x in (*LAZY, *inner))
    ]


def _undeclared(part: str, core: list[str]) -> set[str]:
    """``file: module`` for each module-level import of ``part`` that no requirement of
    it provides (``core``: the core's requirements; an extra's come from PYPROJECT)."""
    extra = PARTS[part]
    declared = list(core)
    if extra is not None:
        declared += PYPROJECT["optional-dependencies"][extra]
    # the core's own requirements directly; an extra's with what they bring
    allowed = (
        {canonicalize_name(Requirement(r).name) for r in declared}
        if extra is None
        else _closure(declared)
    )
    return {
        f"{file.relative_to(ROOT)}: {module}"
        for file in _files(part)
        for module in _module_imports(file)
        if not _providers().get(module, set()) & allowed
    }


@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_import_comes_from_a_declared_requirement(part: str) -> None:
    missing = _undeclared(part, PYPROJECT["dependencies"])
    assert not missing, f"imported at module level but not declared: {sorted(missing)}"


def test_the_check_finds_an_import_its_part_does_not_declare() -> None:
    """Without tenacity among the core's requirements (as before it was one), the retry
    helper, the consume loop and the Spark jobs (whose extra does not list it) are reported."""
    core = [r for r in PYPROJECT["dependencies"] if not r.startswith("tenacity")]
    assert _undeclared("dedupstore", core) == {
        "dedupstore/calls.py: tenacity",
        "dedupstore/consumers/_command.py: tenacity",
        "dedupstore/consumers/_loop.py: tenacity",
    }
    assert _undeclared("spark_integration", core) == {"spark_integration/pipeline.py: tenacity"}


def test_every_part_of_the_package_is_checked() -> None:
    parts = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "backends").iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    parts.discard("backends/__init__.py")
    assert parts <= set(PARTS), sorted(parts - set(PARTS))


def test_the_core_works_with_only_its_own_requirements() -> None:
    """As after ``pip install dedupstore`` with no extra: every other third-party module
    is refused (as if absent), yet the package imports and processes a message."""
    core = sorted(
        {
            module
            for module, dists in _providers().items()
            if dists & _closure(PYPROJECT["dependencies"])
        }
    )
    code = textwrap.dedent(
        f"""
        import importlib.abc, sys, tempfile
        allowed = set({core!r}) | set(sys.stdlib_module_names) | {{"dedupstore"}}

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] not in allowed:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, Absent())
        import dedupstore
        from dedupstore.outbox import OutboxProcessor, Message, Send, InMemoryDispatcher

        def handler(state, message):
            return {{"n": state.get("n", 0) + 1}}, [Send("out", {{"id": message.id}})]

        with tempfile.TemporaryDirectory() as tmp:
            for url in ("memory://", f"sqlite:///{{tmp}}/core.db"):
                with dedupstore.open_entity_store(url) as ents, dedupstore.open_store(url) as dedup:
                    processor = OutboxProcessor(ents, dedup, InMemoryDispatcher())
                    first = processor.process(Message("m-1", "e-1", {{}}), handler)
                    again = processor.process(Message("m-1", "e-1", {{}}), handler)
                    assert (first.outcome, again.outcome) == ("processed", "duplicate"), url
            from dedupstore.cli import main
            from dedupstore.consumers import Consumer  # the consume loop, without a broker

            assert callable(Consumer) and "tenacity" in sys.modules  # its backoff, imported
            url = f"sqlite:///{{tmp}}/cli.db"
            assert main(["add", url, "order-1"]) == 0 and main(["has", url, "order-1"]) == 0
            # the Spark commands: listed as unavailable, refused with the extra to install
            import contextlib, io
            listed, errors = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(listed), contextlib.suppress(SystemExit):
                main(["--help"])
            listed = " ".join(listed.getvalue().split())
            assert "sweep (unavailable: the sweep command needs the pyspark" in listed, listed
            with contextlib.redirect_stderr(errors):
                assert main(["sweep", "--entities", url, "--store", url]) == 2
            assert "pip install 'dedupstore[spark]'" in errors.getvalue(), errors.getvalue()
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["order-1\tadded", "order-1\tprocessed", "ok"]


def test_what_a_requirement_brings_depends_on_its_extras_in_any_order() -> None:
    """``redis[hiredis]`` brings hiredis however often and in whatever order ``redis``
    is asked for too (a closure keyed by distribution alone lost the extra)."""
    assert "hiredis" not in _closure(["redis"])
    assert "hiredis" in _closure(["redis", "redis[hiredis]"])
    assert "hiredis" in _closure(["redis[hiredis]", "redis"])
    assert "pyarrow" in _closure(["pyspark[connect]"]) - _closure(["pyspark"])
