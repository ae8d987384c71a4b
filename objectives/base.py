"""The Objective contract, the registry, and validation of a run's mix of objectives.

An objective has a data half, run in the loader on the host, and a model half, which owns its head:
- `prepare(sample, rng)`: corrupt one sample or add its targets (numpy, deterministic given `rng`);
- `collate(arrays)`: from the padded batch, what the model side needs to gather its targets without a device-side
  `nonzero` (flat target positions and the targets themselves), and `target_counts(arrays)`, each loss term's number
  of targets: host numbers, known before the forward;
- `before_encoder(batch, forward, model)`: change the encoder's inputs (`Forward`: ELECTRA's sampled tokens, PLM's
  masks, and a second stream through the encoder's layers, `forward.stream`: PLM's query stream) and keep what its
  loss needs in `forward.carry[name]`;
- `loss(batch, forward, model, weights)`: its loss from the encoder's output, with `build_head`'s head.
A run sums `weight * loss` over its objectives and logs every loss and metric unweighted. The batch holds data only.

Each loss term is a sum over its targets times a per-target weight (`LossWeights`): 1 / the targets of this
micro-batch (a mean, outside training), or micro-batches x ranks / the targets of the whole optimizer step, which
after DeepSpeed's division by micro-batches x ranks makes every target of the step weigh alike however the batch is
split (`train.loss_normalization=step`, set by the trainer).

Metrics are sums and counts (`Mean`) or histograms (`BinaryAUC`), so that micro-batches and ranks combine exactly.

Options are declared with the values they admit (`option`) and checked here for every objective alike; error messages
name objectives from the registry, never from a list written out; a head that predicts tokens is built by
`objectives.lm_head.lm_head`.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pretrain.core.errors import ConfigError
from pretrain.core.measures import BinaryAUC, Mean
from pretrain.core.parsing import doc, nearest
from pretrain.core.provenance import PLUGINS_ENV, plugin_modules
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens

if TYPE_CHECKING:
    from pretrain.model.pretraining import Forward, LossWeights


def flat_targets(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions [M] into labels.ravel(), the labels there [M]) of the labelled entries (not IGNORE_INDEX) of a
    padded labels array, in row-major order: what a head gathers with index_select instead of a boolean mask."""
    flat = labels.reshape(-1)
    positions = np.flatnonzero(flat != IGNORE_INDEX).astype(np.int64)
    return positions, flat[positions].astype(np.int64)


