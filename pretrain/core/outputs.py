"""What this tool may replace, what it must never touch, and one writer per directory.

Every directory the tool creates as an output carries a marker, `.bert-pretrain.json` ({"kind": ...}). Before a
command replaces or adds to a directory's contents it claims it (`claim_output`): the directory must be absent,
empty, marked with the same kind, or, when written by a version before the marker, recognisably ours (`_SIGNATURES`:
only files that kind writes, and its key file). Anything else is refused, naming the path and what is in the way;
nothing is deleted. A command's inputs, and any directory that holds them, are never a valid output (`check_not_input`).

`exclusive(dir)` is an flock on `dir/.lock`: a second process gets a clear refusal naming the holder, and the kernel
releases the lock when the holder exits, even on kill -9.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pretrain.core.errors import UserError
from pretrain.core.files import write_atomic

MARKER = ".bert-pretrain.json"
LOCK = ".lock"
KINDS = ("run", "tokenizer", "shards", "export", "ablation", "compare", "sentence-transformers")

# what a tokenizer directory of ours holds (training_settings.json: data_pipeline.tokenizer.SETTINGS_FILE)
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "training_settings.json"}
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_SHARD_FILE = re.compile(r"^shard_\d{5}(\.(tokens\.bin|docs\.npy|sents\.npy|words\.bin|done\.json)|\..*tmp-\d+)$")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _tokenizer_signature(path: Path) -> bool:
    """Ours: BERT's five special tokens at ids 0..4 (see data_pipeline.tokenizer), which a hub tokenizer lacks."""
    spec = _read_json(path / "tokenizer.json") or {}
    added = [(t.get("id"), t.get("content")) for t in spec.get("added_tokens", [])[:5]]
    return added == list(enumerate(_SPECIALS))


def _export_signature(path: Path) -> bool:
    """Ours: a model card written by pretrain.hf.export (a hub checkpoint's README is not)."""
    try:
        card = (path / "README.md").read_text()
    except OSError:
        return False
    return "- Objective(s):" in card and (path / "model.safetensors").is_file()


def _shards_signature(path: Path) -> bool:
    manifest, build = _read_json(path / "manifest.json"), _read_json(path / "build.json")
    return (manifest is not None and {"format_version", "cache_key", "shards"} <= set(manifest)) or (
        manifest is None and build is not None and "cache_key" in build
    )


def _run_signature(path: Path) -> bool:
    try:
        import yaml

        config = yaml.safe_load((path / "config.yaml").read_text())
    except Exception:  # unreadable or not YAML: not a run directory of ours
        return False
    return isinstance(config, dict) and {"data", "model", "train", "objectives"} <= set(config)


def _ablation_signature(path: Path) -> bool:
    try:
        import yaml

        config = yaml.safe_load((path / "ablation.yaml").read_text())
    except Exception:
        return False
    return isinstance(config, dict) and "arms" in config


# kind -> (the entries that kind writes, a check that the directory is one of ours)
_SIGNATURES: dict[str, tuple[Callable[[str], bool], Callable[[Path], bool]]] = {
    "tokenizer": (lambda n: n in _TOKENIZER_FILES, _tokenizer_signature),
    "export": (
        lambda n: n in _TOKENIZER_FILES | {"config.json", "model.safetensors", "README.md", "generator"},
        _export_signature,
    ),
    "shards": (
        lambda n: bool(_SHARD_FILE.match(n)) or n in {"manifest.json", "build.json", LOCK, ".tmp"},
        _shards_signature,
    ),
    "run": (
        lambda n: (
            n
            in {
                "config.yaml",
                "metrics.jsonl",
                "checkpoints",
                "tokenizer",
                "shards",
                "hf",
                "wandb",
                "wandb_run_id",
                "eval",
                "inspect",
                "state.json",
                "provenance.json",
                "tensorboard",
                "sentence-transformers",
                LOCK,
            }
        ),
        _run_signature,
    ),
    "ablation": (
        lambda n: (
            n
            in {
                "ablation.yaml",
                "configs",
                "arms",
                "tokenizer",
                "shards",
                "report.md",
                "results.json",
                "loss_curves.png",
                "downstream.png",
                "significance.png",
                LOCK,
            }
        ),
        _ablation_signature,
    ),
    # Newer than the marker: a directory of these kinds without it is never ours
    "compare": (lambda n: False, lambda path: False),
    "sentence-transformers": (lambda n: False, lambda path: False),
}


