"""The attribution view in real headless Chromium: drive mode asks `builtin:demo` a find-fact question about an
uploaded document, Attribute runs (16 + 8 masks, 2 spans checked beside 8 controls), and the view lists the
fact's sentence first with its verdict, draws it outlined with its controls in the tooltip, and a click on it
sets the What-if range."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.builtin import ROOT as BUILTIN_ROOT

from tests.apps.served_page import BROWSER, drive_config, served_page, wait_until

pytestmark = [*BROWSER, pytest.mark.skipif(not (BUILTIN_ROOT / "demo" / "prompting.json").is_file(),
                                           reason="builtin:demo (with its prompting card) not installed")]

NOTES = " ".join(["We left the village early, before the fog had lifted from the fields.",
                  "The path to the river is muddy after rain, so everyone wears boots."] * 5
                 + ["Remember: the alarm code for the greenhouse is 3-8-2-5."]
                 + ["A heron stood in the shallow water and did not move for an hour.",
                    "The children built a raft from planks and empty barrels."] * 5)


def _until(check, timeout: float, what: str) -> None:
    assert wait_until(check, timeout), f"timed out waiting for {what}"


def test_attribute_shows_the_fact_first_with_its_verdict(tmp_path: Path, artifacts: Path) -> None:
    with served_page(drive_config(tmp_path / "traces", "builtin:demo"), every_view=True, height=4200) as browser:
        page = browser.page
        page.locator(".k3-runner input[type=file]").first.set_input_files(
            files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": NOTES.encode()}])
        facts = page.locator(".k3-runner select").nth(2)      # Model, Task, then "Facts found in your documents"
        picked = "greenhouse alarm: 3-8-2-5 (notes.txt)"
        _until(lambda: picked in facts.locator("option").all_inner_texts(), 60, "the found fact")
        facts.select_option(label=picked)
        time.sleep(0.5)
        page.get_by_role("button", name="Generate").click()
        status = page.locator(".k3-runner .alert p")
        _until(lambda: "right: the value in your document" in " ".join(status.all_inner_texts()), 240,
               "the answer")
        panel = page.locator(".k3-attribute")
        button = panel.get_by_role("button", name="Attribute")
        _until(button.is_enabled, 60, "Attribute to be offered")
        for field, value in zip(panel.locator("input").all(), ("16", "8", "2", "8")):
            field.fill(value)
            field.press("Enter")
        time.sleep(0.5)
        button.click()
        progress = panel.locator(".alert p")
        _until(lambda: "attributing the last answer" in " ".join(progress.all_inner_texts()), 10, "the progress line")
        _until(lambda: "attributed in" in " ".join(progress.all_inner_texts()), 180, "the attribution")
        view = page.locator(".k3-view-attribution")
        rows = view.locator("table.k3-attr-top tr")
        _until(lambda: rows.count() > 1, 30, "the top spans")          # live: no reload
        first = rows.nth(1).inner_text()
        assert "greenhouse alarm is 3-8-2-5" in first, first
        assert "hiding tokens" in first and "8 random spans of the same size" in first, first
        assert "each predicted by a surrogate fitted without it" in " ".join(
            view.locator(".k3-attr-lds div").all_inner_texts())
        fact = view.locator(".k3-attr-span.k3-checked", has_text="greenhouse alarm is 3-8-2-5").first
        tip = fact.get_attribute("title")
        assert "Hidden alone" in tip and "8 random same-size disjoint spans changed it by" in tip, tip
        fact.click()
        positions = page.locator(".k3-what-if input[type=text]").first
        start, end = fact.get_attribute("data-start"), fact.get_attribute("data-end")
        _until(lambda: positions.input_value() == f"{start}:{end}", 10, "the What-if range")
        view.screenshot(path=str(artifacts / "attribution_view.png"))
        assert browser.counters.errors == []
