"""Token classification on CoNLL column files (chunking, NER): `pretrain finetune MODEL TASK_DIR` when TASK_DIR holds
train.txt and dev.txt in column format.

Files: one token per line, whitespace-separated columns (the token first, its BIO tag last: `O`, `B-TYPE`,
`I-TYPE`), a blank line between sentences, `-DOCSTART-` lines skipped. A malformed line is an error naming file and
line. Words are tokenized by the model's fast tokenizer; a word's label sits on its FIRST sub-token, the other
sub-tokens and the special tokens are ignored (IGNORE_INDEX).

Scoring is CoNLL-2000's `conlleval`, written from its definition: a chunk starts at a B-, or at an I- after O or
after another type, and ends before a B-, an O or another type; a predicted chunk counts only when its type and both
boundaries match a gold chunk. Precision, recall and F1 (main metric `chunk_f1`) over all chunks and per type;
token accuracy over all words. Words the model never sees (cut by max_seq_len) are predicted O and so scored as
misses; dev tags never seen in train are reported, and scored as misses (the model cannot predict them).

For the paired statistics of an ablation a dev example is a sentence: `dev_labels` holds each sentence's gold chunk
count, and each seed's `dev_predictions` its [correct chunks, predicted chunks]. F1 is a ratio of sums of these
(`stats.chunk_f1_from_sums`), so a bootstrap over sentences resamples them.
"""

from __future__ import annotations

import codecs
import io
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from pretrain.core.errors import UserError
from pretrain.core.tokens import IGNORE_INDEX
from pretrain.evaluation.fit import autocast, batches, fit, linear_schedule, load_with_head, precision
from pretrain.hf.export import check_model_dir, check_tokenizer
from pretrain.train.distributed import local_device

SPLITS = ("train.txt", "dev.txt")
DOCSTART = "-DOCSTART-"
MAIN_METRIC = "chunk_f1"
DEV_FORMAT = "per dev sentence: label = gold chunks, prediction = [correct chunks, predicted chunks]"


@dataclass
class TokenTask:
    """A CoNLL task, shaped like finetune.Task: splits are (sentences as word lists, None, tag lists)."""

    name: str
    labels: list[str]  # the train tags in index order: what the model can predict
    train: tuple[list[list[str]], None, list[list[str]]]
    dev: tuple[list[list[str]], None, list[list[str]]]
    unseen: list[str] = field(default_factory=list)  # dev tags never in train
    kind: str = "token"
    pair: bool = False

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def is_conll_dir(task_dir: Path) -> bool:
    """A CoNLL task directory: train.txt and dev.txt (and no GLUE-style train.tsv)."""
    task_dir = Path(task_dir)
    return all((task_dir / s).is_file() for s in SPLITS) and not (task_dir / "train.tsv").is_file()


def bio_problem(tag: str) -> str | None:
    """Why `tag` is not a BIO tag (O, B-TYPE, I-TYPE), or None."""
    if tag == "O":
        return None
    if len(tag) < 3 or tag[0] not in "BI" or tag[1] != "-":
        return "is not BIO (O, B-TYPE or I-TYPE)"
    if any(c.isspace() for c in tag[2:]):
        return "has white space in its type"
    return None


