"""The code blocks of the README and of ``docs/`` run as written and print what they say.

Every fenced block of ``README.md`` and of the Markdown pages under ``docs/`` (whatever
its language: python, sh, toml, text, ...) is either an **example** or a **fragment**:

* an example is named by a first line ``# example: <name>`` or by
  ``<!-- example: <name> -->`` right above its fence, and exactly one test runs it,
  registered with :func:`runs` (in this module or in any other ``tests/test_*.py``:
  ``from tests.test_readme import runs``); names are unique across all the files;
* a fragment says why it cannot run in ``<!-- fragment: <reason> -->`` right above
  its fence.

A block that is neither fails :func:`test_every_block_is_run_by_one_test_or_is_a_fragment`.
MyST directives (```` ```{include} ````, ```` ```{toctree} ````, ...) are not code
blocks. Server URLs are visible constants at the top of a snippet
(``REDIS = "redis://..."``), replaced by the test server's; everything else runs as a
user would paste it.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.servers import Server

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TESTS = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent

#: Fence languages counted as Python (so a block cannot escape by its label).
PYTHON = {"python", "py", "python3"}
#: An opening fence: its indentation, its backticks or tildes, its info string.
OPENING = re.compile(r"^([ \t]*)(`{3,}|~{3,})[ \t]*([^`\n]*?)[ \t]*$")
MARKER = re.compile(r"\A# example: ([a-z0-9][a-z0-9-]*)[ \t]*\n")
EXAMPLE_ABOVE = re.compile(r"\A<!-- example: ([a-z0-9][a-z0-9-]*) -->\Z")
FRAGMENT = re.compile(r"\A<!-- fragment: (.*) -->\Z")

#: example name -> the test that runs it (filled by @runs at import)
RUNNERS: dict[str, str] = {}
#: example name -> where that test is defined (file, qualified name): a module imported
#: again (by importlib, under the same file) registers the same test, not a second one
_RUNNER_SOURCES: dict[str, tuple[str, str]] = {}

F = TypeVar("F", bound=Callable[..., Any])


def runs(name: str) -> Callable[[F], F]:
    """Register the decorated test as the one that runs the block named ``name``."""

    def register(test: F) -> F:
        source = (test.__code__.co_filename, test.__qualname__)
        assert _RUNNER_SOURCES.get(name, source) == source, f"two tests run example {name!r}"
        _RUNNER_SOURCES[name] = source
        RUNNERS[name] = test.__name__
        return test

    return register


@dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown text."""

    language: str
    code: str  # dedented by the fence's indentation
    line: int  # of the opening fence, 1-based
    above: str  # the line right above the fence


def fenced_blocks(text: str) -> Iterator[Block]:
    """Every fenced block of ``text``, in order, indented ones (in lists) included;
    MyST directives (an info string starting with ``{``) are left out."""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = OPENING.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence, info = opening.groups()
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = index + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line
            for line in lines[index + 1 : end]
        ]
        if not info.startswith("{"):
            language = info.split()[0].lower() if info else ""
            above = lines[index - 1].strip() if index >= 1 else ""
            code = "\n".join(body) + "\n" if body else ""
            yield Block(language, code, index + 1, above)
        index = end + 1


def block_name(block: Block) -> str | None:
    """The example name of ``block``: its first line's marker or the comment above it."""
    marker = MARKER.match(block.code)
    if marker is not None:
        return marker.group(1)
    above = EXAMPLE_ABOVE.match(block.above)
    return above.group(1) if above is not None else None


def unrun_blocks_of(
    texts: Mapping[str, str], runners: Mapping[str, str], corpus: str = "the README"
) -> list[str]:
    """What is wrong with the fenced blocks of ``texts`` (file name -> Markdown) given the
    tests ``runners`` (example name -> test): every block an example run by one test, or
    a fragment with a reason; example names unique across all the texts."""
    problems: list[str] = []
    marked: Counter[str] = Counter()
    for where_file, text in texts.items():
        for block in fenced_blocks(text):
            where = f"{where_file}:{block.line}"
            name = block_name(block)
            fragment = FRAGMENT.match(block.above)
            if MARKER.match(block.code) and EXAMPLE_ABOVE.match(block.above):
                problems.append(f"{where}: named twice (first line and the comment above)")
            if fragment is not None:
                if not fragment.group(1).strip():
                    problems.append(f"{where}: '<!-- fragment: -->' gives no reason")
                if name is not None:
                    problems.append(f"{where}: a fragment cannot be an example too")
                continue
            if name is None:
                kind = "python" if block.language in PYTHON else (block.language or "plain")
                problems.append(
                    f"{where}: a {kind} block without '# example: <name>' (and a test of "
                    "tests/test_readme.py that runs it) or '<!-- fragment: <reason> -->' "
                    "above it (or '<!-- example: <name> -->' above it)"
                )
                continue
            marked[name] += 1
    for name, count in sorted(marked.items()):
        if count > 1:
            problems.append(f"example {name!r} names {count} blocks")
        if name not in runners:
            problems.append(f"example {name!r} is run by no test of tests/test_readme.py")
    for name, test in sorted(runners.items()):
        if name not in marked:
            problems.append(f"{test} runs example {name!r}, which {corpus} no longer has")
    return problems


