"""Train, save, load and fingerprint the tokenizer (WordPiece, byte-level BPE or Unigram).

All three kinds use the same BERT special tokens [PAD] [UNK] [CLS] [SEP] [MASK] with ids 0..4 (also for
byte-level BPE, instead of RoBERTa's <s>...): the objectives and the model only ever see ids, and one set
of names keeps configs, the trainer and exported checkpoints uniform across kinds.

Sentence pairs are encoded as BERT does, [CLS] A [SEP] B [SEP] with token types 0..0 1..1 (the post-processor's pair
template), which is what `objectives.sentence_head.assemble_pair` builds for NSP and SOP. Whether a tokenizer
returns those types is a setting of the export (`copy_tokenizer_files`), not of the trained tokenizer: it depends on
the HF architecture, and the trained files stay byte-identical (the run fingerprint hashes tokenizer.json). So is
[MASK] taking the space before it in a BPE or Unigram export (`strip_space_before_mask`), and such an export
reading line breaks as the pipeline does (`join_lines_as_the_pipeline`).

`transformers` is imported lazily: shard workers import this module and only need `tokenizer_hash`.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data_pipeline.mixing import iter_documents_weighted
from data_pipeline.readers import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    describe_inputs,
    describe_skipped,
    iter_documents,
    iter_documents_sample,
)
from pretrain.core.config import DataConfig
from pretrain.core.errors import DataError, UserError
from pretrain.core.files import sha256_file
from pretrain.core.outputs import check_not_input, claim_output, exclusive_if_free, mark_output

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from pretrain.core.tokens import SpecialTokens

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
KINDS = ("wordpiece", "bpe", "unigram")
VOCAB_MULTIPLE = 64  # padded vocab keeps the embedding/output matmuls on tensor-core friendly shapes
FILLER = "[unused{}]"
MODEL_MAX_LENGTH = 512
MIN_FREQUENCY = DataConfig.min_frequency  # the one value a unigram tokenizer (which has no such option) takes
MAX_VOCAB_SIZE = 2**23  # 8.4M pieces, a cap chosen well past any vocabulary in use (~256k): 10^12 aborted the trainer


def tokenizer_hash(directory: str | os.PathLike) -> str:
    """Fingerprint of a tokenizer: sha256 of its tokenizer.json."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"no tokenizer.json in {directory} — train the tokenizer first")
    return sha256_file(path)


