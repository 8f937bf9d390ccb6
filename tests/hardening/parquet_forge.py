"""Forge Parquet pages that lie about their size, for the page-header tests.

`forge_page(file, column, ...)` overwrites, in place, the first data page of a column chunk that has
no dictionary page with a page header of our choosing and a zstd body of `unpacked` zero bytes; the
footer (rows, values, sizes, offsets) is left as it was, so it still claims what the honest page held.
`footer_bomb(file, chunks)` writes a file whose footer lists more column chunks than a footer may.
`small_trace(tmp_path, parts)` is the honest trace the forged and oversized parts are put beside.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from workbench.trace import TraceWriter


def small_trace(tmp_path: Path, parts: int = 1) -> Path:
    """`tmp_path / "t"`: a finished trace of a model of 8 layers whose dsa_key_counts table is `parts`
    parts of 4 rows (layer 3, one step each)."""
    path = tmp_path / "t"
    w = TraceWriter.create(path, {"model": {"layers": 8, "num_experts": 16, "max_position_embeddings": 4096}},
                           fsync=False)
    for step in range(parts):
        w.append("dsa_key_counts", layer=3, step=step, rank=0, key_bin=np.arange(4), count=np.ones(4, np.int64))
        w.flush()
    w.close()
    return path


def varint(n: int) -> bytes:
    """A Thrift compact-protocol unsigned varint."""
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _i32(field_delta: int, value: int) -> bytes:
    """A compact-protocol i32 field (zigzag varint) `field_delta` ids after the previous one."""
    return bytes([field_delta << 4 | 5]) + varint((value << 1) ^ (value >> 31))


def page_header(page_type: int, unpacked: int, stored: int, values: int) -> bytes:
    """A PageHeader: data page v1 (type 0, PLAIN values, RLE levels) or dictionary page (type 2)."""
    head = _i32(1, page_type) + _i32(1, unpacked) + _i32(1, stored)
    if page_type == 2:  # field 7: DictionaryPageHeader {num_values, encoding PLAIN}
        return head + bytes([4 << 4 | 12]) + _i32(1, values) + _i32(1, 0) + b"\0\0"
    # field 5: DataPageHeader {num_values, encoding PLAIN, definition RLE, repetition RLE}
    return head + bytes([2 << 4 | 12]) + _i32(1, values) + _i32(1, 0) + _i32(1, 3) + _i32(1, 3) + b"\0\0"


def zeros_zstd(unpacked: int) -> bytes:
    """`unpacked` zero bytes compressed with zstd, streamed (never held uncompressed)."""
    sink = pa.BufferOutputStream()
    block = b"\0" * (1 << 20)
    with pa.CompressedOutputStream(sink, "zstd") as stream:
        left = unpacked
        while left:
            stream.write(block[:min(left, len(block))])
            left -= min(left, len(block))
    return sink.getvalue().to_pybytes()


def forge_page(file: Path, column: str, unpacked: int, values: int = 1, page_type: int = 0,
               body: bytes | None = None) -> int:
    """Replace the first page of `column` (row group 0) with a forged one; returns the chunk's size."""
    meta = pq.read_metadata(file)
    group = meta.row_group(0)
    chunk = next(group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema == column)
    assert not chunk.has_dictionary_page, "write the column without a dictionary"
    body = zeros_zstd(unpacked) if body is None else body
    page = page_header(page_type, unpacked, len(body), values) + body
    assert len(page) <= chunk.total_compressed_size, (len(page), chunk.total_compressed_size)
    data = bytearray(file.read_bytes())
    data[chunk.data_page_offset:chunk.data_page_offset + len(page)] = page
    file.write_bytes(bytes(data))
    return chunk.total_compressed_size


def _zigzag(value: int) -> bytes:
    return varint((value << 1) ^ (value >> 63))


def _list(count: int, kind: int) -> bytes:
    return bytes([count << 4 | kind]) if count < 15 else bytes([0xF0 | kind]) + varint(count)


def _column_meta(physical: int, histogram: int) -> bytes:
    """ColumnMetaData of an empty chunk: `physical` type, and a definition level histogram of
    `histogram` entries in its size statistics when > 0."""
    out = bytes([1 << 4 | 5]) + _zigzag(physical) + bytes([1 << 4 | 9]) + _list(1, 5) + _zigzag(0)  # encodings
    out += bytes([1 << 4 | 9]) + _list(1, 8) + varint(1) + b"a"  # path_in_schema
    out += bytes([1 << 4 | 5]) + _zigzag(0)  # codec
    out += b"".join(bytes([1 << 4 | 6]) + _zigzag(0) for _ in range(3))  # values, uncompressed, compressed
    out += bytes([2 << 4 | 6]) + _zigzag(4)  # 9: data_page_offset
    if histogram:  # 16: SizeStatistics {3: definition_level_histogram}
        out += bytes([7 << 4 | 12]) + bytes([3 << 4 | 9]) + _list(histogram, 6) + _zigzag(0) * histogram + b"\0"
    return out + b"\0"


def footer_bomb(file: Path, chunks: int, row_groups: int = 1, physical: int | None = None, histogram: int = 0) -> int:
    """A Parquet file that is nothing but a footer: one required INT32 column, `row_groups` row groups of
    `chunks` minimal column chunks each (3 bytes apiece in the file), or of chunks with metadata of type
    `physical` (and a definition level histogram of `histogram` entries); returns the file size."""
    chunk = bytes([2 << 4 | 6]) + _zigzag(0)  # ColumnChunk {2: file_offset 0}
    if physical is not None:
        chunk += bytes([1 << 4 | 12]) + _column_meta(physical, histogram)  # 3: meta_data
    chunk += b"\0"
    group = bytes([1 << 4 | 9]) + _list(chunks, 12) + chunk * chunks + \
        bytes([1 << 4 | 6]) + _zigzag(0) + bytes([1 << 4 | 6]) + _zigzag(0) + b"\0"  # total_byte_size, num_rows
    root = bytes([4 << 4 | 8]) + varint(6) + b"schema" + bytes([1 << 4 | 5]) + _zigzag(1) + b"\0"
    leaf = bytes([1 << 4 | 5]) + _zigzag(1) + bytes([2 << 4 | 5]) + _zigzag(0) + bytes([1 << 4 | 8]) + varint(1) + \
        b"a" + b"\0"
    meta = bytes([1 << 4 | 5]) + _zigzag(1) + bytes([1 << 4 | 9]) + _list(2, 12) + root + leaf + \
        bytes([1 << 4 | 6]) + _zigzag(0) + bytes([1 << 4 | 9]) + _list(row_groups, 12) + group * row_groups + b"\0"
    data = b"PAR1" + meta + len(meta).to_bytes(4, "little") + b"PAR1"
    file.write_bytes(data)
    return len(data)
