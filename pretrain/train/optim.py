"""Optimizers and the learning-rate schedule.

Where the optimizer runs unwrapped (ZeRO-0 in fp32 or bf16 autocast: DeepSpeed adds no low-precision wrapper), it
also clips the gradient norm and skips a step whose gradients are not finite, without reading anything back to the
host (`guard`): the norm is torch's foreach `clip_grad_norm_` (a device tensor), and the skip is the `found_inf` flag
that torch's fused AdamW honours (the mechanism GradScaler uses): parameters, moments and step count stay as they
were. So the GPU never waits for the host between logging steps; the norm and the skips stay on the device until the
trainer reads them at a log step. Under DeepSpeed's fp16/bf16 and ZeRO optimizers, DeepSpeed clips and skips.

AdamW is torch's, fused on the devices that have it. LAMB (You et al. 2019, the large-batch BERT optimizer) is
written here in plain torch because DeepSpeed's fused LAMB needs CUDA; it runs on any device, at ZeRO-0 only (ZeRO
hands an optimizer flat slices of many tensors, where a per-tensor trust ratio has no tensor: refused in the config
checks), and skips non-finite steps on the device too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pretrain.core.errors import ConfigError


class StepGuard:
    """Mixin: with `guard` on, each step first clips the global gradient norm to `max_norm` (0 = no clipping) and
    flags non-finite gradients, all on the device. `grad_norm` is the last step's norm (before clipping), `skips` the
    per-step flags (1.0 = skipped) since the trainer last took them. DeepSpeed's engine reads `overflow` to count
    skipped steps and hold the lr schedule: it stays False, the schedule advances with the step count."""

    guard = False
    max_norm = 0.0
    overflow = False

    def guarded_step_flag(self) -> torch.Tensor | None:
        """1.0 on the device where this step's gradients are not finite (the step is skipped), else 0.0; None
        without the guard."""
        if not self.guard:
            return None
        grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, self.max_norm if self.max_norm > 0 else math.inf, foreach=True)
        found_inf = (~torch.isfinite(norm)).float()
        self.grad_norm = norm.detach()
        self.skips = getattr(self, "skips", []) + [found_inf]
        return found_inf

    def take_skips(self) -> list[torch.Tensor]:
        skips, self.skips = getattr(self, "skips", []), []
        return skips


class AdamW(StepGuard, torch.optim.AdamW):
    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)  # CPU and CUDA; one kernel over all parameters

    def step(self, closure=None):
        self.found_inf, self.grad_scale = self.guarded_step_flag(), None  # found_inf: the fused kernel skips
        return super().step(closure)


class Lamb(StepGuard, torch.optim.Optimizer):
    """Adam moments, then a per-tensor trust ratio ||w|| / ||update|| scales the step (1 where a norm is 0), in the
    groups marked `adapt` (`build_optimizer`: the decayed matrices). Biases and LayerNorm weights take plain Adam steps,
    as in the LAMB authors' BERT code (excluded from layer adaptation as from decay) and NVIDIA's (no trust ratio where
    there is no decay): a bias starts at 0, so its ratio would shrink its steps to the size of its small norm. A
    skipped step (the guard's flag) leaves parameters, moments and step count as they were, without leaving the
    device."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        found_inf = self.guarded_step_flag()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                grad, keep = p.grad, 1.0
                if found_inf is not None:  # a skipped step: betas of 1 and a zero update keep everything
                    grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
                    keep = 1.0 - found_inf
                b1, b2 = 1 - (1 - beta1) * keep, 1 - (1 - beta2) * keep
                state["step"] += keep
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad * (1 - b1))
                v.mul_(b2).add_(grad * grad * (1 - b2))
                step = state["step"].clamp(min=1)
                update = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                if group.get("adapt", True):  # a checkpoint from before `adapt` goes on as it trained
                    w_norm, u_norm = p.norm(), update.norm()
                    keep = keep * torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * keep, alpha=-group["lr"])
        return loss


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices, not to biases and LayerNorm weights (BERT)."""
    return param.ndim >= 2 and "norm" not in name


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups, in named_parameters order: decayed, then not decayed (`decays`)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if decays(name, param) else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, train_cfg, guard: bool = False) -> torch.optim.Optimizer:
    """The run's optimizer. `guard`: it runs unwrapped, so it clips to train.grad_clip and skips non-finite steps
    itself (see the module doc)."""
    t = train_cfg
    groups = param_groups(model, t.weight_decay)
    betas = (t.adam_beta1, t.adam_beta2)
    if t.optimizer == "adamw":
        optimizer = AdamW(groups, lr=t.lr, betas=betas, eps=t.adam_eps)
    elif t.optimizer == "lamb":
        decayed, plain = groups
        optimizer = Lamb([{**decayed, "adapt": True}, {**plain, "adapt": False}], lr=t.lr, betas=betas, eps=t.adam_eps)
    else:
        raise ConfigError(f"train.optimizer: value '{t.optimizer}' is not one of adamw, lamb")
    optimizer.guard, optimizer.max_norm = guard, t.grad_clip
    return optimizer


def decay_steps(train_cfg) -> int:
    """wsd: the length of the final decay (`TrainConfig.wsd_decay_steps`)."""
    return train_cfg.wsd_decay_steps()


def _remaining(shape: str, progress: float) -> float:
    """How much of the way from the peak down to the floor is left at `progress` (0..1) through a decay."""
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":  # MiniCPM / "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


def lr_factor(step: int, train_cfg) -> float:
    """The learning rate of optimizer step `step` (0-based) as a fraction of train.lr: linear warm-up over
    warmup_steps, then
    - linear: straight down from the peak to 0 at max_steps (transformers' get_linear_schedule_with_warmup);
    - bert: 1 - step / max_steps, the decay counted from step 0 and the warm-up in its place (google-research/bert's
      optimization.py: a polynomial decay over num_train_steps), so 10% below the peak when a 10% warm-up ends;
    - cosine: half a cosine down to min_lr_ratio at max_steps;
    - wsd: warmup-stable-decay (ModernBERT's trapezoid): the peak until the last decay_steps, then down to
      min_lr_ratio in decay_shape; a checkpoint of the stable phase can be decayed into a new run (`pretrain decay`);
    - inverse_sqrt: peak x sqrt(warmup_steps / step) after the warm-up (fairseq's, T5's).
    A pure function of the step and the config: a resume recomputes it, so a changed schedule applies at once."""
    t = train_cfg
    warm, end = t.warmup_steps, t.max_steps
    if step < warm:
        return (step + 1) / warm
    if t.lr_schedule == "inverse_sqrt":
        return math.sqrt(max(1, warm) / (step + 1))
    if t.lr_schedule == "linear":
        return max(0.0, (end - step) / max(1, end - warm))
    if t.lr_schedule == "bert":
        return max(0.0, 1.0 - step / end)
    if t.lr_schedule == "wsd":
        start = end - decay_steps(t)
        if step < start:
            return 1.0
        progress, shape = (step - start) / max(1, end - start), t.decay_shape
    else:
        progress, shape = (step - warm) / max(1, end - warm), "cosine"
    floor = t.min_lr_ratio
    return floor + (1.0 - floor) * _remaining(shape, min(1.0, progress))


def warmup_note(train_cfg) -> str | None:
    """A warm-up as long as the run or longer (a preset's kept when train.max_steps was cut): the run ends inside
    it, never at train.lr. None otherwise."""
    t = train_cfg
    if t.warmup_steps < max(2, t.max_steps):
        return None
    reached = lr_factor(t.max_steps - 1, t)
    return (
        f"train.warmup_steps={t.warmup_steps} is not shorter than train.max_steps={t.max_steps}: the run ends inside "
        f"its warm-up, its learning rate at most {reached:.0%} of train.lr ({reached * t.lr:.3g}); give a shorter "
        "warm-up (1-10% of the steps is usual)"
    )


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train_cfg))


def _optimizers(optimizer) -> list:
    """The optimizer and every one it wraps (DeepSpeed's fp16/bf16/ZeRO wrappers keep ours as `.optimizer`)."""
    chain = []
    while optimizer is not None and all(optimizer is not seen for seen in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def apply_hyperparameters(optimizer, scheduler, train_cfg) -> list[str]:
    """After a checkpoint was loaded: the config's learning rate, betas, epsilon, weight decay and schedule replace
    the ones the checkpoint restored (a resume may change them; moments and step counts stay). Returns
    'key: old -> new' for each value that changed.

    Loading restores every param group's hyper-parameters and the scheduler's `base_lrs` from the checkpoint, so
    without this a changed `train.lr` was announced and ignored. Each optimizer in the chain (ours and DeepSpeed's
    wrappers, which may keep their own group dicts) has `param_groups`' two groups in order: decayed, then not."""
    t = train_cfg
    base = scheduler.optimizer.param_groups
    old = {
        "train.lr": scheduler.base_lrs[0],
        "train.adam_beta1": base[0]["betas"][0],
        "train.adam_beta2": base[0]["betas"][1],
        "train.adam_eps": base[0]["eps"],
        "train.weight_decay": base[0]["weight_decay"],
    }
    scheduler.base_lrs = [t.lr] * len(scheduler.base_lrs)
    lr = t.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)  # the schedule's value at the restored step
    scheduler._last_lr = [lr] * len(scheduler.base_lrs)
    for opt in _optimizers(optimizer):
        for index, group in enumerate(getattr(opt, "param_groups", None) or []):
            group.update(betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, lr=lr, initial_lr=t.lr)
            group["weight_decay"] = t.weight_decay if index == 0 else 0.0
    new = {
        "train.lr": t.lr,
        "train.adam_beta1": t.adam_beta1,
        "train.adam_beta2": t.adam_beta2,
        "train.adam_eps": t.adam_eps,
        "train.weight_decay": t.weight_decay,
    }
    return [f"{k}: {old[k]:g} -> {new[k]:g}" for k in new if float(old[k]) != float(new[k])]
