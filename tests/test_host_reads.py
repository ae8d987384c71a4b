"""Between logging steps a training step never makes the host wait for the device: no code of ours reads a tensor
back (`.item()`, `bool`/`int`/`float` of a tensor, `.tolist()`, `.numpy()`, `nonzero`, boolean-mask indexing).

Counted on the CPU, where every such read is visible to a TorchFunctionMode, around real optimizer steps of the
trainer (`Trainer.train_step` and `after_step` of the steps that do not log), for every objective, in fp32 and bf16,
with accumulation and the unpadded encoder. Each read is attributed to the first frame outside torch: ours when that
frame is in pretrain/, objectives/ or data_pipeline/. DeepSpeed's own reads are counted apart (they are not ours).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

SCRIPT = r"""
import collections, json, os, sys
import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.realpath(sys.argv[1])
OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("pretrain", "objectives", "data_pipeline"))
TORCH = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__format__", "__array__",
         "nonzero", "argwhere", "masked_select", "unique"}


def _mask_index(index):
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ours, self.library = collections.Counter(), collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name in ("__getitem__", "__setitem__") and len(args) > 1 and _mask_index(args[1])):
            frame = sys._getframe(1)
            while frame and (os.path.realpath(frame.f_code.co_filename).startswith(TORCH)
                             or frame.f_code.co_filename == "<string>"):
                frame = frame.f_back
            where = f"{os.path.realpath(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?"
            (self.ours if where.startswith(OURS) else self.library)[f"{where} {name}"] += 1
        return func(*args, **(kwargs or {}))


from pretrain.train import trainer as T
from pretrain.cli import main

mode = HostReads()
counted = {"steps": 0}
original_step, original_after = T.Trainer.train_step, T.Trainer.after_step


def logs_next(self):
    step, t = self.state["step"], self.cfg.train
    return step % t.log_every == 0 or step == t.max_steps or (t.save_every and step % t.save_every == 0)


def train_step(self, micro_batches):
    self.state["step"] += 1
    quiet = not logs_next(self)
    self.state["step"] -= 1
    if quiet:
        counted["steps"] += 1
        with mode:
            return original_step(self, micro_batches)
    return original_step(self, micro_batches)


def after_step(self, stopping):
    if logs_next(self):
        return original_after(self, stopping)
    with mode:
        return original_after(self, stopping)


T.Trainer.train_step, T.Trainer.after_step = train_step, after_step

# the counter sees reads in our files: Packed.from_mask without the token count reads the mask back
from pretrain.model.padding import Packed
with mode:
    Packed.from_mask(torch.tensor([[True, True, False]]), torch.float32)
probe = sum(n for k, n in mode.ours.items() if os.path.join("model", "padding.py") in k)
mode.ours.clear()

results = []
for run in json.loads(sys.argv[2]):
    counted["steps"] = 0
    code = main(["train", "tiny", *run])
    results.append({"run": run, "rc": code, "steps": counted["steps"], "ours": dict(mode.ours),
                    "library": sum(mode.library.values())})
    mode.ours.clear(), mode.library.clear()
print("RESULT " + json.dumps({"probe": probe, "runs": results}))
"""


def test_no_host_reads_of_ours_between_logging_steps(tmp_path):
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join((ROOT / "data" / "us-speeches.public-domain.jsonl").read_text().splitlines()[:10]))
    train_tokenizer([corpus], tmp_path / "tok", vocab_size=512, show_progress=False)
    build_shards([corpus], tmp_path / "tok", tmp_path / "sh", num_workers=0, show_progress=False)
    common = [
        f"output_dir={tmp_path}",
        f"data.tokenizer={tmp_path / 'tok'}",
        f"data.shards={tmp_path / 'sh'}",
        "model.num_layers=1",
        "train.max_steps=6",
        "train.log_every=3",
        "train.save_every=0",
        "train.grad_accum_steps=2",
        "train.micro_batch_size=4",
        "wandb.mode=disabled",
    ]
    runs = [
        [*common, f"name={name}", f"objectives={{{objectives}}}", f"train.precision={precision}", *extra]
        for name, objectives, precision, extra in [
            ("mlm-fp32", "mlm: {}", "fp32", []),
            ("mlm-bf16", "mlm: {whole_word: true}", "bf16", []),
            ("span", "span: {}", "bf16", []),
            ("rtd", "rtd: {}", "bf16", []),
            ("plm", "plm: {}", "fp32", []),
            ("sop", "mlm: {}, sop: {}", "fp32", ["data.packing=doc_bounded"]),
            ("unpadded", "mlm: {}", "bf16", ["model.unpadded=true", "data.packing=doc_bounded"]),
            ("lamb", "mlm: {}", "fp32", ["train.optimizer=lamb"]),
        ]
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), json.dumps(runs)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["probe"] >= 2  # the counter does see reads made in our files
    for run in result["runs"]:
        assert run["rc"] == 0 and run["steps"] == 4, run  # steps 1, 2, 4, 5 of 6 do not log
        assert run["ours"] == {}, run
