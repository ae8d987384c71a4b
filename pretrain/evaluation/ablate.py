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
    launch: {procs: 8, scheduler: single_node, threads: 0, jobs: 1}
                                        # procs, scheduler (single_node | slurm): for --print-commands;
                                        # threads: torch threads here and per arm (0 = torch's default, or
                                        # with jobs the cores shared out; 1 on a shared, oversubscribed
                                        # CPU, where more threads spin-wait);
                                        # jobs: runs at a time, each its own process (side_by_side.py):
                                        # a GPU each where there are several, else sharing the one

Layout: <dir>/tokenizer and <dir>/shards (built once, shared), <dir>/configs/<run>.yaml (each run's resolved
config: what the cluster commands point at), <dir>/arms/<run>/ (a run directory, with hf/ and state.json; <run> is
the arm's name, or <arm>-seed<S> with several seeds: a run done before seeds were added or taken away keeps its
name), <dir>/report.md with its plots and results.json (every score and every dev prediction, from which the
report's paired tests are computed: `pretrain.evaluation.stats`), and <dir>/provenance.json (commit, versions,
command, resolved configs, sha256 of every input: `pretrain.core.provenance`).

Each arm trains in its own `python -m pretrain.cli train` process: DeepSpeed engines, signal handlers and
the distributed group are per process, and it is exactly the command a cluster runs. state.json records
each finished stage (trained, exported, evaluated), so a re-run skips finished arms and stages; a
half-trained arm resumes from its checkpoint (the trainer does that itself). One `pretrain ablate` runs in a directory
at a time: a second is refused, naming the first. ^C or SIGTERM while an arm trains reaches its trainer, which saves a
checkpoint; the invocation stops there. Where a machine keeps nothing between
short loans, `--within-minutes` ends an invocation at a finished run rather than mid-way, and `--copy-record` copies
what the next machine needs to go on, without weights: the tokenizer and each finished run's state (`copy_record`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from pretrain.core.config import RunConfig, load_yaml, save_config
from pretrain.core.errors import ConfigError, UserError
from pretrain.core.files import write_atomic
from pretrain.core.provenance import run_provenance, write_provenance
from pretrain.evaluation.ablation_plan import (
    Ablation,
    Arm,
    apply_budget,
    measure_phase_flops,
    planned_flops_per_step,
    say,
)
from pretrain.evaluation.ablation_record import (
    arm_settings,
    check_settings,
    expected_seconds,
    finished,
    holding,
    read_state,
    recorded_seconds,
    timed_seconds,
    write_state,
)
from pretrain.evaluation.side_by_side import one_line, terminated_with_parent
from pretrain.evaluation.task_files import stale, task_sha256
from pretrain.train.distributed import has_cuda, single_process_env
from pretrain.train.setup import config_from_dict

# ----------------------------------------------------------------------------------------------
# Running


def _trainer_state(cfg: RunConfig) -> dict:
    from pretrain.train import checkpoint as ckpt
    from pretrain.train.state import TrainState

    latest = ckpt.latest_checkpoint(cfg.run_dir / "checkpoints")
    return TrainState.load(latest).to_dict() if latest else {}


def prepare_data(ab: Ablation) -> None:
    from pretrain.pipeline import stage_shards, stage_tokenizer

    check_tokenizer(ab)
    stage_tokenizer(ab.base)
    stage_shards(ab.base)


def check_tokenizer(ab: Ablation) -> None:
    """Refuse a tokenizer in the ablation's directory trained with other data settings than its config gives (an
    invocation stopped after the data stage and run again with another vocabulary or casing, or data built by hand):
    the ablation names its tokenizer, which the tokenizer stage uses as it is, so the arms trained on it as it was."""
    from pretrain.pipeline import describe_change, tokenizer_changes

    used = sorted(p.parent.name for p in (ab.out / "arms").glob("*/state.json"))
    # the files it read are held by the shards' content hash once an arm trained (`check_shards`); a record copied
    # to another machine (`copy_record`) meets its corpus with other times
    changes = tokenizer_changes(ab.base, inputs=not used)
    changed = [describe_change(*change, now_word="the config gives") for change in changes]
    if changed:
        raise UserError(
            f"{ab.path}: the tokenizer in {ab.base.tokenizer_dir} was trained with {', '.join(changed)}: the arms "
            + (
                f"{', '.join(used)} trained on it. Put the config back, or give the changed ablation another output_dir"
                if used
                else f"would train on it as it is. Remove {ab.base.tokenizer_dir} to have it trained again for this "
                "config (no run has used it), or put the config back"
            )
        )


