"""A new run that starts from a checkpoint of another and leaves it untouched: `pretrain decay`.

Warmup-stable-decay (`train.lr_schedule=wsd`) holds the peak learning rate, so any checkpoint of the stable phase can
be decayed into a finished model. The branch is an ordinary run directory whose only checkpoint is a copy of the
source (hard links where the file system allows: checkpoint files are only ever read and, on rotation, unlinked,
never written in place), with the source's tokenizer and shards and its metrics up to that step. Training it is then
a resume with a changed schedule, which the resume applies (`optim.apply_hyperparameters`): the same samples in the
same order, the same optimizer state, a decay over the given steps. Everything the run fixes is as in the source.
`branch.json` records what the branch was made from (source, step, decay steps): the same `pretrain decay` command
resumes it (also once the source's rotation removed that checkpoint), and a `--name` that would continue another
branch is refused. The source's `train.exit_after_steps` and `max_minutes` are not the branch's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml

from pretrain.core.config import REPLACED_BY_PRESET, RunConfig, build_config, load_yaml
from pretrain.core.errors import UserError
from pretrain.core.files import write_atomic
from pretrain.core.outputs import claim_output, mark_output, marked_kind
from pretrain.core.parsing import apply_overrides, to_dict
from pretrain.core.schedule import schedule_until
from pretrain.train import checkpoint as ckpt
from pretrain.train.metrics import read_metrics
from pretrain.train.optim import decay_steps, lr_factor
from pretrain.train.state import TrainState

_SOURCE_LIMITS = ("exit_after_steps", "max_minutes")  # the source's, not inherited (unless given again)
# What `pretrain decay` sets itself, after the overrides: one given would be replaced without a word
_DECAY_SETS = {
    "max_steps": "the checkpoint's step + --steps",
    "lr_schedule": "wsd",
    "decay_steps": "--steps",
}
BRANCH_FILE = "branch.json"  # in a branch: the source run (or checkpoint), its step and the decay's steps


def _read_branch(run_dir: Path) -> dict | None:
    try:
        made = json.loads((run_dir / BRANCH_FILE).read_text())
    except (OSError, ValueError):
        return None
    return made if isinstance(made, dict) and {"source", "step", "decay_steps"} <= set(made) else None


def _link_tree(src: Path, dst: Path) -> None:
    """A copy of `src` at `dst` made of hard links (a copy where links cannot be made: another file system)."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


def _with_overrides(saved: dict, overrides: list[str]) -> dict:
    """`saved` (the source's config, or the branch's last) without the limits of when it stopped, by its clock or a
    step count, which are not when this invocation does, then this command's overrides: a limit holds only where the
    command gives it (train.max_minutes=..., or inside train={...}). Dropped before the overrides, since an override
    of the train mapping merges over the saved one: dropped after, train={lr: ...} kept the source's limits."""
    data = dict(saved)
    if isinstance(data.get("train"), dict):
        data["train"] = {k: v for k, v in data["train"].items() if k not in _SOURCE_LIMITS}
    return apply_overrides(data, overrides, REPLACED_BY_PRESET)


# Where the branch goes, which `pretrain decay` decides: an override of one was dropped without a word (an
# export_dir=... a pipeline then read found nothing there, or an older model)
_PLACED = {
    "name": "give --name",
    "output_dir": "a branch goes beside its source run",
    "export_dir": "it exports into its own hf/; `pretrain export BRANCH --out DIR` writes one elsewhere",
}


def _refuse_what_decay_sets(overrides: list[str]) -> None:
    """An override of a train key `pretrain decay` sets itself (`_DECAY_SETS`), alone or inside train={...}, or of
    where the branch goes (`_PLACED`)."""
    for override in overrides:
        top = next((key for key in apply_overrides({}, [override]) if key in _PLACED), None)
        if top is not None:
            raise UserError(f"{override}: `pretrain decay` decides {top} itself; {_PLACED[top]}")
        given = apply_overrides({}, [override]).get("train")
        for name in given if isinstance(given, dict) else ():
            if name in _DECAY_SETS:
                raise UserError(
                    f"{override}: `pretrain decay` sets train.{name} itself ({_DECAY_SETS[name]}); "
                    f"{'give --steps' if name != 'lr_schedule' else 'its schedule is wsd'} instead"
                )


