"""Import: start a run from a local HuggingFace checkpoint (`model.init_from: DIR`).

DIR/config.json's model_type picks the record of `pretrain.hf.architectures` (its weight table and config); our
ModelConfig's architecture fields are taken from that config (`model_config_from_hf`); weights come from
model.safetensors or pytorch_model.bin (sharded or not). Head weights the checkpoint lacks (a plain BertModel)
stay freshly initialised, with an `InitFromWarning` naming them; checkpoint weights our run has no head for are
named too.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.core.config_checks import check_values
from pretrain.core.errors import ConfigError, UserError
from pretrain.hf.architectures import get, names
from pretrain.hf.architectures.base import InitFromWarning
from pretrain.hf.architectures.weights import from_hf_state_dict, normalise, read_hf_weights
from pretrain.hf.export import HF_TOKENIZER_FILES, check_model_dir

__all__ = [
    "InitFromWarning",
    "architecture_fields",
    "check_init_tokenizer",
    "load_init_from",
    "model_config_from_hf",
    "read_hf_config",
    "resolve_init_from",
]

log = logging.getLogger(__name__)


def read_hf_config(directory: str | Path) -> Any:
    """The transformers config of a local checkpoint directory (no hub access)."""
    import transformers

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise UserError(
            f"model.init_from: {directory} has no config.json (expected a HuggingFace save_pretrained "
            f"directory of {', '.join(names())})"
        )
    check_model_dir(directory, "model.init_from: ")
    model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    if model_type not in names():
        raise UserError(
            f"model.init_from: {directory}/config.json has model_type {model_type!r}; supported: {', '.join(names())}"
        )
    return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)


# ModelConfig fields that do not change what the weights mean: they stay the run's. Every other field is the
# checkpoint's: its record's `from_config`, or, where the record does not set it (a BERT has no sliding window, no
# RoPE), our default, which is the feature off. A field added later is then off on import until a record sets it.
TRAINING_FIELDS = (
    "hidden_dropout",
    "attention_dropout",
    "initializer_range",
    "pad_token_id",  # the checkpoint's where its config has one; the tokenizer's otherwise (pretrain.train.setup)
    "unpadded",
    "compile",
    "compile_mode",
    "activation_checkpointing",
    "init_from",
)


def architecture_fields(model: ModelConfig) -> dict[str, Any]:
    """The fields of `model` that give its weights their meaning (all but TRAINING_FIELDS)."""
    return {f: v for f, v in vars(model).items() if f not in TRAINING_FIELDS}


def model_config_from_hf(hf_cfg: Any, base: ModelConfig, where: str = "model.init_from") -> ModelConfig:
    """`base` with the architecture fields of the checkpoint's config (its record's `from_config`; the rest of
    them at our defaults, see TRAINING_FIELDS). Training-time fields (dropout, initializer_range, compile,
    unpadded, ...) stay the run's: they do not change the weights' meaning."""
    t = hf_cfg.model_type
    arch = architecture_fields(ModelConfig())
    arch |= dict(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        num_layers=hf_cfg.num_hidden_layers,
        num_heads=hf_cfg.num_attention_heads,
        intermediate_size=hf_cfg.intermediate_size,
    )
    arch.update(get(t, f"{where}: model_type").from_config(hf_cfg, where))
    if getattr(hf_cfg, "pad_token_id", None) is not None:  # the tokenizer must agree (pretrain.train.setup)
        arch["pad_token_id"] = hf_cfg.pad_token_id
    known = {f.name for f in fields(ModelConfig)}
    missing = sorted(k for k in arch if k not in known)
    if missing:  # an option model.py / config.py does not have yet
        raise UserError(f"{where}: importing {t} needs ModelConfig options {missing}, which this version lacks")
    changed = {k: (getattr(base, k), v) for k, v in arch.items() if getattr(base, k) != v}
    if changed:
        log.info(
            "%s: model config from the checkpoint: %s",
            where,
            ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()),
        )
    return replace(base, **arch)


def resolve_init_from(cfg):
    """A run with `model.init_from: DIR`, settled before it starts (a new RunConfig): `data.tokenizer: DIR` when no
    tokenizer is set (the vocabulary its embeddings were trained on), and the model's architecture fields and pad
    id from DIR/config.json, so that the run's saved config.yaml describes the model even if DIR later goes away."""
    if not cfg.model.init_from:
        return cfg
    where = f"model.init_from {cfg.model.init_from}"
    data = cfg.data if cfg.data.tokenizer else replace(cfg.data, tokenizer=cfg.model.init_from)
    model = model_config_from_hf(read_hf_config(cfg.model.init_from), cfg.model, where)
    settled = replace(cfg, data=data, model=model)
    try:  # the checks the run's own model fields passed, again with the checkpoint's (its positions: max_seq_len)
        check_values(settled)
    except ConfigError as err:
        raise ConfigError(f"{where}: with the checkpoint's architecture, {err}") from None
    return settled


