"""Fuzz the safetensors header reader, the index reader and the MXFP4 decoder."""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.errors import CheckpointError
from engine.ops.mxfp4.reference import BLOCK, E8M0_NAN, dequantize
from engine.weights.safetensors_io import INDEX_FILE, CheckpointFiles, read_header
from tests.hardening.conftest import bounded

DTYPES = st.sampled_from(["F32", "BF16", "U8", "I64", "F8_E8M0", "X9", ""])
ENTRY = st.fixed_dictionaries({
    "dtype": DTYPES | st.integers(),
    "shape": st.lists(st.integers(-3, 2 ** 40) | st.text(max_size=2), max_size=3),
    "data_offsets": st.lists(st.integers(-5, 2 ** 40) | st.floats(), min_size=0, max_size=3),
}) | st.integers() | st.text(max_size=4)


def _header(tmp_path, raw: bytes):
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    with bounded():
        try:
            out = read_header(path)
        except CheckpointError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc)
            return None
    return out


@given(blob=st.binary(max_size=300))
def test_arbitrary_shard_bytes(tmp_path_factory, blob):
    _header(tmp_path_factory.mktemp("st"), blob)


@given(entries=st.dictionaries(st.text(max_size=5), ENTRY, max_size=4), data=st.binary(max_size=64),
       claim=st.none() | st.integers(0, 2 ** 64 - 1))
def test_structured_headers(tmp_path_factory, entries, data, claim):
    blob = json.dumps(entries).encode()
    length = len(blob) if claim is None else claim
    out = _header(tmp_path_factory.mktemp("st"), struct.pack("<Q", length) + blob + data)
    if out is not None:
        for info in out.values():
            assert info.nbytes <= len(data)


WEIGHT_MAP = st.dictionaries(st.text(max_size=4), st.sampled_from(["model.safetensors", "../x.safetensors",
                                                                    "/abs.safetensors", "", "sub/m.safetensors"])
                             | st.integers() | st.none() | st.lists(st.text(max_size=2), max_size=2), max_size=4)


@given(index=st.fixed_dictionaries({"weight_map": WEIGHT_MAP | st.lists(st.text(max_size=3), max_size=3)
                                    | st.text(max_size=3)}) | st.dictionaries(st.text(max_size=3), st.integers()))
def test_index_files(tmp_path_factory, index):
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("ck")
    save_file({"a": torch.zeros(2)}, root / "model.safetensors")
    (root / INDEX_FILE).write_text(json.dumps(index))
    with bounded():
        try:
            files = CheckpointFiles.open(root)
        except CheckpointError as exc:
            assert "\n" not in str(exc)
            return
    for info in files.tensors.values():
        assert info.file.resolve().is_relative_to(root.resolve())


def _e2m1(code: int) -> float:
    """Independent E2M1 decode from the bits: sign, 2-bit exponent, 1-bit mantissa."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1)
    return 0.0 if mag == 0 else sign * mag


@given(out=st.integers(1, 4), blocks=st.integers(1, 3), data=st.data())
def test_mxfp4_decoder_matches_the_bit_level_definition(out, blocks, data):
    n_in = blocks * BLOCK
    packed = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=out * n_in // 2,
                                             max_size=out * n_in // 2)), dtype=torch.uint8).view(out, n_in // 2)
    scale = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=out * blocks, max_size=out * blocks)),
                         dtype=torch.uint8).view(out, blocks)
    with bounded():
        dense = dequantize(packed, scale, torch.float32)
    assert dense.shape == (out, n_in)
    for r in range(out):
        for c in range(n_in):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            e = int(scale[r, c // BLOCK])
            got = float(dense[r, c])
            if e == E8M0_NAN:
                assert got != got  # NaN: the loader refuses such scales before decoding
            else:
                # exact in float32 except where it overflows (e >= 253 with |code value| >= 4): inf, as IEEE says
                want = float(torch.tensor(_e2m1(code) * 2.0 ** (e - 127), dtype=torch.float64).float())
                assert got == want, (code, e, got)
