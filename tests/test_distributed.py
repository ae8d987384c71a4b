"""Distributed training you can trust, proven on CPU ranks (DS_ACCELERATOR=cpu) through the real launchers:
rank equivalence, bitwise resume for every objective, resume on fewer ranks, SIGTERM, kill -9 during a
checkpoint write, non-finite policy, integrity checks, export from ZeRO-3 and multi-rank checkpoints."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import requires_fp16

from pretrain.train.distributed import single_process_env

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
pytestmark = pytest.mark.slow

# fp32 without dropout: runs that see the same samples must compute the same numbers
EXACT = ["train.precision=fp32", "model.hidden_dropout=0", "model.attention_dropout=0"]


def _env():
    return single_process_env(DS_ACCELERATOR="cpu", WANDB_MODE="disabled")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(data, name, *overrides, ranks=1):
    args = [
        "train",
        "tiny",
        f"output_dir={data['dir']}",
        f"name={name}",
        f"data.tokenizer={data['tok']}",
        f"data.shards={data['shards']}",
        "train.log_every=1",
        "train.warmup_steps=1",
        "model.num_layers=1",
        *overrides,
    ]
    if ranks == 1:
        return [sys.executable, "-m", "pretrain.cli", *args]
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(_port()),
        "--module",
        "pretrain.cli",
        *args,
    ]


def run(data, name, *overrides, ranks=1, rc=0):
    proc = subprocess.run(
        command(data, name, *overrides, ranks=ranks),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=data["dir"],
    )
    if rc is not None:
        assert proc.returncode == rc, f"rc={proc.returncode}\n{proc.stderr[-5000:]}"
    return proc


def losses(data, name):
    return [json.loads(line)["loss"] for line in (data["dir"] / name / "metrics.jsonl").read_text().splitlines()]


def final_weights(data, name):
    from pretrain.train.checkpoint import latest_checkpoint, load_module_state

    return load_module_state(latest_checkpoint(data["dir"] / name / "checkpoints"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("dist")
    corpus = d / "corpus.jsonl"
    corpus.write_text("\n".join(CORPUS.read_text().splitlines()[:12]) + "\n")
    train_tokenizer([corpus], d / "tok", vocab_size=512, show_progress=False)
    build_shards([corpus], d / "tok", d / "shards", num_workers=0, show_progress=False)
    return {"dir": d, "tok": d / "tok", "shards": d / "shards"}


def _shm_buffers() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


@pytest.mark.parametrize("recipe", ["mlm", "mlm_wwm"])
def test_two_ranks_or_accumulation_equal_one_rank_with_double_batch(data, recipe):
    """Whole-word masking gives every micro-batch its own number of targets: equal only because each loss is
    a mean over the targets of the whole step (train.loss_normalization=step)."""
    before = _shm_buffers()
    extra = [*RECIPES[recipe], "train.max_steps=4", *EXACT]
    run(data, f"one-{recipe}", "train.micro_batch_size=8", *extra)
    run(data, f"two-{recipe}", "train.micro_batch_size=4", *extra, ranks=2)
    run(data, f"accum-{recipe}", "train.micro_batch_size=4", "train.grad_accum_steps=2", *extra)
    one, two, accum = (losses(data, f"{name}-{recipe}") for name in ("one", "two", "accum"))
    assert len(one) == len(two) == len(accum) == 4
    assert one == pytest.approx(two, rel=1e-5, abs=1e-5)
    assert one == pytest.approx(accum, rel=1e-5, abs=1e-5)
    # DeepSpeed's CPU all-reduce buffers (66 MB of RAM per rank in /dev/shm) must not outlive the runs
    assert _shm_buffers() - before == set()


SCHEDULE = [
    "train.max_steps=4",
    "train.micro_batch_size=4",
    "schedule.phases=[{start: 2, micro_batch_size: 2}]",
    "schedule.values=[{key: train.global_batch, points: [[0, 8], [2, 16]], multiple_of: 8}, "
    "{key: objectives.mlm.mask_prob, points: [[0, 0.3], [3, 0.15]]}]",
]


@pytest.mark.parametrize("zero", [0, 2])
def test_a_schedule_trains_alike_on_two_ranks(data, zero):
    """A global-batch ramp and a phase with another micro-batch: one rank accumulates 2 then 8 micro-batches, two
    ranks 1 then 4 (DeepSpeed told where each step ends); the same samples and masks, so the same losses."""
    extra = [*EXACT, f"train.zero_stage={zero}", *SCHEDULE]
    run(data, f"sched-one-{zero}", *extra)
    run(data, f"sched-two-{zero}", *extra, ranks=2)
    one, two = (metrics(data, f"sched-{n}-{zero}") for n in ("one", "two"))
    assert [r["global_batch"] for r in one] == [r["global_batch"] for r in two] == [8, 8, 16, 16]
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], rel=1e-5, abs=1e-5)


RECIPES = {
    "mlm": [],
    "mlm_wwm": ["objectives.mlm.whole_word=true"],
    "span": ["objectives={span: {}}"],
    "mlm_nsp": ["objectives={mlm: {}, nsp: {}}"],
    "mlm_sop": ["objectives={mlm: {}, sop: {}}"],
    "rtd": ["objectives={rtd: {}}"],
    "plm": ["objectives={plm: {}}"],
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_resume_is_bitwise_identical(data, recipe):
    """N steps straight vs N/2, stop, resume N/2: the same loss at every step and the same final weights
    (bf16 where the CPU has it, dropout on: the rng state is part of the checkpoint)."""
    extra = RECIPES[recipe]
    run(data, f"{recipe}-straight", "train.max_steps=4", "train.save_every=100", *extra)
    run(data, f"{recipe}-split", "train.max_steps=4", "train.save_every=100", "train.exit_after_steps=2", *extra)
    proc = run(data, f"{recipe}-split", "train.max_steps=4", "train.save_every=100", *extra)
    assert "resumed from" in proc.stderr
    assert losses(data, f"{recipe}-straight") == losses(data, f"{recipe}-split")
    a, b = final_weights(data, f"{recipe}-straight"), final_weights(data, f"{recipe}-split")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_a_stop_inside_a_log_interval_resumes_into_the_same_metrics_lines(data):
    """log_every=2, stopped at step 3: the stop logs step 3 alone, and the resumed run's step-4 line averages steps 3
    and 4, as the run never stopped does (it averaged step 4 alone: 6.170 for 6.193). rtd: its AUC's histograms are
    carried too."""
    common = ["train.max_steps=4", "train.log_every=2", "train.save_every=100", "objectives={rtd: {}}"]
    run(data, "interval-straight", *common)
    run(data, "interval-split", *common, "train.exit_after_steps=3")
    run(data, "interval-split", *common)

    def lines(name):
        records = [json.loads(line) for line in (data["dir"] / name / "metrics.jsonl").read_text().splitlines()]
        timing = {"time", "tokens_per_s", "samples_per_s", "tflops", "mfu", "data_wait"}
        return {r["step"]: {k: v for k, v in r.items() if k not in timing} for r in records}

    straight, split = lines("interval-straight"), lines("interval-split")
    assert sorted(straight) == [2, 4] and sorted(split) == [2, 3, 4]
    assert split[2] == straight[2] and split[4] == straight[4]
    assert split[3]["loss"] != straight[4]["loss"]  # the stop's own line: step 3 alone


@requires_fp16
def test_resume_after_skipped_fp16_steps_keeps_the_schedule(data):
    """fp16's loss scale starts at 2^16 and overflows in the first steps at this learning rate: a checkpoint then
    holds DeepSpeed's count of skipped steps (not the run's: fp16's overflows are routine), which a resume restores.
    The first step after it used to be taken for one more skip (the count was compared with the one before loading):
    the schedule ran a step ahead from then on."""
    fp16 = ["train.precision=fp16", "train.lr=2", "train.lr_schedule=linear", "train.max_steps=10"]
    fp16.append("train.save_every=6")
    run(data, "fp16-skips-straight", *fp16)
    run(data, "fp16-skips-split", *fp16, "train.exit_after_steps=6")
    proc = run(data, "fp16-skips-split", *fp16)
    assert "resumed from" in proc.stderr
    straight, split = metrics(data, "fp16-skips-straight"), metrics(data, "fp16-skips-split")
    assert straight[5]["loss_scale"] < 2.0**16  # overflows (skipped steps) before the checkpoint
    keys = ("step", "loss", "lr", "skipped_steps", "loss_scale")
    assert [[r[k] for k in keys] for r in split] == [[r[k] for k in keys] for r in straight]
    a, b = final_weights(data, "fp16-skips-straight"), final_weights(data, "fp16-skips-split")
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


RESIZE = {
    # name: (ranks before, ranks after, overrides, tolerance). ZeRO-0 fp32 keeps whole optimizer state in one
    # file; the others shard it per rank and resume through DeepSpeed's universal checkpoint.
    "zero0-fp32-2to1": (2, 1, [*EXACT], 1e-5),
    "zero1-fp32-2to1": (2, 1, [*EXACT, "train.zero_stage=1"], 1e-5),
    "zero3-fp32-2to1": (2, 1, [*EXACT, "train.zero_stage=3"], 1e-4),  # ZeRO-3 reduces in another order
    "zero2-bf16-1to2": (1, 2, [*EXACT[1:], "train.precision=bf16", "train.zero_stage=2"], 1e-3),
}


def adam_steps(checkpoint) -> set[float]:
    """Every Adam `step` count in a checkpoint's optimizer files (any ZeRO stage's layout), as floats."""
    found = set()

    def walk(node):
        if isinstance(node, dict):
            if "step" in node and "exp_avg" in node:
                found.add(float(node["step"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    for file in sorted(checkpoint.glob("*.pt")):
        if not file.name.startswith("rng_"):
            walk(torch.load(file, map_location="cpu", weights_only=False))
    return found


@pytest.mark.parametrize("case", list(RESIZE))
def test_resume_on_another_number_of_ranks_continues_the_same_run(data, case):
    """N ranks for 2 steps, then M ranks (same global batch) to 4: the same samples, and the same optimizer
    state, as an uninterrupted run."""
    before, after, overrides, tol = RESIZE[case]
    name = f"resize-{case}"
    mbs = lambda ranks: f"train.micro_batch_size={8 // ranks}"  # noqa: E731
    run(data, name, "train.max_steps=4", mbs(before), "train.exit_after_steps=2", *overrides, ranks=before)
    proc = run(data, name, "train.max_steps=4", mbs(after), *overrides, ranks=after)
    run(data, f"{name}-steady", "train.max_steps=4", mbs(before), *overrides, ranks=before)
    assert "resumed from" in proc.stderr
    assert losses(data, name) == pytest.approx(losses(data, f"{name}-steady"), rel=tol, abs=tol)
    ckpts = data["dir"] / name / "checkpoints"
    state = json.loads((ckpts / "step_00000004" / "trainer_state.json").read_text())
    assert state["consumed_samples"] == 4 * 8 and state["world_size"] == after
    assert (ckpts / "step_00000002" / "universal").is_dir() == (case != "zero0-fp32-2to1")
    # Adam counted each step once (DeepSpeed's universal load under ZeRO-3 shared one step tensor between its
    # sub-groups, which the fused AdamW then advanced once each: 6 at step 4)
    assert adam_steps(ckpts / "step_00000004") == {4.0}
    # the step-4 weights (after two steps that need the restored Adam moments) match the uninterrupted run's
    a, b = final_weights(data, name), final_weights(data, f"{name}-steady")
    assert all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in a), [
        k for k in a if not torch.allclose(a[k], b[k], rtol=tol, atol=tol)
    ]


def test_the_ema_averages_the_fp32_masters_partitioned_and_resumes(data):
    """Under DeepSpeed's bf16 ZeRO-2 the module holds a bf16 copy of the weights: the EMA averages the fp32 masters,
    each rank its fragment, gathered whole into the checkpoint (it was the bf16 copy: 3.9e-4 from the masters at
    decay 0.001, a LayerNorm gain stuck at 1.0). Resumed, each rank takes its fragment back: the EMA goes on as in an
    uninterrupted run."""
    from pretrain.train.checkpoint import latest_checkpoint, load_ema, load_module_state

    bf16 = [*EXACT[1:], "train.precision=bf16", "train.zero_stage=2", "train.max_steps=4", "train.micro_batch_size=4"]
    run(data, "ema-masters", *bf16, "train.ema_decay=0.000001", ranks=2)
    ckpt = latest_checkpoint(data["dir"] / "ema-masters" / "checkpoints")
    masters, ema = load_module_state(ckpt), load_ema(ckpt)
    assert ema.keys() <= masters.keys() and len(ema) > 10  # (the masters' file names tied weights twice)
    assert any(not torch.equal(masters[k], masters[k].bfloat16().float()) for k in ema)  # not what bf16 holds
    assert all(torch.allclose(ema[k], masters[k], rtol=0, atol=1e-6) for k in ema), max(
        (ema[k] - masters[k]).abs().max().item() for k in ema
    )
    decay = [*bf16, "train.ema_decay=0.5", "train.save_every=2"]
    run(data, "ema-cut", *decay, "train.exit_after_steps=2", ranks=2)
    run(data, "ema-cut", *decay, ranks=2)
    run(data, "ema-steady", *decay, ranks=2)
    cut, steady = (load_ema(latest_checkpoint(data["dir"] / n / "checkpoints")) for n in ("ema-cut", "ema-steady"))
    assert [k for k in steady if not torch.equal(cut[k], steady[k])] == []


def _wait_for(path: Path, lines: int, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= lines:
            return
        if proc.poll() is not None:
            raise AssertionError(f"training ended early: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for training to progress")


def test_sigterm_finishes_step_saves_and_resumes(data):
    cmd = command(data, "term", "train.max_steps=100000", "train.save_every=100000")
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=data["dir"])
    _wait_for(data["dir"] / "term" / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    latest = (data["dir"] / "term" / "checkpoints" / "latest").read_text().strip()
    step = json.loads((data["dir"] / "term" / "checkpoints" / latest / "trainer_state.json").read_text())["step"]
    assert latest == f"step_{step:08d}" and step >= 2
    proc = run(data, "term", "train.max_steps=100000", "train.save_every=100000", "train.exit_after_steps=1")
    assert f"(step {step}," in proc.stderr
    assert (
        json.loads((data["dir"] / "term" / "checkpoints" / f"step_{step + 1:08d}" / "trainer_state.json").read_text())[
            "step"
        ]
        == step + 1
    )


def test_kill9_during_checkpoint_writes_keeps_a_loadable_latest(data):
    """Checkpoint every step and kill -9 at random moments: `latest` always names a complete checkpoint."""
    from pretrain.train.checkpoint import latest_checkpoint, verify_integrity

    rng = random.Random(0)
    root = data["dir"] / "killed" / "checkpoints"
    for _ in range(3):
        proc = subprocess.Popen(
            command(data, "killed", "train.max_steps=100000", "train.save_every=1"),
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=data["dir"],
        )
        _wait_for(data["dir"] / "killed" / "metrics.jsonl", 1, proc)
        time.sleep(rng.uniform(0.0, 1.5))
        proc.kill()
        proc.wait()
        latest = latest_checkpoint(root)
        if latest is not None:
            verify_integrity(latest)  # raises, naming the file, if the pointer moved before the write finished
            assert json.loads((latest / "trainer_state.json").read_text())["step"] == int(latest.name[5:])
    before = latest_checkpoint(root)
    proc = run(data, "killed", "train.max_steps=100000", "train.save_every=1", "train.exit_after_steps=1")
    assert "resumed from" in proc.stderr or before is None


def test_truncated_checkpoint_fails_naming_the_file(data):
    run(data, "trunc", "train.max_steps=2", "train.save_every=2")
    ckpt = data["dir"] / "trunc" / "checkpoints" / "step_00000002"
    victim = next(ckpt.glob("*model_states.pt"))
    victim.write_bytes(victim.read_bytes()[:1000])
    proc = run(data, "trunc", "train.max_steps=4", rc=2)
    assert str(victim) in proc.stderr and "truncated" in proc.stderr and "Traceback" not in proc.stderr


def metrics(data, name):
    return [json.loads(line) for line in (data["dir"] / name / "metrics.jsonl").read_text().splitlines()]


@requires_fp16
def test_fp16_under_zero0_trains_like_zero2_and_fp32(data):
    """DeepSpeed's ZeRO-0 fp16 path unscales gradients that were never scaled, and starts Adam with a dummy
    step; the trainer corrects both, so ZeRO-0 follows ZeRO-2 (which has neither problem) and fp32."""
    fp16 = [*EXACT[1:], "train.precision=fp16", "train.max_steps=4"]
    run(data, "fp16-zero0", *fp16, "train.ema_decay=0.000001")  # an EMA that is the fp32 masters (checked below)
    run(data, "fp16-zero2", *fp16, "train.zero_stage=2")
    run(data, "fp32-zero0", *EXACT, "train.max_steps=4")
    zero0, zero2 = metrics(data, "fp16-zero0"), metrics(data, "fp16-zero2")
    assert [r["loss"] for r in zero0] == pytest.approx([r["loss"] for r in zero2], rel=1e-4)
    assert [r["loss"] for r in zero0] == pytest.approx(losses(data, "fp32-zero0"), rel=1e-3)
    # logged unscaled, like ZeRO's; the dynamic loss scale starts at 2^16 and saw no overflow here
    assert [r["grad_norm"] for r in zero0] == pytest.approx([r["grad_norm"] for r in zero2], rel=1e-2)
    assert all(r["loss_scale"] == 2.0**16 for r in zero0 + zero2)
    from pretrain.train.checkpoint import latest_checkpoint, load_ema

    ckpt = latest_checkpoint(data["dir"] / "fp16-zero0" / "checkpoints")
    ema, masters = load_ema(ckpt), final_weights(data, "fp16-zero0")  # the masters of ZeRO-0's fp16 wrapper
    assert all(torch.allclose(ema[k], masters[k], rtol=0, atol=1e-6) for k in ema)
    # fp32 under ZeRO-0, where DeepSpeed keeps no norm, logs the one the trainer measures
    assert [r["grad_norm"] for r in metrics(data, "fp32-zero0")] == pytest.approx(
        [r["grad_norm"] for r in zero2], rel=1e-2
    )


@pytest.mark.parametrize("ranks", [1, 2])
def test_nonfinite_loss_policy_is_applied_on_every_rank(data, ranks):
    """An absurd learning rate blows the weights up: steps are skipped and counted, then the run stops."""
    proc = run(
        data,
        f"nan{ranks}",
        "train.max_steps=40",
        "train.lr=1e30",
        "train.warmup_steps=0",
        "train.max_skipped_steps=3",
        "train.micro_batch_size=4",
        ranks=ranks,
        rc=None,
    )
    assert proc.returncode == 76, proc.stderr[-3000:]
    assert proc.stderr.count("stopping: train.nan_policy=skip") == 1  # rank 0 says it, every rank stops
    records = [json.loads(line) for line in (data["dir"] / f"nan{ranks}" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["skipped_steps"] >= 2


@pytest.mark.parametrize("zero", [0, 1])
def test_the_learning_rate_follows_the_step_through_skipped_steps(data, zero):
    """Every step after the first is skipped (non-finite); the schedule is a function of the step, which a skip
    counts: the same learning rates whether ZeRO-0's guarded optimizer skips or DeepSpeed's ZeRO-1 wrapper does
    (which held its schedule back, so the rate never reached its end)."""
    name = f"skips-zero{zero}"
    steps = ["train.max_steps=6", "train.lr=1e30", "train.warmup_steps=0", "train.lr_schedule=linear"]
    run(data, name, *EXACT, *steps, "train.max_skipped_steps=100", "train.log_every=1", f"train.zero_stage={zero}")
    records = metrics(data, name)
    assert records[-1]["skipped_steps"] >= 4
    # after step s the optimizer holds step s + 1's rate: 1e30 * (6 - s) / 6
    assert [r["lr"] for r in records] == pytest.approx([1e30 * (6 - s) / 6 for s in range(1, 7)])


def test_export_from_zero3_and_two_rank_checkpoints(data, tmp_path):
    """The same training under ZeRO-3 on 2 ranks and ZeRO-0 on 1 rank exports to HF models that agree."""
    from transformers import AutoModelForMaskedLM

    run(data, "z3", "train.max_steps=2", "train.zero_stage=3", "train.micro_batch_size=4", *EXACT, ranks=2)
    run(data, "z0", "train.max_steps=2", "train.micro_batch_size=8", *EXACT)
    outs = {}
    for name in ("z3", "z0"):
        proc = subprocess.run(
            [sys.executable, "-m", "pretrain.cli", "export", str(data["dir"] / name), "--out", str(tmp_path / name)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "max |logit diff|" in proc.stderr  # verified against our model loaded from the checkpoint
        outs[name] = AutoModelForMaskedLM.from_pretrained(tmp_path / name).eval()
    ids = torch.randint(5, 500, (2, 16))
    with torch.no_grad():
        a, b = (outs[n](input_ids=ids).logits for n in ("z3", "z0"))
    assert (a - b).abs().max().item() < 1e-4


SLOW_DATA_STAGES = """
import sys, time
import pretrain.pipeline as pipeline
from pretrain.cli import entry

