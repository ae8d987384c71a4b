"""The training loop: always through `deepspeed.initialize`, also for one process on CPU.

    data (shards -> packed samples -> objectives.prepare -> collate)
    -> engine(batch) -> weighted loss -> engine.backward -> engine.step  (x grad_accum_steps)
    -> log, checkpoint, stop (max_steps, max_minutes, exit_after_steps, SIGTERM)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
import yaml

from data_pipeline.loader import PretrainDataset, build_loader
from data_pipeline.samples import build_samples, builder_kind
from data_pipeline.shards import ShardSet
from data_pipeline.tokenizer import load_tokenizer, special_tokens, tokenizer_hash
from objectives import LOSS_SCALES, SpecialTokens, build_objectives, sample_builder_for
from pretrain import checkpoint as ckpt
from pretrain.config import RunConfig, build_config, load_yaml, save_config, to_dict
from pretrain.errors import ConfigError, UserError
from pretrain.fingerprint import changed_settings, check_resume, fingerprint
from pretrain.outputs import claim_output, exclusive, mark_output
from pretrain.distributed import (any_rank, control_group, deepspeed_config, init_distributed, precision_mode,
                                  resolve_precision)
from pretrain.flops import count_step_flops, device_peak_tflops, throughput_metrics
from pretrain.metrics import MetricsLogger, read_metrics
from pretrain.model import PretrainingModel
from pretrain.optim import build_optimizer, build_scheduler

EXIT_PREEMPTED = 75  # SIGTERM: the step finished, a checkpoint was written; run the same command to resume
EXIT_NONFINITE = 76  # stopped by train.nan_policy: the last good checkpoint is the latest


def model_config_for(cfg: RunConfig, tokens: SpecialTokens):
    """The model config with vocabulary and padding id taken from the tokenizer."""
    if 0 < cfg.model.vocab_size < tokens.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                          f"({tokens.vocab_size} tokens, {cfg.tokenizer_dir}): leave it 0 to take the tokenizer's")
    return replace(cfg.model, vocab_size=cfg.model.vocab_size or tokens.vocab_size, pad_token_id=tokens.pad)


def build_model(cfg: RunConfig, tokens: SpecialTokens, load_init_weights: bool = True) -> PretrainingModel:
    """The model of a run. With `model.init_from: DIR` (a HF checkpoint directory) its architecture fields
    come from DIR/config.json and, when `load_init_weights`, its weights from DIR (heads the checkpoint lacks
    stay freshly initialised, with a warning). Without the weights (loading one of our checkpoints, which
    replaces them anyway) DIR may be gone: the config saved with the run then holds the architecture."""
    torch.manual_seed(cfg.train.seed)
    objectives = build_objectives(cfg.objectives, tokens)
    model_cfg = model_config_for(cfg, tokens)
    init_from = cfg.model.init_from
    if init_from and (load_init_weights or (Path(init_from) / "config.json").is_file()):
        from pretrain.hf_import import init_model_config

        model_cfg = init_model_config(cfg, model_cfg, tokens)
    model = PretrainingModel(model_cfg, objectives)
    if init_from and load_init_weights:
        from pretrain.hf_import import load_init_from

        load_init_from(model, init_from)
    return model


def saved_fingerprint(checkpoint: Path) -> dict:
    """The fingerprint a checkpoint recorded; for one written before fingerprints existed, what its config.yaml and
    tokenizer say (its data is then not compared)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if "fingerprint" in state:
        return state["fingerprint"]
    saved = build_config(load_yaml(checkpoint / "config.yaml"))
    tokenizer_dir = checkpoint / "tokenizer" if (checkpoint / "tokenizer" / "tokenizer.json").is_file() else None
    model = saved.model
    if tokenizer_dir is not None:
        model = model_config_for(saved, special_tokens(load_tokenizer(tokenizer_dir)))
    # before fingerprints, bf16 under ZeRO-0 ran on DeepSpeed's bf16 wrapper: precision 'bf16', not 'bf16-autocast'
    return fingerprint(saved, model, resolve_precision(saved.train.precision), state.get("world_size", 1),
                       tokenizer_hash(tokenizer_dir) if tokenizer_dir else None, None)


