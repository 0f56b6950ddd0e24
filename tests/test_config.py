"""The config's keys and their forms: the default file against the dataclasses, command-line overrides,
config files, and the resolved record a run writes; its checks of values are in test_config_checks.py."""

import dataclasses
import re
import tomllib

import pytest

from grpo.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    config_to_toml,
    load_config,
    record_config,
)


# The default layout is split 1 + 1, so the default world size of these tests is 2.
def load(*argv: str, world_size: int = 2) -> Config:
    return load_config(list(argv), world_size=world_size)


def error(*argv: str, world_size: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load(*argv, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_default_file_equals_dataclass_defaults():
    assert load() == Config()


def test_default_file_lists_every_key_with_a_comment():
    with open(DEFAULT_CONFIG_PATH, "rb") as f:
        file_keys = {(s, k) for s, table in tomllib.load(f).items() for k in table}
    dataclass_keys = {(s.name, f.name) for s in dataclasses.fields(Config) for f in dataclasses.fields(s.type)}
    assert file_keys == dataclass_keys
    lines = DEFAULT_CONFIG_PATH.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\w+ = ", line):
            assert lines[i - 1].startswith("# "), f"no comment above {line!r}"


def test_default_file_sections_in_dataclass_order():
    sections = re.findall(r"^\[(\w+)\]$", DEFAULT_CONFIG_PATH.read_text(), re.MULTILINE)
    assert sections == [f.name for f in dataclasses.fields(Config)]


def test_override_equals_form_and_space_form():
    cfg = load("--grpo.group_size=4", "--training.steps", "7", "--parallelism.mode=colocated")
    assert cfg.grpo.group_size == 4
    assert cfg.training.steps == 7
    assert load("--grpo.group_size", "4") == load("--grpo.group_size=4")


def test_bare_string_overrides():
    cfg = load("--job.output_dir=runs/x", "--job.device", "cpu", "--data.task=reverse_digits")
    assert cfg.job.output_dir == "runs/x"
    assert cfg.job.device == "cpu"
    assert cfg.data.task == "reverse_digits"
    # a string key keeps text that would otherwise read as a TOML number
    assert load("--job.output_dir=2024").job.output_dir == "2024"
    cfg = load("--parallelism.mode=split", "--parallelism.generator_ranks=1", world_size=2)
    assert cfg.parallelism.mode == "split"


def test_toml_valued_overrides():
    cfg = load(
        "--generation.stop=[\"\\n\", \"</answer>\"]",
        "--optimizer.betas=[0.9,0.95]",
        "--job.deterministic=true",
        "--metrics.console",
        "false",
        "--optimizer.lr=1e-4",
        "--generation.temperature=0.7",
    )
    assert cfg.generation.stop == ["\n", "</answer>"]
    assert cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.job.deterministic is True
    assert cfg.metrics.console is False
    assert cfg.optimizer.lr == 1e-4
    assert cfg.generation.temperature == 0.7


def test_int_accepted_for_float_and_converted():
    cfg = load("--grpo.kl_coef=1", "--rewards.weights=[1, 2]", "--rewards.functions=[\"a\", \"b\"]")
    assert cfg.grpo.kl_coef == 1.0 and type(cfg.grpo.kl_coef) is float
    assert cfg.rewards.weights == [1.0, 2.0] and all(type(w) is float for w in cfg.rewards.weights)


def test_last_override_wins():
    assert load("--training.steps=3", "--training.steps=9").training.steps == 9


def test_unknown_key_suggests_closest():
    assert error("--grpo.grop_size=4") == "unknown config key 'grpo.grop_size' (did you mean 'grpo.group_size'?)"


def test_unknown_section_suggests_closest():
    assert error("--optimiser.lr=1e-3") == "unknown config section 'optimiser' (did you mean 'optimizer'?)"


def test_unknown_key_without_close_match_lists_section_keys():
    message = error("--checkpoint.qqqqqqqqqqqqqqqqqqqqqqqq=1")
    assert message.startswith("unknown config key 'checkpoint.qqqqqqqqqqqqqqqqqqqqqqqq'")
    assert "every, keep, resume, export_hf_every" in message


def test_key_without_section():
    assert "did you mean '--job.seed'?" in error("--seed=1")


def test_argument_without_dashes():
    assert "unexpected argument 'grpo.group_size=4'" in error("grpo.group_size=4")


def test_missing_value():
    assert error("--training.steps").startswith("missing value for '--training.steps'")
    assert error("--training.steps", "--grpo.group_size=4").startswith("missing value for '--training.steps'")


def test_wrong_type():
    assert error("--training.steps=ten") == "config key 'training.steps' expects int, got str ('ten')"


def test_bool_not_accepted_for_int():
    assert error("--training.steps=true") == "config key 'training.steps' expects int, got bool (True)"


def test_list_element_type():
    message = error("--optimizer.betas=[0.9, \"x\"]")
    assert message.startswith("config key 'optimizer.betas' expects list[float]")
    assert "'x'" in message
    assert "expects list[str]" in error("--generation.stop=stop")


def test_choice():
    message = error("--job.device=gpu")
    assert message == "config key 'job.device' must be one of \"auto\", \"cpu\", \"cuda\"; got \"gpu\""
    assert "parallelism.mode" in error("--parallelism.mode=async")
    assert "\"copy_digits\"" in error("--data.task=gsm8k")


@pytest.mark.parametrize(
    "override",
    ["--optimizer.lr=inf", "--optimizer.lr=nan", "--rewards.weights=[nan]", "--rewards.weights=[inf]",
     "--eval.correct_reward=nan", "--parallelism.collective_timeout_s=inf", "--generation.temperature=-inf"],
)
def test_non_finite_numbers_name_the_key(override):
    key, _, value = override[2:].partition("=")
    expected = "must hold finite numbers only" if value.startswith("[") else "must be a finite number"
    assert error(override) == f"{key} = {value} {expected}"


def test_non_finite_number_in_a_config_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optimizer]\nlr = +inf\n")
    assert error("--config", str(path)) == "optimizer.lr = inf must be a finite number"


def test_resolved_config_round_trip(tmp_path):
    cfg = load(
        "--job.output_dir=runs/a \"quoted\" \\ dir",
        "--generation.stop=[\"\\n\", \"\\t\\u007f\", \"é\"]",
        "--optimizer.lr=0.1",
        "--optimizer.eps=1e-12",
        "--rewards.functions=[\"digit_match\", \"my_rewards:length_penalty\"]",
        "--rewards.weights=[1.0, -0.25]",
        "--job.deterministic=true",
    )
    path = tmp_path / "out" / "config.toml"
    record_config(cfg, path, None)
    assert path.read_text(encoding="utf-8") == config_to_toml(cfg)
    assert load("--config", str(path)) == cfg
    assert load(f"--config={path}") == cfg


def test_a_resume_with_other_settings_keeps_the_earlier_record_and_names_the_changes(tmp_path):
    """config.toml records the latest launch; a resume whose settings differ renames the earlier
    record config.until_step_N.toml (-2, -3, ... when taken) and says which keys changed."""
    path = tmp_path / "config.toml"
    first = load("--optimizer.lr=1e-6")
    assert record_config(first, path, None) == ""
    assert record_config(first, path, 4) == ""  # same settings: nothing to keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]

    changed = load("--optimizer.lr=1e-5", "--grpo.group_size=4", "--training.steps=150")
    note = record_config(changed, path, 4)
    kept = tmp_path / "config.until_step_4.toml"
    assert note == (f"resuming with changed settings (grpo.group_size 16 -> 4, optimizer.lr 1e-06 -> 1e-05); "
                    f"the earlier config.toml is kept as {kept}")
    assert kept.read_text(encoding="utf-8") == config_to_toml(first)
    assert path.read_text(encoding="utf-8") == config_to_toml(changed)

    path.write_bytes(b"\xff not toml")
    note = record_config(first, path, 4)
    assert note.startswith("resuming with changed settings (the earlier config.toml could not be read)")
    assert (tmp_path / "config.until_step_4-2.toml").read_bytes() == b"\xff not toml"
    assert record_config(first, tmp_path / "fresh" / "config.toml", None) == ""


def test_default_round_trip(tmp_path):
    path = tmp_path / "config.toml"
    record_config(Config(), path, None)
    assert load("--config", str(path)) == Config()


def test_partial_file_falls_back_to_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[grpo]\ngroup_size = 4\n")
    cfg = load("--config", str(path), "--training.steps=2")
    assert cfg.grpo.group_size == 4 and cfg.training.steps == 2
    assert cfg.optimizer == Config().optimizer


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[grpo]\ngrop_size = 4\n")
    assert error("--config", str(path)) == "unknown config key 'grpo.grop_size' (did you mean 'grpo.group_size'?)"


def test_unknown_section_in_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optimiser]\nlr = 1e-3\n")
    assert error("--config", str(path)) == "unknown config section 'optimiser' (did you mean 'optimizer'?)"


