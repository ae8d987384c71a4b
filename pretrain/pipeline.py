"""The stages of a run, each skipped when its output is already there: tokenizer -> shards -> train -> export."""

from __future__ import annotations

import sys
from pathlib import Path

from pretrain.core.config import RunConfig, to_dict
from pretrain.train.setup import load_checkpoint_model


def say(message: str) -> None:
    print(f"[pretrain] {message}", file=sys.stderr, flush=True)


def stage_tokenizer(cfg: RunConfig) -> Path:
    from data_pipeline.readers import expand_inputs
    from data_pipeline.tokenizer import train_tokenizer

    out = cfg.tokenizer_dir
    if (out / "tokenizer.json").is_file():
        say(f"tokenizer: {out} exists, skipped")
        return out
    d = cfg.data
    files = expand_inputs(d.corpus)
    say(f"tokenizer: training {d.tokenizer_type} (vocab {d.vocab_size}) on {', '.join(d.corpus)}")
    train_tokenizer(
        files,
        out,
        kind=d.tokenizer_type,
        vocab_size=d.vocab_size,
        lowercase=d.lowercase,
        strip_accents=d.strip_accents,
        min_frequency=d.min_frequency,
        text_field=d.text_field,
        sample_docs=d.tokenizer_sample_docs,
        max_document_bytes=d.max_document_bytes,
    )
    return out


def stage_shards(cfg: RunConfig) -> dict:
    from data_pipeline.readers import expand_inputs
    from data_pipeline.shards import build_shards

    d = cfg.data
    manifest = build_shards(
        expand_inputs(d.corpus),
        cfg.tokenizer_dir,
        cfg.shards_dir,
        text_field=d.text_field,
        num_workers=d.num_workers,
        docs_per_shard=d.docs_per_shard,
        on_bad=d.on_bad_document,
        max_document_bytes=d.max_document_bytes,
    )
    c = manifest["counts"]
    skipped = ", ".join(f"{n} {why}" for why, n in c.get("skipped", {}).items() if n) or "none"
    say(
        f"shards: {c['documents']} documents, {c['sentences']} sentences, {c['tokens']} tokens in "
        f"{len(manifest['shards'])} shard(s) at {cfg.shards_dir} (skipped: {skipped})"
    )
    return manifest


def stage_train(cfg: RunConfig) -> dict:
    from pretrain.train.trainer import train

    summary = train(cfg)
    say(
        f"train: step {summary['step']}/{cfg.train.max_steps}, {summary['tokens_seen']:,} tokens seen"
        + (f", final loss {summary['final_loss']:.4f}" if summary.get("final_loss") is not None else "")
    )
    return summary


def stage_export(
    run_or_checkpoint: Path,
    out: Path | None = None,
    verify: bool = True,
    arch: str | None = None,
    push_to_hub: str | None = None,
) -> Path:
    """Export the checkpoint to `out` (default <run>/hf) as the HF architecture its options match (`arch`
    forces one: bert, roberta, albert, modernbert, electra; see `pretrain.hf.interop.select_architecture`); optionally
    upload it to the Hub repo `push_to_hub`. Returns the directory a fill-mask demo should load: `out`, or
    `out`/generator for an ELECTRA (rtd) run, whose `out` holds the discriminator."""
    from pretrain.hf.electra import GENERATOR_DIR, export_electra, verify_electra_export
    from pretrain.hf.export import export_pretrained, verify_export
    from pretrain.hf.hub import check_hub_token
    from pretrain.hf.hub import push_to_hub as upload
    from pretrain.hf.interop import select_architecture
    from pretrain.train.metrics import read_metrics

    token = check_hub_token(push_to_hub) if push_to_hub else None  # no token: fail before doing anything
    source = Path(run_or_checkpoint)
    cfg, model, tokens, tokenizer_dir, state = load_checkpoint_model(source)
    target = select_architecture(model, arch)  # a UserError for options with no HF equivalent
    out = Path(out) if out else cfg.hf_dir
    inputs = {"the run directory being exported": source, "its checkpoints": source / "checkpoints"}
    if not (source / "checkpoints").is_dir():
        inputs = {"the checkpoint being exported": source}
    history = [r for r in read_metrics(cfg.run_dir) if r["step"] <= state["step"]]
    card = {
        "run_name": cfg.name,
        "objectives": to_dict(cfg.objectives),
        "corpus": ", ".join(cfg.data.corpus),
        "tokens_seen": state.get("tokens_seen"),
        "steps": state["step"],
        "final_loss": history[-1]["loss"] if history else None,
        "config": {"model": to_dict(model.config), "train": to_dict(cfg.train), "data": to_dict(cfg.data)},
        "init_from": cfg.model.init_from or None,
    }
    for note in target.notes:
        say(f"export: {note}")
    if target.arch == "electra":
        export_electra(model, tokens, tokenizer_dir, out, card, inputs)
        demo = out / GENERATOR_DIR
        if verify:
            diffs = verify_electra_export(model, out)
            say(
                f"export: {out} (ElectraForPreTraining) and {demo} (ElectraForMaskedLM); "
                f"transformers loads both; max |logit diff| vs ours {max(diffs.values()):.2e}"
            )
        else:
            say(f"export: {out} and {demo}")
    else:
        export_pretrained(model, tokens, tokenizer_dir, out, card, arch=target.arch, inputs=inputs)
        demo = out
        if verify:
            diff = verify_export(model, out)
            say(
                f"export: {out} ({target.hf_class}; transformers loads it; max |logit diff| vs ours {diff:.2e}, "
                "hidden states included)"
            )
        else:
            say(f"export: {out} ({target.hf_class})")
    if push_to_hub:
        say(f"export: uploaded to {upload(out, push_to_hub, token)}")
    return demo


