"""Named hook points (engine.hooks, docs/hooks.md): identity modules that read and edit, in chunked prefill and
in the eager decode step, and cost nothing (no call, an unchanged compiled step) when nothing is attached."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import load_model
from engine.cache import KDAState
from engine.decode.step import DecodeStep
from engine.errors import InputError
from engine.hooks import HookPoint, hook_points, hooks, module_paths
from engine.session import Session
from tests.helpers import random_ids

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny", seed=3)


def test_every_point_of_the_docs_table_exists_and_the_checkpoint_names_are_unchanged(model):
    points = hook_points(model)
    table = set(re.findall(r"^\| `([^`]+)` \|", DOCS.read_text(), flags=re.M))
    assert table, "docs/hooks.md has the name table"
    c = model.config
    for name in table:
        if "{i}" not in name:
            assert name in points, name
            continue
        layers = [i for i in range(c.num_hidden_layers) if f"{name.format(i=i)}" in points]
        assert layers, f"{name} exists in no layer"
    documented = {re.sub(r"^blocks\.\d+\.", "blocks.{i}.", n) for n in points}
    assert documented <= table, documented - table
    # identity modules hold nothing: the state_dict (the checkpoint's names) is as it was
    assert not any("hook" in key for key in model.state_dict())
    paths = module_paths(model)
    assert all(model.get_submodule(paths[n]) is p for n, p in points.items())


def test_points_are_plain_attributes_of_their_owners_and_a_reassigned_point_replaces_both_entries():
    # bind_points: `self.hook_*` is a dict hit, not nn.Module.__getattr__ (about 150 reads per eager decode step)
    model = load_model("preset:tiny", seed=3)
    owners = [m for m in model.modules() if any(isinstance(c, HookPoint) for c in m._modules.values())]
    assert owners
    for owner in owners:
        for name, child in owner._modules.items():
            if isinstance(child, HookPoint):
                assert vars(owner)[name] is child, name
    layer = model.model.layers[0]
    fresh = HookPoint("blocks.0.hook_resid_pre")
    layer.hook_resid_pre = fresh
    assert layer.hook_resid_pre is fresh and layer._modules["hook_resid_pre"] is fresh
    assert hook_points(model)["blocks.0.hook_resid_pre"] is fresh


def test_identity_hooks_leave_logits_bit_identical_and_see_every_position_once(model):
    x = torch.tensor([random_ids(40)])
    with torch.inference_mode():
        plain = model(x)
    seen: dict[str, list[int]] = {}

    def watch(module: HookPoint, args, out):
        if out.dim() == 3 and module.name != "blocks.0.kda.hook_state":
            seen.setdefault(module.name, []).extend(range(int(module.start), int(module.start) + out.shape[1]))

    names = [n for n in hook_points(model) if "kda.hook_state" not in n]
    s = Session(model, prefill_chunk=16)
    s.append(ids=x[0].tolist())
    with hooks(model, [(n, watch) for n in names]):
        s.prefill(return_logits=True)
        with torch.inference_mode():
            hooked = model(x)
    assert torch.equal(plain, hooked)  # the very same computation: bit for bit
    for name in ("hook_embed", "blocks.1.hook_resid_post", "blocks.2.attn.hook_out", "ln_final.hook_normalized"):
        assert seen[name][:40] == list(range(40)), name  # chunks of 16: each position once, in order
    assert not any(p.attached for p in hook_points(model).values())  # removed when the block ended


def test_an_edit_replaces_what_the_model_reads(model):
    x = torch.tensor([random_ids(24)])
    with torch.inference_mode():
        plain = model(x)
        with hooks(model, [("blocks.1.attn.hook_out", lambda m, a, out: torch.zeros_like(out))]):
            zeroed = model(x)
        with hooks(model, [("blocks.1.moe.hook_experts", lambda m, a, out: out.flip(-1))]):
            same_routes = model(x)  # the same experts in another order: the same sum up to rounding
        with hooks(model, [("blocks.1.moe.hook_experts", lambda m, a, out: (out + 1) % model.config.num_experts)]):
            rerouted = model(x)
    assert not torch.allclose(plain, zeroed)
    torch.testing.assert_close(same_routes, plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, rerouted)


def dsa_layer(model) -> int:
    return next(i for i in range(model.config.num_hidden_layers) if model.config.is_dsa_layer(i))


def test_a_forced_selection_is_read_even_below_top_k(model):
    layer = dsa_layer(model)
    x = torch.tensor([random_ids(20)])
    with torch.inference_mode():
        plain = model(x)
        # the selection as the indexer made it: the sparse read equals the dense one (every key fits)
        with hooks(model, [(f"blocks.{layer}.dsa.hook_selection", lambda m, a, out: out)]):
            same = model(x)
        # only the query's own key: another function of the context
        own = lambda m, a, out: torch.where(out == torch.arange(out.shape[1]).view(1, -1, 1), out, -1)
        with hooks(model, [(f"blocks.{layer}.dsa.hook_selection", own)]):
            narrowed = model(x)
    torch.testing.assert_close(same, plain, rtol=1e-4, atol=1e-4)  # latent vs expanded dense form, fp32
    assert not torch.allclose(narrowed, plain, atol=1e-3)


def kda_layer(model) -> int:
    return next(i for i in range(model.config.num_hidden_layers) if model.config.is_kda_layer(i))


def test_kda_state_is_shown_after_the_positions_asked_and_an_edit_is_the_state_read_on(model):
    layer = kda_layer(model)
    tokens = random_ids(50, seed=1)
    point = hook_points(model)[f"blocks.{layer}.kda.hook_state"]
    shown: dict[int, torch.Tensor] = {}
    point.positions = frozenset({9, 30})
    try:
        s = Session(model, prefill_chunk=16)
        s.append(ids=tokens)
        with hooks(model, [(point.name, lambda m, a, out: shown.update({int(m.start): out.clone()}))]):
            s.prefill()
    finally:
        point.positions = None
    assert sorted(shown) == [9, 30]
    for at in (9, 30):  # the state a session holds after consuming [0, at]
        ref = Session(model, prefill_chunk=16)
        ref.append(ids=tokens[: at + 1])
        ref.prefill()
        torch.testing.assert_close(shown[at], ref.state.layers[layer].recurrent, rtol=1e-5, atol=1e-5)

    # an edit after position 30 (head 0 erased) is what the rest reads: as if the session's state were edited
    def erase(m, a, out):
        out = out.clone()
        out[:, 0] = 0
        return out

    point.positions = frozenset({30})
    try:
        edited = Session(model, prefill_chunk=16)
        edited.append(ids=tokens)
        with hooks(model, [(point.name, erase)]):
            edited.prefill()
    finally:
        point.positions = None
    by_hand = Session(model, prefill_chunk=16)
    by_hand.append(ids=tokens)
    by_hand.prefill(until=31)
    state = by_hand.state.layers[layer]
    assert isinstance(state, KDAState)
    with torch.inference_mode():
        rec = state.recurrent.clone()
        rec[:, 0] = 0
        state.recurrent = rec
    by_hand.prefill()
    torch.testing.assert_close(edited.last_logits, by_hand.last_logits, rtol=1e-5, atol=1e-5)


def test_decode_with_a_hook_runs_eagerly_and_the_hook_sees_each_step(model):
    step = DecodeStep.of(model)
    model.runtime.compile = "static"
    try:
        assert step.mode(torch.device("cpu")) == "static"  # nothing attached: the step as before
        s = Session(model)
        s.append(ids=random_ids(12))
        starts: list[int] = []
        with hooks(model, [("blocks.0.hook_resid_post", lambda m, a, out: starts.append(int(m.start)))]):
            assert step.mode(torch.device("cpu")) == "off"
            list(s.generate(4, temperature=0, stop_ids=()))
        assert step.mode(torch.device("cpu")) == "static"
        assert starts == [0, 12, 13, 14]  # the prefill (one chunk from 0), then each decode step's position
    finally:
        model.runtime.compile = False


def test_hooks_are_removed_when_the_block_raises_and_unknown_names_are_one_line(model):
    with pytest.raises(RuntimeError):
        with hooks(model, [("hook_embed", lambda m, a, out: None)]):
            raise RuntimeError("boom")
    assert not hook_points(model)["hook_embed"].attached
    with pytest.raises(InputError, match="no hook point named 'blocks.99.hook_resid_post'"):
        with hooks(model, [("blocks.99.hook_resid_post", lambda m, a, out: None)]):
            pass
