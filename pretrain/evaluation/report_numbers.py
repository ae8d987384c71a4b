"""The numbers an ablation report is made from: the downstream cells (arm x task x mode, with every dev prediction),
the planned comparisons in their two families (paired bootstrap over dev examples and seeds, an exact sign-flip test
across 3 or more pretraining seeds, Holm within each family), the smallest effect each task can detect, and each arm's
pretraining totals. See `pretrain.evaluation.report` for the families and why."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.core.errors import UserError
from pretrain.evaluation.ablation_plan import BASELINE
from pretrain.evaluation.stats import (
    ALPHA,
    compare,
    holm,
    metric_batch,
    minimum_detectable_effect,
    p_floor,
    replicates_for,
    sign_flip_floor,
    sign_flip_test,
)
from pretrain.evaluation.task_files import stale

PRIMARY, SECONDARY = "primary", "secondary"
SEED_TEST_MIN = 3  # a sign-flip test over fewer per-seed differences cannot go below p = 0.5


def main_mode(modes) -> str:
    """The mode of the primary family: full fine-tuning where it was run (BERT's own evaluation), else the first."""
    modes = list(modes)
    return "full" if "full" in modes else modes[0] if modes else "probe"


@dataclass
class Cell:
    """One arm on one task in one downstream mode."""

    metric: str
    labels: np.ndarray  # [N] dev labels
    preds: np.ndarray  # [S, P, N]: pretraining seeds x downstream seeds x dev examples
    seeds: list[int] | None = None  # the pretraining seed of each of the S rows (default 0, 1, ...)

    def __post_init__(self):
        if self.seeds is None:
            self.seeds = list(range(self.preds.shape[0]))

    def seed_scores(self) -> np.ndarray:
        """[S] the metric per pretraining seed, averaged over downstream seeds."""
        return metric_batch(self.metric, self.labels, self.preds).mean(1)

    @property
    def mean(self) -> float:
        return float(self.seed_scores().mean())

    @property
    def spread(self) -> float:
        """Standard deviation over pretraining seeds; with one seed, over its downstream seeds."""
        scores = (
            self.seed_scores() if self.preds.shape[0] > 1 else metric_batch(self.metric, self.labels, self.preds[0])
        )
        return float(scores.std(ddof=1)) if len(scores) > 1 else 0.0


@dataclass
class Comparison:
    mode: str
    task: str
    a: str
    b: str
    diff: float
    low: float
    high: float
    p: float
    p_holm: float = 1.0
    family: str = PRIMARY
    se: float = 0.0  # standard deviation of the bootstrap differences
    replicates: int = 0
    seed_diffs: list[float] = field(default_factory=list)  # a minus b per pretraining seed both have
    seed_p: float | None = None  # exact sign-flip test over seed_diffs (3 or more of them)
    seed_p_holm: float | None = None

    @property
    def significant(self) -> bool:
        return self.p_holm < ALPHA

    @property
    def holds_across_seeds(self) -> bool:
        return self.seed_p_holm is not None and self.seed_p_holm < ALPHA

    def interval(self) -> str:
        return f"{self.diff:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def cells(ab, results: dict) -> dict[str, dict[str, dict[str, Cell]]]:
    """{mode: {task: {arm: Cell}}} from the runs' downstream results on the configured tasks (runs that lack a result
    are left out; a run that failed after scoring a task keeps that result, which is whole; an arm needs the same
    downstream seeds in all its runs)."""
    out: dict = {}
    order = {Path(t).name: i for i, t in enumerate(ab.eval["tasks"])}
    paths = {Path(t).name: t for t in ab.eval["tasks"]}
    labels: dict[tuple[str, str], tuple[str, list]] = {}  # (mode, task) -> (the first run, its dev labels)
    for arm, runs in ab.groups().items():
        states = [results.get(run.name, {}) for run in runs]
        for mode in ab.eval["modes"]:
            # the configured tasks only: one dropped from eval.tasks stays in the runs' states, and counted would
            # grow Holm's m for every other comparison
            present = {t for s in states for t in s.get("downstream", {}).get(mode, {}) if t in order}
            for task in sorted(present, key=order.__getitem__):  # the config's order
                found = [(run.seed, r) for run, s in zip(runs, states) if (r := _result(s, mode, task, paths))]
                if len({len(r["dev_predictions"]) for _, r in found}) != 1:
                    continue
                for run, s in zip(runs, states):  # every pairing assumes the same dev examples in every run
                    result = _result(s, mode, task, paths)
                    if result is None:
                        continue
                    first = labels.setdefault((mode, task), (run.name, result["dev_labels"]))
                    if result["dev_labels"] != first[1]:
                        raise UserError(
                            f"{task} ({mode}): runs {first[0]} and {run.name} were scored on different dev labels "
                            "(the task's files changed between them): their scores cannot be compared; remove the "
                            "runs scored on the old files from the ablation directory and run it again"
                        )
                preds = np.array([r["dev_predictions"] for _, r in found])  # [S, P, N]
                first = found[0][1]
                out.setdefault(mode, {}).setdefault(task, {})[arm] = Cell(
                    first["main_metric"], np.array(first["dev_labels"]), preds, [seed for seed, _ in found]
                )
    return out


def _result(state: dict, mode: str, task: str, paths: dict[str, str]) -> dict | None:
    """A run's result on a task, unless it was scored on other files than the task's directory holds now (a rerun
    that failed leaves it in the state: its scores would pass for the new task's)."""
    result = state.get("downstream", {}).get(mode, {}).get(task)
    return None if result is None or (task in paths and stale(paths[task], result)) else result


def planned(table: dict, main: str) -> list[tuple[str, str, str, str, str]]:
    """(family, mode, task, a, b) of every comparison: each arm against `none`, and every pair of pretrained arms."""
    out = []
    for mode, tasks in table.items():
        for task, arms in tasks.items():
            names = list(arms)
            trained = [a for a in names if a != BASELINE]
            if BASELINE in arms:
                family = PRIMARY if mode == main else SECONDARY
                out += [(family, mode, task, a, BASELINE) for a in trained]
            out += [(SECONDARY, mode, task, a, b) for i, a in enumerate(trained) for b in trained[i + 1 :]]
    return out


def seed_differences(a: Cell, b: Cell) -> list[float]:
    """a minus b per pretraining seed, for the seeds both arms have (arms paired by seed: the same data order)."""
    sa, sb = dict(zip(a.seeds, a.seed_scores())), dict(zip(b.seeds, b.seed_scores()))
    return [float(sa[s] - sb[s]) for s in a.seeds if s in sb]


def comparisons(table: dict, main: str | None = None, replicates: int | None = None) -> list[Comparison]:
    """Every planned comparison, tested over dev examples and seeds (and across seeds with 3 or more), Holm-adjusted
    within its family. One replicate count for the report, enough for its largest family (`replicates_for`)."""
    main = main or main_mode(list(table))
    plan = planned(table, main)
    sizes = {f: sum(1 for p in plan if p[0] == f) for f in (PRIMARY, SECONDARY)}
    replicates = replicates or replicates_for(max(sizes.values(), default=1))
    found = []
    for mode, tasks in table.items():
        for task, arms in tasks.items():
            here = [p for p in plan if p[1] == mode and p[2] == task]
            if not here:
                continue
            first = next(iter(arms.values()))
            results = compare(
                first.metric,
                first.labels,
                {a: c.preds for a, c in arms.items()},
                [(a, b) for *_, a, b in here],
                replicates,
                seeds={a: c.seeds for a, c in arms.items()},
            )
            for family, _, _, a, b in here:
                r = results[(a, b)]
                diffs = seed_differences(arms[a], arms[b])
                found.append(
                    Comparison(
                        mode,
                        task,
                        a,
                        b,
                        r["diff"],
                        r["low"],
                        r["high"],
                        r["p"],
                        family=family,
                        se=r["se"],
                        replicates=replicates,
                        seed_diffs=diffs,
                        seed_p=sign_flip_test(diffs) if len(diffs) >= SEED_TEST_MIN else None,
                    )
                )
    adjust(found)
    return found


def adjust(found: list[Comparison]) -> None:
    """Holm within each family, for the bootstrap p-values and (apart) for the seed-level ones."""
    for family in (PRIMARY, SECONDARY):
        members = [c for c in found if c.family == family]
        for c, adjusted in zip(members, holm([c.p for c in members])):
            c.p_holm = adjusted
        tested = [c for c in members if c.seed_p is not None]
        for c, adjusted in zip(tested, holm([c.seed_p for c in tested])):
            c.seed_p_holm = adjusted


def families(found: list[Comparison], main: str) -> dict[str, dict]:
    """Per family: its size, replicates, and the smallest adjusted p it can reach at all (the smallest p times m)."""
    out = {}
    others = any(c.family == SECONDARY and c.b == BASELINE for c in found)
    for family, what in (
        (PRIMARY, f"each arm vs {BASELINE}, per task, {main} mode"),
        (SECONDARY, "pairs of arms, per task and mode" + (f"; vs {BASELINE} in the other mode" if others else "")),
    ):
        members = [c for c in found if c.family == family]
        if not members:
            continue
        m = len(members)
        replicates = min(c.replicates for c in members)
        # the seed-level floor of the comparisons `adjust` tested across seeds (a failed run leaves some with fewer
        # seeds, untested): their count is Holm's m there, their fewest seeds the smallest p
        tested = [c for c in members if c.seed_p is not None]
        seeds = min(len(c.seed_diffs) for c in tested or members)
        out[family] = {
            "what": what,
            "comparisons": m,
            "replicates": replicates,
            "floor": min(1.0, m * p_floor(replicates)) if replicates else 1.0,
            "seeds": seeds,
            "seed_tested": len(tested),
            "seed_floor": min(1.0, len(tested) * sign_flip_floor(seeds)) if tested else None,
        }
    return out


def detectable(table: dict, found: list[Comparison], fams: dict, main: str) -> list[dict]:
    """Per task of the main mode: the minimum detectable effect of its comparisons (`minimum_detectable_effect` with
    the root mean square of their bootstrap standard errors, at alpha / m of their family)."""
    out = []
    for task, arms in table.get(main, {}).items():
        here = [c for c in found if c.mode == main and c.task == task]
        family = PRIMARY if any(c.family == PRIMARY for c in here) else SECONDARY
        here = [c for c in here if c.family == family]
        if not here:
            continue
        se = math.sqrt(sum(c.se**2 for c in here) / len(here))
        m = fams[family]["comparisons"]
        first = next(iter(arms.values()))
        out.append(
            {
                "mode": main,
                "task": task,
                "metric": first.metric,
                "examples": len(first.labels),
                "family": family,
                "m": m,
                "se": se,
                "mde": minimum_detectable_effect(se, m),
            }
        )
    return out


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def _failed(failures: list[str], runs: int, trained: int) -> str | None:
    """What the pretraining row shows in place of an arm's losses when runs of it failed: how many, what its totals
    are the mean of, and the first error."""
    if not failures:
        return None
    totals = f"totals: mean of the {trained} trained" if trained else "no totals"
    return f"{len(failures)} of {runs} runs ({totals}): {failures[0]}"


def _capped(ab, state: dict) -> bool:
    """Whether a run of a time budget stopped at its step cap (run.train.max_steps) with minutes of it left."""
    steps, wall = (state.get("pretraining") or {}).get("steps"), (state.get("pretraining") or {}).get("wall_s", 0.0)
    cap = (state.get("plan") or {}).get("max_steps")
    return ab.budget_kind == "time" and steps is not None and cap and steps >= cap and wall < ab.budget_amount * 60 - 1


def pretraining(ab, results: dict) -> dict[str, dict]:
    """Per arm: spent budget and final pretraining numbers, averaged over its runs that have them (`trained` of
    `runs`): a run that failed before its training was recorded, or is missing, counts in none of the means."""
    out = {}
    for arm, runs in ab.groups().items():
        states = [results.get(r.name, {}) for r in runs]
        p = [s.get("pretraining", {}) for s in states]
        trained = sum(q.get("steps") is not None for q in p)
        failures = [s["failed"] for s in states if s.get("failed")]
        losses: dict[str, list[float]] = {}
        for q in p:
            for key, value in (q.get("final_loss") or {}).items():
                losses.setdefault(key, []).append(value)
        tokens, flops = _mean(q.get("tokens_seen") for q in p), _mean(q.get("flops") for q in p)
        out[arm] = {
            "objectives": "none (random init)" if not runs[0].pretrain else " + ".join(runs[0].cfg.objectives),
            "steps": _mean(q.get("steps") for q in p),
            "tokens": tokens,
            "flops": flops,
            "wall_s": _mean(q.get("wall_s") for q in p),
            "final": {k: _mean(v) for k, v in losses.items()},
            # per real token, as `tokens` counts them: per token slot (the plan's flops_per_step / tokens_per_step)
            # a padded arm (sentence pairs) looks cheaper while it trains on fewer tokens for the same FLOPs
            "flops_per_token": flops / tokens if tokens and flops else 0.0,
            "failed": _failed(failures, len(runs), trained),
            "runs": len(runs),
            "trained": trained,
            "capped": sum(bool(_capped(ab, s)) for s in states),
        }
    return out