def _build(kind: str, lowercase: bool, strip_accents: bool):
    """An untrained `tokenizers.Tokenizer` and its trainer class/options for `kind`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        return tok, trainers.WordPieceTrainer, {"continuing_subword_prefix": "##"}

    steps = [normalizers.NFKC()]
    if strip_accents:  # the nonspacing marks, as BertNormalizer: StripAccents also took spacing ones (Mc), the vowel
        # signs of Indic scripts ('हिन्दी' became 'हनद')
        steps += [normalizers.NFD(), normalizers.Replace(Regex(r"\p{Mn}"), ""), normalizers.NFC()]
    if lowercase:
        steps.append(normalizers.Lowercase())
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        return tok, trainers.BpeTrainer, {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
    if kind == "unigram":
        tok = Tokenizer(models.Unigram())
        # Metaspace splits words at ' ' only: a tab or newline stayed inside a piece, as [UNK] joining two words
        steps.append(normalizers.Replace(Regex(r"\s+"), " "))
        tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        return tok, trainers.UnigramTrainer, {"unk_token": "[UNK]"}
    raise DataError(f"data.tokenizer_type: '{kind}' is not one of {', '.join(KINDS)}")


def _pad_vocab(tok):
    """`tok` with [unusedN] fillers appended to the model vocab until its size is a multiple of 64.

    Fillers go into the model's own vocab (as BERT's vocab.txt does), not as added tokens, so they never
    match text; the padded ids only give the embedding matrix a friendly shape.
    """
    from tokenizers import Tokenizer

    size = tok.get_vocab_size(with_added_tokens=True)
    missing = -size % VOCAB_MULTIPLE
    if not missing:
        return tok
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if spec["model"]["type"] == "Unigram":  # list of [piece, log-prob]; fillers must never win a segmentation
        vocab.extend([FILLER.format(i), -1e6] for i in range(missing))
    else:  # dict piece -> id
        vocab.update({FILLER.format(i): size + i for i in range(missing)})
    return Tokenizer.from_str(json.dumps(spec))


def _lines(documents, paths: list[str], text_field: str) -> _Counted:
    """The lines to train on, from `documents(skipped)`; no document at all is an empty corpus, named with why."""
    skipped: collections.Counter = collections.Counter()
    docs = documents(skipped)
    first = next(docs, None)
    if first is None:  # every input was read through: the counts say why nothing was left
        raise DataError(
            f"empty corpus: no usable documents in {describe_inputs(paths)}: {describe_skipped(skipped, text_field)}"
        )
    return _Counted(_training_text(itertools.chain([first], docs)), describe_inputs(paths), skipped)


class _Counted:
    """An iterator of lines that counts what it gave; `where`: the inputs they come from, for an error; `skipped`:
    the documents the reading skipped, by reason, counted as it goes."""

    def __init__(self, lines: Iterator[str], where: str, skipped: collections.Counter):
        self.lines, self.count, self.where, self.skipped = lines, 0, where, skipped

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = next(self.lines)
        self.count += 1
        return line


def _training_text(documents) -> Iterator[str]:
    # Lines, not whole documents: Unigram seeds pieces per "sentence" and very long inputs slow it down.
    for doc in documents:
        for line in doc.text.split("\n"):
            if line.strip():
                yield line


def _continuation_alphabet(kind: str, lowercase: bool, strip_accents: bool, texts: Iterator[str]) -> list[str]:
    """WordPiece's '##x' pieces, sorted. The trainer creates them while iterating a hash map of words, so their ids,
    and through them the ties between equally frequent merges, change from one process to the next
    (huggingface/tokenizers#1794). Registered up front, they get fixed ids and training is deterministic. This runs
    the trainer once without merges (vocab_size 1): the pieces are exactly the ones it would create."""
    from tokenizers import trainers

    tok, _, _ = _build(kind, lowercase, strip_accents)
    tok.train_from_iterator(
        texts,
        trainers.WordPieceTrainer(
            vocab_size=1, special_tokens=SPECIALS, show_progress=False, continuing_subword_prefix="##"
        ),
    )
    return sorted(p for p in tok.get_vocab() if p.startswith("##") and len(p) > 2)


_UNIGRAM_PENALTY = 1e-4  # tokenizers' UnigramTrainer: step between the scores of required chars it had to add


def _canonical_unigram(pieces: list[list]) -> list[list]:
    """Unigram pieces [[piece, log-prob]] in a fixed order with fixed scores. The trainer's EM sums floats in
    hash-map order (the last digits vary: rounded to 1e-6 here, far below any difference a segmentation turns on),
    and it adds the required characters it never learned at min_score + k * 1e-4, k in hash-set order. Those rungs
    (single characters at low + k * 1e-4, k = 0, 1, ... without a gap; k = 0 ties the lowest learned piece) are
    given k again in code-point order. Equal scores are ordered by piece."""
    scored = [[piece, round(score, 6)] for piece, score in pieces]
    low = min(score for _, score in scored)
    rungs: dict[int, list[list]] = {}
    for entry in scored:
        k = round((entry[1] - low) / _UNIGRAM_PENALTY)
        if len(entry[0]) == 1 and abs(entry[1] - (low + k * _UNIGRAM_PENALTY)) < 2e-6:
            rungs.setdefault(k, []).append(entry)
    ladder, k = [], 0
    while k in rungs:
        ladder += rungs[k]
        k += 1
    for k, entry in enumerate(sorted(ladder, key=lambda ps: ps[0])):
        entry[1] = round(low + k * _UNIGRAM_PENALTY, 6)
    return sorted(scored, key=lambda ps: (-ps[1], ps[0]))


def _canonical(tok, kind: str):
    """`tok` with a byte-identical vocabulary across runs. WordPiece: the '##x' pieces registered as trainer
    specials are plain vocabulary again (not added tokens). Unigram: see `_canonical_unigram`."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIALS]
    if kind == "unigram":
        vocab = spec["model"]["vocab"]  # [[piece, log-prob]]: SPECIALS first, then the learned pieces
        spec["model"]["vocab"] = vocab[: len(SPECIALS)] + _canonical_unigram(vocab[len(SPECIALS) :])
    return Tokenizer.from_str(json.dumps(spec))


def _output_dir(out: Path, paths: list[str]) -> Path:
    """The directory to (re)place, once `out` is known to hold no input, to be ours to replace (`claim_output`), and
    not to hold the current directory: `out` itself, or the directory a symlink `out` points to (the link is kept)."""
    check_not_input(out, {f"the corpus file {p}": p for p in paths})
    claim_output(out, "tokenizer", "the tokenizer directory")  # --out, or a config's data.tokenizer
    real = Path(os.path.realpath(out))
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        # Swapping in the new directory renames this one away: the shell would be left in a deleted directory.
        where = "is" if real == cwd else "holds"
        raise UserError(
            f"--out {out} {where} the current directory, which a new tokenizer replaces as a whole: name a "
            f"directory for it, e.g. --out {out / 'tokenizer'}"
        )
    return real


def _check_training_settings(kind: str, vocab_size: int, min_frequency: int) -> None:
    """Values the trainer would crash on, or ignore, refused before anything is read or written."""
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:  # 10^12: the trainer's allocation aborted the process, no message
        raise DataError(f"vocab_size must be within 1..{MAX_VOCAB_SIZE:,}, got {vocab_size:,}")
    if min_frequency < 0:  # an OverflowError from the trainer
        raise DataError(f"min_frequency must be >= 0, got {min_frequency}")
    if kind == "unigram" and min_frequency != MIN_FREQUENCY:
        raise DataError(
            f"data.min_frequency={min_frequency} has no effect on a unigram tokenizer (its trainer keeps pieces by "
            f"likelihood, not by count): leave it at {MIN_FREQUENCY}, or train wordpiece or bpe"
        )


def train_tokenizer(
    paths: list[str],
    out_dir: str | os.PathLike,
    kind: str = "wordpiece",
    vocab_size: int = 8192,
    lowercase: bool = True,
    strip_accents: bool = True,
    min_frequency: int = MIN_FREQUENCY,
    text_field: str = "text",
    text_documents: str = "paragraphs",
    sample_docs: int = 0,
    show_progress: bool = True,
    on_bad: str = "skip",
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    sources: list[tuple[list, float]] | None = None,
    recorded: dict | None = None,
) -> PreTrainedTokenizerFast:
    """Train a tokenizer on the corpus, streamed, into `out_dir`. The same corpus and settings give byte-identical
    files.

    `sources`: the corpus as weighted sources, (inputs, weight) each, `paths` being all their inputs; with
    sample_docs > 0 each source gives its weight's share of the documents (`mixing.iter_documents_weighted`).

    `recorded`: more data.* values to record with the settings (`trained_settings`), keyed as DataConfig's fields: the
    config's data.corpus and data.sources as written (`paths` are their expanded files, which a config never equals).

    min_frequency: how often a pair of pieces must occur to be merged (WordPiece and BPE). Unigram's trainer has no
    such threshold (it prunes pieces by likelihood), so a value other than the default is refused for it rather
    than ignored.

    sample_docs > 0 trains on about that many documents spread over all inputs (the first
    ceil(sample_docs / inputs) of each): a vocabulary converges long before a large corpus ends, and only
    the sampled part of each file is read. Memory is the trainer's word counts, not the corpus.

    `out_dir` must be absent, empty or a tokenizer directory of ours (`pretrain.core.outputs.claim_output`), and hold no
    input, nor the current directory. The directory appears atomically: it is written to `<out_dir>.tmp-<pid>` and
    renamed into place (entries of the old one that are not tokenizer files are carried into it). A symlink `out_dir`
    is written through: its target is replaced, the link kept.
    """
    _check_training_settings(kind, vocab_size, min_frequency)
    out = _output_dir(Path(out_dir), paths)
    _check_not_in_use(out)  # before the training: its work would be in vain
    built = _build(kind, lowercase, strip_accents)
    read = dict(text_field=text_field, on_bad=on_bad, max_document_bytes=max_document_bytes)
    read.update(text_documents=text_documents)

    def documents(skipped=None):
        if sample_docs > 0 and sources:
            groups, weights = [g for g, _ in sources], [w for _, w in sources]
            return iter_documents_weighted(groups, weights, sample_docs, skipped=skipped, **read)
        if sample_docs > 0:
            return iter_documents_sample(paths, sample_docs, skipped=skipped, **read)
        return iter_documents(paths, skipped=skipped, **read)

    trainer = dict(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress)
    lines = _lines(documents, paths, text_field)
    tok = _train(kind, built, lowercase, strip_accents, trainer, lines, documents)
    if sum(lines.skipped.values()):  # said as the shards' build says it: a corpus mostly skipped trained on the rest
        print(f"[data] tokenizer: {describe_skipped(lines.skipped, text_field)}", file=sys.stderr, flush=True)
    fast = _wrap(tok, lowercase, strip_accents)
    settings = dict(
        tokenizer_type=kind,
        vocab_size=vocab_size,
        lowercase=lowercase,
        strip_accents=strip_accents,
        min_frequency=min_frequency,
        text_documents=text_documents,
        text_field=text_field,
        tokenizer_sample_docs=sample_docs,
        max_document_bytes=max_document_bytes,
        **(recorded or {}),
    )
    _save_atomically(fast, out, settings)
    return fast


# Beside the tokenizer's own files: the data.* settings it was trained with (keys as the config's), so that a run
# whose config now asks for others trains a new one rather than going on with this (`trained_settings`). The file of
# an older version lacks some (text_field, tokenizer_sample_docs, max_document_bytes, corpus, sources): only the keys
# a file has are compared.
SETTINGS_FILE = "training_settings.json"


def trained_settings(directory: str | os.PathLike) -> dict | None:
    """The settings `train_tokenizer` recorded in `directory`; None for a tokenizer it did not train (or an older
    version of it did)."""
    try:
        settings = json.loads((Path(directory) / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return settings if isinstance(settings, dict) else None


def _train(kind: str, built: tuple, lowercase: bool, strip_accents: bool, trainer: dict, docs, documents):
    """The trained, canonical tokenizer with BERT's [CLS]/[SEP] template and its vocabulary padded. `built` is
    `_build`'s (tokenizer, trainer class, options); `docs` the lines to train on (`_Counted`); `documents()` a fresh
    pass over the corpus (WordPiece reads it once more for its alphabet)."""
    from tokenizers import processors

    tok, trainer_cls, options = built
    specials = list(SPECIALS)
    if kind == "wordpiece":
        specials += _continuation_alphabet(kind, lowercase, strip_accents, _training_text(documents()))
    trainer_options = dict(
        vocab_size=trainer["vocab_size"], special_tokens=specials, show_progress=trainer["show_progress"], **options
    )
    if kind != "unigram":
        trainer_options["min_frequency"] = trainer["min_frequency"]
    tok.train_from_iterator(docs, trainer_cls(**trainer_options))
    if not docs.count:  # documents of Unicode spaces only (a .txt's blank test sees ASCII ones): nothing was learned
        raise DataError(
            f"empty corpus: the documents of {docs.where} hold only whitespace, nothing to train a tokenizer on"
        )
    tok = _canonical(tok, kind)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    if [ids[t] for t in SPECIALS] != list(range(len(SPECIALS))):
        raise AssertionError(f"special token ids {ids} are not 0..4")  # a trainer contract broke: a bug
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    return _pad_vocab(tok)


def _wrap(tok, lowercase: bool, strip_accents: bool) -> PreTrainedTokenizerFast:
    """The HuggingFace tokenizer over `tok`, with BERT's special tokens and right padding."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=MODEL_MAX_LENGTH,
        do_lower_case=lowercase,
        strip_accents=strip_accents,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        padding_side="right",
    )


def _in_use(out: Path) -> str:
    return (
        f"{out} holds the tokenizer a run is training with (it reads it now): train this one into another directory "
        f"(--out, data.tokenizer); {out} was left as it was"
    )


def _check_not_in_use(out: Path) -> None:
    """Refuse to train into a tokenizer directory that a run holds `shared` while it trains
    (`pretrain.train.trainer.reading_data`): its shards and checkpoints are of the tokenizer there."""
    if (out / "tokenizer.json").is_file():
        with exclusive_if_free(out) as free:
            if not free:
                raise DataError(_in_use(out))


def _save_atomically(fast: PreTrainedTokenizerFast, out: Path, settings: dict) -> None:
    """Write the tokenizer (and the `settings` it was trained with) to `<out>.tmp-<pid>` and rename it into place, so
    `out` is never half-written. Entries of an old `out` that are not tokenizer files (the user's notes, an eval/
    directory) are carried into the new one first, and put back if the swap fails: never deleted with the old. Not
    while a run trains with the old one (`_check_not_in_use`): the new one is kept at `<out>.tmp-<pid>` then."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    carried: list[str] = []
    kept = False
    try:
        fast.save_pretrained(tmp)
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")
        mark_output(tmp, "tokenizer")
        with exclusive_if_free(out) as free:
            if not free:  # a run started on the old one while this one trained
                kept = True
                raise DataError(f"{_in_use(out)}; the tokenizer trained now is in {tmp}")
            if out.exists():  # os.replace cannot overwrite a non-empty directory: move the old one aside first
                ours = {p.name for p in tmp.iterdir()} | set(TOKENIZER_FILES) | {SETTINGS_FILE}
                for entry in sorted(out.iterdir()):
                    if entry.name not in ours:
                        os.replace(entry, tmp / entry.name)
                        carried.append(entry.name)
                os.replace(out, old)
            os.replace(tmp, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.replace(old, out)
        for name in carried:  # back where they were (unless the swap went through before the interruption)
            if (tmp / name).exists():
                os.replace(tmp / name, out / name)
        raise
    finally:  # removed only when nothing there is the only copy of something: the user's entries, the old tokenizer
        if not kept and not any((tmp / name).exists() for name in carried):
            shutil.rmtree(tmp, ignore_errors=True)
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)


# The files a HuggingFace tokenizer directory may hold; a `model.init_from` checkpoint also holds weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _replace_json(path: Path, data: dict, sort_keys: bool = False) -> None:
    """An export's tokenizer file rewritten beside itself and renamed into place (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# HF architectures whose models add segment (token type) embeddings, and whose tokenizers return token_type_ids for
# a pair as BertTokenizer does (transformers 5's AlbertTokenizer stopped, huggingface/transformers#48128; 4.x did).
# RoBERTa's and ModernBERT's tokenizers return none: RoBERTa was pretrained without segments, ModernBERT has no types.
TOKEN_TYPE_ARCHS = ("bert", "albert", "electra")
MODEL_INPUTS = ["input_ids", "token_type_ids", "attention_mask"]


def takes_token_types(model_type: str | None, type_vocab_size: int = 2) -> bool:
    """Whether a tokenizer for this HF architecture should return token_type_ids: an architecture with segment
    embeddings and room for type 1 (with one type, B's ones would index past the table). None: unknown, as BERT."""
    return (model_type is None or model_type in TOKEN_TYPE_ARCHS) and type_vocab_size > 1


# In an export: the hashes of the tokenizer.json it was exported from (and that one's own sources). An export's
# tokenizer.json adds steps for transformers' callers only (`strip_space_before_mask`, `join_lines_as_the_pipeline`:
# the same ids for the text pretraining read), so shards built with the run's tokenizer are the export's too.
SOURCE_FILE = "exported_from_tokenizer.json"


def tokenizer_hashes(directory: str | os.PathLike) -> tuple[str, ...]:
    """`tokenizer_hash` of `directory`, then those of the tokenizers it was exported from (`record_source`), where
    the record is of the tokenizer.json there now (one replaced since is its own alone): the shards of any of them are
    read with it."""
    own = tokenizer_hash(directory)
    try:
        record = json.loads((Path(directory) / SOURCE_FILE).read_text())
        recorded, of = record["from"], record["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return (own,)
    if of != own or not isinstance(recorded, list):
        return (own,)
    return (own, *[h for h in recorded if isinstance(h, str) and h != own])


def record_source(tokenizer_dir: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Record in `dest` (an export's tokenizer, copied from `tokenizer_dir` and edited) which tokenizers it reads as:
    the hash of its own tokenizer.json, and those of `tokenizer_dir` (`tokenizer_hashes`)."""
    record = {"sha256": tokenizer_hash(dest), "from": list(tokenizer_hashes(tokenizer_dir))}
    (Path(dest) / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")


def read_tokenizer_files(tokenizer_dir: str | os.PathLike) -> dict[str, bytes]:
    """The tokenizer's own files (`TOKENIZER_FILES`), read once: a run keeps the tokenizer it trains with this way,
    and writes it into each checkpoint, whatever becomes of the directory meanwhile."""
    return {n: (Path(tokenizer_dir) / n).read_bytes() for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()}


def files_hash(files: dict[str, bytes]) -> str:
    """`tokenizer_hash` of files read by `read_tokenizer_files`."""
    return hashlib.sha256(files["tokenizer.json"]).hexdigest()


def copy_tokenizer_files(
    tokenizer: str | os.PathLike | dict[str, bytes],
    dest: str | os.PathLike,
    hf_config: Any = None,
    max_length: int | None = None,
) -> None:
    """The tokenizer's own files (from its directory, or as `read_tokenizer_files` read them) into `dest` (exports and
    checkpoints carry the tokenizer): not our output marker, nor the weights of a checkpoint directory that doubles
    as the tokenizer directory. Unchanged but for `model_input_names` in
    tokenizer_config.json, which decides whether transformers returns token_type_ids (`takes_token_types` of
    `hf_config`, the export's transformers config: its model_type and type_vocab_size; None: as BERT), and, given
    `max_length` (the longest input the export's position table holds), `model_max_length` capped at it: with
    truncation=True transformers then cuts inputs to what the model takes, rather than to 512 past its table."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, dict):
        for name, data in tokenizer.items():
            (dest / name).write_bytes(data)
    else:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer) / name).is_file():
                shutil.copy2(Path(tokenizer) / name, dest / name)
    model_type = getattr(hf_config, "model_type", None) if hf_config is not None else None
    type_vocab_size = getattr(hf_config, "type_vocab_size", 2) if hf_config is not None else 2
    set_model_inputs(dest, takes_token_types(model_type, type_vocab_size), max_length)


# Models whose pieces carry the space before a word ('Ġthe', '▁the'); WordPiece's pre-tokenizer drops spaces instead.
_SPACE_IN_PIECES = ("BPE", "Unigram")


def strip_space_before_mask(directory: str | os.PathLike) -> None:
    """Make the mask token of `directory`'s tokenizer.json take the spaces before it (lstrip, as RoBERTa's <mask>)
    where the model's pieces carry a word's leading space (byte-level BPE, Unigram). Without it "the [MASK] of" gave
    'Ġthe', 'Ġ', '[MASK]', 'Ġof': a lone space piece before the mask, which pretraining (whose masks replace a
    word's pieces, its space included) never showed the model. For exports only: the run's own tokenizer.json is
    fingerprinted and stays byte-identical. A file already so, or of another model, is left untouched."""
    path = Path(directory) / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    if (spec.get("model") or {}).get("type") not in _SPACE_IN_PIECES:
        return
    config_path = Path(directory) / "tokenizer_config.json"
    mask = json.loads(config_path.read_text(encoding="utf-8")).get("mask_token") if config_path.is_file() else None
    mask = mask.get("content") if isinstance(mask, dict) else mask or "[MASK]"
    tokens = [t for t in spec.get("added_tokens", []) if t.get("content") == mask and not t.get("lstrip")]
    if not tokens:
        return
    for token in tokens:
        token["lstrip"] = True
    _replace_json(path, spec)


# What the pipeline does to text before a tokenizer whose pieces carry spaces sees it, as normalizers: lines are always
# sentence boundaries (`sentences._LINES`) and each sentence is encoded stripped. No newline, nor a space at either end
# of a line, ever reached the model.
_PIPELINE_LINES = [
    {"type": "Replace", "pattern": {"Regex": "\\s*\\n\\s*"}, "content": " "},
    {"type": "Strip", "strip_left": True, "strip_right": True},
]


def join_lines_as_the_pipeline(directory: str | os.PathLike) -> None:
    """Make a byte-level BPE or Unigram tokenizer.json in `directory` read a line break (with the whitespace around
    it) as one space, and drop whitespace at either end of the text, as the pipeline did. A multi-line text gave BPE
    'Ċ' pieces the model never saw in pretraining and cut the next line's first word without its 'Ġ'; a trailing
    space gave both a lone space piece. For exports only, like `strip_space_before_mask`; WordPiece (whose pieces
    carry no spaces) is left untouched, as is a file that has these steps."""
    path = Path(directory) / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    if (spec.get("model") or {}).get("type") not in _SPACE_IN_PIECES:
        return
    normalizer = spec.get("normalizer")
    steps = normalizer.get("normalizers", []) if (normalizer or {}).get("type") == "Sequence" else [normalizer]
    steps = [step for step in steps if step]
    if steps[-len(_PIPELINE_LINES) :] == _PIPELINE_LINES:
        return
    spec["normalizer"] = {"type": "Sequence", "normalizers": [*steps, *_PIPELINE_LINES]}
    _replace_json(path, spec)


def set_model_inputs(directory: str | os.PathLike, token_types: bool, max_length: int | None = None) -> None:
    """Record in `directory`'s tokenizer_config.json whether the tokenizer returns token_type_ids. Its class's default
    would decide otherwise: transformers 5's generic TokenizersBackend (what ours load as) returns none, so a pair
    reached a BERT as one segment, B typed 0 like A. With `max_length`, model_max_length is capped at it. The class is
    named as transformers 4 and 5 both know it."""
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config["model_input_names"] = [n for n in MODEL_INPUTS if token_types or n != "token_type_ids"]
    if config.get("tokenizer_class") == "TokenizersBackend":
        # transformers 5's name for its generic fast tokenizer, which transformers 4's AutoTokenizer cannot find (an
        # export on the hub would not load there); PreTrainedTokenizerFast names the same class in both
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if max_length is not None:
        declared = config.get("model_max_length")
        real = isinstance(declared, (int, float)) and 0 < declared < 1e9  # no limit is stored as ~1e30
        config["model_max_length"] = int(min(declared, max_length)) if real else int(max_length)
    _replace_json(path, config, sort_keys=True)


def load_tokenizer(directory: str | os.PathLike) -> PreTrainedTokenizerFast:
    """The tokenizer saved in `directory` by `train_tokenizer` (or any HF fast tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    if not (Path(directory) / "tokenizer.json").is_file():
        raise DataError(f"no tokenizer.json in {directory} — train the tokenizer first")
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    except Exception as e:  # any load failure is a bad directory, reported as such
        raise DataError(f"cannot load the tokenizer in {directory}: {e}") from e


def special_tokens(tokenizer: PreTrainedTokenizerFast) -> SpecialTokens:
    """Ids the objectives need; `replaceable` excludes special tokens and [unusedN] fillers."""
    from pretrain.core.tokens import SpecialTokens

    ids = {}
    for name in ("pad", "unk", "cls", "sep", "mask"):
        value = getattr(tokenizer, f"{name}_token_id")
        if value is None:
            raise DataError(
                f"tokenizer {tokenizer.name_or_path} has no {name} token: pretraining needs a pad, unk, cls, sep and "
                "mask token (named in its special_tokens_map.json or tokenizer_config.json)"
            )
        ids[name] = int(value)
    size = len(tokenizer)
    excluded = set(ids.values()) | set(tokenizer.all_special_ids)
    excluded |= {i for t, i in tokenizer.get_vocab().items() if t.startswith("[unused") and t.endswith("]")}
    keep = np.ones(size, dtype=bool)  # [vocab]
    keep[[i for i in excluded if i < size]] = False
    return SpecialTokens(**ids, vocab_size=size, replaceable=np.flatnonzero(keep).astype(np.int64))
