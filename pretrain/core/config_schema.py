"""The run's schema: `RunConfig` and its sections, typed and documented (each field's `doc` is its help text).

Read and checked by `pretrain.core.config` (which the rest of the project imports these from); the checks of the
values are `pretrain.core.config_checks`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.core.parsing import doc

# What a corpus may be, as the readers read it (data_pipeline/readers.py), for the help texts that name it
CORPUS_FORMATS = "JSON Lines, plain text, Parquet, Arrow or datasets save_to_disk; .gz/.zst read as they are"


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
        text=f"Corpus files, directories or globs ({CORPUS_FORMATS}).",
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
        "skip",
        "What to do with a bad document (invalid UTF-8 or JSON, no text in data.text_field, over max_document_bytes): "
        "skip (counted) or error (naming file and line). Empty documents are always skipped and counted.",
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
    optimizer: str = doc("adamw", "adamw, or lamb (layer-wise trust ratio, for large batches; at zero_stage 0).")
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
        "of them; 0 = off. Not with train.zero_stage=3.",
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
    keep_checkpoints: int = doc(2, "How many recent checkpoints to keep (older ones are removed); 0 keeps every one.")
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
