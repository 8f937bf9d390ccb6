"""Issue 42 items 8-11: intervention specs that ran wrongly, cost without bound or raised a raw traceback.

- a `moe.ban` (or several together) that leaves a token fewer experts than it routes to is refused before
  anything runs, naming the layer and the counts (item 8);
- a spec's cost is bounded by its entries and the ids it names, not only by its bytes (item 9);
- positions past int64 are one clear line, not `ValueError: Overflow` (item 10);
- an identity intervention (`kda.scale` by 1) leaves the logits bit-identical (item 11).
"""

from __future__ import annotations

import json
import resource

import pytest
import torch

from apps.cli import main
from engine import load_model
from engine.errors import InputError
from engine.interventions import MAX_INTERVENTIONS, MAX_SPEC_IDS, InterventionPlan, parse_interventions
from engine.session import Session
from tests.helpers import decode_logits

# tiny k3.1: layers 0 1 3 4 are KDA (2 heads), 2 and 5 DSA; 1-5 MoE (8 experts, 2 per token)


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny:k3.1", seed=1)


def ids_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def refused(model, spec, *words: str) -> str:
    """The one-line InputError `spec` gets from a session that is left as it was."""
    s = Session(model, progress=False)
    s.append(ids=ids_of(8))
    with pytest.raises(InputError) as info:
        s.set_interventions(spec)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert s.interventions == () and s.intervention_log == []
    return message


# ---- item 8: a ban must leave a token enough experts -----------------------------------------------------

@pytest.mark.parametrize("spec, words", [
    ([{"op": "moe.ban", "experts": list(range(8))}], ["MoE layer 1", "8 of its 8 experts", "leaving 0", "uses 2"]),
    ([{"op": "moe.ban", "experts": list(range(7)), "layers": [3]}], ["MoE layer 3 ", "leaving 1", "ban at most 6"]),
    # two bans that overlap only over [10, 20): refused there, named both
    ([{"op": "moe.ban", "experts": [0, 1, 2, 3], "positions": [0, 20]},
      {"op": "moe.ban", "experts": [4, 5, 6], "positions": [10, 40], "layers": [2]}],
     ["interventions 0 (moe.ban), 1 (moe.ban)", "MoE layer 2", "from position 10", "leaving 1"]),
    # forces of two entries together exceed what a token uses
    ([{"op": "moe.force", "experts": [1, 2]}, {"op": "moe.force", "experts": [3], "layers": [5]}],
     ["MoE layer 5", "3 experts are forced", "uses 2"]),
])
def test_a_ban_that_leaves_too_few_experts_is_refused(model, spec, words) -> None:
    refused(model, spec, *words)


@pytest.mark.parametrize("spec", [
    [{"op": "moe.ban", "experts": list(range(6))}],  # 2 left: exactly top-k
    [{"op": "moe.ban", "experts": [0, 1, 2, 3], "positions": [0, 10]},
     {"op": "moe.ban", "experts": [4, 5, 6], "positions": [10, 40]}],  # adjacent, never together
    [{"op": "moe.ban", "experts": list(range(7))}, {"op": "moe.force", "experts": [0]}],  # a forced one routes
    [{"op": "moe.ban", "experts": list(range(6)), "layers": [1]}, {"op": "moe.ban", "experts": [6, 7], "layers": [2]}],
])
def test_bans_that_leave_enough_experts_run(model, spec) -> None:
    s = Session(model, progress=False)
    s.append(ids=ids_of(12))
    s.set_interventions(spec)
    assert torch.isfinite(s.prefill(return_logits=True)).all()


