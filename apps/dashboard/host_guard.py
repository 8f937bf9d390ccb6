"""Refuse every request whose `Host` or `Origin` names a site the dashboard was not started for.

Why: a page on `http://evil.example.com:P/` whose name an attacker points at 127.0.0.1 (DNS
rebinding) is, to the browser, same-origin with itself, so it may read the dashboard's pages and open
its websocket; Tornado skips `check_origin` when `Origin` equals `Host`, so Bokeh's origin allow-list
never runs, and plain HTTP has no Host check at all. The one name such a page cannot forge is the
`Host` header its requests carry: its own name. So every HTTP and websocket request is checked here,
before any handler runs, and so is `Origin` when the browser sends one.

- `HostPolicy` (`apps.web_guard`, shared with `workbench serve`): which names a server answers to.
- `install(policy)` / `SETTING`: the policy travels in the Tornado application's settings, and
  `install_hook()` makes Bokeh's application consult it for every request it routes (`find_handler`
  is the one place every HTTP request and websocket upgrade passes). An application without the
  setting (any other Bokeh server in the process) is not touched. It also teaches Panel's URL reader
  and Bokeh's websocket allow-list the bracketed IPv6 form (`[::1]:5006`), which both split on every
  `:` (Panel answered a Host the guard accepts with a 500, Bokeh refused the entry: the dashboard
  could not be opened at `http://[::1]:PORT/`).
"""

from __future__ import annotations

import re
from typing import Any

from apps.web_guard import HostPolicy, ip_literal, normalise_allowed, split_host

# the Tornado application setting that carries a server's HostPolicy
SETTING = "k3wb_host_policy"


def install(settings: dict[str, Any], policy: HostPolicy) -> dict[str, Any]:
    """`settings` (keyword arguments for `pn.serve`) with the policy added; the hook is installed once."""
    install_hook()
    return {**settings, SETTING: policy}


_HOOKED = False


def install_hook() -> None:
    """Make Bokeh's Tornado application check a HostPolicy in its settings before routing any request."""
    global _HOOKED
    if _HOOKED:
        return
    from bokeh.server.tornado import BokehTornado
    from tornado.web import RequestHandler

    class RefusedHost(RequestHandler):
        def initialize(self, reason: str) -> None:
            self.reason = reason

        def prepare(self) -> None:
            self.set_status(403)
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.set_header("Cache-Control", "no-store")
            self.finish(f"403 Forbidden: {self.reason}\n")

        def check_xsrf_cookie(self) -> None:  # refused before anything could change
            pass

        def log_exception(self, *args: Any) -> None:  # a refused request is not a server error
            pass

    original = BokehTornado.find_handler

    def find_handler(self: Any, request: Any, **kwargs: Any) -> Any:
        policy = self.settings.get(SETTING)
        if isinstance(policy, HostPolicy):
            reason = policy.refusal(request.headers.get("Host"), request.headers.get("Origin"))
            if reason is not None:
                return self.get_handler_delegate(request, RefusedHost, {"reason": reason})
        return original(self, request, **kwargs)

    BokehTornado.find_handler = find_handler
    _read_bracketed_ipv6_hosts()
    _allow_bracketed_ipv6_origins()
    _HOOKED = True


def _read_bracketed_ipv6_hosts() -> None:
    """Panel reads a page's `Host` as `name[:port]` split on ':'; give it `[v6]` and its port itself.

    The hostname keeps its brackets, as a browser's `location.hostname` does for an IPv6 page.
    """
    from panel.io import location

    original = location._get_location_params

    def location_params(protocol: str | None, host: str | None, uri: str | None) -> dict:
        if not host or not host.startswith("["):
            return original(protocol, host, uri)
        end = host.find("]")
        bracketed, port = host[:end + 1], host[end + 2:] if host[end + 1:end + 2] == ":" else ""
        params = original(protocol, None, uri)
        scheme = f"{protocol}:" if protocol else ""
        params["href"] = f"{scheme}//{bracketed}{':' + port if port else ''}{params['href'][len(scheme):]}"
        params["hostname"] = bracketed
        if port:
            params["port"] = port
        return params

    location._get_location_params = location_params


_BRACKETED_ORIGIN = re.compile(r"^\[([0-9A-Fa-f:.]+)\]:(\d{1,5})$")


def _allow_bracketed_ipv6_origins() -> None:
    """Let Bokeh's websocket allow-list hold `[v6]:port` entries (it refuses any entry with two ':').

    Bokeh compares a websocket's `Origin` (`[::1]:5006` for a page at `http://[::1]:5006/`) with the
    entries as strings, so a bracketed entry only has to get past the list's parser.
    """
    from bokeh.server import server

    original = server.create_hosts_allowlist

    def create_hosts_allowlist(host_list: Any, port: int | None) -> list[str]:
        bracketed = [h for h in host_list or () if (m := _BRACKETED_ORIGIN.match(h)) and ip_literal(m.group(1))]
        rest = [h for h in host_list or () if h not in bracketed]
        return (original(rest, port) if rest or not bracketed else []) + [h.lower() for h in bracketed]

    server.create_hosts_allowlist = create_hosts_allowlist


__all__ = ["HostPolicy", "SETTING", "install", "install_hook", "normalise_allowed", "split_host"]
