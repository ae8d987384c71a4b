"""`pretrain train --dry-run`: the plan of a run (config, batch arithmetic, parameters, memory, DeepSpeed config)
without training or writing anything."""

from __future__ import annotations

import re

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
