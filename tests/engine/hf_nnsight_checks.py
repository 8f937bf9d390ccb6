"""nnsight on engine.hf's K3ForCausalLM: trace, save a hidden state, patch one, generate.

nnsight reaches modules by wrapping their forward; a hook point is called by its layer only while a
PyTorch hook is attached (`engine.hooks.through`), so a no-op hook (`engine.hooks.hooks`) makes
a point visible to a trace. The patched logits equal the same edit done with a plain forward hook.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("nnsight")

import engine.hf as hf  # noqa: E402
from engine.hooks import hooks  # noqa: E402

PROMPT = "The code that opens the greenhouse alarm is 3-8-2-5. The river was calm that day."


@pytest.fixture(scope="module")
def wrapped():
    from nnsight import TransformersModel

    model = hf.K3ForCausalLM.from_pretrained("builtin:demo")
    tokenizer = hf.K3Tokenizer.from_pretrained("builtin:demo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, tokenizer, TransformersModel(model, tokenizer=tokenizer)


def _plain(model, tokenizer, edit=None):
    ids = torch.tensor([tokenizer.encode(PROMPT, add_special_tokens=False)])
    with torch.no_grad():
        if edit is None:
            return model(ids).logits
        handle = model.get_submodule("model.layers.3").register_forward_hook(edit)
        try:
            return model(ids).logits
        finally:
            handle.remove()


def test_trace_saves_a_layer_output_and_a_hook_point(wrapped) -> None:
    model, tokenizer, lm = wrapped
    seen = []
    expected = _plain(model, tokenizer, lambda m, a, out: seen.append(out.clone()))
    with hooks(model, [("blocks.3.hook_resid_post", lambda m, a, out: None)]):  # the point is called now
        with lm.trace(PROMPT):
            point = lm.model.layers[3].hook_resid_post.output.save()  # in forward order: the point, then the layer
            layer = lm.model.layers[3].output.save()
            logits = lm.output.logits.save()
    # nnsight runs the forward with grad enabled (the engine's projections unfused): fp32 rounding only
    torch.testing.assert_close(layer, seen[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(point, layer, rtol=0, atol=0)  # the layer returns what its last point shows
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_patching_a_hidden_state_equals_a_plain_hook(wrapped) -> None:
    model, tokenizer, lm = wrapped

    def halve_tail(m, a, out):
        out = out.clone()
        out[:, -5:] *= 0.5
        return out

    expected = _plain(model, tokenizer, halve_tail)
    clean = _plain(model, tokenizer)
    with lm.trace(PROMPT):
        lm.model.layers[3].output[:, -5:] *= 0.5
        patched = lm.output.logits.save()
    torch.testing.assert_close(patched, expected, rtol=1e-5, atol=1e-5)
    assert (patched - clean).abs().max() > 1e-3  # the edit reached the output


def test_generate_through_nnsight_equals_generate(wrapped) -> None:
    model, tokenizer, lm = wrapped
    ids = torch.tensor([tokenizer.encode(PROMPT, add_special_tokens=False)])
    expected = model.generate(ids, max_new_tokens=4)[0].tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lm.generate(PROMPT, max_new_tokens=4) as tracer:
            first = lm.model.layers[3].output.save()  # the prefill's layer output
            out = tracer.result.save()
    tokens = out if isinstance(out, torch.Tensor) else out.sequences
    assert tokens[0].tolist() == expected
    assert first.shape == (1, ids.shape[1], 128)


def test_the_command_line_works_beside_nnsight(tmp_path) -> None:
    """nnsight mounts a `save` method on every object once imported (its PYMOUNT); `workbench run` in the
    same process still takes its options as given (argparse fills a default only where the attribute is missing)."""
    import nnsight  # noqa: F401

    from apps.cli import main

    assert hasattr(object(), "save")  # the mount this test is about
    assert main(["run", "--model", "preset:tiny", "--prompt", "hi", "--max-new-tokens", "2", "--compile", "off"]) == 0
