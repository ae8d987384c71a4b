"""Process-group set-up and the DeepSpeed config, derived from the RunConfig (one source of truth)."""

from __future__ import annotations

import os
import socket
from functools import lru_cache

from pretrain.config import RunConfig


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@lru_cache(maxsize=1)
def cpu_supports_bf16() -> bool:
    """Native bf16 on this CPU (AVX512-BF16 or AMX): bf16 is then both correct and fast."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    if has_cuda():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_supports_bf16() else "fp32"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Join (or, for a plain single process, create) the process group; returns (rank, world_size).

    Under the `deepspeed` launcher, torchrun or srun the rank variables are set; a plain `pretrain train`
    is a world of one, which DeepSpeed would otherwise look for through MPI.
    """
    if not has_cuda():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without a launcher
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=None, verbose=False)
        _unlink_shm_allreduce_buffer(dist)
    if has_cuda():
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def _unlink_shm_allreduce_buffer(dist) -> None:
    """Remove this rank's name for DeepSpeed's CPU all-reduce buffer once every rank has mapped it.

    DeepSpeed's CPU backend creates a ~66 MB POSIX shared-memory segment per rank, named by
    uid/MASTER_ADDR/MASTER_PORT/rank, and never unlinks it: every run on a fresh port leaves one in /dev/shm
    (which is RAM) until the machine runs out. Ranks open each other's segment only inside init, so after
    a barrier the names are no longer needed; the mappings stay valid until the processes exit.
    """
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank()
    )
    if dist.get_world_size() > 1:
        dist.barrier()
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict:
    t = cfg.train
    precision = resolve_precision(t.precision)
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.micro_batch_size * t.grad_accum_steps * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,  # our AdamW/LAMB are torch optimizers with a non-finite guard
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                      "hysteresis": 2, "min_loss_scale": 1}
    return ds
