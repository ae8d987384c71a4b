"""What it takes to reproduce a run or a report: the code (git commit, and whether the tree had changes), the library
versions, the command line, the resolved configs, and the sha256 of every input file (corpus, tokenizer, shards,
task files).

`collect` never fails a run: what it cannot find is recorded as such (a corpus named by a pattern that matches
nothing, a tree that is not a git checkout). Files are hashed once per process (keyed by path, size and modification
time), so a report that names the same shards for every arm reads them once.
"""

from __future__ import annotations

import glob
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from pretrain.core.files import sha256_file, write_atomic

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding pretrain/
PLUGINS_ENV = "PRETRAIN_PLUGINS"
"""Comma-separated modules imported with the objectives (`objectives.base.import_plugins`): objectives kept outside
this package register themselves there, in every process of a run (the CLI, its ranks, loader workers)."""
LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "deepspeed", "numpy", "bert-pretrain")
_hashes: dict[tuple[str, int, int], str] = {}


def git_state(root: Path = SOURCE_ROOT) -> dict:
    """{"commit", "dirty"}: dirty when tracked files differ from the commit or untracked, unignored files exist (a new
    module changes what runs as much as an edited one); an "error" instead where git cannot say."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError) as err:
        return {"commit": None, "dirty": None, "error": f"{type(err).__name__}: not a git checkout or no git ({root})"}


def versions() -> dict[str, str | None]:
    """Installed versions, from package metadata (nothing is imported: reading them costs no torch start-up)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def plugin_modules() -> list[str]:
    return [m for m in (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")) if m]


def plugin_sources() -> dict[str, dict[str, str] | str]:
    """{module: {file: sha256}} of each $PRETRAIN_PLUGINS module (a package: every file under it): code outside this
    checkout that changes what a run trains, so the git commit alone does not name it. Found, not imported."""
    import importlib.util

    out: dict[str, dict[str, str] | str] = {}
    for module in plugin_modules():
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as err:
            out[module] = f"not found ({err})"
            continue
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            out[module] = "not found"
            continue
        origin = Path(spec.origin)
        out[module] = hash_paths(origin.parent if spec.submodule_search_locations else origin)
    return out


def file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _hashes:
        _hashes[key] = sha256_file(path)
    return _hashes[key]


def hash_paths(paths) -> dict[str, str]:
    """{file: sha256} for files, the files under directories (hidden ones, such as locks and temporaries, left out)
    and glob patterns; a path that names nothing maps to "missing"."""
    out: dict[str, str] = {}
    for entry in [paths] if isinstance(paths, (str, os.PathLike)) else paths or []:
        matched = [Path(entry)] if Path(entry).exists() else [Path(p) for p in sorted(glob.glob(str(entry)))]
        if not matched:
            out[str(entry)] = "missing"
        for path in matched:
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for file in files:
                if not any(part.startswith(".") for part in file.relative_to(path).parts):
                    out[str(file)] = file_sha256(file)
    return out


def collect(
    command: str | list[str] | None = None,
    configs: dict[str, Any] | None = None,
    files: dict[str, Any] | None = None,
    root: Path = SOURCE_ROOT,
) -> dict:
    """The record: `command` (default: this process's argv), `configs` ({name: resolved config as a dict}), `files`
    ({group such as "corpus" or "shards": paths, directories or patterns}) hashed by `hash_paths`."""
    if command is None:  # `python -m pretrain.cli ...` shows as the module's path in argv[0]
        module = Path(sys.argv[0]).as_posix().endswith("pretrain/cli.py")
        command = (["python", "-m", "pretrain.cli"] if module else sys.argv[:1]) + sys.argv[1:]
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_state(root),
        "versions": versions(),
        "command": command if isinstance(command, str) else shlex.join(map(str, command)),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),  # the configs' relative paths are relative to it
        "configs": configs or {},
        "sha256": {group: hash_paths(paths) for group, paths in (files or {}).items()},
        **({"plugins": plugin_sources()} if plugin_modules() else {}),
    }


def run_provenance(
    cfg, command: str | list[str] | None = None, extra_files: dict[str, Any] | None = None, full: bool = True
) -> dict:
    """The record of one run (a resolved `RunConfig`): its config, and its corpus, tokenizer and shards. `full=False`
    (every start of a training run, whose corpus may be terabytes): the shards' manifest stands for the data, with
    the sha256 of every shard and the size and time of every corpus file, and only it and the tokenizer are read."""
    from pretrain.core.parsing import to_dict

    if full:
        files = {"corpus": list(cfg.data.corpus), "tokenizer": cfg.tokenizer_dir, "shards": cfg.shards_dir}
    else:
        files = {"tokenizer": cfg.tokenizer_dir, "shards": Path(cfg.shards_dir) / "manifest.json"}
    return collect(command, {"run": to_dict(cfg)}, {**files, **(extra_files or {})})


def write_provenance(path: Path, record: dict) -> Path:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


def summary(record: dict) -> str:
    """One line for a report: commit, tree state and the versions."""
    g = record.get("git", {})
    code = (
        f"commit {g['commit'][:12]}" + (" (with uncommitted changes)" if g.get("dirty") else " (clean tree)")
        if g.get("commit")
        else "commit unknown (not a git checkout)"
    )
    libs = ", ".join(f"{k} {v}" for k, v in record.get("versions", {}).items() if v and k != "bert-pretrain")
    files = sum(len(v) for v in record.get("sha256", {}).values())
    plugins = record.get("plugins") or {}
    outside = f"; objectives from outside the package ({PLUGINS_ENV}): {', '.join(plugins)}" if plugins else ""
    return f"{code}; {libs}; sha256 of {files} input file(s){outside}"
