"""Sphinx configuration of the dedupstore documentation (``make docs``).

Sphinx + furo + MyST-Parser: the pages are Markdown (MyST), the API reference is
generated from the docstrings by ``autodoc``, and ``_ext/options_table.py`` renders each
backend's declared options. ``make docs`` builds with ``-W --keep-going -n``: every
warning, an unresolved reference included, fails the build.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

from dedupstore import __version__  # noqa: E402  (after the path set-up)

project = "dedupstore"
author = "the dedupstore authors"
copyright = "the dedupstore authors"
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "options_table",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

html_theme = "furo"
html_title = f"dedupstore {release}"

# MyST: `#anchor` links to headings of a page, and ```{directive} fences.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# autodoc: members in source order, signatures as written; the docstrings are reST.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
autoclass_content = "both"

nitpicky = True
# Targets that have no page in this site. There is no intersphinx: the build must run
# with no network, so the standard library's and the drivers' classes stay unresolved.
nitpick_ignore_regex = [
    # The standard library, typing and collections.abc named in signatures.
    (r"py:.*", r"(typing|collections\.abc|datetime|logging|pathlib|types|enum)\..*"),
    (r"py:class", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Collection|Self)"),
    (r"py:class", r"(timedelta|datetime|Path|TracebackType|BaseException|Exception)"),
    (r"py:class", r"(ValueError|TypeError|KeyError|threading\..*|subprocess\..*)"),
    (r"py:class", r"argparse\..*"),
    # Third-party libraries: pyspark, pandas, pyarrow, the database drivers, pytest.
    (r"py:.*", r"(pyspark|pandas|pyarrow|redis|psycopg|psycopg_pool|boto3|botocore)(\..*)?"),
    (r"py:.*", r"(azure|pika|confluent_kafka|opentelemetry|pytest|_pytest)(\..*)?"),
    (r"py:class", r"(DataFrame|SparkSession|StreamingQuery|abc\.ABC)"),
    # String annotations (``from __future__ import annotations``) of dataclass fields that
    # Sphinx splits at the comma: ``dict[str, Any]`` is looked up as ``dict[str``.
    (r"py:class", r"(dict|tuple)\[str"),
    # Private modules and helpers: the base class every store derives from, parsed URLs,
    # type variables and type aliases, private methods a backend implements (named in
    # docstrings for backend authors; the backend API page describes them).
    (r"py:.*", r"dedupstore\.(client|urls|calls|canonical|dead_letters)\..*"),
    (r"py:.*", r"dedupstore\.(D|T|entities\.T|registry\.T|entities\._Texts)"),
    (r"py:.*", r"dedupstore\.(steps\.[TRP]|aio\.stores\.[ST]|aio\.processor\.C)"),
    (r"py:.*", r"dedupstore\.spark\._columns\..*"),
    (r"py:class", r"(StoreURL|Cleanup|Command|Handler)"),  # annotations imported for type checking
    # OutboxProcessor's private parts (one per module of dedupstore.outbox), shown as bases.
    (r"py:class", r"dedupstore\.outbox\.\w+\._\w+"),
    # The consume loop's rounds, shared by Consumer and AsyncConsumer, shown as a base.
    (r"py:class", r"dedupstore\.consumers\._loop\._Loop"),
    (r"py:meth", r"(_\w+|\w+\._\w+|check_options|close)"),
    # Backends and brokers are described on their own pages, not in the API reference.
    (r"py:.*", r"dedupstore\.backends\..*"),
    # Re-exported from dedupstore.testing and documented there.
    (r"py:.*", r"dedupstore\.testing\.contract\..*"),
    # Instance attributes set by a constructor and described in the class docstring
    # (errors: letter_id, message_id, ...; InMemoryDispatcher.sent; receiver_dedup).
    (
        r"py:attr",
        r"(sent|message_id|letter_id|error|correlation_id|bound|receiver_dedup|"
        r"dedupstore\.entities\.Entity\.consumer|dedupstore\.stats\.Backlog\.consumers)",
    ),
    # The Spark schemas are module constants without docstrings of their own.
    (r"py:data", r"(PROCESS_SCHEMA|SWEEP_SCHEMA|RECORD_SCHEMA|MINT_SCHEMA)"),
]
