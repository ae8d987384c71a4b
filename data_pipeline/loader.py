"""Deterministic, resumable sample order and batching.

The training stream is an endless sequence of *positions*. Position p belongs to epoch p // n and is
sample `order(seed, epoch)[p % n]`; its corruption rng is derived from (seed, epoch, sample index).
Nothing depends on rank, world size or worker count, so resuming is "skip to position consumed_samples":
O(1), no batches replayed, and any world size continues the same global order.

A run with schedule phases (`pretrain.core.schedule`) has one such stream per phase, its positions counted from
the phase's start; phase 0's is the stream above, phase k > 0 appends (3, k) to every rng's seed key
(`_stream_key`), so its order and masks are streams of their own. A phase's sampler (`PhaseBatchSampler`) tags
each position with its optimizer step, so a scheduled rate (a masking rate) is that step's value in every worker.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from data_pipeline.mixing import MixedSamples
from data_pipeline.samples import SampleBuilder
from pretrain.core.batch import Batch
from pretrain.core.config import TrainConfig
from pretrain.core.tokens import IGNORE_INDEX


class Transform(Protocol):
    """What the loader needs of an objective (`objectives.base.Objective` has it; the data layer imports none):
    its per-sample `prepare` (which reads `options`, replaced by a schedule's values at each step), and for the
    collator the padding of the arrays it adds, its `collate` arrays and its targets' counts."""

    name: str
    options: Any
    pad_values: dict[str, int]

    def prepare(self, sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]: ...

    def collate(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def target_counts(self, arrays: dict[str, np.ndarray]) -> dict[str, int]: ...


_ORDER_STREAM = 0  # distinct SeedSequence streams: sample order vs. per-sample corruption
_SAMPLE_STREAM = 1
_PHASE_STREAM = 3  # (data_pipeline.mixing has 2)


def _stream_key(source: int | None, phase: int = 0) -> list[int]:
    # one corpus in one phase keeps the streams it always had
    return ([] if source is None else [source]) + ([] if not phase else [_PHASE_STREAM, phase])


def epoch_order(num_samples: int, seed: int, epoch: int, source: int | None = None, phase: int = 0) -> np.ndarray:
    """A permutation of range(num_samples), a pure function of (seed, epoch), in a mixture the source, and with a
    schedule the phase. Kept as uint32 where the samples fit (the same order at half the memory: every loader worker
    of every rank holds its own, 1.6 GB of int64 for 200M samples)."""
    rng = np.random.default_rng([seed, _ORDER_STREAM, epoch, *_stream_key(source, phase)])
    if num_samples > 2**32:
        return rng.permutation(num_samples)
    order = np.arange(num_samples, dtype=np.uint32)  # what permutation(n) shuffles, in int64: the same draws
    rng.shuffle(order)
    return order


def sample_rng(seed: int, epoch: int, index: int, source: int | None = None, phase: int = 0) -> np.random.Generator:
    """The rng that corrupts sample `index` (of `source` in a mixture, in `phase` of a schedule) when it is seen in
    `epoch`: new masks every epoch."""
    return np.random.default_rng([seed, _SAMPLE_STREAM, epoch, index, *_stream_key(source, phase)])


class PretrainDataset(torch.utils.data.Dataset):
    """Maps a stream position to a prepared sample (the builder's sample, then each objective's prepare). A
    `MixedSamples` builder picks the source of each position (`data_pipeline.mixing`); each source then has epochs
    and orders of its own.

    An index is a position, or (step, position) from `PhaseBatchSampler`: `rates(step)` then gives the scheduled
    options ({objective name: {option: value}}) that the objectives prepare that sample with."""

    def __init__(
        self,
        builder: SampleBuilder,
        objectives: list[Transform],
        seed: int,
        phase: int = 0,
        rates: Callable[[int], dict[str, dict[str, float]]] | None = None,
    ):
        self.builder = builder
        self.objectives = objectives
        self.seed = seed
        self.phase = phase
        self.rates = rates
        self._orders: dict = {}  # epoch (mixture: (source, epoch)) -> permutation, cached per worker
        self._options: tuple[int, list] | None = None  # (step, each objective's options at that step)

    def __len__(self) -> int:
        return len(self.builder)

    def locate(self, position: int) -> tuple[int, int]:
        """Stream position -> (epoch, sample index); in a mixture, of the position's source (see `place`)."""
        return self.place(position)[1:]

    def place(self, position: int) -> tuple[int | None, int, int]:
        """Stream position -> (source, epoch, sample index); source None for one corpus."""
        if isinstance(self.builder, MixedSamples):
            source, epoch, offset = self.builder.draw(position)
            if (source, epoch) not in self._orders:  # keep one epoch per source
                self._orders = {k: v for k, v in self._orders.items() if k[0] != source}
                n = self.builder.lengths[source]
                self._orders[(source, epoch)] = epoch_order(n, self.seed, epoch, source, self.phase)
            return source, epoch, int(self._orders[(source, epoch)][offset])
        epoch, offset = divmod(position, len(self.builder))
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(len(self.builder), self.seed, epoch, phase=self.phase)}
        return None, epoch, int(self._orders[epoch][offset])

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, np.ndarray]:
        step, position = key if isinstance(key, tuple) else (None, key)
        source, epoch, index = self.place(position)
        rng = sample_rng(self.seed, epoch, index, source, self.phase)
        builder = self.builder if source is None else self.builder.builders[source]
        # builders whose samples are themselves random (segment pairs) draw from the same per-sample rng
        sample = builder.sample(index, rng)
        for objective, options in zip(self.objectives, self.options_at(step)):
            configured, objective.options = objective.options, options
            try:
                sample = objective.prepare(sample, rng)
            finally:
                objective.options = configured
        return sample

    def options_at(self, step: int | None) -> list:
        """Each objective's options at optimizer step `step`: the configured ones with `rates(step)` in place."""
        if step is None or self.rates is None:
            return [getattr(o, "options", None) for o in self.objectives]
        if self._options is None or self._options[0] != step:
            values = self.rates(step)
            self._options = (
                step,
                [
                    dataclasses.replace(o.options, **values[o.name]) if o.name in values else o.options
                    for o in self.objectives
                ],
            )
        return self._options[1]


class StreamBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches of stream positions, starting at `consumed_samples`.

    Global batch g covers positions [g*G, (g+1)*G), G = micro * accum * world. Micro-step a of rank r
    takes the slice starting at g*G + (a*world + r)*micro, so the union over ranks and micro-steps of
    one optimizer step is the same set of samples for any split of G.
    """

    def __init__(self, consumed_samples: int, micro_batch_size: int, grad_accum_steps: int, rank: int, world_size: int):
        self.micro = micro_batch_size
        self.accum = grad_accum_steps
        self.rank = rank
        self.world = world_size
        # the run's global batch, from the one function that forms it
        split = TrainConfig(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps)
        self.global_batch = split.global_batch(world_size)
        if consumed_samples % self.global_batch:
            raise ValueError(
                f"consumed_samples={consumed_samples} is not a multiple of the global batch {self.global_batch}"
            )
        self.start_step = consumed_samples // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            base = step * self.global_batch
            for a in range(self.accum):
                start = base + (a * self.world + self.rank) * self.micro
                yield list(range(start, start + self.micro))
            step += 1

    def __len__(self) -> int:  # endless; DataLoader only needs this for its length hints
        return 2**62


class PhaseBatchSampler(torch.utils.data.Sampler):
    """This rank's micro-batches of one schedule phase, as lists of (step, position): from optimizer step `start`,
    at `position` of the phase's stream, until step `end` (None: endless). Step s takes the next
    `global_batch(s)` positions, split as `StreamBatchSampler` splits a global batch, in micro-batches of `micro`."""

    def __init__(
        self,
        start: int,
        position: int,
        end: int | None,
        micro: int,
        global_batch: Callable[[int], int],
        rank: int,
        world_size: int,
    ):
        self.start, self.position, self.end = start, position, end
        self.micro, self.global_batch, self.rank, self.world = micro, global_batch, rank, world_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step, base = self.start, self.position
        while self.end is None or step < self.end:
            size = self.global_batch(step)
            for a in range(size // (self.micro * self.world)):
                first = base + (a * self.world + self.rank) * self.micro
                yield [(step, p) for p in range(first, first + self.micro)]
            base += size
            step += 1

    def __len__(self) -> int:
        return 2**62


def pad_arrays(
    samples: list[dict[str, np.ndarray]], pad_id: int, pad_values: dict[str, int], width: int = 0
) -> dict[str, np.ndarray]:
    """Pad per-token arrays to the longest sample (at least `width`): input_ids with [PAD], *labels with -100, others
    with `pad_values` or 0; per-sample scalars are stacked. Adds attention_mask [B, L] (True = real token)."""
    lengths = np.array([len(s["input_ids"]) for s in samples], np.int64)
    width = max(int(lengths.max()), width)
    arrays: dict[str, np.ndarray] = {}
    for key, first in samples[0].items():
        if np.ndim(first) == 0:
            arrays[key] = np.array([s[key] for s in samples])
            continue
        if key == "input_ids":
            fill = pad_id
        elif key in pad_values:
            fill = pad_values[key]
        else:
            fill = IGNORE_INDEX if key.endswith("labels") else 0
        arr = np.full((len(samples), width), fill, dtype=first.dtype)
        for i, s in enumerate(samples):
            arr[i, : len(s[key])] = s[key]
        arrays[key] = arr
    for key in ("input_ids", "token_type_ids"):
        if key in arrays:
            arrays[key] = arrays[key].astype(np.int64)
    arrays["attention_mask"] = np.arange(width)[None, :] < lengths[:, None]  # [B, L] True = real token
    return arrays


class Collator:
    """The collate_fn (picklable, for loader workers): a `Batch` of padded samples (see `pretrain.core.batch`).

    `static_width` > 0, for a compiled model on data whose rows may be shorter than the window (segment pairs,
    doc-bounded packing): every batch padded to that width and marked padded, so the compiled graph always sees one
    length and one attention-mask form (else a batch of other length, or one without padding, recompiles it)."""

    def __init__(self, pad_id: int, objectives: list[Transform], static_width: int = 0):
        self.pad_id = pad_id
        self.objectives = objectives
        self.static_width = static_width
        self.pad_values: dict[str, int] = {}
        for objective in objectives:
            self.pad_values.update(objective.pad_values)

    def __call__(self, samples: list[dict[str, np.ndarray]]) -> Batch:
        arrays = pad_arrays(samples, self.pad_id, self.pad_values, self.static_width)
        return Batch.from_arrays(arrays, self.objectives, padded=True if self.static_width else None)


def auto_workers(ranks_on_this_machine: int = 1) -> int:
    """Loader workers per rank: on a GPU machine up to 4, leaving a core per rank for the training process; none
    on a CPU-only machine, where the training process itself uses every core (workers would compete with it)."""
    if not torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(4, cores // max(1, ranks_on_this_machine) - 1))


def build_loader(
    dataset: PretrainDataset,
    pad_id: int,
    consumed_samples: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    rank: int,
    world_size: int,
    num_workers: int = 0,
) -> torch.utils.data.DataLoader:
    """This rank's micro-batches from `consumed_samples` on. num_workers < 0: `auto_workers`. Batches are prepared
    ahead in the workers (4 each) and, on a GPU, collated into pinned memory so copies to it do not block."""
    sampler = StreamBatchSampler(consumed_samples, micro_batch_size, grad_accum_steps, rank, world_size)
    return sampler_loader(dataset, pad_id, sampler, num_workers)


def sampler_loader(
    dataset: PretrainDataset,
    pad_id: int,
    sampler: torch.utils.data.Sampler,
    num_workers: int = 0,
    static_width: int = 0,
) -> torch.utils.data.DataLoader:
    """The DataLoader of `build_loader` over any batch sampler (a schedule phase's: `PhaseBatchSampler`);
    `static_width`: `Collator`'s."""
    if num_workers < 0:
        num_workers = auto_workers(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1"))))
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=Collator(pad_id, dataset.objectives, static_width),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        pin_memory=torch.cuda.is_available(),
        # its own generator: making an iterator must not draw from the global
        # torch rng, which is checkpointed for dropout (bitwise resume)
        generator=torch.Generator().manual_seed(0),
    )
