"""Every training job's first steps, pinned: the losses and the saved weights and optimizer moments of a
few steps of `training.demo_model` (dense, indexer warm-up and sparse stages, picture batches, the GPU
run's data options), `training.lengthen` (pictures; copy targets) and `training.extend` (tower frozen,
then trained), recorded from the loops as they were before the shared trainer replaced them.

Same computation, so on the machine and torch build that recorded them (`RECORDED_ON`) they must match
bit for bit (the sha256 of the saved safetensors); elsewhere float sums may round differently, so the
losses are compared with a tolerance and the digests not at all."""

from __future__ import annotations

import csv
import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from training import demo_model, extend, lengthen
from training import state as state_io


def _kernel_fingerprint() -> str:
    """Digest of a few fp32 / bf16 products and a patch convolution of odd shapes: which BLAS / oneDNN
    kernels this process rounds with. The same torch build and ATen capability still take other MKL or
    oneDNN kernels on another processor (or under MKL_CBWR / ONEDNN_MAX_CPU_ISA), and those round
    differently, so the build and capability alone do not make the golden's computation the same."""
    g = torch.Generator().manual_seed(0)
    digest = hashlib.sha256()
    for m, k, n in ((37, 300, 53), (256, 64, 160), (5, 1024, 7)):
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        digest.update((a @ b).numpy().tobytes())
        digest.update((a.bfloat16() @ b.bfloat16()).float().numpy().tobytes())
    image, kernel = torch.randn(2, 3, 28, 28, generator=g), torch.randn(8, 3, 14, 14, generator=g)
    digest.update(torch.nn.functional.conv2d(image, kernel, stride=14).numpy().tobytes())
    return digest.hexdigest()[:16]


RECORDED_ON = ("2.13.0+cpu", "AVX512", "aea2942d02b77b50")  # torch, ATen capability, `_kernel_fingerprint()`
SAME_MACHINE = (torch.__version__, torch.backends.cpu.get_cpu_capability(), _kernel_fingerprint()) == RECORDED_ON


def _digests(state_dir) -> dict[str, str]:
    last = state_io.latest(state_dir)
    return {f: hashlib.sha256((last / f).read_bytes()).hexdigest()[:16]
            for f in ("model.safetensors", "optim.safetensors")}


def _losses(state_dir) -> list[dict[str, str]]:
    """The loss log without its timing column."""
    with open(state_dir / "loss.csv") as f:
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in csv.DictReader(f)]


def _check(state_dir, rows: list[dict[str, str]], digests: dict[str, str]) -> None:
    got = _losses(state_dir)
    if SAME_MACHINE:
        assert got == rows
        assert _digests(state_dir) == digests
        return
    assert [r.keys() for r in got] == [r.keys() for r in rows]
    for new, old in zip(got, rows, strict=True):
        for k, v in old.items():
            if k in ("step", "phase", "length", "text_length"):
                assert new[k] == v
            elif not math.isnan(float(v)):
                # a step's rounding differences come back from Adam (m / sqrt(v) of tiny gradients) as lr-sized
                # updates: other GEMM kernels (MKL_CBWR=COMPATIBLE, ATEN_CPU_CAPABILITY=default) moved extend's
                # step-3 image losses by 2.4e-3 and 3.1e-3 relative, so 1e-2 leaves room and still catches a change
                assert float(new[k]) == pytest.approx(float(v), rel=1e-2, abs=1e-3), (k, new, old)


@dataclass(frozen=True)
class Job:
    """One pinned run: its entry point and arguments (`{base}`: the conftest's base run, `{tmp}`: the test's
    folder), the rows its loss log must hold (`columns`, then one line of values per step) and the first
    16 hex digits of the sha256 of its saved weights and optimizer moments."""

    main: Callable[[list[str]], int]
    args: tuple[str, ...]
    columns: str
    rows: tuple[str, ...]
    digests: tuple[str, str]  # model.safetensors, optim.safetensors
    extend_stages: tuple[extend.Stage, ...] = ()  # replaces extend's schedule (a few short steps)

    def expected_rows(self) -> list[dict[str, str]]:
        names = self.columns.split()
        return [dict(zip(names, row.split(), strict=True)) for row in self.rows]


