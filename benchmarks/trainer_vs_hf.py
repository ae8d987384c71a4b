"""End to end: our `pretrain train` against transformers' Trainer on BertForMaskedLM, the run_mlm recipe a user would
pick instead, on the same tokenizer, text, shape, batch, sequence length and precision.

Each run is a fresh process; the variants run one after the other, alternated over --repeats. Both sides are timed
the same way: the tokens of the steps after --warm over the wall time of those same steps (ours: the metrics.jsonl
log intervals from step --warm to the last, summed; the peer: a callback's clock from step --warm to the last,
synchronized), so start-up, DeepSpeed set-up and compilation are outside both, and a run's rate is one total, not a
median of intervals. The table gives the median of those totals over repeats, and the ratio of medians.

TFLOP/s: each side's FLOPs per sample counted by torch's FlopCounterMode on one forward + backward of a CPU fp32
copy of its own model over real samples (ours: the trainer's own count, `tflops` in metrics.jsonl; the peer: the
same counter on BertForMaskedLM, which projects every position onto the vocabulary where ours projects the masked
ones), times its samples per second. MFU against the device's peak for the precision computed (bf16; with --fp32,
fp32's: TF32 stays off on both sides) (`pretrain.train.flops`), on a GPU only.
Both counts include attention: torch counts none for the CPU's attention kernel, so both sides count it with the
same formulas (`pretrain.train.flops.count_step_flops`; at BERT-base about 3% of a step's FLOPs at seq 128, 10% at
512).

Ours runs as a user runs it: compiled where CUDA is, where a graph torch fails to compile runs eager with torch's
warning. Each run's stderr is kept (`stderr.log` in its run directory; not under --verbose, which shows it) and the
frames torch left eager are counted, the Trainer's too (`compile_fallbacks`; None where not counted): a figure from a
run that fell back is flagged, not taken as compiled.

    pip install -e '.[bench]'                                            # the peer's accelerate
    python benchmarks/trainer_vs_hf.py                                   # CPU: BERT-mini, batch 32, seq 128
    python benchmarks/trainer_vs_hf.py --shape base --batch 128 --steps 150 --warm 50 --peers eager,compile
    python benchmarks/trainer_vs_hf.py --shape base --batch 32 --seq 512 --objectives mlm,rtd
    python benchmarks/trainer_vs_hf.py --shape mini --batch 1024 --objectives mlm,rtd --peers none
    python benchmarks/trainer_vs_hf.py --shape base --objectives mlm,mlm+nsp --peers none   # pairs vs packed
    python benchmarks/trainer_vs_hf.py --shape base --batch 128 --peers none --fp8          # float8 vs bf16

The peer in its best configuration: transformers' Trainer with BertForMaskedLM (sdpa attention),
DataCollatorForLanguageModeling (15%, 80/10/10), torch's fused AdamW (`optim="adamw_torch_fused"`), bf16 autocast,
4 loader workers and pinned memory on a GPU, no per-step nan/inf check of the loss (`logging_nan_inf_filter=False`:
its default reads the loss back every step), the same learning rate and warm-up; `--peers compile` adds it under
torch.compile (`torch_compile=True`). Its blocks are the corpus tokenized with our tokenizer, cut into [CLS] +
seq-2 tokens + [SEP], as our packing does. `--json` writes every run and the medians (benchmarks/gpu_suite.sh
reads them).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pretrain.core.files import write_json_atomic  # a stage cut by its timeout keeps the last one
from pretrain.train.distributed import single_process_env

# layers, hidden, heads, intermediate; tiny: the CPU rehearsal of benchmarks/gpu_suite.sh
SHAPES = {"tiny": (2, 64, 2, 128), "mini": (4, 256, 4, 1024), "base": (12, 768, 12, 3072)}
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "en-mix.train.jsonl"


def _env() -> dict:
    return single_process_env(WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")


def prepare(work: Path, corpus: Path, vocab: int, tokenizer: Path | None = None) -> tuple[Path, Path]:
    """Our tokenizer (`tokenizer` where given, else one trained into `work`) and shards of the corpus (both kept in
    `work` between invocations)."""
    tok, shards = tokenizer or work / "tokenizer", work / "shards"
    cli = [sys.executable, "-m", "pretrain.cli"]
    if tokenizer and not (tok / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer {tok}: no tokenizer.json there")
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


def objectives_override(spec: str) -> str:
    """'mlm+nsp' -> 'objectives={mlm: {}, nsp: {}}'."""
    return "objectives={" + ", ".join(f"{name}: {{}}" for name in spec.split("+")) + "}"


def window(records: list[dict], warm: int) -> dict:
    """Tokens, seconds and FLOPs of the log intervals from step `warm` to the last: each interval's time is its
    tokens over its rate, its FLOPs its TFLOP/s times that time."""
    start = next(r for r in records if r["step"] == warm)
    timed = [r for r in records if r["step"] > warm]
    tokens, seconds, flops, waited, before = 0, 0.0, 0.0, 0.0, start["tokens"]
    for r in timed:
        n = r["tokens"] - before
        dt = n / r["tokens_per_s"]
        tokens, seconds, flops, before = tokens + n, seconds + dt, flops + r["tflops"] * 1e12 * dt, r["tokens"]
        waited += r.get("data_wait", 0.0) * dt
    return {
        "tokens": tokens,
        "seconds": seconds,
        "steps": timed[-1]["step"] - warm,
        "flops": flops,
        "data_wait": waited / seconds,  # the share of those seconds the loop waited for the loader
    }


def run_ours(a, runs_dir: Path, tok: Path, shards: Path, objective: str, repeat: int, fp8: bool = False) -> dict:
    layers, hidden, heads, inter = SHAPES[a.shape]
    name = f"ours-{objective}{'-fp8' if fp8 else ''}-{repeat}"
    # a log line at step --warm and at the last step, and as few as that allows (each reads the device once)
    log_every = math.gcd(a.warm, a.steps - a.warm)
    args = [
        "train",
        "default",
        f"output_dir={runs_dir}",
        f"name={name}",
        f"data.tokenizer={tok}",
        f"data.shards={shards}",
        f"data.max_seq_len={a.seq}",
        f"model.num_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.num_heads={heads}",
        f"model.intermediate_size={inter}",
        f"model.max_position_embeddings={max(512, a.seq)}",
        objectives_override(objective),
        f"train.micro_batch_size={a.batch}",
        f"train.max_steps={a.steps}",
        f"train.lr={a.lr}",
        f"train.warmup_steps={a.warmup}",
        f"train.log_every={log_every}",
        "train.save_every=0",
        "train.max_minutes=0",
        f"train.precision={'fp8' if fp8 else 'fp32' if a.fp32 else 'bf16'}",
        "wandb.mode=disabled",
        # unset: as a user runs it (compiled where CUDA is, `model.compile`'s default)
        *(["model.compile=true"] if a.compile else ["model.compile=false"] if a.eager else []),
        *a.ours_overrides,
    ]
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.cli", *args],
        env=_env(),
        cwd=runs_dir,
        stdout=subprocess.DEVNULL,
        stderr=None if a.verbose else subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:  # its message, into the stage's log: a GPU run's minutes are not spent twice to read it
        raise SystemExit(f"our run {name} failed (exit {proc.returncode}):\n{(proc.stderr or '')[-3000:]}")
    if proc.stderr is not None:
        (runs_dir / name / "stderr.log").write_text(proc.stderr)
    records = [json.loads(line) for line in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
    w = window(records, a.warm)
    return {
        "tokens_per_s": w["tokens"] / w["seconds"],
        "tflops": w["flops"] / w["seconds"] / 1e12,
        "timed_steps": w["steps"],
        "timed_s": w["seconds"],
        "data_wait": w["data_wait"],
        "process_s": time.time() - started,
        "loss": records[-1]["loss"],
        "metrics": str(runs_dir / name / "metrics.jsonl"),
        "compile_fallbacks": None if proc.stderr is None else compile_fallbacks(proc.stderr),
    }


def compile_fallbacks(stderr: str) -> int:
    """Frames that torch.compile left eager, from torch's warnings: a compile error suppressed (`WON'T CONVERT`, where
    model.compile is unset and compiling is only the default) or a recompile limit hit."""
    return stderr.count("WON'T CONVERT") + stderr.count("torch._dynamo hit config.")


PEER = r"""
import copy, json, os, sys, time
import numpy as np
import torch
from transformers import (BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, PreTrainedTokenizerFast,
                          Trainer, TrainerCallback, TrainingArguments)
a = json.loads(sys.argv[1])
cuda = torch.cuda.is_available()
tok = PreTrainedTokenizerFast.from_pretrained(a["tok"])
try:  # the corpus's ids, tokenized once per work folder (16 MB took 9 s single-threaded, in every run)
    ids = np.load(a["ids"]).tolist()
except OSError:
    texts = [json.loads(line)["text"] for line in open(a["corpus"])]
    ids = [i for enc in tok(texts, add_special_tokens=False)["input_ids"] for i in enc + [tok.sep_token_id]]
    np.save(a["ids"] + ".tmp.npy", np.asarray(ids, dtype=np.int32))
    os.replace(a["ids"] + ".tmp.npy", a["ids"])
n = a["seq"] - 2
blocks = [[tok.cls_token_id] + ids[i:i + n] + [tok.sep_token_id] for i in range(0, len(ids) - n, n)]
class Blocks(torch.utils.data.Dataset):
    def __len__(self): return len(blocks)
    def __getitem__(self, i): return {"input_ids": blocks[i]}
layers, hidden, heads, inter = a["shape"]
config = BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=inter, max_position_embeddings=max(512, a["seq"]), pad_token_id=tok.pad_token_id)
collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
# FLOPs per sample as our trainer counts its own: a CPU fp32 model, one forward + backward over 2 real samples
# and the same count: attention included where the CPU's kernel runs it (torch counts only its CUDA kernels)
from pretrain.train.flops import count_step_flops
probe = BertForMaskedLM._from_config(config, attn_implementation="sdpa")
flops_per_sample = count_step_flops(lambda: probe(**collator([Blocks()[0], Blocks()[1]])).loss.backward()) / 2
del probe
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
            samples = (a["steps"] - a["warm"]) * a["batch"]
            print(json.dumps({"tokens_per_s": samples * a["seq"] / dt, "tflops": flops_per_sample * samples / dt / 1e12,
                              "timed_steps": a["steps"] - a["warm"], "timed_s": dt}), flush=True)
# logging_nan_inf_filter (default True) tests every step's loss for nan/inf on the host, a device sync per step:
# off, as a user tuning for speed would have it (ours reads the loss only at its log steps)
args = TrainingArguments(output_dir=a["out"], per_device_train_batch_size=a["batch"], max_steps=a["steps"],
                         bf16=not a["fp32"], learning_rate=a["lr"], warmup_steps=a["warmup"], adam_beta2=0.98,
                         adam_epsilon=1e-6, weight_decay=0.01, max_grad_norm=1.0, save_strategy="no", report_to=[],
                         logging_steps=10**9, dataloader_num_workers=4 if cuda else 0, optim="adamw_torch_fused",
                         torch_compile=a["compile"], use_cpu=not cuda, dataloader_pin_memory=cuda, seed=1234,
                         logging_nan_inf_filter=False)
Trainer(model=model, args=args, train_dataset=Blocks(), data_collator=collator, callbacks=[Clock()]).train()
"""


def peer_ids_key(tok: Path, corpus: Path) -> str:
    """The peer's cached ids belong to this tokenizer and this corpus (its path, size and time)."""
    st = corpus.stat()
    text = f"{(tok / 'tokenizer.json').read_text()}\n{corpus}\n{st.st_size}\n{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
        "ids": str(work / f"peer-ids-{peer_ids_key(tok, a.corpus)}.npy"),
    }
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", PEER, json.dumps(spec)], env=_env(), cwd=work, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"the HF Trainer run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    # Trainer prints its own summary dict after ours
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"tokens_per_s"')][-1])
    (work / f"hf-{'compile' if compile_ else 'eager'}.stderr.log").write_text(proc.stderr)  # the latest repeat's
    return result | {"process_s": time.time() - started, "compile_fallbacks": compile_fallbacks(proc.stderr)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS if DEFAULT_CORPUS.is_file() else ROOT / "data" / "us-speeches.public-domain.jsonl",
    )
    p.add_argument("--work", type=Path, help="directory for tokenizer, shards and runs (default: a temporary one)")
    p.add_argument("--tag", default="", help="runs go to WORK/runs-TAG: several invocations share one tokenizer")
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument(
        "--tokenizer", type=Path, help="a tokenizer of the corpus made before (gpu_prepare.sh's): none trained here"
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="mini")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warm", type=int, default=20, help="steps left out of the rate")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 (autocast)")
    p.add_argument("--fp8", action="store_true", help="each of ours also with train.precision=fp8, after bf16")
    p.add_argument("--compile", action="store_true", help="ours with model.compile=true (default: as configured)")
    p.add_argument("--eager", action="store_true", help="ours with model.compile=false")
    p.add_argument("--peers", default="eager", help="the Trainer's variants: eager, compile, eager,compile or none")
    p.add_argument("--hf-compile", action="store_true", help="also the Trainer compiled (= --peers eager,compile)")
    p.add_argument(
        "--objectives", default="mlm", help="ours: comma-separated objectives to time, '+' joins a mix (mlm+nsp)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ours-overrides", nargs="*", default=[], help="extra key=value overrides for our runs")
    p.add_argument("--json", type=Path, help="also write the runs and medians here (after every run: a cut keeps them)")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args()


def rows_of(runs: dict[str, list[dict]], peak: float | None) -> list[dict]:
    """Each variant's median over the repeats every variant has done (a cut mid-repeat left ours with two runs and
    the Trainer with one: medians of unequal repeats); the first variant is the reference of the ratios."""
    rows = []
    done = min((len(v) for v in runs.values() if v), default=0)
    for name, results in runs.items():
        results = results[:done] if done else results
        if not results:
            continue
        tflops = statistics.median(r["tflops"] for r in results)
        rows.append(
            {
                "run": name,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                "per_repeat": [r["tokens_per_s"] for r in results],
                "tflops": tflops,
                "mfu": tflops / peak if peak else None,
                "loss": statistics.median(r["loss"] for r in results) if all("loss" in r for r in results) else None,
                # ours: the share of the timed seconds spent waiting for the loader (a figure set by the loader)
                "data_wait": (
                    statistics.median(r["data_wait"] for r in results)
                    if all("data_wait" in r for r in results)
                    else None
                ),
                # frames torch.compile left eager, over the repeats (ours; None where not counted)
                "compile_fallbacks": (
                    sum(r["compile_fallbacks"] for r in results)
                    if all(r.get("compile_fallbacks") is not None for r in results)
                    else None
                ),
            }
        )
    for row in rows:
        row["first_over_this"] = rows[0]["tokens_per_s"] / row["tokens_per_s"]
    return rows


def measure(a, work: Path, runs_dir: Path, tok: Path, shards: Path, peers: list[str], save) -> dict:
    """The runs, alternated over the repeats (so load from other jobs hits every variant alike); `save(runs)` after
    each. A run that fails is saved as an error and the other variants go on (a failed compiled run of ours left the
    compiled Trainer unmeasured); the measurement then ends with the errors raised."""
    runs: dict[str, list[dict]] = {}
    errors: list[str] = []

    def one(name: str, fn, *args, **kw) -> None:
        try:
            result = fn(*args, **kw)
        except SystemExit as err:
            errors.append(f"{name}: {err}")
            save(runs, error="\n".join(errors))
            return
        runs.setdefault(name, []).append(result)
        save(runs, error="\n".join(errors) or None)

    for repeat in range(a.repeats):
        for objective in a.objectives.split(","):
            one(f"ours {objective}", run_ours, a, runs_dir, tok, shards, objective, repeat)
            if a.fp8:
                one(f"ours {objective} fp8", run_ours, a, runs_dir, tok, shards, objective, repeat, fp8=True)
        for peer in peers:
            one("HF Trainer" + (" + compile" if peer == "compile" else ""), run_peer, a, work, tok, peer == "compile")
        print(
            f"repeat {repeat + 1}/{a.repeats}: "
            + ", ".join(f"{k} {v[-1]['tokens_per_s']:,.0f}" for k, v in runs.items()),
            file=sys.stderr,
            flush=True,
        )
    if errors:
        raise SystemExit("\n".join(errors))
    return runs


def main() -> None:
    a = parse_args()
    peers = [] if a.peers == "none" else a.peers.split(",")
    if a.hf_compile and "compile" not in peers:
        peers.append("compile")
    if a.fp8 and a.fp32:
        raise SystemExit("--fp8 runs beside bf16: leave out --fp32")
    if not 0 < a.warm < a.steps:
        raise SystemExit("--warm must be between 0 and --steps")
    if math.gcd(a.warm, a.steps - a.warm) < min(10, a.warm):  # ours logs (reads the device) every gcd steps
        raise SystemExit(
            f"--warm {a.warm} and --steps {a.steps}: ours would log every {math.gcd(a.warm, a.steps - a.warm)} "
            "step(s), reading the device each time where the peer never does; give a --warm and timed steps with a "
            "common divisor of 10 or more (e.g. --steps 150 --warm 50)"
        )
    if peers and importlib.util.find_spec("accelerate") is None:  # transformers' Trainer needs it; ours does not
        raise SystemExit("the peer (transformers' Trainer) needs accelerate: pip install -e '.[bench]'")
    a.corpus = a.corpus.resolve()  # the runs start in the work directory
    work = (a.work or Path(tempfile.mkdtemp(prefix="trainer-vs-hf-"))).resolve()
    runs_dir = work / (f"runs-{a.tag}" if a.tag else "runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    # our trainer resumes a run directory it finds: an old run there would be timed as a resumed, finished one
    stale = sorted(str(d) for d in runs_dir.glob("ours-*") if d.is_dir())
    if stale:
        raise SystemExit(f"{runs_dir} already holds runs of an earlier benchmark ({', '.join(stale)}): another --tag")
    tok, shards = prepare(work, a.corpus, a.vocab, a.tokenizer.resolve() if a.tokenizer else None)
    import torch

    from pretrain.train.flops import device_description, device_peak_tflops

    peak = device_peak_tflops("fp32" if a.fp32 else "bf16")
    meta = {
        "shape": a.shape,
        "seq": a.seq,
        "batch": a.batch,
        "precision": "fp32" if a.fp32 else "bf16",
        "vocab": a.vocab,
        "timed_steps": a.steps - a.warm,
        "repeats": a.repeats,
        "device": device_description(),
        "torch": torch.__version__,
        "corpus": a.corpus.name,
        # model.compile as the runs resolved it (unset: compiled where CUDA is)
        "ours_compiled": bool(a.compile or (not a.eager and torch.cuda.is_available())),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }

    def save(runs: dict, error: str | None = None) -> None:
        if a.json:  # the repeats done so far; an error names the run that failed
            done = min((len(v) for v in runs.values() if v), default=0)
            extra = {"repeats_done": done} | ({"error": error[-3000:]} if error else {})
            a.json.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(a.json, {"meta": meta | extra, "rows": rows_of(runs, peak), "runs": runs}, sync=False)

    runs = measure(a, work, runs_dir, tok, shards, peers, save)
    print("\n" + format_table(meta, rows_of(runs, peak)))


def format_table(meta: dict, rows: list[dict]) -> str:
    head = (
        f"{meta['shape']}, seq {meta['seq']}, batch {meta['batch']}, {meta['precision']}, vocab {meta['vocab']}, "
        f"{meta['timed_steps']} timed steps x {meta['repeats']} repeats, {meta['device']}, corpus {meta['corpus']}"
        f"{', ours compiled' if meta.get('ours_compiled') else ''}\n\n"
    )
    lines = [
        f"| run | tokens/s (median) | per repeat | TFLOP/s | MFU | waiting for data | {rows[0]['run']} / this |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        wait = f"{r['data_wait']:.0%}" if r.get("data_wait") is not None else "-"
        per = " / ".join(f"{x:,.0f}" for x in r["per_repeat"])
        rate, ratio = f"{r['tokens_per_s']:,.0f}", f"{r['first_over_this']:.2f}x"
        lines.append(f"| {r['run']} | {rate} | {per} | {r['tflops']:.3g} | {mfu} | {wait} | {ratio} |")
    eager = fallbacks(rows)
    return head + "\n".join(lines) + (f"\n\n**Not all compiled**: {eager}" if eager else "")


def fallbacks(rows: list[dict]) -> str:
    """The runs of which torch.compile left frames eager, in words ('' where none): their figures are not compiled
    figures."""
    eager = [f"{r['run']} ({r['compile_fallbacks']})" for r in rows if r.get("compile_fallbacks")]
    where = "ours: each run's stderr.log; the Trainer's: hf-*.stderr.log in the work directory"
    return f"frames left eager in {', '.join(eager)} (torch's reasons: {where})" if eager else ""


if __name__ == "__main__":
    main()
