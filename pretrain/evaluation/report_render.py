"""Note records made into prose: one wording function per note kind, and `render_note`, the one place notes
become sentences (so the numbers in a note are decided in `report_notes` and only formatted here)."""

from __future__ import annotations

import math

from pretrain.evaluation.report_numbers import BASELINE, PRIMARY, SECONDARY, SEED_TEST_MIN
from pretrain.evaluation.stats import ALPHA, sign_flip_floor

LISTED = 8  # comparisons named in one note at most; the rest are counted


def fmt_p(p: float) -> str:
    """A p-value to two significant digits, or as many more as keep it on its side of ALPHA: an adjusted p of 0.0498,
    which holds, read 0.05 (and 0.0499952, 520 of 10,401 replicates, still did at four)."""
    for digits in range(2, 17):
        shown = f"{p:.{digits}g}"
        if (float(shown) < ALPHA) == (p < ALPHA):
            return shown
    return f"<{ALPHA:g}" if p < ALPHA else f"{p!r}"


def _fmt_num(x: float) -> str:
    if x == 0:
        return "0"
    exp = int(math.floor(math.log10(abs(x))))
    return f"{x:,.0f}" if exp < 6 else f"{x / 10**exp:.2f}e{exp}"


def _fmt_time(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _names(items: list[dict], with_interval: bool = True, pair: bool = False) -> str:
    shown = [
        (f"{i['a']} vs {i['b']} on {i['task']} ({i['mode']})" if pair else i["a"])
        + (f" {i['diff']:+.3f} [{i['low']:+.3f}, {i['high']:+.3f}]" if with_interval else "")
        for i in items[:LISTED]
    ]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f" and {more} more (results.json)" if more > 0 else "")


def _scale(d: dict) -> str:
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


def _cost(d: dict) -> str:
    costs = ", ".join(f"{a} {x:.2f}x" for a, x in d["relative"].items())
    return (
        f"Training FLOPs per real (non-padding) token relative to {d['reference']} (an arm's FLOPs over the tokens it "
        f"trained on, so padding counts in its cost): {costs}."
    )


def _budget(d: dict) -> str:
    partial = ", ".join(f"{a} {n} of {runs}" for a, (n, runs) in (d.get("partial") or {}).items())
    if partial:  # the other runs failed or are missing: their totals count in no mean
        partial = f" Totals are means over the runs that trained, not all of an arm's runs: {partial}."
    capped = ", ".join(f"{a} {n} of {runs}" for a, (n, runs) in (d.get("capped") or {}).items())
    if capped:
        capped = (
            f" Runs that stopped at the step cap (train.max_steps {d['max_steps']:,}) with minutes of the budget "
            f"left, so the arms did not get equal time: {capped}. Raise run.train.max_steps above what any arm reaches "
            "within the budget."
        )
    return _budget_kind(d) + partial + capped


def _budget_kind(d: dict) -> str:
    # each trained arm's tokens (FLOPs budget) or FLOPs (tokens budget); none where no run trained
    spent = ", ".join(f"{a} {_fmt_num(v)}" for a, v in d["spent"].items())
    if d["budget_kind"] == "flops":
        return (
            f"The budget is FLOPs ({d['amount']:.3g} per arm): an arm that costs less per token trains on more "
            f"tokens{f' ({spent})' if spent else ''}. That is the comparison that holds compute equal."
        )
    if d["budget_kind"] == "tokens":
        return (
            "The budget is tokens: arms that cost more per token also used more compute"
            f"{f' (FLOPs: {spent})' if spent else ''}; for claims across objectives, a FLOPs budget "
            "(budget.kind=flops) holds compute equal."
        )
    return (
        "The budget is wall-clock time, on a machine shared with other work: the steps each arm got carry that noise."
    )


