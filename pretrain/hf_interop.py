"""HuggingFace interop, both ways: one explicit weight table per architecture, used to export AND to import.

A table is a list of `Link(ours, hf, offset)`:
- one HF name: a rename;
- several HF names: our tensor is their concatenation on dim 0 (our fused qkv Linear stacks q, k, v along
  its output dimension; HF BERT keeps three Linears);
- `offset` > 0: the HF tensor has `offset` extra leading rows before ours (RoBERTa's position table, whose
  ids start at padding_idx + 1). Those rows are unreachable for real tokens; export writes zeros there.
- several of OUR names on one HF name: our layers share one set of weights (ALBERT's one layer group).
`to_hf` and `from_hf` below are the only two functions that read tables; nothing else renames weights.

Export dispatch (`select_architecture`), from the model options and the run's heads:
- rtd objective                       -> electra (ElectraForPreTraining + generator/ElectraForMaskedLM);
- pre-LN + RoPE + GeGLU + no biases   -> modernbert (ModernBertForMaskedLM, global attention in every layer);
- factorized embeddings or shared layers (or --arch albert)
                                      -> albert (AlbertForPreTraining with an sop head, else AlbertForMaskedLM);
- --arch roberta                      -> roberta (RobertaForMaskedLM);
- otherwise                           -> bert (BertForPreTraining with an nsp head, else BertForMaskedLM).
Any other mix of options (pre-LN with learned positions, RoPE with post-LN, ...) has no HF class that
computes the same function: `UserError` naming the option and the architectures that exist.

Import (`model.init_from: DIR`): DIR/config.json's model_type picks the table; our ModelConfig's architecture
fields are taken from that config (`model_config_from_hf`); weights come from model.safetensors or
pytorch_model.bin (sharded or not). Head weights the checkpoint lacks (a plain BertModel) stay freshly
initialised, with an `InitFromWarning` naming them; checkpoint weights our run has no head for are named too.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from pretrain.config import ModelConfig
from pretrain.errors import UserError

log = logging.getLogger(__name__)

ARCHITECTURES = ("bert", "roberta", "albert", "electra", "modernbert")


class InitFromWarning(UserWarning):
    """Something of an imported checkpoint was not used, or something of our model was not in it."""


class Link(NamedTuple):
    ours: str
    """Our state-dict name."""
    hf: tuple[str, ...]
    """HF state-dict names; several: our tensor is their concatenation on dim 0."""
    offset: int = 0
    """Leading rows of the HF tensor that are not ours (RoBERTa's position ids start at pad + 1)."""


Table = list[Link]


# ----------------------------------------------------------------------------------------------
# What our model has: options and heads


def _has(model: nn.Module, name: str) -> bool:
    """Whether our model has this tensor (biases, norms and projections depend on its options)."""
    return name in model.state_dict()


def lm_head_name(model: nn.Module) -> str | None:
    """Dotted name of the token-prediction head tied to the word embeddings (heads.mlm, heads.span.mlm,
    heads.plm, ...), or None."""
    from objectives.mlm import MLMHead

    tied = model.encoder.embeddings.word_embeddings.weight
    for name, module in model.named_modules():
        if isinstance(module, MLMHead) and module.decoder_weight is tied and name.startswith("heads."):
            return name
    return None


def factorized(cfg: ModelConfig) -> bool:
    """ALBERT's factorized embeddings: a token table narrower (or wider) than the encoder."""
    return bool(getattr(cfg, "embedding_size", 0)) and cfg.embedding_size != cfg.hidden_size


def _options(cfg: ModelConfig) -> dict[str, Any]:
    return {"norm_placement": getattr(cfg, "norm_placement", "post"),
            "position_embedding": getattr(cfg, "position_embedding", "learned"),
            "activation": getattr(cfg, "activation", "gelu"),
            "use_bias": getattr(cfg, "use_bias", True)}


_BERT_OPTIONS = {"norm_placement": "post", "position_embedding": "learned", "activation": "gelu", "use_bias": True}
_MODERNBERT_OPTIONS = {"norm_placement": "pre", "position_embedding": "rope", "activation": "geglu",
                       "use_bias": False}
_WHAT_EXISTS = ("bert / roberta / electra: norm_placement=post, position_embedding=learned, activation=gelu, "
                "use_bias=true; albert: the same plus embedding_size and/or share_layers; modernbert: "
                "norm_placement=pre, position_embedding=rope, activation=geglu, use_bias=false")


@dataclass(frozen=True)
class Target:
    """What an export writes: the architecture (HF model_type) and the HF class."""

    arch: str
    hf_class: str
    notes: tuple[str, ...] = ()
    """Things the user should know (a head that is not exported, a class chosen for lack of a head)."""


def select_architecture(model: nn.Module, requested: str | None = None) -> Target:
    """The HF architecture that computes exactly what `model` computes (see the module docstring)."""
    cfg = model.config
    heads = set(model.heads)
    if requested and requested not in ARCHITECTURES:
        raise UserError(f"--arch {requested}: not one of {', '.join(ARCHITECTURES)}")
    opts = _options(cfg)
    albertish = factorized(cfg) or getattr(cfg, "share_layers", False)

    if "rtd" in heads:
        if requested not in (None, "electra"):
            raise UserError(f"--arch {requested}: an rtd (ELECTRA) run exports as electra only")
        _require(opts, _BERT_OPTIONS, "electra")
        if albertish:
            raise UserError("ELECTRA export has no factorized embeddings or shared layers on the discriminator "
                            f"(model.embedding_size={cfg.embedding_size}, model.share_layers={cfg.share_layers})")
        return Target("electra", "ElectraForPreTraining", ("the generator is in generator/ (ElectraForMaskedLM)",))

    if lm_head_name(model) is None:
        raise UserError(f"HF export needs a token-prediction objective (mlm, span, plm) or rtd; this model "
                        f"has heads {sorted(heads) or 'none'}")
    dropped = sorted(heads & {"nsp", "sop"})

    if opts == _MODERNBERT_OPTIONS:
        if requested not in (None, "modernbert"):
            raise UserError(f"--arch {requested}: norm_placement=pre, rope, geglu and use_bias=false is "
                            f"ModernBERT's architecture; export it as modernbert. {_WHAT_EXISTS}")
        if albertish:
            raise UserError("modernbert export: ModernBERT has no factorized embeddings or shared layers "
                            f"(model.embedding_size={cfg.embedding_size}, model.share_layers={cfg.share_layers})")
        notes = [f"the {h} head has no place in ModernBertForMaskedLM and is not exported" for h in dropped]
        if cfg.type_vocab_size > 1:
            notes.append(f"ModernBERT has no token types: type 0's embedding is folded into the word embeddings, "
                         f"the other {cfg.type_vocab_size - 1} type(s) are not exported")
        return Target("modernbert", "ModernBertForMaskedLM", tuple(notes))

    arch = requested or ("albert" if albertish else "bert")
    _require(opts, _BERT_OPTIONS, arch)
    if albertish and arch != "albert":
        raise UserError(f"--arch {arch}: model.embedding_size={cfg.embedding_size} / model.share_layers="
                        f"{cfg.share_layers} exist in HF only as albert")
    if arch == "electra":
        raise UserError("--arch electra needs an rtd run (ElectraForPreTraining is a replaced-token detector)")
    if arch == "modernbert":
        _require(opts, _MODERNBERT_OPTIONS, "modernbert")
    sentence = {"bert": "nsp", "albert": "sop"}.get(arch)
    if sentence in heads:
        cls = {"bert": "BertForPreTraining", "albert": "AlbertForPreTraining"}[arch]
        dropped.remove(sentence)
    else:
        cls = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "albert": "AlbertForMaskedLM"}[arch]
    notes = [f"the {h} head has no place in {cls} and is not exported" for h in dropped]
    if arch == "albert" and cls == "AlbertForMaskedLM":
        notes.append("no sop head in this run: exported as AlbertForMaskedLM, not AlbertForPreTraining")
    return Target(arch, cls, tuple(notes))


