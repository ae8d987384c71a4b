"""The HF architecture registry: one `Architecture` record per HuggingFace model_type we export and import.

A record holds everything the project knows of one architecture: its weight table (used both ways), its config in
both directions (ours -> HF, HF -> ours), the keys HF may carry that hold nothing of their own (tied decoders,
buffers), its base-model prefix, the fix-ups its tables cannot say, which HF classes to write, and how an export is
checked. Consumers (`pretrain.hf.interop`, `export`, `init_from`, `electra`, the pipeline, the CLI's `--arch`) look
an architecture up here; nothing else branches on its name.

Adding an architecture: a module in this package that builds an `Architecture` and `register`s it, imported in
`__init__.py` (or, for a plug-in, anywhere before use: `register` is all it takes).

A table is a list of `Link(ours, hf, offset)`:
- one HF name: a rename;
- several HF names: our tensor is their concatenation on dim 0 (our fused qkv Linear stacks q, k, v along its
  output dimension; HF BERT keeps three Linears);
- `offset` > 0: the HF tensor has `offset` extra leading rows before ours (RoBERTa's position table, whose ids
  start at padding_idx + 1). Those rows are unreachable for real tokens; export writes zeros there;
- several of OUR names on one HF name: our layers share one set of weights (ALBERT's one layer group).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.core.errors import UserError


class Link(NamedTuple):
    ours: str
    """Our state-dict name."""
    hf: tuple[str, ...]
    """HF state-dict names; several: our tensor is their concatenation on dim 0."""
    offset: int = 0
    """Leading rows of the HF tensor that are not ours (RoBERTa's position ids start at pad + 1)."""


Table = list[Link]


class InitFromWarning(UserWarning):
    """Something of an imported checkpoint was not used, or something of our model was not in it."""


@dataclass(frozen=True)
class Target:
    """What an export writes: the architecture (HF model_type) and the HF class."""

    arch: str
    hf_class: str
    notes: tuple[str, ...] = ()
    """Things the user should know (a head that is not exported, a class chosen for lack of a head)."""


@dataclass(frozen=True)
class Card:
    """What the model card of one exported directory says beyond the common template."""

    intro: str = ""
    """The opening sentence; empty: "A <title> encoder pretrained ..., exported as `<class>`."."""
    fill_mask: bool = True
    """A fill-mask model: the Hub's pipeline tag and the fill-mask usage example."""
    usage: str = ""
    """A "## Usage" section replacing the fill-mask one."""
    notes: tuple[str, ...] = ()
    """What this directory leaves out (a head its class has no place for), beside the run's notes."""


@dataclass(frozen=True)
class Part:
    """One directory an export writes: out_dir/subdir with this class, config and (HF-named) weights."""

    subdir: str
    hf_class: str
    config: Any
    state: dict[str, torch.Tensor]
    body: ModelConfig
    """The model config the card describes (ELECTRA's generator has its own)."""
    card: Card = field(default_factory=Card)


@dataclass(frozen=True)
class Architecture:
    """Everything about one HF architecture (see the module docstring). The callables take our model (a
    PretrainingModel), a `Target`, the run's `SpecialTokens`, a HF config, or a `where` for error messages."""

    name: str
    """HF model_type: what config.json and --arch say."""
    title: str
    """How the model card names it (BERT, RoBERTa, ...)."""
    prefix: str
    """HF base_model_prefix: a bare base model (BertModel) saves its keys without it."""
    computes: str
    """The model options it computes with, in words: errors list what exists."""
    table: Callable[[nn.Module], Table]
    target: Callable[[nn.Module], Target]
    """Check that this architecture computes what our model does (UserError if not); the class and notes."""
    to_config: Callable[[nn.Module, Target, Any], Any]
    """Our model -> the transformers config of `target`."""
    from_config: Callable[[Any, str], dict[str, Any]]
    """A transformers config -> our ModelConfig fields beyond the sizes every architecture has."""
    tied: tuple[str, ...] = ()
    """HF keys that hold nothing of their own: tied decoders, buffers older versions saved."""
    decoder: tuple[str, str] | None = None
    """(HF key of the MLM decoder's weight, of the input embeddings ours ties it to): a checkpoint whose decoder
    holds other values (tie_word_embeddings=false) is refused on import, as ours cannot hold it."""
    claims: Callable[[nn.Module], str | None] | None = None
    """Why only this architecture can export the model (ELECTRA: an rtd run), or None."""
    priority: int = 0
    """Claims are asked highest first."""
    export_fixup: Callable[[nn.Module, dict[str, torch.Tensor]], None] | None = None
    """Complete the HF state dict in place beyond what the table says."""
    import_fixup: Callable[[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor], str], set[str]] | None = None
    """(model, HF state dict, our state so far [changed in place], where) -> further HF keys used."""
    parts: Callable[[nn.Module, Target, Any], list[Part]] | None = None
    """Several directories (ELECTRA's discriminator and generator); None: one, from `table` and `to_config`."""
    import_weights: Callable[..., tuple[dict, list[Link], list[str]]] | None = None
    """(model, directory, HF state dict, classes, where) -> (state, absent links, unused keys); None: the table."""
    verify: Callable[[nn.Module, Path], dict[str, float]] | None = None
    """The parity check of an export directory; None: `pretrain.hf.parity.verify_export`."""
    demo: str = ""
    """The subdirectory a fill-mask demo loads."""
    token_types: bool = True
    """Whether the HF model takes token_type_ids."""
    padding_comparable: bool = True
    """Whether outputs at padded positions must agree too (RoBERTa gives padding its own position id: no)."""


