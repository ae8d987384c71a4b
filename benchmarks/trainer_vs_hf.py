"""End to end: our `pretrain train` against transformers' Trainer on BertForMaskedLM, the run_mlm recipe a user would
pick instead, on the same tokenizer, text, shape, batch, sequence length and precision.

Each is a fresh process, run one after the other and alternated over --repeats. The rate of a run is measured over
its steps after --warm (ours: the metrics.jsonl intervals; the peer: a callback's clock), so start-up, DeepSpeed set-up
and compilation are left out of both. The table gives medians over repeats, the ratio of medians, and our MFU from
metrics.jsonl (on a GPU; a CPU has no peak in the table). `--objectives mlm,rtd` also times other objectives of ours
on the same shape (tokens/s per objective, and each relative to mlm).

    pip install -e '.[bench]'                                            # the peer's accelerate
    python benchmarks/trainer_vs_hf.py                                   # CPU: BERT-mini, batch 32, seq 128
    python benchmarks/trainer_vs_hf.py --shape base --batch 128 --steps 150 --warm 50 --hf-compile
    python benchmarks/trainer_vs_hf.py --shape base --batch 32 --seq 512 --objectives mlm,rtd

The peer is transformers' Trainer with BertForMaskedLM (sdpa attention), DataCollatorForLanguageModeling (15%,
80/10/10), AdamW (torch fused), bf16 autocast, 4 loader workers on a GPU, the same learning rate and warm-up; its
blocks are the corpus tokenized with our tokenizer, cut into [CLS] + seq-2 tokens + [SEP], as our packing does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"mini": (4, 256, 4, 1024), "base": (12, 768, 12, 3072)}  # layers, hidden, heads, intermediate
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "en-mix.train.jsonl"


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def prepare(work: Path, corpus: Path, vocab: int) -> tuple[Path, Path]:
    """Our tokenizer and shards of the corpus (kept in `work` between invocations)."""
    tok, shards = work / "tokenizer", work / "shards"
    cli = [sys.executable, "-m", "pretrain.cli"]
    if not (tok / "tokenizer.json").is_file():
        subprocess.run(
            [*cli, "tokenizer", str(corpus), "--out", str(tok), "--vocab-size", str(vocab)], check=True, env=_env()
        )
    subprocess.run(
        [*cli, "shards", str(corpus), "--tokenizer", str(tok), "--out", str(shards)],
        check=True,
        env=_env(),
        stdout=subprocess.DEVNULL,
    )
    return tok, shards


def run_ours(a, work: Path, tok: Path, shards: Path, objective: str, repeat: int) -> dict:
    layers, hidden, heads, inter = SHAPES[a.shape]
    name = f"ours-{objective}-{repeat}"
    log_every = max(1, (a.steps - a.warm) // 5)
    args = [
        "train",
        "default",
        f"output_dir={work}",
        f"name={name}",
        f"data.tokenizer={tok}",
        f"data.shards={shards}",
        f"data.max_seq_len={a.seq}",
        f"model.num_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.num_heads={heads}",
        f"model.intermediate_size={inter}",
        f"model.max_position_embeddings={max(512, a.seq)}",
        f"objectives={{{objective}: {{}}}}",
        f"train.micro_batch_size={a.batch}",
        f"train.max_steps={a.steps}",
        f"train.lr={a.lr}",
        f"train.warmup_steps={a.warmup}",
        f"train.log_every={log_every}",
        "train.save_every=0",
        "train.max_minutes=0",
        f"train.precision={'fp32' if a.fp32 else 'bf16'}",
        "wandb.mode=disabled",
        *(["model.compile=true"] if a.compile else []),
        *a.ours_overrides,
    ]
    subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args],
        check=True,
        env=_env(),
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=None if a.verbose else subprocess.DEVNULL,
    )
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] - log_every >= a.warm]  # intervals that start after the warm-up
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[-1] else None,
        "tflops": statistics.median(r["tflops"] for r in timed),
        "loss": records[-1]["loss"],
    }


PEER = r"""
import json, sys, time
import torch
from transformers import (BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, PreTrainedTokenizerFast,
                          Trainer, TrainerCallback, TrainingArguments)
a = json.loads(sys.argv[1])
cuda = torch.cuda.is_available()
tok = PreTrainedTokenizerFast.from_pretrained(a["tok"])
texts = [json.loads(line)["text"] for line in open(a["corpus"])]
ids = [i for enc in tok(texts, add_special_tokens=False)["input_ids"] for i in enc + [tok.sep_token_id]]
n = a["seq"] - 2
blocks = [[tok.cls_token_id] + ids[i:i + n] + [tok.sep_token_id] for i in range(0, len(ids) - n, n)]
class Blocks(torch.utils.data.Dataset):
    def __len__(self): return len(blocks)
    def __getitem__(self, i): return {"input_ids": blocks[i]}
