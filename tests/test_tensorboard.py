"""tensorboard.enabled: the scalars of every metrics.jsonl record, at their steps, in TensorBoard event files under
<run>/tensorboard (read back with TensorBoard's own reader); a resume hides what it retrains; asking for it without
the package is a one-line error before anything is written."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from pretrain.core.errors import ConfigError
from pretrain.train.metrics import MetricsLogger, read_metrics

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
ON = {"tensorboard": {"enabled": True}}


def read_events(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard shows them (orphaned steps of a restart purged)."""
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    events = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    for tag, pairs in events.items():
        assert len({step for step, _ in pairs}) == len(pairs), f"{tag}: a step shown twice: {pairs}"
    return {tag: dict(pairs) for tag, pairs in events.items()}


def numeric(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def same(stored: float, value: float) -> bool:
    """TensorBoard keeps a scalar as float32."""
    if math.isnan(value):
        return math.isnan(stored)
    return math.isclose(stored, value, rel_tol=2**-23, abs_tol=1e-30)


@pytest.mark.slow
def test_run_writes_every_metric_to_tensorboard(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    run_cli(
        "run",
        "tiny",
        "--no-demo",
        f"output_dir={tmp_path}",
        "name=tb",
        f"data.corpus=[{corpus}]",
        "data.vocab_size=512",
        "model.num_layers=1",
        "train.max_steps=5",
        "train.log_every=2",
        "train.save_every=0",
        "tensorboard.enabled=true",
        cwd=tmp_path,
    )
    run = tmp_path / "tb"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [2, 4, 5]
    events = read_events(run / "tensorboard")
    expected = {key for r in records for key in numeric(r)}
    assert {"loss", "mlm/loss", "mlm/accuracy", "lr", "grad_norm", "tokens", "tokens_per_s", "tflops"} <= expected
    assert set(events) == expected
    for record in records:
        for key, value in numeric(record).items():
            assert same(events[key][record["step"]], value), (key, record["step"], events[key], value)
    for key, steps in events.items():
        assert set(steps) == {r["step"] for r in records if key in numeric(r)}, key


def test_resume_hides_what_an_earlier_invocation_logged_past_its_checkpoint(tmp_path):
    first = MetricsLogger(tmp_path, ON, 6, 0, "disabled", "p")
    for step in range(1, 6):  # logged up to step 5; say the last checkpoint was at step 3
        first.log({"step": step, "loss": float(step), "tokens": 1000 * step})
    first.close()
    again = MetricsLogger(tmp_path, ON, 6, 3, "disabled", "p")
    for step in range(4, 7):
        again.log({"step": step, "loss": step + 0.5, "tokens": 1000 * step})
    again.close()
    events = read_events(tmp_path / "tensorboard")
    assert events["loss"] == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.5, 5: 5.5, 6: 6.5}
    assert events["tokens"] == {s: 1000.0 * s for s in range(1, 7)}


def test_other_ranks_and_a_switched_off_logger_write_no_events(tmp_path):
    MetricsLogger(tmp_path / "a", ON, 2, 0, "disabled", "p", enabled=False).log({"step": 1, "loss": 1.0})
    assert not (tmp_path / "a").exists()
    off = MetricsLogger(tmp_path / "b", {}, 2, 0, "disabled", "p")
    (tmp_path / "b").mkdir()
    off.log({"step": 1, "loss": 1.0})
    off.close()
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["metrics.jsonl"]


def test_without_the_package_it_is_a_clear_error_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from pretrain.cli import main
    from pretrain.train.setup import load_config

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    load_config("tiny")  # not asked for: not needed
    with pytest.raises(ConfigError, match=r"tensorboard.enabled=true needs the 'tensorboard' package.*pip install"):
        load_config("tiny", ["tensorboard.enabled=true"])

    # through the CLI: one line, and the run directory is never created
    rc = main(["train", "tiny", f"output_dir={tmp_path}", "name=r", "tensorboard.enabled=true"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: tensorboard.enabled=true") and len(err.strip().splitlines()) == 1
    assert "pip install tensorboard" in err and not list(tmp_path.iterdir())

    # the logger (a config built without read_config, e.g. an ablation arm's) refuses before it writes
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        MetricsLogger(tmp_path / "run", ON, 2, 0, "disabled", "p")
    assert not (tmp_path / "run").exists()


def test_the_progress_bar_shows_the_line_just_logged(tmp_path, monkeypatch, capsys):
    """The bar drew a step before its log line was set: it showed the previous line's loss and tokens/s."""
    monkeypatch.delenv("CI", raising=False)  # CI turns the bar off
    logger = MetricsLogger(tmp_path, {}, 4, 0, "disabled", "p")
    logger.advance(1)
    logger.advance(0, {"loss": "6.265", "tok/s": "440"})
    frames = capsys.readouterr().err.split("\r")
    logger.close()
    assert "loss=6.265, tok/s=440" in frames[-1] and "1/4" in frames[-1]
