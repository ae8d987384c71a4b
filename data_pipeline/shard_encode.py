"""Parallel tokenization of shard chunks: each worker process tokenizes a chunk of documents into a shard's
arrays (token ids, word starts, sentence and document offsets) and writes them under the build's tmp dir.

Each distinct word is tokenized once and the rest gathered with numpy (`_encode_words`): BERT-pipeline tokenizers
split at spaces (`_word_fast_path`), byte-level BPE and Metaspace tokenizers at a space before a non-space
(`_chunk_fast_path`); other tokenizers go through encode_batch. `run_workers` keeps a bounded number of chunks in
flight so memory does not grow with the corpus.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import multiprocessing as mp
import os
import re
import unicodedata
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from data_pipeline.sentences import split_sentences
from data_pipeline.shard_format import shard_name
from pretrain.core.files import sha256_file, writing

_worker: dict = {}
_ENCODE_DOCS = 256
"""Documents tokenized per encode_batch call. A tokenizers Encoding costs ~100 bytes per token; taking a
shard's documents in slices and keeping only compact numpy arrays bounds a worker's memory by the slice."""


# The characters the BERT normalizer turns into a space (Rust's char::is_whitespace minus the control
# characters, which it deletes instead): every other step of BERT normalization, pre-tokenization and
# WordPiece acts within a run of text between two of these, so such a run always tokenizes the same.
_BERT_SPACE = re.compile("[ \t\n\r\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")
# Characters Python's str.split() splits on but BERT deletes (controls): text without them can use the
# much faster str.split(), which splits on exactly the BERT spaces then.
_NOT_BERT_SPACE = re.compile("[\x0b\x0c\x1c-\x1f\x85]")
# Where a slice's words were new more often than this (hashes, numbers, code: a cache pays only for words that
# repeat), encode_batch is faster than the word paths (0.6x of it where no word repeats, level at ~25% new words; a
# slice of English prose has 16% new words on an empty cache, 5% after five); every 8th such slice tries them again.
_NEW_WORDS_MAX = 0.25
_RETRY_EVERY = 8
# words -> ids (and a chunk's word starts) per worker: ~45 MB, ~75 MB with the starts; cleared when full
_WORD_CACHE_MAX = 200_000
# Where byte-level BPE's and Metaspace's words always start: at a space with a non-space after it. Metaspace starts a
# word at every space; GPT-2's regex takes such a space with what follows (' ?\p{L}+' and the like) and ends a run of
# spaces before it ('\s+(?!\S)'). Python's \s holds all of the regex's (and \x1c-\x1f): a split it misses is safe.
_CHUNK_SPACE = re.compile(r"(?= \S)")


def _word_fast_path(tok) -> np.ndarray | None:
    """[vocab] bool table of WordPiece continuation pieces ('##ing') when the tokenizer is BERT's pipeline
    (BertNormalizer, BertPreTokenizer, WordPiece), else None.

    For that pipeline (a) a token starts a word exactly when it is not a continuation piece, and (b) text
    can be tokenized one space-separated word at a time (see _BERT_SPACE). Natural text repeats its words
    (a 256-document slice has ~10x more words than distinct ones), so tokenizing only unseen words and
    gathering the rest with numpy is several times faster than encode_batch, and gives the same ids (the
    tests compare both paths). Other tokenizers (byte-level BPE and Metaspace keep the spaces in their
    tokens) go through encode_batch.
    """
    from tokenizers import models, normalizers, pre_tokenizers

    if not (
        isinstance(tok.model, models.WordPiece)
        and isinstance(tok.normalizer, normalizers.BertNormalizer)
        and isinstance(tok.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
    ):
        return None
    if any(" " in t.content for t in tok.get_added_tokens_decoder().values()):
        return None  # an added token spanning a space would be split by the word path
    prefix = tok.model.continuing_subword_prefix
    table = np.zeros(tok.get_vocab_size(with_added_tokens=True), bool)
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        table[i] = piece.startswith(prefix) and len(piece) > len(prefix)
    return table


def _chunk_fast_path(tok):
    """A copy of `tok` without its normalizer when `tok` is a byte-level BPE (GPT-2's regex) or a Metaspace tokenizer
    with a deterministic model, else None.

    Its text, once normalized, tokenizes one chunk at a time, a chunk starting at each space with a non-space after it
    (_CHUNK_SPACE): the pre-tokenizer starts a word there, and BPE and Unigram tokenize each word alone. Chunks (' the',
    ' world.') repeat as words do, so `_encode_words` tokenizes each distinct one once with this copy, the sentence
    normalized by `tok`'s normalizer beforehand (the copy must not normalize again: NFKC after lowercasing is not a
    no-op). Word starts within a chunk are its pre-tokenizer words; the tests compare both paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    pre, model = tok.pre_tokenizer, tok.model
    splits_words = (isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex) or (
        isinstance(pre, pre_tokenizers.Metaspace) and pre.split
    )
    deterministic = isinstance(model, models.Unigram) or (isinstance(model, models.BPE) and not model.dropout)
    # an added token that is not special would be matched in the text, across chunks too
    if not (splits_words and deterministic and all(t.special for t in tok.get_added_tokens_decoder().values())):
        return None
    chunked = Tokenizer.from_str(tok.to_str())
    chunked.normalizer = None
    chunked.encode_special_tokens = True
    return chunked