layers, hidden, heads, inter = a["shape"]
config = BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=inter, max_position_embeddings=max(512, a["seq"]), pad_token_id=tok.pad_token_id)
model = BertForMaskedLM._from_config(config, attn_implementation="sdpa")
def sync():
    if cuda: torch.cuda.synchronize()
class Clock(TrainerCallback):
    t0 = None
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == a["warm"]:
            sync(); Clock.t0 = time.perf_counter()
        if state.global_step == a["steps"]:
            sync(); dt = time.perf_counter() - Clock.t0
            print(json.dumps({"tokens_per_s": (a["steps"] - a["warm"]) * a["batch"] * a["seq"] / dt}), flush=True)
args = TrainingArguments(output_dir=a["out"], per_device_train_batch_size=a["batch"], max_steps=a["steps"],
                         bf16=not a["fp32"], learning_rate=a["lr"], warmup_steps=a["warmup"], adam_beta2=0.98,
                         adam_epsilon=1e-6, weight_decay=0.01, max_grad_norm=1.0, save_strategy="no", report_to=[],
                         logging_steps=10**9, dataloader_num_workers=4 if cuda else 0, optim="adamw_torch_fused",
                         torch_compile=a["compile"], use_cpu=not cuda, dataloader_pin_memory=cuda, seed=1234)
Trainer(model=model, args=args, train_dataset=Blocks(),
        data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.15), callbacks=[Clock()]).train()
"""


def run_peer(a, work: Path, tok: Path, compile_: bool) -> dict:
    spec = {
        "tok": str(tok),
        "corpus": str(a.corpus),
        "seq": a.seq,
        "batch": a.batch,
        "steps": a.steps,
        "warm": a.warm,
        "lr": a.lr,
        "warmup": a.warmup,
        "fp32": a.fp32,
        "compile": compile_,
        "shape": SHAPES[a.shape],
        "out": str(work / "hf-out"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", PEER, json.dumps(spec)], env=_env(), cwd=work, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"the HF Trainer run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    # Trainer prints its own summary dict after ours
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"tokens_per_s"')][-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS if DEFAULT_CORPUS.is_file() else ROOT / "data" / "us-speeches.public-domain.jsonl",
    )
    p.add_argument("--work", type=Path, help="directory for tokenizer, shards and runs (default: a temporary one)")
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--shape", choices=sorted(SHAPES), default="mini")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warm", type=int, default=20, help="steps left out of the rate")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 (autocast)")
    p.add_argument("--compile", action="store_true", help="ours with model.compile=true")
    p.add_argument("--hf-compile", action="store_true", help="also the peer with torch.compile")
    p.add_argument("--objectives", default="mlm", help="ours: comma-separated objectives to time (default: mlm)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ours-overrides", nargs="*", default=[], help="extra key=value overrides for our runs")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args()
    if importlib.util.find_spec("accelerate") is None:  # transformers' Trainer needs it; our trainer does not
        raise SystemExit("the peer (transformers' Trainer) needs accelerate: pip install -e '.[bench]'")
    work = a.work or Path(tempfile.mkdtemp(prefix="trainer-vs-hf-"))
    work.mkdir(parents=True, exist_ok=True)
    # our trainer resumes a run directory it finds: an old run there would be timed as a resumed, finished one
    stale = sorted(str(d) for d in work.glob("ours-*") if d.is_dir())
    if stale:
        raise SystemExit(f"{work} already holds runs of an earlier benchmark ({', '.join(stale)}): give a new --work")
    tok, shards = prepare(work, a.corpus, a.vocab)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    runs: dict[str, list[dict]] = {}
    for repeat in range(a.repeats):  # alternated, so load from other jobs hits every variant alike
        for objective in a.objectives.split(","):
            runs.setdefault(f"ours {objective}", []).append(run_ours(a, work, tok, shards, objective, repeat))
        runs.setdefault("HF Trainer", []).append(run_peer(a, work, tok, False))
        if a.hf_compile:
            runs.setdefault("HF Trainer + compile", []).append(run_peer(a, work, tok, True))
        print(
            f"repeat {repeat + 1}/{a.repeats}: "
            + ", ".join(f"{k} {v[-1]['tokens_per_s']:,.0f}" for k, v in runs.items()),
            file=sys.stderr,
            flush=True,
        )
    median = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    ours = median["ours " + a.objectives.split(",")[0]]
    print(
        f"\n{a.shape}, seq {a.seq}, batch {a.batch}, {'fp32' if a.fp32 else 'bf16'}, vocab {a.vocab}, "
        f"{a.steps - a.warm} timed steps x {a.repeats} repeats, {device}, corpus {a.corpus.name}\n"
    )
    print("| run | tokens/s (median) | ours / this | MFU |")
    print("|---|---:|---:|---:|")
    for name, rate in median.items():
        mfu = [r.get("mfu") for r in runs[name] if r.get("mfu") is not None]
        print(f"| {name} | {rate:,.0f} | {ours / rate:.2f}x | {f'{statistics.median(mfu):.1%}' if mfu else '-'} |")


if __name__ == "__main__":
    main()