def _method(d: dict) -> str:
    fams = d["families"]
    parts = []
    for family in (PRIMARY, SECONDARY):
        f = fams.get(family)
        if f:
            parts.append(
                f"the {family} family ({f['what']}: {f['comparisons']} comparison(s), {f['replicates']:,} "
                f"replicates; the smallest adjusted p it can reach is {fmt_p(f['floor'])}"
                + (", so nothing in it can be significant" if f["floor"] >= d["alpha"] else "")
                + ")"
            )
    head = (
        f"Intervals are 95% paired-bootstrap intervals over dev examples and the {d['seeds']} pretraining "
        f"seed(s), arms paired by seed, averaged over {d['downstream_seeds']} downstream seed(s). 'Significant' "
        f"means a Holm-adjusted p below {d['alpha']} within its family: "
    )
    if not parts:
        return head + "there is nothing to compare."
    return (
        head
        + "; ".join(parts)
        + "."
        + ("" if PRIMARY in fams else f" There is no random-encoder arm ('{BASELINE}'), so no primary family.")
    )


def _few_seeds(d: dict) -> str:
    advice = (
        f"for claims about the objectives, set `seeds:` to {d['needed']} or more"
        if d["needed"] is not None
        else "for claims about the objectives, split the comparisons into smaller families"
    )
    if d["seeds"] <= 1:
        return (
            "With one pretraining seed per arm the intervals leave out the run-to-run variance of pretraining "
            f"itself, so they are too narrow, and no test across seeds is possible: {advice}."
        )
    seed_test = (
        f"a test across seeds cannot give p below {d['seed_floor']:.3g} (2/2^{d['seeds']})"
        if d["seed_floor"] is not None
        else f"a test across seeds needs at least {SEED_TEST_MIN} and cannot give p below 2/2^n"
    )
    needs = "; ".join(
        f"the {f} family's {v['comparisons']} comparison(s) need "
        + (f"{v['needed']} seeds" if v["needed"] is not None else "more than any number of seeds can give")
        + (f", and pair up only {v['seeds']} (runs failed or are missing)" if "seeds" in v else "")
        for f, v in d["families"].items()
    )
    return (
        f"With {d['seeds']} pretraining seeds per arm the bootstrap can draw only {d['seed_draws']:,} distinct sets "
        f"of seeds per arm, and {seed_test}; Holm multiplies that by the family's size, so a difference can hold "
        f"across seeds only with m x 2/2^n below {d['alpha']}"
        + (f" ({needs})" if needs else "")
        + f". Significant differences hold for these pretraining runs; {advice}."
    )


def _task(d: dict) -> str:
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


def _uncorrected(d: dict) -> str:
    items = ", ".join(f"{i['a']} on {i['task']} ({i['mode']}) {i['diff']:+.3f}" for i in d["items"][:LISTED])
    return (
        f"Before correction, {len(d['items'])} of the {d['total']} comparisons with the random encoder have a p "
        f"below {d['alpha']} ({items}); about {d['total'] * d['alpha']:.1f} would by chance alone, and Holm's "
        "correction within their family does not keep them."
    )


def _nothing_separates(d: dict) -> str:
    return f"None of the {d['comparisons']} comparisons is significant: at this budget these numbers cannot tell " + (
        "the arms apart, nor any arm from the random encoder." if d.get("baseline", True) else "the arms apart."
    )


def _none_above_random(d: dict) -> str:
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


def _pairs(d: dict) -> str:
    sig, rest = d["significant"], d["total"] - len(d["significant"])
    if not sig:
        return f"No pair of pretrained arms differs significantly ({d['total']} pair(s) compared)."
    return (
        "Pairs of pretrained arms that differ: "
        + _names(sig, pair=True)
        + "."
        + (f" The other {rest} pair(s) are within noise." if rest else "")
    )


def _seeds_untested(d: dict) -> str:
    shown = "; ".join(
        f"{i['a']} vs {i['b']} on {i['task']} ({i['mode']}) " + ", ".join(f"{x:+.3f}" for x in i["seed_diffs"])
        for i in d["items"][:LISTED]
    )
    return (
        f"The significant differences are tested over dev examples; with {d['seeds']} pretraining seed(s) none "
        f"is tested across seeds (that needs {SEED_TEST_MIN}). Their differences seed by seed: {shown}."
    )


