"""Import: start a run from a local HuggingFace checkpoint (`model.init_from: DIR`).

DIR/config.json's model_type picks the weight table of `pretrain.hf.interop`; our ModelConfig's architecture
fields are taken from that config (`model_config_from_hf`); weights come from model.safetensors or
pytorch_model.bin (sharded or not). Head weights the checkpoint lacks (a plain BertModel) stay freshly
initialised, with an `InitFromWarning` naming them; checkpoint weights our run has no head for are named too.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.hf.interop import (
    ARCHITECTURES,
    BASE_PREFIX,
    BERT_OPTIONS,
    MODERNBERT_OPTIONS,
    electra_discriminator_table,
    electra_generator_as_mlm_table,
    fill_aliases,
    from_hf_state_dict,
    generator_table,
    roberta_offset,
)

log = logging.getLogger(__name__)


class InitFromWarning(UserWarning):
    """Something of an imported checkpoint was not used, or something of our model was not in it."""


def read_hf_config(directory: str | Path) -> Any:
    """The transformers config of a local checkpoint directory (no hub access)."""
    import transformers

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise UserError(
            f"model.init_from: {directory} has no config.json (expected a HuggingFace save_pretrained "
            f"directory of {', '.join(ARCHITECTURES)})"
        )
    model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(
            f"model.init_from: {directory}/config.json has model_type {model_type!r}; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)


def _check_act(act: str, where: str) -> None:
    if act == "gelu":
        return
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python"):
        warnings.warn(
            f"{where}: hidden_act {act!r} is the tanh approximation of GELU; our encoder computes the "
            "exact erf GELU (differences of about 1e-3 per activation), and exports say 'gelu'",
            InitFromWarning,
            stacklevel=3,
        )
        return
    raise UserError(f"{where}: hidden_act {act!r} has no equivalent here (our encoder uses GELU)")


def model_config_from_hf(hf_cfg: Any, base: ModelConfig, where: str = "model.init_from") -> ModelConfig:
    """`base` with the architecture fields of the checkpoint's config. Training-time fields (dropout,
    initializer_range, compile, unpadded, ...) stay the run's: they do not change the weights' meaning."""
    t = hf_cfg.model_type
    arch: dict[str, Any] = dict(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        num_layers=hf_cfg.num_hidden_layers,
        num_heads=hf_cfg.num_attention_heads,
        intermediate_size=hf_cfg.intermediate_size,
    )
    if t in ("bert", "roberta", "albert", "electra"):
        _check_act(hf_cfg.hidden_act, where)
        if getattr(hf_cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise UserError(
                f"{where}: position_embedding_type {hf_cfg.position_embedding_type!r}; only absolute "
                "positions are supported"
            )
        arch.update(
            max_position_embeddings=hf_cfg.max_position_embeddings,
            type_vocab_size=hf_cfg.type_vocab_size,
            layer_norm_eps=hf_cfg.layer_norm_eps,
            **BERT_OPTIONS,
            embedding_size=0,
            share_layers=False,
        )
        if t == "roberta":
            arch["max_position_embeddings"] -= roberta_offset(hf_cfg.pad_token_id)
        if t == "albert":
            if hf_cfg.inner_group_num != 1 or hf_cfg.num_hidden_groups not in (1, hf_cfg.num_hidden_layers):
                raise UserError(
                    f"{where}: ALBERT with inner_group_num={hf_cfg.inner_group_num}, num_hidden_groups="
                    f"{hf_cfg.num_hidden_groups}: only one layer per group, and 1 or num_hidden_layers "
                    "groups, are supported"
                )
            arch.update(
                embedding_size=hf_cfg.embedding_size,
                share_layers=hf_cfg.num_hidden_groups == 1 and hf_cfg.num_hidden_layers > 1,
            )
        if t == "electra" and hf_cfg.embedding_size != hf_cfg.hidden_size:
            arch["embedding_size"] = hf_cfg.embedding_size
    elif t == "modernbert":
        _check_act(hf_cfg.hidden_activation, where)
        biases = {k: getattr(hf_cfg, k) for k in ("norm_bias", "attention_bias", "mlp_bias")}
        if any(biases.values()):
            raise UserError(f"{where}: ModernBERT with {biases}: only bias-free layers are supported (use_bias=false)")
        thetas = {}
        for kind in ("full_attention", "sliding_attention"):
            rope = (hf_cfg.rope_parameters or {}).get(kind) or {}
            if kind in hf_cfg.layer_types and rope.get("rope_type", "default") != "default":
                raise UserError(f"{where}: {kind} rope_type {rope['rope_type']!r}; only plain RoPE is supported")
            thetas[kind] = rope.get("rope_theta")
        # type_vocab_size 1: ModernBERT has no token types; our one row stays zero (see _modernbert_types_from)
        arch.update(
            _modernbert_windows(hf_cfg, where),
            max_position_embeddings=hf_cfg.max_position_embeddings,
            layer_norm_eps=hf_cfg.norm_eps,
            rope_theta=float(thetas["full_attention"]),
            **MODERNBERT_OPTIONS,
            embedding_size=0,
            share_layers=False,
            type_vocab_size=1,
        )
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


def _modernbert_windows(hf_cfg: Any, where: str) -> dict[str, Any]:
    """model.local_attention / global_every / local_rope_theta of a ModernBERT config's layer_types: ours has global
    attention at every global_every-th layer from the first (the layouts ModernBERT's global_attn_every_n_layers
    makes), local elsewhere."""
    types = list(hf_cfg.layer_types)
    theta = ((hf_cfg.rope_parameters or {}).get("sliding_attention") or {}).get("rope_theta")
    out: dict[str, Any] = {} if theta is None else {"local_rope_theta": float(theta)}
    if all(t == "full_attention" for t in types):
        return {**out, "local_attention": 0}
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[1] if len(full) > 1 else len(types)
    if types != ["full_attention" if i % every == 0 else "sliding_attention" for i in range(len(types))]:
        raise UserError(
            f"{where}: layer_types {types}: our encoder has global attention in every n-th layer from the first "
            "(model.global_every) and sliding-window attention in the others; this layout is not one of those"
        )
    half = hf_cfg.local_attention // 2  # transformers' sliding_window: what a token sees on each side
    if half < 1:
        raise UserError(
            f"{where}: local_attention {hf_cfg.local_attention}: a window that sees no other token has no "
            "model.local_attention equivalent (0 means global)"
        )
    return {**out, "local_attention": 2 * half, "global_every": every}  # an odd window is the even one below it


def _normalise(sd: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """A bare base model (BertModel, ModernBertModel, ...) saves its keys without the base prefix: add it."""
    prefix = BASE_PREFIX[arch] + "."
    if any(k.startswith(prefix) for k in sd):
        return sd
    return {prefix + k: v for k, v in sd.items()}


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """model.safetensors / pytorch_model.bin of a save_pretrained directory, sharded or not, on CPU."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for index_name, loader in (
        ("model.safetensors.index.json", load_file),
        ("pytorch_model.bin.index.json", _load_bin),
    ):
        if (directory / index_name).is_file():
            files = sorted(set(json.loads((directory / index_name).read_text())["weight_map"].values()))
            sd = {}
            for f in files:
                sd.update(loader(str(directory / f)))
            return sd
    if (directory / "model.safetensors").is_file():
        return load_file(str(directory / "model.safetensors"))
    if (directory / "pytorch_model.bin").is_file():
        return _load_bin(str(directory / "pytorch_model.bin"))
    raise UserError(f"model.init_from: {directory} has no model.safetensors or pytorch_model.bin")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)  # weights only: no pickled code runs


