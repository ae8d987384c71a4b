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
- pre-LN + RoPE + GeGLU + no biases   -> modernbert (ModernBertForMaskedLM; with model.local_attention its
                                         sliding-window layers, layer_types and both RoPE thetas);
- factorized embeddings or shared layers (or --arch albert)
                                      -> albert (AlbertForPreTraining with an sop head, else AlbertForMaskedLM);
- --arch roberta                      -> roberta (RobertaForMaskedLM);
- otherwise                           -> bert (BertForPreTraining with an nsp head, else BertForMaskedLM).
Any other mix of options (pre-LN with learned positions, RoPE with post-LN, local attention outside ModernBERT, ...)
has no HF class that computes the same function: `UserError` naming the option and the architectures that exist.

Import (`model.init_from`) lives in `pretrain.hf.init_from`, uploads in `pretrain.hf.hub`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError
from pretrain.model.encoder import layer_windows

log = logging.getLogger(__name__)

ARCHITECTURES = ("bert", "roberta", "albert", "electra", "modernbert")


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
    return {
        "norm_placement": getattr(cfg, "norm_placement", "post"),
        "position_embedding": getattr(cfg, "position_embedding", "learned"),
        "activation": getattr(cfg, "activation", "gelu"),
        "use_bias": getattr(cfg, "use_bias", True),
    }


BERT_OPTIONS = {"norm_placement": "post", "position_embedding": "learned", "activation": "gelu", "use_bias": True}
MODERNBERT_OPTIONS = {"norm_placement": "pre", "position_embedding": "rope", "activation": "geglu", "use_bias": False}
_WHAT_EXISTS = (
    "bert / roberta / electra: norm_placement=post, position_embedding=learned, activation=gelu, "
    "use_bias=true; albert: the same plus embedding_size and/or share_layers; modernbert: "
    "norm_placement=pre, position_embedding=rope, activation=geglu, use_bias=false"
)


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
        _require(opts, BERT_OPTIONS, "electra")
        _require_global(cfg, "electra")
        if getattr(cfg, "share_layers", False):  # factorized embeddings are ELECTRA's own (embeddings_project)
            raise UserError("ELECTRA export has no shared layers on the discriminator (model.share_layers=true)")
        return Target("electra", "ElectraForPreTraining", ("the generator is in generator/ (ElectraForMaskedLM)",))

    if lm_head_name(model) is None:
        raise UserError(
            f"HF export needs a token-prediction objective (mlm, span, plm) or rtd; this model "
            f"has heads {sorted(heads) or 'none'}"
        )
    dropped = sorted(heads & {"nsp", "sop"})

    if opts == MODERNBERT_OPTIONS:
        if requested not in (None, "modernbert"):
            raise UserError(
                f"--arch {requested}: norm_placement=pre, rope, geglu and use_bias=false is "
                f"ModernBERT's architecture; export it as modernbert. {_WHAT_EXISTS}"
            )
        if albertish:
            raise UserError(
                "modernbert export: ModernBERT has no factorized embeddings or shared layers "
                f"(model.embedding_size={cfg.embedding_size}, model.share_layers={cfg.share_layers})"
            )
        notes = [f"the {h} head has no place in ModernBertForMaskedLM and is not exported" for h in dropped]
        if cfg.type_vocab_size > 1:
            notes.append(
                f"ModernBERT has no token types: type 0's embedding is folded into the word embeddings, "
                f"the other {cfg.type_vocab_size - 1} type(s) are not exported"
            )
        return Target("modernbert", "ModernBertForMaskedLM", tuple(notes))

    arch = requested or ("albert" if albertish else "bert")
    _require(opts, BERT_OPTIONS, arch)
    if albertish and arch != "albert":
        raise UserError(
            f"--arch {arch}: model.embedding_size={cfg.embedding_size} / model.share_layers="
            f"{cfg.share_layers} exist in HF only as albert"
        )
    if arch == "electra":
        raise UserError("--arch electra needs an rtd run (ElectraForPreTraining is a replaced-token detector)")
    if arch == "modernbert":
        _require(opts, MODERNBERT_OPTIONS, "modernbert")
    _require_global(cfg, arch)
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


def _require_global(cfg: ModelConfig, arch: str) -> None:
    window = getattr(cfg, "local_attention", 0)
    if window:
        raise UserError(
            f"model.local_attention={window} (sliding-window layers) has no {arch} equivalent in HuggingFace "
            f"transformers; only modernbert has local attention. HF architectures that exist: {_WHAT_EXISTS}"
        )


