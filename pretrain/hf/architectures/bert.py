"""BERT (BertForPreTraining with an nsp head, else BertForMaskedLM) and RoBERTa (RobertaForMaskedLM, on request):
post-LN, learned positions, GELU, biases. Also the pieces ALBERT and ELECTRA share with them."""

from __future__ import annotations

from typing import Any

from torch import nn

from pretrain.core.errors import UserError
from pretrain.hf.architectures.base import (
    Architecture,
    Link,
    Table,
    Target,
    check_act,
    common_config,
    lin,
    lm_head_name,
    mlm_head,
    register,
    require,
    require_global,
    require_lm_head,
    sentence_head,
)

BERT_OPTIONS = {"norm_placement": "post", "position_embedding": "learned", "activation": "gelu", "use_bias": True}
BERT_COMPUTES = "norm_placement=post, position_embedding=learned, activation=gelu, use_bias=true"


def bert_body(num_layers: int, prefix: str, position_offset: int = 0) -> Table:
    """Embeddings + post-LN layers of BERT, RoBERTa and ELECTRA, which differ only in the prefix (and
    RoBERTa's position offset)."""
    emb, e = "encoder.embeddings", f"{prefix}.embeddings"
    table = [
        Link(f"{emb}.word_embeddings.weight", (f"{e}.word_embeddings.weight",)),
        Link(f"{emb}.position_embeddings.weight", (f"{e}.position_embeddings.weight",), position_offset),
        Link(f"{emb}.token_type_embeddings.weight", (f"{e}.token_type_embeddings.weight",)),
        *lin(f"{emb}.layer_norm", f"{e}.LayerNorm"),
    ]
    for i in range(num_layers):
        o, h = f"encoder.layers.{i}", f"{prefix}.encoder.layer.{i}"
        table += [
            *lin(f"{o}.attention.qkv", *(f"{h}.attention.self.{p}" for p in ("query", "key", "value"))),
            *lin(f"{o}.attention.out", f"{h}.attention.output.dense"),
            *lin(f"{o}.attn_norm", f"{h}.attention.output.LayerNorm"),
            *lin(f"{o}.ffn_in", f"{h}.intermediate.dense"),
            *lin(f"{o}.ffn_out", f"{h}.output.dense"),
            *lin(f"{o}.ffn_norm", f"{h}.output.LayerNorm"),
        ]
    return table


def mlm_target(model: nn.Module, arch: str, mlm_class: str, sentence: tuple[str, str] | None = None) -> Target:
    """A BERT-like *ForMaskedLM target, or its *ForPreTraining class when the run has `sentence`'s
    (objective, class) head; heads the class cannot hold are noted."""
    require_lm_head(model)
    require(model.config, BERT_OPTIONS, arch)
    require_global(model.config, arch)
    dropped = sorted(set(model.heads) & {"nsp", "sop"})
    cls = mlm_class
    if sentence is not None and sentence[0] in model.heads:
        cls = sentence[1]
        dropped.remove(sentence[0])
    return Target(arch, cls, tuple(f"the {h} head has no place in {cls} and is not exported" for h in dropped))


def bert_config_fields(cfg) -> dict[str, Any]:
    """The config fields BERT, RoBERTa, ALBERT and ELECTRA share. HF's "gelu" is GELUActivation, our erf F.gelu."""
    return dict(
        hidden_act="gelu",
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        type_vocab_size=cfg.type_vocab_size,
        layer_norm_eps=cfg.layer_norm_eps,
        use_cache=False,
    )