def decay_config(
    source: Path, steps: int, name: str | None, overrides: list[str]
) -> tuple[RunConfig, Path, TrainState]:
    """(the branch's config, the source checkpoint, its trainer state): the source's config with a wsd decay over
    `steps` steps after the checkpoint's step, named `name` (default <source name>-decay<step>) beside the source."""
    from pretrain.train.setup import resolve_config

    if steps < 2:  # --steps 1 exported a model trained at the peak learning rate, said to be decayed
        raise UserError(
            f"--steps: the decay needs at least two steps, got {steps}: its first step trains at the peak learning "
            "rate (the rate falls after each step, as in transformers' schedules), so one step does not decay"
        )
    _refuse_what_decay_sets(overrides)
    checkpoint = ckpt.resolve_checkpoint(source)
    state = TrainState.load(checkpoint)
    saved = load_yaml(checkpoint / "config.yaml")
    step = state.step
    warmup = int((saved.get("train") or {}).get("warmup_steps") or 0)
    if step < warmup:  # it said "train.decay_steps (N) is longer than the steps after the warm-up", set by neither
        raise UserError(
            f"{checkpoint} is at step {step}, inside its run's warm-up ({warmup} steps): a decay starts from the peak "
            f"learning rate; decay from a checkpoint at step {warmup} or later"
        )
    source_run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    data = _with_overrides(saved, overrides)
    data["name"] = name or f"{saved.get('name', 'run')}-decay{step}"
    data["output_dir"] = str(source_run.parent if source_run else Path(saved.get("output_dir", "runs")))
    data["train"] = {**data.get("train", {}), "max_steps": step + steps, "lr_schedule": "wsd", "decay_steps": steps}
    if data.get("schedule"):  # the source's phases and ramps, to the branch's end (a later phase would be refused)
        data["schedule"] = schedule_until(data["schedule"], step + steps)
    data["export_dir"] = ""  # the branch exports into its own directory, never the source's
    cfg = resolve_config(build_config(data), apply_init_from=False)
    return cfg, checkpoint, state


def _branch_without_its_source(source: Path, steps: int, name: str | None, overrides: list[str]):
    """(config, summary) of the branch this command made, when `source` names a checkpoint that is gone: the source
    run trained on and its rotation removed the checkpoint the branch copied. The branch holds all it needs (its
    copy of the checkpoint, its config, tokenizer and shards), so the same command still resumes it. None otherwise."""
    from pretrain.train.setup import resolve_config

    step = ckpt.step_of_tag(source.name)
    if source.exists() or step is None or source.parent.name != "checkpoints":
        return None
    source_run = source.parent.parent
    try:  # the name decay_config gave it: the source's config's (a run directory renamed since keeps it)
        run_name = load_yaml(source_run / "config.yaml").get("name") or source_run.name
    except UserError:  # no readable config (ConfigError): the directory's name
        run_name = source_run.name
    run_dir = source_run.parent / (name or f"{run_name}-decay{step}")
    if _read_branch(run_dir) != {"source": str(source_run.resolve()), "step": step, "decay_steps": steps}:
        return None
    data = _with_overrides(load_yaml(run_dir / "config.yaml"), overrides)
    cfg = resolve_config(build_config(data), apply_init_from=False)
    return cfg, f"{run_dir} exists and is this decay (its source checkpoint {source} is gone since): resuming it"


def branch_for_decay(source: Path, steps: int, name: str | None = None, overrides: list[str] | None = None):
    """Make the branch run directory (see the module doc); returns (its config, a line saying what it holds). The
    directory must be absent or empty: an existing one is refused, never replaced."""
    if name is not None and (Path(name).name != name or name in ("", ".", "..")):
        raise UserError(
            f"--name {name!r}: the branch's directory name, beside its source run (a name, not a path: one inside "
            "another run's checkpoints/ went with that run's rotation)"
        )
    gone = _branch_without_its_source(Path(source), steps, name, overrides or [])
    if gone is not None:
        return gone
    unfinished = None if name else _unfinished_branch_of(Path(source), steps)
    if unfinished is not None:  # resumed from its own checkpoint, or from its copy where rotation took that one
        origin, run_dir = unfinished
        said = f"; to decay from {source}'s latest checkpoint instead, give --name"
        if not origin.is_dir():
            cfg, line = _branch_without_its_source(origin, steps, run_dir.name, overrides or [])
            return cfg, line + said
        with ckpt.reading_checkpoints(origin):
            cfg, line = _branch_from(origin, steps, run_dir.name, overrides or [])
        return cfg, line + said
    with ckpt.reading_checkpoints(source):  # a source training on keeps the checkpoint while it is copied
        return _branch_from(Path(source), steps, name, overrides or [])


def ema_note(cfg: RunConfig, steps: int) -> str | None:
    """A weight EMA whose horizon outlasts the decay: what it exports is then mostly the stable phase's average, which
    largely undoes the decay (0.9999 over 4000 steps keeps 67% of its weight from before them). None otherwise."""
    d = cfg.train.ema_decay
    if not d or 1 / (1 - d) <= steps:
        return None
    before = d**steps
    return (
        f"the run's weight EMA (train.ema_decay={d:g}, ~{1 / (1 - d):,.0f} steps long) keeps {before:.0%} of its "
        f"weight from before these {steps} steps: its export is mostly the stable phase's average; give the branch "
        "train.ema_decay with a horizon within the decay, or export it with --raw-weights"
    )


