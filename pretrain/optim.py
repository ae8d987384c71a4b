"""Optimizers and the learning-rate schedule.

AdamW is torch's. LAMB (You et al. 2019, the large-batch BERT optimizer) is written here in plain torch
because DeepSpeed's fused LAMB needs CUDA; this one runs on any device and under every ZeRO stage
(DeepSpeed wraps it like any torch optimizer).
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.errors import ConfigError


def grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    return all(torch.isfinite(p.grad).all() for g in optimizer.param_groups for p in g["params"] if p.grad is not None)


class SkipNonFinite:
    """Mixin: a step whose gradients hold NaN/inf is skipped and flagged as `overflow`, which DeepSpeed's engine
    counts in `skipped_steps` (and then leaves the lr schedule alone), as its bf16/fp16 optimizers do. Used
    where no DeepSpeed optimizer wraps ours (fp32, ZeRO 0): the gradients are already averaged over ranks, so
    every rank takes the same decision."""

    overflow = False

    def step(self, closure=None):
        self.overflow = not grads_finite(self)
        if self.overflow:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


class AdamW(SkipNonFinite, torch.optim.AdamW):
    pass


class _Lamb(torch.optim.Optimizer):
    """Adam moments, then a per-tensor trust ratio ||w|| / ||update|| scales the step (1 where a norm is 0)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step = state["step"].item()
                update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss


class Lamb(SkipNonFinite, _Lamb):
    pass


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


def build_optimizer(model: nn.Module, train_cfg) -> torch.optim.Optimizer:
    t = train_cfg
    groups = param_groups(model, t.weight_decay)
    betas = (t.adam_beta1, t.adam_beta2)
    if t.optimizer == "adamw":
        return AdamW(groups, lr=t.lr, betas=betas, eps=t.adam_eps)
    if t.optimizer == "lamb":
        return Lamb(groups, lr=t.lr, betas=betas, eps=t.adam_eps)
    raise ConfigError(f"train.optimizer: value '{t.optimizer}' is not one of adamw, lamb")


def lr_lambda(warmup_steps: int, max_steps: int):
    """Linear warmup to the peak, then linear decay to 0 at max_steps."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))
    return f


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train_cfg.warmup_steps, train_cfg.max_steps))
