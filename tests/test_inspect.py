"""`pretrain data inspect` with sentence-pair objectives: the samples it shows are the pairs the run trains on.

(`tests/test_data_scale.py` covers inspect with packed sequences, `tests/test_corpus_mixing.py` with mixtures.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_docs, write_jsonl

from data_pipeline.loader import PretrainDataset, sample_rng
from data_pipeline.samples import build_samples
from data_pipeline.shards import ShardSet, build_shards
from data_pipeline.tokenizer import load_tokenizer, special_tokens, train_tokenizer
from objectives import build_objectives
from pretrain.cli import main
from pretrain.core.tokens import IGNORE_INDEX
from pretrain.evaluation.inspect import assembled_sample, inspect_data
from pretrain.train.setup import load_config


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """(tokenizer dir, shards dir) of a tiny corpus."""
    root = tmp_path_factory.mktemp("inspect")
    corpus = write_jsonl(root / "docs.jsonl", make_docs(80, seed=3))
    train_tokenizer([str(corpus)], root / "tokenizer", vocab_size=256, show_progress=False)
    build_shards([str(corpus)], root / "tokenizer", root / "shards", num_workers=0, show_progress=False)
    return root / "tokenizer", root / "shards"


PAIR_OBJECTIVES = {
    "nsp": ("{mlm: {weight: 1.0}, nsp: {weight: 1.0}}", "nsp_label"),
    "sop": ("{mlm: {weight: 1.0}, sop: {weight: 1.0}}", "sop_label"),
}


@pytest.mark.parametrize("name", sorted(PAIR_OBJECTIVES))
def test_inspect_shows_assembled_pairs(tmp_path, data_dirs, capsys, name):
    """A segment pair builder's sample is only raw material ("_" keys) until the sentence objective assembles it:
    inspect measures and shows [CLS] A [SEP] B [SEP] with its label, and the token objective's changes to it (it
    raised KeyError: 'input_ids')."""
    spec, label_key = PAIR_OBJECTIVES[name]
    tok_dir, shard_dir = data_dirs
    args = [f"data.shards={shard_dir}", f"data.tokenizer={tok_dir}", "data.max_seq_len=32", f"objectives={spec}"]
    rc = main(["data", "inspect", "tiny", *args, "--out", str(tmp_path / "hist.png"), "--samples", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "* pairs" in out and f"objectives {name}, mlm, builder pairs" in out
    assert out.count("position ") == 3 and out.count(f"{label_key}=") == 3 and "[MASK](" in out

    cfg = load_config("tiny", args)
    report = inspect_data(cfg, tmp_path / "hist.png", num_samples=3)
    assert 0 < report["packing"]["pairs"]["efficiency"] <= 1
    for s in report["samples"]:
        words = " ".join(s["lines"][1:]).split()
        assert words[0] == "[CLS]" and words.count("[SEP]") == 2 and words[-1] == "[SEP]"

    # the original shown is the pair the prepared sample was made from: they differ only where mlm chose a token
    tokens = special_tokens(load_tokenizer(tok_dir))
    objectives = build_objectives(cfg.objectives, tokens)
    builder = build_samples("pairs", ShardSet(shard_dir), 32, tokens, cfg.train.seed)
    dataset = PretrainDataset(builder, objectives, cfg.train.seed)
    for position in range(3):
        _, epoch, index = dataset.place(position)
        original = assembled_sample(builder, objectives, index, sample_rng(cfg.train.seed, epoch, index))
        prepared = dataset[position]
        assert not [k for k in original if k.startswith("_")]
        assert original[label_key] == prepared[label_key]
        np.testing.assert_array_equal(original["token_type_ids"], prepared["token_type_ids"])
        changed = original["input_ids"] != prepared["input_ids"]
        assert changed.any() and not (changed & (prepared["mlm_labels"] == IGNORE_INDEX)).any()


def test_packing_efficiency_of_packed_sequences_is_that_of_their_samples(data_dirs):
    """A last partial sample is filled from the stream's start: inspect counted it short (94% where every sample was
    full at 512 tokens of a small corpus); read once per token (eval) or shorter than one window, it is short."""
    from data_pipeline.samples import PackedSequences
    from pretrain.evaluation.inspect import packing_efficiency

    tok_dir, shard_dir = data_dirs
    tokens = special_tokens(load_tokenizer(tok_dir))
    stream = PackedSequences(ShardSet(shard_dir), 32, tokens.cls, tokens.sep).stream_len
    for max_seq_len in (32, 500, stream + 10):  # many full samples; a partial last one; one window, not filled
        for once in (False, True):
            builder = PackedSequences(ShardSet(shard_dir), max_seq_len, tokens.cls, tokens.sep, each_token_once=once)
            truth = np.mean([len(builder[i]["input_ids"]) for i in range(len(builder))]) / max_seq_len
            got = packing_efficiency(builder, max_seq_len)
            assert got == pytest.approx(truth, abs=1e-12), (max_seq_len, once, len(builder))


def test_inspect_out_refuses_a_format_it_cannot_write_and_a_file_it_did_not_write(tmp_path, data_dirs, capsys):
    """--out x.txt was a matplotlib traceback after the work; an existing picture of the user's was replaced. A
    histogram this command wrote is replaced on the next run."""
    tok_dir, shard_dir = data_dirs
    inspect = ["data", "inspect", str(shard_dir), "--tokenizer", str(tok_dir), "--samples", "0", "--out"]
    assert main([*inspect, str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert (
        f"--out {tmp_path / 'x.txt'}: .txt is not a format this command writes" in err
        and ".pdf, " in err
        and ".png, " in err
    )
    assert not (tmp_path / "x.txt").exists()

    mine = tmp_path / "mine.png"
    mine.write_bytes(b"\x89PNG the user's own picture")
    assert main([*inspect, str(mine)]) == 2
    assert "exists and was not written by `pretrain data inspect`: it was left untouched" in capsys.readouterr().err
    assert mine.read_bytes() == b"\x89PNG the user's own picture"

    for name in ("hist.png", "hist.svg"):
        assert main([*inspect, str(tmp_path / name)]) == 0
        assert main([*inspect, str(tmp_path / name)]) == 0  # ours: replaced
    # every format it accepts carries the signature, so that none of them is refused the second time
    from pretrain.evaluation.inspect import check_histogram_path, histogram_formats, length_histogram

    assert {"png", "pdf", "svg"} <= set(histogram_formats())
    for suffix in histogram_formats():
        path = length_histogram(np.array([3, 30, 300]), tmp_path / f"again.{suffix}", 128, "lengths")
        check_histogram_path(path)
        # the same lengths, the same bytes: an SVG held the time to the microsecond and random clip-path ids
        first = path.read_bytes()
        assert length_histogram(np.array([3, 30, 300]), path, 128, "lengths").read_bytes() == first, suffix
    assert main([*inspect, str(tmp_path / "x.jpg")]) == 2  # no metadata of ours: not accepted
    assert ".jpg is not a format this command writes" in capsys.readouterr().err


def test_inspect_without_out_keeps_a_picture_of_the_users_beside_the_shards(tmp_path, data_dirs, capsys):
    """Without --out the histogram goes to inspect/ beside the shards, which need not be a run's (a shared shard
    store): a doc_lengths.png of the user's there was replaced without a word, though --out refused the same path."""
    import shutil

    tok_dir, shard_dir = data_dirs
    store = tmp_path / "store"
    shutil.copytree(shard_dir, store / "shards")
    mine = store / "inspect" / "doc_lengths.png"
    mine.parent.mkdir()
    mine.write_bytes(b"\x89PNG the user's own picture")
    inspect = ["data", "inspect", str(store / "shards"), "--tokenizer", str(tok_dir), "--samples", "0"]
    assert main(inspect) == 2
    err = capsys.readouterr().err
    assert f"{mine} (where the histogram goes without --out) exists and was not written" in err
    assert mine.read_bytes() == b"\x89PNG the user's own picture"
    mine.unlink()
    assert main(inspect) == 0 and main(inspect) == 0  # its own: written, then replaced
    assert mine.read_bytes().startswith(b"\x89PNG")


