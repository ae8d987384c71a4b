"""Typed run configuration: the schema of a run (`RunConfig` and its sections), its checks, and reading a preset or
file with dotted command-line overrides into it.

One source of truth: the DeepSpeed config, the HF export config and the data settings are all derived
from a `RunConfig`. Unknown keys and wrong types fail with the key, the value and the nearest valid key: the parsing
is `pretrain.core.parsing`'s, which every other config kind shares.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretrain.core.errors import ConfigError
from pretrain.core.files import write_atomic
from pretrain.core.parsing import (
    CONFIG_DIR,
    apply_overrides,
    doc,
    from_dict,
    load_yaml_with_base,
    nearest,
    resolve_preset,
    to_dict,
)


@dataclass(frozen=True)
class SourceConfig:
    """One corpus of a weighted mixture (`data.sources`)."""

    name: str = doc("", "Short identifier (letters, digits, _ and -); its shards are <shards>/<name>.")
    corpus: list[str] = doc(factory=list, text="Files, directories or globs of this source, as data.corpus.")
    weight: float = doc(1.0, "Share of the training samples drawn from it, relative to the other sources' weights.")


SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""A source's name is a directory name under the shards: no path separators, dots or spaces."""


@dataclass(frozen=True)
class DataConfig:
    corpus: list[str] = doc(
        factory=lambda: ["data/us-speeches.public-domain.jsonl"],
        text="Corpus files, directories or globs (JSON Lines with a text field, or plain text).",
    )
    text_field: str = doc("text", "Field of each JSON Lines record that holds the document text.")
    text_documents: str = doc(
        "paragraphs",
        "What a document is in a plain-text (.txt) file: a paragraph (lines up to a blank line) or each line (lines).",
    )
    tokenizer: str = doc(
        "", "Tokenizer directory; empty means <run_dir>/tokenizer, trained from the corpus if missing."
    )
    tokenizer_type: str = doc("wordpiece", "Kind of tokenizer to train: wordpiece, bpe (byte-level) or unigram.")
    vocab_size: int = doc(8192, "Target vocabulary size (padded up to a multiple of 64).")
    lowercase: bool = doc(True, "Lowercase text before tokenizing (uncased model).")
    strip_accents: bool = doc(True, "Strip accents when normalizing.")
    min_frequency: int = doc(
        2, "Minimum count of a pair/token to enter the vocabulary (WordPiece and BPE; unigram takes only the default)."
    )
    shards: str = doc("", "Shard directory; empty means <run_dir>/shards, built from the corpus if missing.")
    num_workers: int = doc(2, "Processes that tokenize the corpus in parallel.")
    docs_per_shard: int = doc(2000, "Documents per shard file.")
    on_bad_document: str = doc(
        "skip", "What to do with a document that cannot be used (invalid UTF-8, empty): skip (counted) or error."
    )
    max_seq_len: int = doc(128, "Tokens per training sequence, [CLS] and [SEP] included.")
    loader_workers: int = doc(
        -1,
        "DataLoader worker processes per rank: -1 = chosen from the cores present (up to 4 "
        "per GPU rank, none on a CPU-only machine, where the training process uses every "
        "core); 0 = in the training process.",
    )
    tokenizer_sample_docs: int = doc(
        0, "Train the tokenizer on about this many documents, spread over all corpus files (0 = all)."
    )
    max_document_bytes: int = doc(
        16777216,
        "Longer documents (e.g. a 100 MB line) are skipped as too_long, or fail "
        "with file:line under on_bad_document=error.",
    )
    packing: str = doc(
        "full_sentences",
        "Token-level samples: full_sentences (packed across documents, RoBERTa) or "
        "doc_bounded (never cross a document).",
    )
    sources: list[SourceConfig] = doc(
        factory=list,
        text="Corpora mixed by weight, [{name, corpus, weight}], instead of data.corpus (one tokenizer over all; "
        "training samples drawn from each in proportion to its weight, a source repeated when exhausted).",
    )

    def source_list(self) -> list[SourceConfig]:
        """The corpora a run reads: data.sources, or data.corpus as one source named "corpus" of weight 1."""
        return list(self.sources) or [SourceConfig("corpus", list(self.corpus), 1.0)]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = doc(0, "Vocabulary size; 0 means take it from the tokenizer.")
    hidden_size: int = doc(256, "Width of the encoder.")
    num_layers: int = doc(4, "Number of Transformer layers.")
    num_heads: int = doc(4, "Attention heads per layer.")
    intermediate_size: int = doc(1024, "Width of the feed-forward block.")
    max_position_embeddings: int = doc(512, "Learned absolute positions available.")
    type_vocab_size: int = doc(2, "Token type (segment) ids available.")
    hidden_dropout: float = doc(0.1, "Dropout on embeddings and sublayer outputs.")
    attention_dropout: float = doc(0.1, "Dropout on attention probabilities.")
    layer_norm_eps: float = doc(1e-12, "LayerNorm epsilon.")
    initializer_range: float = doc(0.02, "Std of the normal initialisation of weights.")
    pad_token_id: int = doc(0, "Id of [PAD]; set from the tokenizer.")
    norm_placement: str = doc(
        "post", "post (BERT: LayerNorm after each residual) or pre (LayerNorm before each sublayer, plus a final one)."
    )
    position_embedding: str = doc(
        "learned", "learned absolute positions (BERT) or rope (rotary, applied to queries and keys)."
    )
    rope_theta: float = doc(10000.0, "RoPE base (of the global layers, with local_attention).")
    local_attention: int = doc(
        0,
        "Sliding-window attention, as ModernBERT's local_attention: in a local layer a token sees the keys within "
        "local_attention / 2 positions on each side (an even number; ModernBERT: 128). 0 = every layer global.",
    )
    global_every: int = doc(
        3, "With local_attention: layer i is global when i % global_every == 0, the others local (ModernBERT: 3)."
    )
    local_rope_theta: float = doc(
        10000.0, "RoPE base of the local layers (ModernBERT: 10000, its global layers' rope_theta 160000)."
    )
    activation: str = doc(
        "gelu", "Feed-forward activation: gelu, or geglu (gated; the input projection is twice as wide)."
    )
    use_bias: bool = doc(True, "Biases in linear layers and LayerNorms (ModernBERT drops them).")
    embedding_size: int = doc(
        0,
        "ALBERT's factorized embeddings: token embeddings of this width projected up to hidden_size (0 = hidden_size).",
    )
    share_layers: bool = doc(
        False, "ALBERT's cross-layer parameter sharing: one set of layer weights applied num_layers times."
    )
    unpadded: bool = doc(
        False,
        "Run the encoder on the real tokens only (variable-length packing with cumulative "
        "lengths), no compute on padding.",
    )
    compile: bool | None = doc(
        None,
        "torch.compile the embeddings, the encoder's layers and each objective's head and loss: true, false, or null "
        "(the default): on where the run trains on a CUDA GPU (but not under ZeRO-3), off on a CPU (where compiling "
        "costs more than it saves on short runs).",
    )
    compile_mode: str = doc(
        "default",
        "torch.compile's mode where the model is compiled: default, reduce-overhead (CUDA graphs: fewer launches, for "
        "small models), max-autotune or max-autotune-no-cudagraphs. Graphs whose sizes change every batch (the heads, "
        "sized by the masked tokens; an unpadded encoder), and every graph of a run that accumulates micro-batches, "
        "run without CUDA graphs.",
    )
    activation_checkpointing: bool = doc(
        False, "Recompute each layer's activations in the backward pass to save memory."
    )
    init_from: str = doc(
        "", "A local HuggingFace checkpoint directory (bert, roberta, albert, electra, modernbert) to start from."
    )


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = doc(32, "Sequences per device per forward pass.")
    grad_accum_steps: int = doc(1, "Micro-batches accumulated per optimizer step.")
    loss_normalization: str = doc(
        "step",
        "step: each loss term is a mean over all its targets in the optimizer step "
        "(every micro-batch, every rank), so splitting a batch over accumulation or "
        "ranks changes nothing; micro_batch: a mean per micro-batch, then averaged "
        "(original BERT; a micro-batch with few masked tokens weighs as much as one "
        "with many).",
    )
    max_steps: int = doc(1000, "Optimizer steps to train for.")
    max_minutes: float = doc(0.0, "Stop (with a checkpoint) after this much wall-clock time; 0 = no limit.")
    exit_after_steps: int = doc(
        0, "Stop this invocation after this many steps, with a checkpoint (for time-limited jobs); 0 = off."
    )
    optimizer: str = doc("adamw", "adamw, or lamb (layer-wise trust ratio, for large batches).")
    lr: float = doc(5e-4, "Peak learning rate.")
    warmup_steps: int = doc(100, "Linear warm-up steps, then the lr_schedule.")
    lr_schedule: str = doc(
        "linear",
        "After the warm-up: linear (from the peak to 0 at max_steps: transformers' get_linear_schedule_with_warmup), "
        "bert (BERT's reference code: 1 - step/max_steps, the decay counted from step 0, so 10% below the peak after "
        "a 10% warm-up), cosine (to min_lr_ratio), wsd (warmup-stable-decay: the peak, then a decay over the last "
        "decay_steps) or inverse_sqrt.",
    )
    decay_steps: int = doc(0, "wsd: steps of the final decay; 0 = 10% of max_steps.")
    decay_shape: str = doc("linear", "wsd: shape of the final decay: linear, cosine or 1-sqrt.")
    min_lr_ratio: float = doc(0.0, "cosine, wsd: the learning rate they end at, as a fraction of lr.")
    ema_decay: float = doc(
        0.0,
        "Keep an exponential moving average of the weights with this decay (e.g. 0.999), exported instead "
        "of them; 0 = off.",
    )
    ema_warmup: bool = doc(
        True,
        "Warm the EMA up: the decay at step t is min(ema_decay, (1 + t) / (10 + t)), so the initial weights fade "
        "within the run (TensorFlow's ExponentialMovingAverage with num_updates).",
    )
    ema_on_cpu: bool = doc(False, "Keep the EMA weights in CPU memory (large models) rather than on the device.")
    weight_decay: float = doc(0.01, "AdamW weight decay (not applied to biases and LayerNorm weights).")
    adam_beta1: float = doc(0.9, "AdamW beta1.")
    adam_beta2: float = doc(0.98, "AdamW beta2.")
    adam_eps: float = doc(1e-6, "AdamW epsilon.")
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this (0 = off).")
    precision: str = doc(
        "auto",
        "auto (bf16 where the machine supports it), bf16, fp16, fp32, or fp8: bf16 with the encoder layers' matrix "
        "products in float8 (dynamic per-tensor scales; GPUs of compute capability 8.9+, e.g. H100).",
    )
    zero_stage: int = doc(0, "DeepSpeed ZeRO stage (0-3).")
    nan_policy: str = doc(
        "skip", "A step with a NaN/inf loss or gradient: skip (count it; stop after max_skipped_steps) or stop at once."
    )
    max_skipped_steps: int = doc(20, "With nan_policy=skip, stop when this many steps have been skipped in a row.")
    collective_timeout_minutes: float = doc(
        30.0,
        "Longest wait of any collective (all-reduce, barrier) before the rank gives up with an error: a host lost "
        "without closing its connections ends the run after this long instead of hanging.",
    )
    seed: int = doc(1234, "Seed of initialisation, sample order and masking.")
    peak_tflops: float = doc(
        0.0, "Peak TFLOP/s of one device for MFU; 0 = look the device up in a table (unknown on CPUs)."
    )
    log_every: int = doc(10, "Steps between metric lines in metrics.jsonl.")
    save_every: int = doc(
        200, "Steps between checkpoints (0 = none in between; a final one, and one when stopped, are always written)."
    )
    keep_checkpoints: int = doc(2, "How many recent checkpoints to keep.")
    allow_changes: list[str] = doc(
        factory=list,
        text="Settings a resume may change although the run fixed them "
        "(tokenizer, data, model, objectives, global batch, seed, ...), "
        "by key or prefix, e.g. [model.num_heads] or [objectives]: for "
        "users who mean it.",
    )

    def wsd_decay_steps(self) -> int:
        """wsd: the length of the final decay (decay_steps, or 10% of max_steps when 0)."""
        return self.decay_steps or max(1, round(0.1 * self.max_steps))

    def global_batch(self, world: int) -> int:
        """Sequences per optimizer step over `world` data-parallel ranks: the one place this product is formed
        (tests/test_architecture.py holds every other to it)."""
        return self.micro_batch_size * self.grad_accum_steps * world


