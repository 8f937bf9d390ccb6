"""Random weights read what chance predicts: on a recorded run with random weights, the share of
decode steps whose DSA selections hit a small span, summed over many spans, lands near the exact
chance baseline (`workbench.analysis.layers_reading`'s expected_reading). A trained model's needle
reads are compared with this same baseline, so the baseline must be right where nothing is learned.

preset:tiny (the demo architecture at test size, top-k 16) keeps it fast; measured on preset:demo
(top-k 256, 3.2K tokens, 32 decode steps) the ratios were 0.99x / 0.92x / 0.88x for 2 / 4 / 8-token spans.
"""

from __future__ import annotations

import math
import random

import workbench
from workbench.analysis import layers_reading
from workbench.retrieval_text import TRAIN, filler
from workbench.sessions import recorded_session


def test_random_weights_read_spans_at_chance(tmp_path) -> None:
    trace = tmp_path / "trace"
    with recorded_session("preset:tiny", trace, prefill_chunk=512, overwrite=True) as run:
        s = run.session
        s.append("You answer briefly and exactly.", role="system")
        s.append(filler(TRAIN, random.Random(0), 1500), name="doc")
        s.append("What is the code?", role="user")
        pieces = [t.text for t in s.generate(max_new_tokens=24, temperature=0)]
        n = len(s.tokens)
    topk = workbench.open_trace(trace).df("dsa_topk")
    first = n - len(pieces)
    for span in (2, 8):
        observed = expected = 0.0
        for a in range(50, first - 100, 37):
            r = layers_reading(topk, a, a + span, queries=(first, n))
            observed += float(r["queries_reading"].sum())
            expected += float(r["expected_reading"].sum())
        # a binomial-style tolerance (4 sigma) plus 25% for what random (not uniform) selections bias
        tolerance = 4 * math.sqrt(expected) + 0.25 * expected
        assert expected > 20 and abs(observed - expected) <= tolerance, (span, observed, expected)