REGISTRY: dict[str, Architecture] = {}
DEFAULT = "bert"
"""What a model no architecture claims exports as."""


def register(arch: Architecture) -> Architecture:
    """Add `arch` to the registry (a second record under the same name is a programming error)."""
    if arch.name in REGISTRY and REGISTRY[arch.name] is not arch:
        raise ValueError(f"HF architecture {arch.name!r} is registered already")
    REGISTRY[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    """Remove a record (for tests that register their own)."""
    REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str, what: str = "--arch") -> Architecture:
    """The record of `name`; an unknown name is a UserError naming the choices."""
    if name not in REGISTRY:
        raise UserError(f"{what} {name}: not one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def what_exists() -> str:
    return "; ".join(f"{a.name}: {a.computes}" for a in REGISTRY.values())


def select_architecture(model: nn.Module, requested: str | None = None) -> Target:
    """The HF architecture that computes exactly what `model` computes: `requested`, else the one that claims the
    model (ELECTRA an rtd run, ModernBERT its options, ALBERT factorized or shared layers), else `DEFAULT`. A
    request another architecture's claim contradicts, or options the architecture lacks, are UserErrors."""
    chosen = get(requested) if requested else None
    for arch in sorted(REGISTRY.values(), key=lambda a: -a.priority):
        reason = arch.claims(model) if arch.claims else None
        if reason is None:
            continue
        if chosen is not None and chosen is not arch:
            raise UserError(f"--arch {requested}: {reason}")
        chosen = arch
        break
    return (chosen or REGISTRY[DEFAULT]).target(model)


# ----------------------------------------------------------------------------------------------
# What our model has: options and heads


def has(model: nn.Module, name: str) -> bool:
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


def albertish(cfg: ModelConfig) -> bool:
    return factorized(cfg) or bool(getattr(cfg, "share_layers", False))


def model_options(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "norm_placement": getattr(cfg, "norm_placement", "post"),
        "position_embedding": getattr(cfg, "position_embedding", "learned"),
        "activation": getattr(cfg, "activation", "gelu"),
        "use_bias": getattr(cfg, "use_bias", True),
    }


def require(cfg: ModelConfig, wanted: dict, arch: str) -> None:
    """Each of `wanted`'s model options, or a UserError listing the architectures that exist."""
    opts = model_options(cfg)
    for key, value in wanted.items():
        if opts[key] != value:
            raise UserError(
                f"model.{key}={str(opts[key]).lower()} has no {arch} equivalent in HuggingFace "
                f"transformers. HF architectures that exist: {what_exists()}"
            )


def require_global(cfg: ModelConfig, arch: str) -> None:
    """No sliding-window layers (only ModernBERT has them)."""
    window = getattr(cfg, "local_attention", 0)
    if window:
        raise UserError(
            f"model.local_attention={window} (sliding-window layers) has no {arch} equivalent in HuggingFace "
            f"transformers; only modernbert has local attention. HF architectures that exist: {what_exists()}"
        )


def require_lm_head(model: nn.Module) -> str:
    head = lm_head_name(model)
    if head is None:
        raise UserError(
            f"HF export needs a token-prediction objective (mlm, span, plm) or rtd; this model "
            f"has heads {sorted(model.heads) or 'none'}"
        )
    return head


def common_config(model: nn.Module, target: Target, tokens) -> dict[str, Any]:
    """The transformers config fields every architecture has (sizes, pad id, tied embeddings)."""
    cfg = model.config
    if tokens.vocab_size > cfg.vocab_size:  # smaller is fine: checkpoints often pad their tables
        raise UserError(
            f"tokenizer vocabulary ({tokens.vocab_size}) is larger than model.vocab_size ({cfg.vocab_size})"
        )
    return dict(
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


def check_act(act: str, where: str, key: str = "hidden_act") -> None:
    """HF's "gelu" is the exact erf form, ours; the tanh forms import with a warning, others not at all. `key`: the
    config key that names it (ModernBERT's hidden_activation, and classifier_activation for its MLM head)."""
    if act == "gelu":
        return
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python"):
        warnings.warn(
            f"{where}: {key} {act!r} is the tanh approximation of GELU; we compute the exact erf GELU "
            "(differences of about 1e-3 per activation), and exports say 'gelu'",
            InitFromWarning,
            stacklevel=4,
        )
        return
    raise UserError(f"{where}: {key} {act!r} has no equivalent here (we use GELU)")


# ----------------------------------------------------------------------------------------------
# Pieces of tables


def lin(ours: str, *hf: str, bias: bool = True) -> Table:
    """A Linear or LayerNorm: weight and (when the model has biases) bias."""
    params = ("weight", "bias") if bias else ("weight",)
    return [Link(f"{ours}.{p}", tuple(f"{h}.{p}" for h in hf)) for p in params]


def mlm_head(head: str | None, dense: str, norm: str, bias: str, with_bias: bool = True) -> Table:
    """dense -> GELU -> LayerNorm -> decoder tied to the word embeddings (no entry: the decoder weight IS the
    word-embedding Parameter, and HF re-ties it on load) + the decoder's own bias."""
    if head is None:
        return []
    return [
        *lin(f"{head}.dense", dense, bias=with_bias),
        *lin(f"{head}.layer_norm", norm, bias=with_bias),
        Link(f"{head}.bias", (bias,)),
    ]


def sentence_head(model: nn.Module, objective: str, pooler: str, classifier: str) -> Table:
    if objective not in model.heads:
        return []
    return [*lin(f"heads.{objective}.pooler.dense", pooler), *lin(f"heads.{objective}.classifier", classifier)]