def unrun_blocks(text: str, runners: Mapping[str, str]) -> list[str]:
    """What is wrong with the blocks of one Markdown ``text`` (as ``README.md``)."""
    return unrun_blocks_of({"README.md": text}, runners)


def markdown_files() -> list[Path]:
    """The README and every Markdown page of ``docs/`` (not the build output)."""
    pages = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [README, *pages]


def markdown_texts() -> dict[str, str]:
    """File name (relative to the repository) -> text, for every file the check reads."""
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in markdown_files()}


def import_test_modules() -> None:
    """Import every ``tests/test_*.py`` module, so that runners registered with
    :func:`runs` outside this module count too."""
    for path in sorted(TESTS.glob("test_*.py")):
        importlib.import_module(f"tests.{path.stem}")


def example(name: str) -> str:
    """The code of the block named ``name``, from the README or a page of ``docs/``."""
    found = [
        block.code
        for text in markdown_texts().values()
        for block in fenced_blocks(text)
        if block_name(block) == name
    ]
    assert len(found) == 1, f"{len(found)} blocks of the README and docs/ are '# example: {name}'"
    return found[0]


def replaced(code: str, old: str, new: str) -> str:
    """``code`` with the line ``old`` (which it must hold once) replaced by ``new``."""
    assert code.count(old) == 1, f"the snippet no longer says {old!r}"
    return code.replace(old, new)


