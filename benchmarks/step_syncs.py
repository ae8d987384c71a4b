"""What makes the host wait for the device in the training steps that do not log, counted around real optimizer
steps of the trainer (`Trainer.train_step`, and `after_step` of the steps that do not log; not the first step,
which compiles where the trainer compiles):

- reads of a tensor back to the host (`.item()`, `bool`/`int`/`float` of a tensor, `.tolist()`, `.numpy()`,
  `nonzero`, boolean-mask indexing), seen by a TorchFunctionMode;
- device synchronizations: DeepSpeed's `get_accelerator().synchronize()` and `torch.cuda.synchronize()`, patched
  with counters (DeepSpeed's CUDA accelerator calls torch's: counted once, as DeepSpeed's);
- copies of Python data to the device: `torch.tensor` / `as_tensor` / `asarray` of a list, scalar or array with
  a `device`, `Tensor.new_tensor`, and indexing by a Python list or array (torch copies the index to the tensor's
  device). On CUDA these come from pageable memory, and such a copy waits for the stream. The batch's own move to
  the device (a tensor, pinned on a GPU, non-blocking) is not one of them, and neither are reads of tensors made
  on the host from Python data without a device (the trainer's CPU all-reduces of host counts between ranks);
- DeepSpeed's collectives (`deepspeed.comm.all_reduce` and the other reductions and gathers it uses);
- compiles (dynamo's) inside the counted steps: a compiled run compiles in its first step only. The counting
  TorchFunctionMode is on the stack in every step, counting only in the counted ones: dynamo guards on that stack.
  Each run starts from empty compile caches, as a process of its own would (on a GPU every run compiles: 11 new
  models in one process would pass dynamo's recompile limit, 8, and the later runs would count eager steps), and
  the frames torch left eager in a run (a recompile limit hit, a compile error suppressed) are counted
  (`eager_frames`).

Each is attributed to the first frame outside torch (and outside this file): ours when that frame is in pretrain/,
objectives/ or data_pipeline/, else the library's (DeepSpeed's, mostly), counted apart. On CUDA the counted steps
also run under torch.cuda.set_sync_debug_mode (--sync-debug, default "error"), so any synchronizing torch operation
there raises, ours or not.

    python benchmarks/step_syncs.py prepare --work DIR            # tokenizer and shards of 10 documents
    python benchmarks/step_syncs.py run --work DIR [--runs mlm-fp32,rtd] [--sync-debug warn]
    python -m deepspeed.launcher.runner --num_gpus 2 benchmarks/step_syncs.py run --work DIR --runs mlm-bf16,zero2

`run` prints one line `RESULT {json}` per rank, and with --out writes it to a file per rank.
tests/test_host_reads.py runs it on CPU ranks (DS_ACCELERATOR=cpu);
benchmarks/gpu_suite.sh (stage `syncs`) on a GPU. A new objective takes a line in RUNS.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import sys
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: (overrides, probe). Every run: 7 steps of 2 micro-batches, logging at 3, 6 and 7; step 1 warms up (on a GPU
# it compiles: inductor benchmarks its kernels with synchronize()), so steps 2, 4, 5 are counted. A probe turns back
# on what the engine turns off, to show the counters see it.
RUNS = {
    "mlm-fp32": (["objectives={mlm: {}}", "train.precision=fp32"], None),
    "mlm-bf16": (["objectives={mlm: {whole_word: true}}", "train.precision=bf16"], None),
    "span": (["objectives={span: {}}", "train.precision=bf16"], None),
    "rtd": (["objectives={rtd: {}}", "train.precision=bf16"], None),
    "plm": (["objectives={plm: {}}", "train.precision=fp32"], None),
    "sop": (["objectives={mlm: {}, sop: {}}", "train.precision=fp32", "data.packing=doc_bounded"], None),
    "unpadded": (
        ["objectives={mlm: {}}", "train.precision=bf16", "model.unpadded=true", "data.packing=doc_bounded"],
        None,
    ),
    "lamb": (["objectives={mlm: {}}", "train.precision=fp32", "train.optimizer=lamb"], None),
    "zero2": (["objectives={mlm: {}}", "train.precision=bf16", "train.zero_stage=2"], None),
    # float8 products: scales computed and applied on the device
    "fp8": (["objectives={mlm: {}}", "train.precision=fp8"], None),
    # compiled as on a GPU (inductor, on a CPU too): nothing compiles again after the first step
    "compiled": (["objectives={mlm: {}}", "train.precision=bf16", "model.compile=true"], None),
    # DeepSpeed's throughput timer as it is by default (a config without "timers")
    "timers-on": (["objectives={mlm: {}}", "train.precision=fp32"], "timers"),
    # DeepSpeed's gradient all-reduce at world size 1, as it is by default
    "allreduce-on": (["objectives={mlm: {}}", "train.precision=fp32"], "allreduce"),
}
COMMON = [
    "model.num_layers=1",
    "train.max_steps=7",
    "train.log_every=3",
    "train.save_every=0",
    "train.grad_accum_steps=2",
    "train.micro_batch_size=4",
    "wandb.mode=disabled",
]
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "inference_all_reduce",
    "reduce",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "allgather_fn",
    "broadcast",
)
HERE = os.path.realpath(__file__)


def prepare(work: Path, corpus: Path, docs: int) -> None:
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    small = work / "corpus.jsonl"
    small.write_text("\n".join(corpus.read_text().splitlines()[:docs]) + "\n")
    train_tokenizer([small], work / "tok", vocab_size=512, show_progress=False)
    build_shards([small], work / "tok", work / "shards", num_workers=0, show_progress=False)


class Counters:
    """The counts of one run (or probe), split into ours and the libraries'."""

    def __init__(self):
        self.reads, self.h2d, self.syncs = collections.Counter(), collections.Counter(), collections.Counter()
        self.collectives = collections.Counter()

    def summary(self, ours_prefixes: tuple[str, ...]) -> dict:
        def split(counter):
            ours = {k: n for k, n in counter.items() if k.startswith(ours_prefixes)}
            return ours, {k: n for k, n in counter.items() if k not in ours}

        out = {}
        for name in ("reads", "h2d", "syncs"):
            out[f"{name}_ours"], out[f"{name}_library"] = split(getattr(self, name))
        # inductor's generated modules (its cache directory, torchinductor_USER): a kernel's first-run autotuning
        compiler = {k: n for k, n in out["syncs_library"].items() if f"{os.sep}torchinductor" in k}
        out["syncs_compiler"] = compiler
        out["syncs_library"] = {k: n for k, n in out["syncs_library"].items() if k not in compiler}
        out["collectives"] = dict(self.collectives)
        return out


