"""Corpus -> training samples: our shard builder against the transformers `run_mlm.py` recipe, side by side.

Both pipelines run in this one invocation on the same machine, same fast tokenizer (trained once), same
number of worker processes, on a corpus and on a 10x concatenation of it:

  ours     data_pipeline.shards.build_shards (streamed, parallel, writes memory-mapped shards; the packed
           samples are then views computed on the fly, so nothing else has to run before training)
  run_mlm  load_dataset("json") -> Dataset.map(tokenizer(..., return_special_tokens_mask=True), batched,
           num_proc) -> Dataset.map(group_texts, batched, num_proc), exactly as examples/pytorch/
           language-modeling/run_mlm.py does without --line_by_line

Each run is a fresh subprocess with fresh output and cache directories (no cache hits). Peak memory is
sampled every 50 ms over the whole process tree (the child and all its workers), as both the sum of RSS
and the sum of PSS; PSS divides shared pages among the processes that map them, so forked workers that
share their parent's pages are not counted twice. Throughput is tokens produced / wall time of the
pipeline, imports excluded for both.

    python benchmarks/data_pipeline.py [--corpus PATH] [--scale 10] [--repeats 1] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "en-mix.train.jsonl"


# ---------------------------------------------------------------------------------------------- children


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (pool workers are reaped before we read it)."""
    import resource

    return sum(
        getattr(resource.getrusage(who), f)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )


