"""Streaming corpus readers: JSON Lines and plain text (optionally gzip or zstd), Parquet, Arrow and
directories written by `datasets.Dataset.save_to_disk`.

Nothing is ever held in memory whole:
- line formats are read with a bounded `readline`, so a document is at most `max_document_bytes` in memory,
  even a 100 MB line with no newline (its excess is read in fixed blocks and thrown away), compressed or not;
- Parquet is read one record batch of the text column at a time;
- Arrow files (datasets' on-disk format) are memory-mapped and read one record batch at a time.

One bad record is reported (or skipped and counted) with its file:line, or file:row for columnar files,
instead of failing a whole file.
"""

from __future__ import annotations

import collections
import glob
import gzip
import itertools
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from data_pipeline.globbing import glob_paths
from pretrain.core.errors import DataError
from pretrain.core.outputs import MARKER

COMPRESSION = (".gz", ".zst", ".zstd")
LINE_SUFFIXES = (".jsonl", ".json", ".txt")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
# A bare ".zst" is read as JSON Lines: that is what compressed dumps (the Pile, RedPajama...) contain.
CORPUS_SUFFIXES = (
    LINE_SUFFIXES + tuple(s + c for s in LINE_SUFFIXES for c in COMPRESSION) + COLUMNAR_SUFFIXES + (".zst",)
)
ON_BAD = ("skip", "error")
TEXT_DOCUMENTS = ("paragraphs", "lines")  # what a document is in a plain-text file
DEFAULT_MAX_DOCUMENT_BYTES = 16 << 20
"""A longer document is almost always a dump (logs, base64, a table) rather than prose, and tokenizing
it holds ~100 bytes per token in a shard worker; 16 MiB still admits whole books."""

_BLOCK = 1 << 20  # bytes read at a time when discarding the rest of an over-long line
_BATCH_ROWS = 1024  # Parquet rows per record batch: bounded memory, little per-batch overhead
DATASET_MARKERS = ("state.json", "dataset_info.json")


@dataclass
class Document:
    text: str
    source: str
    """Path of the file it came from."""
    line: int
    """1-based line of the JSON Lines record, first line of a plain-text document, or 1-based row of a
    Parquet/Arrow table."""


# ---------------------------------------------------------------------------------------------- inputs


def is_dataset_dir(path: Path) -> bool:
    """A directory written by `Dataset.save_to_disk` (state.json + dataset_info.json + *.arrow)."""
    return path.is_dir() and all((path / m).is_file() for m in DATASET_MARKERS)


def _is_corpus_name(name: str) -> bool:
    return name.lower().endswith(CORPUS_SUFFIXES)  # BOOK.TXT as book.txt


def _is_corpus_file(path: Path) -> bool:
    return path.is_file() and _is_corpus_name(path.name)


def _named_file(path: Path) -> Path:
    """A file named as an input: one of the corpus types, else a DataError (read as JSON Lines, a .text or .md file
    would have been skipped line by line as invalid JSON)."""
    if not _is_corpus_name(path.name):
        raise DataError(
            f"corpus file '{path}' is not one of the types read ({', '.join('*' + s for s in CORPUS_SUFFIXES)}): "
            "rename it (plain text: .txt, one paragraph per blank-line-separated block)"
        )
    return path