def marked_kind(path: Path) -> str | None:
    """The kind this tool recorded in `path`, or None."""
    data = _read_json(Path(path) / MARKER)
    return data.get("kind") if data else None


def mark_output(path: Path, kind: str) -> None:
    """Record that `path` is a `kind` output of this tool (creating the directory)."""
    assert kind in KINDS, kind
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if marked_kind(path) != kind:
        # through a temporary file that a failed write (a full disk) removes: one left behind is not ours by name,
        # so the same command again, once there is space, would refuse the directory it had just created
        write_atomic(path / MARKER, json.dumps({"kind": kind, "by": "bert-pretrain"}) + "\n", sync=False)


def _describe(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def enclosing_run(path: Path) -> Path | None:
    """The run directory of ours that `path` is (or lies in), or None."""
    return next((p for p in [path, *path.parents] if marked_kind(p) == "run"), None)


def check_output_place(out: Path, inputs: dict[str, Path | str], option: str = "--out") -> None:
    """Refuse an export where what this tool does to the directories around it would take it away or replace it:
    inside a run's checkpoints/ (rotation deletes checkpoints whole), inside shards or a tokenizer (which it
    rebuilds), or another trained run's hf/ (that run's export, replaced by a model it is not; the inputs' runs may)."""
    target = Path(out).resolve()
    for parent in target.parents:
        kind = marked_kind(parent)
        inside = "checkpoints" if parent.name == "checkpoints" and marked_kind(parent.parent) == "run" else kind
        if inside in ("checkpoints", "shards", "tokenizer"):
            what = "a run's checkpoints, which rotation deletes" if inside == "checkpoints" else f"{kind} it rebuilds"
            raise UserError(f"{option} {out} is inside {parent} ({what}): choose an output outside it")
    run = target.parent
    if target.name == "hf" and marked_kind(run) == "run" and (run / "checkpoints").is_dir():  # a trained run's (an
        own = {enclosing_run(Path(p).resolve()) for p in inputs.values()}  # ablation's baseline exports into its own)
        if run not in own:
            raise UserError(
                f"{option} {out} is run {run.name}'s own export, and this export is not of that run (none of its "
                "inputs lies in it): export into it from the run itself, or choose another output"
            )


def claim_output(path: Path, kind: str, option: str = "") -> None:
    """Refuse (UserError) unless this tool may write a `kind` output into `path`: absent, empty, marked `kind`, or
    an unmarked `kind` output of an earlier version. `option` names where the path came from (e.g. '--out')."""
    path = Path(path)
    where = f"{option} {path}" if option else str(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{where} is a file, not a directory: choose another output")
    above = next((p for p in path.parents if p.exists()), None)  # the nearest that exists: it must be a directory
    if above is not None and not above.is_dir():  # (output_dir=a file: a NotADirectoryError traceback)
        raise UserError(f"{where}: {above} is a file, not a directory: choose another output")
    if not path.is_dir():
        return
    entries = [p.name for p in path.iterdir() if p.name != MARKER]
    if not entries:
        return
    found = marked_kind(path)
    if found == kind:
        return
    if found is not None:
        raise UserError(
            f"{where} is {'an' if found[0] in 'aeiou' else 'a'} {found} directory of this tool, not a {kind} "
            "directory: it was left "
            f"untouched; choose another output"
        )
    belongs, signature = _SIGNATURES[kind]
    if all(belongs(n) for n in entries) and signature(path):
        return  # written by an earlier version of this tool, before the marker
    foreign = [n for n in entries if not belongs(n)] or entries
    raise UserError(
        f"{where} already holds files this tool did not write ({_describe(foreign)}): it was left "
        f"untouched; choose an empty or new directory"
    )


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_not_input(out: Path, inputs: dict[str, Path | str], option: str = "--out") -> None:
    """`out` must be neither one of the command's inputs nor a directory holding one (replacing it would delete
    the input). `inputs` maps a description to a path."""
    target = Path(out).resolve()
    resolved = {what: Path(path).resolve() for what, path in inputs.items()}
    same = [what for what, path in resolved.items() if path == target]
    held = [what for what, path in resolved.items() if _within(path, target)]
    for what in same + held:  # the plainest conflict first
        relation = "is" if what in same else "holds"
        named = what if str(inputs[what]) in what else f"{what} ({inputs[what]})"  # a path said once
        raise UserError(
            f"{option} {out} {relation} {named}, an input of this command: writing "
            "there would replace it; choose another output"
        )


# ----------------------------------------------------------------------------------------------
# One writer per directory

_held: dict[Path, list] = {}  # directory -> [open lock file, depth]: re-entrant within a process


@contextlib.contextmanager
def exclusive(directory: Path, doing: str, hint: str = "") -> Iterator[None]:
    """Hold `directory/.lock` (flock) for the body; a second process meets a UserError naming the holder.
    Re-entrant in one process. The lock file records pid, host and start time, for that message only."""
    directory = Path(directory).resolve()
    if directory in _held:
        _held[directory][1] += 1
        try:
            yield
        finally:
            _held[directory][1] -= 1
        return
    directory.mkdir(parents=True, exist_ok=True)
    f = open(directory / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise UserError(
            f"another process is {doing} in {directory}"
            + (f" ({holder})" if holder else "")
            + f"; wait for it to finish{hint}"
        ) from None
    except OSError as err:  # a file system without flock (Lustre mounted without -o flock, some NFS): unlocked
        print(
            f"warning: {directory / LOCK} cannot be locked ({err.strerror}; a file system without flock): a second "
            f"process {doing} in {directory} at the same time is not refused; mount it with flock (Lustre: -o flock)",
            file=sys.stderr,
            flush=True,
        )
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held[directory] = [f, 1]
    try:
        yield
    finally:
        del _held[directory]
        f.close()  # releases the flock (the kernel does the same if we die)


# ----------------------------------------------------------------------------------------------
# Readers and the one process that deletes, or one writer that may wait: an flock on the directory itself (its own
# descriptor, so no file is added and a read-only directory can still be locked by a reader)


def _open_dir(directory: Path) -> int | None:
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # absent (nothing to protect yet) or unreadable: no lock
        return None


@contextlib.contextmanager
def _dir_flock(directory: Path, operation: int, on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """Hold `operation` (LOCK_SH / LOCK_EX) on the directory for the body, waiting for it unless `on_wait` is None;
    yields False when it did not wait and the lock is taken. A file system without flock (or an absent directory)
    is not locked: True, as before the lock existed."""
    fd = _open_dir(Path(directory))
    held = True
    if fd is not None:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
        except BlockingIOError:
            held = on_wait is not None
            if held:
                on_wait()
                fcntl.flock(fd, operation)
        except OSError:
            pass
    try:
        yield held
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock (the kernel does the same if we die)


@contextlib.contextmanager
def shared(directory: Path) -> Iterator[None]:
    """Hold a shared flock on `directory` for the body: a process that deletes in it (`exclusive_if_free`) leaves
    it alone meanwhile. Readers never exclude one another; they wait only while a deletion is under way (brief)."""
    with _dir_flock(directory, fcntl.LOCK_SH, on_wait=lambda: None):
        yield


@contextlib.contextmanager
def exclusive_if_free(directory: Path) -> Iterator[bool]:
    """Try, without waiting, to hold `directory` exclusively: yields True when held (no reader holds `shared`), False
    when a reader does, so the caller can put off what would disturb it. Never blocks."""
    with _dir_flock(directory, fcntl.LOCK_EX) as held:
        yield held


@contextlib.contextmanager
def exclusive_waiting(directory: Path, doing: str) -> Iterator[None]:
    """Hold `directory` exclusively for the body, waiting (and saying so) while another process holds it: for
    short writes that should queue, not fail (two exports into one directory)."""

    def say() -> None:
        print(f"another process is {doing} in {directory}: waiting for it to finish", file=sys.stderr, flush=True)

    with _dir_flock(directory, fcntl.LOCK_EX, on_wait=say):
        yield
