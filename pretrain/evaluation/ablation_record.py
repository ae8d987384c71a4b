"""An ablation's progress, run by run: each run's state.json (the stages it finished), whether it has finished, how
long the next should take (`expected_seconds`, for `--within-minutes`), and the record without weights that another
machine goes on from (`copy_record`, for `--copy-record`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pretrain.core.errors import UserError
from pretrain.core.outputs import LOCK, mark_output
from pretrain.evaluation.ablation_plan import Ablation, Arm


def read_state(arm: Arm) -> dict:
    path = arm.cfg.run_dir / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(arm: Arm, state: dict) -> None:
    path = arm.cfg.run_dir / "state.json"
    mark_output(path.parent, "run")  # an arm is a run directory of ours, also before its first step
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)  # atomic: an interruption leaves the previous state, never half of one


def finished(ab: Ablation, state: dict) -> bool:
    """Whether a run's state says it was evaluated, with a downstream result for every eval mode and task of this
    ablation (an ablation that adds a task re-opens its runs)."""
    done = state.get("downstream") or {}
    every = all(Path(task).name in done.get(mode, {}) for mode in ab.eval.modes for task in ab.eval.tasks)
    return bool(state.get("evaluated")) and every


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
