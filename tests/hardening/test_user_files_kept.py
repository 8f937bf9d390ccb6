"""Nothing a user owns is overwritten or deleted: `--overwrite` replaces only what the command wrote.

Per output: a file or directory the command did not write is refused even with `--overwrite`; the
user's own files inside one of our directories survive its replacement; non-regular files (FIFOs,
symbolic links) are never replaced; stale `.NAME.tmp-PID` / `.NAME.old-PID` siblings are removed
only when they bear our marker; a checkpoint overwrite killed at any moment keeps one whole
checkpoint; and a trace has one writer at a time (a lock the OS releases when the writer dies).
docs/reliability.md states these rules.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from apps.cli import build_parser, main
from apps.cli import run_cmd
from engine import get_preset
from engine.io.atomic_dir import PARTIAL_MARKER
from engine.errors import InputError
from engine.session.snapshot import is_snapshot, read_snapshot, write_snapshot
from engine.weights.write import check_checkpoint_target, is_written_checkpoint, write_checkpoint
from workbench.compare import Comparison, check_comparison_target, is_comparison
from workbench.trace import TraceWriter, check_trace_target, open_trace
from workbench.trace.errors import TraceError
from workbench.trace.export import export_trace

STATE = {"tensors": {"x": torch.zeros(4)}}


def _add_user_files(directory: Path) -> None:
    (directory / "notes.txt").write_text("my notes")
    (directory / "analysis").mkdir()
    (directory / "analysis" / "result.csv").write_text("a,b\n1,2\n")


def _user_files_there(directory: Path) -> bool:
    return ((directory / "notes.txt").read_text() == "my notes"
            and (directory / "analysis" / "result.csv").read_text() == "a,b\n1,2\n")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


# --- item 4: logits --out ---------------------------------------------------------------------------

def _logits(ids: Path, out: Path, *extra: str) -> int:
    return main(["logits", "--model", "preset:tiny", "--input-ids", str(ids), "--out", str(out), *extra])


def test_logits_out_replaces_only_its_own_regular_file(tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"the user's own file")
    for extra in ((), ("--overwrite",)):
        assert _logits(ids, mine, *extra) == 2
        assert "not a logits file written by `workbench logits`" in capsys.readouterr().err
    assert mine.read_bytes() == b"the user's own file"

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert _logits(ids, fifo, "--overwrite") == 2
    assert "is a FIFO" in capsys.readouterr().err and fifo.is_fifo()
    link = tmp_path / "link.safetensors"
    link.symlink_to(mine)
    assert _logits(ids, link, "--overwrite") == 2
    assert "symbolic link" in capsys.readouterr().err and link.is_symlink()

    out = tmp_path / "logits.safetensors"
    assert _logits(ids, out) == 0
    assert _logits(ids, out) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert _logits(ids, out, "--overwrite") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.json", "link.safetensors", "logits.safetensors",
                                                          "mine.safetensors", "pipe"]


# --- item 5: the user's files inside our directories ------------------------------------------------

def test_checkpoint_random_overwrite_keeps_the_users_files(tmp_path, capsys):
    out = tmp_path / "ckpt"
    args = ["checkpoint", "random", "--preset", "tiny", "--out", str(out)]
    assert main(args) == 0
    _add_user_files(out)
    assert main([*args, "--seed", "1", "--overwrite"]) == 0
    assert _user_files_there(out) and json.loads((out / "workbench-checkpoint.json").read_text())["seed"] == 1
    assert _siblings(out) == []


def test_snapshot_overwrite_keeps_the_users_files(tmp_path):
    path = tmp_path / "snap"
    write_snapshot(path, {"gen": 0, **STATE})
    _add_user_files(path)
    write_snapshot(path, {"gen": 1, **STATE}, overwrite=True)
    assert read_snapshot(path)["gen"] == 1 and _user_files_there(path) and _siblings(path) == []


def test_overwrite_refuses_a_fifo_or_link_in_place_of_a_file_it_wrote(tmp_path):
    out = tmp_path / "ckpt"
    write_checkpoint(get_preset("tiny"), out)
    shard = next(out.glob("model-*.safetensors"))
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(InputError, match="is a FIFO, not a file this command wrote"):
        write_checkpoint(get_preset("tiny"), out, overwrite=True)
    shard.unlink()
    shard.symlink_to(tmp_path)
    with pytest.raises(InputError, match="is a symbolic link, not a file this command wrote"):
        write_checkpoint(get_preset("tiny"), out, overwrite=True)
    assert shard.is_symlink() and _siblings(out) == []


def test_trace_overwrite_keeps_the_users_files_and_drops_the_old_recording(tmp_path):
    path = tmp_path / "trace"
    with TraceWriter.create(path, {}, fsync=False) as w:
        w.append("dsa_sink", layer=3, step=0, rank=0, position=9, queries=10, sink_hits=10)
    _add_user_files(path)
    TraceWriter.create(path, {}, overwrite=True, fsync=False).close()
    assert _user_files_there(path) and not (path / "dsa_sink").exists()
    assert open_trace(path).status == "complete"


def test_export_overwrite_keeps_the_users_files(tmp_path):
    trace = tmp_path / "trace"
    TraceWriter.create(trace, {}, fsync=False).close()
    out = tmp_path / "export"
    export_trace(trace, out, "csv")
    _add_user_files(out)
    export_trace(trace, out, "csv", overwrite=True)
    assert _user_files_there(out) and _siblings(out) == []


def test_run_overwrite_covers_the_trace_and_overwrite_trace_is_its_alias(tmp_path, capsys):
    trace = tmp_path / "trace"
    TraceWriter.create(trace, {}, fsync=False).close()
    parse = build_parser().parse_args
    for flags, allowed in (((), False), (("--overwrite",), True), (("--overwrite-trace",), True)):
        args = parse(["run", "--model", "preset:tiny", "--prompt", "x", "--trace", str(trace), *flags])
        assert run_cmd.overwrite_trace(args) is allowed
        if allowed:
            run_cmd.check_outputs(args)
        else:
            with pytest.raises(TraceError, match="pass overwrite=True \\(--overwrite\\)"):
                run_cmd.check_outputs(args)


def _comparison() -> Comparison:
    return Comparison(pd.DataFrame({"layer": [0], "position": [0], "rel_diff": [0.0]}),
                      pd.DataFrame({"position": [0], "kl": [0.0]}),
                      pd.DataFrame({"layer": pd.Series([], dtype=np.int64)}), (1,), (1,))


def test_compare_out_replaces_only_a_comparison_and_keeps_the_users_files(tmp_path, monkeypatch):
    monkeypatch.setattr("workbench.compare.summarize_reads", lambda reads: pd.DataFrame())
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "summary.json").write_text('{"my": "summary"}')
    with pytest.raises(InputError, match="is not a comparison written by `workbench compare`; refusing"):
        _comparison().write(foreign, overwrite=True)
    assert (foreign / "summary.json").read_text() == '{"my": "summary"}'

    out = tmp_path / "a_vs_b"
    _comparison().write(out)
    assert is_comparison(out)
    _add_user_files(out)
    with pytest.raises(InputError, match="pass --overwrite"):
        _comparison().write(out)
    _comparison().write(out, overwrite=True)
    assert is_comparison(out) and _user_files_there(out) and _siblings(out) == []


def test_compare_refuses_a_bad_out_before_recording_anything(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "summary.json").write_text("{}")
    base = ["compare", "--model", "preset:tiny", "--prompt", "hello", "--dense-layers", "all",
            "--trace-a", str(a), "--trace-b", str(b), "--overwrite"]
    for out, words in ((a, "overlaps the trace"), (a / "inner", "overlaps the trace"), (tmp_path, "overlaps the trace"),
                       (foreign, "is not a comparison")):
        assert main([*base, "--out", str(out)]) == 2
        assert words in capsys.readouterr().err
        assert not a.exists() and not b.exists()
    with pytest.raises(InputError, match="overlaps the trace"):
        check_comparison_target(b, traces=(a, b))
    assert (foreign / "summary.json").read_text() == "{}"


# --- item 6: recovery removes only leftovers of ours -----------------------------------------------

def test_recovery_keeps_user_directories_that_look_like_leftovers(tmp_path):
    path = tmp_path / "snapK"
    write_snapshot(path, STATE)
    pid = _dead_pid()
    users = [tmp_path / f".snapK.old-{pid}", tmp_path / f".snapK.tmp-{pid}"]
    for d in users:
        d.mkdir()
        (d / "data.txt").write_text("mine")
    ours = [tmp_path / f".snapK.tmp-{_dead_pid()}", tmp_path / f".snapK.old-{_dead_pid()}"]
    for d in ours:  # a dead writer's half-built temporary, and an old copy it was deleting
        d.mkdir()
        (d / PARTIAL_MARKER).write_bytes(b"")
        (d / "state.safetensors").write_bytes(b"half")
    read_snapshot(path)  # what a plain --load does first
    assert all((d / "data.txt").read_text() == "mine" for d in users) and not any(d.exists() for d in ours)
    assert is_snapshot(path)


# --- item 7: a checkpoint overwrite killed at any moment ------------------------------------------

ZYGOTE = textwrap.dedent(r"""
    import os, signal, sys, time
    from engine import get_preset
    from engine.io import atomic_dir
    from engine.weights.random_init import RandomSource
    from engine.weights.write import write_checkpoint

    class SlowSource(RandomSource):  # spreads a tiny checkpoint's write over a second, so kills land inside it
        def get(self, spec):
            time.sleep(0.004)
            return super().get(spec)

    config = get_preset("tiny")
    for line in sys.stdin:
        out, kill_after = line.split()
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            if int(kill_after):  # die right after this many renames of the replacement
                real, calls = os.replace, []
                def replace_then_die(*a, **k):
                    real(*a, **k)
                    calls.append(1)
                    if len(calls) == int(kill_after):
                        os.kill(os.getpid(), signal.SIGKILL)
                atomic_dir.os.replace = replace_then_die
            try:
                seed = 1
                while True:
                    write_checkpoint(config, out, seed=seed, source=SlowSource(config, seed), overwrite=True)
                    seed += 1
            finally:
                os._exit(0)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)
