"""Shared fixtures: small random checkpoints in the real on-disk layout, written once per session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# one compute thread per process: tests spawn ranks, notebook kernels and servers beside pytest,
# and OpenMP threads spinning against each other on 2 cores can slow torch down 50-100x
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the dashboard's on-disk summaries of finished traces (`workbench/trace/summary_cache.py`, also written
# by `workbench run` when a recording ends) go to a temporary directory, never ~/.cache
os.environ["K3WB_DASHBOARD_CACHE"] = tempfile.mkdtemp(prefix="k3wb-test-summary-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import nan_poisoned_empty  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(42)


@pytest.fixture
def nan_poison():
    """Fresh `empty` floating tensors are NaN during the test (kernel and op tests opt in)."""
    with nan_poisoned_empty():
        yield


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: `checkpoint_dir("tiny", "k3.1", seed=0, dtype=torch.float32)` -> Path (cached)."""
    from engine.presets import get_preset
    from engine.weights.write import write_checkpoint

    cache: dict[tuple, Path] = {}

    def make(preset: str = "tiny", variant: str = "k3.1", seed: int = 0, dtype: torch.dtype = torch.float32,
             shards: int = 2) -> Path:
        key = (preset, variant, seed, dtype, shards)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{preset}-{variant}-{seed}")
            write_checkpoint(get_preset(preset, variant), out, seed=seed, shards=shards, float_dtype=dtype,
                             overwrite=True)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="module")
def demo():
    """(model, tokenizer) of the trained demo checkpoint `builtin:demo`, loaded once per test module (so what
    one module sets on the model, runtime options or weights, never reaches the next)."""
    from engine import load_model
    from engine.tokenizer import Tokenizer

    model = load_model("builtin:demo")
    return model, Tokenizer.for_model("builtin:demo", model.config.vocab_size)
