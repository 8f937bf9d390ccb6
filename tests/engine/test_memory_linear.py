"""No [T, T] tensor on the DSA path: the largest tensor a prefill creates grows linearly with T.

A `TorchDispatchMode` sees every tensor any aten op returns during a full causal forward of the
tiny K3.1 preset (top-k 16) at T and 4T, both far above top-k. It records the largest storage
(bytes actually allocated, so expanded views do not count) created inside the DSA layers and in
the whole forward. Linear memory grows 4x from T to 4T; one [T, T] score matrix would grow 16x.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine import load_model

T = 1024  # block sizes are budget-capped at this length already, so growth from here on is the law


class LargestTensor(TorchDispatchMode):
    """Tracks the largest storage returned by any op, overall and while `in_dsa` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.in_dsa = False
        self.largest = {"dsa": (0, ""), "model": (0, "")}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                size = t.untyped_storage().nbytes()
                where = ["model", "dsa"] if self.in_dsa else ["model"]
                for key in where:
                    if size > self.largest[key][0]:
                        self.largest[key] = (size, f"{func} -> {list(t.shape)}")
        return out


def largest_tensors(model, length: int) -> dict[str, tuple[int, str]]:
    mode = LargestTensor()

    def enter(*_args) -> None:
        mode.in_dsa = True

    def leave(*_args) -> None:
        mode.in_dsa = False

    dsa_layers = [layer.self_attn for layer in model.model.layers if getattr(layer.self_attn, "indexer", None)]
    handles = [h for m in dsa_layers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(42))
    try:
        with torch.no_grad(), mode:
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return mode.largest


@pytest.fixture(scope="module")
def measurements():
    model = load_model("preset:tiny", seed=42)
    assert model.config.dsa is not None and T > 4 * model.config.dsa.topk
    return {n: largest_tensors(model, n) for n in (T, 4 * T)}


@pytest.mark.parametrize("scope", ["dsa", "model"])
def test_largest_tensor_grows_linearly(measurements, scope: str) -> None:
    (small, small_op), (large, large_op) = measurements[T][scope], measurements[4 * T][scope]
    ratio = large / small
    # linear: 4; a [T, T] tensor: 16. Headroom for block sizes that reach their caps differently
    assert ratio <= 6, f"largest {scope} tensor grew {ratio:.1f}x from T={T} to {4 * T}: {small_op} -> {large_op}"
    # and at 4T no single tensor is as large as one [4T, 4T] fp32 matrix (64 MB)
    assert large < (4 * T) ** 2 * 4, f"{large_op}: {large / 2**20:.0f} MB"
