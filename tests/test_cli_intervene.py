"""`--intervene SPEC.json` on `workbench run` and `workbench logits` (issue 30)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from apps.cli import main


def test_run_and_logits_take_an_intervention_spec(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"op": "dsa.hide", "segment": "prompt", "layers": "all"},
                                {"op": "moe.ban", "experts": [1, 2]}]))
    assert main(["run", "--model", "preset:tiny", "--prompt", "hello there, a prompt", "--max-new-tokens", "3",
                 "--temperature", "0", "--intervene", str(spec), "--trace", str(tmp_path / "t"),
                 "--compile", "off"]) == 0
    recorded = json.loads((tmp_path / "t" / "session.json").read_text())["interventions"]
    assert [e["op"] for e in recorded] == ["dsa.hide", "moe.ban"] and recorded[0]["from"] == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"op": "dsa.hide", "segment": "nope"}]))
    assert main(["run", "--model", "preset:tiny", "--prompt", "hi", "--intervene", str(bad)]) == 2
    assert "no segment named 'nope'" in capsys.readouterr().err
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([list(range(1, 30))]))
    positions = tmp_path / "positions.json"
    positions.write_text(json.dumps([{"op": "dsa.hide", "positions": [2, 14]}]))
    for name, extra in (("plain", []), ("hidden", ["--intervene", str(positions)])):
        assert main(["logits", "--model", "preset:tiny", "--input-ids", str(ids), "--out",
                     str(tmp_path / f"{name}.safetensors"), *extra]) == 0
    plain, hidden = (load_file(tmp_path / f"{n}.safetensors")["logits.0"] for n in ("plain", "hidden"))
    # positions before the hidden range are computed by the masked path rather than the plain one: the same
    # function, but a different BLAS blocking on some processors, so fp32 rounding (logits ~5, eps 1.2e-7)
    # bounds the difference there; past the range hiding must change the logits by far more than that
    torch.testing.assert_close(hidden[:3], plain[:3], rtol=1e-5, atol=1e-4)
    assert (plain[15:] - hidden[15:]).abs().amax() > 1e-2
    assert main(["logits", "--model", "preset:tiny", "--input-ids", str(ids), "--out", str(tmp_path / "x.safetensors"),
                 "--intervene", str(bad)]) == 2
    assert "a bare token sequence has none" in capsys.readouterr().err
