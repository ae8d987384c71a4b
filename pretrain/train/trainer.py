"""The training loop: always through `deepspeed.initialize` (`pretrain.train.engine`), also for one process on CPU.

    data (shards -> packed samples -> objectives.prepare -> collate, in loader workers)
    -> `train_step`: engine(batch) -> weighted loss -> backward -> step  (x grad_accum_steps)
    -> `after_step`: log (`MetricSums`, read once per log_every), stop (`pretrain.train.stopping`), checkpoint

Between logging steps nothing is read back from the device: metrics and the optimizer's gradient norm and skip flags
accumulate there, token counts come from the host-side batch, and ranks agree on stopping through a CPU all-reduce.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from data_pipeline.loader import PhaseBatchSampler, PretrainDataset, sampler_loader
from data_pipeline.mixing import MixedSamples
from data_pipeline.samples import FULL_WINDOWS, builder_kind
from data_pipeline.shards import ShardSet, reading_shards
from data_pipeline.tokenizer import files_hash, load_tokenizer, read_tokenizer_files, special_tokens, tokenizer_hash
from objectives import sample_builder_for
from pretrain.core.batch import Batch
from pretrain.core.config import RunConfig, load_yaml
from pretrain.core.errors import UserError
from pretrain.core.files import write_atomic
from pretrain.core.outputs import claim_output, exclusive, mark_output, marked_kind, shared
from pretrain.core.parsing import to_dict
from pretrain.core.provenance import run_provenance, write_provenance
from pretrain.core.schedule import Phase, Schedule, config_at, unused_by_first_phase
from pretrain.core.tokens import SpecialTokens
from pretrain.hf.init_from import check_init_tokenizer
from pretrain.model.encoder import set_rope_theta
from pretrain.model.fp8 import use_float8
from pretrain.train import checkpoint as ckpt
from pretrain.train.distributed import (
    any_rank,
    check_shared_directory,
    control_group,
    init_distributed,
    run_precision,
    slow_precision_note,
)
from pretrain.train.ema import EMA_FILE, WeightEMA
from pretrain.train.engine import Engine, build_engine, fp32_masters
from pretrain.train.fingerprint import changed_settings, check_resume, fingerprint
from pretrain.train.flops import count_step_flops, device_peak_tflops, throughput_metrics
from pretrain.train.metrics import MetricsLogger, MetricSums, read_metrics
from pretrain.train.optim import apply_hyperparameters, warmup_note
from pretrain.train.setup import (
    ResolvedRun,
    build_model,
    build_sample_source,
    check_precision,
    compile_for_this_machine,
    config_from_dict,
    model_config_for,
    resolve_run,
)
from pretrain.train.state import TrainState
from pretrain.train.stopping import StopFlag, Stopping


def saved_fingerprint(checkpoint: Path) -> dict:
    """The fingerprint a checkpoint recorded; for one written before fingerprints existed, what its config.yaml and
    tokenizer say (its data is then not compared)."""
    state = TrainState.load(checkpoint)
    if state.fingerprint is not None:
        return state.fingerprint
    saved = config_from_dict(load_yaml(checkpoint / "config.yaml"), apply_init_from=False)
    tokenizer_dir = checkpoint / "tokenizer" if (checkpoint / "tokenizer" / "tokenizer.json").is_file() else None
    model = saved.model
    if tokenizer_dir is not None:
        model = model_config_for(saved, special_tokens(load_tokenizer(tokenizer_dir)))
    return fingerprint(
        saved,
        model,
        run_precision(saved.train, legacy=True),
        state.world_size or 1,
        tokenizer_hash(tokenizer_dir) if tokenizer_dir else None,
        None,
    )


def previous_config(checkpoint: Path, run_dir: Path) -> dict:
    """The resolved config the run last trained with (the checkpoint's config.yaml, else the run directory's), to
    say what a resume changes; {} with a warning when neither can be read (it is rewritten from this config)."""
    for path in (checkpoint / "config.yaml", run_dir / "config.yaml"):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(f"[pretrain] warning: cannot read {path} ({reason})", file=sys.stderr)
            continue
        if isinstance(data, dict):
            return data
        print(f"[pretrain] warning: {path} does not hold a config mapping", file=sys.stderr)
    return {}


def _trim_metrics(run_dir: Path, last_step: int) -> list[int]:
    """Before training, drop metric lines after the step we start from (steps only increase), and a line torn by
    a crash or a full disk, which the next append would run into. Returns the steps of the lines dropped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = read_metrics(run_dir)
    kept = [r for r in records if r["step"] <= last_step]
    text = "".join(json.dumps(r) + "\n" for r in kept)
    if path.read_bytes() != text.encode():  # as bytes: a line of corrupt ones is dropped too, not a traceback
        ckpt.write_atomic(path, text)
    return [r["step"] for r in records if r["step"] > last_step]


