"""Helpers shared by the test modules, in one place: test modules import them from here (`from helpers import
...`), never from each other or from conftest.py (which sets the environment up and holds the fixtures)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.loader import Collator
from objectives import build_objectives
from pretrain.core.config import ModelConfig
from pretrain.core.tokens import SpecialTokens
from pretrain.train.distributed import single_process_env

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# The command line, as a user runs it


def run_cli(*args, cwd, rc=0, wait=True, wandb_mode="disabled"):
    """`python -m pretrain.cli ARGS` in a fresh process, as a user runs it (no rank variables of a launcher around
    it); asserts the exit status `rc` (None: any). wait=False returns the running Popen."""
    import subprocess

    env = single_process_env(DS_ACCELERATOR="cpu", WANDB_MODE=wandb_mode)
    cmd = [sys.executable, "-m", "pretrain.cli", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if rc is not None:
        tails = f"stdout:{proc.stdout[-3000:]}\nstderr:{proc.stderr[-4000:]}"
        assert proc.returncode == rc, f"rc={proc.returncode}\n{tails}"
    return proc


# ----------------------------------------------------------------------------------------------
# Tiny runs through the CLI, as a user makes them

CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"  # the embedded corpus


def small_corpus(directory: Path, lines: slice = slice(0, 20), name: str = "speeches.jsonl") -> Path:
    """A corpus file of a few documents of the embedded corpus (20 by default): enough for the tiny preset."""
    path = Path(directory) / name
    path.write_text("\n".join(CORPUS.read_text().splitlines()[lines]) + "\n")
    return path


def run_args(out, corpus, *extra) -> list[str]:
    """A `tiny` run of 3 steps with 1 layer named r in `out` on `corpus` (a checkpoint at step 3, a metrics line per
    step); `extra` overrides come last and win (e.g. "name=other")."""
    return [
        "tiny",
        f"output_dir={out}",
        "name=r",
        f"data.corpus=[{corpus}]",
        "data.vocab_size=512",
        "data.num_workers=0",
        "model.num_layers=1",
        "train.max_steps=3",
        "train.save_every=3",
        "train.log_every=1",
        "train.warmup_steps=1",
        *extra,
    ]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes (what 'left untouched' means; the lock records its last holder)."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def one_line_error(proc, *needles):
    """The command failed with one `error:` line (no traceback) holding every needle."""
    err = proc.stderr.strip()
    assert err.splitlines()[-1].startswith("error:") and "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in err, (needle, err[-3000:])


# ----------------------------------------------------------------------------------------------
# Made-up corpora

SUBJECTS = [
    "The committee",
    "Our nation",
    "The senator",
    "Every citizen",
    "The government",
    "This council",
    "The people",
    "Mr. Smith",
    "The army",
    "Congress",
]
VERBS = [
    "will review",
    "has approved",
    "cannot ignore",
    "must defend",
    "rejected",
    "considered",
    "supports",
    "questioned",
    "welcomed",
    "debated",
]
OBJECTS = [
    "the budget",
    "the new treaty",
    "our liberty",
    "the public debt",
    "the western territories",
    "an ambitious proposal",
    "the trade agreement",
    "the common defense",
    "the courts",
    "the harbor",
]
TAILS = [
    "on Monday",
    "without delay",
    "with great care",
    "in the spring",
    "for the second time",
    "today",
    "after a long debate",
    "in 1789",
    "at the request of the states",
    "despite protests",
]


def make_docs(n: int, seed: int = 0) -> list[str]:
    """`n` short English-like documents of 2-8 sentences, some with two paragraphs."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sents = [
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}{rng.choice('..!?')}"
            for _ in range(rng.randint(2, 8))
        ]
        cut = rng.randint(1, len(sents))
        docs.append(" ".join(sents[:cut]) + ("\n\n" + " ".join(sents[cut:]) if cut < len(sents) else ""))
    return docs


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


# ----------------------------------------------------------------------------------------------
# Tiny random-weight models and their batches

V = 96
TOKENS = SpecialTokens(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=V, replaceable=np.arange(5, V))
BASE = ModelConfig(
    vocab_size=V, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64, max_position_embeddings=64
)


def make_batch(lengths=(30, 17, 24, 9), seed=0, objectives=None, split=None, static_width=0):
    """A padded MLM batch (rows of different lengths, two segments) through the real collator; with `split` (a row
    index), the two batches of the rows before and after it, from the same samples. `static_width`: the
    collator's. A sentence-level objective (nsp, sop) finds each row a pair already: it draws only the label."""
    objectives = objectives or build_objectives({"mlm": {}}, TOKENS)
    samples = make_samples(lengths, seed, objectives)
    collate = Collator(TOKENS.pad, objectives, static_width)
    return collate(samples) if split is None else [collate(samples[:split]), collate(samples[split:])]