""")


def test_sigkill_during_checkpoint_overwrite_never_blocks_the_next_one(tmp_path):
    rng = np.random.default_rng(13)
    out = tmp_path / "ckpt"
    config = get_preset("tiny")
    write_checkpoint(config, out, seed=0)
    _add_user_files(out)
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, bufsize=1, cwd=os.getcwd())
    try:
        # kills right after the old checkpoint is set aside (nothing at the path), right after the new
        # one is renamed in (the old one not yet deleted), then at random moments
        for kill_after, delay in [(1, 30.0), (2, 30.0)] + [(0, float(rng.uniform(0.05, 1.5))) for _ in range(6)]:
            proc.stdin.write(f"{out} {kill_after}\n")
            proc.stdin.flush()
            pid = int(proc.stdout.readline())
            deadline = time.monotonic() + delay
            while kill_after and time.monotonic() < deadline:  # the child kills itself
                if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                    break
                time.sleep(0.02)
            if not kill_after:
                time.sleep(delay)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            assert "exit" in proc.stdout.readline()
            if kill_after == 1:
                assert not out.exists() and any(".old-" in name for name in _siblings(out))
            elif kill_after == 2:
                assert is_written_checkpoint(out) and any(".old-" in name for name in _siblings(out))
            check_checkpoint_target(out, overwrite=True)  # recovers; must not refuse
            assert is_written_checkpoint(out) and _user_files_there(out) and _siblings(out) == []
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    write_checkpoint(config, out, seed=9, overwrite=True)
    assert _user_files_there(out) and json.loads((out / "workbench-checkpoint.json").read_text())["seed"] == 9


# --- item 8: one writer per trace ------------------------------------------------------------------

HOLDER = textwrap.dedent(r"""
    import sys, time
    from workbench.trace import TraceWriter
    w = TraceWriter.create(sys.argv[1], {}, fsync=False)
    w.append("dsa_sink", layer=3, step=0, rank=0, position=9, queries=10, sink_hits=10)
    w.flush()
    print("recording", flush=True)
    time.sleep(120)
""")


def test_one_writer_per_trace_and_a_crash_releases_the_lock(tmp_path):
    path = tmp_path / "trace"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    try:
        assert holder.stdout.readline().strip() == "recording"
        busy = f"is being recorded by another process \\(pid {holder.pid}\\); one writer per trace"
        for overwrite in (False, True):
            with pytest.raises(TraceError, match=busy):
                check_trace_target(path, overwrite=overwrite)
            with pytest.raises(TraceError, match=busy):
                TraceWriter.create(path, {}, overwrite=overwrite, fsync=False)
        assert open_trace(path).table("dsa_sink").num_rows == 1  # the live trace is untouched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with TraceWriter.create(path, {}, overwrite=True, fsync=False) as w:  # the dead writer's lock is gone
        with pytest.raises(TraceError, match="one writer per trace"):
            TraceWriter.create(path, {}, overwrite=True, fsync=False)  # nor two in one process
        w.append("dsa_sink", layer=3, step=0, rank=0, position=1, queries=2, sink_hits=2)
    trace = open_trace(path)
    assert trace.status == "complete" and trace.table("dsa_sink")["queries"].to_pylist() == [2]
