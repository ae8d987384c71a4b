"""The ablation report's plots: pretraining loss curves, downstream scores per arm, and each arm minus the random
encoder with its interval."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pretrain.core.files import replace_file
from pretrain.evaluation.report_numbers import BASELINE, Comparison


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
    replace_file(path, lambda tmp: fig.savefig(tmp, dpi=120))  # a failed write keeps the previous plot
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
    replace_file(path, lambda tmp: fig.savefig(tmp, dpi=120))  # a failed write keeps the previous plot
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
    replace_file(path, lambda tmp: fig.savefig(tmp, dpi=120))  # a failed write keeps the previous plot
    plt.close(fig)
