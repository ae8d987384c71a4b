"""Checkpoints: DeepSpeed engine state + trainer state + rng + resolved config + tokenizer.

Layout: <run>/checkpoints/step_00000120/{DeepSpeed files, trainer_state.json, rng_rank0.pt, config.yaml,
tokenizer/} and <run>/checkpoints/latest (a one-line pointer). The pointer moves, atomically, only after
every rank has finished writing, so a job killed mid-write leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from pretrain.core.errors import UserError
from pretrain.core.files import fsync_path, write_atomic
from pretrain.train.state import STATE_FILE, TrainState

LATEST = "latest"
INTEGRITY = "integrity.json"
UNIVERSAL = "universal"  # <checkpoint>/universal: DeepSpeed's world-size-free layout, made on a resize
_TAG = re.compile(r"^step_(\d{8,})$")  # tag_for's: 8 digits, more from step 100,000,000


def _safe_globals() -> list:
    """The few non-tensor classes DeepSpeed writes into its checkpoints: nothing else is ever unpickled."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_loads(path: Path):
    """Every torch.load inside (DeepSpeed's own included, which ask for weights_only=False) loads tensors and
    plain data only, plus the allowlisted DeepSpeed classes; anything else fails naming the checkpoint."""
    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = load
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            yield
    except pickle.UnpicklingError as err:
        found = re.findall(r"GLOBAL ([\w.]+)", str(err))
        raise UserError(
            f"checkpoint {path} holds a Python object we do not load "
            f"({', '.join(found) or 'not tensors or plain data'})"
        ) from None
    finally:
        torch.load = original


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of_tag(tag: str) -> int | None:
    """The step a checkpoint directory's name says (`tag_for`'s inverse), or None for any other name."""
    found = _TAG.match(tag)
    return int(found.group(1)) if found else None


