"""What a Parquet file's pages will decode to, read from their headers before any page is decompressed.

    check_footer(path) -> None                          the footer itself, before pyarrow decodes it
    read_footer_checked(path) -> FileMetaData          that, then one column chunk per column in each row group
    check_pages(path, meta, columns=None) -> None      raises PageBoundsError naming the column and sizes

A part's footer is checked against the limits first (`part_checks.read_footer`), but the footer only
says what the writer claims. The reader decompresses each page into a buffer of the size its own
header states (up to 2 GiB) and reads pages until it has seen as many values as the footer claims,
whatever one page holds. A 79 KB file whose footer says one row can thus hold one page that
decompresses to 2 GiB of zeros, or one page of a billion values. So each column chunk's page headers
are walked the way pyarrow walks them (same byte range, same stop rule), and the pages must agree
with the footer that passed the limits:

- the values of its data pages add up to no more than the footer's `num_values`;
- their uncompressed sizes add up to no more than the footer's `total_uncompressed_size` (counted against the part's limit by `part_checks._decoded_bytes`);
- a dictionary page holds no more entries than its bytes can (a plain entry takes 4 bytes at least);
- every page lies inside the column chunk and the file.

The footer is a Thrift struct too, and pyarrow decodes it whole into C++ structs (~700 bytes per
column chunk), so `check_footer` bounds its length and its list entries first.

Page headers are Thrift structs in the compact protocol; `_Compact` reads just enough of it (field
ids and integers; strings and lists are skipped within the bytes that are there).
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Iterable

import pyarrow.parquet as pq

MAX_PAGE_HEADER_BYTES = 16 << 20  # pyarrow's own limit on one page header
MAX_FOOTER_BYTES = 4 << 20  # a part's footer (an honest one: 5-15 KB; one per row group and column adds ~100 bytes)
MAX_FOOTER_ITEMS = 1 << 17  # list entries of a footer (each ~700 bytes once pyarrow decodes it: ~90 MB at most)
MAX_PAGES = 1 << 16  # page headers walked in one file (an honest part: one per MiB of each column chunk)
_MAX_DEPTH = 16  # nesting of Thrift structs and lists (a page header nests three deep)
# PageHeader field ids and page types (parquet.thrift)
_TYPE, _UNCOMPRESSED, _COMPRESSED = 1, 2, 3
_DATA_PAGE_HEADER, _DICTIONARY_PAGE_HEADER, _DATA_PAGE_HEADER_V2 = 5, 7, 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
_NUM_VALUES = 1  # field 1 of DataPageHeader, DictionaryPageHeader and DataPageHeaderV2
# the smallest plain-encoded dictionary entry by physical type (BYTE_ARRAY: its 4-byte length)
_ENTRY_BYTES = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8, "BYTE_ARRAY": 4}


class PageBoundsError(ValueError):
    """Page headers that claim more than the footer, or cannot be read; the message says which."""


class _Compact:
    """A reader of Thrift's compact protocol over `buf[pos:end]` that never reads past `end`."""

    def __init__(self, buf: mmap.mmap, pos: int, end: int, items: int | None = None) -> None:
        self.buf, self.pos, self.end = buf, pos, end
        self.items = items  # list, set and map entries still allowed (None: as many as the bytes hold)

    def _byte(self) -> int:
        if self.pos >= self.end:
            raise PageBoundsError("a page header runs past the end of its column chunk")
        value = self.buf[self.pos]
        self.pos += 1
        return value

    def _varint(self) -> int:
        value = shift = 0
        while True:
            byte = self._byte()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise PageBoundsError("a page header holds a malformed integer")

    def _zigzag(self) -> int:
        value = self._varint()
        return (value >> 1) ^ -(value & 1)

    def _skip(self, count: int) -> None:
        if count < 0 or count > self.end - self.pos:
            raise PageBoundsError("a page header runs past the end of its column chunk")
        self.pos += count

    def _value(self, kind: int, depth: int) -> int | dict | list | None:
        """One value of compact type `kind`: integers, structs and lists are kept, everything else skipped."""
        if kind in (1, 2):  # booleans: the type is the value
            return int(kind == 1)
        if kind == 3:
            self._skip(1)
            return None
        if kind in (4, 5, 6):
            return self._zigzag()
        if kind == 7:
            self._skip(8)
            return None
        if kind == 8:
            self._skip(self._varint())
            return None
        if kind in (9, 10):
            header = self._byte()
            count, item = header >> 4, header & 0x0F
            if count == 15:
                count = self._varint()
            return self._items(count, (item,), depth)
        if kind == 11:
            count = self._varint()
            if count:
                kinds = self._byte()
                self._items(count, (kinds >> 4, kinds & 0x0F), depth)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        raise PageBoundsError(f"a page header holds an unknown Thrift type {kind}")

    def _items(self, count: int, kinds: tuple[int, ...], depth: int) -> list:
        if count > self.end - self.pos:  # every item takes a byte at least
            raise PageBoundsError("a page header claims more list items than it has bytes")
        if self.items is not None:
            self.items -= count
            if self.items < 0:
                raise PageBoundsError(f"the footer lists more than {MAX_FOOTER_ITEMS:,} entries (row groups, "
                                      "column chunks, encodings, ...), more than a part's footer may")
        out = []
        for _ in range(count):
            for kind in kinds:
                if kind in (1, 2):  # a boolean in a list takes a byte
                    self._skip(1)
                    out.append(None)
                else:
                    out.append(self._value(kind, depth + 1))
        return out

    def struct(self, depth: int = 0) -> dict[int, int | dict | list | None]:
        """The fields of the struct at the current position, by field id."""
        if depth > _MAX_DEPTH:
            raise PageBoundsError("a page header nests too deep")
        fields: dict[int, int | dict | list | None] = {}
        last = 0
        while True:
            header = self._byte()
            if header == 0:
                return fields
            delta, kind = header >> 4, header & 0x0F
            last = last + delta if delta else self._zigzag()
            fields[last] = self._value(kind, depth)


