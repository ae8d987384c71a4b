"""Weighted mixing of corpora (`data.sources`): the schedule's proportions and determinism, resuming mid-stream,
source epochs, the tokenizer's sample split by weight, config errors, the per-source shard cache, and a short run
through the CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from data_pipeline.loader import PretrainDataset, build_loader
from data_pipeline.mixing import Interleave, MixedSamples, apportion, iter_documents_weighted
from data_pipeline.samples import build_samples
from data_pipeline.shards import ShardSet
from data_pipeline.tokenizer import load_tokenizer, special_tokens
from objectives import build_objectives
from pretrain.core.config import read_config
from pretrain.core.errors import ConfigError, UserError
from pretrain.train.setup import build_sample_source, load_config

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
Z99 = 2.5758  # two-sided 99% normal quantile


def source_counts(schedule: Interleave, n: int) -> np.ndarray:
    return np.bincount([schedule.locate(i)[0] for i in range(n)], minlength=schedule.num_sources)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [5, 1, 1, 0.5, 0.05], [1, 1]])
@pytest.mark.parametrize("seed", [0, 1234])
def test_proportions_within_binomial_interval(weights, seed):
    n = 10_000
    schedule = Interleave(weights, seed)
    counts = source_counts(schedule, n)
    share = np.array(weights) / sum(weights)
    bound = Z99 * np.sqrt(n * share * (1 - share))
    assert (np.abs(counts - n * share) <= bound).all(), (counts, n * share, bound)
    # stratified: every prefix holds its share to within a few samples, and `counts` says so without a loop
    assert (np.abs(counts - n * share) <= 3).all()
    assert schedule.counts(n).tolist() == counts.tolist()
    assert schedule.counts(777).tolist() == source_counts(schedule, 777).tolist()


def test_each_source_is_drawn_in_order_without_gaps():
    """Position -> (source, k) is a bijection: each source's draws are k = 0, 1, 2, ... in stream order."""
    schedule = Interleave([0.5, 0.3, 0.2], seed=7)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for i in range(5000):
        source, k = schedule.locate(i)
        seen[source].append(k)
    assert all(ks == list(range(len(ks))) for ks in seen.values())
    # the same position far into a run, in O(depth): a pure function of (seed, position)
    assert Interleave([0.5, 0.3, 0.2], seed=7).locate(10**12 + 3) == schedule.locate(10**12 + 3)


class Numbered:
    """A sample builder whose sample says where it came from: [source, index]."""

    def __init__(self, source: int, n: int):
        self.source, self.n = source, n

    def __len__(self) -> int:
        return self.n

    def sample(self, index: int, rng) -> dict[str, np.ndarray]:
        return {"input_ids": np.array([self.source, index, int(rng.integers(1 << 30))], np.int64)}


def mixed(seed: int, sizes=(50, 30, 7), weights=(0.5, 0.3, 0.2)) -> PretrainDataset:
    builders = [Numbered(s, n) for s, n in enumerate(sizes)]
    return PretrainDataset(MixedSamples(builders, ["a", "b", "c"], list(weights), seed), [], seed)


def stream(dataset: PretrainDataset, start: int, stop: int) -> list[tuple[int, ...]]:
    return [tuple(dataset[p]["input_ids"].tolist()) for p in range(start, stop)]


def test_same_seed_same_sequence_and_resume_continues_it():
    full = stream(mixed(3), 0, 400)
    assert stream(mixed(3), 0, 400) == full
    assert stream(mixed(4), 0, 400) != full
    assert stream(mixed(3), 250, 400) == full[250:]  # a fresh dataset jumps straight to a position
    # the loader resumes at consumed_samples: its batches are the stream's positions from there
    loader = build_loader(mixed(3), 0, 240, micro_batch_size=8, grad_accum_steps=2, rank=0, world_size=1)
    batches = iter(loader)
    got = [tuple(row) for _ in range(10) for row in next(batches)["input_ids"].tolist()]
    assert got == full[240:320]


