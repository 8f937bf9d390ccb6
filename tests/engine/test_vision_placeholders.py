"""Images in the token stream: the section-8 text around an image, placeholder expansion, the
vision config (parsing, validation naming the field, presets)."""

from __future__ import annotations

import pytest
import torch

from engine.config_io import config_to_hf, parse_config
from engine.errors import ConfigError, InputError
from engine.presets import get_preset
from engine.tokenizer import Tokenizer
from engine.vision import expand_media_placeholders, image_prompt_ids, merged_grid

PAD = 256 + 21  # <|media_pad|> with the byte-level tokenizer (163605 = 163584 + 21 at full size)


def test_media_pad_id_matches_the_presets_and_the_tokenizer():
    tok = Tokenizer.byte_level()
    for preset in ("tiny", "demo"):
        assert get_preset(preset).media_placeholder_token_id == tok.special["<|media_pad|>"] == PAD
    assert get_preset("k3.1-pro").media_placeholder_token_id == 163605


def test_image_prompt_ids_build_the_section_8_text():
    tok = Tokenizer.byte_level()
    ids = image_prompt_ids(tok, 1280, 720)
    assert tok.decode(ids) == "<|media_begin|>image 1280x720<|media_content|><|media_pad|><|media_end|>"
    assert ids.count(PAD) == 1 and ids[0] == tok.special["<|media_begin|>"]


def test_user_text_cannot_produce_media_tokens():
    tok = Tokenizer.byte_level()
    ids = tok.encode("<|media_pad|><|media_begin|>")
    assert PAD not in ids and not set(ids) & tok.special_ids


def test_expansion_layout():
    ids = [1, 2, PAD, 3, PAD, 4, 5]
    out = expand_media_placeholders(ids, [(2, 3), (1, 2)], PAD)
    assert out.input_ids.tolist() == [1, 2] + [PAD] * 6 + [3] + [PAD] * 2 + [4, 5]
    assert out.image_index.tolist() == [-1, -1] + [0] * 6 + [-1] + [1] * 2 + [-1, -1]
    assert out.patch_row.tolist() == [-1, -1, 0, 0, 0, 1, 1, 1, -1, 0, 0, -1, -1]
    assert out.patch_col.tolist() == [-1, -1, 0, 1, 2, 0, 1, 2, -1, 0, 1, -1, -1]
    assert [(s.start, s.stop, s.rows, s.cols) for s in out.spans] == [(2, 8, 2, 3), (9, 11, 1, 2)]
    assert out.is_image.sum() == 8


def test_expansion_of_an_896_square_image_gives_1024_tokens():
    grid = (64, 64)  # 896 / 14
    out = expand_media_placeholders([7, PAD, 8], [merged_grid(grid)], PAD)
    assert out.spans[0].length == 1024 and len(out.input_ids) == 1026


def test_scatter_embeddings_fills_image_positions_only():
    out = expand_media_placeholders([1, PAD, 2], [(1, 2)], PAD)
    text = torch.zeros(4, 3)
    image = torch.arange(6.0).reshape(2, 3)
    filled = out.scatter_embeddings(text, [image])
    assert torch.equal(filled[1:3], image) and (filled[[0, 3]] == 0).all() and (text == 0).all()
    with pytest.raises(InputError, match="3 embeddings for 2 positions"):
        out.scatter_embeddings(text, [torch.zeros(3, 3)])


@pytest.mark.parametrize("ids, grids, message", [
    ([1, PAD, PAD], [(1, 1)], "holds 2 <|media_pad|> tokens .* for 1 images"),
    ([1, 2], [(1, 1)], "holds 0 <|media_pad|>"),
    ([PAD], [(0, 3)], "empty merged grid"),
])
def test_expansion_errors(ids, grids, message):
    with pytest.raises(InputError, match=message.replace("|", r"\|")):
        expand_media_placeholders(ids, grids, PAD)


def test_no_images_is_the_identity():
    out = expand_media_placeholders([5, 6], [], PAD)
    assert out.input_ids.tolist() == [5, 6] and out.spans == () and not out.is_image.any()


# ---- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "demo", "k3.1-pro"])
def test_vision_config_round_trips_through_config_json(preset):
    config = get_preset(preset)
    assert config.vision is not None and config.vision.text_hidden_size == config.hidden_size
    again = parse_config(config_to_hf(config))
    assert again.vision == config.vision
    assert again.vision.projector_norm_eps == config.rms_norm_eps
    assert again.vision.tower_norm_eps == torch.finfo(torch.float32).eps


def test_k31_pro_tower_is_full_size():
    v = get_preset("k3.1-pro").vision
    assert (v.hidden_size, v.num_layers, v.num_heads, v.head_dim, v.intermediate_size) == (1024, 27, 12, 128, 4096)
    assert (v.pos_emb_height, v.pos_emb_width, v.merged_hidden_size, v.text_hidden_size) == (64, 64, 4096, 7168)


def _hf_with_vision(**changes):
    raw = config_to_hf(get_preset("tiny"))
    raw["vision_config"].update(changes)
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"vt_num_attention_heads": 3}, r"`vision_config.qkv_hidden_size`: 32 is not divisible by num_heads=3"),
    ({"qkv_hidden_size": 36, "vt_num_attention_heads": 6}, r"head dim 6 must be divisible by 4"),
    ({"vt_hidden_size": "wide"}, r"`vision_config.vt_hidden_size`: expected an integer"),
    ({"patch_size": 0}, r"`vision_config.patch_size`: expected an integer in \[1, 4096\], got 0"),
    ({"merge_kernel_size": [2]}, r"`vision_config.merge_kernel_size`: expected two integers"),
    ({"mm_projector_type": "mlp2x"}, r"`vision_config.mm_projector_type`"),
    ({"text_hidden_size": 99}, r"`vision_config.text_hidden_size`: the projector writes 99-wide"),
    ({"rope_theta": "big"}, r"`vision_config.rope_theta`: expected a number"),
])
def test_vision_config_validation_names_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(_hf_with_vision(**changes))


def test_vision_config_must_be_an_object():
    raw = config_to_hf(get_preset("tiny"))
    raw["vision_config"] = "moonvit"
    with pytest.raises(ConfigError, match="`vision_config`: expected an object"):
        parse_config(raw)
