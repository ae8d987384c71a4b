"""`pretrain train --dry-run`: the plan of a run (config, batch arithmetic, parameters, memory, DeepSpeed config)
without training or writing anything."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
import yaml

from pretrain.cli import main


def test_dry_run_plans_a_cluster_run_without_training(tmp_path, capsys):
    rc = main(
        [
            "train",
            "bert-base",
            "--dry-run",
            "--world-size",
            "16",
            "--gpus-per-node",
            "8",
            "train.zero_stage=2",
            "train.micro_batch_size=32",
            "train.grad_accum_steps=2",
            f"output_dir={tmp_path / 'runs'}",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written

    assert (
        "micro_batch_size 32 x grad_accum_steps 2 x data-parallel ranks 16 = global batch 1024 sequences = "
        "131,072 tokens per step"
    ) in out
    assert "100,000 steps = 102,400,000 sequences" in out

    # BERT-base with MLM has exactly the parameters of transformers' BertForMaskedLM (vocabulary padded to 64)
    with torch.device("meta"):
        hf = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=30528))
    total = int(re.search(r"^total\s+([\d,]+)$", out, re.M).group(1).replace(",", ""))
    assert total == sum(p.numel() for p in hf.parameters()) == 109_518_912

    assert "# memory per device (ZeRO stage 2, " in out and "16 rank(s) on 2 node(s)" in out
    assert "HW: Setup with 2 nodes, 8 GPUs per node." in out  # DeepSpeed's own estimator
    ds = yaml.safe_load(out.split("# DeepSpeed config (derived)\n", 1)[1])
    assert ds["train_batch_size"] == 1024 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 2


def test_dry_run_names_a_bad_batch_setting(capsys):
    assert main(["train", "tiny", "--dry-run", "train.grad_accum_steps=0"]) == 2
    assert "train.grad_accum_steps: must be >= 1, got 0" in capsys.readouterr().err


def test_dry_run_prints_the_schedule_and_each_phases_tokens(tmp_path, capsys):
    """Two phases (128 tokens, micro-batch 8; then 64 from step 600, micro-batch 4), a global batch ramp in tokens
    and a masking ramp on 2 ranks: each phase's numbers by hand."""
    rc = main(
        [
            "train",
            "tiny",
            "--dry-run",
            "--world-size",
            "2",
            f"output_dir={tmp_path / 'runs'}",
            "train.max_steps=1000",
            "model.max_position_embeddings=128",
            "data.max_seq_len=128",
            "train.micro_batch_size=8",
            "schedule.phases=[{start: 600, max_seq_len: 64, micro_batch_size: 4}]",
            "schedule.values=[{key: train.global_batch, points: [[0, 2048], [100, 4096]], unit: tokens}, "
            "{key: objectives.mlm.mask_prob, points: [[0, 0.3], [500, 0.15]]}]",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "runs").exists()
    # phase 0: 2048 -> 4096 tokens at 128 = 16 -> 32 sequences, in multiples of 8 x 2 = 16: 16 while the ramp is
    # below 32 (steps 0-99), then 32 for steps 100-599
    p0_seqs = 100 * 16 + 500 * 32
    p1_seqs = 400 * (4096 // 64)  # 64 sequences of 64 tokens, a multiple of 4 x 2
    assert (
        f"phase 0: steps 0-599, 128 tokens, micro-batch 8, global batch 16 -> 32 (accumulation 1 -> 2): "
        f"{p0_seqs:,} sequences, {p0_seqs * 128:,} tokens"
    ) in out
    assert (
        f"phase 1: steps 600-999, 64 tokens, micro-batch 4, global batch 64 (accumulation 8): {p1_seqs:,} sequences, "
        f"{p1_seqs * 64:,} tokens"
    ) in out
    assert "objectives.mlm.mask_prob (linear): step 0: 0.3, step 500: 0.15; at the last step 0.15" in out
    assert f"total: {p0_seqs * 128 + p1_seqs * 64:,} tokens" in out
    assert f"1,000 steps = {p0_seqs + p1_seqs:,} sequences" in out and "(not used: schedule.values" in out


def test_dry_run_plans_fewer_ranks_than_a_node_holds_on_one_node_of_them(capsys):
    """2 ranks at up to 8 per node: one node of 2 GPUs (ZeRO shards over 2), not 1 node x 8 GPUs."""
    args = ["train", "bert-base", "--dry-run", "--world-size", "2", "train.zero_stage=2"]
    assert main([*args, "--gpus-per-node", "8"]) == 0
    eight = capsys.readouterr().out
    assert main([*args, "--gpus-per-node", "2"]) == 0
    two = capsys.readouterr().out
    assert "2 rank(s) on 1 node(s)" in eight and "2 GPUs per node" in eight
    assert _memory(eight) == _memory(two)


def _memory(out: str) -> str:
    return out.split("# memory per device", 1)[1].split("# DeepSpeed config", 1)[0]


def test_dry_run_refuses_a_world_size_that_does_not_fill_its_nodes(capsys):
    assert main(["train", "tiny", "--dry-run", "--world-size", "12", "--gpus-per-node", "8"]) == 2
    err = capsys.readouterr().err
    assert "--world-size 12 is not a multiple of --gpus-per-node 8" in err
    assert main(["train", "tiny", "--dry-run", "--world-size", "16", "--gpus-per-node", "8"]) == 0
    assert "16 rank(s) on 2 node(s)" in capsys.readouterr().out


def test_dry_run_refuses_zero_ranks(capsys):
    for option in ("--world-size", "--gpus-per-node"):
        with pytest.raises(SystemExit) as exit_:
            main(["train", "tiny", "--dry-run", option, "0"])
        assert exit_.value.code == 2
        assert f"argument {option}: must be a whole number above 0, got '0'" in capsys.readouterr().err


def test_a_warm_up_as_long_as_the_run_is_said(capsys):
    """bert-mini's 1000 warm-up steps kept when train.max_steps was cut to 500: the whole run was warm-up, at no more
    than half of train.lr, and nothing said so. The dry run (and the trainer at its start) says it."""
    from pretrain.train.optim import warmup_note
    from pretrain.train.setup import load_config

    assert main(["train", "bert-mini", "--dry-run", "train.max_steps=500"]) == 0
    said = "note: train.warmup_steps=1000 is not shorter than train.max_steps=500: the run ends inside its warm-up"
    assert said in capsys.readouterr().out
    assert "at most 50% of train.lr (0.00025)" in warmup_note(load_config("bert-mini", ["train.max_steps=500"]).train)
    assert warmup_note(load_config("bert-mini", ["train.max_steps=1001"]).train) is None


def test_settings_a_phase_from_step_0_replaces_are_said_unused(capsys):
    """bert-base-two-phase with data.max_seq_len=256 and train.micro_batch_size=16: its phase from step 0 trains at
    128 x 32, and the dry run's activation estimate was labelled 'micro-batch 16, seq 256', with no word."""
    assert main(["train", "bert-base-two-phase", "--dry-run", "train.micro_batch_size=16", "data.max_seq_len=256"]) == 0
    out = capsys.readouterr().out
    assert (
        "note: schedule.phases[0] sets the run's settings from step 0: data.max_seq_len=256 (the phase: 128), "
        "train.micro_batch_size=16 (the phase: 32) not used"
    ) in out
    assert "activations (estimate, micro-batch 32, seq 128, the largest phase)" in out
    assert main(["train", "bert-base-two-phase", "--dry-run"]) == 0 and "note: schedule" not in capsys.readouterr().out


def test_dry_run_memory_counts_what_the_run_keeps(capsys):
    """Activation checkpointing was not credited (4.78 GiB with it or without), the EMA's copy was left out, and ZeRO-1
    and fp32 got DeepSpeed's ZeRO-2, 16-bit figure (gradients partitioned, 2-byte weights)."""

    def memory(*overrides) -> tuple[int, dict[str, float]]:
        assert main(["train", "bert-base", "--dry-run", "--world-size", "8", *overrides]) == 0
        out = capsys.readouterr().out
        total = int(re.search(r"^total\s+([\d,]+)$", out, re.M).group(1).replace(",", ""))
        figures = {
            line.split(":")[0].split(" (")[0]: float(line.rsplit(" ", 2)[-2])
            for line in _memory(out).splitlines()
            if line.endswith(" GiB")
        }
        return total, figures

    params, plain = memory()
    _, checkpointed = memory("model.activation_checkpointing=true")
    layer = 34 * 128 * 128 * 768 / 2**30  # one layer's activations at 16 bits: micro-batch 128 of 128 tokens
    assert plain["activations"] == pytest.approx(12 * layer, abs=0.01)
    assert checkpointed["activations"] == pytest.approx(12 * 2 * 128 * 128 * 768 / 2**30 + layer, abs=0.01)
    _, zero1 = memory("train.zero_stage=1", "train.ema_decay=0.999")
    assert zero1["model states of this run"] == pytest.approx((2 + 2 + 16 / 8) * params / 2**30, abs=0.01)
    assert zero1["EMA of the fp32 weights"] == pytest.approx(4 * params / 8 / 2**30, abs=0.01)
    _, fp32 = memory("train.zero_stage=2", "train.precision=fp32")
    assert fp32["model states of this run"] == pytest.approx((4 + 4 / 8 + 8 / 8) * params / 2**30, abs=0.01)
    assert "EMA of the fp32 weights" not in plain


def test_dry_run_says_its_tokens_are_slots_where_samples_do_not_fill_them(capsys):
    """doc_bounded packing and sentence pairs pad their samples: '10,240 tokens' where the run counted 8,325."""
    for overrides, said in (
        (["data.packing=doc_bounded"], "data.packing=doc_bounded"),
        (["objectives={mlm: {}, sop: {}}"], "sop"),
    ):
        assert main(["train", "tiny", "--dry-run", *overrides]) == 0
        assert f"note: the tokens above are slots (sequences x length): with {said}" in capsys.readouterr().out
    assert main(["train", "tiny", "--dry-run"]) == 0
    assert "are slots" not in capsys.readouterr().out  # full sentences packed: every slot a token