def expand_inputs(paths: Iterable[str]) -> list[Path]:
    """Inputs named by `paths` (files, directories searched recursively, or globs): sorted, and each file once
    however it is reached (a symlink, another spelling of its path), by the least of the spellings it was reached by.

    A `datasets` save_to_disk directory is one input (read through its state.json), never its arrow
    files one by one. Directories are searched through symlinks, not into hidden ones (.ipynb_checkpoints, .git).
    """
    paths = [str(p) for p in paths]
    found: dict[str, Path] = {}  # real path -> the least spelling found

    def add(files: Iterable[Path]) -> None:
        # The least, not the first: the first depends on the order `paths` come in, and the sort below (the order of
        # the documents, so the shards and their cache key) would follow it
        for f in files:
            real = os.path.realpath(f)
            found[real] = min(found.get(real, f), f)

    for entry in paths:
        # a path that exists is that path, whatever its name holds: 'part[1].jsonl' was read as a pattern matching
        # part1.jsonl (another file, or none), and a list expanded once was expanded again when read
        if glob.has_magic(entry) and not os.path.lexists(entry):
            matches = [Path(m) for m in glob_paths(entry)]  # glob's, without its hang on a symlink loop
            if not matches:
                raise DataError(f"corpus path '{entry}' not found (the pattern matches nothing)")
            base = Path(_static_prefix(entry))
            matches = [m for m in matches if not _inside_output(m, base)]  # no further than a directory walk goes
            # a file of a save_to_disk directory (its state.json, an arrow file) is that dataset, read whole once
            matches = sorted({m.parent if is_dataset_dir(m.parent) else m for m in matches})
            if matches and not any(m.is_dir() or _is_corpus_file(m) for m in matches):
                raise DataError(
                    f"corpus pattern '{entry}' matches only files of types not read ({_suffix_counts(matches)}); "
                    f"the types read: {', '.join('*' + s for s in CORPUS_SUFFIXES)}"
                )
            for m in matches:
                add(_files_under(m) if m.is_dir() else [m] if _is_corpus_file(m) else [])
        else:
            p = Path(entry)
            if not p.exists():
                raise DataError(f"corpus path '{entry}' not found" + _where_relative(p))
            add(_files_under(p) if p.is_dir() else [_named_file(p)])
    if not found:
        raise DataError(
            f"no corpus files ({', '.join('*' + s for s in CORPUS_SUFFIXES)} or a datasets "
            f"save_to_disk directory) found in: {', '.join(paths) or '(no inputs)'}"
        )
    return sorted(found.values())


def _static_prefix(pattern: str) -> str:
    """The directory a glob pattern starts from: its leading components without a wildcard."""
    parts = Path(pattern).parts
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts[:-1]))
    return str(Path(*fixed)) if fixed else "."


def _inside_output(path: Path, base: Path) -> bool:
    """Whether `path`, or a directory between `base` and it, is an output of this tool (shards, a tokenizer, a run:
    marked), which a directory walk does not enter either."""
    try:
        below = path.relative_to(base).parts
    except ValueError:
        return False
    return any((base.joinpath(*below[: i + 1]) / MARKER).is_file() for i in range(len(below)))


def _where_relative(path: Path) -> str:
    """For a relative path not found: where it was looked for, and the checkout's copy if it has one (the presets'
    demo corpus, data/..., is relative to the project's root, which `pretrain run tiny` elsewhere does not find)."""
    if path.is_absolute():
        return ""
    from pretrain.core.provenance import SOURCE_ROOT

    here = f" (relative to the directory you run from, {Path.cwd()})"
    shipped = SOURCE_ROOT / path
    return here + (
        f"; the project's copy is {shipped}: give that path, or run from {SOURCE_ROOT}" if shipped.exists() else ""
    )


def _files_under(directory: Path) -> list[Path]:
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if is_dataset_dir(p))
        raise DataError(
            f"{directory} is a datasets DatasetDict (splits: {', '.join(splits) or 'none'}); name one "
            f"split directory, e.g. {directory / (splits[0] if splits else 'train')}"
        )
    if is_dataset_dir(directory):
        return [directory]
    out: list[Path] = []
    passed: list[Path] = []  # files of other types, said once
    seen = {os.path.realpath(directory)}  # symlinked directories are followed, each real one once (no loops)
    for root, dirs, files in os.walk(directory, followlinks=True):
        here = Path(root)
        # Not into hidden folders, nor into this tool's outputs (shards, a tokenizer, a run, an export: marked) placed
        # inside a corpus directory: their .json files would be read as corpus the next time, and the shards not
        # found again for a corpus that now includes them.
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and os.path.realpath(here / d) not in seen and not (here / d / MARKER).is_file()
        ]
        seen.update(os.path.realpath(here / d) for d in dirs)
        for d in dirs:
            if (here / d / "dataset_dict.json").is_file():
                _files_under(here / d)  # raises: which split to read is the user's choice
        # A dataset directory below is one input: do not descend into it and pick up its arrow files.
        datasets_here = [d for d in dirs if is_dataset_dir(here / d)]
        out += [here / d for d in datasets_here]
        dirs[:] = sorted(d for d in dirs if d not in datasets_here)
        out += [here / f for f in files if not f.startswith(".") and _is_corpus_file(here / f)]
        passed += [here / f for f in files if not f.startswith(".") and not _is_corpus_name(f)]
    if passed and str(directory) not in _said_passed:  # once per directory: inputs are expanded several times a run
        _said_passed.add(str(directory))
        print(
            f"[data] {directory}: {len(passed):,} file(s) not read, of types that are not corpus files "
            f"({_suffix_counts(passed)}); rename those that are (plain text: .txt, JSON Lines: .jsonl)",
            file=sys.stderr,
            flush=True,
        )
    return out


