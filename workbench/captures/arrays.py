"""Captured arrays: a base64 payload checked against the shape the model allows, then read a few rows at a time.

Two encodings reach us (docs/captures.md has the sources):
- `flat` (SGLang): the raw bytes of a row-major [rows, layers, width] integer array; the dtype comes
  from the response (`routed_experts_dtype`, int32 when absent), the row count from the token ids.
- `npy` (vLLM): a NumPy `.npy` file (header with dtype and shape, then the data); read with the
  standard header parser (a Python literal, never pickle) and `allow_pickle` never set.

Nothing sized from the payload is allocated before its size is checked: the decoded length follows from
the text length, the `.npy` header is decoded alone (a few hundred bytes), and rows are decoded in
chunks of `CHUNK_BYTES` by the importer (`RowArray.read`), so a capture of a million tokens never sits
decoded in memory at once.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import tokenize
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.errors import InputError

NPY_MAGIC = b"\x93NUMPY"
MAX_NPY_HEADER = 4096  # a 3-D integer array's header takes about 120 bytes; a longer one is not a capture
MAX_HEADER_BRACKETS = 4  # the header is a dict holding one shape tuple: the literal parser sees no deeper nesting
MAX_SHAPE_DIGITS = 20  # digits of one dimension (int64 at most)
WIRE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}  # SGLang's names
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@dataclass(frozen=True)
class RowArray:
    """A validated [rows, layers, width] integer array, still base64 text; `read` decodes a row range."""

    text: str
    offset: int  # byte offset of the first element in the decoded bytes (the `.npy` header length, or 0)
    dtype: np.dtype
    rows: int
    layers: int
    width: int
    where: str  # names the array in messages: "record 3: choices[0].routed_experts"

    @property
    def row_bytes(self) -> int:
        return self.layers * self.width * self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as [n, layers, width] in the payload's dtype (a view of the decoded bytes)."""
        first, last = self.offset + start * self.row_bytes, self.offset + stop * self.row_bytes
        lo, hi = first // 3, -(-last // 3)  # whole base64 quanta (3 bytes = 4 characters) around the range
        raw = base64.b64decode(self.text[4 * lo: 4 * hi])
        chunk = raw[first - 3 * lo: last - 3 * lo]
        return np.frombuffer(chunk, self.dtype).reshape(stop - start, self.layers, self.width)


def decoded_length(text: object, where: str) -> int:
    """Bytes the base64 `text` decodes to, computed without decoding; InputError for anything but base64."""
    if not isinstance(text, str):
        raise InputError(f"{where}: expected a base64 string, got {type(text).__name__}")
    if len(text) % 4:
        raise InputError(f"{where}: truncated base64 ({len(text):,} characters, not a multiple of 4)")
    if not _BASE64.fullmatch(text):
        bad = next(i for i, c in enumerate(text) if not (c.isascii() and (c.isalnum() or c in "+/=")) or
                   (c == "=" and i < len(text) - 2))
        raise InputError(f"{where}: not base64 (character {bad:,} is {text[bad]!r})")
    return len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))


def check_int_dtype(dtype: np.dtype, largest: int, what: str, where: str) -> None:
    """An integer dtype that can hold every value up to `largest`; else the capture overflowed or is not ids."""
    if dtype.kind not in "iu":
        raise InputError(f"{where}: {what} must be integers, got dtype {dtype}")
    if np.iinfo(dtype).max < largest:
        raise InputError(f"{where}: dtype {dtype} cannot hold {what} up to {largest:,} (the largest this model "
                         f"allows): the capture overflowed; capture with a wider dtype")


def flat_array(text: object, dtype_name: object, rows: int, layer_choices: Sequence[int], width: int, largest: int,
               what: str, where: str) -> RowArray:
    """SGLang's raw row-major bytes of `rows` rows: the layer count is whichever of `layer_choices` the size gives."""
    if dtype_name is None:
        dtype = WIRE_DTYPES["int32"]
    elif not isinstance(dtype_name, str) or dtype_name.strip().lower() not in WIRE_DTYPES:
        raise InputError(f"{where}: unknown dtype {dtype_name!r:.80}; SGLang sends one of {', '.join(WIRE_DTYPES)}")
    else:
        dtype = WIRE_DTYPES[dtype_name.strip().lower()]
    check_int_dtype(dtype, largest, what, where)
    size = decoded_length(text, where)
    if rows == 0 and size == 0:  # a one-token record: nothing was fed forward
        return RowArray(text, 0, dtype, 0, layer_choices[0], width, where)
    per_layer = rows * width * dtype.itemsize
    layers = next((n for n in layer_choices if per_layer and size == n * per_layer), None)
    if layers is None:
        shapes = " or ".join(f"[{rows:,}, {n}, {width}]" for n in layer_choices)
        raise InputError(f"{where}: {size:,} bytes of {dtype} is not a {shapes} array (rows from the token ids, "
                         f"layers and width from the model config): wrong model, a truncated payload or a "
                         f"different layout")
    return RowArray(text, 0, dtype, rows, layers, width, where)


