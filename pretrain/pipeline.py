"""The stages of a run, each skipped when its output is already there: tokenizer -> shards -> train -> export."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from pretrain.core.config import RunConfig
from pretrain.core.parsing import to_dict
from pretrain.hf.card import card_names, card_paths
from pretrain.hf.init_from import check_init_tokenizer
from pretrain.train.checkpoint import latest_checkpoint
from pretrain.train.fingerprint import TOKENIZER_SETTINGS
from pretrain.train.setup import load_checkpoint_model


def say(message: str) -> None:
    print(f"[pretrain] {message}", file=sys.stderr, flush=True)


def stage_tokenizer(cfg: RunConfig) -> Path:
    """The run's own tokenizer: trained, or kept where it was trained with what the config gives now (or where a
    checkpoint trained on it, `_tokenizer_settings_changed`); a tokenizer the config names is used as it is."""
    from data_pipeline.tokenizer import load_tokenizer, special_tokens, train_tokenizer

    check_init_tokenizer(cfg)  # the checkpoint's, where it has none: said, not trained into its directory
    out = cfg.tokenizer_dir
    d = cfg.data
    if d.tokenizer and (out / "tokenizer.json").is_file():  # the user's, used as it is: what it holds decides
        kept = [(k, v, now) for k, v, now in tokenizer_changes(cfg, inputs=False) if k in TOKENIZER_SETTINGS]
        if kept:
            said = ", ".join(f"{k}={v}" for k, v, _ in kept)
            given = ", ".join(f"data.{k}={now}" for k, _, now in kept)
            say(
                f"note: data.tokenizer {out} was trained with {said}: it is used as it is, and the config's {given} "
                "do not apply"
            )
    if (out / "tokenizer.json").is_file():
        changed = _tokenizer_settings_changed(cfg)
        if not changed:
            special_tokens(load_tokenizer(out))  # the tokens a run needs, before shards are built with it
            say(f"tokenizer: {out} exists, skipped")
            return out
        # trained by this run for other settings or text, and nothing trained on it: it is replaced
        say(f"tokenizer: {out} was trained with {', '.join(changed)}: training it again")
    sources, files = _tokenizer_inputs(d)
    named = ", ".join(f"{n} (weight {w:g})" for n, _, w in sources) if sources else ", ".join(d.corpus)
    say(f"tokenizer: training {d.tokenizer_type} (vocab {d.vocab_size}) on {named}")
    train_tokenizer(
        files,
        out,
        kind=d.tokenizer_type,
        vocab_size=d.vocab_size,
        lowercase=d.lowercase,
        strip_accents=d.strip_accents,
        min_frequency=d.min_frequency,
        text_field=d.text_field,
        text_documents=d.text_documents,
        sample_docs=d.tokenizer_sample_docs,
        max_document_bytes=d.max_document_bytes,
        on_bad=d.on_bad_document,
        sources=[(fs, w) for _, fs, w in sources] if sources else None,
        # as the config writes them, so that `_tokenizer_settings_changed` compares them like the other data.* keys;
        # and what the files were (path, bytes, mtime), which a corpus edited under its name changes
        recorded={"corpus": list(d.corpus), "sources": to_dict(d.sources), INPUTS: _fingerprints(files)},
    )
    return out


INPUTS = "input_files"  # the key of a tokenizer's training inputs in its training_settings.json


def _tokenizer_inputs(d) -> tuple[list | None, list]:
    """(each source's (name, files, weight), or None without data.sources; every input file) of the data config."""
    from data_pipeline.mixing import source_inputs
    from data_pipeline.readers import expand_inputs

    sources = source_inputs(d.sources) if d.sources else None  # one tokenizer, each source its weight's share
    return sources, (sorted({f for _, fs, _ in sources for f in fs}) if sources else expand_inputs(d.corpus))


def _fingerprints(files: list) -> list:
    """[path, bytes, mtime_ns] of each input file, sorted (the order a tokenizer reads a whole corpus in does not
    change what it learns)."""
    from data_pipeline.readers import input_fingerprint

    return sorted(fp for f in files for fp in input_fingerprint(Path(f)))


def _tokenizer_settings_changed(cfg: RunConfig) -> list[str]:
    """'data.KEY=OLD (now NEW)' for each setting the run's own tokenizer was trained with that its config changes,
    and 'corpus files since (edited: ...)' where the files it read changed, while nothing has trained on it yet. A
    tokenizer the config names (data.tokenizer) is the user's, used as it is; one a checkpoint trained on is held to
    its settings by the resume's fingerprint (`pretrain.train.fingerprint`) and to its data by the shards' content
    hash."""
    if cfg.data.tokenizer or latest_checkpoint(cfg.run_dir / "checkpoints") is not None:
        return []
    return [describe_change(*change) for change in tokenizer_changes(cfg)]


FILES = "corpus files"  # `tokenizer_changes`'s key where the files a tokenizer read changed


def describe_change(key: str, recorded, now, now_word: str = "now") -> str:
    """One of `tokenizer_changes`, as the tokenizer stage and `pretrain ablate` say it."""
    return f"{FILES} that changed since ({now})" if key == FILES else f"data.{key}={recorded} ({now_word} {now})"


def tokenizer_changes(cfg: RunConfig, inputs: bool = True) -> list[tuple[str, object, object]]:
    """(KEY, recorded, now) of each data.KEY the run's own tokenizer was trained with that the config gives
    otherwise; with `inputs`, (FILES, ..., what changed) where the files it read are not as they were. With
    the whole corpus read (data.tokenizer_sample_docs=0) its files decide, not how the config groups or weighs them.
    A settings file of an older version compares the keys it has."""
    from data_pipeline.tokenizer import trained_settings

    recorded = trained_settings(cfg.tokenizer_dir) or {}
    now = to_dict(cfg.data)
    whole = INPUTS in recorded and recorded.get("tokenizer_sample_docs") == now["tokenizer_sample_docs"] == 0
    skip = ("corpus", "sources") if inputs and whole else ()  # the files compared in their place
    changed = [(k, v, now[k]) for k, v in recorded.items() if k in now and k not in skip and now[k] != v]
    if inputs and INPUTS in recorded:
        files = _input_changes(recorded[INPUTS], _fingerprints(_tokenizer_inputs(cfg.data)[1]))
        if files:
            changed.append((FILES, "as they were", files))
    return changed


def _input_changes(then: list, now: list) -> str:
    """'edited: A; added: B; removed: C' between two `_fingerprints` lists; '' where the files are the same by name
    and size: a `touch`, a copy that did not keep times, a corpus moved with its run are not a change that retrains a
    tokenizer (an edit of the same size is, rarely, missed)."""
    import collections
    import os

    def kept(fps):
        return collections.Counter((os.path.basename(path), size) for path, size, *_ in fps)

    if kept(then) == kept(now):
        return ""
    old, new = ({path: size for path, size, *_ in fps} for fps in (then, now))
    kinds = {
        "edited": [p for p in new if p in old and old[p] != new[p]],
        "added": [p for p in new if p not in old],
        "removed": [p for p in old if p not in new],
    }

    def some(paths):
        return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")

    return "; ".join(f"{kind}: {some(paths)}" for kind, paths in kinds.items() if paths)


def stage_shards(cfg: RunConfig, resuming: Path | None = None) -> dict:
    """Tokenize the corpus into cfg.shards_dir (a cache hit when nothing changed). `resuming`: the checkpoint the run
    goes on from; shards that would be rebuilt are then built apart (`.rebuild` in the shards directory) and replace
    the old ones only when they hold the data the checkpoint trained on (or `train.allow_changes` names data): a
    changed corpus is refused with the run's shards as they were."""
    from data_pipeline.readers import expand_inputs
    from data_pipeline.shards import build_shards, shards_current

    if cfg.data.sources:  # weighted sources: one shard directory each, below cfg.shards_dir
        return _stage_source_shards(cfg, resuming)
    d = cfg.data
    named = _named_shards(cfg)
    if named is not None and not d.corpus:
        say(f"shards: {cfg.shards_dir} used as they are (data.corpus is empty)")
        return named
    paths = expand_inputs(d.corpus)
    if named is not None:
        _refuse_other_inputs(cfg, named, paths)
    settings = shard_settings(d)
    if (
        resuming is not None
        and (cfg.shards_dir / "manifest.json").is_file()
        and not shards_current(paths, cfg.tokenizer_dir, cfg.shards_dir, **settings)
    ):
        manifest = _rebuild_for_resume(cfg, paths, settings, resuming)
    else:
        manifest = build_shards(paths, cfg.tokenizer_dir, cfg.shards_dir, num_workers=d.num_workers, **settings)
    c = manifest["counts"]
    skipped = _skipped(c)
    say(
        f"shards: {c['documents']} documents, {c['sentences']} sentences, {c['tokens']} tokens in "
        f"{len(manifest['shards'])} shard(s) at {cfg.shards_dir} (skipped: {skipped})"
    )
    return manifest


def shard_settings(d) -> dict:
    """The data.* settings a shard build takes (one corpus's, or each source's)."""
    return dict(
        text_field=d.text_field,
        docs_per_shard=d.docs_per_shard,
        on_bad=d.on_bad_document,
        max_document_bytes=d.max_document_bytes,
        text_documents=d.text_documents,
    )


def _skipped(counts: dict) -> str:
    """A manifest's skipped documents by reason, for the summary line."""
    return ", ".join(f"{n} {why}" for why, n in counts.get("skipped", {}).items() if n) or "none"


def _named_shards(cfg: RunConfig) -> dict | None:
    """The manifest of finished shards in a directory the config names (data.shards: the user's), else None."""
    from data_pipeline.shard_format import read_json

    if not cfg.data.shards:
        return None
    return read_json(cfg.shards_dir / "manifest.json")


def _refuse_other_inputs(cfg: RunConfig, manifest: dict, paths: list) -> None:
    """Shards the user built (data.shards) from other files than data.corpus (or data.sources) are not rebuilt over:
    a preset's demo corpus, left in data.corpus, replaced them with no word; a mixture's manifest cleared them. The
    same files, changed, are built again as ever."""
    import os

    from data_pipeline.readers import input_fingerprint
    from pretrain.core.errors import UserError

    built = sorted(os.path.realpath(p) for p in manifest.get("inputs", []))
    # as the manifest names them: a datasets directory by its arrow files
    if built == sorted(os.path.realpath(fp[0]) for p in paths for fp in input_fingerprint(Path(p))):
        return
    shown = ", ".join(map(str, manifest.get("inputs", [])[:3])) + (
        " ..." if len(manifest.get("inputs", [])) > 3 else ""
    )
    if cfg.data.sources:
        given = f"data.sources ({', '.join(s.name for s in cfg.data.sources)})"
        instead = "data.sources=[] and data.corpus=[]"
    else:
        given, instead = f"data.corpus ({', '.join(map(str, cfg.data.corpus[:3]))})", "data.corpus=[]"
    raise UserError(
        f"data.shards={cfg.shards_dir} holds the shards of {shown or 'other files'}, not of {given}: building these "
        f"would replace them. Set {instead} (with data.tokenizer, the tokenizer they were built with) to train on "
        f"them as they are, the files they were built from, or another data.shards to build into"
    )


# the shards' build settings, as the config names them
DATA_SETTINGS = {
    "text_field": "data.text_field",
    "docs_per_shard": "data.docs_per_shard",
    "on_bad": "data.on_bad_document",
    "max_document_bytes": "data.max_document_bytes",
    "text_documents": "data.text_documents",
}


# Shard settings no config key sets: what a newer version of the build does otherwise
VERSIONS = {
    "splitter_version": "it splits the sentences of non-Latin scripts (Cyrillic, Greek, CJK, Devanagari) where the "
    "one before did not; Latin text splits as before",
    "format_version": "its shard files are of another format",
}


def _rebuild_for_resume(cfg: RunConfig, paths: list, settings: dict, checkpoint: Path) -> dict:
    """The shards of a resumed run, built again (their inputs' sizes or times changed) in `.rebuild` within their
    directory, compared with the data the checkpoint recorded, and swapped in only if it is the same data or the user
    allows the change; otherwise removed, with a UserError, leaving the run's shards untouched."""
    import shutil

    from data_pipeline.shard_format import read_json
    from data_pipeline.shards import ShardSet, build_shards
    from pretrain.core.errors import UserError
    from pretrain.train.fingerprint import DATA_KEY, change_allowed
    from pretrain.train.trainer import saved_fingerprint

    out = cfg.shards_dir
    tmp = out / ".rebuild"  # inside: on the same file system as the shards, a symlinked data.shards included
    shutil.rmtree(tmp, ignore_errors=True)  # a rebuild a crash left: only ever ours, by this name
    previous = read_json(out / "manifest.json") or {}
    before = previous.get("settings", {})
    say(f"shards: the corpus or the shards' settings changed since {checkpoint.name}; building beside, in {tmp}")
    try:
        manifest = build_shards(paths, cfg.tokenizer_dir, tmp, num_workers=cfg.data.num_workers, **settings)
        now, then = ShardSet(tmp, verify=False).content_hash(), saved_fingerprint(checkpoint).get(DATA_KEY)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if then is not None and now != then and not change_allowed(DATA_KEY, cfg.train.allow_changes):
        shutil.rmtree(tmp, ignore_errors=True)
        # settings that change the shards' files (docs_per_shard cuts the same text elsewhere): named, as the cause
        now_set = manifest.get("settings", {})
        differ = [k for k, v in now_set.items() if k in before and before[k] != v]
        changed = [f"{DATA_SETTINGS[k]}={now_set[k]} (was {before[k]})" for k in differ if k in DATA_SETTINGS]
        why = f" The shards' settings changed: {', '.join(changed)}; put them back to resume." if changed else ""
        versions = [k for k in differ if k in VERSIONS]
        if not changed and versions:  # this version cuts the same text otherwise: nothing the user can put back
            why = (
                f" This version builds shards otherwise ({'; '.join(VERSIONS[k] for k in versions)}): add "
                "train.allow_changes=[data] to go on with the new shards."
            )
        if not changed and _only_words_differ(previous, manifest):
            why = (
                " The corpus gives the same tokens as before: only the whole-word boundaries differ, cut by an "
                "earlier version (this one cuts CJK text and combining marks into words as BERT does); add "
                "train.allow_changes=[data] to go on with them."
            )
        raise UserError(
            f"cannot resume {checkpoint}: the corpus ({', '.join(cfg.data.corpus)}) no longer gives the data this "
            f"run trained on (shard content {now[:12]}... now, {then[:12]}... in the checkpoint).{why} The run "
            "directory and its shards were left as they were. Use the corpus the run started with, or another run "
            "name; to continue on purpose anyway, add train.allow_changes=[data]"
        )
    _swap_in(tmp, out)
    return manifest


def _only_words_differ(old: dict, new: dict) -> bool:
    """Whether two shard manifests hold the same files (tokens, documents, sentences) but for the word starts."""

    def files(manifest: dict) -> list:
        return [
            {k: v for k, v in s["sha256"].items() if not k.endswith(".words.bin")} for s in manifest.get("shards", [])
        ]

    return bool(old.get("shards")) and files(old) == files(new)


def _swap_in(new: Path, out: Path) -> None:
    """Put the shards in `new` (built apart: `.rebuild` within `out`, or beside a source's directory) in place of
    those in `out` (`shards.replace_build`: the user's other files there, and a symlinked `out`, stay as they are),
    unless a trainer reads `out` (another run on the same data.shards holds it `shared`): then `new` goes, with a
    UserError, and `out` stays."""
    import shutil

    from data_pipeline.shards import replace_build
    from pretrain.core.errors import UserError
    from pretrain.core.outputs import exclusive_if_free

    if not out.exists():  # a source new to the run: nothing to replace
        new.rename(out)
        return
    with exclusive_if_free(out) as free:
        if not free:
            shutil.rmtree(new, ignore_errors=True)
            raise UserError(
                f"{out} holds shards a run is training on (it reads them now): resume once it has finished, or use "
                "another data.shards directory; the shards were left as they were"
            )
        replace_build(new, out)


def _stage_source_shards(cfg: RunConfig, resuming: Path | None) -> dict:
    """`stage_shards` for data.sources: each source tokenized into <shards_dir>/<name>, a cache of its own (a source
    whose inputs did not change is a hit), then the mixture's manifest (`shards.write_mixture`). Resuming, a source
    that would be built is built beside and swapped in only if the mixture still holds the data the checkpoint
    trained on (or `train.allow_changes` names data), as `_rebuild_for_resume` does for one corpus: a refused
    resume leaves the run's shards (a one-corpus build there included) as they were."""
    from data_pipeline.mixing import source_inputs
    from data_pipeline.shards import write_mixture
    from pretrain.core.outputs import claim_output, mark_output

    d, out = cfg.data, cfg.shards_dir
    sources = source_inputs(d.sources)  # a pattern matching nothing fails here, naming its source
    named = _named_shards(cfg)
    if named is not None:  # the user's shards of other files: writing the mixture would clear them
        _refuse_other_inputs(cfg, named, [f for _, files, _ in sources for f in files])
    claim_output(out, "shards", "the shard directory")  # the sources' directories go inside: ours before they do
    mark_output(out, "shards")
    built, rebuilt = _build_sources(cfg, sources, resuming)
    for name, tmp in rebuilt.items():
        _swap_in(tmp, out / name)
    manifest = write_mixture(out, [(n, w, built[n]) for n, _, w in sources])
    for (name, _, weight), part in zip(sources, manifest["sources"]):
        c = part["counts"]
        say(f"shards: source {name} (weight {weight:g}): {c['documents']} documents, {c['tokens']} tokens")
    c = manifest["counts"]
    skipped = _skipped(c)
    say(
        f"shards: {len(sources)} sources, {c['documents']} documents, {c['tokens']} tokens in "
        f"{len(manifest['shards'])} shard(s) at {out} (skipped: {skipped})"
    )
    return manifest


def _build_sources(cfg: RunConfig, sources: list, resuming: Path | None) -> tuple[dict[str, dict], dict[str, Path]]:
    """(manifest of each source, where each source built beside the run's shards went). Resuming, any source not
    already current in <shards_dir>/<name> is built beside it, and the mixture is compared with the checkpoint's data
    before anything in <shards_dir> changes: a UserError then, with the builds beside removed."""
    import shutil

    from data_pipeline.shards import build_shards, shards_current

    d, out = cfg.data, cfg.shards_dir
    settings = shard_settings(d)
    built: dict[str, dict] = {}
    rebuilt: dict[str, Path] = {}  # source -> where it was built beside the run's shards
    try:
        for name, files, _ in sources:
            where = out / name
            if resuming is not None and not shards_current(files, cfg.tokenizer_dir, where, **settings):
                where = rebuilt[name] = out / f".{name}.rebuild"
                shutil.rmtree(where, ignore_errors=True)  # a rebuild a crash left: only ever ours, by this name
                say(f"shards: source {name} is not built as {resuming.name} used it; building it beside to compare")
            built[name] = build_shards(files, cfg.tokenizer_dir, where, num_workers=d.num_workers, **settings)
        if resuming is not None:
            _refuse_other_mixture(cfg, sources, built, rebuilt, resuming)
    except BaseException:
        for tmp in rebuilt.values():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return built, rebuilt


def _refuse_other_mixture(cfg: RunConfig, sources: list, built: dict, rebuilt: dict, checkpoint: Path) -> None:
    """A UserError unless the mixture `built` is the data `checkpoint` trained on (or train.allow_changes names data):
    sources changed on disk, other weights or names, or a run that trained on data.corpus."""
    from data_pipeline.shards import mixture_hash, shards_hash
    from pretrain.core.errors import UserError
    from pretrain.train.fingerprint import DATA_KEY, change_allowed
    from pretrain.train.trainer import saved_fingerprint

    now = mixture_hash([(n, w, shards_hash(built[n]["shards"])) for n, _, w in sources])
    then = saved_fingerprint(checkpoint).get(DATA_KEY)
    if then is None or now == then or change_allowed(DATA_KEY, cfg.train.allow_changes):
        return
    old = [n for n in rebuilt if (cfg.shards_dir / n / "manifest.json").is_file()]
    new = [n for n in rebuilt if n not in old]
    changed = "; ".join(
        [f"changed on disk: {', '.join(old)}"] * bool(old) + [f"not in the run's shards: {', '.join(new)}"] * bool(new)
    )
    changed = changed or "their names, weights or order changed"  # the interleaving follows their order too
    raise UserError(
        f"cannot resume {checkpoint}: data.sources ({changed}) no longer give the data this run trained on (shard "
        f"content {now[:12]}... now, {then[:12]}... in the checkpoint). The run directory and its shards were left "
        "as they were. Use the corpus the run started with, or another run name; to continue on purpose anyway, "
        "add train.allow_changes=[data]"
    )


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
    raw_weights: bool = False,
    private: bool = False,
    revision: str | None = None,
) -> Path:
    """Export the checkpoint to `out` (default <run>/hf, for the run `checkpoint.run_of` finds, however it was
    renamed or copied since training; a checkpoint outside a run needs `out`) as the HF architecture its options
    match (`arch` forces one of the registered architectures, `pretrain.hf.architectures`; see
    `pretrain.hf.interop.select_architecture`); optionally upload it to the Hub repo `push_to_hub` (`private`,
    on branch `revision`: `pretrain.hf.hub.push_to_hub`). The parity
    check (`verify`) runs on the new export before it replaces the previous one. The checkpoint is read under
    `reading_checkpoints`, so a trainer saving into the run meanwhile does not rotate it away. A run that kept a
    weight EMA exports it, unless `raw_weights`. Returns the directory a fill-mask demo should load: `out`, or
    `out`/generator for an ELECTRA (rtd) run, whose `out` holds the discriminator."""
    from pretrain.core.errors import UserError
    from pretrain.hf.hub import check_hub_token
    from pretrain.hf.hub import push_to_hub as upload
    from pretrain.train.checkpoint import reading_checkpoints, run_of
    from pretrain.train.metrics import read_metrics

    token = check_hub_token(push_to_hub) if push_to_hub else None  # no token: fail before doing anything
    source = Path(run_or_checkpoint)
    run = run_of(source)
    if out is None and run is None:
        raise UserError(
            f"{source} is a checkpoint outside a run directory (no <run>/checkpoints around it): "
            "give --out DIR for the export"
        )
    out = Path(out) if out else run / "hf"
    inputs = {"the run directory being exported": source, "its checkpoints": source / "checkpoints"}
    if not (source / "checkpoints").is_dir():
        inputs = {"the checkpoint being exported": source}
    with reading_checkpoints(source):  # until the tokenizer files are copied out of the checkpoint too
        cfg, model, tokens, tokenizer_dir, state = load_checkpoint_model(source, ema=not raw_weights)
        history = [r for r in read_metrics(run) if r["step"] <= state["step"]] if run else []
        card = export_card(cfg, model, state, run.name if run else cfg.name, history)
        out, demo = export_model(model, tokens, tokenizer_dir, out, card, arch, verify, inputs)
    if push_to_hub:
        say(f"export: uploaded to {upload(out, push_to_hub, token, private=private, revision=revision)}")
    return demo


