"""The project's wheel, built once per test session from a copy of its sources."""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What the wheel is built from (a copy: the build writes beside its sources).
SOURCES = ("pyproject.toml", "README.md", "dedupstore", "backends", "spark_integration")


@functools.cache
def _built() -> Path:
    where = Path(tempfile.mkdtemp(prefix="dedupstore-wheel-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)  # the session's, not the machine's
    source = where / "source"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--wheel-dir", str(where / "dist"), str(source)),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (where / "dist").glob("dedupstore-*.whl")
    return wheel


def build_wheel(directory: Path) -> Path:
    """The project's wheel (built once per session), copied into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(_built(), directory))


def top_level_names(wheel: Path) -> set[str]:
    """The importable top-level names a wheel installs (its ``.dist-info`` aside)."""
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    return {
        top.removesuffix(".py")
        for top in tops
        if not top.endswith((".dist-info", ".data")) and (top.endswith(".py") or "." not in top)
    }
