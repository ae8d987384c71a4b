"""`pretrain ablate CONFIG`: pretraining objectives compared at an equal budget, then downstream.

An ablation config (YAML, typed as `pretrain.evaluation.configs.AblationConfig`; see configs/ablation-tiny.yaml;
`base:` inherits from another ablation file, whose arms a file naming its own replaces):

    output_dir: runs/ablation-tiny      # the ablation directory
    run: {base: tiny.yaml, ...}         # the run config every arm shares (encoder, data, seed, optimizer)
    arms:                               # name -> overrides of `run` (objectives replace the shared ones;
      mlm: {objectives: {mlm: {}}}      # train options may differ, e.g. rtd: {..., train: {lr: 5e-4}})
      none: {pretrain: false}           # baseline: random init, same config and tokenizer, no training
    seeds: [1234, 1235, 1236]           # pretraining seeds: every arm is pretrained (or, `none`, initialised)
                                        # once per seed (default: run.train.seed alone)
    budget: {kind: flops, amount: 2e15} # flops | tokens | time (minutes); the same for every arm
    eval: {tasks: [dir, ...], seeds: [1, 2, 3], mode: [probe, full], pooling: mean, epochs: 0, lr: 0,
           batch_size: 0, max_seq_len: 128, max_train_examples: 0,
           lrs: [1e-4, 3e-4], probe_lrs: [], heldout_fraction: 0.1}
                                        # lrs (full) / probe_lrs: a learning-rate sweep per arm, task and mode,
                                        # chosen on heldout_fraction of train (never dev), then all of train
    launch: {procs: 8, scheduler: single_node, threads: 0}
                                        # procs, scheduler (single_node | slurm): for --print-commands;
                                        # threads: torch threads here and per arm (0 = torch's default;
                                        # 1 on a shared, oversubscribed CPU, where more threads spin-wait)

Layout: <dir>/tokenizer and <dir>/shards (built once, shared), <dir>/configs/<run>.yaml (each run's resolved
config: what the cluster commands point at), <dir>/arms/<run>/ (a run directory, with hf/ and state.json; <run> is
the arm's name, or <arm>-seed<S> with several seeds), <dir>/report.md with its plots and results.json (every score
and every dev prediction, from which the report's paired tests are computed: `pretrain.evaluation.stats`), and
<dir>/provenance.json (commit, versions, command, resolved configs, sha256 of every input: `pretrain.core.provenance`).

Each arm trains in its own `python -m pretrain.cli train` process: DeepSpeed engines, signal handlers and
the distributed group are per process, and it is exactly the command a cluster runs. state.json records
each finished stage (trained, exported, evaluated), so a re-run skips finished arms and stages; a
half-trained arm resumes from its checkpoint (the trainer does that itself). Where a machine keeps nothing between
short loans, `--within-minutes` ends an invocation at a finished run rather than mid-way, and `--copy-record` copies
what the next machine needs to go on, without weights: the tokenizer and each finished run's state (`copy_record`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pretrain.core.config import REPLACED_BY_PRESET, RunConfig, check_config, load_yaml, save_config
from pretrain.core.errors import ConfigError, UserError
from pretrain.core.outputs import LOCK, claim_output, mark_output
from pretrain.core.parsing import (
    apply_overrides,
    deep_merge,
    from_dict,
    load_yaml_with_base,
    merge_base,
    resolve_preset,
)
from pretrain.core.provenance import run_provenance, write_provenance
from pretrain.core.schedule import Schedule, config_at
from pretrain.evaluation.configs import AblationConfig, EvalConfig, LaunchConfig, missing_task_hint
from pretrain.evaluation.token_tasks import is_conll_dir
from pretrain.train.distributed import single_process_env
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


def _read(config: str, overrides: list[str]) -> tuple[Path, dict, AblationConfig]:
    """The file (a path or a preset; its own `base:` followed, whose arms it replaces), overrides applied, typed."""
    path = Path(config)
    if not path.is_file():
        path = resolve_preset(config)
    raw = apply_overrides(load_yaml_with_base(path, ("arms",)), overrides)
    if isinstance(raw.get("seeds"), int):  # `seeds: 7` for one seed
        raw["seeds"] = [raw["seeds"]]
    return path, raw, from_dict(AblationConfig, raw, source=path).check(str(path))


def _check_tasks(tasks: list[str], path: Path) -> None:
    """Each task is a directory with train.tsv (GLUE format) or CoNLL train.txt/dev.txt; a missing one says where the
    presets' tasks come from."""
    for task in tasks:
        if not ((Path(task) / "train.tsv").is_file() or is_conll_dir(Path(task))):
            raise ConfigError(
                f"{path}: eval.tasks: '{task}' has no train.tsv nor CoNLL train.txt/dev.txt (paths are relative to "
                f"the directory you run from, {Path.cwd()}){missing_task_hint(task)}"
            )


