"""Issue 11 items 5, 11, 12 (config side): sizes are bounded before anything is built; wrong types and
non-finite numbers give the one-line ConfigError naming the field; config.json must be a regular file."""

from __future__ import annotations

import json
import os
import time

import pytest

from engine import config_to_hf, get_preset, parse_config
from engine.config_io import load_config
from engine.errors import ConfigError


def _hf():
    return config_to_hf(get_preset("tiny"))


@pytest.mark.parametrize("field, value, words", [
    ("num_hidden_layers", 10 ** 12, r"`num_hidden_layers`: expected an integer in \[1, 4096\], got 1000000000000"),
    ("num_hidden_layers", -6, r"`num_hidden_layers`: expected an integer in \[1, 4096\], got -6"),
    ("num_hidden_layers", 0, r"`num_hidden_layers`: expected an integer in \[1, 4096\]"),
    ("vocab_size", 2 ** 40, "`vocab_size`"),
    ("hidden_size", -1, "`hidden_size`"),
    ("num_experts", 10 ** 9, "`num_experts`"),
    ("intermediate_size", 10 ** 10, "`intermediate_size`"),
    ("max_position_embeddings", 2 ** 70, "`max_position_embeddings`"),
    ("rms_norm_eps", "abc", "`rms_norm_eps`: expected a number, got 'abc'"),
    ("rms_norm_eps", 0, "`rms_norm_eps`: expected a finite positive number"),
    ("rms_norm_eps", [1e-5], "`rms_norm_eps`: expected a number"),
    ("routed_scaling_factor", float("inf"), "`routed_scaling_factor`: expected a finite number"),
    ("routed_scaling_factor", 10 ** 400, "`routed_scaling_factor`: expected a finite number"),
    ("activation_situ_beta", None, None),  # null means the default
    ("attn_res_block_size", "8", "`attn_res_block_size`: expected an integer"),
    ("routed_expert_hidden_size", 1.5, "`routed_expert_hidden_size`: expected an integer"),
    ("eos_token_id", "</s>", "`eos_token_id`: expected an integer"),
    ("bos_token_id", 10 ** 12, "`bos_token_id`"),  # past any 32-bit id
    ("bos_token_id", -3, None),  # loads: only a use of an id outside the vocabulary is refused
    ("linear_attn_config", [1, 2], "`linear_attn_config`: expected an object, got list"),
    ("quantization_config", "mxfp4", "`quantization_config`: expected an object, got str"),
    ("dsa_config", [1], "`dsa_config`: expected an object, got list"),
    ("layer_types", [{"a": 1}], None),  # ignored: the layer lists take precedence
])
def test_text_fields_are_validated_before_anything_is_built(field, value, words):
    hf = _hf()
    hf["text_config"][field] = value
    start = time.perf_counter()
    if words is None:
        parse_config(hf)
    else:
        with pytest.raises(ConfigError, match=words) as info:
            parse_config(hf)
        assert "\n" not in str(info.value) and len(str(info.value)) < 300
    assert time.perf_counter() - start < 1.0


def test_unhashable_layer_types_are_a_config_error():
    hf = _hf()
    lin = hf["text_config"].pop("linear_attn_config")
    n = hf["text_config"]["num_hidden_layers"]
    hf["text_config"]["layer_types"] = [{"x": 1}] * n
    with pytest.raises(ConfigError, match="unknown layer types"):
        parse_config(hf)
    assert lin


def test_quantization_config_groups_of_the_wrong_type():
    hf = _hf()
    hf["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": [1]}
    with pytest.raises(ConfigError, match="config_groups`: expected an object"):
        parse_config(hf)


def test_load_config_names_the_file(tmp_path):
    hf = _hf()
    hf["text_config"]["rms_norm_eps"] = "abc"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"config\.json: config field `rms_norm_eps`"):
        load_config(tmp_path)


def test_config_json_that_is_a_directory_or_fifo(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="is a directory, not a regular file"):
        load_config(tmp_path)
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.json"
        os.mkfifo(fifo)
        with pytest.raises(ConfigError, match="is a FIFO, not a regular file"):
            load_config(fifo)


def test_config_json_that_is_not_utf8_or_deeply_nested(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_a_list_as_quantization_format():
    # found by test_fuzz_config (long profile): an unhashable format crashed the set of formats
    hf = _hf()
    hf["text_config"]["quantization_config"]["format"] = []
    with pytest.raises(ConfigError, match="quantization_config.format`: expected a string"):
        parse_config(hf)