def _require(opts: dict, wanted: dict, arch: str) -> None:
    for key, value in wanted.items():
        if opts[key] != value:
            raise UserError(f"model.{key}={str(opts[key]).lower()} has no {arch} equivalent in HuggingFace "
                            f"transformers. HF architectures that exist: {_WHAT_EXISTS}")


# ----------------------------------------------------------------------------------------------
# The tables


def _lin(ours: str, *hf: str, bias: bool = True) -> Table:
    """A Linear or LayerNorm: weight and (when the model has biases) bias."""
    params = ("weight", "bias") if bias else ("weight",)
    return [Link(f"{ours}.{p}", tuple(f"{h}.{p}" for h in hf)) for p in params]


def bert_body(num_layers: int, prefix: str, position_offset: int = 0) -> Table:
    """Embeddings + post-LN layers of BERT, RoBERTa and ELECTRA, which differ only in the prefix (and
    RoBERTa's position offset)."""
    emb, e = "encoder.embeddings", f"{prefix}.embeddings"
    table = [Link(f"{emb}.word_embeddings.weight", (f"{e}.word_embeddings.weight",)),
             Link(f"{emb}.position_embeddings.weight", (f"{e}.position_embeddings.weight",), position_offset),
             Link(f"{emb}.token_type_embeddings.weight", (f"{e}.token_type_embeddings.weight",)),
             *_lin(f"{emb}.layer_norm", f"{e}.LayerNorm")]
    for i in range(num_layers):
        o, h = f"encoder.layers.{i}", f"{prefix}.encoder.layer.{i}"
        table += [*_lin(f"{o}.attention.qkv", *(f"{h}.attention.self.{p}" for p in ("query", "key", "value"))),
                  *_lin(f"{o}.attention.out", f"{h}.attention.output.dense"),
                  *_lin(f"{o}.attn_norm", f"{h}.attention.output.LayerNorm"),
                  *_lin(f"{o}.ffn_in", f"{h}.intermediate.dense"),
                  *_lin(f"{o}.ffn_out", f"{h}.output.dense"),
                  *_lin(f"{o}.ffn_norm", f"{h}.output.LayerNorm")]
    return table


