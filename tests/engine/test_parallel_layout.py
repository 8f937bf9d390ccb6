"""The parallel layout without a process group: expert placement and dispatch maths, the shard
table, per-rank shapes, and sharded loading (bytes read per rank)."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.errors import ConfigError
from engine.parallel import ep
from engine.parallel.mesh import ParallelContext, check_divisible
from engine.presets import get_preset
from engine.weights.names import checkpoint_tensors, layer_tensors
from engine.weights.random_init import RandomSource
from engine.weights.safetensors_io import CheckpointFiles
from engine.weights.shard import SHARD_DIM, module_name, shard_dim, take_shard


def test_experts_are_placed_contiguously_once():
    ranges = [ep.expert_range(896, r, 8) for r in range(8)]
    assert [len(r) for r in ranges] == [112] * 8
    assert sorted(e for r in ranges for e in r) == list(range(896))
    ids = torch.tensor([[0, 111, 112, 895]])
    assert ep.owner_rank(ids, 896, 8).tolist() == [[0, 0, 1, 7]]


def test_local_route_masks_partition_every_route():
    ids = torch.randint(0, 16, (50, 4), generator=torch.Generator().manual_seed(42))
    masks = torch.stack([ep.local_route_mask(ids, 16, r, 4) for r in range(4)])
    assert torch.equal(masks.sum(0), torch.ones_like(ids))


def test_all_to_all_plan_round_trip():
    g = torch.Generator().manual_seed(42)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(37)])  # distinct experts per token
    plan = ep.all_to_all_plan(ids, 16, 4)
    hits = ep.ranks_per_token(ids, 16, 4)
    assert int(plan.send_counts.sum()) == int(hits.sum()) == plan.token.numel()
    assert bool((plan.dest[1:] >= plan.dest[:-1]).all())  # grouped by destination rank
    owners = ep.owner_rank(ids, 16, 4)
    for row in range(plan.token.numel()):  # each row goes to a rank holding one of its token's experts
        assert int(plan.dest[row]) in owners[plan.token[row]].tolist()
    x = torch.randn(37, 5, generator=g)
    back = ep.combine_rows(x[plan.token], plan, 37)
    torch.testing.assert_close(back, x * hits.unsqueeze(-1).float())


def test_expected_ranks_per_token_k31_pro():
    assert ep.expected_ranks_per_token(896, 16, 8) == pytest.approx(7.07, abs=0.01)
    assert ep.expected_ranks_per_token(16, 4, 1) == 1.0
    assert ep.ring_all_reduce_bytes(7168, 8) == 12544


def test_shard_table_names_real_modules_and_k31_pro_splits_over_8_and_16():
    config = get_preset("k3.1-pro")
    for world in (8, 16):
        check_divisible(config, world)
    # layer 0 (dense), 1 (KDA + MoE) and 3 (DSA + MoE) hold every kind of tensor; experts are not split
    specs = [s for layer in (0, 1, 3) for s in layer_tensors(config, layer) if s.expert is None]
    assert config.vocab_size % 16 == 0
    linear = [s for s in checkpoint_tensors(get_preset("tiny", "kimi-linear")) if s.expert is None]
    assert set(SHARD_DIM) <= {module_name(s.name) for s in specs + linear}  # no stale entries
    for spec in specs:
        dim = shard_dim(spec)
        if dim is not None and spec.init != "a_log":
            assert spec.shape[dim] % 8 == 0, spec.name
    split = {module_name(s.name) for s in specs if shard_dim(s) is not None}
    assert {"wq_b", "wk", "weights_proj", "routed_expert_down_proj", "gate", "q_a_proj"}.isdisjoint(split)


def test_indivisible_layouts_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="num_attention_heads=2"):
        load_model("preset:tiny", parallel=ParallelContext.layout(0, 8))


def test_shards_reassemble_the_full_tensors():
    config = get_preset("tiny-tp")
    source = RandomSource(config, seed=1)
    for spec in checkpoint_tensors(config, include_vision=False):
        dim = shard_dim(spec)
        if dim is None or spec.init == "a_log":
            continue
        full = source.get(spec)
        parts = [source.get_slice(spec, dim, *ParallelContext.layout(r, 4).local_range(spec.shape[dim]))
                 for r in range(4)]
        assert torch.equal(torch.cat(parts, dim), full), spec.name
        assert torch.equal(parts[2], take_shard(full, spec, 2, 4))


def test_per_rank_modules_hold_their_heads_experts_and_state():
    world = 4
    models = [load_model("preset:tiny-tp", parallel=ParallelContext.layout(r, world)) for r in range(world)]
    full = load_model("preset:tiny-tp")
    held = [e for m in models for e in m.model.layers[1].block_sparse_moe.experts.expert_ids]
    assert held == list(range(16))
    kda = models[1].model.layers[0].self_attn
    assert kda.num_heads == 2 and kda.q_proj.weight.shape == (16, 64)
    state = models[1].empty_state(1)
    assert state.layers[0].recurrent.shape == (1, 2, 8, 8) and state.layers[0].conv.shape == (1, 48, 3)
    assert state.layers[2].latent.shape == full.empty_state(1).layers[2].latent.shape  # MLA cache replicated
    rows = torch.cat([m.model.embed_tokens.weight for m in models])
    assert torch.equal(rows, full.model.embed_tokens.weight)
    a_log = torch.cat([m.model.layers[0].self_attn.A_log for m in models])
    assert torch.equal(a_log, full.model.layers[0].self_attn.A_log)


@pytest.mark.parametrize("world", [1, 4, 8])
def test_each_rank_reads_its_share_of_the_checkpoint(world, checkpoint_dir, monkeypatch):
    ckpt = checkpoint_dir("tiny-tp", "k3.1", seed=3)
    config = get_preset("tiny-tp")
    read: dict[str, int] = {}
    get, get_slice = CheckpointFiles.get, CheckpointFiles.get_slice

    def counting_get(self, name):
        t = get(self, name)
        read[name] = read.get(name, 0) + t.numel() * t.element_size()
        return t

    def counting_slice(self, name, dim, start, stop):
        t = get_slice(self, name, dim, start, stop)
        read[name] = read.get(name, 0) + t.numel() * t.element_size()
        return t

    read_into = CheckpointFiles.read_into

    def counting_read_into(self, name, dest):  # a whole tensor read straight into its parameter
        read_into(self, name, dest)
        read[name] = read.get(name, 0) + self.tensors[name].nbytes

    monkeypatch.setattr(CheckpointFiles, "get", counting_get)
    monkeypatch.setattr(CheckpointFiles, "get_slice", counting_slice)
    monkeypatch.setattr(CheckpointFiles, "read_into", counting_read_into)
    files = CheckpointFiles.open(ckpt)
    experts_total = sum(i.nbytes for n, i in files.tensors.items() if ".experts." in n)
    split_total = replicated_total = 0
    for spec in checkpoint_tensors(config, include_vision=False):
        if spec.expert is None:
            nbytes = files.tensors[spec.name].nbytes
            if shard_dim(spec) is None or spec.init == "a_log":
                replicated_total += nbytes
            else:
                split_total += nbytes
    for rank in range(world):
        read.clear()
        load_model(ckpt, parallel=ParallelContext.layout(rank, world))
        experts = sum(n for name, n in read.items() if ".experts." in name)
        assert experts == experts_total // world
        others = sum(n for name, n in read.items() if ".experts." not in name)
        assert others == replicated_total + split_total // world
