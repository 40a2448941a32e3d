"""Backends are written from the public backend API alone (:mod:`dedupstore.backend`).

Every module under ``backends/`` is parsed (ast) and checked for:

(a) an import from the core other than ``dedupstore.backend`` (or any name starting
    with ``_`` from it);
(b) an attribute ``x._name`` (read, written or defined) where ``_name`` is a private
    member defined by a class of the core (methods, class attributes and ``self._x``
    assignments of ``dedupstore/**.py``), unless it is one of the hooks a backend
    implements (:data:`dedupstore.backend.HOOKS`) or a private member the backend
    defines itself that no base class of the API defines;
(c) an attribute ``obj._name`` on another object than ``self``/``cls``/``super()``
    where ``_name`` is defined by a class of another module of the same backend
    package (an entity store reaching into its deduplication store);
    A class whose bases all come from third-party imports (a driver's connection
    pool) is not a class of the API: the private members it reaches on
    ``self``/``cls``/``super()`` are that library's, and neither (b) nor (c) applies
    to them;
(d) a private member reached by name: ``part_of(client, "_x", ...)`` (the attributes
    a connection's rules read from a client are declared public), ``getattr`` & co.
    with a private member of the core.

The page ``docs/backend-api.md`` writes a backend from the public API and runs it
against the shipped contract kit (:func:`test_the_public_api_backend_example_runs`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dedupstore.backend as api
from tests.test_readme import MARKER, PYTHON, fenced_blocks, runs, user_env

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "dedupstore"
BACKENDS = ROOT / "backends"
PAGE = ROOT / "docs" / "backend-api.md"

#: The one core module a backend may import.
ALLOWED_MODULES = {"dedupstore.backend"}
#: The classes of the API a backend subclasses: their private members are the core's,
#: even when a backend assigns one (it would write the core's state).
BASES = {
    "Client",
    "Closing",
    "Connection",
    "DeduplicationStore",
    "EntityStore",
    "URLDispatcher",
    "Broker",
    "ReadBack",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _class_members(cls: ast.ClassDef) -> set[str]:
    """The names ``cls`` defines: methods, class attributes, ``self.x``/``cls.x`` stores."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return names


def _classes(tree: ast.AST) -> Iterator[ast.ClassDef]:
    yield from (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef))


def core_private_names() -> tuple[set[str], set[str]]:
    """(private members of the core's classes, those of the bases backends subclass)."""
    every: set[str] = set()
    bases: dict[str, set[str]] = {}
    parents: dict[str, list[str]] = {}
    for path in CORE.rglob("*.py"):
        for cls in _classes(ast.parse(path.read_text(encoding="utf-8"))):
            members = {name for name in _class_members(cls) if _private(name)}
            every |= members
            bases.setdefault(cls.name, set()).update(members)
            parents.setdefault(cls.name, []).extend(
                b.id for b in cls.bases if isinstance(b, ast.Name)
            )
    of_bases: set[str] = set()
    todo = list(BASES)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        of_bases |= bases.get(name, set())
        todo.extend(parents.get(name, []))
    return every, of_bases


@dataclass(frozen=True)
class Finding:
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}"