def _mlm_head(head: str | None, dense: str, norm: str, bias: str, with_bias: bool = True) -> Table:
    """dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (no entry: the decoder weight IS the
    word-embedding Parameter, and HF re-ties it on load) + the decoder's own bias."""
    if head is None:
        return []
    return [*_lin(f"{head}.dense", dense, bias=with_bias), *_lin(f"{head}.layer_norm", norm, bias=with_bias),
            Link(f"{head}.bias", (bias,))]


def _sentence_head(model: nn.Module, objective: str, pooler: str, classifier: str) -> Table:
    if objective not in model.heads:
        return []
    return [*_lin(f"heads.{objective}.pooler.dense", pooler), *_lin(f"heads.{objective}.classifier", classifier)]


def bert_table(model: nn.Module) -> Table:
    """BertForPreTraining / BertForMaskedLM (BertModel: the same names with `bert.` dropped, see `_normalise`)."""
    return (bert_body(model.config.num_layers, "bert")
            + _mlm_head(lm_head_name(model), "cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                        "cls.predictions.bias")
            + _sentence_head(model, "nsp", "bert.pooler.dense", "cls.seq_relationship"))


def roberta_offset(pad_token_id: int) -> int:
    """RoBERTa numbers real tokens from padding_idx + 1 (padding itself gets position padding_idx)."""
    return pad_token_id + 1


def roberta_table(model: nn.Module) -> Table:
    """RobertaForMaskedLM: BERT's body under `roberta.`, its position table shifted by pad + 1 rows."""
    return (bert_body(model.config.num_layers, "roberta", roberta_offset(model.config.pad_token_id))
            + _mlm_head(lm_head_name(model), "lm_head.dense", "lm_head.layer_norm", "lm_head.bias"))


def electra_discriminator_table(model: nn.Module) -> Table:
    """ElectraForPreTraining (the table of `export_electra`): BERT's body under `electra.` + the discriminator
    head, when our model has one (an rtd run)."""
    from pretrain.export_electra import discriminator_weight_map

    table = discriminator_weight_map(model.config.num_layers) + _electra_projection(model)
    return table if "rtd" in model.heads else [link for link in table if link.ours.startswith("encoder.")]


def _electra_projection(model: nn.Module) -> Table:
    """ELECTRA with embedding_size != hidden_size projects LN-ed embeddings up, as ALBERT (and we) do."""
    if not _has(model, "encoder.embeddings.projection.weight"):
        return []
    return _lin("encoder.embeddings.projection", "electra.embeddings_project")


def electra_generator_as_mlm_table(model: nn.Module) -> Table:
    """ElectraForMaskedLM imported as a plain MLM model: its head is ours (same math, other names)."""
    return (bert_body(model.config.num_layers, "electra") + _electra_projection(model)
            + _mlm_head(lm_head_name(model), "generator_predictions.dense", "generator_predictions.LayerNorm",
                        "generator_lm_head.bias"))


def albert_table(model: nn.Module) -> Table:
    """AlbertForPreTraining / AlbertForMaskedLM. Embeddings (width E) -> LayerNorm(E) -> projection E -> H
    (`embedding_hidden_mapping_in`); layers are groups of one layer: group i per layer, or group 0 applied
    num_layers times when our layers are shared. The MLM head projects H -> E before the tied decoder."""
    cfg = model.config
    emb, e = "encoder.embeddings", "albert.embeddings"
    table = [Link(f"{emb}.word_embeddings.weight", (f"{e}.word_embeddings.weight",)),
             Link(f"{emb}.position_embeddings.weight", (f"{e}.position_embeddings.weight",)),
             Link(f"{emb}.token_type_embeddings.weight", (f"{e}.token_type_embeddings.weight",)),
             *_lin(f"{emb}.layer_norm", f"{e}.LayerNorm")]
    if _has(model, f"{emb}.projection.weight"):
        table += _lin(f"{emb}.projection", "albert.encoder.embedding_hidden_mapping_in")
    shared = getattr(cfg, "share_layers", False)
    for i in range(cfg.num_layers):
        # Shared: one module in our state dict (encoder.shared_layer), one group of one layer in ALBERT's.
        o = "encoder.shared_layer" if shared else f"encoder.layers.{i}"
        h = f"albert.encoder.albert_layer_groups.{0 if shared else i}.albert_layers.0"
        table += [*_lin(f"{o}.attention.qkv", *(f"{h}.attention.{p}" for p in ("query", "key", "value"))),
                  *_lin(f"{o}.attention.out", f"{h}.attention.dense"),
                  *_lin(f"{o}.attn_norm", f"{h}.attention.LayerNorm"),
                  *_lin(f"{o}.ffn_in", f"{h}.ffn"),
                  *_lin(f"{o}.ffn_out", f"{h}.ffn_output"),
                  *_lin(f"{o}.ffn_norm", f"{h}.full_layer_layer_norm")]
    return (list(dict.fromkeys(table))  # shared layers: one link per our name
            + _mlm_head(lm_head_name(model), "predictions.dense", "predictions.LayerNorm", "predictions.bias")
            + _sentence_head(model, "sop", "albert.pooler", "sop_classifier.classifier"))


# ALBERT always has embedding_hidden_mapping_in; a model without a projection (E == H) exports the identity.
ALBERT_PROJECTION = "albert.encoder.embedding_hidden_mapping_in"


def modernbert_table(model: nn.Module) -> Table:
    """ModernBertForMaskedLM: tok_embeddings -> norm (no positions: RoPE; no token types); pre-LN layers whose
    first has no attn_norm (the embedding norm plays its part); final_norm; head dense -> GELU -> norm;
    decoder tied with its own bias. Wqkv is q, k, v stacked on dim 0 like our qkv; Wi is [input; gate] on
    dim 0, GELU(input) * gate."""
    bias = getattr(model.config, "use_bias", True)
    emb = "encoder.embeddings"
    table = [Link(f"{emb}.word_embeddings.weight", ("model.embeddings.tok_embeddings.weight",)),
             *_lin(f"{emb}.layer_norm", "model.embeddings.norm", bias=bias)]
    for i in range(model.config.num_layers):
        o, h = f"encoder.layers.{i}", f"model.layers.{i}"
        if _has(model, f"{o}.attn_norm.weight"):
            table += _lin(f"{o}.attn_norm", f"{h}.attn_norm", bias=bias)
        table += [*_lin(f"{o}.attention.qkv", f"{h}.attn.Wqkv", bias=bias),
                  *_lin(f"{o}.attention.out", f"{h}.attn.Wo", bias=bias),
                  *_lin(f"{o}.ffn_norm", f"{h}.mlp_norm", bias=bias),
                  *_lin(f"{o}.ffn_in", f"{h}.mlp.Wi", bias=bias),
                  *_lin(f"{o}.ffn_out", f"{h}.mlp.Wo", bias=bias)]
    table += _lin("encoder.final_norm", "model.final_norm", bias=bias)
    head = lm_head_name(model)
    if head is not None:
        head_bias = _has(model, f"{head}.dense.bias")
        table += [*_lin(f"{head}.dense", "head.dense", bias=head_bias),
                  *_lin(f"{head}.layer_norm", "head.norm", bias=head_bias),
                  Link(f"{head}.bias", ("decoder.bias",))]
    return table


TABLES = {"bert": bert_table, "roberta": roberta_table, "albert": albert_table,
          "electra": electra_discriminator_table, "modernbert": modernbert_table}

# Keys HF may carry that hold no information of their own: decoders tied to the word embeddings (and to the
# head's bias), and non-persistent buffers older versions saved.
_TIED_OR_BUFFERS = {
    "bert": ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "bert.embeddings.position_ids",
             "bert.embeddings.token_type_ids"),
    "roberta": ("lm_head.decoder.weight", "lm_head.decoder.bias", "roberta.embeddings.position_ids",
                "roberta.embeddings.token_type_ids"),
    "albert": ("predictions.decoder.weight", "predictions.decoder.bias", "albert.embeddings.position_ids",
               "albert.embeddings.token_type_ids"),
    "electra": ("generator_lm_head.weight", "electra.embeddings.position_ids", "electra.embeddings.token_type_ids"),
    "modernbert": ("decoder.weight",),
}
BASE_PREFIX = {"bert": "bert", "roberta": "roberta", "albert": "albert", "electra": "electra", "modernbert": "model"}


