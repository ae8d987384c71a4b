"""Can the loader keep the model fed? Loader samples/s (packed samples + MLM masking + collation) against
the samples/s a training step consumes, measured in the same run on the same machine.

Training step: the bert-mini preset (4 layers, hidden 256, MLM), micro-batch 32 x 128 tokens, fp32 on CPU,
PretrainingModel forward + backward + AdamW step, as many threads as torch uses by default. The loader is
timed with its work in the training process (num_workers=0: it then competes with nothing, which is its
best case) and with 2 worker processes (a run's `data.loader_workers` default is none on a CPU-only machine and up
to 4 per GPU; on a 2-core machine the workers and the main process share the cores, so this is its worst case).

    python benchmarks/loader.py [--corpus PATH] [--batches 100] [--steps 6]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "en-mix.train.jsonl"


def loader_rate(dataset, pad: int, batch: int, workers: int, batches: int) -> float:
    from data_pipeline.loader import build_loader

    it = iter(build_loader(dataset, pad, 0, batch, 1, 0, 1, num_workers=workers))
    for _ in range(3 if workers == 0 else 3 * workers):  # warm-up: worker start and first prefetches
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - start)


def train_rate(model, tokens, dataset, batch: int, steps: int) -> float:
    import torch

    from data_pipeline.loader import build_loader

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter(build_loader(dataset, tokens.pad, 0, batch, 1, 0, 1, num_workers=0))
    data = [next(batches) for _ in range(steps + 1)]  # prepared up front: time the model alone
    times = []
    for b in data:
        start = time.perf_counter()
        loss, _ = model(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return batch / (sum(times[1:]) / steps)  # the first step pays one-off allocation costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    parser.add_argument("--tokenizer", help="tokenizer directory (default: train a WordPiece 8192 once into /tmp)")
    parser.add_argument("--shards", help="shard directory (default: build once into /tmp)")
    parser.add_argument("--config", default="bert-mini", help="preset whose model and objectives are timed")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batches", type=int, default=100, help="loader batches timed")
    parser.add_argument("--steps", type=int, default=6, help="training steps timed (after one warm-up step)")
    args = parser.parse_args()

    import torch

    from data_pipeline.loader import PretrainDataset
    from data_pipeline.samples import build_samples
    from data_pipeline.shards import ShardSet, build_shards
    from data_pipeline.tokenizer import load_tokenizer, special_tokens, train_tokenizer
    from objectives import build_objectives, sample_builder_for
    from pretrain.train.setup import build_model, load_config

    tmp = Path(tempfile.gettempdir())
    tok_dir = Path(args.tokenizer) if args.tokenizer else tmp / "bench-tok-8192"
    if not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer([args.corpus], tok_dir, vocab_size=8192, show_progress=False)
    shard_dir = Path(args.shards) if args.shards else tmp / "bench-loader-shards"
    build_shards([args.corpus], tok_dir, shard_dir, num_workers=2, show_progress=False)  # a cache hit after once

    cfg = load_config(args.config, [f"data.max_seq_len={args.seq_len}", f"train.micro_batch_size={args.batch}"])
    tokens = special_tokens(load_tokenizer(tok_dir))
    objectives = build_objectives(cfg.objectives, tokens)
    samples = build_samples(sample_builder_for(objectives), ShardSet(shard_dir), args.seq_len, tokens, cfg.train.seed)
    dataset = PretrainDataset(samples, objectives, cfg.train.seed)

    rates = {f"loader, {w} workers": loader_rate(dataset, tokens.pad, args.batch, w, args.batches) for w in (0, 2)}
    model = build_model(cfg, tokens)
    train = train_rate(model, tokens, dataset, args.batch, args.steps)
    print(
        f"\n{args.config}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters, vocab {tokens.vocab_size}, batch {args.batch} x {args.seq_len}, objectives "
        f"{', '.join(cfg.objectives)}, torch threads {torch.get_num_threads()}\n"
    )
    print("| what | samples/s | loader / training step |")
    print("|---|---:|---:|")
    print(f"| training step (forward + backward + AdamW) | {train:,.0f} | |")
    for name, rate in rates.items():
        print(f"| {name} (packed + MLM masking + collate) | {rate:,.0f} | {rate / train:.1f}x |")


if __name__ == "__main__":
    main()
