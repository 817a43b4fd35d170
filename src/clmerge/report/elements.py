"""The building blocks of every clmerge HTML page: escaped tables, embedded images, sections, and the
number formatting that keeps raw 16-digit floats off the page.

Every string that reaches the page goes through :func:`html.escape` here; callers pass plain text.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

__all__ = ["MISSING", "Html", "is_number", "format_number", "format_value", "table", "img", "link", "section", "page",
           "details"]

MISSING = "—"
SIGNIFICANT = 4  # significant digits of a float shown in a table

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 1100px; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
h3 { margin: 1.2em 0 0.3em; font-size: 1.05em; }
.meta { color: #555; } .meta span { margin-right: 1.5em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
img { max-width: 100%; height: auto; margin: 0.4em 1em 0.4em 0; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
details summary { cursor: pointer; color: #555; }
.note { color: #777; font-style: italic; }
"""


class Html(str):
    """Markup already escaped (built by :func:`link`): :func:`table` puts it in a cell as it is."""


def link(href: str, text: str) -> Html:
    """``<a href=...>text</a>``, both escaped; ``href`` is a relative URL the caller built (quoted)."""
    return Html(f'<a href="{escape(href)}">{escape(text)}</a>')


def is_number(value: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_number(value: Any, fmt: str = ".2f") -> str:
    """Format a metric for display: numbers with ``fmt``, ``None`` as "—", anything else as ``str``.

    The result is plain text; callers escape it.
    """
    if value is None:
        return MISSING
    if is_number(value):
        return format(value, fmt)
    return str(value)


def format_value(value: Any, depth: int = 0) -> str:
    """Format a free-form value (a method metric, a manifest field) as short plain text; callers escape it.

    Ints exactly (counts, seeds, ranks), floats to :data:`SIGNIFICANT` significant digits, lists inline,
    dicts as ``key: value`` pairs, both rounded all the way down; ``None`` as "—". Below three levels of
    nesting a value is elided as "…" so a table cell stays readable.
    """
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)  # never "1.234e+04" for a count
    if isinstance(value, float):
        return format(value, f".{SIGNIFICANT}g") if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple, Mapping)) and depth >= 3:
        return "…"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v, depth + 1) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {format_value(v, depth + 1)}" for k, v in value.items()) + "}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1) -> str:
    """An HTML table; every header and cell is escaped (but :class:`Html` cells, escaped when made). Columns
    from ``numeric_from`` on are right-aligned."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{_cell(c)}</td>' if k >= numeric_from else f"<td>{_cell(c)}</td>"
            for k, c in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _cell(c: str) -> str:
    return c if isinstance(c, Html) else escape(c)


def img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def section(title: str, body: str) -> str:
    return f"<section><h2>{escape(title)}</h2>\n{body}\n</section>"


def details(summary: str, body: str) -> str:
    """A collapsed block (plain HTML, no script) for long tables."""
    return f"<details><summary>{escape(summary)}</summary>\n{body}\n</details>"


def page(title: str, header: str, sections: Sequence[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        f"{header}\n" + "\n".join(s for s in sections if s) + "\n</body>\n</html>\n"
    )
