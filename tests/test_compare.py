"""`pretrain compare`: two real runs with different objectives give a panel per loss and metric (PNG, against tokens
and wall time) and a table whose final values are the runs' metrics.jsonl; what is not a run is refused, naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import run_cli

from pretrain.core.errors import UserError
from pretrain.evaluation.compare import compare_runs, wall_times
from pretrain.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """mlm, and mlm + sop on the same tokenizer: a few steps each."""
    tmp = tmp_path_factory.mktemp("runs")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    common = [
        "--no-demo",
        f"output_dir={tmp}",
        f"data.corpus=[{corpus}]",
        "data.vocab_size=512",
        "model.num_layers=1",
        "train.max_steps=6",
        "train.log_every=2",
        "train.save_every=0",
    ]
    run_cli("run", "tiny", *common, "name=mlm", cwd=tmp)
    sop = ["name=mlm-sop", "objectives.sop.weight=1", f"data.tokenizer={tmp}/mlm/tokenizer"]
    run_cli("run", "tiny", *common, *sop, cwd=tmp)
    return tmp / "mlm", tmp / "mlm-sop"


def table_rows(markdown: str) -> dict[str, list[str]]:
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("| |"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_compare_plots_every_metric_and_tables_the_final_values(runs, tmp_path):
    mlm, sop = runs
    proc = run_cli("compare", mlm, sop, cwd=tmp_path)  # --out defaults to ./compare
    out = tmp_path / "compare"
    for name in ("vs_tokens.png", "vs_time.png"):
        assert (out / name).read_bytes()[:8] == PNG and (out / name).stat().st_size > 10_000
    report = (out / "compare.md").read_text()
    assert "final loss" in proc.stdout and "vs_tokens.png" in report and "vs_time.png" in report
    rows = table_rows(report)
    summary = {s["label"]: s for s in json.loads((out / "compare.json").read_text())["runs"]}
    keys = json.loads((out / "compare.json").read_text())["keys"]
    assert {"loss", "mlm/loss", "mlm/accuracy", "sop/loss", "sop/accuracy", "tokens_per_s"} <= set(keys)

    for column, run in enumerate(runs):
        records = read_metrics(run)
        last = records[-1]
        info = summary[run.name]
        assert info["steps"] == last["step"] == 6 and info["tokens"] == last["tokens"]
        assert rows["steps"][column] == "6" and rows["tokens seen"][column] == f"{last['tokens']:,}"
        assert info["final"]["loss"] == last["loss"]
        assert math.isclose(float(rows["final loss"][column]), last["loss"], abs_tol=5e-5)
        assert math.isclose(float(rows["final mlm/loss"][column]), last["mlm/loss"], abs_tol=5e-5)
        rates = sorted(r["tokens_per_s"] for r in records)
        assert info["median_tokens_per_s"] == rates[len(rates) // 2]
        # the records' logged training time (seconds since the run began, over resumes)
        assert info["wall_time_source"] == "logged" and info["wall_time_s"] == last["time"]
    # the mlm run has no sop panel line nor value; the mlm+sop run has both
    assert rows["final sop/loss"][0] == "—"
    assert math.isclose(float(rows["final sop/loss"][1]), read_metrics(sop)[-1]["sop/loss"], abs_tol=5e-5)
    assert rows["objectives"] == ["mlm", "mlm, sop"]

    # again into the same directory: ours, so replaced
    (out / "compare.md").unlink()
    assert compare_runs([sop, mlm], out)[0] == out and (out / "compare.md").is_file()


@pytest.mark.slow
def test_what_is_not_a_run_is_refused(runs, tmp_path):
    mlm, sop = runs
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    proc = run_cli("compare", mlm, notes, "--out", tmp_path / "cmp", cwd=tmp_path, rc=2)
    assert proc.stderr.startswith(f"error: {notes} is not a run directory: it has no config.yaml or metrics.jsonl")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "cmp").exists()

    for args, message in [
        ((mlm,), "compare needs two or more run directories, got 1"),
        ((mlm, tmp_path / "gone"), f"{tmp_path / 'gone'}: no such run directory"),
        ((mlm, notes / "todo.txt"), "todo.txt is a file, not a run directory"),
        ((mlm, mlm), "run directory given more than once"),
    ]:
        with pytest.raises(UserError, match=message):
            compare_runs(list(args), tmp_path / "cmp")
    with pytest.raises(UserError, match="an input of this command"):
        compare_runs([mlm, sop], mlm.parent)  # would hold the runs
    with pytest.raises(UserError, match="todo.txt"):
        compare_runs([mlm, sop], notes)  # not ours
    assert not (tmp_path / "cmp").exists() and [p.name for p in notes.iterdir()] == ["todo.txt"]


def test_wall_time_prefers_a_logged_time():
    records = [{"step": 1, "tokens": 100, "tokens_per_s": 50.0}, {"step": 2, "tokens": 400, "tokens_per_s": 100.0}]
    assert wall_times(records) == ([2.0, 5.0], "derived from tokens and tokens/s")
    timed = [{**r, "time": t} for r, t in zip(records, (1.5, 9.0))]
    assert wall_times(timed) == ([1.5, 9.0], "logged")
    assert wall_times([{"step": 1, "tokens": 10}])[0] is None


def _run_dir(path: Path, records: list[dict]) -> Path:
    """A run directory of `records` (an mlm run's config and metrics.jsonl), as `pretrain train` leaves one."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("objectives: {mlm: {weight: 1.0}}\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_runs_without_a_known_wall_time_are_compared(tmp_path):
    """Older logs carry no `time`, and their first line no tokens/s: such a run's wall time cannot be known. It has
    no line against wall time and a '—' in the table, said in a note; the rest is compared (it raised TypeError)."""
    from pretrain.evaluation.compare import load_run

    losses = [(2, 1024, 7.0), (4, 2048, 6.9), (6, 3072, 6.8)]
    old = [{"step": s, "tokens": t, "loss": x, **({"tokens_per_s": 2000.0} if s > 2 else {})} for s, t, x in losses]
    timed = [{"step": s, "tokens": t, "loss": x - 0.1, "time": s * 1.5} for s, t, x in losses]
    old_dir, old2_dir = _run_dir(tmp_path / "old", old), _run_dir(tmp_path / "old2", old)
    new_dir = _run_dir(tmp_path / "new", timed)
    assert load_run(old_dir).series("loss", "time") == ([], [])
    assert load_run(old_dir).series("loss", "tokens") == ([1024, 2048, 3072], [7.0, 6.9, 6.8])

    out, _ = compare_runs([old_dir, new_dir], tmp_path / "cmp")
    for name in ("vs_tokens.png", "vs_time.png"):
        assert (out / name).read_bytes()[:8] == PNG
    summary = {s["label"]: s for s in json.loads((out / "compare.json").read_text())["runs"]}
    assert summary["old"]["wall_time_s"] is None and summary["old"]["wall_time_source"].startswith("unknown")
    assert summary["new"]["wall_time_s"] == 9.0 and summary["old"]["final"]["loss"] == 6.8
    report = (out / "compare.md").read_text()
    assert table_rows(report)["wall time*"] == ["—", "9.0 s"]
    assert "Wall time is not known for old:" in report and "rebuilt" not in report

    out, _ = compare_runs([old_dir, old2_dir], tmp_path / "cmp2")  # no run's wall time known: empty panels
    assert (out / "vs_time.png").read_bytes()[:8] == PNG
    assert "Wall time is not known for old, old2:" in (out / "compare.md").read_text()


def test_a_run_directory_named_with_a_pipe_keeps_the_tables_columns(tmp_path):
    """A '|' in a run's directory name began another column: its values sat under the next run's header."""
    records = [{"step": s, "tokens": 512 * s, "loss": 7.0 - s / 10, "time": float(s)} for s in (2, 4)]
    runs = [_run_dir(tmp_path / "a|x", records), _run_dir(tmp_path / "b", records)]
    out, _ = compare_runs(runs, tmp_path / "cmp")
    lines = [line for line in (out / "compare.md").read_text().splitlines() if line.startswith("|")]
    assert {len(line.replace("\\|", "").split("|")) for line in lines} == {5}, lines  # 3 columns
    assert table_rows((out / "compare.md").read_text().replace("\\|", "/"))["final loss"] == ["6.6000", "6.6000"]


def test_final_values_are_the_last_lines_and_compare_json_is_strict(tmp_path):
    """A key the last line holds as null (a grad norm not read) showed an earlier line's value as the final one; a
    non-finite loss made compare.json unreadable to strict parsers (jq, JavaScript): it is null there."""
    records = [
        {"step": 2, "tokens": 1024, "loss": 7.0, "grad_norm": 1.8, "time": 1.0},
        {"step": 4, "tokens": 2048, "loss": float("nan"), "grad_norm": None, "time": 2.0},
    ]
    out, _ = compare_runs([_run_dir(tmp_path / "a", records), _run_dir(tmp_path / "b", records[:1])], tmp_path / "c")
    rows = table_rows((out / "compare.md").read_text())
    assert rows["final grad_norm"] == ["—", "1.8000"] and rows["final loss"] == ["nan", "7.0000"]
    text = (out / "compare.json").read_text()
    summary = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in compare.json"))
    assert summary["runs"][0]["final"]["loss"] is None and "grad_norm" not in summary["runs"][0]["final"]
