"""FLOP counting (`pretrain.train.flops`): what the MFU in metrics.jsonl and an ablation's FLOPs budget rest on."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from pretrain.model.encoder import BertEncoder
from pretrain.train.flops import count_step_flops
from pretrain.train.setup import load_config


def test_attention_on_the_cpu_counts_as_torch_counts_it_on_a_gpu():
    # torch registers formulas for SDPA's CUDA kernels only; the CPU's flash kernel does the same work
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    shape = tuple(q.shape)
    expected = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    assert expected == 3.5 * 4 * 2 * 4 * 64 * 64 * 16  # forward: q k^T and p v; backward: 2.5 x
    for mask in (None, torch.zeros(2, 1, 1, 64), torch.ones(2, 1, 64, 64, dtype=torch.bool)):
        assert count_step_flops(lambda m=mask: F.scaled_dot_product_attention(q, q, q, m).sum().backward()) == expected


def test_an_encoder_step_counts_its_attention_with_or_without_attention_dropout():
    # With dropout SDPA takes its math path (counted as its matmuls), without it the CPU flash kernel: both count
    # the attention, so the totals differ only by the backward's convention (2 vs 2.5 forwards), a few percent.
    def step_flops(dropout: float) -> int:
        model = BertEncoder(load_config("tiny", [f"model.attention_dropout={dropout}", "model.vocab_size=128"]).model)
        ids = torch.randint(5, 100, (4, 64))
        return count_step_flops(lambda: model(ids).sum().backward())

    cfg = load_config("tiny", []).model
    layers, hidden = cfg.num_layers, cfg.hidden_size
    attention = 3 * 4 * 4 * 64 * 64 * hidden * layers  # 4 sequences of 64: forward + backward as matmuls
    with_math, with_flash = step_flops(0.1), step_flops(0.0)
    assert with_flash - with_math == attention // 6  # the half forward more that torch's flash formula counts
    assert with_math > attention


def test_mfu_counts_the_model_once_under_activation_checkpointing():
    """Checkpointing repeats each layer's forward in the backward: work the hardware does, not the model. MFU counts
    the model's (as PaLM's definition does), so the FLOPs per sample are the same with it on or off."""
    from helpers import TOKENS, make_samples

    from objectives import build_objectives
    from pretrain.train.trainer import probe_flops_per_sample

    samples = make_samples((30, 17), objectives=build_objectives({"mlm": {}}, TOKENS))
    per_sample = {
        on: probe_flops_per_sample(load_config("tiny", [f"model.activation_checkpointing={on}"]), TOKENS, samples, 0)
        for on in ("false", "true")
    }
    assert per_sample["true"] == per_sample["false"] > 0


def test_the_flops_probe_leaves_every_random_stream_alone(monkeypatch):
    """The probe runs at every start and phase change of a run: its throwaway model was built under
    torch.manual_seed(train.seed), which reseeds the CUDA generators too (only the CPU one was restored), so on a GPU
    a resume replayed step 0's dropout masks and every rank drew the same ones. No generator is seeded now."""
    from helpers import TOKENS, make_samples

    from objectives import build_objectives
    from pretrain.train.trainer import probe_flops_per_sample

    samples = make_samples((30, 17), objectives=build_objectives({"mlm": {}}, TOKENS))
    seeded = []
    monkeypatch.setattr(torch, "manual_seed", lambda s: seeded.append(("all", s)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seeded.append(("cuda", s)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: seeded.append(("cuda", s)))
    cpu = torch.get_rng_state()
    assert probe_flops_per_sample(load_config("tiny"), TOKENS, samples, 0) > 0
    assert seeded == [] and torch.equal(torch.get_rng_state(), cpu)


SLOW_PROBE = """
import time

from pretrain.train import flops

counted = flops.count_step_flops


def slow(fn):  # a big model's FLOPs probe: a whole CPU copy, a forward and a backward
    time.sleep(4.0)
    return counted(fn)


flops.count_step_flops = slow  # imported with the objectives, before the trainer takes the name
"""


@pytest.mark.slow
def test_throughput_leaves_out_the_flops_probe(tmp_path, monkeypatch):
    """tokens/s, TFLOP/s and MFU are the training's: the set-up of a phase (its data, the FLOPs probe on a CPU copy
    of the model, 5 s for BERT-base on a small CPU) used to fall inside the first log interval, and a schedule's
    later phase inside the interval it starts in."""
    from helpers import run_cli, small_corpus

    from objectives.base import PLUGINS_ENV
    from pretrain.train.metrics import read_metrics

    (tmp_path / "slow_probe.py").write_text(SLOW_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "slow_probe")  # imported in the run's process, before it trains
    corpus = small_corpus(tmp_path)
    args = [f"output_dir={tmp_path}", "name=r", f"data.corpus=[{corpus}]", "data.vocab_size=512"]
    args += ["model.num_layers=1", "train.max_steps=4", "train.log_every=2", "train.save_every=0"]
    run_cli("run", "tiny", "--no-demo", *args, "schedule.phases=[{start: 2, max_seq_len: 32}]", cwd=tmp_path)
    records = read_metrics(tmp_path / "r")
    assert [r["step"] for r in records] == [2, 4]
    previous = 0
    for record in records:  # each interval's seconds, as its tokens/s says: two tiny steps, not the probe's 4 s
        assert (record["tokens"] - previous) / record["tokens_per_s"] < 2.0, record
        previous = record["tokens"]


@pytest.mark.slow
def test_a_log_interval_across_a_phase_change_counts_each_step_at_its_own_flops(tmp_path):
    """A line whose interval spans a phase change (64 -> 32 tokens at step 3: step 3 at 64, step 4 at 32) counts
    each step's samples at its own phase's FLOPs: at the new phase's count for all of them, TFLOP/s and MFU were
    off by the ratio of the phases' FLOPs per sample (1.7x for a phase that doubles the length)."""
    from helpers import run_cli, small_corpus

    from pretrain.train.metrics import read_metrics

    corpus = small_corpus(tmp_path)
    args = [f"output_dir={tmp_path}", "name=r", f"data.corpus=[{corpus}]", "data.vocab_size=512"]
    args += ["model.num_layers=1", "train.max_steps=6", "train.log_every=2", "train.save_every=0"]
    run_cli("run", "tiny", "--no-demo", *args, "schedule.phases=[{start: 3, max_seq_len: 32}]", cwd=tmp_path)
    records = read_metrics(tmp_path / "r")
    assert [(r["step"], r["max_seq_len"]) for r in records] == [(2, 64), (4, 32), (6, 32)]
    # FLOPs per token: TFLOP/s over tokens/s, one interval's time on both sides. The spanning line lies between
    # the phases' own (longer rows cost more per token: attention), nearer neither than its tokens say
    per_token = [r["tflops"] * 1e12 / r["tokens_per_s"] for r in records]
    long, mixed, short = per_token
    assert short < long
    tokens = 64 * 8, 32 * 8  # step 3's tokens (micro-batch 8 at 64), step 4's (at 32)
    assert mixed == pytest.approx((long * tokens[0] + short * tokens[1]) / sum(tokens), rel=2e-3)


PROBE_POSITIONS = """
import os
import sys

from pretrain.train import flops

counted = flops.count_step_flops


def recorded(fn):  # called by the trainer's FLOPs probe: its phase and position are the caller's
    probe = sys._getframe(1).f_locals
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(f"{probe['dataset'].phase} {probe['position']}\\n")
    return counted(fn)


flops.count_step_flops = recorded  # imported with the objectives, before the trainer takes the name
"""


@pytest.mark.slow
def test_each_phase_probes_its_flops_where_its_own_stream_starts(tmp_path, monkeypatch):
    """A phase's samples are a stream of their own from position 0; its FLOPs probe read them at the run's total
    (16 after two steps of 8), building an epoch order its loader never used, on a resume in a later epoch too."""
    from helpers import run_cli, small_corpus

    from objectives.base import PLUGINS_ENV

    (tmp_path / "probe_positions.py").write_text(PROBE_POSITIONS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "probe_positions")
    monkeypatch.setenv("PROBE_LOG", str(tmp_path / "probes.txt"))
    corpus = small_corpus(tmp_path)
    args = [f"output_dir={tmp_path}", "name=r", f"data.corpus=[{corpus}]", "data.vocab_size=512"]
    args += ["model.num_layers=1", "train.max_steps=5", "train.save_every=1", "schedule.phases=[{start: 2}]"]
    run_cli("run", "tiny", "--no-demo", *args, "train.exit_after_steps=3", cwd=tmp_path, rc=None)
    run_cli("train", "tiny", *args, cwd=tmp_path)  # resumed at step 3: one step into phase 1
    assert (tmp_path / "probes.txt").read_text().splitlines() == ["0 0", "1 0", "1 8"]


SLOW_SAVE = """
import time

from pretrain.train import checkpoint

save = checkpoint.save_checkpoint


def slow(*args, **kwargs):  # a big model's checkpoint on a slow disk: 1.5 s
    time.sleep(1.5)
    return save(*args, **kwargs)


checkpoint.save_checkpoint = slow
"""


@pytest.mark.slow
def test_throughput_leaves_out_checkpoint_saves(tmp_path, monkeypatch):
    """A save inside a log interval (step 1's and 3's, logging every 2) counted into its seconds: tokens/s, TFLOP/s
    and MFU dipped on every line around a save."""
    from helpers import run_cli, small_corpus

    from objectives.base import PLUGINS_ENV
    from pretrain.train.metrics import read_metrics

    (tmp_path / "slow_save.py").write_text(SLOW_SAVE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "slow_save")
    corpus = small_corpus(tmp_path)
    args = [f"output_dir={tmp_path}", "name=r", f"data.corpus=[{corpus}]", "data.vocab_size=512"]
    args += ["model.num_layers=1", "train.max_steps=4", "train.log_every=2", "train.save_every=1"]
    run_cli("run", "tiny", "--no-demo", *args, cwd=tmp_path)
    records = read_metrics(tmp_path / "r")
    assert [r["step"] for r in records] == [2, 4]
    previous = 0
    for record in records:  # each interval's seconds, as its tokens/s says: two tiny steps, not a 1.5 s save
        assert (record["tokens"] - previous) / record["tokens_per_s"] < 1.5, record
        previous = record["tokens"]
    assert records[-1]["time"] > 3.0  # the run's training seconds hold the saves


SLOW_LOADER = """
import time

from data_pipeline import loader

collate = loader.Collator.__call__


def slow(self, samples):  # a loader that cannot keep up: 0.4 s per micro-batch
    time.sleep(0.4)
    return collate(self, samples)


loader.Collator.__call__ = slow
"""


@pytest.mark.slow
def test_data_wait_is_the_share_of_the_interval_spent_waiting_for_batches(tmp_path, monkeypatch):
    """metrics.jsonl's data_wait: the share of each interval the loop waited for its batches. The step reads nothing
    back, so on a GPU the host runs ahead and waits only where the loader is behind; a loader made slow (0.4 s a
    micro-batch, in the loop's own process: no workers on a CPU) shows as most of the interval."""
    from helpers import run_cli, small_corpus

    from objectives.base import PLUGINS_ENV
    from pretrain.train.metrics import read_metrics

    corpus = small_corpus(tmp_path)
    args = [f"output_dir={tmp_path}", f"data.corpus=[{corpus}]", "data.vocab_size=512", "model.num_layers=1"]
    args += ["train.max_steps=6", "train.log_every=3", "train.save_every=0", "train.grad_accum_steps=2"]
    run_cli("run", "tiny", "--no-demo", "name=plain", *args, cwd=tmp_path)
    (tmp_path / "slow_loader.py").write_text(SLOW_LOADER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "slow_loader")
    run_cli(
        "run",
        "tiny",
        "--no-demo",
        "name=slow",
        *args,
        f"data.tokenizer={tmp_path / 'plain' / 'tokenizer'}",
        cwd=tmp_path,
    )
    plain, slow = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "slow")
    assert [r["step"] for r in slow] == [3, 6]
    previous = 0
    for record in slow:  # steps x 2 micro-batches x 0.4 s waited, of the interval its tokens/s says
        seconds = (record["tokens"] - previous) / record["tokens_per_s"]
        # the loader's first fetch (step 1) is set-up, left out of the interval as its opening is
        waited = 2 * 2 * 0.4 if record["step"] == 3 else 3 * 2 * 0.4
        assert waited / seconds - 0.05 <= record["data_wait"] <= 1.0 and record["data_wait"] > 0.6, (record, seconds)
        previous = record["tokens"]
    assert all(0.0 <= r["data_wait"] < slow[1]["data_wait"] - 0.3 for r in plain), (plain, slow)
