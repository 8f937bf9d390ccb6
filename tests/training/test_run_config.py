"""Run configurations (`training/configs/*.toml`, `training.run_config`): every shipped file gives its job
the settings its recorded command line gave, flags override a file, and a bad file is one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from training import demo_model, extend, gpu_run, lengthen
from training import run_config
from training.run_config import CONFIGS

PATHS = ["--base", "B", "--state", "S", "--out", "O"]

# the shipped runs as builtin:demo's MODEL_CARD.md records their commands (paths aside)
SHIPPED = {
    "builtin_demo_1_v4img.toml": (demo_model, "--threads 1 --stages dense:700x8x512,dense:200x4x1024,"
                                  "warmup:60x4x1024,sparse:200x4x1024,sparse:150x2x2048,sparse:100x1x4096,"
                                  "sparse:50x1x8192 --varied-share 0.7 --gaps --drill-share 0.5 --first-weight 3 "
                                  "--answer-style key --image-every 2 --tower-from 600 --eval-lengths 2048,8192,32768 "
                                  "--eval-samples 8,4,3"),
    "builtin_demo_2_v4img_len.toml": (lengthen, "--stages 1200x2x2048,200x1x4096 --stream 7000000 --image-every 2 "
                                      "--gaps --first-weight 3 --varied-share 0.7 --drill-share 0.5 --threads 1 "
                                      "--eval-every 400 --eval-lengths 2048,8192,32768 --eval-samples 8,4,3"),
    "builtin_demo_3_v4img_len2a.toml": (lengthen, "--stages 2000x2x2048,400x1x4096,200x1x8192 --stream 8000000 "
                                        "--image-every 2 --gaps --first-weight 3 --varied-share 0.7 --drill-share 0.5 "
                                        "--threads 1 --eval-every 500 --eval-lengths 2048,8192,32768 "
                                        "--eval-samples 8,4,3"),
    "builtin_demo_4_v4img_len3.toml": (lengthen, "--stages 800x2x2048,300x1x8192,100x1x16384 --stream 10000000 "
                                       "--image-every 2 --gaps --first-weight 3 --varied-share 0.7 --drill-share 0.5 "
                                       "--threads 1 --eval-every 400 --eval-lengths 2048,8192,32768 "
                                       "--eval-samples 8,4,3"),
    "extend.toml": (extend, "--threads 1"),
    "gpu_demo.toml": (demo_model, "--size gpu --varied-share 0.7 --gaps --drill-share 0.5 --first-weight 3 "
                                  "--image-every 2"),
    "gpu_run.toml": (gpu_run, ""),   # training/gpu_train.sh's defaults
}


def _paths(module) -> list[str]:
    own = {a.option_strings[0] for a in module.build_parser()._actions if a.option_strings}
    return [x for i in range(0, len(PATHS), 2) if PATHS[i] in own for x in PATHS[i:i + 2]]


def _settings(module, argv: list[str]) -> dict:
    args = run_config.parse_args(module.build_parser(), _paths(module) + argv, module.__name__.split(".")[-1])
    return {k: v for k, v in vars(args).items() if k != "config"}


def test_every_shipped_configuration_is_tested() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.toml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_configuration_gives_its_recorded_command_line(name: str) -> None:
    module, flags = SHIPPED[name]
    assert _settings(module, ["--config", str(CONFIGS / name)]) == _settings(module, flags.split())


def test_the_gpu_run_trains_with_the_shipped_demo_data_options() -> None:
    assert gpu_run.DEMO_CONFIG == CONFIGS / "gpu_demo.toml"
    args = demo_model.SPEC.parse_args(["--config", str(gpu_run.DEMO_CONFIG)])
    assert args.image_every == gpu_run.IMAGE_EVERY


def test_flags_override_the_file() -> None:
    config = str(CONFIGS / "builtin_demo_4_v4img_len3.toml")
    args = lengthen.SPEC.parse_args(["--base", "B", "--state", "S", "--config", config, "--stream", "5", "--no-final"])
    assert (args.stream, args.no_final, args.image_every, args.first_weight) == (5, True, 2, 3.0)


def test_a_required_option_may_come_from_the_file(tmp_path) -> None:
    path = _write(tmp_path, 'kind = "lengthen"\nbase = "builtin:demo"\n')
    args = lengthen.SPEC.parse_args(["--state", "S", "--config", path])
    assert args.base == Path("builtin:demo")
    assert lengthen.SPEC.parse_args(["--state", "S", "--config", path, "--base", "B2"]).base == Path("B2")


def _write(tmp_path, text: str) -> str:
    f = tmp_path / "run.toml"
    f.write_text(text)
    return str(f)


@pytest.mark.parametrize("text, problem", [
    ('kind = "demo_model"\nvaried_shares = 0.7\n', "unknown setting 'varied_shares'"),
    ('kind = "demo_model"\nvaried_share = "high"\n', "varied_share = 'high': must be a number"),
    ('kind = "demo_model"\ngaps = 1\n', "gaps = 1: must be true or false"),
    ('kind = "demo_model"\nseed = 1.5\n', "seed = 1.5: must be an integer"),
    ('kind = "demo_model"\nsize = "huge"\n', "must be one of"),
    ('kind = "demo_model"\nout = 5\n', "out = 5: must be a path"),
    ('kind = "demo_model"\n[stages]\ndense = 1\n', "must be a string"),
    ('kind = "demo_model"\nconfig = "other.toml"\n', "unknown setting 'config'"),
    ('kind = "lengthen"\n', "this is training.demo_model"),
    ('varied_share = 0.7\n', "kind = None"),
    ('kind = "demo_model"\nvaried_share = \n', "not valid TOML"),
])
def test_a_bad_configuration_is_one_line_naming_the_file(tmp_path, text: str, problem: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as err:
        demo_model.SPEC.parse_args(["--config", path])
    message = str(err.value)
    assert path in message and problem in message and "\n" not in message


def test_a_missing_or_huge_configuration_is_one_line(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--config .*missing.toml"):
        demo_model.SPEC.parse_args(["--config", str(tmp_path / "missing.toml")])
    huge = tmp_path / "huge.toml"
    huge.write_text('kind = "demo_model"\n' + "#" * (2 << 20))
    with pytest.raises(SystemExit, match="is not a run configuration"):
        demo_model.SPEC.parse_args(["--config", str(huge)])