def _require(opts: dict, wanted: dict, arch: str) -> None:
    for key, value in wanted.items():
        if opts[key] != value:
            raise UserError(
                f"model.{key}={str(opts[key]).lower()} has no {arch} equivalent in HuggingFace "
                f"transformers. HF architectures that exist: {_WHAT_EXISTS}"
            )


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
    table = [
        Link(f"{emb}.word_embeddings.weight", (f"{e}.word_embeddings.weight",)),
        Link(f"{emb}.position_embeddings.weight", (f"{e}.position_embeddings.weight",), position_offset),
        Link(f"{emb}.token_type_embeddings.weight", (f"{e}.token_type_embeddings.weight",)),
        *_lin(f"{emb}.layer_norm", f"{e}.LayerNorm"),
    ]
    for i in range(num_layers):
        o, h = f"encoder.layers.{i}", f"{prefix}.encoder.layer.{i}"
        table += [
            *_lin(f"{o}.attention.qkv", *(f"{h}.attention.self.{p}" for p in ("query", "key", "value"))),
            *_lin(f"{o}.attention.out", f"{h}.attention.output.dense"),
            *_lin(f"{o}.attn_norm", f"{h}.attention.output.LayerNorm"),
            *_lin(f"{o}.ffn_in", f"{h}.intermediate.dense"),
            *_lin(f"{o}.ffn_out", f"{h}.output.dense"),
            *_lin(f"{o}.ffn_norm", f"{h}.output.LayerNorm"),
        ]
    return table


def _mlm_head(head: str | None, dense: str, norm: str, bias: str, with_bias: bool = True) -> Table:
    """dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (no entry: the decoder weight IS the
    word-embedding Parameter, and HF re-ties it on load) + the decoder's own bias."""
    if head is None:
        return []
    return [
        *_lin(f"{head}.dense", dense, bias=with_bias),
        *_lin(f"{head}.layer_norm", norm, bias=with_bias),
        Link(f"{head}.bias", (bias,)),
    ]


def _sentence_head(model: nn.Module, objective: str, pooler: str, classifier: str) -> Table:
    if objective not in model.heads:
        return []
    return [*_lin(f"heads.{objective}.pooler.dense", pooler), *_lin(f"heads.{objective}.classifier", classifier)]


def bert_table(model: nn.Module) -> Table:
    """BertForPreTraining / BertForMaskedLM (BertModel: the same names with `bert.` dropped, see `_normalise`)."""
    return (
        bert_body(model.config.num_layers, "bert")
        + _mlm_head(
            lm_head_name(model),
            "cls.predictions.transform.dense",
            "cls.predictions.transform.LayerNorm",
            "cls.predictions.bias",
        )
        + _sentence_head(model, "nsp", "bert.pooler.dense", "cls.seq_relationship")
    )


def roberta_offset(pad_token_id: int) -> int:
    """RoBERTa numbers real tokens from padding_idx + 1 (padding itself gets position padding_idx)."""
    return pad_token_id + 1


def roberta_table(model: nn.Module) -> Table:
    """RobertaForMaskedLM: BERT's body under `roberta.`, its position table shifted by pad + 1 rows."""
    return bert_body(model.config.num_layers, "roberta", roberta_offset(model.config.pad_token_id)) + _mlm_head(
        lm_head_name(model), "lm_head.dense", "lm_head.layer_norm", "lm_head.bias"
    )


# ----------------------------------------------------------------------------------------------
# ELECTRA: the discriminator (ElectraForPreTraining) and the generator (ElectraForMaskedLM)


ELECTRA_HEAD = "heads.rtd"


def _linear_or_norm(ours: str, hf: str) -> Table:
    return [Link(f"{ours}.{p}", (f"{hf}.{p}",)) for p in ("weight", "bias")]


def _body(num_layers: int, our_layers: str) -> Table:
    """Embeddings + encoder layers: BERT's body under electra.*, our layers under `our_layers`."""
    table = []
    for link in bert_body(num_layers, "electra"):
        if link.ours.startswith("encoder.layers."):
            link = link._replace(ours=our_layers + link.ours[len("encoder.layers") :])
        table.append(link)
    return table


