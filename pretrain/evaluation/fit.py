"""What every downstream fit shares (sequence and token tasks, full fine-tuning): the device, bf16 autocast on the GPU,
shuffled batches of row indices, and the training loop (AdamW with weight decay 0.01 on matrices, none on biases and
LayerNorm weights; linear warmup then linear decay to 0; clipping), as transformers' Trainer does it."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from pretrain.core.errors import UserError
from pretrain.train.optim import param_groups


def autocast():
    """bf16 on the GPU (as transformers' Trainer with bf16), fp32 on the CPU (`precision()` says which)."""
    if torch.cuda.is_available():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def precision() -> str:
    """What `autocast` computes downstream fits in on this machine, in words (a result records it: a GPU's scores
    and a CPU's come from the same protocol in different precisions)."""
    return "bf16 autocast" if torch.cuda.is_available() else "fp32"


_REINITIALISED: set[tuple[str, int]] = set()  # (model, labels) whose re-initialised head was already reported


def load_with_head(auto_class, model_dir: Path, config):
    """`auto_class.from_pretrained(model_dir)` with `config`'s label count. A model fine-tuned before (any
    *ForSequenceClassification or *ForTokenClassification) has a head of its own task's size: one of another size is
    re-initialised, said once on stderr, where transformers would refuse it (ignore_mismatched_sizes)."""
    model, info = auto_class.from_pretrained(
        str(model_dir), config=config, dtype=torch.float32, ignore_mismatched_sizes=True, output_loading_info=True
    )
    mismatched = sorted(info.get("mismatched_keys") or ())  # (name, saved shape, new shape)
    encoder = [k for k, *_ in mismatched if k.startswith(f"{model.base_model_prefix}.")]
    if encoder:  # only the head may be re-initialised: an encoder weight of another shape is a broken directory
        raise UserError(f"{model_dir}: weights {encoder[:3]} do not have the shapes its config.json gives them")
    n = config.num_labels
    if mismatched and (str(model_dir), n) not in _REINITIALISED:
        _REINITIALISED.add((str(model_dir), n))
        print(
            f"note: {model_dir}: its head was trained for {mismatched[0][1][0]} labels, this task has {n}: "
            f"re-initialised for {n} labels ({', '.join(k[0] for k in mismatched)})",
            file=sys.stderr,
        )
    return model


def batches(n: int, size: int, generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Row indices [<= size] covering 0..n-1: shuffled by `generator`, in order without one."""
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    yield from (order[i : i + size] for i in range(0, n, size))


def linear_schedule(opt: torch.optim.Optimizer, total: int, warmup_frac: float):
    """Linear warmup over warmup_frac of `total` steps, then linear decay to 0."""
    warmup = max(1, int(warmup_frac * total)) if warmup_frac else 0
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup if warmup else 1.0, max(0.0, (total - s) / (total - warmup + 1e-9)))
    )


def fit(
    model: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    seed: int,
    epochs: int,
    lr: float,
    batch_size: int,
    warmup_frac: float,
    desc: str,
) -> torch.nn.Module:
    """Train `model` on `n` rows for `epochs`: `loss_of(row indices)` is a batch's loss (run under `autocast`). The
    batch order is a function of `seed`; the caller seeds the head's initialisation before building the model."""
    gen = torch.Generator().manual_seed(seed)
    # decay on matrices only, as pretraining, BERT's fine-tuning and transformers' Trainer (not biases, LayerNorms)
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=lr)
    total = max(1, epochs * math.ceil(n / batch_size))
    sched = linear_schedule(opt, total, warmup_frac)
    model.train()
    bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, mininterval=1.0, leave=False)
    for _ in range(epochs):
        for idx in batches(n, batch_size, gen):
            with autocast():
                loss = loss_of(idx)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(1)
            if bar.n % 50 == 0:  # reading the loss makes the host wait for the GPU: now and then
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    bar.close()
    return model.eval()
