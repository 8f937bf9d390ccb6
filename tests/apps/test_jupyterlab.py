"""`workbench.show` in a real JupyterLab page, in headless Chromium (Playwright, Debian's /usr/bin/chromium).

`jupyter lab` is started on 127.0.0.1 with a token and a fresh config; the page opens a notebook and
runs its cells one by one through JupyterLab's own commands. The notebook records a tiny-preset
session in a thread of the kernel, gated by events so the page can be checked at known points:

1. the prefill of a first document is recorded, `workbench.show(session)` is displayed: the session map
   and DSA views appear (drawn canvases) while the status reads "recording";
2. the next cell lets the thread append a second document: the inline view changes by itself (more
   tokens in its status line, and both views' drawings differ) while the session is still recording;
3. the last cell lets the session generate and finish: the view reads "complete".

No console errors; nothing fetched from outside 127.0.0.1. Then the notebook is saved with its outputs
(it must stay small: BokehJS is not in it) and the tab reloaded: the saved views render again, their
libraries fetched from the Jupyter server by the loader each view's cell holds. A screenshot is left in
$K3WB_ARTIFACTS.
When the view does not render, the failure prints the page's console errors, the cells' outputs and
the server's log: that is how the empty view of issue 10 was traced to BokehJS being fetched from
cdn.bokeh.org (unreachable offline; `workbench.show` now sends it inline).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import nbformat
import pytest

from k3testing.browser import Browser, chromium_available, free_port

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not chromium_available(),
                                 reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium; "
                                        ".ci/run installs it)")]

TOKEN = "k3wb-lab-token"
# every wait below is sized for CI (< 90 s in all); a starved shared machine may stretch them
SCALE = float(os.environ.get("K3WB_LAB_TIMEOUT_SCALE", "1"))

CELLS = [
    # 1: a session recorded in a kernel thread, paused between its steps by events
    """import os
import threading
import torch
import workbench
from workbench.sessions import recorded_session

torch.set_num_threads(1)
WAIT = 120 * float(os.environ.get("K3WB_LAB_TIMEOUT_SCALE", "1"))
ready, more, finish, failed = threading.Event(), threading.Event(), threading.Event(), []
box = {}

def run():
    try:
        with recorded_session("preset:tiny", "live_trace", prefill_chunk=128, progress=False,
                              policy={"flush_seconds": 0.1}, overwrite=True) as rec:
            box["session"] = rec.session
            rec.session.append(workbench.haystack(600, rec.session.tokenizer, seed=1), name="first.txt")
            rec.recorder.writer.flush()
            ready.set()
            more.wait(WAIT)
            rec.session.append(workbench.haystack(600, rec.session.tokenizer, seed=2), name="second.txt")
            rec.recorder.writer.flush()
            finish.wait(WAIT)
            rec.session.append("Which pier was busiest?", role="user")
            list(rec.session.generate(8, temperature=0.0))
    except BaseException as exc:
        failed.append(exc)
        ready.set()

worker = threading.Thread(target=run, daemon=True)
worker.start()
assert ready.wait(WAIT) and not failed, failed""",
    # 2: the inline view of the session being recorded
    """view = workbench.show(box["session"], views=["session", "dsa"], refresh_ms=200, interval=0.1)
view""",
    # 3: the session grows while the view is shown
    "more.set()",
    # 4: the session finishes
    """finish.set()
worker.join(WAIT)
assert not worker.is_alive() and not failed, failed
print("session done")""",
]


def _write_notebook(path: Path) -> None:
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS], metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
    nbformat.write(book, path)


def _lab_prefix() -> Path:
    """The environment jupyterlab is installed in: its share/jupyter (static assets, lab extensions such as
    @pyviz/jupyterlab_pyviz from pyviz_comms) and etc/jupyter (server extensions the packages enabled)."""
    import jupyterlab

    for parent in Path(jupyterlab.__file__).resolve().parents:
        if (parent / "share" / "jupyter" / "lab" / "static").is_dir():
            return parent
    pytest.skip("JupyterLab's application assets (share/jupyter/lab/static) are not installed")


def _start_lab(root: Path, port: int) -> subprocess.Popen:
    prefix = _lab_prefix()
    share = prefix / "share" / "jupyter"
    # a fresh user config, but the environment's own data and config paths: the page gets what a user's
    # install has (without etc/jupyter the lsp and panel server extensions are off and their probes 404)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(root / ".jupyter-config"),
           "JUPYTER_RUNTIME_DIR": str(root / ".jupyter-runtime"), "JUPYTER_DATA_DIR": str(root / ".jupyter-data"),
           "JUPYTER_PATH": str(share), "JUPYTER_CONFIG_PATH": str(prefix / "etc" / "jupyter"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}", f"--LabApp.app_dir={share / 'lab'}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--ServerApp.port_retries=0"] + (["--allow-root"] if os.geteuid() == 0 else [])   # CI containers run as root
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=open(root / "lab.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60 * SCALE
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited: {(root / 'lab.log').read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"jupyter lab did not listen on {port}: {(root / 'lab.log').read_text()[-3000:]}")


def _status(browser: Browser) -> tuple[str, int]:
    """(status, tokens) from the view's source line: "status: recording, 1,234 tokens"."""
    text = browser.page.locator(".k3-inline .k3-source pre").first.inner_text()
    match = re.search(r"status: (\w+), ([\d,]+) tokens", text)
    return (match.group(1), int(match.group(2).replace(",", ""))) if match else ("", 0)


