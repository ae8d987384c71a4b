"""`pretrain finetune`: downstream scores of an exported (or any HF BERT-family) model on GLUE-format TSV tasks.

A task directory holds train.tsv and dev.tsv with a header row: `sentence` (single sentence), `sentence1` and
`sentence2`, or `question` and `sentence` (pairs, the question first as GLUE's QNLI), and `label`; an id column
(`index`, `idx`, `id`) may be there too, any other column is refused by name rather than dropped. Integer or string
labels make a classification task, non-integer numbers a regression task. Scores are reported per seed and as mean,
(sample) standard deviation and median.
The options are a `pretrain.evaluation.configs.FinetuneConfig` (`run_finetune`; `finetune` takes them as arguments).

The protocol, with `lrs`: each learning rate is trained on train minus a held-out part (heldout_fraction, a split
fixed by heldout_seed) and scored there; the best is re-trained on all of train with every seed and scored on dev.
Dev never chooses anything. The result records the chosen `lr` and the sweep (`lr_sweep`).

Modes:
- full: fine-tune encoder and head (AdamW, linear warmup then decay, dropout on).
- probe: freeze the encoder and train a linear head on its features. The features do not depend on the seed,
  so they are computed once per model and task, and each seed only trains the head: seconds on a CPU.
  The seed spread of a probe therefore measures only the head's training, not the encoder's.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data_pipeline.tokenizer import TOKEN_TYPE_ARCHS, takes_token_types
from pretrain.core.errors import UserError
from pretrain.core.parsing import from_dict
from pretrain.evaluation.configs import MIN_PAIR_SEQ_LEN, FinetuneConfig, missing_task_hint
from pretrain.evaluation.fit import autocast, batches, fit, load_with_head, precision
from pretrain.evaluation.token_tasks import (
    SPLITS,
    TokenTask,
    finetune_tokens,
    is_conll_dir,
    load_token_task,
    read_task_text,
)
from pretrain.hf.export import check_model_dir, check_tokenizer, position_limit
from pretrain.train.distributed import local_device

csv.field_size_limit(1 << 24)
PAIR_COLUMNS = (("sentence1", "sentence2"), ("question", "sentence"))  # (first, second) of a pair task, as GLUE's
ID_COLUMNS = ("index", "idx", "id")  # columns a task may have besides its text and label, not read
DEFAULT_SEQ_LEN = 128  # max_seq_len 0: this, or the model's positions where it has fewer (as `pretrain eval`)
DEFAULTS = FinetuneConfig()  # the options' defaults, declared once there (the command line reads them too)


@dataclass
class Task:
    name: str
    kind: str  # "classification" | "regression"
    pair: bool
    labels: list[str]  # class names in index order (classification)
    train: tuple[list[str], list[str] | None, list]  # (sentence1, sentence2 or None, label)
    dev: tuple[list[str], list[str] | None, list]

    @property
    def num_labels(self) -> int:
        return 1 if self.kind == "regression" else len(self.labels)


def read_tsv(path: Path, lines: list[int] | None = None) -> tuple[list[str], list[str] | None, list[str]]:
    """Columns of a GLUE-format TSV; a malformed row fails naming the file and line. `lines` (given) gets each
    example's line. A field that starts with " is CSV-quoted (it ends at the next lone "; a doubled "" is one), as
    csv writers write them; a file that is not (text after a closing quote, a quote never closed: GLUE's own files,
    '"Yes," she said.') is read again with every quote as text, as GLUE's readers do, and said: read as CSV, its
    quotes were dropped with no word."""
    if not path.is_file():
        raise UserError(f"{path}: task file not found (a task directory needs train.tsv and dev.tsv)")
    text = read_task_text(path)
    with io.StringIO(text, newline="") as f:  # newline="": as the csv module wants a file opened
        rows = csv.reader(f, delimiter="\t", strict=True)
        at = [1]  # the first line of the row being read
        try:
            return _read_rows(path, _Tracked(rows, at), [] if lines is None else lines)
        except csv.Error as err:
            why = "a quote never closed" if "end of data" in str(err) else f"text after a closing quote ({err})"
    print(
        f"note: {path}:{at[0]}: {why}: not CSV-quoted; read with every quote as text (as GLUE's files)", file=sys.stderr
    )
    if lines is not None:
        lines.clear()
    with io.StringIO(text, newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return _read_rows(path, _Tracked(rows, [1]), [] if lines is None else lines)


class _Tracked:
    """A csv reader that keeps `at[0]`, the first physical line of the row it reads next (for its errors)."""

    def __init__(self, rows, at: list[int]):
        self.rows, self.at = rows, at

    @property
    def line_num(self) -> int:
        return self.rows.line_num

    def __iter__(self):
        return self

    def __next__(self) -> list[str]:
        self.at[0] = self.rows.line_num + 1
        return next(self.rows)


def _read_rows(path: Path, rows, lines: list[int]) -> tuple[list[str], list[str] | None, list[str]]:
    """`read_tsv` of a file's csv rows (`_Tracked`)."""
    header = next(rows, None)
    if not header:
        raise UserError(f"{path}:1: empty file, expected a header row (sentence<TAB>label)")
    header = [h.strip() for h in header]
    while header and not header[-1]:  # a trailing tab (spreadsheet exports write one): no column
        header.pop()
    if "label" not in header:
        raise UserError(f"{path}:1: no 'label' column in header {header}")
    pair = next((p for p in PAIR_COLUMNS if all(c in header for c in p)), None)
    if pair:
        text_cols = [header.index(c) for c in pair]
    elif "sentence" in header:
        text_cols = [header.index("sentence")]
    else:
        raise UserError(
            f"{path}:1: header {header} needs 'sentence', 'sentence1' and 'sentence2', or 'question' and 'sentence'"
        )
    label_col = header.index("label")
    unread = [h for i, h in enumerate(header) if i not in (*text_cols, label_col) and h not in ID_COLUMNS]
    if unread:  # a text column not read would be dropped from every example without a word
        raise UserError(
            f"{path}:1: column(s) {unread} of header {header} are neither text nor label: a task reads "
            f"{' and '.join(header[i] for i in text_cols)}, and label (besides an id column: "
            f"{', '.join(ID_COLUMNS)}); remove or rename them"
        )
    first, second, labels = [], [], []
    end = rows.line_num
    for row in rows:
        line, end = end + 1, rows.line_num  # the row's first and last physical lines
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line
        if len(row) > len(header) and not any(f.strip() for f in row[len(header) :]):
            row = row[: len(header)]  # trailing empty fields
        if any("\t" in f for f in row):  # a `"` opening a field swallowed separators up to the next `"`
            raise UserError(
                f"{path}:{line}: a field holds a tab (this row runs on to line {end}): the file's quoting is off; "
                'a field that starts with " runs to the next " (remove the quote, or quote the whole field and '
                'double each " in it)'
                if end > line
                else f"{path}:{line}: a quoted field holds a tab, which a task's text may not: replace it with a "
                'space (or, if the " was not meant to quote the field, remove it)'
            )
        row = [" ".join(f.split()) if "\n" in f or "\r" in f else f for f in row]  # a quoted field's lines
        if len(row) != len(header):
            raise UserError(f"{path}:{line}: {len(row)} tab-separated field(s), the header has {len(header)}")
        label = row[label_col].strip()
        if not label:
            raise UserError(f"{path}:{line}: empty label")
        first.append(row[text_cols[0]])
        if len(text_cols) == 2:
            second.append(row[text_cols[1]])
        labels.append(label)
        lines.append(line)
    if not labels:
        raise UserError(f"{path}: no examples after the header")
    return first, (second if len(text_cols) == 2 else None), labels