# ----------------------------------------------------------------------------------------------
# Applying a table, both ways


def to_hf(table: Table, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names: fp32, CPU, contiguous, unshared (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    for link in table:
        tensor = ours[link.ours].detach().to("cpu", torch.float32)
        if link.offset:
            tensor = torch.cat([tensor.new_zeros((link.offset, *tensor.shape[1:])), tensor])
        for hf_name, part in zip(link.hf, tensor.chunk(len(link.hf), dim=0)):
            part = part.contiguous().clone()
            if hf_name in out and not torch.equal(out[hf_name], part):  # shared layers must really be shared
                raise UserError(f"{link.ours} and another of our tensors both map to {hf_name} but differ")
            out[hf_name] = part
    return out


def from_hf(table: Table, hf_sd: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], where: str
            ) -> tuple[dict[str, torch.Tensor], list[Link]]:
    """HF state dict -> our names, as far as it goes: (our tensors, the links whose HF tensors are absent).
    A link half present, or a shape that differs from our model's, is an error naming both sides."""
    out, absent = {}, []
    for link in table:
        present = [h in hf_sd for h in link.hf]
        if not any(present):
            absent.append(link)
            continue
        if not all(present):
            raise UserError(f"{where}: has {[h for h, p in zip(link.hf, present) if p]} but not "
                            f"{[h for h, p in zip(link.hf, present) if not p]}")
        tensor = torch.cat([hf_sd[h] for h in link.hf], dim=0) if len(link.hf) > 1 else hf_sd[link.hf[0]]
        if link.offset:
            tensor = tensor[link.offset:]
        want = ref[link.ours].shape
        if tensor.shape != want:
            raise UserError(f"{where}: {' + '.join(link.hf)} has shape {tuple(tensor.shape)}"
                            f"{f' after dropping {link.offset} leading rows' if link.offset else ''}, our "
                            f"{link.ours} has {tuple(want)}: the model config does not match the checkpoint")
        out[link.ours] = tensor.to(ref[link.ours].dtype)
    return out, absent


def fill_aliases(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the names of tied parameters (heads.mlm.decoder_weight is the word-embedding Parameter, shared
    layers appear under every index) so `load_state_dict(strict=True)` accepts `state`."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    out = dict(state)
    for names in groups.values():
        source = next((n for n in names if n in state), None)
        if source is not None:
            for n in names:
                out.setdefault(n, state[source])
    return out


def to_hf_state_dict(model: nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """Our model under `arch`'s HF names (heads the model has and `arch` can hold)."""
    table = TABLES[arch](model)
    state = model.state_dict()
    out = to_hf(table, state)
    if arch == "albert" and f"{ALBERT_PROJECTION}.weight" not in out:  # E == H: ALBERT projects anyway
        hidden = model.config.hidden_size
        out[f"{ALBERT_PROJECTION}.weight"] = torch.eye(hidden)
        out[f"{ALBERT_PROJECTION}.bias"] = torch.zeros(hidden)
    if arch == "modernbert":
        type0 = _modernbert_type0(model)
        if type0.any():
            # ModernBERT has no token types; ours add type 0's row to every token. Folded into the input table,
            # which then differs from the decoder: written untied (config tie_word_embeddings=false).
            out[MODERNBERT_WORD] = out[MODERNBERT_WORD] + type0
            out[MODERNBERT_DECODER] = state["encoder.embeddings.word_embeddings.weight"].detach().to(
                "cpu", torch.float32).contiguous().clone()
    return out


MODERNBERT_WORD, MODERNBERT_DECODER = "model.embeddings.tok_embeddings.weight", "decoder.weight"
_OUR_TYPES = "encoder.embeddings.token_type_embeddings.weight"


def _modernbert_type0(model: nn.Module) -> torch.Tensor:
    return model.state_dict()[_OUR_TYPES][0].detach().to("cpu", torch.float32)


def modernbert_tied(model: nn.Module) -> bool:
    """Whether a ModernBERT export of `model` keeps its decoder tied (type 0's embedding is zero)."""
    return not _modernbert_type0(model).any()


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], model: nn.Module, arch: str, where: str = "checkpoint",
                       table: Table | None = None) -> tuple[dict[str, torch.Tensor], list[Link], list[str]]:
    """(our tensors incl. tied aliases, our links absent from the checkpoint, checkpoint keys not used)."""
    table = TABLES[arch](model) if table is None else table
    ref = model.state_dict()
    state, absent = from_hf(table, hf_sd, ref, where)
    used = {h for link in table for h in link.hf} | set(_TIED_OR_BUFFERS.get(arch, ()))
    if arch == "albert" and f"{ALBERT_PROJECTION}.weight" in hf_sd and not _has(model, "encoder.embeddings.projection.weight"):
        w, b = hf_sd[f"{ALBERT_PROJECTION}.weight"], hf_sd.get(f"{ALBERT_PROJECTION}.bias")
        identity = w.shape[0] == w.shape[1] and torch.equal(w, torch.eye(w.shape[0], dtype=w.dtype)) and (
            b is None or not b.any())
        if not identity:
            raise UserError(f"{where}: embedding_size == hidden_size but {ALBERT_PROJECTION} is not the identity; "
                            "our encoder has an embedding projection only when embedding_size != hidden_size")
        used |= {f"{ALBERT_PROJECTION}.weight", f"{ALBERT_PROJECTION}.bias"}
    if arch == "modernbert" and _OUR_TYPES in ref:
        state[_OUR_TYPES] = _modernbert_types_from(hf_sd, ref[_OUR_TYPES], where)
        if MODERNBERT_DECODER in hf_sd and _OUR_TYPES in state and state[_OUR_TYPES].any():
            state["encoder.embeddings.word_embeddings.weight"] = hf_sd[MODERNBERT_DECODER].to(ref[_OUR_TYPES].dtype)
    unused = sorted(k for k in hf_sd if k not in used)
    return fill_aliases(model, state), absent, unused


def _modernbert_types_from(hf_sd: dict[str, torch.Tensor], ref: torch.Tensor, where: str) -> torch.Tensor:
    """Our token-type table for a ModernBERT checkpoint, which has none: zeros (every token type 0, adding
    nothing), or, for an untied export of ours (input table = decoder + type 0's row), that row back."""
    types = torch.zeros_like(ref)
    if MODERNBERT_WORD not in hf_sd or MODERNBERT_DECODER not in hf_sd:
        return types
    diff = hf_sd[MODERNBERT_WORD].float() - hf_sd[MODERNBERT_DECODER].float()
    if not diff.any():
        return types
    if not torch.allclose(diff, diff[:1].expand_as(diff), atol=1e-5, rtol=0):
        raise UserError(f"{where}: the decoder is not tied to the input embeddings (nor off by one row, as our "
                        "exports fold token type 0); an untied decoder cannot be imported")
    types[0] = diff.mean(0).to(ref.dtype)  # one row; the mean evens out the rounding of the fold
    return types


# ----------------------------------------------------------------------------------------------
# HF configs of our model


def hf_config(model: nn.Module, target: Target, tokens) -> Any:
    """The transformers config object `target` needs for our model."""
    import transformers

    cfg = model.config
    if tokens.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer vocabulary ({tokens.vocab_size}) is larger than model.vocab_size "
                        f"({cfg.vocab_size})")
    common = dict(architectures=[target.hf_class], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  intermediate_size=cfg.intermediate_size, initializer_range=cfg.initializer_range,
                  pad_token_id=tokens.pad, tie_word_embeddings=True, is_decoder=False)
    # HF's "gelu" is GELUActivation, the exact erf form: our F.gelu.
    bertish = dict(hidden_act="gelu", hidden_dropout_prob=cfg.hidden_dropout,
                   attention_probs_dropout_prob=cfg.attention_dropout, type_vocab_size=cfg.type_vocab_size,
                   layer_norm_eps=cfg.layer_norm_eps, use_cache=False)
    if target.arch == "bert":
        # transformers 5 only has absolute positions and ignores this; 4.x readers consult it.
        return transformers.BertConfig(**common, **bertish, max_position_embeddings=cfg.max_position_embeddings,
                                       position_embedding_type="absolute")
    if target.arch == "roberta":
        return transformers.RobertaConfig(
            **common, **bertish, bos_token_id=tokens.cls, eos_token_id=tokens.sep,
            max_position_embeddings=cfg.max_position_embeddings + roberta_offset(tokens.pad))
    if target.arch == "albert":
        groups = 1 if getattr(cfg, "share_layers", False) else cfg.num_layers
        return transformers.AlbertConfig(
            **common, **bertish, embedding_size=cfg.embedding_size or cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings, num_hidden_groups=groups, inner_group_num=1,
            classifier_dropout_prob=cfg.hidden_dropout, bos_token_id=tokens.cls, eos_token_id=tokens.sep)
    if target.arch == "modernbert":
        head = lm_head_name(model)
        theta = float(cfg.rope_theta)
        return transformers.ModernBertConfig(
            **{**common, "tie_word_embeddings": modernbert_tied(model)},
            hidden_activation="gelu", max_position_embeddings=cfg.max_position_embeddings,
            norm_eps=cfg.layer_norm_eps, norm_bias=False, attention_bias=False, mlp_bias=False,
            classifier_bias=head is not None and _has(model, f"{head}.dense.bias"), decoder_bias=True,
            classifier_activation="gelu", attention_dropout=cfg.attention_dropout,
            embedding_dropout=cfg.hidden_dropout, mlp_dropout=cfg.hidden_dropout,
            # Global attention in every layer (ours has no sliding window); the window is made to cover every
            # position too, for readers that still consult it.
            layer_types=["full_attention"] * cfg.num_layers, local_attention=2 * cfg.max_position_embeddings,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": theta},
                             "sliding_attention": {"rope_type": "default", "rope_theta": theta}},
            bos_token_id=tokens.cls, eos_token_id=tokens.sep, cls_token_id=tokens.cls, sep_token_id=tokens.sep)
    raise UserError(f"no HF config for architecture {target.arch}")


