"""What an ablation can and cannot show, as structured note records (kind, data) made from its numbers only.

`notes` builds them in a fixed order (scale and cost, budget, method, per-task verdicts, the verdicts over all
comparisons, the test across seeds, the detectable gaps, then pretraining caveats); `report_render.render_note`
words them. Tests assert on these records, so a note's figures are checked, not its sentences."""

from __future__ import annotations

import math

import numpy as np

from pretrain.evaluation.report_numbers import (
    BASELINE,
    SEED_TEST_MIN,
    Comparison,
    detectable,
    families,
    main_mode,
)
from pretrain.evaluation.stats import ALPHA, POWER, seeds_needed, sign_flip_floor

# BERT-base (Devlin et al. 2019): 1M steps of 256 sequences, 90% of the steps at 128 tokens and 10% at 512:
# 256 x (900,000 x 128 + 100,000 x 512) = 256 x 1.664e8 = 4.26e10 token slots.
BERT_BASE_TOKENS = 256 * (900_000 * 128 + 100_000 * 512)
# ELECTRA-Small (Clark et al. 2020): 1M steps of 128 sequences of 128 tokens = 1.64e10.
ELECTRA_SMALL_TOKENS = 1_000_000 * 128 * 128
EARLY = 0.01  # below this share of ELECTRA-Small's tokens, a run is in the first phase of pretraining

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
    "diverged",
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
    trained = {a: v for a, v in pre.items() if v["steps"]}
    # The pretraining seeds each arm was given; a family that pairs up fewer (a run failed or is missing) is judged
    # on its own count (`families`: its fewest seeds)
    seeds = max(1, len(ab.seeds))
    out = scale_notes(trained) + [budget_note(ab, trained)] + method_notes(ab, fams, main, seeds)
    out += task_notes(table, found) + verdict_notes(found) + seed_notes(found, fams) + diverged_notes(table)
    if detect:
        out.append(("detectable", {"items": detect, "power": POWER, "alpha": ALPHA}))
    return out + pretraining_notes(ab, table, pre, trained)


def scale_notes(trained: dict) -> list[Note]:
    """How far into pretraining the arms got (against BERT-base and ELECTRA-Small) and what a token costs each."""
    out: list[Note] = []
    tokens = max((v["tokens"] for v in trained.values()), default=0)
    if tokens:
        share = tokens / ELECTRA_SMALL_TOKENS
        scale = {"tokens": tokens, "bert_base": tokens / BERT_BASE_TOKENS, "electra_small": share}
        out.append(("scale", {**scale, "early": share < EARLY}))
    ref = "mlm" if "mlm" in trained else next(iter(trained), None)
    if ref and trained[ref]["flops_per_token"]:
        relative = {
            a: v["flops_per_token"] / trained[ref]["flops_per_token"]
            for a, v in trained.items()
            if v["flops_per_token"] and a != ref
        }
        if relative:
            out.append(("cost", {"reference": ref, "relative": relative}))
    return out


def budget_note(ab, trained: dict) -> Note:
    """The budget kind, the quantity it leaves free per arm (tokens under FLOPs, FLOPs otherwise), and the arms whose
    totals are the mean of fewer than all their runs (`partial`: [trained, runs]; the others failed or are missing)."""
    spent = {a: v["tokens" if ab.budget_kind == "flops" else "flops"] for a, v in trained.items()}
    partial = {a: [v["trained"], v["runs"]] for a, v in trained.items() if v["trained"] < v["runs"]}
    # under a time budget, run.train.max_steps still caps every arm: a fast arm stopped there with minutes left
    capped = {a: [v["capped"], v["runs"]] for a, v in trained.items() if v.get("capped")}
    data = {"budget_kind": ab.budget_kind, "amount": ab.budget_amount, "spent": spent, "partial": partial}
    return ("budget", {**data, "capped": capped, "max_steps": ab.base.train.max_steps} if capped else data)


def method_notes(ab, fams: dict, main: str, seeds: int) -> list[Note]:
    """How the comparisons were made, and a warning wherever the seeds are too few for a test across them to hold."""
    method = {
        "seeds": len(ab.seeds),
        "downstream_seeds": len(ab.eval["seeds"]),
        "main": main,
        "families": fams,
        "alpha": ALPHA,
    }
    out: list[Note] = [("method", method)]
    few = few_seeds(fams, seeds)
    return out + ([("few_seeds", few)] if few else [])


def few_seeds(fams: dict, seeds: int) -> dict | None:
    """The seeds each family needs for a sign-flip test to hold after Holm (m x 2/2^n < alpha), where `seeds` is
    short of it in any family (None where not): a fixed count such as 5 cannot do (2/2^5 > 0.05 even for m = 1)."""
    sizes = {f: v["comparisons"] for f, v in fams.items()}
    have = {f: min(seeds, v.get("seeds", seeds)) for f, v in fams.items()}  # fewer where runs failed or are missing
    short = {
        f: {"comparisons": m, "needed": seeds_needed(m), **({"seeds": have[f]} if have[f] < seeds else {})}
        for f, m in sizes.items()
    }
    short = {f: v for f, v in short.items() if v["needed"] is None or have[f] < v["needed"]}
    if (sizes and not short) or (not sizes and seeds >= seeds_needed(1)):  # nothing compared: as one comparison
        return None
    reachable = [v["needed"] for v in short.values() if v["needed"] is not None] or ([] if short else [seeds_needed(1)])
    needed = max(reachable, default=None)  # None: some family is too large for any number of seeds
    return {
        "seeds": seeds,
        "seed_draws": math.comb(2 * seeds - 1, seeds),
        "seed_floor": sign_flip_floor(seeds) if seeds >= SEED_TEST_MIN else None,
        "families": short,
        "needed": needed,
        "alpha": ALPHA,
    }