def _is_int(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def _is_float(s: str) -> bool:
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False


def load_task(task_dir: Path, task_type: str = "auto", max_train: int = 0) -> Task | TokenTask:
    task_dir = Path(task_dir)
    if not task_dir.is_dir():  # a task the presets name says where to get it, as `pretrain ablate` does
        raise UserError(
            f"{task_dir}: task directory not found (a path relative to the directory you run from, {Path.cwd()})"
            f"{missing_task_hint(str(task_dir))}"
        )
    conll = all((task_dir / split).is_file() for split in SPLITS)
    if is_conll_dir(task_dir) or (task_type == "token" and conll):  # CoNLL columns: token classification
        return load_token_task(task_dir, task_type, max_train)
    if task_type == "token":
        raise UserError(
            f"{task_dir}: --task-type token needs a CoNLL task: {' and '.join(SPLITS)} in that directory, one token "
            "per line (the token first, its BIO tag last) and a blank line between sentences"
        )
    lines: dict[str, list[int]] = {"train.tsv": [], "dev.tsv": []}  # each example's line, for the label errors
    train_1, train_2, train_y = read_tsv(task_dir / "train.tsv", lines["train.tsv"])
    dev_1, dev_2, dev_y = read_tsv(task_dir / "dev.tsv", lines["dev.tsv"])
    if (train_2 is None) != (dev_2 is None):
        raise UserError(f"{task_dir}: train.tsv and dev.tsv disagree on single sentence vs sentence pair columns")
    everything = train_y + dev_y
    numeric = all(_is_float(y) for y in everything)
    integral = numeric and all(float(y).is_integer() for y in everything)
    if task_type == "auto":  # ints, integral numbers (0.0/1.0) or strings -> classes; other numbers -> regression
        task_type = "regression" if numeric and not integral else "classification"
        if integral and not all(_is_int(y) for y in everything):
            print(
                f"note: {task_dir}: labels such as '{next(y for y in everything if not _is_int(y))}' are whole "
                "numbers, read as classes; use --task-type regression if they are scores",
                file=sys.stderr,
            )
    if task_type not in ("classification", "regression"):
        raise UserError(f"task type '{task_type}' is not one of auto, classification, regression, token")
    if task_type == "classification" and integral:  # one name per class: '1.0' in train and '1' in dev agree
        train_y, dev_y = [str(int(float(y))) for y in train_y], [str(int(float(y))) for y in dev_y]
    if task_type == "regression":
        for split, ys in (("train.tsv", train_y), ("dev.tsv", dev_y)):
            bad = next((i for i, y in enumerate(ys) if not _is_float(y)), None)
            if bad is not None:
                raise UserError(f"{task_dir / split}:{lines[split][bad]}: label '{ys[bad]}' is not a number")
        names: list[str] = []
        train_lab, dev_lab = [float(y) for y in train_y], [float(y) for y in dev_y]
    else:
        names = sorted(set(train_y), key=lambda y: (not _is_int(y), int(y) if _is_int(y) else 0, y))
        if len(names) < 2:
            raise UserError(
                f"{task_dir / 'train.tsv'}: every label is '{names[0]}': classification needs at least "
                "two classes (or --task-type regression for scores)"
            )
        index = {y: i for i, y in enumerate(names)}
        unseen = sorted(set(dev_y) - set(index))
        if unseen:
            first = lines["dev.tsv"][dev_y.index(unseen[0])]
            raise UserError(
                f"{task_dir / 'dev.tsv'}:{first}: label(s) {unseen[:5]} never appear in train.tsv (the first on this "
                "line)"
            )
        train_lab, dev_lab = [index[y] for y in train_y], [index[y] for y in dev_y]
    if max_train and len(train_lab) > max_train:  # a fixed subset: the same for every model and seed
        keep = np.sort(np.random.default_rng(0).permutation(len(train_lab))[:max_train])
        train_1 = [train_1[i] for i in keep]
        train_2 = [train_2[i] for i in keep] if train_2 is not None else None
        train_lab = [train_lab[i] for i in keep]
    return Task(
        task_dir.name, task_type, train_2 is not None, names, (train_1, train_2, train_lab), (dev_1, dev_2, dev_lab)
    )


# ----------------------------------------------------------------------------------------------
# Metrics


def matthews_corr(y: np.ndarray, p: np.ndarray) -> float:
    """Binary MCC; 0 when a row or column of the confusion matrix is empty (as sklearn)."""
    tp = float(((p == 1) & (y == 1)).sum())
    tn = float(((p == 0) & (y == 0)).sum())
    fp = float(((p == 1) & (y == 0)).sum())
    fn = float(((p == 0) & (y == 1)).sum())
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denom if denom else 0.0


def _rank(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for value in np.unique(x):  # average ranks of ties
        tie = x == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def task_metrics(task: Task, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    if task.kind == "regression":
        bad = int((~np.isfinite(predictions)).sum())
        if bad:  # a diverged fine-tuning: its correlation is undefined, its pearson was nan here and 0 in the report
            print(
                f"warning: {task.name}: {bad} of {len(predictions)} dev predictions are not finite (the fine-tuning "
                "diverged): scored as a constant prediction is, pearson and spearman 0 (the report says so too)",
                file=sys.stderr,
            )
            return {"pearson": 0.0, "spearman": 0.0}
        return {"pearson": _pearson(predictions, labels), "spearman": _pearson(_rank(predictions), _rank(labels))}
    out = {"accuracy": float((predictions == labels).mean())}
    if task.num_labels == 2:
        out["mcc"] = matthews_corr(labels, predictions)
    return out


def main_metric(task_name: str, kind: str, num_labels: int) -> str:
    """The headline metric: GLUE's choice (MCC for CoLA, Pearson for regression), chunk F1 for token tasks (as
    CoNLL-2000), else accuracy."""
    if kind == "regression":
        return "pearson"
    if kind == "token":
        return "chunk_f1"
    words = re.split(r"[^a-z0-9]+", task_name.lower())  # "cola", "glue-cola", "CoLA_small"; not "chocolate"
    return "mcc" if "cola" in words and num_labels == 2 else "accuracy"


# ----------------------------------------------------------------------------------------------
# Models


def load_model(model_dir: Path | None, num_labels: int, kind: str, random_init: bool = False):
    """(tokenizer, sequence-classification model). random_init: same config, untrained weights."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # the load report lists the MLM head as unused and the classifier as new: expected here, not news
    hf_logging.set_verbosity_error()
    model_dir = check_model_dir(model_dir)
    problem = "regression" if kind == "regression" else "single_label_classification"
    config = AutoConfig.from_pretrained(str(model_dir), num_labels=num_labels, problem_type=problem)
    check_tokenizer(model_dir, None, config.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    check_tokenizer(model_dir, len(tokenizer), config.vocab_size)
    if random_init:
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = load_with_head(AutoModelForSequenceClassification, model_dir, config)
    return tokenizer, model


def fit_max_seq_len(model_dir: Path, max_seq_len: int) -> int:
    """The input length to use: 0 is the model's positions, at most DEFAULT_SEQ_LEN; a longer one than the model's
    position table is refused (an export caps its tokenizer there, but the explicit max_length the encoders pass
    overrides that cap, and the model then fails mid-run with an index error)."""
    config = json.loads((check_model_dir(model_dir) / "config.json").read_text())
    limit = position_limit(config)
    if config.get("model_type") == "modernbert" or "max_position_embeddings" not in config:
        limit = None  # rotary positions have no table (as `pretrain eval`), or the model names its length otherwise
    if not max_seq_len:
        return min(DEFAULT_SEQ_LEN, limit) if limit is not None else DEFAULT_SEQ_LEN
    if limit is not None and max_seq_len > limit:
        raise UserError(f"--max-seq-len {max_seq_len} is longer than {model_dir} takes ({limit} positions)")
    return max_seq_len


def _token_types(config) -> bool | None:
    """Whether to ask the tokenizer for token_type_ids: yes for a model with segment embeddings, which would otherwise
    read a pair's B as type 0 (exports from before tokenizer_config.json said so, and transformers 5's ALBERT
    tokenizer, return none); no where the model has one type. Other models: the tokenizer's own choice."""
    if config.model_type not in TOKEN_TYPE_ARCHS:
        return None
    return takes_token_types(config.model_type, getattr(config, "type_vocab_size", 2))


def _encode(tokenizer, split, max_seq_len: int, config) -> dict[str, torch.Tensor]:
    first, second, _ = split
    return tokenizer(
        first,
        second,
        truncation=True,
        max_length=max_seq_len,
        padding=True,
        return_tensors="pt",
        return_token_type_ids=_token_types(config),
    )


def _trim(enc: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows `idx`, cut to their longest real length (padding was to the whole split's longest), on `local_device()`."""
    mask = enc["attention_mask"][idx]
    width = int(mask.sum(1).max())  # host tensors: no device read
    return {k: v[idx, :width].to(local_device(), non_blocking=True) for k, v in enc.items()}


@torch.no_grad()
def encoder_features(
    model_dir: Path,
    task: Task,
    pooling: str = "mean",
    max_seq_len: int = 128,
    batch_size: int = 64,
    random_init: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen-encoder features [N, H] of train and dev: mean over real tokens, or the [CLS] vector."""
    from transformers import AutoModel

    if random_init:  # one random encoder whatever ran before in this process (features are computed once, not per seed)
        torch.manual_seed(0)
    tokenizer, cls_model = load_model(model_dir, task.num_labels, task.kind, random_init)
    base = getattr(cls_model, cls_model.base_model_prefix, None)
    encoder = base if base is not None else AutoModel.from_config(cls_model.config)
    encoder.eval().to(local_device())
    out = []
    for split_name, split in (("train", task.train), ("dev", task.dev)):
        enc = _encode(tokenizer, split, max_seq_len, cls_model.config)
        feats = []
        for idx in tqdm(
            list(batches(len(split[0]), batch_size)),
            desc=f"features {task.name}/{split_name}",
            unit="batch",
            file=sys.stderr,
            mininterval=1.0,
            leave=False,
        ):
            b = _trim(enc, idx)
            with autocast():
                hidden = encoder(**b).last_hidden_state.float()  # [B, L, H]
            if pooling == "cls":
                feats.append(hidden[:, 0])
            else:
                m = b["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
                feats.append((hidden * m).sum(1) / m.sum(1).clamp(min=1))
        out.append(torch.cat(feats).cpu())
    return out[0], out[1]


def train_probe(
    task: Task,
    train_x: torch.Tensor,
    dev_x: torch.Tensor,
    seed: int,
    epochs: int = 20,
    lr: float = 1e-2,
    batch_size: int = 64,
    weight_decay: float = 1e-4,
) -> tuple[dict[str, float], list]:
    """A linear head on fixed features (standardised with train statistics), minibatch AdamW."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mean, std = train_x.mean(0), train_x.std(0).clamp(min=1e-6)
    xs, xd = (train_x - mean) / std, (dev_x - mean) / std
    y = torch.tensor(task.train[2])
    head = torch.nn.Linear(xs.shape[1], task.num_labels)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    total = epochs * math.ceil(len(xs) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    for _ in range(epochs):
        for idx in batches(len(xs), batch_size, gen):
            out = head(xs[idx])
            loss = (
                F.mse_loss(out.squeeze(-1), y[idx].float())
                if task.kind == "regression"
                else F.cross_entropy(out, y[idx])
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        out = head(xd)
    return _score(task, out)


def _score(task: Task, out: torch.Tensor) -> tuple[dict[str, float], list]:
    """(metrics, per-example dev predictions: class indices, or scores for regression)."""
    labels = np.asarray(task.dev[2])
    preds = out.squeeze(-1).numpy() if task.kind == "regression" else out.argmax(-1).numpy()
    return task_metrics(task, preds, labels), preds.tolist()


def train_full(
    model_dir: Path,
    task: Task,
    seed: int,
    epochs: int = 3,
    lr: float = 5e-5,
    batch_size: int = 32,
    max_seq_len: int = 128,
    warmup_frac: float = 0.1,
    random_init: bool = False,
) -> tuple[dict[str, float], list]:
    """Fine-tune the whole model (`fit`: AdamW, linear warmup then linear decay to 0) and score dev."""
    torch.manual_seed(seed)  # the head's initialisation and dropout
    tokenizer, model = load_model(model_dir, task.num_labels, task.kind, random_init)
    model.to(local_device())
    train_enc, dev_enc = (_encode(tokenizer, split, max_seq_len, model.config) for split in (task.train, task.dev))
    y = torch.tensor(task.train[2])

    def loss_of(idx):
        labels = (y[idx].float() if task.kind == "regression" else y[idx]).to(local_device())
        return model(**_trim(train_enc, idx), labels=labels).loss

    fit(model, loss_of, len(y), seed, epochs, lr, batch_size, warmup_frac, f"finetune {task.name} seed {seed}")
    with torch.no_grad(), autocast():
        out = torch.cat([model(**_trim(dev_enc, idx)).logits.float() for idx in batches(len(task.dev[2]), 128)])
    return _score(task, out.cpu())


def summarize(per_seed: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """{metric: {mean, std, median}} over seeds; std is the sample std (ddof=1), 0 for one seed. The median is what
    GLUE papers report over fine-tuning seeds (one diverged seed moves the mean, not the median)."""
    out = {}
    for key in per_seed[0]:
        values = np.array([r[key] for r in per_seed])
        out[key] = {
            "mean": float(values.mean()),
            "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "median": float(np.median(values)),
        }
    return out


# ----------------------------------------------------------------------------------------------
# The protocol: a learning rate chosen on a part of train held out (never dev), then all of train, scored on dev


def heldout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit, held-out) indices of train's `n` examples, each sorted: the same split for every model, given the seed."""
    held = max(1, round(n * fraction))
    if held >= n:
        raise UserError(f"{n} training example(s) are too few to hold out {fraction:g} of them to choose the lr")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def _take(split: tuple, idx: np.ndarray) -> tuple:
    first, second, labels = split
    return [first[i] for i in idx], (None if second is None else [second[i] for i in idx]), [labels[i] for i in idx]


def heldout_task(task: Task | TokenTask, fit: np.ndarray, held: np.ndarray) -> Task | TokenTask:
    """The task as the sweep sees it: train is train's fit part, dev its held-out part; the real dev is not in it
    (and its name says so in what it warns of: a warning about 'dev' words during the sweep read as dev in use)."""
    name = f"{task.name} (held-out part of train)"
    return replace(task, name=name, train=_take(task.train, fit), dev=_take(task.train, held))


def sweep_lr(task: Task | TokenTask, cfg: FinetuneConfig, score) -> dict:
    """Each of cfg.lrs scored by `score(view, fit, held, lr)` (the main metric on the held-out part, trained on the
    rest of train); the best is chosen, the first of equal scores. Returns the record the results keep."""
    fit, held = heldout_split(len(task.train[2]), cfg.heldout_fraction, cfg.heldout_seed)
    view = heldout_task(task, fit, held)
    scores = [float(score(view, fit, held, lr)) for lr in cfg.lrs]
    best = int(np.argmax([s if math.isfinite(s) else -math.inf for s in scores]))
    return {
        "lrs": list(cfg.lrs),
        "heldout_scores": scores,
        "chosen": cfg.lrs[best],
        "metric": main_metric(task.name, task.kind, task.num_labels),
        "fit_examples": len(fit),
        "heldout_examples": len(held),
        "heldout_fraction": cfg.heldout_fraction,
        "heldout_seed": cfg.heldout_seed,
        "sweep_seeds": cfg.sweep_seeds,
    }


def _scores(model_dir: Path, task: Task | TokenTask, cfg: FinetuneConfig, seeds: list[int], features=None) -> dict:
    """One model on one task at cfg's (resolved) options, per seed; `features`: the probe's (train, dev) features."""
    if task.kind == "token":  # scored by chunk F1: see token_tasks
        return finetune_tokens(
            Path(model_dir), task, seeds, cfg.mode, cfg.epochs, cfg.lr, cfg.batch_size, cfg.max_seq_len, cfg.random_init
        )
    runs = []
    if cfg.mode == "probe":
        train_x, dev_x = features
        for seed in tqdm(seeds, desc=f"probe {task.name}", unit="seed", file=sys.stderr, leave=False):
            runs.append(train_probe(task, train_x, dev_x, seed, cfg.epochs, cfg.lr, cfg.batch_size))
    else:
        for seed in seeds:
            runs.append(
                train_full(
                    Path(model_dir),
                    task,
                    seed,
                    cfg.epochs,
                    cfg.lr,
                    cfg.batch_size,
                    cfg.max_seq_len,
                    random_init=cfg.random_init,
                )
            )
    return {
        "task": task.name,
        "kind": task.kind,
        "pair": task.pair,
        "num_labels": task.num_labels,
        "train_examples": len(task.train[2]),
        "dev_examples": len(task.dev[2]),
        "mode": cfg.mode,
        "seeds": list(seeds),
        "main_metric": main_metric(task.name, task.kind, task.num_labels),
        "precision": precision(),  # bf16 autocast on a GPU, fp32 on a CPU
        "per_seed": [metrics for metrics, _ in runs],
        "dev_labels": list(task.dev[2]),
        "dev_predictions": [predictions for _, predictions in runs],
    }


def run_finetune(model_dir: Path, task_dir: Path, seeds: list[int], cfg: FinetuneConfig) -> dict:
    """Scores of one model on one task over `seeds`: per seed, and mean/std/median per metric. With cfg.lrs, the
    learning rate is first chosen on a held-out part of train (`sweep_lr`, recorded as lr_sweep)."""
    if not seeds:
        raise UserError("at least one seed is needed")
    repeated = sorted({seed for seed in seeds if list(seeds).count(seed) > 1})
    if repeated:  # a seed run again is the same run: it would pass for another draw and shrink the spread
        raise UserError(
            f"seeds {list(seeds)} repeat {repeated}: give each seed once (--seed-list takes distinct seeds)"
        )
    cfg = cfg.check().resolved()
    cfg = replace(cfg, max_seq_len=fit_max_seq_len(Path(model_dir), cfg.max_seq_len))
    task = load_task(Path(task_dir), cfg.task_type, cfg.max_train)
    if getattr(task, "pair", False) and cfg.max_seq_len < MIN_PAIR_SEQ_LEN:  # 4 kept only B; 3 neither sentence
        raise UserError(
            f"--max-seq-len {cfg.max_seq_len} leaves a sentence pair of {task.name} no room for both sentences "
            f"([CLS] A [SEP] B [SEP]): give at least {MIN_PAIR_SEQ_LEN}"
        )
    features = None
    if cfg.mode == "probe" and task.kind != "token":  # computed once: they do not depend on the seed or the lr
        features = encoder_features(Path(model_dir), task, cfg.pooling, cfg.max_seq_len, random_init=cfg.random_init)

    def score(view, fit, held, lr) -> float:
        part = None if features is None else (features[0][torch.as_tensor(fit)], features[0][torch.as_tensor(held)])
        result = _scores(model_dir, view, replace(cfg, lr=lr), list(seeds)[: cfg.sweep_seeds], part)
        return float(np.mean([r[result["main_metric"]] for r in result["per_seed"]]))

    sweep = sweep_lr(task, cfg, score) if cfg.lrs else None
    if sweep is not None:
        cfg = replace(cfg, lr=sweep["chosen"])
    result = _scores(model_dir, task, cfg, list(seeds), features)
    return {
        **result,
        "task_dir": str(task_dir),
        "summary": summarize(result["per_seed"]),
        "lr": cfg.lr,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "max_seq_len": cfg.max_seq_len,
        "lr_sweep": sweep,
    }


def finetune(
    model_dir: Path,
    task_dir: Path,
    seeds: list[int],
    mode: str = DEFAULTS.mode,
    epochs: int | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    max_seq_len: int = DEFAULTS.max_seq_len,
    task_type: str = DEFAULTS.task_type,
    pooling: str = DEFAULTS.pooling,
    max_train: int = DEFAULTS.max_train,
    random_init: bool = DEFAULTS.random_init,
    lrs: list[float] | None = None,
    heldout_fraction: float = DEFAULTS.heldout_fraction,
    heldout_seed: int = DEFAULTS.heldout_seed,
    sweep_seeds: int = DEFAULTS.sweep_seeds,
) -> dict:
    """`run_finetune` with the options as arguments (the defaults are FinetuneConfig's; None = the mode's), typed and
    checked as a config file's."""
    options = dict(locals())
    options = {k: v for k, v in options.items() if k not in ("model_dir", "task_dir", "seeds") and v is not None}
    return run_finetune(Path(model_dir), Path(task_dir), seeds, from_dict(FinetuneConfig, options))


def format_finetune(result: dict) -> str:
    sweep = result.get("lr_sweep")
    chosen = (
        f", lr {result['lr']:g} chosen on {sweep['heldout_examples']} held-out train examples from "
        f"{', '.join(f'{lr:g}' for lr in sweep['lrs'])}"
        if sweep
        else (f", lr {result['lr']:g}" if "lr" in result else "")
    )
    lines = [
        f"{result['task']} ({result['kind']}, {'sentence pairs' if result['pair'] else 'single sentences'}, "
        f"{result['train_examples']} train / {result['dev_examples']} dev, {result['mode']}{chosen}, "
        f"seeds {result['seeds']}):"
    ]
    for key, s in result["summary"].items():
        lines.append(
            f"  {key:<9} {s['mean']:.4f} +- {s['std']:.4f}   median {s['median']:.4f}"
            + ("   <- main metric" if key == result["main_metric"] else "")
        )
    return "\n".join(lines)