def test_inspect_says_when_a_run_would_build_its_shards_again(tmp_path, capsys):
    """inspect read a run's shards as they were after its corpus grew: the counts, histogram and samples of data the
    next `pretrain run` would not train on, with no word."""
    from pretrain.pipeline import stage_shards, stage_tokenizer

    corpus = write_jsonl(tmp_path / "docs.jsonl", make_docs(40, seed=5))
    args = [f"output_dir={tmp_path}", "name=r", f"data.corpus=[{corpus}]", "data.vocab_size=256"]
    cfg = load_config("tiny", args)
    stage_tokenizer(cfg)
    stage_shards(cfg)
    inspect = ["data", "inspect", "tiny", *args, "--out", str(tmp_path / "h.png"), "--samples", "1"]
    capsys.readouterr()
    assert main(inspect) == 0 and "warning:" not in capsys.readouterr().err
    write_jsonl(corpus, make_docs(50, seed=5))  # the corpus grew
    assert main(inspect) == 0
    err = capsys.readouterr().err
    assert f"warning: {cfg.shards_dir} is not what `pretrain run` would train on now" in err
    corpus.rename(tmp_path / "moved.jsonl")  # the corpus gone: the shards are still inspected, and that is said
    assert main(inspect) == 0
    assert "warning: cannot tell whether the shards are what a run would build now" in capsys.readouterr().err


def test_inspect_shows_the_masking_a_schedule_gives_step_0_and_its_first_phase(tmp_path, data_dirs):
    """The samples shown are those step 0 trains: at a scheduled masking rate (0.4 at step 0; the configured 0.15
    showed ~9 targets of 64 where the run trained ~26) and at the length of a phase from step 0."""
    tok_dir, shard_dir = data_dirs
    args = [f"data.shards={shard_dir}", f"data.tokenizer={tok_dir}", "data.max_seq_len=64", "train.max_steps=100"]
    ramp = "schedule.values=[{key: objectives.mlm.mask_prob, points: [[0, 0.4], [99, 0.15]]}]"
    chosen = []
    for phases in ("schedule.phases=[{start: 0, max_seq_len: 32}]", "schedule.phases=[]"):
        report = inspect_data(load_config("tiny", [*args, ramp, phases]), tmp_path / "hist.png", num_samples=8)
        stats = [s["lines"][0].split(", ") for s in report["samples"]]  # "64 tokens, 26 chosen for prediction, ..."
        chosen += [int(s[1].split()[0]) / int(s[0].split()[0]) for s in stats]
        assert {int(s[0].split()[0]) for s in stats} == {32 if "32" in phases else 64}
    assert np.mean(chosen) == pytest.approx(0.4, abs=0.06)
