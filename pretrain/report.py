"""The ablation report: `<ablation>/report.md`, `loss_curves.png`, `downstream.png` and `results.json`.

Everything is computed from the arms' state.json (budget plan, spent budget, downstream scores) and
metrics.jsonl (loss curves), so the report can be rebuilt without rerunning anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

TYPICAL_BERT_TOKENS = 1.3e11  # BERT-base: 1M steps x 256 sequences x 512 tokens
SMALL_BERT_TOKENS = 4e9  # the smallest published BERTs (Turc et al. 2019, ELECTRA-small) see ~10^9-10^10 tokens


def _fmt_num(x: float) -> str:
    if x == 0:
        return "0"
    exp = int(math.floor(math.log10(abs(x))))
    return f"{x:,.0f}" if exp < 6 else f"{x / 10**exp:.2f}e{exp}"


def _fmt_time(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _task_columns(results: dict) -> list[tuple[str, str]]:
    """(task, main metric) in first-seen order."""
    cols: dict[str, str] = {}
    for state in results.values():
        for task, r in state.get("downstream", {}).items():
            cols.setdefault(task, r["main_metric"])
    return list(cols.items())


def _objectives(ab, name: str) -> str:
    arm = next(a for a in ab.arms if a.name == name)
    return "none (random init)" if not arm.pretrain else " + ".join(arm.cfg.objectives)


def plot_losses(ab, results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pretrain.metrics import read_metrics

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in ab.arms:
        records = read_metrics(arm.cfg.run_dir) if arm.pretrain else []
        if records:
            ax.plot([r["tokens"] for r in records], [r["loss"] for r in records], label=f"{arm.name}", lw=1.4)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("pretraining loss (sum over the arm's objectives)")
    ax.set_title("Pretraining loss per arm (objectives differ: compare shapes, not levels)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_downstream(ab, results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = _task_columns(results)
    names = [a.name for a in ab.arms if a.name in results]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(tasks) * len(names) / 2 + 2), 4.2))
    width = 0.8 / max(1, len(names))
    x = np.arange(len(tasks))
    for i, name in enumerate(names):
        ds = results[name].get("downstream", {})
        means = [ds[t]["summary"][m]["mean"] if t in ds else np.nan for t, m in tasks]
        stds = [ds[t]["summary"][m]["std"] if t in ds else 0 for t, m in tasks]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, means, width, yerr=stds, capsize=3, label=name)
    ax.set_xticks(x, [f"{t}\n({m})" for t, m in tasks])
    ax.set_ylabel("dev score (mean +- std over seeds)")
    ax.set_title(f"Downstream, {ab.eval['mode']} mode, seeds {ab.eval['seeds']}", fontsize=9)
    ax.axhline(0, color="black", lw=0.5)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(len(names), 4))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def budget_notes(ab, results: dict) -> list[str]:
    """What the budget can and cannot show, from the numbers of this ablation."""
    trained = [s["pretraining"] for n, s in results.items() if s.get("pretraining", {}).get("steps")]
    tokens = max((p["tokens_seen"] for p in trained), default=0)
    notes = []
    if tokens:
        notes.append(f"Each pretrained arm saw about {_fmt_num(tokens)} tokens: "
                     f"{tokens / TYPICAL_BERT_TOKENS:.1e} of BERT-base's ~1.3e11 and {tokens / SMALL_BERT_TOKENS:.1e} "
                     f"of the ~4e9 of the smallest published BERTs. Results are about the very first phase of "
                     "pretraining; rankings there need not hold at full scale (objectives with denser signal, "
                     "e.g. RTD, are known to lead early).")
    # the smallest gap that the seed spread lets us call real, per task
    for task, metric in _task_columns(results):
        scores = {n: s["downstream"][task]["summary"][metric] for n, s in results.items() if task in s.get("downstream", {})}
        if len(scores) < 2:
            continue
        spread = max(v["std"] for v in scores.values())
        ranked = sorted(scores.items(), key=lambda kv: -kv[1]["mean"])
        (best, b), (second, c) = ranked[0], ranked[1]
        gap = b["mean"] - c["mean"]
        verdict = ("larger than 2 std: likely real for this setup" if spread and gap > 2 * spread
                   else "within 2 std: not significant")
        notes.append(f"{task} ({metric}): best {best} {b['mean']:.3f}, next {second} {c['mean']:.3f}; gap "
                     f"{gap:.3f}, largest seed std {spread:.3f} ({verdict}).")
    notes.append("Differences smaller than about 2 standard deviations over seeds are not significant. "
                 f"With {len(ab.eval['seeds'])} seeds the std itself is a rough estimate.")
    if ab.eval["mode"] == "probe":
        notes.append("Downstream scores are linear probes on a frozen encoder: the seeds vary only the probe's "
                     "initialisation and batch order, not pretraining, so the error bars understate the real "
                     "run-to-run variance (each arm was pretrained once, with one seed). Probes measure what the "
                     "features already encode; full fine-tuning can change rankings, and absolute scores are "
                     "well below fine-tuned BERT's.")
    kind = ab.budget_kind
    if kind == "tokens":
        notes.append("The budget is tokens, so arms that cost more per token (ELECTRA's generator, PLM's second "
                     "stream, an NSP/SOP head) used more FLOPs and time: see the FLOPs and time columns before "
                     "calling an objective better per unit of compute.")
    elif kind == "flops":
        notes.append("The budget is FLOPs: cheaper objectives take more steps and see more tokens.")
    else:
        notes.append("The budget is wall-clock time on a machine shared with other work: timings, and so the "
                     "steps each arm got, carry that noise. The learning rate decays over train.max_steps, "
                     "not over the time budget.")
    notes.append("Pretraining losses of different objectives are different quantities (a 15%-masked MLM CE, an "
                 "all-token RTD BCE, ...): compare an arm's curve with itself, not levels across arms.")
    return notes


def write_report(ab, results: dict, command: str | None = None) -> Path:
    out = ab.out
    plot_losses(ab, results, out / "loss_curves.png")
    plot_downstream(ab, results, out / "downstream.png")
    (out / "results.json").write_text(json.dumps(results, indent=1))

    tasks = _task_columns(results)
    header = (["arm", "objectives"] + [f"{t} ({m})" for t, m in tasks]
              + ["final pretraining loss", "steps", "tokens", "wall time", "FLOPs"])
    rows = []
    for arm in ab.arms:
        s = results.get(arm.name)
        if s is None:
            continue
        p = s.get("pretraining", {})
        ds = s.get("downstream", {})
        scores = [f"{ds[t]['summary'][m]['mean']:.3f} ± {ds[t]['summary'][m]['std']:.3f}" if t in ds else "–"
                  for t, m in tasks]
        losses = p.get("final_loss", {})
        loss = ", ".join(f"{k.split('/')[0]} {v:.3f}" for k, v in losses.items() if k != "loss") or "–"
        if s.get("failed"):
            loss = f"FAILED: {s['failed'][:80]}"
        rows.append([arm.name, _objectives(ab, arm.name), *scores, loss, str(p.get("steps", 0)),
                     _fmt_num(p.get("tokens_seen", 0)), _fmt_time(p.get("wall_s", 0.0)), _fmt_num(p.get("flops", 0))])

    plan = next((s["plan"] for s in results.values() if s.get("plan", {}).get("max_steps")), {})
    unit = {"tokens": "tokens (sequence slots)", "flops": "FLOPs", "time": "minutes"}[ab.budget_kind]
    lines = [f"# Pretraining-objective ablation: {ab.out.name}", ""]
    if command:
        lines += ["Made with:", "", "```bash", command, "```", ""]
    b = ab.base
    lines += [f"Budget: **{ab.budget_amount:g} {unit} per arm**. Shared: encoder {b.model.num_layers} layers x "
              f"{b.model.hidden_size} hidden ({b.model.num_heads} heads), sequences of {b.data.max_seq_len} tokens, "
              f"global batch {plan.get('global_batch', b.train.micro_batch_size * b.train.grad_accum_steps)}, "
              f"seed {b.train.seed}, one tokenizer ({b.data.tokenizer_type}) and one set of shards from "
              f"{', '.join(b.data.corpus)}. Downstream: {ab.eval['mode']} "
              f"({ab.eval['pooling']}-pooled features) on {', '.join(t for t, _ in tasks)}, seeds {ab.eval['seeds']}; "
              "dev scores, mean ± std over seeds.", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Tokens are real (non-padding) tokens the trainer consumed; FLOPs are steps x the FLOPs of one "
              "step, counted by torch on a real batch of each arm (forward + backward); wall time is training "
              "only (this machine, shared).", "",
              "![pretraining loss per arm](loss_curves.png)", "", "![downstream scores](downstream.png)", "",
              "## What this budget can and cannot show", ""]
    lines += [f"- {n}" for n in budget_notes(ab, results)]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
