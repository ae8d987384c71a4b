"""`pretrain compare RUN... --out DIR`: two or more runs side by side.

Every loss and metric the runs logged is a panel of its own, against tokens seen (`vs_tokens.png`) and against wall
time (`vs_time.png`); each run is a line in the panels of the keys it logged, so runs with different objectives
never share an axis for different losses. `compare.md` tables each run's final values, throughput (medians over its
log lines) and length; `compare.json` holds the same numbers.

Wall time: a record's `time` (seconds of training since the run began) where the records carry one; otherwise it is
rebuilt from the records themselves: each log line's tokens/s is measured over the interval since the line before,
so (tokens - previous tokens) / tokens_per_s is that interval's training time, and their running sum the time
since the start (set-up and checkpoint loading excluded, as in tokens/s).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pretrain.core.errors import UserError
from pretrain.core.files import replace_file, write_atomic
from pretrain.core.outputs import check_not_input, claim_output, mark_output
from pretrain.train.metrics import read_metrics

KIND = "compare"
X_AXES = ("step", "tokens", "time")  # what the panels are plotted against, never a panel themselves
THROUGHPUT = ("tokens_per_s", "tflops", "mfu", "data_wait")  # summarised by their medians, not their last values
COUNTERS = ("skipped_steps",)  # shown only where some run has a non-zero count: a flat 0 says nothing
FILES = ("compare.md", "compare.json", "vs_tokens.png", "vs_time.png")


@dataclass
class Run:
    path: Path
    label: str
    objectives: list[str]
    records: list[dict]
    seconds: list[float] | None = None  # wall time at each record; None when it cannot be known
    time_source: str = ""
    final: dict[str, float] = field(default_factory=dict)

    def series(self, key: str, axis: str) -> tuple[list[float], list[float]]:
        """(x, y) of `key` over the run's records, x being tokens seen or wall time; missing and non-finite values
        left out, and every value against a wall time the run's records do not give (`seconds` None)."""
        xs, ys = [], []
        if axis == "time" and self.seconds is None:
            return xs, ys
        for i, record in enumerate(self.records):
            value = record.get(key)
            if not _is_number(value) or not math.isfinite(value):
                continue
            x = self.seconds[i] if axis == "time" else record.get(axis)
            if x is None:
                continue
            xs.append(x)
            ys.append(value)
        return xs, ys


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------------------------------
# Reading the runs


def load_run(path: Path) -> Run:
    """A run directory's records and objectives; anything else is refused, naming it."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such run directory")
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a run directory")
    missing = [name for name in ("config.yaml", "metrics.jsonl") if not (path / name).is_file()]
    if missing:
        raise UserError(
            f"{path} is not a run directory: it has no {' or '.join(missing)} (give directories that `pretrain "
            "train` or `pretrain run` wrote, e.g. runs/NAME)"
        )
    try:
        config = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"{path / 'config.yaml'}: cannot be read as a run's config ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path / 'config.yaml'}: not a run's config (expected a mapping)")
    records = read_metrics(path)
    if not records:
        raise UserError(f"{path / 'metrics.jsonl'} holds no metrics yet: nothing to compare in {path}")
    objectives = list(config.get("objectives") or {})
    seconds, source = wall_times(records)
    run = Run(path, path.name, objectives, records, seconds, source)
    # the last line's, as compare.md says: a key that line holds as null (a grad norm not read, an AUC of nothing)
    # or lacks is none, not an earlier line's value passed for the final one
    run.final = {k: v for k, v in records[-1].items() if k not in X_AXES and _is_number(v)}
    return run


def wall_times(records: list[dict]) -> tuple[list[float] | None, str]:
    """Seconds since the run's start at each record, and where they come from (see the module's docstring)."""
    if all(_is_number(r.get("time")) for r in records):
        return [float(r["time"]) for r in records], "logged"
    seconds, total, previous = [], 0.0, 0
    for record in records:
        rate, tokens = record.get("tokens_per_s"), record.get("tokens")
        if not (_is_number(rate) and rate > 0 and _is_number(tokens)):
            return None, "unknown (a record without tokens or tokens/s)"
        total += max(tokens - previous, 0) / rate
        previous = tokens
        seconds.append(total)
    return seconds, "derived from tokens and tokens/s"


def _labels(paths: list[Path]) -> list[str]:
    """Each run's directory name, or more of its path where two names are the same."""
    labels = [p.name for p in paths]
    for depth in range(2, 64):
        clashes = {label for label in labels if labels.count(label) > 1}
        if not clashes:
            break
        labels = [str(Path(*p.parts[-depth:])) if label in clashes else label for p, label in zip(paths, labels)]
    return labels