def _unfinished_branch_of(source: Path, steps: int) -> tuple[Path, Path] | None:
    """(its source checkpoint, which may be gone; its directory) of an unfinished decay of the run directory `source`
    over `steps` that the same command made (named by default, beside the run): run again after the source saved a
    newer checkpoint, the command made a new branch from that one, and left the first unfinished and never exported."""
    if not (source / "checkpoints").is_dir():
        return None  # a checkpoint named: its branch is named by its step
    real = str(source.resolve())
    branches = [(d, _read_branch(d)) for d in source.parent.iterdir() if d.is_dir() and d != source]
    for run_dir, made in sorted(branches, key=lambda b: -(b[1] or {}).get("step", -1)):  # the newest first
        if not made or made["source"] != real or made["decay_steps"] != steps:
            continue
        latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
        if latest is not None and TrainState.load(latest).step < made["step"] + steps:
            return source / "checkpoints" / ckpt.tag_for(made["step"]), run_dir
    return None


def _branch_from(source: Path, steps: int, name: str | None, overrides: list[str]):
    cfg, checkpoint, state = decay_config(source, steps, name, overrides)
    source_cfg = build_config(load_yaml(checkpoint / "config.yaml"))
    run_dir = cfg.run_dir
    source_run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    if source_run is not None and run_dir.resolve() == source_run.resolve():
        raise UserError(f"the decay run {run_dir} would be the source run itself: give another --name")
    made_from = {"source": str((source_run or checkpoint).resolve()), "step": state.step, "decay_steps": steps}
    if run_dir.exists() and any(run_dir.iterdir()):
        if marked_kind(run_dir) != "run" or not (run_dir / "checkpoints" / ckpt.LATEST).is_file():
            raise UserError(
                f"{run_dir} already exists and is not a run of ours: give another --name (nothing was changed)"
            )
        made = _read_branch(run_dir)
        if made != made_from:
            was = (
                f"the decay of {made['source']} at step {made['step']} over {made['decay_steps']} steps"
                if made
                else f"not a decay branch (no {BRANCH_FILE}): `pretrain train {run_dir / 'config.yaml'}` resumes it"
            )
            go_on = f"; `pretrain train {run_dir / 'config.yaml'}` continues it" if made else ""
            raise UserError(
                f"{run_dir} exists and is {was}, not the decay of {made_from['source']} at step {state.step} over "
                f"{steps} steps: give another --name (nothing was changed){go_on}"
            )
        return cfg, f"{run_dir} exists and is this decay: resuming it"
    claim_output(run_dir, "run", "the decay run directory")
    tmp = run_dir.parent / f".{run_dir.name}.branch-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        mark_output(tmp, "run")
        _link_tree(checkpoint, tmp / "checkpoints" / checkpoint.name)
        write_atomic(tmp / "checkpoints" / ckpt.LATEST, checkpoint.name)
        # the source's tokenizer and shards: where its config put them, resolved against the source run directory
        for what, given, default in (
            ("tokenizer", source_cfg.data.tokenizer, "tokenizer"),
            ("shards", source_cfg.data.shards, "shards"),
        ):
            if not given:
                origin = (source_run / default) if source_run else None
                if origin is None or not origin.is_dir():
                    raise UserError(
                        f"the source's {what} directory ({origin or 'unknown: not inside a run directory'}) is "
                        "missing: decay from a checkpoint inside its run directory"
                    )
                _link_tree(origin, tmp / default)
        if source_run is not None:
            history = [r for r in read_metrics(source_run) if r["step"] <= state.step]
            write_atomic(tmp / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history))
        write_atomic(tmp / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        write_atomic(tmp / BRANCH_FILE, json.dumps(made_from, indent=1))  # what a later `decay --name` must match
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        if run_dir.exists():
            run_dir.rmdir()  # empty: checked above
        tmp.rename(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    t, source_t = cfg.train, source_cfg.train
    at = source_t.lr * lr_factor(state.step - 1, source_t) if state.step else 0.0
    summary = (
        f"{run_dir}: step {state.step} of {checkpoint.parent.parent.name if source_run else checkpoint}, decayed "
        f"over {t.decay_steps} steps ({t.decay_shape}) from lr {t.lr:g} to {t.lr * t.min_lr_ratio:g}; the source "
        f"trained its last step at lr {at:g}"
    )
    if source_t.lr_schedule != "wsd" or state.step > source_t.max_steps - decay_steps(source_t):
        summary += " (not in a stable phase of a wsd schedule: the decay starts from the peak lr all the same)"
    return cfg, summary