_ASCII_SPACES = re.compile("[\t\n\x0b\x0c\r ]+")  # Rust's \s+ within ASCII (Python's \s adds \x1c-\x1f)


def _ascii_normalizer(normalizer) -> Callable[[str], str] | None:
    """`normalizer` as Python string operations that give the same text for ASCII text, when all its steps are known,
    else None. Normalizing costs the tokenizers library ~150 ns a character (it tracks each one's alignment), a third
    of a chunked shard build; on ASCII, Unicode normalization and accent stripping change nothing and the rest are
    str.lower, str.replace and a regex."""
    if normalizer is None:
        return lambda text: text
    spec = json.loads(normalizer.__getstate__())
    steps, ops = spec["normalizers"] if spec["type"] == "Sequence" else [spec], []
    for step in steps:
        kind, pattern, content = step["type"], step.get("pattern", {}), step.get("content", "")
        if kind == "Lowercase":
            ops.append(str.lower)
        elif kind == "Replace" and content.isascii() and pattern.get("String"):
            ops.append(
                functools.partial(lambda text, old, new: text.replace(old, new), old=pattern["String"], new=content)
            )
        elif kind == "Replace" and content.isascii() and pattern.get("Regex") == r"\s+":
            ops.append(functools.partial(_ASCII_SPACES.sub, content))
        elif not (
            kind in ("NFC", "NFD", "NFKC", "NFKD", "StripAccents")
            or (kind, pattern) == ("Replace", {"Regex": r"\p{Mn}"})
        ):
            return None  # (those change no ASCII character)
    return functools.partial(functools.reduce, lambda text, op: op(text), ops)


def _is_punctuation(c: str) -> bool:
    """BERT's punctuation (its BasicTokenizer's `_is_punctuation`): the ASCII symbols and Unicode's P categories."""
    cp = ord(c)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or unicodedata.category(c)[0] == "P"


