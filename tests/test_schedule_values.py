"""In-run schedules (`schedule:`) as read and as evaluated, against hand-computed values: scheduled values and phases
at given steps, the global batch's rounding and accumulation, config errors naming key and value, what a resume may
change (`first_change`, `check_resume`), the masking rate a scheduled sample is prepared with (statistically, on
real packed shards), and the phase sampler's positions and streams. Nothing trains here (the CLI runs are in
tests/test_in_run_schedules.py)."""

from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import astuple

import numpy as np
import pytest
from helpers import make_docs, write_jsonl

from data_pipeline.loader import PhaseBatchSampler, PretrainDataset
from data_pipeline.samples import build_samples
from data_pipeline.shards import ShardSet, build_shards
from data_pipeline.tokenizer import load_tokenizer, special_tokens, train_tokenizer
from objectives import build_objectives
from pretrain.core.config import read_config
from pretrain.core.errors import ConfigError, UserError
from pretrain.core.schedule import Schedule, config_at, first_change
from pretrain.train.fingerprint import check_resume, fingerprint, schedule_change
from pretrain.train.setup import load_config

# The tiny preset: data.max_seq_len 64, train.micro_batch_size 8, grad_accum_steps 1, model.max_position_embeddings
# 128, learned positions (model.rope_theta 10000), objectives {mlm: {}} (mask_prob 0.15). Runs of 1000 steps here.
MASK = "objectives.mlm.mask_prob"


def config(*overrides: str):
    return load_config("tiny", ["train.max_steps=1000", *overrides])


def schedule(*overrides: str) -> Schedule:
    return Schedule.of(config(*overrides))


def values(*entries: str) -> str:
    return "schedule.values=[" + ", ".join(entries) + "]"


def phases(*entries: str) -> str:
    return "schedule.phases=[" + ", ".join(entries) + "]"


RAMP = values(f"{{key: {MASK}, points: [[0, 0.3], [500, 0.15]], shape: linear}}")
ROPE = ("model.position_embedding=rope", "model.max_position_embeddings=512")


# ---------------------------------------------------------------------------------------------- values by step


def test_a_linear_ramp_interpolates_between_its_points_and_holds_its_ends():
    s = schedule(RAMP)
    # 0.3 + (0.15 - 0.3) * step / 500
    expected = {0: 0.3, 1: 0.2997, 100: 0.27, 250: 0.225, 499: 0.1503, 500: 0.15, 501: 0.15, 999: 0.15}
    assert {step: s.value(MASK, step) for step in expected} == pytest.approx(expected, abs=1e-12)
    assert s.objective_values(250) == {"mlm": {"mask_prob": pytest.approx(0.225)}}
    steps = np.array(sorted(expected))
    assert s.arrays(steps, 1)[MASK] == pytest.approx([expected[int(k)] for k in steps], abs=1e-12)
    # before a first point after step 0: its value; between three points: piecewise
    later = schedule(values(f"{{key: {MASK}, points: [[100, 0.3], [300, 0.1], [400, 0.2]]}}"))
    got = [later.value(MASK, step) for step in (0, 50, 100, 200, 300, 350, 400, 999)]
    assert got == pytest.approx([0.3, 0.3, 0.3, 0.2, 0.1, 0.15, 0.2, 0.2], abs=1e-12)


def test_a_steps_value_holds_until_the_next_point():
    s = schedule(values(f"{{key: {MASK}, points: [[100, 0.3], [300, 0.2], [600, 0.1]], shape: steps}}"))
    got = {step: s.value(MASK, step) for step in (0, 99, 100, 299, 300, 599, 600, 999)}
    assert got == {0: 0.3, 99: 0.3, 100: 0.3, 299: 0.3, 300: 0.2, 599: 0.2, 600: 0.1, 999: 0.1}
    assert list(s.arrays(np.array([0, 299, 300, 600]), 1)[MASK]) == [0.3, 0.3, 0.2, 0.1]
    # a global batch in steps: 16 until step 300, then 32 (no ramp in between)
    batch = schedule(values("{key: train.global_batch, points: [[0, 16], [300, 32]], shape: steps}"))
    assert [batch.global_batch(step, 1) for step in (0, 150, 299, 300, 999)] == [16, 16, 16, 32, 32]


def test_at_gives_each_scheduled_setting_of_a_step():
    s = schedule(
        values(
            f"{{key: {MASK}, points: [[0, 0.3], [500, 0.15]]}}",
            "{key: train.global_batch, points: [[0, 8], [100, 40]]}",
        ),
        phases("{start: 600, max_seq_len: 32}"),
    )
    assert s.at(50, 1) == {"phase": 0, "max_seq_len": 64, "global_batch": 24, MASK: 0.285}
    assert s.at(600, 1) == {"phase": 1, "max_seq_len": 32, "global_batch": 40, MASK: 0.15}


# ---------------------------------------------------------------------------------------------- phases