_said_passed: set[str] = set()


def _suffix_counts(files: list[Path]) -> str:
    """'.csv: 2, .md: 1': the types of `files`, most first."""
    counts = collections.Counter(f.suffix or "(no suffix)" for f in files)
    return ", ".join(f"{suffix}: {n:,}" for suffix, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def input_fingerprint(path: Path) -> list:
    """[path, bytes, mtime_ns] of an input (for a dataset directory, of each of its arrow files): what a
    cache of anything derived from the corpus is keyed on."""
    files = _dataset_arrow_files(path) if path.is_dir() else [path]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


# ---------------------------------------------------------------------------------------------- documents


def iter_documents(
    paths: Iterable[str],
    text_field: str = "text",
    on_bad: str = "skip",
    skipped: collections.Counter | None = None,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    text_documents: str = "paragraphs",
) -> Iterator[Document]:
    """Documents of every input, in `expand_inputs` order. In plain text a document is a paragraph (a run of
    non-blank lines) or, with text_documents="lines", each line (one document per line, as many dumps are).

    Bad input (invalid UTF-8 or JSON, a record without `text_field`, a document over `max_document_bytes`)
    raises DataError naming file:line when on_bad="error" and is counted in `skipped[reason]` when
    on_bad="skip". Empty documents are always skipped and counted as "empty". A Parquet/Arrow input without
    a `text_field` column is always an error: the whole file would be skipped.
    """
    if on_bad not in ON_BAD:
        raise DataError(f"on_bad_document: '{on_bad}' is not one of {', '.join(ON_BAD)}")
    if text_documents not in TEXT_DOCUMENTS:
        raise DataError(f"text_documents: '{text_documents}' is not one of {', '.join(TEXT_DOCUMENTS)}")
    if max_document_bytes < 1:
        raise DataError(f"max_document_bytes must be >= 1, got {max_document_bytes}")
    skipped = collections.Counter() if skipped is None else skipped
    for path in expand_inputs(paths):
        read = _reader_for(path)
        if read is _iter_text and text_documents == "lines":
            read = _iter_text_lines
        yield from read(path, text_field, on_bad, skipped, max_document_bytes)


def iter_documents_sample(paths: Iterable[str], max_docs: int, **kwargs) -> Iterator[Document]:
    """About `max_docs` documents spread over every input: the first ceil(max_docs / inputs) of each.

    A corpus is often several sources in sorted files; a plain prefix would see only the first of them.
    Each input is opened in turn and read only as far as its quota, so this stays cheap on a huge corpus.
    """
    files = expand_inputs(paths)
    quota = -(-max_docs // len(files))
    count = 0
    for path in files:
        take = min(quota, max_docs - count)
        if take <= 0:
            return
        for doc in itertools.islice(iter_documents([str(path)], **kwargs), take):
            count += 1
            yield doc


def _reader_for(path: Path):
    if path.is_dir():
        return _iter_dataset_dir
    name = path.name.lower()
    if name.endswith(".parquet"):
        return _iter_parquet
    if name.endswith(".arrow"):
        return _iter_arrow
    inner = name
    for c in COMPRESSION:
        if inner.endswith(c):
            inner = inner[: -len(c)]
            break
    return _iter_text if inner.endswith(".txt") else _iter_jsonl  # .json, .jsonl, and a bare .zst


def _open_binary(path: Path) -> BinaryIO:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        from data_pipeline.zstd_stream import open_zstd

        return open_zstd(path, _BLOCK)  # in bounded memory, a cut-off frame an error
    return open(path, "rb")


_SKIPS = "(on_bad_document=skip skips such lines)"


def _bad(reason: str, message: str, on_bad: str, skipped: collections.Counter) -> None:
    if on_bad == "error":
        raise DataError(message)
    skipped[reason] += 1


def _decode(raw: bytes, where: str, on_bad: str, skipped: collections.Counter) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _bad(
            "invalid_utf8",
            f"{where}: invalid UTF-8 at byte {e.start} of the line {_SKIPS}",
            on_bad,
            skipped,
        )
        return None


def _too_long(where: str, size: str, limit: int, on_bad: str, skipped: collections.Counter) -> None:
    _bad(
        "too_long",
        f"{where}: document of {size} exceeds max_document_bytes={limit} "
        f"(raise data.max_document_bytes, or on_bad_document=skip skips it)",
        on_bad,
        skipped,
    )


_BOM = b"\xef\xbb\xbf"


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | int]]:
    """(1-based line number, bytes) of each line, or (line number, size) for a line longer than `limit`.

    An over-long line is consumed in blocks and never held whole: memory stays O(limit). A UTF-8 byte-order mark
    (what some Windows editors write first) is not part of the first line's text.
    """
    for lineno in itertools.count(1):
        if lineno == 1:  # room for a BOM: stripped after the limit was applied, it cut a line near it in two
            raw = f.readline(limit + 1 + len(_BOM))
            raw = raw[len(_BOM) :] if raw.startswith(_BOM) else raw
        else:
            raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n") and len(raw) == limit + 1:
            yield lineno, raw
            continue
        size = len(raw)
        while not raw.endswith(b"\n"):
            raw = f.readline(_BLOCK)
            if not raw:
                break
            size += len(raw)
        yield lineno, size


