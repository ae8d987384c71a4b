"""The checks of a run config's values: ranges, choices, and settings that must agree with each other. Each error
names the dotted key and the value (`pretrain.core.config` adds the file where the user wrote it)."""

from __future__ import annotations

from pathlib import Path

from pretrain.core.config_schema import (
    GLOBAL_BATCH,
    SHAPES,
    SOURCE_NAME,
    UNITS,
    DataConfig,
    RunConfig,
    ScheduledValue,
    TrainConfig,
)
from pretrain.core.errors import ConfigError
from pretrain.core.parsing import nearest

CHOICES: dict[str, tuple[str, ...]] = {
    "train.precision": ("auto", "bf16", "fp16", "fp32", "fp8"),
    "data.tokenizer_type": ("wordpiece", "bpe", "unigram"),
    "data.on_bad_document": ("skip", "error"),
    "data.text_documents": ("paragraphs", "lines"),
    "data.packing": ("full_sentences", "doc_bounded"),
    "wandb.mode": ("offline", "online", "disabled"),
    "train.optimizer": ("adamw", "lamb"),
    "model.norm_placement": ("post", "pre"),
    "model.position_embedding": ("learned", "rope"),
    "model.activation": ("gelu", "geglu"),
    "model.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "train.nan_policy": ("skip", "stop"),
    "train.loss_normalization": ("step", "micro_batch"),
    "train.lr_schedule": ("linear", "bert", "cosine", "wsd", "inverse_sqrt"),
    "train.decay_shape": ("linear", "cosine", "1-sqrt"),
}
"""The allowed values of RunConfig's string options, by dotted key (checked here, offered by the command line)."""