def test_without_a_batch_schedule_each_steps_global_batch_is_found_without_the_schedules_arrays(monkeypatch):
    """The trainer and its batch sampler ask for the global batch at every step; without a train.global_batch
    schedule the answer (the run's batch in the phase's whole micro-batches) is the arrays' and is found without
    building them (numpy arrays and a TrainConfig per call, host work at every step)."""
    s = Schedule.of(
        config(
            "train.grad_accum_steps=4",
            phases("{start: 300, micro_batch_size: 4}", "{start: 600, micro_batch_size: 64}"),
        )
    )
    steps = np.array([0, 1, 299, 300, 301, 599, 600, 999])
    expected = {world: s.arrays(steps, world)["global_batch"].tolist() for world in (1, 2, 3)}

    def arrays(*args):
        raise AssertionError("Schedule.arrays evaluated for one step's global batch")

    monkeypatch.setattr(Schedule, "arrays", arrays)
    for world in (1, 2, 3):
        assert [s.global_batch(int(step), world) for step in steps] == expected[world]
        assert all(type(s.global_batch(int(step), world)) is int for step in steps)


def test_phase_boundaries_and_each_phases_settings():
    s = schedule(
        *ROPE,
        "train.micro_batch_size=32",
        "train.grad_accum_steps=2",  # a global batch of 64 on one rank
        phases(
            "{start: 0, max_seq_len: 128, micro_batch_size: 32}",
            "{start: 900, max_seq_len: 512, micro_batch_size: 8, rope_theta: 160000}",
        ),
    )
    assert len(s.phases) == 2  # a first phase at step 0 replaces the run's own settings: no implicit one
    before, after = s.phase(899), s.phase(900)
    assert astuple(before) == (0, 0, 128, 32, 10000.0)  # index, start, max_seq_len, micro_batch_size, rope_theta
    assert astuple(after) == (1, 900, 512, 8, 160000.0)
    assert [s.phase(step).index for step in (0, 1, 899, 900, 901, 999)] == [0, 0, 0, 1, 1, 1]
    assert s.phase_end(before) == 900 and s.phase_end(after) is None
    assert [s.accumulation(step, 1) for step in (899, 900)] == [2, 8]  # 64 / 32, 64 / 8
    assert [s.accumulation(step, 2) for step in (899, 900)] == [2, 8]  # 128 / (32 x 2), 128 / (8 x 2)
    arrays = s.arrays(np.array([0, 899, 900]), 1)
    assert list(arrays["phase"]) == [0, 0, 1] and list(arrays["max_seq_len"]) == [128, 128, 512]
    assert list(arrays["rope_theta"]) == [1e4, 1e4, 1.6e5] and list(arrays["micro_batch_size"]) == [32, 32, 8]
    # what a model trained up to a step is: the settings of that step's phase
    cfg = config(*ROPE, phases("{start: 900, max_seq_len: 512, micro_batch_size: 8, rope_theta: 160000}"))
    assert (config_at(cfg, 899).data.max_seq_len, config_at(cfg, 899).model.rope_theta) == (64, 10000.0)
    at = config_at(cfg, 900)
    assert (at.data.max_seq_len, at.train.micro_batch_size, at.model.rope_theta) == (512, 8, 160000.0)


def test_a_phases_zero_fields_inherit_from_the_phase_before_and_an_implicit_phase_0_has_the_runs_settings():
    s = schedule(
        *ROPE,
        "model.rope_theta=20000",
        phases(
            "{start: 200, max_seq_len: 32}",
            "{start: 400, micro_batch_size: 4}",
            "{start: 600, rope_theta: 50000}",
            "{start: 800}",
        ),
    )
    assert [astuple(p) for p in s.phases] == [
        (0, 0, 64, 8, 20000.0),  # implicit: data.max_seq_len, train.micro_batch_size, model.rope_theta
        (1, 200, 32, 8, 20000.0),
        (2, 400, 32, 4, 20000.0),
        (3, 600, 32, 4, 50000.0),
        (4, 800, 32, 4, 50000.0),
    ]
    steps = (0, 199, 200, 399, 400, 599, 600, 799, 800, 999)
    assert [s.phase(step).index for step in steps] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    # a first phase at step 0 with 0 fields takes the run's own settings too
    first = schedule(phases("{start: 0, micro_batch_size: 4}", "{start: 10, max_seq_len: 16}")).phases
    assert [(p.start, p.max_seq_len, p.micro_batch_size) for p in first] == [(0, 64, 4), (10, 16, 4)]


def test_a_schedule_survives_its_record_as_a_resume_reads_it():
    s = schedule(
        *ROPE,
        phases("{start: 300, max_seq_len: 32, micro_batch_size: 4, rope_theta: 40000}"),
        values(
            f"{{key: {MASK}, points: [[0, 0.3], [500, 0.15]]}}", "{key: train.global_batch, points: [[0, 8], [99, 40]]}"
        ),
    )
    back = Schedule.from_record(json.loads(json.dumps(s.record())))
    steps = np.arange(1000)
    for world in (1, 2):
        a, b = s.arrays(steps, world), back.arrays(steps, world)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert first_change(s, back, 1000, 1) is None