def _record_lines(path: Path, on_bad: str, skipped: collections.Counter, limit: int) -> Iterator[tuple[int, str, str]]:
    """(line number, "path:line", text) of each line that is a record: not blank, within `limit`, valid UTF-8 (the
    others skipped and counted, or a DataError, by `on_bad`)."""
    with _open_binary(path) as f:
        for lineno, raw in _read_guarded(path, _lines(f, limit)):
            where = f"{path}:{lineno}"
            if isinstance(raw, int):
                _too_long(where, f"{raw} bytes (one line)", limit, on_bad, skipped)
                continue
            if not raw.strip():
                continue  # blank lines are not records
            line = _decode(raw, where, on_bad, skipped)
            if line is not None:
                yield lineno, where, line


def _iter_jsonl(
    path: Path, text_field: str, on_bad: str, skipped: collections.Counter, limit: int
) -> Iterator[Document]:
    for lineno, where, line in _record_lines(path, on_bad, skipped, limit):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            _bad("invalid_json", f"{where}: invalid JSON ({e.msg} at column {e.colno})", on_bad, skipped)
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            if isinstance(record, dict) and text_field in record:
                problem = f"field '{text_field}' is a {type(text).__name__}, not a string"
            elif isinstance(record, dict):
                problem = f"no field '{text_field}' (keys: {', '.join(map(str, record)) or 'none'})"
            else:
                problem = f"record is a JSON {type(record).__name__}, not an object with field '{text_field}'"
            _bad("missing_field", f"{where}: {problem}; set data.text_field", on_bad, skipped)
            continue
        lone = _LONE_SURROGATE.search(text) if "\\u" in line else None  # only an escape gives one
        if lone:
            at = f"U+{ord(lone.group()):04X} at character {lone.start()}"
            message = f"{where}: invalid UTF-8: '{text_field}' holds a lone surrogate ({at}) {_SKIPS}"
            _bad("invalid_utf8", message, on_bad, skipped)
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        yield Document(text, str(path), lineno)


