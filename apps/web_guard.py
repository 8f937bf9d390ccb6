"""Who may talk to a local web server: the `Host` / `Origin` check shared by the dashboard and `workbench serve`.

Why: a page on `http://evil.example.com:P/` whose name an attacker points at 127.0.0.1 (DNS rebinding) is, to
the browser, same-origin with itself, so it may read a local server's pages and call its API. The one name
such a page cannot forge is the `Host` header its requests carry: its own name. So every request is checked
against the names the server was started for, and so is `Origin` when the browser sends one.

- `HostPolicy.for_server(bind, extra)`: the names a server answers to. Loopback names always; the bind
  address itself; names given with `--allow-host`; and, for a wildcard bind (0.0.0.0, ::), any IP
  literal and this machine's host name: an IP literal is never rebound, and a non-loopback server
  also requires the access token (the dashboard) or the API key (the server).
- `HostPolicy.refusal(host, origin, service=...)`: None, or the reason a request is refused, naming the
  server that refuses it. How each server applies it (Tornado's routing for the dashboard,
  `apps.dashboard.host_guard`; an ASGI middleware for the server, `apps.serve.app`) lives with that server.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

WILDCARD_BINDS = {"", "0.0.0.0", "::"}
# a DNS name or an IP literal as --allow-host accepts it (no scheme, no path, no wildcard)
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def ip_literal(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `name` spells, or None when it is a DNS name (or malformed)."""
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def split_host(value: str) -> str | None:
    """The lower-case name of a `Host` value (`name`, `name:port`, `[v6]`, `[v6]:port`); None if malformed."""
    value = value.strip()
    if not value or len(value) > 300 or any(c.isspace() or ord(c) < 33 for c in value):
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1:] and not re.fullmatch(r":\d{1,5}", value[end + 1:])):
            return None
        name = value[1:end]
        return name.lower() if ip_literal(name) is not None else None
    name, _, port = value.partition(":")
    if port and not port.isdigit():
        return None
    return name.lower().rstrip(".") or None


def normalise_allowed(name: str) -> str:
    """An `--allow-host` value as a bare lower-case name (a port is dropped); raises ValueError if malformed."""
    bare = split_host(name) if not ip_literal(name) else name.lower()
    if bare is None or not (_NAME.match(bare) or ip_literal(bare) is not None):
        raise ValueError(f"--allow-host {name!r} is not a host name or IP address (give a bare name such as "
                         "'myhost.lan', without scheme, path or wildcard)")
    return bare


@dataclass(frozen=True)
class HostPolicy:
    """Which `Host` / `Origin` names a dashboard server answers to.

    Attributes:
        names: bare lower-case names accepted as they are.
        any_ip: accept any IP literal (a wildcard bind: the token protects it; an IP is never rebound).
    """

    names: frozenset[str]
    any_ip: bool = False

    @classmethod
    def for_server(cls, bind: str, extra: tuple[str, ...] | list[str] = ()) -> "HostPolicy":
        names = {"localhost", "127.0.0.1", "::1"} | {normalise_allowed(n) for n in extra}
        wildcard = bind.strip("[]") in WILDCARD_BINDS
        if not wildcard:
            names.add(normalise_allowed(bind.strip("[]")))
        else:
            hostname = socket.gethostname().lower()
            if _NAME.match(hostname):
                names.add(hostname)
        return cls(frozenset(names), any_ip=wildcard)

    def allows(self, name: str) -> bool:
        if name in self.names:
            return True
        address = ip_literal(name)
        # every loopback literal reaches only this machine; other literals only where the bind is a wildcard
        return address is not None and (address.is_loopback or self.any_ip)

    def refusal(self, host: str | None, origin: str | None, *, service: str = "this dashboard") -> str | None:
        """None when a request with these headers may be served, else why it is refused (`service`: what the
        message calls the server refusing it: "this dashboard", "this server")."""
        if host is None:
            return "the request has no Host header"
        name = split_host(host)
        if name is None:
            return f"malformed Host header {host[:80]!r}"
        if not self.allows(name):
            return (f"{service} does not answer to the name {name[:80]!r} (a page served under another "
                    "site's name is refused); start it with --allow-host NAME to trust that name")
        if origin is None:
            return None
        parts = urlsplit(origin.strip())
        try:
            origin_name = parts.hostname
        except ValueError:
            origin_name = None
        if parts.scheme not in ("http", "https") or not origin_name:
            return f"the request's Origin {origin[:80]!r} is not a web page {service} serves"
        if not self.allows(origin_name.lower().rstrip(".")):
            return (f"a page from {origin_name[:80]!r} may not use {service}; start it with --allow-host NAME "
                    "to trust that name")
        return None


__all__ = ["HostPolicy", "WILDCARD_BINDS", "ip_literal", "normalise_allowed", "split_host"]
