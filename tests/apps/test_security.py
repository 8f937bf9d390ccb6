"""Access rules: local binding by default, token for other hosts, `trace` URL parameter inside the root only."""

from __future__ import annotations

import argparse
from pathlib import Path

import panel as pn
import pytest

from apps.dashboard.app import DashboardConfig, create_app, url
from apps.dashboard.security import AccessError, is_local, resolve_trace, token_ok


def test_resolve_trace_stays_inside_root(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    (root / "run1").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    assert resolve_trace("run1", root) == (root / "run1").resolve()
    for bad in ["../secret", "run1/../../secret", "/etc", "", "a\x00b", "x" * 2000]:
        with pytest.raises(AccessError):
            resolve_trace(bad, root)
    (root / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(AccessError, match="outside"):
        resolve_trace("link", root)


def test_token_checks() -> None:
    assert token_ok(None, None) and token_ok("anything", None)
    assert token_ok("abc", "abc") and token_ok(b"abc", "abc")
    assert not token_ok(None, "abc") and not token_ok("abd", "abc")
    assert is_local("127.0.0.1") and is_local("localhost") and not is_local("0.0.0.0")


def test_app_refuses_a_wrong_token(small_trace: Path) -> None:
    config = DashboardConfig(trace=small_trace, root=small_trace.parent, token="s3cret")
    denied = create_app(config, session_args={"token": [b"wrong"]})
    assert isinstance(denied, pn.pane.Alert) and "token" in denied.object
    assert isinstance(create_app(config, session_args={}), pn.pane.Alert)
    ok = create_app(config, session_args={"token": [b"s3cret"]})
    assert isinstance(ok, pn.template.BootstrapTemplate)
    ok.dashboard.close()


def test_bad_trace_parameter_shows_an_error(small_trace: Path) -> None:
    config = DashboardConfig(trace=None, root=small_trace.parent)
    app = create_app(config, session_args={"trace": [b"../../etc"]})
    dash = app.dashboard
    assert "outside" in dash.message and dash.alert.visible
    dash.close()
    app = create_app(config, session_args={"trace": [small_trace.name.encode()]})
    # the page names traces relative to --root; the state resolves them inside it
    assert (small_trace.parent / app.dashboard.state.trace_path).resolve() == small_trace.resolve()
    app.dashboard.state.sync()
    assert app.dashboard.state.frame.session.status == "complete"
    app.dashboard.close()
    app = create_app(config, session_args={"trace": [b"no-such-trace"]})
    app.dashboard.state.sync()
    assert "does not exist" in app.dashboard.alert.object
    app.dashboard.close()


def test_cli_config_and_token(tmp_path: Path) -> None:
    from apps.dashboard.app import serve
    from apps.cli.dashboard_cmd import dashboard_config

    args = argparse.Namespace(trace=tmp_path / "t", model=None, host="0.0.0.0", port=5999, root=None, no_drive=False)
    config = dashboard_config(args)
    assert config.root == tmp_path and config.host == "0.0.0.0" and config.token is None
    server = serve(config, start=False)  # binds; not started
    try:
        assert config.token and len(config.token) >= 20  # a non-local host always gets a token
        assert f"token={config.token}" in url(config)
    finally:
        server.stop()
    local = dashboard_config(argparse.Namespace(trace=None, model=None, host="127.0.0.1", port=5998,
                                                root=tmp_path / "r", no_drive=True))
    assert local.token is None and not local.drive and (tmp_path / "r").is_dir()
    from engine.errors import InputError
    with pytest.raises(InputError):
        dashboard_config(argparse.Namespace(trace=None, model=None, host="127.0.0.1", port=0, root=tmp_path,
                                            no_drive=False))
