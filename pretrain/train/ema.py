"""An exponential moving average of the weights (`train.ema_decay`), and the uniform average of checkpoints.

After every optimizer step, ema <- decay * ema + (1 - decay) * weights, in fp32 whatever the training precision (a
bf16 average would lose the small updates it exists to keep). It runs as one foreach lerp on the device the weights
are on, or on the CPU (`train.ema_on_cpu`, for models whose fp32 copy does not fit beside the optimizer), and never
reads anything back to the host. It is saved with each checkpoint (`ema.pt`), restored on resume, and exported
instead of the raw weights (ModernBERT trains with one through Composer; Polyak averaging in general).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pretrain.core.errors import UserError

EMA_FILE = "ema.pt"


class WeightEMA:
    """fp32 shadows of a module's trainable parameters, by name."""

    def __init__(self, module: nn.Module, decay: float, device: torch.device | str | None = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        params = dict(module.named_parameters())
        self.shadow = [params[n].detach().to(device or params[n].device, torch.float32, copy=True) for n in self.names]
        self._params = [params[n] for n in self.names]

    @torch.no_grad()
    def update(self) -> None:
        """One step toward the current weights: shadow += (1 - decay) * (weight - shadow)."""
        current = [p.detach().to(s.device, torch.float32) for p, s in zip(self._params, self.shadow)]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: s.detach().cpu() for n, s in zip(self.names, self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise UserError(f"{where}: the EMA weights lack {', '.join(missing[:3])}: saved for another model")
        for n, s in zip(self.names, self.shadow):
            if state[n].shape != s.shape:
                raise UserError(
                    f"{where}: EMA weight {n} has shape {tuple(state[n].shape)}, the model {tuple(s.shape)}"
                )
            s.copy_(state[n])


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
