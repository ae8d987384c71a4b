"""The trainer's host work per step around the model: CPU time of its loop outside the model's forward, autograd's
backward and the optimizer's step, beside the same outside-time of a bare DeepSpeed-engine loop and a bare torch loop
(forward, backward, optimizer.step, lr schedule, zero_grad) over the same prepared batches, in one process,
alternated in segments of --seg steps, medians over --repeats.

A model so small that its math is cheap (hidden 32, seq 32; --layers sets the module tree, 12 = BERT-base's 154
parameter tensors), one intra-op thread, `pretrain train` on the tiny preset with the loader replaced by 16 batches it
made, cycled (on a GPU its workers prepare them). Thread CPU time, not wall time: on a shared machine a process's
waits for a core are not the loop's work. What the loop does outside the model is what a launch-bound GPU step pays
on the host before the next kernels are queued.

    python benchmarks/step_syncs.py prepare --work DIR      # tokenizer and shards (shared with that tool)
    python benchmarks/step_overhead.py --work DIR --layers 12 [--precision bf16] [overrides...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCHES = 16


def deepspeed_loop(self, batches):
    """A bare DeepSpeed-engine loop over `batches` (what the trainer's step is, less the trainer)."""
    ds = self.engine.ds
    for batch in batches:
        loss, _ = ds(batch)  # the model autocasts itself where the run's precision is bf16
        ds.backward(loss)
        ds.step()


def torch_loop(self, batches):
    """A bare torch loop over `batches`: forward, backward, optimizer and lr steps, zero_grad."""
    ds = self.engine.ds
    model, optimizer, schedule = ds.module, ds.optimizer, ds.lr_scheduler
    for batch in batches:
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)


def train_args(a, out: Path) -> list[str]:
    """`pretrain train` on the tiny preset, made as small as its math allows but for --layers."""
    args = ["train", "tiny", f"output_dir={out}", "name=r", f"data.tokenizer={a.work / 'tok'}"]
    args += [f"data.shards={a.work / 'shards'}", f"model.num_layers={a.layers}", "model.hidden_size=32"]
    args += ["model.num_heads=2", "model.intermediate_size=64", "data.max_seq_len=32", "train.micro_batch_size=8"]
    args += [f"train.max_steps={a.seg * (a.repeats + 1)}", f"train.log_every={a.seg}", "train.save_every=0"]
    return args + ["data.num_workers=0", "wandb.mode=disabled", f"train.precision={a.precision}", *a.overrides]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--seg", type=int, default=50, help="steps per timed segment (the trainer logs once per segment)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")

    import torch

    torch.set_num_threads(1)
    from pretrain.cli import main as cli
    from pretrain.train import trainer as T

    inside = [0.0]  # CPU seconds in the model's forward, autograd's backward and the optimizer's step

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] += time.thread_time() - start

        return wrapper

    torch.autograd.backward = timed(torch.autograd.backward)
    outside = {"trainer": [], "deepspeed": [], "torch": []}
    enter_phase, after_step = T.Trainer.enter_phase, T.Trainer.after_step

    def prepared(self, phase):
        loader = enter_phase(self, phase)
        self.bench_batches = [next(loader) for _ in range(BATCHES)]
        ds = self.engine.ds
        ds.module.forward = timed(ds.module.forward)
        ds.optimizer.step = timed(ds.optimizer.step)  # the instance's, inside the lr scheduler's wrapper
        return itertools.cycle(self.bench_batches)

    def segment(name, fn, self):
        batches = [b.to(self.engine.device) for b in itertools.islice(itertools.cycle(self.bench_batches), a.seg)]
        inside[0], start = 0.0, time.thread_time()
        fn(self, batches)
        outside[name].append((time.thread_time() - start - inside[0]) / a.seg * 1e6)

    started = {}

    def timed_after_step(self, stopping):
        stop = after_step(self, stopping)
        if self.state.step % a.seg == 0:
            if "at" in started:
                outside["trainer"].append((time.thread_time() - started["at"] - inside[0]) / a.seg * 1e6)
            if self.state.step > a.seg:  # the first segment warms up
                segment("deepspeed", deepspeed_loop, self)
                segment("torch", torch_loop, self)
            self.engine.take_skip_flags()
            inside[0], started["at"] = 0.0, time.thread_time()
        return stop

    T.Trainer.enter_phase, T.Trainer.after_step = prepared, timed_after_step
    out = a.work / "overhead-runs"
    shutil.rmtree(out, ignore_errors=True)
    with contextlib.redirect_stderr(io.StringIO()):
        cli(train_args(a, out))
    result = {k: round(statistics.median(v), 1) for k, v in outside.items()}
    print("RESULT " + json.dumps({"us_per_step_outside_the_model": result, "layers": a.layers}), flush=True)


if __name__ == "__main__":
    main()
