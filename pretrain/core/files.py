"""Files written whole or not at all, and their checksums."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path


def sha256_file(path: str | os.PathLike, block: int = 1 << 20, sync: bool = False) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks; with `sync`, its bytes forced to the disk too (one pass)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """An OSError inside names `path`: a write or close that fails (a full disk) says no file, and the CLI's one line
    should say what did not fit."""
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


def _replace_from_tmp(path: Path, tmp: Path, write) -> None:
    """`write(file)` into `tmp`, then rename it over `path`; a failed write (a full disk) leaves no `tmp` behind, and
    its error names `path`."""
    try:
        with writing(path), open(tmp, "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _synced(write, sync: bool):
    """`write`, then (with `sync`) the file's bytes forced to the disk before the rename makes them the file."""

    def run(f) -> None:
        write(f)
        if sync:
            f.flush()
            os.fsync(f.fileno())

    return run


def replace_file(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """`write(tmp)` a file beside `path`, then rename it over `path`: a failed write (a full disk) leaves the previous
    file whole, never a truncated one in its place, and no temporary file; its error names `path`. `tmp` keeps the
    suffix, which says the format to a writer that reads it there (matplotlib's savefig)."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        with writing(path):
            write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, text: str, sync: bool = True) -> None:
    path = Path(path)
    _replace_from_tmp(path, path.with_name(f".{path.name}.tmp-{os.getpid()}"), _synced(lambda f: f.write(text), sync))


def write_json_atomic(path: Path, obj: dict, sync: bool = True) -> None:
    path = Path(path)
    write = _synced(lambda f: json.dump(obj, f, indent=1), sync)
    _replace_from_tmp(path, path.with_name(f"{path.name}.tmp-{os.getpid()}"), write)


def fsync_path(path: Path) -> None:
    """Force a file's bytes, or a directory's entries (a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """Force every file under `path`, and the directories that name them, to the disk: what a pointer written next
    (a checkpoint's `latest`) names then survives a power cut, not only a killed process."""
    path = Path(path)
    for p in [*sorted(path.rglob("*")), path]:
        if not p.is_symlink():
            fsync_path(p)