def _wait_status(browser: Browser, test, timeout: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout * SCALE
    seen = ("", 0)
    while time.monotonic() < deadline:
        seen = _status(browser)
        if test(*seen):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"the inline view never showed the expected state; last: {seen}")


def _run_next_cell(browser: Browser) -> None:
    browser.page.evaluate("window.jupyterapp.commands.execute('notebook:run-cell-and-select-next')")


def _kernel_idle(browser: Browser, timeout: float) -> None:
    browser.page.wait_for_function(
        "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
        " return !!k && k.status === 'idle'; }", timeout=timeout * 1000 * SCALE)


def _diagnosis(browser: Browser, root: Path) -> str:
    """What to read when a wait fails: the page's console errors, the cells' outputs, the server's log."""
    log = (root / "lab.log").read_text(errors="replace")[-2000:] if (root / "lab.log").exists() else ""
    outputs = [o[:300] for o in _outputs(browser)]
    return (f"console errors: {browser.counters.errors}\nexternal requests: {browser.counters.external}\n"
            f"cell outputs: {outputs}\njupyter lab log (tail):\n{log}")


def _cell_done(browser: Browser, index: int, timeout: float) -> None:
    """Wait until cell `index` has run (JupyterLab sets its execution count when the reply arrives)."""
    try:
        browser.page.wait_for_function(
            f"() => {{ const c = window.jupyterapp.shell.currentWidget.content.widgets[{index}];"
            " return c.model.executionCount !== null; }", timeout=timeout * 1000 * SCALE)
    except Exception as exc:
        raise AssertionError(f"cell {index + 1} did not finish: {_outputs(browser)}") from exc
    errors = browser.page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t]
    assert not tracebacks, tracebacks


def _outputs(browser: Browser) -> list[str]:
    return browser.page.locator(".jp-OutputArea-output").all_inner_texts()


def _view_pixels(browser: Browser, view: str) -> bytes:
    """A PNG of one view as drawn now (its canvases included)."""
    return browser.page.locator(f".k3-inline .k3-view-{view}").first.screenshot()


# BokehJS's comm receiver reporting a message it got only in part ("Expected binary fragment but received
# text fragment", then patches without their events). Seen in about 1 run in 10 of this test on the 2-core
# machine, at the first frames after the view is displayed, and not yet traced to our code (the inline view
# waits for the page's width report before it pushes frames; apps/dashboard/notebook.py). The views still
# render and follow the session in such a run; the test runs the scenario again once when these are the
# only errors, and fails if they come back.
RECEIVER_ERRORS = ("fragment but received", "_apply_json_patch")


def _receiver_error(error: str) -> bool:
    return any(mark in error for mark in RECEIVER_ERRORS)


def _saved_and_reloaded(browser: Browser, notebook: Path, artifacts: Path) -> None:
    """Save the notebook (outputs included), check its size, reload the tab: the saved views render again."""
    before = notebook.stat().st_mtime_ns
    browser.page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
    deadline = time.monotonic() + 30 * SCALE
    while notebook.stat().st_mtime_ns == before and time.monotonic() < deadline:
        time.sleep(0.2)
    saved = nbformat.read(notebook, as_version=4)
    assert any(o.get("output_type") == "execute_result" for o in saved.cells[1].outputs), "saved without the view"
    size = notebook.stat().st_size
    # the inline bundle made it 6.4-6.8 MB; the views' own documents and a loader per cell remain
    assert size < 1_500_000, f"the saved notebook is {size:,} bytes"
    warnings_seen: list[str] = []
    browser.page.on("console", lambda msg: warnings_seen.append(msg.text) if msg.type in ("warning", "error") else None)
    browser.counters.errors.clear()
    browser.page.reload(wait_until="commit")
    browser.page.locator(".jp-Notebook").first.wait_for(state="visible", timeout=60_000 * SCALE)
    for view in ("session", "dsa"):
        try:
            browser.page.locator(f".k3-inline .k3-view-{view} canvas").first.wait_for(state="visible",
                                                                                      timeout=60_000 * SCALE)
        except Exception as exc:
            raise AssertionError(f"after a reload the saved {view} view did not render: {warnings_seen}") from exc
    browser.page.screenshot(path=str(artifacts / "jupyterlab_reloaded.png"), full_page=True)
    assert not [w for w in warnings_seen if "library is missing" in w], warnings_seen
    assert browser.counters.external == [], browser.counters.external
    (artifacts / "jupyterlab_reloaded.json").write_text(json.dumps({"saved_bytes": size, "console": warnings_seen}))