LENGTHEN = ("--base", "{base}", "--stages", "2x1x256,1x1x384", "--eval-every", "1000", "--eval-during", "",
            "--no-final", "--gaps", "--first-weight", "3")
JOBS = {
    # dense, indexer warm-up and sparse stages, picture batches and the GPU run's data options
    "demo_model": Job(demo_model.main, (
        "--out", "{tmp}/out", "--stages", "dense:2x2x128,warmup:1x1x256,sparse:2x1x256", "--no-final",
        "--eval-every", "1000", "--stop-after", "5", "--varied-share", "0.7", "--gaps", "--drill-share", "0.5",
        "--first-weight", "3", "--image-every", "2", "--image-batch", "2", "--tower-from", "2"),
        "step phase length loss answer_loss indexer_kl topk_mass lr expert_max_load image_loss", (
            "0 dense  128 6.73874 6.82218 nan     nan    0.000075 5.17 6.90569",
            "1 dense  128 6.72534 6.48176 nan     nan    0.000150 5.19 nan",
            "2 warmup 256 nan     nan     0.47990 0.4376 0.000225 4.66 nan",
            "3 sparse 256 6.74508 6.47223 0.37946 0.4148 0.000225 5.88 nan",
            "4 sparse 256 6.57662 6.90979 0.73262 0.4349 0.000300 4.77 6.48753"),
        ("90094b4e86f06d01", "672c14b7290eb01d")),
    "lengthen-pictures": Job(lengthen.main, (*LENGTHEN, "--image-every", "2", "--image-batch", "2"),
        "step length loss answer_loss indexer_kl topk_mass lr image_loss", (
            "0 256 6.79782 6.73674 0.85891 0.4719 0.000040 6.80262",
            "1 256 6.57590 5.95441 0.32510 0.4756 0.000080 nan",
            "2 384 6.69085 6.79570 0.78826 0.4215 0.000120 6.76452"),
        ("12df590d389f1a43", "34079993f5ac6419")),
    "lengthen-copy-targets": Job(lengthen.main, (*LENGTHEN, "--copy-weight", "0.5", "--copy-first-only"),
        "step length loss answer_loss indexer_kl topk_mass lr copy_loss copy_mass", (
            "0 256 6.79782 6.73674 0.38727 0.4584 0.000040 4.96118 0.0070",
            "1 256 6.58770 5.94921 0.31954 0.4738 0.000080 5.41191 0.0060",
            "2 384 6.66454 6.70194 0.34765 0.3606 0.000120 5.70233 0.0041"),
        ("3299d0f5d948bb60", "cc05f6fd505de8ae")),
    # the tower frozen, then trained
    "extend": Job(extend.main, ("--base", "{base}", "--out", "{tmp}/out", "--eval-every", "1000",
                                "--stop-after", "4", "--no-final"),
        "step phase text_length text_loss answer_loss image_loss image_answer_loss indexer_kl lr_scale", (
            "0 frozen 256 6.72179 6.90236 6.86776 6.89725 0.33979 0.0333",
            "1 frozen 256 6.73122 6.91907 6.61328 6.04680 0.35590 0.0667",
            "2 tower  256 6.63636 6.02754 6.58942 6.36296 0.35448 0.1000",
            "3 tower  512 6.71035 6.92518 6.60865 6.72674 0.35884 0.1333"),
        ("19070212623793ca", "7322010c17d62048"),
        extend_stages=(extend.Stage("frozen", 2, 256, 2, 224), extend.Stage("tower", 2, 256, 2, 224))),
}


@pytest.mark.parametrize("job", JOBS.values(), ids=JOBS.keys())
def test_first_steps_are_unchanged(job: Job, tmp_path, request, monkeypatch) -> None:
    if job.extend_stages:
        monkeypatch.setattr(extend, "schedule", lambda scale: list(job.extend_stages))
    base = request.getfixturevalue("base") if "{base}" in job.args else None
    state = tmp_path / "state"
    assert job.main(["--state", str(state), *(a.format(base=base, tmp=tmp_path) for a in job.args)]) == 0
    _check(state, job.expected_rows(), dict(zip(("model.safetensors", "optim.safetensors"), job.digests)))
