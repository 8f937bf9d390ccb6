"""The `workbench` command line end to end (in-process `main`, plus one real `python -m workbench`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from apps.cli import main


def test_inspect_k31_pro_reports_true_sizes(capsys):
    assert main(["inspect", "--preset", "k3.1-pro"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 2.78T total, 104.37B active per token" in out
    assert "1.56 TB" in out and "dsa" in out


def test_checkpoint_random_inspect_and_logits(tmp_path, capsys):
    ckpt = tmp_path / "ck"
    assert main(["checkpoint", "random", "--preset", "tiny", "--variant", "k3", "--seed", "5", "--out", str(ckpt),
                 "--dtype", "float32"]) == 0
    assert main(["checkpoint", "random", "--preset", "tiny", "--out", str(ckpt)]) == 2  # never overwrites silently
    capsys.readouterr()
    assert main(["inspect", str(ckpt), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["validation"] == {"checked": True, "values_checked": True, "problems": []}
    assert report["config"]["variant"] == "k3" and report["config"]["dsa_layers"] == 0
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7], [300, 20]]))
    out = tmp_path / "logits.safetensors"
    assert main(["logits", "--model", str(ckpt), "--input-ids", str(ids), "--out", str(out)]) == 0
    logits = load_file(str(out))
    assert logits["logits.0"].shape == (7, 512) and logits["logits.1"].shape == (2, 512)
    with torch.no_grad():   # as the command runs it (with gradients on, fused projections run one by one)
        expected = load_model(ckpt)(torch.tensor([[300, 20]]))[0]
    assert torch.equal(logits["logits.1"], expected)


def test_run_streams_text_and_saves_a_snapshot(tmp_path, capsys):
    snap = tmp_path / "snap"
    argv = ["run", "--model", "preset:tiny", "--prompt", "Hello", "--chat", "--max-new-tokens", "6",
            "--temperature", "0", "--save", str(snap)]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "prompt +" in first.err and (snap / "snapshot.json").exists()
    assert main(["run", "--model", "preset:tiny", "--load", str(snap), "--max-new-tokens", "3", "--stats"]) == 0
    stats = capsys.readouterr().err
    assert '"output_tokens": 3' in stats and '"ttft_s"' in stats
    assert main(["run", "--model", "preset:tiny", "--prompt", ""]) == 2
    assert main(["run", "--model", "preset:tiny:k3", "--load", str(snap)]) == 2  # foreign snapshot


def test_run_compile_on_records_through_the_decode_step(tmp_path, capsys, monkeypatch):
    """`--compile on` with `--trace`: greedy text equal to `--compile off`, every decode step recorded."""
    from engine.decode import step as decode_step
    from workbench import open_trace

    monkeypatch.setattr(decode_step, "BACKEND", "aot_eager")  # dynamo's tracing without inductor's minutes
    outs = []
    for mode in ("off", "on"):
        argv = ["run", "--model", "preset:tiny", "--prompt", "Hello there", "--max-new-tokens", "5", "--temperature",
                "0", "--compile", mode, "--trace", str(tmp_path / mode)]
        assert main(argv) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    on, off = open_trace(tmp_path / "on"), open_trace(tmp_path / "off")
    assert sorted(on.df("dsa_topk")["position"]) == sorted(off.df("dsa_topk")["position"])
    with pytest.raises(SystemExit):
        main(["run", "--model", "preset:tiny", "--prompt", "x", "--compile", "maybe"])


def test_python_dash_m_workbench():
    result = subprocess.run([sys.executable, "-m", "workbench", "inspect", "--preset", "tiny"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "parameters:" in result.stdout


def test_run_with_a_trace_writes_the_dashboards_summaries(tmp_path, capsys, monkeypatch):
    """A finished recording is reduced for the dashboard at once: its first page reads summaries."""
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    argv = ["run", "--model", "preset:tiny", "--prompt", "Hello there", "--max-new-tokens", "4", "--temperature", "0",
            "--trace", str(tmp_path / "t")]
    assert main(argv) == 0
    assert "dashboard summaries written" in capsys.readouterr().err
    # inside the trace (they travel with it), not in the user cache
    inside = tmp_path / "t" / "summaries"
    assert any(inside.glob("*.json")) and any(inside.glob("*.arrow"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.*"))
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", "off")  # off: nothing written, nothing said
    assert main(argv[:-1] + [str(tmp_path / "t2")]) == 0
    assert "dashboard summaries" not in capsys.readouterr().err
    assert not (tmp_path / "t2" / "summaries").exists()
    # `workbench summarize` writes them later for a trace recorded without them
    assert main(["summarize", str(tmp_path / "t2")]) == 2  # still off: one line says so
    assert "turned off" in capsys.readouterr().err
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    assert main(["summarize", str(tmp_path / "t2")]) == 0
    assert "summaries of" in capsys.readouterr().out and any((tmp_path / "t2" / "summaries").glob("*.arrow"))
    assert main(["summarize", str(tmp_path / "nothing-here")]) == 2
    assert "error:" in capsys.readouterr().err