def read_task_text(path: Path) -> str:
    """A task file's text (TSV or CoNLL): UTF-8, a leading byte-order mark dropped (else the first column's name, or
    the first token, would start with it); other bytes fail naming the file and line."""
    data = Path(path).read_bytes()
    body = data[len(codecs.BOM_UTF8) :] if data.startswith(codecs.BOM_UTF8) else data
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        line = body[: err.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: byte {body[err.start]:#04x} is not UTF-8: task files are read as UTF-8 (re-save it so)"
        ) from None


def read_conll(path: Path) -> tuple[list[list[str]], list[list[str]]]:
    """(sentences as word lists, their tag lists). Columns split on tabs if the first line has one, else on runs of
    white space (aligned columns); every line needs the first line's column count."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: task file not found (a CoNLL task directory needs {' and '.join(SPLITS)})")
    words: list[list[str]] = []
    tags: list[list[str]] = []
    sep, columns, open_ = None, 0, False
    with io.StringIO(read_task_text(path), newline=None) as f:  # newlines as open() reads them
        for line_no, raw in enumerate(f, 1):
            line = raw.rstrip("\r\n").rstrip(" ")
            if not line.strip() or line.split()[0] == DOCSTART:
                open_ = False  # a sentence (or document) boundary
                continue
            if not columns:
                sep = "\t" if "\t" in line else None  # None: str.split's runs of white space
                columns = len(line.split(sep))
                if columns < 2:
                    raise UserError(f"{path}:{line_no}: one column; a CoNLL line is `token ... tag`")
            fields = line.split(sep)
            if sep is None and line[0].isspace():  # split() would drop the empty token and blame the column count
                raise UserError(f"{path}:{line_no}: empty token")
            if len(fields) != columns:
                raise UserError(f"{path}:{line_no}: {len(fields)} column(s), the file's first line has {columns}")
            if not fields[0].strip():
                raise UserError(f"{path}:{line_no}: empty token")
            problem = bio_problem(fields[-1])
            if problem:
                raise UserError(f"{path}:{line_no}: tag '{fields[-1]}' {problem}")
            if not open_:
                words.append([])
                tags.append([])
                open_ = True
            words[-1].append(fields[0])
            tags[-1].append(fields[-1])
    if not words:
        raise UserError(f"{path}: no sentences")
    return words, tags


def load_token_task(task_dir: Path, task_type: str = "auto", max_train: int = 0) -> TokenTask:
    """The task of a CoNLL directory; warns (stderr) about dev tags that train never has."""
    task_dir = Path(task_dir)
    if task_type not in ("auto", "token"):
        raise UserError(f"{task_dir}: a CoNLL (token-level) task; --task-type {task_type} does not apply to it")
    train_w, train_t = read_conll(task_dir / SPLITS[0])
    dev_w, dev_t = read_conll(task_dir / SPLITS[1])
    seen = {t for s in train_t for t in s}
    labels = sorted(seen, key=lambda t: (t != "O", t[2:], t))  # O first, then B-X, I-X by type
    dev_counts = Counter(t for s in dev_t for t in s if t not in seen)
    unseen = sorted(dev_counts)
    if unseen:
        print(
            f"warning: {task_dir / SPLITS[1]}: tag(s) {unseen} never appear in {SPLITS[0]} "
            f"({sum(dev_counts.values())} dev word(s)): the model cannot predict them, they are scored as misses",
            file=sys.stderr,
        )
    if max_train and len(train_w) > max_train:  # a fixed subset: the same for every model and seed (as load_task)
        keep = np.sort(np.random.default_rng(0).permutation(len(train_w))[:max_train])
        train_w, train_t = [train_w[i] for i in keep], [train_t[i] for i in keep]
    return TokenTask(task_dir.name, labels, (train_w, None, train_t), (dev_w, None, dev_t), unseen)


# ----------------------------------------------------------------------------------------------
# conlleval


def _split_tag(tag: str) -> tuple[str, str]:
    return ("O", "") if tag == "O" else (tag[0], tag[2:])


def _chunk_ends(prev: str, prev_type: str, tag: str, type_: str) -> bool:
    """conlleval's endOfChunk (BIO): the chunk open at the previous token ends before this one."""
    return prev != "O" and (tag in ("B", "O") or type_ != prev_type)


def _chunk_starts(prev: str, prev_type: str, tag: str, type_: str) -> bool:
    """conlleval's startOfChunk (BIO): a B-, or an I- after O or after another type."""
    return tag != "O" and (tag == "B" or prev == "O" or type_ != prev_type)


def chunks(tags: list[str]) -> list[tuple[int, int, str]]:
    """The chunks of one sentence as (start, end exclusive, type)."""
    out, start, prev, prev_type = [], 0, "O", ""
    for i, full in enumerate([*tags, "O"]):  # a sentence ends every chunk
        tag, type_ = _split_tag(full)
        if _chunk_ends(prev, prev_type, tag, type_):
            out.append((start, i, prev_type))
        if _chunk_starts(prev, prev_type, tag, type_):
            start = i
        prev, prev_type = tag, type_
    return out


def _prf(correct: int, guessed: int, gold: int) -> dict[str, float]:
    p = correct / guessed if guessed else 0.0
    r = correct / gold if gold else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


def conlleval(gold: list[list[str]], pred: list[list[str]]) -> dict:
    """Chunk precision/recall/F1 (fractions, conlleval prints percentages), token accuracy, per type, and the
    per-sentence [correct, predicted] and gold chunk counts."""
    correct, guessed, found = Counter(), Counter(), Counter()
    per_sentence, gold_counts, right, words = [], [], 0, 0
    for g, p in zip(gold, pred, strict=True):
        if len(g) != len(p):
            raise ValueError(f"a sentence of {len(g)} gold tags has {len(p)} predicted")
        gc, pc = chunks(g), chunks(p)
        hits = set(gc) & set(pc)
        correct.update(c[2] for c in hits)
        guessed.update(c[2] for c in pc)
        found.update(c[2] for c in gc)
        per_sentence.append([len(hits), len(pc)])
        gold_counts.append(len(gc))
        right += sum(a == b for a, b in zip(g, p))
        words += len(g)
    overall = _prf(sum(correct.values()), sum(guessed.values()), sum(found.values()))
    per_type = {
        t: {**_prf(correct[t], guessed[t], found[t]), "gold": found[t], "predicted": guessed[t]}
        for t in sorted(set(guessed) | set(found))
    }
    return {
        "metrics": {
            MAIN_METRIC: overall["f1"],
            "precision": overall["precision"],
            "recall": overall["recall"],
            "token_accuracy": right / words if words else 0.0,
        },
        "per_type": per_type,
        "per_sentence": per_sentence,
        "gold_chunks": gold_counts,
    }


# ----------------------------------------------------------------------------------------------
# Tokens


# Byte-level BPE's and Metaspace's space pieces: a word they cannot join ('Ġ' + ',' for a comma) starts with one alone
SPACE_PIECES = ("Ġ", "▁")


def encode_words(
    tokenizer, sentences: list[list[str]], max_seq_len: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs [N, L] padded to the longest, `first` [N, W]: each word's first sub-token position (past a bare space
    piece), -1 where the word has no token: cut by max_seq_len, or nothing left of it after normalisation)."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("token classification needs a fast tokenizer (tokenizer.json) to map words to sub-tokens")
    enc = tokenizer(
        sentences, is_split_into_words=True, truncation=True, max_length=max_seq_len, padding=True, return_tensors="pt"
    )
    first = torch.full((len(sentences), max(map(len, sentences))), -1, dtype=torch.long)
    for i in range(len(sentences)):
        pieces = enc.tokens(i)
        for pos, w in enumerate(enc.word_ids(i)):
            if w is None:
                continue
            if first[i, w] < 0 or (pieces[first[i, w]] in SPACE_PIECES and first[i, w] == pos - 1):
                first[i, w] = pos  # a bare space piece ('Ġ' before ',') holds nothing of the word: the next one does
    return dict(enc), first


