"""`benchmarks/bench_demo_model.py` runs as a user runs it, on the shipped checkpoint, and writes its
Markdown tables: the interval table (in-world and held-out, 95% intervals, reads beside chance) and the
older per-depth table (each DSA mode's needle reads beside their chance value)."""

from __future__ import annotations

import json

from tests.helpers import run_benchmark


def test_bench_demo_model_writes_its_table_with_reads_beside_chance(tmp_path):
    md, rows = tmp_path / "BENCH.md", tmp_path / "rows.json"
    out = run_benchmark("bench_demo_model.py", "--by-depth", "--lengths", "1024", "--samples", "1", "--depths", "0.5",
                        "--markdown", str(md), "--json", str(rows), timeout=300)
    assert "1,024 tokens depth 50% sparse" in out and "1,024 tokens depth 50% dense" in out
    data = json.loads(rows.read_text())
    assert {r["mode"] for r in data} == {"sparse", "dense"} and all(r["total"] == 1 for r in data)
    table = [line for line in md.read_text().splitlines() if line.startswith("| 1,024 |")]
    assert [line.split(" | ")[1] for line in table] == ["sparse", "dense"]
    for line in table:
        cells = line.strip("| ").split(" | ")
        assert len(cells) == 7 and cells[3].endswith("%")
        # every read figure stands beside its chance value ("-": no right answer to count reads of)
        assert all(c == "-" or ("chance" in c and c.endswith("x")) for c in cells[4:]), line
        assert "chance" in cells[4] and "chance" in cells[6], line
    # the same table from the rows alone, without running the model again
    again = tmp_path / "again.md"
    run_benchmark("bench_demo_model.py", "--by-depth", "--render", str(rows), "--markdown", str(again))
    assert again.read_text() == md.read_text()


def test_bench_demo_model_interval_table_separates_the_worlds(tmp_path):
    md, rows = tmp_path / "INTERVALS.md", tmp_path / "rows.json"
    out = run_benchmark("bench_demo_model.py", "--cells", "in-world:1024x2,held-out:1024x2", "--markdown", str(md),
                        "--json", str(rows), timeout=300)
    data = json.loads(rows.read_text())
    assert [(r["world"], r["length"], r["prompts"]) for r in data] == [("in-world", 1024, 2), ("held-out", 1024, 2)]
    assert all(0 <= r["lo"] <= r["value_correct"] / 2 <= r["hi"] <= 1 for r in data)
    table = md.read_text()
    assert "| in-world | 1,024 | " in table and "| held-out | 1,024 | " in table and "95% interval" in table
    assert all("chance" in line for line in table.splitlines() if line.startswith("| in-world | 1,024"))
    assert "in-world" in out and "95%" in out
    # a kept table is compared world by world
    out = run_benchmark("bench_demo_model.py", "--cells", "in-world:1024x2,held-out:1024x2", "--compare", str(rows),
                        timeout=300)
    assert "beats the base (better held-out, not worse in-world): no" in out