def build_sample_source(cfg: RunConfig, shards: ShardSet, tokens: SpecialTokens, objectives: list):
    kind = builder_kind(sample_builder_for(objectives), cfg.data.packing)
    return build_samples(kind, shards, cfg.data.max_seq_len, tokens, cfg.train.seed)


class _StopFlag:
    """Set by SIGTERM/SIGINT; the step in progress finishes, then we checkpoint and exit."""

    def __init__(self):
        self.signal = 0
        self._previous = {}

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _trim_metrics(run_dir: Path, last_step: int) -> None:
    """Before training, drop metric lines after the step we start from (steps only increase), and a line torn by
    a crash or a full disk, which the next append would run into."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    records = read_metrics(run_dir)
    kept = [r for r in records if r["step"] <= last_step]
    text = "".join(json.dumps(r) + "\n" for r in kept)
    if path.read_text() != text:
        ckpt.write_atomic(path, text)


@contextlib.contextmanager
def own_run_dir(run_dir: Path, is_main: bool, doing: str = "training"):
    """Collective. Rank 0 claims the run directory (absent, empty, or a run directory of ours: see
    `pretrain.outputs`) and holds its lock for the body: one trainer per run directory. Every rank fails together."""
    error, held = None, contextlib.ExitStack()
    if is_main:
        try:
            claim_output(run_dir, "run", "the run directory")
            held.enter_context(exclusive(run_dir, doing, ", or use another run name (name=...)"))
            mark_output(run_dir, "run")
        except UserError as err:
            held.close()
            error = err
    if any_rank(error is not None):
        raise error or UserError(f"rank 0 could not take the run directory {run_dir} (its message says why)")
    with held:
        yield


def train(cfg: RunConfig) -> dict:
    """Train (resuming from the latest checkpoint if there is one). Returns a summary of the run."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = init_distributed()
    with own_run_dir(cfg.run_dir, rank == 0):
        return _train(cfg, rank, world)


