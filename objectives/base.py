"""The Objective contract, the registry, and validation of a run's mix of objectives.

An objective has a data half, run in the loader on the host, and a model half, which owns its head:
- `prepare(sample, rng)`: corrupt one sample or add its targets (numpy, deterministic given `rng`);
- `collate(arrays)`: from the padded batch, what the model side needs to gather its targets without a device-side
  `nonzero` (flat target positions and the targets themselves), and `target_counts(arrays)`, each loss term's number
  of targets: host numbers, known before the forward;
- `before_encoder(batch, forward, model)`: change the encoder's inputs (`Forward`: ELECTRA's sampled tokens, PLM's
  query stream and masks) and keep what its loss needs in `forward.carry[name]`;
- `loss(batch, forward, model, weights)`: its loss from the encoder's output, with `build_head`'s head.
A run sums `weight * loss` over its objectives and logs every loss and metric unweighted. The batch holds data only.

Each loss term is a sum over its targets times a per-target weight (`LossWeights`): 1 / the targets of this
micro-batch (a mean, outside training), or micro-batches x ranks / the targets of the whole optimizer step, which
after DeepSpeed's division by micro-batches x ranks makes every target of the step weigh alike however the batch is
split (`train.loss_normalization=step`, set by the trainer).

Metrics are sums and counts (`Mean`) or histograms (`BinaryAUC`), so that micro-batches and ranks combine exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from pretrain.core.config import doc
from pretrain.core.errors import ConfigError
from pretrain.core.measures import BinaryAUC, Mean
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens

if TYPE_CHECKING:
    from pretrain.model.pretraining import Forward, LossWeights


def flat_targets(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions [M] into labels.ravel(), the labels there [M]) of the labelled entries (not IGNORE_INDEX) of a
    padded labels array, in row-major order: what a head gathers with index_select instead of a boolean mask."""
    flat = labels.reshape(-1)
    positions = np.flatnonzero(flat != IGNORE_INDEX).astype(np.int64)
    return positions, flat[positions].astype(np.int64)


@dataclass
class ObjectiveOptions:
    weight: float = doc(1.0, "Weight of this objective's loss in the total.")


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    """Scalar, unweighted."""
    metrics: dict[str, torch.Tensor | Mean | BinaryAUC] = doc(
        factory=dict,
        text="Unweighted metrics to log, e.g. accuracy: a `Mean` (sum and count) or `BinaryAUC`; a plain 0-d tensor is "
        "a mean over this micro-batch (Mean(value, 1)).",
    )


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

    def collate(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Extra arrays from the padded batch (numpy, in the loader): e.g. the flat positions of the targets."""
        return {}

    def target_counts(self, arrays: dict[str, np.ndarray]) -> dict[str, int]:
        """{loss term: its number of targets in this padded batch}. Terms are named "<objective>" or
        "<objective>_<part>"; `loss` weighs each by `weights(term)`."""
        return {}

    def before_encoder(self, batch: Mapping[str, torch.Tensor], forward: Forward, model: nn.Module) -> None:
        """Change the encoder's inputs in `forward`, and keep what `loss` needs in forward.carry[self.name]."""

    def build_head(self, model_config: Any, encoder: nn.Module) -> nn.Module | None:
        """The head this objective trains, if any; stored as model.heads[self.name]."""
        return None

    def loss(
        self, batch: Mapping[str, torch.Tensor], forward: Forward, model: nn.Module, weights: LossWeights
    ) -> ObjectiveOutput:
        raise NotImplementedError


REGISTRY: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    if cls.name in REGISTRY:
        raise ValueError(f"objective '{cls.name}' registered twice ({REGISTRY[cls.name].__module__}, {cls.__module__})")
    REGISTRY[cls.name] = cls
    return cls


def validate_objectives(spec: dict[str, Any]) -> dict[str, Any]:
    """Typed options for each objective in a config mapping {name: {option: value}}; checks the mix."""
    from pretrain.core.config import _nearest, from_dict

    if not spec:
        raise ConfigError("objectives: at least one objective is needed (e.g. objectives.mlm.weight=1)")
    typed = {}
    for name, options in spec.items():
        if name not in REGISTRY:
            raise ConfigError(
                f"objectives: unknown objective '{name}'{_nearest(name, REGISTRY)}; "
                f"known: {', '.join(sorted(REGISTRY))}"
            )
        cls = REGISTRY[name]
        if dataclasses.is_dataclass(options) and isinstance(options, cls.Options):
            typed[name] = options
        else:
            typed[name] = from_dict(cls.Options, options or {}, f"objectives.{name}")
    rewriters = [n for n in typed if REGISTRY[n].rewrites_inputs]
    if len(rewriters) > 1:
        raise ConfigError(
            f"objectives: {' and '.join(rewriters)} both rewrite the input tokens; a run can use "
            "only one of mlm, span, rtd, plm"
        )
    pairs = [n for n in typed if REGISTRY[n].sentence_level]
    if len(pairs) > 1:
        raise ConfigError(f"objectives: {' and '.join(pairs)} both build segment pairs; choose one of nsp, sop")
    for name, options in typed.items():
        if options.weight < 0:
            raise ConfigError(f"objectives.{name}.weight: must be >= 0, got {options.weight}")
    if all(options.weight == 0 for options in typed.values()):
        raise ConfigError(
            f"objectives: every weight is 0 ({', '.join(f'{n}.weight=0' for n in typed)}), so nothing "
            "would be trained; give at least one objective a weight > 0"
        )
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
