"""Issue 42 item 14: HTML and script in every text the dashboard shows stays text, in a real browser.

Payloads that would set `window.__pwned` or `document.title` are put into segment names, the trace's
directory name, generated tokens (model output), an uploaded file's name and its text, and the
prompt. Every view is opened in headless Chromium, every figure is swept with the mouse so its
tooltips are drawn, tokens are clicked (DSA read-out, routes) and the experts' segment choice is
opened. Nothing runs: `window.__pwned` stays unset, the title stays the dashboard's, no element in
the page (shadow roots included) carries an injected handler, script or `javascript:` link; and the
payloads are shown as their literal text.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

from apps.dashboard.app import DashboardConfig, url
from k3testing.browser import Browser
from k3testing.synthetic import Dims, write_synthetic_trace

from tests.apps.conftest import SMALL_POLICY, write_token_text
from tests.apps.served_page import BROWSER, drive_config, generate, served_page

pytestmark = BROWSER

PAYLOADS = [
    "<img src=x onerror=\"window.__pwned=1;document.title='pwned'\">",
    "<script>window.__pwned=2;document.title='pwned'</script>",
    "\"><svg onload=\"window.__pwned=3\">",
    "javascript:window.__pwned=4",
    "'><iframe srcdoc=\"<script>parent.__pwned=5</script>\"></iframe>",
    "{{7*7}} ${window.__pwned=6} @name",
]
# Markdown that an alert (a Markdown pane) would turn into an image fetched from another site, a link, a list
MARKDOWN = "../![x](http://evil.example/p.png) [y](http://evil.example/) \n# h\n- li"
# a directory name may not hold '/': the first payload, as a file name
HOSTILE_DIR = "<img src=x onerror=window.__pwned=7>"

# every element of the page, shadow roots included; anything a payload could have turned into markup
INJECTED = """() => {
  const found = [];
  const walk = root => {
    for (const el of root.querySelectorAll('*')) {
      for (const a of el.getAttributeNames()) {
        const v = el.getAttribute(a) || '';
        if (a.startsWith('on') && v.includes('__pwned')) found.push(`${el.tagName} ${a}`);
        if ((a === 'href' || a === 'src') && v.trim().toLowerCase().startsWith('javascript:')) found.push(`${el.tagName} ${a}`);
        if (a === 'srcdoc' && v.includes('__pwned')) found.push(`${el.tagName} srcdoc`);
      }
      if (el.tagName === 'SCRIPT' && (el.textContent || '').includes('__pwned')) found.push('SCRIPT');
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return found;
}"""
# the text of every Bokeh tooltip on screen now (tooltips live in shadow roots and go when the mouse leaves)
TOOLTIPS = """() => {
  const out = [];
  const walk = root => {
    for (const el of root.querySelectorAll('*')) {
      const cls = typeof el.className === 'string' ? el.className : '';
      if (cls.includes('bk-tooltip-row-value') || cls.includes('bk-tooltip-content')) out.push(el.textContent);
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return out.join('\\n');
}"""
PAGE_TEXT = """() => {
  const out = [];
  const walk = root => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) { out.push(el.shadowRoot.textContent || ''); walk(el.shadowRoot); }
    }
  };
  out.push(document.body.innerText);
  walk(document);
  return out.join('\\n');
}"""


def _hostile_trace(root: Path) -> Path:
    path = write_synthetic_trace(root / HOSTILE_DIR, 4096, Dims.demo(), SMALL_POLICY)
    session_file = path / "session.json"
    session = json.loads(session_file.read_text())
    for i, segment in enumerate(session["segments"]):
        segment["name"] = PAYLOADS[i % len(PAYLOADS)]
    session_file.write_text(json.dumps(session))
    write_token_text(path, {-20 + 2 * i: text for i, text in enumerate(PAYLOADS)})
    return path


def _sweep(browser: Browser, selector: str) -> str:
    """Move the mouse across every canvas under `selector` so that each figure draws its tooltips;
    returns the text of every tooltip seen on the way."""
    seen: set[str] = set()
    canvases = browser.page.locator(f"{selector} canvas")
    for i in range(min(canvases.count(), 16)):
        box = canvases.nth(i).bounding_box()
        if not box or box["width"] < 20 or box["height"] < 20:
            continue
        for row in (0.3, 0.5, 0.7):
            for step in range(1, 40):
                browser.page.mouse.move(box["x"] + box["width"] * step / 40, box["y"] + box["height"] * row)
                if step % 3 == 0:
                    seen.add(browser.page.evaluate(TOOLTIPS))
        browser.page.mouse.move(0, 0)
    return "\n".join(seen)


def _assert_nothing_ran(browser: Browser) -> None:
    assert browser.page.evaluate("window.__pwned === undefined"), browser.page.evaluate("window.__pwned")
    assert "pwned" not in browser.page.title() and "K3 Workbench" in browser.page.title()
    assert browser.page.evaluate(INJECTED) == []


def test_hostile_names_and_tokens_stay_text_in_every_view_and_tooltip(tmp_path: Path) -> None:
    trace = _hostile_trace(tmp_path)
    config = DashboardConfig(root=tmp_path, drive=False)
    with served_page(config, trace.name, every_view=True, height=3600) as browser:
        browser.page.locator(".k3-session-text .k3-token", has_text="window.__pwned=2").first.wait_for(timeout=60_000)
        time.sleep(1.0)
        _assert_nothing_ran(browser)
        # generated tokens and the session table show the payloads as their own text
        text = browser.page.evaluate(PAGE_TEXT)
        for payload in PAYLOADS:
            assert payload in text, payload
        # every figure's tooltips
        tips = _sweep(browser, "body")
        assert any(p in tips for p in PAYLOADS), tips[:2000]  # segment names shown as text in tooltips
        _assert_nothing_ran(browser)
        # click hostile tokens: the DSA read-out, the token title and the routes of that token
        for payload in PAYLOADS[:3]:
            token = browser.page.locator(".k3-dsa-tokens .k3-token", has_text=payload).first
            token.click()
            browser.page.locator(".k3-dsa-readout table.k3-reads").wait_for(timeout=30_000)
            time.sleep(0.5)
            _assert_nothing_ran(browser)
        _sweep(browser, ".k3-view-dsa")
        _sweep(browser, ".k3-view-experts")
        # the experts' segment choice lists the hostile names as options (text)
        selects = browser.page.locator(".k3-view-experts select")
        lists = [selects.nth(i).locator("option").all_inner_texts() for i in range(selects.count())]
        segment = next(i for i, options in enumerate(lists) if any(PAYLOADS[0] in o for o in options))
        selects.nth(segment).select_option(index=2)
        time.sleep(1.5)
        _assert_nothing_ran(browser)
        assert browser.counters.errors == [], browser.counters.errors
        # a URL parameter naming no trace is quoted in an error (a Markdown alert): Markdown in it stays
        # text too, so the page fetches no image from another site and shows no link
        browser.open(url(config, trace=MARKDOWN), wait_for=".k3-alert")
        browser.page.get_by_text("outside the dashboard's trace root").first.wait_for(timeout=30_000)
        time.sleep(1.0)
        assert browser.counters.external == [], browser.counters.external
        assert "![x](http://evil.example/p.png)" in browser.page.evaluate(PAGE_TEXT)
        assert browser.page.evaluate(INJECTED) == []


def test_markdown_in_an_alert_stays_text() -> None:
    import panel as pn

    from apps.dashboard.components.panes import alert_text

    # the HTML the browser receives (Panel sends it escaped once more)
    shown = html.unescape(pn.pane.Alert(alert_text(f"error: trace {MARKDOWN!r} is outside the root")).get_root().text)
    assert "<img" not in shown and "<a " not in shown and "<h1" not in shown and "<li" not in shown, shown
    assert "![x](http://evil.example/p.png)" in shown.replace("\\", "")


def test_hostile_upload_name_text_and_prompt_stay_text_in_drive_mode(tmp_path: Path) -> None:
    with served_page(drive_config(tmp_path / "traces", new_tokens=4), height=3400) as browser:
        name = PAYLOADS[0].replace("/", "") + ".txt"
        body = "\n".join(PAYLOADS) + "\nThe crate count is 12.\n"
        browser.page.locator(".k3-runner input[type=file]").first.set_input_files(
            files=[{"name": name, "mimeType": "text/plain", "buffer": body.encode()}])
        browser.page.get_by_text(f"{name} (").first.wait_for(timeout=60_000)
        _assert_nothing_ran(browser)
        assert generate(browser, PAYLOADS[1] + " " + PAYLOADS[2], 300)
        time.sleep(1.5)
        text = browser.page.evaluate(PAGE_TEXT)
        assert name in text  # the upload's name in the list, the session table
        tips = _sweep(browser, "body")
        assert name in tips, tips[:2000]  # the document's segment in the session map's tooltip
        _assert_nothing_ran(browser)
        assert browser.counters.errors == [], browser.counters.errors
