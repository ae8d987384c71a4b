"""The ablation report: `<ablation>/report.md`, `loss_curves.png`, `downstream.png`, `significance.png` and
`results.json`.

Everything is computed from the runs' state.json (budget plan, spent budget, downstream scores and every dev
prediction) and metrics.jsonl (loss curves), so the report can be rebuilt without rerunning anything. Scores are means
over pretraining seeds (and the downstream seeds within each); every comparison is a paired bootstrap over dev
examples and pretraining seeds (`pretrain.evaluation.stats`), Holm-adjusted over all the comparisons of the report.
Every note is generated from these numbers (`notes`); none is written ahead of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.evaluation.stats import holm, metric_batch, paired_bootstrap

TYPICAL_BERT_TOKENS = 1.3e11  # BERT-base: 1M steps x 256 sequences x 512 tokens
SMALL_BERT_TOKENS = 4e9  # the smallest published BERTs (Turc et al. 2019, ELECTRA-small) see ~10^9-10^10 tokens
ALPHA = 0.05
BASELINE = "none"


@dataclass
class Cell:
    """One arm on one task in one downstream mode."""

    metric: str
    labels: np.ndarray  # [N] dev labels
    preds: np.ndarray  # [S, P, N]: pretraining seeds x downstream seeds x dev examples

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

    @property
    def significant(self) -> bool:
        return self.p_holm < ALPHA

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
                found = [s["downstream"][mode][task] for s in states if task in s.get("downstream", {}).get(mode, {})]
                if len({len(r["dev_predictions"]) for r in found}) != 1:
                    continue
                preds = np.array([r["dev_predictions"] for r in found])  # [S, P, N]
                out.setdefault(mode, {}).setdefault(task, {})[arm] = Cell(
                    found[0]["main_metric"], np.array(found[0]["dev_labels"]), preds
                )
    return out


def comparisons(table: dict) -> list[Comparison]:
    """Every arm against `none`, and every pair of pretrained arms, per mode and task; Holm over all of them."""
    found = []
    for mode, tasks in table.items():
        for task, arms in tasks.items():
            names = list(arms)
            pairs = [(a, BASELINE) for a in names if a != BASELINE and BASELINE in arms]
            trained = [a for a in names if a != BASELINE]
            pairs += [(a, b) for i, a in enumerate(trained) for b in trained[i + 1 :]]
            for a, b in pairs:
                ca, cb = arms[a], arms[b]
                r = paired_bootstrap(ca.metric, ca.labels, ca.preds, cb.preds)
                found.append(Comparison(mode, task, a, b, r["diff"], r["low"], r["high"], r["p"]))
    for c, adjusted in zip(found, holm([c.p for c in found])):
        c.p_holm = adjusted
    return found


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


def notes(ab, table: dict, found: list[Comparison], pre: dict) -> list[str]:
    """What this ablation can and cannot show, each sentence from its numbers."""
    lines = []
    trained = {a: v for a, v in pre.items() if v["steps"]}
    tokens = max((v["tokens"] for v in trained.values()), default=0)
    if tokens:
        lines.append(
            f"Each pretrained arm saw up to {_fmt_num(tokens)} tokens: {tokens / TYPICAL_BERT_TOKENS:.1e} of "
            f"BERT-base's ~1.3e11 and {tokens / SMALL_BERT_TOKENS:.1e} of the ~4e9 of the smallest published "
            "BERTs. These are results about the first phase of pretraining; rankings there need not hold "
            "at full scale."
        )
    base = trained.get("mlm") or next(iter(trained.values()), None)
    if base and base["flops_per_token"]:
        ref = "mlm" if "mlm" in trained else next(iter(trained))
        costs = ", ".join(
            f"{a} {v['flops_per_token'] / base['flops_per_token']:.2f}x"
            for a, v in trained.items()
            if v["flops_per_token"] and a != ref
        )
        if costs:
            lines.append(f"Training FLOPs per token relative to {ref} (counted on a real step of each arm): {costs}.")
    if ab.budget_kind == "flops":
        seen = ", ".join(f"{a} {_fmt_num(v['tokens'])}" for a, v in trained.items())
        lines.append(
            f"The budget is FLOPs ({ab.budget_amount:.3g} per arm): an arm that costs less per token trains "
            f"on more tokens ({seen}). That is the comparison that holds compute equal."
        )
    elif ab.budget_kind == "tokens":
        spent = ", ".join(f"{a} {_fmt_num(v['flops'])}" for a, v in trained.items())
        lines.append(
            f"The budget is tokens: arms that cost more per token also used more compute (FLOPs: {spent}); "
            "for claims across objectives, a FLOPs budget (budget.kind=flops) holds compute equal."
        )
    else:
        lines.append(
            "The budget is wall-clock time, on a machine shared with other work: the steps each arm got "
            "carry that noise."
        )

    seeds = len(ab.seeds)
    extra = (
        ""
        if seeds > 1
        else " With one pretraining seed per arm they leave out the run-to-run variance of "
        "pretraining itself, so they are too narrow: set `seeds:` to several for claims."
    )
    lines.append(
        f"Intervals are 95% paired-bootstrap intervals over dev examples and the {seeds} pretraining seed(s) "
        f"of each arm, averaged over {len(ab.eval['seeds'])} downstream seed(s); 'significant' means a "
        f"Holm-adjusted p below {ALPHA} over all {len(found)} comparisons of this report.{extra}"
    )

    versus = [c for c in found if c.b == BASELINE]
    for mode, tasks in table.items():
        for task in tasks:
            here = [c for c in versus if c.mode == mode and c.task == task]
            if not here:
                continue
            above = [c for c in here if c.significant and c.diff > 0]
            below = [c for c in here if c.significant and c.diff < 0]
            same = [c for c in here if not c.significant]
            parts = []  # the first part names the random encoder, the later ones say "it"
            for group, words in ((above, "above"), (below, "below")):
                if group:
                    what = "a random encoder" if not parts else "it"
                    parts.append(f"{words} {what}: " + ", ".join(f"{c.a} {c.interval()}" for c in group))
            if same and parts:
                parts.append("within noise of it: " + ", ".join(c.a for c in same))
            elif same:
                parts.append("every arm within noise of a random encoder (" + ", ".join(c.a for c in same) + ")")
            lines.append(f"{task} ({mode}, {next(iter(tasks[task].values())).metric}): " + "; ".join(parts) + ".")
    loose = [c for c in versus if c.p < ALPHA and not c.significant]
    if loose:  # what an uncorrected reading would claim, and why it does not hold
        lines.append(
            f"Before correction, {len(loose)} of the {len(versus)} comparisons with the random encoder have a p "
            f"below {ALPHA} ("
            + ", ".join(f"{c.a} on {c.task} ({c.mode}) {c.diff:+.3f}" for c in loose)
            + f"); about {len(versus) * ALPHA:.1f} would by chance alone, and Holm's correction over the report's "
            f"{len(found)} comparisons does not keep them."
        )
    if versus and not any(c.significant and c.diff > 0 for c in versus):
        lines.append(
            "No pretrained arm separates from the random encoder on any task and mode: at this budget these "
            "numbers cannot say which objective is better, only that none has yet beaten random features."
        )

    between = [c for c in found if c.b != BASELINE]
    if between:
        significant = [c for c in between if c.significant]
        if significant:
            rest = len(between) - len(significant)
            lines.append(
                "Pairs of pretrained arms that differ: "
                + "; ".join(f"{c.a} vs {c.b} on {c.task} ({c.mode}) {c.interval()}" for c in significant)
                + "."
                + (f" The other {rest} pair(s) are within noise." if rest else "")
            )
        else:
            lines.append(f"No pair of pretrained arms differs significantly ({len(between)} pairs compared).")

    rtd = pre.get("rtd") or next((v for a, v in pre.items() if "rtd" in v["objectives"].split(" + ")), None)
    if rtd and "rtd/disc_auc" in rtd["final"]:
        auc = rtd["final"]["rtd/disc_auc"]
        state = (
            "it detects replaced tokens"
            if auc >= 0.7
            else "it has barely begun to tell replaced tokens from real ones"
            if auc >= 0.55
            else "it is near its base rate (below 0.55), so it has not yet learned to detect replaced tokens; "
            "ELECTRA's discriminator can sit there for thousands of steps (benchmarks/RESULTS.md)"
        )
        lines.append(f"The ELECTRA discriminator ended pretraining at AUC {auc:.3f} (0.5 = chance): {state}.")
    if "probe" in table:
        lines.append(
            "Probe scores are linear probes on frozen, mean-pooled features: they measure what the features "
            "already encode, and are well below fine-tuned scores."
        )
    lines.append(
        "Pretraining losses of different objectives are different quantities (a 15%-masked MLM cross-entropy, "
        "an all-token RTD binary cross-entropy, ...): compare an arm's curve with itself, not levels across "
        "arms."
    )
    return lines


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
    ax.set_xlabel("score minus the random encoder's\n(95% paired bootstrap interval; filled: Holm p < 0.05)")
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


def write_report(ab, results: dict, command: str | None = None) -> Path:
    out = ab.out
    table = cells(ab, results)
    found = comparisons(table)
    pre = pretraining(ab, results)
    plot_losses(ab, out / "loss_curves.png")
    plot_downstream(ab, table, out / "downstream.png")
    plot_significance(found, out / "significance.png")
    (out / "results.json").write_text(json.dumps({"runs": results, "comparisons": [vars(c) for c in found]}))

    b = ab.base
    plan = next((s["plan"] for s in results.values() if s.get("plan", {}).get("max_steps")), {})
    unit = {"tokens": "tokens (sequence slots)", "flops": "training FLOPs", "time": "minutes"}[ab.budget_kind]
    lines = [f"# Pretraining-objective ablation: {ab.out.name}", ""]
    if command:
        lines += ["Made with:", "", "```bash", command, "```", ""]
    lines += [run_on(results), ""]
    lines += [
        f"Budget: **{ab.budget_amount:g} {unit} per arm**, pretraining seeds {ab.seeds}. Shared: encoder "
        f"{b.model.num_layers} layers x {b.model.hidden_size} hidden ({b.model.num_heads} heads), sequences of "
        f"{b.data.max_seq_len} tokens, global batch "
        f"{plan.get('global_batch', b.train.micro_batch_size * b.train.grad_accum_steps)}, "
        f"one tokenizer ({b.data.tokenizer_type}) and one set of shards from {', '.join(b.data.corpus)}. "
        f"Downstream: {', '.join(ab.eval['modes'])} ({ab.eval['pooling']}-pooled features for probes) on "
        f"{', '.join(Path(t).name for t in ab.eval['tasks'])}, downstream seeds {ab.eval['seeds']}; dev scores.",
        "",
    ]
    versus = {(c.mode, c.task, c.a): c for c in found if c.b == BASELINE}
    for mode, tasks in table.items():
        header = ["arm", "objectives"] + [
            h
            for t, cell in ((t, next(iter(a.values()))) for t, a in tasks.items())
            for h in (f"{t} ({cell.metric})", f"{t} vs none")
        ]
        lines += [f"### {mode}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for arm in ab.groups():
            row = [arm, pre[arm]["objectives"]]
            for task, arms in tasks.items():
                cell = arms.get(arm)
                row.append(f"{cell.mean:.3f} ± {cell.spread:.3f}" if cell else "–")
                c = versus.get((mode, task, arm))
                row.append("–" if c is None else f"{c.interval()}{' **✓**' if c.significant else ''}")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "Scores: mean over pretraining seeds ± their standard deviation (one seed: ± over downstream seeds). "
        "vs none: difference with its 95% paired-bootstrap interval; **✓**: significant after Holm's correction "
        "over every comparison in this report.",
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
    lines += [f"- {n}" for n in notes(ab, table, found, pre)]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
