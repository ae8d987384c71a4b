"""ModernBERT (ModernBertForMaskedLM): pre-LN, RoPE, GeGLU, no biases; with model.local_attention its
sliding-window layers, layer_types and both RoPE thetas. It has no token types: type 0's embedding is folded into
the word embeddings on export (then written untied) and recovered on import."""

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
    check_act,
    common_config,
    has,
    lin,
    lm_head_name,
    model_options,
    register,
    require,
    require_lm_head,
    what_exists,
)
from pretrain.model.encoder import layer_windows

MODERNBERT_OPTIONS = {"norm_placement": "pre", "position_embedding": "rope", "activation": "geglu", "use_bias": False}
MODERNBERT_WORD, MODERNBERT_DECODER = "model.embeddings.tok_embeddings.weight", "decoder.weight"
_OUR_TYPES = "encoder.embeddings.token_type_embeddings.weight"
_OUR_WORD = "encoder.embeddings.word_embeddings.weight"


def modernbert_table(model: nn.Module) -> Table:
    """ModernBertForMaskedLM: tok_embeddings -> norm (no positions: RoPE; no token types); pre-LN layers whose
    first has no attn_norm (the embedding norm plays its part); final_norm; head dense -> GELU -> norm;
    decoder tied with its own bias. Wqkv is q, k, v stacked on dim 0 like our qkv; Wi is [input; gate] on
    dim 0, GELU(input) * gate."""
    bias = getattr(model.config, "use_bias", True)
    emb = "encoder.embeddings"
    table = [
        Link(f"{emb}.word_embeddings.weight", (MODERNBERT_WORD,)),
        *lin(f"{emb}.layer_norm", "model.embeddings.norm", bias=bias),
    ]
    for i in range(model.config.num_layers):
        o, h = f"encoder.layers.{i}", f"model.layers.{i}"
        if has(model, f"{o}.attn_norm.weight"):
            table += lin(f"{o}.attn_norm", f"{h}.attn_norm", bias=bias)
        table += [
            *lin(f"{o}.attention.qkv", f"{h}.attn.Wqkv", bias=bias),
            *lin(f"{o}.attention.out", f"{h}.attn.Wo", bias=bias),
            *lin(f"{o}.ffn_norm", f"{h}.mlp_norm", bias=bias),
            *lin(f"{o}.ffn_in", f"{h}.mlp.Wi", bias=bias),
            *lin(f"{o}.ffn_out", f"{h}.mlp.Wo", bias=bias),
        ]
    table += lin("encoder.final_norm", "model.final_norm", bias=bias)
    head = lm_head_name(model)
    if head is not None:
        head_bias = has(model, f"{head}.dense.bias")
        table += [
            *lin(f"{head}.dense", "head.dense", bias=head_bias),
            *lin(f"{head}.layer_norm", "head.norm", bias=head_bias),
            Link(f"{head}.bias", ("decoder.bias",)),
        ]
    return table


def modernbert_claims(model: nn.Module) -> str | None:
    if model_options(model.config) != MODERNBERT_OPTIONS:
        return None
    return (
        "norm_placement=pre, rope, geglu and use_bias=false is ModernBERT's architecture; export it as "
        f"modernbert. {what_exists()}"
    )


def modernbert_target(model: nn.Module) -> Target:
    cfg = model.config
    require_lm_head(model)
    require(cfg, MODERNBERT_OPTIONS, "modernbert")
    if albertish(cfg):
        raise UserError(
            "modernbert export: ModernBERT has no factorized embeddings or shared layers "
            f"(model.embedding_size={cfg.embedding_size}, model.share_layers={cfg.share_layers})"
        )
    dropped = sorted(set(model.heads) & {"nsp", "sop"})
    notes = [f"the {h} head has no place in ModernBertForMaskedLM and is not exported" for h in dropped]
    if cfg.type_vocab_size > 1:
        notes.append(
            f"ModernBERT has no token types: type 0's embedding is folded into the word embeddings, "
            f"the other {cfg.type_vocab_size - 1} type(s) are not exported"
        )
    return Target("modernbert", "ModernBertForMaskedLM", tuple(notes))


def _type0(model: nn.Module) -> torch.Tensor:
    return model.state_dict()[_OUR_TYPES][0].detach().to("cpu", torch.float32)


def modernbert_tied(model: nn.Module) -> bool:
    """Whether a ModernBERT export of `model` keeps its decoder tied (type 0's embedding is zero)."""
    return not _type0(model).any()