def _piece_edges(tok) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[vocab] bool tables of the pieces whose text begins with punctuation, ends with it, or is spaces alone ('Ġ',
    'ĊĊ', '▁'); the added (special) tokens are none of them. Word starts from the pre-tokenizer's words differed by
    tokenizer kind: Metaspace (Unigram) splits at spaces only, so "causes." or "don't" was one word to mask, where
    BERT's words, and byte-level BPE's mostly, make a punctuation mark a word of its own (`_encode_slice`)."""
    from tokenizers import models

    size = tok.get_vocab_size(with_added_tokens=True)
    if isinstance(tok.model, models.WordPiece):  # its decoder keeps a lone piece's '##', which is not punctuation
        prefix = tok.model.continuing_subword_prefix
        pieces = [tok.id_to_token(i) or "" for i in range(size)]
        texts = [p[len(prefix) :] if p.startswith(prefix) and len(p) > len(prefix) else p for p in pieces]
    else:
        texts = tok.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    first, last, blank = (np.zeros(size, bool) for _ in range(3))
    for i, text in enumerate(texts):
        core = text.strip()
        blank[i] = not core  # (Metaspace decodes a lone '▁' to nothing)
        if core:
            first[i], last[i] = _is_punctuation(core[0]), _is_punctuation(core[-1])
    added = list(tok.get_added_tokens_decoder())
    first[added] = last[added] = blank[added] = False
    # byte-fallback pieces ('<0xC3>': a byte of a character outside the vocabulary) are neither, whatever they decode to
    fallback = [i for i in range(size) if _BYTE_PIECE.fullmatch(tok.id_to_token(i) or "")]
    first[fallback] = last[fallback] = blank[fallback] = False
    return first, last, blank


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_FILLER = re.compile(r"\[unused\d+\]")  # data_pipeline.tokenizer.FILLER's pieces


def _unreachable_controls(tok):
    """`tok`, if a Unigram model, with its special-token and [unusedN] filler pieces renamed so that no text
    segments into them; every id stays where it was.

    encode_special_tokens stops "[SEP]" in the text matching the added token, but Unigram also holds the
    specials as model pieces of score 0.0, the best there is, so its lattice picked them from the text itself; a
    filler (score -1e6) beat a run of unknown characters ("[unused0]" with no '[' in the training text). A
    renamed piece holds a plain space, which Metaspace has replaced by '▁' before the model sees a word. Only
    the workers' copy is renamed: the saved tokenizer keeps the names HF matches special tokens by."""
    from tokenizers import Tokenizer, models

    if not isinstance(tok.model, models.Unigram):
        return tok
    spec = json.loads(tok.to_str())
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    controls = {p for p, _ in spec["model"]["vocab"] if p in specials or _FILLER.fullmatch(p)}
    for entry in (*spec["model"]["vocab"], *spec["added_tokens"]):  # an added token names its piece: both renamed
        key = "content" if isinstance(entry, dict) else 0
        if entry[key] in controls:
            entry[key] = f" {entry[key]}"
    return Tokenizer.from_str(json.dumps(spec))


def _init_worker(tokenizer_file: str, tmp_dir: str, dtype: str, threads: int, fast: bool = True) -> None:
    # Each process uses its share of the cores; rayon reads this before its pool first starts.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    from tokenizers import Tokenizer

    tok = _unreachable_controls(Tokenizer.from_file(tokenizer_file))
    tok.no_truncation()
    tok.no_padding()
    # Text that spells a control token ("[SEP]" in a paper about BERT) is text: encoded as its pieces, never as the
    # control id, which would put a false document boundary or a [PAD] (no gradient) inside a training sample
    tok.encode_special_tokens = True
    continuation = _word_fast_path(tok) if fast else None
    edges = _piece_edges(tok) if continuation is None else None
    chunked = _chunk_fast_path(tok) if fast and continuation is None else None
    _worker.update(tok=tok, tmp=Path(tmp_dir), dtype=np.dtype(dtype), continuation=continuation, edges=edges, cache={})
    _worker.update(chunked=chunked, ascii_normalizer=_ascii_normalizer(tok.normalizer) if chunked else None)
    _worker.update(new_words=0.0, skipped=0)  # `_words_repeat`


def _chunks(text: str) -> list[str]:
    """`text` split before each space with a non-space after it (_CHUNK_SPACE). Where its only whitespace is single
    spaces (isprintable: every other whitespace character is not) that is before every space, which str.split does
    ~10x faster; a lone space at an end is a word of its own either way. A space after a tab or a newline is not
    always a word start: GPT-2's regex keeps '\t ' together before a tab or the end ('ĉĠ')."""
    if "  " in text or not text.isprintable():
        return _CHUNK_SPACE.split(text)
    return text.replace(" ", "\x00 ").split("\x00")


def _split_words(sentences: list[str]) -> list[list[str]]:
    """Each sentence's words: BERT's pipeline's (see _BERT_SPACE), or a chunked tokenizer's chunks of the normalized
    text (see _chunk_fast_path)."""
    chunked = _worker["chunked"]
    if chunked is not None:
        normalizer = _worker["tok"].normalizer  # (may be falsy: an empty Sequence has length 0)
        normalize = normalizer.normalize_str if normalizer is not None else str
        ascii_normalize = _worker["ascii_normalizer"] or normalize  # steps it does not know: the library's
        return [_chunks(ascii_normalize(s) if s.isascii() else normalize(s)) for s in sentences]
    odd = any(_NOT_BERT_SPACE.search(s) for s in sentences)
    return [_BERT_SPACE.split(s) if odd else s.split() for s in sentences]  # a "" at an end encodes to nothing


