"""The DeepSpeed engine of a run: its config (derived from the RunConfig, one source of truth), its creation, and
the work-arounds DeepSpeed 0.19 needs, kept here rather than in the training loop.

Which optimizer path each precision mode and ZeRO stage takes (`distributed.run_precision`):
- fp32, and bf16 (torch autocast over fp32 weights, entered by the model's own forward: DeepSpeed's forward turns off
  one entered around it) under ZeRO-0: DeepSpeed wraps nothing; our optimizer is torch's
  fused AdamW, which clips and skips non-finite steps on the device (`pretrain.train.optim`, `guard`), so the step never
  waits for the host. DeepSpeed's own clipping is off there.
- bf16 under ZeRO 1-3 and fp16: DeepSpeed's low-precision and ZeRO optimizers wrap ours; they clip, check for
  overflow and skip (reading a few values back to the host each step: DeepSpeed's own).
Work-arounds (DeepSpeed 0.19):
- fp16 under ZeRO-0: the wrappers unscale gradients of a loss they never scaled (PR #8393), and start Adam with a
  dummy step (`fp16_loss_needs_scaling`, `drop_fp16_dummy_step`);
- bf16/fp16: the fp32 master weights are built from the module after its cast, so they start rounded
  (`restore_fp32_masters`).
What DeepSpeed does by default that the step does not need: its throughput timer synchronizes the device twice per
micro-batch (off in `deepspeed_config`), on one rank under ZeRO-0 it still all-reduces every gradient
(`skip_single_rank_allreduce`), and where it wraps no optimizer it walks the module tree to clear the gradients after
every step (`zero_grad_over_a_list`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pretrain.train.distributed import BF16_AUTOCAST
from pretrain.train.ema import FP32Master
from pretrain.train.optim import StepGuard, build_optimizer, build_scheduler

if TYPE_CHECKING:
    from pretrain.train.setup import ResolvedRun


def optimizer_unwrapped(precision: str, zero_stage: int) -> bool:
    """True where DeepSpeed adds no optimizer wrapper: our optimizer then clips and skips itself."""
    return zero_stage == 0 and precision in ("fp32", BF16_AUTOCAST)


MIN_LOSS_SCALE = 1.0  # fp16's dynamic loss scale goes no lower


def deepspeed_config(run: ResolvedRun) -> dict:
    t, precision = run.cfg.train, run.precision
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": run.global_batch,
        # unwrapped, our optimizer clips on the device; DeepSpeed's fp32 clipping reads the norm back to the host
        "gradient_clipping": 0.0 if optimizer_unwrapped(precision, t.zero_stage) else t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,  # our AdamW/LAMB are torch optimizers
        "steps_per_print": 10**9,  # we log ourselves
        # DeepSpeed's throughput timer is on unless configured off, and then calls the accelerator's synchronize()
        # at the start of every forward and the end of every step() (ThroughputTimer in deepspeed/utils/timer.py,
        # started in DeepSpeedEngine._forward_prologue and stopped in step(); 0.19.8): two device syncs per
        # micro-batch. We time log intervals ourselves; tests/test_host_reads.py counts these syncs.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "wall_clock_breakdown": False,  # its per-phase timers wait on CUDA events when they are read, each step
    }
    if t.zero_stage in (1, 2):
        # On several ranks the reduction stays DeepSpeed's. overlap_comm stays off (its default below ZeRO-3): with
        # it, stage_1_and_2.py synchronizes the device before every bucket's all-reduce and at the end of every
        # backward (allreduce_and_copy, independent_gradient_partition_epilogue), the host waits that this loop
        # avoids everywhere else. Without it the buckets are reduced on the compute stream as they fill, so the
        # bucket size only sets how often; DeepSpeed's 5e8 elements is one bucket for BERT-base and -large. Whether
        # overlap_comm pays for its syncs on several GPUs is unmeasured (no multi-GPU machine yet).
        ds["zero_optimization"].update(overlap_comm=False, reduce_bucket_size=int(5e8), allgather_bucket_size=int(5e8))
    if precision == "bf16":  # bf16-autocast: DeepSpeed sees an fp32 model
        ds["bf16"] = {"enabled": True}
    elif precision == "fp16":
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": MIN_LOSS_SCALE,
        }
    return ds


@dataclass
class Engine:
    """A DeepSpeed engine with what the training step needs around it."""

    ds: object  # deepspeed.DeepSpeedEngine
    precision: str  # the run's precision mode (`ResolvedRun.precision`): fp32, bf16-autocast, bf16 or fp16
    prescale_fp16: bool
    skip_flags: list = field(default_factory=list)  # steps DeepSpeed's wrappers skipped, when they skip
    explicit_boundary: bool = False  # say where each optimizer step ends (a schedule varies the accumulation)

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def guarded(self) -> bool:
        return isinstance(self.ds.optimizer, StepGuard) and self.ds.optimizer.guard

    def split_batch(self, micro_batch_size: int, accumulation: int) -> int:
        """Make DeepSpeed's micro-batch and accumulation these (a schedule's phase and global batch; unchanged
        otherwise): its loss scaling divides by the accumulation. Returns `accumulation`."""
        if self.ds.train_micro_batch_size_per_gpu() != micro_batch_size:
            self.ds.set_train_micro_batch_size(micro_batch_size)
        if self.ds.gradient_accumulation_steps() != accumulation:
            self.ds.set_train_batch_size(micro_batch_size * accumulation * self.ds.dp_world_size)
        return accumulation

    def begin_micro_batch(self, last: bool) -> None:
        """Before a micro-batch's forward: with `explicit_boundary`, tell DeepSpeed whether it ends the optimizer
        step (its own count of micro-steps modulo the accumulation goes wrong once the accumulation changes)."""
        if self.explicit_boundary:
            self.ds.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss * self.ds.optimizer.loss_scale if self.prescale_fp16 else loss)

    def step(self) -> None:
        """engine.step(): the optimizer steps at the end of the accumulation (DeepSpeed knows when)."""
        boundary = self.ds.is_gradient_accumulation_boundary()
        # counted around this step, not since the engine was built: loading a checkpoint restores DeepSpeed's count
        noted = boundary and not self.guarded  # DeepSpeed's wrappers decide on the host: note it
        before = self.ds.skipped_steps
        scale = self.loss_scale() if noted else None  # fp16: the scale this step ran at (a host float)
        self.ds.step()
        if noted:
            skipped = self.ds.skipped_steps > before
            # fp16 skips an overflow to lower its loss scale, routinely; at the lowest scale nothing is left to lower:
            # the gradients are non-finite as they are, a skip as under any precision (a run skipping every step
            # there trained nothing, logged skipped_steps 0 and ignored train.nan_policy)
            self.skip_flags.append(skipped and (scale is None or scale <= MIN_LOSS_SCALE))
            if skipped and self.ds.lr_scheduler is not None:
                # DeepSpeed holds its schedule back on a skipped step; ours is a function of the step, which a skip
                # counts (as the data, the schedule's values and the guarded optimizer of ZeRO-0 count it)
                self.ds.lr_scheduler.step()

    def take_skip_flags(self) -> list[bool]:
        """Whether each optimizer step since the last call was skipped (non-finite gradients), oldest first. Reads
        the device where the optimizer guards itself: call at log steps."""
        if self.guarded:
            flags = self.ds.optimizer.take_skips()
            return [bool(f) for f in torch.stack(flags).tolist()] if flags else []  # one read for the interval
        flags, self.skip_flags = self.skip_flags, []
        return flags

    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last step. Reads the device: call at log steps."""
        if self.guarded:
            norm = getattr(self.ds.optimizer, "grad_norm", None)
            return None if norm is None else float(norm)
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None
        norm = float(norm)
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

        if isinstance(self.ds.optimizer, FP16_UnfusedOptimizer):  # it measures the loss-scaled gradients
            norm /= self.ds.optimizer.loss_scale
        return norm

    def loss_scale(self) -> float | None:
        """fp16's current dynamic loss scale: every DeepSpeed fp16 optimizer (fused, unfused, ZeRO 1-3) has it."""
        scale = getattr(self.ds.optimizer, "loss_scale", None)
        return float(scale) if scale is not None and self.precision == "fp16" else None


