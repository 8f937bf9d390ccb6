"""Read an Arrow IPC file received with a trace (a summary) within a row limit, allocating nothing first.

    read_bounded(path, max_rows) -> pa.Table     raises BoundsError when the file breaks a limit

The file size alone bounds nothing: a compressed record batch of a few hundred KB can decompress to
gigabytes, and reading it is what allocates them. So the file is read message by message, and each
record batch's header (its row count, every column's length, whether its body is compressed) is
checked before the batch is decoded. Only uncompressed bodies are accepted (the dashboard never writes
compressed summaries); read from a memory map, an uncompressed body is used in place, so what a file
can make the reader hold is bounded by the file's size. Dictionary batches are refused too (no
summary has one). The header is a flatbuffer (Arrow's `Message.fbs`), read here field by field.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pyarrow as pa

_MAGIC = b"ARROW1"
_RECORD_BATCH = 3  # MessageHeader union: Schema 1, DictionaryBatch 2, RecordBatch 3
MAX_FIELDS = 64  # fields of a summary's schema, nested ones included (a summary has a few columns)
VALUES_PER_ROW_LIMIT = 8  # values of all columns together, per value one column may hold


class BoundsError(ValueError):
    """An Arrow file that breaks a limit or cannot be read; the message says which."""


class _Table:
    """A flatbuffer table at `pos` of `buf`: its fields by index (the vtable says where each is)."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - _i32(buf, pos)
        self.vtable_size = _u16(buf, self.vtable)

    def _field(self, index: int) -> int | None:
        slot = 4 + 2 * index
        if slot + 2 > self.vtable_size:
            return None
        offset = _u16(self.buf, self.vtable + slot)
        return self.pos + offset if offset else None

    def scalar(self, index: int, fmt: str, default: int = 0) -> int:
        at = self._field(index)
        return default if at is None else struct.unpack_from("<" + fmt, self.buf, at)[0]

    def table(self, index: int) -> "_Table | None":
        at = self._field(index)
        return None if at is None else _Table(self.buf, at + _u32(self.buf, at))

    def vector(self, index: int) -> tuple[int, int]:
        """(position of the first element, element count) of a vector field; (0, 0) when absent."""
        at = self._field(index)
        if at is None:
            return 0, 0
        start = at + _u32(self.buf, at)
        return start + 4, _u32(self.buf, start)


def _u16(buf: bytes, at: int) -> int:
    return struct.unpack_from("<H", buf, at)[0]


def _u32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _i32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<i", buf, at)[0]


def _check_batch(metadata: bytes, max_rows: int) -> int:
    """Refuse a record batch message whose header is compressed or claims more than `max_rows` per column;
    returns the values its columns claim together (every field node's length: a list's items too)."""
    message = _Table(metadata, _u32(metadata, 0))
    kind = message.scalar(1, "B")
    if kind != _RECORD_BATCH:
        raise BoundsError(f"holds a message of type {kind}; a summary holds only record batches")
    batch = message.table(2)
    if batch is None:
        raise BoundsError("a record batch message has no header")
    if batch.table(3) is not None:
        raise BoundsError("its record batches are compressed; summaries are written uncompressed")
    rows = batch.scalar(0, "q")
    start, count = batch.vector(1)  # FieldNode structs: (length int64, null_count int64)
    if count > len(metadata) // 16:
        raise BoundsError("a record batch header is malformed")
    lengths = [struct.unpack_from("<q", metadata, start + 16 * i)[0] for i in range(count)]
    longest = max([rows] + lengths)
    if rows < 0 or longest > max_rows:
        raise BoundsError(f"a record batch claims {longest:,} rows, more than the {max_rows:,} allowed")
    if min(lengths, default=0) < 0:
        raise BoundsError("a record batch header is malformed")
    return sum(lengths) + rows


def _nested_fields(kind: pa.DataType) -> int:
    """Fields nested inside a type (a list's item, a struct's members, ...), counted to any depth."""
    return sum(1 + _nested_fields(kind.field(i).type) for i in range(kind.num_fields))


def _next(reader: pa.ipc.MessageReader) -> pa.ipc.Message | None:
    try:
        return reader.read_next_message()
    except StopIteration:  # the end-of-stream marker
        return None


def read_bounded(path: str | Path, max_rows: int) -> pa.Table:
    """The table in the Arrow IPC file at `path`, if no record batch column holds more than `max_rows`
    values, all columns together no more than `VALUES_PER_ROW_LIMIT` times that, the schema no more than
    `MAX_FIELDS` fields, no body is compressed, and the batches decode whole (BoundsError otherwise).

    Why the total: a column of the null type (or run-end encoded) has no buffers, so the file size
    does not bound it; 2,000 such columns of a million rows each take 200 KB and cost 16 GB to
    convert to NumPy."""
    with pa.memory_map(str(path)) as source:
        data = source.read_buffer()
    if data.size < 16 or data[:6].to_pybytes() != _MAGIC:
        raise BoundsError("not an Arrow IPC file")
    try:
        # the file format is the stream format after the 8-byte magic, followed by a footer that the
        # stream's end-of-stream marker keeps the message reader from
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(data.slice(8)))
        schema_message = _next(reader)
        if schema_message is None or schema_message.type != "schema":
            raise BoundsError("does not start with a schema")
        schema = pa.ipc.read_schema(schema_message)
        fields = len(schema.names) + sum(_nested_fields(f.type) for f in schema)
        if fields > MAX_FIELDS:
            raise BoundsError(f"its schema holds {fields:,} fields, more than the {MAX_FIELDS:,} a summary may")
        batches, rows, values = [], 0, 0
        while (message := _next(reader)) is not None:
            values += _check_batch(message.metadata.to_pybytes(), max_rows - rows)
            if values > VALUES_PER_ROW_LIMIT * max_rows:
                raise BoundsError(f"its columns claim {values:,} values together, more than the "
                                  f"{VALUES_PER_ROW_LIMIT * max_rows:,} allowed")
            batch = pa.ipc.read_record_batch(message, schema)
            batch.validate()  # buffers as long as the lengths claim (no full scan of the values)
            rows += batch.num_rows
            batches.append(batch)
    except (pa.ArrowException, OSError, struct.error, IndexError) as exc:
        raise BoundsError(f"cannot be read: {str(exc)[:200]}") from None
    return pa.Table.from_batches(batches, schema)