def test_an_exhausted_source_starts_a_new_epoch_in_a_new_order():
    dataset = mixed(11)
    draws = [s for s in stream(dataset, 0, 600) if s[0] == 2]  # the 7-sample source, about 120 draws
    epochs = [tuple(d[1] for d in draws[i : i + 7]) for i in range(0, len(draws) - 6, 7)]
    assert len(epochs) >= 10
    assert all(sorted(e) == list(range(7)) for e in epochs)  # each epoch sees every sample once
    assert len(set(epochs)) > 1  # in an order of its own
    masks = [d[2] for d in draws if d[1] == 0]
    assert len(set(masks)) == len(masks)  # a sample's rng differs every epoch (new masks)


def test_tokenizer_sample_split_by_weight(tmp_path):
    lines = CORPUS.read_text().splitlines()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(lines[:40]) + "\n")
    b.write_text("\n".join(lines[40:]) + "\n")
    assert apportion(20, [0.25, 0.75]) == [5, 15]
    assert apportion(10, [0.5, 0.3, 0.2]) == [5, 3, 2]
    docs = list(iter_documents_weighted([[str(a)], [str(b)]], [0.25, 0.75], 20))
    assert [d.source for d in docs] == [str(a)] * 5 + [str(b)] * 15
    assert [d.line for d in docs] == list(range(1, 6)) + list(range(1, 16))  # deterministic: the first of each
    # a source with fewer documents than its share gives them again, as training repeats it: 1:1 was 88/12
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines[:4]) + "\n")
    docs = list(iter_documents_weighted([[str(b)], [str(small)]], [1, 1], 30))
    assert [d.source for d in docs] == [str(b)] * 15 + [str(small)] * 15
    assert [d.line for d in docs[15:]] == [1, 2, 3, 4] * 3 + [1, 2, 3]


