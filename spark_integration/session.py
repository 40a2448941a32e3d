"""A local SparkSession configured for these jobs (driver and workers on loopback)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["local_session"]


def local_session(
    master: str = "local[*]",
    app_name: str = "dedupstore",
    *,
    progress: bool = True,
    conf: Mapping[str, Any] | None = None,
) -> SparkSession:
    """Get or create a SparkSession for ``master`` with this interpreter as the workers' Python.

    Under ``spark-submit`` the submitted ``--master`` wins. Binds the driver to 127.0.0.1, turns off
    the web UI, keeps Spark's stage progress bar when ``progress`` and logs only
    errors. ``conf`` adds or overrides settings.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    settings: dict[str, Any] = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "true" if progress else "false",
        "spark.sql.shuffle.partitions": str(2 * (os.cpu_count() or 2)),
        "spark.sql.execution.arrow.maxRecordsPerBatch": "2000",
        "spark.python.worker.reuse": "true",
    }
    settings.update({k: str(v) for k, v in (conf or {}).items()})
    for key, value in settings.items():
        builder = builder.config(key, value)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        builder = builder.master(master)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