def user_env(**extra: str) -> dict[str, str]:
    """A user's environment: no dedupstore settings of the harness, this checkout first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUPSTORE_")}
    env["PYTHONPATH"] = str(ROOT)  # the code under test, not an installed copy
    env.update(extra)
    return env


def run_python(
    code: str,
    cwd: Path,
    *,
    env: Mapping[str, str] | None = None,
    args: tuple[str, ...] = (),
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script in ``cwd`` with this interpreter (the venv's)."""
    script = cwd / "example.py"
    script.write_text(code, encoding="utf-8")
    return subprocess.run(
        [sys.executable, *args, str(script)],
        cwd=cwd,
        env=dict(env) if env is not None else user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def succeeded(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines ``done`` printed; it must have exited 0."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout.splitlines()


# ---------------------------------------------------------------------- every block


def test_every_block_is_run_by_one_test_or_is_a_fragment() -> None:
    """Every fenced block of the README and docs/, whatever its language (this replaced
    the check of the README's python blocks alone)."""
    import_test_modules()
    problems = unrun_blocks_of(markdown_texts(), RUNNERS, corpus="the README and docs/")
    assert not problems, "\n".join(problems)


def test_a_new_block_without_a_test_is_caught() -> None:
    """The check itself: an unmarked block, an unrun or doubled example, an unreasoned
    fragment, a runner whose example is gone."""
    text = textwrap.dedent(
        """
        ```python
        # example: a
        print(1)
        ```

        ```py
        print("new, unmarked")
        ```

        ```python
        # example: b
        ```
        ```python
        # example: b
        ```

        <!-- fragment:  -->
        ```python
        x
        ```

        <!-- fragment: needs your own cluster -->
        ```python
        y
        ```
        """
    )
    problems = unrun_blocks(text, {"a": "test_a", "gone": "test_gone"})
    assert len(problems) == 5, problems
    assert "README.md:7: a python block without '# example: <name>'" in problems[0]
    assert "gives no reason" in problems[1]
    assert problems[2:] == [
        "example 'b' names 2 blocks",
        "example 'b' is run by no test of tests/test_readme.py",
        "test_gone runs example 'gone', which the README no longer has",
    ]
    assert unrun_blocks(text.replace('print("new, unmarked")', "# example: c"), {}) != []


def test_the_check_covers_every_language_indented_blocks_and_every_file() -> None:
    """A shell block and an indented (list) block need a test or a reason too; a name
    may be given above the fence; names are unique across files; MyST directives are
    not code blocks."""
    page = textwrap.dedent(
        """
        ```sh
        make something
        ```

        - a list item:

          ```toml
          key = 1
          ```

        <!-- example: shell-a -->
        ```console
        $ dedupstore --help
        ```

        ```{include} ../README.md
        ```
        """
    )
    readme = "```sh\n# example: shell-a\necho\n```\n"
    problems = unrun_blocks_of({"README.md": readme, "docs/page.md": page}, {"shell-a": "t"})
    assert problems[0].startswith("docs/page.md:2: a sh block without")
    assert problems[1].startswith("docs/page.md:8: a toml block without")
    assert problems[2:] == ["example 'shell-a' names 2 blocks"], problems
    [indented] = [b for b in fenced_blocks(page) if b.language == "toml"]
    assert indented.code == "key = 1\n"
    assert [b.language for b in fenced_blocks(page)] == ["sh", "toml", "console"]
    marked = page.replace("```sh", "<!-- fragment: an example of a bad block -->\n```sh")
    marked = marked.replace("  ```toml", "  <!-- fragment: data -->\n  ```toml")
    assert unrun_blocks_of({"docs/page.md": marked}, {"shell-a": "t"}) == []


def test_runners_of_other_test_modules_count() -> None:
    """The check imports every tests/test_*.py first; importing one again registers
    nothing twice."""
    import_test_modules()
    before = dict(RUNNERS)
    import_test_modules()
    assert before == RUNNERS
    assert RUNNERS["outbox"] == "test_the_outbox_example_runs"


def test_every_built_in_class_opened_by_url_has_its_option_table_in_docs() -> None:
    """Each store, entity store, dispatcher and broker class the registries open by URL
    is rendered by an ``options-table`` directive (docs/_ext/options_table.py) on a page
    of docs/, so a new backend cannot ship without its generated table."""
    import importlib

    from dedupstore import registry

    def load(path: str) -> object:
        module, _, name = path.replace(":", ".").rpartition(".")
        return getattr(importlib.import_module(module), name)

    tabled = {
        load(m.group(1))
        for text in markdown_texts().values()
        for m in re.finditer(r"^```\{options-table\} ([\w.]+)[ \t]*$", text, re.M)
    }
    kinds: tuple[registry.Kind, ...] = ("store", "entity_store", "dispatcher", "broker")
    missing = sorted(
        f"{kind} {scheme}: {spec.target}"
        for kind in kinds
        for scheme, spec in registry.known(kind).items()
        if spec.target.startswith("dedupstore.") and load(spec.target) not in tabled
    )
    assert not missing, missing


# ---------------------------------------------------------------------- the examples


@runs("outbox")
@pytest.mark.sqlite
def test_the_outbox_example_runs(tmp_path: Path) -> None:
    lines = succeeded(run_python(example("outbox"), tmp_path))
    assert lines[:2] == ["processed", "duplicate"]
    assert lines[2] == str(["processed"] * 6 + ["duplicate"])
    assert lines[3] == "0"


@runs("stats")
@pytest.mark.sqlite
def test_the_stats_example_runs(tmp_path: Path) -> None:
    lines = succeeded(run_python(example("stats"), tmp_path))
    assert lines == ["0", "1", "None", "['orders']", "1", "{'orders'}"]


@runs("redis-streams-consumer")
@pytest.mark.redis
def test_the_redis_streams_consumer_example_runs(tmp_path: Path, redis_server: Server) -> None:
    code = replaced(  # the test's server, and keys of this run only
        example("redis-streams-consumer"),
        'REDIS, APP = "redis://localhost:6379/0", "shop"',
        f'REDIS, APP = "{redis_server.url}", "shop-{uuid.uuid4().hex[:8]}"',
    )
    assert succeeded(run_python(code, tmp_path)) == ["3", "{'total': 6}"]


@runs("rabbitmq")
@pytest.mark.rabbitmq
def test_the_rabbitmq_example_runs(tmp_path: Path, rabbitmq_server: Server) -> None:
    done = run_python(example("rabbitmq"), tmp_path, env=user_env(AMQP_URL=rabbitmq_server.url))
    assert succeeded(done) == [
        "3 {'processed': 2, 'duplicate': 1}",
        "{'balance': 750}",
    ]


@pytest.mark.redis
def test_the_hand_written_stream_entry_is_on_the_stream_the_broker_reads(
    redis_server: Server,
) -> None:
    """Issue 36: the README's `XADD orders ...` beside `destination=orders` was never read."""
    import shlex

    import redis

    from dedupstore.consumers import open_broker

    text = (DOCS / "consuming.md").read_text(encoding="utf-8")
    line = re.search(r"beside `destination=(\w+)`:\n`(XADD [^`]+)`", text, re.S)
    assert line is not None, "the brokers page's hand-written entry beside its destination"
    destination, command = line.group(1), shlex.split(line.group(2))
    group = f"g-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.delete(command[1])
        url = f"{redis_server.url}?destination={destination}&group={group}"
        with open_broker(url) as broker:
            client.execute_command(*command)
            deliveries = broker.fetch(10, 1.0)
        assert [d.headers.get("id") for d in deliveries] == ["m-1"]
        assert deliveries[0].headers.get("correlation_id") == "acct-1"
    finally:
        client.delete(command[1])
        client.close()


@runs("kafka")
@pytest.mark.timeout(180)
def test_the_kafka_example_runs(tmp_path: Path) -> None:
    """Against librdkafka's built-in mock cluster (the Kafka protocol over TCP, consumer
    groups, offset commits; not Kafka: no broker can be installed here), held by a
    producer of this process; only the bootstrap address of the snippet is replaced."""
    from confluent_kafka import Producer

    mock = Producer({"test.mock.num.brokers": 1, "log_level": 0})
    [broker] = mock.list_topics(timeout=10).brokers.values()
    code = replaced(
        example("kafka"), 'KAFKA = "localhost:9092"', f'KAFKA = "{broker.host}:{broker.port}"'
    )
    assert succeeded(run_python(code, tmp_path, timeout=150)) == [
        "{'processed': 2, 'duplicate': 1}",
        "{'balance': 750}",
    ]
    del mock


@runs("store-contract")
@pytest.mark.redis
def test_the_store_contract_example_runs(tmp_path: Path, redis_server: Server) -> None:
    code = replaced(  # the test's server, and keys of this run only
        example("store-contract"),
        'REDIS = "redis://localhost:6379/0"',
        f'REDIS = "{redis_server.url}?key_prefix=readme-{uuid.uuid4().hex[:8]}:"',
    )
    assert succeeded(run_python(code, tmp_path)) == [
        "True",
        "False",
        "True",
        "{'msg-2'}",
        "{'msg-1'}",
        "0",
        "2",
    ]


MY_STORE = '''
"""A backend "of your own" for the README's contract example: SQLite under myscheme.

``myscheme://localhost/<name>`` is the file ``<name>.db`` in ``$MYSTORE_DIR``.
"""

import os
from urllib.parse import urlsplit

from dedupstore.backends.sqlite import SqliteDeduplicationStore


class MyStore(SqliteDeduplicationStore):
    def __init__(self, url, **options):
        parts = urlsplit(str(url))
        if parts.netloc:  # as the tests name it; a pickled copy has the file's path
            url = f"myscheme:///{os.environ['MYSTORE_DIR']}/{parts.path.strip('/')}.db"
        super().__init__(url, **options)
'''


@runs("own-backend-contract")
@pytest.mark.sqlite
@pytest.mark.slow
def test_the_own_backend_contract_example_runs(tmp_path: Path) -> None:
    """The contract suite of the snippet, run by pytest, passes a backend of one's own
    (here ``mypkg.store:MyStore``, SQLite under the scheme ``myscheme``)."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "mypkg" / "store.py").write_text(MY_STORE, encoding="utf-8")
    data = tmp_path / "data"
    data.mkdir()
    code = example("own-backend-contract")
    (tmp_path / "test_my_store.py").write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_store.py"],
        cwd=tmp_path,
        env=user_env(MYSTORE_DIR=str(data)),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    summary = done.stdout.splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary
    assert list(data.glob("test-*.db")), "the suite did not use the backend"


@runs("spark-job")
@pytest.mark.sqlite
@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_the_spark_job_example_runs(tmp_path: Path) -> None:
    """On a plain session, as ``.venv/bin/python job.py`` starts it: the venv neither
    activated nor on the ``PATH``, no ``PYSPARK_PYTHON`` (the snippet's own
    ``use_this_python`` gives the local workers this interpreter)."""
    env = {
        k: v
        for k, v in user_env().items()
        if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV", "SPARK_HOME")
        and not k.startswith("SPARK_CONNECT")
    }
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(p for p in path if p and p != str(VENV_BIN))
    env["SPARK_LOCAL_IP"] = "127.0.0.1"  # the test machine's hostname may not resolve
    lines = succeeded(run_python(example("spark-job"), tmp_path, env=env, timeout=540))
    said = [line for line in lines if line and not line.startswith(("+", "|"))]  # not .show()'s
    assert said == [
        "['processed', 'processed', 'processed']",
        "['duplicate', 'duplicate', 'duplicate']",
        "0",
    ], "\n".join(lines)
    assert (tmp_path / "runs" / "2026-11-25" / "_SUCCESS").is_file()
    swept = [line.split("|")[4].strip() for line in lines if re.match(r"\|\s+\d+\|", line)]
    assert sum(map(int, swept)) == 3  # the sweep's ids_moved, over its 4 segments


# ---------------------------------------------------------------------- shell blocks


def section_blocks(heading: str, language: str, page: Path = README) -> list[Block]:
    """The ``language`` blocks of the section of ``page`` (the README or a page of
    ``docs/``) under ``heading`` (a whole line)."""
    text = "\n" + page.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(heading) + 2)
    section = text[start : end if end >= 0 else len(text)]
    return [b for b in fenced_blocks(section) if b.language == language]


@runs("quick-start")
@pytest.mark.sqlite
def test_the_quick_start_runs(tmp_path: Path) -> None:
    """The README's quick start shell block, with the venv of this run for its ``.venv`` (the
    install line is the harness's job): each command exits as the README says."""
    [block] = section_blocks("## Quick start", "sh")
    install, *rest = block.code.splitlines(keepends=True)
    assert install.strip() == "python3 -m venv .venv && .venv/bin/pip install --quiet -e ."
    commands = "".join(rest)
    assert commands.count(".venv") == commands.count(".venv/bin/")  # every use is a program
    script = commands.replace(".venv/bin/", f"{VENV_BIN}/")
    done = subprocess.run(
        ["bash", "-e", "-u", "-o", "pipefail", "-c", script],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert succeeded(done) == [
        "order-1\tadded",
        "order-2\tadded",
        "order-1\tduplicate",
        "order-1\tprocessed",
        "order-2\tprocessed",
        "True",
        "False",
        "{'order-2'}",
        "{'order-1'}",
        "True",
    ]
    # "exit 1 if one is not": the same `has` line with an id never added
    [has] = [line for line in rest if "/dedupstore has " in line]
    command = has.split("#", 1)[0].replace(".venv/bin/", f"{VENV_BIN}/") + " order-9"
    missing = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=user_env(), capture_output=True, text=True
    )
    assert missing.returncode == 1, missing.stderr
    assert missing.stdout.splitlines()[-1] == "order-9\tnot processed"


@runs("configuration-file")
@pytest.mark.sqlite
@pytest.mark.parametrize("environment", ["dev", "test", "prod"])
def test_the_configuration_file_is_accepted(tmp_path: Path, environment: str) -> None:
    """The ``dedupstore.toml`` of the configuration page, as written, resolves in each
    of its environments (``dedupstore config``: no I/O), the expanded secret masked."""
    block = section_blocks("# Per-environment configuration", "toml", DOCS / "configuration.md")[0]
    assert block.code == example("configuration-file")  # (the next block is a fragment)
    (tmp_path / "dedupstore.toml").write_text(block.code, encoding="utf-8")
    done = subprocess.run(
        [str(VENV_BIN / "dedupstore"), "config"],
        cwd=tmp_path,
        env=user_env(DEDUPSTORE_ENV=environment, PGPASSWORD="s3cret-for-the-test"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    shown = "\n".join(succeeded(done))
    assert f'"environment": "{environment}"' in shown
    assert "s3cret-for-the-test" not in shown


def test_the_readme_is_a_front_door() -> None:
    """At most 300 lines: the guide lives in docs/, the changelog in CHANGELOG.md."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert "## Changelog" not in text and (ROOT / "CHANGELOG.md").is_file()
