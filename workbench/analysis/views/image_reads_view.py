"""The image part of the DSA memory map: the real picture and what each DSA layer read per merged patch.

- picture: the segment's thumbnail from the trace (`workbench.trace.thumbnail_files`), downscaled on the
  server to the figure (SCREEN_SIDE px), as RGBA ready for Bokeh; the full-resolution pixels are never read;
- token: `workbench.analysis.patch_reads` of the selected query's top-k rows;
- answer: the same over every query of the latest generated segment (the answer so far).

Both carry every layer (the component picks one or sums them without asking the server again) and
the chance values of the same queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from workbench.analysis import PatchReads, image_grid, patch_reads
from workbench.trace import Trace, TraceError
from workbench.trace.thumbnail_files import read_thumbnail

from workbench.trace import summary_cache
from workbench.analysis.views.base import Reducer
from workbench.analysis.views.session_map import RecordingMapData

# longest side, in screen pixels, of the picture sent to the browser
SCREEN_SIDE = 360
PATCH_PX = 14  # pixels per tower patch side (MoonViT-V2; the segment records the grids, not this)


@dataclass(frozen=True, eq=False)
class ImageReadsData:
    """One image's picture and patch reads (None fields: not available yet)."""

    image_id: int
    name: str
    grid: tuple[int, int]  # merged patches (rows, cols)
    images: tuple[tuple[int, str], ...]  # (segment id, name) of every image segment, for the picker
    picture: np.ndarray | None = None  # uint32 RGBA [h, w], row 0 at the bottom (Bokeh's image_rgba)
    covers: tuple[float, float] = (0.0, 0.0)  # (cols, rows) of the grid the picture covers (the rest is padding)
    problem: str = ""  # why there is no picture (no thumbnail recorded, unreadable file)
    token: PatchReads | None = None  # reads of the selected query
    token_position: int | None = None
    answer: PatchReads | None = None  # reads of every query of the answer
    answer_range: tuple[int, int] | None = None  # inclusive query positions of the answer


def image_segments(session: RecordingMapData) -> list[dict]:
    return [g for g in session.segments if g["kind"] == "image"]


def screen_picture(trace: Trace, segment: dict) -> tuple[np.ndarray | None, str]:
    """(uint32 RGBA picture at screen size, row 0 at the bottom, or None; the reason when None)."""
    try:
        im = read_thumbnail(trace.path, segment, SCREEN_SIDE)
    except TraceError as exc:
        return None, str(exc)
    if im is None:
        return None, "no thumbnail recorded for this image"
    rgba = np.ascontiguousarray(np.asarray(im, dtype=np.uint8)[::-1])
    return rgba.view(np.uint32).reshape(rgba.shape[:2]), ""


def picture_cover(segment: dict, grid: tuple[int, int]) -> tuple[float, float]:
    """(cols, rows) of merged patches the picture itself covers: the tower pads right and bottom to whole
    merge windows (28 px), so the grid's last column and row may be partly padding."""
    info = segment.get("image") or {}
    try:
        width = float(info.get("resized_width", info["width"]))
        height = float(info.get("resized_height", info["height"]))
        kx = float(info.get("patch_cols", 2 * grid[1])) / max(grid[1], 1)  # patches per merged cell
        ky = float(info.get("patch_rows", 2 * grid[0])) / max(grid[0], 1)
        cover = (width / (PATCH_PX * kx), height / (PATCH_PX * ky))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return float(grid[1]), float(grid[0])
    if not (0 < cover[0] <= grid[1] + 1e-6 and 0 < cover[1] <= grid[0] + 1e-6):
        return float(grid[1]), float(grid[0])  # not the tower's layout (another patch size): fill the grid
    return cover


def answer_range(session: RecordingMapData) -> tuple[int, int] | None:
    """Inclusive query positions of the latest generated segment (the recorder may run ahead of its end)."""
    spans = [(int(g["start"]), int(g["end"])) for g in session.segments if g["kind"] == "generated"]
    if not spans:
        return None
    start, end = spans[-1]
    return start, max(end, session.tokens) - 1


