"""Issue 31 items 2 and 3: files small on disk that claim huge sizes are refused before anything is
allocated (limits on rows, decoded bytes and counts, not on file bytes), with an error naming the
file and the limit; a bad summary counts as absent."""

from __future__ import annotations

import base64
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workbench.trace import summary_cache
from workbench.trace.arrow_limits import BoundsError, read_bounded
from tests.hardening.conftest import bounded
from tests.hardening.parquet_forge import small_trace, varint
from workbench.trace import TraceCorruptError, TraceError, open_trace
from workbench.trace import part_checks
from workbench.trace.export import export_trace
from workbench.trace.schema import TABLES, parquet_options


def _many_rows_part(path, rows_per_group: int = 1 << 22, groups: int = 9):
    """A dsa_key_counts part of 37.7M valid rows (equal values: under 1 MB on disk)."""
    spec = TABLES["dsa_key_counts"]
    n = rows_per_group
    table = pa.table({"layer": np.full(n, 3, np.int16), "step": np.zeros(n, np.int32), "rank": np.zeros(n, np.int16),
                      "key_bin": np.zeros(n, np.int32), "count": np.ones(n, np.int64)}, schema=spec.arrow_schema)
    out = path / "dsa_key_counts" / "part-000002.parquet"
    with pq.ParquetWriter(out, spec.arrow_schema, **parquet_options(spec)) as writer:
        for _ in range(groups):
            writer.write_table(table, row_group_size=n)
    return out


def test_a_part_of_many_valid_rows_is_refused_from_its_footer(tmp_path):
    path = small_trace(tmp_path, parts=2)
    bad = _many_rows_part(path)
    assert bad.stat().st_size < 2 << 20 and pq.read_metadata(bad).num_rows > part_checks.MAX_PART_ROWS
    with bounded(seconds=5, rss_mib=100):
        t = open_trace(path)
        assert t.dsa_heatmap(bins=4).sum() == 8
    assert any(str(bad) in p and "rows, more than the" in p and "skipped" in p for p in t.problems)
    with pytest.raises(TraceCorruptError, match="rows, more than the"):
        export_trace(path, tmp_path / "out", fmt="csv")
    assert not (tmp_path / "out").exists()


def test_list_items_count_as_decoded_bytes(tmp_path, monkeypatch):
    path = small_trace(tmp_path, parts=2)
    spec = TABLES["dsa_topk"]
    rows = 4
    keys = np.zeros(rows * 100_000, np.int32)
    selected = pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * 100_000), pa.array(keys))
    scores = pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * 100_000),
                                      pa.array(keys.astype(np.float32)))
    table = pa.table({"layer": np.full(rows, 3, np.int16), "step": np.zeros(rows, np.int32),
                      "rank": np.zeros(rows, np.int16), "position": np.arange(rows, dtype=np.int32),
                      "selected": selected, "scores": scores}, schema=spec.arrow_schema)
    bad = path / "dsa_topk" / "part-000000.parquet"
    bad.parent.mkdir(exist_ok=True)
    pq.write_table(table, bad, **parquet_options(spec))
    monkeypatch.setattr(part_checks, "MAX_PART_BYTES", 1 << 20)  # the rows decode to 3.2 MB
    t = open_trace(path)
    assert t.table("dsa_topk").num_rows == 0
    assert any(str(bad) in p and "decoded bytes, more than the 1,048,576" in p for p in t.problems)


def _claim_schema(file, written: pa.Schema, claimed: pa.Schema) -> None:
    """Replace the Arrow schema a Parquet footer stores (a Thrift string, base64) without touching a page."""
    old, new = (base64.b64encode(s.serialize().to_pybytes()) for s in (written, claimed))
    data = file.read_bytes()
    at = data.index(varint(len(old)) + old)
    data = data[:at] + varint(len(new)) + new + data[at + len(varint(len(old))) + len(old):]
    footer = int.from_bytes(data[-8:-4], "little") + len(varint(len(new)) + new) - len(varint(len(old)) + old)
    file.write_bytes(data[:-8] + footer.to_bytes(4, "little") + b"PAR1")


