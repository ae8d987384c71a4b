"""In-run schedules (`schedule:` in a run config): what a setting is at each optimizer step, as pure functions of it.

- **Phases** (`schedule.phases`) are piecewise constant. From its `start` until the next phase's, a phase fixes the
  sequence length, the micro-batch and the RoPE theta of the global layers (BERT: 128 tokens, then 512 for the last
  10% of the steps; ModernBERT: context extension with a larger theta). Each phase reads a sample stream of its own,
  a function of (seed, phase, position in the phase), so changing a phase never moves another's samples.
- **Scheduled values** (`schedule.values`) are piecewise linear (`shape: linear`, a ramp) or piecewise constant
  (`steps`) in the step: an objective's rate, whose `option` says it may be scheduled (objectives.mlm.mask_prob:
  mmBERT's 30% -> 15% -> 5%), or the global batch (`train.global_batch`, in sequences or in tokens), which a phase's
  micro-batch then splits into accumulation steps.

A scheduled global batch is rounded down to a multiple of its `multiple_of` (Megatron's ramp increment: the same
batches on any number of ranks), or else of micro-batch x ranks, and is at least one such multiple. Without a
`train.global_batch` value it is the run's `train.global_batch(world)`.

Everything here is a function of (config, step, ranks): a resumed run recomputes it and continues bitwise. What a
resume may change is decided by `first_change`: the first step at which two schedules differ, which must not be one
the checkpoint has trained (`pretrain.train.fingerprint`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pretrain.core.config import GLOBAL_BATCH, RunConfig, ScheduleConfig, ScheduledValue, TrainConfig
from pretrain.core.errors import ConfigError
from pretrain.core.parsing import from_dict, to_dict


@dataclass(frozen=True)
class Phase:
    """One phase with every field filled in (`Schedule.phases`)."""

    index: int
    start: int
    max_seq_len: int
    micro_batch_size: int
    rope_theta: float


def curve(value: ScheduledValue, steps: np.ndarray) -> np.ndarray:
    """[len(steps)] float64: `value` at each step (np.interp holds the end values outside the points)."""
    xs = np.array([p[0] for p in value.points], np.float64)
    ys = np.array([p[1] for p in value.points], np.float64)
    steps = np.asarray(steps, np.float64)
    if value.shape == "linear":
        return np.interp(steps, xs, ys)
    return ys[np.maximum(np.searchsorted(xs, steps, side="right") - 1, 0)]


def schedule_until(schedule: dict, end: int) -> dict:
    """A config's `schedule:` (as its YAML holds it) cut for a run that ends at step `end` (train.max_steps) and
    trains every step before it as the full schedule does: phases from `end` on dropped, and each value's points
    from `end` on replaced by one point at step end-1 holding the value the full schedule has there."""
    phases = [p for p in schedule.get("phases") or [] if p.get("start", 0) < end]
    values = []
    for v in schedule.get("values") or []:
        points = [tuple(p) for p in v.get("points") or []]
        kept = [p for p in points if p[0] < end]
        if len(kept) < len(points) and (not kept or kept[-1][0] != end - 1):
            spec = ScheduledValue(points=points, shape=v.get("shape", "linear"))
            kept.append((end - 1, float(curve(spec, np.array([end - 1]))[0])))
        values.append({**v, "points": [list(p) for p in kept]})
    return {**schedule, "phases": phases, "values": values}


class Schedule:
    """A run's schedule with its base settings (what holds where the schedule says nothing)."""

    def __init__(
        self,
        spec: ScheduleConfig,
        max_seq_len: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        rope_theta: float,
        rates: dict[str, float] | None = None,
    ):
        self.spec = spec
        self.base = {
            "max_seq_len": max_seq_len,
            "micro_batch_size": micro_batch_size,
            "grad_accum_steps": grad_accum_steps,
            "rope_theta": rope_theta,
        }
        self.rates = dict(rates or {})  # "objectives.<name>.<option>" -> its constant, where no value schedules it
        phases = (
            []
            if spec.phases and spec.phases[0].start == 0
            else [Phase(0, 0, max_seq_len, micro_batch_size, rope_theta)]
        )
        for p in spec.phases:
            before = phases[-1] if phases else Phase(0, 0, max_seq_len, micro_batch_size, rope_theta)
            phases.append(
                Phase(
                    len(phases),
                    p.start,
                    p.max_seq_len or before.max_seq_len,
                    p.micro_batch_size or before.micro_batch_size,
                    p.rope_theta or before.rope_theta,
                )
            )
        self.phases = phases
        self.starts = np.array([p.start for p in phases], np.int64)  # [P] increasing, starts[0] == 0
        self.values = {v.key: v for v in spec.values}
        self._constant_batches: dict[int, int] = {}  # world -> constant_batch(world), asked at every step

    @classmethod
    def of(cls, cfg: RunConfig) -> Schedule:
        t = cfg.train
        rates = {
            f"objectives.{name}.{key}": float(value)
            for name, options in to_dict(cfg.objectives).items()
            for key, value in (options or {}).items()
            if isinstance(value, float)
        }
        return cls(
            cfg.schedule, cfg.data.max_seq_len, t.micro_batch_size, t.grad_accum_steps, cfg.model.rope_theta, rates
        )

    @property
    def active(self) -> bool:
        return self.spec.active

    def constant_batch(self, world: int) -> int:
        """The global batch without a train.global_batch schedule: the run's own (`TrainConfig.global_batch`)."""
        split = TrainConfig(
            micro_batch_size=self.base["micro_batch_size"], grad_accum_steps=self.base["grad_accum_steps"]
        )
        return split.global_batch(world)

    # --- one step -------------------------------------------------------------------------------------------

    def phase(self, step: int) -> Phase:
        return self.phases[int(np.searchsorted(self.starts, step, side="right")) - 1]

    def phase_end(self, phase: Phase) -> int | None:
        """The first step after `phase` (None: it lasts to the end of the run)."""
        return self.phases[phase.index + 1].start if phase.index + 1 < len(self.phases) else None

    def value(self, key: str, step: int) -> float:
        return float(curve(self.values[key], np.array([step]))[0])

    def objective_values(self, step: int) -> dict[str, dict[str, float]]:
        """{objective: {option: its value at `step`}} of the scheduled objective rates."""
        out: dict[str, dict[str, float]] = {}
        for key in self.values:
            if key.startswith("objectives."):
                _, name, option = key.split(".")
                out.setdefault(name, {})[option] = self.value(key, step)
        return out

    def global_batch(self, step: int, world: int) -> int:
        """Sequences over `world` ranks in optimizer step `step`, as `arrays` gives it. The trainer and its batch
        sampler ask at every step: without a train.global_batch schedule it is the run's batch in the phase's whole
        micro-batches, worked out here without `arrays`, which built numpy arrays and a TrainConfig at each call."""
        if GLOBAL_BATCH in self.values:
            return int(self.arrays(np.array([step]), world)["global_batch"][0])
        if world not in self._constant_batches:
            self._constant_batches[world] = self.constant_batch(world)
        quantum = self.phase(step).micro_batch_size * world
        return max(self._constant_batches[world] // quantum, 1) * quantum

    def accumulation(self, step: int, world: int) -> int:
        """Micro-batches per rank in optimizer step `step`."""
        return self.global_batch(step, world) // (self.phase(step).micro_batch_size * world)

    def at(self, step: int, world: int) -> dict[str, Any]:
        """Every scheduled setting at `step`, as metrics.jsonl logs it."""
        phase = self.phase(step)
        record: dict[str, Any] = {
            "phase": phase.index,
            "max_seq_len": phase.max_seq_len,
            "global_batch": self.global_batch(step, world),
        }
        if self.base["rope_theta"] != phase.rope_theta or any(p.rope_theta != phase.rope_theta for p in self.phases):
            record["rope_theta"] = phase.rope_theta
        for key in self.values:
            if key != GLOBAL_BATCH:
                record[key] = round(self.value(key, step), 6)
        return record

    # --- many steps at once ---------------------------------------------------------------------------------

    def last_change(self) -> int:
        """The last step at which anything scheduled changes (a phase's start, a value's last point): every later
        step trains as this one does."""
        return max([p.start for p in self.phases] + [int(pt[0]) for v in self.spec.values for pt in v.points])

    def accumulates(self, world: int) -> bool:
        """Whether any optimizer step on `world` ranks sums the gradients of several micro-batches per rank."""
        a = self.arrays(np.arange(self.last_change() + 1), world)
        return bool((a["global_batch"] > a["micro_batch_size"] * world).any())

    def arrays(self, steps: np.ndarray, world: int) -> dict[str, np.ndarray]:
        """What the run trains with at each of `steps` [S] on `world` ranks: phase, max_seq_len, rope_theta,
        micro_batch_size, global_batch (sequences) and each scheduled value, each [S]."""
        steps = np.asarray(steps, np.int64)
        idx = np.searchsorted(self.starts, steps, side="right") - 1
        seq = np.array([p.max_seq_len for p in self.phases], np.int64)[idx]
        micro = np.array([p.micro_batch_size for p in self.phases], np.int64)[idx]
        out = {
            "phase": idx,
            "max_seq_len": seq,
            "rope_theta": np.array([p.rope_theta for p in self.phases], np.float64)[idx],
            "micro_batch_size": micro,
        }
        quantum = micro * world  # a global batch is whole micro-batches on every rank
        if GLOBAL_BATCH in self.values:
            ramp = self.values[GLOBAL_BATCH]
            wanted = curve(ramp, steps)
            if ramp.unit == "tokens":
                wanted = wanted / seq
            sequences = np.floor(wanted + 1e-9).astype(np.int64)
            if ramp.multiple_of:  # independent of the ranks (`check_split` holds every phase to it)
                quantum = np.full(steps.shape, ramp.multiple_of, np.int64)
        else:
            sequences = np.full(steps.shape, self.constant_batch(world))
        out["global_batch"] = np.maximum(sequences // quantum, 1) * quantum
        for key, value in self.values.items():
            if key != GLOBAL_BATCH:
                out[key] = curve(value, steps)
        return out

    def check_split(self, world: int, max_steps: int) -> None:
        """Without a train.global_batch schedule, every phase's micro-batch must divide the run's global batch on
        `world` ranks (the accumulation is whole): a ConfigError naming the phase otherwise."""
        ramp = self.values.get(GLOBAL_BATCH)
        if ramp is not None:
            for i, p in enumerate(self.phases):
                if ramp.multiple_of and p.start < max_steps and ramp.multiple_of % (p.micro_batch_size * world):
                    raise ConfigError(
                        f"schedule.values: {GLOBAL_BATCH}.multiple_of={ramp.multiple_of} is not a multiple of phase "
                        f"{i}'s micro-batch {p.micro_batch_size} x {world} rank(s): its batches could not be split "
                        "into whole micro-batches"
                    )
            return
        total = self.constant_batch(world)
        for i, p in enumerate(self.phases):
            if p.start < max_steps and total % (p.micro_batch_size * world):
                raise ConfigError(
                    f"schedule.phases: phase {i} (from step {p.start}) has micro_batch_size {p.micro_batch_size}, "
                    f"which with {world} rank(s) does not divide the global batch of {total} sequences "
                    f"(train.micro_batch_size x grad_accum_steps x ranks); choose a divisor, or schedule "
                    f"{GLOBAL_BATCH}"
                )

    # --- records, for the fingerprint ----------------------------------------------------------------------

    def series(self, key: str, steps: np.ndarray, world: int, arrays: dict | None = None) -> np.ndarray | None:
        """`key` (an `arrays` key, or an objective rate) at each of `steps`; None where this run has no such rate."""
        arrays = self.arrays(steps, world) if arrays is None else arrays
        if key in arrays:
            return arrays[key]
        return np.full(len(steps), self.rates[key]) if key in self.rates else None

    def record(self) -> dict[str, Any]:
        return {"base": dict(self.base), "rates": dict(self.rates), **to_dict(self.spec)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Schedule:
        base = record["base"]
        spec = from_dict(ScheduleConfig, {k: v for k, v in record.items() if k not in ("base", "rates")}, "schedule")
        return cls(
            spec,
            base["max_seq_len"],
            base["micro_batch_size"],
            base["grad_accum_steps"],
            base["rope_theta"],
            record.get("rates"),
        )


def config_at(cfg: RunConfig, step: int) -> RunConfig:
    """`cfg` with the phase settings of optimizer step `step` in place of the run's own (data.max_seq_len,
    train.micro_batch_size, model.rope_theta): what a model trained up to there is (an export's RoPE theta)."""
    if not cfg.schedule.phases:
        return cfg
    phase = Schedule.of(cfg).phase(step)
    return replace(
        cfg,
        data=replace(cfg.data, max_seq_len=phase.max_seq_len),
        train=replace(cfg.train, micro_batch_size=phase.micro_batch_size),
        model=replace(cfg.model, rope_theta=phase.rope_theta),
    )


def unused_by_first_phase(cfg: RunConfig) -> str | None:
    """The run's own settings a phase from step 0 replaces with other values, said: they are never trained with (an
    override of data.max_seq_len over bert-base-two-phase trained at its phase's 128). None where none is."""
    first = next((p for p in cfg.schedule.phases if p.start == 0), None)
    if first is None:
        return None
    at = config_at(cfg, 0)
    unused = [
        f"{name}={mine:g} (the phase: {theirs:g})"
        for name, mine, theirs in (
            ("data.max_seq_len", cfg.data.max_seq_len, at.data.max_seq_len),
            ("train.micro_batch_size", cfg.train.micro_batch_size, at.train.micro_batch_size),
            ("model.rope_theta", cfg.model.rope_theta, at.model.rope_theta),
        )
        if mine != theirs
    ]
    if not unused:
        return None
    return f"schedule.phases[0] sets the run's settings from step 0: {', '.join(unused)} not used"


COMPARED = ("phase", "max_seq_len", "rope_theta", "global_batch")
"""What a resume must not change for a step already trained; the micro-batch may change (it only splits the batch)."""


def first_change(
    old: Schedule, new: Schedule, upto: int, world: int, new_world: int | None = None
) -> tuple[int, str] | None:
    """(first step below `upto` at which `new` on `new_world` ranks (default `world`) trains differently from `old`
    on `world`, what differs), or None. The global batches are each side's own: the same batch split over other
    ranks is no change."""
    if upto <= 0:
        return None
    worlds = (world, world if new_world is None else new_world)
    steps = np.arange(upto, dtype=np.int64)
    a, b = old.arrays(steps, worlds[0]), new.arrays(steps, worlds[1])
    first: tuple[int, str] | None = None
    # a rate scheduled on one side only is compared with the other side's constant
    for key in [*COMPARED, *sorted((set(a) | set(b)) - set(COMPARED) - {"micro_batch_size"})]:
        x, y = old.series(key, steps, worlds[0], a), new.series(key, steps, worlds[1], b)
        if x is None or y is None:
            continue  # an objective only one side has: the fingerprint's objectives say so
        hit = np.flatnonzero(x != y)
        if len(hit) and (first is None or hit[0] < first[0]):
            first = (int(hit[0]), key)
    return first