def build_engine(run: ResolvedRun, model: nn.Module, fresh: bool, load_universal: bool) -> Engine:
    """deepspeed.initialize with the run's optimizer, schedule and config, corrected as the module doc says.
    `fresh`: no checkpoint will be loaded (the fp32 masters are then restored from the model's own weights)."""
    import deepspeed

    t, precision = run.cfg.train, run.precision
    optimizer = build_optimizer(model, t, guard=optimizer_unwrapped(precision, t.zero_stage))
    ds_config = deepspeed_config(run)
    if load_universal:
        ds_config["checkpoint"] = {"load_universal": True}
    # DeepSpeed casts the module to bf16/fp16 in place and builds its fp32 masters from that copy
    fp32_weights = (
        {n: p.detach().clone() for n, p in model.named_parameters()}
        if fresh and precision in ("bf16", "fp16")
        else None
    )
    ds, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=build_scheduler(optimizer, t), config=ds_config
    )
    if precision == BF16_AUTOCAST:  # inside DeepSpeed's forward: one around it is turned off there (see the model)
        model.autocast_dtype = torch.bfloat16
    drop_fp16_dummy_step(ds)
    skip_at_the_lowest_loss_scale(ds)
    skip_single_rank_allreduce(ds, run.world, t.zero_stage)
    if optimizer_unwrapped(precision, t.zero_stage):
        zero_grad_over_a_list(ds)
    if fp32_weights is not None:
        restore_fp32_masters(ds, fp32_weights)
    return Engine(ds, precision, fp16_loss_needs_scaling(ds))


