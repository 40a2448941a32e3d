"""The wheel installs one top-level import package, ``dedupstore``: the backends and
the Spark integration (the repository's top-level folders ``backends/`` and
``spark_integration/``) are mapped under it, so no generic name (``backends``) lands
on a user's import path."""

from __future__ import annotations

import zipfile
from pathlib import Path

from tests.wheel import build_wheel, top_level_names

ROOT_DIR = Path(__file__).resolve().parent.parent


def test_the_wheel_installs_only_the_dedupstore_package(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    assert top_level_names(wheel) == {"dedupstore"}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for module in (
        "dedupstore/outbox/__init__.py",
        "dedupstore/outbox/processor.py",
        "dedupstore/backends/__init__.py",
        "dedupstore/backends/sqlite.py",
        "dedupstore/backends/redis/store.py",
        "dedupstore/backends/py.typed",
        "dedupstore/spark/pipeline.py",
        "dedupstore/testing/contract.py",
        "dedupstore/py.typed",
    ):
        assert module in names, module
    # every package of the source tree is in the wheel (a new subpackage not listed in
    # pyproject.toml would be left out silently)
    for init in sorted(ROOT_DIR.glob("dedupstore/**/__init__.py")):
        module = init.relative_to(ROOT_DIR).as_posix()
        assert module in names, f"{module} is not in the wheel: list its package"
    assert not any(name.startswith(("backends/", "spark_integration/")) for name in names)