def make_samples(lengths=(30, 17, 24, 9), seed=0, objectives=None) -> list[dict]:
    """The samples of `make_batch`, before the collator: what a PretrainDataset gives, prepared by `objectives`."""
    rng = np.random.default_rng(seed)
    objectives = objectives or build_objectives({"mlm": {}}, TOKENS)
    samples = []
    for n in lengths:
        ids = rng.integers(5, V, size=n)
        ids[0], ids[n // 2], ids[-1] = TOKENS.cls, TOKENS.sep, TOKENS.sep
        types = np.zeros(n, np.int64)
        types[n // 2 + 1 :] = 1
        special = np.isin(ids, [TOKENS.cls, TOKENS.sep])
        sample = {
            "input_ids": ids,
            "token_type_ids": types,
            "special_mask": special,
            "word_starts": special | (rng.random(n) < 0.6),
        }  # words of 1-3 tokens, for word-level masking
        for objective in objectives:
            if objective.sentence_level:
                sample[objective.label_key] = np.array(rng.integers(2), np.int64)
            else:
                sample = objective.prepare(sample, rng)
        samples.append(sample)
    return samples


def compile_with(monkeypatch, make) -> None:
    """The model's compiled functions (`pretrain.model.compiling`) made by `make(fn, mode)` instead, from a fresh
    start: dynamo reset and none made yet."""
    import torch

    from pretrain.model import compiling

    torch._dynamo.reset()
    monkeypatch.setattr(compiling, "_made", {})
    monkeypatch.setattr(compiling, "_make", make)


def loss_and_grads(model, batch):
    """(the loss, {parameter name: its gradient}) of one forward and backward of `model` on `batch`."""
    model.zero_grad(set_to_none=True)
    loss = model(batch)[0]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------------
# What the machine can do


def tiny_engine_script(precision: str, zero_stage: int = 0, mask_rate: float = 0.3) -> str:
    """The start of a script for a subprocess of one rank: `engine`, the DeepSpeed engine of a one-layer MLM model
    (vocabulary 64, 16 positions) in `precision` under ZeRO `zero_stage`, `run` its ResolvedRun, and `batch`, two
    rows with about `mask_rate` of their tokens as targets. Imports torch, nn and Batch."""
    return f"""
import torch
from torch import nn
from pretrain.core.batch import Batch
from pretrain.core.tokens import SpecialTokens
from pretrain.train.distributed import init_distributed
from pretrain.train.engine import build_engine
from pretrain.train.setup import build_model, load_config, resolve_run

init_distributed()
tokens = SpecialTokens(pad=0, unk=1, cls=2, sep=3, mask=4, vocab_size=64)
cfg = load_config("tiny", ["objectives={{mlm: {{}}}}", "train.precision={precision}", "train.zero_stage={zero_stage}",
                           "model.num_layers=1", "model.max_position_embeddings=16", "data.max_seq_len=16",
                           "train.micro_batch_size=2"])
run = resolve_run(cfg, tokens)
engine = build_engine(run, build_model(cfg, tokens), fresh=True, load_universal=False)
ids = torch.randint(5, 64, (2, 16))
batch = Batch.of({{"input_ids": ids, "mlm_labels": torch.where(torch.rand(2, 16) < {mask_rate}, ids, -100)}},
                 engine.ds.module.objectives)
"""


def _deepspeed_fp16_here() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


# DeepSpeed trains fp16 on a CPU only where oneDNN has fp16 kernels (AVX512-FP16 / AMX-FP16, e.g. Sapphire Rapids);
# elsewhere it refuses ("Type fp16 is not supported on your device"). GPUs and such CPUs run these tests.
requires_fp16 = pytest.mark.skipif(
    not _deepspeed_fp16_here(), reason="DeepSpeed refuses fp16 on this CPU (oneDNN without fp16 kernels)"
)


PAIR_WORDS = (
    "river stone cloud apple night music paper window garden silver engine forest letter market bridge "
    "candle winter summer doctor island"
).split()


def make_pair_task(directory: Path, n_train: int = 48, n_dev: int = 24, seed: int = 0) -> Path:
    """Do two short sentences share a word? Label 1 if they do (half the examples), 0 otherwise."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        rows = ["sentence1\tsentence2\tlabel"]
        for i in range(n):
            a = rng.sample(PAIR_WORDS, 3)
            rest = [w for w in PAIR_WORDS if w not in a]
            b = rng.sample(rest, 3)
            if i % 2:
                b[rng.randrange(3)] = rng.choice(a)
            rows.append(f"the {' '.join(a)} .\tthe {' '.join(b)} .\t{i % 2}")
        (directory / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return directory


def tiny_bert(directory: Path, words: list[str], positions: int = 64, head: str = "mlm", num_labels: int = 2) -> Path:
    """A tiny BERT directory (random weights, as an export holds) with a WordPiece vocabulary of `words` and their
    characters, `positions` long (its tokenizer capped there, as an export caps it); head: mlm, sequence or token
    (`num_labels` classes: a model already fine-tuned on another task)."""
    import torch
    import transformers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted(set("".join(words)))
    vocab = list(dict.fromkeys([*specials, *words, *chars, *(f"##{c}" for c in chars)]))
    tok = transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, model_max_length=positions)
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=positions,
        pad_token_id=0,
        num_labels=num_labels,
    )
    model = {
        "mlm": transformers.BertForMaskedLM,
        "sequence": transformers.BertForSequenceClassification,
        "token": transformers.BertForTokenClassification,
    }[head]
    torch.manual_seed(0)
    model(config).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return Path(directory)


def tsv_task(directory: Path, n: int) -> Path:
    """A single-sentence task of n rows (labels alternating 0 and 1), the same rows in train.tsv and dev.tsv."""
    directory.mkdir(parents=True)
    rows = "".join(f"sentence {i}\t{i % 2}\n" for i in range(n))
    for split in ("train.tsv", "dev.tsv"):
        (directory / split).write_text("sentence\tlabel\n" + rows)
    return directory


TASK_WORDS = "river stone cloud apple night music paper window garden silver engine forest letter market bridge".split()


def make_task(directory: Path, n_train: int = 40, n_dev: int = 16, seed: int = 0) -> Path:
    """Single sentences; label 1 when 'river' is in it. Dev sentences end in 'dev' so a leak would be visible."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        rows = ["sentence\tlabel"]
        for i in range(n):
            words = rng.sample(TASK_WORDS[1:], 3) + (["river"] if i % 2 else [])
            rows.append(f"the {' '.join(words)} {split}\t{i % 2}")
        (directory / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return directory


# the CoNLL task's words (`write_conll`); VERBS above is make_docs's
CONLL_NOUNS = "river stone cloud apple night music paper window garden silver".split()
CONLL_VERBS = "runs sings falls grows".split()


def write_conll(directory: Path, n_train: int = 24, n_dev: int = 8, seed: int = 0) -> Path:
    """'the NOUN NOUN VERB .' sentences chunked as NP VP O; dev's last sentence has an ADVP that train never has."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        lines = ["-DOCSTART- -X- O", ""]
        for i in range(n):
            a, b, v = rng.choice(CONLL_NOUNS), rng.choice(CONLL_NOUNS), rng.choice(CONLL_VERBS)
            lines += ["the DT B-NP", f"{a} NN I-NP", f"{b} NN I-NP", f"{v} VBZ B-VP"]
            if split == "dev" and i == n - 1:
                lines.append("fast RB B-ADVP")
            lines += [". . O", ""]
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return directory


# ----------------------------------------------------------------------------------------------
# A job of pretrain.evaluation.side_by_side, run in its child process (which imports this module by name)


def side_job(marker: str, lines: int = 2, wait_s: float = 0.0, fail: str = "", kill: int = 0, meet: str = "") -> None:
    """Notes its start and end (wall times) in `marker`.start / .end, prints `lines` lines, a progress bar as tqdm
    draws one ('\\r' updates) and a last line without an end; waits for the job of marker `meet` to start (at most
    60 s), then `wait_s` (SIGTERM meanwhile: `marker`.signalled, then KeyboardInterrupt, as a trainer's stop); then
    sends itself the signal `kill` or raises UserError(fail)."""
    import os
    import signal
    import time

    from pretrain.core.errors import UserError

    def stopped(*_):
        print("stopping: saving a checkpoint", flush=True)  # as a trainer logs its stop before it saves
        Path(f"{marker}.signalled").write_text("SIGTERM")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stopped)
    Path(f"{marker}.start").write_text(str(time.time()))
    for i in range(lines):
        print(f"line {i}", flush=True)
    sys.stderr.write("".join(f"\rbar {k}/5" for k in range(6)) + "\n")
    sys.stderr.flush()
    deadline = time.monotonic() + 60
    while meet and not Path(f"{meet}.start").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(wait_s)
    Path(f"{marker}.end").write_text(str(time.time()))
    if kill:
        os.kill(os.getpid(), kill)
    if fail:
        raise UserError(fail)
    print("last words", end="", flush=True)