def _encode_words(sentences: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per-sentence token counts [S], token ids [n] and pre-tokenizer word starts [n] bool of `sentences`, one
    distinct word at a time (None for WordPiece, whose starts its ids give)."""
    tok, dtype, cache, chunked = _worker["tok"], _worker["dtype"], _worker["cache"], _worker["chunked"]
    split = _split_words(sentences)
    counts = np.fromiter(map(len, split), np.int64, len(split))  # [S] words per sentence
    words = list(itertools.chain.from_iterable(split))
    distinct = {w: k for k, w in enumerate(dict.fromkeys(words))}
    codes = np.fromiter(map(distinct.__getitem__, words), np.int64, len(words))  # [W] word -> distinct index
    missing = [w for w in distinct if w not in cache]
    _worker["new_words"] = len(missing) / max(1, len(words))
    if missing:
        if len(cache) + len(missing) > _WORD_CACHE_MAX:
            cache.clear()
            missing = list(distinct)  # the words found before the clear are gone with it
        # encode_batch_fast gives no word ids (all None): a chunk's words need encode_batch
        encode = chunked.encode_batch if chunked else tok.encode_batch_fast
        for w, e in zip(missing, encode(missing, add_special_tokens=False)):
            word = e.word_ids  # a chunk's first token starts a word: the pre-tokenizer starts one where a chunk does
            cache[w] = (e.ids, [k == 0 or word[k] != word[k - 1] for k in range(len(word))]) if chunked else e.ids
    pieces = [cache[w] for w in distinct]
    id_lists = [p[0] for p in pieces] if chunked else pieces
    piece_lens = np.fromiter(map(len, id_lists), np.int64, len(pieces))  # [U]
    total = int(piece_lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype, total)  # [sum U]
    piece_starts = np.cumsum(piece_lens) - piece_lens  # [U]
    lens = piece_lens[codes]  # [W] tokens of each word occurrence
    n = int(lens.sum())
    out_starts = np.cumsum(lens) - lens  # [W]
    # Token t of the output belongs to word occurrence w: it is flat[piece_starts[codes[w]] + (t - out_starts[w])].
    index = np.arange(n) + np.repeat(piece_starts[codes] - out_starts, lens)  # [n]
    ends = np.concatenate([[0], np.cumsum(lens)])  # [W+1]
    bounds = np.concatenate([[0], np.cumsum(counts)])  # [S+1] word offsets of sentences
    starts = np.fromiter(itertools.chain.from_iterable(p[1] for p in pieces), bool, total)[index] if chunked else None
    return ends[bounds[1:]] - ends[bounds[:-1]], flat[index], starts


def _batch_ids(encodings) -> tuple[np.ndarray, np.ndarray]:
    """Per-sentence token counts [S] and token ids [n] of encode_batch's `encodings` (one per sentence)."""
    sent_lens = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))  # [S]
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), _worker["dtype"], int(sent_lens.sum()))
    return sent_lens, ids


