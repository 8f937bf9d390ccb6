"""Test helpers shared by every suite: the numerical comparison and NaN poisoning of fresh buffers.

- `relative_error(actual, expected)`: ||a - e|| / ||e|| in float64, which is the relative RMS error
  (both norms are over the same number of elements).
- `assert_close(actual, expected, what, ratio)`: shapes equal, no NaN where the expected value has
  none, relative RMS error <= ratio; the message names what was compared and by how much it missed.
- `topk_boundary_gap(scores, k)`: how close any row's k-th and (k+1)-th scores come (relative); a test that
  compares top-k selections made by two different computations asserts it exceeds `NEAR_TIE` first, so a
  legitimate near-tie flip fails as "change the seed" instead of as a wrong selection.
- `nan_poisoned_empty()`: while active, `torch.empty`, `torch.empty_like` and `Tensor.new_empty`
  return floating tensors filled with NaN, so an output element a kernel or op forgot to write
  fails `assert_close` loudly instead of passing on whatever memory held (the `nan_poison` fixture
  in `tests/conftest.py` applies it to a test module: `pytestmark = pytest.mark.usefixtures("nan_poison")`).
- `random_ids(n, seed)`: n byte-level token ids from a generator of their own, the same in every test.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import torch

TOLERANCE = 1e-5  # the house default for fp32 against a float64 oracle


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64 (the house metric for numerical oracles)."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, ratio: float = TOLERANCE) -> None:
    """Fail unless `actual` matches `expected` within relative RMS error `ratio` over the finite
    reference values, with NaN exactly where the reference has NaN and the same infinities."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    nan_a, nan_e = actual.isnan(), expected.isnan()
    stray, missing = int((nan_a & ~nan_e).sum()), int((nan_e & ~nan_a).sum())
    assert not stray, f"{what}: {stray} NaN element(s) where the reference has a value (unwritten output?)"
    assert not missing, f"{what}: {missing} element(s) with a value where the reference is NaN"
    inf_e = expected.isinf()
    assert torch.equal(actual[inf_e], expected[inf_e].to(actual.dtype)), f"{what}: infinities differ from the reference"
    finite = expected.isfinite()
    assert not bool(actual[finite].isinf().any()), f"{what}: infinite element(s) where the reference is finite"
    err = relative_error(actual[finite], expected[finite])
    assert err <= ratio, f"{what}: relative error {err:.3e} > {ratio:.0e}"


# relative to a row's largest score: two fp32 computations of the same scores (another blocking or summation
# order, a kernel against its reference) agree to ~1e-6 of it, so only a gap below this can change a top-k
NEAR_TIE = 1e-5


def topk_boundary_gap(scores: torch.Tensor, k: int) -> float:
    """Smallest nonzero gap between the k-th and (k+1)-th score of any row (last dim), relative to that row's
    largest finite |score|; inf when no row has more than k finite scores. Exact ties (gap 0) are left out:
    both computations see them as ties and break them by the same rule (the earliest position)."""
    rows = scores.detach().double().flatten(0, -2)
    rows = rows[rows.isfinite().sum(-1) > k]
    if not rows.shape[0]:
        return float("inf")
    top = rows.topk(k + 1, dim=-1).values
    scale = rows.masked_fill(~rows.isfinite(), 0).abs().amax(-1).clamp_min(1e-30)
    gaps = (top[:, k - 1] - top[:, k]) / scale
    gaps = gaps[gaps > 0]  # an exact tie, or +inf - +inf (two pinned keys), is no near tie
    return float(gaps.min()) if gaps.numel() else float("inf")


def _poisoned(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(make)
    def poisoned(*args, **kwargs) -> torch.Tensor:
        out = make(*args, **kwargs)
        if out.is_floating_point() or out.is_complex():
            with torch.no_grad():
                out.fill_(float("nan"))
        return out

    return poisoned


@contextlib.contextmanager
def nan_poisoned_empty() -> Iterator[None]:
    """Fill every new `empty` floating tensor with NaN while the block runs (then restore torch)."""
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty, torch.empty_like = _poisoned(saved[0]), _poisoned(saved[1])
    torch.Tensor.new_empty = _poisoned(saved[2])
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved


ROOT = Path(__file__).resolve().parents[1]


def random_ids(n: int, seed: int = 0) -> list[int]:
    """`n` token ids drawn uniformly from [0, 256) (byte-level) by a generator seeded `seed`: the same ids
    whatever else drew random numbers before."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_logits(model, ids: list[int], prompt: int, mode: bool | str, *, spec=None,
                  chunk: int = 16) -> torch.Tensor:
    """Chunked prefill of `prompt` tokens (under the intervention `spec` when given), then one session
    decode step per remaining token in decode-step `mode`; logits [n, V]."""
    from engine.session import Session

    model.runtime.compile = mode
    try:
        s = Session(model, prefill_chunk=chunk)
        if spec is not None:
            s.set_interventions(spec)
        s.append(ids=ids[:prompt])
        out = [s.prefill(return_logits=True)]
        for t in ids[prompt:]:
            s.tokens.append(t)
            s._forward([t], "decode", False)
            out.append(s.last_logits[None])
        return torch.cat(out)
    finally:
        model.runtime.compile = "auto"


def run_benchmark(script: str, *args: str, timeout: float = 600) -> str:
    """Run `benchmarks/<script>` as a user would (its own process, from the repository root); its stdout.
    Fails the test with the end of its stderr when it exits non-zero."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def nullable_copy(table: pa.Table) -> pa.Table:
    """`table` with every column declared nullable, as writers other than the workbench's write parts."""
    return table.cast(pa.schema([f.with_nullable(True) for f in table.schema], metadata=table.schema.metadata))


def hold_at_start(monkeypatch, module: object, name: str) -> threading.Event:
    """Replace `module.name` by the same function held at its start until the returned event is set (a
    background job is then surely running when a test clicks Stop)."""
    gate, real = threading.Event(), getattr(module, name)

    def held(*args, **kwargs):
        assert gate.wait(60), f"{name} was held for 60 s"
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)
    return gate