def test_inline_view_in_jupyterlab_follows_a_live_session(tmp_path: Path, artifacts: Path) -> None:
    first = _live_view_in_lab(tmp_path / "run1", artifacts)
    errors = first["errors"]
    if errors and all(_receiver_error(e) for e in errors):
        warnings.warn(f"BokehJS comm receiver errors in the first run (stages: {first['stages']}); running again: "
                      f"{errors[0][:200]}")
        errors = _live_view_in_lab(tmp_path / "run2", artifacts)["errors"]
    assert errors == [], errors


def _live_view_in_lab(tmp_path: Path, artifacts: Path) -> dict:
    """One run of the scenario; every check but the console errors, which are returned with the number
    seen at each stage."""
    tmp_path.mkdir(parents=True)
    _write_notebook(tmp_path / "live.ipynb")
    port = free_port()
    lab = _start_lab(tmp_path, port)
    try:
        with Browser(height=2400) as browser:
            browser.open(f"http://127.0.0.1:{port}/lab/tree/live.ipynb?token={TOKEN}", wait_for=".jp-Notebook",
                         timeout_ms=int(60_000 * SCALE))
            _kernel_idle(browser, 60)
            _run_next_cell(browser)  # 1: the session records its first document, then waits
            _cell_done(browser, 0, 120)
            stages = {"before the view": len(browser.counters.errors)}
            _run_next_cell(browser)  # 2: the inline view
            _cell_done(browser, 1, 60)
            try:
                for view in ("session", "dsa"):
                    browser.page.locator(f".k3-inline .k3-view-{view} canvas").first.wait_for(
                        state="visible", timeout=60_000 * SCALE)
                first = _wait_status(browser, lambda status, n: status == "recording" and n >= 600, 30)
            except Exception as exc:
                raise AssertionError(f"the inline view did not render: {exc}\n{_diagnosis(browser, tmp_path)}") from exc
            external = {"rendered": list(browser.counters.external)}  # when outside fetches happened, if any
            drawn = {view: _view_pixels(browser, view) for view in ("session", "dsa")}
            stages["view drawn"] = len(browser.counters.errors)
            _run_next_cell(browser)  # 3: the second document is appended while the view is shown
            grown = _wait_status(browser, lambda status, n: status == "recording" and n > first[1], 60)
            # the drawings themselves follow (not only the status line): the pushed frame redrew the canvases
            browser.page.wait_for_timeout(1000)
            changed = [view for view in drawn if _view_pixels(browser, view) != drawn[view]]
            stages["view grown"] = len(browser.counters.errors)
            _run_next_cell(browser)  # 4: generate and finish
            external["grown"] = list(browser.counters.external)
            done = _wait_status(browser, lambda status, n: status == "complete", 60)
            _cell_done(browser, 3, 60)
            assert done[1] > grown[1] > first[1], (first, grown, done)
            assert changed == ["session", "dsa"], f"views that did not redraw as the session grew: {changed}"
            browser.page.get_by_text("session done").first.wait_for(timeout=30_000 * SCALE)
            browser.page.screenshot(path=str(artifacts / "jupyterlab_inline_view.png"), full_page=True)
            (artifacts / "jupyterlab_inline_view.json").write_text(json.dumps(
                {"first": first, "grown": grown, "done": done, "errors": browser.counters.errors}, indent=1))
            # nothing from outside 127.0.0.1, at any stage: not BokehJS or Panel (sent inline), and not the
            # stylesheets a text update would re-send as cdn.holoviz.org links (components/panes.py)
            assert browser.counters.external == [], {**external, "done": browser.counters.external}
            stages["done"] = len(browser.counters.errors)
            if browser.counters.errors and not all(_receiver_error(e) for e in browser.counters.errors):
                raise AssertionError(_diagnosis(browser, tmp_path))
            errors = list(browser.counters.errors)
            _saved_and_reloaded(browser, tmp_path / "live.ipynb", artifacts)
            return {"errors": errors, "stages": stages}
    finally:
        lab.terminate()
        try:
            lab.wait(timeout=15)
        except subprocess.TimeoutExpired:
            lab.kill()