def resolve_init_from(cfg):
    """A run with `model.init_from: DIR`, settled before it starts (a new RunConfig): `data.tokenizer: DIR` when no
    tokenizer is set (the vocabulary its embeddings were trained on), and the model's architecture fields and pad
    id from DIR/config.json, so that the run's saved config.yaml describes the model even if DIR later goes away."""
    if not cfg.model.init_from:
        return cfg
    data = cfg.data if cfg.data.tokenizer else replace(cfg.data, tokenizer=cfg.model.init_from)
    model = model_config_from_hf(
        read_hf_config(cfg.model.init_from), cfg.model, f"model.init_from {cfg.model.init_from}"
    )
    return replace(cfg, data=data, model=model)


def load_init_from(model: nn.Module, directory: str | Path) -> dict[str, list[str]]:
    """Copy the weights of a HF checkpoint directory into `model` (built from a config `resolve_init_from` settled).
    Returns {"fresh": our tensors left as initialised, "unused": checkpoint tensors not used}; both are also
    reported with an `InitFromWarning`. Missing encoder weights are an error."""
    directory = Path(directory)
    hf_cfg = read_hf_config(directory)
    arch = hf_cfg.model_type
    where = f"model.init_from {directory}"
    sd = _normalise(read_hf_weights(directory), arch)
    classes = list(getattr(hf_cfg, "architectures", None) or [])

    if arch == "electra":
        state, absent, unused = _electra_import(model, directory, sd, classes, where)
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


def _electra_import(model, directory: Path, sd, classes, where):
    """An ELECTRA directory: the discriminator (ElectraForPreTraining) is our encoder (+ our rtd head, and the
    generator from DIR/generator as our own exports write it); a generator alone (ElectraForMaskedLM) is
    imported as a BERT-style MLM model (its prediction head is ours under other names)."""
    is_generator = "ElectraForMaskedLM" in classes or any(k.startswith("generator_") for k in sd)
    if is_generator:
        if "rtd" in model.heads:
            raise UserError(
                f"{where} is an ELECTRA generator (ElectraForMaskedLM). An rtd run imports the "
                "discriminator directory (ElectraForPreTraining, with the generator in generator/); a "
                "generator alone can start an mlm/span/plm run as its encoder + MLM head"
            )
        return from_hf_state_dict(sd, model, "electra", where, electra_generator_as_mlm_table(model))
    state, absent, unused = from_hf_state_dict(sd, model, "electra", where, electra_discriminator_table(model))
    gen_dir = directory / "generator"
    if "rtd" in model.heads and (gen_dir / "config.json").is_file():
        gen = model.heads["rtd"].generator
        gen_sd = _normalise(read_hf_weights(gen_dir), "electra")
        gen_table = generator_table(gen)
        gen_state, gen_absent, gen_unused = from_hf_state_dict(
            gen_sd, model, "electra", f"{where}/generator", gen_table
        )
        word = "encoder.embeddings.word_embeddings.weight"
        for name, tensor in gen_state.items():
            if name.startswith("encoder.embeddings.") and name in state and not torch.equal(state[name], tensor):
                if name == word and "encoder.embeddings.word_embeddings.delta" in model.state_dict():
                    continue  # disentangled: handled below
                raise UserError(f"{where}: the generator's {name} differs from the discriminator's; ours share it")
        if "encoder.embeddings.word_embeddings.delta" in model.state_dict():
            effective = state[word]
            state = {**state, **gen_state, "encoder.embeddings.word_embeddings.delta": effective - gen_state[word]}
        else:
            state = {**gen_state, **state}
        absent = [link for link in absent] + gen_absent
        unused = unused + [f"generator/{k}" for k in gen_unused]
        state = fill_aliases(model, state)
    return state, absent, unused
