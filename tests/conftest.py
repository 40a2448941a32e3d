"""Suite-wide configuration: real servers, Spark, and the rules of ``tests/suite_rules.py``."""

from __future__ import annotations

import os
from pathlib import Path

# Child processes (Spark's Python workers, the CLI in a subprocess, worker scripts) import
# the tests' handler modules (``tests.*``): the project's root goes first on their path
# (the editable install maps the packages, not the root).
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _ROOT)]
)

pytest_plugins = [
    "pytester",
    "tests.suite_rules",
    "tests.server_fixtures",
    "tests.outbox_backends",
    "tests.spark_fixtures",
]
