"""Loading reads each tensor from the file straight into its parameter: the values are the memory
map's, no mapping of the shards stays behind, and a prefill's logits are held once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import load_model
from engine.session import Session
from engine.weights import load as load_module


def _mapped_files() -> set[str]:
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if len(line.split()) >= 6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["kimi-linear", "k3.1"])
def test_direct_read_equals_the_memory_map(checkpoint_dir, monkeypatch, dtype, variant):
    ckpt = checkpoint_dir("tiny", variant, seed=5, dtype=dtype)
    direct = load_model(ckpt)
    monkeypatch.setattr(load_module.CheckpointSource, "read_into", lambda self, spec, dest: 0)
    mapped = load_model(ckpt)
    a, b = direct.state_dict(), mapped.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_no_shard_stays_mapped_after_loading(checkpoint_dir):
    ckpt = checkpoint_dir("tiny", "kimi-linear", seed=5, dtype=torch.float32)
    model = load_model(ckpt)
    shards = {str(p.resolve()) for p in ckpt.glob("*.safetensors")}
    assert shards and not shards & _mapped_files()
    assert model.lm_head.weight.abs().sum() > 0


def test_prefill_logits_are_held_once():
    model = load_model("preset:tiny:kimi-linear", seed=1)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    chunked = Session(model, prefill_chunk=16)
    chunked.append(ids=ids)
    logits = chunked.prefill(return_logits=True)
    assert logits.shape == (40, model.config.vocab_size)
    assert logits.is_contiguous() and logits.untyped_storage().nbytes() == logits.numel() * 4  # one buffer
    # the session's last logits are their own row, not a view keeping every position alive
    assert torch.equal(chunked.last_logits, logits[-1])
    assert chunked.last_logits.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    # the chunks' rows are each chunk's own forward: equal to running the chunks one by one
    by_hand = Session(model, prefill_chunk=16)
    rows = []
    for a in range(0, 40, 16):
        by_hand.append(ids=ids[a:a + 16])
        rows.append(by_hand.prefill(return_logits=True))
    assert torch.equal(logits, torch.cat(rows))
