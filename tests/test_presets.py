"""Every shipped preset loads, resolves and plans (`--dry-run`'s code, on the meta device: no weights are made), and a
preset that names a published model has that model's size."""

import re

import numpy as np
import pytest
import torch
from transformers import ModernBertConfig, ModernBertForMaskedLM

from pretrain.core.parsing import resolve_preset
from pretrain.core.schedule import Schedule
from pretrain.train.dryrun import dry_run
from pretrain.train.setup import load_config

PRESETS = sorted(p.stem for p in resolve_preset("default").parent.glob("*.yaml") if not p.stem.startswith("ablation"))


def total_parameters(plan: str) -> int:
    return int(re.search(r"^total\s+([\d,]+)$", plan, re.M).group(1).replace(",", ""))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_plans(name):
    cfg = load_config(name)
    plan = dry_run(cfg, world_size=1, gpus_per_node=1)
    assert cfg.name and total_parameters(plan) > 0


def test_modernbert_base_has_modernbert_bases_shape():
    cfg = load_config("modernbert-base")
    m = cfg.model
    hf = ModernBertConfig(
        vocab_size=cfg.data.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        global_rope_theta=m.rope_theta,
        local_rope_theta=m.local_rope_theta,
        local_attention=m.local_attention,
        global_attn_every_n_layers=m.global_every,
        max_position_embeddings=cfg.data.max_seq_len,
    )
    with torch.device("meta"):
        theirs = sum(p.numel() for p in ModernBertForMaskedLM(hf).parameters())
    ours = total_parameters(dry_run(cfg, world_size=1, gpus_per_node=1))
    # ModernBERT-base is published as 149M parameters; ours may differ only by a LayerNorm weight or two
    assert abs(ours - theirs) <= 4 * m.hidden_size, (ours, theirs)
    assert 148e6 < ours < 151e6
    assert (m.activation, m.norm_placement, m.use_bias, m.position_embedding) == ("geglu", "pre", False, "rope")
    assert cfg.objectives["mlm"].mask_prob == 0.30 and cfg.train.lr_schedule == "wsd" and cfg.model.unpadded


def test_modernbert_base_decays_its_weights_as_modernberts_optimizer_does():
    """ModernBERT's weight decay of 1e-5 is StableAdamW's decoupled one (1e-5 of a weight a step at the peak lr);
    copied as AdamW's weight_decay it became 8e-4 x 1e-5 = 8e-9 a step, which leaves an fp32 weight of 1 unchanged."""
    from pretrain.train.optim import build_optimizer

    t = load_config("modernbert-base").train
    layer = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    optimizer = build_optimizer(layer, t)
    layer.weight.grad = torch.zeros_like(layer.weight)
    optimizer.step()  # at the peak lr, a zero gradient: all that moves the weight is the decay
    assert 1.0 - layer.weight[0, 0].item() == pytest.approx(1e-5, rel=1e-2)


def test_bert_base_two_phase_is_berts_two_phases():
    """Devlin et al.'s 128 tokens for 90% of the steps, then 512, at 256 sequences a step on 1 rank or 8."""
    cfg = load_config("bert-base-two-phase")
    schedule = Schedule.of(cfg)
    end = cfg.train.max_steps
    assert end == 100_000 and cfg.model.max_position_embeddings == 512
    first, second = schedule.phases
    assert (first.start, first.max_seq_len, second.start, second.max_seq_len) == (0, 128, 90_000, 512)
    steps = np.arange(end)
    for world, accumulation in ((1, (8, 32)), (8, (1, 4))):
        schedule.check_split(world, end)
        a = schedule.arrays(steps, world)
        assert (a["max_seq_len"] == np.where(steps < 90_000, 128, 512)).all()
        assert (a["global_batch"] == 256).all()
        assert (a["global_batch"] % (a["micro_batch_size"] * world) == 0).all()  # whole micro-batches on every rank
        assert (schedule.accumulation(89_999, world), schedule.accumulation(90_000, world)) == accumulation
    tokens = a["global_batch"] * a["max_seq_len"]
    short, long = tokens[a["phase"] == 0].sum(), tokens[a["phase"] == 1].sum()
    assert (short, long) == (90_000 * 256 * 128, 10_000 * 256 * 512)  # 2.95e9 and 1.31e9 tokens
    assert long / short == pytest.approx(4 * 10 / 90)