def check_init_tokenizer(cfg) -> None:
    """Before the tokenizer is read or trained: a run reading the checkpoint's tokenizer (no data.tokenizer given)
    from a directory without tokenizer.json (older repos keep vocab.txt) went on to train one into the checkpoint's
    directory, and was refused there with a message about that directory's files."""
    init = Path(cfg.model.init_from) if cfg.model.init_from else None
    if init is None or Path(cfg.tokenizer_dir).resolve() != init.resolve() or (init / "tokenizer.json").is_file():
        return
    found = sorted(p.name for p in init.glob("*") if p.name in HF_TOKENIZER_FILES)
    raise UserError(
        f"model.init_from {init} has no tokenizer.json{f' (only {found})' if found else ''}: set data.tokenizer to "
        "the directory of a fast tokenizer with the checkpoint's vocabulary (transformers' AutoTokenizer loads this "
        "one and save_pretrained writes tokenizer.json)"
    )


def load_init_from(model: nn.Module, directory: str | Path) -> dict[str, list[str]]:
    """Copy the weights of a HF checkpoint directory into `model` (built from a config `resolve_init_from` settled).
    Returns {"fresh": our tensors left as initialised, "unused": checkpoint tensors not used}; both are also
    reported with an `InitFromWarning`. Missing encoder weights are an error."""
    directory = Path(directory)
    hf_cfg = read_hf_config(directory)
    arch = hf_cfg.model_type
    where = f"model.init_from {directory}"
    record = get(arch, f"{where}: model_type")
    sd = normalise(read_hf_weights(directory), arch)
    classes = list(getattr(hf_cfg, "architectures", None) or [])

    if record.import_weights is not None:  # ELECTRA: the discriminator, its generator/, or a generator alone
        state, absent, unused = record.import_weights(model, directory, sd, classes, where)
    else:
        state, absent, unused = from_hf_state_dict(sd, model, arch, where)
    encoder_absent = [link.ours for link in absent if link.ours.startswith("encoder.")]
    if encoder_absent:
        raise UserError(
            f"{where}: not a complete {arch} encoder of this size: missing {encoder_absent[:5]}"
            f"{' ...' if len(encoder_absent) > 5 else ''}"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:  # a table naming something our model lacks: a bug here, not the user's
        raise RuntimeError(f"weight table of {arch} names tensors this model lacks: {unexpected[:5]}")
    fresh = sorted(missing)
    if fresh:
        heads = sorted({".".join(n.split(".")[:2]) for n in fresh})
        warnings.warn(
            f"{where} ({', '.join(classes) or arch}) has no weights for {', '.join(heads)}: freshly "
            f"initialised ({len(fresh)} tensors, e.g. {fresh[0]})",
            InitFromWarning,
            stacklevel=2,
        )
    if unused:
        warnings.warn(
            f"{where}: {len(unused)} checkpoint tensors have no place in this run's model and are not "
            f"used: {unused[:6]}{' ...' if len(unused) > 6 else ''}",
            InitFromWarning,
            stacklevel=2,
        )
    return {"fresh": fresh, "unused": unused}