def align_labels(first: torch.Tensor, tag_ids: list[list[int]], length: int) -> torch.Tensor:
    """Labels [N, length]: each word's tag on its first sub-token, IGNORE_INDEX elsewhere. first [N, W]."""
    labels = torch.full((first.shape[0], length), IGNORE_INDEX, dtype=torch.long)
    for i, ids in enumerate(tag_ids):
        pos = first[i, : len(ids)]
        kept = pos >= 0
        labels[i, pos[kept]] = torch.tensor(ids, dtype=torch.long)[kept]
    return labels


def word_tags(token_preds: torch.Tensor, first: torch.Tensor, sentences: list[list[str]], tags: list[str]):
    """Each word's predicted tag (its first sub-token's), O for a word without a token. token_preds [N, L]."""
    picked = token_preds.gather(1, first.clamp(min=0)).tolist()  # [N, W]
    has = (first >= 0).tolist()
    return [[tags[picked[i][j]] if has[i][j] else "O" for j in range(len(s))] for i, s in enumerate(sentences)]


def _rows(enc: dict[str, torch.Tensor], idx: torch.Tensor, *extra: torch.Tensor) -> list:
    """Rows `idx` of the inputs (and of `extra` [N, L] tensors), cut to their longest real length, on the device."""
    width = int(enc["attention_mask"][idx].sum(1).max())
    batch = {k: v[idx, :width].to(local_device(), non_blocking=True) for k, v in enc.items()}
    return [batch, *(t[idx, :width].to(local_device(), non_blocking=True) for t in extra)]


# ----------------------------------------------------------------------------------------------
# Models


