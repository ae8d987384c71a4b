"""What an ablation runs: its config read and checked, one `Arm` per arm and pretraining seed, and each run's budget
(`apply_budget`: the steps, or minutes, that spend the same tokens, FLOPs or time in every arm). `pretrain ablate`
(`pretrain.evaluation.ablate`) runs them; its docstring shows the config."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.core.config import REPLACED_BY_PRESET, RunConfig, check_config
from pretrain.core.errors import ConfigError
from pretrain.core.parsing import (
    apply_overrides,
    coerce,
    deep_merge,
    from_dict,
    load_yaml_with_base,
    merge_base,
    resolve_preset,
)
from pretrain.core.schedule import Schedule, config_at
from pretrain.evaluation.configs import AblationConfig, EvalConfig, LaunchConfig, missing_task_hint
from pretrain.evaluation.token_tasks import is_conll_dir
from pretrain.train.setup import config_from_dict


def say(message: str) -> None:
    print(f"[ablate] {message}", flush=True)


@dataclass
class Arm:
    """One run of an arm: its objectives at one pretraining seed."""

    name: str  # the run: the arm's name, or <arm>-seed<S> when the ablation has several seeds
    cfg: RunConfig  # resolved; run_dir = <ablation>/arms/<name>
    pretrain: bool = True
    group: str = ""  # the arm this run belongs to
    seed: int = 0
    overrides: dict = field(default_factory=dict)  # what the arm changes of the shared run, as written


@dataclass
class Ablation:
    path: Path
    out: Path
    base: RunConfig
    arms: list[Arm]
    config: AblationConfig  # the file as typed (budget, eval, launch)
    raw: dict = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)

    @property
    def eval(self) -> EvalConfig:
        return self.config.eval

    @property
    def launch(self) -> LaunchConfig:
        return self.config.launch

    @property
    def budget_kind(self) -> str:
        return self.config.budget.kind

    @property
    def budget_amount(self) -> float:
        return self.config.budget.amount

    def groups(self) -> dict[str, list[Arm]]:
        """Arm name -> its runs (one per pretraining seed), in config order."""
        out: dict[str, list[Arm]] = {}
        for arm in self.arms:
            out.setdefault(arm.group, []).append(arm)
        return out

    def arm_config_path(self, arm: Arm) -> Path:
        return self.out / "configs" / f"{arm.name}.yaml"


# ----------------------------------------------------------------------------------------------
# Config


# What a file (over its `base:`) and an override take whole rather than merged: the arms, and the shared run's
# objectives (as `run:` replaces its preset's in `load_ablation`): run.objectives={mlm: {}} means mlm alone.
OVERRIDDEN_WHOLE = ("arms", *(f"run.{key}" for key in REPLACED_BY_PRESET))


def _read(config: str, overrides: list[str]) -> tuple[Path, dict, AblationConfig]:
    """The file (a path or a preset; its own `base:` followed, whose arms it replaces), overrides applied, typed."""
    path = Path(config)
    if not path.is_file():
        path = resolve_preset(config)
    raw = apply_overrides(load_yaml_with_base(path, OVERRIDDEN_WHOLE), overrides, OVERRIDDEN_WHOLE)
    if isinstance(raw.get("seeds"), int):  # `seeds: 7` for one seed
        raw["seeds"] = [raw["seeds"]]
    return path, raw, from_dict(AblationConfig, raw, source=path).check(str(path))


def _check_tasks(tasks: list[str], path: Path) -> None:
    """Each task is a directory with train.tsv (GLUE format) or CoNLL train.txt/dev.txt; a missing one says where the
    presets' tasks come from."""
    names = [Path(task).name for task in tasks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # results are kept by task name: the second would be skipped as done
        raise ConfigError(
            f"{path}: eval.tasks: two task directories named {', '.join(twice)} ({', '.join(tasks)}): results are "
            "kept by directory name, so give each task a directory of its own name"
        )
    for task in tasks:
        if not ((Path(task) / "train.tsv").is_file() or is_conll_dir(Path(task))):
            raise ConfigError(
                f"{path}: eval.tasks: '{task}' has no train.tsv nor CoNLL train.txt/dev.txt (paths are relative to "
                f"the directory you run from, {Path.cwd()}){missing_task_hint(task)}"
            )


# Where an ablation puts its runs, tokenizer and shards, and how it names runs: an arm (or run:, for the tokenizer and
# shards; its name and output_dir come from its preset) that set them was overridden with no word, so a user looked
# for an arm (or reused a tokenizer) where it was not.
SET_BY_THE_ABLATION = ("name", "output_dir", "data.tokenizer", "data.shards")


def _refuse_what_the_ablation_sets(spec: dict, where: str, keys: tuple[str, ...] = SET_BY_THE_ABLATION) -> None:
    def given_in(mapping: Any, key: str) -> bool:
        head, _, rest = key.partition(".")
        inner = mapping.get(head) if isinstance(mapping, dict) else None
        return given_in(inner, rest) if rest else inner is not None

    given = [k for k in keys if given_in(spec, k)]
    if given:
        raise ConfigError(
            f"{where}: {', '.join(given)}: set by the ablation (runs <output_dir>/arms/<arm>[-seed<N>], the tokenizer "
            "and shards built once in <output_dir>); set the ablation's own output_dir instead"
        )


def _shared_run(run: dict, out: Path, path: Path) -> tuple[dict, RunConfig]:
    """The run config every arm starts from (as a mapping, and typed): the tokenizer and shards are built once, in the
    ablation directory."""
    _refuse_what_the_ablation_sets(run, f"{path}: run", ("data.tokenizer", "data.shards"))
    data = deep_merge(
        run,
        {"output_dir": str(out / "arms"), "data": {"tokenizer": str(out / "tokenizer"), "shards": str(out / "shards")}},
    )
    try:
        return data, config_from_dict({**data, "name": "base"})
    except ConfigError as err:
        raise ConfigError(f"{path}: run: {err}") from None


BASELINE = "none"  # the random-encoder arm's name
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*")  # a directory and file name, and markdown as it is


def _check_arm_name(name: str, path: Path) -> None:
    """An arm's name names its runs' directories and config files, and its rows in the report's tables: a name with
    '/' or '..' wrote them outside the ablation's directory (over a user's file), one with '|' shifted the columns."""
    if not ARM_NAME.fullmatch(name) or name.endswith("."):
        raise ConfigError(
            f"{path}: arms: '{name}' cannot name an arm: use letters, digits and _ . + = - (starting with a letter "
            "or digit); it names the arm's run directories and its rows in the report"
        )


def _run_name(arm: str, seed: int, several: bool, runs: Path) -> str:
    """A run's name (its directory under `runs`): the arm's, or <arm>-seed<S> with several seeds. A run recorded under
    the other of the two at this seed (before seeds were added, or after they were taken away) keeps its name: it is
    reused, not run again beside it."""
    named, other = (f"{arm}-seed{seed}", arm) if several else (arm, f"{arm}-seed{seed}")
    return next((name for name in (named, other) if _recorded_seed(runs / name) == seed), named)


def _recorded_seed(run_dir: Path) -> int | None:
    """The pretraining seed a run's state.json records (None: no run there, or one recorded before its settings)."""
    try:
        return json.loads((run_dir / "state.json").read_text())["settings"]["run"]["train"]["seed"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _arm_runs(name: str, spec: Any, shared: dict, base: RunConfig, seeds: list[int], path: Path) -> list[Arm]:
    """One Arm per pretraining seed: the shared run with the arm's overrides (its objectives replace the shared
    ones; train options such as its learning rate may differ; the encoder, sequence length and seed may not)."""
    if spec is not None and not isinstance(spec, dict):  # dict(3) was a TypeError's traceback
        raise ConfigError(
            f"{path}: arms.{name}: expected a mapping of the arm's overrides of run "
            f"(e.g. {{objectives: {{mlm: {{}}}}}}), got {spec!r}"
        )
    spec = dict(spec or {})
    _check_arm_name(name, path)
    _refuse_what_the_ablation_sets(spec, f"{path}: arms.{name}")
    # typed as a bool setting is: bool() took the text "false" (quoted) or "nope" as true, and trained the baseline
    pretrain = coerce(spec.pop("pretrain", name != BASELINE), bool, f"{path}: arms.{name}.pretrain")
    if pretrain != (name != BASELINE):  # the report finds the random encoder by its name
        raise ConfigError(
            f"{path}: arms.{name}: pretrain: {str(pretrain).lower()}: the random-encoder baseline is the arm named "
            f"'{BASELINE}' (untrained; every pretrained arm is compared with it), and only it: "
            + (f"rename this arm '{BASELINE}'" if not pretrain else "give this pretrained arm another name")
        )
    overrides = deep_merge({}, spec)  # as written, for the results: what this arm changes
    data = dict(shared)
    if "objectives" in spec:
        data["objectives"] = spec.pop("objectives")
    if not pretrain:  # the baseline exports an mlm model: the same encoder and tokenizer, untrained
        data["objectives"] = {"mlm": {}}
    data = deep_merge(data, spec)
    runs = []
    for seed in seeds:
        run_name = _run_name(str(name), seed, len(seeds) > 1, Path(shared["output_dir"]))
        seeded = deep_merge(data, {"train": {"seed": seed}})
        try:
            cfg = config_from_dict({**seeded, "name": run_name, "output_dir": shared["output_dir"]})
        except ConfigError as err:
            raise ConfigError(f"{path}: arms.{name}: {err}") from None
        _check_arm_data(cfg, base, f"{path}: arms.{name}")
        if (
            cfg.model != base.model
            or cfg.data.max_seq_len != base.data.max_seq_len
            or cfg.schedule.phases != base.schedule.phases  # a phase's sequence length, micro-batch, rope_theta
            or "seed" in (spec.get("train") or {})
        ):
            raise ConfigError(
                f"{path}: arms.{name}: an arm may change objectives and training options, not the "
                "encoder, seed, sequence length or schedule phases (they are what the arms share; seeds: sets the "
                "pretraining seeds of every arm, run.schedule the phases)"
            )
        runs.append(Arm(run_name, cfg, pretrain, str(name), seed, overrides))
    return runs


# What an arm's `data:` may change: how samples are cut from the shared shards, and the loader's processes.
ARM_DATA = ("packing", "loader_workers")


def _check_arm_data(cfg: RunConfig, base: RunConfig, where: str) -> None:
    """The tokenizer and shards are built once, from the shared run's data settings: an arm's other data setting
    was dropped for the shared one (data.vocab_size, data.corpus) with no word, so the arm trained on what it did not
    say. Refused, naming it."""
    ours = replace(cfg.data, **{k: getattr(base.data, k) for k in ARM_DATA})
    changed = [k for k in vars(base.data) if getattr(ours, k) != getattr(base.data, k)]
    if changed:
        said = ", ".join(f"data.{k}={getattr(cfg.data, k)!r} (run: {getattr(base.data, k)!r})" for k in changed)
        raise ConfigError(
            f"{where}: {said}: every arm trains on the one tokenizer and the shards built from run.data; an arm may "
            f"change only {', '.join(f'data.{k}' for k in ARM_DATA)} (set the others in run.data)"
        )


def _refuse_what_the_budget_sets(cfg: AblationConfig, path: Path) -> None:
    """`apply_budget` gives every arm its length: the steps that spend a tokens or FLOPs budget, the minutes of a time
    budget. An arm's own train.max_steps (or max_minutes) was replaced by it with no word, so the arm meant to train
    longer trained as long as the others."""
    key = "max_minutes" if cfg.budget.kind == "time" else "max_steps"
    for name, spec in cfg.arms.items():
        train = spec.get("train") if isinstance(spec, dict) else None
        for own in ("max_minutes", "max_steps") if isinstance(train, dict) else ():
            if own in train:  # under a time budget, an arm's max_steps cut it short of the others' minutes
                raise ConfigError(
                    f"{path}: arms.{name}: train.{own}={train[own]}: the {cfg.budget.kind} budget sets every arm's "
                    f"{key} (budget.amount={cfg.budget.amount:g}), the same for each; leave train.{own} out of "
                    "the arm"
                )


def load_ablation(config: str, overrides: list[str] | None = None) -> Ablation:
    """An ablation config (a file or preset name, with dotted overrides), typed and checked, its arms resolved."""
    path, raw, cfg = _read(config, overrides or [])
    _check_tasks(cfg.eval.tasks, path)
    out = Path(cfg.output_dir)
    # where the runs go is the ablation's (a run.output_dir was dropped with no word; a run.name comes with a preset)
    _refuse_what_the_ablation_sets(cfg.run, f"{path}: run", ("output_dir",))
    run = merge_base(cfg.run, path, REPLACED_BY_PRESET)  # `run.base:`: a preset, or a file relative to this one
    shared, base = _shared_run(run, out, path)
    seeds = list(cfg.seeds) or [base.train.seed]
    m = base.model
    if m.position_embedding == "learned" and cfg.eval.max_seq_len > m.max_position_embeddings:
        # found here, before any arm trains, rather than at the first downstream task after pretraining
        raise ConfigError(
            f"{path}: eval.max_seq_len={cfg.eval.max_seq_len} is longer than the arms' encoder takes "
            f"(model.max_position_embeddings={m.max_position_embeddings}); give at most that, or 0 for its positions"
        )
    if "full" in cfg.eval.modes and len(cfg.eval.seeds) < 5:
        say(f"note: {len(cfg.eval.seeds)} fine-tuning seed(s): a median over seeds, as GLUE papers report, wants 5+")
    _refuse_what_the_budget_sets(cfg, path)
    arms = [arm for name, spec in cfg.arms.items() for arm in _arm_runs(str(name), spec, shared, base, seeds, path)]
    # saved as <dir>/ablation.yaml: self-contained (the `run.base` preset merged in, overrides applied)
    resolved = {**raw, "run": run}
    return Ablation(path, out, base, arms, cfg, resolved, seeds)


# ----------------------------------------------------------------------------------------------
# Budget


def measure_phase_flops(cfg: RunConfig) -> list[int]:
    """FLOPs of one micro-batch (forward + backward) of this arm on one process, for each phase of its schedule (its
    length and micro-batch; one entry without a schedule), counted as the trainer counts them for MFU
    (`probe_flops_per_sample`) over a micro-batch of real samples; phases of the same shape are measured once.
    Scheduled masking rates are taken at their configured value (they move only the sparse heads' share)."""
    from data_pipeline.loader import PretrainDataset
    from data_pipeline.shards import ShardSet
    from data_pipeline.tokenizer import load_tokenizer, special_tokens
    from objectives import build_objectives
    from pretrain.train.setup import build_sample_source
    from pretrain.train.trainer import probe_flops_per_sample

    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    shards = ShardSet(cfg.shards_dir, verify=False)
    objectives = build_objectives(cfg.objectives, tokens)
    measured: dict[tuple[int, int], int] = {}
    for phase in Schedule.of(cfg).phases:
        shape = (phase.max_seq_len, phase.micro_batch_size)
        if shape not in measured:
            at = config_at(cfg, phase.start)
            dataset = PretrainDataset(build_sample_source(at, shards, tokens, objectives), objectives, at.train.seed)
            n = phase.micro_batch_size
            measured[shape] = round(probe_flops_per_sample(at, tokens, dataset, 0, n) * n)
    return [measured[(p.max_seq_len, p.micro_batch_size)] for p in Schedule.of(cfg).phases]


def budget_costs(cfg: RunConfig, phase_flops: list[int], world: int) -> tuple[np.ndarray, np.ndarray]:
    """(token slots [S], FLOPs [S]) of each optimizer step up to the schedule's last change (S = that step + 1; every
    later step costs what the last does). A step's FLOPs are its phase's micro-batch FLOPs times the micro-batches
    of its global batch (over all ranks)."""
    s = Schedule.of(cfg)
    a = s.arrays(np.arange(s.last_change() + 1), world)
    batch = a["global_batch"]
    flops = np.asarray(phase_flops, np.float64)[a["phase"]] * (batch // a["micro_batch_size"])
    return batch * a["max_seq_len"], flops


def steps_within(costs: np.ndarray, budget: float) -> int:
    """How many steps of these costs [S] (the last repeated after S) fit in `budget`."""
    total = np.cumsum(costs, dtype=np.float64)
    n = int(np.searchsorted(total, budget, side="right"))
    if n == len(costs):
        n += int((budget - total[-1]) // costs[-1])
    return n


def per_step_cost(costs: np.ndarray, steps: int) -> float:
    """The cost per step of `costs` [S] (the last repeated after S) averaged over the first `steps` steps: what the
    report multiplies the steps trained by."""
    return float(costs[np.minimum(np.arange(steps), len(costs) - 1)].mean())


def planned_flops_per_step(cfg: RunConfig, plan: dict) -> float:
    """FLOPs per step of a plan made without them (`pretrain ablate --print-commands` before the data existed, or with
    a tokens or time budget before they were measured for it), measured now for its steps and global batch."""
    world = max(1, plan.get("global_batch", 0) // cfg.train.global_batch(1))
    return per_step_cost(budget_costs(cfg, measure_phase_flops(cfg), world)[1], plan["max_steps"])


def apply_budget(ab: Ablation, arm: Arm, phase_flops: list[int], world: int = 1) -> dict:
    """Give the arm its budget (a new config: max_steps for tokens and flops, max_minutes for time); returns the plan
    for the report. A scheduled arm's steps cost what its schedule says at each step (length, global batch);
    `phase_flops`: `measure_phase_flops` (zeros when the budget is not in FLOPs)."""
    t = arm.cfg.train
    tokens, flops = budget_costs(arm.cfg, phase_flops, world)
    minutes = t.max_minutes
    if ab.budget_kind in ("tokens", "flops"):
        steps = steps_within(tokens if ab.budget_kind == "tokens" else flops, ab.budget_amount)
    else:
        steps, minutes = t.max_steps, ab.budget_amount  # steps an upper bound: the clock stops training first
    if steps < 1:
        raise ConfigError(
            f"{ab.path}: budget.amount {ab.budget_amount:g} {ab.budget_kind} is less than one step "
            f"of arm '{arm.name}' ({tokens[0]} tokens, {flops[0]:.3g} FLOPs)"
        )
    # the warm-up at most a tenth of the budgeted steps (a preset's, kept over a short budget, left the whole run
    # below its learning rate), said where it is cut: under a FLOPs budget the arms' steps, and so their cuts, differ
    warmup = min(t.warmup_steps, max(1, steps // 10))
    if warmup < t.warmup_steps:
        say(
            f"note: arm {arm.name}: train.warmup_steps {t.warmup_steps} cut to {warmup}, a tenth of the {steps} steps "
            f"its {ab.budget_kind} budget gives"
        )
    arm.cfg = replace(
        arm.cfg,
        train=replace(
            t, max_steps=steps, max_minutes=minutes, save_every=min(t.save_every, steps), warmup_steps=warmup
        ),
    )
    try:  # what the budget's length may break: a phase or ramp point past the end, a WSD decay longer than the run
        check_config(arm.cfg)
    except ConfigError as err:
        where = f"{ab.path}: arm '{arm.name}': its {ab.budget_kind} budget ends it at step {steps}"
        raise ConfigError(f"{where}: {err}") from None
    per_step = [per_step_cost(c, steps) for c in (tokens, flops)]
    return {
        "kind": ab.budget_kind,
        "amount": ab.budget_amount,
        "max_steps": steps,
        "warmup_steps": warmup,
        "global_batch": int(arm.cfg.train.global_batch(world)),
        "tokens_per_step": per_step[0] if per_step[0] % 1 else int(per_step[0]),
        "flops_per_step": per_step[1],
    }
