"""`pretrain eval`: masked-token accuracy, loss and perplexity on held-out shards.

The target is a run or checkpoint directory (our model, its tied token-prediction head) or an exported
HuggingFace directory (`AutoModelForMaskedLM`; for an ELECTRA export, its generator). Masking is BERT's 15%
80/10/10, drawn from a fixed seed per sample, so two models evaluated on the same shards see the very same
masks and their numbers are comparable. Perplexity is exp(mean cross-entropy over masked tokens), i.e. a
masked-LM pseudo-perplexity, not a left-to-right one.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from pretrain.core.config import DataConfig
from pretrain.core.errors import UserError
from pretrain.core.tokens import IGNORE_INDEX
from pretrain.train.distributed import local_device

EVAL_SEED = 20240607  # fixed, independent of any run's seed: every model is scored on the same masks
DEFAULT_SEQ_LEN = 128  # without --max-seq-len: this, or the model's positions where it has fewer


def _is_hf_dir(path: Path) -> bool:
    """A HuggingFace model directory, not a run or checkpoint of ours (their config.yaml says so): a transformers
    Trainer's checkpoint-N/, with a trainer_state.json of its own, was taken for ours and refused."""
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def load_target(target: Path, ema: bool = True) -> tuple[Callable, Path, str, int | None]:
    """(logits_fn(input_ids, token_type_ids, attention_mask, selected) -> [M, V], tokenizer dir, description, the
    longest sequence the model takes, or None where positions have no table (RoPE)).

    logits_fn scores only the M positions where `selected` (bool [B, L]) is True, in row-major order: the decoder
    runs on those rows alone, so a 250k-word vocabulary costs [M, V] (15% of the tokens), not [B, L, V] (4 GB in
    fp32 for 32 x 128 tokens)."""
    target = Path(target)
    if not target.exists():
        raise UserError(f"'{target}' not found: expected a run, checkpoint or exported HuggingFace directory")
    if _is_hf_dir(target):
        from transformers import AutoConfig, AutoModelForMaskedLM

        from data_pipeline.tokenizer import load_tokenizer
        from pretrain.hf.export import check_model_dir, check_tokenizer

        config = json.loads((check_model_dir(target) / "config.json").read_text())  # checked: JSON, an object
        model_dir = target
        # An ELECTRA export keeps the discriminator at the top and the masked-LM generator below it
        if config.get("model_type") == "electra" and (target / "generator" / "config.json").is_file():
            model_dir = check_model_dir(target / "generator")  # the top one is checked above
        check_tokenizer(target, len(load_tokenizer(target)), config.get("vocab_size"))  # past it: an IndexError
        try:
            AutoConfig.from_pretrained(str(model_dir))
            model = AutoModelForMaskedLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().to(local_device())
        except (OSError, ValueError) as err:
            raise UserError(f"{model_dir}: cannot load a masked-LM model with transformers ({err})") from None

        # Token types only where the model has them (ModernBERT has none: its forward would swallow them in **kwargs)
        takes_types = "token_type_ids" in inspect.signature(model.forward).parameters

        decoder = model.get_output_embeddings()  # the head's last layer: its output is the model's logits

        def logits_fn(ids, types, mask, selected):
            extra = {"token_type_ids": types} if takes_types else {}
            rows = selected.flatten().nonzero().squeeze(1)  # [M] flat indices into [B * L]

            def only_selected(_module, args):  # [B, L, E] -> [M, E], before the decoder's [E, V] product
                if args[0].shape[:-1] != selected.shape:  # a model that unpads inside (transformers 4's ModernBERT
                    return None  # with flash-attn): its decoder scores every token, selected from below
                return (args[0].reshape(-1, args[0].shape[-1]).index_select(0, rows), *args[1:])

            hook = decoder.register_forward_pre_hook(only_selected)
            try:
                logits = model(input_ids=ids, attention_mask=mask.long(), **extra).logits
            finally:
                hook.remove()
            return logits[selected] if logits.dim() == 3 else logits  # [M, V]

        hf = model.config
        limit = hf.max_position_embeddings - (hf.pad_token_id + 1 if hf.model_type == "roberta" else 0)
        if hf.model_type == "modernbert":
            limit = None
        return logits_fn, target, f"{model_dir} ({type(model).__name__})", limit

    from pretrain.hf.export import lm_head_name
    from pretrain.train.setup import load_checkpoint_model

    cfg, model, _tokens, tokenizer_dir, state = load_checkpoint_model(target, ema=ema)
    model.to(local_device())
    try:
        head_name = lm_head_name(model)  # raises a UserError without a token-prediction head
    except UserError as err:
        raise UserError(_no_lm_head(target, cfg, err)) from None
    head = model.get_submodule(head_name)

    def logits_fn(ids, types, mask, selected):
        return head(model.encoder(ids, types, mask)[selected])  # [B, L, H] -> [M, H] -> [M, V]

    m = model.config
    limit = m.max_position_embeddings if m.position_embedding == "learned" else None
    description = f"{cfg.name} step {state['step']} ({', '.join(cfg.objectives)})"
    if state.get("weights"):  # a run that kept an EMA is scored by it, as its export is: said, as the card says it
        description += f"; the weights are {state['weights']}"
    if head_name == "heads.plm":
        # its head read the query stream, which never holds a [MASK]: these masks are not what it was trained on
        description += "; a permutation-LM head scored under BERT's masking, which it never trained on"
    return logits_fn, tokenizer_dir, description, limit


