"""``options-table``: a backend's declared options as a table, read from the class itself.

Usage in a MyST page::

    ```{options-table} dedupstore.backends.sqlite.SqliteDeduplicationStore
    ```

The directive imports the class, reads its ``declared_options`` (an
:class:`dedupstore.options.OptionSet`) and renders one row per option: its name, its
default, where it may be given, and its ``doc``. The table is generated at every build,
so it cannot drift from the code.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from dedupstore.options import Option, OptionSet, format_duration


def _load(path: str) -> Any:
    """The object named ``module.Class`` (the last dotted part is the attribute)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def default_text(option: Option) -> str:
    """The default as a reader would write it in a URL or a configuration file."""
    value = option.default
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return str(value)


def where_text(option: Option) -> str:
    """Where the option may be given: the URL query or a configuration file, or keyword only."""
    where = "URL, keyword" if option.in_url else "keyword only"
    if option.secret:
        where += "; secret (masked)"
    return where


class OptionsTable(SphinxDirective):
    """Render ``declared_options`` of the class named by the argument as a table."""

    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {"caption": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        path = self.arguments[0]
        try:
            declared = _load(path).declared_options
        except (ImportError, AttributeError) as exc:
            raise self.error(f"options-table: cannot read {path}.declared_options: {exc}") from exc
        if not isinstance(declared, OptionSet):
            raise self.error(f"options-table: {path}.declared_options is not an OptionSet")
        # Depend on the module's file so an incremental build re-reads a changed declaration.
        module = importlib.import_module(path.rpartition(".")[0])
        if getattr(module, "__file__", None):
            self.env.note_dependency(module.__file__)
        rows = [
            (name, default_text(option), where_text(option), option.doc)
            for name, option in declared.items()
        ]
        return [self._table(("option", "default", "given", "meaning"), rows)]

    def _table(self, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> nodes.table:
        table = nodes.table(classes=["options-table"])
        if "caption" in self.options:
            table += nodes.title(text=self.options["caption"])
        group = nodes.tgroup(cols=len(header))
        table += group
        for width in (18, 14, 16, 52):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += self._row(header, literal_first=False)
        body = nodes.tbody()
        group += body
        for row in rows:
            body += self._row(row, literal_first=True)
        return table

    @staticmethod
    def _row(cells: tuple[str, ...], *, literal_first: bool) -> nodes.row:
        row = nodes.row()
        for index, cell in enumerate(cells):
            entry = nodes.entry()
            paragraph = nodes.paragraph()
            if literal_first and index in (0, 1):
                paragraph += nodes.literal(text=cell)
            else:
                paragraph += nodes.Text(cell)
            entry += paragraph
            row += entry
        return row


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("options-table", OptionsTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