def shards_hash(ab: Ablation) -> str | None:
    """What the ablation's shards hold (`ShardSet.content_hash`, as a run's resume fingerprint records it); None
    before they are built."""
    from data_pipeline.shards import ShardSet

    return (
        ShardSet(ab.base.shards_dir, verify=False).content_hash()
        if (ab.base.shards_dir / "manifest.json").is_file()
        else None
    )


def check_shards(ab: Ablation) -> None:
    """Refuse to go on where a run trained on other data than the shards hold now: the corpus changed in place since
    and `prepare_data` built them again, so the arms trained from here on would not be comparable with it."""
    now = shards_hash(ab)
    for arm in ab.arms:
        then = read_state(arm).get("shards")
        if then is not None and then != now:
            d = ab.base.data
            inputs = ", ".join(d.corpus) or "data.sources"
            raise UserError(
                f"{ab.path}: run {arm.name} in {ab.out} trained on other data than {ab.base.shards_dir} holds now "
                f"(built again from {inputs}, whose files changed since): the arms trained from here on would not be "
                f"comparable with it. Put the corpus back as it was, give the changed ablation another output_dir, "
                f"or remove {arm.cfg.run_dir} to run it again"
            )


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
    if not has_cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    if ab.launch.threads > 0:
        env["OMP_NUM_THREADS"] = str(ab.launch.threads)
    say(
        f"arm {arm.name}: training ({t.max_steps} steps"
        + (f", at most {t.max_minutes:.1f} min" if ab.budget_kind == "time" else "")
        + ")"
    )
    returncode, signalled = _run_trainer([sys.executable, "-m", "pretrain.cli", "train", str(cfg_path)], env)
    if signalled:  # this invocation was asked to stop: the arms after this one wait for the next
        import signal

        saved = "its checkpoint saved" if returncode == 75 else f"its trainer's exit status {returncode}"
        say(
            f"arm {arm.name}: stopped by {signal.Signals(signalled).name} ({saved}); run the same `pretrain "
            "ablate` command again to resume"
        )
        raise KeyboardInterrupt
    if returncode == 75:
        raise UserError(
            f"arm {arm.name}: training was interrupted (checkpoint saved); run the same "
            f"`pretrain ablate` command again to resume"
        )
    if returncode != 0:
        raise UserError(
            f"arm {arm.name}: `pretrain train {cfg_path}` failed with exit status {returncode} (see its output above)"
        )
    state = _trainer_state(arm.cfg)
    if not _budget_spent(ab, t.max_steps, state):
        limits = [f"train.{k} {getattr(t, k):g}" for k in ("max_minutes", "exit_after_steps") if getattr(t, k)]
        raise UserError(
            f"arm {arm.name}: training stopped at step {state.get('step', 0)} of {t.max_steps} "
            "before the budget was spent; run again to resume"
            + (
                f" (the run's {' and '.join(limits)} end each invocation's training: set them to 0 in run: to train "
                "every arm to its budget at once)"
                if limits and ab.budget_kind != "time"
                else ""
            )
        )
    return state


def check_tasks(ab: Ablation) -> None:
    """Read every task as its evaluation will, before any arm trains: an empty dev.tsv or a bad label was found only
    after each arm had pretrained and exported, and failed every arm."""
    from pretrain.evaluation.finetune import load_task

    options = ab.eval.finetune(ab.eval.modes[0])
    for task in ab.eval.tasks:
        load_task(Path(task), options.task_type, options.max_train)


def _budget_spent(ab: Ablation, max_steps: int, trainer_state: dict) -> bool:
    """Whether a trainer state has its arm's budget: its steps, or under a time budget its minutes."""
    return trainer_state.get("step", 0) >= max_steps or (
        ab.budget_kind == "time" and trainer_state.get("elapsed_s", 0.0) >= ab.budget_amount * 60 - 1
    )