def wandb_keeps_note(dropped: list[int], start: int) -> str:
    """What a resume cannot take back from wandb: its run (resumed under the same id) keeps the lines an earlier
    invocation logged after the checkpoint, which metrics.jsonl and TensorBoard drop."""
    return (
        f"wandb keeps the {len(dropped)} line(s) the interrupted invocation logged after step {start} (steps "
        f"{dropped[0]}-{dropped[-1]}), which are trained again now; an online run keeps those earlier values (it "
        "takes no step twice), an offline one both: metrics.jsonl and TensorBoard hold the values trained from here"
    )


def check_not_past_the_end(max_steps: int, step: int, latest: Path) -> None:
    """A resume whose train.max_steps is below the checkpoint's step trained nothing, exited 0 and wrote max_steps 4
    into config.yaml for a model trained 6 steps on a schedule that ended at 8: refused before anything is written."""
    if max_steps < step:
        raise UserError(
            f"train.max_steps {max_steps} is below the step of the checkpoint this run resumes from ({latest}, step "
            f"{step}): nothing would train. Give train.max_steps={step} or more (equal: the run as it is, to export), "
            "or decay it to an end with `pretrain decay` (a new run beside it)"
        )


def record_start(cfg: RunConfig, config: dict, config_text: str, latest: Path | None) -> None:
    """Rank 0, before training: say what a resume changes, then write config.yaml and what it takes to reproduce
    this start (code, versions, command, config, input hashes)."""
    if latest is not None:
        changed = changed_settings(previous_config(latest, cfg.run_dir), config)
        if changed:
            print(f"[pretrain] resuming with changed settings: {'; '.join(changed)}", file=sys.stderr)
    write_atomic(cfg.run_dir / "config.yaml", config_text)
    write_provenance(cfg.run_dir / "provenance.json", run_provenance(cfg, full=False))


@contextlib.contextmanager
def own_run_dir(run_dir: Path, is_main: bool, doing: str = "training"):
    """Collective. Rank 0 claims the run directory (absent, empty, or a run directory of ours: see
    `pretrain.core.outputs`) and holds its lock for the body: one trainer per run directory. Every rank fails
    together."""
    error, held = None, contextlib.ExitStack()
    if is_main:
        try:
            claim_output(run_dir, "run", "the run directory")
            held.enter_context(exclusive(run_dir, doing, ", or use another run name (name=...)"))
            mark_output(run_dir, "run")
        except UserError as err:
            held.close()
            error = err
    if any_rank(error is not None):
        raise error or UserError(f"rank 0 could not take the run directory {run_dir} (its message says why)")
    with held:
        check_shared_directory(run_dir, "the run directory")
        yield


@contextlib.contextmanager
def reading_data(cfg: RunConfig):
    """Hold the run's shards (`reading_shards`) and its tokenizer directory `shared` while it trains: a tokenizer
    trained into that directory meanwhile is refused (`data_pipeline.tokenizer`), as a shard build is. Not a directory
    no tokenizer is trained into (an export a run starts from, `model.init_from`): an export into it would wait for the
    whole run, and the run keeps the bytes it read anyway (`Trainer.tokenizer_files`)."""
    tokenizer = cfg.tokenizer_dir
    held = shared(tokenizer) if marked_kind(tokenizer) in (None, "tokenizer") else contextlib.nullcontext()
    with reading_shards(cfg.shards_dir), held:
        yield