def _chunk_range(chunk: pq.ColumnChunkMetaData, file_size: int) -> tuple[int, int]:
    """The bytes pyarrow reads for a column chunk: from its dictionary page (when it has one before its
    data pages) or its first data page, `total_compressed_size` long."""
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset and 0 < chunk.dictionary_page_offset < start:
        start = chunk.dictionary_page_offset
    length = chunk.total_compressed_size
    if start < 0 or length < 0 or start + length > file_size:
        raise PageBoundsError(f"its footer places the chunk at bytes {start:,}..{start + length:,}, outside the "
                              f"file's {file_size:,}")
    return start, start + length


def _check_chunk(buf: mmap.mmap, chunk: pq.ColumnChunkMetaData, file_size: int, budget: list[int]) -> None:
    """Walk one column chunk's page headers as pyarrow does; PageBoundsError when they break the footer."""
    pos, end = _chunk_range(chunk, file_size)
    claimed_values, claimed_bytes = max(chunk.num_values, 0), max(chunk.total_uncompressed_size, 0)
    values = unpacked = 0
    while values < claimed_values:
        budget[0] -= 1
        if budget[0] < 0:
            raise PageBoundsError(f"the file holds more than {MAX_PAGES:,} pages")
        reader = _Compact(buf, pos, min(end, pos + MAX_PAGE_HEADER_BYTES))
        header = reader.struct()
        kind = header.get(_TYPE)
        size, stored = header.get(_UNCOMPRESSED), header.get(_COMPRESSED)
        if not isinstance(size, int) or not isinstance(stored, int) or size < 0 or stored < 0:
            raise PageBoundsError("a page header lacks its sizes")
        pos = reader.pos + stored
        if pos > end:
            raise PageBoundsError(f"a page of {stored:,} stored bytes runs past the end of its column chunk")
        # the footer's size counts the headers too (most writers): the pages alone must fit it
        unpacked += size
        if unpacked > claimed_bytes:
            raise PageBoundsError(f"its pages decompress to {unpacked:,} bytes or more, the footer says "
                                  f"{claimed_bytes:,}")
        inner = header.get({_DATA_PAGE: _DATA_PAGE_HEADER, _DATA_PAGE_V2: _DATA_PAGE_HEADER_V2,
                            _DICTIONARY_PAGE: _DICTIONARY_PAGE_HEADER}.get(kind, -1))
        if kind not in (_DATA_PAGE, _DATA_PAGE_V2, _DICTIONARY_PAGE):
            continue  # an index page or a kind pyarrow skips too
        count = inner.get(_NUM_VALUES) if isinstance(inner, dict) else None
        if not isinstance(count, int) or count < 0:
            raise PageBoundsError("a page header lacks its value count")
        if kind == _DICTIONARY_PAGE:
            entry = _ENTRY_BYTES.get(chunk.physical_type, 1)
            if count * entry > size:
                raise PageBoundsError(f"its dictionary page claims {count:,} entries in {size:,} bytes")
            continue
        values += count
    if values > claimed_values:
        raise PageBoundsError(f"its pages hold {values:,} values, the footer says {claimed_values:,}")


