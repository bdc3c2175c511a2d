"""MkDocs hook: the pass reference (docs/passes.md) is generated from the pass registry at build time.

The page holds the marker ``<!-- passes: generated -->``; this hook replaces it with one section
per built-in pass: what ``autoshard passes`` prints (name, summary, options with their defaults,
requires → provides) plus each option's type and help and the pass's whole docstring. It reads the
built-in passes only (no entry-point plugins), so the page is the same on every machine.
"""

from __future__ import annotations

import inspect
from typing import Any

MARKER = "<!-- passes: generated -->"


def render_pass_reference() -> str:
    """The Markdown that replaces ``MARKER``: an index table, then one section per pass."""
    from autoshard.passes import BUILTIN_PASSES, PassRegistry
    from autoshard.passes.options import option_table

    passes = PassRegistry(BUILTIN_PASSES, entry_point_group=None).passes()
    lines = ["| pass | summary | requires → provides |", "| --- | --- | --- |"]
    lines += [f"| [`{cls.name}`](#{cls.name}) | {_cell(cls.summary())} | {_flow(cls)} |" for cls in passes]
    for cls in passes:
        lines += ["", f"## `{cls.name}` {{#{cls.name}}}", "", inspect.cleandoc(cls.__doc__ or ""), "",
                  f"Requires → provides: {_flow(cls)}.", ""]
        rows = option_table(cls)
        if not rows:
            lines.append("No options.")
            continue
        lines += ["| option | default | value | what it does |", "| --- | --- | --- | --- |"]
        for row in rows:
            default = "(required)" if row.default is None else f"`{row.default}`" if row.default else "(empty)"
            lines.append(f"| `{row.key}` | {default} | {_cell(row.type)} | {_cell(row.help)} |")
    return "\n".join(lines) + "\n"


def _flow(cls: Any) -> str:
    requires = ", ".join(f"`{name}`" for name in sorted(cls.requires)) or "nothing"
    return f"{requires} → {', '.join(f'`{name}`' for name in sorted(cls.provides))}"


def _cell(text: str) -> str:
    """Text that stays inside one table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_pass_reference())
