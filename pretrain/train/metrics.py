"""Where training metrics go: metrics.jsonl (one object per logged step), wandb (offline by default), TensorBoard
event files (`tensorboard.enabled`), a progress bar. Only rank 0 writes; the others get a logger that does nothing."""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from pretrain.core.config import require_tensorboard
from pretrain.core.files import write_atomic, writing
from pretrain.core.measures import BinaryAUC, Mean


class MetricSums:
    """Running sums of a log interval's metrics, kept on the device: adding a micro-batch's metrics reads nothing
    back to the host. `read` moves them to the host once, sums them over ranks in one CPU all-reduce (the gloo
    control group) and finalises each (a Mean divides, an AUC integrates its histograms)."""

    def __init__(self):
        self.device: dict[str, torch.Tensor] = {}
        self.host: dict[str, float] = {}
        self.kinds: dict[str, type] = {}

    def add(self, metrics: dict, parts: int = 1) -> None:
        """A micro-batch's metrics, of an optimizer step split into `parts` micro-batches over all ranks: a
        micro-batch mean (the loss) weighs 1 / parts, so that an interval's value is the mean of its steps' (the
        same on any number of ranks and accumulation, also across a resume on another number of ranks)."""
        for name, stat in metrics.items():
            if isinstance(stat, torch.Tensor):
                stat = Mean.micro_batch(stat)
            if isinstance(stat, Mean):
                stat = stat.step_share(parts)
            part = stat.device_part()
            # the first part copied: it may be a view of a compiled function's output, which a CUDA graph
            # (compile_mode=reduce-overhead) overwrites at its next replay
            self.device[name] = part.clone() if name not in self.device else self.device[name] + part
            self.host[name] = self.host.get(name, 0.0) + stat.host_part()
            self.kinds[name] = type(stat)

    def _summed(self, group) -> tuple[list[str], list[torch.Tensor], list[float]]:
        """Collective. The names, and each one's device and host parts summed over ranks (float64, on the host)."""
        import torch.distributed as dist

        names = sorted(self.device)
        sizes = [self.device[n].numel() for n in names]
        flat = torch.cat(
            [
                torch.cat([self.device[n] for n in names]).cpu().double(),
                torch.tensor([self.host[n] for n in names], dtype=torch.float64),
            ]
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat, group=group)
        return names, list(flat[: sum(sizes)].split(sizes)), flat[sum(sizes) :].tolist()

    def read(self, group=None) -> dict[str, float | None]:
        """Collective. The interval's value of every metric over all ranks; starts a new interval."""
        if not self.device:
            return {}
        names, device, host = self._summed(group)
        values = {n: self.kinds[n].finish(d, h) for n, d, h in zip(names, device, host)}
        self.device, self.host = {}, {}
        return values

    def snapshot(self, group=None) -> dict:
        """Collective. The interval's sums so far over all ranks as JSON, the interval going on: a checkpoint cut
        inside a log interval carries them, so that the resumed run logs the line a run never stopped logs (on one rank
        bit for bit: a float32 sum is exact in float64 and back; summed over ranks in float64, then rounded to float32,
        within an ulp). They are kept sparse (an AUC's histograms are mostly 0)."""
        if not self.device:
            return {}
        names, device, host = self._summed(group)
        saved = {}
        for n, d, h in zip(names, device, host):
            index = torch.nonzero(d).reshape(-1)
            saved[n] = {"kind": self.kinds[n].__name__, "size": d.numel(), "index": index.tolist()}
            saved[n].update(value=d[index].tolist(), host=h)
        return saved

    def restore(self, saved: dict, device) -> None:
        """The sums a `snapshot` gave, on this rank (one rank holds them: the next `read` adds the others' parts)."""
        for name, part in saved.items():
            dense = torch.zeros(part["size"], dtype=torch.float32)
            dense[torch.tensor(part["index"], dtype=torch.long)] = torch.tensor(part["value"], dtype=torch.float32)
            self.device[name], self.host[name], self.kinds[name] = dense.to(device), part["host"], KINDS[part["kind"]]


KINDS = {kind.__name__: kind for kind in (Mean, BinaryAUC)}  # what a snapshot's "kind" names


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        config: dict,
        total_steps: int,
        start_step: int,
        wandb_mode: str,
        wandb_project: str,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        self.tensorboard = None
        # `config` is the run's resolved config as a dict: the switch is read there, like everything else of the run
        wants_tensorboard = bool((config.get("tensorboard") or {}).get("enabled"))
        if wants_tensorboard:
            require_tensorboard()  # on every rank, so that all fail together, and before anything is written
        if not enabled:
            return
        if wants_tensorboard:
            self.tensorboard = _init_tensorboard(Path(run_dir), start_step)
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=None if os.environ.get("CI") else False,
            mininterval=1.0,
        )
        if wandb_mode != "disabled":
            self.wandb = _init_wandb(Path(run_dir), config, wandb_mode, wandb_project)

    def advance(self, steps: int, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if postfix:  # drawn now: the step's own update drew the bar before its log line, with the last one's
                self.bar.set_postfix(postfix, refresh=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, global_step=record["step"])
            self.tensorboard.flush()  # each log line is on disk as soon as metrics.jsonl's is

    def write(self, message: str) -> None:
        if self.enabled:
            (tqdm.write if self.bar is not None else print)(message, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def _init_wandb(run_dir: Path, config: dict, mode: str, project: str):
    """One wandb run per run directory, kept across resumes (its id is stored in the run directory)."""
    import wandb

    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:  # first invocation, or a file a kill left empty: written whole, once
        run_id = secrets.token_hex(4)
        write_atomic(id_file, run_id)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), mode=mode, config=config
    )


def _init_tensorboard(run_dir: Path, start_step: int):
    """A writer of event files in <run_dir>/tensorboard, one new file per invocation. purge_step tells TensorBoard's
    readers to drop what earlier invocations logged after the step this one starts from (a crash after the last
    checkpoint), as the trainer trims metrics.jsonl: those steps are trained and logged again."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of <run_dir>/metrics.jsonl. A last line cut short (a crash or a full disk while logging) is left
    out, and the trainer rewrites the file without it before appending; any other line that is not a JSON record is
    skipped with a warning naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        elif number < len(lines):
            print(f"warning: {path}:{number}: not a metrics record, skipped", file=sys.stderr)
    return records


def last_intervals(records: list[dict], log_every: int, count: int = 3) -> list[dict]:
    """The last `count` records of whole log intervals: those at a multiple of `log_every`, and the last record (the
    run's end). A run stopped by a signal, `train.exit_after_steps` or a preemption logs the stop's step alone, and
    the resumed run keeps that line: a mean over the last few records counted it, so the same run gave another
    final loss for every interruption."""
    if not records:
        return []
    whole = [r for r in records[:-1] if log_every <= 1 or r["step"] % log_every == 0]
    return [*whole, records[-1]][-count:]
