"""What a run is built from: its config, finished once (`resolve_config`); what this launch derives from it, decided
once (`ResolvedRun`); its model (the encoder, the objectives' heads, `model.init_from` weights) and its sample source,
from that config and the tokenizer; and a checkpoint loaded back as a model."""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from data_pipeline.mixing import MixedSamples
from data_pipeline.samples import build_samples, builder_kind
from data_pipeline.shards import ShardSet
from data_pipeline.tokenizer import load_tokenizer, special_tokens
from objectives import (
    build_objectives,
    check_scheduled_options,
    pair_objectives,
    sample_builder_for,
    validate_objectives,
)
from pretrain.core.config import RunConfig, build_config, load_yaml, read_config
from pretrain.core.errors import ConfigError, DataError, UserError
from pretrain.core.schedule import config_at
from pretrain.core.tokens import SpecialTokens
from pretrain.hf.init_from import InitFromWarning, architecture_fields, load_init_from, resolve_init_from
from pretrain.model.fp8 import float8_problem
from pretrain.model.pretraining import PretrainingModel
from pretrain.train import checkpoint as ckpt
from pretrain.train.distributed import local_device, run_precision
from pretrain.train.ema import EMA_FILE
from pretrain.train.state import TrainState


def resolve_config(cfg: RunConfig, apply_init_from: bool = True) -> RunConfig:
    """The run's config, finished once and frozen, then passed down as it is: each objective's options typed and
    checked, the mix checked (`objectives.validate_objectives`), and with `model.init_from` the checkpoint's
    architecture and tokenizer (`hf.init_from.resolve_init_from`). `apply_init_from=False` for a config a run
    saved, which has them already (and whose init_from directory may be gone). With data.sources, data.corpus
    (the built-in demo corpus a preset left there) is emptied: the run reads the sources only."""
    cfg = replace(cfg, objectives=validate_objectives(cfg.objectives))
    check_scheduled_options(cfg.schedule.values, cfg.objectives)
    if cfg.data.sources and cfg.data.corpus:
        cfg = replace(cfg, data=replace(cfg.data, corpus=[]))
    if apply_init_from:
        cfg = _resumed_without_init_dir(cfg) or resolve_init_from(cfg)
    _check_token_types(cfg)
    return cfg


def _check_token_types(cfg: RunConfig) -> None:
    """Segment pairs type their second segment 1: a model with one token type (RoBERTa's, imported) failed at its
    first forward with a bare IndexError, after the tokenizer and shards were built."""
    pairs = pair_objectives(cfg.objectives)
    if pairs and cfg.model.type_vocab_size < 2:
        raise ConfigError(
            f"objectives {', '.join(pairs)} build segment pairs, typed 0 and 1, but model.type_vocab_size is "
            f"{cfg.model.type_vocab_size}"
            + (
                f" (the checkpoint's, model.init_from {cfg.model.init_from}: it has no second token type)"
                if cfg.model.init_from
                else ""
            )
        )


def _resumed_without_init_dir(cfg: RunConfig) -> RunConfig | None:
    """A run started from `model.init_from: DIR` and resumed after DIR went (a scratch directory purged): its latest
    checkpoint holds the weights, the architecture its config.yaml was settled with, and the tokenizer it trained
    with (copied to <run_dir>/tokenizer, `_run_home_of`), so those are used (and said) where DIR's would have been.
    None where DIR is there or nothing resumes."""
    init = Path(cfg.model.init_from) if cfg.model.init_from else None
    if init is None or (init / "config.json").is_file() or not (cfg.run_dir / "checkpoints").is_dir():
        return None
    try:
        resumed = ckpt.latest_checkpoint(cfg.run_dir / "checkpoints")
    except UserError:
        return None  # the resume itself says what is wrong
    if resumed is None or not (resumed / "tokenizer" / "tokenizer.json").is_file():
        return None
    saved = config_from_dict(load_yaml(resumed / "config.yaml"), apply_init_from=False)
    model = replace(cfg.model, **architecture_fields(saved.model))
    reads_init = not cfg.data.tokenizer or Path(cfg.data.tokenizer) == init
    data = cfg.data
    if reads_init:
        data = replace(data, tokenizer=str(_run_home_of(resumed / "tokenizer", cfg.run_dir)))
    if os.environ.get("RANK", "0") == "0":  # every rank resolves the config; the note is said once
        print(
            f"[pretrain] model.init_from {init} is gone: resuming from {resumed}, with the architecture"
            + (" and tokenizer" if reads_init else "")
            + " it was trained with (the weights are the checkpoint's)",
            file=sys.stderr,
            flush=True,
        )
    return replace(cfg, model=model, data=data)