def child_ours(corpus: str, tokenizer: str, work: str, workers: int, seq_len: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from data_pipeline.shards import build_shards

    start, cpu = time.perf_counter(), cpu_seconds()
    manifest = build_shards([corpus], tokenizer, Path(work) / "shards", num_workers=workers, show_progress=False)
    seconds = time.perf_counter() - start
    return {"tokens": manifest["counts"]["tokens"], "seconds": seconds, "cpu_s": cpu_seconds() - cpu}


def child_run_mlm(corpus: str, tokenizer: str, work: str, workers: int, seq_len: int) -> dict:
    from itertools import chain

    import datasets
    from datasets import load_dataset
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    start, cpu = time.perf_counter(), cpu_seconds()
    raw = load_dataset("json", data_files=corpus, split="train", cache_dir=str(Path(work) / "cache"))

    def tokenize_function(examples):
        return tok(examples["text"], return_special_tokens_mask=True)

    tokenized = raw.map(tokenize_function, batched=True, num_proc=workers, remove_columns=raw.column_names)

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = len(concatenated[next(iter(examples))]) // seq_len * seq_len
        return {k: [t[i : i + seq_len] for i in range(0, total, seq_len)] for k, t in concatenated.items()}

    grouped = tokenized.map(group_texts, batched=True, num_proc=workers)
    seconds = time.perf_counter() - start
    return {"tokens": grouped.num_rows * seq_len, "seconds": seconds, "cpu_s": cpu_seconds() - cpu}


# ---------------------------------------------------------------------------------------------- parent


def measure(pipeline: str, corpus: Path, tokenizer: Path, workers: int, seq_len: int) -> dict:
    """Run one pipeline in a fresh subprocess; its result plus the peak memory of its process tree."""
    import psutil

    work = Path(tempfile.mkdtemp(prefix=f"bench-{pipeline}-", dir="/tmp"))
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "hf-cache"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        __file__,
        "--child",
        pipeline,
        "--corpus",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--work",
        str(work),
        "--workers",
        str(workers),
        "--seq-len",
        str(seq_len),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    top = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss = pss = 0
        try:
            tree = [top] + top.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                info = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    out, err = proc.communicate()
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode:
        raise SystemExit(f"{pipeline} on {corpus} failed (rc={proc.returncode}):\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "tokens_per_s": result["tokens"] / result["seconds"], "peak_rss": peak_rss, "peak_pss": peak_pss}


def scaled_corpus(corpus: Path, scale: int) -> Path:
    """`corpus` concatenated `scale` times into /tmp (reused when already there with the right size)."""
    out = Path(tempfile.gettempdir()) / f"{corpus.stem}.x{scale}{corpus.suffix}"
    want = corpus.stat().st_size * scale
    if not out.is_file() or out.stat().st_size != want:
        tmp = out.with_suffix(".partial")
        with open(tmp, "wb") as f:
            for _ in range(scale):
                with open(corpus, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 20)
        os.replace(tmp, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="JSON Lines corpus with a 'text' field")
    parser.add_argument("--scale", type=int, default=10, help="also run on this many concatenated copies (0: no)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per (pipeline, corpus); the median is shown")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for both pipelines")
    parser.add_argument("--seq-len", type=int, default=128, help="group_texts block size")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", help="existing tokenizer directory (default: train one once into /tmp)")
    parser.add_argument("--child", choices=["ours", "run_mlm"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        fn = child_ours if args.child == "ours" else child_run_mlm
        print(json.dumps(fn(args.corpus, args.tokenizer, args.work, args.workers, args.seq_len)))
        return

    sys.path.insert(0, str(ROOT))
    corpus = Path(args.corpus)
    tokenizer = Path(args.tokenizer) if args.tokenizer else Path(tempfile.gettempdir()) / f"bench-tok-{args.vocab_size}"
    if not (tokenizer / "tokenizer.json").is_file():
        from data_pipeline.tokenizer import train_tokenizer

        print(f"training a WordPiece tokenizer ({args.vocab_size}) on {corpus} -> {tokenizer}", file=sys.stderr)
        train_tokenizer([str(corpus)], tokenizer, vocab_size=args.vocab_size, show_progress=False)
    corpora = [("1x", corpus)] + ([(f"{args.scale}x", scaled_corpus(corpus, args.scale))] if args.scale > 1 else [])

    rows = []
    for label, path in corpora:
        runs: dict[str, list[dict]] = {"ours": [], "run_mlm": []}
        for r in range(args.repeats):
            for pipeline in ("ours", "run_mlm") if r % 2 == 0 else ("run_mlm", "ours"):  # alternate: fair drift
                res = measure(pipeline, path, tokenizer, args.workers, args.seq_len)
                print(
                    f"  {label} {pipeline}: {res['tokens']:,} tokens in {res['seconds']:.1f}s "
                    f"({res['cpu_s']:.1f} CPU-s), peak PSS "
                    f"{res['peak_pss'] / 2**20:.0f} MiB, RSS {res['peak_rss'] / 2**20:.0f} MiB",
                    file=sys.stderr,
                )
                runs[pipeline].append(res)
        med = {p: {k: statistics.median(x[k] for x in v) for k in v[0]} for p, v in runs.items()}
        rows.append((label, path, med))

    mib = 2**20
    print(
        f"\nCorpus {corpus} ({corpus.stat().st_size / mib:.1f} MiB), {args.workers} workers, "
        f"median of {args.repeats}, {os.cpu_count()} cores\n"
    )
    print(
        "| corpus | pipeline | tokens | seconds | CPU-s | tokens/s | tokens/CPU-s | peak PSS (MiB) | peak RSS (MiB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, path, med in rows:
        for p in ("ours", "run_mlm"):
            m = med[p]
            print(
                f"| {label} ({path.stat().st_size / mib:.0f} MiB) | {p} | {m['tokens']:,.0f} | {m['seconds']:.1f} | "
                f"{m['cpu_s']:.1f} | {m['tokens_per_s']:,.0f} | {m['tokens'] / m['cpu_s']:,.0f} | "
                f"{m['peak_pss'] / mib:.0f} | {m['peak_rss'] / mib:.0f} |"
            )
    print("\n| corpus | speed-up, tokens/s | speed-up, tokens/CPU-s | memory, peak PSS ours/run_mlm | (peak RSS) |")
    print("|---|---:|---:|---:|---:|")
    for label, _, med in rows:
        o, h = med["ours"], med["run_mlm"]
        print(
            f"| {label} | {o['tokens_per_s'] / h['tokens_per_s']:.2f}x | "
            f"{(o['tokens'] / o['cpu_s']) / (h['tokens'] / h['cpu_s']):.2f}x | {o['peak_pss'] / h['peak_pss']:.2f} | "
            f"{o['peak_rss'] / h['peak_rss']:.2f} |"
        )
    if len(rows) > 1:
        first, last = rows[0][2]["ours"], rows[-1][2]["ours"]
        print(
            f"\nours, peak PSS {rows[-1][0]} / 1x: {last['peak_pss'] / first['peak_pss']:.2f} "
            f"(flat = 1.00); run_mlm: {rows[-1][2]['run_mlm']['peak_pss'] / rows[0][2]['run_mlm']['peak_pss']:.2f}"
        )


if __name__ == "__main__":
    main()
