"""The interval table's statistics: Wilson intervals, cell parsing, pooling and the ship verdict."""

from __future__ import annotations

import pytest

from training.interval_table import Cell, compare, markdown, parse_cells, pooled, wilson


def test_wilson_interval_matches_known_values_and_stays_inside_0_1():
    lo, hi = wilson(12, 24)
    assert lo == pytest.approx(0.3134, abs=1e-3) and hi == pytest.approx(0.6866, abs=1e-3)
    assert wilson(0, 24)[0] == 0.0 and 0.13 < wilson(0, 24)[1] < 0.15
    assert wilson(24, 24)[1] == 1.0 and 0.85 < wilson(24, 24)[0] < 0.87
    # more prompts, narrower interval: cells of 8 prompts cannot tell 50% from 75%, cells of 80 can
    assert wilson(4, 8)[1] > 0.75 and wilson(6, 8)[0] < 0.5
    assert wilson(40, 80)[1] < 0.62 and wilson(60, 80)[0] > 0.64


def test_cells_parse_and_bad_cells_name_the_problem():
    assert parse_cells("in-world:2048x24, held-out:8192x6") == [Cell("in-world", 2048, 24), Cell("held-out", 8192, 6)]
    for bad, words in (("world:2048x24", "world must be one of"), ("in-world:2048", "WORLD:LENGTHxPROMPTS"),
                       ("in-world:64x2", "length must be"), ("", "no cells")):
        with pytest.raises(ValueError, match=words):
            parse_cells(bad)


def _row(world, length, k, n):
    lo, hi = wilson(k, n)
    return {"world": world, "length": length, "prompts": n, "value_correct": k, "correct": 0, "lo": lo, "hi": hi,
            "reads": {"5": {"read": 0.9, "chance": 0.1}}}


def test_pooling_comparison_and_table():
    base = [_row("in-world", 2048, 24, 24), _row("held-out", 2048, 12, 24), _row("held-out", 8192, 10, 24)]
    assert pooled(base, "held-out")[:2] == (22, 48)
    better = [_row("in-world", 2048, 23, 24), _row("held-out", 2048, 22, 24), _row("held-out", 8192, 21, 24),
              _row("held-out", 32768, 0, 24)]    # a length the base lacks is left out of the comparison
    verdict = compare(better, base)
    assert verdict["held-out"]["lengths"] == [2048, 8192] and verdict["held-out"]["better"]
    assert verdict["in-world"]["not_worse"] and verdict["beats"]
    worse_in_world = [_row("in-world", 2048, 16, 24), _row("held-out", 2048, 22, 24), _row("held-out", 8192, 21, 24)]
    assert not compare(worse_in_world, base)["beats"]
    same = compare(base, base)
    assert not same["held-out"]["better"] and not same["beats"]
    table = markdown(better, "t")
    assert "| in-world | 2,048 | 23/24 | 96% |" in table and "| held-out | 66/72 |" not in table
    assert "| held-out | 43/72 | 60% |" in table and "chance 10%" in table
