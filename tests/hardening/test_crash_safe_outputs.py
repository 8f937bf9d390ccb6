"""Snapshots and exports survive SIGKILL at any moment of an overwrite, and disk full says what was kept.

A zygote process imports the writers once and forks one writer per run that overwrites the same
target in a loop; the test kills it at a random moment and then reads the target: the previous (or
the new) snapshot / export must always be there, whole, and the next read removes the leftovers.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from engine.errors import InputError
from engine.session.snapshot import read_snapshot, write_snapshot
from workbench.trace.errors import TraceError
from engine.io.atomic_dir import recover
from workbench.trace.export import MANIFEST, export_trace, is_export
from k3testing.synthetic import Dims, Policy, write_synthetic_trace

ZYGOTE = textwrap.dedent(r"""
    import os, sys
    import torch
    from engine.session.snapshot import write_snapshot
    from workbench.trace.export import export_trace

    def snapshots(path):
        gen = 1
        while True:  # 16 MiB of state per save, so kills land inside the writes too
            write_snapshot(path, {"gen": gen, "tensors": {"x": torch.full((1 << 22,), float(gen))}}, overwrite=True)
            gen += 1

    def exports(trace, out):
        while True:
            export_trace(trace, out, "parquet", overwrite=True)

    for line in sys.stdin:
        kind, *args = line.split()
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            try:
                snapshots(*args) if kind == "snapshot" else exports(*args)
            finally:
                os._exit(0)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)
""")

RUNS = 20


@pytest.fixture(scope="module")
def zygote():
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, bufsize=1, cwd=os.getcwd())

    def run_and_kill(line: str, delay: float) -> None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        pid = int(proc.stdout.readline())
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        assert "exit" in proc.stdout.readline()

    yield run_and_kill
    proc.stdin.close()
    proc.wait(timeout=30)


def _leftovers(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_sigkill_during_snapshot_overwrite_keeps_a_loadable_snapshot(tmp_path, zygote):
    rng = np.random.default_rng(11)
    path = tmp_path / "snap"
    write_snapshot(path, {"gen": 0, "tensors": {"x": torch.zeros(1 << 22)}})
    gens = []
    for _ in range(RUNS):
        zygote(f"snapshot {path}", float(rng.uniform(0.05, 1.5)))
        state = read_snapshot(path)  # recovers a snapshot set aside, removes the dead writer's temporaries
        gen = state["gen"]
        assert torch.equal(state["tensors"]["x"], torch.full((1 << 22,), float(gen)))
        assert _leftovers(path) == []
        gens.append(gen)
    print(f"\n{RUNS} SIGKILLs during snapshot saves: generations seen {gens}")


def test_sigkill_during_export_overwrite_keeps_a_whole_export(tmp_path, zygote):
    rng = np.random.default_rng(12)
    trace = write_synthetic_trace(tmp_path / "trace", 4096, Dims.demo(), Policy(prefill_chunk=1024, decode_tokens=64),
                                  seed=3)
    out = tmp_path / "export"
    export_trace(trace, out, "parquet")
    stamps = set()
    for _ in range(RUNS):
        zygote(f"export {trace} {out}", float(rng.uniform(0.05, 2.0)))
        # the next export recovers an export set aside (killed between the two renames) before anything else
        assert is_export(out) or any(".old-" in name for name in _leftovers(out))
        recover(out, is_export)
        manifest = json.loads((out / MANIFEST).read_text())
        for name, entry in manifest["tables"].items():
            assert pq.read_table(out / entry["file"]).num_rows == entry["rows"], name
        assert _leftovers(out) == []
        stamps.add(manifest["exported"])
    print(f"\n{RUNS} SIGKILLs during exports: {len(stamps)} distinct exports survived")


def test_overwrite_refuses_what_the_command_did_not_write(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("mine")
    state = {"tensors": {"x": torch.zeros(2)}}
    with pytest.raises(InputError, match="is not a snapshot; refusing"):
        write_snapshot(notes, state, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        write_snapshot(tmp_path / "file", state, overwrite=True)
    trace = write_synthetic_trace(tmp_path / "trace", 2048, Dims.demo(), Policy(prefill_chunk=1024, decode_tokens=16))
    before = sorted(p.name for p in trace.iterdir())
    other = write_synthetic_trace(tmp_path / "src", 2048, Dims.demo(), Policy(prefill_chunk=1024, decode_tokens=16))
    with pytest.raises(TraceError, match="is a trace, not an export"):
        export_trace(other, trace, "csv", overwrite=True)
    assert sorted(p.name for p in trace.iterdir()) == before and (notes / "a.txt").read_text() == "mine"


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_a_snapshot_save_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "snap"
    write_snapshot(path, {"gen": 0, "tensors": {"x": torch.zeros(4)}})
    monkeypatch.setattr("engine.session.snapshot.save_file", _enospc)
    with pytest.raises(InputError, match="No space left on device; the previous snapshot there is kept"):
        write_snapshot(path, {"gen": 1, "tensors": {"x": torch.ones(4)}}, overwrite=True)
    assert read_snapshot(path)["gen"] == 0 and _leftovers(path) == []


def test_disk_full_during_an_export_keeps_the_previous_one(tmp_path, monkeypatch):
    trace = write_synthetic_trace(tmp_path / "trace", 2048, Dims.demo(), Policy(prefill_chunk=1024, decode_tokens=16))
    out = tmp_path / "out"
    export_trace(trace, out, "csv")
    before = (out / MANIFEST).read_text()
    monkeypatch.setattr("workbench.trace.export.shutil.copyfile", _enospc)
    with pytest.raises(TraceError, match="No space left on device; the previous export there is kept"):
        export_trace(trace, out, "csv", overwrite=True)
    assert (out / MANIFEST).read_text() == before and _leftovers(out) == []


def test_disk_full_during_a_recording_is_one_line_and_keeps_the_flushed_parts(tmp_path, monkeypatch):
    import workbench
    from engine import load_model
    from engine.session import Session
    from engine.tokenizer import Tokenizer
    from workbench.trace import files

    session = Session(load_model("preset:tiny", seed=1), Tokenizer.byte_level(), prefill_chunk=16, progress=False)
    real = files.write_parquet_atomic
    calls = {"n": 0}

    def fills_up(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 12:  # the first flushes fit, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(files, "write_parquet_atomic", fills_up)
    monkeypatch.setattr("workbench.trace.writer.write_parquet_atomic", fills_up, raising=False)
    with pytest.raises(TraceError, match="No space left on device; kept: the .* part"):
        with workbench.record(session, trace=tmp_path / "t", policy={"flush_seconds": 0.001, "flush_share": 1.0}):
            session.append("some words to record " * 20, name="doc")
            list(session.generate(20, temperature=0))
    trace = workbench.open_trace(tmp_path / "t")
    assert trace.problems == [] and len(trace.tokens()) >= 0
