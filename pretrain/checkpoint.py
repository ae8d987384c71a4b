"""Checkpoints: DeepSpeed engine state + trainer state + rng + resolved config + tokenizer.

Layout: <run>/checkpoints/step_00000120/{DeepSpeed files, trainer_state.json, rng_rank0.pt, config.yaml,
tokenizer/} and <run>/checkpoints/latest (a one-line pointer). The pointer moves, atomically, only after
every rank has finished writing, so a job killed mid-write leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.errors import UserError

LATEST = "latest"
INTEGRITY = "integrity.json"
UNIVERSAL = "universal"  # <checkpoint>/universal: DeepSpeed's world-size-free layout, made on a resize
_TAG = re.compile(r"^step_(\d{8})$")


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
        raise UserError(f"checkpoint {path} holds a Python object we do not load "
                        f"({', '.join(found) or 'not tensors or plain data'})") from None
    finally:
        torch.load = original


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_integrity(path: Path) -> None:
    """Size and sha256 of every file of a finished checkpoint (written once all ranks are done)."""
    from data_pipeline.tokenizer import sha256_file

    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != INTEGRITY)
    record = {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    write_atomic(path / INTEGRITY, json.dumps(record, indent=1))


def verify_integrity(path: Path) -> None:
    """Every file the manifest lists is there, whole and unchanged; checked before anything is unpickled."""
    from data_pipeline.tokenizer import sha256_file

    manifest = Path(path) / INTEGRITY
    if not manifest.is_file():
        raise UserError(f"checkpoint {path} has no {INTEGRITY}: it was not completely written")
    for name, want in json.loads(manifest.read_text()).items():
        file = Path(path) / name
        if not file.is_file():
            raise UserError(f"checkpoint file {file} is missing")
        if file.stat().st_size != want["bytes"]:
            raise UserError(f"checkpoint file {file} is truncated or changed ({file.stat().st_size} bytes, "
                            f"expected {want['bytes']})")
        if sha256_file(file) != want["sha256"]:
            raise UserError(f"checkpoint file {file} is corrupt (sha256 mismatch)")


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint directory the `latest` pointer names, or None when there is none yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    path = Path(root) / tag
    if not (path / "trainer_state.json").is_file():
        raise UserError(f"{pointer} names checkpoint '{tag}', but {path}/trainer_state.json is missing")
    return path


def all_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).glob("step_*") if _TAG.match(p.name) and p.is_dir())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(engine, root: Path, state: dict, config_text: str, tokenizer_dir: Path, keep: int) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    root = Path(root)
    tag = tag_for(state["step"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and (root / tag).exists():  # left half-written by a killed job; `latest` never named it
        shutil.rmtree(root / tag)
    _barrier()
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    path = root / tag
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, path / f"rng_rank{rank}.pt")
    if rank == 0:
        (path / "config.yaml").write_text(config_text)
        if tokenizer_dir and Path(tokenizer_dir).is_dir() and not (path / "tokenizer").exists():
            shutil.copytree(tokenizer_dir, path / "tokenizer")
        write_atomic(path / "trainer_state.json", json.dumps(state, indent=1))
    _barrier()  # every rank has written its files
    if rank == 0:
        write_integrity(path)
        write_atomic(root / LATEST, tag)
        for old in all_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def needs_universal(path: Path, world_size: int) -> bool:
    """True when `path` was written by another number of ranks and its optimizer state is split per rank
    (ZeRO 1-3, or DeepSpeed's bf16 optimizer): DeepSpeed can then load it only in its universal layout."""
    saved = json.loads((Path(path) / "trainer_state.json").read_text()).get("world_size", world_size)
    return saved != world_size and any(Path(path).glob("*zero_pp_rank_*_optim_states.pt"))


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
        print(f"{path} was written by another number of ranks: converting it once to DeepSpeed's universal "
              f"checkpoint layout in {out}", file=sys.stderr, flush=True)
        verify_integrity(path)
        tmp = path / f".{UNIVERSAL}-tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        args = Namespace(input_folder=str(path), output_folder=str(tmp), num_extract_workers=1, num_merge_workers=1,
                         keep_temp_folder=False, strict=True, inject_missing_state=True)
        # In this process (1 worker), so DeepSpeed's own loads stay weights-only too
        with weights_only_loads(path), redirect_stdout(sys.stderr):
            ds_to_universal(args)
        os.replace(tmp, out)
    _barrier()
    return out


def load_checkpoint(engine, path: Path, universal: bool = False) -> dict:
    """Restore engine (weights, optimizer, scheduler) and this rank's rng; returns the trainer state.

    `universal`: load <path>/universal (see `make_universal`); the engine must have been configured with
    DeepSpeed's `checkpoint.load_universal`."""
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    verify_integrity(path)
    load_dir, tag = (path, UNIVERSAL) if universal else (path.parent, path.name)
    with weights_only_loads(path):
        load_path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=True)
    if load_path is None:
        raise UserError(f"could not load the DeepSpeed checkpoint in {path}")
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / "trainer_state.json").read_text())


def resolve_checkpoint(run_or_checkpoint: str | Path) -> Path:
    """A run directory (its latest checkpoint), a checkpoints/ directory, or a checkpoint directory."""
    path = Path(run_or_checkpoint)
    if not path.exists():
        raise UserError(f"'{path}' not found: expected a run directory or a checkpoint directory")
    if (path / "trainer_state.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found:
            return found
    raise UserError(f"no checkpoint in '{path}' (looked for checkpoints/latest and trainer_state.json)")


def load_module_state(path: Path) -> dict[str, torch.Tensor]:
    """fp32 weights of a checkpoint without a DeepSpeed engine (any ZeRO stage, any precision, any world size).

    Where DeepSpeed keeps fp32 master partitions (bf16/fp16, ZeRO 1-3) they are the exact weights and are
    merged with its own zero_to_fp32; otherwise (fp32, ZeRO 0) the module state is the full model.
    """
    path = Path(path)
    verify_integrity(path)
    with weights_only_loads(path):
        if any(path.glob("*optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
        else:
            state = torch.load(path / "mp_rank_00_model_states.pt", map_location="cpu")["module"]
    return {k: v.float() for k, v in state.items() if v is not None}
