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

The stages live apart: `report_numbers` (cells, comparisons, families, detectable effects, pretraining totals),
`report_notes` (the note records), `report_render` (their wording), `report_plots`; this module writes the report
and re-exports their public names.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pretrain.core.files import write_atomic
from pretrain.core.provenance import collect, summary, write_provenance
from pretrain.evaluation.report_notes import (
    BERT_BASE_TOKENS,
    EARLY,
    ELECTRA_SMALL_TOKENS,
    NOTE_KINDS,
    Note,
    notes,
)
from pretrain.evaluation.report_numbers import (
    BASELINE,
    PRIMARY,
    SECONDARY,
    SEED_TEST_MIN,
    Cell,
    Comparison,
    adjust,
    cells,
    comparisons,
    detectable,
    families,
    main_mode,
    planned,
    pretraining,
    seed_differences,
)
from pretrain.evaluation.report_plots import plot_downstream, plot_losses, plot_significance
from pretrain.evaluation.report_render import LISTED, _fmt_num, _fmt_time, fmt_p, render_note
from pretrain.evaluation.stats import ALPHA, POWER, metric_batch

__all__ = [
    "BASELINE",
    "BERT_BASE_TOKENS",
    "EARLY",
    "ELECTRA_SMALL_TOKENS",
    "LISTED",
    "NOTE_KINDS",
    "PRIMARY",
    "SECONDARY",
    "SEED_TEST_MIN",
    "Cell",
    "Comparison",
    "Note",
    "ablation_provenance",
    "adjust",
    "cells",
    "comparisons",
    "detectable",
    "families",
    "main_mode",
    "notes",
    "planned",
    "plot_downstream",
    "plot_losses",
    "plot_significance",
    "pretraining",
    "render_note",
    "run_on",
    "seed_differences",
    "write_report",
]


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
    # fine-tuning and probes compute in bf16 on a GPU, fp32 on a CPU (arms of older versions did not record it)
    fits = sorted({h["downstream_precision"] for h in hosts if h.get("downstream_precision")})
    fits_in = f"; fine-tuning and probes in {' and '.join(fits)}" if fits else ""
    shared = max(h.get("runs_per_device", 1) for h in hosts)  # launch.jobs over fewer devices
    if shared > 1:
        fits_in += f"; up to {shared} runs at a time shared a device (their wall times include the sharing)"
    return f"Run on: {devices}; {versions}; {when}{fits_in}" + (
        f" ({missing} arm(s) not recorded)." if missing else "."
    )


def ablation_provenance(ab, command: str | None = None) -> dict:
    """The reproducibility record of an ablation: the ablation config as run, each arm's resolved config (as written
    for it, budget applied), and the sha256 of the corpus, tokenizer, shards and task files."""
    import yaml

    from pretrain.core.parsing import to_dict

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
    """Compute every number from `results`, write results.json, provenance.json and the plots, then report.md."""
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
    # whole or not at all (a kill mid-write left a truncated results.json beside the previous report.md)
    write_atomic(out / "results.json", json.dumps(record, default=float))

    lines = header_lines(ab, results, command, provenance)
    lines += score_tables(ab, table, found, pre, main)
    lines += family_table(fams) + detectable_table(detect, main) + pretraining_table(pre) + figures_and_notes_heading()
    lines += [f"- {render_note(kind, data)}" for kind, data in found_notes]
    path = out / "report.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def header_lines(ab, results: dict, command: str | None, provenance: dict) -> list[str]:
    """Title, the command, where it ran, provenance, and the setup every arm shares."""
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
        f"{plan.get('global_batch', b.train.global_batch(1))}, "
        f"one tokenizer ({b.data.tokenizer_type}) and one set of shards from {', '.join(b.data.corpus)}. "
        f"Downstream: {', '.join(ab.eval['modes'])}"
        + (f" ({ab.eval['pooling']}-pooled features for probes)" if "probe" in ab.eval["modes"] else "")
        + f" on {', '.join(Path(t).name for t in ab.eval['tasks'])}, downstream seeds {ab.eval['seeds']}; dev scores.",
        "",
    ]
    return lines