def test_cli_refuses_a_full_ban_before_anything_runs(tmp_path, capsys) -> None:
    spec = tmp_path / "ban.json"
    spec.write_text(json.dumps([{"op": "moe.ban", "experts": list(range(8)), "layers": "all"}]))
    trace = tmp_path / "trace"
    assert main(["run", "--model", "preset:tiny", "--prompt", "hello", "--max-new-tokens", "2",
                 "--intervene", str(spec), "--trace", str(trace)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "MoE layer 1" in err[0] and "leaving 0" in err[0], err
    assert not trace.exists()  # refused before the trace was created
    (tmp_path / "ids.json").write_text("[[1, 2, 3]]")
    out = tmp_path / "logits.safetensors"
    assert main(["logits", "--model", "preset:tiny", "--input-ids", str(tmp_path / "ids.json"), "--out", str(out),
                 "--intervene", str(spec)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "MoE layer 1" in err[0] and "leaving 0" in err[0], err
    assert not out.exists()


# ---- item 9: the cost of a spec ------------------------------------------------------------------------

def test_entry_count_and_named_ids_are_bounded(model) -> None:
    many = [{"op": "moe.ban", "experts": [i % 6], "positions": [i, i + 1]} for i in range(MAX_INTERVENTIONS + 1)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(model, many, f"holds {MAX_INTERVENTIONS + 1} entries", f"at most {MAX_INTERVENTIONS}")
    refused(model, json.dumps(many * 20), "holds", "entries")  # 20K entries, under the spec file's byte limit
    long_list = [{"op": "moe.ban", "experts": [0] * (MAX_SPEC_IDS + 1)}]
    assert "at most" in refused(model, long_list, "experts must be")
    spread = [{"op": "moe.ban", "experts": list(range(4000)), "layers": [1]}] * 20  # 80K ids over 20 entries
    refused(model, spread, "names 80020 layer, head and expert ids")
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown < 200, f"refusing the specs raised the peak RSS by {grown:.0f} MiB"


def test_the_largest_spec_costs_the_forward_little(model) -> None:
    """MAX_INTERVENTIONS entries on one layer: the route masks are [tokens, experts], never [tokens, entries,
    experts]; repeated entries count once; the answer equals the same bans given once each."""
    spec = [{"op": "moe.ban", "experts": [i % 6], "layers": [1], "positions": [i % 40, i % 40 + 3]}
            for i in range(MAX_INTERVENTIONS)]
    plan = InterventionPlan(parse_interventions(spec), model.config)
    assert plan.moe[1].ban.shape[0] <= 64  # 40 distinct ranges (padded), not 1024 rows
    unique = list({json.dumps(e): e for e in spec}.values())
    ids = ids_of(48, 3)
    assert torch.equal(decode_logits(model, ids, 40, False, spec=spec), decode_logits(model, ids, 40, False, spec=unique))


# ---- item 10: positions past int64 -------------------------------------------------------------------

@pytest.mark.parametrize("entry", [
    {"op": "dsa.hide", "positions": [0, 2 ** 63]},
    {"op": "kda.suppress_writes", "positions": [2 ** 64, 2 ** 65]},
    {"op": "moe.ban", "experts": [1], "positions": [0, 10 ** 30]},
    {"op": "kda.erase", "at": 2 ** 63},
    {"op": "dsa.hide", "positions": [0, 4], "layers": [2 ** 70]},
    {"op": "kda.erase", "at": 1, "heads": [2 ** 64]},
    {"op": "moe.ban", "experts": [2 ** 63]},
    {"op": "dsa.hide", "positions": [0.5, 4]},
    {"op": "dsa.hide", "positions": [True, 4]},
    {"op": "kda.scale", "at": 1, "factor": True},
    {"op": "kda.scale", "at": 1, "factor": 10 ** 400},
    {"op": "kda.scale", "at": 1, "factor": 1e308},  # finite, but an infinite state: refused, not a NaN forward
    {"op": "kda.scale", "at": 1, "factor": -1e7},
    {"op": "dsa.hide", "positions": [0, 4], "layers": "ALL"},
    {"op": "dsa.hide", "positions": [0, 4], "layers": ["all"]},
    {"op": "kda.erase", "at": -1},
])
def test_huge_or_mistyped_values_are_one_line(model, entry) -> None:
    refused(model, [entry], "intervention 0")


def test_an_end_past_the_limit_runs_to_the_end(model) -> None:
    """[0, 2**63 - 1] is a valid range (end exclusive): it means every position."""
    ids = ids_of(20, 4)
    far = [{"op": "dsa.hide", "positions": [3, 2 ** 63 - 1]}]
    near = [{"op": "dsa.hide", "positions": [3, model.config.max_position_embeddings]}]
    assert torch.equal(decode_logits(model, ids, 16, False, spec=far), decode_logits(model, ids, 16, False, spec=near))


def test_logits_cli_with_a_huge_position_is_one_line(tmp_path, capsys) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text('[{"op": "dsa.hide", "positions": [0, 9223372036854775808]}]')
    (tmp_path / "ids.json").write_text("[[1, 2, 3]]")
    assert main(["logits", "--model", "preset:tiny", "--input-ids", str(tmp_path / "ids.json"), "--out",
                 str(tmp_path / "out.safetensors"), "--intervene", str(spec)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "positions must be" in err[0], err


# ---- item 11: an identity intervention is exact ------------------------------------------------------

@pytest.mark.parametrize("spec", [
    [{"op": "kda.scale", "at": 9, "factor": 1.0, "layers": "all"}],  # inside a prefill chunk: no split there
    [{"op": "kda.scale", "at": 9, "factor": 1, "layers": [0], "heads": [1]}],
    [{"op": "kda.scale", "at": 33, "factor": 1.0}],  # in decode
    [{"op": "kda.scale", "at": 20, "factor": 1.0}, {"op": "kda.scale", "at": 5, "factor": 1.0, "layers": [3]}],
])
def test_scaling_by_one_is_bit_identical(model, spec) -> None:
    ids = ids_of(40, 9)
    plain = decode_logits(model, ids, 30, False)
    assert torch.equal(decode_logits(model, ids, 30, False, spec=spec), plain)
    fed = []
    for edit in ([], spec):  # set after its position was consumed: applied now, by 1
        late = Session(model, progress=False)
        late.append(ids=ids[:30])
        late.prefill()
        late.set_interventions(edit)
        fed.append(late.feed(ids[30:]))
    assert torch.equal(fed[1], fed[0])


def test_dataclasses_built_by_hand_pass_the_same_checks(model) -> None:
    from engine.interventions import DsaHide, KdaScale, MoeBan

    for item, words in ((MoeBan(experts=(-1,)), "ids >= 0"), (KdaScale(at=0, factor=float("nan")), "finite"),
                        (DsaHide(positions=(5, 2)), "START < END"), (MoeBan(experts=tuple(range(8))), "leaving 0")):
        refused(model, [item], *words.split("|"))
        with pytest.raises(InputError, match=words):  # also handed straight to the plan
            InterventionPlan([item], model.config)


def test_one_spec_object_as_json_text_is_read_as_a_spec(model) -> None:
    """'{"op": ...}' was taken for a file name ("cannot read the intervention spec")."""
    from workbench.interventions import resolve

    s = Session(model, progress=False)
    s.append(ids=ids_of(8), name="doc")
    assert resolve(s, '{"op": "dsa.hide", "segment": "doc"}')[0].positions == (0, 8)
    with pytest.raises(InputError, match=r"missing \['positions'\]"):
        resolve(s, ' {"op": "dsa.hide"}')
