"""Self-contained HTML pages for people who read pages, not JSON (issue 64): the node's ledger page
(``fedsyn_client.ledger_page``) and a run's report (``fedsyn_server.report_page``).

One style and a few pieces: escaped text, tables, images inlined as ``data:`` URIs, one document.
No script and nothing fetched, so a page opens offline (from a USB stick, on a machine with no
connection). Written by hand: Python's ``html.escape`` and ``base64`` are all it takes, and a
template engine would be a dependency for six functions.
"""

from __future__ import annotations

import base64
import html
import io
import math
import time
from collections.abc import Iterable
from typing import Any

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { padding: 0.2em 0.6em; border: 1px solid #ddd; }
th { background: #f3f3f3; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.warn { color: #a40000; } .muted { color: #777; } img { max-width: 100%; } blockquote { color: #444; }
"""


def escape(value: Any) -> str:
    """``value`` as HTML text (quotes too): nothing from a file is ever markup."""
    return html.escape(str(value), quote=True)


def number(value: Any, digits: int = 4) -> str:
    """A number to ``digits`` significant digits (inf as ∞); anything else escaped as text."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return escape(value if value is not None else "")
    return "∞" if math.isinf(x) else f"{x:.{digits}g}"


def when(t: Any) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS`` ("" for anything else)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError, OverflowError):
        return ""


def table(header: Iterable[str], rows: Iterable[Iterable[str]], numeric: Iterable[int] = ()) -> str:
    """An HTML table of ``rows`` (cells already escaped or built here) under ``header`` (escaped
    here); the columns in ``numeric`` aligned right."""
    right = set(numeric)
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in right else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def png_uri(data: bytes) -> str:
    """PNG bytes as a ``data:`` URI (the image inside the page)."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def figure_uri(fig: Any) -> str:
    """A matplotlib figure as an inline PNG ``data:`` URI (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return png_uri(buf.getvalue())


def image(uri: str, alt: str) -> str:
    """An ``<img>`` of an inline image."""
    return f'<img alt="{escape(alt)}" src="{escape(uri)}">'


def section(anchor: str, title: str, body: str) -> str:
    """A section: its ``h2`` (with the ``id`` a test or a link finds) and its body."""
    return f'<h2 id="{escape(anchor)}">{escape(title)}</h2>\n{body}'


def document(title: str, parts: Iterable[str]) -> str:
    """The whole page: one HTML document with the style inline."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head>\n<body>\n" + "\n".join(parts)
            + "\n</body></html>\n")