def skip_at_the_lowest_loss_scale(engine) -> None:
    """fp16 under ZeRO 1-3: DeepSpeed's loss scaler raises a bare Exception ("Current loss scale already at minimum")
    at an overflow it can no longer scale away (0.19.8, fp16/loss_scaler.py; no config key turns it off), a
    traceback where ZeRO-0's optimizer skips the step. Made to skip there too: `Engine.step` counts the skip and
    train.nan_policy decides, as for any precision."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if hasattr(scaler, "raise_error_at_min_scale"):
        scaler.raise_error_at_min_scale = False


def skip_single_rank_allreduce(engine, world_size: int, zero_stage: int) -> None:
    """On one rank under ZeRO-0, turn off DeepSpeed's gradient all-reduce: after every backward at an accumulation
    boundary, DeepSpeedEngine._backward_epilogue calls allreduce_gradients -> buffered_allreduce_fallback, which
    flattens every gradient into one buffer, all-reduces it over a group of one and copies it back (0.19.8,
    runtime/engine.py; the flag it checks is `enable_backward_allreduce`, which DeepSpeed itself clears only when
    there is no communication backend). The values are unchanged by it (a sum over one rank, divided by 1), so
    dropping it changes no number; it cost a copy of all gradients each step. One difference: it also gives a
    parameter without a gradient zeros (AdamW then decays it; now it skips it): every objective, alone and in the
    mixes of tests/test_host_reads.py, gives every parameter a gradient (checked 2026-11-23). ZeRO 1-3 reduce
    inside their own optimizer (partitioning needs it, also on one rank): untouched."""
    if world_size == 1 and zero_stage == 0:
        engine.enable_backward_allreduce = False


def zero_grad_over_a_list(engine) -> None:
    """Clear the gradients after each step over the module's parameters listed once. Where DeepSpeed wraps no
    optimizer (`optimizer_unwrapped`), DeepSpeedEngine._take_model_step calls its own zero_grad, which sets
    `param.grad = None` over `module.named_parameters()` (0.19.8, runtime/engine.py): a walk of the whole module tree
    on the host every optimizer step, 139 us of CPU for BERT-base's tree (12 layers and the MLM head: 121 modules,
    154 tensors) against 7 us over a list (benchmarks/RESULTS.md). The parameters are fixed once the engine is built
    (float8 Linears are converted before it), so the list is the walk's result; the wrappers (fp16, bf16 and ZeRO
    optimizers) clear their own."""
    params = list(engine.module.parameters())

    def zero_grad():
        for param in params:
            param.grad = None

    engine.zero_grad = zero_grad


def _zero0_fp16(optimizer) -> bool:
    """DeepSpeed's ZeRO-0 fp16 wrappers (FP16_Optimizer, FP16_UnfusedOptimizer), which need two corrections."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer))