def bert_from_config(hf_cfg: Any, where: str) -> dict[str, Any]:
    """Our fields of a BERT-like config (absolute positions, GELU, no factorization, no sharing)."""
    check_act(hf_cfg.hidden_act, where)
    if getattr(hf_cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
        raise UserError(
            f"{where}: position_embedding_type {hf_cfg.position_embedding_type!r}; only absolute "
            "positions are supported"
        )
    return dict(
        max_position_embeddings=hf_cfg.max_position_embeddings,
        type_vocab_size=hf_cfg.type_vocab_size,
        layer_norm_eps=hf_cfg.layer_norm_eps,
        **BERT_OPTIONS,
        embedding_size=0,
        share_layers=False,
    )


# ----------------------------------------------------------------------------------------------
# BERT


def bert_table(model: nn.Module) -> Table:
    """BertForPreTraining / BertForMaskedLM (BertModel: the same names with `bert.` dropped, see `normalise`)."""
    return (
        bert_body(model.config.num_layers, "bert")
        + mlm_head(
            lm_head_name(model),
            "cls.predictions.transform.dense",
            "cls.predictions.transform.LayerNorm",
            "cls.predictions.bias",
        )
        + sentence_head(model, "nsp", "bert.pooler.dense", "cls.seq_relationship")
    )


def bert_config(model: nn.Module, target: Target, tokens) -> Any:
    import transformers

    cfg = model.config
    # transformers 5 only has absolute positions and ignores position_embedding_type; 4.x readers consult it.
    return transformers.BertConfig(
        **common_config(model, target, tokens),
        **bert_config_fields(cfg),
        max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type="absolute",
    )


BERT = register(
    Architecture(
        name="bert",
        title="BERT",
        prefix="bert",
        computes=BERT_COMPUTES,
        table=bert_table,
        target=lambda model: mlm_target(model, "bert", "BertForMaskedLM", ("nsp", "BertForPreTraining")),
        to_config=bert_config,
        from_config=bert_from_config,
        decoder=("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
        tied=(
            "cls.predictions.decoder.weight",
            "cls.predictions.decoder.bias",
            "bert.embeddings.position_ids",
            "bert.embeddings.token_type_ids",
        ),
    )
)


# ----------------------------------------------------------------------------------------------
# RoBERTa


def roberta_offset(pad_token_id: int) -> int:
    """RoBERTa numbers real tokens from padding_idx + 1 (padding itself gets position padding_idx)."""
    return pad_token_id + 1


def roberta_table(model: nn.Module) -> Table:
    """RobertaForMaskedLM: BERT's body under `roberta.`, its position table shifted by pad + 1 rows."""
    return bert_body(model.config.num_layers, "roberta", roberta_offset(model.config.pad_token_id)) + mlm_head(
        lm_head_name(model), "lm_head.dense", "lm_head.layer_norm", "lm_head.bias"
    )


def roberta_target(model: nn.Module) -> Target:
    """RobertaForMaskedLM, for a run without sentence pairs: RoBERTa's tokenizers return no token types, so a pair
    would reach the export as one segment, B typed 0, where NSP or SOP trained B as type 1."""
    pairs = sorted(set(model.heads) & {"nsp", "sop"})
    if pairs:
        raise UserError(
            f"roberta export: the run trained sentence pairs with token types ({', '.join(pairs)}), which RoBERTa's "
            f"tokenizer does not give: a pair would reach the export as one segment. Export it as bert (its class "
            f"keeps the {pairs[0]} head too, where it has one: BertForPreTraining, AlbertForPreTraining)"
        )
    return mlm_target(model, "roberta", "RobertaForMaskedLM")


def roberta_config(model: nn.Module, target: Target, tokens) -> Any:
    import transformers

    cfg = model.config
    return transformers.RobertaConfig(
        **common_config(model, target, tokens),
        **bert_config_fields(cfg),
        bos_token_id=tokens.cls,
        eos_token_id=tokens.sep,
        max_position_embeddings=cfg.max_position_embeddings + roberta_offset(tokens.pad),
    )


def roberta_from_config(hf_cfg: Any, where: str) -> dict[str, Any]:
    fields = bert_from_config(hf_cfg, where)
    fields["max_position_embeddings"] -= roberta_offset(hf_cfg.pad_token_id)
    return fields


ROBERTA = register(
    Architecture(
        name="roberta",
        title="RoBERTa",
        prefix="roberta",
        computes=BERT_COMPUTES,
        table=roberta_table,
        target=roberta_target,
        to_config=roberta_config,
        from_config=roberta_from_config,
        decoder=("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight"),
        tied=(
            "lm_head.decoder.weight",
            "lm_head.decoder.bias",
            "roberta.embeddings.position_ids",
            "roberta.embeddings.token_type_ids",
        ),
        padding_comparable=False,
    )
)