def _shared_run(run: dict, out: Path, path: Path) -> tuple[dict, RunConfig]:
    """The run config every arm starts from (as a mapping, and typed): the tokenizer and shards are built once, in the
    ablation directory."""
    data = deep_merge(
        run,
        {"output_dir": str(out / "arms"), "data": {"tokenizer": str(out / "tokenizer"), "shards": str(out / "shards")}},
    )
    try:
        return data, config_from_dict({**data, "name": "base"})
    except ConfigError as err:
        raise ConfigError(f"{path}: run: {err}") from None


def _arm_runs(name: str, spec: Any, shared: dict, base: RunConfig, seeds: list[int], path: Path) -> list[Arm]:
    """One Arm per pretraining seed: the shared run with the arm's overrides (its objectives replace the shared
    ones; train options such as its learning rate may differ; the encoder, sequence length and seed may not)."""
    spec = dict(spec or {})
    pretrain = bool(spec.pop("pretrain", name != "none"))
    overrides = deep_merge({}, spec)  # as written, for the results: what this arm changes
    data = dict(shared)
    if "objectives" in spec:
        data["objectives"] = spec.pop("objectives")
    if not pretrain:  # the baseline exports an mlm model: the same encoder and tokenizer, untrained
        data["objectives"] = {"mlm": {}}
    data = deep_merge(data, spec)
    runs = []
    for seed in seeds:
        run_name = str(name) if len(seeds) == 1 else f"{name}-seed{seed}"
        seeded = deep_merge(data, {"train": {"seed": seed}, "data": shared["data"]})
        try:
            cfg = config_from_dict({**seeded, "name": run_name, "output_dir": shared["output_dir"]})
        except ConfigError as err:
            raise ConfigError(f"{path}: arms.{name}: {err}") from None
        if (
            cfg.model != base.model
            or cfg.data.max_seq_len != base.data.max_seq_len
            or "seed" in (spec.get("train") or {})
        ):
            raise ConfigError(
                f"{path}: arms.{name}: an arm may change objectives and training options, not the "
                "encoder, seed or sequence length (they are what the arms share; seeds: sets the "
                "pretraining seeds of every arm)"
            )
        runs.append(Arm(run_name, cfg, pretrain, str(name), seed, overrides))
    return runs