def sources_override(*sources: tuple[str, str, float]) -> str:
    return "data.sources=[" + ", ".join(f"{{name: {n}, corpus: [{c}], weight: {w}}}" for n, c, w in sources) + "]"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([sources_override(("a", "x", 0))], "data.sources[0].weight: source 'a' has weight 0.0"),
        ([sources_override(("a", "x", 1), ("b", "y", -2))], "data.sources[1].weight: source 'b' has weight -2.0"),
        ([sources_override(("a", "x", 1)), "data.corpus=[z.jsonl]"], "data.corpus (z.jsonl) and data.sources"),
        ([sources_override(("a", "x", 1), ("a", "y", 1))], "data.sources[1].name: 'a' names two sources"),
        (["data.sources=[{name: a, corpus: []}]"], "data.sources[0].corpus: source 'a' names no files"),
        ([sources_override(("../a", "x", 1))], "data.sources[0].name: '../a' is not a short identifier"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        read_config("tiny", overrides)
    assert message in str(err.value)


def test_a_source_matching_no_file_is_named(tmp_path):
    from pretrain.pipeline import stage_shards, stage_tokenizer
    from pretrain.train.setup import load_config

    (tmp_path / "a.jsonl").write_text(CORPUS.read_text().splitlines()[0] + "\n")
    cfg = load_config(
        "tiny",
        [f"output_dir={tmp_path}", sources_override(("a", tmp_path / "a.jsonl", 1), ("b", tmp_path / "b*.jsonl", 1))],
    )
    for stage in (stage_tokenizer, stage_shards):
        with pytest.raises(ConfigError, match=r"data.sources\[1\] \('b'\): corpus '.*b\*.jsonl' matches no"):
            stage(cfg)
    assert not (tmp_path / "tiny").exists()  # refused before anything was written


# ---------------------------------------------------------------------------------------------- shards per source


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two sources cut from the embedded corpus, and a run config over them with its tokenizer trained."""
    from pretrain.pipeline import stage_tokenizer

    d = tmp_path_factory.mktemp("mix")
    lines = CORPUS.read_text().splitlines()
    (d / "a.jsonl").write_text("\n".join(lines[:30]) + "\n")
    (d / "b.jsonl").write_text("\n".join(lines[30:70]) + "\n")
    overrides = [
        f"output_dir={d / 'runs'}",
        "name=r",
        "data.vocab_size=512",
        "data.num_workers=0",
        "data.tokenizer_sample_docs=30",
    ]
    config = _config(overrides, d, 0.7, 0.3)
    stage_tokenizer(config)
    return d, overrides


def _config(overrides, d, wa, wb):
    from pretrain.train.setup import load_config

    return load_config("tiny", [*overrides, sources_override(("a", d / "a.jsonl", wa), ("b", d / "b.jsonl", wb))])


def _files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.name.startswith(("shard_", "manifest"))}


def test_shards_per_source_cache_hit_and_content_hash(two_sources, tmp_path):
    from pretrain.pipeline import stage_shards

    d, overrides = two_sources
    cfg = _config(overrides, d, 0.7, 0.3)
    stage_shards(cfg)
    shards = ShardSet(cfg.shards_dir)
    assert shards.is_mixture and [n for n, _, _ in shards.sources()] == ["a", "b"]
    assert shards.num_docs == 70  # one set over both, as the trainer opens it
    before = {name: _files(cfg.shards_dir / name) for name in ("a", "b")}
    hash_before = shards.content_hash()

    # the same weights with only b's file changed: a is a cache hit, b is rebuilt, the data hash moves
    original = (d / "b.jsonl").read_text()
    try:
        (d / "b.jsonl").write_text(original + CORPUS.read_text().splitlines()[80] + "\n")
        stage_shards(cfg)
        assert _files(cfg.shards_dir / "a") == before["a"]
        assert _files(cfg.shards_dir / "b") != before["b"]
        assert ShardSet(cfg.shards_dir).num_docs == 71
        assert ShardSet(cfg.shards_dir).content_hash() != hash_before
    finally:
        (d / "b.jsonl").write_text(original)
    stage_shards(cfg)
    assert ShardSet(cfg.shards_dir).content_hash() == hash_before  # the data, not the files' times

    # the weights are part of what a run trained on: another mix is other data for a resume
    stage_shards(_config(overrides, d, 0.5, 0.5))
    assert ShardSet(cfg.shards_dir).content_hash() != hash_before
    assert _files(cfg.shards_dir / "a") == before["a"]


def test_resume_with_a_changed_source_is_refused_and_leaves_the_shards(two_sources):
    from pretrain.pipeline import stage_shards
    from pretrain.train.fingerprint import DATA_KEY

    d, overrides = two_sources
    cfg = _config(overrides, d, 0.7, 0.3)
    stage_shards(cfg)
    trained_on = ShardSet(cfg.shards_dir).content_hash()
    checkpoint = d / "step_00000003"  # what saved_fingerprint reads of a checkpoint
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"fingerprint": {DATA_KEY: trained_on}}))
    a_files = _files(cfg.shards_dir / "a")
    original = (d / "a.jsonl").read_text()
    try:
        (d / "a.jsonl").write_text(original + CORPUS.read_text().splitlines()[90] + "\n")
        with pytest.raises(UserError, match=r"data.sources \(changed on disk: a\)"):
            stage_shards(cfg, checkpoint)
        assert _files(cfg.shards_dir / "a") == a_files
        assert ShardSet(cfg.shards_dir).content_hash() == trained_on
        assert not list(cfg.shards_dir.glob(".*rebuild"))
        allowed = _config([*overrides, "train.allow_changes=[data]"], d, 0.7, 0.3)
        stage_shards(allowed, checkpoint)
        assert ShardSet(cfg.shards_dir).content_hash() != trained_on
    finally:
        (d / "a.jsonl").write_text(original)
    # the same data again (only the file's time changed): rebuilt beside, found equal, swapped in
    stage_shards(_config(overrides, d, 0.7, 0.3), checkpoint)
    assert ShardSet(cfg.shards_dir).content_hash() == trained_on


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_sources_never_build_over_shards_the_config_names(two_sources, tmp_path):
    """data.sources with data.shards naming the user's shards of another file wrote the mixture's manifest there,
    clearing their shard files; now it is refused as data.corpus is, and nothing there changes."""
    from data_pipeline.shards import build_shards
    from pretrain.pipeline import stage_shards

    d, overrides = two_sources
    tokenizer = d / "runs" / "r" / "tokenizer"
    other = tmp_path / "c.jsonl"
    other.write_text("\n".join(CORPUS.read_text().splitlines()[70:90]) + "\n")
    users = tmp_path / "usershards"
    build_shards([str(other)], tokenizer, users, num_workers=0, show_progress=False)
    (users / "NOTES.md").write_text("mine")
    before = _tree(users)
    cfg = _config([*overrides, "name=named", f"data.tokenizer={tokenizer}", f"data.shards={users}"], d, 1, 1)
    with pytest.raises(UserError, match=rf"data.shards={users} holds the shards of .*c.jsonl, not of data.sources"):
        stage_shards(cfg)
    assert _tree(users) == before


def test_resume_switched_from_corpus_to_sources_leaves_the_shards(two_sources):
    """A run that trained on data.corpus, resumed with data.sources: the mixture was written over its shards (a
    one-corpus build, cleared) before the resume was refused; now it is built beside, compared and refused first."""
    from pretrain.pipeline import stage_shards
    from pretrain.train.fingerprint import DATA_KEY
    from pretrain.train.setup import load_config

    d, overrides = two_sources
    tokenizer = f"data.tokenizer={d / 'runs' / 'r' / 'tokenizer'}"
    single = load_config("tiny", [*overrides, "name=switch", tokenizer, f"data.corpus=[{d / 'a.jsonl'}]"])
    stage_shards(single)
    checkpoint = d / "switch_step_00000003"
    checkpoint.mkdir(exist_ok=True)
    trained_on = ShardSet(single.shards_dir).content_hash()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"fingerprint": {DATA_KEY: trained_on}}))
    before = _tree(single.shards_dir)
    mixed = _config([*overrides, "name=switch", tokenizer], d, 1, 1)
    with pytest.raises(UserError, match=r"data.sources \(not in the run's shards: a, b\).*left as they were"):
        stage_shards(mixed, checkpoint)
    assert _tree(single.shards_dir) == before
    assert ShardSet(single.shards_dir).content_hash() == trained_on


@pytest.mark.parametrize("linked", [False, True])
def test_resume_swap_keeps_the_users_files_and_link(two_sources, tmp_path, linked):
    """A resume's rebuild of a named data.shards swapped the whole directory in: the user's NOTES.md there went, and
    a symlinked data.shards became a directory of its own. Now only the build's files are replaced."""
    import os

    from pretrain.pipeline import stage_shards
    from pretrain.train.fingerprint import DATA_KEY
    from pretrain.train.setup import load_config

    d, overrides = two_sources
    corpus = tmp_path / "a.jsonl"
    corpus.write_text((d / "a.jsonl").read_text())
    real = tmp_path / "real"
    shards = tmp_path / "link" if linked else real
    if linked:
        real.mkdir()
        shards.symlink_to(real)
    named = [f"data.tokenizer={d / 'runs' / 'r' / 'tokenizer'}", f"data.shards={shards}"]
    cfg = load_config("tiny", [*overrides, "name=swap", *named, f"data.corpus=[{corpus}]"])
    stage_shards(cfg)
    (real / "NOTES.md").write_text("mine")
    (real / "eval").mkdir()
    (real / "eval" / "scores.txt").write_text("0.9")
    trained_on = ShardSet(real).content_hash()
    checkpoint = tmp_path / "step_00000003"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"fingerprint": {DATA_KEY: trained_on}}))
    os.utime(corpus, ns=(1, 1))  # the same text, another time: rebuilt beside, found equal, swapped in
    stage_shards(cfg, checkpoint)
    assert not linked or os.readlink(shards) == str(real)
    assert (real / "NOTES.md").read_text() == "mine" and (real / "eval" / "scores.txt").read_text() == "0.9"
    assert ShardSet(real).content_hash() == trained_on
    assert not list(real.glob(".*rebuild")) and sorted(tmp_path.iterdir()) == sorted({corpus, real, shards, checkpoint})