def _train(cfg: RunConfig, rank: int, world: int) -> dict:
    import deepspeed
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    run_dir = cfg.run_dir
    is_main = rank == 0
    t = cfg.train
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    tokens = special_tokens(tokenizer)
    tokenizer_sha = tokenizer_hash(cfg.tokenizer_dir)
    shards = ShardSet(cfg.shards_dir, verify=True, expected_tokenizer_hash=tokenizer_sha)
    ckpt_root = run_dir / "checkpoints"
    latest = ckpt.latest_checkpoint(ckpt_root)
    precision = precision_mode(resolve_precision(t.precision), t.zero_stage)
    identity = fingerprint(cfg, model_config_for(cfg, tokens), precision, world, tokenizer_sha, shards.content_hash())
    if latest is not None:  # before anything is written: a refused resume leaves the run directory as it was
        check_resume(saved_fingerprint(latest), identity, t.allow_changes, latest)
    if is_main:
        if latest is not None and (run_dir / "config.yaml").is_file():
            changed = changed_settings(yaml.safe_load((run_dir / "config.yaml").read_text()), to_dict(cfg))
            if changed:
                print(f"[pretrain] resuming with changed settings: {'; '.join(changed)}", file=sys.stderr)
        save_config(cfg, run_dir / "config.yaml")

    model = build_model(cfg, tokens)
    samples = build_sample_source(cfg, shards, tokens, model.objectives)
    optimizer = build_optimizer(model, t)
    # Resuming on another number of ranks with per-rank optimizer shards goes through the universal layout
    universal = latest is not None and ckpt.needs_universal(latest, world)
    ds_config = deepspeed_config(cfg, world)
    if universal:
        ckpt.make_universal(latest)
        ds_config["checkpoint"] = {"load_universal": True}
    # DeepSpeed casts the module to bf16/fp16 in place and builds its fp32 masters from that copy
    fp32_weights = ({n: p.detach().clone() for n, p in model.named_parameters()}
                    if latest is None and precision in ("bf16", "fp16") else None)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=build_scheduler(optimizer, t),
                                           config=ds_config)
    drop_fp16_dummy_step(engine)
    if fp32_weights is not None:
        restore_fp32_masters(engine, fp32_weights)
    torch.manual_seed(t.seed * 1000 + rank)  # dropout (and ELECTRA sampling) streams differ across ranks

    state = {"step": 0, "consumed_samples": 0, "tokens_seen": 0, "elapsed_s": 0.0, "skipped_steps": 0,
             "skipped_in_a_row": 0, "world_size": world, "fingerprint": identity}
    if latest is not None:
        state = {**state, **ckpt.load_checkpoint(engine, latest, universal=universal), "world_size": world,
                 "fingerprint": identity}
    if is_main:
        _trim_metrics(run_dir, state["step"])
    config_text = yaml.safe_dump(to_dict(cfg), sort_keys=False)

    global_batch = t.micro_batch_size * t.grad_accum_steps * world
    dataset = PretrainDataset(samples, engine.module.objectives, t.seed)
    loader = build_loader(dataset, tokens.pad,
                          state["consumed_samples"], t.micro_batch_size, t.grad_accum_steps, rank, world,
                          cfg.data.loader_workers)
    logger = MetricsLogger(run_dir, to_dict(cfg), t.max_steps, state["step"], cfg.wandb.mode, cfg.wandb.project,
                           enabled=is_main)
    if latest is not None:
        logger.write(f"resumed from {latest} (step {state['step']}, {state['consumed_samples']} samples)")
    logger.write(f"training {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {world} "
                 f"process(es), {precision}, global batch {global_batch} "
                 f"({t.micro_batch_size} x {t.grad_accum_steps} accumulation x {world} ranks), "
                 f"{len(samples)} sequences of {cfg.data.max_seq_len} tokens per epoch")

    device = engine.device
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-autocast"
                else contextlib.nullcontext())
    prescale_fp16 = fp16_loss_needs_scaling(engine)
    # fp32 under ZeRO-0 runs our optimizer unwrapped, and DeepSpeed then keeps no gradient norm: measure it here
    own_grad_norm, grad_norm = not isinstance(engine.optimizer, DeepSpeedOptimizer), None
    stop = _StopFlag()
    stop.install()
    data = iter(loader)
    start_step, started = state["step"], time.time()
    interval_start, interval_tokens, interval_metrics, interval_steps = time.time(), 0, {}, 0
    unflushed_tokens = 0  # local tokens not yet summed over ranks into state["tokens_seen"]
    flops_per_sample = probe_flops_per_sample(cfg, tokens, dataset, state["consumed_samples"])
    peak = device_peak_tflops(resolve_precision(t.precision), t.peak_tflops)
    exit_code, reason = 0, "max_steps"

    def logs_now(step: int) -> bool:
        return step % t.log_every == 0 or step == t.max_steps
    try:
        while state["step"] < t.max_steps:
            step_tokens, skipped_before = 0, engine.skipped_steps
            micro_batches = [next(data) for _ in range(t.grad_accum_steps)]
            scales = (step_loss_scales(model.objectives, micro_batches) if t.loss_normalization == "step"
                      else [{}] * len(micro_batches))
            for micro_batch, scale in zip(micro_batches, scales):
                batch = {k: v.to(device, non_blocking=True) for k, v in micro_batch.items()}
                batch[LOSS_SCALES] = scale
                with autocast:
                    loss, metrics = engine(batch)
                engine.backward(loss * engine.optimizer.loss_scale if prescale_fp16 else loss)
                if own_grad_norm and engine.is_gradient_accumulation_boundary() and logs_now(state["step"] + 1):
                    grad_norm = _own_grad_norm(model)  # complete and averaged over ranks by now; step clips
                engine.step()
                step_tokens += int(batch["attention_mask"].sum())
                for key, value in metrics.items():
                    interval_metrics[key] = interval_metrics.get(key, 0.0) + float(value) / t.grad_accum_steps
            state["step"] += 1
            state["consumed_samples"] += global_batch
            interval_tokens += step_tokens
            unflushed_tokens += step_tokens
            interval_steps += 1
            logger.advance(1)

            if logs_now(state["step"]):
                tokens_all = _sum_ranks(interval_tokens)
                state["tokens_seen"] += _sum_ranks(unflushed_tokens)
                unflushed_tokens = 0
                elapsed = time.time() - interval_start
                means = _mean_ranks(interval_metrics)
                record = {"step": state["step"], "loss": round(means.pop("loss") / interval_steps, 6),
                          **{k: round(v / interval_steps, 6) for k, v in sorted(means.items())},
                          "lr": engine.get_lr()[0], "grad_norm": _rounded(grad_norm) if own_grad_norm else _grad_norm(engine),
                          "tokens": state["tokens_seen"], "tokens_per_s": round(tokens_all / max(elapsed, 1e-9), 1),
                          **throughput_metrics(flops_per_sample, interval_steps * global_batch / max(elapsed, 1e-9),
                                               world, peak),
                          "skipped_steps": state["skipped_steps"]}
                if resolve_precision(t.precision) == "fp16":
                    record["loss_scale"] = _loss_scale(engine)
                logger.log(record)
                logger.advance(0, {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"})
                interval_start, interval_tokens, interval_metrics, interval_steps = time.time(), 0, {}, 0
                if not math.isfinite(record["loss"]):
                    logger.write(f"warning: non-finite loss at step {state['step']}")

            ran = state["step"] - start_step
            timed_out = t.max_minutes > 0 and (time.time() - started) / 60 >= t.max_minutes
            # DeepSpeed skips a step whose gradient norm is not finite (same decision on every rank)
            skipped = engine.skipped_steps > skipped_before
            stop_now, nonfinite = any_rank(
                bool(stop.signal) or timed_out or (t.exit_after_steps > 0 and ran >= t.exit_after_steps),
                skipped and resolve_precision(t.precision) != "fp16")  # fp16: loss-scale overflows are routine
            if nonfinite:
                state["skipped_steps"] += 1
                state["skipped_in_a_row"] += 1
                logger.write(f"warning: step {state['step']} skipped (non-finite loss or gradient); "
                             f"{state['skipped_steps']} skipped so far")
                if t.nan_policy == "stop" or state["skipped_in_a_row"] >= t.max_skipped_steps:
                    logger.write(f"stopping: train.nan_policy={t.nan_policy}, {state['skipped_in_a_row']} "
                                 "non-finite step(s) in a row; the latest checkpoint is the last good one")
                    exit_code, reason = EXIT_NONFINITE, "nonfinite"
                    break
            else:
                state["skipped_in_a_row"] = 0
            if stop_now or (t.save_every and state["step"] % t.save_every == 0) or state["step"] == t.max_steps:
                state["tokens_seen"] += _sum_ranks(unflushed_tokens)
                unflushed_tokens = 0
                state["elapsed_s"] = state.get("elapsed_s", 0.0) + (time.time() - started)
                started = time.time()
                ckpt.save_checkpoint(engine, ckpt_root, state, config_text, cfg.tokenizer_dir, t.keep_checkpoints)
            if stop_now:
                reason = "signal" if stop.signal else ("max_minutes" if timed_out else "exit_after_steps")
                exit_code = EXIT_PREEMPTED if stop.signal else 0
                logger.write(f"stopped at step {state['step']} ({reason}); checkpoint saved, run the same "
                             "command again to continue")
                break
    finally:
        stop.restore()
        logger.close()
    final = read_metrics(run_dir)[-1] if is_main and read_metrics(run_dir) else {}
    return {"step": state["step"], "tokens_seen": state["tokens_seen"], "exit_code": exit_code, "reason": reason,
            "final_loss": final.get("loss"), "run_dir": str(run_dir), "complete": state["step"] >= t.max_steps}


def probe_flops_per_sample(cfg: RunConfig, tokens: SpecialTokens, dataset: PretrainDataset, position: int,
                           n: int = 2) -> float:
    """Training FLOPs per sample, counted on a throwaway fp32 CPU copy of the model over `n` real samples.

    A separate model and saved/restored rng keep the run itself untouched (bitwise resume); under ZeRO-3 the
    engine's own parameters are partitioned anyway.
    """
    from data_pipeline.loader import Collator

    rng_state = torch.get_rng_state()
    try:
        probe = build_model(cfg, tokens, load_init_weights=False)  # FLOPs need the shapes, not the weights
        batch = Collator(tokens.pad, probe.objectives)([dataset[position + i] for i in range(n)])
        flops = count_step_flops(lambda: probe(batch)[0].backward())
    finally:
        torch.set_rng_state(rng_state)
    return flops / n


def step_loss_scales(objectives, micro_batches: list[dict]) -> list[dict[str, float]]:
    """Per micro-batch, {loss term: targets here x micro-batches x ranks / targets in the whole step}: see
    `objectives.base.loss_scale`. One all-reduce of the step's target counts per term. A term with no target
    anywhere in the step gets 0 (its loss is a connected zero anyway)."""
    counts = [{term: n for o in objectives for term, n in o.target_counts(b).items()} for b in micro_batches]
    terms = sorted(counts[0])
    if not terms:
        return [{} for _ in micro_batches]
    local = torch.tensor([[float(c[term]) for term in terms] for c in counts], dtype=torch.float64)  # [A, T]
    total = local.sum(0)  # [T]
    world = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, group=control_group())
        world = dist.get_world_size()
    scale = torch.where(total > 0, local * (len(micro_batches) * world) / total.clamp(min=1), 0.0)  # [A, T]
    return [dict(zip(terms, row)) for row in scale.tolist()]


def _grad_norm(engine) -> float | None:
    """Global gradient norm (before clipping) of the last step, as DeepSpeed computed it."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    norm = float(norm)
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if isinstance(engine.optimizer, FP16_UnfusedOptimizer):  # it measures the loss-scaled gradients
        norm /= engine.optimizer.loss_scale
    return _rounded(norm)


@torch.no_grad()
def _own_grad_norm(model: nn.Module) -> float:
    norms = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def _rounded(value: float | None) -> float | None:
    return round(value, 6) if value is not None and math.isfinite(value) else value


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


def restore_fp32_masters(engine, weights: dict[str, torch.Tensor]) -> None:
    """Make DeepSpeed's fp32 master weights the model's fp32 weights. DeepSpeed builds them from the module after
    casting it to bf16/fp16, so they start rounded: a `model.init_from` checkpoint lost about 1e-3 of precision
    before the first step, for good. ZeRO 1-3 through DeepSpeed's own setter; ZeRO-0's fp16 wrappers keep one fp32
    tensor per parameter (unfused) or one flat tensor per group (fused), in their fp16 groups' order."""
    from deepspeed.utils import safe_set_full_fp32_param

    names = {id(p): n for n, p in engine.module.named_parameters()}
    if _zero0_fp16(engine.optimizer):
        opt = engine.optimizer
        for i, group in enumerate(opt.fp16_groups):
            flat = opt.fp32_groups_flat[i] if hasattr(opt, "fp32_groups_flat") else None
            offset = 0
            for j, param in enumerate(group):
                value = weights[names[id(param)]].to(param.device).view(-1)
                target = flat[offset:offset + value.numel()] if flat is not None else opt.fp32_groups[i][j].view(-1)
                target.data.copy_(value)
                offset += value.numel()
        return
    for name, param in engine.module.named_parameters():
        safe_set_full_fp32_param(param, weights[name].to(engine.device))


def _loss_scale(engine) -> float | None:
    """fp16's current dynamic loss scale: every DeepSpeed fp16 optimizer (fused, unfused, ZeRO 1-3) has it."""
    scale = getattr(engine.optimizer, "loss_scale", None)
    return float(scale) if scale is not None else None


def _sum_ranks(value: int) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, group=control_group())
    return int(t.item())


def _mean_ranks(metrics: dict[str, float]) -> dict[str, float]:
    if not dist.is_initialized() or dist.get_world_size() == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=control_group())
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, t.tolist())}


def trained_steps(cfg: RunConfig) -> int:
    latest = ckpt.latest_checkpoint(cfg.run_dir / "checkpoints")
    return json.loads((latest / "trainer_state.json").read_text())["step"] if latest else 0


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