def _run_home_of(tokenizer: Path, run_dir: Path) -> Path:
    """<run_dir>/tokenizer, a copy of a checkpoint's `tokenizer` made once (rotation deletes checkpoints; the run and
    its config.yaml go on reading their tokenizer after that), for a run whose own tokenizer directory is gone. Made
    beside and renamed into place, so that ranks resolving the config at once each find it whole."""
    import shutil

    from data_pipeline.tokenizer import tokenizer_hash

    home = run_dir / "tokenizer"
    if not home.exists():
        tmp = run_dir / f".tokenizer.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(tokenizer, tmp)
        try:
            os.replace(tmp, home)
        except OSError:  # another rank's copy is in place: the same files
            shutil.rmtree(tmp, ignore_errors=True)
    if tokenizer_hash(home) != tokenizer_hash(tokenizer):
        raise UserError(
            f"{home} is not the tokenizer {tokenizer} holds, which this run trained with: move it away, and the same "
            "command puts that one there"
        )
    return home


@dataclass(frozen=True)
class ResolvedRun:
    """What a run derives from its resolved config, the tokenizer and this launch, decided once when it starts
    (`resolve_run`) and passed down as it is: engine, loader, fingerprint, metrics and `--dry-run` read it here and
    never work it out again."""

    cfg: RunConfig
    rank: int
    world: int  # data-parallel ranks
    precision: str  # the precision mode (`distributed.run_precision`): fp32, bf16-autocast, bf16 or fp16
    global_batch: int  # sequences per optimizer step over all ranks (`TrainConfig.global_batch`)
    tokens: SpecialTokens  # the tokenizer's special ids; the pad id is tokens.pad

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def checkpoints_dir(self) -> Path:
        return self.cfg.run_dir / "checkpoints"


def resolve_run(cfg: RunConfig, tokens: SpecialTokens, rank: int = 0, world: int = 1) -> ResolvedRun:
    return ResolvedRun(cfg, rank, world, run_precision(cfg.train), cfg.train.global_batch(world), tokens)


def load_config(name_or_path: str | None, overrides: list[str] | None = None) -> RunConfig:
    """A preset or config file with dotted overrides, resolved (`resolve_config`)."""
    return resolve_config(read_config(name_or_path, overrides))


def config_from_dict(data: dict, apply_init_from: bool = True) -> RunConfig:
    return resolve_config(build_config(data), apply_init_from)


def model_config_for(cfg: RunConfig, tokens: SpecialTokens):
    """The model config with vocabulary and padding id taken from the tokenizer, which must fit it: no more tokens
    than model.vocab_size when that is set, and the padding id of a `model.init_from` checkpoint."""
    if 0 < cfg.model.vocab_size < tokens.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokens.vocab_size} tokens, {cfg.tokenizer_dir}): leave it 0 to take the tokenizer's"
            + (" (use the checkpoint's tokenizer)" if cfg.model.init_from else "")
        )
    if cfg.model.init_from and cfg.model.pad_token_id != tokens.pad:
        raise ConfigError(
            f"model.init_from {cfg.model.init_from}: the tokenizer's pad id is {tokens.pad}, the "
            f"checkpoint's pad_token_id {cfg.model.pad_token_id}: use the checkpoint's tokenizer"
        )
    return replace(cfg.model, vocab_size=cfg.model.vocab_size or tokens.vocab_size, pad_token_id=tokens.pad)


def build_model(
    cfg: RunConfig, tokens: SpecialTokens, load_init_weights: bool = True, seed: bool = True
) -> PretrainingModel:
    """The model of a resolved run config. With `model.init_from: DIR` (a HF checkpoint directory) and
    `load_init_weights`, its weights come from DIR (heads the checkpoint lacks stay freshly initialised, with a
    warning). Without them (loading one of our checkpoints, which replaces them anyway) DIR may be gone. `seed`:
    initialise from train.seed, which reseeds every generator, CUDA's included; off for a throwaway model built
    while a run trains (its values unused), which must leave the run's random streams alone."""
    if seed:
        torch.manual_seed(cfg.train.seed)
    model = PretrainingModel(model_config_for(cfg, tokens), build_objectives(cfg.objectives, tokens))
    if cfg.model.init_from and load_init_weights:
        _check_vocabulary(cfg.tokenizer_dir, Path(cfg.model.init_from))
        load_init_from(model, cfg.model.init_from)
    return model


