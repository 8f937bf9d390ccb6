"""Crash safety and live following, with real writer processes.

A "zygote" process imports the writer once (importing the engine costs seconds) and forks a fresh
writer process per run on request; the test kills those with SIGKILL at random moments, or follows
one from this process while it writes. Rows carry their flush number (`step`) and each flush's rows
are numbered 0..n-1 (`position`), so a reader can tell a complete prefix from a torn one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from workbench.trace import open_trace

ZYGOTE = textwrap.dedent(r"""
    import os, sys, time
    import numpy as np
    from workbench.trace.writer import TraceWriter

    def write(path, seed, flushes, pause, progress):
        rng = np.random.default_rng(seed)
        fd = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        w = TraceWriter.create(path, {"policy": {"dsa_bin_tokens": 64}})
        step = 0
        while flushes < 0 or step < flushes:
            n = int(rng.integers(1, 400))
            pos = np.arange(n)
            w.append("dsa_dense_mass", layer=3, step=step, rank=0, position=pos, mass=np.full(n, 0.5))
            w.append("tokens", position=np.arange(step * 10, step * 10 + 10), token_id=step, piece="x", segment=0,
                     modality="text")
            # a larger part, so that kills often land while a part is being written
            w.append("dsa_topk", layer=3, step=step, rank=0, position=pos[: 64],
                     selected=np.sort(rng.integers(0, 1 << 20, (min(n, 64), 1024)), axis=1))
            w.append("dsa_key_counts", layer=3, step=step, rank=0, key_bin=np.arange(8), count=np.ones(8, int))
            w.flush()
            os.write(fd, f"{step} {n}\n".encode())
            step += 1
            time.sleep(pause)
        w.close()

    for line in sys.stdin:
        path, seed, flushes, pause, progress = line.split()
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            try:
                write(path, int(seed), int(flushes), float(pause), progress)
            finally:
                os._exit(0)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)
""")


@pytest.fixture(scope="module")
def zygote():
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, bufsize=1, cwd=os.getcwd())

    def start(path, seed: int, flushes: int = -1, pause: float = 0.0) -> tuple[int, object]:
        progress = f"{path}.progress"
        proc.stdin.write(f"{path} {seed} {flushes} {pause} {progress}\n")
        proc.stdin.flush()
        return int(proc.stdout.readline()), progress

    def wait() -> str:
        return proc.stdout.readline().strip()

    yield start, wait
    proc.stdin.close()
    proc.wait(timeout=30)


def _reported(progress) -> list[tuple[int, int]]:
    try:
        with open(progress) as f:
            return [tuple(map(int, line.split())) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _check_prefix(trace, reported: list[tuple[int, int]] | None) -> int:
    """Rows present are whole flushes 0..m-1; with `reported` (flushes the writer finished), m is that
    count or one more (the flush in flight when it died)."""
    table = trace.table("dsa_dense_mass", columns=["step", "position"])
    steps = table["step"].to_numpy()
    positions = table["position"].to_numpy()
    present = np.unique(steps)
    assert present.tolist() == list(range(len(present))), "flushes present must be a prefix"
    for step in present:
        mine = positions[steps == step]
        assert mine.tolist() == list(range(len(mine))), f"flush {step} is torn"
    if reported is not None:
        for step, n in reported:
            assert (steps == step).sum() == n, f"flush {step} is torn"
        assert len(reported) <= len(present) <= len(reported) + 1
    return len(present)


def test_sigkill_at_random_moments_leaves_a_readable_prefix(tmp_path, zygote):
    start, wait = zygote
    rng = np.random.default_rng(7)
    runs, flushed_runs, mid_flush = 24, 0, 0
    for run in range(runs):
        path = tmp_path / f"run{run}"
        pid, progress = start(path, seed=run)
        if run % 2:
            # half the kills land after the first flush is visible, wherever the machine's load puts it
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(path.glob("*/part-*.parquet")):
                time.sleep(0.005)
            time.sleep(float(rng.uniform(0.0, 0.2)))
        else:
            time.sleep(float(rng.uniform(0.05, 0.5)))  # blind: anywhere from before create() on
        os.kill(pid, signal.SIGKILL)
        assert "exit" in wait()
        reported = _reported(progress)
        if not (path / "session.json").exists():
            # killed before create() published session.json: nothing was flushed, so nothing is lost
            assert reported == []
            continue
        trace = open_trace(path)
        # the writer was SIGKILLed: the reader sees its pid is gone (same host) instead of "recording" forever
        assert trace.problems == [] and trace.status == "stopped (writer gone)"
        present = _check_prefix(trace, reported)
        mid_flush += present == len(reported) + 1
        flushed_runs += present > 0
        # every other table is a prefix too, and the reader never reads a temporary
        assert len(np.unique(trace.table("dsa_topk", columns=["step"])["step"].to_numpy())) <= present + 1
        assert trace.check() == []
    assert flushed_runs >= runs // 2  # every waited-for kill, whatever the load
    print(f"\n{runs} SIGKILLs: {flushed_runs} traces with data, {mid_flush} killed inside a flush")


def test_a_follower_sees_parts_appear_and_never_a_torn_one(tmp_path, zygote):
    start, wait = zygote
    path = tmp_path / "live"
    flushes = 40
    pid, progress = start(path, seed=99, flushes=flushes, pause=0.01)
    deadline = time.monotonic() + 60
    while not (path / "session.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    trace = open_trace(path)
    seen_counts, changes = [], 0
    while True:
        changed = trace.refresh()
        changes += bool(changed & {"dsa_dense_mass", "dsa_topk"})
        assert trace.problems == []
        present = _check_prefix(trace, None)
        if seen_counts:
            assert present >= seen_counts[-1]
        seen_counts.append(present)
        tokens = trace.tokens()["position"].to_numpy()
        assert tokens.tolist() == list(range(len(tokens)))
        if trace.status == "complete":
            break
        assert time.monotonic() < deadline
        time.sleep(0.003)
    assert "exit 0" in wait()
    assert _check_prefix(trace, _reported(progress)) == flushes
    assert len(trace.tokens()) == flushes * 10 and trace.parts("tokens")[0].name == "tokens.parquet"
    assert trace.dsa_heatmap(bins=1).sum() == 8 * flushes
    # the follower saw the trace grow in several steps, not only the finished result
    assert changes >= 5 and len(set(seen_counts)) >= 5