def discriminator_weight_map(num_layers: int) -> Table:
    """Our names <-> ElectraForPreTraining names; several names = our tensor is their concatenation on dim 0."""
    return (
        _body(num_layers, "encoder.layers")
        + _linear_or_norm(f"{ELECTRA_HEAD}.dense", "discriminator_predictions.dense")
        + _linear_or_norm(f"{ELECTRA_HEAD}.dense_prediction", "discriminator_predictions.dense_prediction")
    )


def generator_table(generator: nn.Module) -> Table:
    """Our names <-> ElectraForMaskedLM names of our rtd generator. The decoder is the word-embedding Parameter:
    no entry. `electra.embeddings_project` (E -> Hg) exists where the widths differ, on both sides."""
    gen = f"{ELECTRA_HEAD}.generator"
    project = generator.embeddings_project is not None
    return (
        _body(generator.config.num_layers, f"{gen}.layers")
        + (_linear_or_norm(f"{gen}.embeddings_project", "electra.embeddings_project") if project else [])
        + _linear_or_norm(f"{gen}.head.dense", "generator_predictions.dense")
        + _linear_or_norm(f"{gen}.head.layer_norm", "generator_predictions.LayerNorm")
        + [Link(f"{gen}.head.bias", ("generator_lm_head.bias",))]
    )


def electra_discriminator_table(model: nn.Module) -> Table:
    """ElectraForPreTraining (the table of `export_electra`): BERT's body under `electra.` + the discriminator
    head, when our model has one (an rtd run)."""
    table = discriminator_weight_map(model.config.num_layers) + _electra_projection(model)
    return table if "rtd" in model.heads else [link for link in table if link.ours.startswith("encoder.")]


def _electra_projection(model: nn.Module) -> Table:
    """ELECTRA with embedding_size != hidden_size projects LN-ed embeddings up, as ALBERT (and we) do."""
    if not _has(model, "encoder.embeddings.projection.weight"):
        return []
    return _lin("encoder.embeddings.projection", "electra.embeddings_project")


def electra_generator_as_mlm_table(model: nn.Module) -> Table:
    """ElectraForMaskedLM imported as a plain MLM model: its head is ours (same math, other names)."""
    return (
        bert_body(model.config.num_layers, "electra")
        + _electra_projection(model)
        + _mlm_head(
            lm_head_name(model),
            "generator_predictions.dense",
            "generator_predictions.LayerNorm",
            "generator_lm_head.bias",
        )
    )


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
        *_lin(f"{emb}.layer_norm", f"{e}.LayerNorm"),
    ]
    if _has(model, f"{emb}.projection.weight"):
        table += _lin(f"{emb}.projection", "albert.encoder.embedding_hidden_mapping_in")
    shared = getattr(cfg, "share_layers", False)
    for i in range(cfg.num_layers):
        # Shared: one module in our state dict (encoder.shared_layer), one group of one layer in ALBERT's.
        o = "encoder.shared_layer" if shared else f"encoder.layers.{i}"
        h = f"albert.encoder.albert_layer_groups.{0 if shared else i}.albert_layers.0"
        table += [
            *_lin(f"{o}.attention.qkv", *(f"{h}.attention.{p}" for p in ("query", "key", "value"))),
            *_lin(f"{o}.attention.out", f"{h}.attention.dense"),
            *_lin(f"{o}.attn_norm", f"{h}.attention.LayerNorm"),
            *_lin(f"{o}.ffn_in", f"{h}.ffn"),
            *_lin(f"{o}.ffn_out", f"{h}.ffn_output"),
            *_lin(f"{o}.ffn_norm", f"{h}.full_layer_layer_norm"),
        ]
    return (
        list(dict.fromkeys(table))  # shared layers: one link per our name
        + _mlm_head(lm_head_name(model), "predictions.dense", "predictions.LayerNorm", "predictions.bias")
        + _sentence_head(model, "sop", "albert.pooler", "sop_classifier.classifier")
    )


# ALBERT always has embedding_hidden_mapping_in; a model without a projection (E == H) exports the identity.
ALBERT_PROJECTION = "albert.encoder.embedding_hidden_mapping_in"


