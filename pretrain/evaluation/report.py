"""The ablation report: `<ablation>/report.md`, `loss_curves.png`, `downstream.png`, `significance.png`,
`results.json` and `provenance.json`.

Everything is computed from the runs' state.json (budget plan, spent budget, downstream scores and every dev
prediction) and metrics.jsonl (loss curves), so the report can be rebuilt without rerunning anything. Scores are means
over pretraining seeds (and the downstream seeds within each). Every comparison is a paired bootstrap over dev
examples and pretraining seeds (`pretrain.evaluation.stats`), with as many replicates as its family needs, and, with
3 or more pretraining seeds, an exact sign-flip test over the per-seed differences. The comparisons fall in two
families, each Holm-adjusted on its own:

- primary: each pretrained arm against the random encoder `none`, per task, in the main mode (full fine-tuning where
  it was run, else the probe): the question the ablation asks first, is there anything learned at all;
- secondary: every pair of pretrained arms, per task and mode, and the comparisons with `none` in the other mode.

Every note is a record (kind, data) made from these numbers (`notes`) and turned into a sentence in one place
(`render_note`); none is written ahead of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pretrain.core.provenance import collect, summary, write_provenance
from pretrain.evaluation.stats import (
    ALPHA,
    POWER,
    compare,
    holm,
    metric_batch,
    minimum_detectable_effect,
    p_floor,
    replicates_for,
    sign_flip_floor,
    sign_flip_test,
)

# BERT-base (Devlin et al. 2019): 1M steps of 256 sequences, 90% of the steps at 128 tokens and 10% at 512:
# 256 x (900,000 x 128 + 100,000 x 512) = 256 x 1.664e8 = 4.26e10 token slots.
BERT_BASE_TOKENS = 256 * (900_000 * 128 + 100_000 * 512)
# ELECTRA-Small (Clark et al. 2020): 1M steps of 128 sequences of 128 tokens = 1.64e10.
ELECTRA_SMALL_TOKENS = 1_000_000 * 128 * 128
EARLY = 0.01  # below this share of ELECTRA-Small's tokens, a run is in the first phase of pretraining
BASELINE = "none"
PRIMARY, SECONDARY = "primary", "secondary"
SEED_TEST_MIN = 3  # a sign-flip test over fewer per-seed differences cannot go below p = 0.5
ENOUGH_SEEDS = 5  # below, the notes warn that run-to-run variance is poorly measured
LISTED = 8  # comparisons named in one note at most; the rest are counted


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
    """{mode: {task: {arm: Cell}}} from the runs' downstream results (runs that failed or lack a result are left out,
    and an arm needs the same downstream seeds in all its runs)."""
    out: dict = {}
    order = {Path(t).name: i for i, t in enumerate(ab.eval["tasks"])}
    for arm, runs in ab.groups().items():
        states = [results.get(run.name, {}) for run in runs]
        for mode in ab.eval["modes"]:
            present = {t for s in states for t in s.get("downstream", {}).get(mode, {})}
            for task in sorted(present, key=lambda t: (order.get(t, len(order)), t)):  # the config's order
                found = [
                    (run.seed, s["downstream"][mode][task])
                    for run, s in zip(runs, states)
                    if task in s.get("downstream", {}).get(mode, {})
                ]
                if len({len(r["dev_predictions"]) for _, r in found}) != 1:
                    continue
                preds = np.array([r["dev_predictions"] for _, r in found])  # [S, P, N]
                first = found[0][1]
                out.setdefault(mode, {}).setdefault(task, {})[arm] = Cell(
                    first["main_metric"], np.array(first["dev_labels"]), preds, [seed for seed, _ in found]
                )
    return out


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
        seeds = min(len(c.seed_diffs) for c in members)
        out[family] = {
            "what": what,
            "comparisons": m,
            "replicates": replicates,
            "floor": min(1.0, m * p_floor(replicates)) if replicates else 1.0,
            "seeds": seeds,
            "seed_floor": min(1.0, m * sign_flip_floor(seeds)) if seeds >= SEED_TEST_MIN else None,
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


# ----------------------------------------------------------------------------------------------
# Numbers


def _fmt_num(x: float) -> str:
    if x == 0:
        return "0"
    exp = int(math.floor(math.log10(abs(x))))
    return f"{x:,.0f}" if exp < 6 else f"{x / 10**exp:.2f}e{exp}"


def _fmt_time(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def pretraining(ab, results: dict) -> dict[str, dict]:
    """Per arm: spent budget and final pretraining numbers, averaged over its runs."""
    out = {}
    for arm, runs in ab.groups().items():
        states = [results.get(r.name, {}) for r in runs]
        p = [s.get("pretraining", {}) for s in states]
        plans = [s.get("plan", {}) for s in states]
        losses: dict[str, list[float]] = {}
        for q in p:
            for key, value in (q.get("final_loss") or {}).items():
                losses.setdefault(key, []).append(value)
        out[arm] = {
            "objectives": "none (random init)" if not runs[0].pretrain else " + ".join(runs[0].cfg.objectives),
            "steps": _mean(q.get("steps", 0) for q in p),
            "tokens": _mean(q.get("tokens_seen", 0) for q in p),
            "flops": _mean(q.get("flops", 0) for q in p),
            "wall_s": _mean(q.get("wall_s", 0.0) for q in p),
            "final": {k: _mean(v) for k, v in losses.items()},
            "flops_per_token": _mean(
                pl["flops_per_step"] / pl["tokens_per_step"]
                for pl in plans
                if pl.get("flops_per_step") and pl.get("tokens_per_step")
            ),
            "failed": next((s["failed"] for s in states if s.get("failed")), None),
            "runs": len(runs),
        }
    return out


Note = tuple[str, dict]
NOTE_KINDS = (
    "scale",
    "cost",
    "budget",
    "method",
    "few_seeds",
    "task",
    "uncorrected",
    "nothing_separates",
    "none_above_random",
    "pairs",
    "seeds_untested",
    "seed_level",
    "detectable",
    "rtd_auc",
    "probe",
    "loss_levels",
)


def _item(c: Comparison) -> dict:
    return {"a": c.a, "b": c.b, "task": c.task, "mode": c.mode, "diff": c.diff, "low": c.low, "high": c.high}


def notes(
    ab, table: dict, found: list[Comparison], pre: dict, fams: dict | None = None, detect: list | None = None
) -> list[Note]:
    """What this ablation can and cannot show, as (kind, data) records made from its numbers only; `render_note`
    words them. No two contradict: the notes that say nothing separates appear only where nothing is significant."""
    main = main_mode(ab.eval["modes"])
    fams = families(found, main) if fams is None else fams
    detect = detectable(table, found, fams, main) if detect is None else detect
    out: list[Note] = []
    trained = {a: v for a, v in pre.items() if v["steps"]}
    tokens = max((v["tokens"] for v in trained.values()), default=0)
    if tokens:
        share = tokens / ELECTRA_SMALL_TOKENS
        out.append(
            (
                "scale",
                {
                    "tokens": tokens,
                    "bert_base": tokens / BERT_BASE_TOKENS,
                    "electra_small": share,
                    "early": share < EARLY,
                },
            )
        )
    ref = "mlm" if "mlm" in trained else next(iter(trained), None)
    if ref and trained[ref]["flops_per_token"]:
        relative = {
            a: v["flops_per_token"] / trained[ref]["flops_per_token"]
            for a, v in trained.items()
            if v["flops_per_token"] and a != ref
        }
        if relative:
            out.append(("cost", {"reference": ref, "relative": relative}))
    spent = {a: v["tokens" if ab.budget_kind == "flops" else "flops"] for a, v in trained.items()}
    out.append(("budget", {"kind": ab.budget_kind, "amount": ab.budget_amount, "spent": spent}))

    seeds = min((len(c.seed_diffs) for c in found), default=len(ab.seeds)) or len(ab.seeds)
    out.append(
        (
            "method",
            {
                "seeds": len(ab.seeds),
                "downstream_seeds": len(ab.eval["seeds"]),
                "main": main,
                "families": fams,
                "alpha": ALPHA,
            },
        )
    )
    if seeds < ENOUGH_SEEDS:
        out.append(
            (
                "few_seeds",
                {
                    "seeds": seeds,
                    "seed_draws": math.comb(2 * seeds - 1, seeds),
                    "seed_floor": sign_flip_floor(seeds) if seeds >= SEED_TEST_MIN else None,
                },
            )
        )

    versus = [c for c in found if c.b == BASELINE]
    for mode, tasks in table.items():
        for task, arms in tasks.items():
            here = [c for c in versus if c.mode == mode and c.task == task]
            if here:
                out.append(
                    (
                        "task",
                        {
                            "mode": mode,
                            "task": task,
                            "metric": next(iter(arms.values())).metric,
                            "family": here[0].family,
                            "above": [_item(c) for c in here if c.significant and c.diff > 0],
                            "below": [_item(c) for c in here if c.significant and c.diff < 0],
                            "same": [c.a for c in here if not c.significant],
                        },
                    )
                )
    loose = [c for c in versus if c.p < ALPHA and not c.significant]
    if loose:  # what an uncorrected reading would claim, and why it does not hold
        out.append(("uncorrected", {"items": [_item(c) for c in loose], "total": len(versus), "alpha": ALPHA}))

    between = [c for c in found if c.b != BASELINE]
    anything = any(c.significant or c.holds_across_seeds for c in found)
    if not anything and found:
        out.append(("nothing_separates", {"comparisons": len(found)}))
    elif versus and not any(c.significant and c.diff > 0 for c in versus):
        below = sum(c.significant and c.diff < 0 for c in versus)
        out.append(
            (
                "none_above_random",
                {"compared": len(versus), "below": below, "pairs": sum(c.significant for c in between)},
            )
        )
    if between and anything:  # with nothing significant, "nothing_separates" already says it of the pairs
        out.append(("pairs", {"significant": [_item(c) for c in between if c.significant], "total": len(between)}))

    significant = [c for c in found if c.significant]
    if seeds < SEED_TEST_MIN and significant:
        out.append(
            (
                "seeds_untested",
                {"seeds": seeds, "items": [{**_item(c), "seed_diffs": c.seed_diffs} for c in significant]},
            )
        )
    elif seeds >= SEED_TEST_MIN and any(c.significant or c.holds_across_seeds for c in found):
        out.append(
            (
                "seed_level",
                {
                    "seeds": seeds,
                    "floor": sign_flip_floor(seeds),
                    "held": [_item(c) for c in found if c.significant and c.holds_across_seeds],
                    "not_held": [
                        {**_item(c), "seed_p_holm": c.seed_p_holm}
                        for c in found
                        if c.significant and not c.holds_across_seeds
                    ],
                    "seeds_only": [_item(c) for c in found if c.holds_across_seeds and not c.significant],
                    "family_floors": {f: v["seed_floor"] for f, v in fams.items() if v["seed_floor"] is not None},
                },
            )
        )
    if detect:
        out.append(("detectable", {"items": detect, "power": POWER, "alpha": ALPHA}))

    rtd = pre.get("rtd") or next((v for a, v in pre.items() if "rtd" in v["objectives"].split(" + ")), None)
    if rtd and "rtd/disc_auc" in rtd["final"]:
        out.append(("rtd_auc", {"auc": rtd["final"]["rtd/disc_auc"]}))
    if "probe" in table:
        gaps = [
            table["full"][t][a].mean - cell.mean
            for t, arms in table["probe"].items()
            for a, cell in arms.items()
            if a in table.get("full", {}).get(t, {})
        ]
        out.append(
            (
                "probe",
                {
                    "pooling": ab.eval["pooling"],
                    "full_above": sum(g > 0 for g in gaps),
                    "cells": len(gaps),
                    "mean_gap": float(np.mean(gaps)) if gaps else None,
                },
            )
        )
    kinds = sorted({v["objectives"] for v in trained.values()})
    if len(kinds) > 1:
        out.append(("loss_levels", {"objectives": kinds}))
    return out


def _names(items: list[dict], with_interval: bool = True, pair: bool = False) -> str:
    shown = [
        (f"{i['a']} vs {i['b']} on {i['task']} ({i['mode']})" if pair else i["a"])
        + (f" {i['diff']:+.3f} [{i['low']:+.3f}, {i['high']:+.3f}]" if with_interval else "")
        for i in items[:LISTED]
    ]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f" and {more} more (results.json)" if more > 0 else "")


def render_note(kind: str, d: dict) -> str:
    """The one place notes become prose."""
    if kind == "scale":
        return (
            f"Each pretrained arm saw up to {_fmt_num(d['tokens'])} tokens: {d['bert_base']:.1e} of BERT-base's "
            f"~4.3e10 (1M steps of 256 sequences, 90% of them of 128 tokens and 10% of 512) and "
            f"{d['electra_small']:.1e} of ELECTRA-Small's ~1.6e10 (1M steps of 128 x 128 tokens)."
            + (
                " These are results about the first phase of pretraining; rankings there need not hold at full scale."
                if d["early"]
                else ""
            )
        )
    if kind == "cost":
        costs = ", ".join(f"{a} {x:.2f}x" for a, x in d["relative"].items())
        return f"Training FLOPs per token relative to {d['reference']} (counted on a real step of each arm): {costs}."
    if kind == "budget":
        if d["kind"] == "flops":
            seen = ", ".join(f"{a} {_fmt_num(v)}" for a, v in d["spent"].items())
            return (
                f"The budget is FLOPs ({d['amount']:.3g} per arm): an arm that costs less per token trains on more "
                f"tokens ({seen}). That is the comparison that holds compute equal."
            )
        if d["kind"] == "tokens":
            spent = ", ".join(f"{a} {_fmt_num(v)}" for a, v in d["spent"].items())
            return (
                f"The budget is tokens: arms that cost more per token also used more compute (FLOPs: {spent}); for "
                "claims across objectives, a FLOPs budget (budget.kind=flops) holds compute equal."
            )
        return (
            "The budget is wall-clock time, on a machine shared with other work: the steps each arm got carry that "
            "noise."
        )
    if kind == "method":
        fams = d["families"]
        parts = []
        for family in (PRIMARY, SECONDARY):
            f = fams.get(family)
            if f:
                parts.append(
                    f"the {family} family ({f['what']}: {f['comparisons']} comparison(s), {f['replicates']:,} "
                    f"replicates; the smallest adjusted p it can reach is {f['floor']:.2g}"
                    + (", so nothing in it can be significant" if f["floor"] >= d["alpha"] else "")
                    + ")"
                )
        head = (
            f"Intervals are 95% paired-bootstrap intervals over dev examples and the {d['seeds']} pretraining "
            f"seed(s) of each arm, averaged over {d['downstream_seeds']} downstream seed(s). 'Significant' means a "
            f"Holm-adjusted p below {d['alpha']} within its family: "
        )
        if not parts:
            return head + "there is nothing to compare."
        return (
            head
            + "; ".join(parts)
            + "."
            + ("" if PRIMARY in fams else f" There is no random-encoder arm ('{BASELINE}'), so no primary family.")
        )
    if kind == "few_seeds":
        if d["seeds"] <= 1:
            return (
                "With one pretraining seed per arm the intervals leave out the run-to-run variance of pretraining "
                "itself, so they are too narrow, and no test across seeds is possible: set `seeds:` to 5 or more "
                "for claims about the objectives."
            )
        seed_test = (
            f"a test across seeds cannot give p below {d['seed_floor']:.3g} (2/2^{d['seeds']})"
            if d["seed_floor"] is not None
            else f"a test across seeds needs at least {SEED_TEST_MIN}"
        )
        return (
            f"With {d['seeds']} pretraining seeds per arm the run-to-run variance of pretraining is poorly measured: "
            f"the bootstrap can draw only {d['seed_draws']} distinct sets of seeds per arm, and {seed_test}. "
            "Significant differences hold for these pretraining runs; for claims about the objectives, use 5 or "
            "more seeds (`seeds:`)."
        )
    if kind == "task":
        parts = []  # the first part names the random encoder, the later ones say "it"
        for group, words in ((d["above"], "above"), (d["below"], "below")):
            if group:
                what = "a random encoder" if not parts else "it"
                parts.append(f"{words} {what}: " + _names(group))
        if d["same"] and parts:
            parts.append("within noise of it: " + ", ".join(d["same"]))
        elif d["same"]:
            parts.append("every arm within noise of a random encoder (" + ", ".join(d["same"]) + ")")
        return f"{d['task']} ({d['mode']}, {d['metric']}; {d['family']}): " + "; ".join(parts) + "."
    if kind == "uncorrected":
        items = ", ".join(f"{i['a']} on {i['task']} ({i['mode']}) {i['diff']:+.3f}" for i in d["items"][:LISTED])
        return (
            f"Before correction, {len(d['items'])} of the {d['total']} comparisons with the random encoder have a p "
            f"below {d['alpha']} ({items}); about {d['total'] * d['alpha']:.1f} would by chance alone, and Holm's "
            "correction within their family does not keep them."
        )
    if kind == "nothing_separates":
        return (
            f"None of the {d['comparisons']} comparisons is significant: at this budget these numbers cannot tell "
            "the arms apart, nor any arm from the random encoder."
        )
    if kind == "none_above_random":
        also = []
        if d["below"]:
            also.append(f"{d['below']} comparison(s) put an arm below it")
        if d["pairs"]:
            also.append(f"{d['pairs']} pair(s) of arms differ (next note)")
        return (
            f"No pretrained arm is significantly above the random encoder ({d['compared']} comparisons)"
            + (": " + " and ".join(also) + ", among features that have not yet beaten random ones" if also else "")
            + "."
        )
    if kind == "pairs":
        sig, rest = d["significant"], d["total"] - len(d["significant"])
        if not sig:
            return f"No pair of pretrained arms differs significantly ({d['total']} pair(s) compared)."
        return (
            "Pairs of pretrained arms that differ: "
            + _names(sig, pair=True)
            + "."
            + (f" The other {rest} pair(s) are within noise." if rest else "")
        )
    if kind == "seeds_untested":
        shown = "; ".join(
            f"{i['a']} vs {i['b']} on {i['task']} ({i['mode']}) " + ", ".join(f"{x:+.3f}" for x in i["seed_diffs"])
            for i in d["items"][:LISTED]
        )
        return (
            f"The significant differences are tested over dev examples; with {d['seeds']} pretraining seed(s) none "
            f"is tested across seeds (that needs {SEED_TEST_MIN}). Their differences seed by seed: {shown}."
        )
    if kind == "seed_level":
        parts = []
        if d["held"]:
            parts.append("these hold: " + _names(d["held"], False, pair=True))
        if d["not_held"]:
            parts.append(
                "these do not: "
                + ", ".join(
                    f"{i['a']} vs {i['b']} on {i['task']} ({i['mode']}, p {i['seed_p_holm']:.2g})"
                    for i in d["not_held"][:LISTED]
                )
            )
        if d["seeds_only"]:
            parts.append("significant across seeds only: " + _names(d["seeds_only"], False, pair=True))
        closed = [f"{f} ({x:.3g})" for f, x in d["family_floors"].items() if x >= ALPHA]
        return (
            f"Across the {d['seeds']} pretraining seeds (exact sign-flip test over the per-seed differences, Holm "
            f"within each family; it cannot give p below {d['floor']:.3g}): "
            + "; ".join(parts)
            + "."
            + (
                f" The smallest adjusted p across seeds is not below {ALPHA} in the {' and '.join(closed)} "
                f"family: no comparison there can hold across {d['seeds']} seeds."
                if closed
                else ""
            )
        )
    if kind == "detectable":
        items = ", ".join(
            f"{i['task']} {i['mde']:.3f} ({i['metric']}, {i['examples']:,} dev examples)" for i in d["items"]
        )
        first = d["items"][0]
        return (
            f"Smallest gap a comparison with the random encoder can find with {d['power']:.0%} power in the "
            f"{first['mode']} mode, at alpha/m = {d['alpha']}/{first['m']}, from each task's dev set and bootstrap "
            f"variance: {items}. Smaller gaps may be real and still not show."
        )
    if kind == "rtd_auc":
        auc = d["auc"]
        state = (
            "it detects replaced tokens"
            if auc >= 0.7
            else "it has barely begun to tell replaced tokens from real ones"
            if auc >= 0.55
            else "it is near its base rate (below 0.55), so it has not yet learned to detect replaced tokens; "
            "ELECTRA's discriminator can sit there for thousands of steps (benchmarks/RESULTS.md)"
        )
        return f"The ELECTRA discriminator ended pretraining at AUC {auc:.3f} (0.5 = chance): {state}."
    if kind == "probe":
        text = (
            f"Probe scores are linear probes on frozen, {d['pooling']}-pooled features: they measure what the "
            "features already encode."
        )
        if d["cells"]:
            text += (
                f" Fine-tuning scored above the probe in {d['full_above']} of {d['cells']} arm-task cells "
                f"(mean gap {d['mean_gap']:+.3f})."
            )
        return text
    if kind == "loss_levels":
        return (
            f"Pretraining losses of different objectives ({', '.join(d['objectives'])}) are different quantities: "
            "compare an arm's curve with itself, not levels across arms."
        )
    raise ValueError(f"no wording for a note of kind '{kind}'")


# ----------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(ab, path: Path) -> None:
    from pretrain.train.metrics import read_metrics

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, runs) in enumerate(ab.groups().items()):
        for j, run in enumerate(runs):
            records = read_metrics(run.cfg.run_dir) if run.pretrain else []
            if records:
                ax.plot(
                    [r["tokens"] for r in records],
                    [r["loss"] for r in records],
                    color=colors[i % len(colors)],
                    lw=1.2,
                    alpha=0.9 if j == 0 else 0.45,
                    label=arm if j == 0 else None,
                )
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("pretraining loss (sum over the arm's objectives)")
    ax.set_title("Pretraining loss per arm and seed (objectives differ: compare shapes, not levels)", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_downstream(ab, table: dict, path: Path) -> None:
    plt = _pyplot()
    columns = [(mode, task) for mode, tasks in table.items() for task in tasks]
    arms = list(ab.groups())
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(columns) * len(arms) / 2 + 2), 4.2))
    width = 0.8 / max(1, len(arms))
    x = np.arange(len(columns))
    for i, arm in enumerate(arms):
        means = [table[m][t][arm].mean if arm in table[m][t] else np.nan for m, t in columns]
        spreads = [table[m][t][arm].spread if arm in table[m][t] else 0 for m, t in columns]
        ax.bar(x + (i - (len(arms) - 1) / 2) * width, means, width, yerr=spreads, capsize=3, label=arm)
    ax.set_xticks(x, [f"{t}\n{m} ({table[m][t][next(iter(table[m][t]))].metric})" for m, t in columns], fontsize=8)
    ax.set_ylabel("dev score (mean over pretraining seeds, ± sd)")
    ax.axhline(0, color="black", lw=0.5)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(len(arms), 4))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_significance(found: list[Comparison], path: Path) -> None:
    """Each arm minus `none`, with its 95% interval, per task and mode: filled where Holm-significant."""
    plt = _pyplot()
    versus = [c for c in found if c.b == BASELINE]
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.32 * len(versus) + 1)))
    for y, c in enumerate(versus):
        ax.errorbar(
            c.diff,
            y,
            xerr=[[c.diff - c.low], [c.high - c.diff]],
            fmt="o",
            capsize=3,
            color="#2a6f97" if c.significant else "#999999",
            mfc=None if c.significant else "white",
        )
    ax.set_yticks(range(len(versus)), [f"{c.a}  {c.task} ({c.mode})" for c in versus], fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("score minus the random encoder's\n(95% paired bootstrap interval; filled: Holm p < 0.05 in family)")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# The report


def run_on(results: dict) -> str:
    """Devices, versions and dates of the arms (each arm records them when it finishes)."""
    hosts = [s["host"] for s in results.values() if s.get("host")]
    if not hosts:
        return "Run on: not recorded (arms finished before versions that record it)."
    devices = ", ".join(sorted({h["device"] for h in hosts}))
    versions = ", ".join(sorted({f"torch {h['torch']}, DeepSpeed {h['deepspeed']}" for h in hosts}))
    dates = sorted({h["date"] for h in hosts})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    missing = len(results) - len(hosts)
    return f"Run on: {devices}; {versions}; {when}" + (f" ({missing} arm(s) not recorded)." if missing else ".")


def ablation_provenance(ab, command: str | None = None) -> dict:
    """The reproducibility record of an ablation: the ablation config as run, each arm's resolved config (as written
    for it, budget applied), and the sha256 of the corpus, tokenizer, shards and task files."""
    import yaml

    from pretrain.core.config import to_dict

    configs = {"ablation": ab.raw}
    for arm in ab.arms:
        path = ab.arm_config_path(arm)
        configs[arm.name] = yaml.safe_load(path.read_text()) if path.is_file() else to_dict(arm.cfg)
    files = {
        "corpus": list(ab.base.data.corpus),
        "tokenizer": ab.base.tokenizer_dir,
        "shards": ab.base.shards_dir,
        "tasks": list(ab.eval["tasks"]),
    }
    return collect(command, configs, files)


def write_report(
    ab, results: dict, command: str | None = None, provenance: dict | None = None, replicates: int | None = None
) -> Path:
    out = ab.out
    main = main_mode(ab.eval["modes"])
    table = cells(ab, results)
    found = comparisons(table, main, replicates)
    fams = families(found, main)
    detect = detectable(table, found, fams, main)
    pre = pretraining(ab, results)
    found_notes = notes(ab, table, found, pre, fams, detect)
    provenance = provenance or ablation_provenance(ab, command)
    write_provenance(out / "provenance.json", provenance)
    plot_losses(ab, out / "loss_curves.png")
    plot_downstream(ab, table, out / "downstream.png")
    plot_significance(found, out / "significance.png")
    record = {
        "runs": results,
        "main_mode": main,
        "comparisons": [asdict(c) for c in found],
        "families": fams,
        "detectable": detect,
        "notes": [{"kind": kind, **data} for kind, data in found_notes],
        "provenance": provenance,
    }
    (out / "results.json").write_text(json.dumps(record, default=float))

    b = ab.base
    plan = next((s["plan"] for s in results.values() if s.get("plan", {}).get("max_steps")), {})
    unit = {"tokens": "tokens (sequence slots)", "flops": "training FLOPs", "time": "minutes"}[ab.budget_kind]
    lines = [f"# Pretraining-objective ablation: {ab.out.name}", ""]
    if command:
        lines += ["Made with:", "", "```bash", command, "```", ""]
    lines += [run_on(results), ""]
    lines += [
        f"Code and inputs: {summary(provenance)}; the full record (command, resolved configs, every sha256) is "
        "provenance.json.",
        "",
    ]
    lines += [
        f"Budget: **{ab.budget_amount:g} {unit} per arm**, pretraining seeds {ab.seeds}. Shared: encoder "
        f"{b.model.num_layers} layers x {b.model.hidden_size} hidden ({b.model.num_heads} heads), sequences of "
        f"{b.data.max_seq_len} tokens, global batch "
        f"{plan.get('global_batch', b.train.micro_batch_size * b.train.grad_accum_steps)}, "
        f"one tokenizer ({b.data.tokenizer_type}) and one set of shards from {', '.join(b.data.corpus)}. "
        f"Downstream: {', '.join(ab.eval['modes'])}"
        + (f" ({ab.eval['pooling']}-pooled features for probes)" if "probe" in ab.eval["modes"] else "")
        + f" on {', '.join(Path(t).name for t in ab.eval['tasks'])}, downstream seeds {ab.eval['seeds']}; dev scores.",
        "",
    ]
    versus = {(c.mode, c.task, c.a): c for c in found if c.b == BASELINE}
    for mode, tasks in table.items():
        header = ["arm", "objectives"] + [
            h
            for t, cell in ((t, next(iter(a.values()))) for t, a in tasks.items())
            for h in (f"{t} ({cell.metric})", f"{t} vs none")
        ]
        title = f"### {mode}" + (" (primary)" if mode == main and any(c.family == PRIMARY for c in found) else "")
        lines += [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for arm in ab.groups():
            row = [arm, pre[arm]["objectives"]]
            for task, arms in tasks.items():
                cell = arms.get(arm)
                row.append(f"{cell.mean:.3f} ± {cell.spread:.3f}" if cell else "–")
                c = versus.get((mode, task, arm))
                if c is None:
                    row.append("–")
                else:
                    seeds = "" if c.seed_p_holm is None else f" seeds p {c.seed_p_holm:.2g}"
                    row.append(f"{c.interval()}{' **✓**' if c.significant else ''}{seeds}")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "Scores: mean over pretraining seeds ± their standard deviation (one seed: ± over downstream seeds). "
        "vs none: difference with its 95% paired-bootstrap interval; **✓**: Holm-adjusted p below "
        f"{ALPHA} within its family; seeds p: the Holm-adjusted p of the exact sign-flip test across pretraining "
        f"seeds (with {SEED_TEST_MIN} or more).",
    ]
    if fams:
        lines += [
            "",
            "| family | comparisons | bootstrap replicates | smallest adjusted p it can reach | across seeds |",
            "|---|---|---|---|---|",
        ]
    for family, f in fams.items():
        seed_floor = (
            f"{f['seed_floor']:.3g} ({f['seeds']} seeds)"
            if f["seed_floor"] is not None
            else f"untested ({f['seeds']} seed(s); needs {SEED_TEST_MIN})"
        )
        lines.append(
            f"| {family}: {f['what']} | {f['comparisons']} | {f['replicates']:,} | {f['floor']:.2g} | {seed_floor} |"
        )
    if detect:
        lines += [
            "",
            f"| task ({main}) | dev examples | smallest detectable gap ({POWER:.0%} power, alpha/m) |",
            "|---|---|---|",
        ]
        lines += [
            f"| {d['task']} ({d['metric']}) | {d['examples']:,} | {d['mde']:.3f} (m = {d['m']}) |" for d in detect
        ]
    lines += [
        "",
        "| arm | final pretraining loss | steps | tokens | FLOPs | FLOPs per token | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, p in pre.items():
        final = ", ".join(f"{k} {v:.3f}" for k, v in p["final"].items() if k != "loss") or "–"
        if p["failed"]:
            final = f"FAILED: {p['failed'][:80]}"
        lines.append(
            f"| {arm} | {final} | {p['steps']:.0f} | {_fmt_num(p['tokens'])} | {_fmt_num(p['flops'])} | "
            f"{_fmt_num(p['flops_per_token'])} | {_fmt_time(p['wall_s'])} |"
        )
    lines += [
        "",
        "Tokens are real (non-padding) tokens the trainer consumed; FLOPs are steps x the FLOPs of one step, "
        "counted by torch on a real batch of each arm (forward + backward); wall time is training only.",
        "",
        "![pretraining loss per arm](loss_curves.png)",
        "",
        "![downstream scores](downstream.png)",
        "",
        "![each arm minus the random encoder](significance.png)",
        "",
        "## What this budget can and cannot show",
        "",
    ]
    lines += [f"- {render_note(kind, data)}" for kind, data in found_notes]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