class FramesLeftEager(logging.Handler):
    """Counts torch's warnings that a frame runs eager from now on: a recompile limit hit, or a compile error
    suppressed (model.compile unset: compiling is only the default there)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.count += ("WON'T CONVERT" in text) + ("torch._dynamo hit config." in text)


def patch_syncs(counters_ref: list, active: list, where) -> None:
    """Count device synchronizations (DeepSpeed's accelerator's and torch.cuda's) and DeepSpeed's collectives while
    `active[0]`, each at the first frame outside torch (`where`)."""
    import torch

    depth = [0]  # DeepSpeed's CUDA accelerator synchronizes through torch.cuda.synchronize: count it once

    def counting(kind, original):
        def wrapper(*args, **kwargs):
            if active[0] and depth[0] == 0:
                counters_ref[0].syncs[f"{where(sys._getframe(1))} {kind}"] += 1
            depth[0] += 1
            try:
                return (
                    original(*args, **kwargs) if kind != "torch.cuda.synchronize" or torch.cuda.is_available() else None
                )
            finally:
                depth[0] -= 1

        return wrapper

    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.synchronize = counting("accelerator.synchronize", accelerator.synchronize)  # the instance's
    torch.cuda.synchronize = counting("torch.cuda.synchronize", torch.cuda.synchronize)

    import deepspeed.comm as ds_comm

    def collective(name, original):
        def wrapper(*args, **kwargs):
            if active[0]:
                counters_ref[0].collectives[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in COLLECTIVES:
        if hasattr(ds_comm, name):
            setattr(ds_comm, name, collective(name, getattr(ds_comm, name)))


def install(counters_ref: list, active: list):
    """Patch the counters in; `counters_ref[0]` is the Counters of the run being counted, `active[0]` whether a
    counted step is running. Returns the TorchFunctionMode to enter around counted steps."""
    import numpy as np
    import torch
    from torch.overrides import TorchFunctionMode

    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    reads = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__format__", "__array__"}
    reads |= {"nonzero", "argwhere", "masked_select", "unique"}

    def where(frame) -> str:
        while frame and (
            os.path.realpath(frame.f_code.co_filename).startswith(torch_dir)
            or frame.f_code.co_filename == "<string>"
            or os.path.realpath(frame.f_code.co_filename) == HERE
        ):
            frame = frame.f_back
        return f"{os.path.realpath(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?"

    def index_parts(index):
        return index if isinstance(index, tuple) else (index,)

    def mask_index(index):
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in index_parts(index))

    def python_index(index):
        return any(isinstance(p, (list, np.ndarray)) for p in index_parts(index))

    def python_data_to_device(name, args, kwargs):
        if not args or isinstance(args[0], torch.Tensor):
            return False
        if name == "new_tensor":  # on its tensor's device
            return True
        if name in ("tensor", "as_tensor", "asarray"):
            device = kwargs.get("device", args[2] if name == "as_tensor" and len(args) > 2 else None)
            return device is not None
        return False

    # Tensors made from Python data without a device stay on the host (the trainer's CPU all-reduces of host
    # counts over the gloo control group): reading them back waits for no device. Held weakly, by identity.
    host = weakref.WeakValueDictionary()

    def on_host(x) -> bool:
        return isinstance(x, torch.Tensor) and host.get(id(x)) is x

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            indexing = name in ("__getitem__", "__setitem__") and len(args) > 1
            c = counters_ref[0]
            if (name in reads or (indexing and mask_index(args[1]))) and not on_host(args[0] if args else None):
                c.reads[f"{where(sys._getframe(1))} {name}"] += 1
            elif (indexing and python_index(args[1])) or python_data_to_device(name, args, kwargs):
                c.h2d[f"{where(sys._getframe(1))} {name}"] += 1
            out = func(*args, **kwargs)
            if name in ("tensor", "as_tensor", "asarray") and kwargs.get("device") is None and len(args) < 3:
                host[id(out)] = out
            return out

    patch_syncs(counters_ref, active, where)
    return Mode()


@contextlib.contextmanager
def probe_setting(probe: str | None):
    """Turn back on, for one run, what the engine turns off."""
    from pretrain.train import engine as E

    saved = E.deepspeed_config, E.skip_single_rank_allreduce
    if probe == "timers":

        def config(*args, **kwargs):
            ds = saved[0](*args, **kwargs)
            ds.pop("timers", None)
            return ds

        E.deepspeed_config = config
    elif probe == "allreduce":
        E.skip_single_rank_allreduce = lambda *args, **kwargs: None
    try:
        yield
    finally:
        E.deepspeed_config, E.skip_single_rank_allreduce = saved


def probe_counters(counters: list, mode, ours_prefixes: tuple, cuda: bool) -> dict:
    """What the counters see of reads and copies made on purpose in our files (and, on CUDA, whether
    set_sync_debug_mode raises)."""
    import torch

    # The counters see what they count, in our files: a read (Packed.from_mask without the token count reads the
    # mask back), and the two copies of Python data rtd made before its special ids became a buffer, compiled as
    # if they were in objectives/.
    from pretrain.model.padding import Packed

    counters[0] = probe = Counters()
    source = (
        "def copies(x, ids):\n"
        "    x[:, list(ids)] = float('-inf')\n"
        "    return torch.tensor(list(ids), device=x.device)\n"
    )
    scope = {"torch": torch}
    exec(compile(source, str(ROOT / "objectives" / "_probe.py"), "exec"), scope)
    with mode:
        Packed.from_mask(torch.tensor([[True, True, False]]), torch.float32)
        scope["copies"](torch.zeros(2, 5), (1, 3))
    probes = {k: sum(v.values()) for k, v in probe.summary(ours_prefixes).items() if k.endswith("_ours")}
    if cuda:  # and set_sync_debug_mode raises where a torch operation synchronizes
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.ones(1, device="cuda").item()
            probes["cuda_sync_debug_raises"] = False
        except RuntimeError:
            probes["cuda_sync_debug_raises"] = True
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return probes


def count_steps(mode, active: list, cuda: bool, sync_debug: str) -> dict:
    """Wrap the trainer's step and after-step so that the counters (and, on CUDA, the sync debug mode) are on in the
    steps that neither warm up nor log; returns the count of such steps, which the caller resets per run."""
    import torch

    from pretrain.train import trainer as T

    counted = {"steps": 0, "compiles": 0}
    original_step, original_after = T.Trainer.train_step, T.Trainer.after_step

    def counts(self, step):  # neither the warm-up step nor one that logs
        t = self.cfg.train
        logs = step % t.log_every == 0 or step == t.max_steps or bool(t.save_every and step % t.save_every == 0)
        return step > 1 and not logs

    @contextlib.contextmanager
    def counting():
        active[0] = True
        if cuda and sync_debug != "off":
            torch.cuda.set_sync_debug_mode(sync_debug)
        try:
            with mode:
                yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            active[0] = False

    def train_step(self, micro_batches, *args):
        if not counts(self, self.state.step + 1):
            # under the counting mode too, counting nothing: dynamo guards on the stack of torch function modes, so
            # graphs compiled without it compiled again in the counted steps (and autotuned there, on a GPU)
            with mode:
                return original_step(self, micro_batches, *args)
        counted["steps"] += 1
        with counting():
            return original_step(self, micro_batches, *args)

    def after_step(self, stopping):
        if not counts(self, self.state.step):
            return original_after(self, stopping)
        with counting():
            return original_after(self, stopping)

    T.Trainer.train_step, T.Trainer.after_step = train_step, after_step
    pause_while_compiling(active, cuda, sync_debug, counted)
    return counted


def pause_while_compiling(active: list, cuda: bool, sync_debug: str, counted: dict) -> None:
    """A compile (dynamo's, with inductor's code generation) inside a counted step is not the step: nothing is
    counted and the sync debug mode is off while it runs, and it is counted itself (`compiles`: after the first step
    nothing should recompile). On an H100 (2026-11-27) inductor's constant folding read a value under the "error"
    mode, so that function ran eager. Kernels that autotune at their first run synchronize after the compile ended:
    such syncs are told apart by their place, in inductor's generated code (`syncs_compiler`)."""
    import torch
    from torch._dynamo.callback import on_compile_end, on_compile_start

    held = []

    @on_compile_start
    def start(_args) -> None:
        held.append(active[0])
        if active[0]:
            counted["compiles"] += 1
            active[0] = False
            if cuda:
                torch.cuda.set_sync_debug_mode("default")

    @on_compile_end
    def end(_args) -> None:
        if held and held.pop():
            active[0] = True
            if cuda and sync_debug != "off":
                torch.cuda.set_sync_debug_mode(sync_debug)


def run(work: Path, names: list[str], sync_debug: str, save=lambda result: None) -> dict:
    """The runs, one after the other in this process; `save(result)` after each, with the runs so far."""
    import torch

    ours_prefixes = tuple(
        os.path.join(str(ROOT.resolve()), d) + os.sep for d in ("pretrain", "objectives", "data_pipeline")
    )
    counters, active = [Counters()], [False]
    mode = install(counters, active)
    cuda = torch.cuda.is_available()

    from pretrain.cli import main

    counted = count_steps(mode, active, cuda, sync_debug)

    probes = probe_counters(counters, mode, ours_prefixes, cuda)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = []
    head = {"rank": int(os.environ.get("RANK", "0")), "world": world, "cuda": cuda}
    head |= {"sync_debug": sync_debug if cuda else None, "probes": probes}
    from pretrain.model import compiling

    eager = FramesLeftEager()
    logging.getLogger("torch._dynamo").addHandler(eager)
    for name in names:
        overrides, probe_kind = RUNS[name]
        counters[0] = Counters()
        counted["steps"] = counted["compiles"] = eager.count = 0
        torch._dynamo.reset_code_caches()  # not reset(): it would drop pause_while_compiling's callbacks
        compiling._made.clear()
        args = [
            "train",
            "tiny",
            f"output_dir={work / 'runs'}",
            f"name={name}-{world}r",
            f"data.tokenizer={work / 'tok'}",
            f"data.shards={work / 'shards'}",
            *COMMON,
            *overrides,
        ]
        error = None
        with probe_setting(probe_kind):
            try:
                code = main(args)
            except Exception as err:  # noqa: BLE001 - reported, and the next run goes on
                code, error = 1, f"{type(err).__name__}: {err}"
        results.append(
            {"run": name, "probe": probe_kind, "rc": code, "error": error}
            | {"steps": counted["steps"], "compiles": counted["compiles"], "eager_frames": eager.count}
            | counters[0].summary(ours_prefixes)
        )
        save(head | {"runs": results})
    return head | {"runs": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["prepare", "run"])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--corpus", type=Path, default=ROOT / "data" / "us-speeches.public-domain.jsonl")
    p.add_argument("--docs", type=int, default=10)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of: {', '.join(RUNS)}")
    p.add_argument("--sync-debug", default="error", choices=["error", "warn", "off"], help="CUDA only")
    p.add_argument("--out", type=Path, help="also OUT/result-RANK.json, after every run (ranks share stdout)")
    p.add_argument("--json", type=Path, help="rank 0's result alone, likewise (benchmarks/gpu_suite.sh's syncs.json)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # the DeepSpeed launcher's
    a = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    if a.what == "prepare":
        prepare(a.work, a.corpus, a.docs)
        return
    names = [n for n in a.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")

    def save(result: dict) -> None:  # after every run, whole or not at all: a stage cut by its timeout keeps them
        paths = [a.out / f"result-{result['rank']}.json"] if a.out else []
        paths += [a.json] if a.json and result["rank"] == 0 else []
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, path)

    result = run(a.work, names, a.sync_debug, save)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