def _no_lm_head(target: Path, cfg, err: UserError) -> str:
    """Why a checkpoint cannot be scored as a masked LM, for `pretrain eval`: an ELECTRA run's export can (its
    generator/ is a masked LM), so say where it is, not what an export needs."""
    from pretrain.train.checkpoint import run_of

    if "rtd" not in cfg.objectives:
        return f"{target}: no token-prediction head to score masked tokens with ({err})"
    run = run_of(target)
    hf = run / "hf" if run is not None else None
    where = (
        f"`pretrain eval {hf}` scores its generator"
        if hf is not None and (hf / "config.json").is_file()
        else f"export it (`pretrain export {target}`), then `pretrain eval` the export: its generator is scored"
    )
    return f"{target}: an ELECTRA (rtd) checkpoint's discriminator predicts no tokens; {where}"


def check_held_out(shards: str | None, corpus: list[str] | None) -> None:
    """One source of held-out data, said before the model loads (the other would be ignored)."""
    if shards and corpus:
        raise UserError("give held-out data once: --shards DIR or --corpus FILE, not both (one would be ignored)")
    if not shards and not corpus:
        raise UserError("give held-out data: --shards DIR (built with the model's tokenizer) or --corpus FILE")


def corpus_reading(target: Path, hf_dir: bool, text_field: str | None, text_documents: str | None) -> dict[str, str]:
    """How a held-out corpus is read (build_shards' text_field, text_documents): as given, else as the run read its
    own (a run or checkpoint target: its data.text_field and data.text_documents), else the defaults."""
    data = DataConfig()
    if not hf_dir:
        from pretrain.train.checkpoint import resolve_checkpoint
        from pretrain.train.setup import checkpoint_config

        data = checkpoint_config(resolve_checkpoint(target))[0].data
    return {
        "text_field": text_field or data.text_field,
        "text_documents": text_documents or data.text_documents,
    }


def resolve_shards(
    tokenizer_dir: Path, shards: str | None, corpus: list[str] | None, cache_root: Path, reading: dict[str, str]
) -> Path:
    """Held-out shards: given, or built once from `corpus` with the model's tokenizer, read as `reading` says
    (`corpus_reading`; cached by content and reading)."""
    check_held_out(shards, corpus)
    if shards:
        return Path(shards)
    from data_pipeline.readers import expand_inputs
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import tokenizer_hash

    files = expand_inputs(corpus)
    cache_dir(cache_root)
    # the reading is in the key only where it is not the default, so caches built before it was keep their names
    default = DataConfig()
    said = sorted((k, v) for k, v in reading.items() if v != getattr(default, k))
    key = [sorted(map(str, files)), tokenizer_hash(tokenizer_dir), *([said] if said else [])]
    out = cache_root / f"{CACHE_PREFIX}{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]}"
    build_shards(files, tokenizer_dir, out, num_workers=0, **reading)  # a cache hit when it exists
    return out