def load_token_model(model_dir: Path, tags: list[str], random_init: bool = False):
    """(tokenizer, AutoModelForTokenClassification) with the tags as id2label."""
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the unused MLM head and the new classifier are expected here
    model_dir = check_model_dir(model_dir)
    config = AutoConfig.from_pretrained(
        str(model_dir),
        num_labels=len(tags),
        id2label=dict(enumerate(tags)),
        label2id={t: i for i, t in enumerate(tags)},
    )
    check_tokenizer(model_dir, None, config.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    check_tokenizer(model_dir, len(tokenizer), config.vocab_size)
    if random_init:
        return tokenizer, AutoModelForTokenClassification.from_config(config)
    return tokenizer, load_with_head(AutoModelForTokenClassification, model_dir, config)


def fit_token_model(
    model_dir: Path,
    task: TokenTask,
    seed: int,
    epochs: int = 3,
    lr: float = 5e-5,
    batch_size: int = 32,
    max_seq_len: int = 128,
    warmup_frac: float = 0.1,
    random_init: bool = False,
):
    """(tokenizer, model) fine-tuned on the train split: AdamW, warmup then linear decay, as finetune.train_full."""
    torch.manual_seed(seed)  # the head's initialisation and dropout
    tokenizer, model = load_token_model(model_dir, task.labels, random_init)
    model.to(local_device())
    words, _, tags = task.train
    enc, first = encode_words(tokenizer, words, max_seq_len)
    index = {t: i for i, t in enumerate(task.labels)}
    labels = align_labels(first, [[index[t] for t in s] for s in tags], enc["input_ids"].shape[1])  # [N, L]

    def loss_of(idx):
        batch, y = _rows(enc, idx, labels)
        return model(**batch, labels=y).loss

    fit(model, loss_of, len(words), seed, epochs, lr, batch_size, warmup_frac, f"finetune {task.name} seed {seed}")
    return tokenizer, model


@torch.no_grad()
def predict_tags(model, tokenizer, sentences: list[list[str]], max_seq_len: int = 128, batch_size: int = 128):
    """(each word's predicted tag, the number of words without a token: predicted O)."""
    enc, first = encode_words(tokenizer, sentences, max_seq_len)
    preds = torch.zeros_like(enc["input_ids"])  # [N, L]
    for idx in batches(len(sentences), batch_size):
        (batch,) = _rows(enc, idx)
        with autocast():
            out = model(**batch).logits.argmax(-1).cpu()  # [B, width]
        preds[idx, : out.shape[1]] = out
    tags = [model.config.id2label[i] for i in range(model.config.num_labels)]
    return word_tags(preds, first, sentences, tags), _words_without_token(first, sentences)


def _words_without_token(first: torch.Tensor, sentences: list[list[str]]) -> int:
    lengths = torch.tensor([len(s) for s in sentences])
    real = torch.arange(first.shape[1]) < lengths[:, None]  # [N, W]
    return int(((first < 0) & real).sum())


def save_token_model(model, tokenizer, out_dir: Path) -> Path:
    """A directory AutoModelForTokenClassification (and AutoTokenizer) load, the tags as id2label."""
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


# ----------------------------------------------------------------------------------------------
# Probe: a linear layer on frozen token features


@torch.no_grad()
def token_features(model_dir: Path, task: TokenTask, max_seq_len: int = 128, batch_size: int = 64, random_init=False):
    """Each split's frozen features of the words that have a token: (features [W, H], first [N, W])."""
    if random_init:  # one random encoder whatever ran before in this process (features are computed once)
        torch.manual_seed(0)
    tokenizer, model = load_token_model(model_dir, task.labels, random_init)
    encoder = getattr(model, model.base_model_prefix)
    encoder.eval().to(local_device())
    out = []
    for split_name, (words, _, _) in (("train", task.train), ("dev", task.dev)):
        enc, first = encode_words(tokenizer, words, max_seq_len)
        feats = []
        for idx in tqdm(list(batches(len(words), batch_size)), desc=f"features {task.name}/{split_name}", leave=False):
            (batch,) = _rows(enc, idx)
            with autocast():
                hidden = encoder(**batch).last_hidden_state.float()  # [B, width, H]
            pos = first[idx]  # [B, W]
            rows = torch.arange(len(idx))[:, None].expand_as(pos)
            kept = pos >= 0
            at = rows[kept].to(local_device()), pos[kept].to(local_device())
            feats.append(hidden[at].cpu())  # [words with a token, H]
        out.append((torch.cat(feats), first))
    return out[0], out[1]


def train_token_probe(task: TokenTask, train, dev, seed: int, epochs: int = 20, lr: float = 1e-2, batch_size: int = 64):
    """A linear head on fixed word features (standardised with train statistics); a batch holds the words of about
    `batch_size` sentences. train, dev: (features [W, H], first [N, W]) from `token_features`. Returns the
    per-word predicted tags of dev."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    (train_x, train_first), (dev_x, dev_first) = train, dev
    index = {t: i for i, t in enumerate(task.labels)}
    y = torch.tensor(
        [index[t] for s, f in zip(task.train[2], train_first) for t, p in zip(s, f.tolist()) if p >= 0]
    )  # [W]: the words with a token, in the features' order
    mean, std = train_x.mean(0), train_x.std(0).clamp(min=1e-6)
    xs, xd = ((train_x - mean) / std).to(local_device()), ((dev_x - mean) / std).to(local_device())
    y = y.to(local_device())
    head = torch.nn.Linear(xs.shape[1], task.num_labels).to(local_device())
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    words_per_batch = batch_size * max(1, round(len(xs) / max(1, len(task.train[0]))))
    total = max(1, epochs * math.ceil(len(xs) / words_per_batch))
    sched = linear_schedule(opt, total, 0.0)
    for _ in range(epochs):
        for idx in batches(len(xs), words_per_batch, gen):
            idx = idx.to(local_device())
            loss = F.cross_entropy(head(xs[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        pred = head(xd).argmax(-1).cpu()  # [dev words with a token]
    token_preds = torch.zeros(dev_first.shape, dtype=torch.long)  # [N, W], laid out by word as `word_tags` reads it
    token_preds[dev_first >= 0] = pred
    by_word = torch.arange(dev_first.shape[1]).expand_as(dev_first).masked_fill(dev_first < 0, -1)
    return word_tags(token_preds, by_word, task.dev[0], task.labels)


# ----------------------------------------------------------------------------------------------
# `pretrain finetune` on a CoNLL task


def finetune_tokens(
    model_dir: Path,
    task: TokenTask,
    seeds: list[int],
    mode: str = "full",
    epochs: int | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    max_seq_len: int = 128,
    random_init: bool = False,
) -> dict:
    """finetune()'s result for a token task (its caller adds the summary): per seed conlleval's metrics, per type,
    and each dev sentence's chunk counts for the paired statistics."""
    runs, missing = [], 0
    if mode == "probe":
        train, dev = token_features(Path(model_dir), task, max_seq_len, random_init=random_init)
        missing = _words_without_token(dev[1], task.dev[0])
        for seed in seeds:
            runs.append(train_token_probe(task, train, dev, seed, epochs or 20, lr or 1e-2, batch_size or 64))
    else:
        for seed in seeds:
            tokenizer, model = fit_token_model(
                Path(model_dir), task, seed, epochs or 3, lr or 5e-5, batch_size or 32, max_seq_len, 0.1, random_init
            )
            predicted, missing = predict_tags(model, tokenizer, task.dev[0], max_seq_len)
            runs.append(predicted)
    if missing:
        print(
            f"warning: {task.name}: {missing} word(s) scored on lie beyond --max-seq-len {max_seq_len} tokens (or have "
            "no token): predicted O, scored as misses",
            file=sys.stderr,
        )
    scores = [conlleval(task.dev[2], predicted) for predicted in runs]
    return {
        "task": task.name,
        "kind": task.kind,
        "pair": False,
        "num_labels": task.num_labels,
        "labels": task.labels,
        "train_examples": len(task.train[0]),
        "dev_examples": len(task.dev[0]),
        "mode": mode,
        "seeds": list(seeds),
        "main_metric": MAIN_METRIC,
        "precision": precision(),  # bf16 autocast on a GPU, fp32 on a CPU
        "per_seed": [s["metrics"] for s in scores],
        "per_type": [s["per_type"] for s in scores],
        "unseen_dev_tags": task.unseen,
        "dev_words_without_token": missing,
        "dev_format": DEV_FORMAT,
        "dev_labels": scores[0]["gold_chunks"],
        "dev_predictions": [s["per_sentence"] for s in scores],
    }