def export_card(cfg: RunConfig, model, state: dict, name: str, history: list[dict], notes: list[str] = ()) -> dict:
    """What the model card says of a checkpoint: run, objectives, data, tokens, steps, final loss, config; which
    weights (the EMA's, an average) in its notes."""
    sources = cfg.data.source_list()
    files = [f for src in sources for f in src.corpus]
    named = dict(zip(files, card_names(files)))
    corpus = ", ".join(named[f] for f in files)
    if len(sources) > 1:
        corpus = "; ".join(
            f"{src.name} (weight {src.weight:g}): {', '.join(map(named.get, src.corpus))}" for src in sources
        )
    return {
        "run_name": name,
        "objectives": to_dict(cfg.objectives),
        "corpus": corpus,
        "provenance": _data_provenance(state),
        "tokens_seen": state.get("tokens_seen"),
        "steps": state["step"],
        "final_loss": history[-1]["loss"] if history else None,
        "final_loss_step": history[-1]["step"] if history else None,  # a checkpoint between log lines: an earlier one
        "final_loss_of_training_weights": bool(state.get("ema_weights")),  # an EMA export's loss is not its own
        "config": card_paths({"model": to_dict(model.config), "train": to_dict(cfg.train), "data": to_dict(cfg.data)}),
        "init_from": card_paths(cfg.model.init_from) or None,
        "notes": [*notes, *([f"the weights are {state['weights']}"] if state.get("weights") else [])],
    }


