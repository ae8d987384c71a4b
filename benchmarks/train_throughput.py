"""Training throughput of our full step (forward, backward, AdamW step) vs transformers' BertForPreTraining.

Both models get the same config, the same batch (random ids, 15% of the real tokens masked with labels, a
random NSP label per row), the same precision and the same optimizer (torch AdamW, fused where the device
has it), and do the same work: MLM + NSP (ours: the `mlm` and `nsp` objectives; HF: attn_implementation
"sdpa"). The variants of one shape are built side by side in ONE process and timed in alternation (one timed
run = --steps steps of each variant in turn, --repeats times), so load from other jobs hits them alike;
the tables report medians over the runs and ratios of medians.

Each side's batch is prepared before the timed loop, on the device, as its training loop hands it over: ours a
collated `Batch` (its host-side counts included, as the loader makes it), HF's the dict of tensors. TFLOP/s from
each side's own FLOP count (torch's FlopCounterMode over one step).

Shapes: mini (4 layers, 256 wide, 4 heads, 1024 FFN), base (12/768/12/3072), padding (mini with ~40% of every
batch padding: our padded vs our unpadded encoder, with BERT's attention dropout and without it; the unpadded encoder
runs flash attention's variable-length kernel on a GPU, either way; --compile adds the unpadded one compiled).
Sequence length 128, vocabulary 30522. Batch: on a CPU 32 for mini and padding, 8 for base; on a GPU 128 for every
shape (--batch overrides). --cuda-graphs adds our model compiled with CUDA graphs (compile_mode=reduce-overhead);
--variants keeps the named variants only.

    python benchmarks/train_throughput.py                       # CPU: all shapes, fp32 and bf16 autocast
    python benchmarks/train_throughput.py --shapes mini --precision bf16 --compile
    python benchmarks/train_throughput.py --device cuda         # GPU: bf16, batch 128, with MFU
    python benchmarks/train_throughput.py --device cuda --shapes mini --compile --cuda-graphs \
        --variants "ours + compile,ours + CUDA graphs"           # CUDA graphs where launches set the pace
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from objectives import build_objectives
from pretrain.core.batch import Batch
from pretrain.core.config import ModelConfig
from pretrain.core.files import write_json_atomic
from pretrain.core.tokens import IGNORE_INDEX, SpecialTokens
from pretrain.model.pretraining import PretrainingModel
from pretrain.train.flops import count_step_flops, device_description, device_peak_tflops

VOCAB, SEQ, MASK_ID, CLS_ID, SEP_ID = 30522, 128, 103, 101, 102
SHAPES = {  # layers, hidden, heads, intermediate, batch on a CPU
    "tiny": (2, 64, 2, 128, 8),  # the CPU rehearsal of benchmarks/gpu_suite.sh
    "mini": (4, 256, 4, 1024, 32),
    "base": (12, 768, 12, 3072, 8),
    "padding": (4, 256, 4, 1024, 32),
}
GPU_BATCH = 128


def make_batch(batch: int, pad_fraction: float, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """[B, L] ids with [CLS]/[SEP], two segments, ~pad_fraction right padding, 15% of real tokens masked."""
    rng = np.random.default_rng(seed)
    if pad_fraction:  # lengths uniform around (1 - pad_fraction) * L, one row full so L stays the width
        mean = (1 - pad_fraction) * SEQ
        lengths = rng.integers(int(2 * mean - SEQ), SEQ + 1, size=batch)
        lengths[0] = SEQ
    else:
        lengths = np.full(batch, SEQ)
    ids = np.zeros((batch, SEQ), np.int64)
    types = np.zeros((batch, SEQ), np.int64)
    mask = np.zeros((batch, SEQ), np.int64)
    labels = np.full((batch, SEQ), IGNORE_INDEX, np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1000, VOCAB, size=n)
        ids[row, 0], ids[row, n // 2], ids[row, n - 1] = CLS_ID, SEP_ID, SEP_ID
        types[row, n // 2 + 1 : n] = 1
        mask[row, :n] = 1
        chosen = rng.choice(np.arange(1, n - 1), size=max(1, round(0.15 * (n - 2))), replace=False)
        labels[row, chosen] = ids[row, chosen]
        ids[row, chosen] = MASK_ID
    out = {
        "input_ids": ids,
        "token_type_ids": types,
        "attention_mask": mask,
        "mlm_labels": labels,
        "nsp_label": rng.integers(0, 2, size=batch),
    }
    return {k: torch.as_tensor(v, device=device) for k, v in out.items()}


class Ours:
    def __init__(self, cfg: ModelConfig, device: str):
        tokens = SpecialTokens(pad=0, unk=100, cls=CLS_ID, sep=SEP_ID, mask=MASK_ID, vocab_size=VOCAB)
        self.model = PretrainingModel(cfg, build_objectives({"nsp": {}, "mlm": {}}, tokens)).to(device).train()

    def prepare(self, batch: dict) -> Batch:
        """The collated Batch the trainer's loader hands over (target positions and counts made on the host),
        built once: given plain tensors, the model would rebuild it, reading them back, at every step."""
        return Batch.of(batch, self.model.objectives)

    def loss(self, batch: Batch):
        return self.model(batch)[0]


class HF:
    def __init__(self, cfg: ModelConfig, device: str):
        import transformers

        config = transformers.BertConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            hidden_act="gelu",
            hidden_dropout_prob=cfg.hidden_dropout,
            attention_probs_dropout_prob=cfg.attention_dropout,
            max_position_embeddings=cfg.max_position_embeddings,
            type_vocab_size=cfg.type_vocab_size,
            layer_norm_eps=cfg.layer_norm_eps,
            pad_token_id=0,
        )
        self.model = transformers.BertForPreTraining._from_config(config, attn_implementation="sdpa")
        self.model.to(device).train()

    def prepare(self, batch: dict) -> dict:
        return batch

    def loss(self, batch):
        return self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
            labels=batch["mlm_labels"],
            next_sentence_label=batch["nsp_label"],
        ).loss


@dataclass
class Variant:
    name: str
    runner: object
    optimizer: torch.optim.Optimizer
    autocast: contextlib.AbstractContextManager | None
    batch: dict
    times: list

    def step(self):
        ctx = (
            torch.autocast(self.batch["input_ids"].device.type, dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )
        with ctx:
            loss = self.runner.loss(self.batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def make_optimizer(model, device):
    # Same optimizer for both sides: AdamW, fused kernels where torch has them (CPU and CUDA do for fp32).
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def build_variants(shape: str, precision: str, args) -> tuple[int, dict, list[Variant]]:
    """The shape's batch and variants, each with its model, optimizer and prepared batch."""
    layers, hidden, heads, inter, batch_size = SHAPES[shape]
    batch_size = args.batch or (GPU_BATCH if args.device == "cuda" else batch_size)
    base_cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=inter,
        max_position_embeddings=512,
    )
    pad = 0.4 if shape == "padding" else 0.0
    batch = make_batch(batch_size, pad, args.device)
    bf16 = precision == "bf16"
    specs = []
    if shape == "padding":
        specs += [("ours padded", Ours, dict()), ("ours unpadded", Ours, dict(unpadded=True))]
        no_dropout = dict(attention_dropout=0.0)  # as ModernBERT trains; the rows above keep BERT's 0.1
        specs += [
            ("ours padded, attn dropout 0", Ours, no_dropout),
            ("ours unpadded, attn dropout 0", Ours, dict(no_dropout, unpadded=True)),
        ]
    else:
        specs += [("HF BertForPreTraining", HF, None), ("ours", Ours, dict())]
    extra = dict(unpadded=True) if shape == "padding" else dict()
    if args.compile:
        specs.append(("ours + compile", Ours, dict(extra, compile=True)))
    if args.cuda_graphs:  # model.compile_mode=reduce-overhead: where launches, not the device, set the pace
        specs.append(("ours + CUDA graphs", Ours, dict(extra, compile=True, compile_mode="reduce-overhead")))
    if args.variants:
        keep = args.variants.split(",")
        unknown = sorted(set(keep) - {name for name, *_ in specs})
        if unknown:
            raise SystemExit(f"--variants: {unknown} not among {shape}'s: {', '.join(name for name, *_ in specs)}")
        specs = [spec for spec in specs if spec[0] in keep]
    variants = []
    for name, cls, options in specs:
        torch.manual_seed(0)
        cfg = base_cfg if options is None else ModelConfig(**{**base_cfg.__dict__, **options})
        runner = cls(cfg, args.device)
        prepared = runner.prepare(batch)  # before any timing
        variants.append(Variant(name, runner, make_optimizer(runner.model, args.device), bf16, prepared, []))
    return batch_size, batch, variants


