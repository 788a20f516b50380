"""HTML tables of the pages, their cells escaped."""

from __future__ import annotations

import html


def table(rows: list[tuple], header: tuple[str, ...] = (), css: str | None = None) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    css_class = f' class="{css}"' if css else ""
    return f"<table{css_class}>{head}{body}</table>"