# ---------------------------------------------------------------------------------------------- the global batch


def test_a_global_batch_ramp_is_rounded_down_to_whole_micro_batches_on_every_rank():
    s = schedule(values("{key: train.global_batch, points: [[0, 8], [100, 40]]}"))  # micro-batch 8
    # wanted 8 + 32 * step / 100: 8, 15.68, 16, 24, 32, 39.68, 40
    steps = (0, 24, 25, 50, 75, 99, 100, 999)
    assert [s.global_batch(step, 1) for step in steps] == [8, 8, 16, 24, 32, 32, 40, 40]  # multiples of 8
    assert [s.global_batch(step, 2) for step in steps] == [16, 16, 16, 16, 32, 32, 32, 32]  # of 16, at least 16
    assert [s.global_batch(step, 8) for step in steps] == [64] * 8  # never below one micro-batch per rank
    assert [s.accumulation(step, 1) for step in steps] == [1, 1, 2, 3, 4, 4, 5, 5]
    assert [s.accumulation(step, 2) for step in steps] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [s.accumulation(step, 8) for step in steps] == [1] * 8
    assert list(s.arrays(np.array(steps), 2)["global_batch"]) == [s.global_batch(step, 2) for step in steps]
    # a phase with another micro-batch rounds to its own: 4 x 1 from step 50
    mixed = schedule(
        values("{key: train.global_batch, points: [[0, 8], [100, 40]]}"), phases("{start: 50, micro_batch_size: 4}")
    )
    assert [mixed.global_batch(step, 1) for step in (24, 49, 50, 60, 99)] == [
        8,
        16,
        24,
        24,
        36,
    ]  # 27.2 -> 24 at step 60
    assert [mixed.accumulation(step, 1) for step in (49, 50, 99)] == [2, 6, 9]


def test_a_global_batch_in_tokens_is_divided_by_the_phases_length():
    s = schedule(
        phases("{start: 500, max_seq_len: 32, micro_batch_size: 4}"),
        values("{key: train.global_batch, points: [[0, 1000]], unit: tokens}"),
    )
    # 1000 / 64 = 15.6 sequences -> 8 (micro 8); 1000 / 32 = 31.25 -> 28 (micro 4)
    assert [s.global_batch(step, 1) for step in (0, 499, 500, 999)] == [8, 8, 28, 28]
    assert [s.accumulation(step, 1) for step in (0, 500)] == [1, 7]
    assert [s.global_batch(step, 2) for step in (0, 500)] == [16, 24]  # 15 -> 16 (at least 8 x 2); 31 -> 24
    assert [s.accumulation(step, 2) for step in (0, 500)] == [1, 3]
    exact = schedule(
        phases("{start: 500, max_seq_len: 32}"), values("{key: train.global_batch, points: [[0, 2048]], unit: tokens}")
    )
    assert [exact.global_batch(step, 1) for step in (0, 500)] == [32, 64]  # 2048 / 64, 2048 / 32: no loss to rounding


def test_a_global_batch_multiple_of_is_the_same_on_any_number_of_ranks():
    s = schedule(values("{key: train.global_batch, points: [[0, 8], [100, 40]], multiple_of: 16}"))
    steps = (0, 50, 75, 100)
    assert [s.global_batch(step, 1) for step in steps] == [16, 16, 32, 32]
    assert [s.global_batch(step, 2) for step in steps] == [16, 16, 32, 32]
    assert [s.accumulation(step, 2) for step in steps] == [1, 1, 2, 2]
    s.check_split(1, 1000)
    s.check_split(2, 1000)
    with pytest.raises(ConfigError, match=r"multiple_of=16 is not a multiple of phase 0's micro-batch 8 x 4 rank"):
        s.check_split(4, 1000)


def test_without_a_batch_schedule_the_global_batch_is_the_runs_own():
    cfg = config(
        "train.grad_accum_steps=4", phases("{start: 300, micro_batch_size: 4}", "{start: 600, micro_batch_size: 16}")
    )
    s = Schedule.of(cfg)
    for world in (1, 2, 3):
        assert cfg.train.global_batch(world) == 32 * world
        assert [s.global_batch(step, world) for step in (0, 299, 300, 600, 999)] == [32 * world] * 5
        assert [s.accumulation(step, world) for step in (0, 300, 600)] == [4, 8, 2]
        s.check_split(world, 1000)
    assert Schedule.of(config()).global_batch(0, 5) == config().train.global_batch(5) == 40


