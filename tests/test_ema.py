"""The weight EMA against its closed form, checkpoint averaging against the mean of the weights, and both through the
CLI: EMA weights saved with checkpoints, restored bitwise on resume, exported instead of the raw weights;
`pretrain average` exports the mean of two checkpoints and refuses checkpoints of different shapes."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_args, small_corpus
from helpers import run_cli as pretrain
from safetensors.torch import load_file

from pretrain.core.errors import UserError
from pretrain.train.ema import EMA_FILE, WeightEMA, average_states


def test_ema_equals_its_closed_form():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    decay = 0.8
    start = {n: p.detach().clone() for n, p in layer.named_parameters()}
    ema = WeightEMA(layer, decay)
    seen = []
    for _ in range(5):
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn_like(p))
        seen.append({n: p.detach().clone() for n, p in layer.named_parameters()})
        ema.update()
    # ema_n = d^n w_0 + sum_k (1 - d) d^(n-k) w_k, k = 1..n
    n = len(seen)
    for name, got in ema.state_dict().items():
        want = decay**n * start[name] + sum((1 - decay) * decay ** (n - k) * seen[k - 1][name] for k in range(1, n + 1))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert got.dtype == torch.float32


def test_the_warm_up_lets_the_initial_weights_fade():
    """With the warm-up, the share of the initial weights after n steps is the product of min(decay, (1+t)/(10+t)),
    t < n: at decay 0.999 and 300 steps 3e-7 (it was 0.999^300 = 74% without)."""
    layer = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    ema = WeightEMA(layer, 0.999, warmup=True)
    with torch.no_grad():
        layer.weight.fill_(1.0)  # from step 0 on the weights are 1: the EMA is 1 - (the initial weights' share)
    for step in range(300):
        ema.update(step)
    share = math.prod(min(0.999, (1 + t) / (10 + t)) for t in range(300))
    assert share < 1e-6
    torch.testing.assert_close(ema.state_dict()["weight"], torch.full((2, 2), 1.0 - share), rtol=0, atol=1e-6)
    assert ema.decay_at(100_000) == 0.999 and WeightEMA(layer, 0.999).decay_at(0) == 0.999


def test_ema_keeps_fp32_of_low_precision_weights():
    layer = torch.nn.Linear(4, 4).to(torch.bfloat16)
    ema = WeightEMA(layer, 0.999, device="cpu")
    assert all(s.dtype == torch.float32 for s in ema.shadow)
    with torch.no_grad():
        layer.weight.add_(1.0)
    ema.update()
    # a bf16 average could not move by 0.001 from values near 1; the fp32 one does
    assert not torch.equal(ema.state_dict()["weight"], layer.weight.float() - 1.0)


def test_average_is_the_mean_and_refuses_other_shapes():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([1.0])}
    mean = average_states([("a", a), ("b", b)])
    assert torch.equal(mean["w"], torch.tensor([2.0, 4.0])) and torch.equal(mean["b"], torch.tensor([0.5]))
    with pytest.raises(UserError, match="differ in shape at w"):
        average_states([("a", a), ("c", {"w": torch.zeros(3), "b": torch.zeros(1)})])
    with pytest.raises(UserError, match="different weights"):
        average_states([("a", a), ("d", {"w": torch.zeros(2)})])


@pytest.mark.slow
def test_ema_through_the_cli_resumes_bitwise_and_is_exported(tmp_path):
    corpus = small_corpus(tmp_path)
    ema = ["train.ema_decay=0.9", "train.save_every=2"]
    pretrain("run", *run_args(tmp_path, corpus, *ema, "train.max_steps=4"), "--no-demo", cwd=tmp_path)
    # the same run interrupted after step 2 (its checkpoint), then resumed
    pretrain(
        "train",
        *run_args(
            tmp_path,
            corpus,
            *ema,
            "train.max_steps=4",
            "name=cut",
            "data.tokenizer=" + str(tmp_path / "r" / "tokenizer"),
            "data.shards=" + str(tmp_path / "r" / "shards"),
            "train.exit_after_steps=2",
        ),
        cwd=tmp_path,
        rc=None,
    )
    pretrain(
        "train",
        *run_args(
            tmp_path,
            corpus,
            *ema,
            "train.max_steps=4",
            "name=cut",
            "data.tokenizer=" + str(tmp_path / "r" / "tokenizer"),
            "data.shards=" + str(tmp_path / "r" / "shards"),
        ),
        cwd=tmp_path,
    )
    full = torch.load(tmp_path / "r" / "checkpoints" / "step_00000004" / EMA_FILE, weights_only=True)
    cut = torch.load(tmp_path / "cut" / "checkpoints" / "step_00000004" / EMA_FILE, weights_only=True)
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)

    # an EMA an older version kept (its config has no train.ema_warmup) goes on without the warm-up, and says so
    from pretrain.train.checkpoint import write_integrity

    old = tmp_path / "old"
    shutil.copytree(tmp_path / "cut", old)
    shutil.rmtree(old / "checkpoints" / "step_00000004")
    (old / "checkpoints" / "latest").write_text("step_00000002")
    config = old / "checkpoints" / "step_00000002" / "config.yaml"
    config.write_text("".join(line for line in config.read_text().splitlines(True) if "ema_warmup" not in line))
    write_integrity(old / "checkpoints" / "step_00000002")
    data = ["data.tokenizer=" + str(tmp_path / "r" / "tokenizer"), "data.shards=" + str(tmp_path / "r" / "shards")]
    proc = pretrain("train", *run_args(tmp_path, corpus, *ema, "train.max_steps=4", "name=old", *data), cwd=tmp_path)
    assert "EMA was kept without a warm-up: train.ema_warmup=false" in proc.stderr
    assert "ema_warmup: false" in (old / "checkpoints" / "step_00000004" / "config.yaml").read_text()

    # the export holds the EMA weights, not the raw ones, and says so
    exported = load_file(tmp_path / "r" / "hf" / "model.safetensors")
    word = "bert.embeddings.word_embeddings.weight"
    torch.testing.assert_close(exported[word], full["encoder.embeddings.word_embeddings.weight"], rtol=0, atol=0)
    card = (tmp_path / "r" / "hf" / "README.md").read_text()
    assert "exponential moving average" in card
    # its final loss is the one training logged, of the training weights: the card says whose
    assert "(the training weights' loss as logged, not that of these moving-average weights)" in card
    # the raw weights, or a mean of them, say which they are: their cards passed them for the EMA the config names
    pretrain("export", tmp_path / "r", "--raw-weights", "--out", tmp_path / "raw", "--no-verify", cwd=tmp_path)
    raw = (tmp_path / "raw" / "README.md").read_text()
    assert "the weights are the raw training weights, not the exponential moving average (decay 0.9)" in raw
    assert "moving-average weights)" not in raw  # the raw weights' loss is theirs
    ckpts = tmp_path / "r" / "checkpoints"
    pretrain("average", ckpts / "step_00000002", ckpts / "step_00000004", "--out", tmp_path / "avg", cwd=tmp_path)
    mean = (tmp_path / "avg" / "README.md").read_text()
    assert "(not of the exponential moving average the run also kept)" in mean and "raw training weights" not in mean
    # eval of the run scores the EMA, as its export holds it, and says so
    shards = tmp_path / "r" / "shards"
    args = ["eval", tmp_path / "r", "--shards", shards, "--max-samples", "4", "--json", tmp_path / "eval.json"]
    pretrain(*args, cwd=tmp_path)
    ema_eval = json.loads((tmp_path / "eval.json").read_text())
    assert "the weights are an exponential moving average" in ema_eval["model"]
    pretrain(*args, "--raw-weights", cwd=tmp_path)  # or its training weights, as `export --raw-weights` exports them
    raw_eval = json.loads((tmp_path / "eval.json").read_text())
    assert "the weights are the raw training weights" in raw_eval["model"] and raw_eval["loss"] != ema_eval["loss"]
    proc = pretrain("eval", tmp_path / "raw", "--shards", shards, "--raw-weights", cwd=tmp_path, rc=2)
    assert "holds one set" in proc.stderr


@pytest.mark.slow
def test_average_of_two_checkpoints_through_the_cli(tmp_path, monkeypatch):
    corpus = small_corpus(tmp_path)
    pretrain("run", *run_args(tmp_path, corpus, "train.max_steps=4", "train.save_every=2"), "--no-demo", cwd=tmp_path)
    ckpts = tmp_path / "r" / "checkpoints"
    proc = pretrain(
        "average", ckpts / "step_00000002", ckpts / "step_00000004", "--out", tmp_path / "avg", cwd=tmp_path
    )
    assert "max |logit diff|" in proc.stderr, proc.stderr[-2000:]
    from pretrain.train.checkpoint import load_module_state

    a, b = load_module_state(ckpts / "step_00000002"), load_module_state(ckpts / "step_00000004")
    exported = load_file(tmp_path / "avg" / "model.safetensors")
    word = "bert.embeddings.word_embeddings.weight"
    ours = "encoder.embeddings.word_embeddings.weight"
    torch.testing.assert_close(exported[word], (a[ours].double() + b[ours].double()).div(2).float(), rtol=0, atol=0)
    card = (tmp_path / "avg" / "README.md").read_text()
    assert "step_00000002" in card and "step_00000004" in card
    tokens = json.loads((ckpts / "step_00000004" / "trainer_state.json").read_text())["tokens_seen"]
    assert "- Steps: 4\n" in card and f"- Tokens seen: {tokens:,}\n" in card  # the most trained one's, not the first's
    # a trainer saving into the run meanwhile (keeping 1) leaves the checkpoints being averaged where they are
    import pretrain.train.checkpoint as checkpoint
    from pretrain.pipeline import stage_average

    def rotating(path, load=checkpoint.load_module_state):
        checkpoint.rotate(ckpts, 1, ckpts / "step_00000004")
        return load(path)

    monkeypatch.setattr(checkpoint, "load_module_state", rotating)
    stage_average([ckpts / "step_00000002", ckpts / "step_00000004"], tmp_path / "avg4", verify=False)
    assert (ckpts / "step_00000002").is_dir()
    monkeypatch.undo()
    # a checkpoint named twice (the run's latest is step 4) would weigh twice: refused, nothing written
    proc = pretrain(
        "average",
        ckpts / "step_00000002",
        tmp_path / "r",
        ckpts / "step_00000004",
        "--out",
        tmp_path / "avg3",
        cwd=tmp_path,
        rc=2,
    )
    assert "are the same checkpoint" in proc.stderr and not (tmp_path / "avg3").exists()
    # ... or named as a hard-linked copy (a decay branch's) under another path
    shutil.copytree(ckpts / "step_00000002", tmp_path / "linked", copy_function=os.link)
    args = ["average", ckpts / "step_00000002", tmp_path / "linked", "--out", tmp_path / "avg3"]
    proc = pretrain(*args, cwd=tmp_path, rc=2)
    assert "are the same checkpoint" in proc.stderr and not (tmp_path / "avg3").exists()
    # ... or as a copy (a decay branch's where the file system has no hard links): it weighed twice
    shutil.rmtree(tmp_path / "linked")
    shutil.copytree(ckpts / "step_00000002", tmp_path / "copied")
    args = ["average", ckpts / "step_00000002", tmp_path / "copied", "--out", tmp_path / "avg3"]
    proc = pretrain(*args, cwd=tmp_path, rc=2)
    assert "are the same checkpoint" in proc.stderr and not (tmp_path / "avg3").exists()

    # a checkpoint of another shape, or of another tokenizer (of the same size), is refused by name: nothing written
    pretrain(
        "run",
        *run_args(tmp_path, corpus, "name=wide", "model.intermediate_size=96"),
        "--no-demo",
        cwd=tmp_path,
    )
    other = tmp_path / "wide" / "checkpoints" / "step_00000003"
    proc = pretrain("average", ckpts / "step_00000004", other, "--out", tmp_path / "avg2", cwd=tmp_path, rc=2)
    assert "model.intermediate_size is 96 there, 128 here" in proc.stderr and not (tmp_path / "avg2").exists()
    shutil.rmtree(tmp_path / "wide")
    other_text = small_corpus(tmp_path, slice(100, 120), "other.jsonl")
    pretrain("run", *run_args(tmp_path, other_text, "name=words"), "--no-demo", cwd=tmp_path)
    other = tmp_path / "words" / "checkpoints" / "step_00000003"
    proc = pretrain("average", ckpts / "step_00000004", other, "--out", tmp_path / "avg2", cwd=tmp_path, rc=2)
    assert "tokenizer (sha256 of tokenizer.json) is" in proc.stderr and not (tmp_path / "avg2").exists()
    # a run of another seed (its own initialisation, no init_from in common): its weights are not aligned with these
    data = [f"data.tokenizer={tmp_path / 'r' / 'tokenizer'}", f"data.shards={tmp_path / 'r' / 'shards'}"]
    pretrain("train", *run_args(tmp_path, corpus, "name=seeded", "train.seed=7", *data), cwd=tmp_path)
    other = tmp_path / "seeded" / "checkpoints" / "step_00000003"
    proc = pretrain("average", ckpts / "step_00000004", other, "--out", tmp_path / "avg2", cwd=tmp_path, rc=2)
    assert "initialised apart (train.seed 7 there, train.seed 1234 here" in proc.stderr
    assert not (tmp_path / "avg2").exists()
    assert json.loads((ckpts / "step_00000004" / "trainer_state.json").read_text())["step"] == 4


def test_average_refuses_checkpoints_either_side_of_a_rope_theta_phase(tmp_path):
    """A RoPE run whose schedule raised rope_theta at step 2 (a context extension): its checkpoints at steps 2 and 4
    have one fingerprint (it records the base theta), and their average was exported under step 4's theta. Refused
    now, naming both; two checkpoints of one phase still pass."""
    import yaml

    from pretrain.core.errors import UserError
    from pretrain.core.parsing import to_dict
    from pretrain.train.averaging import _refuse_other_positions
    from pretrain.train.setup import load_config
    from pretrain.train.state import TrainState

    cfg = load_config("tiny", ["model.position_embedding=rope", "schedule.phases=[{start: 3, rope_theta: 40000}]"])
    ckpts = {}
    for step in (2, 3, 4, 5):
        ckpts[step] = tmp_path / f"step_{step:08d}"
        ckpts[step].mkdir()
        (ckpts[step] / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        TrainState(step=step).save(ckpts[step])
    _refuse_other_positions([ckpts[2], ckpts[3]])  # steps 1-3 trained at the base theta
    _refuse_other_positions([ckpts[4], ckpts[5]])
    with pytest.raises(UserError, match=r"step_00000004 trained its last step under model.rope_theta 40000, .* 10000"):
        _refuse_other_positions([ckpts[3], ckpts[4]])


def test_average_refuses_a_run_from_init_from_with_one_from_scratch_of_the_same_seed(tmp_path, monkeypatch):
    """A run started from model.init_from and a run from scratch were averaged where their train.seed matched (1234,
    every run's default), though their weights share no starting point. One init_from, whatever the seeds (fine-tunings
    of one checkpoint), is one start."""
    from pretrain.train import averaging
    from pretrain.train.setup import read_config

    (tmp_path / "base").mkdir()
    configs = {
        "scratch": read_config("tiny"),
        "from-base": read_config("tiny", [f"model.init_from={tmp_path / 'base'}"]),
        "from-base-seed-7": read_config("tiny", [f"model.init_from={tmp_path / 'base'}", "train.seed=7"]),
    }
    monkeypatch.setattr(averaging, "checkpoint_config", lambda path: (configs[path.name], None))
    with pytest.raises(UserError, match=r"initialised apart \(train.seed 1234 there, model.init_from .*base here\)"):
        averaging._refuse_other_inits([Path("from-base"), Path("scratch")])
    averaging._refuse_other_inits([Path("from-base"), Path("from-base-seed-7")])
    # a run continued from another run's export starts where that run started: theirs average (seed 99 here)
    from pretrain.core.outputs import mark_output
    from pretrain.train.state import TrainState

    mark_output(tmp_path / "r", "run")
    (tmp_path / "r" / "checkpoints" / "step_00000003").mkdir(parents=True)
    TrainState(step=3).save(tmp_path / "r" / "checkpoints" / "step_00000003")
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step_00000003")
    configs["step_00000003"] = read_config("tiny", ["train.seed=99"])
    configs["continued"] = read_config("tiny", [f"model.init_from={tmp_path / 'r' / 'hf'}"])
    averaging._refuse_other_inits([Path("continued"), Path("step_00000003")])
    with pytest.raises(UserError, match=r"initialised apart \(train.seed 1234 there, train.seed 99 here\)"):
        averaging._refuse_other_inits([Path("continued"), Path("scratch")])