def test_one_corpus_keeps_its_layout(two_sources):
    from pretrain.pipeline import stage_shards
    from pretrain.train.setup import load_config

    d, overrides = two_sources
    tokenizer = d / "runs" / "r" / "tokenizer"
    corpus = f"data.corpus=[{d / 'a.jsonl'}]"
    cfg = load_config("tiny", [*overrides, "name=single", corpus, f"data.tokenizer={tokenizer}"])
    stage_shards(cfg)
    manifest = json.loads((cfg.shards_dir / "manifest.json").read_text())
    assert "cache_key" in manifest and "sources" not in manifest
    assert not ShardSet(cfg.shards_dir).is_mixture
    assert (cfg.shards_dir / "shard_00000.tokens.bin").is_file()


# ---------------------------------------------------------------------------------------------- through the CLI


@pytest.mark.slow
def test_run_and_inspect_with_two_sources(tmp_path):
    lines = CORPUS.read_text().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:20]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines[20:60]) + "\n")
    args = [
        "tiny",
        f"output_dir={tmp_path}",
        "name=r",
        sources_override(("speeches_a", tmp_path / "a.jsonl", 3), ("speeches_b", tmp_path / "b.jsonl", 1)),
        "data.vocab_size=512",
        "data.num_workers=0",
        "model.num_layers=1",
        "train.max_steps=3",
        "train.save_every=3",
        "train.log_every=1",
        "train.warmup_steps=1",
    ]
    proc = run_cli("run", *args, "--no-demo", cwd=tmp_path)
    assert "shards: source speeches_a (weight 3)" in proc.stderr
    # each source's epoch, not their sum (a small source repeats by its weight)
    said = re.search(
        r"per epoch of each source: speeches_a (\d+) \(weight 3\), speeches_b (\d+) \(weight 1\)",
        proc.stdout + proc.stderr,
    )
    assert said and int(said.group(1)) > 0 and int(said.group(2)) > 0, proc.stderr[-2000:]
    state = json.loads((tmp_path / "r" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["step"] == 3
    assert state["fingerprint"]["data (content of the shards)"] == ShardSet(tmp_path / "r" / "shards").content_hash()

    report = run_cli("data", "inspect", *args, cwd=tmp_path).stdout
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.startswith("  speeches_")}
    shards = {name: part for name, _, part in ShardSet(tmp_path / "r" / "shards").sources()}
    for name, row in rows.items():
        assert int(row[4].replace(",", "")) == shards[name].num_tokens  # tokens per source
    # 8 x 3 = 24 samples, 3:1 -> 18 and 6; epochs = drawn / samples per epoch
    assert [int(rows[n][6]) for n in ("speeches_a", "speeches_b")] == [18, 6]
    per_epoch = int(rows["speeches_a"][5].replace(",", ""))
    assert math.isclose(float(rows["speeches_a"][7]), 18 / per_epoch, abs_tol=0.006)

    # packing efficiency as the run draws: each source's builder by its weight (the two taken as one corpus, unweighted,
    # was off by 14 points on a 9:1 mix of short and long documents), each from the lengths of its every sample
    parts = ShardSet(tmp_path / "r" / "shards").sources()
    cfg = load_config(*args[:1], args[1:])
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    L = cfg.data.max_seq_len
    for kind in ("packed", "doc_packed"):
        row = next(r.split() for r in report.splitlines() if "samples" in r and kind in r.split()[:2])
        truth = sum(
            weight * np.mean([len(b[i]["input_ids"]) for i in range(len(b))]) / L
            for _, weight, part in parts
            for b in [build_samples(kind, part, L, tokens, cfg.train.seed)]
        ) / sum(weight for _, weight, _ in parts)
        assert math.isclose(float(row[-1].rstrip("%")) / 100, truth, abs_tol=0.0006), (kind, row, truth)

    # with a second phase of 32-token sequences from step 1, that phase draws 16 samples from a stream of its own
    phased = run_cli("data", "inspect", *args, "schedule.phases=[{start: 1, max_seq_len: 32}]", cwd=tmp_path).stdout
    rows = {line.split()[0]: line.split() for line in phased.splitlines() if line.startswith("  speeches_")}
    assert [int(rows[n][6]) for n in ("speeches_a", "speeches_b")] == [6 + 12, 2 + 4]
    cfg = load_config(*args[:1], args[1:] + ["data.max_seq_len=32"])
    tokens = special_tokens(load_tokenizer(cfg.tokenizer_dir))
    short = build_sample_source(
        cfg, ShardSet(tmp_path / "r" / "shards"), tokens, build_objectives(cfg.objectives, tokens)
    )
    expected = 6 / per_epoch + 12 / short.lengths[0]
    assert "(of each phase's length)" in phased and math.isclose(float(rows["speeches_a"][7]), expected, abs_tol=0.006)

    # the same command again resumes nothing new and refuses nothing: the data is the run's
    again = run_cli("run", *args, "--no-demo", cwd=tmp_path)
    assert "shards: 2 sources" in again.stderr
