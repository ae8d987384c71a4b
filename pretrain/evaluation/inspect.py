"""`pretrain data inspect`: what a run will actually train on, before spending compute on it.

Reports the shard counts (documents, sentences, tokens, skips by reason), a histogram of document lengths
in tokens (PNG), the packing efficiency of every sample builder (fraction of a max_seq_len window that
holds real tokens rather than padding), and a few samples decoded after the run's own objectives prepared
them, showing exactly which tokens each objective masks or replaces. For weighted sources (`data.sources`): the tokens
of each, and how many of its epochs a run of train.max_steps sees.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np

from pretrain.core.errors import UserError
from pretrain.core.files import replace_file
from pretrain.core.tokens import IGNORE_INDEX

LEGEND = "[MASK](x): x replaced by [MASK];  ~y~(x): x replaced by y;  x(=): x chosen for prediction but unchanged"


def packing_efficiency(builder, max_seq_len: int, probe: int = 512, objectives=()) -> float:
    """Mean fraction of a max_seq_len window filled by a sample's tokens (the rest would be padding).

    Exact for the packed builders (from their chunk table); other builders are probed on up to `probe`
    evenly spaced samples, each as the sentence-level objective of `objectives` assembles it (segment pairs are
    raw material until then, see `assembled_sample`).
    """
    from data_pipeline.loader import sample_rng
    from data_pipeline.samples import DocPackedSequences, PackedSequences

    n = len(builder)
    if n == 0:
        return 0.0
    if isinstance(builder, DocPackedSequences):
        return float((builder.chunk_lengths() + 2).sum() / (n * max_seq_len))
    if isinstance(builder, PackedSequences):
        # every sample full but maybe the last: a partial one is filled from the stream's start (not where each token
        # is read once, nor where the stream is shorter than one sample), so 94% on a small corpus was really 100%
        full, rest = divmod(builder.stream_len, builder.chunk)
        last = (rest if builder.each_token_once or full == 0 else builder.chunk) if n > full else 0
        return float((full * builder.chunk + last + 2 * n) / (n * max_seq_len))
    picks = np.unique(np.linspace(0, n - 1, min(n, probe)).astype(np.int64))
    lengths = []
    for i in picks:
        sample = assembled_sample(builder, objectives, int(i), sample_rng(0, 0, int(i)))
        lengths.append(len(sample["input_ids"]))
    return float(np.mean(lengths) / max_seq_len)


def mixture_efficiency(kind: str, shards, max_seq_len: int, tokens, seed: int, objectives) -> dict:
    """Samples and packing efficiency of `kind` over weighted sources: each source's builder, weighted as the run draws
    from them (the sources' shards taken as one corpus, unweighted, said 61% where a 9:1 mix trains on 47%)."""
    from data_pipeline.samples import build_samples

    parts = shards.sources()  # [(name, weight, ShardSet)]
    total = sum(weight for _, weight, _ in parts)
    samples, efficiency = 0, 0.0
    for _, weight, part in parts:
        builder = build_samples(kind, part, max_seq_len, tokens, seed)
        samples += len(builder)
        efficiency += weight / total * packing_efficiency(builder, max_seq_len, 512, objectives)
    return {"samples": samples, "efficiency": efficiency}


def assembled_sample(builder, objectives, index: int, rng: np.random.Generator) -> dict:
    """Sample `index` as built and, where a sentence-level objective (nsp, sop) is among `objectives`, as it
    assembled the pair: [CLS] A [SEP] B [SEP] with its label. That is what the token-level objective then corrupts;
    a `SegmentPairs` sample alone holds only the raw "_" keys (see `data_pipeline.pairs`). Draws from `rng` as
    `PretrainDataset` does (builder first, then the sentence-level objective, which runs first), so a fresh rng of
    the same seed gives the very pair that the dataset's sample was made from."""
    sample = builder.sample(index, rng)
    for objective in objectives:
        if objective.sentence_level:
            sample = objective.prepare(sample, rng)
    return sample


SIGNATURE = "bert-pretrain data inspect"  # written into the histogram's metadata: a file that holds it is ours
_METADATA_KEY = {"png": "Software", "pdf": "Creator", "svg": "Creator", "eps": "Creator", "ps": "Creator"}


def histogram_formats() -> list[str]:
    """The suffixes matplotlib writes here whose metadata carries SIGNATURE (so that the next run may replace the
    file; jpeg, tiff, webp and the like have none matplotlib writes, pgf needs a LaTeX installation)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(set(FigureCanvasBase.get_supported_filetypes()) & set(_METADATA_KEY))


def check_histogram_path(path: Path, given: bool = True) -> None:
    """Refuse, before any work, an --out that matplotlib cannot write, or an existing file this command did not write
    (the user's own picture is never replaced). `given`: False for the default path, beside the shards (which need
    not be a run's: a shared shard store, or a directory inspected as it is)."""
    name = f"--out {path}" if given else f"{path} (where the histogram goes without --out)"
    formats = histogram_formats()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        what = f".{suffix} is not a format this command writes" if suffix else "no suffix"
        raise UserError(f"{name}: {what}: give a path ending in one of .{', .'.join(formats)}")
    if path.is_dir():
        raise UserError(f"{name} is a directory: give the path of the histogram file with --out")
    if path.exists() and SIGNATURE.encode() not in path.read_bytes():
        raise UserError(
            f"{name} exists and was not written by `pretrain data inspect`: it was left untouched; choose "
            "another path with --out (or remove it)"
        )


def length_histogram(lengths: np.ndarray, path: Path, max_seq_len: int, title: str) -> Path:
    """Histogram of document lengths (tokens, log-spaced bins) with the sequence length marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    hi = max(2, int(lengths.max()))
    bins = np.unique(np.geomspace(1, hi + 1, 60).astype(np.int64))
    ax.hist(lengths, bins=bins, color="#4c72b0")
    ax.set_xscale("log")
    ax.axvline(max_seq_len - 2, color="#c44e52", linestyle="--", label=f"max_seq_len - 2 = {max_seq_len - 2}")
    ax.axvline(float(np.median(lengths)), color="#55a868", linestyle=":", label=f"median = {np.median(lengths):.0f}")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    key = _METADATA_KEY.get(path.suffix.lower().lstrip("."))
    # The same shards give the same file: matplotlib stamps the time into PDF, SVG and PostScript (unless
    # SOURCE_DATE_EPOCH says which: 0 where the user set none), and an SVG's clip-path ids are random unless salted
    ours = "SOURCE_DATE_EPOCH" not in os.environ
    os.environ.setdefault("SOURCE_DATE_EPOCH", "0")
    try:
        with matplotlib.rc_context({"svg.hashsalt": SIGNATURE}):
            replace_file(path, lambda tmp: fig.savefig(tmp, dpi=100, metadata={key: SIGNATURE} if key else None))
    finally:
        if ours:
            os.environ.pop("SOURCE_DATE_EPOCH", None)
        plt.close(fig)
    return path


def render_sample(original: dict, prepared: dict, tokenizer) -> list[str]:
    """Lines showing a prepared sample: its tokens with each objective's changes marked (see LEGEND)."""
    orig = np.asarray(original["input_ids"])
    ids = np.asarray(prepared["input_ids"])
    n = len(ids)
    token_labels = {
        k: np.asarray(v) for k, v in prepared.items() if k.endswith("labels") and np.ndim(v) == 1 and len(v) == n
    }
    chosen = np.zeros(n, bool)
    for labels in token_labels.values():
        chosen |= labels != IGNORE_INDEX
    same_tokens = len(orig) == n
    words = []
    for i in range(n):
        tok = tokenizer.convert_ids_to_tokens(int(ids[i]))
        if same_tokens and ids[i] != orig[i]:
            was = tokenizer.convert_ids_to_tokens(int(orig[i]))
            words.append(f"{tok}({was})" if int(ids[i]) == tokenizer.mask_token_id else f"~{tok}~({was})")
        elif chosen[i]:
            words.append(f"{tok}(=)")
        else:
            words.append(tok)
    lines = textwrap.wrap(" ".join(words), width=110, break_long_words=False, break_on_hyphens=False)
    chosen_count = int(chosen.sum())
    stats = [f"{n} tokens", f"{chosen_count} chosen for prediction"]
    if same_tokens:
        stats.append(f"{int((ids != orig).sum())} changed")
    for key, value in prepared.items():
        if np.ndim(value) == 0:  # sentence-level targets, e.g. NSP/SOP labels
            stats.append(f"{key}={int(value)}")
    return [", ".join(stats)] + ["    " + line for line in lines]


def shards_to_rebuild(cfg) -> list[str]:
    """The run's built shard directories `pretrain run` would build again now (their corpus files changed since, or
    the tokenizer or a data setting did): what `data inspect` would otherwise report as the data a run trains on.
    Shards the config names (data.shards) are the user's, used as they are or refused (`_refuse_other_inputs`)."""
    from data_pipeline.mixing import source_inputs
    from data_pipeline.readers import expand_inputs
    from data_pipeline.shards import shards_current
    from pretrain.pipeline import shard_settings

    d = cfg.data
    if d.shards:
        return []
    if d.sources:
        parts = [(cfg.shards_dir / name, files) for name, files, _ in source_inputs(d.sources)]
    else:
        parts = [(cfg.shards_dir, expand_inputs(d.corpus))] if d.corpus else []
    return [
        str(where)
        for where, files in parts
        if (where / "manifest.json").is_file()
        and not shards_current(files, cfg.tokenizer_dir, where, **shard_settings(d))
    ]


def inspect_data(cfg, out_png: str | os.PathLike | None = None, num_samples: int = 3) -> dict:
    """Counts, histogram, packing efficiency and decoded samples for a run's shards; returns a report dict
    (`format_report` turns it into text). The shards are held while read: a build into them meanwhile is refused."""
    from data_pipeline.shards import reading_shards

    with reading_shards(cfg.shards_dir):
        return _inspect_data(cfg, out_png, num_samples)


def _inspect_data(cfg, out_png: str | os.PathLike | None, num_samples: int) -> dict:
    from data_pipeline.samples import build_samples, builder_kind
    from data_pipeline.shards import ShardSet
    from data_pipeline.tokenizer import load_tokenizer, special_tokens, tokenizer_hash
    from objectives import build_objectives, sample_builder_for
    from pretrain.core.schedule import Schedule, config_at
    from pretrain.train.setup import build_sample_source

    cfg = config_at(cfg, 0)  # the samples of the run's first phase: a phase from step 0 replaces the base settings

    png = Path(out_png) if out_png else cfg.shards_dir.parent / "inspect" / "doc_lengths.png"
    check_histogram_path(png, given=bool(out_png))
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    tokens = special_tokens(tokenizer)
    # Sizes are checked, checksums are not: inspecting must stay cheap; training verifies in full.
    shards = ShardSet(cfg.shards_dir, verify=False, expected_tokenizer_hash=tokenizer_hash(cfg.tokenizer_dir))
    m = shards.manifest
    lengths = shards.doc_lengths()
    L = cfg.data.max_seq_len
    seed = cfg.train.seed

    length_histogram(lengths, png, L, f"{shards.num_docs:,} documents, {shards.num_tokens:,} tokens ({cfg.shards_dir})")

    objectives = build_objectives(cfg.objectives, tokens)
    objective_kind = sample_builder_for(objectives)
    packing = getattr(cfg.data, "packing", "full_sentences")
    run_kind = builder_kind(objective_kind, packing)
    kinds = ["packed", "doc_packed"] + ([objective_kind] if objective_kind not in ("packed", "doc_packed") else [])
    efficiency, builders = {}, {}
    for kind in kinds:
        if shards.is_mixture:
            efficiency[kind] = mixture_efficiency(kind, shards, L, tokens, seed, objectives)
            continue
        builder = build_samples(kind, shards, L, tokens, seed)
        builders[kind] = builder
        efficiency[kind] = {"samples": len(builder), "efficiency": packing_efficiency(builder, L, 512, objectives)}

    if shards.is_mixture:  # each source's own builder, drawn from by weight, as the run does
        builder = build_sample_source(cfg, shards, tokens, objectives)
    else:
        builder = builders.get(run_kind) or build_samples(run_kind, shards, L, tokens, seed)
    schedule = Schedule.of(cfg)
    rates = schedule.objective_values if schedule.values else None
    samples = decoded_samples(builder, objectives, seed, num_samples, tokenizer, rates)
    return {
        "shards_dir": str(cfg.shards_dir),
        "tokenizer_dir": str(cfg.tokenizer_dir),
        "counts": m["counts"],
        "num_shards": len(m["shards"]),
        "vocab_size": m["vocab_size"],
        "max_seq_len": L,
        "doc_lengths": length_stats(lengths, L),
        "histogram": str(png),
        "packing": efficiency,
        "run_builder": run_kind,
        "objectives": [o.name for o in objectives],
        "samples": samples,
        **(source_report(cfg, shards, builder) if shards.is_mixture else {}),
    }


def length_stats(lengths: np.ndarray, max_seq_len: int) -> dict:
    """Mean, median, 95th percentile and longest document, and the share too long for one sequence with its
    [CLS] and [SEP]."""
    return {
        "mean": float(lengths.mean()),
        "median": float(np.median(lengths)),
        "p95": float(np.percentile(lengths, 95)),
        "max": int(lengths.max()),
        "over_max_seq_len": float((lengths > max_seq_len - 2).mean()),
    }


def decoded_samples(builder, objectives, seed: int, num_samples: int, tokenizer, rates=None) -> list[dict]:
    """The first samples a run would train on, each as built (a segment pair as assembled, with its label) and as
    its objectives prepared it at step 0, decoded: with `rates` (`Schedule.objective_values`), at the rates a
    schedule gives step 0, not the configured ones (mask_prob 0.15 showed 9 targets where step 0 trained 24)."""
    from data_pipeline.loader import PretrainDataset, sample_rng

    dataset = PretrainDataset(builder, objectives, seed, rates=rates)
    samples = []
    for position in range(min(num_samples, len(dataset))):
        source, epoch, index = dataset.place(position)
        rng = sample_rng(seed, epoch, index, source)  # the builder draws first from the same rng, as the dataset does
        original = assembled_sample(builder if source is None else builder.builders[source], objectives, index, rng)
        samples.append(
            {
                "position": position,
                "index": index,
                "source": None if source is None else builder.names[source],
                "lines": render_sample(original, dataset[(0, position)], tokenizer),
            }
        )
    return samples


def source_report(cfg, shards, mixed) -> dict:
    """Per source of a mixture: its tokens, and how many epochs of it a run of train.max_steps steps sees (the
    samples the run draws from it, over its samples per epoch), for one rank. With schedule phases each phase draws
    from a stream of its own at its own sequence length: their epochs add up."""
    import numpy as np

    from pretrain.core.schedule import Schedule, config_at
    from pretrain.train.setup import build_sample_source

    t, schedule = cfg.train, Schedule.of(cfg)
    batches = schedule.arrays(np.arange(t.max_steps), 1)["global_batch"]  # [max_steps] sequences, one rank
    drawn, epochs = np.zeros(len(mixed.lengths), np.int64), np.zeros(len(mixed.lengths))
    for phase in schedule.phases:
        end = min(schedule.phase_end(phase) or t.max_steps, t.max_steps)
        if phase.start >= end:
            continue
        source = mixed
        if phase.max_seq_len != cfg.data.max_seq_len:
            phase_cfg = config_at(cfg, phase.start)
            source = build_sample_source(phase_cfg, shards, special_tokens_of(cfg), objectives_of(phase_cfg))
        counts = source.draws(int(batches[phase.start : end].sum()))
        drawn += counts
        epochs += counts / np.array(source.lengths)
    total = sum(mixed.weights)
    rows = []
    for i, (name, weight, part) in enumerate(shards.sources()):
        c = part.manifest["counts"]
        rows.append(
            {
                "name": name,
                "weight": weight,
                "share": weight / total,
                "documents": c["documents"],
                "tokens": c["tokens"],
                "samples_per_epoch": mixed.lengths[i],
                "drawn": int(drawn[i]),
                "epochs": float(epochs[i]),
            }
        )
    return {
        "sources": rows,
        "global_batch": t.global_batch(1),
        "max_steps": t.max_steps,
        "drawn_total": int(batches.sum()),
        "scheduled": schedule.active,
    }


def special_tokens_of(cfg):
    from data_pipeline.tokenizer import load_tokenizer, special_tokens

    return special_tokens(load_tokenizer(cfg.tokenizer_dir))


def objectives_of(cfg):
    from objectives import build_objectives

    return build_objectives(cfg.objectives, special_tokens_of(cfg))


def format_report(r: dict) -> str:
    c, d = r["counts"], r["doc_lengths"]
    skipped = ", ".join(f"{n:,} {why}" for why, n in (c.get("skipped") or {}).items() if n) or "none"
    out = [
        f"shards     {r['shards_dir']} ({r['num_shards']} shard(s), vocab {r['vocab_size']:,})",
        f"documents  {c['documents']:,}   sentences {c['sentences']:,}   tokens {c['tokens']:,}",
        f"skipped    {skipped}",
        f"doc length mean {d['mean']:.0f}, median {d['median']:.0f}, p95 {d['p95']:.0f}, max {d['max']:,} tokens; "
        f"{d['over_max_seq_len']:.1%} longer than max_seq_len - 2 = {r['max_seq_len'] - 2}",
        f"histogram  {r['histogram']}",
        f"packing    (non-pad fraction of {r['max_seq_len']}-token windows; * = this run's builder)",
    ]
    for kind, e in r["packing"].items():
        mark = "*" if kind == r["run_builder"] else " "
        out.append(f"  {mark} {kind:<11} {e['samples']:>10,} samples   {e['efficiency']:.1%}")
    if r.get("sources"):
        drawn = r.get("drawn_total", r["global_batch"] * r["max_steps"])
        batch = (
            "the schedule's global batches (1 rank) over"
            if r.get("scheduled")
            else f"{r['global_batch']} (global batch, 1 rank) x"
        )
        out.append(
            f"sources    epochs at max_steps: {batch} {r['max_steps']} steps = {drawn:,} samples, each source's "
            "share of them over its samples per epoch" + (" (of each phase's length)" if r.get("scheduled") else "")
        )
        head = ("source", "weight", "share", "documents", "tokens", "samples/epoch", "drawn", "epochs")
        out.append("  {:<16} {:>8} {:>7} {:>10} {:>12} {:>14} {:>10} {:>8}".format(*head))
        for s in r["sources"]:
            out.append(
                f"  {s['name']:<16} {s['weight']:>8g} {s['share']:>7.1%} {s['documents']:>10,} {s['tokens']:>12,} "
                f"{s['samples_per_epoch']:>14,} {s['drawn']:>10,} {s['epochs']:>8.2f}"
            )
    out.append(f"samples    objectives {', '.join(r['objectives'])}, builder {r['run_builder']}; {LEGEND}")
    for s in r["samples"]:
        source = f"source {s['source']}, " if s.get("source") else ""
        out.append(f"  position {s['position']} ({source}sample {s['index']}): {s['lines'][0]}")
        out += s["lines"][1:]
    return "\n".join(out)
