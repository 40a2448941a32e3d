"""Running the Spark jobs as a user would: own jobs, shipped code, small inputs, quiet retries.

* a job of the README's shape, started from the virtual environment's Python without
  activating it and without ``PYSPARK_PYTHON`` (a ``python3`` on the ``PATH`` that
  refuses to run stands for "another interpreter"), on a plain SparkSession with
  its 200 shuffle partitions;
* the code shipped to a ``local-cluster`` with ``spark-submit --py-files``, driver
  and workers on a Python that does not have the project on its path;
* adaptive execution merging ``process_messages``' shuffle partitions without ever
  splitting an entity across tasks;
* :func:`dedupstore.spark.session.quiet_task_retries` counting a killed worker's
  retried task and restoring the loggers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import dedupstore
from dedupstore.outbox import Message, Send
from dedupstore.spark import process_messages
from dedupstore.spark._faults import _claim
from dedupstore.spark.order_pipeline import task_attempts
from dedupstore.spark.session import TASK_FAILURE_LOGGERS, is_local_master, quiet_task_retries
from tests.spark_fixtures import TEST_AWS_ENV, spark_home
from tests.wheel import build_wheel

ROOT = Path(__file__).resolve().parents[1]


def handle_sequence(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    state.setdefault("seen", []).append(message.id)
    return state, []


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without a chosen Python for Spark or the venv on the PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV", "SPARK_HOME")
        and not k.startswith("SPARK_CONNECT")
    }
    venv_bin = str(Path(sys.executable).parent)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env["PATH"] = os.pathsep.join(path)
    env.update(TEST_AWS_ENV)
    env.update(extra)
    return env


def _refusing_python3(directory: Path) -> Path:
    """A ``python3`` that refuses to run: what Spark starts if nobody chose its Python."""
    directory.mkdir(parents=True, exist_ok=True)
    fake = directory / "python3"
    fake.write_text("#!/bin/sh\necho 'not the interpreter of this job' >&2\nexit 97\n")
    fake.chmod(0o755)
    return directory


def test_local_masters_are_told_from_cluster_masters() -> None:
    for master in ("local", "local[*]", "local[2]", "local[2,3]", "local-cluster[2,1,1024]"):
        assert is_local_master(master), master
    for master in ("yarn", "spark://h:7077", "k8s://https://h:6443", "localhost", "local[2"):
        assert not is_local_master(master), master


# ---------------------------------------------------------------------- a user's own job

OWN_JOB = textwrap.dedent(
    """
    import json, sys
    from pyspark.sql import SparkSession, functions as F
    from dedupstore.outbox import Send
    from dedupstore.spark import process_messages

    def handle(state, message):            # pure: no I/O, no clock, no randomness
        seen = [*state.get("seen", []), message.id]
        return {**state, "seen": seen}, [Send("orders.seen", {"id": message.id})]

    db = sys.argv[1]
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    # input without Python, like spark.read.parquet: the first Python is ours
    orders = spark.range(300).select(
        F.format_string("m%03d", (F.col("id") * 37) % 300).alias("id"),
        F.format_string("order-%d", F.col("id") % 25).alias("order_id"),
        F.col("id").cast("int").alias("seq"),
    )
    results = process_messages(
        orders, handle, entities_url=db, dedup_url=db, dispatcher_url=db,
        correlation_col="order_id", order_col="seq",
    )
    out = results.withColumn("task", F.spark_partition_id()).collect()
    # after the first call, the session's other Python work runs this interpreter too
    local_rows = spark.createDataFrame([(n,) for n in range(10)], "n int")
    tasks_of = {}
    for r in out:
        tasks_of.setdefault(r["correlation_id"], set()).add(r["task"])
    print(json.dumps({
        "workers_python": spark.sparkContext.pythonExec,
        "shuffle_partitions": spark.conf.get("spark.sql.shuffle.partitions"),
        "outcomes": sorted(r["outcome"] for r in out),
        "tasks": len({r["task"] for r in out}),
        "entities_split": sum(len(t) > 1 for t in tasks_of.values()),
        "python_after": local_rows.selectExpr("sum(n)").first()[0],
    }))
    spark.stop()
    """
)


@pytest.mark.sqlite
@pytest.mark.slow
def test_an_own_job_runs_from_an_unactivated_venv_in_few_tasks(tmp_path: Path) -> None:
    """No PYSPARK_PYTHON, the venv not on the PATH: the workers still run this interpreter."""
    job = tmp_path / "job.py"
    job.write_text(OWN_JOB, encoding="utf-8")
    fake = _refusing_python3(tmp_path / "bin")
    env = _clean_env()
    env["PATH"] = os.pathsep.join([str(fake), env["PATH"]])
    db = f"sqlite:///{tmp_path}/own.db"
    done = subprocess.run(
        [sys.executable, str(job), db],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["workers_python"] == sys.executable
    assert report["shuffle_partitions"] == "200"
    assert report["outcomes"] == ["processed"] * 300
    assert report["entities_split"] == 0
    assert 1 <= report["tasks"] < 200  # adaptive execution merged the small partitions
    assert report["python_after"] == 45
    with dedupstore.open_entity_store(db) as entities:
        found = entities.load_many([f"order-{e}" for e in range(25)])
    for e in range(25):
        seqs = [n for n in range(300) if n % 25 == e]
        assert found[f"order-{e}"].state["seen"] == [f"m{(n * 37) % 300:03d}" for n in seqs]


# ---------------------------------------------------------------------- adaptive execution


@pytest.mark.parametrize("spark", ["local"], indirect=True)
@pytest.mark.sqlite
def test_merged_shuffle_partitions_keep_each_entity_whole_and_in_order(
    spark: Any, tmp_path: Path
) -> None:
    """Partitions merged into many tasks (not one): each entity in one task, in order."""
    from pyspark.sql import functions as F

    rows = [(f"m{(n * 7919) % 3000:05d}", f"e{n % 97}", 3000 - n) for n in range(3000)]
    df = spark.createDataFrame(rows, "id string, correlation_id string, rank int")
    db = f"sqlite:///{tmp_path}/merged.db"
    small_tasks = {  # merge 200 partitions into tasks of about 4 KB of shuffle data
        "spark.sql.shuffle.partitions": "200",
        "spark.sql.adaptive.enabled": "true",
        "spark.sql.adaptive.coalescePartitions.parallelismFirst": "false",
        "spark.sql.adaptive.advisoryPartitionSizeInBytes": "4k",
        "spark.sql.adaptive.coalescePartitions.minPartitionSize": "1k",
    }
    saved = {key: spark.conf.get(key, None) for key in small_tasks}
    try:
        for key, value in small_tasks.items():
            spark.conf.set(key, value)
        tasks: dict[str, dict[str, set[int]]] = {}
        for tag, partitions in (("merged", None), ("fixed", 200)):
            results = process_messages(
                df.withColumn("correlation_id", F.concat(df.correlation_id, F.lit(f"-{tag}"))),
                handle_sequence,
                entities_url=db,
                dedup_url=db,
                dispatcher_url=db,
                order_col="rank",
                partitions=partitions,
            )
            bucket = F.expr("pmod(hash(correlation_id), 200)")
            out = results.select(
                "correlation_id", "outcome", F.spark_partition_id().alias("task"), bucket.alias("b")
            ).collect()
            assert Counter(r["outcome"] for r in out) == Counter({"processed": 3000})
            by_entity: dict[str, set[int]] = {}
            for r in out:
                by_entity.setdefault(r["correlation_id"], set()).add(r["task"])
            assert all(len(t) == 1 for t in by_entity.values()), tag
            tasks[tag] = by_entity
            if partitions is None:  # merged: contiguous ranges of the 200 hash buckets
                pairs = sorted({(r["b"], r["task"]) for r in out})
                assert [t for _, t in pairs] == sorted(t for _, t in pairs)
                assert 1 < len({r["task"] for r in out}) < 100
            else:  # an explicit count: the hash bucket is the task, nothing merged
                assert all(r["task"] == r["b"] for r in out)
    finally:
        for key, value in saved.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
    with dedupstore.open_entity_store(db) as entities:
        for tag in tasks:
            for e in range(97):
                seen = entities.load(f"e{e}-{tag}").state["seen"]
                ranks = [3000 - n for n in range(e, 3000, 97)]
                assert seen == [rows[3000 - r][0] for r in sorted(ranks)], (tag, e)


# ---------------------------------------------------------------------- quiet retries


@pytest.mark.parametrize("spark", ["local"], indirect=True)
def test_quiet_task_retries_counts_the_killed_worker_and_restores_the_loggers(
    spark: Any, tmp_path: Path
) -> None:
    marker = str(tmp_path / "killed")

    def die_once(batches: Any) -> Any:
        for batch in batches:
            if _claim(marker):
                os._exit(3)  # the Python worker dies; Spark retries the task
            yield batch

    config = spark.sparkContext._jvm.org.apache.logging.log4j.LogManager.getContext(
        False
    ).getConfiguration()
    with quiet_task_retries(spark) as retries:
        for name in TASK_FAILURE_LOGGERS:
            assert str(config.getLoggerConfig(name).getLevel()) == "OFF"
        rows = spark.range(0, 100, 1, 2).mapInArrow(die_once, "id long").collect()
    assert sorted(r["id"] for r in rows) == list(range(100))
    assert Path(marker).exists()
    assert retries.failed_attempts == 1
    for name in TASK_FAILURE_LOGGERS:  # no level of their own again: they follow the root
        assert config.getLoggerConfig(name).getName() != name
    with quiet_task_retries(spark) as calm:
        assert spark.range(10).count() == 10
    assert calm.failed_attempts == 0
    assert task_attempts(spark) == 3  # local[2,3]: what lets the demo's kill be retried


# ---------------------------------------------------------------------- shipped code

SHIPPED_HANDLER = textwrap.dedent(
    """
    from dedupstore.outbox import Send

    def handle(state, message):
        total = state.get("total", 0) + message.body["amount"]
        return {**state, "total": total}, [Send("ledger.posted", {"total": total})]
    """
)

SHIPPED_JOB = textwrap.dedent(
    """
    import json, sys
    import pyarrow as pa
    from pyspark.sql import SparkSession
    from handlers import handle
    from dedupstore.spark import drop_processed, process_messages

    db = sys.argv[1]
    spark = SparkSession.builder.getOrCreate()
    rows = [(f"t{n}", f"acct-{n % 5}", n, n % 7) for n in range(60)]
    df = spark.createDataFrame(rows, "id string, account string, seq int, amount int")
    results = process_messages(
        df, handle, entities_url=db, dedup_url=db, dispatcher_url=db,
        correlation_col="account", order_col="seq", cleanup="inline",
    ).collect()
    left = drop_processed(df, db, correlation_col="account").count()

    def where(batches):
        import dedupstore, dedupstore.backends.sqlite, dedupstore.spark, handlers
        for _ in batches:
            yield pa.RecordBatch.from_pylist([{
                "dedupstore": dedupstore.__file__,
                "backends": dedupstore.backends.sqlite.__file__,
                "spark": dedupstore.spark.__file__,
                "handlers": handlers.__file__,
            }])

    places = spark.range(0, 4, 1, 4).mapInArrow(
        where, "dedupstore string, backends string, spark string, handlers string"
    ).collect()
    print(json.dumps({
        "outcomes": sorted(r["outcome"] for r in results),
        "left": left,
        "driver": sys.modules["dedupstore.spark"].__file__,
        "workers": sorted({v for r in places for v in r.asDict().values()}),
    }))
    spark.stop()
    """
)


def _python_without_the_project(directory: Path) -> Path:
    """A venv that sees this one's libraries (pyspark, pyarrow, ...) but not the project."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120
    )
    python = directory / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # a path line, not this venv's site directory: its .pth files (the editable
    # install of the project) are not read
    Path(purelib, "libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.sqlite
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_code_shipped_with_py_files_runs_on_a_local_cluster(tmp_path: Path) -> None:
    """The README's --py-files recipe: the workers import the package from the shipped
    wheel (a zip: its one top-level package, ``dedupstore``, with the backends and the
    Spark integration under it)."""
    python = _python_without_the_project(tmp_path / "venv")
    env = _clean_env(PYSPARK_DRIVER_PYTHON=str(python), SPARK_LOCAL_IP="127.0.0.1")
    env.pop("PYTHONPATH", None)
    probe = subprocess.run(
        [str(python), "-c", "import pyspark, tenacity\nimport dedupstore"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "No module named 'dedupstore'" in probe.stderr  # only the libraries
    wheel = build_wheel(tmp_path / "dist")  # the README's commands: the wheel, as a .zip
    package = Path(shutil.copy2(wheel, tmp_path / "dedupstore.zip"))
    (tmp_path / "handlers.py").write_text(SHIPPED_HANDLER, encoding="utf-8")
    (tmp_path / "job.py").write_text(SHIPPED_JOB, encoding="utf-8")
    conf = {
        "spark.pyspark.python": str(python),
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.executor.memory": "768m",
        "spark.worker.dir": str(tmp_path / "worker"),
        "spark.local.dir": str(tmp_path / "local"),
    }
    db = f"sqlite:///{tmp_path}/ledger.db"
    submit = [str(spark_home() / "bin" / "spark-submit")]
    submit += ["--master", "local-cluster[2,1,1024]"]
    submit += ["--py-files", f"{package},{tmp_path / 'handlers.py'}"]
    for key, value in conf.items():
        submit += ["--conf", f"{key}={value}"]
    done = subprocess.run(
        [*submit, str(tmp_path / "job.py"), db],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["outcomes"] == ["processed"] * 60
    assert report["left"] == 0
    assert package.name in report["driver"]
    # every module came from the shipped files, none from the project's source tree
    # (Spark's local-cluster work directory may lie inside the checkout's .venv)
    sources = tuple(str(ROOT / name) for name in ("dedupstore", "backends", "spark_integration"))
    for place in report["workers"]:
        assert package.name in place or place.endswith("handlers.py"), place
        assert not place.startswith(sources), place
    with dedupstore.open_entity_store(db) as entities:
        totals = {e: entities.load(f"acct-{e}").state["total"] for e in range(5)}
    assert totals == {e: sum(n % 7 for n in range(e, 60, 5)) for e in range(5)}
