"""Process groups: joining them (any launcher, or none), a gloo group for small CPU-side decisions, and precision."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from functools import lru_cache

from pretrain.core.provenance import SOURCE_ROOT

# what torchrun, the deepspeed launcher and this module set for a rank (TORCHELASTIC_* too, by prefix)
LAUNCHER_VARS = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    *("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"),
    *("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS"),  # what makes `init_distributed` join srun's world
)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def local_device():
    """This process's device: its GPU where there is one (`init_distributed` picks it by LOCAL_RANK), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


@lru_cache(maxsize=1)
def cpu_supports_bf16() -> bool:
    """Native bf16 on this CPU (AVX512-BF16 or AMX): bf16 is then both correct and fast."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


BF16_AUTOCAST = "bf16-autocast"  # the precision mode of bf16 under ZeRO-0 (`run_precision`)


def resolve_precision(requested: str) -> str:
    """train.precision on this machine: auto -> bf16 where it is native, else fp16 on a GPU, fp32 on a CPU."""
    if requested != "auto":
        return requested
    import torch

    if has_cuda():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_supports_bf16() else "fp32"


def slow_precision_note(precision: str) -> str | None:
    """A line for the log where the run's precision (`run_precision`) is bf16 on a CPU without native bf16: there
    its products are emulated (0.9 GFLOP/s against fp32's 58 on one thread of a CPU without AVX-512), which
    `auto` avoids by choosing fp32."""
    if precision not in ("bf16", BF16_AUTOCAST) or has_cuda() or cpu_supports_bf16():
        return None
    return (
        "train.precision=bf16 on a CPU without native bf16 (AVX512-BF16 or AMX): its matrix products are emulated, "
        "many times slower than fp32 (train.precision=auto chooses fp32 on this machine)"
    )


def run_precision(train_cfg, legacy: bool = False) -> str:
    """How the run's precision runs, decided here only (`pretrain.train.setup.ResolvedRun.precision` holds it):
    fp32, bf16-autocast, bf16 or fp16. bf16 under ZeRO-0 is torch autocast over fp32 weights, as DDP with AMP and
    transformers' Trainer run it: no DeepSpeed low-precision wrapper in the step, fp32 weights in checkpoints and
    exports. Under ZeRO 1-3 it is DeepSpeed's bf16 (bf16 weights and gradients, fp32 master partitions: half the
    communication). fp16 is DeepSpeed's, with dynamic loss scaling.

    `legacy`: the mode as checkpoints written before fingerprints had it, when bf16 under ZeRO-0 still ran on
    DeepSpeed's bf16 wrapper ('bf16', never 'bf16-autocast').

    fp8 runs as bf16 does: its float8 products are inside the model (`pretrain.model.fp8`), not a mode of its own."""
    precision = resolve_precision(train_cfg.precision)
    precision = "bf16" if precision == "fp8" else precision
    return BF16_AUTOCAST if precision == "bf16" and train_cfg.zero_stage == 0 and not legacy else precision


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env(**extra: str) -> dict[str, str]:
    """The environment for a fresh one-process run of this package in a subprocess (an ablation arm, a benchmark's
    run, a test's CLI call): this package's root ahead of what PYTHONPATH holds already (replacing it would lose
    what a machine without a registry installs there, DeepSpeed on a lent GPU machine), no launcher's rank
    variables (the child is a world of its own, on a port of its own), then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))
    return env | extra