def score_tables(ab, table: dict, found: list[Comparison], pre: dict, main: str) -> list[str]:
    """One table per downstream mode: each arm's score per task and its difference with the random encoder."""
    versus = {(c.mode, c.task, c.a): c for c in found if c.b == BASELINE}
    lines = []
    for mode, tasks in table.items():
        header = ["arm", "objectives"] + [
            h
            for t, cell in ((t, next(iter(a.values()))) for t, a in tasks.items())
            for h in (f"{t} ({cell.metric})", f"{t} vs none")
        ]
        title = f"### {mode}" + (" (primary)" if mode == main and any(c.family == PRIMARY for c in found) else "")
        lines += [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for arm in ab.groups():
            row = [arm, pre[arm]["objectives"] + _own_lr(ab, arm)]
            for task, arms in tasks.items():
                cell = arms.get(arm)
                row.append(f"{cell.mean:.3f} ± {cell.spread:.3f} (median {_median(cell):.3f})" if cell else "–")
                row.append(_versus_cell(versus.get((mode, task, arm))))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "Scores: mean over pretraining seeds ± their standard deviation (one seed: ± over downstream seeds); "
        "median: over downstream seeds, as GLUE papers report (averaged over pretraining seeds); lr: an arm's own "
        "pretraining learning rate, where it differs from the shared one. "
        "vs none: difference with its 95% paired-bootstrap interval; **✓**: Holm-adjusted p below "
        f"{ALPHA} within its family; seeds p: the Holm-adjusted p of the exact sign-flip test across pretraining "
        f"seeds (with {SEED_TEST_MIN} or more).",
    ]
    return lines


def _median(cell: Cell) -> float:
    """The median over downstream seeds of each pretraining seed's scores, averaged over pretraining seeds."""
    return float(np.median(metric_batch(cell.metric, cell.labels, cell.preds), axis=1).mean())


def _own_lr(ab, arm: str) -> str:
    """' (lr 5e-04)' for an arm pretrained at its own learning rate (ELECTRA's), else ''."""
    run = ab.groups()[arm][0]
    lr = run.cfg.train.lr
    return f" (lr {lr:g})" if run.pretrain and lr != ab.base.train.lr else ""


def _versus_cell(c: Comparison | None) -> str:
    if c is None:
        return "–"
    seeds = "" if c.seed_p_holm is None else f" seeds p {fmt_p(c.seed_p_holm)}"
    return f"{c.interval()}{' **✓**' if c.significant else ''}{seeds}"


def family_table(fams: dict) -> list[str]:
    """Per family: its size, replicates, and the smallest adjusted p it can reach (by bootstrap and across seeds)."""
    if not fams:
        return []
    lines = [
        "",
        "| family | comparisons | bootstrap replicates | smallest adjusted p it can reach | across seeds |",
        "|---|---|---|---|---|",
    ]
    for family, f in fams.items():
        seed_floor = (
            f"{f['seed_floor']:.3g} ({f['seeds']} seeds"
            + (f"; {f['seed_tested']} of the {f['comparisons']} tested" if f["seed_tested"] < f["comparisons"] else "")
            + ")"
            if f["seed_floor"] is not None
            else f"untested ({f['seeds']} seed(s); needs {SEED_TEST_MIN})"
        )
        lines.append(
            f"| {family}: {f['what']} | {f['comparisons']} | {f['replicates']:,} | {fmt_p(f['floor'])} | {seed_floor} |"
        )
    return lines


def detectable_table(detect: list[dict], main: str) -> list[str]:
    """Per task of the main mode: the smallest gap its comparisons can detect."""
    if not detect:
        return []
    return [
        "",
        f"| task ({main}) | dev examples | smallest detectable gap ({POWER:.0%} power, alpha/m) |",
        "|---|---|---|",
    ] + [f"| {d['task']} ({d['metric']}) | {d['examples']:,} | {d['mde']:.3f} (m = {d['m']}) |" for d in detect]


def pretraining_table(pre: dict) -> list[str]:
    """Per arm: final losses and the budget it spent."""
    lines = [
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
    return lines + [
        "",
        "Tokens are real (non-padding) tokens the trainer consumed; FLOPs are steps x the FLOPs of one step, "
        "counted by torch on a real batch of each arm (forward + backward); FLOPs per token is FLOPs / tokens, per "
        "real token (an arm's padding counts in its cost); wall time is training only.",
    ]


def figures_and_notes_heading() -> list[str]:
    return [
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
