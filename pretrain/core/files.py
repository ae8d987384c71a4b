"""Files written whole or not at all, and their checksums."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def sha256_file(path: str | os.PathLike, block: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _replace_from_tmp(path: Path, tmp: Path, write) -> None:
    """`write(file)` into `tmp`, then rename it over `path`; a failed write (a full disk) leaves no `tmp` behind."""
    try:
        with open(tmp, "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, text: str) -> None:
    path = Path(path)
    _replace_from_tmp(path, path.with_name(f".{path.name}.tmp-{os.getpid()}"), lambda f: f.write(text))


def write_json_atomic(path: Path, obj: dict, sync: bool = True) -> None:
    def write(f) -> None:
        json.dump(obj, f, indent=1)
        if sync:
            f.flush()
            os.fsync(f.fileno())

    path = Path(path)
    _replace_from_tmp(path, path.with_name(f"{path.name}.tmp-{os.getpid()}"), write)