@dataclass(frozen=True)
class PhaseConfig:
    """One phase of `schedule.phases`: from its start step until the next phase's, what it names holds (0 = as the
    phase before it; the first phase's defaults are data.max_seq_len, train.micro_batch_size, model.rope_theta)."""

    start: int = doc(0, "First step of the phase; phases in increasing order, each before train.max_steps.")
    max_seq_len: int = doc(0, "Tokens per sequence in this phase (a sample stream of its own); 0 = as before.")
    micro_batch_size: int = doc(
        0,
        "Sequences per device per forward pass in this phase (accumulation makes up the global batch); 0 = as before.",
    )
    rope_theta: float = doc(0.0, "RoPE base of the global layers in this phase (context extension); 0 = as before.")


GLOBAL_BATCH = "train.global_batch"
"""The `schedule.values` key of the global batch (the others are objectives' rates)."""
UNITS = ("sequences", "tokens")
SHAPES = ("linear", "steps")


@dataclass(frozen=True)
class ScheduledValue:
    """One entry of `schedule.values`: a setting as a function of the step."""

    key: str = doc(
        "",
        "What it schedules: an objective's rate (objectives.mlm.mask_prob, objectives.span.mask_prob, "
        "objectives.rtd.mask_prob) or train.global_batch.",
    )
    points: list[tuple[int, float]] = doc(
        factory=list,
        text="[step, value] pairs, steps increasing; before the first point its value, after the last the last.",
    )
    shape: str = doc(
        "linear", "linear (interpolated between points: a ramp) or steps (each value holds until the next)."
    )
    unit: str = doc(
        "sequences", "train.global_batch: its values count sequences, or tokens (divided by the phase's length)."
    )
    multiple_of: int = doc(
        0,
        "train.global_batch: each batch is rounded down to a multiple of this (Megatron's ramp increment), which "
        "every phase's micro-batch x ranks must divide; 0 = of micro-batch x ranks, so that the batches of a ramp "
        "depend on the number of ranks.",
    )


