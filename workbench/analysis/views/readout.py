"""The DSA read-out as HTML: the per-layer table of `workbench.analysis.token_reads`, all text escaped.

- `escape_piece`: how a token is shown in HTML (escaped, whitespace made visible).
- `reads_html(reads, tokens)`: the table, with the text around each layer's densest far reads quoted
  from the token table (selected keys in <mark>).
"""

from __future__ import annotations

import html

import numpy as np

from workbench.analysis import TokenText


def escape_piece(piece: str | None) -> str:
    """HTML for one token: escaped, with newlines and tabs made visible (a token may be only whitespace)."""
    if piece is None:
        return "\u2026"
    return html.escape(piece).replace("\n", "\u23ce").replace("\t", "\u21e5")


def snippet_html(tokens: TokenText, keys: np.ndarray, start: int, end: int) -> str:
    """Escaped text of [start, end) with the selected `keys` marked."""
    chosen = set(keys[(keys >= start) & (keys < end)].tolist())
    parts = []
    for pos, piece in tokens.span(start, end):
        text = escape_piece(piece)
        parts.append(f"<mark>{text}</mark>" if pos in chosen else text)
    return "".join(parts) or "<i>(text not recorded)</i>"


def _pct(p: float) -> str:
    return f"{p * 100:.2g}%" if 0 < p < 0.01 else f"{p * 100:.0f}%"


def reads_html(reads: dict, tokens: TokenText) -> str:
    """The per-layer read-out of `token_reads` as an HTML table (all text escaped)."""
    if not reads["rows"]:
        return (f"<p>No top-k lists recorded for position {reads['position']} (the default policy keeps them "
                "for every generated token and every 1024th prompt token).</p>")
    marks = "".join(f"<th>keys in {html.escape(label)} [{a}, {b})</th>" for a, b, label in reads["marks"])
    head = ("<table class='k3-reads'><tr><th>layer</th><th>keys</th><th>nearest</th><th>farthest back</th>"
            f"<th>local</th><th>mostly in</th>{marks}<th>text around the densest far reads</th></tr>")
    body = []
    for r in reads["rows"]:
        snippets = "".join(f"<div class='k3-snippet'><span class='k3-at'>@{s}</span> "
                           f"{snippet_html(tokens, r['selected'], a, b)}</div>"
                           for s, (a, b) in zip(r["snippet_starts"], r["windows"]))
        # beside each count what uniformly random picks of as many keys would give (chance of any hit)
        marked = "".join(f"<td>{f'<b>{n}</b>' if n else '0'} <span class='k3-chance'>(random: {e:.2g}, "
                         f"{_pct(c)} any)</span></td>"
                         for n, e, c in zip(r["marked"], r.get("marked_expected", []), r.get("marked_chance", [])))
        body.append(f"<tr><td>{r['layer']}</td><td>{r['keys']}</td><td>{r['nearest']}</td><td>{r['farthest']}</td>"
                    f"<td>{r['local_share']:.0%} <span class='k3-chance'>(random {_pct(r.get('local_chance', 0.0))})"
                    f"</span></td><td>{html.escape(r['top_segment'])}</td>{marked}"
                    f"<td>{snippets}</td></tr>")
    return head + "".join(body) + "</table>"