def train(cfg: RunConfig) -> dict:
    """Train (resuming from the latest checkpoint if there is one). Returns a summary of the run."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = init_distributed(cfg.train.collective_timeout_minutes)
    with own_run_dir(cfg.run_dir, rank == 0), reading_data(cfg), StopFlag() as flag:
        try:
            return Trainer.start(cfg, rank, world).run(flag)
        except RuntimeError as err:
            if world > 1 and is_lost_rank(err):
                raise lost_rank(cfg, err) from err
            raise


# What a failed collective says: torch's own distributed errors, or gloo's transport raising a plain RuntimeError
LOST_RANK_SIGNS = ("gloo/transport", "ProcessGroupGloo", "ProcessGroupNCCL", "NCCL communicator", "by peer")


def is_lost_rank(err: Exception) -> bool:
    return isinstance(err, torch.distributed.DistError) or any(sign in str(err) for sign in LOST_RANK_SIGNS)


def lost_rank(cfg: RunConfig, err: Exception) -> UserError:
    """A collective failed: another rank died, or its host went away (or stayed silent past the timeout)."""
    try:
        latest = ckpt.latest_checkpoint(cfg.run_dir / "checkpoints")
    except UserError:
        latest = None
    where = f"its last checkpoint is {latest}" if latest else "it has no checkpoint to resume from yet"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(
        f"lost contact with another rank ({first}); the run stops here and {where}: "
        "start the same launch again on every node to resume"
    )


@dataclass
class Interval:
    """What happened since the last log line: steps, wall time, this rank's real tokens."""

    steps: int = 0
    samples: int = 0  # sequences over all ranks (a schedule may vary the global batch)
    tokens: int = 0
    started: float = field(default_factory=time.time)
    data_wait: float = 0.0  # seconds this rank's loop waited for its next micro-batches (the loader behind)
    # model FLOPs of those samples, each at its own phase's count: an interval across a phase change (32 -> 64 tokens)
    # counted at the new phase's FLOPs per sample overstated TFLOP/s and MFU (1.7x)
    flops: float = 0.0
    unpriced: int = 0  # samples an older version's checkpoint carried without their FLOPs: priced when logged