def _encode_batch(encodings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sentence token counts [S], token ids [n] and pre-tokenizer word starts [n] bool of encode_batch's
    `encodings` (one per sentence)."""
    sent_lens, ids = _batch_ids(encodings)
    n = len(ids)
    # Word ids restart per sentence; None (a token outside any word) is -1 and always a start.
    word = np.fromiter((-1 if w is None else w for e in encodings for w in e.word_ids), np.int64, n)  # [n]
    starts = np.ones(n, bool)  # [n]
    starts[1:] = (word[1:] != word[:-1]) | (word[1:] < 0)
    first = np.cumsum(sent_lens) - sent_lens  # [S] each sentence's first token (n for an empty last one)
    starts[first[first < n]] = True
    return sent_lens, ids, starts


def _merge_sentences(a: tuple, b: tuple, in_b: np.ndarray) -> tuple:
    """(sent_lens, *per-token arrays) of all sentences, from those of the sentences not in b [S] (`a`) and in it."""
    lens = np.zeros(len(in_b), np.int64)
    lens[~in_b], lens[in_b] = a[0], b[0]
    from_b = np.repeat(in_b, lens)  # [n] each token comes from b
    merged = [np.empty(len(from_b), x.dtype) for x in a[1:]]
    for out, x, y in zip(merged, a[1:], b[1:]):
        out[~from_b], out[from_b] = x, y
    return lens, *merged


def _words_repeat() -> bool:
    """Whether the next slice takes a word path (if the tokenizer has one): while the words of the last slice that
    took it were mostly seen before (_NEW_WORDS_MAX), and every _RETRY_EVERY-th slice after."""
    if _worker["new_words"] <= _NEW_WORDS_MAX:
        return True
    _worker["skipped"] += 1
    if _worker["skipped"] < _RETRY_EVERY:
        return False
    _worker["skipped"] = 0
    return True


def _encode_slice(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token ids [n], word starts [n] bool, sentence lengths [S] and sentences per document [d] of `texts`."""
    tok, continuation, chunked = _worker["tok"], _worker["continuation"], _worker["chunked"]
    sentences = [split_sentences(t) for t in texts]
    flat = list(itertools.chain.from_iterable(sentences))
    doc_sents = np.array([len(s) for s in sentences], np.int64)
    words = (continuation is not None or chunked is not None) and _words_repeat()
    if continuation is not None:  # WordPiece's starts are its ids' whichever way they came (`_word_fast_path`)
        if words:
            sent_lens, ids, _ = _encode_words(flat)
        else:
            sent_lens, ids = _batch_ids(tok.encode_batch_fast(flat, add_special_tokens=False))
        return ids, ~continuation[ids], sent_lens, doc_sents
    chunked = chunked if words else None
    # sentences whose words a script decides (CJK, combining marks) need encode_batch's offsets
    scripted = np.fromiter(map(_needs_script_starts, flat), bool, len(flat)) if chunked else np.ones(len(flat), bool)
    batch = [s for s, x in zip(flat, scripted) if x]
    encodings = tok.encode_batch(batch, add_special_tokens=False)
    if chunked:
        plain = _encode_words([s for s, x in zip(flat, scripted) if not x])
        sent_lens, ids, starts = _merge_sentences(plain, _encode_batch(encodings), scripted)
    else:
        sent_lens, ids, starts = _encode_batch(encodings)
    n = len(ids)
    first_tokens = np.cumsum(sent_lens) - sent_lens  # [S]
    sent_starts = np.zeros(n + 1, bool)
    sent_starts[first_tokens[1:]] = True  # the first token of each sentence (but the first)
    first, last, blank = _worker["edges"]
    # a punctuation mark is a word of its own, as BERT's pre-tokenizer makes it, whatever this one's words were
    starts |= first[ids]
    starts[1:] |= last[ids[:-1]]
    _script_word_starts(batch, encodings, starts, first_tokens[scripted])
    # spaces alone (a double space's 'Ġ', the '▁' before a mark or an ideograph) are no word to mask by themselves:
    # they go with the token after them
    starts[1:] &= ~(blank[ids[:-1]] & ~sent_starts[1:n])
    return ids, starts, sent_lens, doc_sents


# CJK ideographs, each a word of its own as BERT's tokenizer makes them (BertNormalizer's handle_chinese_chars, the
# ranges of BERT's _is_chinese_char). Written without spaces, a Chinese sentence was one pre-tokenizer word for
# byte-level BPE and a paragraph one for Unigram's Metaspace: whole-word masking then masked all of it or none.
_CJK = re.compile(
    "[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ceaf\U0002f800-\U0002fa1f]"
)


@functools.cache
def _is_mark(c: str) -> bool:
    """A combining mark (Unicode category M): it continues the word before it. Byte-level BPE's pre-tokenizer
    (letters as \\p{L}+) split Indic words at every vowel sign and virama, each piece a word to mask apart."""
    return unicodedata.category(c)[0] == "M"


@functools.cache
def _is_cjk(c: str) -> bool:
    return _CJK.match(c) is not None


def _needs_script_starts(text: str) -> bool:
    return not text.isascii() and any(_is_mark(c) or _is_cjk(c) for c in set(text))


def _script_word_starts(sentences: list[str], encodings, starts: np.ndarray, first: np.ndarray) -> None:
    """Word starts (in place, [n] over the sentences' tokens; `first` [S] each sentence's first token) where the
    pre-tokenizer's words are not a script's: a CJK ideograph is a word, a combining mark continues the word it marks.
    Byte-level pieces may hold the end of one character and the start of the next: what decides is the first
    character a token brings that the tokens before it did not."""
    for text, e, base in zip(sentences, encodings, first):
        if not _needs_script_starts(text):
            continue
        end, last = 0, " "  # the characters the previous tokens cover, and the last of them
        for t, (a, b) in enumerate(e.offsets):
            new = text[max(a, end) : b]
            piece = new.lstrip()
            if not piece:  # within the characters before (another byte of one), or spaces only
                continue
            if t > 0:
                if _is_cjk(piece[0]) or _is_cjk(last):
                    starts[base + t] = True
                elif a == end and piece == new and (_is_mark(piece[0]) or (_is_mark(last) and piece[0].isalpha())):
                    starts[base + t] = False  # a mark, or a letter right after one ('न' after 'ि' in 'हिन्दी')
            end, last = b, text[b - 1]


def _npy(array: np.ndarray) -> bytes:
    """`array` as np.save writes it to a file."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _encode_shard(task: tuple[int, list[str]]) -> dict:
    """Tokenize one chunk of documents and write it as shard files in the tmp dir; return its counts."""
    index, texts = task
    parts = [_encode_slice(texts[lo : lo + _ENCODE_DOCS]) for lo in range(0, len(texts), _ENCODE_DOCS)]
    ids, starts, sent_lens, doc_sent_counts = (np.concatenate([p[k] for p in parts]) for k in range(4))
    n = len(ids)

    # Drop sentences that tokenize to nothing, and documents left with no tokens.
    sent_doc = np.repeat(np.arange(len(texts)), doc_sent_counts)  # [S] document of each sentence
    nonempty = sent_lens > 0
    doc_lens = np.bincount(sent_doc[nonempty], weights=sent_lens[nonempty], minlength=len(texts)).astype(np.int64)
    kept_docs = doc_lens > 0
    doc_offsets = np.concatenate([[0], np.cumsum(doc_lens[kept_docs])]).astype(np.int64)  # [d'+1]
    sent_offsets = np.concatenate([[0], np.cumsum(sent_lens[nonempty])]).astype(np.int64)  # [s'+1]

    name = shard_name(index)
    prefix = f"{name}.{os.getpid()}"  # a worker orphaned by a killed build never collides with a new one
    tmp = _worker["tmp"]
    # The bytes of each file, written by Python's file object: numpy's tofile (np.save's too) reports a full disk as
    # an OSError with no errno ('N requested and M written'), which the CLI cannot tell from a bug
    files = {
        ".tokens.bin": lambda: ids,
        ".docs.npy": lambda: _npy(doc_offsets),
        ".sents.npy": lambda: _npy(sent_offsets),
        ".words.bin": lambda: np.packbits(starts),
    }
    sha = {}
    if kept_docs.any():  # a shard of no tokens gets no files (an empty file cannot be memory-mapped)
        for suffix, data in files.items():
            path = tmp / (prefix + suffix)
            with writing(path), open(path, "wb") as f:
                f.write(data())
            sha[name + suffix] = sha256_file(path)
    return {
        "index": index,
        "name": name,
        "tmp_prefix": prefix,
        "documents": int(kept_docs.sum()),
        "sentences": int(nonempty.sum()),
        "tokens": n,
        "sha256": sha,
        "dropped_docs": int((~kept_docs).sum()),
        "input_docs": len(texts),
    }


def run_workers(chunks, num_workers: int, init_args: tuple) -> Iterator[dict]:
    """Results of `_encode_shard` over `chunks`, in order, with a bounded number of chunks in flight.

    Pool.imap would pull the whole chunk generator into its task queue as fast as it can read it, so
    submission is windowed by hand instead.
    """
    if num_workers <= 0:
        _init_worker(*init_args)
        yield from map(_encode_shard, chunks)
        return
    with mp.get_context("spawn").Pool(num_workers, _init_worker, init_args) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_shard, (chunk,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
