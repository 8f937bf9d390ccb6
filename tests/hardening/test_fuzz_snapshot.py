"""Fuzz the snapshot reader: any snapshot directory content loads or raises InputError (one line), quickly.

Targets: `snapshot.json` with one field replaced by arbitrary JSON (or arbitrary bytes), and
`state.safetensors` with its tensors replaced, dropped, retyped or its bytes cut / flipped; each is
read with `read_snapshot` and restored into a session of the model it was saved from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from engine import load_model
from engine.errors import InputError
from engine.session import Session
from engine.session.snapshot import read_snapshot
from engine.tokenizer import Tokenizer
from tests.hardening.conftest import bounded

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
                    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
DTYPES = [torch.int64, torch.float32, torch.uint8, torch.bfloat16, torch.int32]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = load_model("preset:tiny", seed=2)
    session = Session(model, Tokenizer.byte_level(), progress=False)
    session.append("a small context to save", name="doc")
    list(session.generate(3, temperature=1.0, seed=3))
    path = tmp_path_factory.mktemp("snap") / "good"
    session.save(path)
    return model, path


def _load(model, path: Path) -> None:
    with bounded():
        try:
            state = read_snapshot(path)
            Session(model, Tokenizer.byte_level(), progress=False).load_state_dict(state)
        except InputError as exc:
            assert "\n" not in str(exc)


def _copy(path: Path, tmp: Path) -> Path:
    target = tmp / "s"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(path, target)
    return target


@given(data=st.data())
def test_snapshot_json_fields(saved, tmp_path, data):
    model, good = saved
    snap = _copy(good, tmp_path)
    meta = json.loads((snap / "snapshot.json").read_text())
    key = data.draw(st.sampled_from(sorted(meta)))
    if isinstance(meta[key], list) and meta[key] and isinstance(meta[key][0], dict) and data.draw(st.booleans()):
        inner = data.draw(st.sampled_from(sorted(meta[key][0]) + ["extra"]))
        meta[key][0][inner] = data.draw(JSON)
    else:
        meta[key] = data.draw(JSON)
    (snap / "snapshot.json").write_text(json.dumps(meta))
    _load(model, snap)


@given(raw=st.binary(max_size=256))
def test_snapshot_json_bytes(saved, tmp_path, raw):
    model, good = saved
    snap = _copy(good, tmp_path)
    (snap / "snapshot.json").write_bytes(raw)
    _load(model, snap)


@given(data=st.data())
def test_state_tensors(saved, tmp_path, data):
    model, good = saved
    snap = _copy(good, tmp_path)
    tensors = load_file(str(snap / "state.safetensors"))
    name = data.draw(st.sampled_from(sorted(tensors)))
    action = data.draw(st.sampled_from(["drop", "retype", "reshape", "fill"]))
    t = tensors[name]
    if action == "drop":
        del tensors[name]
    elif action == "retype":
        tensors[name] = torch.zeros(t.shape, dtype=data.draw(st.sampled_from(DTYPES)))
    elif action == "reshape":
        tensors[name] = torch.zeros(data.draw(st.lists(st.integers(0, 9), max_size=3)), dtype=t.dtype)
    else:
        value = data.draw(st.sampled_from([float("nan"), float("inf"), -1, 2 ** 40]))
        tensors[name] = torch.full(t.shape, value).to(t.dtype) if t.is_floating_point() or value in (-1, 2 ** 40) \
            else t
    save_file(tensors, str(snap / "state.safetensors"))
    _load(model, snap)


@given(cut=st.integers(0, 4096), flips=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(1, 255)), max_size=4))
def test_state_bytes(saved, tmp_path, cut, flips):
    model, good = saved
    snap = _copy(good, tmp_path)
    raw = bytearray((snap / "state.safetensors").read_bytes())
    for pos, x in flips:
        raw[pos % len(raw)] ^= x
    (snap / "state.safetensors").write_bytes(bytes(raw[: len(raw) - cut]))
    _load(model, snap)