def fill_mask_demo(model_dir: Path, text: str | None = None) -> list[dict]:
    """Load the exported model with transformers, as a user would, and fill in a mask."""
    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(model_dir), device="cpu")
    mask = fill.tokenizer.mask_token
    text = text or f"The President shall address the {mask} of the United States."
    predictions = fill(text, top_k=5)
    print(f"\nfill-mask with transformers, model {model_dir}:\n  {text}")
    for p in predictions:
        print(f"  {p['score']:.3f}  {p['token_str']}")
    return predictions


def run_all(cfg: RunConfig, demo: bool = True) -> dict:
    """tokenizer -> shards -> train -> export -> fill-mask demo, skipping stages whose output exists."""
    import torch.distributed as dist

    from pretrain.train.distributed import init_distributed
    from pretrain.train.trainer import own_run_dir

    rank, world = init_distributed()
    with own_run_dir(cfg.run_dir, rank == 0, "running"):
        if rank == 0:
            stage_tokenizer(cfg)
            stage_shards(cfg)
        if world > 1:
            dist.barrier()
        summary = stage_train(cfg)
        # train.max_minutes is a budget the config sets (the demo's cap on a slow or busy machine): what it trained is
        # exported and shown; a signal or an exit_after_steps preemption leaves only the checkpoint, to resume
        budget_spent = summary["reason"] == "max_minutes"
        if rank == 0 and (summary["complete"] or budget_spent):
            if not summary["complete"]:
                say(
                    f"train.max_minutes={cfg.train.max_minutes:g} ended training at step {summary['step']} of "
                    f"{cfg.train.max_steps}: exporting that checkpoint (the same command again trains on)"
                )
            out = stage_export(cfg.run_dir)
            if demo:
                fill_mask_demo(out)
                say(plateau_note(cfg))
    return summary


def plateau_note(cfg: RunConfig) -> str:
    """What the run's masked-LM loss says: compared with the corpus's unigram entropy, the loss of predicting each
    masked token from word frequencies alone, it shows whether the model has started to use context."""
    from data_pipeline.shards import ShardSet, unigram_entropy
    from data_pipeline.tokenizer import load_tokenizer, special_tokens
    from pretrain.train.metrics import read_metrics

    records = [r for r in read_metrics(cfg.run_dir) if "mlm/loss" in r]
    if not records:
        return "run finished"
    loss = sum(r["mlm/loss"] for r in records[-3:]) / len(records[-3:])
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    plateau = unigram_entropy(ShardSet(cfg.shards_dir, verify=False), tokens.special_ids)
    more = "that takes more than a few CPU minutes (on a GPU, `make demo` trains long enough)"
    if loss < plateau - 0.25:
        where = f"{plateau - loss:.2f} nats below it, so the model has begun to use context"
    elif loss <= plateau + 0.25:
        where = f"the model is at that plateau: it predicts frequent words and does not use context yet; {more}"
    else:
        where = f"the model is still learning word frequencies, before it can learn to use context; {more}"
    return (
        f"masked-LM loss {loss:.2f} after {records[-1]['tokens']:,} tokens; predicting every masked token from "
        f"word frequencies alone would give {plateau:.2f} (the unigram entropy of this corpus): {where}"
    )
