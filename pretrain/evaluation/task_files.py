"""Which files a downstream result was scored on. Results are filed under a task's directory name; each carries the
sha256 of the task's files (`task_sha256`), so that another task under that name (a full set replacing a subset) is
scored again rather than passing for it (`stale`). Kept apart from the ablation runner so the report reads it without
loading torch."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pretrain.core.provenance import file_sha256

TASK_FILES = ("train.tsv", "dev.tsv", "train.txt", "dev.txt")  # what load_task reads: TSV or CoNLL


def task_sha256(task: str | Path) -> str:
    """One sha256 over the files a task is read from, each named relative to its directory (so a copy of the task
    elsewhere keeps it, while another task under the same directory name does not)."""
    digest = hashlib.sha256()
    for name in TASK_FILES:
        path = Path(task) / name
        if path.is_file():
            digest.update(f"{name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def stale(task: str | Path, result: dict) -> bool:
    """Whether `result` was scored on other files than `task` holds now. A result recorded before the hash was kept
    has nothing to tell by, and is trusted."""
    recorded = result.get("task_sha256")
    return recorded is not None and recorded != task_sha256(task)