def load_ablation(config: str, overrides: list[str] | None = None) -> Ablation:
    """An ablation config (a file or preset name, with dotted overrides), typed and checked, its arms resolved."""
    path, raw, cfg = _read(config, overrides or [])
    _check_tasks(cfg.eval.tasks, path)
    out = Path(cfg.output_dir)
    run = merge_base(cfg.run, path, REPLACED_BY_PRESET)  # `run.base:`: a preset, or a file relative to this one
    shared, base = _shared_run(run, out, path)
    seeds = list(cfg.seeds) or [base.train.seed]
    if "full" in cfg.eval.modes and len(cfg.eval.seeds) < 5:
        say(f"note: {len(cfg.eval.seeds)} fine-tuning seed(s): a median over seeds, as GLUE papers report, wants 5+")
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
    last = max([p.start for p in s.phases] + [int(pt[0]) for v in s.spec.values for pt in v.points])
    a = s.arrays(np.arange(last + 1), world)
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
    # warmup must fit in the budget; keep the shared value unless it would eat most of the run
    arm.cfg = replace(
        arm.cfg,
        train=replace(
            t,
            max_steps=steps,
            max_minutes=minutes,
            save_every=min(t.save_every, steps),
            warmup_steps=min(t.warmup_steps, max(1, steps // 10)),
        ),
    )
    try:  # what the budget's length may break: a phase or ramp point past the end, a WSD decay longer than the run
        check_config(arm.cfg)
    except ConfigError as err:
        where = f"{ab.path}: arm '{arm.name}': its {ab.budget_kind} budget ends it at step {steps}"
        raise ConfigError(f"{where}: {err}") from None
    # per step, averaged over the planned steps (what the report multiplies the steps trained by)
    planned = np.arange(steps)
    per_step = [float(c[np.minimum(planned, len(c) - 1)].mean()) for c in (tokens, flops)]
    return {
        "kind": ab.budget_kind,
        "amount": ab.budget_amount,
        "max_steps": steps,
        "global_batch": int(arm.cfg.train.global_batch(world)),
        "tokens_per_step": per_step[0] if per_step[0] % 1 else int(per_step[0]),
        "flops_per_step": per_step[1],
    }


# ----------------------------------------------------------------------------------------------
# State


def read_state(arm: Arm) -> dict:
    path = arm.cfg.run_dir / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(arm: Arm, state: dict) -> None:
    path = arm.cfg.run_dir / "state.json"
    mark_output(path.parent, "run")  # an arm is a run directory of ours, also before its first step
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)  # atomic: an interruption leaves the previous state, never half of one


def _trainer_state(cfg: RunConfig) -> dict:
    from pretrain.train import checkpoint as ckpt
    from pretrain.train.state import TrainState

    latest = ckpt.latest_checkpoint(cfg.run_dir / "checkpoints")
    return TrainState.load(latest).to_dict() if latest else {}


# ----------------------------------------------------------------------------------------------
# Running


def prepare_data(ab: Ablation) -> None:
    from pretrain.pipeline import stage_shards, stage_tokenizer

    stage_tokenizer(ab.base)
    stage_shards(ab.base)


def train_arm(ab: Ablation, arm: Arm, cfg_path: Path) -> dict:
    """Train in a subprocess until the budget is spent; returns the trainer state of its last checkpoint."""
    t = arm.cfg.train
    done = _trainer_state(arm.cfg)
    if ab.budget_kind == "time" and done:  # the clock restarts per invocation: give a resumed arm what is left
        left = ab.budget_amount - done.get("elapsed_s", 0.0) / 60
        if left <= 0.05:
            return done
        arm.cfg = replace(arm.cfg, train=replace(t, max_minutes=left))
        t = arm.cfg.train
        save_config(arm.cfg, cfg_path)
    if done.get("step", 0) >= t.max_steps:
        return done
    env = single_process_env()  # a single-process run, even inside a launcher's environment
    import torch

    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    if ab.launch.threads > 0:
        env["OMP_NUM_THREADS"] = str(ab.launch.threads)
    say(
        f"arm {arm.name}: training ({t.max_steps} steps"
        + (f", at most {t.max_minutes:.1f} min" if ab.budget_kind == "time" else "")
        + ")"
    )
    proc = subprocess.run([sys.executable, "-m", "pretrain.cli", "train", str(cfg_path)], env=env)
    if proc.returncode == 75:
        raise UserError(
            f"arm {arm.name}: training was interrupted (checkpoint saved); run the same "
            f"`pretrain ablate` command again to resume"
        )
    if proc.returncode != 0:
        raise UserError(
            f"arm {arm.name}: `pretrain train {cfg_path}` failed with exit status {proc.returncode} "
            f"(see its output above)"
        )
    state = _trainer_state(arm.cfg)
    finished = state.get("step", 0) >= t.max_steps or (
        ab.budget_kind == "time" and state.get("elapsed_s", 0.0) >= ab.budget_amount * 60 - 1
    )
    if not finished:
        raise UserError(
            f"arm {arm.name}: training stopped at step {state.get('step', 0)} of {t.max_steps} "
            "before the budget was spent; run again to resume"
        )
    return state


def export_baseline(arm: Arm) -> Path:
    """The no-pretraining arm: the shared encoder config, randomly initialised with the shared seed, exported
    through the same path as the trained arms so tokenizer and HF config are identical."""
    from data_pipeline.tokenizer import load_tokenizer, special_tokens
    from pretrain.hf.export import export_pretrained
    from pretrain.train.setup import build_model

    tokens = special_tokens(load_tokenizer(arm.cfg.tokenizer_dir))
    model = build_model(arm.cfg, tokens).eval()
    card = {
        "run_name": arm.cfg.name,
        "objectives": {},
        "corpus": "none (random initialisation)",
        "tokens_seen": 0,
        "steps": 0,
        "final_loss": None,
        "config": {"model": vars(model.config), "train": {}, "data": vars(arm.cfg.data)},
    }
    return export_pretrained(model, tokens, arm.cfg.tokenizer_dir, arm.cfg.hf_dir, card)


def downstream(ab: Ablation, model_dir: Path, done: dict | None = None, save=None) -> dict[str, dict[str, dict]]:
    """{mode: {task: finetune result}} for every eval mode and task. `done` holds results already computed (kept:
    an interrupted evaluation resumes per mode and task); `save(results)` is called after each new one."""
    from pretrain.evaluation.finetune import run_finetune

    ev = ab.eval
    results = {mode: dict((done or {}).get(mode, {})) for mode in ev.modes}
    for mode in ev.modes:
        for task in ev.tasks:
            if Path(task).name in results[mode]:
                continue
            result = run_finetune(model_dir, Path(task), list(ev.seeds), ev.finetune(mode))
            s = result["summary"][result["main_metric"]]
            say(
                f"  {mode} {result['task']}: {result['main_metric']} median {s['median']:.4f}, "
                f"{s['mean']:.4f} +- {s['std']:.4f} (lr {result['lr']:g})"
            )
            results[mode][result["task"]] = result
            if save is not None:
                save(results)
    return results


def evaluated(ab: Ablation, state: dict) -> bool:
    """Whether a run has a downstream result for every eval mode and task of this ablation."""
    done = state.get("downstream") or {}
    return all(Path(task).name in done.get(mode, {}) for mode in ab.eval.modes for task in ab.eval.tasks)


def _final_losses(cfg: RunConfig) -> dict[str, float]:
    """Pretraining loss per objective, and the discriminator's AUC for rtd: mean of the last few logged intervals
    (one is noisy)."""
    from pretrain.train.metrics import read_metrics

    records = read_metrics(cfg.run_dir)[-3:]
    keys = [k for k in (records[-1] if records else {}) if k == "loss" or k.endswith(("/loss", "_auc"))]
    values = {k: [r[k] for r in records if r.get(k) is not None] for k in keys}
    return {k: sum(v) / len(v) for k, v in values.items() if v}


def host_record() -> dict:
    """Where and when an arm finished, for the report's "Run on" line."""
    import deepspeed
    import torch

    from pretrain.train.flops import device_description

    return {
        "device": device_description(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def hyperparameters(arm: Arm) -> dict:
    """What the report shows of an arm's pretraining: its objectives, learning rate and what it overrides."""
    t = arm.cfg.train
    return {
        "objectives": sorted(arm.cfg.objectives) if arm.pretrain else [],
        "lr": t.lr if arm.pretrain else None,
        "warmup_steps": t.warmup_steps if arm.pretrain else None,
        "overrides": arm.overrides,
    }


def _pretrain_arm(ab: Ablation, arm: Arm, state: dict, cfg_path: Path) -> None:
    """Plan (once), train and export a pretrained arm, each stage recorded in `state` as it finishes."""
    if "plan" not in state:
        state["plan"] = apply_budget(ab, arm, measure_phase_flops(arm.cfg))
        save_config(arm.cfg, cfg_path)
        write_state(arm, state)
    else:  # resumed: the same plan, so a resumed arm never gets a different budget
        arm.cfg = config_from_dict(load_yaml(cfg_path), apply_init_from=False)
    if not state.get("trained"):
        trainer_state = train_arm(ab, arm, cfg_path)
        plan = state["plan"]
        state["pretraining"] = {
            "steps": trainer_state["step"],
            "tokens_seen": trainer_state.get("tokens_seen", 0),
            "token_slots": trainer_state["step"] * plan["tokens_per_step"],
            "flops": trainer_state["step"] * plan["flops_per_step"],
            "wall_s": trainer_state.get("elapsed_s", 0.0),
            "final_loss": _final_losses(arm.cfg),
        }
        state["trained"] = True
        write_state(arm, state)
    if not state.get("exported"):
        from pretrain.pipeline import stage_export

        stage_export(arm.cfg.run_dir, arm.cfg.hf_dir)
        state["exported"] = True
        write_state(arm, state)


def _baseline_arm(ab: Ablation, arm: Arm, state: dict, cfg_path: Path) -> None:
    """The random encoder: no training, exported (once) as the trained arms are."""
    state.setdefault("plan", {"kind": ab.budget_kind, "amount": 0, "max_steps": 0})
    state["pretraining"] = {"steps": 0, "tokens_seen": 0, "token_slots": 0, "flops": 0, "wall_s": 0.0, "final_loss": {}}
    save_config(arm.cfg, cfg_path)
    if not state.get("exported"):
        export_baseline(arm)
        # no trainer runs for this arm, so its record (which the trainer writes for the others) is written here
        write_provenance(arm.cfg.run_dir / "provenance.json", run_provenance(arm.cfg))
        state["exported"] = True
        write_state(arm, state)


def run_arm(ab: Ablation, arm: Arm) -> dict:
    state = read_state(arm)
    state["hyperparameters"] = hyperparameters(arm)  # (re)written: a resumed arm's record matches its config
    if finished(ab, state):
        say(f"arm {arm.name}: finished earlier, skipped ({arm.cfg.run_dir / 'state.json'})")
        return state
    cfg_path = ab.arm_config_path(arm)
    started = time.time()
    (_pretrain_arm if arm.pretrain else _baseline_arm)(ab, arm, state, cfg_path)
    say(
        f"arm {arm.name}: downstream ({', '.join(ab.eval.modes)}, seeds {ab.eval.seeds}) on "
        f"{len(ab.eval.tasks)} task(s)"
    )

    def save(results):
        state["downstream"] = results
        write_state(arm, state)

    state["downstream"] = downstream(ab, arm.cfg.hf_dir, state.get("downstream"), save)
    state["eval_s"] = time.time() - started
    state["host"] = host_record()
    state["evaluated"] = True
    write_state(arm, state)
    return state


def run_ablation(ab: Ablation, command: str | None = None, within_minutes: float = 0.0) -> Path | None:
    """Run every arm that has not finished, then write the report. With `within_minutes`, a run that would not finish
    within that many minutes of this invocation (judged by `expected_seconds`) is left for the next invocation of
    the same command, and the report waits for it: None is returned then."""
    import torch

    from pretrain.evaluation.report import write_report

    started = time.monotonic()
    if ab.launch.threads > 0:
        torch.set_num_threads(ab.launch.threads)
    claim_output(ab.out, "ablation", "output_dir")
    mark_output(ab.out, "ablation")
    (ab.out / "ablation.yaml").write_text(yaml.safe_dump(ab.raw, sort_keys=False))  # what was run, overrides in
    prepare_data(ab)
    timed = recorded_seconds(ab)
    results, failed, left = {}, {}, []
    for i, arm in enumerate(ab.arms, 1):
        expected = expected_seconds(ab, arm, timed)
        remaining = within_minutes * 60 - (time.monotonic() - started)
        if within_minutes and expected is not None and expected > remaining and not finished(ab, read_state(arm)):
            say(
                f"arm {i}/{len(ab.arms)}: {arm.name} left for the next run (it should take ~{expected / 60:.1f} min; "
                f"{max(remaining, 0) / 60:.1f} of --within-minutes {within_minutes:g} are left)"
            )
            left.append(arm.name)
            continue
        say(
            f"arm {i}/{len(ab.arms)}: {arm.name} "
            f"({', '.join(arm.cfg.objectives) if arm.pretrain else 'no pretraining'})"
        )
        try:
            results[arm.name] = run_arm(ab, arm)
            if "eval_s" in results[arm.name]:
                timed[arm.name] = results[arm.name]["eval_s"]
        except KeyboardInterrupt:
            raise
        except Exception as err:  # one broken arm must not cost the others: report it, carry on
            message = f"{type(err).__name__}: {err}".splitlines()[0]
            say(f"arm {arm.name} FAILED ({message}); the other arms go on, re-run to retry it")
            failed[arm.name] = message
            results[arm.name] = {**read_state(arm), "failed": message}
    failures = ", ".join(f"{k} ({v})" for k, v in failed.items())
    if left:
        say(
            f"--within-minutes {within_minutes:g}: {len(ab.arms) - len(left) - len(failed)} of {len(ab.arms)} runs "
            f"have finished; left for the next run of the same command: {', '.join(left)} (the report is written "
            f"once every run has finished)"
        )
        if failed:
            raise UserError(f"{len(failed)} arm(s) failed: {failures}; re-run the same command to retry")
        return None
    report = write_report(ab, results, command)
    say(f"report: {report}")
    if failed:
        raise UserError(
            f"{len(failed)} arm(s) failed: {failures}; the report at {report} shows the others; re-run the same "
            f"command to retry"
        )
    return report


# ----------------------------------------------------------------------------------------------
# Chunks: a time limit per invocation, and a record without weights that another machine goes on from


def finished(ab: Ablation, state: dict) -> bool:
    """Whether a run's state says it was evaluated on every mode and task of this ablation."""
    return bool(state.get("evaluated")) and evaluated(ab, state)


def recorded_seconds(ab: Ablation) -> dict[str, float]:
    """Run name -> seconds from start to evaluated, as recorded by the invocation that finished it (`eval_s`; a run
    resumed from an earlier invocation's checkpoint records only its last part), for the finished runs."""
    states = {arm.name: read_state(arm) for arm in ab.arms}
    return {name: s["eval_s"] for name, s in states.items() if finished(ab, s) and "eval_s" in s}


def expected_seconds(ab: Ablation, arm: Arm, timed: dict[str, float]) -> float | None:
    """How long `arm` should take: the longest timed run of the same arm (another seed), else the longest timed run
    of any arm; None while nothing is timed (the first run always starts). `timed`: run name -> seconds."""
    same = [timed[a.name] for a in ab.arms if a.group == arm.group and a.name in timed]
    pool = same or list(timed.values())
    return max(pool) if pool else None


def copy_record(ab: Ablation, dest: Path) -> list[str]:
    """Copy into `dest` (new or empty) what the report and a resumed ablation need, without weights, checkpoints or
    shards: the files at the ablation's top (ablation.yaml, the report), the tokenizer and, for each finished run, its
    config, state, metrics and provenance. `pretrain ablate` with output_dir=dest then skips those runs (it rebuilds
    the shards from the corpus with this tokenizer) and writes the report from them. Returns the finished runs."""
    if not (ab.out / "ablation.yaml").is_file():
        raise UserError(f"{ab.out} holds no ablation yet (no ablation.yaml): there is no record to copy")
    dest = Path(dest)
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise UserError(f"--copy-record {dest}: not a new or empty directory; it was left untouched")
    done = [arm for arm in ab.arms if finished(ab, read_state(arm))]
    files = [p for p in sorted(ab.out.iterdir()) if p.is_file() and p.name != LOCK]  # ablation.yaml, the report
    files += [p for p in sorted((ab.out / "tokenizer").rglob("*")) if p.is_file()]
    for arm in done:
        files += [p for p in [ab.arm_config_path(arm)] if p.is_file()]
        files += [p for p in sorted(arm.cfg.run_dir.iterdir()) if p.is_file() and p.name != LOCK]
    # copied beside dest, then renamed: an interrupted copy never looks like a record
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        for src in files:
            target = tmp / src.relative_to(ab.out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [arm.name for arm in done]


# ----------------------------------------------------------------------------------------------
# Cluster commands


def print_commands(ab: Ablation) -> list[str]:
    """Write each arm's config (budget applied) and return one launch command per arm."""
    claim_output(ab.out, "ablation", "output_dir")
    procs = ab.launch.procs
    d = ab.base.data
    corpus = " ".join(shlex.quote(c) for c in d.corpus)
    lines = [
        "# 1. data, once (a cache hit when it exists); put the ablation directory on a shared filesystem",
        f"pretrain tokenizer {corpus} --out {ab.base.tokenizer_dir} --type {d.tokenizer_type} "
        f"--vocab-size {d.vocab_size}",
        f"pretrain shards {corpus} --tokenizer {ab.base.tokenizer_dir} --out {ab.base.shards_dir}",
        f"# 2. one job per arm ({ab.budget_kind} budget {ab.budget_amount:g}, {procs} processes each)",
    ]
    have_data = (ab.base.tokenizer_dir / "tokenizer.json").is_file() and (
        ab.base.shards_dir / "manifest.json"
    ).is_file()
    for arm in ab.arms:
        if not arm.pretrain:
            continue
        cfg_path = ab.arm_config_path(arm)
        if read_state(arm).get("trained"):
            lines.append(f"# {arm.name}: already trained here ({arm.cfg.run_dir}), nothing to launch")
            continue
        phases = len(Schedule.of(arm.cfg).phases)
        flops = measure_phase_flops(arm.cfg) if (ab.budget_kind == "flops" and have_data) else [0] * phases
        if ab.budget_kind == "flops" and not have_data:
            lines.append(f"# {arm.name}: a flops budget needs the data to measure a step; run step 1, then again")
            continue
        plan = apply_budget(ab, arm, flops, world=procs)
        save_config(arm.cfg, cfg_path)
        # the local `pretrain ablate` of step 3 must find this plan, or it would re-plan for one process
        write_state(arm, {**read_state(arm), "plan": plan})
        if ab.launch.scheduler == "slurm":
            lines.append(f"sbatch --job-name=ablate-{arm.name} launch/slurm.sbatch {cfg_path}")
        else:
            lines.append(f"launch/single_node.sh {procs} {cfg_path}")
    mark_output(ab.out, "ablation")
    (ab.out / "ablation.yaml").write_text(yaml.safe_dump(ab.raw, sort_keys=False))
    lines += [
        "# 3. when the jobs are done: export, downstream evaluation and the report (trained arms are not retrained)",
        f"pretrain ablate {ab.out / 'ablation.yaml'}",
    ]
    return lines