def task_notes(table: dict, found: list[Comparison]) -> list[Note]:
    """Per task and mode: the arms above, below and within noise of the random encoder; then the comparisons an
    uncorrected reading would call significant and Holm does not keep."""
    out: list[Note] = []
    versus = [c for c in found if c.b == BASELINE]
    for mode, tasks in table.items():
        for task, arms in tasks.items():
            here = [c for c in versus if c.mode == mode and c.task == task]
            if not here:
                continue
            verdict = {
                "above": [_item(c) for c in here if c.significant and c.diff > 0],
                "below": [_item(c) for c in here if c.significant and c.diff < 0],
                "same": [c.a for c in here if not c.significant],
            }
            metric = next(iter(arms.values())).metric
            out.append(("task", {"mode": mode, "task": task, "metric": metric, "family": here[0].family, **verdict}))
    loose = [c for c in versus if c.p < ALPHA and not c.significant]
    if loose:
        out.append(("uncorrected", {"items": [_item(c) for c in loose], "total": len(versus), "alpha": ALPHA}))
    return out


def verdict_notes(found: list[Comparison]) -> list[Note]:
    """Over all comparisons: nothing separates, or no arm beats random, and which pairs of arms differ. Each is
    written only where the numbers allow it, so no two contradict."""
    out: list[Note] = []
    versus = [c for c in found if c.b == BASELINE]
    between = [c for c in found if c.b != BASELINE]
    anything = any(c.significant or c.holds_across_seeds for c in found)
    if not anything and found:
        out.append(("nothing_separates", {"comparisons": len(found), "baseline": bool(versus)}))
    elif versus and not any(c.significant and c.diff > 0 for c in versus):
        below = sum(c.significant and c.diff < 0 for c in versus)
        pairs = sum(c.significant for c in between)
        out.append(("none_above_random", {"compared": len(versus), "below": below, "pairs": pairs}))
    if between and anything:  # with nothing significant, "nothing_separates" already says it of the pairs
        out.append(("pairs", {"significant": [_item(c) for c in between if c.significant], "total": len(between)}))
    return out


def seed_notes(found: list[Comparison], fams: dict) -> list[Note]:
    """Whether the significant differences hold across pretraining seeds (or, with too few, their per-seed values)."""
    significant = [c for c in found if c.significant]
    tested = [len(c.seed_diffs) for c in found if c.seed_p is not None]  # seeds of each comparison tested across them
    if not tested:  # fewer than SEED_TEST_MIN seeds paired up anywhere
        if not significant:
            return []
        items = [{**_item(c), "seed_diffs": c.seed_diffs} for c in significant]
        return [("seeds_untested", {"seeds": max(len(c.seed_diffs) for c in significant), "items": items})]
    if not any(c.significant or c.holds_across_seeds for c in found):
        return []
    level = {
        # the seeds the tests had (fewer than `seeds` where a run failed): their floors, from the most seeds down
        "seeds": max(tested),
        "fewest": min(tested),
        "floor": sign_flip_floor(max(tested)),
        "held": [_item(c) for c in significant if c.holds_across_seeds],
        "untested": [_item(c) for c in significant if c.seed_p is None],
        "not_held": [
            {**_item(c), "seed_p_holm": c.seed_p_holm}
            for c in significant
            if c.seed_p is not None and not c.holds_across_seeds
        ],
        "seeds_only": [_item(c) for c in found if c.holds_across_seeds and not c.significant],
        "family_floors": {f: v["seed_floor"] for f, v in fams.items() if v["seed_floor"] is not None},
    }
    return [("seed_level", level)]


def diverged_notes(table: dict) -> list[Note]:
    """Regression fine-tunings that diverged (a non-finite dev prediction): their correlation is undefined, and is
    scored as a constant prediction's, 0 (`stats.metric_batch`), which pulls their arm down: said, per cell."""
    items = []
    for mode, tasks in table.items():
        for task, arms in tasks.items():
            for arm, cell in arms.items():
                if cell.metric == "pearson":
                    bad = ~np.isfinite(np.asarray(cell.preds, float)).all(-1)  # [S, P]
                    if bad.any():
                        items.append({"arm": arm, "task": task, "mode": mode, "runs": int(bad.sum()), "of": bad.size})
    return [("diverged", {"items": items})] if items else []


def pretraining_notes(ab, table: dict, pre: dict, trained: dict) -> list[Note]:
    """Caveats from pretraining itself: the ELECTRA discriminator's AUC, what probes measure against fine-tuning,
    and that loss levels of different objectives do not compare."""
    out: list[Note] = []
    rtd = pre.get("rtd") or next((v for v in pre.values() if "rtd" in v["objectives"].split(" + ")), None)
    if rtd and "rtd/disc_auc" in rtd["final"]:
        out.append(("rtd_auc", {"auc": rtd["final"]["rtd/disc_auc"]}))
    if "probe" in table:
        gaps = [
            table["full"][t][a].mean - cell.mean
            for t, arms in table["probe"].items()
            for a, cell in arms.items()
            if a in table.get("full", {}).get(t, {})
        ]
        probe = {"pooling": ab.eval["pooling"], "full_above": sum(g > 0 for g in gaps), "cells": len(gaps)}
        out.append(("probe", {**probe, "mean_gap": float(np.mean(gaps)) if gaps else None}))
    kinds = sorted({v["objectives"] for v in trained.values()})
    if len(kinds) > 1:
        out.append(("loss_levels", {"objectives": kinds}))
    return out
