"""The README's outbox example runs as written and prints what it says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import Server

pytestmark = pytest.mark.sqlite

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_outbox_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(block for block in blocks if "OutboxProcessor(" in block)
    script = tmp_path / "example.py"
    script.write_text(example, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["processed", "duplicate"]
    assert lines[2] == str(["processed"] * 6 + ["duplicate"])
    assert lines[3] == "0"


@pytest.mark.rabbitmq
def test_the_rabbitmq_example_runs(tmp_path: Path, rabbitmq_server: Server) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(block for block in blocks if "open_broker(AMQP" in block)
    script = tmp_path / "example.py"
    script.write_text(example, encoding="utf-8")
    env = {**os.environ, "AMQP_URL": rabbitmq_server.url}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "3 {'processed': 2, 'duplicate': 1}",
        "{'balance': 750}",
    ]
