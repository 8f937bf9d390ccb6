"""`run_with_cache`: what named hook points saw, at the positions asked, within a memory bound.

The position filter runs inside each hook, on the chunk the prefill is running: a row outside the
positions asked is never copied, so caching 16 positions of a 128K-token prefill holds 16 rows per
point. What is kept goes to memory until the cache holds `max_bytes`; past that each further piece
(and what was already held of that point) is written to a safetensors part under `spill_dir`, and
the cache's entry for that point becomes a `Spilled` (its directory, its row positions, `load()`).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from engine.errors import InputError
from engine.hooks import HookPoint, hook_points, hooks
from engine.session import Session

# what a cache holds in memory before it spills (bytes); a 128K-token prefill with every layer's
# residual at 16 positions holds ~12 KB per point at demo size
DEFAULT_MAX_BYTES = 256 * 2**20
STATE_POINT = "kda.hook_state"


@dataclass
class Spilled:
    """A point's rows written to disk: `directory/part-NNNNN.safetensors`, each holding `rows` (the
    tensor, rows along dim 1 for per-token points and dim 0 for states) and `positions` (int64)."""

    directory: Path
    dim: int  # the rows' dimension: 1 for per-token points, 0 for states
    parts: int = 0

    def load(self) -> torch.Tensor:
        """Every part concatenated (holds it all in memory: read parts one by one for a long run)."""
        from safetensors.torch import load_file

        pieces = [load_file(str(self.directory / f"part-{i:05d}.safetensors"))["rows"] for i in range(self.parts)]
        return torch.cat(pieces, dim=self.dim) if pieces else torch.zeros(0)

    def positions(self) -> np.ndarray:
        from safetensors.torch import load_file

        return np.concatenate([load_file(str(self.directory / f"part-{i:05d}.safetensors"))["positions"].numpy()
                               for i in range(self.parts)]) if self.parts else np.zeros(0, np.int64)


class ActivationCache(dict):
    """name -> tensor (`[B, positions, ...]` for per-token points; `[positions, B, heads, K, V]` for
    `blocks.{i}.kda.hook_state`) or -> `Spilled`. `positions[name]`: the absolute position of each row."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: dict[str, np.ndarray] = {}

    def spilled(self) -> list[str]:
        return [name for name, value in self.items() if isinstance(value, Spilled)]


def expand_names(model: torch.nn.Module, names: Sequence[str] | str, layers: Iterable[int] | None = None) -> list[str]:
    """Full point names: a full name as is; a per-layer one (`hook_resid_post`, `kda.hook_state`) for every
    layer of `layers` (default all) that has it. InputError naming an unknown name or layer."""
    if isinstance(names, str):
        names = [names]
    if not names:
        raise InputError("names= must name at least one hook point (docs/hooks.md has the table)")
    points = hook_points(model)
    n_layers = model.config.num_hidden_layers
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        layers = [int(layers)]
    if layers is None:
        wanted = list(range(n_layers))
    else:
        wanted = []
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n_layers:
                raise InputError(f"layers= holds {layer!r:.40}; the model has layers 0..{n_layers - 1}")
            wanted.append(int(layer))
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise InputError(f"a hook point name must be text, got {type(name).__name__}")
        if name in points:
            out.append(name)
            continue
        per_layer = [f"blocks.{i}.{name}" for i in wanted if f"blocks.{i}.{name}" in points]
        if not per_layer:
            known = sorted({re.sub(r"^blocks\.\d+\.", "", n) for n in points})
            raise InputError(f"no hook point named {name!r:.80} (in the layers asked); names: {', '.join(known)}")
        out.extend(per_layer)
    return list(dict.fromkeys(out))


def position_set(positions: Iterable[int] | range | None, end: int) -> np.ndarray | None:
    """Sorted unique positions inside [0, end), or None for all; InputError for one outside."""
    if positions is None:
        return None
    if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool):
        positions = [int(positions)]
    try:
        arr = np.asarray(list(positions))
    except TypeError:
        raise InputError(f"positions= must be positions (integers), got {type(positions).__name__}") from None
    if arr.size == 0:
        raise InputError("positions= is empty: name at least one position")
    if arr.dtype.kind not in "iu":
        raise InputError(f"positions= must hold integer positions, got {arr.dtype}")
    if arr.min() < 0 or arr.max() >= end:
        raise InputError(f"positions= holds {int(arr.min() if arr.min() < 0 else arr.max())}; the run covers "
                         f"positions 0..{end - 1}")
    return np.unique(arr.astype(np.int64))


