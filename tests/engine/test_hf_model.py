"""engine.hf: the engine's model under transformers' auto classes, cache and generate.

- `AutoModelForCausalLM.from_pretrained(dir)` loads builtin:demo's directory as `K3ForCausalLM`;
  its logits equal the session's chunked prefill (the same computation) and the stateless forward
  (fp32 tolerance: a different call shape).
- greedy `generate` equals `workbench run` greedy (the CLI's saved snapshot) and a session's
  greedy ids, prefilling once and then feeding one token per step (the `K3Cache` is used).
- batches, padding, beams and foreign caches are refused in words; every hook point is a module.
- a flat Kimi-Linear directory stays transformers' own class under the auto classes and loads
  through ours with `K3ForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import engine.hf as hf  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from apps.cli import main  # noqa: E402
from engine import load_model  # noqa: E402
from engine.builtin import model_dir  # noqa: E402
from engine.config_io import config_to_hf  # noqa: E402
from engine.errors import InputError  # noqa: E402
from engine.hooks import module_paths  # noqa: E402
from engine.presets import get_preset  # noqa: E402
from engine.session import Session  # noqa: E402
from engine.tokenizer import Message, Tokenizer  # noqa: E402

DEMO = str(model_dir("builtin:demo"))


@pytest.fixture(scope="module")
def demo() -> hf.K3ForCausalLM:
    return AutoModelForCausalLM.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.for_model(DEMO, 512)


def _ids(tokenizer: Tokenizer, n: int = 300) -> list[int]:
    text = "The code that opens the greenhouse alarm is 3-8-2-5. " + "The river was calm that day. " * 40
    return tokenizer.chat_prompt([Message("user", text)])[:n]


def test_auto_classes_load_the_demo_directory(demo) -> None:
    assert isinstance(demo, hf.K3ForCausalLM)
    assert type(AutoConfig.from_pretrained(DEMO)) is hf.K3CheckpointConfig
    assert demo.config.vocab_size == 512 and demo.config.eos_token_id == 258
    engine_names = dict(load_model("builtin:demo").state_dict())
    assert set(demo.state_dict()) == set(engine_names)  # the checkpoint's names, each once


def test_logits_equal_the_engine(demo, tokenizer) -> None:
    ids = _ids(tokenizer)
    small = hf.K3ForCausalLM.from_pretrained("builtin:demo", prefill_chunk=128)
    with torch.no_grad():  # as generate runs: the session's computation, fused projections included
        out = small(torch.tensor([ids]))
    session = Session(load_model("builtin:demo"), tokenizer, prefill_chunk=128)
    session.append(ids=ids)
    chunked = session.prefill(return_logits=True)
    torch.testing.assert_close(out.logits[0], chunked, rtol=0, atol=0)  # the same computation
    # with grad enabled the engine runs its projections unfused (gradients reach each weight): rounding only
    torch.testing.assert_close(small(torch.tensor([ids])).logits[0], chunked, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        whole = load_model("builtin:demo")(torch.tensor([ids]))[0]
    torch.testing.assert_close(demo(torch.tensor([ids])).logits[0], whole, rtol=1e-4, atol=1e-4)
    assert out.cache.get_seq_length() == len(ids)
    last = demo(torch.tensor([ids]), logits_to_keep=1).logits
    assert last.shape == (1, 1, 512)
    torch.testing.assert_close(last[0, 0], out.logits[0, -1], rtol=1e-5, atol=1e-5)


def test_generate_equals_workbench_run_greedy(demo, tmp_path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The code that opens the greenhouse alarm is 3-8-2-5. The weather was fine.")
    snap = tmp_path / "snap"
    assert main(["run", "--model", "builtin:demo", "--prompt-file", str(prompt), "--chat", "--temperature", "0",
                 "--max-new-tokens", "10", "--save", str(snap)]) == 0
    saved = Session.load(snap, demo.engine_model)
    generated = next(s for s in json.loads((snap / "snapshot.json").read_text())["segments"] if s["kind"] == "generated")
    tokens = list(saved.tokens)
    assert len(tokens) == generated["end"]
    calls: list[int] = []
    handle = demo.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = demo.generate(torch.tensor([tokens[:generated["start"]]]), max_new_tokens=10)
    finally:
        handle.remove()
    assert out[0, generated["start"]:].tolist() == tokens[generated["start"]:generated["end"]]
    assert calls[0] == generated["start"] and set(calls[1:]) == {1}  # one prefill, then one token a step


def test_generate_continues_a_given_cache(demo, tokenizer) -> None:
    ids = _ids(tokenizer, 120)
    session = Session(demo.engine_model, tokenizer)
    session.append(ids=ids)
    expected = [t.id for t in session.generate(6, temperature=0)]
    cache = demo.new_cache()
    demo(torch.tensor([ids[:80]]), cache=cache)
    out = demo.generate(torch.tensor([ids]), cache=cache, max_new_tokens=6)
    assert out[0, len(ids):].tolist() == expected


def test_refusals_are_sentences(demo, tokenizer) -> None:
    ids = torch.tensor([_ids(tokenizer, 20)])
    with pytest.raises(InputError, match="one sequence per call"):
        demo(ids.repeat(2, 1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(InputError, match="padding"):
        demo(ids, attention_mask=mask)
    assert demo(ids, attention_mask=torch.ones_like(ids)).logits.shape == (1, 20, 512)
    with pytest.raises(InputError, match="num_beams"):
        demo.generate(ids, num_beams=2, max_new_tokens=2)
    with pytest.raises(InputError, match="K3Cache"):
        demo.generate(ids, cache=DynamicCache(), max_new_tokens=2)
    with pytest.raises(InputError, match="position_ids"):
        demo(ids, position_ids=torch.arange(5, 25)[None])
    with pytest.raises(InputError, match="not a checkpoint directory"):
        hf.K3ForCausalLM.from_pretrained("moonshotai/Kimi-K3")


def test_hook_points_are_modules(demo, tokenizer) -> None:
    paths = module_paths(demo)
    assert paths == module_paths(demo.engine_model)
    assert paths["blocks.3.hook_resid_post"] == "model.layers.3.hook_resid_post"
    ids = torch.tensor([_ids(tokenizer, 40)])
    clean = demo(ids).logits
    seen = []
    point = demo.get_submodule("model.layers.3.hook_resid_post")
    handle = point.register_forward_hook(lambda m, a, out: (seen.append(out.shape), out * 0)[1])
    try:
        edited = demo(ids).logits
    finally:
        handle.remove()
    assert seen == [torch.Size([1, 40, 128])]
    assert not torch.allclose(clean, edited)
    torch.testing.assert_close(demo(ids).logits, clean, rtol=0, atol=0)


def test_from_config_is_the_engines_seeded_random_model(tmp_path) -> None:
    raw = config_to_hf(get_preset("tiny", None))
    config = hf.K3Config(checkpoint_config=raw)
    assert hf.K3Config.from_dict(config.to_dict()).checkpoint_config == raw
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, load_model("preset:tiny")(ids), rtol=0, atol=0)
    with pytest.raises(InputError, match="does not write checkpoints"):
        model.save_pretrained(tmp_path)


def test_kimi_linear_directory_stays_transformers_own(checkpoint_dir) -> None:
    directory = checkpoint_dir("tiny", "kimi-linear")
    config = AutoConfig.from_pretrained(str(directory))
    assert config.model_type == "kimi_linear" and type(config).__module__.startswith("transformers.")
    model = hf.K3ForCausalLM.from_pretrained(directory)
    ids = torch.arange(1, 30)[None]
    with torch.inference_mode():
        expected = load_model(directory)(ids)
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_tokenizer_matches_the_engine(tokenizer) -> None:
    tok = hf.K3Tokenizer.from_pretrained("builtin:demo")
    assert tok.eos_token_id == 258
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is it? ü"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.chat_prompt([Message(m["role"], m["content"]) for m in messages])
    assert tok.encode(text, add_special_tokens=False) == expected
    assert tok.decode(expected) == text
    encoded = tok("héllo <|open|>x", add_special_tokens=False)
    assert encoded["input_ids"] == tokenizer.encode("héllo ") + [tokenizer.open_id] + tokenizer.encode("x")
    assert (encoded.token_to_chars(1).start, encoded.token_to_chars(2).start) == (1, 1)  # é is two byte tokens
    assert encoded.token_to_chars(7) == (6, 14)  # the control token's name