def _data_provenance(state: dict) -> str | None:
    """The checkpoint's own record of what it trained on (its fingerprint's hashes), or None where it has none."""
    from pretrain.train.fingerprint import DATA_KEY, TOKENIZER_KEY

    found = state.get("fingerprint") or {}
    hashes = (("the shards' content", found.get(DATA_KEY)), ("tokenizer.json", found.get(TOKENIZER_KEY)))
    return "; ".join(f"sha256 of {what} {value}" for what, value in hashes if value) or None


def export_model(model, tokens, tokenizer_dir: Path, out: Path, card: dict, arch, verify: bool, inputs: dict):
    """Export `model` as the HF architecture its options match into `out`, checked (`verify`) against ours on a
    probe batch and through the exported tokenizer's own call on a sentence pair before it replaces anything;
    returns (out, the directory a fill-mask demo loads)."""
    from pretrain.hf.architectures import get
    from pretrain.hf.export import export_hf, verify_parts
    from pretrain.hf.interop import select_architecture
    from pretrain.hf.tokenizer_check import check_pair_encoding

    target = select_architecture(model, arch)  # a UserError for options with no HF equivalent
    for note in target.notes:
        say(f"export: {note}")
    found: dict[str, float] = {}  # the parity check's max differences, filled in by `check`

    def check(directory: Path) -> None:
        found.update(verify_parts(model, directory, target.arch))
        check_pair_encoding(directory)

    out, parts = export_hf(
        model, tokens, tokenizer_dir, out, card, target.arch, inputs, check=check if verify else None, target=target
    )
    demo = out / get(target.arch).demo  # ELECTRA: the generator, the fill-mask model of its two
    what = " and ".join(f"{out / part.subdir} ({part.hf_class})" for part in parts)
    if verify:
        what += (
            f"; transformers loads it, max |logit diff| vs ours {max(found.values()):.2e} (hidden states included), "
            "and its tokenizer types sentence pairs as ours"
        )
    say(f"export: {what}")
    return out, demo