def _check_vocabulary(tokenizer_dir: Path, init_dir: Path) -> None:
    """A run's own tokenizer beside a checkpoint that has one: the same size and pad id passed, and every embedding
    row then belonged to another token where the two number their tokens otherwise. Said, with how many differ."""
    if not (init_dir / "tokenizer.json").is_file() or Path(tokenizer_dir).resolve() == init_dir.resolve():
        return
    ours, theirs = load_tokenizer(tokenizer_dir).get_vocab(), load_tokenizer(init_dir).get_vocab()
    moved = sorted((i, t) for t, i in ours.items() if theirs.get(t) != i)
    if moved:
        examples = ", ".join(f"{t!r} (id {i} here, {theirs.get(t, 'none')} there)" for i, t in moved[:3])
        warnings.warn(
            f"model.init_from {init_dir}: {len(moved)} of the {len(ours)} tokens of this run's tokenizer "
            f"({tokenizer_dir}) have another id in the checkpoint's tokenizer, e.g. {examples}: their embeddings are "
            "those the checkpoint learned for other tokens. Leave data.tokenizer unset to use the checkpoint's",
            InitFromWarning,
            stacklevel=3,
        )


def compile_for_this_machine(cfg: RunConfig, world: int = 1) -> RunConfig:
    """The config a training process builds its model from: model.compile unset (null) is on where CUDA is and off
    on a CPU, and under ZeRO-3 (whose parameters are gathered by hooks around each module, which compiled layers
    would trace through). Only training decides it (evaluation and export run eager unless the config says
    otherwise). Compiling by default must not stop a run that eager would train: then a graph torch fails to compile
    runs eager, with torch's warning (`suppress_errors`); `model.compile=true` asked for it, and its errors stop it.

    A mode that records CUDA graphs (reduce-overhead, max-autotune) runs without them where a step accumulates
    micro-batches (on `world` ranks): the backward graph's replay writes each gradient into the memory the previous
    micro-batch's gradient is held in, so accumulating would lose (or fail on) every micro-batch but the last."""
    from pretrain.core.schedule import Schedule
    from pretrain.model.compiling import without_cuda_graphs

    model = cfg.model
    if model.compile is None:
        on = torch.cuda.is_available() and cfg.train.zero_stage != 3
        if on:
            import torch._dynamo as dynamo

            dynamo.config.suppress_errors = True
        model = replace(model, compile=on)
    mode = without_cuda_graphs(model.compile_mode)
    if model.compile and mode != model.compile_mode:
        why = None
        if not torch.cuda.is_available():  # torch runs it without them there, unsaid
            why = "CUDA graphs need a GPU"
        elif Schedule.of(cfg).accumulates(world):
            why = "its CUDA graphs would overwrite the gradients a step accumulates over micro-batches"
        if why:
            print(f"[pretrain] model.compile_mode={model.compile_mode} runs as {mode}: {why}", file=sys.stderr)
            model = replace(model, compile_mode=mode)
    return cfg if model == cfg.model else replace(cfg, model=model)


def check_precision(cfg: RunConfig, precision: str) -> None:
    """train.precision=fp8 on a device without fp8 kernels, or fp16 (`precision`, resolved) where DeepSpeed has no
    fp16 (a CPU without oneDNN's fp16 kernels): a ConfigError, raised before the run writes anything, not
    DeepSpeed's traceback after it wrote config.yaml."""
    if cfg.train.precision == "fp8":
        problem = float8_problem(local_device())
        if problem:
            raise ConfigError(f"train.precision=fp8: {problem}; train with train.precision=bf16 on this machine")
    if precision == "fp16":
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise ConfigError(
                f"train.precision=fp16: DeepSpeed has no fp16 on this {get_accelerator().device_name()} device; "
                "train with train.precision=bf16 (or fp32) on this machine"
            )


