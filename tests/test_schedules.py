"""Learning-rate schedules (linear, cosine, warmup-stable-decay, inverse-sqrt) against their closed forms, their
config checks, and `pretrain decay`: a stable-phase checkpoint decayed in a new run directory equals a run that
decayed there uninterrupted, and leaves its source untouched."""

import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import one_line_error, run_args, small_corpus, snapshot
from helpers import run_cli as pretrain

from pretrain.core.config import TrainConfig, read_config
from pretrain.core.errors import ConfigError, UserError
from pretrain.train.optim import lr_factor


def factors(schedule: str, **kw) -> list[float]:
    t = replace(TrainConfig(), lr_schedule=schedule, max_steps=10, warmup_steps=2, **kw)
    return [lr_factor(step, t) for step in range(10)]


def test_schedules_follow_their_closed_forms():
    warm = [0.5, 1.0]
    assert factors("linear") == pytest.approx(warm + [(10 - s) / 8 for s in range(2, 10)])
    # BERT's reference code counts its decay from step 0: 1 - s/10, the warm-up in its place
    assert factors("bert") == pytest.approx(warm + [1 - s / 10 for s in range(2, 10)])
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)]
    assert factors("cosine", min_lr_ratio=0.1) == pytest.approx(warm + cos)
    # wsd: the peak until the last 4 steps, then down to the floor in the chosen shape
    assert factors("wsd", decay_steps=4) == pytest.approx(warm + [1, 1, 1, 1] + [1 - p / 4 for p in range(4)])
    assert factors("wsd", decay_steps=4, decay_shape="1-sqrt", min_lr_ratio=0.2) == pytest.approx(
        warm + [1, 1, 1, 1] + [0.2 + 0.8 * (1 - math.sqrt(p / 4)) for p in range(4)]
    )
    # by default the last 10% of the steps decay; like linear, the floor is reached at max_steps, after the last step
    t = replace(TrainConfig(), lr_schedule="wsd", max_steps=100, warmup_steps=0)
    assert [lr_factor(s, t) for s in (89, 90, 95, 100)] == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert factors("inverse_sqrt") == pytest.approx(warm + [math.sqrt(2 / (s + 1)) for s in range(2, 10)])


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lr_schedule=cosin", "did you mean 'cosine'"),
        ("train.decay_shape=sqrt", "train.decay_shape"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio"),
        ("train.decay_steps=2000", "train.decay_steps (2000)"),
        ("train.warmup_steps=950", "the decay (100 steps: 10% of max_steps"),  # it would start inside the warm-up
        ("train.lr=inf", "not a finite number"),
    ],
)
def test_bad_schedule_settings_are_refused_by_name(override, needle):
    with pytest.raises(ConfigError, match=re_escape(needle)):
        read_config("tiny", ["train.lr_schedule=wsd", "train.max_steps=1000", override])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.lr_schedule=linear", "train.min_lr_ratio=0.1"], "does not use train.min_lr_ratio=0.1"),
        (["train.lr_schedule=inverse_sqrt", "train.min_lr_ratio=0.1"], "does not use train.min_lr_ratio=0.1"),
        (["train.lr_schedule=cosine", "train.decay_steps=100"], "does not use train.decay_steps=100"),
        (["train.lr_schedule=linear", "train.decay_shape=1-sqrt"], "does not use train.decay_shape=1-sqrt"),
        (["train.ema_on_cpu=true"], "train.ema_on_cpu=True has no EMA without train.ema_decay"),
        (["train.seed=-1"], "train.seed: must be >= 0, got -1"),  # numpy's generators crashed on it mid-run
        # a negative limit or clip meant "off" unsaid; torch refused the optimizer's mid-start, without the key
        (["train.max_minutes=-1"], "train.max_minutes: must be >= 0, got -1.0"),
        (["train.exit_after_steps=-5"], "train.exit_after_steps: must be >= 0, got -5"),
        (["train.grad_clip=-1"], "train.grad_clip: must be >= 0, got -1.0"),
        (["train.weight_decay=-0.01"], "train.weight_decay: must be >= 0, got -0.01"),
        (["train.adam_beta2=1.0"], "train.adam_beta2: must be within [0, 1), got 1.0"),
        # accepted unsaid, or a trainer's OverflowError after the corpus was read
        (["train.max_skipped_steps=-1"], "train.max_skipped_steps: must be >= 0, got -1"),
        (["train.peak_tflops=-1"], "train.peak_tflops: must be >= 0, got -1.0"),
        (["data.loader_workers=-5"], "data.loader_workers: must be >= -1"),
        (["data.min_frequency=-1"], "data.min_frequency: must be >= 0, got -1"),
        (["data.tokenizer_sample_docs=-3"], "data.tokenizer_sample_docs: must be >= 0, got -3"),
    ],
)
def test_schedule_options_the_schedule_does_not_use_are_refused(overrides, needle):
    """Accepted and ignored, they left a run ending elsewhere than its config said (a linear schedule's floor is 0)."""
    with pytest.raises(ConfigError, match=re_escape(needle)):
        read_config("tiny", ["train.max_steps=1000", *overrides])
    read_config("tiny", ["train.max_steps=1000", "train.lr_schedule=cosine", "train.min_lr_ratio=0.1"])  # it ends there


