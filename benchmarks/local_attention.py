"""Tokens/s of an encoder forward + backward with sliding-window (local) layers vs global attention everywhere.

    python benchmarks/local_attention.py [--shape tiny|mini|base --seq 1024 --batch 4 --window 128 --repeats 7]
                                         [--json OUT.json]

The arms are the same ModernBERT-style encoder (pre-LN, RoPE, GeGLU, no biases) with model.local_attention=WINDOW
(global_every 3: a third of the layers global, as ModernBERT) or 0 (every layer global). Each repeat times one step
of each arm, in alternating order, so machine noise hits both alike; the table gives medians and the ratio.
tiny / mini are CPU-sized; --shape base is BERT-base (12 x 768), for a GPU (bf16 autocast there, fp32 on the CPU).
--padding P makes every other row end with a fraction P of padding; --unpadded runs the encoder on real tokens only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pretrain.core.config import ModelConfig  # noqa: E402
from pretrain.model.encoder import BertEncoder, init_weights  # noqa: E402

SHAPES = {  # layers, hidden, heads
    "tiny": (3, 128, 2),
    "mini": (6, 256, 4),
    "base": (12, 768, 12),
}


def make_encoder(args, window: int, device: torch.device) -> BertEncoder:
    layers, hidden, heads = SHAPES[args.shape]
    cfg = ModelConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=hidden * 3 // 2,  # ModernBERT's GeGLU width (1152 at 768)
        max_position_embeddings=args.seq,
        norm_placement="pre",
        position_embedding="rope",
        activation="geglu",
        use_bias=False,
        rope_theta=160000.0,
        local_attention=window,
        global_every=3,
        unpadded=args.unpadded,
        hidden_dropout=0.0,  # ModernBERT trains without dropout
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    encoder = BertEncoder(cfg)
    init_weights(encoder, 0.02)
    return encoder.to(device).train()


def step(encoder: BertEncoder, ids: torch.Tensor, mask: torch.Tensor | None, device: torch.device) -> None:
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        hidden = encoder(ids, None, mask)  # [B, L, H]
        loss = hidden.float().pow(2).mean()
    loss.backward()
    encoder.zero_grad(set_to_none=True)


def timed(encoder, ids, mask, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(encoder, ids, mask, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--padding", type=float, default=0.0)
    parser.add_argument("--unpadded", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the result here (benchmarks/gpu_suite.sh reads it)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 30522, (args.batch, args.seq), generator=gen)
    mask = None
    if args.padding or args.unpadded:
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[1::2, args.seq - int(args.padding * args.seq) :] = False
        ids[~mask] = 0
        mask = mask.to(device)
    ids = ids.to(device)
    arms = {"global": make_encoder(args, 0, device), "sliding": make_encoder(args, args.window, device)}
    for encoder in arms.values():
        for _ in range(args.warmup):
            step(encoder, ids, mask, device)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.repeats):
        for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:  # alternate which arm goes first
            times[name].append(timed(arms[name], ids, mask, device))

    layers, hidden, heads = SHAPES[args.shape]
    tokens = args.batch * args.seq if mask is None else int(mask.sum())
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{where}; {args.shape}: {layers} layers x {hidden} ({heads} heads), batch {args.batch} x seq {args.seq} "
        f"({tokens} real tokens), window {args.window}, global every 3rd layer, unpadded={args.unpadded}; "
        f"median of {args.repeats} alternated fwd+bwd steps"
    )
    rate = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        rate[name] = tokens / median
        print(f"  {name:8s} {median * 1e3:9.1f} ms/step  {rate[name]:11.0f} tokens/s  (min {min(ts) * 1e3:.1f} ms)")
    print(f"  sliding / global tokens/s: {rate['sliding'] / rate['global']:.2f}x")
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"} | {
            "device": where,
            "layers": layers,
            "hidden": hidden,
            "tokens": tokens,
            "command": " ".join(["python", "benchmarks/local_attention.py", *sys.argv[1:]]),
        }
        rows = [
            {"arm": name, "step_s": statistics.median(ts), "tokens_s": rate[name], "per_repeat": ts}
            for name, ts in times.items()
        ]
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "ratio": rate["sliding"] / rate["global"]}))


if __name__ == "__main__":
    main()