real = pipeline.stage_shards

def slow(*args, **kwargs):  # a corpus whose shards take longer than train.collective_timeout_minutes to build
    time.sleep(25)
    return real(*args, **kwargs)

if __name__ == "__main__":  # the shard workers are spawned: they import this file as __mp_main__
    pipeline.stage_shards = slow
    entry()  # as `python -m pretrain.cli`: after a 2-rank run it leaves by os._exit, not through finalization
"""


def test_pretrain_run_on_two_ranks_outwaits_the_collective_timeout_for_the_data_stages(data, tmp_path):
    """Rank 0 builds the tokenizer and shards while the other ranks wait: they waited in a collective, which gave up
    after train.collective_timeout_minutes (30 by default), so a large corpus could never be prepared by a multi-rank
    `pretrain run`. Here the shards take 25 s against a 15 s timeout."""
    script = tmp_path / "slow_data_stages.py"
    script.write_text(SLOW_DATA_STAGES)
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_port())]
    args = ["run", "tiny", f"output_dir={tmp_path}", "name=slow", f"data.corpus=[{data['dir'] / 'corpus.jsonl'}]"]
    args += ["data.vocab_size=512", "model.num_layers=1", "train.max_steps=2", "train.collective_timeout_minutes=0.25"]
    proc = subprocess.run(
        [*launcher, str(script), *args, "--no-demo"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (tmp_path / "slow" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert (tmp_path / "slow" / "hf" / "config.json").is_file()


def test_a_child_run_keeps_what_pythonpath_held_and_drops_the_launchers_ranks(monkeypatch):
    """A lent GPU machine has DeepSpeed only on PYTHONPATH (/tmp/site): a benchmark's or an ablation arm's process
    that replaced PYTHONPATH with the repository could not import it."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    ranks = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    for key, value in {**ranks, "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    env = single_process_env(WANDB_MODE="disabled")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/site"]
    assert not {*ranks, "TORCHELASTIC_RUN_ID"} & env.keys()  # LOCAL_WORLD_SIZE would split its loader's workers
    assert env["WANDB_MODE"] == "disabled" and env["PATH"] == os.environ["PATH"]
    monkeypatch.delenv("PYTHONPATH")
    assert single_process_env()["PYTHONPATH"] == str(ROOT)