def modernbert_config(model: nn.Module, target: Target, tokens) -> Any:
    import transformers

    cfg = model.config
    head = lm_head_name(model)
    # transformers reads layer_types (a token of a sliding layer sees local_attention // 2 on each side, as
    # ours); global_attn_every_n_layers is what readers before layer_types took (and 5.x keeps it).
    # All global: the window is made to cover every position too, for readers that still consult it.
    window = getattr(cfg, "local_attention", 0)
    return transformers.ModernBertConfig(
        **{**common_config(model, target, tokens), "tie_word_embeddings": modernbert_tied(model)},
        hidden_activation="gelu",
        max_position_embeddings=cfg.max_position_embeddings,
        norm_eps=cfg.layer_norm_eps,
        norm_bias=False,
        attention_bias=False,
        mlp_bias=False,
        classifier_bias=head is not None and has(model, f"{head}.dense.bias"),
        decoder_bias=True,
        classifier_activation="gelu",
        attention_dropout=cfg.attention_dropout,
        embedding_dropout=cfg.hidden_dropout,
        mlp_dropout=cfg.hidden_dropout,
        layer_types=["sliding_attention" if w else "full_attention" for w in layer_windows(cfg)],
        local_attention=window or 2 * cfg.max_position_embeddings,
        global_attn_every_n_layers=cfg.global_every if window else 1,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": float(cfg.local_rope_theta)},
        },
        bos_token_id=tokens.cls,
        eos_token_id=tokens.sep,
        cls_token_id=tokens.cls,
        sep_token_id=tokens.sep,
    )


def modernbert_from_config(hf_cfg: Any, where: str) -> dict[str, Any]:
    check_act(hf_cfg.hidden_activation, where, "hidden_activation")
    check_act(getattr(hf_cfg, "classifier_activation", "gelu"), where, "classifier_activation")  # the MLM head's
    # classifier_bias: the MLM head's dense bias, which ours has only with use_bias=true (dropped, logits off by ~2.6)
    biases = {k: getattr(hf_cfg, k, False) for k in ("norm_bias", "attention_bias", "mlp_bias", "classifier_bias")}
    if any(biases.values()):
        raise UserError(f"{where}: ModernBERT with {biases}: only bias-free layers are supported (use_bias=false)")
    thetas = {}
    for kind in ("full_attention", "sliding_attention"):
        rope = (hf_cfg.rope_parameters or {}).get(kind) or {}
        if kind in hf_cfg.layer_types and rope.get("rope_type", "default") != "default":
            raise UserError(f"{where}: {kind} rope_type {rope['rope_type']!r}; only plain RoPE is supported")
        thetas[kind] = rope.get("rope_theta")
    # type_vocab_size 1: ModernBERT has no token types; our one row stays zero (see `_types_from`)
    return dict(
        _windows(hf_cfg, where),
        max_position_embeddings=hf_cfg.max_position_embeddings,
        layer_norm_eps=hf_cfg.norm_eps,
        rope_theta=float(thetas["full_attention"]),
        **MODERNBERT_OPTIONS,
        embedding_size=0,
        share_layers=False,
        type_vocab_size=1,
    )


def _windows(hf_cfg: Any, where: str) -> dict[str, Any]:
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


def modernbert_export_fixup(model: nn.Module, out: dict[str, torch.Tensor]) -> None:
    """Ours add type 0's row to every token; ModernBERT has no token types: folded into the input table, which
    then differs from the decoder: written untied (config tie_word_embeddings=false)."""
    type0 = _type0(model)
    if type0.any():
        out[MODERNBERT_WORD] = out[MODERNBERT_WORD] + type0
        word = model.state_dict()[_OUR_WORD]
        out[MODERNBERT_DECODER] = word.detach().to("cpu", torch.float32).contiguous().clone()


def modernbert_import_fixup(model: nn.Module, hf_sd: dict, state: dict, where: str) -> set[str]:
    ref = model.state_dict()
    if _OUR_TYPES in ref:
        state[_OUR_TYPES] = _types_from(hf_sd, ref[_OUR_TYPES], where)
        if MODERNBERT_DECODER in hf_sd and state[_OUR_TYPES].any():
            state[_OUR_WORD] = hf_sd[MODERNBERT_DECODER].to(ref[_OUR_TYPES].dtype)
    return set()


def _types_from(hf_sd: dict[str, torch.Tensor], ref: torch.Tensor, where: str) -> torch.Tensor:
    """Our token-type table for a ModernBERT checkpoint, which has none: zeros (every token type 0, adding
    nothing), or, for an untied export of ours (input table = decoder + type 0's row), that row back."""
    types = torch.zeros_like(ref)
    if MODERNBERT_WORD not in hf_sd or MODERNBERT_DECODER not in hf_sd:
        return types
    diff = hf_sd[MODERNBERT_WORD].float() - hf_sd[MODERNBERT_DECODER].float()
    if not diff.any():
        return types
    if not torch.allclose(diff, diff[:1].expand_as(diff), atol=1e-5, rtol=0):
        raise UserError(
            f"{where}: the decoder is not tied to the input embeddings (nor off by one row, as our "
            "exports fold token type 0); an untied decoder cannot be imported"
        )
    types[0] = diff.mean(0).to(ref.dtype)  # one row; the mean evens out the rounding of the fold
    return types


MODERNBERT = register(
    Architecture(
        name="modernbert",
        title="ModernBERT",
        prefix="model",
        computes="norm_placement=pre, position_embedding=rope, activation=geglu, use_bias=false",
        table=modernbert_table,
        target=modernbert_target,
        to_config=modernbert_config,
        from_config=modernbert_from_config,
        tied=("decoder.weight",),
        claims=modernbert_claims,
        priority=20,
        export_fixup=modernbert_export_fixup,
        import_fixup=modernbert_import_fixup,
        token_types=False,
    )
)
