"""Tensor + expert parallelism end to end: real gloo ranks on the CPU, spawned by the tests.

Each job runs `parallel_worker.py` in `world` processes (torchrun's variables set by hand, rank 0
hosting the store) or the `workbench` CLI under torchrun itself. Kept small for a 2-core CI: the
`tiny-tp` preset, a 22-token prompt, one job per world size.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from engine.session import Session
from tests.helpers import assert_close
from tests.engine.parallel_worker import PROMPT
from apps.cli import main

WORKER = Path(__file__).with_name("parallel_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, *args: str, timeout: float = 150.0) -> tuple[list[int], list[str], float]:
    """Run the worker in `world` processes; returns (exit codes, stderr texts, seconds)."""
    port = _free_port()
    procs = []
    started = time.monotonic()
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = []
    try:
        for proc in procs:
            errors.append(proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))[1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [p.returncode for p in procs], errors, time.monotonic() - started


def reference(model_path: str | Path, new_tokens: int = 6) -> tuple[torch.Tensor, list[int]]:
    """World-1 logits of the worker's prompt and its greedy continuation, in this process."""
    model = load_model(model_path)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT]))[0]
    session = Session(model)
    session.append(ids=PROMPT)
    return logits, [t.id for t in session.generate(max_new_tokens=new_tokens, temperature=0)]


@pytest.fixture(scope="module")
def k31_mxfp4(checkpoint_dir) -> Path:
    return checkpoint_dir("tiny-tp", "k3.1", seed=3)


@pytest.fixture(scope="module")
def k31_reference(k31_mxfp4):
    return reference(k31_mxfp4)


def _check_job(world: int, model: str | Path, expected: tuple[torch.Tensor, list[int]], tmp_path: Path,
               *extra: str) -> None:
    out = tmp_path / f"world{world}.safetensors"
    codes, errors, _ = launch(world, "--model", str(model), "--out", str(out), *extra)
    assert codes == [0] * world, "\n".join(errors)
    got = load_file(str(out))
    assert_close(got["logits"], expected[0], "logits")
    assert got["tokens"].tolist() == expected[1]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_k31_mxfp4_checkpoint_same_logits_and_greedy_tokens(world, k31_mxfp4, k31_reference, tmp_path):
    # world 2 also checks in every forward that all ranks chose the same DSA keys and experts
    _check_job(world, k31_mxfp4, k31_reference, tmp_path, *(["--check-ranks"] if world == 2 else []))


# every op at once, on heads and experts that live on one rank only (tiny-tp: 8 KDA heads, 16 experts)
EVERY_OP = [{"op": "dsa.hide", "positions": [3, 12]}, {"op": "dsa.pin", "positions": [0, 2], "layers": [5]},
            {"op": "kda.suppress_writes", "positions": [2, 15], "heads": [1, 6]},
            {"op": "kda.scale", "at": 24, "factor": 0.5, "heads": [7]}, {"op": "kda.erase", "at": 9, "layers": [3]},
            {"op": "moe.ban", "experts": [0, 9, 15]}, {"op": "moe.force", "experts": [3], "layers": [2]}]


def test_every_intervention_two_ranks_equal_one(k31_mxfp4, tmp_path):
    """Every rank applies the same interventions: its own heads' share of a KDA edit, the same banned and
    forced experts and hidden keys (`--check-ranks` asserts the DSA selections and routes agree)."""
    from engine.interventions import InterventionPlan, parse_interventions

    model = load_model(k31_mxfp4)
    items = parse_interventions(EVERY_OP)
    model.runtime.interventions = InterventionPlan(items, model.config)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT]))[0]
    model.runtime.interventions = None
    session = Session(model)
    session.set_interventions(items)
    session.append(ids=PROMPT)
    tokens = [t.id for t in session.generate(max_new_tokens=6, temperature=0)]
    plain = reference(k31_mxfp4)
    assert not torch.allclose(logits, plain[0], atol=1e-3)  # the interventions change the output
    _check_job(2, k31_mxfp4, (logits, tokens), tmp_path, "--check-ranks", "--intervene", json.dumps(EVERY_OP))


def test_kimi_linear_preset_world2(tmp_path):
    # dense experts at full width, plain residuals, low-rank KDA gate; weights sliced from the random source
    model = "preset:tiny-tp:kimi-linear"
    _check_job(2, model, reference(model), tmp_path)


@pytest.mark.parametrize("how, rank, message", [
    ("--fail-rank", 1, "rank 1 failed: RuntimeError: injected failure"),
    ("--fail-rank", 0, "rank 0 failed: RuntimeError: injected failure"),  # the rank hosting the store
    ("--die-rank", 1, "rank 1 stopped responding"),  # vanishes without a word: the heartbeat names it
], ids=["rank1-raises", "rank0-raises", "rank1-dies"])
def test_a_failing_rank_stops_every_rank_naming_it(how, rank, message, k31_mxfp4):
    codes, errors, seconds = launch(2, "--model", str(k31_mxfp4), how, str(rank), timeout=90)
    assert all(code != 0 for code in codes), codes
    assert seconds < 60
    for other, err in enumerate(errors):
        if other != rank or how == "--fail-rank":
            assert message in err, (other, err)


def test_mismatched_configs_are_refused_at_start(k31_mxfp4):
    codes, errors, _ = launch(2, "--model", str(k31_mxfp4), "--other-model-on-rank", "1",
                              "--other-model", "preset:tiny-tp:k3", timeout=90)
    assert all(code != 0 for code in codes), codes
    for err in errors:
        assert "ranks disagree on the model to load" in err, err


def _torchrun(world: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "workbench", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_logits_and_run_under_torchrun(k31_mxfp4, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([PROMPT, PROMPT[:5]]))
    out = tmp_path / "logits.safetensors"
    done = _torchrun(2, "logits", "--model", str(k31_mxfp4), "--input-ids", str(ids), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("wrote 2 logits tensors") == 1  # rank 0 writes, rank 1 only computes
    got = load_file(str(out))
    model = load_model(k31_mxfp4)
    with torch.inference_mode():
        for i, seq in enumerate([PROMPT, PROMPT[:5]]):
            assert_close(got[f"logits.{i}"], model(torch.tensor([seq]))[0], f"logits of sequence {i}")

    run_args = ["run", "--model", str(k31_mxfp4), "--prompt", "hello parallel", "--temperature", "0",
                "--max-new-tokens", "5"]
    capsys.readouterr()
    assert main(run_args) == 0
    single = capsys.readouterr().out
    parallel = _torchrun(2, *run_args)
    assert parallel.returncode == 0, parallel.stderr
    assert parallel.stdout == single and single.strip()  # same greedy text, printed once