def _check_header_text(header: str, where: str) -> None:
    """Refuse a `.npy` header the literal parser would choke on (deep nesting: tokenizer errors and
    recursion; a huge number: Python refuses past 4,300 digits) before handing it to the parser."""
    brackets = sum(header.count(c) for c in "{([")
    if brackets > MAX_HEADER_BRACKETS:
        raise InputError(f"{where}: .npy header holds {brackets:,} brackets; a header is a dict with one shape "
                         f"tuple ({MAX_HEADER_BRACKETS} at most)")
    longest = max((len(run) for run in re.findall(r"[0-9]+", header)), default=0)
    if longest > MAX_SHAPE_DIGITS:
        raise InputError(f"{where}: .npy header holds a number of {longest:,} digits; a dimension has at most "
                         f"{MAX_SHAPE_DIGITS}")


def npy_array(text: object, max_rows: int, layer_choices: Sequence[int], width: int, largest: int, what: str,
              where: str) -> RowArray:
    """vLLM's base64 `.npy` payload: its header checked (3-D, C order, integers, shape the model allows)."""
    size = decoded_length(text, where)
    head = base64.b64decode(text[: 4 * -(-min(size, 12) // 3)])[:12]
    if size < 10 or not head.startswith(NPY_MAGIC):
        raise InputError(f"{where}: not a base64 NumPy .npy payload (no NUMPY header)")
    major = head[6]
    if major not in (1, 2, 3):
        raise InputError(f"{where}: unknown .npy format version {major}")
    header_len = int.from_bytes(head[8:10], "little") if major == 1 else int.from_bytes(head[8:12], "little")
    offset = (10 if major == 1 else 12) + header_len
    if header_len > MAX_NPY_HEADER:
        raise InputError(f"{where}: .npy header of {header_len:,} bytes, more than the {MAX_NPY_HEADER:,} a 3-D "
                         f"integer array's header takes")
    if offset > size:
        raise InputError(f"{where}: .npy header of {header_len:,} bytes does not fit the payload (truncated?)")
    prefix = base64.b64decode(text[: 4 * -(-offset // 3)])[:offset]
    _check_header_text(prefix[offset - header_len:].decode("latin-1"), where)
    try:
        fp = io.BytesIO(prefix)
        version = np.lib.format.read_magic(fp)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = reader(fp, max_header_size=MAX_NPY_HEADER)
    except (ValueError, SyntaxError, TypeError, binascii.Error, tokenize.TokenError, RecursionError,
            MemoryError, OverflowError) as exc:
        raise InputError(f"{where}: unreadable .npy header ({' '.join(str(exc).split())[:160]})") from None
    if fortran:
        raise InputError(f"{where}: the .npy array is in Fortran order; expected C order (as vLLM writes it)")
    if dtype.hasobject or dtype.fields is not None:
        raise InputError(f"{where}: the .npy array holds {dtype}, not integers")
    check_int_dtype(dtype, largest, what, where)
    if len(shape) != 3:
        raise InputError(f"{where}: expected a [tokens, layers, {width}] array, got shape {list(shape)}")
    rows, layers, got_width = shape
    if rows < 0:
        raise InputError(f"{where}: shape {list(shape)} has a negative row count")
    if layers not in layer_choices or got_width != width:
        allowed = " or ".join(str(n) for n in layer_choices)
        raise InputError(f"{where}: shape {list(shape)} does not match the model config: expected {allowed} layers "
                         f"and width {width}")
    if rows > max_rows:
        raise InputError(f"{where}: {rows:,} rows but the record has only {max_rows:,} forwarded tokens")
    need = rows * layers * width * dtype.itemsize
    if size - offset != need:
        state = "truncated" if size - offset < need else "longer than its header says"
        raise InputError(f"{where}: the .npy data is {state} ({size - offset:,} bytes for shape {list(shape)} of "
                         f"{dtype}, {need:,} expected)")
    return RowArray(text, offset, dtype, rows, layers, width, where)


def encode_flat(array: np.ndarray, dtype: str = "int32") -> str:
    """A [rows, layers, width] array as SGLang sends it: base64 of its row-major bytes (little-endian)."""
    return base64.b64encode(np.ascontiguousarray(array, WIRE_DTYPES[dtype]).tobytes()).decode("ascii")


def encode_npy(array: np.ndarray, dtype: str = "int32") -> str:
    """A [rows, layers, width] array as vLLM sends it: base64 of a `.npy` file."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, np.dtype(dtype).newbyteorder("<")), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")