def load_runs(paths: list[Path]) -> list[Run]:
    if len(paths) < 2:
        raise UserError(f"compare needs two or more run directories, got {len(paths)}")
    resolved = [Path(p).resolve() for p in paths]
    twice = sorted({str(p) for p, r in zip(paths, resolved) if resolved.count(r) > 1})
    if twice:
        raise UserError(f"run directory given more than once: {', '.join(twice)}")
    runs = [load_run(p) for p in paths]
    for run, label in zip(runs, _labels([Path(os.path.abspath(p)) for p in paths])):
        run.label = label
    return runs


# ----------------------------------------------------------------------------------------------
# What to show


def metric_keys(runs: list[Run]) -> list[str]:
    """Every numeric key any run logged, but the x axes: the total loss first, then each objective's losses and
    metrics, then the rest (lr, grad_norm, throughput, ...); COUNTERS only where one is not 0."""
    found: dict[str, bool] = {}
    for run in runs:
        for record in run.records:
            for key, value in record.items():
                if key not in X_AXES and _is_number(value):
                    found[key] = found.get(key, False) or value != 0 or key not in COUNTERS
    keys = [k for k, shown in found.items() if shown]

    def order(key: str):
        objective, _, metric = key.rpartition("/")
        return (key != "loss", not objective, objective, metric != "loss", metric)

    return sorted(keys, key=order)


def summary(run: Run) -> dict:
    def median(key: str) -> float | None:
        values = [r[key] for r in run.records if _is_number(r.get(key)) and math.isfinite(r[key])]
        return statistics.median(values) if values else None

    last = run.records[-1]
    return {
        "label": run.label,
        "path": str(run.path),
        "objectives": run.objectives,
        "steps": last["step"],
        "tokens": last.get("tokens"),
        "wall_time_s": run.seconds[-1] if run.seconds else None,
        "wall_time_source": run.time_source,
        **{f"median_{key}": median(key) for key in THROUGHPUT},
        "final": run.final,
    }


def _finite(value):
    """`value` with every non-finite float (nan, inf), at any depth, as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:  # a rate beside thousands (tokens/s): four decimals would claim a precision it has not
        return f"{value:.1f}"
    if abs(value) >= 0.01:
        return f"{value:.4f}"
    return f"{value:.3g}"


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _cell(text: str) -> str:
    """A table cell as markdown reads it: a '|' in a run's directory name began another column."""
    return text.replace("|", "\\|")


def table(runs: list[Run], summaries: list[dict], keys: list[str]) -> str:
    """Markdown: one column per run, one row per quantity."""
    rows = [
        ("directory", [f"`{s['path']}`" for s in summaries]),
        ("objectives", [", ".join(s["objectives"]) or "—" for s in summaries]),
        ("steps", [_fmt(s["steps"]) for s in summaries]),
        ("tokens seen", [_fmt(s["tokens"]) for s in summaries]),
        ("wall time" + ("*" if any(r.time_source != "logged" for r in runs) else ""), []),
        ("median tokens/s", [_fmt(s["median_tokens_per_s"]) for s in summaries]),
        ("median TFLOP/s per device", [_fmt(s["median_tflops"]) for s in summaries]),
        ("median MFU", [_fmt(s["median_mfu"]) for s in summaries]),
    ]
    rows[4][1].extend(_fmt_time(s["wall_time_s"]) for s in summaries)
    rows += [(f"final {key}", [_fmt(run.final.get(key)) for run in runs]) for key in keys if key not in THROUGHPUT]
    lines = ["| | " + " | ".join(_cell(r.label) for r in runs) + " |", "|---|" + "---:|" * len(runs)]
    lines += [f"| {name} | " + " | ".join(_cell(c) for c in cells) + " |" for name, cells in rows]
    return "\n".join(lines)


