"""Streaming corpus readers: JSON Lines (optionally gzipped) and blank-line-separated plain text.

Files are read as bytes and decoded line by line, so one bad line is reported (or skipped) with its
file:line instead of failing a whole file, and no file is ever held in memory at once.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from pretrain.errors import DataError

CORPUS_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".txt")
ON_BAD = ("skip", "error")


@dataclass
class Document:
    text: str
    source: str
    """Path of the file it came from."""
    line: int
    """1-based line of the JSON Lines record, or the first line of a plain-text document."""


def _is_corpus_file(path: Path) -> bool:
    return path.is_file() and path.name.endswith(CORPUS_SUFFIXES)


def expand_inputs(paths: Iterable[str]) -> list[Path]:
    """Files named by `paths` (files, directories searched recursively, or globs): sorted and unique."""
    paths = [str(p) for p in paths]
    found: set[Path] = set()
    for entry in paths:
        if glob.has_magic(entry):
            matches = [Path(m) for m in glob.glob(entry, recursive=True)]
            if not matches:
                raise DataError(f"corpus path '{entry}' not found (the pattern matches nothing)")
            for m in matches:
                found.update(_files_under(m) if m.is_dir() else [m] if m.is_file() else [])
        else:
            p = Path(entry)
            if not p.exists():
                raise DataError(f"corpus path '{entry}' not found")
            found.update(_files_under(p) if p.is_dir() else [p])
    if not found:
        raise DataError(f"no corpus files ({', '.join('*' + s for s in CORPUS_SUFFIXES)}) found in: "
                        f"{', '.join(paths) or '(no inputs)'}")
    return sorted(found)


def _files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if _is_corpus_file(p)]


def _open_binary(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _is_jsonl(path: Path) -> bool:
    # .json is read as JSON Lines too: one object per line (a single top-level array is not supported).
    return path.name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz"))


def iter_documents(paths: Iterable[str], text_field: str = "text", on_bad: str = "skip",
                   skipped: collections.Counter | None = None) -> Iterator[Document]:
    """Documents of every corpus file, in `expand_inputs` order.

    Bad input (invalid UTF-8 or JSON, a record without `text_field`) raises DataError naming file:line when
    on_bad="error" and is counted in `skipped[reason]` when on_bad="skip". Empty documents are always
    skipped and counted as "empty".
    """
    if on_bad not in ON_BAD:
        raise DataError(f"on_bad_document: '{on_bad}' is not one of {', '.join(ON_BAD)}")
    skipped = collections.Counter() if skipped is None else skipped
    for path in expand_inputs(paths):
        reader = _iter_jsonl if _is_jsonl(path) else _iter_text
        yield from reader(path, text_field, on_bad, skipped)


def _bad(reason: str, message: str, on_bad: str, skipped: collections.Counter) -> None:
    if on_bad == "error":
        raise DataError(message)
    skipped[reason] += 1


def _decode(raw: bytes, where: str, on_bad: str, skipped: collections.Counter) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _bad("invalid_utf8", f"{where}: invalid UTF-8 at byte {e.start} of the line "
             f"(on_bad_document=skip skips such lines)", on_bad, skipped)
        return None


def _iter_jsonl(path: Path, text_field: str, on_bad: str, skipped: collections.Counter) -> Iterator[Document]:
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue  # blank lines are not records
            where = f"{path}:{lineno}"
            line = _decode(raw, where, on_bad, skipped)
            if line is None:
                continue
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
            if not text.strip():
                skipped["empty"] += 1
                continue
            yield Document(text, str(path), lineno)


def _iter_text(path: Path, text_field: str, on_bad: str, skipped: collections.Counter) -> Iterator[Document]:
    """Plain text: a document is a run of non-blank lines; a line of bad UTF-8 drops its whole document."""
    lines: list[str] = []
    first = 0
    bad = False
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                if lines and not bad:
                    yield Document("".join(lines).rstrip("\r\n"), str(path), first)
                lines, bad = [], False
                continue
            if not lines and not bad:
                first = lineno
            line = _decode(raw, f"{path}:{lineno}", on_bad, skipped)
            if line is None:
                bad = True
            elif not bad:
                lines.append(line)
    if lines and not bad:
        yield Document("".join(lines).rstrip("\r\n"), str(path), first)


def describe_inputs(paths: Iterable[str]) -> str:
    """The inputs as a user typed them, for error messages."""
    return ", ".join(os.fspath(p) for p in paths) or "(no inputs)"