def test_a_checkpoints_config_with_a_value_refused_since_still_loads():
    """Refused for a new config only: a run trained with loader_workers -2 (read as -1 then) still exports."""
    from pretrain.core.config import build_config

    cfg = build_config({"data": {"loader_workers": -2}, "train": {"max_skipped_steps": -1, "peak_tflops": -1.0}})
    assert cfg.data.loader_workers == -2


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def metric_lines(run: Path) -> list[dict]:
    timing = {"tokens_per_s", "tflops", "mfu", "samples_per_s", "time", "data_wait"}
    return [
        {k: v for k, v in json.loads(line).items() if k not in timing}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
def test_a_schedule_cut_at_a_branchs_end_trains_its_steps_as_before():
    from pretrain.core.schedule import schedule_until

    spec = {
        "phases": [{"start": 0, "max_seq_len": 64}, {"start": 6, "max_seq_len": 32}],
        "values": [
            {"key": "objectives.mlm.mask_prob", "points": [[0, 0.1], [10, 0.2]]},
            {"key": "train.global_batch", "points": [[0, 8], [3, 16], [9, 32]], "shape": "steps"},
            {"key": "objectives.mlm.random_prob", "points": [[0, 0.1], [2, 0.2]]},
        ],
    }
    cut = schedule_until(spec, 6)
    assert cut["phases"] == [{"start": 0, "max_seq_len": 64}]
    assert [v["points"] for v in cut["values"]] == [
        [[0, 0.1], [5, pytest.approx(0.15)]],
        [[0, 8], [3, 16], [5, 16]],
        [[0, 0.1], [2, 0.2]],
    ]


def test_decay_from_a_stable_checkpoint_equals_an_uninterrupted_decay(tmp_path):
    corpus = small_corpus(tmp_path)
    wsd = ["train.lr_schedule=wsd", "train.decay_steps=2", "train.save_every=4", "train.lr=2e-3"]
    # the source: 8 steps, stable until its last 2, a masking ramp to step 7 and a phase from step 7 (past the
    # branch's end: the branch keeps the ramp's steps 0-5 and drops the phase, which made `decay` refuse);
    # the reference: 6 steps, decaying over steps 5-6, the ramp's steps 0-5
    ramp = lambda points: f"schedule.values=[{{key: objectives.mlm.mask_prob, points: {points}}}]"  # noqa: E731
    source = [*wsd, "train.max_steps=8", ramp("[[1, 0.15], [5, 0.25], [7, 0.35]]"), "schedule.phases=[{start: 7}]"]
    pretrain("run", *run_args(tmp_path, corpus, *source), "--no-demo", cwd=tmp_path)
    reference = [*wsd, "train.max_steps=6", "name=ref", ramp("[[1, 0.15], [5, 0.25]]")]
    pretrain("run", *run_args(tmp_path, corpus, *reference), "--no-demo", cwd=tmp_path)
    source = tmp_path / "r"
    before = snapshot(source)

    proc = pretrain("decay", source / "checkpoints" / "step_00000004", "--steps", "2", cwd=tmp_path)
    assert "decay:" in proc.stderr and "export:" in proc.stderr, proc.stderr[-3000:]
    branch = tmp_path / "r-decay4"
    assert snapshot(source) == before  # the source run is left as it was
    assert metric_lines(branch) == metric_lines(tmp_path / "ref")  # steps 1-4 copied, 5-6 trained: equal
    assert [r["lr"] for r in metric_lines(branch)][3:] == pytest.approx([2e-3, 1e-3, 0.0])
    assert (branch / "hf" / "model.safetensors").is_file()

    # the same command again resumes the finished branch (nothing to train); another name that exists is refused
    pretrain("decay", source / "checkpoints" / "step_00000004", "--steps", "2", cwd=tmp_path)
    # a branch of the same name from another step, or over other steps, would continue the old branch: refused
    made = snapshot(branch)
    for other in ([source, "--steps", "2"], [source / "checkpoints" / "step_00000004", "--steps", "3"]):
        proc = pretrain("decay", *other, "--name", "r-decay4", cwd=tmp_path, rc=2)
        one_line_error(proc, f"{branch} exists and is the decay of {source} at step 4 over 2 steps", "--name")
    assert snapshot(branch) == made
    # a branch stopped part-way goes on with the same command once the source's rotation removed the checkpoint it
    # came from; the stop asked of one invocation (train.exit_after_steps) is not the next one's
    half = ["decay", source / "checkpoints" / "step_00000004", "--steps", "3", "--name", "half"]
    proc = pretrain(*half, "train.exit_after_steps=1", cwd=tmp_path)
    assert "stopped at step 5" in proc.stderr, proc.stderr[-2000:]
    (source / "checkpoints" / "step_00000004").rename(tmp_path / "rotated")  # what the source's rotation does
    proc = pretrain(*half, cwd=tmp_path)
    assert "is gone since): resuming it" in proc.stderr and "export:" in proc.stderr, proc.stderr[-2000:]
    assert [r["step"] for r in metric_lines(tmp_path / "half")] == list(range(1, 8))
    (tmp_path / "rotated").rename(source / "checkpoints" / "step_00000004")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    proc = pretrain("decay", source, "--steps", "2", "--name", "mine", cwd=tmp_path, rc=2)
    assert "not a run of ours" in proc.stderr and (tmp_path / "mine" / "notes.txt").read_text() == "mine"

    # the command on the run directory, run again after the source saved a newer checkpoint, resumes its unfinished
    # branch: it started another from the newer checkpoint, and left the first unfinished and never exported
    shutil.move(branch, tmp_path / "done")
    latest = source / "checkpoints" / "latest"
    newest = latest.read_text()
    latest.write_text("step_00000004")  # the source when the branch began
    proc = pretrain("decay", source, "--steps", "3", "train.exit_after_steps=1", cwd=tmp_path)
    assert "stopped at step 5" in proc.stderr, proc.stderr[-2000:]
    latest.write_text(newest)  # the source trained on: its latest is step 8
    proc = pretrain("decay", source, "--steps", "3", cwd=tmp_path)
    assert f"{branch} exists and is this decay: resuming it; to decay from {source}'s latest" in proc.stderr
    assert not (tmp_path / "r-decay8").exists() and [r["step"] for r in metric_lines(branch)] == list(range(1, 8))


@pytest.mark.parametrize("override", ["train={lr: 1.0e-3}", "train.lr=1.0e-3"])
def test_a_decay_branch_stops_where_its_command_says_not_where_its_source_did(tmp_path, override):
    """The source's train.max_minutes and exit_after_steps said when the source stopped, not the branch: an override
    of the train mapping merges over the saved one, so a decay given train={lr: ...} kept them (and a branch of a
    source cut by exit_after_steps=3 stopped after 3 steps). A limit holds only where the command gives it."""
    from pretrain.core.config import read_config, save_config
    from pretrain.train.branch import decay_config
    from pretrain.train.state import TrainState

    checkpoint = tmp_path / "r" / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    save_config(read_config("tiny", ["train.max_minutes=5", "train.exit_after_steps=3"]), checkpoint / "config.yaml")
    TrainState(step=4).save(checkpoint)
    cfg = decay_config(checkpoint, 2, None, [override])[0]
    assert (cfg.train.lr, cfg.train.max_minutes, cfg.train.exit_after_steps, cfg.train.max_steps) == (1e-3, 0, 0, 6)
    cfg = decay_config(checkpoint, 2, None, [override, "train.exit_after_steps=1"])[0]
    assert cfg.train.exit_after_steps == 1
    with pytest.raises(UserError, match="at least two steps, got 1: its first step trains at the peak"):
        decay_config(checkpoint, 1, None, [override])  # exported undecayed, said decayed
    # a checkpoint inside the warm-up: said so (it was a message about decay_steps, which the user set nowhere)
    warm = tmp_path / "w" / "checkpoints" / "step_00000002"
    warm.mkdir(parents=True)
    save_config(read_config("tiny", ["train.warmup_steps=4"]), warm / "config.yaml")
    TrainState(step=2).save(warm)
    with pytest.raises(UserError, match=r"is at step 2, inside its run's warm-up \(4 steps\).* at step 4 or later"):
        decay_config(warm, 4, None, [])
    # what the command sets itself was replaced without a word: refused, naming what sets it
    for given, said in (
        ("train.max_steps=100", "train.max_steps itself (the checkpoint's step + --steps); give --steps"),
        ("train={lr_schedule: cosine}", "train.lr_schedule itself (wsd)"),
        ("train.decay_steps=1", "train.decay_steps itself (--steps)"),
    ):
        with pytest.raises(UserError, match=re.escape(f"{given}: `pretrain decay` sets {said}")):
            decay_config(checkpoint, 2, None, [override, given])
    # ... and where the branch goes: export_dir=DIR left nothing in DIR (the branch exported into its own hf/)
    for given, said in (
        ("export_dir=/elsewhere/final", "export_dir itself; it exports into its own hf/"),
        ("name=kk", "name itself; give --name"),
        ("output_dir=/elsewhere", "output_dir itself; a branch goes beside its source run"),
    ):
        with pytest.raises(UserError, match=re.escape(f"{given}: `pretrain decay` decides {said}")):
            decay_config(checkpoint, 2, None, [given])