def test_a_repeated_long_token_piece_is_refused_before_it_is_expanded(tmp_path):
    path = small_trace(tmp_path, parts=2)
    tokens = path / "tokens.parquet"
    spec = TABLES["tokens"]
    n = 120_000  # x 10,000 characters: 1.2 GB of text once expanded, a few KB in the file
    pieces = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["x" * 10_000]))
    columns = {c.name: pa.array(np.zeros(n, c.type.to_pandas_dtype()), c.type)
               for c in spec.columns if c.name not in ("piece", "modality")}
    columns["modality"] = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array(["text"]))
    columns["piece"] = pieces
    schema = pa.schema([pa.field(f.name, pieces.type if f.name == "piece" else f.type, f.nullable)
                        for f in spec.arrow_schema])
    pq.write_table(pa.table({f.name: columns[f.name] for f in schema}, schema=schema), tokens)
    _claim_schema(tokens, schema, spec.arrow_schema)  # the pages hold one dictionary entry, the footer says string
    assert tokens.stat().st_size < 1 << 20
    with bounded(seconds=5, rss_mib=150):
        t = open_trace(path)
        assert len(t.tokens()) == 0
    assert any(str(tokens) in p and "column piece expands to 1,200,000,000 bytes" in p for p in t.problems)


def test_a_sparse_session_json_is_not_read_whole(tmp_path):
    path = small_trace(tmp_path, parts=2)
    file = path / "session.json"
    with open(file, "r+b") as f:
        f.truncate(3 << 30)  # sparse: no disk taken, 3 GB claimed
    with bounded(seconds=5, rss_mib=150):
        with pytest.raises(TraceCorruptError, match=r"session.json: larger than the .* bytes allowed"):
            open_trace(path)


def test_a_session_with_too_many_segments_is_refused(tmp_path):
    from engine.session.segments import MAX_SEGMENTS
    path = small_trace(tmp_path, parts=2)
    session = json.loads((path / "session.json").read_text())
    session["segments"] = [{"id": i, "kind": "turn", "start": 0, "end": 0} for i in range(MAX_SEGMENTS + 1)]
    (path / "session.json").write_text(json.dumps(session))
    with pytest.raises(TraceCorruptError, match=f"holds {MAX_SEGMENTS + 1:,} segments, more than the"):
        open_trace(path)


def _ipc(path, table: pa.Table, compression: str | None = None):
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_file(str(path), table.schema, options=options) as writer:
        writer.write_table(table)
    return path


def test_arrow_summaries_are_read_within_limits(tmp_path):
    ok = _ipc(tmp_path / "ok.arrow", pa.table({"a": np.arange(10), "b": pa.array([[1, 2]] * 10)}))
    assert read_bounded(ok, 100).equals(pa.table({"a": np.arange(10), "b": pa.array([[1, 2]] * 10)}))
    with pytest.raises(BoundsError, match="claims 20 rows, more than the 15"):  # the list's 20 items
        read_bounded(ok, 15)
    zipped = _ipc(tmp_path / "z.arrow", pa.table({"a": np.zeros(10_000_000, np.int64)}), "zstd")
    assert zipped.stat().st_size < 1 << 20
    nulls = _ipc(tmp_path / "n.arrow", pa.table({"a": pa.nulls(600_000_000)}))  # no buffers: a tiny file
    with bounded(seconds=2, rss_mib=40):
        with pytest.raises(BoundsError, match="compressed"):
            read_bounded(zipped, 1 << 40)
        with pytest.raises(BoundsError, match="claims 600,000,000 rows"):
            read_bounded(nulls, summary_cache.MAX_ROWS)
    (tmp_path / "junk.arrow").write_bytes(b"ARROW1\0\0" + b"\xff" * 64)
    with pytest.raises(BoundsError):
        read_bounded(tmp_path / "junk.arrow", 100)


