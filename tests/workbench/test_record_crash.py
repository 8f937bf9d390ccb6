"""A recording session killed with SIGKILL at random moments leaves a trace that opens, holding a
prefix of what it recorded (at most the last unflushed part is missing).

The model is loaded once; each run is a forked child recording a real session (flushing every 20
ms) that the test kills after a random delay, 20 times.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import numpy as np
import pytest

import workbench
from engine import load_model
from engine.session import Session
from engine.tokenizer import Tokenizer

KILLS = 20


def _record_until_killed(model, trace) -> None:
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=8, progress=False)
    policy = {"flush_seconds": 0.02, "flush_share": 1.0, "dsa_prefill_stride": 4, "moe_window_every": 1}
    with workbench.record(session, trace=trace, policy=policy):
        session.append("A long record of things that happened, one after another. " * 12, name="log")
        for _ in session.generate(400, temperature=1.0, seed=1, stop_ids=()):
            pass


def _wait_for_a_part(table_dir, timeout: float) -> None:
    """Poll until the child published its first part of `table_dir` (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(table_dir.glob("part-*.parquet")):
        time.sleep(0.01)


def _sink_counts_are_a_prefix(df) -> bool:
    """Delta rows (coalesced per flush) must count every query up to the last covered position once."""
    for _, rows in df.groupby("layer"):
        if int(rows["queries"].sum()) != int(rows["position"].max()) + 1:
            return False
    return True


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_during_recording_leaves_readable_prefix(tmp_path):
    model = load_model("preset:tiny", seed=4)
    rng = random.Random(7)
    opened_with_rows = 0
    for i in range(KILLS):
        trace = tmp_path / f"t{i}"
        pid = os.fork()
        if pid == 0:  # child: record until the parent kills it
            try:
                _record_until_killed(model, trace)
            finally:
                os._exit(0)
        if i % 2:
            # half the kills land after the first flush is visible, wherever the load puts it
            _wait_for_a_part(trace / "dsa_sink", timeout=120)
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            time.sleep(rng.uniform(0.05, 1.2))  # blind: anywhere from before create() on
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if not (trace / "session.json").exists():
            continue  # killed before the trace was created: nothing to lose
        t = workbench.open_trace(trace)
        assert t.problems == [], t.problems
        assert t.status in ("stopped (writer gone)", "complete")  # the killed writer is seen as gone
        tokens = t.tokens()
        assert np.array_equal(tokens["position"].to_numpy(), np.arange(len(tokens)))  # a prefix, no holes
        sink = t.df("dsa_sink")
        # each table holds whole flushes (a kill during a flush may cut it between tables, not inside one)
        assert _sink_counts_are_a_prefix(sink)
        if len(sink):
            opened_with_rows += 1
    print(f"{opened_with_rows} of {KILLS} killed recordings had flushed signal rows", file=sys.stderr)
    assert opened_with_rows >= KILLS // 2
