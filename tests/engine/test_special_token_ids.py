"""Special token ids outside the vocabulary: the config loads and runs text; only their use is refused.

A scaled-down K3 / K3.1 config derived from the released one cuts the vocabulary to a few hundred tokens
and keeps the released special ids (media placeholder 163605, bos 163584, eos 163585, pad 163839). The
independent implementations load such a config and run text, so this engine must too.
"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from engine import config_to_hf, get_preset, load_model, parse_config
from engine.errors import InputError
from engine.session import Session
from engine.tokenizer import Tokenizer
from engine.weights.write import write_checkpoint

RELEASED_IDS = {"bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
                "media_placeholder_token_id": 163605}


def released_ids_config(variant: str | None = None) -> dict:
    """`tiny`'s HF config (K3.1, or `variant`) with the released special ids, all outside its vocabulary."""
    hf = config_to_hf(get_preset("tiny", variant))
    for name, value in RELEASED_IDS.items():
        if name in hf["text_config"]:
            hf["text_config"][name] = value
        if name in hf:
            hf[name] = value
    hf["media_placeholder_token_id"] = RELEASED_IDS["media_placeholder_token_id"]
    return hf


@pytest.mark.parametrize("variant", [None, "k3"], ids=["k3.1", "k3"])
def test_released_special_ids_beside_a_small_vocabulary_load(variant) -> None:
    config = parse_config(released_ids_config(variant))
    assert config.vocab_size < 163584
    assert config.media_placeholder_token_id == 163605 and config.eos_token_id == 163585
    assert config.special_token_id("eos_token_id") is None
    assert config.special_token_problem("media_placeholder_token_id") == (
        f"media_placeholder_token_id 163605 is outside the vocabulary [0, {config.vocab_size:,})")
    # -1 ("none") as some released configs spell an absent pad id
    hf = released_ids_config(variant)
    hf["text_config"]["pad_token_id"] = -1
    assert parse_config(hf).special_token_id("pad_token_id") is None


@pytest.fixture(scope="module")
def released_ids_checkpoint(tmp_path_factory):
    out = write_checkpoint(get_preset("tiny"), tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, shards=1)
    (out / "config.json").write_text(json.dumps(released_ids_config()))
    return out


def test_text_runs_and_an_image_is_one_clear_line(released_ids_checkpoint) -> None:
    model = load_model(str(released_ids_checkpoint))
    assert model.config.media_placeholder_token_id == 163605
    session = Session(model, Tokenizer.byte_level(), progress=False)
    session.append(text="hello there")
    out = list(session.generate(4, temperature=0, stop_ids=()))
    assert len(out) == 4
    picture = Image.new("RGB", (64, 64), (200, 40, 40))
    before = session.length
    with pytest.raises(InputError) as refused:
        session.append(image=picture, name="cat.png")
    message = str(refused.value)
    assert "\n" not in message and "163605" in message and "outside the vocabulary" in message, message
    assert session.length == before  # nothing changed; the text already in the session is kept