def _ranks_from_srun() -> None:
    """The rank variables of a task of an srun step of several tasks (srun without a launcher: launch/slurm.sbatch).
    Slurm also sets SLURM_PROCID and SLURM_NTASKS in the batch script itself and in a one-task step, where this
    process is a world of its own: taken for rank 0 of the job's tasks it looked for MPI, or waited for the others
    until the collective timeout."""
    from pretrain.core.errors import UserError

    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if "SLURM_PROCID" not in os.environ or not tasks.isdigit() or int(tasks) < 2:
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise UserError(
            f"an srun step of {tasks} tasks needs {' and '.join(missing)}: the address of the step's first node and a "
            "free port every task reaches (launch/slurm.sbatch sets both)"
        )
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = tasks
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def _local_device(visible: int) -> int:
    """This process's GPU among the `visible` ones: LOCAL_RANK, modulo them where it names one past them (srun
    --gpus-per-task shows each task its own, as device 0), written back: DeepSpeed's engine sets its device from
    LOCAL_RANK again (an invalid device ordinal for every task but the first on a node)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if visible and local >= visible:
        os.environ["LOCAL_RANK"] = str(local % visible)
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(timeout_minutes: float = 30.0) -> tuple[int, int]:
    """Join (or, for a plain single process, create) the process group; returns (rank, world_size).

    Under the `deepspeed` launcher, torchrun or srun the rank variables are set; a plain `pretrain train`
    is a world of one, which DeepSpeed would otherwise look for through MPI. `timeout_minutes` bounds every
    collective, in every group (a host lost without closing its connections otherwise leaves the others waiting).
    """
    if not has_cuda():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:
        _ranks_from_srun()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if has_cuda():  # before the group: NCCL's first collectives (the barriers below) run on the current device
        import torch

        torch.cuda.set_device(_local_device(torch.cuda.device_count()))
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        # Groups made later (DeepSpeed's, our control group) take torch's module default, not the first group's
        c10d.default_pg_timeout = timeout
        if hasattr(c10d, "default_pg_nccl_timeout"):
            c10d.default_pg_nccl_timeout = timeout
        deepspeed.init_distributed(dist_backend=None, verbose=False, timeout=timeout)
        _unlink_shm_allreduce_buffer(dist)
        _make_control_group(dist)
    return dist.get_rank(), dist.get_world_size()


_control_group = None


def _make_control_group(dist) -> None:
    """Collective (every rank, right after init): a gloo group over all ranks for the trainer's small CPU-side
    decisions (stop flags, target counts, metric sums). Under NCCL the default group takes CUDA tensors only, and
    moving a flag to the GPU to reduce it would make the host wait for the GPU."""
    global _control_group
    if dist.get_world_size() > 1 and dist.get_backend() != "gloo":
        _control_group = dist.new_group(backend="gloo")


def control_group():
    """The process group for CPU tensors: the gloo control group, or None (the default group) where that is gloo."""
    return _control_group


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


def any_rank(*flags: bool) -> bool | list[bool]:
    """Collective: each flag OR-ed over ranks in one all-reduce, so every rank takes the same decision (one flag:
    a bool; several: a list). Also a barrier."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        out = [bool(f) for f in flags]
    else:
        t = torch.tensor([1.0 if f else 0.0 for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
        out = [bool(v) for v in t.tolist()]
    return out[0] if len(flags) == 1 else out


_waits = 0


def rank0_alone(
    work, what: str, poll_seconds: float = 1.0, say_every_minutes: float = 5.0, linger_seconds: float = 60.0
):
    """Collective: `work()` runs on rank 0 while the other ranks wait for it with no time limit (building a large
    corpus's tokenizer and shards can take longer than any collective timeout). Returns work's result on rank 0 and
    None elsewhere; where work raised on rank 0, the other ranks raise a UserError saying so.

    The others poll a key in the process group's store: while rank 0 works the wait goes on. Where the store lives in
    rank 0's process (the DeepSpeed launcher, env://), rank 0's death fails their connection and they stop with it;
    under torchrun the store is its agent's, which ends the other workers when one fails. A rank 0 whose work failed
    waits (`linger_seconds` at most; not after a ^C) until each other rank has read that: exiting at once took its
    store with it, and the others met a lost connection rather than the failure."""
    import time

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from pretrain.core.errors import UserError

    global _waits
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    _waits += 1  # every rank calls this in the same order: the n-th call's key is the same on all of them
    store, key = c10d._get_default_store(), f"pretrain/rank0_alone/{_waits}"
    if dist.get_rank() == 0:
        try:
            result = work()
        except BaseException as err:
            store.set(key, b"failed")
            if isinstance(err, Exception):  # not a ^C: the others read it before this process (maybe the store) goes
                deadline, others = time.monotonic() + linger_seconds, dist.get_world_size() - 1
                while time.monotonic() < deadline and store.add(f"{key}/read", 0) < others:
                    time.sleep(min(poll_seconds, 0.1))
            raise
        store.set(key, b"done")
        return result
    started, said = time.monotonic(), time.monotonic()
    while not store.check([key]):
        time.sleep(poll_seconds)
        if time.monotonic() - said >= say_every_minutes * 60 and os.environ.get("LOCAL_RANK", "0") == "0":
            said = time.monotonic()
            print(f"rank {dist.get_rank()}: waiting for rank 0 to {what} ({(said - started) / 60:.0f} min)", flush=True)
    done = store.get(key) == b"done"
    store.add(f"{key}/read", 1)
    if not done:
        raise UserError(f"rank 0 could not {what} (its message says why)")
    return None


def check_shared_directory(path, what: str) -> None:
    """Collective: every rank sees the directory rank 0 writes to as `path`. Rank 0 writes a token there that each
    rank reads back; a rank that reads another (or none) is on storage of its own, a node-local disk where the
    path should be on one every node mounts. Unchecked, each rank resumed from its own disk's checkpoints (one from
    step N, one from step 0), their gradients were averaged, and rank 0's checkpoints lacked the others' shards,
    with the run reported complete."""
    import uuid
    from pathlib import Path

    import torch.distributed as dist

    from pretrain.core.errors import UserError
    from pretrain.core.files import write_atomic

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    probe = Path(path) / ".shared-check"
    sent = [uuid.uuid4().hex, str(path)] if dist.get_rank() == 0 else [None, None]  # the token, rank 0's path
    if dist.get_rank() == 0:
        write_atomic(probe, sent[0])
    dist.broadcast_object_list(sent, src=0, group=control_group())
    try:
        seen = probe.read_text()
    except OSError:
        seen = None
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, (seen != sent[0], socket.gethostname()), group=control_group())
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    others = [f"rank {r} on {host}" for r, (cut_off, host) in enumerate(blind) if cut_off]
    if others:
        raise UserError(
            f"{', '.join(others)} cannot see {what} {sent[1]} as rank 0 on {blind[0][1]} writes it: it must be on a "
            "file system every node mounts, at the same path (not a node-local disk)"
        )