def test_check_split_refuses_a_phase_micro_batch_that_does_not_divide_the_global_batch():
    s = schedule(phases("{start: 300, micro_batch_size: 3}"))
    with pytest.raises(ConfigError) as err:
        s.check_split(1, 1000)
    message = str(err.value)
    assert "phase 1 (from step 300) has micro_batch_size 3" in message
    assert "with 1 rank(s) does not divide the global batch of 8 sequences" in message
    # on 2 ranks the global batch is 8 x 1 x 2 = 16: a micro-batch of 16 would need 32
    with pytest.raises(ConfigError, match=r"phase 1 \(from step 300\) has micro_batch_size 16, which with 2 rank"):
        schedule(phases("{start: 300, micro_batch_size: 16}")).check_split(2, 1000)
    schedule(phases("{start: 300, micro_batch_size: 2}")).check_split(4, 1000)  # 32 / (2 x 4) = 4
    # a phase that starts at or after the end of the run (a shorter resumed run) is not held to it
    schedule(phases("{start: 300, micro_batch_size: 3}")).check_split(1, 300)


def test_a_dry_run_refuses_a_phase_micro_batch_that_does_not_divide_the_global_batch():
    from pretrain.train.dryrun import dry_run

    cfg = config(phases("{start: 300, micro_batch_size: 3}"))
    with pytest.raises(ConfigError, match=r"phase 1 \(from step 300\) has micro_batch_size 3"):
        dry_run(cfg, 1)


# ---------------------------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "overrides, message",
    [
        # phases
        ((phases("{start: -5}"),), "schedule.phases[0].start: -5 is negative"),
        (
            (phases("{start: 500}", "{start: 400}"),),
            "schedule.phases[1].start: 400 is not after the phase before it (step 500)",
        ),
        ((phases("{start: 500}", "{start: 500}"),), "schedule.phases[1].start: 500 is not after the phase before it"),
        ((phases("{start: 1000}"),), "schedule.phases[0].start: 1000 is past the run's end (train.max_steps=1000)"),
        ((phases("{start: 10}", "{start: 2000}"),), "schedule.phases[1].start: 2000 is past the run's end"),
        (
            (phases("{start: 5, max_seq_len: 129}"),),
            "schedule.phases[0].max_seq_len: 129 is outside [8, model.max_position_embeddings=128]",
        ),
        ((phases("{start: 5, max_seq_len: 4}"),), "schedule.phases[0].max_seq_len: 4 is outside [8,"),
        ((phases("{start: 5, micro_batch_size: -2}"),), "schedule.phases[0].micro_batch_size: must be >= 1"),
        (
            (phases("{start: 5, rope_theta: 160000}"),),
            "schedule.phases[0].rope_theta: model.position_embedding is learned, not rope",
        ),
        # values: keys
        (
            (values("{key: train.lr, points: [[0, 1]]}"),),
            "schedule.values[0].key: 'train.lr' is not train.global_batch",
        ),
        ((values("{key: objectives.mlm, points: [[0, 0.2]]}"),), "schedule.values[0].key: 'objectives.mlm' is not"),
        (
            (values("{key: train.global_batch, points: [[0, 8]]}", "{key: train.global_batch, points: [[0, 16]]}"),),
            "schedule.values[1].key: 'train.global_batch' is scheduled twice",
        ),
        # values: points, shapes, units
        (
            (values("{key: train.global_batch, points: [[5, 8], [2, 16]]}"),),
            "schedule.values[0].points: steps 5 then 2 are not in increasing order",
        ),
        (
            (values("{key: train.global_batch, points: [[5, 8], [5, 16]]}"),),
            "schedule.values[0].points: steps 5 then 5 are not in increasing order",
        ),
        (
            (values("{key: train.global_batch, points: [[0, 8], [1000, 16]]}"),),
            "schedule.values[0].points: step 1000 is outside the run (0 to train.max_steps-1=999)",
        ),
        ((values(f"{{key: {MASK}, points: [[-1, 0.2]]}}"),), "schedule.values[0].points: step -1 is outside the run"),
        ((values("{key: train.global_batch, points: []}"),), "schedule.values[0].points: 'train.global_batch' has no"),
        (
            (values(f"{{key: {MASK}, points: [[0, 0.2]], unit: tokens}}"),),
            f"schedule.values[0].unit: only train.global_batch has a unit ({MASK} is a rate)",
        ),
        (
            (values("{key: train.global_batch, points: [[0, 8]], unit: bytes}"),),
            "schedule.values[0].unit: value 'bytes'",
        ),
        ((values(f"{{key: {MASK}, points: [[0, 0.2]], shape: cosine}}"),), "schedule.values[0].shape: value 'cosine'"),
        (
            (values(f"{{key: {MASK}, points: [[0, 0.2]], multiple_of: 8}}"),),
            "schedule.values[0].multiple_of: only train.global_batch takes one",
        ),
        (
            (values("{key: train.global_batch, points: [[0, 8], [10, 0.5]]}"),),
            "schedule.values[0].points: global batch 0.5 at step 10 is below 1 sequence",
        ),
        (
            (values("{key: train.global_batch, points: [[0, 0]], unit: tokens}"),),
            "schedule.values[0].points: global batch 0 at step 0 is below 1 token",
        ),
        ((values("{key: train.global_batch, points: [[0, .inf]]}"),), "is not a finite number"),
    ],
)
def test_a_bad_schedule_is_refused_when_the_config_is_read_naming_key_and_value(overrides, message):
    with pytest.raises(ConfigError) as err:
        read_config("tiny", ["train.max_steps=1000", *overrides])
    assert message in str(err.value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        config(*overrides)  # and when it is resolved


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            (values(f"{{key: {MASK}, points: [[0, 0.3], [500, 1.2]]}}"),),
            "schedule.values[0].points: at step 500: objectives.mlm.mask_prob: must be in (0, 1), got 1.2",
        ),
        ((values(f"{{key: {MASK}, points: [[0, 0]]}}"),), "schedule.values[0].points: at step 0: objectives.mlm"),
        ((values(f"{{key: {MASK}, points: [[0, 1]]}}"),), "objectives.mlm.mask_prob: must be in (0, 1), got 1.0"),
        (
            (values("{key: train.global_batch, points: [[0, 8]]}", f"{{key: {MASK}, points: [[7, -0.1]]}}"),),
            "schedule.values[1].points: at step 7: objectives.mlm.mask_prob",
        ),
        (
            (values("{key: objectives.span.mask_prob, points: [[0, 0.2]]}"),),
            "schedule.values[0].key: 'objectives.span.mask_prob' schedules objective 'span', which this run does not "
            "train (its objectives: mlm)",
        ),
        (
            (values("{key: objectives.mlm.max_ngram, points: [[0, 2]]}"),),
            "schedule.values[0].key: 'objectives.mlm.max_ngram' cannot be scheduled; mlm's schedulable options: "
            "mask_prob",
        ),
        ((values("{key: objectives.mlm.mask_token_prob, points: [[0, 0.5]]}"),), "cannot be scheduled"),
        ((values("{key: objectives.mlm.weight, points: [[0, 0.5]]}"),), "'objectives.mlm.weight' cannot be scheduled"),
        (
            ("objectives={rtd: {}}", values("{key: objectives.rtd.mask_prob, points: [[0, 1.5]]}")),
            "schedule.values[0].points: at step 0: objectives.rtd.mask_prob: must be in (0, 1], got 1.5",
        ),
    ],
)
def test_a_bad_scheduled_objective_rate_is_refused_naming_the_entry(overrides, message):
    with pytest.raises(ConfigError) as err:
        config(*overrides)
    assert message in str(err.value)


