"""The Objective contract, the registry, and validation of a run's mix of objectives.

An objective has a data half, `prepare(sample, rng)`, pure numpy and deterministic given `rng`, run in the
loader; and a model half, `loss(batch, hidden, model)`, which owns its head (built by `build_head`).
A run sums `weight * loss` over its objectives and logs every loss and metric unweighted.

Each loss term is a mean over targets. So that an optimizer step weights every target alike however the step's
batch is split into micro-batches and ranks, an objective reports its terms' target counts (`target_counts`,
countable before the forward) and multiplies each term by the trainer's `loss_scale` for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pretrain.errors import ConfigError

IGNORE_INDEX = -100
LOSS_SCALES = "_loss_scales"
"""Batch key of {loss term: factor} set by the trainer (see `loss_scale`); absent outside training."""


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Number of labelled positions (not IGNORE_INDEX) in a labels tensor of any shape."""
    return (labels != IGNORE_INDEX).sum()


def loss_scale(batch: dict, term: str) -> float:
    """Factor that turns a term's mean over this micro-batch into its share of the mean over the whole optimizer
    step: (targets here) x (micro-batches x ranks) / (targets in the step). DeepSpeed divides the gradient by
    micro-batches x ranks, which leaves the gradient of the step-wide mean. 1.0 when the trainer sets none."""
    return batch.get(LOSS_SCALES, {}).get(term, 1.0)


@dataclass(frozen=True)
class SpecialTokens:
    """Ids the objectives need from the tokenizer."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int
    vocab_size: int
    """Size of the (padded) vocabulary; the model's output size."""
    replaceable: np.ndarray = field(compare=False, repr=False, default_factory=lambda: np.zeros(0, np.int64))
    """Ids a random replacement may draw: real tokens, no special or padding-filler ([unusedN]) ids."""

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


@dataclass
class ObjectiveOptions:
    weight: float = 1.0
    """Weight of this objective's loss in the total."""


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    """Scalar, unweighted."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Unweighted scalars to log, e.g. accuracy."""


class Objective:
    """Base class; subclasses set `name` and `Options` and are registered with `@register`."""

    name: ClassVar[str]
    Options: ClassVar[type] = ObjectiveOptions
    rewrites_inputs: ClassVar[bool] = False
    """True for objectives that corrupt input tokens (mlm, span, rtd, plm): at most one per run."""
    sentence_level: ClassVar[bool] = False
    """True for objectives over segment pairs (nsp, sop): at most one per run."""
    sample_builder: ClassVar[str] = "packed"
    """Which sample builder feeds this objective: "packed" sequences, or segment "pairs" (nsp, sop)."""
    pad_values: ClassVar[dict[str, int]] = {}
    """Padding value of each per-token array this objective adds to a sample (default 0; *labels: -100)."""

    def __init__(self, options: Any, tokens: SpecialTokens):
        self.options = options
        self.tokens = tokens

    @property
    def weight(self) -> float:
        return float(self.options.weight)

    def prepare(self, sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Add targets / corrupt inputs of one sample (numpy, no torch). Must be deterministic given rng."""
        return sample

    def before_encoder(self, batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """Rewrite the batch on the model side before the encoder runs (e.g. ELECTRA's generator samples)."""
        return batch

    def build_head(self, model_config: Any, encoder: nn.Module) -> nn.Module | None:
        """The head this objective trains, if any; stored as model.heads[self.name]."""
        return None

    def loss(self, batch: dict[str, torch.Tensor], hidden: torch.Tensor, model: nn.Module) -> ObjectiveOutput:
        raise NotImplementedError

    def target_counts(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{loss term: how many targets its mean is over in this collated micro-batch}; `loss` scales each term
        by `loss_scale(batch, term)`. Terms are named "<objective>" or "<objective>_<part>"."""
        return {}


REGISTRY: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    if cls.name in REGISTRY:
        raise ValueError(f"objective '{cls.name}' registered twice ({REGISTRY[cls.name].__module__}, {cls.__module__})")
    REGISTRY[cls.name] = cls
    return cls


def validate_objectives(spec: dict[str, Any]) -> dict[str, Any]:
    """Typed options for each objective in a config mapping {name: {option: value}}; checks the mix."""
    from pretrain.config import _nearest, from_dict  # shared typed-dict builder

    if not spec:
        raise ConfigError("objectives: at least one objective is needed (e.g. objectives.mlm.weight=1)")
    typed = {}
    for name, options in spec.items():
        if name not in REGISTRY:
            raise ConfigError(f"objectives: unknown objective '{name}'{_nearest(name, REGISTRY)}; "
                              f"known: {', '.join(sorted(REGISTRY))}")
        cls = REGISTRY[name]
        if dataclasses.is_dataclass(options) and isinstance(options, cls.Options):
            typed[name] = options
        else:
            typed[name] = from_dict(cls.Options, options or {}, f"objectives.{name}")
    rewriters = [n for n in typed if REGISTRY[n].rewrites_inputs]
    if len(rewriters) > 1:
        raise ConfigError(f"objectives: {' and '.join(rewriters)} both rewrite the input tokens; a run can use "
                          "only one of mlm, span, rtd, plm")
    pairs = [n for n in typed if REGISTRY[n].sentence_level]
    if len(pairs) > 1:
        raise ConfigError(f"objectives: {' and '.join(pairs)} both build segment pairs; choose one of nsp, sop")
    for name, options in typed.items():
        if options.weight < 0:
            raise ConfigError(f"objectives.{name}.weight: must be >= 0, got {options.weight}")
    if all(options.weight == 0 for options in typed.values()):
        raise ConfigError(f"objectives: every weight is 0 ({', '.join(f'{n}.weight=0' for n in typed)}), so nothing "
                          "would be trained; give at least one objective a weight > 0")
    return typed


def build_objectives(spec: dict[str, Any], tokens: SpecialTokens) -> list[Objective]:
    """Instances in a fixed order: sentence-level objectives first (they assemble the segment pair that a
    token-level objective then corrupts), then the config's order."""
    typed = validate_objectives(spec)
    objectives = [REGISTRY[name](options, tokens) for name, options in typed.items()]
    return sorted(objectives, key=lambda o: not o.sentence_level)


def sample_builder_for(objectives: list[Objective]) -> str:
    """The one sample builder every objective of a run agrees on."""
    kinds = {o.sample_builder for o in objectives if o.sample_builder != "packed"}
    if len(kinds) > 1:
        raise ConfigError(f"objectives need different sample builders: {sorted(kinds)}")
    return kinds.pop() if kinds else "packed"
