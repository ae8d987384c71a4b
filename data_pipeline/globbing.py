"""Corpus patterns expanded as `glob.glob(pattern, recursive=True)` does, without its hang on symlink loops.

glob's `**` follows symlinked directories with no memory of where it has been: a link back to a folder above is
entered again and again until paths grow past the system's limit, and two such links make that exponential (a
corpus tree with `a/up -> ..` and `b/up -> ..` never returned). Here `**` enters each real directory once for each
part of the pattern still to match, as a directory walk of the corpus does (`readers._files_under`); everything else
is glob's: names starting with '.' only where the pattern's part does, `**` matching zero or more directories,
the pattern's own spelling kept in what is returned.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterator


def glob_paths(pattern: str) -> list[str]:
    """The paths `pattern` matches, sorted (glob's own where the pattern has no `**`)."""
    if "**" not in pattern:
        return sorted(glob.glob(pattern, recursive=True))
    head, parts = _split(pattern)
    found = set(_match(head, parts, set()))
    return sorted(p for p in found if os.path.isdir(p)) if pattern.endswith(os.sep) else sorted(found)


def _split(pattern: str) -> tuple[str, list[str]]:
    """(the leading directory without a wildcard, '' for none; the parts after it)."""
    parts = pattern.split(os.sep)
    fixed = 0
    while fixed < len(parts) - 1 and not glob.has_magic(parts[fixed]):
        fixed += 1
    head = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else "")
    return head, [p for p in parts[fixed:] if p]


def _names(directory: str, hidden: bool, dirs_only: bool) -> list[str]:
    try:
        with os.scandir(directory or os.curdir) as entries:
            shown = [e for e in entries if hidden or not e.name.startswith(".")]
            names = [e.name for e in shown if not dirs_only or _is_dir(e)]
    except OSError:
        return []
    return sorted(names)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink, as glob does
    except OSError:
        return False


def _match(directory: str, parts: list[str], seen: set[tuple[str, int]]) -> Iterator[str]:
    """Paths below `directory` (its spelling kept) matching `parts`; `seen`: (real directory, parts left) done."""
    if not parts:
        if directory:  # a pattern of `**` alone matches what is below the current directory, not '' itself
            yield directory
        return
    key = (os.path.realpath(directory or os.curdir), len(parts))
    if key in seen:  # a symlink loop, or the same folder reached twice: its matches are already given
        return
    seen.add(key)
    part, rest = parts[0], parts[1:]
    if part == "**":
        yield from _match(directory, rest, seen)  # zero directories
        for name in _names(directory, hidden=False, dirs_only=True):
            yield from _match(os.path.join(directory, name), parts, seen)
        if not rest:  # a pattern ending in `**` matches the files below too
            yield from (os.path.join(directory, n) for n in _names(directory, hidden=False, dirs_only=False))
        return
    if glob.has_magic(part):
        names = fnmatch.filter(_names(directory, hidden=part.startswith("."), dirs_only=bool(rest)), part)
    else:
        names = [part] if os.path.lexists(os.path.join(directory, part)) else []
    for name in names:
        path = os.path.join(directory, name)
        if not rest:
            yield path
        elif os.path.isdir(path):
            yield from _match(path, rest, seen)