def stage_average(checkpoints: list[Path], out: Path, arch: str | None = None, verify: bool = True) -> Path:
    """The uniform average of several checkpoints of one model (every weight the mean of theirs, computed in fp64),
    exported like a run into `out`, its card naming the checkpoints. Checkpoints of different shapes are refused
    before anything is written. Every checkpoint is held (`reading_checkpoints`) from its resolution to the export:
    a trainer saving into its run meanwhile keeps it instead of rotating it away under the reader."""
    from pretrain.train.averaging import check_averageable
    from pretrain.train.checkpoint import load_module_state, reading_checkpoints, resolve_checkpoint
    from pretrain.train.ema import average_states
    from pretrain.train.state import TrainState

    with contextlib.ExitStack() as held:
        for c in checkpoints:
            held.enter_context(reading_checkpoints(c))
        paths = [resolve_checkpoint(Path(c)) for c in checkpoints]
        check_averageable(checkpoints, paths)
        averaged = average_states((str(p), load_module_state(p)) for p in paths)
        # the card's steps and tokens: those of the most trained checkpoint, whatever the order they were named in
        latest = max(paths, key=lambda p: TrainState.load(p).step)
        cfg, model, tokens, tokenizer_dir, state = load_checkpoint_model(latest, ema=False)
        model.load_state_dict(averaged)
        names = ", ".join(
            p.parent.parent.name + "/" + p.name if p.parent.name == "checkpoints" else card_names([str(p)])[0]
            for p in paths
        )
        kept = "weights" in state  # only where the run kept an EMA, which the mean is not of (`load_checkpoint_model`)
        state["weights"] = f"the mean of the training weights of {names}" + (
            " (not of the exponential moving average the run also kept)" if kept else ""
        )
        card = export_card(cfg, model, state, f"average of {len(paths)} checkpoints", [], [])
        inputs = {f"the checkpoint {p}": p for p in paths}
        out, demo = export_model(model, tokens, tokenizer_dir, Path(out), card, arch, verify, inputs)
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
    """tokenizer -> shards -> train -> export -> fill-mask demo; the tokenizer, shards and training are skipped where
    done (the export is made again)."""
    from pretrain.core.errors import UserError
    from pretrain.train.distributed import any_rank, init_distributed, rank0_alone
    from pretrain.train.trainer import own_run_dir

    rank, world = init_distributed(cfg.train.collective_timeout_minutes)  # the group is made once: here, for all
    # the inputs are found before the run directory is claimed: an error then leaves nothing written
    error = _inputs_missing(cfg) if rank == 0 else None
    if any_rank(error is not None):
        raise error or UserError("rank 0 could not find the run's inputs (its message says why)")
    with own_run_dir(cfg.run_dir, rank == 0, "running"):

        def prepare_data() -> None:
            # a resumed run's derived data is checked against its checkpoint before anything is rebuilt
            resuming = latest_checkpoint(cfg.run_dir / "checkpoints")
            stage_tokenizer(cfg)
            stage_shards(cfg, resuming)

        # the other ranks wait as long as it takes (a large corpus outlasts any collective timeout); every rank stops
        # with rank 0 where it fails
        rank0_alone(prepare_data, "prepare the tokenizer and shards")
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
            out = stage_export(cfg.run_dir, cfg.hf_dir)  # this config's export_dir, else <run_dir>/hf
            if demo:
                fill_mask_demo(out)
                say(plateau_note(cfg))
    return summary


