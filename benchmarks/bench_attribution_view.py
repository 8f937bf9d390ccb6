"""The attribution view at long contexts: what the page receives with windows around the top spans vs the whole
context, and how long the reducer takes, measured side by side in one run.

    python benchmarks/bench_attribution_view.py                         # synthetic: 10,000 spans over 128K tokens
    python benchmarks/bench_attribution_view.py --trace traces/long     # a trace holding attribution.json
    python benchmarks/bench_attribution_view.py --trace traces/long --browser   # + first paint in Chromium
    python benchmarks/bench_attribution_view.py --drive 131072 --browser        # drive mode first (~15 min)

0. With --drive N: drive mode records a find-fact question about a document of about N tokens on
   builtin:demo (the fact in its middle, restated at its end by the template) and presses Attribute
   with --masks/--holdout/--top/--controls; the seconds of each and the answer are printed, and the
   figures below are taken on that trace.

1. Layout (`attribution_view.attribution_data`: read the file's record, shade, pick windows) beside the
   same record laid out whole (every span a piece, what a page without windows would get), interleaved,
   best of --repeats; and the JSON bytes of the text pieces each sends to the browser.
2. With --browser (needs /usr/bin/chromium and a --trace): the dashboard opened on the trace in headless
   Chromium; seconds from navigation to the first shaded span drawn, and the span elements in the page.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.dashboard.components.attribution import piece_rows  # noqa: E402
from workbench.analysis.views.attribution_view import (Piece, attribution_data, focus_rows, lds_words,  # noqa: E402
                                                       span_rows)
from workbench.trace.attribution_file import read_attribution  # noqa: E402


SENTENCES = ["We left the village early, before the fog had lifted from the fields.",
             "The path to the river is muddy after rain, so everyone wears boots.",
             "A heron stood in the shallow water and did not move for an hour.",
             "Somebody left a blue umbrella on the bench by the station.",
             "The children built a raft from planks and empty barrels."]


def drive(tokens: int, root: Path, masks: int, holdout: int, top: int, controls: int) -> tuple[Path, dict]:
    """Drive mode on builtin:demo: a find-fact question about ~`tokens` tokens of prose, then Attribute."""
    import random

    from apps.dashboard.follower import DashboardState
    from apps.dashboard.session_runner import SessionRunner

    rng = random.Random(0)
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < tokens - 600:  # the demo tokenizer: about a token per character
        parts.append(rng.choice(SENTENCES))
    parts.insert(len(parts) // 2, "Remember: the alarm code for the greenhouse is 3-8-2-5.")
    runner = SessionRunner(state=DashboardState(None), runs_dir=str(root), prefill_chunk=4096)
    runner.param.model.objects = ["builtin:demo"]
    runner.model = "builtin:demo"
    runner.dropper.value = {"notes.txt": " ".join(parts)}
    runner.tasks.fact = "greenhouse alarm: 3-8-2-5 (notes.txt)"

    def wait() -> None:
        while runner.running or runner.attribution.running:
            runner.poll()
            time.sleep(0.2)
        runner.poll()

    t0 = time.perf_counter()
    trace = runner.generate()
    if trace is None:
        raise SystemExit(runner.message)
    wait()
    recorded = time.perf_counter() - t0
    panel = runner.attribution
    panel.masks, panel.holdout, panel.top, panel.controls = masks, holdout, top, controls
    runner.poll()
    if not panel.attribute():
        raise SystemExit(panel.message)
    t0 = time.perf_counter()
    wait()
    runner.state.close()
    return trace, {"recorded_s": recorded, "session": runner.message, "attribute_s": time.perf_counter() - t0,
                   "attribute": panel.message}


def synthetic_record(spans: int = 10_000, tokens: int = 131_072) -> dict:
    """An attribution of `spans` sentences over `tokens` positions, two of them checked (as a 128K run gives)."""
    from workbench.trace.attribution_file import FORMAT

    width = tokens // spans
    rows = []
    for i in range(spans):
        checked = i in (spans // 10, spans * 6 // 10)
        rows.append({"start": i * width, "end": (i + 1) * width, "text": "A sentence of the context, about sixty "
                     "characters long.", "effect": -0.9 if checked else -0.01 * (i % 7), "estimate": -0.01,
                     "control_min": -0.01 if checked else None, "control_max": 0.02 if checked else None,
                     "controls": 8 if checked else 0, "verdict": "the answer depends on it" if checked else "",
                     "label": "notes.txt", "kind": "sentence", "rank": 1 if checked else None,
                     "p_value": 1 / 9 if checked else None, "reads": 3,
                     "source": "checked" if checked else "unread" if i % 3 == 0 else "estimated"})
    rows.sort(key=lambda r: (r["source"] != "checked", r["effect"]))
    return {"format": FORMAT, "check": "synthetic", "answer": "3-8-2-5", "right": True, "target": "3-8-2-5",
            "target_logprob": -0.02, "lds": 0.8, "prefill_s": None, "attribution_s": 1.0, "masks": 64, "holdout": 16,
            "candidates": 384, "runs": 154, "kda": False, "context_tokens": tokens, "notes": [], "spans": rows}


def whole(record: dict) -> list[Piece]:
    """Every span as a piece: the page without windows."""
    line, _ = lds_words(record.get("lds"), int(record["holdout"]))
    rows = span_rows(record, line)
    focus_rows(rows)
    return [Piece("span", r.start, r.end, row=r) for r in sorted(rows, key=lambda r: r.start)]


def layout(record: dict, repeats: int) -> dict:
    windowed_s, whole_s = [], []
    for _ in range(repeats):  # interleaved: both see the same machine load
        t0 = time.perf_counter()
        data = attribution_data(record)
        windowed_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        everything = whole(record)
        whole_s.append(time.perf_counter() - t0)
    sent = len(json.dumps(piece_rows(data["pieces"])))
    sent_whole = len(json.dumps(piece_rows(tuple(everything))))
    return {"spans": data["spans"], "context_tokens": record["context_tokens"], "spans_sent": data["shown"],
            "windowed_layout_s": min(windowed_s), "whole_layout_s": min(whole_s),
            "text_bytes_sent": sent, "text_bytes_whole": sent_whole, "bytes_ratio_whole_over_sent": sent_whole / sent}


def first_paint(trace: Path) -> dict:
    from apps.dashboard.app import DashboardConfig, url
    from k3testing.browser import Browser, start_server

    config = DashboardConfig(trace=trace, root=trace.parent, drive=False, refresh_ms=250)
    server = start_server(config)
    try:
        with Browser(height=3000) as browser:
            t0 = time.perf_counter()
            browser.page.goto(url(config, trace=trace.name))
            browser.page.locator(".k3-view-attribution .k3-attr-span").first.wait_for(timeout=300_000)
            seconds = time.perf_counter() - t0
            return {"first_span_drawn_s": seconds, "span_elements": browser.page.locator(".k3-attr-span").count(),
                    "dom_nodes": browser.dom_nodes()}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, help="a trace directory holding attribution.json (default: synthetic)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--browser", action="store_true", help="also open the trace in headless Chromium")
    parser.add_argument("--drive", type=int, metavar="TOKENS", help="record and attribute a session of this size first")
    parser.add_argument("--root", type=Path, default=Path("traces/bench-attribution"), help="where --drive records")
    parser.add_argument("--masks", type=int, default=16)
    parser.add_argument("--holdout", type=int, default=8)
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--controls", type=int, default=8)
    args = parser.parse_args()
    driven = {}
    if args.drive:
        import torch

        torch.set_num_threads(1)
        args.trace, driven = drive(args.drive, args.root, args.masks, args.holdout, args.top, args.controls)
    record = read_attribution(args.trace) if args.trace else synthetic_record()
    if record is None:
        raise SystemExit(f"{args.trace}: no attribution.json (press Attribute in drive mode first)")
    out = {"source": str(args.trace or "synthetic"), **driven, **layout(record, args.repeats)}
    if args.browser:
        if args.trace is None:
            raise SystemExit("--browser needs --trace (a recorded trace: the page also draws its DSA map)")
        out.update(first_paint(args.trace.resolve()))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