def report(runs: list[Run], summaries: list[dict], keys: list[str]) -> str:
    notes = []
    rebuilt = [r for r in runs if r.time_source != "logged" and r.seconds is not None]
    unknown = [r for r in runs if r.seconds is None]
    if rebuilt:
        notes.append(
            "\\* Wall time is the training time rebuilt from each log line's tokens and tokens/s (set-up and "
            "checkpoint loading not counted); " + "; ".join(f"{r.label}: {r.time_source}" for r in rebuilt) + "."
        )
    if unknown:
        notes.append(
            f"\\* Wall time is not known for {', '.join(r.label for r in unknown)}: no `time` in the records, and "
            "not every record has the tokens and tokens/s to rebuild it from (older logs); no line in the panels "
            "against wall time."
        )
    if any(s["median_mfu"] is None for s in summaries):
        notes.append("MFU is logged only where the device's peak is known (a table of GPUs, or `train.peak_tflops`).")
    if len({tuple(r.objectives) for r in runs}) > 1:
        notes.append(
            "The runs' objectives differ: `loss` is each run's weighted sum of its own objectives' losses, so compare "
            "its shape, not its level; each objective's loss and metrics have panels of their own."
        )
    return "\n".join(
        [
            "# Runs compared",
            "",
            "Final values are each run's last log line; throughput is the median over its log lines.",
            "",
            table(runs, summaries, keys),
            "",
            *[f"{n}\n" for n in notes],
            "## Against tokens seen",
            "",
            "![every loss and metric against tokens seen](vs_tokens.png)",
            "",
            "## Against wall time",
            "",
            "![every loss and metric against wall time](vs_time.png)",
            "",
        ]
    )


# ----------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[Run], keys: list[str], axis: str, path: Path) -> None:
    """One panel per key, each run a line where it logged that key; the colours of the runs are the same in every
    panel (one legend for the figure)."""
    plt = _pyplot()
    ncols = min(3, len(keys)) or 1
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.1 * nrows + 0.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, keys):
        drawn = False
        for i, run in enumerate(runs):
            xs, ys = run.series(key, axis)
            if xs:
                ax.plot(xs, ys, color=colors[i % len(colors)], lw=1.3, marker="o" if len(xs) < 12 else None, ms=3)
                drawn = True
        if not drawn:  # e.g. no run's wall time is known
            ax.text(0.5, 0.5, "not known for any run", ha="center", va="center", transform=ax.transAxes, fontsize=8)
        ax.set_title(key + (" (sum over each run's objectives)" if key == "loss" else ""), fontsize=9)
        ax.set_xlabel("tokens seen" if axis == "tokens" else "wall time (s)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors[i % len(colors)], lw=2) for i in range(len(runs))]
    labels = [r.label + (" (wall time not known)" if axis == "time" and r.seconds is None else "") for r in runs]
    fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 4), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    try:
        replace_file(path, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)


# ----------------------------------------------------------------------------------------------
# The command


def compare_runs(paths: list[Path], out: Path) -> tuple[Path, str]:
    """Read the runs (each refused, naming it, unless it is a run directory with metrics), write FILES into `out`
    (absent, empty, or an earlier comparison; never one of the runs nor a directory holding one). Returns (out, the
    markdown table)."""
    out = Path(out)
    runs = load_runs([Path(p) for p in paths])
    check_not_input(out, {f"the run {r.label}": r.path for r in runs})
    claim_output(out, KIND, "--out")
    keys = metric_keys(runs)
    summaries = [summary(r) for r in runs]
    mark_output(out, KIND)
    plot(runs, keys, "tokens", out / "vs_tokens.png")
    plot(runs, keys, "time", out / "vs_time.png")
    # strict JSON (jq, JavaScript): a non-finite value (a diverged loss, what one looks for here) is null
    text = json.dumps(_finite({"runs": summaries, "keys": keys}), indent=1, allow_nan=False)
    write_atomic(out / "compare.json", text + "\n")
    write_atomic(out / "compare.md", report(runs, summaries, keys))
    return out, table(runs, summaries, keys)