def shape_rows(shape: str, precision: str, variants, failed: dict, flops: dict, tokens: tuple, args) -> list[dict]:
    """A row per variant timed so far (median of its repeats), then one per failed variant with its error.
    tokens: the batch's size and its real (unpadded) tokens."""
    batch_size, real_tokens = tokens
    timed = [v for v in variants if v.name not in failed and v.times]
    reference = statistics.median(timed[0].times) if timed else float("nan")
    peak = device_peak_tflops(precision) if args.device == "cuda" else None
    eager = flops.get("ours unpadded" if shape == "padding" else "ours")
    compiled_flops = eager or next((f for name, f in flops.items() if name.startswith("ours +")), None)
    rows = []
    for v in timed:
        t = statistics.median(v.times)
        row = {
            "shape": shape,
            "precision": precision,
            "variant": v.name,
            "batch": batch_size,
            "step_s": t,
            "tokens_s": batch_size * SEQ / t,
            "real_tokens_s": real_tokens / t,
            "ratio": reference / t,
            "spread": (min(v.times), max(v.times)),
        }
        step_flops = flops.get(v.name, compiled_flops)  # compiled: the same model's count
        row["tflops"] = step_flops / t / 1e12 if step_flops else float("nan")
        row["mfu"] = row["tflops"] / peak if peak else None
        rows.append(row)
    return rows + [
        {"shape": shape, "precision": precision, "variant": name, "batch": batch_size, "error": error}
        for name, error in failed.items()
    ]


