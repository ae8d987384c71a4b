"""`pretrain finetune`: downstream scores of an exported (or any HF BERT-family) model on GLUE-format TSV tasks.

A task directory holds train.tsv and dev.tsv with a header row: `sentence` (single sentence) or `sentence1`
and `sentence2` (pairs), and `label`. Integer or string labels make a classification task, non-integer
numbers a regression task. Scores are reported per seed and as mean and (sample) standard deviation.

Modes:
- full: fine-tune encoder and head (AdamW, linear warmup then decay, dropout on).
- probe: freeze the encoder and train a linear head on its features. The features do not depend on the seed,
  so they are computed once per model and task, and each seed only trains the head: seconds on a CPU.
  The seed spread of a probe therefore measures only the head's training, not the encoder's.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data_pipeline.tokenizer import TOKEN_TYPE_ARCHS, takes_token_types
from pretrain.core.errors import UserError

csv.field_size_limit(1 << 24)


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


def read_tsv(path: Path) -> tuple[list[str], list[str] | None, list[str]]:
    """Columns of a GLUE-format TSV; a malformed row fails naming the file and line."""
    if not path.is_file():
        raise UserError(f"{path}: task file not found (a task directory needs train.tsv and dev.tsv)")
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t")
        header = next(rows, None)
        if not header:
            raise UserError(f"{path}:1: empty file, expected a header row (sentence<TAB>label)")
        header = [h.strip() for h in header]
        if "label" not in header:
            raise UserError(f"{path}:1: no 'label' column in header {header}")
        if "sentence" in header:
            text_cols = [header.index("sentence")]
        elif "sentence1" in header and "sentence2" in header:
            text_cols = [header.index("sentence1"), header.index("sentence2")]
        else:
            raise UserError(f"{path}:1: header {header} needs 'sentence' or 'sentence1' and 'sentence2'")
        label_col = header.index("label")
        first, second, labels = [], [], []
        for row in rows:
            line = rows.line_num  # physical line, also right after a quoted field spanning lines
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) != len(header):
                raise UserError(f"{path}:{line}: {len(row)} tab-separated field(s), the header has {len(header)}")
            label = row[label_col].strip()
            if not label:
                raise UserError(f"{path}:{line}: empty label")
            first.append(row[text_cols[0]])
            if len(text_cols) == 2:
                second.append(row[text_cols[1]])
            labels.append(label)
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


def load_task(task_dir: Path, task_type: str = "auto", max_train: int = 0) -> Task:
    task_dir = Path(task_dir)
    train_1, train_2, train_y = read_tsv(task_dir / "train.tsv")
    dev_1, dev_2, dev_y = read_tsv(task_dir / "dev.tsv")
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
        raise UserError(f"task type '{task_type}' is not one of auto, classification, regression")
    if task_type == "classification" and integral:  # one name per class: '1.0' in train and '1' in dev agree
        train_y, dev_y = [str(int(float(y))) for y in train_y], [str(int(float(y))) for y in dev_y]
    if task_type == "regression":
        for split, ys in (("train.tsv", train_y), ("dev.tsv", dev_y)):
            bad = next((i for i, y in enumerate(ys) if not _is_float(y)), None)
            if bad is not None:
                raise UserError(f"{task_dir / split}: label '{ys[bad]}' of example {bad + 1} is not a number")
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
            raise UserError(f"{task_dir / 'dev.tsv'}: label(s) {unseen[:5]} never appear in train.tsv")
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
        return {"pearson": _pearson(predictions, labels), "spearman": _pearson(_rank(predictions), _rank(labels))}
    out = {"accuracy": float((predictions == labels).mean())}
    if task.num_labels == 2:
        out["mcc"] = matthews_corr(labels, predictions)
    return out


def main_metric(task_name: str, kind: str, num_labels: int) -> str:
    """The headline metric: GLUE's choice (MCC for CoLA, Pearson for regression), else accuracy."""
    if kind == "regression":
        return "pearson"
    return "mcc" if "cola" in task_name.lower() and num_labels == 2 else "accuracy"


# ----------------------------------------------------------------------------------------------
# Models


def load_model(model_dir: Path | None, num_labels: int, kind: str, random_init: bool = False):
    """(tokenizer, sequence-classification model). random_init: same config, untrained weights."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # the load report lists the MLM head as unused and the classifier as new: expected here, not news
    hf_logging.set_verbosity_error()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise UserError(
            f"{model_dir}: no config.json: not a HuggingFace model directory (export one with `pretrain export`)"
        )
    problem = "regression" if kind == "regression" else "single_label_classification"
    config = AutoConfig.from_pretrained(str(model_dir), num_labels=num_labels, problem_type=problem)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if random_init:
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    return tokenizer, model


def device() -> torch.device:
    """The GPU when there is one (bf16 autocast there, as transformers' Trainer with bf16), else the CPU in fp32."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _autocast():
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if torch.cuda.is_available()
        else torch.autocast("cpu", enabled=False)
    )


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


def _batches(n: int, batch_size: int, generator: torch.Generator | None = None):
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for i in range(0, n, batch_size):
        yield order[i : i + batch_size]


