"""An exponential moving average of the weights (`train.ema_decay`), and the uniform average of checkpoints.

After every optimizer step t (0 first), ema <- d * ema + (1 - d) * weights with d = decay, or with `warmup`
(`train.ema_warmup`, on by default) d = min(decay, (1 + t) / (10 + t)): at decay 0.999 without it, 74% of the
average was still the random initial weights after 300 steps. In fp32 whatever the training precision (a
bf16 average would lose the small updates it exists to keep). The weights it averages are the optimizer's fp32 ones
(`pretrain.train.engine.fp32_masters`): under DeepSpeed's bf16/fp16 wrappers the module holds only a rounded copy,
which moves in steps of its precision (a LayerNorm gain near 1 not at all for updates under 0.004). Under ZeRO 1-2
each rank averages its own fragment of those masters, so the EMA is partitioned as they are; a checkpoint gathers
it whole. It runs as one foreach lerp on the device the weights are on, or on the CPU (`train.ema_on_cpu`, for
models whose fp32 copy does not fit beside the optimizer), and never reads anything back to the host. It is saved
with each checkpoint (`ema.pt`), restored on resume, and exported instead of the raw weights (ModernBERT trains with
one through Composer; Polyak averaging in general).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pretrain.core.errors import UserError

EMA_FILE = "ema.pt"


@dataclass
class FP32Master:
    """Where a parameter's fp32 weight lives (the value the optimizer updates): `flat` is all of it, flattened, when
    `start` is None; under ZeRO 1-2 it is this rank's fragment of the flattened parameter, from `start`, the rest held
    by the other ranks of `group` (a rank may hold none of it: `flat` is then empty)."""

    flat: torch.Tensor  # fp32 [numel] or [fragment]
    shape: torch.Size  # the parameter's
    start: int | None = None
    group: object = None


class WeightEMA:
    """fp32 shadows of a module's trainable parameters, by name: of all of each, or of this rank's fragment where
    `masters` (`pretrain.train.engine.fp32_masters`) says the fp32 weights are partitioned."""

    def __init__(
        self,
        module: nn.Module,
        decay: float,
        device: torch.device | str | None = None,
        masters: dict[str, FP32Master] | None = None,
        warmup: bool = False,
    ):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay, self.warmup = decay, warmup
        params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.names = list(params)
        if masters is None:  # the module's own weights, whatever their precision
            masters = {n: FP32Master(p.detach().view(-1), p.shape) for n, p in params.items()}
        self.masters = [masters[n] for n in self.names]
        self.shadow = [
            m.flat.detach().to(device or m.flat.device, torch.float32, copy=True) for m in self.masters
        ]  # [numel] or [fragment]

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, step: int = 0) -> None:
        """One step toward the weights after optimizer step `step` (0 first): shadow += (1 - d) * (weight - shadow)."""
        current = [m.flat.detach().to(s.device, torch.float32) for m, s in zip(self.masters, self.shadow)]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay_at(step))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole EMA, by name, on the CPU. Collective where it is partitioned: every rank of the run calls it."""
        out = {}
        for n, m, s in zip(self.names, self.masters, self.shadow):
            if m.start is not None:  # this rank's fragment, placed in a zero tensor summed over the ranks
                whole = torch.zeros(m.shape.numel(), dtype=torch.float32, device=m.flat.device)
                whole.narrow(0, m.start, s.numel()).copy_(s)
                torch.distributed.all_reduce(whole, group=m.group)
                s = whole
            out[n] = s.detach().view(m.shape).cpu()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise UserError(f"{where}: the EMA weights lack {', '.join(missing[:3])}: saved for another model")
        for n, m, s in zip(self.names, self.masters, self.shadow):
            if state[n].shape != m.shape:
                raise UserError(
                    f"{where}: EMA weight {n} has shape {tuple(state[n].shape)}, the model {tuple(m.shape)}"
                )
            saved = state[n].reshape(-1)
            s.copy_(saved if m.start is None else saved.narrow(0, m.start, s.numel()))


def average_states(states: Iterable[tuple[str, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The uniform average (in fp64, returned as fp32) of several checkpoints' weights, given as (name, state);
    checkpoints of different shapes or parameter names are refused, naming both and the first difference."""
    total: dict[str, torch.Tensor] = {}
    first = None
    count = 0
    for name, state in states:
        if first is None:
            first, total = (name, state), {k: v.double().clone() for k, v in state.items()}
        else:
            ref_name, ref = first
            keys = set(ref) ^ set(state)
            if keys:
                raise UserError(f"{name} and {ref_name} hold different weights ({', '.join(sorted(keys)[:3])})")
            for k, v in state.items():
                if v.shape != ref[k].shape:
                    raise UserError(
                        f"{name} and {ref_name} differ in shape at {k}: {tuple(v.shape)} vs {tuple(ref[k].shape)}"
                    )
                total[k] += v.double()
        count += 1
    if count == 0:
        raise UserError("nothing to average: give at least one checkpoint")
    return {k: (v / count).float() for k, v in total.items()}