def check_module(
    source: str,
    where: str,
    *,
    own: set[str],
    siblings: set[str],
    core: tuple[set[str], set[str]] | None = None,
) -> list[Finding]:
    """What breaks the rules in one backend module's ``source``.

    ``own``: the private names the backend package defines itself; ``siblings``: those
    defined by classes of the package's other modules (not this one)."""
    every, of_bases = core if core is not None else core_private_names()
    tree = ast.parse(source)
    found: list[Finding] = []
    theirs = _on_foreign_self(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module == "dedupstore" or module.startswith("dedupstore."):
                if module.startswith("dedupstore.backends"):
                    continue
                if module not in ALLOWED_MODULES:
                    found.append(Finding(where, node.lineno, f"imports the core module {module}"))
                for alias in node.names:
                    if _private(alias.name):
                        found.append(Finding(where, node.lineno, f"imports {module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                if (name == "dedupstore" or name.startswith("dedupstore.")) and not (
                    name in ALLOWED_MODULES or name.startswith("dedupstore.backends")
                ):
                    found.append(Finding(where, node.lineno, f"imports the core module {name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node not in theirs:
            name = node.attr
            text = ast.unparse(node)
            if name in api.HOOKS:
                continue
            if name in of_bases or (name in every and name not in own):
                found.append(Finding(where, node.lineno, f"{text}: a private member of the core"))
                continue
            target = node.value
            on_self = isinstance(target, ast.Name) and target.id in ("self", "cls")
            on_super = isinstance(target, ast.Call) and ast.unparse(target.func) == "super"
            if not (on_self or on_super) and name in siblings:
                found.append(
                    Finding(where, node.lineno, f"{text}: a private member of a sibling module")
                )
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            # by name: part_of(client, "_x", ...) reads only declared (public) attributes;
            # getattr & co. may not reach the core's private members either
            function = node.func.id
            if function in ("part_of", "getattr", "setattr", "hasattr") and len(node.args) >= 2:
                named = node.args[1]
                if isinstance(named, ast.Constant) and isinstance(named.value, str):
                    name = named.value
                    if _private(name) and (
                        function == "part_of"
                        or (name not in api.HOOKS and (name in of_bases or name in every - own))
                    ):
                        found.append(
                            Finding(
                                where, node.lineno, f"{function}(..., {name!r}): private by name"
                            )
                        )
    for cls in _classes(tree):
        for name in _class_members(cls):
            if _private(name) and name in of_bases and name not in api.HOOKS:
                found.append(
                    Finding(
                        where,
                        cls.lineno,
                        f"{cls.name} defines {name}, a private member of the core",
                    )
                )
    return found


def _third_party_names(tree: ast.Module) -> set[str]:
    """The names a module imports from outside dedupstore (absolute imports only)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "dedupstore":
                names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "dedupstore":
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def _base_name(base: ast.expr) -> str:
    """The imported name a base class expression starts from (``ConnectionPool[T]``,
    ``psycopg.Connection``: ``ConnectionPool``, ``psycopg``)."""
    while isinstance(base, ast.Subscript | ast.Attribute):
        base = base.value
    return base.id if isinstance(base, ast.Name) else ""


def _on_foreign_self(tree: ast.Module) -> set[ast.Attribute]:
    """The attributes on ``self``/``cls``/``super()`` inside the methods of a class whose
    bases all come from third-party imports (it is not a class of the API)."""
    imported = _third_party_names(tree)
    theirs: set[ast.Attribute] = set()
    for cls in _classes(tree):
        if not cls.bases or not all(_base_name(b) in imported for b in cls.bases):
            continue
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(method):
                if isinstance(node, ast.Attribute):
                    target = node.value
                    if (isinstance(target, ast.Name) and target.id in ("self", "cls")) or (
                        isinstance(target, ast.Call) and ast.unparse(target.func) == "super"
                    ):
                        theirs.add(node)
    return theirs


def _packages() -> dict[str, list[Path]]:
    """Each backend (a package, or a single module) -> its modules."""
    packages: dict[str, list[Path]] = {}
    for path in sorted(BACKENDS.rglob("*.py")):
        relative = path.relative_to(BACKENDS)
        key = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        packages.setdefault(key, []).append(path)
    return packages


def backend_findings() -> list[Finding]:
    core = core_private_names()
    found: list[Finding] = []
    for modules in _packages().values():
        defined = {
            path: {
                name
                for cls in _classes(ast.parse(path.read_text(encoding="utf-8")))
                for name in _class_members(cls)
                if _private(name)
            }
            for path in modules
        }
        own = set().union(*defined.values())
        for path in modules:
            siblings = set().union(*(names for p, names in defined.items() if p != path))
            siblings -= defined[path]
            found += check_module(
                path.read_text(encoding="utf-8"),
                str(path.relative_to(ROOT)),
                own=own,
                siblings=siblings,
                core=core,
            )
    return found


def test_backends_use_the_public_backend_api_only() -> None:
    found = backend_findings()
    assert not found, f"{len(found)} private accesses:\n" + "\n".join(map(str, found))


def test_the_checker_flags_private_accesses() -> None:
    """The anti-test: a backend snippet breaking each rule is flagged, a clean one is not."""
    bad = (
        "from dedupstore.client import Client\n"
        "from dedupstore.backend import _CONTRACT_KIT\n"
        "import dedupstore.calls\n"
        "class S(DeduplicationStore):\n"
        "    _pending = None\n"
        "    def _add_one(self, request):\n"
        "        self._secret_values()\n"
        "        part_of(self, '_commands', str), getattr(self, '_pending_lock')\n"
        "        return self._dedup._sql_has, client._closed\n"
    )
    bad += (
        "from psycopg_pool import ConnectionPool\n"
        "class P(ConnectionPool, DeduplicationStore):\n"
        "    def f(self, client):\n"
        "        return self._lock, client._closed\n"
    )
    found = check_module(bad, "bad.py", own=set(), siblings={"_sql_has"})
    said = "\n".join(map(str, found))
    for expected in (
        "imports the core module dedupstore.client",
        "imports dedupstore.backend._CONTRACT_KIT",
        "imports the core module dedupstore.calls",
        "self._secret_values: a private member of the core",
        "client._closed: a private member of the core",
        "self._dedup._sql_has: a private member of a sibling module",
        "S defines _pending, a private member of the core",
        "part_of(..., '_commands'): private by name",
        "getattr(..., '_pending_lock'): private by name",
        "self._lock: a private member of the core",  # P is also a DeduplicationStore
    ):
        assert expected in said, said
    good = (
        "from dedupstore.backend import DeduplicationStore\n"
        "from .store import helper\n"
        "class S(DeduplicationStore):\n"
        "    def _configure(self):\n"
        "        super()._configure()\n"
        "        self._table = self.options['table']\n"
        "    def _add_one(self, request):\n"
        "        self.check_open()\n"
        "        return self._table, other._table\n"
        "from psycopg_pool import ConnectionPool\n"
        "class P(ConnectionPool['C']):\n"
        "    def reconnect_failed(self):\n"
        "        with self._lock:\n"
        "            super()._maybe_grow_pool()\n"
    )
    assert check_module(good, "good.py", own={"_table"}, siblings=set()) == []


def test_every_public_name_is_documented() -> None:
    """``__all__`` is the module's names, each named in its docstring."""
    doc = api.__doc__ or ""
    missing = [name for name in api.__all__ if not re.search(rf"\b{name}\b", doc)]
    assert not missing, missing
    for name in api.__all__:
        assert getattr(api, name) is not None


def test_importing_a_backend_does_not_import_the_contract_kit() -> None:
    code = (
        "import sys, dedupstore.backends.memory, dedupstore.backends.sqlite\n"
        "print('pytest' in sys.modules, 'dedupstore.testing' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == ["False", "False"]


def page_example(name: str) -> str:
    """The code of the page's Python block ``# example: name``."""
    found = [
        block.code
        for block in fenced_blocks(PAGE.read_text(encoding="utf-8"))
        if block.language in PYTHON
        and (m := MARKER.match(block.code)) is not None
        and m.group(1) == name
    ]
    assert len(found) == 1, f"{len(found)} blocks of {PAGE.name} are '# example: {name}'"
    return found[0]


def test_the_page_lists_every_public_name() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert page.startswith("# "), "the page starts with its # Title"
    missing = [name for name in api.__all__ if f"`{name}`" not in page]
    assert not missing, missing


@runs("own-backend-public-api")
def test_the_public_api_backend_example_runs(tmp_path: Path) -> None:
    """The page's dict-backed store, written from ``dedupstore.backend`` alone, passes the
    shipped contract suite (run by pytest, as a user would)."""
    code = page_example("own-backend-public-api")
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dedupstore"):
            assert node.module in ("dedupstore", "dedupstore.backend"), node.module
    (tmp_path / "test_dict_store.py").write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_dict_store.py"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    summary = done.stdout.splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


@pytest.mark.parametrize("name", sorted(api.HOOKS))
def test_every_hook_is_a_method_of_a_base(name: str) -> None:
    bases = [api.Client, api.DeduplicationStore, api.TokenStore, api.EntityStore, api.URLDispatcher]
    assert any(name in vars(base) for base in bases), name