def test_wrong_type_in_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nsteps = \"ten\"\n")
    assert error("--config", str(path)) == "config key 'training.steps' expects int, got str ('ten')"
    # A word key given a TOML bool names its words (training.share_prompts took true/false once).
    path.write_text("[training]\nshare_prompts = true\n")
    assert error("--config", str(path)) == (
        "config key 'training.share_prompts' expects one of \"auto\", \"on\", \"off\", got bool (True)")


def test_missing_and_malformed_file(tmp_path):
    assert error("--config", str(tmp_path / "nope.toml")).startswith("config file not found")
    path = tmp_path / "bad.toml"
    path.write_text("[grpo\n")
    assert error("--config", str(path)).startswith(f"cannot parse config file {path}")


def test_config_that_is_a_folder_empty_or_not_utf8(tmp_path):
    assert error(f"--config={tmp_path}") == f"cannot read config file {tmp_path}: Is a directory"
    assert error("--config=") == "'--config=' names no config file; write --config=FILE or --config FILE"
    assert error("--config", "") == "'--config' names no config file; write --config=FILE or --config FILE"
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"\xff\xfe[job]\n")
    assert error(f"--config={path}") == (
        f"config file {path} is not UTF-8 text (byte 0xff at offset 0); TOML files are UTF-8"
    )