def _unwrapped(fn):
    """The function a decorator wraps, followed through __wrapped__ and through closures (DeepSpeed's NVTX
    wrapper keeps the original only in its closure)."""
    fn = inspect.unwrap(fn)
    inner = next((c.cell_contents for c in fn.__closure__ or () if inspect.isfunction(c.cell_contents)), None)
    return fn if inner is None else _unwrapped(inner)


def fp16_loss_needs_scaling(engine) -> bool:
    """True where DeepSpeed's fp16 optimizer would unscale gradients that were never scaled: under ZeRO-0 its
    step() divides the gradients by the loss scale, but engine.backward() multiplies the loss by it only for
    ZeRO optimizers (DeepSpeed <= 0.19; PR #8393 open). Updates then come out 65536x too small and Adam's epsilon
    swamps them. The trainer scales the loss itself, unless this DeepSpeed's backward handles fp16 (as the fix
    does)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return _zero0_fp16(engine.optimizer) and "fp16" not in inspect.getsource(_unwrapped(DeepSpeedEngine.backward))


def drop_fp16_dummy_step(engine) -> None:
    """DeepSpeed's ZeRO-0 fp16 wrappers create the optimizer state by a step with zero gradients: Adam's count
    then starts at 1 and its bias correction damps the first real updates (to 0.74x at the first). Dropping the
    state lets the optimizer create it at the first real step, as under every other precision and stage."""
    if _zero0_fp16(engine.optimizer):
        engine.optimizer.optimizer.state.clear()


def fp32_masters(engine) -> dict[str, FP32Master]:
    """Each trainable parameter's fp32 weight, as views of the tensors the optimizer updates in place: the module's
    where it is fp32 (fp32, bf16 under autocast); ZeRO-0's fp16 wrappers' fp32 groups (one tensor per parameter when
    unfused, one flat tensor per group when fused, in their fp16 groups' order); under ZeRO 1-2 (bf16, fp16 or fp32)
    this rank's fragment of the flat fp32 partition (`_hp_mapping`, as DeepSpeed's safe_get_full_fp32_param reads
    it, without its all-reduce). ZeRO-3 keeps its partitions elsewhere: not mapped (KeyError for its names)."""
    params = {id(p): (n, p) for n, p in engine.module.named_parameters() if p.requires_grad}
    masters: dict[str, FP32Master] = {}
    if _zero0_fp16(engine.optimizer):
        opt = engine.optimizer
        for i, group in enumerate(opt.fp16_groups):
            flat = opt.fp32_groups_flat[i] if hasattr(opt, "fp32_groups_flat") else None
            offset = 0
            for j, param in enumerate(group):
                n = param.numel()
                target = flat.narrow(0, offset, n) if flat is not None else opt.fp32_groups[i][j].view(-1)
                masters[params[id(param)][0]] = FP32Master(target, param.shape)
                offset += n
        return masters
    for name, param in params.values():
        if hasattr(param, "ds_id"):  # ZeRO-3
            continue
        if hasattr(param, "_hp_mapping"):
            mapping = param._hp_mapping
            if mapping is None:  # all of it lives on other ranks
                masters[name] = FP32Master(param.new_empty(0, dtype=torch.float32), param.shape, 0, param._dp_group)
            else:
                fragment = mapping.get_hp_fragment()
                start = mapping.lp_fragment_address.start
                masters[name] = FP32Master(fragment.view(-1), param.shape, start, param._dp_group)
        elif param.dtype == torch.float32:
            masters[name] = FP32Master(param.detach().view(-1), param.shape)
    return masters


def restore_fp32_masters(engine, weights: dict[str, torch.Tensor]) -> None:
    """Make DeepSpeed's fp32 master weights the model's fp32 weights. DeepSpeed builds them from the module after
    casting it to bf16/fp16, so they start rounded: a `model.init_from` checkpoint lost about 1e-3 of precision
    before the first step, for good. Each master (`fp32_masters`) gets its part of the weight; ZeRO-3 through
    DeepSpeed's own setter."""
    from deepspeed.utils import safe_set_full_fp32_param

    masters = fp32_masters(engine)
    for name, param in engine.module.named_parameters():
        if name not in masters:
            safe_set_full_fp32_param(param, weights[name].to(engine.device))
            continue
        m = masters[name]
        value = weights[name].view(-1)
        if m.start is not None:
            value = value.narrow(0, m.start, m.flat.numel())
        m.flat.data.copy_(value.to(m.flat.device))