def modernbert_table(model: nn.Module) -> Table:
    """ModernBertForMaskedLM: tok_embeddings -> norm (no positions: RoPE; no token types); pre-LN layers whose
    first has no attn_norm (the embedding norm plays its part); final_norm; head dense -> GELU -> norm;
    decoder tied with its own bias. Wqkv is q, k, v stacked on dim 0 like our qkv; Wi is [input; gate] on
    dim 0, GELU(input) * gate."""
    bias = getattr(model.config, "use_bias", True)
    emb = "encoder.embeddings"
    table = [
        Link(f"{emb}.word_embeddings.weight", ("model.embeddings.tok_embeddings.weight",)),
        *_lin(f"{emb}.layer_norm", "model.embeddings.norm", bias=bias),
    ]
    for i in range(model.config.num_layers):
        o, h = f"encoder.layers.{i}", f"model.layers.{i}"
        if _has(model, f"{o}.attn_norm.weight"):
            table += _lin(f"{o}.attn_norm", f"{h}.attn_norm", bias=bias)
        table += [
            *_lin(f"{o}.attention.qkv", f"{h}.attn.Wqkv", bias=bias),
            *_lin(f"{o}.attention.out", f"{h}.attn.Wo", bias=bias),
            *_lin(f"{o}.ffn_norm", f"{h}.mlp_norm", bias=bias),
            *_lin(f"{o}.ffn_in", f"{h}.mlp.Wi", bias=bias),
            *_lin(f"{o}.ffn_out", f"{h}.mlp.Wo", bias=bias),
        ]
    table += _lin("encoder.final_norm", "model.final_norm", bias=bias)
    head = lm_head_name(model)
    if head is not None:
        head_bias = _has(model, f"{head}.dense.bias")
        table += [
            *_lin(f"{head}.dense", "head.dense", bias=head_bias),
            *_lin(f"{head}.layer_norm", "head.norm", bias=head_bias),
            Link(f"{head}.bias", ("decoder.bias",)),
        ]
    return table


TABLES = {
    "bert": bert_table,
    "roberta": roberta_table,
    "albert": albert_table,
    "electra": electra_discriminator_table,
    "modernbert": modernbert_table,
}

