"""Sessions for these jobs: a local SparkSession, the workers' Python, quiet retried tasks.

* :func:`local_session`: a loopback SparkSession (``spark-submit``'s master wins).
* :func:`use_this_python`: on a local master, the Python workers run this
  interpreter, not whatever ``python3`` is on the ``PATH``; every job of
  :mod:`dedupstore.spark.pipeline` calls it, so a job started from a virtual
  environment, activated or not, finds its packages in the workers.
* :func:`quiet_task_retries`: a block in which a failed task attempt that Spark
  retries is not logged with its stack trace, and which counts such attempts.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "TASK_FAILURE_LOGGERS",
    "TaskRetries",
    "is_local_master",
    "local_session",
    "quiet_task_retries",
    "use_this_python",
]

_LOCAL_MASTER = re.compile(r"local(\[[^\]]*\]|-cluster\[[^\]]*\])?")


def is_local_master(master: str) -> bool:
    """Whether ``master`` runs every worker on this machine: ``local``, ``local[...]``,
    ``local-cluster[...]``."""
    return _LOCAL_MASTER.fullmatch(master.strip()) is not None


def _classic_context(spark: Any) -> Any | None:
    """The SparkContext of a classic session; ``None`` on Spark Connect (no driver JVM here)."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return None
    return spark.sparkContext


def use_this_python(spark: Any) -> bool:
    """Make this interpreter the Python workers' when that is safe; whether it did.

    Only on a classic session whose master is local (``local``, ``local[...]``,
    ``local-cluster[...]``: the workers run on this machine, so ``sys.executable``
    exists for them; never on a cluster master or Spark Connect, whose executors run
    another machine's Python) and only when nobody chose the workers' Python:
    neither ``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` is set, so PySpark would
    start ``python3`` from the ``PATH`` (without the virtual environment activated,
    one that lacks this package). Applies to the Python functions created
    afterwards, not to the session's earlier ones. Idempotent; changes no
    environment variable.
    """
    sc = _classic_context(spark)
    if sc is None or not is_local_master(str(sc.master)):
        return False
    if os.environ.get("PYSPARK_PYTHON") or sc.getConf().get("spark.pyspark.python"):
        return False
    if sc.pythonExec != "python3":  # PySpark's default: anything else was chosen (or is ours)
        return False
    sc.pythonExec = sys.executable
    return True


def local_session(
    master: str = "local[*]",
    app_name: str = "dedupstore",
    *,
    progress: bool = True,
    conf: Mapping[str, Any] | None = None,
) -> SparkSession:
    """Get or create a SparkSession for ``master`` with this interpreter as the workers' Python.

    Under ``spark-submit`` the submitted ``--master`` wins. The workers run
    ``sys.executable`` only on a local master, unless ``PYSPARK_PYTHON`` says
    otherwise (see :func:`use_this_python`). Binds the driver to 127.0.0.1, turns off
    the web UI, keeps Spark's stage progress bar when ``progress`` and logs only
    errors. ``conf`` adds or overrides settings.
    """
    from pyspark.sql import SparkSession

    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # launched by spark-submit
    if not submitted and is_local_master(master):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    settings: dict[str, Any] = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "true" if progress else "false",
        "spark.sql.shuffle.partitions": str(2 * (os.cpu_count() or 2)),
        # process_messages lets adaptive execution merge small shuffle partitions; its
        # rows are small and their work (handler, stores) is not, so merge down to
        # 64 KB a task (not Spark's 1 MB): a tiny input still runs in one task, a
        # medium one keeps every core busy
        "spark.sql.adaptive.coalescePartitions.minPartitionSize": "64k",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "2000",
        "spark.python.worker.reuse": "true",
    }
    settings.update({k: str(v) for k, v in (conf or {}).items()})
    for key, value in settings.items():
        builder = builder.config(key, value)
    if not submitted:
        builder = builder.master(master)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    use_this_python(session)  # under spark-submit with a local master
    return session


#: The loggers that log a failed task attempt with its stack trace: the executor that
#: ran it (ERROR "Exception in task ...") and the scheduler that retries it (WARN
#: "Lost task ...").
TASK_FAILURE_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
)


@dataclass
class TaskRetries:
    """What :func:`quiet_task_retries` saw: failed task attempts in the block's jobs.

    ``failed_attempts`` is ``None`` when they cannot be counted (Spark Connect).
    """

    failed_attempts: int | None = None


@contextmanager
def quiet_task_retries(
    spark: Any, *, quiet: bool = True, settle: float = 10.0
) -> Iterator[TaskRetries]:
    """A block in which failed task attempts are not logged; counts them on the way out.

    For a stage in which a task failure is expected and retried (the demo kills a
    Python worker on purpose), which Spark would log with a long Java stack trace:
    inside the block the :data:`TASK_FAILURE_LOGGERS` log nothing, and their levels
    are restored on the way out, whatever happens. Nothing real is lost: a task
    that fails for good still fails its job, and the yielded :class:`TaskRetries`
    counts, from Spark's status tracker, every failed attempt of the jobs the block
    ran (in this thread's job group); ``settle`` bounds the wait for the tracker to
    see them end. With ``quiet=False`` it only counts. On Spark Connect (the
    driver's logs are the server's) nothing is silenced and nothing is counted.
    """
    sc = _classic_context(spark)
    seen = TaskRetries()
    if sc is None:
        yield seen
        return
    log4j = sc._jvm.org.apache.logging.log4j
    context = log4j.LogManager.getContext(False)
    config = context.getConfiguration()
    saved: dict[str, Any] = {}
    for name in TASK_FAILURE_LOGGERS:
        own = config.getLoggerConfig(name)
        saved[name] = own.getLevel() if own.getName() == name else None
    group = sc.getLocalProperty("spark.jobGroup.id")
    tracker = sc.statusTracker()
    before = set(tracker.getJobIdsForGroup(group))
    for name in TASK_FAILURE_LOGGERS if quiet else ():
        log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
    try:
        yield seen
    finally:
        for name, level in saved.items() if quiet else ():
            if level is None:  # it had no level of its own: inherit again
                config.removeLogger(name)
            else:
                log4j.core.config.Configurator.setLevel(name, level)
        context.updateLoggers()
    jobs = sorted(set(tracker.getJobIdsForGroup(group)) - before)
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline and any(
        (info := tracker.getJobInfo(job)) is not None and info.status == "RUNNING" for job in jobs
    ):
        time.sleep(0.05)
    stages: set[int] = set()  # a stage that several jobs share (AQE) counts once
    for job in jobs:
        info = tracker.getJobInfo(job)
        stages.update(info.stageIds if info is not None else ())
    infos = (tracker.getStageInfo(stage) for stage in stages)
    seen.failed_attempts = sum(info.numFailedTasks for info in infos if info is not None)
