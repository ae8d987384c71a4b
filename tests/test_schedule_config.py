"""Schedules as read and as evaluated (`pretrain.core.schedule`): values at given steps, phases and their
inheritance, the global batch's rounding, config errors naming key and value, what a resume may change, the masking
rate a scheduled sample is prepared with, and the phase sampler's positions. No training here (the CLI runs are in
tests/test_in_run_schedules.py)."""

import numpy as np
import pytest

from data_pipeline.loader import PhaseBatchSampler, PretrainDataset
from pretrain.core.errors import ConfigError, UserError
from pretrain.core.schedule import Schedule, first_change
from pretrain.train.fingerprint import check_resume, fingerprint
from pretrain.train.setup import load_config

RAMP = "schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.3], [500, 0.15]]}]"
PHASES = "schedule.phases=[{start: 300, max_seq_len: 32, micro_batch_size: 4}, {start: 700, rope_theta: 0}]"


def config(*overrides):
    return load_config("tiny", ["train.max_steps=1000", *overrides])


def test_values_phases_and_the_global_batch_at_given_steps():
    s = Schedule.of(config(RAMP, PHASES, "schedule.values=[{key: train.global_batch, points: [[0, 8], [100, 24]]}]"))
    # phases: an implicit first one with the run's own settings, then each inherits what it leaves at 0
    assert [(p.start, p.max_seq_len, p.micro_batch_size) for p in s.phases] == [(0, 64, 8), (300, 32, 4), (700, 32, 4)]
    assert [s.phase(step).index for step in (0, 299, 300, 699, 700, 999)] == [0, 0, 1, 1, 2, 2]
    assert s.phase_end(s.phases[1]) == 700 and s.phase_end(s.phases[2]) is None
    # the ramp: 8 + 16 * step / 100, rounded down to whole micro-batches on every rank, at least one each
    assert [s.global_batch(step, 1) for step in (0, 49, 50, 99, 100, 500)] == [8, 8, 16, 16, 24, 24]
    assert [s.global_batch(step, 2) for step in (0, 50, 100)] == [16, 16, 16]  # multiples of 8 x 2
    assert s.global_batch(300, 2) == 24 and s.accumulation(300, 2) == 3  # phase 1: micro 4 x 2 ranks
    steps = np.array([0, 250, 500, 900])
    ramp = load_config("tiny", ["train.max_steps=1000", RAMP])
    assert Schedule.of(ramp).arrays(steps, 1)["objectives.mlm.mask_prob"] == pytest.approx([0.3, 0.225, 0.15, 0.15])
    held = config("schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.3], [500, 0.15]], shape: steps}]")
    assert Schedule.of(held).arrays(steps, 1)["objectives.mlm.mask_prob"] == pytest.approx([0.3, 0.3, 0.15, 0.15])
    # in tokens: divided by each phase's length; with multiple_of, the same batches on any number of ranks
    tokens = config(PHASES, "schedule.values=[{key: train.global_batch, points: [[0, 1024]], unit: tokens}]")
    assert [Schedule.of(tokens).global_batch(step, 1) for step in (0, 300)] == [16, 32]
    fixed = config("schedule.values=[{key: train.global_batch, points: [[0, 8], [100, 24]], multiple_of: 8}]")
    assert [Schedule.of(fixed).global_batch(60, w) for w in (1,)] == [16]
    # without a batch schedule: the run's own, which every phase's micro-batch must divide
    assert Schedule.of(config(PHASES)).global_batch(500, 2) == config().train.global_batch(2)
    with pytest.raises(ConfigError, match=r"phase 1 \(from step 300\) has micro_batch_size 3"):
        Schedule.of(config("schedule.phases=[{start: 300, micro_batch_size: 3}]")).check_split(1, 1000)


@pytest.mark.parametrize(
    "override, message",
    [
        ("schedule.phases=[{start: 500}, {start: 400}]", r"schedule.phases\[1\].start: 400 is not after"),
        ("schedule.phases=[{start: 1000}]", r"schedule.phases\[0\].start: 1000 is past the run's end"),
        ("schedule.phases=[{start: 5, max_seq_len: 256}]", r"max_seq_len: 256 is outside \[8, model.max_position"),
        ("schedule.phases=[{start: 5, rope_theta: 1e5}]", r"rope_theta: model.position_embedding is learned"),
        ("schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 1.2]]}]", r"values\[0\].points: at step 0"),
        ("schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0]]}]", r"mask_prob: must be in \(0"),
        ("schedule.values=[{key: train.lr, points: [[0, 1]]}]", r"values\[0\].key: 'train.lr' is not"),
        ("schedule.values=[{key: objectives.span.mask_prob, points: [[0, 0.2]]}]", "which this run does not train"),
        ("schedule.values=[{key: objectives.mlm.max_ngram, points: [[0, 2]]}]", "cannot be scheduled"),
        ("schedule.values=[{key: train.global_batch, points: [[5, 8], [2, 16]]}]", "steps 5 then 2 are not in"),
        ("schedule.values=[{key: train.global_batch, points: [[0, 8], [1000, 16]]}]", "step 1000 is outside the run"),
        ("schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.2]], unit: tokens}]", "only train.global"),
        ("schedule.values=[{key: train.global_batch, points: [[0, 0.5]]}]", "global batch 0.5 at step 0 is below 1"),
        (
            "schedule.values=[{key: train.global_batch, points: [[0, 8]]}, "
            "{key: train.global_batch, points: [[0, 8]]}]",
            "scheduled twice",
        ),
    ],
)
def test_bad_schedules_are_refused_naming_key_and_value(override, message):
    with pytest.raises(ConfigError, match=message):
        config(override)


