"""Typed run configuration: reading a preset or file with dotted command-line overrides into a checked `RunConfig`,
and writing one. The schema is `pretrain.core.config_schema`, the checks of its values `pretrain.core.config_checks`;
the rest of the project imports all of it from here.

One source of truth: the DeepSpeed config, the HF export config and the data settings are all derived
from a `RunConfig`. Unknown keys and wrong types fail with the key, the value and the nearest valid key: the parsing
is `pretrain.core.parsing`'s, which every other config kind shares.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from pretrain.core.config_checks import (
    CHOICES,
    check_data_stages,
    check_options_apply,
    check_run_name,
    check_values,
)
from pretrain.core.config_schema import (
    CORPUS_FORMATS,
    GLOBAL_BATCH,
    DataConfig,
    ModelConfig,
    PhaseConfig,
    RunConfig,
    ScheduleConfig,
    ScheduledValue,
    SourceConfig,
    TensorBoardConfig,
    TrainConfig,
    WandbConfig,
)
from pretrain.core.errors import ConfigError
from pretrain.core.files import write_atomic
from pretrain.core.parsing import (
    CONFIG_DIR,
    apply_overrides,
    from_dict,
    load_yaml_with_base,
    read_yaml,
    resolve_preset,
    to_dict,
)

# The schema and the choices are imported from here: one name for the typed config wherever it is used.
__all__ = [
    "CORPUS_FORMATS",
    "CHOICES",
    "GLOBAL_BATCH",
    "REPLACED_BY_PRESET",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "PhaseConfig",
    "RunConfig",
    "ScheduleConfig",
    "ScheduledValue",
    "SourceConfig",
    "TensorBoardConfig",
    "TrainConfig",
    "WandbConfig",
    "build_config",
    "check_config",
    "load_yaml",
    "read_config",
    "require_tensorboard",
    "save_config",
]


# A preset that names its objectives means exactly those, not those plus its base's.
REPLACED_BY_PRESET = ("objectives",)


def load_yaml(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a run config preset: `load_yaml_with_base`, where a preset that names objectives replaces its base's."""
    return load_yaml_with_base(path, REPLACED_BY_PRESET, _chain)


def build_config(data: dict) -> RunConfig:
    """A typed, checked RunConfig from a dict. Its objectives are still the mapping given: the run's config is
    finished, once, by `pretrain.train.setup.resolve_config` (objectives typed, `model.init_from` applied)."""
    cfg = from_dict(RunConfig, data)
    check_values(cfg)
    return cfg


def check_config(cfg: RunConfig) -> None:
    """Every check `build_config` makes, for a config changed in code (an ablation arm given its budget's steps)."""
    check_values(cfg)


def read_config(name_or_path: str | None, overrides: list[str] | None = None) -> RunConfig:
    """A preset or file with dotted overrides, typed and checked (not yet resolved: see `build_config`)."""
    path = resolve_preset(name_or_path) if name_or_path else None
    data = load_yaml(path) if path else {}
    _refuse_objectives_added_by_an_option(data, overrides or [])
    try:
        cfg = build_config(apply_overrides(data, overrides or [], REPLACED_BY_PRESET))
    except ConfigError as err:
        where = _written_where(path, err, overrides) if path is not None else None
        if where is None:
            raise  # a preset's name says where already; a value from an override is not a file's
        raise ConfigError(f"{where}: {err}") from None
    # Here, not in build_config: a checkpoint's config is built too, and exporting it must not need the package
    if cfg.tensorboard.enabled:
        require_tensorboard()
    check_options_apply(cfg.train)  # (a checkpoint's config that has one still loads: it trained so)
    check_data_stages(cfg.data)
    check_run_name(cfg.name, cfg.output_dir)
    return cfg


def _written_where(path: Path, err: ConfigError, overrides: list[str] | None) -> Path | None:
    """The file of `path`'s chain (itself, then its `base:` files, not the presets, whose names say where) that
    writes a setting `err` names, unless an override sets it: the file to name in the message. Every key the
    message names counts (a check across two keys names the one a file wrote), an unknown top-level key too."""
    text = str(err)
    keys = re.findall(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)", text) + re.findall(r"config key '([a-z_0-9.]+)'", text)
    if not keys or any(_given_by(o, key) for o in overrides or [] for key in keys):
        return None
    chain: set[Path] = set()
    while path is not None and path.parent.resolve() != CONFIG_DIR.resolve() and path.resolve() not in chain:
        chain.add(path.resolve())
        try:
            node = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            return None
        if any(_holds(node, key) for key in keys):
            return path
        base = node.get("base") if isinstance(node, dict) else None
        path = path.parent / base if isinstance(base, str) else None  # an absolute base stays itself
        path = path if path is not None and path.is_file() else None
    return None


def _holds(node, key: str) -> bool:
    """Whether the mapping `node` (a file as read) writes the dotted `key`."""
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _given_by(override: str, key: str) -> bool:
    """Whether the dotted `override` sets `key`: it names the key, or a section above it whose value replaces the
    file's, or a mapping that holds the key (a mapping is merged over the file's: train={lr: 0.1} leaves the file's
    train.max_steps, whose error is the file's to name)."""
    name, _, raw = override.partition("=")
    name = name.strip()
    if key == name:
        return True
    if not key.startswith(name + "."):
        return False
    try:
        node = read_yaml(raw)
    except yaml.YAMLError:
        return True
    if name.split(".")[0] in REPLACED_BY_PRESET:  # taken whole: what it leaves out is a default, not the file's
        return True
    for part in key[len(name) + 1 :].split("."):
        if not isinstance(node, dict):
            return True
        if part not in node:
            return False
        node = node[part]
    return True


def _refuse_objectives_added_by_an_option(data: dict, overrides: list[str]) -> None:
    """`objectives.sop.swap_prob=0.3` on a config without sop added sop at weight 1 (and switched the run to sentence
    pairs) with no word: an objective is added by name (objectives.sop.weight=1, objectives.sop={...}) or not at all."""
    trained = set(data.get("objectives") or {})
    keys = [item.partition("=")[0].strip() for item in overrides]
    if "objectives" in keys:  # the whole mapping given: what it names is what trains
        return
    named = {k.split(".")[1] for k in keys if k.count(".") == 1 and k.startswith("objectives.")}
    named |= {
        k.split(".")[1] for k in keys if k.count(".") == 2 and k.startswith("objectives.") and k.endswith(".weight")
    }
    for item, key in zip(overrides, keys):
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "objectives" and parts[1] not in trained | named:
            raise ConfigError(
                f"{item.strip()}: this config does not train {parts[1]} ({', '.join(sorted(trained)) or 'none'}); to "
                f"add it, name it: objectives.{parts[1]}.weight=1 (or objectives.{parts[1]}={{{parts[2]}: ...}})"
            )


def require_tensorboard() -> None:
    """tensorboard.enabled needs the tensorboard package (torch.utils.tensorboard writes through it): checked when the
    config is read, before a stage writes anything, and again by the metrics logger before training."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "tensorboard.enabled=true needs the 'tensorboard' package, which is not installed: "
            "pip install tensorboard (or set tensorboard.enabled=false)"
        ) from None


def save_config(cfg: RunConfig, path: os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