def test_the_edges_of_what_a_schedule_admits():
    config(phases("{start: 999, max_seq_len: 128}"))  # the last step, the longest length the model holds
    config(values("{key: train.global_batch, points: [[0, 1], [999, 1]]}"))
    config(values(f"{{key: {MASK}, points: [[0, 0.999], [999, 0.001]]}}"))
    config(*ROPE, phases("{start: 5, rope_theta: 160000}"))
    config("objectives={rtd: {}}", values("{key: objectives.rtd.mask_prob, points: [[0, 1.0]]}"))  # rtd admits 1
    config("objectives={span: {}}", values("{key: objectives.span.mask_prob, points: [[0, 0.3], [10, 0.1]]}"))


# ---------------------------------------------------------------------------------------------- resumes


def fp(cfg, world=1):
    return fingerprint(cfg, cfg.model, "fp32", world, None, None)


def refused(old, new, step, world=1, new_world=None, allow=()):
    """The resume's error message ('' where it is allowed)."""
    try:
        check_resume(fp(old, world), fp(new, new_world or world), list(allow), "ckpt", step, world, new_world)
    except UserError as err:
        return str(err)
    return ""


LATE = phases("{start: 600, max_seq_len: 32}")
TWO = phases("{start: 300, max_seq_len: 32, micro_batch_size: 4}", "{start: 700, max_seq_len: 16}")


def test_a_change_to_a_phase_the_checkpoint_has_not_reached_is_allowed_and_one_it_trained_is_refused():
    old = config(TWO)
    moved = config(phases("{start: 300, max_seq_len: 32, micro_batch_size: 4}", "{start: 800, max_seq_len: 16}"))
    assert first_change(Schedule.of(old), Schedule.of(moved), 1000, 1) == (700, "phase")
    assert refused(old, moved, 500) == "" and refused(old, moved, 700) == ""  # steps 0..699 are the same
    message = refused(old, moved, 701)
    assert "schedule (its phase at step 700, which the checkpoint has trained): 2 in the checkpoint, 1 now" in message
    assert "train.allow_changes=[schedule]" in message
    assert refused(old, moved, 701, allow=["schedule"]) == ""
    # a phase's length changed before the checkpoint
    shorter = config(phases("{start: 300, max_seq_len: 24, micro_batch_size: 4}", "{start: 700, max_seq_len: 16}"))
    assert refused(old, shorter, 300) == ""
    assert "its max_seq_len at step 300, which the checkpoint has trained): 32 in the checkpoint, 24 now" in refused(
        old, shorter, 301
    )
    # the micro-batch only splits the batch: changing it in a trained phase changes nothing trained
    split = config(phases("{start: 300, max_seq_len: 32, micro_batch_size: 2}", "{start: 700, max_seq_len: 16}"))
    assert first_change(Schedule.of(old), Schedule.of(split), 1000, 1) is None
    assert refused(old, split, 900) == ""


