"""fp16's skipped steps (`pretrain.train.engine.Engine.step`): an overflow that lowers the dynamic loss scale is
routine and not counted; one at the lowest scale is a non-finite step like any other, counted and judged by
train.nan_policy. (DeepSpeed refuses fp16 on most CPUs: DeepSpeed's engine is stood in for by its counters.)"""

from types import SimpleNamespace

from pretrain.core.config import TrainConfig
from pretrain.train.engine import Engine
from pretrain.train.state import TrainState
from pretrain.train.stopping import StopFlag, Stopping


class OverflowingEngine:
    """What `Engine.step` reads of DeepSpeed's: every step overflows, halving the loss scale down to 1."""

    def __init__(self, scale: float):
        self.skipped_steps = 0
        self.optimizer = SimpleNamespace(loss_scale=scale)
        self.lr_scheduler = None

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def step(self) -> None:
        self.skipped_steps += 1
        self.optimizer.loss_scale = max(self.optimizer.loss_scale / 2, 1.0)


def test_fp16_counts_the_overflows_it_cannot_scale_away():
    engine = Engine(OverflowingEngine(2.0**4), "fp16", prescale_fp16=False)
    for _ in range(8):
        engine.step()
    # at 16, 8, 4 and 2 the scale is lowered (routine); at 1 nothing is left to lower: each such step counts
    assert engine.take_skip_flags() == [False] * 4 + [True] * 4
    state = TrainState()
    stopping = Stopping(TrainConfig(nan_policy="skip", max_skipped_steps=3), state, StopFlag())
    assert stopping.count_skips([False] * 4 + [True] * 4) == (4, True)  # it trained nothing: stopped, not "complete"
    assert state.skipped_steps == 4


def test_other_precisions_count_every_skip():
    engine = Engine(OverflowingEngine(2.0**4), "bf16", prescale_fp16=False)
    engine.ds.optimizer.loss_scale = 2.0**4  # a bf16 optimizer has no scale to lower: `Engine.loss_scale` is None
    for _ in range(3):
        engine.step()
    assert engine.take_skip_flags() == [True] * 3


def test_zero_1_to_3_skip_at_the_lowest_scale_rather_than_raise():
    """ZeRO 1-3's DeepSpeed loss scaler raised a bare Exception at an overflow at its lowest scale: a traceback, never
    train.nan_policy. It is made to skip there (and `Engine.step` counts it)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from pretrain.train.engine import skip_at_the_lowest_loss_scale

    scaler = DynamicLossScaler(
        init_scale=1.0, scale_window=1000, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False
    )
    assert scaler.raise_error_at_min_scale  # DeepSpeed's default
    skip_at_the_lowest_loss_scale(SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=scaler)))
    assert not scaler.raise_error_at_min_scale
    skip_at_the_lowest_loss_scale(SimpleNamespace(optimizer=object()))  # ZeRO-0's own optimizer: nothing to change