@dataclass
class Trainer:
    resolved: ResolvedRun  # what the run derives from its config and this launch, decided once (`resolve_run`)
    config_text: str  # the resolved config as YAML, saved with every checkpoint
    engine: Engine
    data: PhaseData  # the sample source of each schedule phase (one without phases), opened as the run reaches it
    state: TrainState  # saved with every checkpoint; the skip counters are kept by `Stopping`
    logger: MetricsLogger
    ema: WeightEMA | None = None  # train.ema_decay: saved with each checkpoint, exported instead of the weights
    # the tokenizer it trains with, read once at the start: each checkpoint carries it, whatever becomes of the
    # directory meanwhile (a tokenizer trained into it again, an edit)
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    metrics: MetricSums = field(default_factory=MetricSums)
    interval: Interval = field(default_factory=Interval)
    unflushed_tokens: int = 0  # this rank's tokens not yet summed over ranks into state.tokens_seen
    clock: float = field(default_factory=time.time)  # training time since, not yet in state.elapsed_s

    @property
    def cfg(self) -> RunConfig:
        return self.resolved.cfg

    @property
    def rank(self) -> int:
        return self.resolved.rank

    @property
    def world(self) -> int:
        return self.resolved.world

    @property
    def schedule(self) -> Schedule:
        return self.data.schedule

    @classmethod
    def start(cls, cfg: RunConfig, rank: int, world: int) -> Trainer:
        """Data, model, engine and the checkpoint to resume from; refuses a resume that changes the run before
        anything is written (`pretrain.train.fingerprint`)."""
        run_dir, t = cfg.run_dir, cfg.train
        check_init_tokenizer(cfg)
        run = resolve_run(cfg, special_tokens(load_tokenizer(cfg.tokenizer_dir)), rank, world)
        tokenizer_files = read_tokenizer_files(cfg.tokenizer_dir)
        tokenizer_sha = files_hash(tokenizer_files)
        shards = ShardSet(cfg.shards_dir, verify=True, expected_tokenizer_hash=tokenizer_sha)
        latest = ckpt.latest_checkpoint(run.checkpoints_dir)
        identity = fingerprint(
            cfg, model_config_for(cfg, run.tokens), run.precision, world, tokenizer_sha, shards.content_hash()
        )
        schedule = Schedule.of(cfg)
        schedule.check_split(world, t.max_steps)
        check_precision(cfg, run.precision)
        if latest is not None:
            saved = TrainState.load(latest)
            check_resume(
                saved_fingerprint(latest),
                identity,
                t.allow_changes,
                latest,
                saved.step,
                saved.world_size or world,
                world,
            )
            check_not_past_the_end(t.max_steps, saved.step, latest)
            cfg = _keep_an_older_ema_without_warmup(cfg, latest)
            t = cfg.train
        config = to_dict(cfg)
        config_text = yaml.safe_dump(config, sort_keys=False)  # config.yaml, and in every checkpoint
        if run.is_main:
            record_start(cfg, config, config_text, latest)

        # a resume's weights are the checkpoint's: model.init_from's are not read (its directory may be gone)
        model = build_model(compile_for_this_machine(cfg, world), run.tokens, load_init_weights=latest is None)
        in_fp8 = use_float8(model.encoder) if t.precision == "fp8" else []  # float8 products (pretrain.model.fp8)
        # Resuming on another number of ranks with per-rank optimizer shards goes through the universal layout
        universal = latest is not None and ckpt.needs_universal(latest, world)
        if universal:
            ckpt.make_universal(latest)
        engine = build_engine(run, model, fresh=latest is None, load_universal=universal)
        engine.explicit_boundary = schedule.active  # a schedule may vary the accumulation from step to step
        torch.manual_seed(t.seed * 1000 + rank)  # dropout (and ELECTRA sampling) streams differ across ranks
        state, applied = TrainState(), []
        if latest is not None:
            state = ckpt.load_checkpoint(engine.ds, latest, universal=universal)
            applied = apply_hyperparameters(engine.ds.optimizer, engine.ds.lr_scheduler, t)
        ema = start_ema(t, engine.ds, latest)
        state.world_size, state.fingerprint = world, identity
        dropped = _trim_metrics(run_dir, state.step) if run.is_main else []
        data = PhaseData(cfg, schedule, shards, run.tokens, model.objectives)
        logger = MetricsLogger(
            run_dir, config, t.max_steps, state.step, cfg.wandb.mode, cfg.wandb.project, enabled=run.is_main
        )
        if latest is not None:
            logger.write(f"resumed from {latest} (step {state.step}, {state.consumed_samples} samples)")
        if dropped and cfg.wandb.mode != "disabled":
            logger.write(f"note: {wandb_keeps_note(dropped, state.step)}")
        if applied:
            logger.write(f"applied on resume: {'; '.join(applied)} (lr now {engine.ds.get_lr()[0]:g} at this step)")
        logger.write(
            f"training {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {world} "
            f"process{'es' if world != 1 else ''}, {run.precision}"
            + (f" with float8 products in {len(in_fp8)} encoder Linears" if in_fp8 else "")
            + f", global batch {run.global_batch} "
            f"({t.micro_batch_size} x {t.grad_accum_steps} accumulation x {world} ranks)"
            + (
                f"; schedule: {len(schedule.phases)} phase(s), {len(schedule.values)} scheduled value(s)"
                if schedule.active
                else ""
            )
        )
        for note in (slow_precision_note(run.precision), warmup_note(t), unused_by_first_phase(cfg)):
            if note:
                logger.write(f"note: {note}")
        return cls(run, config_text, engine, data, state, logger, ema, tokenizer_files)

    def run(self, flag: StopFlag) -> dict:
        t = self.cfg.train
        stopping = Stopping(t, self.state, flag)
        self.carry_interval()
        batches, phase, opened = None, None, False
        try:
            while self.state.step < t.max_steps:
                step = self.state.step
                if phase is None or step == self.schedule.phase_end(phase):
                    batches, phase = None, self.schedule.phase(step)  # the last phase's loader goes first
                    started = time.time()
                    batches, opened = self.enter_phase(phase), True
                    # set-up, not throughput: tokens/s, TFLOP/s and MFU leave out the phase's data and FLOPs probe
                    self.interval.started += time.time() - started
                size = self.schedule.global_batch(step, self.world)
                accumulation = self.engine.split_batch(
                    phase.micro_batch_size, size // (phase.micro_batch_size * self.world)
                )
                self.train_step(self.next_batches(batches, accumulation, opened), size)
                opened = False
                if self.after_step(stopping):
                    break
        finally:
            self.logger.close()
        final = read_metrics(self.cfg.run_dir)[-1] if self.rank == 0 and read_metrics(self.cfg.run_dir) else {}
        return {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "exit_code": stopping.exit_code,
            "reason": stopping.reason.value,
            "final_loss": final.get("loss"),
            "run_dir": str(self.cfg.run_dir),
            "complete": self.state.step >= t.max_steps,
        }

    def enter_phase(self, phase: Phase):
        """This rank's micro-batches of `phase` from the current step on; where the run enters the phase here (not
        a resume inside it), its stream starts at position 0. The model takes the phase's RoPE theta."""
        if self.schedule.active and phase.index != (self.state.phase or 0):
            self.state.phase, self.state.phase_start_samples = phase.index, self.state.consumed_samples
        position = self.state.consumed_samples - (self.state.phase_start_samples or 0)  # in the phase's own stream
        dataset = self.data.open(phase, position)
        epoch = f"{len(dataset)} sequences of {phase.max_seq_len} tokens per epoch"
        if isinstance(dataset.builder, MixedSamples):  # each source its own epochs: a small one repeats by weight
            mixed = dataset.builder
            shares = ", ".join(f"{n} {k} (weight {w:g})" for n, k, w in zip(mixed.names, mixed.lengths, mixed.weights))
            epoch = f"sequences of {phase.max_seq_len} tokens per epoch of each source: {shares}, drawn by weight"
        if self.schedule.active:
            set_rope_theta(self.engine.ds.module, phase.rope_theta)
            epoch = f"phase {phase.index} from step {self.state.step}: micro-batch {phase.micro_batch_size}, {epoch}"
        self.logger.write(epoch)
        sampler = PhaseBatchSampler(
            self.state.step,
            position,
            self.schedule.phase_end(phase),
            phase.micro_batch_size,
            functools.partial(self.schedule.global_batch, world=self.world),
            self.rank,
            self.world,
        )
        width = self.data.static_width(phase, bool(self.engine.ds.module.config.compile))
        return iter(sampler_loader(dataset, self.resolved.tokens.pad, sampler, self.cfg.data.loader_workers, width))

    def next_batches(self, batches: Iterator[Batch], count: int, opened: bool) -> list[Batch]:
        """The step's `count` micro-batches. The step reads nothing back, so the host runs ahead of the device and
        waits here only where the loader cannot keep up: `data_wait` in the log line. The first fetch of a loader
        just opened (its workers starting, each building its epoch's order) is set-up, left out as its opening is."""
        waiting = time.time()
        micro_batches = [next(batches) for _ in range(count)]
        if opened:
            self.interval.started += time.time() - waiting
        else:
            self.interval.data_wait += time.time() - waiting
        return micro_batches

    def train_step(self, micro_batches: list[Batch], global_batch: int) -> None:
        """One optimizer step over the accumulated micro-batches (`global_batch` sequences over all ranks). Reads
        nothing back from the device: counts come with the host-side batches, metrics accumulate on the device."""
        engine = self.engine
        weights = step_loss_weights(micro_batches) if self.cfg.train.loss_normalization == "step" else None
        for i, micro_batch in enumerate(micro_batches):
            engine.begin_micro_batch(last=i == len(micro_batches) - 1)
            loss, metrics = engine.ds(micro_batch.to(engine.device), weights)
            engine.backward(loss)
            engine.step()
            self.metrics.add(metrics, len(micro_batches) * self.world)
        if self.ema is not None:
            self.ema.update(self.state.step)
        tokens = sum(b.tokens for b in micro_batches)
        self.interval.tokens += tokens
        self.unflushed_tokens += tokens
        self.state.step += 1
        self.state.consumed_samples += global_batch
        self.interval.steps += 1
        self.interval.samples += global_batch
        self.interval.flops += global_batch * self.data.flops_per_sample
        self.logger.advance(1)

    def after_step(self, stopping: Stopping) -> bool:
        """Log, decide whether to stop, checkpoint; True when the run stops here."""
        t, step = self.cfg.train, self.state.step
        reasons = any_rank(*stopping.requested(step))
        stop_now = any(reasons)
        nonfinite = False
        log_step = step % t.log_every == 0 or step == t.max_steps
        saving = stop_now or (t.save_every and step % t.save_every == 0) or step == t.max_steps
        # before a stop's own line ends the interval: the checkpoint carries the interval a log step would have ended
        self.state.open_interval = self.interval_so_far() if saving and not log_step else None
        if log_step or stop_now:
            nonfinite = self.log(stopping)
        elif t.save_every and step % t.save_every == 0:
            nonfinite = self.count_skips(stopping)  # a checkpoint must know whether its steps were skipped
        if nonfinite:
            self.logger.write(
                f"stopping: train.nan_policy={t.nan_policy}, {self.state.skipped_in_a_row} non-finite "
                "step(s) in a row; the latest checkpoint is the last good one"
            )
            return True
        if saving:
            self.save()
        if stop_now:
            stopping.stop(*reasons[:2])
            self.logger.write(
                f"stopped at step {step} ({stopping.reason}); checkpoint saved, run the same command again to continue"
            )
        return stop_now

    def interval_so_far(self) -> dict:
        """Collective. The open log interval over all ranks, as a checkpoint keeps it (`TrainState.open_interval`)."""
        return {
            "steps": self.interval.steps,
            "samples": self.interval.samples,
            "flops": self.interval.flops,
            "tokens": self.sum_ranks(self.interval.tokens),
            "seconds": time.time() - self.interval.started,
            "data_wait": self.over_ranks(self.interval.data_wait, dist.ReduceOp.MAX),  # the slowest loader's
            "sums": self.metrics.snapshot(control_group()),
        }

    def carry_interval(self) -> None:
        """A resumed run goes on with the log interval its checkpoint cut: rank 0 takes its sums over all ranks."""
        saved, self.state.open_interval = self.state.open_interval, None
        if saved is None or self.rank != 0:
            return
        self.interval = Interval(saved["steps"], saved["samples"], saved["tokens"], time.time() - saved["seconds"])
        self.interval.data_wait = saved.get("data_wait", 0.0)  # a checkpoint of an older version has none
        self.interval.flops = saved.get("flops", 0.0)
        self.interval.unpriced = 0 if "flops" in saved else saved["samples"]  # an older version's checkpoint
        self.metrics.restore(saved["sums"], self.engine.device)

    def count_skips(self, stopping: Stopping) -> bool:
        """Fold the steps skipped (non-finite gradients) since the last call into the state; True when
        train.nan_policy says stop. fp16's loss-scale overflows are routine and not counted, but at its lowest scale
        (`Engine.step`)."""
        flags = self.engine.take_skip_flags()
        new, stop = stopping.count_skips(flags)
        if new:
            self.logger.write(
                f"warning: {new} step(s) up to step {self.state.step} skipped (non-finite loss or "
                f"gradient); {self.state.skipped_steps} skipped so far"
            )
        return stop

    def log(self, stopping: Stopping) -> bool:
        """Collective. One metrics line for the interval since the last one; returns `count_skips`."""
        stop = self.count_skips(stopping)
        means = self.metrics.read(control_group())
        tokens = self.sum_ranks(self.interval.tokens)
        self.flush_tokens()
        elapsed = max(time.time() - self.interval.started, 1e-9)
        loss = means.pop("loss")
        record = {
            "step": self.state.step,
            "loss": _rounded(loss),
            **{k: _rounded(v) for k, v in sorted(means.items())},
            "lr": self.engine.ds.get_lr()[0],
            "grad_norm": _rounded(self.engine.grad_norm()),
            "tokens": self.state.tokens_seen,
            "tokens_per_s": round(tokens / elapsed, 1),
            # the share of the interval the slowest rank's loop waited for batches: near 0 where the device (or the
            # host's own work) sets the pace, high where a loader does (more data.loader_workers, a cheaper mix).
            # Another rank's wait shows on rank 0 as time in the step's collectives, so it is the maximum over ranks
            "data_wait": round(min(self.over_ranks(self.interval.data_wait, dist.ReduceOp.MAX) / elapsed, 1.0), 3),
            "time": round(self.state.elapsed_s + time.time() - self.clock, 3),  # training seconds, over resumes
            **(self.schedule.at(self.state.step - 1, self.world) if self.schedule.active else {}),
            **throughput_metrics(
                (self.interval.flops + self.interval.unpriced * self.data.flops_per_sample) / elapsed,
                self.world,
                device_peak_tflops(self.resolved.precision, self.cfg.train.peak_tflops),
            ),
            "skipped_steps": self.state.skipped_steps,
        }
        if self.engine.loss_scale() is not None:
            record["loss_scale"] = self.engine.loss_scale()
        self.logger.log(record)
        self.logger.advance(0, {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"})
        if loss is not None and not math.isfinite(loss):
            self.logger.write(f"warning: non-finite loss at step {self.state.step}")
        self.interval = Interval()
        return stop

    def flush_tokens(self) -> None:
        """Collective: the tokens every rank consumed since the last flush into state.tokens_seen."""
        self.state.tokens_seen += self.sum_ranks(self.unflushed_tokens)
        self.unflushed_tokens = 0

    def save(self) -> None:
        """Collective: a checkpoint of this step (the latest once every rank has written)."""
        t = self.cfg.train
        self.flush_tokens()
        now = time.time()
        self.state.elapsed_s += now - self.clock
        self.clock = now
        ckpt.save_checkpoint(
            self.engine.ds,
            self.cfg.run_dir / "checkpoints",
            self.state,
            self.config_text,
            self.tokenizer_files,
            t.keep_checkpoints,
            {EMA_FILE: self.ema.state_dict()} if self.ema is not None else None,
        )
        # the save is not throughput (as a phase's set-up is not): tokens/s, TFLOP/s and MFU dipped on the lines
        # around each save; a resumed run's interval never held it either
        self.interval.started += time.time() - now

    @staticmethod
    def sum_ranks(value: int) -> int:
        return int(Trainer.over_ranks(float(value), dist.ReduceOp.SUM))

    @staticmethod
    def over_ranks(value: float, op) -> float:
        """Collective: `value` reduced by `op` over the ranks (on the host, through the control group)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, op=op, group=control_group())
        return total.item()


class PhaseData:
    """The run's sample source in each schedule phase (without phases, one): the phase's sequence length, its own
    stream (`data_pipeline.loader`), the scheduled objective rates, and its training FLOPs per sample."""

    def __init__(self, cfg: RunConfig, schedule: Schedule, shards: ShardSet, tokens: SpecialTokens, objectives: list):
        self.cfg, self.schedule, self.shards, self.tokens, self.objectives = cfg, schedule, shards, tokens, objectives
        self.dataset: PretrainDataset | None = None
        self.flops_per_sample = 0.0

    def open(self, phase: Phase, position: int) -> PretrainDataset:
        """The dataset of `phase` (built once per phase); FLOPs are probed on its samples from `position`, in the
        phase's own stream, where its loader starts: the epoch order the probe builds is then the one the loader's
        workers inherit (from the run's total, a later epoch's: built in vain, 4 bytes a sample, kept all phase)."""
        if self.dataset is None or self.dataset.phase != phase.index:
            cfg = config_at(self.cfg, phase.start)
            samples = build_sample_source(cfg, self.shards, self.tokens, self.objectives)
            rates = self.schedule.objective_values if self.schedule.values else None
            self.dataset = PretrainDataset(samples, self.objectives, cfg.train.seed, phase.index, rates)
            self.flops_per_sample = probe_flops_per_sample(cfg, self.tokens, self.dataset, position)
        return self.dataset

    def static_width(self, phase: Phase, compiled: bool) -> int:
        """`Collator.static_width` in `phase`: its length where a compiled model reads rows that may be shorter
        (segment pairs, doc-bounded packing), else 0 (packed rows fill the window and need no mask: flash runs)."""
        kind = builder_kind(sample_builder_for(self.objectives), self.cfg.data.packing)
        return phase.max_seq_len if compiled and kind not in FULL_WINDOWS else 0


def _keep_an_older_ema_without_warmup(cfg: RunConfig, checkpoint: Path) -> RunConfig:
    """A run whose EMA an older version kept (no train.ema_warmup in its config) goes on without the warm-up, and
    records so: turned on mid-run, it would drop the decay (0.9999 -> 0.991 at step 1000) for ~90k steps."""
    t = cfg.train
    if not (t.ema_decay and t.ema_warmup) or "ema_warmup" in (load_yaml(checkpoint / "config.yaml").get("train") or {}):
        return cfg
    if ckpt.load_ema(checkpoint) is None:
        return cfg
    print(f"[pretrain] {checkpoint}'s EMA was kept without a warm-up: train.ema_warmup=false", file=sys.stderr)
    return replace(cfg, train=replace(t, ema_warmup=False))


def start_ema(t, engine, checkpoint: Path | None) -> WeightEMA | None:
    """The run's weight EMA (train.ema_decay) of the optimizer's fp32 weights, from the checkpoint's when it has one;
    a run that turns it on at a resume starts it from the resumed weights."""
    if not t.ema_decay:
        return None
    ema = WeightEMA(engine.module, t.ema_decay, "cpu" if t.ema_on_cpu else None, fp32_masters(engine), t.ema_warmup)
    if checkpoint is not None:
        saved = ckpt.load_ema(checkpoint)
        if saved is None:
            print(f"[pretrain] {checkpoint} has no EMA weights: the EMA starts from its weights", file=sys.stderr)
        else:
            ema.load_state_dict(saved, str(checkpoint / EMA_FILE))
    return ema


def probe_flops_per_sample(
    cfg: RunConfig, tokens: SpecialTokens, dataset: PretrainDataset, position: int, n: int = 2
) -> float:
    """Training FLOPs per sample, counted on a throwaway fp32 CPU copy of the model over `n` real samples.

    A separate model, built unseeded (a seed would reset the CUDA generators: the checkpoint's restored streams and
    each rank's own, on every start and phase), and the CPU rng saved and restored keep the run itself untouched
    (bitwise resume); under ZeRO-3 the engine's own parameters are partitioned anyway. The model's FLOPs, as MFU
    counts them: without the forward passes activation checkpointing repeats in the backward (that work is the
    hardware's, not the model's).
    """
    from data_pipeline.loader import Collator

    rng_state = torch.get_rng_state()
    try:
        model = replace(cfg.model, activation_checkpointing=False)
        probe = build_model(replace(cfg, model=model), tokens, load_init_weights=False, seed=False)  # shapes only
        batch = Collator(tokens.pad, probe.objectives)([dataset[position + i] for i in range(n)])
        flops = count_step_flops(lambda: probe(batch)[0].backward())
    finally:
        torch.set_rng_state(rng_state)
    return flops / n


def step_loss_weights(micro_batches: list[Batch]) -> dict[str, float]:
    """Per loss term, the weight of one target under train.loss_normalization=step: micro-batches x ranks / the
    term's targets in the whole step, over every micro-batch of every rank (one small CPU all-reduce of the
    host-side counts). DeepSpeed divides the gradient by micro-batches x ranks, which leaves each term a mean over
    all its targets in the step, however the step is split. A term with no target anywhere weighs 0."""
    terms = sorted({term for b in micro_batches for term in b.counts})
    totals = [float(sum(b.counts.get(term, 0) for b in micro_batches)) for term in terms]
    parts = len(micro_batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        summed = torch.tensor(totals, dtype=torch.float64)
        dist.all_reduce(summed, group=control_group())
        totals, parts = summed.tolist(), parts * dist.get_world_size()
    return {term: parts / total if total else 0.0 for term, total in zip(terms, totals)}


def _rounded(value: float | None) -> float | None:
    return round(value, 6) if value is not None and math.isfinite(value) else value


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