def check_footer(path: str | Path) -> None:
    """Refuse a Parquet file whose footer is longer than MAX_FOOTER_BYTES or lists more than
    MAX_FOOTER_ITEMS entries (row groups, column chunks, encodings, ...), before pyarrow decodes it:
    every entry becomes a C++ struct of ~700 bytes, so a 15 MB footer of minimal column chunks took
    pyarrow's footer reader past 50 GB. PageBoundsError naming the sizes."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size < 12:
            return  # pyarrow refuses it itself
        handle.seek(size - 8)
        tail = handle.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1":
            return  # not a plain footer (encrypted, or not Parquet): pyarrow refuses or reads it itself
        if length > MAX_FOOTER_BYTES:
            raise PageBoundsError(f"its footer takes {length:,} bytes, more than the {MAX_FOOTER_BYTES:,} a part's "
                                  "footer may")
        if length > size - 12:
            return  # pyarrow refuses it: longer than the file
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            reader = _Compact(buf, size - 8 - length, size - 8, items=MAX_FOOTER_ITEMS)
            try:
                footer = reader.struct()
            except PageBoundsError as exc:
                raise PageBoundsError(str(exc).replace("a page header", "the footer")) from None
    _check_column_chunks(footer)


def _leaves(schema: list) -> list[tuple[int, int, int | None]]:
    """(max definition level, max repetition level, physical type) of each leaf column of a footer's
    flattened schema (SchemaElement structs: 1 type, 3 repetition, 5 children); [] when it is malformed
    (pyarrow refuses such a schema itself, with an exception it does translate)."""
    out: list[tuple[int, int, int | None]] = []
    pos = 1
    stack = [(schema[0].get(5) or 0 if schema and isinstance(schema[0], dict) else 0, 0, 0)]
    while stack:
        left, defined, repeated = stack.pop()
        if left <= 0:
            continue
        stack.append((left - 1, defined, repeated))
        if pos >= len(schema) or not isinstance(schema[pos], dict) or len(stack) > _MAX_DEPTH * 4:
            return []
        element = schema[pos]
        pos += 1
        repetition = element.get(3) or 0
        level = (defined + (repetition in (1, 2)), repeated + (repetition == 2))
        children = element.get(5)
        if isinstance(children, int) and children > 0:
            stack.append((children, *level))
        else:
            out.append((*level, element.get(1)))
    return out


def _check_column_chunks(footer: dict) -> None:
    """What pyarrow checks when it builds a column chunk's metadata, where a failure terminates the
    process (its accessor does not translate the C++ exception): every row group lists one chunk per
    leaf column of the schema's physical type, a chunk's size statistics have level histograms of the
    column's levels (or none) and unencoded byte counts only for BYTE_ARRAY, and no chunk is encrypted
    or holds geospatial statistics (a trace's never do)."""
    schema, groups = footer.get(2), footer.get(4)
    if not isinstance(schema, list) or not isinstance(groups, list):
        return  # pyarrow refuses a footer without them itself
    leaves = _leaves(schema)
    for rg, group in enumerate(groups):
        chunks = group.get(1) if isinstance(group, dict) else None
        if not isinstance(chunks, list) or len(chunks) != len(leaves):
            listed = len(chunks) if isinstance(chunks, list) else 0
            raise PageBoundsError(f"row group {rg} lists {listed:,} column chunks for the schema's "
                                  f"{len(leaves):,} column(s)")
        for i, (chunk, (max_def, max_rep, physical)) in enumerate(zip(chunks, leaves)):
            if not isinstance(chunk, dict):
                continue
            if chunk.get(8) is not None or chunk.get(9) is not None:
                raise PageBoundsError(f"row group {rg} column {i} is encrypted")
            meta = chunk.get(3)
            if isinstance(meta, dict) and meta.get(1) != physical:
                raise PageBoundsError(f"row group {rg} column {i}: its chunk's physical type {meta.get(1)} is not "
                                      f"the schema's {physical}")
            if isinstance(meta, dict) and meta.get(17) is not None:
                raise PageBoundsError(f"row group {rg} column {i}: geospatial statistics (no trace column has them)")
            sizes = meta.get(16) if isinstance(meta, dict) else None
            if not isinstance(sizes, dict):
                continue
            for field, level, name in ((2, max_rep, "repetition"), (3, max_def, "definition")):
                histogram = sizes.get(field)
                if isinstance(histogram, list) and histogram and len(histogram) != level + 1:
                    raise PageBoundsError(f"row group {rg} column {i}: its {name} level histogram has "
                                          f"{len(histogram)} entries, the column {level + 1}")
            if sizes.get(1) is not None and physical != 6:  # 6: BYTE_ARRAY
                raise PageBoundsError(f"row group {rg} column {i}: unencoded byte counts for a column that is "
                                      "not BYTE_ARRAY")


def read_footer_checked(path: str | Path) -> pq.FileMetaData:
    """The footer of a Parquet file, bounded (`check_footer`) before pyarrow decodes it and consistent
    after: every row group lists one column chunk per column of the schema. pyarrow terminates the
    process (a C++ exception it does not catch) when a row group's chunk beyond the schema is asked for,
    so no caller may look at a chunk before this check. PageBoundsError otherwise."""
    check_footer(path)
    meta = pq.read_metadata(path)
    for rg in range(meta.num_row_groups):
        listed = meta.row_group(rg).num_columns
        if listed != meta.num_columns:
            raise PageBoundsError(f"row group {rg} lists {listed:,} column chunks for the schema's "
                                  f"{meta.num_columns:,} column(s)")
    return meta


def check_pages(path: str | Path, meta: pq.FileMetaData | None = None, columns: Iterable[str] | None = None) -> None:
    """Refuse a Parquet file whose page headers claim more values or bytes than its footer (which the
    caller has checked against its limits): PageBoundsError naming the column, before any page is
    decompressed. `columns` (top-level names) limits the check to the columns that will be read."""
    wanted = None if columns is None else set(columns)
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if meta is None:
            meta = read_footer_checked(path)
        if size == 0:
            raise PageBoundsError("the file is empty")
        budget = [MAX_PAGES]
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for rg in range(meta.num_row_groups):
                group = meta.row_group(rg)
                for i in range(group.num_columns):
                    chunk = group.column(i)
                    if wanted is not None and chunk.path_in_schema.split(".")[0] not in wanted:
                        continue
                    try:
                        _check_chunk(buf, chunk, size, budget)
                    except PageBoundsError as exc:
                        raise PageBoundsError(f"column {chunk.path_in_schema} (row group {rg}): {exc}") from None