def check_values(cfg: RunConfig) -> None:
    """Every value of a config against its range, choices and the other values it must agree with."""
    for key, allowed in CHOICES.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key}: value '{value}' is not one of {', '.join(allowed)}{nearest(value, allowed)}")
    if cfg.train.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage: value {cfg.train.zero_stage} is not one of 0, 1, 2, 3")
    if cfg.train.collective_timeout_minutes <= 0:
        raise ConfigError(f"train.collective_timeout_minutes: must be > 0, got {cfg.train.collective_timeout_minutes}")
    if cfg.model.hidden_size % cfg.model.num_heads:
        raise ConfigError(
            f"model.hidden_size ({cfg.model.hidden_size}) must be divisible by model.num_heads ({cfg.model.num_heads})"
        )
    if cfg.data.max_seq_len < 8:  # as a schedule phase's: [CLS] A [SEP] B [SEP] and a masked token need room
        raise ConfigError(f"data.max_seq_len: must be >= 8 tokens, got {cfg.data.max_seq_len}")
    for key in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(cfg.model, key) < 1.0:
            raise ConfigError(f"model.{key}: must be within [0, 1), got {getattr(cfg.model, key)}")
    if cfg.data.max_seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.max_seq_len ({cfg.data.max_seq_len}) exceeds "
            f"model.max_position_embeddings ({cfg.model.max_position_embeddings})"
        )
    for key in ("micro_batch_size", "grad_accum_steps", "max_steps", "log_every"):
        if getattr(cfg.train, key) < 1:
            raise ConfigError(f"train.{key}: must be >= 1, got {getattr(cfg.train, key)}")
    # a negative time limit, step limit or clip norm used to mean "off" silently, as 0 does; the optimizer's were
    # refused by torch mid-start, after the data stage, without the key's name
    for key in (
        "save_every",
        "keep_checkpoints",
        "seed",
        "max_minutes",
        "exit_after_steps",
        "grad_clip",
        "weight_decay",
        "adam_eps",
    ):
        if getattr(cfg.train, key) < 0:
            raise ConfigError(f"train.{key}: must be >= 0, got {getattr(cfg.train, key)}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg.train, key) < 1.0:
            raise ConfigError(f"train.{key}: must be within [0, 1), got {getattr(cfg.train, key)}")
    _check_schedule(cfg.train)
    _check_sources(cfg.data)
    head = cfg.model.hidden_size // cfg.model.num_heads
    if cfg.model.position_embedding == "rope" and head % 2:
        raise ConfigError(
            f"model.hidden_size / model.num_heads = {head} per head: RoPE rotates pairs of dimensions, so a head needs "
            f"an even size"
        )
    if "plm" in cfg.objectives and cfg.model.embedding_size not in (0, cfg.model.hidden_size):
        raise ConfigError(
            f"model.embedding_size={cfg.model.embedding_size}: the PLM query stream starts from a vector as wide as "
            f"the encoder (hidden_size {cfg.model.hidden_size}); leave embedding_size at 0 for plm"
        )
    for key in ("num_layers", "num_heads", "hidden_size", "intermediate_size", "type_vocab_size"):
        if getattr(cfg.model, key) < 1:
            raise ConfigError(f"model.{key}: must be >= 1, got {getattr(cfg.model, key)}")
    for key, ok, rule in (  # torch's tracebacks, or NaN RoPE tables and a run that stops at its first step
        ("vocab_size", cfg.model.vocab_size >= 0, ">= 0 (0: the tokenizer's)"),
        ("embedding_size", cfg.model.embedding_size >= 0, ">= 0 (0: hidden_size)"),
        ("initializer_range", cfg.model.initializer_range >= 0, ">= 0"),
        ("layer_norm_eps", cfg.model.layer_norm_eps > 0, "> 0"),
        ("rope_theta", cfg.model.rope_theta > 0, "> 0"),
    ):
        if not ok:
            raise ConfigError(f"model.{key}: must be {rule}, got {getattr(cfg.model, key)}")
    _check_local_attention(cfg)
    _check_schedule_section(cfg)


def _check_local_attention(cfg: RunConfig) -> None:
    """model.local_attention and its companions. ModernBERT's window: a token sees |query - key| <= window / 2."""
    m, window = cfg.model, cfg.model.local_attention
    if window < 0 or window % 2:
        raise ConfigError(
            f"model.local_attention: value {window} is not 0 (global attention) or an even number of tokens "
            "(a token sees local_attention / 2 on each side)"
        )
    if m.global_every < 1:
        raise ConfigError(f"model.global_every: must be >= 1, got {m.global_every}")
    if m.local_rope_theta <= 0:
        raise ConfigError(f"model.local_rope_theta: must be > 0, got {m.local_rope_theta}")
    if not window:
        return
    if m.global_every == 1:
        raise ConfigError(
            f"model.global_every: value 1 makes every layer global, so model.local_attention={window} would do nothing"
        )
    if m.share_layers:
        raise ConfigError(
            f"model.local_attention={window} with model.share_layers=true: a shared layer is one module for every "
            "depth, so it cannot be global at some and local at others"
        )
    # An imported checkpoint keeps its window whatever the run's length (its export must say the same window).
    if not m.init_from and window // 2 >= cfg.data.max_seq_len - 1:
        raise ConfigError(
            f"model.local_attention: value {window} lets a token see {window // 2} positions on each side, all of "
            f"data.max_seq_len={cfg.data.max_seq_len}: the local layers would attend globally (use 0, or a window "
            f"below {2 * (cfg.data.max_seq_len - 1)})"
        )


def _check_sources(d: DataConfig) -> None:
    """data.sources: named, non-empty, positive weights; instead of data.corpus, not beside it. The built-in demo
    corpus (what DataConfig and the default preset set) counts as not given, so presets based on it take sources."""
    if d.sources and d.corpus and d.corpus != DataConfig().corpus:
        raise ConfigError(
            f"data.corpus ({', '.join(d.corpus)}) and data.sources are both given: data.sources replaces data.corpus; "
            "give one of them (data.corpus=[] where a preset sets it)"
        )
    seen: set[str] = set()
    for i, s in enumerate(d.sources):
        where = f"data.sources[{i}]"
        if not SOURCE_NAME.fullmatch(s.name):
            raise ConfigError(
                f"{where}.name: {s.name!r} is not a short identifier (letters, digits, _ and -, at most 64, not "
                "starting with _ or -): it names the source's shard directory"
            )
        if s.name in seen:
            raise ConfigError(f"{where}.name: '{s.name}' names two sources; give each source its own name")
        seen.add(s.name)
        if not s.weight > 0:
            raise ConfigError(f"{where}.weight: source '{s.name}' has weight {s.weight}; weights must be > 0")
        if not s.corpus:
            raise ConfigError(f"{where}.corpus: source '{s.name}' names no files (an empty list)")


def _check_schedule(t: TrainConfig) -> None:
    if t.lr < 0 or t.warmup_steps < 0 or t.decay_steps < 0:
        raise ConfigError(
            f"train.lr, warmup_steps and decay_steps must be >= 0 (got {t.lr}, {t.warmup_steps}, {t.decay_steps})"
        )
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio: must be within [0, 1], got {t.min_lr_ratio}")
    if not 0.0 <= t.ema_decay < 1.0:
        raise ConfigError(f"train.ema_decay: must be within (0, 1), or 0 for no EMA; got {t.ema_decay}")
    if t.ema_decay and t.zero_stage == 3:
        raise ConfigError("train.ema_decay: not with train.zero_stage=3 (its weights are partitioned over ranks)")
    if t.optimizer == "lamb" and t.zero_stage > 0:
        # ZeRO hands the optimizer one flat slice of fp32 parameters per rank: LAMB's per-tensor trust ratio became
        # one ratio over whatever a rank's slice held, another update rule on each number of ranks
        raise ConfigError(
            f"train.optimizer=lamb: not with train.zero_stage={t.zero_stage} (ZeRO gives the optimizer flat slices of "
            "many tensors, and LAMB's trust ratio is per tensor); use train.zero_stage=0, or adamw"
        )
    if t.lr_schedule == "wsd" and t.wsd_decay_steps() > t.max_steps - t.warmup_steps:
        given = (
            f"train.decay_steps ({t.decay_steps})"
            if t.decay_steps
            else f"the decay ({t.wsd_decay_steps()} steps: 10% of max_steps, as train.decay_steps=0 says)"
        )
        raise ConfigError(
            f"{given} is longer than the steps after the warm-up (max_steps {t.max_steps} - warmup_steps "
            f"{t.warmup_steps}): it would start inside the warm-up"
        )


def _check_schedule_section(cfg: RunConfig) -> None:
    """`schedule:` as read: phases in order and inside the run, lengths the model can hold, known value keys with
    points in order and inside the run, shapes and units. Objective rates' ranges are checked where the objectives
    are known (`objectives.base.check_scheduled_options`); the schedule itself is `pretrain.core.schedule`."""
    s, t, m = cfg.schedule, cfg.train, cfg.model
    previous = -1
    for i, p in enumerate(s.phases):
        where = f"schedule.phases[{i}]"
        if p.start < 0:
            raise ConfigError(f"{where}.start: {p.start} is negative: a phase starts at an optimizer step >= 0")
        if p.start <= previous:
            raise ConfigError(
                f"{where}.start: {p.start} is not after the phase before it (step {previous}): phases "
                "go in increasing order of start"
            )
        if p.start >= t.max_steps:
            raise ConfigError(f"{where}.start: {p.start} is past the run's end (train.max_steps={t.max_steps})")
        previous = p.start
        for key in ("max_seq_len", "micro_batch_size"):
            if getattr(p, key) < 0:
                raise ConfigError(f"{where}.{key}: must be >= 1 (or 0: as before), got {getattr(p, key)}")
        if p.max_seq_len and not 8 <= p.max_seq_len <= m.max_position_embeddings:
            raise ConfigError(
                f"{where}.max_seq_len: {p.max_seq_len} is outside [8, model.max_position_embeddings="
                f"{m.max_position_embeddings}]"
            )
        if p.rope_theta < 0:
            raise ConfigError(f"{where}.rope_theta: must be > 0 (or 0: as before), got {p.rope_theta}")
        window = m.local_attention
        if p.max_seq_len and window and not m.init_from and window // 2 >= p.max_seq_len - 1:
            raise ConfigError(
                f"{where}.max_seq_len: {p.max_seq_len} tokens are all within model.local_attention={window} "
                f"(a token sees {window // 2} on each side): the local layers would attend globally in this phase"
            )
        if p.rope_theta and m.position_embedding != "rope":
            raise ConfigError(f"{where}.rope_theta: model.position_embedding is {m.position_embedding}, not rope")
    seen: set[str] = set()
    for i, v in enumerate(s.values):
        _check_value(v, f"schedule.values[{i}]", t.max_steps, seen)


def _check_value(v: ScheduledValue, where: str, max_steps: int, seen: set[str]) -> None:
    parts = v.key.split(".")
    if v.key != GLOBAL_BATCH and not (len(parts) == 3 and parts[0] == "objectives"):
        raise ConfigError(
            f"{where}.key: '{v.key}' is not {GLOBAL_BATCH} or objectives.<name>.<rate> (e.g. objectives.mlm.mask_prob)"
        )
    if v.key in seen:
        raise ConfigError(f"{where}.key: '{v.key}' is scheduled twice; give it one list of points")
    seen.add(v.key)
    if v.shape not in SHAPES:
        raise ConfigError(f"{where}.shape: value '{v.shape}' is not one of {', '.join(SHAPES)}")
    if v.unit not in UNITS:
        raise ConfigError(f"{where}.unit: value '{v.unit}' is not one of {', '.join(UNITS)}")
    if v.unit != "sequences" and v.key != GLOBAL_BATCH:
        raise ConfigError(f"{where}.unit: only {GLOBAL_BATCH} has a unit ({v.key} is a rate)")
    if not v.points:
        raise ConfigError(f"{where}.points: '{v.key}' has no [step, value] points")
    steps = [p[0] for p in v.points]
    for a, b in zip(steps, steps[1:]):
        if b <= a:
            raise ConfigError(f"{where}.points: steps {a} then {b} are not in increasing order")
    if steps[0] < 0 or steps[-1] >= max_steps:
        bad = steps[0] if steps[0] < 0 else steps[-1]
        raise ConfigError(f"{where}.points: step {bad} is outside the run (0 to train.max_steps-1={max_steps - 1})")
    if v.multiple_of < 0 or (v.multiple_of and v.key != GLOBAL_BATCH):
        raise ConfigError(f"{where}.multiple_of: only {GLOBAL_BATCH} takes one, >= 1 (got {v.multiple_of})")
    if v.key == GLOBAL_BATCH:
        for step, value in v.points:
            if value < 1:
                raise ConfigError(f"{where}.points: global batch {value:g} at step {step} is below 1 {v.unit[:-1]}")


def check_data_stages(d: DataConfig) -> None:
    """Settings of the stages that build data, checked for a new config only: a checkpoint's config of a run whose
    shards an older version built with docs_per_shard=0 (read then as 1) still exports and resumes."""
    for key in ("vocab_size", "docs_per_shard"):
        if getattr(d, key) < 1:
            raise ConfigError(f"data.{key}: must be >= 1, got {getattr(d, key)}")
    for key in ("min_frequency", "tokenizer_sample_docs"):  # a trainer's OverflowError; "all" unsaid
        if getattr(d, key) < 0:
            raise ConfigError(f"data.{key}: must be >= 0, got {getattr(d, key)}")
    if d.loader_workers < -1:  # (an older version read any negative as -1: a checkpoint's config still loads)
        raise ConfigError(
            f"data.loader_workers: must be >= -1 (-1: chosen from the cores, 0: the training process), got "
            f"{d.loader_workers}"
        )


def check_run_name(name: str, output_dir: str) -> None:
    """`name` is the run directory under `output_dir`, checked where a config is read from a file or preset (not a
    checkpoint's, which exports as it trained): an absolute path or a '..' put the run outside it, where the ablation
    and `pretrain compare` of output_dir never look, or inside another run's directory (its checkpoints/, where that
    run's rotation deleted it). Nested names (group/run) stay within. A run made so before is resumed by giving
    output_dir its real parent and name its directory's name."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or not parts:
        raise ConfigError(
            f"name: {name!r} is the run directory under output_dir ({output_dir}): give a relative name without "
            "'..' (and output_dir for where the runs go)"
        )


def check_options_apply(t: TrainConfig) -> None:
    """Options the run does not use are refused rather than ignored: a learning-rate schedule's (a preset's wsd
    decay under a cosine override, a floor the linear schedule never reaches), where the EMA is kept without one; and
    values below what they mean anything at (accepted unsaid before: a checkpoint's config that has one still loads)."""
    for key in ("max_skipped_steps", "peak_tflops"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}: must be >= 0, got {getattr(t, key)}")
    for key in ("ema_on_cpu", "ema_warmup"):
        if getattr(t, key) != getattr(TrainConfig(), key) and not t.ema_decay:
            raise ConfigError(f"train.{key}={getattr(t, key)} has no EMA without train.ema_decay: set both, or neither")
    unused = []
    if t.lr_schedule not in ("cosine", "wsd") and t.min_lr_ratio != 0.0:
        unused.append(f"train.min_lr_ratio={t.min_lr_ratio:g} (cosine and wsd end there)")
    if t.lr_schedule != "wsd":
        defaults = TrainConfig()
        unused += [
            f"train.{key}={getattr(t, key)} (wsd's decay)"
            for key in ("decay_steps", "decay_shape")
            if getattr(t, key) != getattr(defaults, key)
        ]
    if unused:
        raise ConfigError(
            f"train.lr_schedule={t.lr_schedule} does not use {' or '.join(unused)}: set the schedule that does, or "
            f"leave them at their defaults"
        )