@dataclass(frozen=True)
class ScheduleConfig:
    phases: list[PhaseConfig] = doc(
        factory=list,
        text="Piecewise-constant phases [{start, max_seq_len, micro_batch_size, rope_theta}], e.g. BERT's 128 then "
        "512 tokens; a first phase starting after step 0 follows the run's own settings until then.",
    )
    values: list[ScheduledValue] = doc(
        factory=list,
        text="Settings by step [{key, points, shape, unit}]: masking rates and the global batch, as ramps or steps.",
    )

    @property
    def active(self) -> bool:
        return bool(self.phases or self.values)


@dataclass(frozen=True)
class WandbConfig:
    mode: str = doc("offline", "offline (default), online or disabled.")
    project: str = doc("bert-pretrain", "wandb project name.")


@dataclass(frozen=True)
class TensorBoardConfig:
    enabled: bool = doc(
        False,
        "Also write metrics.jsonl's scalars as TensorBoard event files in <run_dir>/tensorboard "
        "(needs the tensorboard package).",
    )


@dataclass(frozen=True)
class RunConfig:
    name: str = doc("run", "Run name; the run directory is <output_dir>/<name>.")
    output_dir: str = doc("runs", "Parent directory of run directories.")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objectives: dict[str, Any] = doc(
        factory=lambda: {"mlm": {}}, text="Objectives and their options, by registered name, each with a weight."
    )
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    export_dir: str = doc("", "Where `pretrain run` exports the HF model; empty means <run_dir>/hf.")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def tokenizer_dir(self) -> Path:
        return Path(self.data.tokenizer) if self.data.tokenizer else self.run_dir / "tokenizer"

    @property
    def shards_dir(self) -> Path:
        return Path(self.data.shards) if self.data.shards else self.run_dir / "shards"

    @property
    def hf_dir(self) -> Path:
        return Path(self.export_dir) if self.export_dir else self.run_dir / "hf"