SLOW_RANK_1 = """
import os
import time

from data_pipeline import loader

collate = loader.Collator.__call__


def slow(self, samples):  # rank 1's loader cannot keep up: 1 s a micro-batch, several steps' time; rank 0's can
    if os.environ.get("RANK") == "1":
        time.sleep(1.0)
    return collate(self, samples)


loader.Collator.__call__ = slow
"""


@pytest.mark.slow
def test_data_wait_is_the_slowest_ranks(data, tmp_path, monkeypatch):
    """Rank 0 writes the log line; a slow loader on another rank shows on rank 0 as time in the step's collectives,
    not as waiting for data. data_wait is the maximum over ranks, so a loader that sets the pace anywhere says so."""
    from objectives.base import PLUGINS_ENV

    (tmp_path / "slow_rank1.py").write_text(SLOW_RANK_1)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "slow_rank1")
    run(data, "wait-2r", "train.max_steps=7", "train.log_every=3", ranks=2)
    records = metrics(data, "wait-2r")
    assert [r["step"] for r in records] == [3, 6, 7]
    # rank 1 waits 2 s of the first interval (rank 0 also waits there for rank 1's first fetch, set-up to rank 1),
    # 3 s of the second and 1 s of the last, each step taking a few tenths of a second more on an idle machine
    # (0.48 / 0.93 / 0.64); rank 0's own wait, what the line said before, was 0.002
    waits = [r["data_wait"] for r in records]
    assert waits[0] > 0.2 and all(w > 0.35 for w in waits[1:]), waits