# ----------------------------------------------------------------------------------------------
# Import: model.init_from


def read_hf_config(directory: str | Path) -> Any:
    """The transformers config of a local checkpoint directory (no hub access)."""
    import transformers

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise UserError(f"model.init_from: {directory} has no config.json (expected a HuggingFace save_pretrained "
                        f"directory of {', '.join(ARCHITECTURES)})")
    model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(f"model.init_from: {directory}/config.json has model_type {model_type!r}; supported: "
                        f"{', '.join(ARCHITECTURES)}")
    return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)


def _check_act(act: str, where: str) -> None:
    if act == "gelu":
        return
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python"):
        warnings.warn(f"{where}: hidden_act {act!r} is the tanh approximation of GELU; our encoder computes the "
                      "exact erf GELU (differences of about 1e-3 per activation), and exports say 'gelu'",
                      InitFromWarning, stacklevel=3)
        return
    raise UserError(f"{where}: hidden_act {act!r} has no equivalent here (our encoder uses GELU)")


def model_config_from_hf(hf_cfg: Any, base: ModelConfig, where: str = "model.init_from") -> ModelConfig:
    """`base` with the architecture fields of the checkpoint's config. Training-time fields (dropout,
    initializer_range, compile, unpadded, ...) stay the run's: they do not change the weights' meaning."""
    t = hf_cfg.model_type
    arch: dict[str, Any] = dict(vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size,
                                num_layers=hf_cfg.num_hidden_layers, num_heads=hf_cfg.num_attention_heads,
                                intermediate_size=hf_cfg.intermediate_size)
    if t in ("bert", "roberta", "albert", "electra"):
        _check_act(hf_cfg.hidden_act, where)
        if getattr(hf_cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise UserError(f"{where}: position_embedding_type {hf_cfg.position_embedding_type!r}; only absolute "
                            "positions are supported")
        arch.update(max_position_embeddings=hf_cfg.max_position_embeddings, type_vocab_size=hf_cfg.type_vocab_size,
                    layer_norm_eps=hf_cfg.layer_norm_eps, **_BERT_OPTIONS, embedding_size=0, share_layers=False)
        if t == "roberta":
            arch["max_position_embeddings"] -= roberta_offset(hf_cfg.pad_token_id)
        if t == "albert":
            if hf_cfg.inner_group_num != 1 or hf_cfg.num_hidden_groups not in (1, hf_cfg.num_hidden_layers):
                raise UserError(f"{where}: ALBERT with inner_group_num={hf_cfg.inner_group_num}, num_hidden_groups="
                                f"{hf_cfg.num_hidden_groups}: only one layer per group, and 1 or num_hidden_layers "
                                "groups, are supported")
            arch.update(embedding_size=hf_cfg.embedding_size,
                        share_layers=hf_cfg.num_hidden_groups == 1 and hf_cfg.num_hidden_layers > 1)
        if t == "electra" and hf_cfg.embedding_size != hf_cfg.hidden_size:
            arch["embedding_size"] = hf_cfg.embedding_size
    elif t == "modernbert":
        _check_act(hf_cfg.hidden_activation, where)
        if any(lt != "full_attention" for lt in hf_cfg.layer_types):
            raise UserError(f"{where}: this ModernBERT has sliding-window (local) attention layers "
                            f"({hf_cfg.layer_types.count('sliding_attention')} of {len(hf_cfg.layer_types)}); our "
                            "encoder attends globally in every layer with one RoPE theta. Only checkpoints with "
                            "global attention everywhere (global_attn_every_n_layers=1) can be imported")
        biases = {k: getattr(hf_cfg, k) for k in ("norm_bias", "attention_bias", "mlp_bias")}
        if any(biases.values()):
            raise UserError(f"{where}: ModernBERT with {biases}: only bias-free layers are supported (use_bias=false)")
        rope = hf_cfg.rope_parameters["full_attention"]
        if rope.get("rope_type", "default") != "default":
            raise UserError(f"{where}: rope_type {rope['rope_type']!r}; only plain RoPE is supported")
        # type_vocab_size 1: ModernBERT has no token types; our one row stays zero (see _modernbert_types_from)
        arch.update(max_position_embeddings=hf_cfg.max_position_embeddings, layer_norm_eps=hf_cfg.norm_eps,
                    rope_theta=float(rope["rope_theta"]), **_MODERNBERT_OPTIONS, embedding_size=0,
                    share_layers=False, type_vocab_size=1)
    known = {f.name for f in fields(ModelConfig)}
    missing = sorted(k for k in arch if k not in known)
    if missing:  # an option model.py / config.py does not have yet
        raise UserError(f"{where}: importing {t} needs ModelConfig options {missing}, which this version lacks")
    changed = {k: (getattr(base, k), v) for k, v in arch.items() if getattr(base, k) != v}
    if changed:
        log.info("%s: model config from the checkpoint: %s", where,
                 ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    return replace(base, **arch)


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
    for index_name, loader in (("model.safetensors.index.json", load_file),
                               ("pytorch_model.bin.index.json", _load_bin)):
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


def resolve_init_from(cfg) -> None:
    """Settle a run with `model.init_from: DIR` before it starts (mutates the RunConfig; idempotent):
    - `data.tokenizer: DIR` when no tokenizer is set: the checkpoint's vocabulary is the one its embeddings
      were trained on;
    - the model's architecture fields from DIR/config.json, so that the run's saved config.yaml describes the
      model even if DIR later goes away."""
    if not cfg.model.init_from:
        return
    if not cfg.data.tokenizer:
        cfg.data.tokenizer = cfg.model.init_from
    cfg.model = model_config_from_hf(read_hf_config(cfg.model.init_from), cfg.model,
                                     f"model.init_from {cfg.model.init_from}")


def init_model_config(cfg, model_cfg: ModelConfig, tokens) -> ModelConfig:
    """The ModelConfig a run with `model.init_from` builds: the checkpoint's architecture, and a check that
    the tokenizer fits it."""
    directory = Path(cfg.model.init_from)
    hf_cfg = read_hf_config(directory)
    out = model_config_from_hf(hf_cfg, model_cfg, f"model.init_from {directory}")
    if tokens.vocab_size > out.vocab_size:
        raise UserError(f"model.init_from {directory}: the tokenizer ({cfg.tokenizer_dir}) has {tokens.vocab_size} "
                        f"tokens, the checkpoint's embeddings {out.vocab_size}: use the checkpoint's tokenizer")
    hf_pad = getattr(hf_cfg, "pad_token_id", None)
    if hf_pad is not None and hf_pad != tokens.pad:
        raise UserError(f"model.init_from {directory}: the tokenizer's pad id is {tokens.pad}, the checkpoint's "
                        f"pad_token_id {hf_pad}: use the checkpoint's tokenizer")
    return out


def load_init_from(model: nn.Module, directory: str | Path) -> dict[str, list[str]]:
    """Copy the weights of a HF checkpoint directory into `model` (built with `init_model_config`'s config).
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
        raise UserError(f"{where}: not a complete {arch} encoder of this size: missing {encoder_absent[:5]}"
                        f"{' ...' if len(encoder_absent) > 5 else ''}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:  # a table naming something our model lacks: a bug here, not the user's
        raise RuntimeError(f"weight table of {arch} names tensors this model lacks: {unexpected[:5]}")
    fresh = sorted(missing)
    if fresh:
        heads = sorted({".".join(n.split(".")[:2]) for n in fresh})
        warnings.warn(f"{where} ({', '.join(classes) or arch}) has no weights for {', '.join(heads)}: freshly "
                      f"initialised ({len(fresh)} tensors, e.g. {fresh[0]})", InitFromWarning, stacklevel=2)
    if unused:
        warnings.warn(f"{where}: {len(unused)} checkpoint tensors have no place in this run's model and are not "
                      f"used: {unused[:6]}{' ...' if len(unused) > 6 else ''}", InitFromWarning, stacklevel=2)
    return {"fresh": fresh, "unused": unused}


def _electra_import(model, directory: Path, sd, classes, where):
    """An ELECTRA directory: the discriminator (ElectraForPreTraining) is our encoder (+ our rtd head, and the
    generator from DIR/generator as our own exports write it); a generator alone (ElectraForMaskedLM) is
    imported as a BERT-style MLM model (its prediction head is ours under other names)."""
    is_generator = "ElectraForMaskedLM" in classes or any(k.startswith("generator_") for k in sd)
    if is_generator:
        if "rtd" in model.heads:
            raise UserError(f"{where} is an ELECTRA generator (ElectraForMaskedLM). An rtd run imports the "
                            "discriminator directory (ElectraForPreTraining, with the generator in generator/); a "
                            "generator alone can start an mlm/span/plm run as its encoder + MLM head")
        return from_hf_state_dict(sd, model, "electra", where, electra_generator_as_mlm_table(model))
    state, absent, unused = from_hf_state_dict(sd, model, "electra", where, electra_discriminator_table(model))
    gen_dir = directory / "generator"
    if "rtd" in model.heads and (gen_dir / "config.json").is_file():
        from pretrain.export_electra import generator_weight_map

        gen = model.heads["rtd"].generator
        gen_sd = _normalise(read_hf_weights(gen_dir), "electra")
        gen_table = generator_weight_map(gen.config.num_layers)
        gen_state, gen_absent, gen_unused = from_hf_state_dict(gen_sd, model, "electra", f"{where}/generator",
                                                                gen_table)
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


# ----------------------------------------------------------------------------------------------
# Push to the Hub


def hub_token() -> str | None:
    """HF_TOKEN, or the token stored by `hf auth login`."""
    import huggingface_hub

    return os.environ.get("HF_TOKEN") or huggingface_hub.get_token()


def check_hub_token(repo_id: str) -> str:
    token = hub_token()
    if not token:
        raise UserError(f"--push-to-hub {repo_id}: no Hugging Face token configured; set HF_TOKEN or run "
                        "`hf auth login` (nothing was exported or uploaded)")
    return token


def push_to_hub(folder: str | Path, repo_id: str, token: str | None = None) -> str:
    """Upload an export directory to the model repo `repo_id` (created if missing); returns its URL."""
    import huggingface_hub

    token = token or check_hub_token(repo_id)
    api = huggingface_hub.HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                      commit_message=f"Upload {Path(folder).name} exported by pretrain")
    return f"https://huggingface.co/{repo_id}"
