"""Issue 42 item 5: a part whose footer passes the limits but whose pages claim more (decompressed
size, value count, dictionary entries) is refused from its page headers, before any page is
decompressed: a one-line problem naming the file, the column and the sizes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.hardening.conftest import bounded
from tests.hardening.parquet_forge import footer_bomb, forge_page, small_trace, zeros_zstd
from workbench.trace import TraceCorruptError, open_trace
from workbench.trace.export import export_trace
from workbench.trace.parquet_pages import (MAX_FOOTER_BYTES, MAX_FOOTER_ITEMS, PageBoundsError, check_footer,
                                           check_pages)
from workbench.trace.schema import TABLES, TOKENS_FILE, parquet_options

_BOMB = 256 << 20  # what the forged page decompresses to (zstd: a few KB in the file)


def _one_row_tokens(path, characters: int = 120_000):
    """tokens.parquet of one token whose piece is a long random text stored without a dictionary (its
    chunk is then large enough to hold a forged page in place)."""
    spec = TABLES["tokens"]
    rng = np.random.default_rng(0)
    piece = "".join(chr(c) for c in rng.integers(33, 127, characters))
    columns = {c.name: pa.array([0], c.type) for c in spec.columns if c.name not in ("piece", "modality")}
    columns["piece"] = pa.array([piece])
    columns["modality"] = pa.DictionaryArray.from_arrays(pa.array([0], pa.int8()), pa.array(["text"]))
    table = pa.table({f.name: columns[f.name] for f in spec.arrow_schema}, schema=spec.arrow_schema)
    options = parquet_options(spec)
    options["use_dictionary"] = [c for c in options["use_dictionary"] if c != "piece"]
    file = path / TOKENS_FILE
    pq.write_table(table, file, **options)
    return file


def test_a_page_that_decompresses_past_its_footer_is_refused_before_decompressing(tmp_path):
    path = small_trace(tmp_path)
    file = _one_row_tokens(path)
    forge_page(file, "piece", _BOMB)
    assert file.stat().st_size < 200_000 and pq.read_metadata(file).num_rows == 1
    with bounded(seconds=10, rss_mib=100):
        t = open_trace(path)
        assert len(t.tokens()) == 0
        assert t.table("tokens").num_rows == 0
    problem = next(p for p in t.problems if str(file) in p)
    assert f"column piece (row group 0): its pages decompress to {_BOMB // 1000:,}," in problem  # + its header
    assert "the footer says" in problem and "skipped" in problem and "\n" not in problem
    with bounded(seconds=10, rss_mib=100):
        with pytest.raises(TraceCorruptError, match="its pages decompress to"):
            export_trace(path, tmp_path / "out", fmt="csv")
    assert not (tmp_path / "out").exists()


def test_the_honest_part_reads_as_before(tmp_path):
    path = small_trace(tmp_path)
    _one_row_tokens(path, characters=1000)
    t = open_trace(path)
    assert len(t.tokens()) == 1 and len(t.tokens()["piece"][0]) == 1000 and t.problems == []


def test_a_page_of_more_values_than_the_footer_is_refused(tmp_path):
    path = small_trace(tmp_path)
    spec = TABLES["dsa_topk"]
    n = 30_000  # random scores: their chunk does not compress, so a forged page fits in place
    rng = np.random.default_rng(1)
    offsets = pa.array([0, n], pa.int32())
    table = pa.table({"layer": pa.array([3], pa.int16()), "step": pa.array([0], pa.int32()),
                      "rank": pa.array([0], pa.int16()), "position": pa.array([0], pa.int32()),
                      "selected": pa.ListArray.from_arrays(offsets, pa.array(np.arange(n, dtype=np.int32))),
                      "scores": pa.ListArray.from_arrays(offsets, pa.array(rng.random(n, np.float32)))},
                     schema=spec.arrow_schema)
    file = path / "dsa_topk" / "part-000000.parquet"
    file.parent.mkdir()
    pq.write_table(table, file, **parquet_options(spec))
    forge_page(file, "scores.list.element", 4096, values=1_000_000_000)
    t = open_trace(path)
    assert t.table("dsa_topk").num_rows == 0
    assert any(str(file) in p and "its pages hold 1,000,000,000 values, the footer says 30,000" in p
               for p in t.problems)


def test_a_dictionary_page_of_more_entries_than_bytes_is_refused(tmp_path):
    path = small_trace(tmp_path)
    file = _one_row_tokens(path)
    forge_page(file, "piece", 4096, values=400_000_000, page_type=2)
    with pytest.raises(PageBoundsError, match="dictionary page claims 400,000,000 entries in 4,096 bytes"):
        check_pages(file)


@pytest.mark.parametrize("body", [b"\xff" * 64, b"\x1c" * 64, b""])
def test_garbage_where_a_page_header_should_be_is_one_line(tmp_path, body):
    path = small_trace(tmp_path)
    file = _one_row_tokens(path, characters=2000)
    meta = pq.read_metadata(file)
    chunk = meta.row_group(0).column(2)
    data = bytearray(file.read_bytes())
    data[chunk.data_page_offset:chunk.data_page_offset + len(body)] = body
    data[chunk.data_page_offset + len(body):chunk.data_page_offset + len(body) + 1] = b"\xff"
    file.write_bytes(bytes(data))
    with pytest.raises(PageBoundsError) as info:
        check_pages(file)
    assert "column piece" in str(info.value) and "\n" not in str(info.value)


def test_zeros_compress_to_a_few_kilobytes():
    assert len(zeros_zstd(_BOMB)) < 64 << 10


def test_an_effects_table_with_a_lying_page_is_one_line(tmp_path):
    from workbench.trace.effects_table import EFFECTS_FILE, effects_schema, read_effects
    path = small_trace(tmp_path)
    schema = effects_schema()
    rng = np.random.default_rng(2)
    row = {f.name: pa.array([None], f.type) for f in schema}
    row["target"] = pa.array(["".join(chr(c) for c in rng.integers(33, 127, 50_000))])
    file = path / EFFECTS_FILE
    pq.write_table(pa.table({f.name: row[f.name] for f in schema}, schema=schema), file, compression="zstd",
                   use_dictionary=False)
    forge_page(file, "target", _BOMB)
    with bounded(seconds=10, rss_mib=100):
        with pytest.raises(Exception, match="not a readable Parquet effects table .*its pages decompress to") as info:
            read_effects(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("compression", ["none", "snappy", "gzip", "lz4", "zstd", "brotli"])
@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_honest_files_of_every_shape_pass(tmp_path, compression, version):
    """No false alarm: compressions, data page versions, dictionaries, nested and null lists, many pages and
    row groups, page statistics and checksums."""
    rng = np.random.default_rng(3)
    n = 50_000
    lists = pa.array([None if i % 7 == 0 else list(range(i % 5)) for i in range(n)], pa.list_(pa.int32()))
    nested = pa.array([[[i], []] if i % 3 else None for i in range(n)], pa.list_(pa.list_(pa.int64())))
    table = pa.table({"a": rng.integers(0, 1 << 40, n), "s": pa.array([f"w{i % 97}" for i in range(n)]),
                      "f": rng.random(n).astype(np.float16), "l": lists, "n": nested,
                      "b": pa.array([i % 2 == 0 for i in range(n)]), "d": pa.array(rng.random(n))})
    file = tmp_path / "h.parquet"
    pq.write_table(table, file, compression=compression, data_page_version=version, row_group_size=20_000,
                   data_page_size=8192, write_page_checksum=True, write_page_index=True,
                   use_dictionary=["s", "a"], column_encoding={"d": "BYTE_STREAM_SPLIT"})
    check_pages(file)
    assert pq.read_table(file).equals(table)


@pytest.fixture(scope="module")
def honest_part(tmp_path_factory):
    spec = TABLES["dsa_topk"]
    rows = 64
    table = pa.table({"layer": pa.array([3] * rows, pa.int16()), "step": pa.array([0] * rows, pa.int32()),
                      "rank": pa.array([0] * rows, pa.int16()), "position": pa.array(range(rows), pa.int32()),
                      "selected": pa.array([list(range(i % 9)) for i in range(rows)], pa.list_(pa.int32())),
                      "scores": pa.array([[0.5] * (i % 9) for i in range(rows)], pa.list_(pa.float32()))},
                     schema=spec.arrow_schema)
    file = tmp_path_factory.mktemp("pages") / "part.parquet"
    pq.write_table(table, file, **parquet_options(spec))
    return file.read_bytes()


@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8))
@example([(4, 0x15)])
def test_mutated_page_headers_pass_or_are_refused_in_one_line(honest_part, tmp_path_factory, edits):
    """Any byte of a part flipped: the page check passes or raises PageBoundsError (one line), within bounds;
    a part it passes is what pyarrow reads or refuses itself."""
    data = bytearray(honest_part)
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")  # keep the footer: pages only
    for at, value in edits:
        data[4 + at % max(footer - 4, 1)] = value
    file = tmp_path_factory.mktemp("m") / "part.parquet"
    file.write_bytes(bytes(data))
    with bounded(seconds=5, rss_mib=100):
        try:
            check_pages(file)
        except PageBoundsError as exc:
            assert "\n" not in str(exc)
            return
        try:
            pq.read_table(file)
        except (pa.ArrowException, OSError):
            pass


def test_a_footer_of_many_column_chunks_is_refused_before_pyarrow_decodes_it(tmp_path):
    path = small_trace(tmp_path)
    bad = path / "dsa_key_counts" / "part-000001.parquet"
    size = footer_bomb(bad, 100_000, row_groups=3)  # 0.9 MB; pyarrow's footer reader took ~210 MB for it
    assert size < 1 << 20
    with bounded(seconds=10, rss_mib=60):
        t = open_trace(path)
        assert t.dsa_heatmap(bins=4).sum() == 4
    assert any(str(bad) in p and f"the footer lists more than {MAX_FOOTER_ITEMS:,} entries" in p for p in t.problems)
    with pytest.raises(TraceCorruptError, match="the footer lists more than"):
        export_trace(path, tmp_path / "out", fmt="csv")


def test_a_footer_longer_than_the_limit_is_refused_unread(tmp_path):
    file = tmp_path / "long.parquet"
    footer_bomb(file, MAX_FOOTER_BYTES // 3)
    with bounded(seconds=5, rss_mib=20):
        with pytest.raises(PageBoundsError, match=f"more than the {MAX_FOOTER_BYTES:,} a part's footer may"):
            check_footer(file)


def test_honest_footers_pass(tmp_path):
    path = small_trace(tmp_path)
    for file in path.rglob("*.parquet"):
        check_footer(file)
    footer_bomb(tmp_path / "ok.parquet", 1, row_groups=2)
    check_footer(tmp_path / "ok.parquet")  # within the limits: pyarrow judges the rest


@pytest.mark.parametrize("chunks, row_groups", [(2, 1), (1, 3), (40, 2)])
def test_a_row_group_with_more_chunks_than_columns_is_refused_not_a_crash(tmp_path, chunks, row_groups):
    """pyarrow terminates the process ("Invalid Column Index", a C++ exception it does not catch) when such a
    chunk is looked at: a 100-byte part used to kill a dashboard that opened the trace."""
    path = small_trace(tmp_path)
    bad = path / "dsa_key_counts" / "part-000001.parquet"
    footer_bomb(bad, chunks, row_groups)
    t = open_trace(path)
    assert t.dsa_heatmap(bins=4).sum() == 4
    if chunks != 1:
        assert any(str(bad) in p and f"lists {chunks} column chunks for the schema's 1 column(s)" in p
                   for p in t.problems)
    else:
        assert any(str(bad) in p for p in t.problems)  # consistent, but its columns are not the table's



@pytest.mark.parametrize("physical, histogram, words", [
    (9, 0, "its chunk's physical type 9 is not the schema's 1"),
    (7, 0, "its chunk's physical type 7 is not the schema's 1"),
    (1, 2, "its definition level histogram has 2 entries, the column 1"),
])
def test_column_chunk_metadata_pyarrow_would_die_on_is_refused(tmp_path, physical, histogram, words):
    """pyarrow terminates the process on these too ("ColumnMetaData type does not match ColumnDescriptor
    physical type", "Definition level histogram size mismatch"): found by mutating footers."""
    path = small_trace(tmp_path)
    bad = path / "dsa_key_counts" / "part-000001.parquet"
    footer_bomb(bad, 1, physical=physical, histogram=histogram)
    t = open_trace(path)
    assert t.dsa_heatmap(bins=4).sum() == 4
    assert any(str(bad) in p and words in p for p in t.problems), t.problems


def test_a_consistent_forged_footer_reaches_pyarrow(tmp_path):
    footer_bomb(tmp_path / "ok.parquet", 1, physical=1, histogram=1)
    check_footer(tmp_path / "ok.parquet")
    assert pq.read_metadata(tmp_path / "ok.parquet").row_group(0).column(0).physical_type == "INT32"