def test_a_ramp_may_change_after_the_checkpoints_step_but_not_before():
    old = config(RAMP)
    longer = config(values(f"{{key: {MASK}, points: [[0, 0.3], [500, 0.15], [800, 0.05]]}}"))
    # the new point moves step 501 on: 0.15 - 0.1 / 300
    assert first_change(Schedule.of(old), Schedule.of(longer), 1000, 1) == (501, MASK)
    assert refused(old, longer, 400) == "" and refused(old, longer, 501) == ""
    message = refused(old, longer, 502)
    assert (
        f"schedule (its {MASK} at step 501, which the checkpoint has trained): 0.15 in the checkpoint, 0.149667 now"
        in (message)
    )
    # moving a ramp's end moves every step after its first
    later_end = config(values(f"{{key: {MASK}, points: [[0, 0.3], [600, 0.15]]}}"))
    assert first_change(Schedule.of(old), Schedule.of(later_end), 1000, 1) == (1, MASK)
    assert refused(old, later_end, 1) == ""
    assert f"its {MASK} at step 1, which the checkpoint has trained): 0.2997 in the checkpoint, 0.29975 now" in (
        refused(old, later_end, 2)
    )
    assert refused(old, later_end, 200, allow=["schedule"]) == ""
    # a scheduled global batch: its rounded batches are compared, not its points
    batch = config(values("{key: train.global_batch, points: [[0, 8], [100, 40]]}"))
    smoother = config(values("{key: train.global_batch, points: [[0, 8], [24, 15], [100, 40]]}"))
    assert first_change(Schedule.of(batch), Schedule.of(smoother), 1000, 1) == (25, "global_batch")  # 16 vs 8
    assert "its global_batch at step 25, which the checkpoint has trained): 16 in the checkpoint, 8 now" in refused(
        batch, smoother, 26
    )


def test_a_schedule_added_to_a_run_without_one_may_resume_where_its_past_is_the_runs_settings():
    plain = config()
    # a later phase
    ahead = config(phases("{start: 600, max_seq_len: 128, micro_batch_size: 4}"))
    assert refused(plain, ahead, 400) == "" and refused(plain, ahead, 600) == ""
    assert "its phase at step 600, which the checkpoint has trained): 0 in the checkpoint, 1 now" in refused(
        plain, ahead, 601
    )
    # a masking ramp that starts at the run's own rate
    ramp = config(values(f"{{key: {MASK}, points: [[0, 0.15], [400, 0.15], [600, 0.05]]}}"))
    assert refused(plain, ramp, 401) == ""
    assert f"its {MASK} at step 401, which the checkpoint has trained): 0.15 in the checkpoint, 0.1495 now" in (
        refused(plain, ramp, 402)
    )
    # a batch ramp from the run's own batch (8): 8 + 8 * (step - 600) / 200 stays below 16 until step 800
    grow = config(values("{key: train.global_batch, points: [[0, 8], [600, 8], [800, 16]]}"))
    assert [Schedule.of(grow).global_batch(step, 1) for step in (0, 799, 800)] == [8, 8, 16]
    assert refused(plain, grow, 800) == ""
    assert "its global_batch at step 800, which the checkpoint has trained): 8 in the checkpoint, 16 now" in refused(
        plain, grow, 801
    )
    # a ramp whose first value is not the run's: refused from step 0
    assert "its global_batch at step 0" in refused(
        plain, config(values("{key: train.global_batch, points: [[0, 16]]}")), 1
    )
    # and the other way: a schedule removed before it did anything
    assert refused(ahead, plain, 600) == ""
    assert "its phase at step 600" in refused(ahead, plain, 601)


def test_a_resume_on_other_ranks_compares_each_sides_own_batches():
    old = config(TWO)  # 8 sequences a step on one rank
    assert refused(old, config(TWO, "train.micro_batch_size=4"), 500, world=1, new_world=2) == ""  # 4 x 2 ranks
    assert "train.global_batch" in refused(old, config(TWO), 500, world=1, new_world=2)  # 16: not the same batch
    # a run without a schedule (8 = 8 x 1 x 1 rank) taking phases on 2 ranks of 4: its recorded batch, not 4 x 1
    assert refused(config(), config("train.micro_batch_size=4", LATE), 500, world=1, new_world=2) == ""
    assert refused(config(), config("train.micro_batch_size=4", LATE), 500, world=1, new_world=1).count(
        "train.global_batch ("
    )
    ramp = values("{key: train.global_batch, points: [[0, 8], [100, 40]]}")
    # without multiple_of, the ramp's batches depend on the ranks: 8 on one rank, 16 on two at step 0
    assert "its global_batch at step 0, which the checkpoint has trained): 8 in the checkpoint, 16 now" in refused(
        config(ramp), config(ramp), 50, world=1, new_world=2
    )
    assert refused(config(ramp), config(ramp, "train.micro_batch_size=4"), 500, world=1, new_world=2) == ""
    fixed = values("{key: train.global_batch, points: [[0, 8], [100, 40]], multiple_of: 16}")
    assert refused(config(fixed), config(fixed), 500, world=1, new_world=2) == ""
    assert schedule_change(fp(config(fixed)), fp(config(fixed), 2), 500, 1, 2) is None