def _trim(enc: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows `idx`, cut to their longest real length (padding was to the whole split's longest), on `device()`."""
    mask = enc["attention_mask"][idx]
    width = int(mask.sum(1).max())  # host tensors: no device read
    return {k: v[idx, :width].to(device(), non_blocking=True) for k, v in enc.items()}


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

    tokenizer, cls_model = load_model(model_dir, task.num_labels, task.kind, random_init)
    base = getattr(cls_model, cls_model.base_model_prefix, None)
    encoder = base if base is not None else AutoModel.from_config(cls_model.config)
    encoder.eval().to(device())
    out = []
    for split_name, split in (("train", task.train), ("dev", task.dev)):
        enc = _encode(tokenizer, split, max_seq_len, cls_model.config)
        feats = []
        for idx in tqdm(
            list(_batches(len(split[0]), batch_size)),
            desc=f"features {task.name}/{split_name}",
            unit="batch",
            file=sys.stderr,
            mininterval=1.0,
            leave=False,
        ):
            b = _trim(enc, idx)
            with _autocast():
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
        for idx in _batches(len(xs), batch_size, gen):
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
    """Fine-tune the whole model: AdamW, linear warmup then linear decay to 0."""
    torch.manual_seed(seed)  # the head's initialisation and dropout
    gen = torch.Generator().manual_seed(seed)
    tokenizer, model = load_model(model_dir, task.num_labels, task.kind, random_init)
    model.to(device())
    train_enc, dev_enc = (_encode(tokenizer, split, max_seq_len, model.config) for split in (task.train, task.dev))
    y = torch.tensor(task.train[2])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = max(1, epochs * math.ceil(len(y) / batch_size))
    warmup = max(1, int(warmup_frac * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / (total - warmup + 1e-9)))
    )
    model.train()
    bar = tqdm(
        total=total,
        desc=f"finetune {task.name} seed {seed}",
        unit="step",
        file=sys.stderr,
        mininterval=1.0,
        leave=False,
    )
    for _ in range(epochs):
        for idx in _batches(len(y), batch_size, gen):
            labels = (y[idx].float() if task.kind == "regression" else y[idx]).to(device())
            with _autocast():
                loss = model(**_trim(train_enc, idx), labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(1)
            if bar.n % 50 == 0:  # reading the loss makes the host wait for the GPU: now and then
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    bar.close()
    model.eval()
    with torch.no_grad(), _autocast():
        out = torch.cat([model(**_trim(dev_enc, idx)).logits.float() for idx in _batches(len(task.dev[2]), 128)])
    return _score(task, out.cpu())


def summarize(per_seed: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """{metric: {mean, std}} over seeds; std is the sample std (ddof=1), 0 for one seed."""
    out = {}
    for key in per_seed[0]:
        values = np.array([r[key] for r in per_seed])
        out[key] = {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0}
    return out


def finetune(
    model_dir: Path,
    task_dir: Path,
    seeds: list[int],
    mode: str = "probe",
    epochs: int | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    max_seq_len: int = 128,
    task_type: str = "auto",
    pooling: str = "mean",
    max_train: int = 0,
    random_init: bool = False,
) -> dict:
    """Scores of one model on one task over `seeds`: per seed, and mean/std per metric."""
    if mode not in ("full", "probe"):
        raise UserError(f"mode '{mode}' is not one of full, probe")
    if pooling not in ("mean", "cls"):
        raise UserError(f"pooling '{pooling}' is not one of mean, cls")
    if not seeds:
        raise UserError("at least one seed is needed")
    task = load_task(Path(task_dir), task_type, max_train)
    runs = []
    if mode == "probe":
        train_x, dev_x = encoder_features(Path(model_dir), task, pooling, max_seq_len, random_init=random_init)
        for seed in tqdm(seeds, desc=f"probe {task.name}", unit="seed", file=sys.stderr, leave=False):
            runs.append(train_probe(task, train_x, dev_x, seed, epochs or 20, lr or 1e-2, batch_size or 64))
    else:
        for seed in seeds:
            runs.append(
                train_full(
                    Path(model_dir),
                    task,
                    seed,
                    epochs or 3,
                    lr or 5e-5,
                    batch_size or 32,
                    max_seq_len,
                    random_init=random_init,
                )
            )
    per_seed = [metrics for metrics, _ in runs]
    return {
        "task": task.name,
        "task_dir": str(task_dir),
        "kind": task.kind,
        "pair": task.pair,
        "num_labels": task.num_labels,
        "train_examples": len(task.train[2]),
        "dev_examples": len(task.dev[2]),
        "mode": mode,
        "seeds": list(seeds),
        "main_metric": main_metric(task.name, task.kind, task.num_labels),
        "per_seed": per_seed,
        "summary": summarize(per_seed),
        "dev_labels": list(task.dev[2]),
        "dev_predictions": [predictions for _, predictions in runs],
    }


def format_finetune(result: dict) -> str:
    lines = [
        f"{result['task']} ({result['kind']}, {'sentence pairs' if result['pair'] else 'single sentences'}, "
        f"{result['train_examples']} train / {result['dev_examples']} dev, {result['mode']}, "
        f"seeds {result['seeds']}):"
    ]
    for key, s in result["summary"].items():
        lines.append(
            f"  {key:<9} {s['mean']:.4f} +- {s['std']:.4f}"
            + ("   <- main metric" if key == result["main_metric"] else "")
        )
    return "\n".join(lines)
