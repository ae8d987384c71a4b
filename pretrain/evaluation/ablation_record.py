"""An ablation's progress, run by run: each run's state.json (the stages it finished, and the settings it ran with:
a changed config is refused, never mixed in), whether it has finished, how long the next should take
(`expected_seconds`, for `--within-minutes`), and the record without weights that another machine goes on from
(`copy_record`, for `--copy-record`)."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from pretrain.core.errors import UserError
from pretrain.core.outputs import LOCK, claim_output, exclusive, mark_output
from pretrain.core.parsing import to_dict
from pretrain.evaluation.ablation_plan import Ablation, Arm
from pretrain.evaluation.task_files import stale
from pretrain.train.fingerprint import changed_settings


@contextmanager
def holding(ab: Ablation):
    """The ablation directory, claimed as ours and held: one `pretrain ablate` (or --print-commands, --data-only) at a
    time in it, as two would evaluate the same run at once, interleave its state.json, and mark as failed the arms
    whose trainer the other holds. A second is refused, naming the first."""
    claim_output(ab.out, "ablation", "output_dir")
    mark_output(ab.out, "ablation")  # first: a directory holding the lock alone would not look like ours
    hint = " before running it again, or give this one another output_dir"
    with exclusive(ab.out, "running `pretrain ablate`", hint):
        yield


def read_state(arm: Arm) -> dict:
    path = arm.cfg.run_dir / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(arm: Arm, state: dict) -> None:
    path = arm.cfg.run_dir / "state.json"
    mark_output(path.parent, "run")  # an arm is a run directory of ours, also before its first step
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)  # atomic: an interruption leaves the previous state, never half of one


def arm_settings(ab: Ablation, arm: Arm) -> dict:
    """What a run's results depend on, recorded in its state: its run config as the ablation file gives it (before the
    budget; where the ablation keeps its files aside, so that a record goes on from another directory), the budget,
    and the evaluation (its tasks aside: a run is re-opened for a task it lacks, `finished`)."""
    run = to_dict(arm.cfg)
    run["data"] = {k: v for k, v in run["data"].items() if k not in ("tokenizer", "shards")}
    for where in ("output_dir", "export_dir"):
        run.pop(where, None)
    return {
        "pretrain": arm.pretrain,
        "run": run,
        "budget": {"kind": ab.budget_kind, "amount": ab.budget_amount},
        "eval": {k: v for k, v in to_dict(ab.eval).items() if k != "tasks"},
    }


def check_settings(ab: Ablation, reopen: bool = False) -> None:
    """Refuse (UserError, nothing written) to go on with an ablation whose runs recorded other settings than its
    config gives now: a skipped run's results, or a resumed run's plan, would not be what the report says they are.
    Evaluation settings alone changed leave the pretraining as it was: with `reopen` (an invocation that evaluates),
    such runs' downstream results are dropped, to be made again under the new settings (the message said to remove
    the run, and its pretraining with it)."""
    evaluated_otherwise = []
    for arm in ab.arms:
        saved = read_state(arm).get("settings")
        changed = changed_settings(saved, arm_settings(ab, arm)) if saved is not None else []
        if changed and all(c.startswith("eval.") for c in changed):
            evaluated_otherwise.append((arm, changed))
        elif changed:
            shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
            raise UserError(
                f"{ab.path}: run {arm.name} in {ab.out} ran with other settings ({shown}): its results would not be "
                f"comparable with the rest. Put the config back, give the changed ablation another output_dir, or "
                f"remove {arm.cfg.run_dir} to run it again (nothing was changed)"
            )
    for arm, changed in evaluated_otherwise if reopen else ():
        state = read_state(arm)
        for done in ("downstream", "evaluated"):
            state.pop(done, None)
        write_state(arm, {**state, "settings": arm_settings(ab, arm)})
        print(
            f"[ablate] run {arm.name}: evaluated with other settings ({'; '.join(changed[:4])}): its pretraining "
            "stands, its downstream results are made again",
            flush=True,
        )


def finished(ab: Ablation, state: dict) -> bool:
    """Whether a run's state says it was evaluated, with a downstream result for every eval mode and task of this
    ablation, scored on the task's files as they are now (an added or replaced task re-opens its runs)."""
    done = state.get("downstream") or {}

    def current(mode: str, task: str) -> bool:
        result = done.get(mode, {}).get(Path(task).name)
        return result is not None and not stale(task, result)

    every = all(current(mode, task) for mode in ab.eval.modes for task in ab.eval.tasks)
    return bool(state.get("evaluated")) and every


def timed_seconds(state: dict, sharing: int = 1) -> float:
    """How long a finished run should take again with `sharing` runs to its device (launch.jobs): its seconds from
    start to evaluated (`eval_s`: the invocations that finished it, or re-opened it for a task added since; one
    resumed from an earlier invocation's checkpoint records only its last part), times the sharing's growth since
    (`runs_per_device`, as recorded; never less: s runs sharing a device take at most s times as long as one alone,
    and a run timed while others shared its device is not assumed faster alone)."""
    then = (state.get("host") or {}).get("runs_per_device", 1)
    return state["eval_s"] * max(1.0, sharing / then)


def recorded_seconds(ab: Ablation, sharing: int = 1) -> dict[str, float]:
    """Run name -> `timed_seconds`, for the finished runs that recorded their time."""
    states = {arm.name: read_state(arm) for arm in ab.arms}
    return {name: timed_seconds(s, sharing) for name, s in states.items() if finished(ab, s) and "eval_s" in s}


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
    # Copied into a temporary directory, then renamed: an interrupted copy never looks like a record. A new dest is
    # the renamed directory; an empty one that exists (a symlink to a directory, a mount point: neither can be
    # replaced) gets its entries, each whole, the top-level files (ablation.yaml) last.
    into = dest.exists()
    dest = dest.resolve() if into else dest
    tmp = dest / f".record.tmp-{os.getpid()}" if into else dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        for src in files:
            target = tmp / src.relative_to(ab.out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
        if into:
            for entry in sorted(tmp.iterdir(), key=lambda e: (e.is_file(), e.name)):
                os.replace(entry, dest / entry.name)
            tmp.rmdir()
        else:
            os.replace(tmp, dest)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--copy-record {dest}: {err.strerror or err} ({err.filename or dest})") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [arm.name for arm in done]
