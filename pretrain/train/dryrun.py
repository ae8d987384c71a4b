"""`pretrain train --dry-run`: what a run would do, without training.

Prints the resolved config, the batch arithmetic (micro x accumulation x data-parallel = global), parameter
counts per part, and a per-device memory estimate: model states from DeepSpeed's own ZeRO estimators, plus
an estimate of activations (Korthikanti et al. 2022: about 34 * s * b * h bytes per layer in 16-bit with
fused attention, doubled for fp32).
"""

from __future__ import annotations

import contextlib
import io
import math
import os

import numpy as np
import torch
import yaml

from objectives import pair_objectives
from pretrain.core.config import GLOBAL_BATCH, RunConfig
from pretrain.core.errors import UserError
from pretrain.core.parsing import to_dict
from pretrain.core.schedule import Schedule, unused_by_first_phase
from pretrain.train.distributed import BF16_AUTOCAST
from pretrain.train.engine import deepspeed_config
from pretrain.train.optim import warmup_note


def _vocab_size(cfg: RunConfig) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if (cfg.tokenizer_dir / "tokenizer.json").is_file():
        from data_pipeline.tokenizer import load_tokenizer

        return len(load_tokenizer(cfg.tokenizer_dir))
    return -(-cfg.data.vocab_size // 64) * 64  # what the tokenizer will be padded to


def _special_tokens(cfg: RunConfig, vocab_size: int):
    """The tokenizer's special ids where it exists already (a `model.init_from` checkpoint's, e.g. RoBERTa's pad
    id 1), BERT's layout otherwise."""
    import numpy as np

    from pretrain.core.tokens import SpecialTokens

    if (cfg.tokenizer_dir / "tokenizer.json").is_file():
        from data_pipeline.tokenizer import load_tokenizer, special_tokens

        return special_tokens(load_tokenizer(cfg.tokenizer_dir))
    return SpecialTokens(
        pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=vocab_size, replaceable=np.arange(5, vocab_size)
    )


def _model_on_meta(run):
    """The run's model without memory or weights."""
    from pretrain.train.setup import build_model

    with torch.device("meta"):
        return build_model(run.cfg, run.tokens, load_init_weights=False)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def _zero_estimate(stage: int, params: int, largest_layer: int, gpus_per_node: int, nodes: int) -> str:
    """DeepSpeed's estimator table for this stage (it prints; we capture)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        if stage == 3:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

            estimate_zero3_model_states_mem_needs_all_cold(
                params, largest_layer, num_gpus_per_node=gpus_per_node, num_nodes=nodes
            )
        else:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

            estimate_zero2_model_states_mem_needs_all_cold(params, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
    return buf.getvalue().rstrip()


def schedule_lines(cfg: RunConfig, schedule: Schedule, plan: dict, world: int) -> list[str]:
    """`# schedule`: each phase's steps, length, micro-batch, global batch and accumulation on `world` ranks, and the
    sequences and tokens (slots: global batch x length) it consumes; each scheduled value at its points."""
    t, rope = cfg.train, cfg.model.position_embedding == "rope"
    lines = [f"# schedule ({world} rank(s))"]
    total = 0
    for phase in schedule.phases:
        end = min(schedule.phase_end(phase) or t.max_steps, t.max_steps)
        if phase.start >= end:
            continue
        batch = plan["global_batch"][phase.start : end]
        tokens = int((batch * phase.max_seq_len).sum())
        total += tokens
        accumulation = sorted({int(b) // (phase.micro_batch_size * world) for b in (batch[0], batch[-1])})
        lines.append(
            f"phase {phase.index}: steps {phase.start:,}-{end - 1:,}, {phase.max_seq_len} tokens, micro-batch "
            f"{phase.micro_batch_size}"
            + (f", rope_theta {phase.rope_theta:g}" if rope else "")
            + f", global batch {int(batch[0]):,}"
            + (f" -> {int(batch[-1]):,}" if batch[-1] != batch[0] else "")
            + f" (accumulation {' -> '.join(map(str, accumulation))}): {int(batch.sum()):,} sequences, "
            f"{tokens:,} tokens"
        )
    for value in schedule.spec.values:
        points = ", ".join(f"step {step:,}: {v:g}" for step, v in value.points)
        unit = f", in {value.unit}" + (f", multiple of {value.multiple_of}" if value.multiple_of else "")
        lines.append(
            f"{value.key} ({value.shape}{unit if value.key == GLOBAL_BATCH else ''}): {points}; "
            f"at the last step {float(plan[value.key][-1]) if value.key in plan else int(plan['global_batch'][-1]):g}"
        )
    return [*lines, f"total: {total:,} tokens", ""]


def plan_nodes(world: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(ranks per node, nodes) for `world` ranks with at most `gpus_per_node` on a node. DeepSpeed's estimator
    assumes every node holds as many ranks, so a world that does not fill its nodes evenly is refused, not planned
    as the nodes it fills (12 ranks at 8 per node were estimated for 8)."""
    if world < 1:
        raise UserError(f"--world-size: must be at least 1, got {world}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise UserError(f"--gpus-per-node: must be at least 1, got {gpus_per_node}")
    per_node = min(gpus_per_node or world, world)  # 2 ranks at up to 8 per node: one node of 2
    if world % per_node:
        raise UserError(
            f"--world-size {world} is not a multiple of --gpus-per-node {per_node}: the nodes would hold different "
            f"numbers of ranks, which the memory estimate cannot plan; give a multiple of {per_node}"
        )
    return per_node, world // per_node


def dry_run(cfg: RunConfig, world_size: int | None = None, gpus_per_node: int | None = None) -> str:
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if gpus_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:
        gpus_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    per_node, nodes = plan_nodes(world, gpus_per_node)
    from pretrain.train.setup import resolve_run

    t = cfg.train
    run = resolve_run(cfg, _special_tokens(cfg, _vocab_size(cfg)), world=world)
    precision, global_batch = run.precision, run.global_batch
    model = _model_on_meta(run)
    parts: dict[str, int] = {}
    for name, p in model.named_parameters():
        key = (
            "embeddings"
            if ".embeddings." in f".{name}"
            else name.split(".")[0] + (f".{name.split('.')[1]}" if name.startswith("heads.") else "")
        )
        parts[key] = parts.get(key, 0) + p.numel()
    total = sum(parts.values())
    largest = max(p.numel() for p in model.parameters())
    tokens_per_step = global_batch * cfg.data.max_seq_len
    schedule = Schedule.of(cfg)
    schedule.check_split(world, t.max_steps)  # what the run itself would refuse
    plan = schedule.arrays(np.arange(t.max_steps), world) if schedule.active else None
    ds = deepspeed_config(run)

    lines = [
        "# resolved config",
        yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip(),
        "",
        "# batch arithmetic",
        f"micro_batch_size {t.micro_batch_size} x grad_accum_steps {t.grad_accum_steps} x data-parallel ranks "
        f"{world} = global batch {global_batch} sequences = {tokens_per_step:,} tokens per step"
        + (
            " (not used: schedule.values sets the global batch; DeepSpeed's batch follows it step by step)"
            if GLOBAL_BATCH in schedule.values
            else ""
        ),
        f"{t.max_steps:,} steps = {t.max_steps * global_batch:,} sequences = {t.max_steps * tokens_per_step:,} tokens"
        if plan is None
        else f"{t.max_steps:,} steps = {int(plan['global_batch'].sum()):,} sequences = "
        f"{int((plan['global_batch'] * plan['max_seq_len']).sum()):,} tokens (as scheduled, below)",
        "each loss term is a mean over "
        + (
            "all its targets in the step (train.loss_normalization=step)"
            if t.loss_normalization == "step"
            else "each micro-batch, then averaged (train.loss_normalization=micro_batch)"
        ),
        *(f"note: {note}" for note in (warmup_note(t), unused_by_first_phase(cfg), _padding_note(cfg)) if note),
        "",
        *(schedule_lines(cfg, schedule, plan, world) if plan is not None else []),
        "# parameters",
    ]
    lines += [f"{name:<24} {n:>14,}" for name, n in sorted(parts.items())]
    lines += [
        f"{'total':<24} {total:>14,}",
        "",
        f"# memory per device (ZeRO stage {t.zero_stage}, {precision}"
        + (" with float8 products in the encoder layers" if t.precision == "fp8" else "")
        + f", {world} rank(s) on {nodes} node(s))",
    ]
    lines += _model_states(t, precision, total, largest, per_node, nodes)
    lines += _activations(schedule, cfg, precision, model.encoder.embeddings.word_embeddings.num_embeddings)
    lines += ["", "# DeepSpeed config (derived)", yaml.safe_dump(ds, sort_keys=False).rstrip()]
    return "\n".join(lines)


def _padding_note(cfg: RunConfig) -> str | None:
    """The tokens above are slots (sequences x length): where samples do not fill them, the run counts fewer."""
    pairs = pair_objectives(cfg.objectives)
    why = "data.packing=doc_bounded" if cfg.data.packing == "doc_bounded" else ", ".join(pairs) if pairs else None
    if why is None:
        return None
    return (
        f"the tokens above are slots (sequences x length): with {why} padding fills some of them, and the run's "
        "metrics count real tokens only (`pretrain data inspect` gives the share filled)"
    )


def _model_states(t, precision: str, params: int, largest: int, per_node: int, nodes: int) -> list[str]:
    """Weights, gradients, fp32 master copy and Adam moments per device, and the EMA's copy. Under ZeRO 1-2 our own
    figure beside DeepSpeed's table, which assumes 16-bit weights and partitioned gradients (stage 2's) for stage 1
    too: ZeRO-1 keeps every gradient (2 bytes a parameter more), an fp32 run has 4-byte weights and gradients."""
    world = per_node * nodes
    weights = 4 if precision in ("fp32", BF16_AUTOCAST) else 2  # autocast: fp32 weights and gradients
    # what ZeRO 1-2 partition over the ranks: Adam's moments, and beside 16-bit weights an fp32 master and gradients
    partitioned = 8 + (0 if weights == 4 else 8)
    if t.zero_stage == 0:
        states = params * (weights + (0 if weights == 4 else 4) + 8 + weights)
        lines = [f"model states (weights, master copy, Adam moments, gradients): {_gib(states)}"]
    else:
        lines = ["model states, DeepSpeed's estimator:", _zero_estimate(t.zero_stage, params, largest, per_node, nodes)]
        if t.zero_stage in (1, 2):
            gradients = weights * params if t.zero_stage == 1 else weights * params / world
            states = weights * params + gradients + partitioned * params / world
            lines.append(
                f"model states of this run (ZeRO {t.zero_stage}, {weights}-byte weights, gradients "
                f"{'whole' if t.zero_stage == 1 else 'partitioned'}; no offload): {_gib(states)}"
            )
    if t.ema_decay and not t.ema_on_cpu:  # the fp32 weights' average: whole at ZeRO-0, this rank's fragment above
        lines.append(
            f"EMA of the fp32 weights (train.ema_on_cpu=false): {_gib(4 * params / (world if t.zero_stage else 1))}"
        )
    return lines


def _activations(schedule: Schedule, cfg: RunConfig, precision: str, vocab: int) -> list[str]:
    """The activation estimate of the largest micro-batch of tokens any phase trains with (a phase from step 0
    replaces the run's own micro-batch and length): 34 bytes per token and hidden unit a layer at 16 bits (Korthikanti
    et al., 2022), with fused attention; under activation checkpointing each layer keeps its input alone and one layer
    at a time is recomputed whole. The token-prediction logits and the attention scores of unfused attention (a CPU,
    masks that rule the fused kernels out) are said beside it."""
    m = cfg.model
    micro, seq = max(((p.micro_batch_size, p.max_seq_len) for p in schedule.phases), key=lambda x: x[0] * x[1])
    width = 2 if precision == "fp32" else 1
    layer = 34 * seq * micro * m.hidden_size * width
    checkpointed = m.activation_checkpointing
    act_bytes = (
        (m.num_layers * 2 * seq * micro * m.hidden_size * width + layer) if checkpointed else m.num_layers * layer
    )
    # the share of positions each token-level objective predicts (PLM: the last 1/K of its order)
    rates = [
        getattr(o, "mask_prob", 0.0) or 1 / getattr(o, "predict_fraction_k", math.inf) for o in cfg.objectives.values()
    ]
    targets = max(rates, default=0.0) * seq * micro  # masked positions: the decoder scores those alone
    logits = targets * vocab * (2 * width + 4 + 4)  # logits, their fp32 for the loss, its gradient
    scores = 5 * m.num_heads * seq * seq * micro * width * (1 if checkpointed else m.num_layers)
    largest = ", the largest phase" if len(schedule.phases) > 1 else ""
    return [
        f"activations (estimate, micro-batch {micro}, seq {seq}{largest}"
        + (", activation checkpointing" if checkpointed else "")
        + f"): {_gib(act_bytes)}",
        *([f"token-prediction logits (masked positions x vocabulary): {_gib(logits)}"] if logits else []),
        f"without fused attention (a CPU, or masks that rule it out) add the attention scores: {_gib(scores)}",
    ]