def _seed_level(d: dict) -> str:
    parts = []
    if d["held"]:
        parts.append("these hold: " + _names(d["held"], False, pair=True))
    if d["not_held"]:
        parts.append(
            "these do not: "
            + ", ".join(
                f"{i['a']} vs {i['b']} on {i['task']} ({i['mode']}, p {fmt_p(i['seed_p_holm'])})"
                for i in d["not_held"][:LISTED]
            )
        )
    if d["seeds_only"]:
        parts.append("significant across seeds only: " + _names(d["seeds_only"], False, pair=True))
    if d.get("untested"):
        parts.append(
            f"not tested (fewer than {SEED_TEST_MIN} seeds paired up, runs failed or missing): "
            + _names(d["untested"], False, pair=True)
        )
    closed = [f"{f} ({x:.3g})" for f, x in d["family_floors"].items() if x >= ALPHA]
    fewest = d.get("fewest", d["seeds"])
    seeds = f"{d['seeds']}" if fewest == d["seeds"] else f"{fewest} to {d['seeds']}"
    return (
        f"Across the {seeds} pretraining seeds ("
        + ("fewer where runs failed or are missing; " if fewest != d["seeds"] else "")
        + "exact sign-flip test over the per-seed differences, Holm "
        f"within each family; it cannot give p below {d['floor']:.3g}"
        + (f" with {d['seeds']} seeds, {sign_flip_floor(fewest):.3g} with {fewest}" if fewest != d["seeds"] else "")
        + "): "
        + "; ".join(parts)
        + "."
        + (
            f" The smallest adjusted p across seeds is not below {ALPHA} in the {' and '.join(closed)} "
            f"family: no comparison there can hold across {fewest} seeds."
            if closed
            else ""
        )
    )


def _diverged(d: dict) -> str:
    shown = "; ".join(f"{i['arm']} on {i['task']} ({i['mode']}): {i['runs']} of {i['of']}" for i in d["items"])
    return (
        "Some fine-tunings diverged (non-finite dev predictions), and are scored as a constant prediction is, "
        f"correlation 0, which lowers their arm's score: {shown}. A smaller learning rate (`eval.lr`, or a sweep "
        "with `eval.lrs`) may keep them finite."
    )


def _detectable(d: dict) -> str:
    families = {i["family"] for i in d["items"]}  # primary: against `none`; without it, the pairs of arms
    what = (
        "a comparison with the random encoder"
        if families == {PRIMARY}
        else "a comparison between pretrained arms"
        if PRIMARY not in families
        else "a comparison (with the random encoder where a task has one, else between pretrained arms)"
    )
    ms = {i["m"] for i in d["items"]}
    items = ", ".join(
        f"{i['task']} {i['mde']:.3f} ({i['metric']}, {i['examples']:,} dev examples"
        + ("" if len(ms) == 1 else f", m = {i['m']}")
        + ")"
        for i in d["items"]
    )
    first = d["items"][0]
    level = f"alpha/m = {d['alpha']}/{first['m']}" if len(ms) == 1 else f"alpha/m ({d['alpha']} over its family's m)"
    return (
        f"Smallest gap {what} can find with {d['power']:.0%} power in the {first['mode']} mode, at {level}, from each "
        f"task's dev set and bootstrap variance: {items}. Smaller gaps may be real and still not show."
    )


def _rtd_auc(d: dict) -> str:
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


def _probe(d: dict) -> str:
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


def _loss_levels(d: dict) -> str:
    return (
        f"Pretraining losses of different objectives ({', '.join(d['objectives'])}) are different quantities: "
        "compare an arm's curve with itself, not levels across arms."
    )


# Kind -> its wording; every kind in report_notes.NOTE_KINDS has one (a test checks).
WORDING = {
    "scale": _scale,
    "cost": _cost,
    "budget": _budget,
    "method": _method,
    "few_seeds": _few_seeds,
    "task": _task,
    "uncorrected": _uncorrected,
    "nothing_separates": _nothing_separates,
    "none_above_random": _none_above_random,
    "pairs": _pairs,
    "seeds_untested": _seeds_untested,
    "seed_level": _seed_level,
    "diverged": _diverged,
    "detectable": _detectable,
    "rtd_auc": _rtd_auc,
    "probe": _probe,
    "loss_levels": _loss_levels,
}


def render_note(kind: str, d: dict) -> str:
    """The one place notes become prose."""
    if kind not in WORDING:
        raise ValueError(f"no wording for a note of kind '{kind}'")
    return WORDING[kind](d)