# A surrogate code point in a str from json.loads ("\\ud800", which it accepts) is a lone one (an escaped pair is joined
# into one character): no UTF-8 holds it, and the tokenizer's trainer and encoder fail on it far from the file and line.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _read_guarded(path: Path, lines: Iterator) -> Iterator:
    """`lines`, with a corrupt compressed stream reported as a DataError naming the file (never skipped:
    everything after the damage is lost, which a count would hide)."""
    lineno = 0
    try:
        for item in lines:
            lineno = item[0]
            yield item
    except (EOFError, OSError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot decompress after line {lineno} ({e}); the file is truncated or corrupt") from e
    except Exception as e:  # zstandard.ZstdError does not derive from OSError
        if type(e).__module__.startswith("zstandard") or type(e).__name__ == "ZstdError":
            raise DataError(
                f"{path}: cannot decompress after line {lineno} ({e}); the file is truncated or corrupt"
            ) from e
        raise


def _iter_text(
    path: Path, text_field: str, on_bad: str, skipped: collections.Counter, limit: int
) -> Iterator[Document]:
    """Plain text: a document is a run of non-blank lines; a line of bad UTF-8 drops its whole document,
    and so does reaching `limit` bytes (counted once per document). A file whose documents run to thousands of lines
    is most likely one document per line: said once, with the setting that reads it so."""
    lines: list[str] = []
    first = 0
    size = 0
    bad = False
    current = longest = 0  # lines of this document, and of the longest so far
    with _open_binary(path) as f:
        for lineno, raw in _read_guarded(path, _lines(f, limit)):
            if not isinstance(raw, int) and not raw.strip():
                if lines and not bad:
                    yield Document("".join(lines).rstrip("\r\n"), str(path), first)
                lines, bad, size, current, longest = [], False, 0, 0, max(longest, current)
                continue
            current += 1
            if not lines and not bad:
                first = lineno
            if bad:
                continue
            size += raw if isinstance(raw, int) else len(raw)
            if size > limit:
                _too_long(
                    f"{path}:{first}",
                    f"more than {limit} bytes (lines {first}-{lineno} and on, no blank line between them: one "
                    "document per line? data.text_documents=lines reads them so)",
                    limit,
                    on_bad,
                    skipped,
                )
                lines, bad = [], True
                continue
            line = _decode(raw, f"{path}:{lineno}", on_bad, skipped)
            if line is None:
                lines, bad = [], True
            else:
                lines.append(line)
    if lines and not bad:
        yield Document("".join(lines).rstrip("\r\n"), str(path), first)
    longest = max(longest, current)
    if longest >= _LINES_OF_ONE_DOCUMENT:
        print(
            f"[data] {path}: a document of {longest:,} lines with no blank line between "
            "them; if each line is a document, set data.text_documents=lines (--text-documents lines)",
            file=sys.stderr,
            flush=True,
        )


_LINES_OF_ONE_DOCUMENT = 1000  # a paragraph that long is a file of one-line documents, not prose


def _iter_text_lines(
    path: Path, text_field: str, on_bad: str, skipped: collections.Counter, limit: int
) -> Iterator[Document]:
    """Plain text, one document per line (text_documents="lines"); blank lines are not documents."""
    for lineno, _, line in _record_lines(path, on_bad, skipped, limit):
        yield Document(line.rstrip("\r\n"), str(path), lineno)


# ---------------------------------------------------------------------------------------------- columnar


def _text_column(path: Path, schema, text_field: str):
    """Index of `text_field` in an Arrow schema; a missing or non-text column is a DataError."""
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(
            f"{path}: no column '{text_field}' (columns: {', '.join(schema.names) or 'none'}); set data.text_field"
        )
    typ = schema.field(text_field).type

    def text(t) -> bool:
        return (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
            or getattr(pa.types, "is_string_view", lambda t: False)(t)
        )

    # dictionary-encoded text (pandas' categorical, a repeated label) reads as its values (`_rows`: to_pylist)
    if not (text(typ) or (pa.types.is_dictionary(typ) and text(typ.value_type))):
        raise DataError(f"{path}: column '{text_field}' is {typ}, not text; set data.text_field")
    return schema.get_field_index(text_field)


def _rows(
    path: Path,
    batches: Iterable,
    text_field: str,
    on_bad: str,
    skipped: collections.Counter,
    limit: int,
    first_row: int = 1,
) -> Iterator[Document]:
    """Documents of an iterable of single-column record batches; row numbers start at `first_row`."""
    row = first_row - 1
    for batch in batches:
        for value in batch.column(0).to_pylist():
            row += 1
            where = f"{path}: row {row}"
            if value is None:
                _bad("missing_field", f"{where}: '{text_field}' is null", on_bad, skipped)
                continue
            if isinstance(value, bytes):  # binary columns: decode (and report) like a line
                if len(value) > limit:
                    _too_long(where, f"{len(value)} bytes", limit, on_bad, skipped)
                    continue
                value = _decode(value, where, on_bad, skipped)
                if value is None:
                    continue
            elif len(value) > limit // 4 and len(value.encode("utf-8")) > limit:  # chars <= bytes <= 4 * chars
                _too_long(where, f"{len(value.encode('utf-8'))} bytes", limit, on_bad, skipped)
                continue
            if not value.strip():
                skipped["empty"] += 1
                continue
            yield Document(value, str(path), row)


def _iter_parquet(
    path: Path, text_field: str, on_bad: str, skipped: collections.Counter, limit: int
) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, memory_map=True)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for anything that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    _text_column(path, pf.schema_arrow, text_field)
    try:
        yield from _rows(
            path, pf.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field]), text_field, on_bad, skipped, limit
        )
    except OSError as e:  # pyarrow errors derive from it: a corrupt page mid-file
        raise DataError(f"{path}: cannot read ({e}); the file is truncated or corrupt") from e


