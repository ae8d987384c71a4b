"""ALBERT (AlbertForPreTraining with an sop head, else AlbertForMaskedLM): BERT's layers with factorized embeddings
(width E, projected to H) and/or one layer shared by every depth."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pretrain.core.errors import UserError
from pretrain.hf.architectures.base import (
    Architecture,
    Link,
    Table,
    Target,
    albertish,
    common_config,
    has,
    lin,
    lm_head_name,
    mlm_head,
    register,
    sentence_head,
)
from pretrain.hf.architectures.bert import BERT_COMPUTES, bert_config_fields, bert_from_config, mlm_target

# ALBERT always has embedding_hidden_mapping_in; a model without a projection (E == H) exports the identity.
ALBERT_PROJECTION = "albert.encoder.embedding_hidden_mapping_in"
_OUR_PROJECTION = "encoder.embeddings.projection.weight"


def albert_table(model: nn.Module) -> Table:
    """AlbertForPreTraining / AlbertForMaskedLM. Embeddings (width E) -> LayerNorm(E) -> projection E -> H
    (`embedding_hidden_mapping_in`); layers are groups of one layer: group i per layer, or group 0 applied
    num_layers times when our layers are shared. The MLM head projects H -> E before the tied decoder."""
    cfg = model.config
    emb, e = "encoder.embeddings", "albert.embeddings"
    table = [
        Link(f"{emb}.word_embeddings.weight", (f"{e}.word_embeddings.weight",)),
        Link(f"{emb}.position_embeddings.weight", (f"{e}.position_embeddings.weight",)),
        Link(f"{emb}.token_type_embeddings.weight", (f"{e}.token_type_embeddings.weight",)),
        *lin(f"{emb}.layer_norm", f"{e}.LayerNorm"),
    ]
    if has(model, _OUR_PROJECTION):
        table += lin(f"{emb}.projection", ALBERT_PROJECTION)
    shared = getattr(cfg, "share_layers", False)
    for i in range(cfg.num_layers):
        # Shared: one module in our state dict (encoder.shared_layer), one group of one layer in ALBERT's.
        o = "encoder.shared_layer" if shared else f"encoder.layers.{i}"
        h = f"albert.encoder.albert_layer_groups.{0 if shared else i}.albert_layers.0"
        table += [
            *lin(f"{o}.attention.qkv", *(f"{h}.attention.{p}" for p in ("query", "key", "value"))),
            *lin(f"{o}.attention.out", f"{h}.attention.dense"),
            *lin(f"{o}.attn_norm", f"{h}.attention.LayerNorm"),
            *lin(f"{o}.ffn_in", f"{h}.ffn"),
            *lin(f"{o}.ffn_out", f"{h}.ffn_output"),
            *lin(f"{o}.ffn_norm", f"{h}.full_layer_layer_norm"),
        ]
    return (
        list(dict.fromkeys(table))  # shared layers: one link per our name
        + mlm_head(lm_head_name(model), "predictions.dense", "predictions.LayerNorm", "predictions.bias")
        + sentence_head(model, "sop", "albert.pooler", "sop_classifier.classifier")
    )


def albert_target(model: nn.Module) -> Target:
    target = mlm_target(model, "albert", "AlbertForMaskedLM", ("sop", "AlbertForPreTraining"))
    if target.hf_class == "AlbertForMaskedLM":
        note = "no sop head in this run: exported as AlbertForMaskedLM, not AlbertForPreTraining"
        target = Target(target.arch, target.hf_class, (*target.notes, note))
    return target


def albert_claims(model: nn.Module) -> str | None:
    cfg = model.config
    if not albertish(cfg):
        return None
    return (
        f"model.embedding_size={cfg.embedding_size} / model.share_layers={cfg.share_layers} exist in HF only as albert"
    )


def albert_config(model: nn.Module, target: Target, tokens) -> Any:
    import transformers

    cfg = model.config
    return transformers.AlbertConfig(
        **common_config(model, target, tokens),
        **bert_config_fields(cfg),
        embedding_size=cfg.embedding_size or cfg.hidden_size,
        max_position_embeddings=cfg.max_position_embeddings,
        num_hidden_groups=1 if getattr(cfg, "share_layers", False) else cfg.num_layers,
        inner_group_num=1,
        classifier_dropout_prob=cfg.hidden_dropout,
        bos_token_id=tokens.cls,
        eos_token_id=tokens.sep,
    )


def albert_from_config(hf_cfg: Any, where: str) -> dict[str, Any]:
    if hf_cfg.inner_group_num != 1 or hf_cfg.num_hidden_groups not in (1, hf_cfg.num_hidden_layers):
        raise UserError(
            f"{where}: ALBERT with inner_group_num={hf_cfg.inner_group_num}, num_hidden_groups="
            f"{hf_cfg.num_hidden_groups}: only one layer per group, and 1 or num_hidden_layers groups, are supported"
        )
    return {
        **bert_from_config(hf_cfg, where),
        "embedding_size": hf_cfg.embedding_size,
        "share_layers": hf_cfg.num_hidden_groups == 1 and hf_cfg.num_hidden_layers > 1,
    }


def albert_export_fixup(model: nn.Module, out: dict[str, torch.Tensor]) -> None:
    if f"{ALBERT_PROJECTION}.weight" not in out:  # E == H: ALBERT projects anyway
        hidden = model.config.hidden_size
        out[f"{ALBERT_PROJECTION}.weight"] = torch.eye(hidden)
        out[f"{ALBERT_PROJECTION}.bias"] = torch.zeros(hidden)


def albert_import_fixup(model: nn.Module, hf_sd: dict, state: dict, where: str) -> set[str]:
    """A projection where we have none (E == H) must be the identity our export writes."""
    if f"{ALBERT_PROJECTION}.weight" not in hf_sd or has(model, _OUR_PROJECTION):
        return set()
    w, b = hf_sd[f"{ALBERT_PROJECTION}.weight"], hf_sd.get(f"{ALBERT_PROJECTION}.bias")
    identity = (
        w.shape[0] == w.shape[1] and torch.equal(w, torch.eye(w.shape[0], dtype=w.dtype)) and (b is None or not b.any())
    )
    if not identity:
        raise UserError(
            f"{where}: embedding_size == hidden_size but {ALBERT_PROJECTION} is not the identity; "
            "our encoder has an embedding projection only when embedding_size != hidden_size"
        )
    return {f"{ALBERT_PROJECTION}.weight", f"{ALBERT_PROJECTION}.bias"}


ALBERT = register(
    Architecture(
        name="albert",
        title="ALBERT",
        prefix="albert",
        computes=f"{BERT_COMPUTES}, plus embedding_size and/or share_layers",
        table=albert_table,
        target=albert_target,
        to_config=albert_config,
        from_config=albert_from_config,
        decoder=("predictions.decoder.weight", "albert.embeddings.word_embeddings.weight"),
        tied=(
            "predictions.decoder.weight",
            "predictions.decoder.bias",
            "albert.embeddings.position_ids",
            "albert.embeddings.token_type_ids",
        ),
        claims=albert_claims,
        priority=10,
        export_fixup=albert_export_fixup,
        import_fixup=albert_import_fixup,
    )
)