CACHE_PREFIX = "eval-shards-"


def cache_dir(out: Path) -> Path:
    """`out` as the cache of held-out shards: absent, or holding such caches alone. Beside an exported model its parent
    is any folder of the user's: its own eval/ was written into, and a file of that name was a traceback."""
    from pretrain.core.outputs import LOCK, MARKER

    ours = (MARKER, LOCK)
    if out.exists() and (
        not out.is_dir() or any(p.name not in ours and not p.name.startswith(CACHE_PREFIX) for p in out.iterdir())
    ):
        held = "is a file" if not out.is_dir() else "holds what this tool did not write"
        raise UserError(
            f"{out} is where held-out shards built from --corpus are kept, and it {held}: it was left untouched; give "
            "--shards DIR (built with `pretrain shards`) instead"
        )
    return out


def trained_length(target: Path, limit: int | None) -> int:
    """The sequence length a run's or checkpoint's last step trained at (under a schedule, its phase's), within the
    model's positions."""
    from pretrain.train.checkpoint import resolve_checkpoint
    from pretrain.train.setup import checkpoint_config

    length = checkpoint_config(resolve_checkpoint(target))[0].data.max_seq_len
    return min(length, limit) if limit is not None else length


@torch.no_grad()
def evaluate_mlm(
    target: Path,
    shards: str | None = None,
    corpus: list[str] | None = None,
    max_samples: int = 0,
    max_seq_len: int = 0,
    batch_size: int = 32,
    mask_prob: float = 0.15,
    seed: int = EVAL_SEED,
    text_field: str | None = None,
    text_documents: str | None = None,
    raw_weights: bool = False,
) -> dict:
    """Masked-token accuracy, mean CE loss and perplexity of `target` on held-out shards. max_seq_len 0: for a run or
    checkpoint the length it trained at last, for a HuggingFace directory its positions, at most DEFAULT_SEQ_LEN (a
    longer one than the positions given is refused). text_field, text_documents: how `corpus` is
    read; None: as a run target read its own corpus (`corpus_reading`). `raw_weights`: a run that kept a weight EMA
    is scored by its training weights, not the EMA (as `pretrain export --raw-weights`)."""
    from data_pipeline.samples import PackedSequences
    from data_pipeline.shards import ShardSet, reading_shards
    from data_pipeline.tokenizer import load_tokenizer, special_tokens, tokenizer_hashes
    from objectives.mlm import MaskedLM, MLMOptions
    from pretrain.train.checkpoint import reading_checkpoints, run_of

    check_held_out(shards, corpus)
    if shards and (text_field or text_documents):
        raise UserError("--text-field and --text-documents say how a --corpus is read: --shards are tokenized already")
    if batch_size < 1 or max_samples < 0 or max_seq_len < 0:  # the command line refuses them by option name
        raise UserError(
            f"batch_size must be >= 1 (got {batch_size}), max_samples and max_seq_len >= 0 (got {max_samples}, "
            f"{max_seq_len})"
        )
    if 0 < max_seq_len < 3:
        raise UserError(f"--max-seq-len {max_seq_len}: a sequence needs room for [CLS], a token and [SEP] (>= 3)")
    torch.manual_seed(seed)
    hf_dir = _is_hf_dir(Path(target))
    if raw_weights and hf_dir:
        raise UserError(f"--raw-weights picks a run's or checkpoint's training weights; {target} holds one set")
    with contextlib.ExitStack() as held:
        # a checkpoint's tokenizer is read until the shards are open: a run saving meanwhile must not rotate it away
        with contextlib.nullcontext() if hf_dir else reading_checkpoints(target):
            logits_fn, tokenizer_dir, description, limit = load_target(target, ema=not raw_weights)
            if not max_seq_len and not hf_dir:  # at 128, a run trained at 64 was scored on untrained positions
                max_seq_len = trained_length(Path(target), limit)
            elif not max_seq_len:  # a model of 64 positions is scored at 64 rather than refused at the default
                max_seq_len = min(DEFAULT_SEQ_LEN, limit) if limit is not None else DEFAULT_SEQ_LEN
            elif limit is not None and max_seq_len > limit:
                raise UserError(f"--max-seq-len {max_seq_len} is longer than {description} takes ({limit} positions)")
            # the held-out shards beside what is scored: a checkpoint's go in its run's eval/, not into the checkpoint
            # (rotated away with it); a checkpoint outside a run keeps them in its own eval/
            cache_root = Path(target).parent if hf_dir else run_of(target) or Path(target)
            reading = corpus_reading(Path(target), hf_dir, text_field, text_documents) if corpus else {}
            shard_dir = resolve_shards(tokenizer_dir, shards, corpus, cache_root / "eval", reading)
            held.enter_context(reading_shards(shard_dir))  # until scored: a build into them meanwhile is refused
            tokens = special_tokens(load_tokenizer(tokenizer_dir))
            # an export's own tokenizer.json, or the run's it was exported from (whose shards these may be)
            shard_set = ShardSet(shard_dir, verify=True, expected_tokenizer_hash=tokenizer_hashes(tokenizer_dir))
        samples = PackedSequences(shard_set, max_seq_len, tokens.cls, tokens.sep, each_token_once=True)
        n = len(samples) if max_samples <= 0 else min(max_samples, len(samples))
        if n == 0:
            raise UserError(f"{shard_dir}: no samples of {max_seq_len} tokens to evaluate on")
        masker = MaskedLM(MLMOptions(mask_prob=mask_prob), tokens)
        total_loss, correct, count = _score_masked(logits_fn, samples, n, masker, tokens.pad, batch_size, seed)
        loss = total_loss / max(count, 1)
        return {
            "target": str(target),
            "model": description,
            "shards": str(shard_dir),
            "samples": n,
            "max_seq_len": max_seq_len,
            "masked_tokens": count,
            "accuracy": correct / max(count, 1),
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "mask_prob": mask_prob,
            "seed": seed,
        }


