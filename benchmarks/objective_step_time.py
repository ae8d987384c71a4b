"""Training-step time of each objective relative to MLM, same encoder, same data, one process.

    python benchmarks/objective_step_time.py [--layers 4 --hidden 256 --heads 4 --seq 128 --batch 16 --repeats 10]
        [--arms mlm,rtd] [--compile]

Batches are real: the embedded corpus is tokenized and sharded into a temporary directory, and each objective
prepares its own samples (segment pairs for nsp/sop). The timed step is forward + backward + AdamW step
(data preparation runs in the loader, off the critical path; see benchmarks/loader.py). `--compile`: every arm's
model compiled as a training run compiles it on a GPU (embeddings, layers, heads and losses), compile time outside
the timing (the warm-up compiles). The objectives run in
turn inside every repeat, so machine noise hits them alike; the table gives medians and the ratio to MLM.
Goals from the issue: rtd <= 1.4x, plm <= 1.5x, nsp / sop / span add <= 10%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_pipeline.loader import Collator, PretrainDataset  # noqa: E402
from data_pipeline.samples import build_samples, builder_kind  # noqa: E402
from data_pipeline.shards import ShardSet, build_shards  # noqa: E402
from data_pipeline.tokenizer import special_tokens, train_tokenizer  # noqa: E402
from objectives import build_objectives, sample_builder_for  # noqa: E402
from pretrain.core.config import ModelConfig
from pretrain.model.pretraining import PretrainingModel

ARMS = {
    "mlm": {"mlm": {}},
    "mlm+nsp": {"mlm": {}, "nsp": {}},
    "mlm+sop": {"mlm": {}, "sop": {}},
    "span": {"span": {}},
    "rtd": {"rtd": {}},
    "plm": {"plm": {}},
}


def make_arm(spec, tokens, shards, args):
    objectives = build_objectives(spec, tokens)
    samples = build_samples(builder_kind(sample_builder_for(objectives)), shards, args.seq, tokens, seed=0)
    data = PretrainDataset(samples, objectives, seed=0)
    collate = Collator(tokens.pad, objectives)
    batches = [collate([data[i * args.batch + j] for j in range(args.batch)]) for i in range(4)]
    cfg = ModelConfig(
        vocab_size=tokens.vocab_size,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=4 * args.hidden,
        pad_token_id=tokens.pad,
        compile=args.compile,
    )
    torch.manual_seed(0)
    model = PretrainingModel(cfg, objectives)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, batches


def step(model, optimizer, batch, bf16: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = model(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (AMX on CPUs that have it)")
    parser.add_argument("--compile", action="store_true", help="model.compile=true for every arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, mlm first (of {', '.join(ARMS)})")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="objbench-"))
    corpus = [ROOT / "data" / "us-speeches.public-domain.jsonl"]
    tokenizer = train_tokenizer(corpus, work / "tok", vocab_size=args.vocab, show_progress=False)
    build_shards(corpus, work / "tok", work / "shards", num_workers=0, show_progress=False)
    tokens, shards = special_tokens(tokenizer), ShardSet(work / "shards")

    names = args.arms.split(",")
    if names[0] != "mlm" or not set(names) <= set(ARMS):
        parser.error(f"--arms: mlm first, then any of {', '.join(ARMS)}; got {args.arms}")
    arms = {name: make_arm(ARMS[name], tokens, shards, args) for name in names}
    for model, opt, batches in arms.values():  # warm-up: allocator, kernels
        for batch in batches[:2]:
            step(model, opt, batch, args.bf16)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.repeats):
        for name, (model, opt, batches) in arms.items():
            batch = batches[r % len(batches)]
            start = time.perf_counter()
            step(model, opt, batch, args.bf16)
            times[name].append(time.perf_counter() - start)

    base = statistics.median(times["mlm"])
    print(
        f"\n{args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {tokens.vocab_size}, seq {args.seq}, "
        f"batch {args.batch}, {'bf16' if args.bf16 else 'fp32'}, {'compiled' if args.compile else 'eager'}, "
        f"{torch.get_num_threads()} threads, "
        f"median of {args.repeats}\n"
    )
    print("| objective | step ms (median) | vs mlm |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1000:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