def test_a_checkpoint_without_a_schedule_is_compared_with_its_own_settings():
    old = config()  # trained at data.max_seq_len=64 for 300 steps
    # the same past (64 tokens up to step 500), written as a schedule over a new base length of 32
    new = config("data.max_seq_len=32", phases("{start: 0, max_seq_len: 64}", "{start: 500, max_seq_len: 32}"))
    assert refused(old, new, 300, allow=["data.max_seq_len"]) == ""


# ---------------------------------------------------------------------------------------------- scheduled masking


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(sample builder of 64-token packed sequences over real shards, the tokenizer's special tokens)."""
    d = tmp_path_factory.mktemp("schedule_data")
    corpus = write_jsonl(d / "docs.jsonl", make_docs(120, seed=1))
    train_tokenizer([str(corpus)], d / "tok", vocab_size=256, show_progress=False)
    build_shards([str(corpus)], d / "tok", d / "shards", num_workers=0, docs_per_shard=90, show_progress=False)
    tokens = special_tokens(load_tokenizer(d / "tok"))
    builder = build_samples("packed", ShardSet(d / "shards"), 64, tokens, 0)
    assert len(builder) >= 100
    return builder, tokens


def masked_fraction(dataset, step, labels="mlm_labels", n=None):
    """Fraction of the non-special tokens that are prediction targets, over the first `n` positions (at `step`, or
    bare positions when None)."""
    chosen = candidates = 0
    for position in range(n or len(dataset)):
        sample = dataset[position if step is None else (step, position)]
        chosen += int((sample[labels] != -100).sum())
        candidates += int((~sample["special_mask"]).sum())
    return chosen / candidates


@pytest.mark.parametrize(
    "objective, options, labels",
    [
        ("mlm", "{}", "mlm_labels"),
        ("mlm", "{whole_word: true}", "mlm_labels"),  # words of several tokens: a rate met on average
        ("span", "{}", "span_labels"),
        ("rtd", "{}", "rtd_mlm_labels"),
    ],
)
def test_masking_follows_the_schedule(packed, objective, options, labels):
    builder, tokens = packed
    key = f"objectives.{objective}.mask_prob"
    cfg = config(f"objectives={{{objective}: {options}}}", values(f"{{key: {key}, points: [[0, 0.3], [500, 0.15]]}}"))
    objectives = build_objectives(cfg.objectives, tokens)
    configured = objectives[0].options
    dataset = PretrainDataset(builder, objectives, 7, rates=Schedule.of(cfg).objective_values)
    at_start, mid, late, bare = (masked_fraction(dataset, step, labels) for step in (0, 250, 600, None))
    assert at_start == pytest.approx(0.3, abs=0.015)
    assert mid == pytest.approx(0.225, abs=0.015)
    assert late == pytest.approx(0.15, abs=0.015)
    assert bare == pytest.approx(0.15, abs=0.015)  # a position without a step: the configured rate
    assert at_start - late > 0.12
    # the objective's own options were put back after every sample
    assert objectives[0].options is configured and configured.mask_prob == 0.15
    # where the schedule's value is the configured one, a step changes nothing: the same rng, the same rate
    for position in range(5):
        a, b = dataset[(600, position)], dataset[position]
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(dataset[(0, 0)][labels], dataset[0][labels])


def test_a_steps_rate_changes_at_its_point_and_not_before(packed):
    builder, tokens = packed
    cfg = config(values(f"{{key: {MASK}, points: [[0, 0.1], [300, 0.4]], shape: steps}}"))
    objectives = build_objectives(cfg.objectives, tokens)
    dataset = PretrainDataset(builder, objectives, 3, rates=Schedule.of(cfg).objective_values)
    # plain mlm picks round(rate x candidates) tokens of each sample, at least one
    for position in range(10):
        candidates = int((~dataset[position]["special_mask"]).sum())
        for step, rate in ((0, 0.1), (299, 0.1), (300, 0.4), (999, 0.4)):
            chosen = int((dataset[(step, position)]["mlm_labels"] != -100).sum())
            assert chosen == max(1, round(rate * candidates)), (step, position)
    # steps visited out of order (a worker's cache of one step's options) still give each step its own rate
    order = [(0, 1), (300, 1), (0, 1), (299, 2), (300, 2)]
    assert [int((dataset[k]["mlm_labels"] != -100).sum()) for k in order] == [
        int(
            (
                PretrainDataset(builder, objectives, 3, rates=Schedule.of(cfg).objective_values)[k]["mlm_labels"]
                != -100
            ).sum()
        )
        for k in order
    ]


# ---------------------------------------------------------------------------------------------- the phase sampler


def micro_batches(sampler, limit=None):
    return list(itertools.islice(iter(sampler), limit)) if limit else list(iter(sampler))


@pytest.mark.parametrize("world, micro", [(1, 8), (2, 4), (3, 2)])
def test_the_phase_sampler_gives_each_step_its_consecutive_positions_over_ranks_and_micro_steps(world, micro):
    s = schedule(values("{key: train.global_batch, points: [[0, 8], [100, 80]], multiple_of: 24}"))
    gb = functools.partial(s.global_batch, world=world)
    start, position, end = 10, 1000, 110
    sizes = [gb(step) for step in range(start, end)]
    # 8 + 0.72 s rounded down to a multiple of 24, at least 24: 48 from step 56 (48.32), 72 from 89 (72.08)
    assert sizes == [24] * 46 + [48] * 33 + [72] * 21
    per_rank = [micro_batches(PhaseBatchSampler(start, position, end, micro, gb, rank, world)) for rank in range(world)]
    base = position
    for step, size in zip(range(start, end), sizes):
        seen = [p for batches in per_rank for batch in batches for s_, p in batch if s_ == step]
        assert sorted(seen) == list(range(base, base + size)), step  # each exactly once, none of another step's
        for rank in range(world):  # every rank the same number of full micro-batches of that step
            mine = [batch for batch in per_rank[rank] if batch[0][0] == step]
            assert len(mine) == size // (micro * world) and all(len(batch) == micro for batch in mine)
            assert all({s_ for s_, _ in batch} == {step} for batch in mine)
        base += size
    assert base == position + sum(sizes)
    # a sampler started at a later step (a resume) continues the same batches
    k = 37
    resumed = PhaseBatchSampler(start + k, position + sum(sizes[:k]), end, micro, gb, 0, world)
    skipped = sum(size // (micro * world) for size in sizes[:k])
    assert micro_batches(resumed) == per_rank[0][skipped:]


def test_the_phase_sampler_follows_a_ramp_without_multiple_of_and_runs_on_without_an_end():
    s = schedule(values("{key: train.global_batch, points: [[0, 8], [100, 40]]}"))  # micro-batch 8 on 2 ranks
    gb = functools.partial(s.global_batch, world=2)
    batches = [micro_batches(PhaseBatchSampler(0, 0, None, 8, gb, rank, 2), 40) for rank in range(2)]
    # sizes 16 (steps 0..74) then 32: rank r's micro-batch of step s is at 16 s + 8 r
    assert batches[0][:3] == [[(s_, 16 * s_ + p) for p in range(8)] for s_ in range(3)]
    assert batches[1][0] == [(0, p) for p in range(8, 16)]
    assert batches[0][-1][0][0] == 39


def test_phase_streams(packed):
    builder, tokens = packed
    objectives = build_objectives({"mlm": {}}, tokens)
    plain = PretrainDataset(builder, objectives, 11)
    zero = PretrainDataset(builder, objectives, 11, phase=0, rates=Schedule.of(config()).objective_values)
    one, two = (PretrainDataset(builder, objectives, 11, phase=k) for k in (1, 2))
    n = len(builder)
    # phase 0 is the stream a run without a schedule reads, sample for sample (its masks too)
    for position in (0, 1, n - 1, n, 3 * n + 5):
        a, b = plain[position], zero[(position // 7, position)]
        assert plain.place(position) == zero.place(position)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # ... which is what it was before schedules existed: order rng [seed, 0, epoch], sample rng [seed, 1, epoch, index]
    # (a checkpoint of an older run resumes on the same samples)
    order = np.random.default_rng([11, 0, 1]).permutation(n)
    assert [plain.place(n + p)[2] for p in range(n)] == list(order)
    index = int(order[5])
    rng = np.random.default_rng([11, 1, 1, index])
    expected = objectives[0].prepare(builder.sample(index, rng), rng)
    assert all(np.array_equal(expected[k], zero[(3, n + 5)][k]) for k in expected)
    # each later phase orders every epoch anew: a permutation of the samples, not phase 0's or another phase's
    orders = [[d.place(p)[2] for p in range(n)] for d in (plain, one, two)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    assert [one.place(p)[2] for p in range(n, 2 * n)] != orders[1]  # its next epoch too
    # the same sample is masked differently in another phase
    a, b = plain[orders[0].index(orders[1][0])], one[0]  # sample orders[1][0] in phases 0 and 1

    def original(sample):
        return np.where(sample["mlm_labels"] != -100, sample["mlm_labels"], sample["input_ids"])

    assert np.array_equal(original(a), original(b))
    assert not np.array_equal(a["mlm_labels"], b["mlm_labels"])