@torch.no_grad()
def _score_masked(logits_fn, samples, n: int, masker, pad: int, batch_size: int, seed: int) -> tuple[float, int, int]:
    """(summed cross-entropy, correct predictions, masked tokens) over the first `n` samples, masked by `masker`."""
    from data_pipeline.loader import Collator

    total_loss, correct, count = 0.0, 0, 0
    for start in tqdm(range(0, n, batch_size), desc="eval", unit="batch", file=sys.stderr, mininterval=1.0):
        # mask of sample i depends only on (seed, i): the same for every model and batch size
        batch = Collator(pad, [masker])(
            [
                masker.prepare(dict(samples[i]), np.random.default_rng([seed, i]))
                for i in range(start, min(start + batch_size, n))
            ]
        )
        batch = {k: v.to(local_device(), non_blocking=True) for k, v in batch.items()}
        labels = batch["mlm_labels"]
        selected = labels != IGNORE_INDEX  # [B, L]
        targets = labels[selected]  # [M]
        logits = logits_fn(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], selected).float()
        total_loss += float(F.cross_entropy(logits, targets, reduction="sum"))
        correct += int((logits.argmax(-1) == targets).sum())
        count += int(targets.numel())
    return total_loss, correct, count


def format_eval(result: dict) -> str:
    rows = [
        ("model", result["model"]),
        ("shards", result["shards"]),
        (
            "samples",
            f"{result['samples']:,} of {result['max_seq_len']} tokens ({result['masked_tokens']:,} masked tokens)",
        ),
        ("masked-token accuracy", f"{result['accuracy']:.4f}"),
        ("loss (mean CE)", f"{result['loss']:.4f}"),
        ("perplexity", f"{result['perplexity']:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
