"""DNS rebinding: a page served under a name the dashboard was not started for gets nothing.

The attack: a site whose name resolves to 127.0.0.1 loads the dashboard same-origin with itself
(`Host` and `Origin` both `evil.example.com:P`), so neither the browser nor Bokeh's origin list
stops it. Every HTTP request and websocket upgrade must be refused on its `Host` (and `Origin`),
while the names the server was started for keep working.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import os
from pathlib import Path
from typing import Iterator

import pytest

from apps.dashboard.app import DashboardConfig, url
from k3testing.browser import Browser, chromium_available, start_server
from apps.dashboard.host_guard import HostPolicy, split_host
from engine.errors import InputError

EVIL = "evil.example.com"


def test_split_host_reads_every_host_form() -> None:
    assert split_host("127.0.0.1:5006") == "127.0.0.1"
    assert split_host("LocalHost") == "localhost"
    assert split_host("[::1]:80") == "::1"
    assert split_host("example.com.") == "example.com"
    for bad in ("", "a b", "[::1", "[nothost]:1", "x:y", "\x00", "h" * 400):
        assert split_host(bad) is None, bad


def test_policy_of_a_loopback_server() -> None:
    policy = HostPolicy.for_server("127.0.0.1")
    for ok in ("127.0.0.1:5006", "localhost:5006", "[::1]:5006", "127.0.0.2"):
        assert policy.refusal(ok, None) is None, ok
    assert policy.refusal("127.0.0.1:5006", "http://localhost:5006") is None
    assert "does not answer" in policy.refusal(f"{EVIL}:5006", None)
    assert "does not answer" in policy.refusal("192.168.1.20:5006", None)  # another address is not this bind
    assert "may not use" in policy.refusal("127.0.0.1:5006", f"http://{EVIL}:5006")
    assert "Origin" in policy.refusal("127.0.0.1:5006", "null")
    assert "no Host" in policy.refusal(None, None)


def test_policy_of_a_named_or_wildcard_server() -> None:
    named = HostPolicy.for_server("10.1.2.3", ["inspect.lab:80", "Box.Local"])
    for ok in ("10.1.2.3:5006", "inspect.lab", "box.local:5006", "localhost"):
        assert named.refusal(ok, None) is None, ok
    assert named.refusal("10.1.2.4", None) is not None
    wildcard = HostPolicy.for_server("0.0.0.0")
    # an IP literal is never rebound (and a non-loopback server also needs its token); names still are
    assert wildcard.refusal("192.168.1.20:5006", "http://192.168.1.20:5006") is None
    assert wildcard.refusal(f"{EVIL}:5006", None) is not None
    with pytest.raises(ValueError, match="allow-host"):
        HostPolicy.for_server("127.0.0.1", ["http://x/"])


def test_allow_host_flag_is_checked(tmp_path: Path) -> None:
    from apps.cli.dashboard_cmd import dashboard_config

    base = dict(trace=None, model=None, host="127.0.0.1", port=5997, root=tmp_path, no_drive=True)
    config = dashboard_config(argparse.Namespace(**base, allow_host=["Inspect.Lab:5006"]))
    assert config.allow_hosts == ("inspect.lab",)
    with pytest.raises(InputError, match="allow-host"):
        dashboard_config(argparse.Namespace(**base, allow_host=["*.example.com"]))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DashboardConfig]:
    config = DashboardConfig(root=tmp_path_factory.mktemp("traces"), drive=False, allow_hosts=("trusted.lab",))
    server = start_server(config)
    try:
        yield config
    finally:
        server.stop()


def _get(config: DashboardConfig, path: str, headers: dict[str, str]) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", config.port, timeout=30)
    try:
        connection.putrequest("GET", path, skip_host=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read(4096).decode("utf-8", "replace")
    finally:
        connection.close()


def _upgrade(host: str, origin: str) -> dict[str, str]:
    return {"Host": host, "Origin": origin, "Upgrade": "websocket", "Connection": "Upgrade",
            "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode()}


def test_every_request_under_a_foreign_name_is_refused(served: DashboardConfig) -> None:
    port = served.port
    evil = f"{EVIL}:{port}"
    for path in ("/", "/?trace=x", "/static/js/bokeh.min.js", "/autoload.js", "/no-such-page"):
        status, body = _get(served, path, {"Host": evil})
        assert status == 403 and "does not answer" in body, (path, status, body[:200])
    # the websocket upgrade the issue reproduced (Host == Origin, so Tornado skips check_origin): no 101
    status, body = _get(served, "/ws", _upgrade(evil, f"http://{evil}"))
    assert status == 403, status
    # a page of another site using the loopback name (classic cross-origin) is refused too
    status, _ = _get(served, "/ws", _upgrade(f"127.0.0.1:{port}", f"http://{evil}"))
    assert status == 403
    status, _ = _get(served, "/", {"Host": f"127.0.0.1:{port}", "Origin": "null"})
    assert status == 403


def test_the_names_it_was_started_for_still_work(served: DashboardConfig) -> None:
    for host in (f"127.0.0.1:{served.port}", f"localhost:{served.port}", f"trusted.lab:{served.port}"):
        status, body = _get(served, "/", {"Host": host})
        assert status == 200 and "K3 Workbench" in body, (host, status)
    status, _ = _get(served, "/", {"Host": f"localhost:{served.port}", "Origin": f"http://localhost:{served.port}"})
    assert status == 200


@pytest.mark.browser
@pytest.mark.skipif(not chromium_available(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_a_rebound_page_gets_nothing_in_a_real_browser(served: DashboardConfig) -> None:
    rules = f"--host-resolver-rules=MAP {EVIL} 127.0.0.1"
    with Browser(extra_args=(rules,)) as browser:
        response = browser.page.goto(f"http://{EVIL}:{served.port}/", wait_until="load", timeout=60_000)
        assert response is not None and response.status == 403
        text = browser.page.inner_text("body")
        assert "does not answer" in text and "K3 Workbench" not in browser.page.title()
        # the page cannot script a websocket to the dashboard either
        opened = browser.page.evaluate(
            """() => new Promise(done => {
                   const ws = new WebSocket(`ws://${location.host}/ws`);
                   ws.onopen = () => done('open'); ws.onerror = () => done('refused');
                   setTimeout(() => done('timeout'), 10000); })""")
        assert opened == "refused"
        # the same server, opened by its own name, shows the dashboard
        browser.open(url(served), wait_for=".k3-view-session")
        assert "K3 Workbench" in browser.page.title()


# --- issue 42 item 13: the IPv6 loopback name `[::1]:PORT` passes the guard and is served end to end

def test_an_ipv6_loopback_host_is_served_not_a_500(served: DashboardConfig) -> None:
    """Panel split the Host on every ':' (a 500 after the guard let it through)."""
    for host in (f"[::1]:{served.port}", "[::1]", f"[0:0:0:0:0:0:0:1]:{served.port}"):
        status, body = _get(served, "/", {"Host": host})
        assert status == 200 and "K3 Workbench" in body, (host, status, body[:200])
    status, body = _get(served, "/", {"Host": f"[::1]:{served.port}", "Origin": f"http://[::1]:{served.port}"})
    assert status == 200 and "K3 Workbench" in body
    # a wrong token under the IPv6 name: the refusal page, not a 500 (it goes through Panel's URL reader too)
    status, _ = _get(served, "/?trace=x&token=no", {"Host": f"[::1]:{served.port}"})
    assert status == 200
    # another IPv6 address is still refused before Panel sees it
    status, body = _get(served, "/", {"Host": f"[2001:db8::1]:{served.port}"})
    assert status == 403 and "does not answer" in body


def test_panel_reads_a_bracketed_host_as_a_browser_does() -> None:
    from panel.io.location import _get_location_params

    from apps.dashboard.host_guard import install_hook

    install_hook()
    params = _get_location_params("http", "[::1]:5006", "/?trace=a#x")
    assert params["hostname"] == "[::1]" and params["port"] == "5006"
    assert params["href"] == "http://[::1]:5006/?trace=a#x" and params["search"] == "?trace=a"
    assert _get_location_params("http", "[::1]", "/")["href"] == "http://[::1]/"
    assert _get_location_params("http", "127.0.0.1:5006", "/")["hostname"] == "127.0.0.1"


def test_the_dashboard_url_brackets_an_ipv6_bind() -> None:
    assert url(DashboardConfig(host="::1", port=5006)) == "http://[::1]:5006/"


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.browser
@pytest.mark.skipif(not chromium_available(), reason="needs Debian's chromium at /usr/bin/chromium")
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_the_dashboard_works_at_an_ipv6_loopback_url(tmp_path: Path) -> None:
    """A server bound to ::1, opened at http://[::1]:PORT/ in Chromium: the page loads, its websocket is
    accepted (Bokeh's allow-list holds `[::1]:PORT`) and the trace's frames reach the views."""
    import socket
    import time

    from apps.dashboard.app import serve
    from k3testing.synthetic import Dims, Policy, write_synthetic_trace

    trace = write_synthetic_trace(tmp_path / "t", 2048, Dims.demo(),
                                  Policy(prefill_chunk=1024, dsa_prefill_stride=256, dense_mass_stride=512,
                                         moe_window_every=1024, decode_tokens=64, decode_flush_every=16))
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    config = DashboardConfig(root=tmp_path, host="::1", port=port, drive=False)
    server = serve(config, threaded=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("::1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not listen on ::1"
                time.sleep(0.1)
        with Browser() as browser:
            address = url(config, trace=trace.name)
            assert address.startswith(f"http://[::1]:{port}/")
            browser.open(address, wait_for=".k3-view-session canvas")
            # tokens arrive over the websocket after the page has loaded
            browser.page.locator(".k3-session-text .k3-token").first.wait_for(timeout=60_000)
            assert "K3 Workbench" in browser.page.title()
            assert browser.page.evaluate("location.hostname") == "[::1]"
            assert browser.counters.errors == []
    finally:
        server.stop()