def test_a_bad_summary_counts_as_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    key = summary_cache.Key("ab" * 20, tmp_path)
    (tmp_path / "summaries").mkdir()
    _ipc(tmp_path / "summaries" / f"{key.digest}.x.arrow", pa.table({"a": np.zeros(1000, np.int64)}), "zstd")
    assert summary_cache.load_arrow(key, "x") is None
    summary_cache.save_arrow(key, "x", pa.table({"a": np.arange(3)}))  # the user cache: read after the bad one
    assert summary_cache.load_arrow(key, "x")["a"].to_pylist() == [0, 1, 2]
    big = tmp_path / "summaries" / f"{key.digest}.y.json"
    with open(big, "wb") as f:
        f.truncate(summary_cache.MAX_JSON_BYTES + 1)
    assert summary_cache.load_json(key, "y") is None


def _hf_config() -> dict:
    from engine import config_to_hf, get_preset
    return config_to_hf(get_preset("tiny"))


@pytest.mark.parametrize("edit, words", [
    (lambda c: c["text_config"]["dsa_config"].update(index_topk=2 ** 24),
     r"`dsa_config.index_topk`: expected an integer in \[1, 65536\], got 16777216"),
    (lambda c: c["text_config"]["dsa_config"].update(index_topk=2 ** 31 - 1), "`dsa_config.index_topk`"),
    (lambda c: c["text_config"].update(max_position_embeddings=1024) or
     c["text_config"]["dsa_config"].update(index_topk=2048), r"index_topk.*\[1, 1024\].*got 2048"),
    (lambda c: c["vision_config"].update(vt_num_hidden_layers=10 ** 9),
     r"`vision_config.vt_num_hidden_layers`: expected an integer in \[1, 4096\]"),
    (lambda c: c["vision_config"].update(vt_num_hidden_layers=1e9), "`vision_config.vt_num_hidden_layers`: expected an integer"),
    (lambda c: c["vision_config"].update(init_pos_emb_height=10 ** 6), "`vision_config.init_pos_emb_height`"),
    (lambda c: c["vision_config"].update(merge_kernel_size=[2, 10 ** 7]), "`vision_config.merge_kernel_size`"),
    (lambda c: c["vision_config"].update(vt_num_attention_heads=10 ** 8), "`vision_config.vt_num_attention_heads`"),
])
def test_sizes_a_config_sets_are_bounded(tmp_path, edit, words):
    from engine.config_io import load_config
    from engine.errors import ConfigError
    config = _hf_config()
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with bounded(seconds=2, rss_mib=50):
        with pytest.raises(ConfigError, match=words) as info:
            load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_a_snapshot_token_tensor_longer_than_its_metadata_says_is_refused_before_listing(tmp_path):
    from safetensors.torch import load_file, save_file

    from engine import load_model
    from engine.errors import InputError
    from engine.session import Session
    from engine.session.snapshot import read_snapshot
    from engine.tokenizer import Tokenizer
    import torch
    model = load_model("preset:tiny", seed=2)
    session = Session(model, Tokenizer.byte_level(), progress=False)
    session.append("fifteen tokens!", name="doc")
    session.save(tmp_path / "snap")
    state_file = tmp_path / "snap" / "state.safetensors"
    tensors = load_file(str(state_file))
    tensors["tokens"] = torch.zeros(4_000_000, dtype=torch.int64)  # a list of these would take ~150 MB
    save_file(tensors, str(state_file))
    state = read_snapshot(tmp_path / "snap")
    with bounded(seconds=2, rss_mib=60):
        with pytest.raises(InputError, match="holds 4,000,000 token ids, its metadata says 15"):
            Session(model, Tokenizer.byte_level(), progress=False).load_state_dict(state)


def test_a_tokenizer_config_with_300k_special_tokens_is_refused_before_building_them(tmp_path):
    from engine.errors import CheckpointError
    from engine.tokenizer import Tokenizer, write_byte_level_tokenizer
    write_byte_level_tokenizer(tmp_path)
    decoder = {str(256 + i): {"content": f"<|t{i}|>"} for i in range(300_000)}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    with bounded(seconds=5, rss_mib=200):
        with pytest.raises(CheckpointError, match=r"tokenizer_config.json: cannot read added_tokens_decoder \(it lists 300,000 special tokens, more than the 256"):
            Tokenizer.load(tmp_path)


