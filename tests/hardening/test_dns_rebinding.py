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
