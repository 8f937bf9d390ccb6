"""Memory the engine does not need to hold: the compiler is not imported by loading or prefilling a
model (it is ~110 MB of a process's resident memory once imported), and the C heap's free pages go
back to the OS before every position's logits are allocated and before the first compile
(`engine.heap`)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import engine.model
from engine import load_model
from engine.heap import release_free_heap
from engine.session import Session
from engine.weights.meta import on_meta
from tests.helpers import ROOT

_LOAD_AND_PREFILL = """
import json, sys
import torch
from engine import load_model
from engine.session import Session
model = load_model("preset:tiny")
session = Session(model)
session.append(ids=list(range(3, 40)))
session.prefill(return_logits=True)
list(session.generate(3, temperature=0, stop_ids=()))  # eager decode (runtime.compile is off)
print(json.dumps({name: name in sys.modules for name in ("torch._dynamo", "torch._inductor")}))
"""


def test_loading_prefilling_and_eager_decode_import_no_compiler() -> None:
    # a fresh process: this one may have imported the compiler already (other tests compile)
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_PREFILL], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"torch._dynamo": False, "torch._inductor": False}


def test_on_meta_builds_meta_tensors_and_skips_only_their_initialisers() -> None:
    with on_meta():
        lin = torch.nn.Linear(4, 3)
        emb = torch.nn.Embedding(5, 2)
    assert lin.weight.is_meta and emb.weight.is_meta
    # outside the block initialisers run as always, on real tensors
    w = torch.zeros(3, 4)
    torch.nn.init.normal_(w)
    assert bool(w.abs().sum() > 0)
    # and inside it a real tensor is still initialised
    with on_meta():
        real = torch.zeros(3, 4, device="cpu")
        torch.nn.init.uniform_(real, 1.0, 2.0)
    assert bool((real >= 1.0).all())


def test_loaded_weights_do_not_depend_on_the_skipped_initialisers() -> None:
    torch.manual_seed(0)
    a = load_model("preset:tiny", seed=3)
    torch.manual_seed(1)  # a different global RNG: skipped initialisers never drew from it
    b = load_model("preset:tiny", seed=3)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_release_free_heap_is_harmless() -> None:
    expected = sys.platform.startswith("linux")  # glibc here; elsewhere nothing to call
    assert release_free_heap() in ((True,) if expected else (False,))
    assert release_free_heap() is release_free_heap()  # resolved once, the same answer


def test_heap_released_before_every_positions_logits_only_when_large(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(engine.model, "release_free_heap", lambda: calls.append(1) or True)
    model = load_model("preset:tiny")
    vocab = model.config.vocab_size
    # the threshold in bytes of logits: 20 positions' logits reach it, 19 do not
    monkeypatch.setattr(engine.model, "LARGE_ALLOCATION_BYTES", 20 * vocab * 4)
    session = Session(model)
    session.append(ids=list(range(3, 22)))  # 19 positions
    session.prefill(return_logits=True)
    assert calls == []
    session.append(ids=list(range(3, 23)))  # 20
    logits = session.prefill(return_logits=True)
    assert calls == [1] and logits.shape[0] == 20
    session.append(ids=list(range(3, 43)))  # 40, but only the last position's logits
    session.prefill()
    assert calls == [1]


def test_heap_released_once_before_the_first_compile(monkeypatch) -> None:
    from engine.decode import step as decode_step

    calls: list[int] = []
    monkeypatch.setattr(decode_step, "release_free_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(decode_step, "BACKEND", "aot_eager")  # tracing only: seconds, not inductor's minutes
    model = load_model("preset:tiny:kimi-linear", seed=1)
    model.runtime.compile = True
    session = Session(model)
    session.append(ids=list(range(3, 20)))
    list(session.generate(4, temperature=0, stop_ids=()))
    assert calls == [1] and decode_step.DecodeStep.of(model).compiles == 1
    list(session.generate(2, temperature=0, stop_ids=()))
    assert calls == [1]
    torch._dynamo.reset()


def test_silu_mul_in_place_equals_the_product_and_keeps_its_inputs() -> None:
    from engine.layers.common import silu_mul

    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(7, 12, generator=g), torch.randn(7, 12, generator=g)
    want = torch.nn.functional.silu(gate) * up
    kept = (gate.clone(), up.clone())
    with torch.no_grad():  # the in-place form
        assert torch.equal(silu_mul(gate, up), want)
        # a mixed-dtype product promotes as `*` does; a broadcast one has the larger shape
        assert silu_mul(gate.bfloat16(), up).dtype == torch.float32
        assert silu_mul(gate[:1], up).shape == (7, 12)
    assert torch.equal(gate, kept[0]) and torch.equal(up, kept[1])
    leaf = gate.clone().requires_grad_()
    silu_mul(leaf, up).sum().backward()  # with autograd: the out-of-place form, gradients flow
    assert leaf.grad is not None