def fingerprint_of(cfg, world=1):
    return fingerprint(cfg, cfg.model, "fp32", world, None, None)


def test_a_resume_may_change_what_lies_ahead_but_not_what_it_trained():
    old = config(RAMP, PHASES)
    later_phase = config(RAMP, "schedule.phases=[{start: 300, max_seq_len: 32, micro_batch_size: 4}, {start: 800}]")
    check_resume(fingerprint_of(old), fingerprint_of(later_phase), [], "ckpt", step=700)  # phase 2 not reached
    moved_ramp = config("schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.3], [600, 0.15]]}]", PHASES)
    assert first_change(Schedule.of(old), Schedule.of(moved_ramp), 1000, 1) == (1, "objectives.mlm.mask_prob")
    with pytest.raises(UserError, match=r"mask_prob at step 1, which the checkpoint has trained\): 0.2997 in"):
        check_resume(fingerprint_of(old), fingerprint_of(moved_ramp), [], "ckpt", step=200)
    check_resume(fingerprint_of(old), fingerprint_of(moved_ramp), ["schedule"], "ckpt", step=200)
    # a run without a schedule may take one whose past is its own constant settings
    plain = config()
    ahead = config("schedule.phases=[{start: 300, max_seq_len: 32}]")
    check_resume(fingerprint_of(plain), fingerprint_of(ahead), [], "ckpt", step=300)
    with pytest.raises(UserError, match="its phase at step 300"):
        check_resume(fingerprint_of(plain), fingerprint_of(ahead), [], "ckpt", step=301)
    # the same global batch split over other ranks is no change
    wide = config(PHASES, "train.micro_batch_size=4")
    check_resume(fingerprint_of(config(PHASES), 1), fingerprint_of(wide, 2), [], "ckpt", 500, 1, 2)


class Builder:
    """Samples of 100 non-special tokens (ids 10..109)."""

    def __len__(self):
        return 50

    def sample(self, index, rng):
        return {"input_ids": np.concatenate([[2], 10 + rng.permutation(100), [3]]).astype(np.int64)}


def test_a_scheduled_rate_reaches_prepare_and_leaves_the_objective_as_it_was():
    from objectives import build_objectives
    from pretrain.core.tokens import SpecialTokens

    cfg = config(RAMP)
    tokens = SpecialTokens(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=128, replaceable=np.arange(5, 128))
    objectives = build_objectives(cfg.objectives, tokens)
    configured = objectives[0].options
    data = PretrainDataset(Builder(), objectives, seed=3, rates=Schedule.of(cfg).objective_values)

    def masked(key):
        return int((data[key]["mlm_labels"] != -100).sum())

    assert [masked((0, p)) for p in range(5)] == [30] * 5  # 30% of 100 tokens at step 0
    assert [masked((250, p)) for p in range(5)] == [22] * 5  # round(0.225 x 100)
    assert [masked((900, p)) for p in range(5)] == [15] * 5
    assert masked(0) == 15  # a bare position: the configured rate (0.15)
    assert objectives[0].options is configured and configured.mask_prob == 0.15


def test_the_phase_sampler_covers_each_steps_positions_once_over_ranks():
    sizes = {5: 8, 6: 16, 7: 24}
    per_rank = [list(iter(PhaseBatchSampler(5, 40, 8, 4, sizes.__getitem__, rank, 2))) for rank in range(2)]
    for step, start in ((5, 40), (6, 48), (7, 64)):
        seen = sorted(p for batches in per_rank for batch in batches for s, p in batch if s == step)
        assert seen == list(range(start, start + sizes[step]))
    assert [len(batches) for batches in per_rank] == [1 + 2 + 3] * 2  # 8, 16, 24 sequences in micro-batches of 4 x 2
    # phase 0 is the stream an unscheduled run reads; a later phase orders its samples anew
    assert PretrainDataset(Builder(), [], 3).place(7) == PretrainDataset(Builder(), [], 3, phase=0).place(7)
    orders = [[PretrainDataset(Builder(), [], 3, phase=k).place(p)[2] for p in range(50)] for k in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(50)) and orders[0] != orders[1]