def _run_trainer(command: list[str], env: dict) -> tuple[int, int]:
    """Run an arm's trainer to its end: (its exit status, the signal this process got meanwhile or 0). SIGINT and
    SIGTERM are passed on and the trainer waited for, so that it finishes its step, saves a checkpoint and exits 75
    (from a terminal, ^C reaches it too; a second signal changes nothing). subprocess.run killed it 0.25 s after a
    ^C, before any checkpoint of a model larger than a toy, and this process alone terminated left it training on."""
    import signal
    import threading

    got: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum, frame):
        got.append(signum)
        if proc is not None:
            proc.send_signal(signum)

    here = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if here else {}
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=terminated_with_parent(os.getpid()))
        if got:  # signalled while it started
            proc.send_signal(got[0])
        return proc.wait(), (got[0] if got else 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    an interrupted evaluation resumes per mode and task, unless a task's files changed since: `stale`); each new
    result records its task's `task_sha256`; `save(results)` is called after each new one."""
    from pretrain.evaluation.finetune import run_finetune

    ev = ab.eval
    results = {mode: dict((done or {}).get(mode, {})) for mode in ev.modes}
    for mode in ev.modes:
        for task in ev.tasks:
            old = results[mode].get(Path(task).name)
            if old is not None and not stale(task, old):
                continue
            if old is not None:  # its result is replaced; the task's files are the user's and stay as they are
                say(
                    f"  {mode} {Path(task).name}: {task} holds other files than this run was scored on (sha256 "
                    f"{old['task_sha256'][:12]}, now {task_sha256(task)[:12]}): scoring it again"
                )
            sha = task_sha256(task)
            result = run_finetune(model_dir, Path(task), list(ev.seeds), ev.finetune(mode))
            result["task_sha256"] = sha
            s = result["summary"][result["main_metric"]]
            say(
                f"  {mode} {result['task']}: {result['main_metric']} median {s['median']:.4f}, "
                f"{s['mean']:.4f} +- {s['std']:.4f} (lr {result['lr']:g})"
            )
            results[mode][result["task"]] = result
            if save is not None:
                save(results)
    return results


def _final_losses(cfg: RunConfig) -> dict[str, float]:
    """Pretraining loss per objective, and the discriminator's AUC for rtd: mean of the last few logged intervals
    (one is noisy), whether or not the arm's training was interrupted."""
    from pretrain.train.metrics import last_intervals, read_metrics

    records = last_intervals(read_metrics(cfg.run_dir), cfg.train.log_every)
    keys = [k for k in (records[-1] if records else {}) if k == "loss" or k.endswith(("/loss", "_auc"))]
    values = {k: [r[k] for r in records if r.get(k) is not None] for k in keys}
    return {k: sum(v) / len(v) for k, v in values.items() if v}


def host_record(sharing: int = 1) -> dict:
    """Where and when an arm finished, for the report's "Run on" line; `sharing`: the runs that shared its device
    (launch.jobs), whose wall times include that."""
    import deepspeed
    import torch

    from pretrain.evaluation.fit import precision
    from pretrain.train.flops import device_description

    return {
        "device": device_description(),
        "downstream_precision": precision(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "runs_per_device": sharing,
    }


def hyperparameters(arm: Arm, plan: dict | None = None) -> dict:
    """What the report shows of an arm's pretraining: its objectives, learning rate, warm-up (its plan's: the budget
    cuts it to a tenth of the steps, and the config's was recorded) and what it overrides."""
    t = arm.cfg.train
    return {
        "objectives": sorted(arm.cfg.objectives) if arm.pretrain else [],
        "lr": t.lr if arm.pretrain else None,
        "warmup_steps": (plan or {}).get("warmup_steps", t.warmup_steps) if arm.pretrain else None,
        "overrides": arm.overrides,
    }


def _drop_plan_for_other_ranks(ab: Ablation, arm: Arm, state: dict) -> None:
    """A plan --print-commands made for its jobs' ranks (a global batch other than one process's): kept where that
    job trained the arm to its budget; refused where it started and did not finish; dropped, to be made again, where
    nothing trained (trained here in one process, its steps were a fraction of the budget the report then claimed)."""
    planned, here = (state.get("plan") or {}).get("global_batch"), arm.cfg.train.global_batch(1)
    if planned is None or planned == here or state.get("trained"):  # trained: its checkpoints may be gone since
        return
    done = _trainer_state(arm.cfg)
    if done and _budget_spent(ab, state["plan"]["max_steps"], done):
        return
    if done:
        raise UserError(
            f"arm {arm.name} was planned for the jobs of --print-commands (global batch {planned}) and has started "
            f"training in one: finish it with its job (launch.procs {ab.launch.procs}) before this command, which "
            f"trains in one process (global batch {here})"
        )
    say(
        f"note: arm {arm.name}: planned by --print-commands for global batch {planned}; trained here in one process "
        f"(global batch {here}), so planned again for it"
    )
    del state["plan"]


def _pretrain_arm(ab: Ablation, arm: Arm, state: dict, cfg_path: Path) -> None:
    """Plan (once), train and export a pretrained arm, each stage recorded in `state` as it finishes."""
    _drop_plan_for_other_ranks(ab, arm, state)
    if "plan" not in state:
        state["plan"] = apply_budget(ab, arm, measure_phase_flops(arm.cfg))
        save_config(arm.cfg, cfg_path)
        write_state(arm, state)
    else:  # resumed: the same plan, so a resumed arm never gets a different budget
        saved = config_from_dict(load_yaml(cfg_path), apply_init_from=False)
        # where its files are is this ablation's: a record copied elsewhere (--copy-record) carries the paths of the
        # directory it came from, and must neither read its weights there nor write into it
        data = replace(saved.data, tokenizer=arm.cfg.data.tokenizer, shards=arm.cfg.data.shards)
        here = replace(saved, output_dir=arm.cfg.output_dir, export_dir=arm.cfg.export_dir, data=data)
        arm.cfg = here
        if here != saved:  # the trainer reads this file
            save_config(here, cfg_path)
        plan = state["plan"]
        if not plan.get("flops_per_step"):  # planned by --print-commands before the data existed
            plan["flops_per_step"] = planned_flops_per_step(arm.cfg, plan)
            if "pretraining" in state:  # trained, its record written with none
                state["pretraining"]["flops"] = state["pretraining"]["steps"] * plan["flops_per_step"]
            write_state(arm, state)
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
        if (shards := shards_hash(ab)) is not None:  # what it trained on (a resumed trainer refuses other data)
            state.setdefault("shards", shards)
        state["trained"] = True
        write_state(arm, state)
    if not _exported(arm, state):
        _export_trained(arm)
        state["exported"] = True
        write_state(arm, state)


def _exported(arm: Arm, state: dict) -> bool:
    """Whether the arm's export is there: `exported` alone is not enough, a record copied with --copy-record keeps
    the state of a finished run without its hf/ (or any weights), and a task added since re-opens it."""
    return bool(state.get("exported")) and (arm.cfg.hf_dir / "config.json").is_file()


def _export_trained(arm: Arm) -> None:
    """Export a trained arm from its last checkpoint; where there is none (a copied record), say what to do."""
    from pretrain.pipeline import stage_export
    from pretrain.train.checkpoint import latest_checkpoint

    if latest_checkpoint(arm.cfg.run_dir / "checkpoints") is None:
        raise UserError(
            f"arm {arm.name}: trained, but its weights are not in {arm.cfg.run_dir} (neither hf/ nor a checkpoint: "
            "a record copied with --copy-record keeps none), so it cannot be evaluated on the task(s) added since. "
            f"Copy its hf/ or checkpoints/ from where it trained into {arm.cfg.run_dir}, or evaluate it there; or "
            f"remove {arm.cfg.run_dir} to train it again here"
        )
    stage_export(arm.cfg.run_dir, arm.cfg.hf_dir)


def _baseline_arm(ab: Ablation, arm: Arm, state: dict, cfg_path: Path) -> None:
    """The random encoder: no training, exported (once) as the trained arms are."""
    state.setdefault("plan", {"kind": ab.budget_kind, "amount": 0, "max_steps": 0})
    state["pretraining"] = {"steps": 0, "tokens_seen": 0, "token_slots": 0, "flops": 0, "wall_s": 0.0, "final_loss": {}}
    save_config(arm.cfg, cfg_path)
    if not _exported(arm, state):  # rebuilt where a copied record lacks it: the seeded init gives the same encoder
        export_baseline(arm)
        # no trainer runs for this arm, so its record (which the trainer writes for the others) is written here
        if not (arm.cfg.run_dir / "provenance.json").is_file():
            write_provenance(arm.cfg.run_dir / "provenance.json", run_provenance(arm.cfg))
        state["exported"] = True
        write_state(arm, state)


def run_arm(ab: Ablation, arm: Arm, sharing: int = 1) -> dict:
    state = read_state(arm)
    state.setdefault("settings", arm_settings(ab, arm))  # what `check_settings` holds the next invocation to
    state["hyperparameters"] = hyperparameters(arm, state.get("plan"))  # (re)written: a resumed arm's is its config's
    if finished(ab, state):
        say(f"arm {arm.name}: finished earlier, skipped ({arm.cfg.run_dir / 'state.json'})")
        return state
    cfg_path = ab.arm_config_path(arm)
    started = time.time()
    (_pretrain_arm if arm.pretrain else _baseline_arm)(ab, arm, state, cfg_path)
    state["hyperparameters"] = hyperparameters(arm, state.get("plan"))  # planned now, where it was not before
    say(
        f"arm {arm.name}: downstream ({', '.join(ab.eval.modes)}, seeds {ab.eval.seeds}) on "
        f"{len(ab.eval.tasks)} task(s)"
    )

    def save(results):
        state["downstream"] = results
        write_state(arm, state)

    state["downstream"] = downstream(ab, arm.cfg.hf_dir, state.get("downstream"), save)
    # added to what the run took before: an invocation that re-opens a finished run (a task added) takes seconds,
    # and recorded alone they were what `--within-minutes` expected another seed of the arm to take
    state["eval_s"] = state.get("eval_s", 0.0) + time.time() - started
    state["host"] = host_record(sharing)
    state["evaluated"] = True
    write_state(arm, state)
    return state


def _check_sharing(ab: Ablation) -> int:
    """How many runs will share a device (`side_by_side.runs_per_device`; 1 one at a time). A time budget is refused
    where they would: each run's share of the device would depend on what the others were doing meanwhile."""
    from pretrain.evaluation.side_by_side import runs_per_device

    sharing = runs_per_device(ab.launch.jobs) if ab.launch.jobs > 1 else 1
    if sharing > 1 and ab.budget_kind == "time":
        raise ConfigError(
            f"{ab.path}: launch.jobs={ab.launch.jobs} would run {sharing} runs at a time on one device, and with "
            "budget.kind=time each would train for its minutes on a share of it that depends on what the others do "
            "meanwhile: give a tokens or flops budget, or launch.jobs no more than the GPUs here (nothing was run)"
        )
    return sharing


def _side_by_side(ab: Ablation, sharing: int, starts, ended) -> None:
    """The runs `launch.jobs` at a time, each in a process of its own (`side_by_side.run_jobs`), `sharing` of them
    to a device; `starts(i, arm)` and `ended(arm, state, failure)` as the one-at-a-time loop calls them. Finished
    runs are skipped here, in order."""
    from pretrain.evaluation.side_by_side import Job, run_jobs, threads_per_job

    threads = threads_per_job(ab.launch.threads, ab.launch.jobs)  # each run's
    queue = list(enumerate(ab.arms, 1))
    by_name = {arm.name: arm for arm in ab.arms}

    def next_job() -> Job | None:
        while queue:
            i, arm = queue.pop(0)
            if not starts(i, arm):
                continue
            try:  # as one at a time does, a run that fails here (its state unreadable) is reported, not fatal
                if finished(ab, read_state(arm)):
                    ended(arm, run_arm(ab, arm), None)  # says so; nothing to run
                    continue
            except Exception as err:
                ended(arm, None, one_line(err))
                continue
            return Job(arm.name, run_arm_alone, (ab, arm.name, sharing, threads))
        return None

    def done(name: str, failure: str | None) -> None:
        try:
            state = read_state(by_name[name]) if failure is None else None
        except Exception as err:
            state, failure = None, one_line(err)
        ended(by_name[name], state, failure)

    say(f"{ab.launch.jobs} runs at a time (launch.jobs); each one's output also in {ab.out / 'logs'}")
    env = single_process_env()
    if not has_cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    if run_jobs(ab.launch.jobs, next_job, done, threads, ab.out / "logs", env):
        say("stopped: the runs under way were passed the signal; run the same `pretrain ablate` command to go on")
        raise KeyboardInterrupt


def run_arm_alone(ab: Ablation, name: str, sharing: int, threads: int) -> None:
    """One run of a side-by-side ablation, in a process of its own with `threads` torch threads (its share of the
    host's, or launch.threads), its results in its state.json, which the parent reads; `sharing` runs share its
    device."""
    import torch

    ab = replace(ab, config=replace(ab.config, launch=replace(ab.launch, threads=threads)))
    torch.set_num_threads(threads)
    run_arm(ab, next(arm for arm in ab.arms if arm.name == name), sharing)


def run_ablation(ab: Ablation, command: str | None = None, within_minutes: float = 0.0) -> Path | None:
    """Run every arm that has not finished, then write the report. With `within_minutes`, a run that would not finish
    within that many minutes of this invocation (judged by `expected_seconds`) is left for the next invocation of
    the same command, and the report waits for it: None is returned then."""
    with holding(ab):
        return _run_ablation(ab, command, within_minutes)


def _run_ablation(ab: Ablation, command: str | None, within_minutes: float) -> Path | None:
    import torch

    from pretrain.evaluation.report import write_report

    started = time.monotonic()
    if ab.launch.threads > 0:
        torch.set_num_threads(ab.launch.threads)
    sharing = _check_sharing(ab)
    # before anything but the marker is written: a changed config never mixes into the runs done (changed evaluation
    # settings re-open the evaluation alone)
    check_settings(ab, reopen=True)
    check_tasks(ab)
    # what was run, overrides in; whole or not at all: the printed commands, and the user after them, run from it
    write_atomic(ab.out / "ablation.yaml", yaml.safe_dump(ab.raw, sort_keys=False))
    prepare_data(ab)
    check_shards(ab)  # a corpus changed in place: its shards were built again, and would not be what the runs had
    timed = recorded_seconds(ab, sharing)
    results, failed, left = {}, {}, []

    def starts(i: int, arm: Arm) -> bool:
        """Whether run i (1-based) starts now: not where --within-minutes is too short for it (it is left), as
        judged by the runs timed so far (`timed_seconds`: longer where more runs share a device now than then)."""
        expected = expected_seconds(ab, arm, timed)
        remaining = within_minutes * 60 - (time.monotonic() - started)
        if within_minutes and expected is not None and expected > remaining and not finished(ab, read_state(arm)):
            say(
                f"arm {i}/{len(ab.arms)}: {arm.name} left for the next run (it should take ~{expected / 60:.1f} min; "
                f"{max(remaining, 0) / 60:.1f} of --within-minutes {within_minutes:g} are left)"
            )
            left.append(arm.name)
            return False
        say(
            f"arm {i}/{len(ab.arms)}: {arm.name} "
            f"({', '.join(arm.cfg.objectives) if arm.pretrain else 'no pretraining'})"
        )
        return True

    def ended(arm: Arm, state: dict | None, message: str | None) -> None:
        if message is None:
            results[arm.name] = state
            if "eval_s" in state:
                timed[arm.name] = timed_seconds(state, sharing)
        else:  # one broken arm must not cost the others: report it, carry on
            say(f"arm {arm.name} FAILED ({message}); the other arms go on, re-run to retry it")
            failed[arm.name] = message
            results[arm.name] = {**read_state(arm), "failed": message}

    if ab.launch.jobs > 1:
        _side_by_side(ab, sharing, starts, ended)
    else:
        for i, arm in enumerate(ab.arms, 1):
            if starts(i, arm):
                try:
                    ended(arm, run_arm(ab, arm), None)
                except KeyboardInterrupt:
                    raise
                except Exception as err:
                    ended(arm, None, one_line(err))
    results = {arm.name: results[arm.name] for arm in ab.arms if arm.name in results}  # in the config's order
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


def data_only(ab: Ablation) -> None:
    """`pretrain ablate --data-only`: the tokenizer and shards the runs share, built as the ablation builds them,
    and nothing else (step 1 of --print-commands where the data has weighted sources)."""
    with holding(ab):
        check_settings(ab)  # as every path does first: the runs launched may be training on this data
        write_atomic(ab.out / "ablation.yaml", yaml.safe_dump(ab.raw, sort_keys=False))
        prepare_data(ab)
