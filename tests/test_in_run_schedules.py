"""In-run schedules through the CLI, as a user trains with them: a run with two phases (another sequence length and
micro-batch), a masking-rate ramp and a global-batch ramp resumes bitwise inside the ramp and one step after the
phase change; a resume may change what lies ahead of its checkpoint but not what it has trained; an export takes the
RoPE theta of its last phase. (Schedule arithmetic and validation: tests/test_schedule_values.py.)"""

import json

import pytest
import torch
from helpers import run_args, small_corpus
from helpers import run_cli as pretrain

from pretrain.train.checkpoint import load_module_state

PHASES = "schedule.phases=[{start: 5, max_seq_len: 32, micro_batch_size: 2}]"
VALUES = (
    "schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.3], [6, 0.1]]}, "
    "{key: train.global_batch, points: [[0, 4], [4, 8]]}]"
)


def scheduled(out, corpus, *extra):
    """8 steps, micro-batch 4 at 64 tokens then 2 at 32 from step 5; the global batch 4 -> 8 by step 4 (so the
    accumulation goes 1 -> 2 -> 4), the masking rate 0.3 -> 0.1 by step 6."""
    return run_args(out, corpus, "train.max_steps=8", "train.micro_batch_size=4", PHASES, VALUES, *extra)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def reuse(tmp_path):
    return ["data.tokenizer=" + str(tmp_path / "r" / "tokenizer"), "data.shards=" + str(tmp_path / "r" / "shards")]


@pytest.mark.slow
def test_a_scheduled_run_resumes_bitwise_mid_ramp_and_after_a_phase_change(tmp_path):
    corpus = small_corpus(tmp_path, slice(0, 40))
    pretrain("run", *scheduled(tmp_path, corpus, "train.save_every=8"), "--no-demo", cwd=tmp_path)
    full = metrics(tmp_path / "r")
    assert [r["step"] for r in full] == list(range(1, 9))
    # what metrics.jsonl says each step trained with: the logged values are those of the step just trained
    assert [r["phase"] for r in full] == [0] * 5 + [1] * 3
    assert [r["max_seq_len"] for r in full] == [64] * 5 + [32] * 3
    assert [r["global_batch"] for r in full] == [4, 4, 4, 4, 8, 8, 8, 8]  # 4 + 4 * s / 4 rounded down to 4s, then 8
    assert [r["objectives.mlm.mask_prob"] for r in full] == pytest.approx(
        [0.3 - 0.2 * s / 6 for s in range(6)] + [0.1, 0.1], abs=1e-6
    )

    # the same run cut at step 3 (inside both ramps), then at step 6 (one step after the phase change), then finished
    cut = ["name=cut", "train.save_every=1", *reuse(tmp_path)]
    for stop in (3, 3):
        pretrain("train", *scheduled(tmp_path, corpus, *cut, f"train.exit_after_steps={stop}"), cwd=tmp_path, rc=None)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert (state["phase"], state["phase_start_samples"]) == (1, 4 * 4 + 8)  # steps 0-3 at 4, step 4 at 8
    pretrain("train", *scheduled(tmp_path, corpus, *cut), cwd=tmp_path)

    resumed = metrics(tmp_path / "cut")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    a = load_module_state(tmp_path / "r" / "checkpoints" / "step_00000008")
    b = load_module_state(tmp_path / "cut" / "checkpoints" / "step_00000008")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # a resume may change what lies ahead of its checkpoint (step 8): a ramp after it, a later phase ...
    ahead = [
        "name=cut",
        *reuse(tmp_path),
        "train.max_steps=10",
        "schedule.phases=[{start: 5, max_seq_len: 32, micro_batch_size: 2}, {start: 8, max_seq_len: 48}]",
        "schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.3], [6, 0.1], [8, 0.1], [9, 0.2]]}, "
        "{key: train.global_batch, points: [[0, 4], [4, 8]]}]",
    ]
    pretrain("train", *run_args(tmp_path, corpus, "train.micro_batch_size=4", *ahead), cwd=tmp_path)
    assert [r["max_seq_len"] for r in metrics(tmp_path / "cut")][-2:] == [48, 48]

    # ... but not what it has trained: the ramp's start, refused with the step, the run directory untouched
    past = "schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.25], [6, 0.1]]}]"
    before = (tmp_path / "cut" / "metrics.jsonl").read_text()
    proc = pretrain(
        "train",
        *run_args(
            tmp_path,
            corpus,
            "name=cut",
            *reuse(tmp_path),
            "train.max_steps=12",
            "train.micro_batch_size=4",
            PHASES,
            past,
        ),
        cwd=tmp_path,
        rc=2,
    )
    assert "schedule (its" in proc.stderr and "at step 0, which the checkpoint has trained" in proc.stderr
    assert "train.allow_changes=[schedule]" in proc.stderr
    assert (tmp_path / "cut" / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_an_export_takes_the_rope_theta_of_its_last_phase(tmp_path):
    corpus = small_corpus(tmp_path)
    modern = [
        "model.norm_placement=pre",
        "model.position_embedding=rope",
        "model.activation=geglu",
        "model.use_bias=false",
        "model.rope_theta=10000",
        "schedule.phases=[{start: 2, rope_theta: 40000}]",
    ]
    proc = pretrain("run", *run_args(tmp_path, corpus, *modern), "--no-demo", cwd=tmp_path)
    hf = json.loads((tmp_path / "r" / "hf" / "config.json").read_text())
    thetas = json.dumps(hf)
    assert "40000" in thetas and "max |logit diff|" in proc.stdout + proc.stderr
    # the run's own config keeps the base value; the checkpoint's last step trained at 40000
    assert "rope_theta: 10000" in (tmp_path / "r" / "config.yaml").read_text()
