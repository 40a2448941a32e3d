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

# Every JVM the tests start (Spark's driver, the local-cluster master, workers and executors,
# the Connect server, spark-submit) runs for seconds, not hours: the client compiler only and
# the serial collector spend about a fifth less CPU than C2 and G1 on the 2-core machine
# (docs/contributing.md), and change nothing Spark computes.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
_given = os.environ.get("JAVA_TOOL_OPTIONS", "")
if JVM_OPTIONS not in _given:
    os.environ["JAVA_TOOL_OPTIONS"] = f"{_given} {JVM_OPTIONS}".strip()

pytest_plugins = [
    "pytester",
    "tests.suite_rules",
    "tests.server_fixtures",
    "tests.outbox_backends",
    "tests.spark_fixtures",
]