def test_a_3_gib_policy_file_is_not_read(tmp_path):
    from engine.errors import InputError
    from workbench.recorders.policy import load_policy
    policy = tmp_path / "policy.json"
    with open(policy, "wb") as f:
        f.write(b'{"name": "x"}')
        f.truncate(3 << 30)  # sparse
    with bounded(seconds=2, rss_mib=50):
        with pytest.raises(InputError, match=r"policy.json: larger than the 1,048,576 bytes allowed for a policy file"):
            load_policy(str(policy))


def test_a_huge_layer_range_is_refused_before_it_is_expanded(tmp_path):
    from workbench.trace.errors import TraceError
    from workbench.trace.export import parse_layers
    with bounded(seconds=1, rss_mib=20):
        with pytest.raises(TraceError, match="layer 2000000000 is beyond 32767"):
            parse_layers("1000000-2000000000")
    path = small_trace(tmp_path, parts=2)  # a model of 8 layers
    with pytest.raises(TraceError, match=r"layers 8, 9 are not layers of the trace .* 0\.\.7\); export aborted"):
        export_trace(path, tmp_path / "out", fmt="csv", layers=parse_layers("3,8-9"))
    assert not (tmp_path / "out").exists()


def _png16(width: int, height: int) -> bytes:
    """A 16-bit grey PNG of zeros, compressed row by row (never held whole)."""
    import struct
    import zlib
    packer = zlib.compressobj(9)
    row = b"\0" * (1 + 2 * width)
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 16, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def test_a_16_bit_png_decodes_without_whole_image_float_copies():
    from engine.vision.preprocess import _pixel_digest, open_image
    data = _png16(5000, 5000)  # 25M pixels; whole-image float64 conversion peaked at ~670 MB more here
    assert len(data) < 64 << 10
    with bounded(seconds=5, rss_mib=250):  # the 16-bit pixels, their 8-bit grey and RGB copies: ~180 MB
        image, _ = open_image(data, name="deep.png")
        _pixel_digest(image)
    assert image.size == (5000, 5000) and image.mode == "RGB"


def test_16_bit_grey_converts_and_hashes_as_before():
    import hashlib

    from PIL import Image

    from engine.vision.preprocess import _pixel_digest, _to_rgb8
    values = np.random.default_rng(0).integers(0, 65536, (37, 29)).astype(np.uint16)
    image = _to_rgb8(Image.frombytes("I;16", (29, 37), values.astype("<u2").tobytes()), "x")
    expected = np.clip(np.rint(values.astype(np.float64) / 257.0), 0, 255).astype(np.uint8)
    assert (np.asarray(image)[..., 0] == expected).all()
    assert _pixel_digest(image) == hashlib.sha256(b"29x37:" + image.tobytes()).hexdigest()


def test_many_parts_within_their_limits_are_not_read_together_beyond_the_read_limit(tmp_path, monkeypatch):
    path = small_trace(tmp_path, parts=2)
    spec = TABLES["dsa_sink"]
    (path / "dsa_sink").mkdir(exist_ok=True)
    for seq in range(4):  # four parts of 8 rows, each at other positions
        rows = pa.table({"layer": np.full(8, 3, np.int16), "step": np.zeros(8, np.int32),
                         "rank": np.zeros(8, np.int16), "position": np.arange(8, dtype=np.int32) + 8 * seq,
                         "queries": np.ones(8, np.int32), "sink_hits": np.ones(8, np.int32)}, schema=spec.arrow_schema)
        pq.write_table(rows, path / "dsa_sink" / f"part-{seq:06d}.parquet", **parquet_options(spec))
    t = open_trace(path)
    one = max(p.decoded for p in t._parts["dsa_sink"])
    monkeypatch.setattr(part_checks, "MAX_READ_BYTES", 2 * one)
    with pytest.raises(TraceError, match=r"table dsa_sink would decode to about .* bytes in 4 part\(s\), more than"):
        t.table("dsa_sink")
    assert t.table("dsa_sink", positions=(8, 9)).num_rows == 2  # the footers narrow the read to one part