# Keys HF may carry that hold no information of their own: decoders tied to the word embeddings (and to the
# head's bias), and non-persistent buffers older versions saved.
_TIED_OR_BUFFERS = {
    "bert": (
        "cls.predictions.decoder.weight",
        "cls.predictions.decoder.bias",
        "bert.embeddings.position_ids",
        "bert.embeddings.token_type_ids",
    ),
    "roberta": (
        "lm_head.decoder.weight",
        "lm_head.decoder.bias",
        "roberta.embeddings.position_ids",
        "roberta.embeddings.token_type_ids",
    ),
    "albert": (
        "predictions.decoder.weight",
        "predictions.decoder.bias",
        "albert.embeddings.position_ids",
        "albert.embeddings.token_type_ids",
    ),
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


def from_hf(
    table: Table, hf_sd: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], where: str
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
            raise UserError(
                f"{where}: has {[h for h, p in zip(link.hf, present) if p]} but not "
                f"{[h for h, p in zip(link.hf, present) if not p]}"
            )
        tensor = torch.cat([hf_sd[h] for h in link.hf], dim=0) if len(link.hf) > 1 else hf_sd[link.hf[0]]
        if link.offset:
            tensor = tensor[link.offset :]
        want = ref[link.ours].shape
        if tensor.shape != want:
            raise UserError(
                f"{where}: {' + '.join(link.hf)} has shape {tuple(tensor.shape)}"
                f"{f' after dropping {link.offset} leading rows' if link.offset else ''}, our "
                f"{link.ours} has {tuple(want)}: the model config does not match the checkpoint"
            )
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
            out[MODERNBERT_DECODER] = (
                state["encoder.embeddings.word_embeddings.weight"]
                .detach()
                .to("cpu", torch.float32)
                .contiguous()
                .clone()
            )
    return out


MODERNBERT_WORD, MODERNBERT_DECODER = "model.embeddings.tok_embeddings.weight", "decoder.weight"
_OUR_TYPES = "encoder.embeddings.token_type_embeddings.weight"


def _modernbert_type0(model: nn.Module) -> torch.Tensor:
    return model.state_dict()[_OUR_TYPES][0].detach().to("cpu", torch.float32)


def modernbert_tied(model: nn.Module) -> bool:
    """Whether a ModernBERT export of `model` keeps its decoder tied (type 0's embedding is zero)."""
    return not _modernbert_type0(model).any()


def from_hf_state_dict(
    hf_sd: dict[str, torch.Tensor], model: nn.Module, arch: str, where: str = "checkpoint", table: Table | None = None
) -> tuple[dict[str, torch.Tensor], list[Link], list[str]]:
    """(our tensors incl. tied aliases, our links absent from the checkpoint, checkpoint keys not used)."""
    table = TABLES[arch](model) if table is None else table
    ref = model.state_dict()
    state, absent = from_hf(table, hf_sd, ref, where)
    used = {h for link in table for h in link.hf} | set(_TIED_OR_BUFFERS.get(arch, ()))
    if (
        arch == "albert"
        and f"{ALBERT_PROJECTION}.weight" in hf_sd
        and not _has(model, "encoder.embeddings.projection.weight")
    ):
        w, b = hf_sd[f"{ALBERT_PROJECTION}.weight"], hf_sd.get(f"{ALBERT_PROJECTION}.bias")
        identity = (
            w.shape[0] == w.shape[1]
            and torch.equal(w, torch.eye(w.shape[0], dtype=w.dtype))
            and (b is None or not b.any())
        )
        if not identity:
            raise UserError(
                f"{where}: embedding_size == hidden_size but {ALBERT_PROJECTION} is not the identity; "
                "our encoder has an embedding projection only when embedding_size != hidden_size"
            )
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
        raise UserError(
            f"{where}: the decoder is not tied to the input embeddings (nor off by one row, as our "
            "exports fold token type 0); an untied decoder cannot be imported"
        )
    types[0] = diff.mean(0).to(ref.dtype)  # one row; the mean evens out the rounding of the fold
    return types


# ----------------------------------------------------------------------------------------------
# HF configs of our model


def hf_config(model: nn.Module, target: Target, tokens) -> Any:
    """The transformers config object `target` needs for our model."""
    import transformers

    cfg = model.config
    if tokens.vocab_size > cfg.vocab_size:
        raise UserError(
            f"tokenizer vocabulary ({tokens.vocab_size}) is larger than model.vocab_size ({cfg.vocab_size})"
        )
    common = dict(
        architectures=[target.hf_class],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        initializer_range=cfg.initializer_range,
        pad_token_id=tokens.pad,
        tie_word_embeddings=True,
        is_decoder=False,
    )
    # HF's "gelu" is GELUActivation, the exact erf form: our F.gelu.
    bertish = dict(
        hidden_act="gelu",
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        type_vocab_size=cfg.type_vocab_size,
        layer_norm_eps=cfg.layer_norm_eps,
        use_cache=False,
    )
    if target.arch == "bert":
        # transformers 5 only has absolute positions and ignores this; 4.x readers consult it.
        return transformers.BertConfig(
            **common, **bertish, max_position_embeddings=cfg.max_position_embeddings, position_embedding_type="absolute"
        )
    if target.arch == "roberta":
        return transformers.RobertaConfig(
            **common,
            **bertish,
            bos_token_id=tokens.cls,
            eos_token_id=tokens.sep,
            max_position_embeddings=cfg.max_position_embeddings + roberta_offset(tokens.pad),
        )
    if target.arch == "albert":
        groups = 1 if getattr(cfg, "share_layers", False) else cfg.num_layers
        return transformers.AlbertConfig(
            **common,
            **bertish,
            embedding_size=cfg.embedding_size or cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings,
            num_hidden_groups=groups,
            inner_group_num=1,
            classifier_dropout_prob=cfg.hidden_dropout,
            bos_token_id=tokens.cls,
            eos_token_id=tokens.sep,
        )
    if target.arch == "modernbert":
        head = lm_head_name(model)
        windows = layer_windows(cfg)
        # transformers reads layer_types (a token of a sliding layer sees local_attention // 2 on each side, as
        # ours); global_attn_every_n_layers is what readers before layer_types took (and 5.x keeps it).
        # All global: the window is made to cover every position too, for readers that still consult it.
        window = getattr(cfg, "local_attention", 0)
        return transformers.ModernBertConfig(
            **{**common, "tie_word_embeddings": modernbert_tied(model)},
            hidden_activation="gelu",
            max_position_embeddings=cfg.max_position_embeddings,
            norm_eps=cfg.layer_norm_eps,
            norm_bias=False,
            attention_bias=False,
            mlp_bias=False,
            classifier_bias=head is not None and _has(model, f"{head}.dense.bias"),
            decoder_bias=True,
            classifier_activation="gelu",
            attention_dropout=cfg.attention_dropout,
            embedding_dropout=cfg.hidden_dropout,
            mlp_dropout=cfg.hidden_dropout,
            layer_types=["sliding_attention" if w else "full_attention" for w in windows],
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
    raise UserError(f"no HF config for architecture {target.arch}")