def _inputs_missing(cfg: RunConfig):
    """The UserError that expanding data.sources or data.corpus gives (a pattern matching nothing, a missing file),
    or None: what stage_tokenizer and stage_shards would find, said before anything is written."""
    from data_pipeline.mixing import source_inputs
    from data_pipeline.readers import expand_inputs
    from pretrain.core.errors import UserError
    from pretrain.core.outputs import claim_output

    try:
        if cfg.data.sources:
            source_inputs(cfg.data.sources)
        elif cfg.data.corpus:
            expand_inputs(cfg.data.corpus)
        if cfg.export_dir:  # a folder of the user's files (or a file) was refused only after the whole training
            claim_output(Path(cfg.export_dir), "export", "export_dir")
    except UserError as err:
        return err
    return None


def plateau_note(cfg: RunConfig) -> str:
    """What the run's masked-LM loss says: compared with the corpus's unigram entropy, the loss of predicting each
    masked token from word frequencies alone, it shows whether the model has started to use context."""
    from data_pipeline.shards import ShardSet, unigram_entropy
    from data_pipeline.tokenizer import load_tokenizer, special_tokens
    from pretrain.train.metrics import last_intervals, read_metrics

    records = [r for r in read_metrics(cfg.run_dir) if "mlm/loss" in r]
    if not records:
        return "run finished"
    last = last_intervals(records, cfg.train.log_every)  # an interruption's own line does not count
    loss = sum(r["mlm/loss"] for r in last) / len(last)
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
