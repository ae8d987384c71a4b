"""Config: presets, overrides, and errors that name the key, the value and the nearest valid key."""

import pytest
import yaml

from pretrain.config import RunConfig, describe_fields, load_config, save_config
from pretrain.errors import ConfigError


def test_preset_with_base_and_overrides():
    cfg = load_config("tiny", ["model.hidden_size=128", "train.lr=3e-4", "objectives.mlm.mask_prob=0.2"])
    assert cfg.model.hidden_size == 128 and cfg.model.num_layers == 2  # tiny overrides default.yaml
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.objectives["mlm"].mask_prob == pytest.approx(0.2)
    assert cfg.data.corpus == ["data/us-speeches.public-domain.jsonl"]  # inherited from default.yaml


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'model.hiden_size'.*did you mean 'hidden_size'"):
        load_config("tiny", ["model.hiden_size=128"])
    with pytest.raises(ConfigError, match=r"'objectives.mlm.mask_probability'.*'mask_prob'"):
        load_config("tiny", ["objectives.mlm.mask_probability=0.2"])
    with pytest.raises(ConfigError, match=r"unknown objective 'mlmm'.*'mlm'"):
        load_config("tiny", ["objectives.mlmm.weight=1"])


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"model.hidden_size: value 'big' is not a valid int"):
        load_config("tiny", ["model.hidden_size=big"])
    with pytest.raises(ConfigError, match=r"train.lr: value 'fast' is not a valid float"):
        load_config("tiny", ["train.lr=fast"])
    with pytest.raises(ConfigError, match=r"train.precision: value 'bf17' is not one of .*did you mean 'bf16'"):
        load_config("tiny", ["train.precision=bf17"])


def test_inconsistent_values():
    with pytest.raises(ConfigError, match="divisible"):
        load_config("tiny", ["model.hidden_size=66"])
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        load_config("tiny", ["data.max_seq_len=1024"])


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: 64\n  num_layers: [2\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="not found"):
        load_config("no-such-preset")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("tiny", ["train.max_steps=7"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_steps"] == 7


def test_every_field_is_documented():
    undocumented = [key for key, _, doc in describe_fields(RunConfig) if not doc]
    assert undocumented == []