def bench_shape(shape: str, precision: str, args, save=lambda rows: None) -> list[dict]:
    """The shape's variants, warmed up, then timed in alternation; `save(rows)` after every repeat."""
    batch_size, batch, variants = build_variants(shape, precision, args)
    failed: dict[str, str] = {}  # a variant that fails (a compile on a new GPU) is left out; the others are timed

    def attempt(v: Variant, steps: int) -> None:
        if v.name in failed:
            return
        try:
            for _ in range(steps):
                v.step()
        except Exception as err:  # noqa: BLE001 - reported in its row and the table
            failed[v.name] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            print(f"{shape} {precision} {v.name} failed: {failed[v.name]}", file=sys.stderr, flush=True)

    for v in variants:  # warm-up (allocator, oneDNN primitives, compilation)
        attempt(v, args.warmup)
    # each eager variant's own count; compiled ones take their eager model's (under the counter our model runs
    # eager), counted on the first compiled one where --variants kept no eager one
    counted = [v for v in variants if not v.name.startswith("ours +")]
    if not any(v.name.startswith("ours") for v in counted):
        counted += [v for v in variants if v.name.startswith("ours +")][:1]
    flops = {v.name: count_step_flops(v.step) for v in counted if v.name not in failed}
    tokens = (batch_size, int(batch["attention_mask"].sum()))
    for _ in range(args.repeats):
        for v in variants:
            sync(args.device)
            start = time.perf_counter()
            attempt(v, args.steps)
            sync(args.device)
            v.times.append((time.perf_counter() - start) / args.steps)
        save(shape_rows(shape, precision, variants, failed, flops, tokens, args))
    rows = shape_rows(shape, precision, variants, failed, flops, tokens, args)
    del variants
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default="mini,base,padding")
    parser.add_argument("--precision", default=None, help="fp32, bf16 or both (default: both on CPU, bf16 on CUDA)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="override the shape's batch size")
    parser.add_argument("--steps", type=int, help="steps per timed run (default: 2 on a CPU, 20 on a GPU)")
    parser.add_argument("--repeats", type=int, default=5, help="alternated timed runs per variant")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant first (default: 2 CPU, 10 GPU)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--compile", action="store_true", help="also time our model with model.compile=true")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time it compiled with CUDA graphs (compile_mode=reduce-overhead)",
    )
    parser.add_argument("--variants", default="", help="time only these variants (comma-separated names)")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.steps = args.steps or (20 if gpu else 2)
    args.warmup = args.warmup or (10 if gpu else 2)
    torch.set_num_threads(args.threads)
    precisions = args.precision or ("bf16" if args.device == "cuda" else "both")
    precisions = ["fp32", "bf16"] if precisions == "both" else [precisions]
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    meta = {"command": command, "device": device_description(), "torch": torch.__version__}

    def save(done: list[dict]) -> None:
        if args.json:  # the rows so far: a stage cut by its timeout keeps every repeat it finished
            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.json, {"meta": meta, "rows": done}, sync=False)

    rows = []
    for shape in args.shapes.split(","):
        for precision in precisions:
            before = list(rows)
            rows += bench_shape(shape, precision, args, lambda partial, before=before: save(before + partial))
            save(rows)
            print(f"done {shape} {precision}", file=sys.stderr, flush=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(
        f"\n`{command}`  \ntorch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, "
        f"load average at the end {load[0]:.2f}; ratio = median step time of the shape's first row / this row's\n"
    )
    print(
        "| shape | precision | variant | batch | step (ms, median) | tokens/s | real tokens/s | ratio | TFLOP/s |"
        + (" MFU |" if gpu else "")
    )
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if gpu else ""))
    ms = "{:.1f}" if gpu else "{:.0f}"
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['precision']} | {r['variant']} | {r['batch']} | failed: {r['error']} |")
            continue
        low, high = (ms.format(1000 * x) for x in r["spread"])
        line = (
            f"| {r['shape']} | {r['precision']} | {r['variant']} | {r['batch']} | {ms.format(1000 * r['step_s'])} "
            f"({low}-{high}) | {r['tokens_s']:,.0f} | {r['real_tokens_s']:,.0f} | {r['ratio']:.2f}x | "
            f"{r['tflops']:.3g} |"
        )
        if gpu:
            line += " - |" if r["mfu"] is None else f" {r['mfu']:.1%} |"
        print(line)


if __name__ == "__main__":
    main()
