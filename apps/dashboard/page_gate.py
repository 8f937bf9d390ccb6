"""`PageGate`: hold a page's model updates while its browser is pulling and drawing the document.

Why (measured on the 1M-token K3.1 Pro trace, `benchmarks/bench_dashboard.py`): in about half of
the first opens the session map's segments, its x range and both token strips never showed the
frame the server had applied, while the server's models held it. Panel 1.9's `hold()` drops the
model-change events of a document it does not yet count as connected (`state._connected`, set by
the page's onload), on the assumption that the document will be serialized in full when the
session connects. That holds until the browser opens its websocket and pulls the document; from
then until the page reports that it has drawn (seconds on a long trace), a frame applied by the
periodic callback changed the server's models and reached the browser only in part.

So a frame is applied while nobody holds the document (it goes out with the pull) or once the page
has loaded (it goes out as events), never between the two: `open()` says which.
"""

from __future__ import annotations

from typing import Any, Callable

import panel as pn


def _socket_open(doc: Any) -> bool:
    context = getattr(doc, "session_context", None)
    session = getattr(context, "session", None)
    return session is not None and session.connection_count > 0


class PageGate:
    """Whether the current server page may receive model updates now.

    Build it while the page's document is built (inside the Panel app function); outside a server
    session (notebooks, tests without a page) it is always open. `on_open` runs once when the page
    has loaded, so a frame held back meanwhile is applied without waiting for the next tick.
    """

    def __init__(self, on_open: Callable[[], Any] | None = None) -> None:
        doc = pn.state.curdoc
        self._doc = doc if doc is not None and getattr(doc, "session_context", None) is not None \
            and not pn.state.loaded else None
        self._on_open = on_open
        if self._doc is not None:
            pn.state.onload(self._loaded)

    def _loaded(self) -> None:
        self._doc = None
        if self._on_open is not None:
            self._on_open()

    def open(self) -> bool:
        """False only between the browser's pull of the document and the page's onload."""
        return self._doc is None or not _socket_open(self._doc)