def _arrow_batches(path: Path, text_field: str):
    """Memory-mapped record batches of the text column of an Arrow IPC file (stream or file format)."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)  # datasets writes the streaming format
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            f = pa.ipc.open_file(source)
        except pa.ArrowInvalid as e:
            raise DataError(f"{path}: not an Arrow IPC file ({e})") from e
        reader = (f.get_batch(i) for i in range(f.num_record_batches))
        schema = f.schema
    else:
        schema = reader.schema
        reader = _stream_to_its_end(path, source, reader)
    index = _text_column(path, schema, text_field)
    try:
        for batch in reader:
            yield batch.select([index])  # zero-copy: other columns are never touched
    except (OSError, pa.ArrowException) as e:  # ArrowInvalid (a cut inside a batch) is a ValueError, not an OSError
        raise DataError(f"{path}: cannot read ({e}); the file is truncated or corrupt") from e


_END_OF_STREAM = (b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\x00\x00\x00\x00")  # Arrow's marker; before 0.15's


def _stream_to_its_end(path: Path, source, reader):
    """The batches of an Arrow stream, then a warning unless its end-of-stream marker follows the last: pyarrow takes
    the end of a file cut at a batch boundary (an interrupted write or copy) for the end of the stream, and would
    read it short in silence. The marker is optional in the format (a writer may end a stream by closing it), so
    such a file is read as it is, and said. The memory map's position is where the reader's next message starts."""
    end, batches = source.tell(), 0  # after the schema, then after each batch
    for batch in reader:
        end, batches = source.tell(), batches + 1
        yield batch
    marker = source.read_at(min(8, source.size() - end), end)
    if marker != _END_OF_STREAM[0] and marker[:4] != _END_OF_STREAM[1]:
        print(
            f"[data] {path}: the Arrow stream ends after {batches} record batch(es) without its end-of-stream "
            "marker: either its writer ended it by closing it, or the file is truncated (an interrupted write or "
            "copy: write or copy it again); read as it is",
            file=sys.stderr,
            flush=True,
        )


def _iter_arrow(
    path: Path, text_field: str, on_bad: str, skipped: collections.Counter, limit: int
) -> Iterator[Document]:
    yield from _rows(path, _arrow_batches(path, text_field), text_field, on_bad, skipped, limit)


def _dataset_arrow_files(directory: Path) -> list[Path]:
    try:
        state = json.loads((directory / "state.json").read_text())
        files = [directory / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{directory / 'state.json'}: not a datasets save_to_disk state ({e})") from e
    for f in files:
        if not f.is_file():
            raise DataError(f"{directory}: state.json lists {f.name}, which is missing")
    return files


def _iter_dataset_dir(
    directory: Path, text_field: str, on_bad: str, skipped: collections.Counter, limit: int
) -> Iterator[Document]:
    for f in _dataset_arrow_files(directory):
        yield from _iter_arrow(f, text_field, on_bad, skipped, limit)


def describe_inputs(paths: Iterable[str]) -> str:
    """The inputs as a user typed them, for error messages."""
    return ", ".join(os.fspath(p) for p in paths) or "(no inputs)"


_SKIP_REASONS = {  # the reasons `iter_documents` counts, as in "skipped 3 documents: 2 with invalid JSON, 1 empty"
    "invalid_utf8": "with invalid UTF-8",
    "invalid_json": "with invalid JSON",
    "missing_field": "without text in field '{field}'",
    "too_long": "over max_document_bytes",
    "empty": "empty",
    "no_tokens": "with no tokens",
}


def describe_skipped(skipped: collections.Counter, text_field: str = "text") -> str:
    """What `iter_documents` skipped, most first, for a message: "skipped 5 documents: 3 with invalid JSON, ..."."""
    counts = sorted(((n, reason) for reason, n in skipped.items() if n), key=lambda nr: (-nr[0], nr[1]))
    if not counts:
        return "the inputs hold no documents"
    total = sum(n for n, _ in counts)
    parts = [f"{n:,} {_SKIP_REASONS.get(r, r.replace('_', ' ')).format(field=text_field)}" for n, r in counts]
    hints = []
    if skipped["missing_field"]:
        hints.append("is the text under another field? set --text-field / data.text_field")
    if {r for _, r in counts} - {"empty", "no_tokens"}:
        hints.append("--on-bad error (data.on_bad_document=error) stops at the first bad one, naming its file and line")
    return f"skipped {total:,} document{'' if total == 1 else 's'}: {', '.join(parts)}" + (
        f" ({'; '.join(hints)})" if hints else ""
    )