def write_integrity(path: Path) -> None:
    """Size and sha256 of every file of a finished checkpoint (written once all ranks are done)."""
    from pretrain.core.files import sha256_file

    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != INTEGRITY)
    # each file read once: hashed, and its bytes forced to the disk before the record (then `latest`) names it
    record = {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": sha256_file(p, sync=True)} for p in files}
    write_atomic(path / INTEGRITY, json.dumps(record, indent=1))
    for directory in [*sorted(p for p in path.rglob("*") if p.is_dir()), path]:  # their entries, the record's too
        fsync_path(directory)


def verify_integrity(path: Path) -> None:
    """Every file the manifest lists is there, whole and unchanged; checked before anything is unpickled."""
    from pretrain.core.files import sha256_file

    manifest = Path(path) / INTEGRITY
    if not manifest.is_file():
        raise UserError(f"checkpoint {path} has no {INTEGRITY}: it was not completely written")
    try:
        record = json.loads(manifest.read_text())
        entries = [(name, int(want["bytes"]), str(want["sha256"])) for name, want in record.items()]
    except (ValueError, UnicodeDecodeError, AttributeError, TypeError, KeyError):  # torn or not a record of ours
        raise UserError(f"checkpoint {path}: its {INTEGRITY} is damaged (not the record this tool writes)") from None
    for name, size, sha in entries:
        want = {"bytes": size, "sha256": sha}
        file = Path(path) / name
        if not file.is_file():
            raise UserError(f"checkpoint file {file} is missing")
        if file.stat().st_size != want["bytes"]:
            raise UserError(
                f"checkpoint file {file} is truncated or changed ({file.stat().st_size} bytes, "
                f"expected {want['bytes']})"
            )
        if sha256_file(file) != want["sha256"]:
            raise UserError(f"checkpoint file {file} is corrupt (sha256 mismatch)")


def _complete(path: Path) -> bool:
    """Written to the end: its integrity record is the last file a checkpoint gets."""
    return (path / INTEGRITY).is_file() and (path / STATE_FILE).is_file()


def _read_pointer(pointer: Path) -> str | None:
    """The tag `latest` names, or None when it is absent, empty, unreadable or not a checkpoint tag."""
    try:
        tag = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if _TAG.match(tag) else None


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint directory the `latest` pointer names, or None when the run has none yet. If the user moved that
    checkpoint away (as a damaged checkpoint's message suggests), the newest complete one before it.

    Checkpoints without a readable `latest` are never taken for a fresh start (that would cut metrics.jsonl back and
    rotate the checkpoints away): a UserError names the newest complete one and the command that resumes from it."""
    root = Path(root)
    pointer = root / LATEST
    tag = _read_pointer(pointer)
    if tag is None:
        complete = [c for c in all_checkpoints(root) if _complete(c)]
        if not complete:
            return None  # a fresh run (or one killed while writing its first checkpoint: nothing to keep)
        state = "missing" if not pointer.exists() else "empty or unreadable"
        raise UserError(
            f"{pointer} is {state}, but {root} holds {len(complete)} complete checkpoint(s), the newest "
            f"{complete[-1].name}. Nothing was changed. To resume from it: echo {complete[-1].name} > {pointer} "
            "and run the same command again; to start over, use another run name (name=...)"
        )
    path = root / tag
    if (path / STATE_FILE).is_file():
        return path
    earlier = [c for c in all_checkpoints(root) if step_of_tag(c.name) < step_of_tag(tag) and _complete(c)]
    if not path.exists() and earlier:
        print(
            f"{path} is gone: continuing from {earlier[-1].name}, the newest complete checkpoint before it",
            file=sys.stderr,
            flush=True,
        )
        return earlier[-1]
    raise UserError(f"{pointer} names checkpoint '{tag}', but {path}/{STATE_FILE} is missing")


def _intact_before(path: Path) -> Path | None:
    """The newest checkpoint before `path` (same run) whose files verify."""
    step = step_of_tag(path.name)
    if step is None:  # a checkpoint directory named otherwise has no place among the steps beside it
        return None
    for candidate in reversed(all_checkpoints(path.parent)):
        if step_of_tag(candidate.name) < step:
            try:
                verify_integrity(candidate)
                return candidate
            except UserError:
                continue
    return None


def damaged(path: Path, err: UserError, then: str = "run the same command again") -> UserError:
    """`err` (a failed integrity check of checkpoint `path`) with what the user can do: the previous intact
    checkpoint, if there is one, and how to continue from it."""
    previous = _intact_before(Path(path))
    if previous is None:
        return UserError(f"{err}; no earlier intact checkpoint in {Path(path).parent}")
    aside = Path(path).parent / f"damaged-{Path(path).name}"
    return UserError(
        f"{err}. The previous checkpoint {previous.name} is intact: to continue from it, move the damaged "
        f"one out of the way (mv {path} {aside}) and {then}"
    )


def all_checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories in `root`, by step (not by name: step_100000000 comes after step_99999999)."""
    found = [p for p in Path(root).glob("step_*") if _TAG.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: step_of_tag(p.name))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if path else 0


def _disk_full(err: BaseException, root: Path, previous: Path | None) -> str | None:
    """A message when `err`, raised while writing a checkpoint into `root`, means the disk is full. torch.save
    reports a full disk as a RuntimeError from its zip writer ("unexpected pos ..."), not as ENOSPC: without an
    errno, little space left says it. An error with another errno (EIO, EACCES) is that error, whatever the space."""
    code = getattr(err, "errno", None)
    if code is not None and code != errno.ENOSPC:
        return None
    free = shutil.disk_usage(root).free
    if code != errno.ENOSPC and free >= max(64 << 20, _size(previous)):
        return None
    return (
        f"no space left on device on {root} while writing a checkpoint ({free >> 20} MiB free"
        + (f", a checkpoint takes {_size(previous) >> 20} MiB" if previous else "")
        + ")"
    )


def save_checkpoint(
    engine,
    root: Path,
    state: TrainState,
    config_text: str,
    tokenizer: dict[str, bytes] | None,
    keep: int,
    extra: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory. A rank that fails to write (a full disk)
    fails every rank, and the half-written directory goes: `latest` still names the previous checkpoint. `tokenizer`:
    the files of the tokenizer the run trains with (`read_tokenizer_files`), written into the checkpoint. `extra`:
    more files of tensors (name -> state) that rank 0 writes, such as the weight EMA (the same on every rank)."""
    from pretrain.train.distributed import any_rank

    root = Path(root)
    tag = tag_for(state.step)
    path = root / tag
    rank = dist.get_rank() if dist.is_initialized() else 0
    previous = latest_checkpoint(root) if rank == 0 else None
    if rank == 0 and path.exists():
        _clear_the_way(path)
    _barrier()
    failure = None
    try:
        with _writes_that_fail_return(engine) as failed:
            engine.save_checkpoint(str(root), tag=tag, save_latest=False)
        if failed:
            raise failed[0]
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, path / f"rng_rank{rank}.pt")
        if rank == 0:
            (path / "config.yaml").write_text(config_text)
            if tokenizer and not (path / "tokenizer").exists():
                from data_pipeline.tokenizer import copy_tokenizer_files

                copy_tokenizer_files(tokenizer, path / "tokenizer")
            for name, tensors in (extra or {}).items():
                torch.save(tensors, path / name)
            state.save(path)
    except (OSError, RuntimeError) as err:
        failure = err
    if any_rank(failure is not None):  # also the barrier after every rank's writes
        _abandon(path, failure, previous, rank)
    if rank == 0:
        try:  # every rank's files on the disk, then the record of them, then the pointer: either may not fit
            write_integrity(path)
            write_atomic(root / LATEST, tag)
        except OSError as err:
            failure = err
    if any_rank(failure is not None):
        _abandon(path, failure, previous, rank)
    if rank == 0:
        fsync_path(root)  # the pointer's rename
        rotate(root, keep, path)
    _barrier()
    return path


@contextmanager
def _writes_that_fail_return(engine):
    """DeepSpeed's file writes (its checkpoint engine's `save`, and its copy of zero_to_fp32.py) record a failure in
    the yielded list and return, for the body: raised inside `engine.save_checkpoint`, a full disk on one rank skipped
    the barrier DeepSpeed ends with, where every other rank waited for train.collective_timeout_minutes (30 by default)
    and the run then blamed a lost rank. Now each rank goes through DeepSpeed's collectives, and `any_rank` fails them
    all with the disk's error."""
    failed: list[BaseException] = []
    writer = getattr(engine, "checkpoint_engine", None)
    # its checkpoint engine's writes, and rank 0's copy of zero_to_fp32.py beside them (shutil, not the engine)
    patched = [(o, name) for o, name in ((writer, "save"), (engine, "_copy_recovery_script")) if hasattr(o, name)]
    originals = [(o, name, getattr(o, name), name in vars(o)) for o, name in patched]

    def recording(write):
        def run(*args, **kwargs):
            if failed:
                return None  # the checkpoint is lost already: write nothing more of it
            try:
                return write(*args, **kwargs)
            except (OSError, RuntimeError) as err:  # torch.save's writer says ENOSPC as a RuntimeError
                failed.append(err)
                return None

        return run

    for o, name, write, _ in originals:
        setattr(o, name, recording(write))
    try:
        yield failed
    finally:
        for o, name, write, own in originals:
            if own:
                setattr(o, name, write)
            else:
                delattr(o, name)  # the class's method again


def _clear_the_way(path: Path) -> None:
    """A directory already at the step being saved: one a killed save left half-written (`latest` never named it)
    goes; a complete one is a later checkpoint of the timeline this run resumed before (from an earlier checkpoint,
    say with a lower learning rate past a loss spike), which is the user's to compare with or go back to: it is set
    aside as `<tag>.superseded[-N]`, where neither rotation nor resume looks, and said."""
    if not _complete(path):
        shutil.rmtree(path)
        return
    aside = path.with_name(f"{path.name}.superseded")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.superseded-{n}")
    os.replace(path, aside)
    print(
        f"{path.name} of the timeline this run was resumed before is kept as {aside} (this run writes its own "
        f"{path.name}); delete it when you no longer need it",
        file=sys.stderr,
        flush=True,
    )


def _abandon(path: Path, failure: BaseException | None, previous: Path | None, rank: int) -> NoReturn:
    """Collective, after a rank (this one where `failure`) failed to write checkpoint `path`: rank 0 removes what
    was written (`latest` still names `previous`), and every rank raises, a full disk as one line saying so."""
    full = _disk_full(failure, path.parent, previous) if failure is not None else None
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    if rank != 0:  # the pointer alone (rank 0's `latest_checkpoint` also says where it went on from)
        tag = _read_pointer(path.parent / LATEST)
        previous = path.parent / tag if tag else None
    kept = f"{previous.name} stays the latest checkpoint" if previous else "there is no checkpoint yet"
    if full:
        raise UserError(f"{full}; {kept}. Free some space and run the same command again") from failure
    if failure is not None:
        raise failure
    raise UserError(f"another rank failed to write checkpoint {path.name} (its message says why); {kept}")


def rotate(root: Path, keep: int, current: Path) -> None:
    """Delete all but the newest `keep` complete checkpoints up to `current` (the one just written, which `latest`
    names and which always stays), unless a reader (`pretrain export`, `eval`) holds `root` (`reading_checkpoints`):
    then leave them for the next save, which deletes every one past `keep`. Never waits, so an export cannot stall or
    break training. Directories past `current` are not counted nor touched: a half-written one left by a killed save
    (the save at its step replaces it), or the later checkpoints of a run resumed from an earlier one."""
    from pretrain.core.outputs import exclusive_if_free

    if keep <= 0:
        return
    upto = [c for c in all_checkpoints(root) if step_of_tag(c.name) <= step_of_tag(current.name)]
    kept = {current, *[c for c in upto if _complete(c)][-keep:]}
    old = [c for c in upto if c not in kept]
    if not old:
        return
    with exclusive_if_free(root) as free:
        if free:
            for path in old:
                shutil.rmtree(path, ignore_errors=True)


def checkpoints_root(run_or_checkpoint: str | Path) -> Path:
    """The directory whose checkpoints `resolve_checkpoint(run_or_checkpoint)` chooses among, where `rotate`
    deletes: <run>/checkpoints for a run, the parent of a checkpoint directory, else the path itself."""
    path = Path(run_or_checkpoint)
    if (path / STATE_FILE).is_file():
        return path.parent
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def run_of(source: str | Path) -> Path | None:
    """The run directory `source` belongs to as the user has it now (copied or moved since, not where its config
    says it was trained): a run directory itself, its checkpoints/ directory, or a checkpoint directory in it;
    None for a checkpoint directory outside any run."""
    from pretrain.core.outputs import marked_kind

    source = Path(source).resolve()
    if (source / STATE_FILE).is_file():  # <run>/checkpoints/step_X, or a checkpoint on its own
        run = source.parent.parent if source.parent.name == "checkpoints" else None
    elif source.name == "checkpoints" and not (source / "checkpoints").is_dir():
        run = source.parent
    else:
        return source  # a run directory (or nothing loadable: loading it says what is wrong)
    if run is None or not (marked_kind(run) == "run" or (run / "config.yaml").is_file()):
        return None
    return run


@contextmanager
def reading_checkpoints(run_or_checkpoint: str | Path):
    """Hold the checkpoints of a run (or a checkpoint's siblings) shared for the body: a trainer saving into it
    meanwhile keeps them instead of rotating them away under the reader. Resolve the checkpoint inside, not
    before: `latest` may move on until the lock is held."""
    from pretrain.core.outputs import shared

    with shared(checkpoints_root(run_or_checkpoint)):
        yield


def load_ema(path: Path) -> dict[str, torch.Tensor] | None:
    """The weight EMA a checkpoint holds (`pretrain.train.ema`), or None; loaded as tensors only."""
    from pretrain.train.ema import EMA_FILE

    file = Path(path) / EMA_FILE
    if not file.is_file():
        return None
    with weights_only_loads(path):
        saved = torch.load(file, map_location="cpu")
    if not isinstance(saved, dict) or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        raise UserError(f"{file} does not hold the EMA weights this tool writes")
    return saved


def needs_universal(path: Path, world_size: int) -> bool:
    """True when `path` was written by another number of ranks and its optimizer state is split per rank
    (ZeRO 1-3, or DeepSpeed's bf16 optimizer): DeepSpeed can then load it only in its universal layout."""
    saved = TrainState.load(path).world_size
    return saved is not None and saved != world_size and zero_partitioned(path)


def make_universal(path: Path) -> Path:
    """Collective. Rank 0 converts the checkpoint to DeepSpeed's universal layout in <path>/universal (once:
    a later resize reuses it), through a temporary directory renamed into place, so a job killed while
    converting leaves nothing half-made. The checkpoint itself is left as it was."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    path = Path(path)
    out = path / UNIVERSAL
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not out.is_dir():
        print(
            f"{path} was written by another number of ranks: converting it once to DeepSpeed's universal "
            f"checkpoint layout in {out}",
            file=sys.stderr,
            flush=True,
        )
        verify_integrity(path)
        tmp = path / f".{UNIVERSAL}-tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        args = Namespace(
            input_folder=str(path),
            output_folder=str(tmp),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
        # In this process (1 worker), so DeepSpeed's own loads stay weights-only too
        with weights_only_loads(path), redirect_stdout(sys.stderr):
            ds_to_universal(args)
        os.replace(tmp, out)
    _barrier()
    return out


def load_checkpoint(engine, path: Path, universal: bool = False) -> TrainState:
    """Restore engine (weights, optimizer, scheduler) and this rank's rng; returns the trainer state.

    `universal`: load <path>/universal (see `make_universal`); the engine must have been configured with
    DeepSpeed's `checkpoint.load_universal`."""
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        verify_integrity(path)
    except UserError as err:
        raise damaged(path, err) from None
    load_dir, tag = (path, UNIVERSAL) if universal else (path.parent, path.name)
    with weights_only_loads(path):
        try:
            load_path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=True)
        except RuntimeError as err:  # shapes or names that do not fit (only past train.allow_changes)
            # torch's first line only names the module; the keys follow
            detail = " ".join(line.strip() for line in str(err).strip().splitlines()[:3])
            detail = detail if len(detail) <= 500 else detail[:500] + " ..."
            raise UserError(f"checkpoint {path} does not fit this model: {detail}") from None
    if load_path is None:
        raise UserError(f"could not load the DeepSpeed checkpoint in {path}")
    if universal:
        _own_step_counts(engine)
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        with weights_only_loads(path):
            rng = torch.load(rng_file)
        if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
            raise UserError(f"{rng_file} is not a random-number state written by this tool")
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return TrainState.load(path)
    # A rank the checkpoint had no rng state for: its seed (the run's, by rank) moved on by the step, so that its
    # dropout and sampling streams do not replay those of step 0
    state = TrainState.load(path)
    torch.manual_seed(torch.initial_seed() + 1_000_003 * state.step)
    return state


def _own_step_counts(engine) -> None:
    """Give each optimizer state its own `step` tensor. DeepSpeed's universal load under ZeRO-3 (0.19,
    stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3) puts one tensor in every sub-group's state, and the
    fused AdamW then adds 1 to it once per sub-group: Adam's step ran 2x per step after a resume on another number
    of ranks (bias correction off from there on, and saved so)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    seen: set[int] = set()
    for state in getattr(inner, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def resolve_checkpoint(run_or_checkpoint: str | Path) -> Path:
    """A run directory (its latest checkpoint), a checkpoints/ directory, or a checkpoint directory."""
    path = Path(run_or_checkpoint)
    if not path.exists():
        raise UserError(f"'{path}' not found: expected a run directory or a checkpoint directory")
    if (path / STATE_FILE).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found:
            return found
    raise UserError(f"no checkpoint in '{path}' (looked for checkpoints/latest and {STATE_FILE})")


def _zero0_masters(model_states: dict) -> dict[str, torch.Tensor] | None:
    """The fp32 master weights DeepSpeed's ZeRO-0 fp16 wrappers keep (fp16, and bf16 before it ran under torch
    autocast): FP16_UnfusedOptimizer saves `fp32_groups`, one tensor per parameter; FP16_Optimizer (fused)
    `fp32_groups_flat`, one flat tensor per group. Neither saves names: they follow our optimizer's parameter
    order (`optim.param_groups`), and every master must round to the saved low-precision weight (DeepSpeed copies
    master -> module after each step), which catches any other order. None for other checkpoints."""
    from pretrain.train.optim import decays

    opt = model_states.get("optimizer") or {}
    if not ({"fp32_groups", "fp32_groups_flat"} & set(opt)):
        return None
    module = model_states["module"]
    first, aliases = {}, {}  # tied weights share storage in the saved module
    for name, t in module.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in first and t.numel():
            aliases[name] = first[key]
        else:
            first[key] = name
    names = list(first.values())
    names = [n for n in names if decays(n, module[n])] + [n for n in names if not decays(n, module[n])]
    if "fp32_groups" in opt:
        masters = [t for group in opt["fp32_groups"] for t in group]
    else:
        flat = torch.cat([g.view(-1) for g in opt["fp32_groups_flat"]])
        sizes = [module[n].numel() for n in names]
        masters = [t.view(module[n].shape) for n, t in zip(names, flat[: sum(sizes)].split(sizes))]
    state = {}
    for name, master in zip(names, masters, strict=True):
        if master.shape != module[name].shape or not torch.equal(master.to(module[name].dtype), module[name]):
            raise UserError(
                f"fp32 master weights of the checkpoint do not match its parameter {name}: "
                "it was written by an optimizer with another parameter order"
            )
        state[name] = master.clone()
    for alias, name in aliases.items():
        state[alias] = state[name]
    return {**{k: v for k, v in module.items() if k not in state}, **state}  # buffers, as saved


def load_module_state(path: Path) -> dict[str, torch.Tensor]:
    """The exact fp32 weights of a checkpoint without a DeepSpeed engine (any ZeRO stage, precision, world size):
    where DeepSpeed keeps fp32 master copies they are the weights, never the module's bf16/fp16 copy.

    ZeRO 1-3: the fp32 partitions, merged by DeepSpeed's zero_to_fp32. ZeRO-0 under DeepSpeed's fp16 wrappers: their
    fp32 groups (`_zero0_masters`). ZeRO-0 otherwise (fp32, or bf16 under autocast): the module, fp32 already.
    """
    path = Path(path)
    try:
        verify_integrity(path)
    except UserError as err:
        raise damaged(path, err, "use the intact one") from None
    with weights_only_loads(path):
        if zero_partitioned(path):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            try:
                with redirect_stdout(io.StringIO()):
                    state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
            except (FileNotFoundError, ValueError) as err:  # DeepSpeed's words for shards missing or mismatched
                raise UserError(f"checkpoint {path}: cannot merge its ZeRO optimizer shards: {err}") from None
        else:
            module_file = path / "mp_rank_00_model_states.pt"
            if not module_file.is_file():
                raise UserError(f"checkpoint {path} has no {module_file.name}: not a DeepSpeed checkpoint of this tool")
            model_states = torch.load(module_file, map_location="cpu")
            state = _zero0_masters(model_states) or model_states["module"]
    return {k: v.float() for k, v in state.items() if v is not None}


_ZERO_SHARD = re.compile(r"^((bf16|fp16)_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")


def zero_partitioned(path: Path) -> bool:
    """Whether the checkpoint's weights live in DeepSpeed's ZeRO optimizer shards (`zero_pp_rank_R_mp_rank_M_
    optim_states.pt`, which zero_to_fp32 merges). Only the files its integrity manifest lists count, the ones the
    trainer wrote: anything copied in later (a stray `*optim_states.pt`) is not part of the checkpoint."""
    manifest = Path(path) / INTEGRITY
    try:
        names = list(json.loads(manifest.read_text()))
    except (OSError, ValueError):  # verify_integrity has already refused a checkpoint without one
        names = [p.name for p in Path(path).iterdir()]
    return any(_ZERO_SHARD.match(name) for name in names)