FULL_DISK_ON_RANK_0 = """
import errno
import os

import deepspeed.runtime.engine as engine
import torch

from pretrain.cli import entry

real_save, real_copy, what = torch.save, engine.copyfile, os.environ["FULL_DISK_AT"]


def full(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def save(obj, f, *args, **kwargs):  # rank 0's disk fills up while DeepSpeed writes the step-4 model states
    if what == "model_states" and os.environ.get("RANK") == "0" and "step_00000004" in str(f) and what in str(f):
        raise full(f)
    return real_save(obj, f, *args, **kwargs)


def copy(src, dst, *args, **kwargs):  # or as it copies zero_to_fp32.py beside them (shutil's), saving step 4
    saving = os.path.isdir(os.path.join(os.path.dirname(dst), "step_00000004"))
    if what == "zero_to_fp32" and os.environ.get("RANK") == "0" and saving and what in str(dst):
        raise full(dst)
    return real_copy(src, dst, *args, **kwargs)


if __name__ == "__main__":
    torch.save, engine.copyfile = save, copy
    entry()
"""


@pytest.mark.parametrize("what,zero", [("model_states", 0), ("zero_to_fp32", 1)])
def test_a_full_disk_inside_deepspeeds_save_on_one_rank_fails_every_rank_at_once(data, tmp_path, what, zero):
    """A write failing inside DeepSpeed's save_checkpoint on one rank skipped the barrier DeepSpeed ends it with: the
    other ranks waited there for train.collective_timeout_minutes (30 by default), then the run said it had lost a
    rank. Now every rank leaves at once with the disk's error, and the previous checkpoint stays the latest: a model
    state DeepSpeed writes, or under ZeRO the recovery script it copies beside them."""
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_ON_RANK_0)
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_port())]
    args = ["train", "tiny", f"output_dir={tmp_path}", "name=r", f"data.tokenizer={data['tok']}"]
    args += [f"data.shards={data['shards']}", "model.num_layers=1", "train.warmup_steps=1", "train.save_every=2"]
    args += ["train.max_steps=6", "train.collective_timeout_minutes=2", f"train.zero_stage={zero}"]
    env = {**_env(), "FULL_DISK_AT": what}
    proc = subprocess.run([*launcher, str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "lost contact" not in proc.stderr, proc.stderr[-5000:]
    assert "error: no space left on device" in proc.stderr, proc.stderr[-5000:]
    assert proc.stderr.count("step_00000002 stays the latest checkpoint") == 2  # each rank's line names it
    checkpoints = tmp_path / "r" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    assert not (checkpoints / "step_00000004").exists()