# A preset that names its objectives means exactly those, not those plus its base's.
REPLACED_BY_PRESET = ("objectives",)


def load_yaml(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a run config preset: `load_yaml_with_base`, where a preset that names objectives replaces its base's."""
    return load_yaml_with_base(path, REPLACED_BY_PRESET, _chain)


def build_config(data: dict) -> RunConfig:
    """A typed, checked RunConfig from a dict. Its objectives are still the mapping given: the run's config is
    finished, once, by `pretrain.train.setup.resolve_config` (objectives typed, `model.init_from` applied)."""
    cfg = from_dict(RunConfig, data)
    _check_values(cfg)
    return cfg


def check_config(cfg: RunConfig) -> None:
    """Every check `build_config` makes, for a config changed in code (an ablation arm given its budget's steps)."""
    _check_values(cfg)


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


def _check_values(cfg: RunConfig) -> None:
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
    for key in ("save_every", "keep_checkpoints", "seed"):
        if getattr(cfg.train, key) < 0:
            raise ConfigError(f"train.{key}: must be >= 0, got {getattr(cfg.train, key)}")
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
    for key in ("num_layers", "num_heads", "hidden_size", "intermediate_size"):
        if getattr(cfg.model, key) < 1:
            raise ConfigError(f"model.{key}: must be >= 1, got {getattr(cfg.model, key)}")
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


def read_config(name_or_path: str | None, overrides: list[str] | None = None) -> RunConfig:
    """A preset or file with dotted overrides, typed and checked (not yet resolved: see `build_config`)."""
    path = resolve_preset(name_or_path) if name_or_path else None
    data = load_yaml(path) if path else {}
    _refuse_objectives_added_by_an_option(data, overrides or [])
    try:
        cfg = build_config(apply_overrides(data, overrides or []))
    except ConfigError as err:
        if path is None or path.parent.resolve() == CONFIG_DIR.resolve() or not _written_in(path, err, overrides):
            raise  # a preset's name says where already; a value from an override or a base file is not this file's
        raise ConfigError(f"{path}: {err}") from None
    # Here, not in build_config: a checkpoint's config is built too, and exporting it must not need the package
    if cfg.tensorboard.enabled:
        require_tensorboard()
    _check_options_apply(cfg.train)  # (a checkpoint's config that has one still loads: it trained so)
    _check_data_stages(cfg.data)
    return cfg


def _written_in(path: Path, err: ConfigError, overrides: list[str] | None) -> bool:
    """Whether the setting `err` names is written in the file `path` itself (not only in its base, nor set by an
    override): the file to name in the message."""
    import re

    import yaml

    found = re.search(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)", str(err))
    if found is None:
        return False
    key = found.group(1)
    if any(
        key == o.partition("=")[0].strip() or key.startswith(o.partition("=")[0].strip() + ".") for o in overrides or []
    ):
        return False
    try:
        node = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _refuse_objectives_added_by_an_option(data: dict, overrides: list[str]) -> None:
    """`objectives.sop.swap_prob=0.3` on a config without sop added sop at weight 1 (and switched the run to sentence
    pairs) with no word: an objective is added by name (objectives.sop.weight=1, objectives.sop={...}) or not at all."""
    trained = set(data.get("objectives") or {})
    keys = [item.partition("=")[0].strip() for item in overrides]
    if "objectives" in keys:  # the whole mapping given: what it names is what trains
        return
    named = {k.split(".")[1] for k in keys if k.count(".") == 1 and k.startswith("objectives.")}
    named |= {
        k.split(".")[1] for k in keys if k.count(".") == 2 and k.startswith("objectives.") and k.endswith(".weight")
    }
    for item, key in zip(overrides, keys):
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "objectives" and parts[1] not in trained | named:
            raise ConfigError(
                f"{item.strip()}: this config does not train {parts[1]} ({', '.join(sorted(trained)) or 'none'}); to "
                f"add it, name it: objectives.{parts[1]}.weight=1 (or objectives.{parts[1]}={{{parts[2]}: ...}})"
            )


def _check_data_stages(d: DataConfig) -> None:
    """Settings of the stages that build data, checked for a new config only: a checkpoint's config of a run whose
    shards an older version built with docs_per_shard=0 (read then as 1) still exports and resumes."""
    for key in ("vocab_size", "docs_per_shard"):
        if getattr(d, key) < 1:
            raise ConfigError(f"data.{key}: must be >= 1, got {getattr(d, key)}")


def _check_options_apply(t: TrainConfig) -> None:
    """Options the run does not use are refused rather than ignored: a learning-rate schedule's (a preset's wsd
    decay under a cosine override, a floor the linear schedule never reaches), where the EMA is kept without one."""
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


def require_tensorboard() -> None:
    """tensorboard.enabled needs the tensorboard package (torch.utils.tensorboard writes through it): checked when the
    config is read, before a stage writes anything, and again by the metrics logger before training."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "tensorboard.enabled=true needs the 'tensorboard' package, which is not installed: "
            "pip install tensorboard (or set tensorboard.enabled=false)"
        ) from None


def save_config(cfg: RunConfig, path: os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


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
