"""Pending rows: device tensors queued by the signal families, turned into numpy columns at a flush.

The families (`workbench.signals`) count on the model's device with fixed, data-independent shapes,
and which raw rows are kept is decided from positions on the CPU (`select_rows`), so recording never
forces a device synchronisation inside the forward pass; the recorder copies the pending results
out when it flushes (`to_columns`).
"""

from __future__ import annotations

import numpy as np
import torch

Pending = dict[str, torch.Tensor]


def select_rows(keep: np.ndarray, **columns: torch.Tensor | None) -> Pending | None:
    """Rows `keep` (CPU indices) of every given [T, ...] tensor; None when nothing is kept."""
    if len(keep) == 0:
        return None
    out: Pending = {}
    for name, t in columns.items():
        if t is not None:
            out[name] = t[torch.as_tensor(keep, device=t.device)]
    return out


def to_columns(pending: Pending, drop_zero: str | None = None) -> dict:
    """Device tensors -> numpy columns (the copy happens here, at flush time); scalars stay scalars.
    With drop_zero, rows whose `drop_zero` column is 0 are dropped (dense counts -> sparse rows)."""
    cols = {name: t.detach().to("cpu").numpy() if isinstance(t, torch.Tensor) else t for name, t in pending.items()}
    if drop_zero is not None:
        nz = cols[drop_zero] != 0
        cols = {name: c[nz] if isinstance(c, np.ndarray) and c.ndim > 0 else c for name, c in cols.items()}
    return cols
