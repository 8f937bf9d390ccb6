"""One dashboard built ahead of the page request that will show it.

    SpareDashboard(build)     holds at most one object made by `build()` in a background thread
    spare.fill()              start building one (no-op while one is held or being built)
    spare.take(timeout)       the built one (waiting for a build under way), or None; the holder is empty then
    spare.close()             drop what is held (`close()` on it)

Why: the server answers a page request only once the page's document exists, and building the
`Dashboard` (the views' figures, widgets and panes: about half of the server's work before it
answers; Panel's conversion to Bokeh models is the other half) made the browser wait with nothing
to do. `serve()` builds one for its `--trace` at start and again after each page that used it has
loaded (Panel's onload), so the build never competes with a page being sent or drawn. Only a request
for the server's own trace uses it: another `?trace=`, a comparison or an error message builds its
own, as before. The spare's follower thread starts only when a page takes it, except the server's
first spare's (`app.build_dashboard(follow=True)`): the first page then finds its trace reduced.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class SpareDashboard:
    """A holder for one object built ahead by `build` in a daemon thread (failures are dropped:
    `take` then returns None and the caller builds its own)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._held: Any = None
        self._thread: threading.Thread | None = None
        self.built = 0  # how many were built (tests)

    def fill(self) -> None:
        with self._lock:
            if self._held is not None or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._run, name="spare-dashboard", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            made = self._build()
        except Exception:  # noqa: BLE001 - a spare is an optimisation: the request builds its own instead
            return
        with self._lock:
            self._held = made
            self.built += 1

    def take(self, timeout: float = 30.0) -> Any:
        """The spare (after a build under way has finished, up to `timeout` s), or None."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:
            made, self._held = self._held, None
        return made

    def close(self) -> None:
        made = self.take(timeout=0)
        if made is not None and hasattr(made, "close"):
            made.close()