class ImageReadsReducer(Reducer[ImageReadsData]):
    """Used by the DSA map's reducer: `reduce(trace, options, session)` -> ImageReadsData or None."""

    data_type = ImageReadsData

    def reduce(self, trace: Trace, options, session: RecordingMapData) -> ImageReadsData | None:
        images = image_segments(session)
        if not images:
            return None
        chosen = next((g for g in images if g["id"] == options.image_id), images[-1])
        image_id = int(chosen["id"])
        tokens = self.memo("tokens", (tuple(trace.parts("tokens")),), lambda: _image_tokens(trace))
        grid = image_grid(tokens, image_id, chosen)
        picture, problem = self.memo("picture", (image_id, chosen.get("thumbnail"), str(chosen.get("image"))),
                                     lambda: screen_picture(trace, chosen))
        n_topk = len(trace.parts("dsa_topk"))
        token = None
        if options.position is not None and grid[0] * grid[1] > 0:
            token = self.memo("token", (image_id, options.position, n_topk, id(tokens)),
                              lambda: patch_reads(trace.topk_for(options.position), tokens, image_id, grid))
        span = answer_range(session)
        answer = None
        if span is not None and grid[0] * grid[1] > 0:
            answer = self.memo("answer", (image_id, span, n_topk, id(tokens)),
                               lambda: _answer_reads(trace, tokens, image_id, grid, span))
        return self.result(image_id=image_id, name=str(chosen.get("name") or f"image {image_id}"), grid=grid,
                           images=tuple((int(g["id"]), str(g.get("name") or f"image {g['id']}")) for g in images),
                           picture=picture, covers=picture_cover(chosen, grid), problem=problem, token=token,
                           token_position=options.position if token is not None else None,
                           answer=answer, answer_range=span)


def _answer_reads(trace: Trace, tokens, image_id: int, grid: tuple[int, int], span: tuple[int, int]) -> PatchReads:
    """`patch_reads` over the answer's queries; a finished trace's result is kept in the summary cache
    (reading the answer's top-k rows is most of a warm reopen of a long trace)."""
    cache_key = summary_cache.key(trace, ("dsa_topk", "tokens"), [image_id, list(grid), list(span)])
    cached = patch_reads_from_json(summary_cache.load_json(cache_key, "image_answer_reads"), image_id, grid)
    if cached is not None:
        return cached
    rows = trace.table("dsa_topk", columns=["layer", "position", "selected"], positions=span)
    reads = patch_reads(rows, tokens, image_id, grid, queries=span)
    summary_cache.save_json(cache_key, "image_answer_reads", patch_reads_json(reads))
    return reads


def patch_reads_json(reads: PatchReads) -> dict:
    return {"image_id": reads.image_id, "grid": list(reads.grid), "layers": list(reads.layers),
            "counts": reads.counts.reshape(len(reads.layers), -1).tolist(), "queries": reads.queries.tolist(),
            "picks": reads.picks.tolist(), "expected": reads.expected.tolist(), "log_miss": reads.log_miss.tolist()}


def patch_reads_from_json(value: object, image_id: int, grid: tuple[int, int]) -> PatchReads | None:
    """A cached `PatchReads`, checked field by field against the image it must describe (None: recompute)."""
    if not isinstance(value, dict) or value.get("image_id") != image_id or value.get("grid") != list(grid):
        return None
    layers = value.get("layers")
    if not isinstance(layers, list) or not all(type(l) is int for l in layers):
        return None
    n, cells = len(layers), int(grid[0] * grid[1])
    try:
        counts = np.asarray(value["counts"], dtype=np.int64)
        queries, picks = np.asarray(value["queries"], dtype=np.int64), np.asarray(value["picks"], dtype=np.int64)
        expected, log_miss = np.asarray(value["expected"], dtype=np.float64), np.asarray(value["log_miss"], np.float64)
    except (KeyError, TypeError, ValueError):
        return None
    if counts.shape != (n, cells) or log_miss.shape != (n, cells) or not (
            queries.shape == picks.shape == expected.shape == (n,)):
        return None
    return PatchReads(image_id, (int(grid[0]), int(grid[1])), tuple(layers), counts.reshape(n, *grid), queries,
                      picks, expected, log_miss)


def _image_tokens(trace: Trace):
    """Image rows of the token table (position, image_id, patch_row, patch_col)."""
    # filtered in Arrow: a long table's modality column turned into Python strings is slow
    tok = trace.table("tokens", columns=["position", "modality", "image_id", "patch_row", "patch_col"])
    return tok.filter(pc.equal(tok["modality"].cast(pa.string()), "image")).to_pandas()
