"""The bad-input matrix at the command line: each case is ONE line `error: ...`, exit 2, no traceback.

Every row names a case, the `workbench` arguments that hit it (paths from a per-test sandbox holding
a tiny checkpoint, a snapshot, a trace and an export) and words the one line must contain. Cases on
outputs use a model that does not exist: the output error coming first proves outputs are checked
before the model is loaded, i.e. before any prefill. What was there before is checked unchanged.
docs/reliability.md's error table lists these rows beside the library-level cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from apps.cli import main
from engine import get_preset, load_model
from engine.session import Session
from engine.tokenizer import Tokenizer
from engine.weights.write import write_checkpoint
from workbench.trace.export import export_trace
from k3testing.synthetic import Dims, Policy, write_synthetic_trace

MISSING_MODEL = "/nonexistent/model"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("matrix")
    write_checkpoint(get_preset("tiny"), root / "ckpt", seed=0)
    model = load_model(str(root / "ckpt"))
    session = Session(model, Tokenizer.for_model(str(root / "ckpt"), model.config.vocab_size), progress=False)
    session.append("hello there", name="doc")
    list(session.generate(2, temperature=0))
    session.save(root / "snap")
    write_synthetic_trace(root / "trace", 2048, Dims.demo(), Policy(prefill_chunk=1024, decode_tokens=16))
    export_trace(root / "trace", root / "export", "csv")
    (root / "notes").mkdir()
    (root / "notes" / "mine.txt").write_text("keep me")
    (root / "afile").write_text("x")
    (root / "ids.json").write_text("[[1, 2, 3]]")
    return root


@pytest.fixture()
def sb(base, tmp_path) -> Path:
    """A fresh copy of the sandbox for each case (cases damage it)."""
    shutil.copytree(base, tmp_path / "sb", symlinks=True)
    return tmp_path / "sb"


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _snapshot_meta(sb: Path, change) -> None:
    meta_file = sb / "snap" / "snapshot.json"
    meta = json.loads(meta_file.read_text())
    change(meta)
    meta_file.write_text(json.dumps(meta))


def _snapshot_tensor(sb: Path, name: str, value) -> None:
    tensors = load_file(str(sb / "snap" / "state.safetensors"))
    tensors[name] = value
    save_file(tensors, str(sb / "snap" / "state.safetensors"))


def _token_tensor(sb: Path):
    return load_file(str(sb / "snap" / "state.safetensors"))["tokens"]


def _config(sb: Path, **changes) -> None:
    cfg = json.loads((sb / "ckpt" / "config.json").read_text())
    (cfg["text_config"] if "text_config" in cfg else cfg).update(changes)
    (sb / "ckpt" / "config.json").write_text(json.dumps(cfg))


def _index(sb: Path, change) -> None:
    f = sb / "ckpt" / "model.safetensors.index.json"
    index = json.loads(f.read_text())
    change(index)
    f.write_text(json.dumps(index))


def _shard_dir(sb: Path) -> None:
    shard = sorted((sb / "ckpt").glob("model-*.safetensors"))[0]
    shard.unlink()
    shard.mkdir()


RUN = ["run", "--model"]
LOAD_SNAP = ["run", "--model", "{sb}/ckpt", "--load", "{sb}/snap", "--max-new-tokens", "1"]

# (case id, setup(sb) or None, argv (with {sb}), words in the one line, directory that must stay unchanged)
CASES = [
    # outputs, checked before the model is loaded
    ("run --save onto a file", None, RUN + [MISSING_MODEL, "--prompt", "x", "--save", "{sb}/afile"],
     "not a directory", "afile"),
    ("run --save onto an existing snapshot without --overwrite", None,
     RUN + [MISSING_MODEL, "--prompt", "x", "--save", "{sb}/snap"], "pass --overwrite", "snap"),
    ("run --save --overwrite onto a foreign directory", None,
     RUN + [MISSING_MODEL, "--prompt", "x", "--save", "{sb}/notes", "--overwrite"], "not a snapshot", "notes"),
    ("run --save --overwrite onto a checkpoint", None,
     RUN + [MISSING_MODEL, "--prompt", "x", "--save", "{sb}/ckpt", "--overwrite"], "not a snapshot", "ckpt"),
    ("run --trace onto a file", None, RUN + [MISSING_MODEL, "--prompt", "x", "--trace", "{sb}/afile"],
     "not a directory", "afile"),
    ("run --trace onto an existing trace", None, RUN + [MISSING_MODEL, "--prompt", "x", "--trace", "{sb}/trace"],
     "not empty", "trace"),
    ("run --trace --overwrite onto a foreign directory", None,
     RUN + [MISSING_MODEL, "--prompt", "x", "--trace", "{sb}/notes", "--overwrite"], "holds no trace", "notes"),
    ("checkpoint random --overwrite onto a foreign directory", None,
     ["checkpoint", "random", "--preset", "tiny", "--out", "{sb}/notes", "--overwrite"], "refusing", "notes"),
    ("checkpoint random --overwrite onto a snapshot", None,
     ["checkpoint", "random", "--preset", "tiny", "--out", "{sb}/snap", "--overwrite"], "refusing", "snap"),
    ("checkpoint random onto a file", None, ["checkpoint", "random", "--preset", "tiny", "--out", "{sb}/afile"],
     "not a directory", "afile"),
    ("export --overwrite onto a trace", None,
     ["export", "{sb}/trace", "--format", "csv", "--out", "{sb}/trace", "--overwrite"], "inside the trace", "trace"),
    ("export --overwrite onto another trace", lambda sb: shutil.copytree(sb / "trace", sb / "trace2"),
     ["export", "{sb}/trace", "--format", "csv", "--out", "{sb}/trace2", "--overwrite"], "is a trace, not an export",
     "trace2"),
    ("export --overwrite onto a foreign directory", None,
     ["export", "{sb}/trace", "--format", "csv", "--out", "{sb}/notes", "--overwrite"], "holds no export", "notes"),
    ("export onto an export without --overwrite", None,
     ["export", "{sb}/trace", "--format", "csv", "--out", "{sb}/export"], "pass --overwrite", "export"),
    ("export of a missing trace", None, ["export", "{sb}/nope", "--format", "csv", "--out", "{sb}/o"],
     "export aborted", None),
    ("export with a corrupt part", lambda sb: next((sb / "trace" / "dsa_sink").glob("part-*.parquet")).write_bytes(
        b"PAR1garbage"), ["export", "{sb}/trace", "--format", "csv", "--out", "{sb}/export", "--overwrite"],
     "export aborted, the previous export there is kept", "export"),
    ("export --tables bogus", None, ["export", "{sb}/trace", "--format", "csv", "--out", "{sb}/o", "--tables", "bogus"],
     "unknown table", None),
    # snapshots given to --load
    ("snapshot consumed 'abc'", lambda sb: _snapshot_meta(sb, lambda m: m.update(consumed="abc")), LOAD_SNAP,
     "invalid consumed-token count", "snap"),
    ("snapshot extra segment key", lambda sb: _snapshot_meta(sb, lambda m: m["segments"][0].update(bogus=1)),
     LOAD_SNAP, "unknown key(s) bogus", "snap"),
    ("snapshot segment without end", lambda sb: _snapshot_meta(sb, lambda m: m["segments"][0].pop("end")),
     LOAD_SNAP, "missing end", "snap"),
    ("snapshot segments not a list", lambda sb: _snapshot_meta(sb, lambda m: m.update(segments={"a": 1})),
     LOAD_SNAP, "segments must be a list", "snap"),
    ("snapshot segment past the tokens", lambda sb: _snapshot_meta(sb, lambda m: m["segments"][0].update(end=10**9)),
     LOAD_SNAP, "outside the", "snap"),
    ("snapshot step -1", lambda sb: _snapshot_meta(sb, lambda m: m.update(step=-1)), LOAD_SNAP, "invalid step", "snap"),
    ("snapshot bad sampling", lambda sb: _snapshot_meta(sb, lambda m: m.update(sampling=[1])), LOAD_SNAP,
     "sampling parameters must be an object", "snap"),
    ("snapshot bad generator state", lambda sb: _snapshot_tensor(sb, "generator", torch.zeros(7, dtype=torch.uint8)),
     LOAD_SNAP, "invalid sampler generator state", "snap"),
    ("snapshot.json not JSON", lambda sb: (sb / "snap" / "snapshot.json").write_text("{ nope"), LOAD_SNAP,
     "corrupt snapshot metadata", "snap"),
    ("snapshot of another format", lambda sb: _snapshot_meta(sb, lambda m: m.update(format="other")), LOAD_SNAP,
     "not a K3 Workbench snapshot", "snap"),
    ("snapshot of a newer version", lambda sb: _snapshot_meta(sb, lambda m: m.update(version=99)), LOAD_SNAP,
     "version 99 is not supported", "snap"),
    ("snapshot state file garbage", lambda sb: (sb / "snap" / "state.safetensors").write_bytes(b"\x00" * 40),
     LOAD_SNAP, "corrupt snapshot state", "snap"),
    ("snapshot without state file", lambda sb: (sb / "snap" / "state.safetensors").unlink(), LOAD_SNAP,
     "not a snapshot", "snap"),
    ("snapshot token count changed", lambda sb: _snapshot_tensor(sb, "tokens", torch.zeros(3, dtype=torch.int64)),
     LOAD_SNAP, "holds 3 token ids", "snap"),
    ("snapshot token ids changed", lambda sb: _snapshot_tensor(sb, "tokens", _token_tensor(sb) + 1),
     LOAD_SNAP, "prefix hash", "snap"),
    ("--load a directory that is no snapshot", None, ["run", "--model", "{sb}/ckpt", "--load", "{sb}/notes"],
     "not a snapshot", "notes"),
    # checkpoints and configs through `run --model`
    ("config rms_norm_eps 'abc'", lambda sb: _config(sb, rms_norm_eps="abc"), RUN + ["{sb}/ckpt", "--prompt", "x"],
     "rms_norm_eps", None),
    ("config num_hidden_layers -6", lambda sb: _config(sb, num_hidden_layers=-6), RUN + ["{sb}/ckpt", "--prompt", "x"],
     "expected an integer in", None),
    ("config.json a directory", lambda sb: ((sb / "ckpt" / "config.json").unlink(), (sb / "ckpt" / "config.json").mkdir()),
     RUN + ["{sb}/ckpt", "--prompt", "x"], "config.json", None),
    ("index weight_map a list", lambda sb: _index(sb, lambda i: i.update(weight_map=[1])),
     RUN + ["{sb}/ckpt", "--prompt", "x"], "weight_map", None),
    ("index entry outside the checkpoint", lambda sb: _index(
        sb, lambda i: i["weight_map"].update({k: "../../outside.safetensors" for k in list(i["weight_map"])[:1]})),
     RUN + ["{sb}/ckpt", "--prompt", "x"], "outside", None),
    ("shard a directory", _shard_dir, RUN + ["{sb}/ckpt", "--prompt", "x"], "directory", None),
    ("inspect of a shard that is a directory", _shard_dir, ["inspect", "{sb}/ckpt"], "directory", None),
    # prompts, sampling flags, policy and record flags
    ("--prompt-file a directory", None, RUN + ["{sb}/ckpt", "--prompt-file", "{sb}/notes"], "directory", None),
    ("--prompt-file not UTF-8", lambda sb: (sb / "p.txt").write_bytes(b"\xff\xfe\x00"),
     RUN + ["{sb}/ckpt", "--prompt-file", "{sb}/p.txt"], "UTF-8", None),
    ("empty prompt", None, RUN + ["{sb}/ckpt", "--prompt", ""], "prompt is empty", None),
    ("--temperature inf", None, RUN + ["{sb}/ckpt", "--prompt", "x", "--temperature", "inf"], "temperature", None),
    ("--temperature nan", None, RUN + ["{sb}/ckpt", "--prompt", "x", "--temperature", "nan"], "temperature", None),
    ("--top-k -1", None, RUN + ["{sb}/ckpt", "--prompt", "x", "--top-k", "-1"], "top_k", None),
    ("--record bogus", None, RUN + ["{sb}/ckpt", "--prompt", "x", "--trace", "{sb}/t", "--record", "bogus"],
     "--record", None),
    ("--policy file with wrong types", lambda sb: (sb / "pol.json").write_text('{"decode_tokens": "many"}'),
     RUN + ["{sb}/ckpt", "--prompt", "x", "--trace", "{sb}/t", "--policy", "{sb}/pol.json"], "decode_tokens", None),
    # logits input
    ("logits id 2^70", lambda sb: (sb / "ids.json").write_text(f"[[{2**70}]]"),
     ["logits", "--model", "{sb}/ckpt", "--input-ids", "{sb}/ids.json", "--out", "{sb}/l.safetensors"], "ids.json", None),
    ("logits ids file a directory", None,
     ["logits", "--model", "{sb}/ckpt", "--input-ids", "{sb}/notes", "--out", "{sb}/l.safetensors"], "directory", None),
    ("logits --out a directory", None,
     ["logits", "--model", MISSING_MODEL, "--input-ids", "{sb}/ids.json", "--out", "{sb}/notes"], "directory", "notes"),
    # dashboard flags
    ("dashboard --port 0", None, ["dashboard", "--port", "0", "--root", "{sb}/roots"], "--port", None),
    ("dashboard --root a file", None, ["dashboard", "--root", "{sb}/afile"], "not a directory", "afile"),
]


def _argv(argv: list[str], sb: Path) -> list[str]:
    return [a.replace("{sb}", str(sb)) for a in argv]


@pytest.mark.parametrize("case,setup,argv,words,kept", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line(case, setup, argv, words, kept, sb, capsys):
    if setup is not None:
        setup(sb)
    before = _tree_hash(sb / kept) if kept and (sb / kept).is_dir() else None
    code = main(_argv(argv, sb))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (case, err)
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (case, err)
    assert str(sb) not in words
    if before is not None:
        assert _tree_hash(sb / kept) == before, f"{case}: {kept} changed"


def test_a_port_in_use_is_one_line(sb, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = main(["dashboard", "--port", str(port), "--root", str(sb / "roots"), "--no-drive"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "already in use" in err[0], err


def test_the_installed_command_prints_one_line_and_exits_2(sb):
    """The same contract through the console script in a fresh process (one case: process start-up is slow)."""
    (sb / "snap" / "snapshot.json").write_text(json.dumps({**json.loads((sb / "snap" / "snapshot.json").read_text()),
                                                          "consumed": "abc"}))
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "workbench"]
    proc = subprocess.run(cmd + ["run", "--model", str(sb / "ckpt"), "--load", str(sb / "snap"),
                                 "--max-new-tokens", "1"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