def summed_ce_and_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of logits [M, C] summed over targets [M], how many the argmax gets right): what each
    classification head's compiled loss returns, the mean taken by the caller's `Mean`."""
    return F.cross_entropy(logits, targets, reduction="sum"), (logits.argmax(-1) == targets).sum()


@dataclass(frozen=True)
class Range:
    """The values an option admits: bounds (ge/gt, le/lt; None: unbounded) or a set of choices."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple = ()

    def admits(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def __str__(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return "any value"


def option(
    default: Any,
    text: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple = (),
    schedulable: bool = False,
) -> Any:
    """An objective's option: `pretrain.core.parsing.doc`'s one-line documentation plus the values it admits, which
    `ObjectiveOptions` checks for every objective alike and `pretrain objectives` shows. `schedulable`: the option
    may follow `schedule.values` (`pretrain.core.schedule`); it must then be read by `prepare` at every call, never
    kept in the objective at construction."""
    bounds = Range(ge, gt, le, lt, tuple(choices))
    admitted = bounds if bounds != Range() else None
    return dataclasses.field(default=default, metadata={"doc": text, "range": admitted, "schedulable": schedulable})


def objective_names(options_cls: type) -> str:
    """The registered name(s) whose options are `options_cls` (the class name before registration): the key
    under `objectives.` that error messages name."""
    names = [name for name, cls in REGISTRY.items() if cls.Options is options_cls]
    return "/".join(names) or options_cls.__name__


@dataclass
class ObjectiveOptions:
    """Base of every objective's options. Each field is an `option(default, text, <range>)`; ranges are checked
    here, when the options are built (the config is read), not in a loader worker; rules that tie several
    options together go in `check`."""

    weight: float = option(1.0, "Weight of this objective's loss in the total.", ge=0)

    def __post_init__(self):
        where = f"objectives.{objective_names(type(self))}"
        for f in dataclasses.fields(self):
            bounds, value = f.metadata.get("range"), getattr(self, f.name)
            if bounds is not None and not bounds.admits(value):
                raise ConfigError(f"{where}.{f.name}: must be {bounds}, got {value!r}")
        self.check(where)

    def check(self, where: str) -> None:
        """Rules between options (raise ConfigError naming `where`, e.g. "objectives.mlm"); one option's range
        belongs in its field."""


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
    sample_builder: ClassVar[str] = "packed"
    """Which sample builder feeds this objective: "packed" sequences, or segment "pairs" (nsp, sop)."""
    sentence_level: ClassVar[bool] = False
    """Derived, never set: True where sample_builder == "pairs" (the objective builds the segment pair); at most
    one per run, and it prepares its samples before the token-level objective corrupts them."""
    pad_values: ClassVar[dict[str, int]] = {}
    """Padding value of each per-token array this objective adds to a sample; an array not listed pads with -100
    (IGNORE_INDEX) if its name ends in "labels", else 0. Name per-token targets *labels so padding is no target."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "sentence_level" in cls.__dict__:
            raise TypeError(f"{cls.__name__}: sentence_level follows from sample_builder; set that instead")
        cls.sentence_level = cls.sample_builder == "pairs"

    def __init__(self, options: Any, tokens: SpecialTokens):
        self.options = options
        self.tokens = tokens

    @classmethod
    def describe(cls) -> list[str]:
        """`pretrain objectives`' lines for this objective: its name and the first paragraph of its module's doc, then
        each option with its default, the values it admits and its doc."""
        module = sys.modules.get(cls.__module__)
        doc = ((module.__doc__ if module else None) or cls.__doc__ or "").strip()
        summary = " ".join(doc.split("\n\n")[0].split())  # its first paragraph, whole: a line may end mid-sentence
        lines = [f"{cls.name}: {summary}"]
        for f in dataclasses.fields(cls.Options):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            bounds = f.metadata.get("range")
            admits = f" ({bounds})" if bounds is not None else ""
            scheduled = " [schedulable]" if f.metadata.get("schedulable") else ""
            lines.append(
                f"    objectives.{cls.name}.{f.name} = {default!r}{admits}{scheduled}   {f.metadata.get('doc', '')}"
            )
        return lines

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


def import_plugins() -> None:
    for module in plugin_modules():
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"{PLUGINS_ENV}: cannot import '{module}' ({err})") from err


def register(cls: type[Objective]) -> type[Objective]:
    if cls.name in REGISTRY:
        raise ValueError(f"objective '{cls.name}' registered twice ({REGISTRY[cls.name].__module__}, {cls.__module__})")
    REGISTRY[cls.name] = cls
    return cls


def validate_objectives(spec: dict[str, Any]) -> dict[str, Any]:
    """Typed options for each objective in a config mapping {name: {option: value}}; checks the mix."""
    from pretrain.core.parsing import from_dict, nearest

    if not spec:
        raise ConfigError("objectives: at least one objective is needed (e.g. objectives.mlm.weight=1)")
    typed = {}
    for name, options in spec.items():
        if name not in REGISTRY:
            raise ConfigError(
                f"objectives: unknown objective '{name}'{nearest(name, REGISTRY)}; known: {', '.join(sorted(REGISTRY))}"
            )
        cls = REGISTRY[name]
        if dataclasses.is_dataclass(options) and isinstance(options, cls.Options):
            typed[name] = options
        elif options is None or isinstance(options, dict):  # `mlm:` with nothing after it: the defaults
            typed[name] = from_dict(cls.Options, options or {}, f"objectives.{name}")
        else:  # `objectives.nsp=false` (or 0) trained nsp at weight 1: `options or {}` read it as no options
            raise ConfigError(
                f"objectives.{name}: expected a mapping of its options (e.g. {{weight: 1.0}}), got {options!r}; to "
                f"train without {name}, name the objectives that train: objectives={{...}} without it"
            )
    for flag, what in (("rewrites_inputs", "rewrite the input tokens"), ("sentence_level", "build segment pairs")):
        clash = [n for n in typed if getattr(REGISTRY[n], flag)]
        if len(clash) > 1:
            every = ", ".join(n for n, cls in REGISTRY.items() if getattr(cls, flag))
            raise ConfigError(f"objectives: {' and '.join(clash)} both {what}; choose one of {every}")
    if all(options.weight == 0 for options in typed.values()):
        raise ConfigError(
            f"objectives: every weight is 0 ({', '.join(f'{n}.weight=0' for n in typed)}), so nothing "
            "would be trained; give at least one objective a weight > 0"
        )
    return typed


def schedulable_options(options_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(options_cls) if f.metadata.get("schedulable")]


def check_scheduled_options(values: list, typed: dict[str, Any]) -> None:
    """`schedule.values` entries that name objectives: the objective is in the run, the option is schedulable, and
    every point's value is one the option admits (its `option` range), each error naming the entry."""
    for i, entry in enumerate(values):
        if not entry.key.startswith("objectives."):
            continue
        where, (_, name, key) = f"schedule.values[{i}]", entry.key.split(".")
        if name not in typed:
            raise ConfigError(
                f"{where}.key: '{entry.key}' schedules objective '{name}', which this run does not train "
                f"(its objectives: {', '.join(typed)})"
            )
        cls = REGISTRY[name]
        allowed = schedulable_options(cls.Options)
        if key not in allowed:
            raise ConfigError(
                f"{where}.key: '{entry.key}' cannot be scheduled; {name}'s schedulable options: "
                f"{', '.join(allowed) or 'none'}{nearest(key, allowed)}"
            )
        for step, value in entry.points:  # the option's range and its rules with the others, at every point
            try:
                dataclasses.replace(typed[name], **{key: float(value)})
            except ConfigError as err:
                raise ConfigError(f"{where}.points: at step {step}: {err}") from None


def scheduled(objective: Objective, values: dict[str, float] | None) -> Any:
    """`objective.options` with `values` ({option: value}) in place of the configured ones (the same object when
    there are none): what `prepare` reads at a step of a schedule."""
    if not values:
        return objective.options
    return dataclasses.replace(objective.options, **values)


def build_objectives(spec: dict[str, Any], tokens: SpecialTokens) -> list[Objective]:
    """Instances in a fixed order: sentence-level objectives first (they assemble the segment pair that a
    token-level objective then corrupts), then the config's order."""
    typed = validate_objectives(spec)
    objectives = [REGISTRY[name](options, tokens) for name, options in typed.items()]
    return sorted(objectives, key=lambda o: not o.sentence_level)


def pair_objectives(names) -> list[str]:
    """The objectives among `names` that build segment pairs (nsp, sop), sorted: their samples are padded, and their
    second segment typed 1."""
    return sorted(name for name in names if REGISTRY[name].sentence_level)


def sample_builder_for(objectives: list[Objective]) -> str:
    """The one sample builder every objective of a run agrees on."""
    kinds = {o.sample_builder for o in objectives if o.sample_builder != "packed"}
    if len(kinds) > 1:
        raise ConfigError(f"objectives need different sample builders: {sorted(kinds)}")
    return kinds.pop() if kinds else "packed"