def build_sample_source(cfg: RunConfig, shards: ShardSet, tokens: SpecialTokens, objectives: list):
    """The run's samples: of its shards, or for weighted sources (shards holding a mixture) each source's own
    builder, drawn from by weight (`data_pipeline.mixing.MixedSamples`)."""
    kind = builder_kind(sample_builder_for(objectives), cfg.data.packing)
    d, seed = cfg.data, cfg.train.seed
    if not shards.is_mixture:
        if d.sources:
            raise ConfigError(
                f"data.sources names {len(d.sources)} source(s), but {shards.dir} holds the shards of one corpus: "
                "build the sources' shards with `pretrain run` (or point data.shards elsewhere)"
            )
        return _nonempty(build_samples(kind, shards, d.max_seq_len, tokens, seed), "the corpus", shards, d)
    parts = shards.sources()
    # The shards' manifest records the weights (the run's fingerprint hashes them): the config must agree.
    wanted = [(s.name, float(s.weight)) for s in d.sources]
    found = [(name, weight) for name, weight, _ in parts]
    if wanted and wanted != found:
        raise ConfigError(
            f"data.sources ({_weights(wanted)}) differ from the sources {shards.dir} was built for "
            f"({_weights(found)}): `pretrain run` rebuilds them"
        )
    builders = []
    for name, _, part in parts:
        builders.append(_nonempty(build_samples(kind, part, d.max_seq_len, tokens, seed), f"source '{name}'", part, d))
    return MixedSamples(builders, [p[0] for p in parts], [p[1] for p in parts], seed)


def _nonempty(builder, what: str, shards: ShardSet, d):
    """`builder`, or a DataError where its shards give no sample at all (a corpus shorter than one sequence)."""
    if not len(builder):
        from data_pipeline.pairs import SegmentPairs

        if isinstance(builder, SegmentPairs):  # segment pairs come from documents of two sentences or more
            raise DataError(
                f"{what} ({shards.dir}, {shards.num_docs} documents) has no document of two sentences or more: nsp "
                f"and sop pair a segment with the text after it (with data.text_documents=lines each line is a "
                f"document; a corpus of one sentence per document trains mlm or span, not these)"
            )
        raise DataError(
            f"{what} ({shards.dir}, {shards.num_tokens} tokens) gives no sample of data.max_seq_len={d.max_seq_len} "
            f"with data.packing={d.packing}: give it more text"
        )
    return builder


def _weights(sources: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name}={weight:g}" for name, weight in sources)


def checkpoint_config(path: Path) -> tuple[RunConfig, TrainState]:
    """The config of the checkpoint directory `path` (resolved) as its last step trained: under a schedule, that
    step's phase settings (data.max_seq_len, micro-batch, model.rope_theta) in place of the run's own, which are
    phase 0's; and its trainer state."""
    cfg = config_from_dict(load_yaml(path / "config.yaml"), apply_init_from=False)
    state = TrainState.load(path)
    return config_at(cfg, max(state.step - 1, 0)), state


def load_checkpoint_model(path: Path, ema: bool = True):
    """(config, model, special tokens, tokenizer dir, trainer state) of a checkpoint, fp32 on CPU. Read under
    `reading_checkpoints`, so that a trainer saving into the same run meanwhile does not rotate it away; a caller
    that goes on reading the returned tokenizer dir (an export copies it) holds that lock itself, around this.

    Where the run kept a weight EMA (train.ema_decay) its weights are the model's, unless `ema=False`; the returned
    state then says so in `weights`."""
    with ckpt.reading_checkpoints(path):
        path = ckpt.resolve_checkpoint(path)
        cfg, state = checkpoint_config(path)
        tokenizer_dir = path / "tokenizer" if (path / "tokenizer").is_dir() else cfg.tokenizer_dir
        tokens = special_tokens(load_tokenizer(tokenizer_dir))
        model = build_model(cfg, tokens, load_init_weights=False)  # the checkpoint's weights replace them anyway
        missing, unexpected = model.load_state_dict(ckpt.load_module_state(path), strict=False)
        if missing or unexpected:
            raise UserError(
                f"checkpoint {path} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        state = state.to_dict()  # a dict: export cards and summaries read it as one
        averaged = ckpt.load_ema(path) if ema else None
        if averaged is not None:
            with torch.no_grad():
                params = dict(model.named_parameters())
                for name, value in averaged.items():
                    params[name].copy_(value)
            state["weights"] = f"an exponential moving average of the training weights (decay {cfg.train.ema_decay:g})"
            state["ema_weights"] = True  # the run's logged losses are not theirs (`export_card`)
        elif not ema and (path / EMA_FILE).is_file():  # its card must not pass these for the EMA its config names
            state["weights"] = (
                f"the raw training weights, not the exponential moving average (decay {cfg.train.ema_decay:g}) the "
                "run also kept"
            )
    return cfg, model.eval(), tokens, tokenizer_dir, state
