"""The browser's CPU while the dashboard follows a live session, for source trees side by side.

    python benchmarks/bench_live_cpu.py --trace-128k T --trees OLD NEW [--rounds 2] [--seconds 40]

Per tree and round: a fresh process running that tree's code replays trace T into a new directory as if a
session were recording it (`k3testing.replay.TraceReplay`, --seconds long), serves the dashboard on it, opens it
in headless Chromium, shows every view (scrolling to each), then reads Chrome's renderer counters
(`Performance.getMetrics`) over 80% of the replay: task, script, style-recalculation and layout seconds, and
their share of the wall time. Trees alternate in order every round; medians per tree, and each one's ratio to
the first tree's, are printed. The figure to read on a shared machine is the ratio (the same replay for all).
Needs /usr/bin/chromium and Playwright.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

COUNTERS = ("TaskDuration", "ScriptDuration", "RecalcStyleDuration", "LayoutDuration", "RecalcStyleCount",
            "LayoutCount")

# run in the tree's own process (its `apps` and `k3testing`), printing one JSON line
_ONE_RUN = """
import json, sys, tempfile, time
from pathlib import Path
from apps.dashboard.app import DashboardConfig, url
from k3testing.browser import Browser, start_server
from k3testing.replay import TraceReplay
source, seconds, counters = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(",")
with tempfile.TemporaryDirectory(prefix="k3wb-live-cpu-") as tmp:
    target = Path(tmp) / "live"
    replay = TraceReplay(source, target, seconds=seconds, decode_rate=None, interval=0.5)
    config = DashboardConfig(trace=target, root=Path(tmp))
    server = start_server(config)
    try:
        with Browser() as browser:
            browser.cdp.send("Performance.enable")
            replay.start()
            browser.open(url(config), wait_for=".k3-view-session canvas", timeout_ms=120_000)
            browser.wait_views(120_000)
            read = lambda: {m["name"]: m["value"] for m in browser.cdp.send("Performance.getMetrics")["metrics"]}
            before, start = read(), time.perf_counter()
            time.sleep(seconds * 0.8)
            after, wall = read(), time.perf_counter() - start
        out = {k: after[k] - before[k] for k in counters}
        out["wall_s"] = wall
        out["task_share"] = out["TaskDuration"] / wall
        out["replay_error"] = repr(replay.error) if replay.error else None
        print(json.dumps(out))
    finally:
        replay.stop()
        replay.join(10)
        server.stop()
"""


def one_run(tree: Path, trace: Path, seconds: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", _ONE_RUN, str(trace), str(seconds), ",".join(COUNTERS)], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=seconds * 4 + 300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the live run of {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-128k", type=Path, required=True, help="the finished trace replayed as a live session")
    ap.add_argument("--trees", type=Path, nargs="+", required=True, help="source trees (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=40.0, help="how long each replay lasts")
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench_live_cpu.json"))
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            runs[str(tree)].append(one_run(tree, args.trace_128k.resolve(), args.seconds))
            print(json.dumps({"round": r + 1, "tree": str(tree),
                              **{k: round(v, 3) for k, v in runs[str(tree)][-1].items() if isinstance(v, float)}}),
                  flush=True)
    keys = (*COUNTERS, "task_share")
    result: dict = {"rounds": args.rounds, "seconds": args.seconds, "trees": {}}
    base: dict = {}
    for tree, rs in runs.items():
        med = {k: round(statistics.median(x[k] for x in rs), 3) for k in keys}
        base = base or med
        result["trees"][tree] = {"median": med, "ratio_to_first_tree": {k: round(v / base[k], 3) for k, v in med.items()
                                                                       if base[k]}, "runs": rs}
        print(json.dumps({"tree": tree, "median": med, "ratio_to_first_tree": result["trees"][tree]["ratio_to_first_tree"]}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