def test_modernbert_base_trains_at_theta_10k_and_its_header_schedules_the_papers_ramp_and_extension(tmp_path):
    """The preset's own run is ModernBERT's 1024-token training (RoPE theta 10k everywhere); the config its header
    shows adds the batch ramp (768 -> 4608 over 50B tokens, each size the same number of steps) and the context
    extension (1.719T tokens at 1024, then 300B at 8192 with the global layers' theta at 160k, its decay the last
    50B), as Warner et al. (2024) report them."""
    preset = resolve_preset("modernbert-base")
    m = load_config("modernbert-base").model
    assert (m.rope_theta, m.local_rope_theta) == (10000.0, 10000.0)
    block = [line[4:] for line in preset.read_text().splitlines() if line.startswith("#   ")]
    (tmp_path / "full.yaml").write_text("base: modernbert-base.yaml\nname: modernbert-base-full\n" + "\n".join(block))
    cfg = load_config(str(tmp_path / "full.yaml"))
    schedule = Schedule.of(cfg)
    main, extension = schedule.phases
    assert (main.max_seq_len, main.rope_theta, extension.max_seq_len, extension.rope_theta) == (
        1024,
        10000.0,
        8192,
        160000.0,
    )
    schedule.check_split(8, cfg.train.max_steps)
    steps = np.arange(cfg.train.max_steps)
    a = schedule.arrays(steps, 8)
    tokens = a["global_batch"] * a["max_seq_len"]
    ramp_end = int(np.flatnonzero(a["global_batch"] == 4608)[0])
    sizes, counts = np.unique(a["global_batch"][:ramp_end], return_counts=True)
    assert sizes.tolist() == [768, 1536, 2304, 3072, 3840] and len(set(counts.tolist())) == 1
    assert set(a["global_batch"][ramp_end:][a["phase"][ramp_end:] == 0].tolist()) == {4608}
    assert tokens[:ramp_end].sum() == pytest.approx(50e9, rel=1e-3)
    assert tokens[a["phase"] == 0].sum() == pytest.approx(1.719e12, rel=1e-3)
    assert tokens[a["phase"] == 1].sum() == pytest.approx(300e9, rel=1e-3)
    assert set(a["global_batch"][a["phase"] == 1].tolist()) == {72}
    assert tokens[-cfg.train.decay_steps :].sum() == pytest.approx(50e9, rel=1e-3)
    assert tokens[: cfg.train.warmup_steps].sum() == pytest.approx(3e9, rel=1e-3)


def test_electra_is_electra_smalls_recipe():
    """google-research/electra (configure_pretraining.py, model/optimization.py): 12 x 256 on 128-wide embeddings, a
    generator of 1/4 the width (64, 1 head, FFN 256), batch 128 of 128 tokens, AdamW (0.9, 0.999, 1e-6, decay 0.01),
    clipping at 1.0, and lr 5e-4 x (1 - step / 1M) x min(1, step / 10k): after the warm-up, the `bert` schedule."""
    from objectives.rtd import generator_config
    from pretrain.train.optim import lr_factor

    cfg = load_config("electra")
    m, t, rtd = cfg.model, cfg.train, cfg.objectives["rtd"]
    assert (m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size, m.embedding_size) == (12, 256, 4, 1024, 128)
    g = generator_config(m, rtd)
    assert (g.hidden_size, g.num_heads, g.intermediate_size, g.num_layers) == (64, 1, 256, 12)
    assert (t.global_batch(1), cfg.data.max_seq_len, cfg.data.vocab_size) == (128, 128, 30522)
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.grad_clip) == (0.9, 0.999, 1e-6, 0.01, 1.0)
    assert (t.lr, t.warmup_steps, t.max_steps) == (5e-4, 10_000, 1_000_000)
    assert (rtd.mask_prob, rtd.mask_token_prob, rtd.temperature, rtd.gen_weight, rtd.disc_weight) == (
        0.15,
        0.85,
        1.0,
        1.0,
        50.0,
    )
    for step in (10_000, 10_001, 500_000, 999_999):  # after the warm-up: the same decay, counted from step 0
        assert lr_factor(step, t) == pytest.approx(1 - step / t.max_steps), step
    for step in (0, 1, 5_000, 9_999):  # in it: within 1.1% and one increment (TensorFlow's first update has lr 0)
        electra = (1 - step / t.max_steps) * min(1.0, step / t.warmup_steps)
        assert abs(lr_factor(step, t) - electra) <= 0.011 * electra + 1.01 / t.warmup_steps, step