@dataclass
class RowCollector:
    """The rows one run keeps for each point, within the byte budget shared by all points."""

    wanted: np.ndarray | None
    max_bytes: int
    spill_dir: Path | None
    held: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = field(default_factory=dict)
    spilled: dict[str, Spilled] = field(default_factory=dict)
    bytes_held: int = 0

    def keep(self, name: str, positions: np.ndarray, rows: torch.Tensor) -> None:
        rows = rows.detach().to("cpu", copy=True)
        if name in self.spilled:
            self._write(name, positions, rows)
            return
        self.held.setdefault(name, []).append((positions, rows))
        self.bytes_held += rows.numel() * rows.element_size()
        while self.bytes_held > self.max_bytes and self.held:
            biggest = max(self.held, key=lambda n: sum(r.numel() * r.element_size() for _, r in self.held[n]))
            for pos, part in self.held.pop(biggest):
                self.bytes_held -= part.numel() * part.element_size()
                self._write(biggest, pos, part)

    def _write(self, name: str, positions: np.ndarray, rows: torch.Tensor) -> None:
        from safetensors.torch import save_file

        if self.spill_dir is None:
            self.spill_dir = Path(tempfile.mkdtemp(prefix="k3-cache-"))
        target = self.spilled.get(name)
        if target is None:
            target = self.spilled[name] = Spilled(self.spill_dir / name, 0 if name.endswith(STATE_POINT) else 1)
            target.directory.mkdir(parents=True, exist_ok=True)
        save_file({"rows": rows.contiguous(), "positions": torch.from_numpy(positions.copy())},
                  str(target.directory / f"part-{target.parts:05d}.safetensors"))
        target.parts += 1

    def hook(self, name: str, state: bool):
        shown = None if self.wanted is None else set(self.wanted.tolist())

        def fn(module: HookPoint, args: tuple, out: torch.Tensor) -> None:
            start = int(module.start)
            if state:  # one state, after position `start` (the layer splits there when positions are set)
                if shown is None or start in shown:
                    self.keep(name, np.array([start], np.int64), out.unsqueeze(0))
                return
            T = out.shape[1]
            if self.wanted is None:
                self.keep(name, np.arange(start, start + T), out)
                return
            lo, hi = np.searchsorted(self.wanted, [start, start + T])
            if hi > lo:
                picked = self.wanted[lo:hi]
                self.keep(name, picked, out[:, torch.from_numpy(picked - start).to(out.device)])
        return fn

    def result(self) -> ActivationCache:
        cache = ActivationCache()
        for name, parts in self.held.items():
            cache.positions[name] = np.concatenate([p for p, _ in parts])
            cache[name] = torch.cat([r for _, r in parts], dim=0 if name.endswith(STATE_POINT) else 1)
        for name, spilled in self.spilled.items():
            cache[name] = spilled
            cache.positions[name] = spilled.positions()
        return cache


def run_with_cache(session: Session, names: Sequence[str] | str, positions: Iterable[int] | None = None,
                   layers: Iterable[int] | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                   spill_dir: str | Path | None = None) -> ActivationCache:
    """Prefill the session's pending tokens (in its chunks) while caching what the named points see.

    Args:
        names: hook point names (docs/hooks.md), full (`blocks.3.hook_resid_post`) or per layer
            (`hook_resid_post`, `kda.hook_state`: every layer of `layers` that has the point).
        positions: absolute positions whose rows are kept (default: every pending position); a KDA state
            point keeps the state after each of them (default: after the last position only).
        max_bytes: what the cache holds in memory; past it, the largest points spill to `spill_dir`
            (default: a new temporary directory) as safetensors parts.

    With nothing pending, the session's consumed tokens are replayed in a fresh session of the same
    model (the session itself is left as it is). Returns an `ActivationCache`.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise InputError(f"max_bytes= must be a non-negative number of bytes, got {max_bytes!r:.40}")
    model = session.model
    full = expand_names(model, names, layers)
    run = session if session.pending else replay(session)
    wanted = position_set(positions, len(run.tokens))
    if wanted is not None and wanted.min() < run.length:
        raise InputError(f"positions= holds {int(wanted.min())}, before the pending tokens (from {run.length}): "
                         "those were run already")
    collector = RowCollector(wanted, max_bytes, Path(spill_dir) if spill_dir is not None else None)
    points = hook_points(model)
    states = [points[n] for n in full if n.endswith(STATE_POINT)]
    # a state is [B, heads, K, V] per layer (6.3 MB at K3 size): by default only the run's last one is kept
    shown = frozenset([len(run.tokens) - 1] if wanted is None else wanted.tolist())
    for point in states:
        point.positions = shown
    try:
        with hooks(model, [(n, collector.hook(n, n.endswith(STATE_POINT))) for n in full]):
            run.prefill()
    finally:
        for point in states:
            point.positions = None
    return collector.result()


def replay(session: Session) -> Session:
    """A fresh session of the same model holding `session`'s consumed tokens as pending (its
    interventions too), for a tool that must watch positions already run."""
    if not session.tokens:
        raise InputError("the session is empty: append a prompt first")
    if any(seg.modality == "image" for seg in session.segments):
        raise InputError("replaying a session with images is not supported: run the tool before prefilling it")
    fresh = Session(session.model, session.tokenizer, prefill_chunk=session.prefill_chunk, progress=session.progress)
    fresh.append(ids=session.tokens[: session.length], name="replay")
    if session.interventions:
        fresh.set_interventions(list(session.interventions))
    return fresh


__all__ = ["ActivationCache", "Spilled", "run_with_cache", "expand_names", "position_set", "replay",
           "DEFAULT_MAX_BYTES"]
