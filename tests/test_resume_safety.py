"""A resume does what it says, through the CLI as a user meets it: changed learning-rate and optimizer settings are
applied (and saved), a lost `latest` never restarts a run, a changed corpus or tokenizer setting is refused before
anything derived is rebuilt, and bad files on resume are messages, not tracebacks."""

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import PAIR_WORDS, one_line_error, run_args, small_corpus, snapshot, tiny_bert
from helpers import run_cli as pretrain

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A finished tiny run with checkpoints at steps 2 and 3, for each test to copy."""
    tmp = tmp_path_factory.mktemp("runs")
    pretrain("run", *run_args(tmp, corpus, "train.save_every=1"), "--no-demo", cwd=tmp)
    return tmp / "r"


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run (its config names output_dir=<tmp> name=r): resumed as tmp_path/r."""
    shutil.copytree(finished, tmp_path / "r")
    return tmp_path / "r"


def optimizer_groups(checkpoint: Path) -> list[dict]:
    states = torch.load(checkpoint / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return states["optimizer"]["param_groups"]


def test_changed_lr_and_optimizer_settings_are_applied_and_saved(run, corpus):
    tmp = run.parent
    before = optimizer_groups(run / "checkpoints" / "step_00000003")
    assert [tuple(g["betas"]) for g in before] == [(0.9, 0.98)] * 2 and before[0]["eps"] == 1e-6  # the control
    changes = ["train.max_steps=5", "train.lr=0.01", "train.adam_beta2=0.95", "train.adam_eps=1e-8"]
    proc = pretrain(
        "train", *run_args(tmp, corpus, *changes, "train.weight_decay=0.05", "train.warmup_steps=1"), cwd=tmp
    )
    assert "applied on resume" in proc.stderr and "train.lr: 0.001 -> 0.01" in proc.stderr, proc.stderr[-2000:]
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    # linear decay from the new peak: lr(step) = 0.01 * (5 - s) / (5 - 1) after step s-1's scheduler step
    assert records[4]["lr"] == pytest.approx(0.01 * (5 - 4) / 4, rel=1e-6)
    assert records[5]["lr"] == pytest.approx(0.0, abs=1e-12)
    groups = optimizer_groups(run / "checkpoints" / "step_00000005")
    assert [tuple(g["betas"]) for g in groups] == [(0.9, 0.95)] * 2
    assert [g["eps"] for g in groups] == [1e-8] * 2
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]  # biases and LayerNorm weights never decay
    assert [g["initial_lr"] for g in groups] == [0.01] * 2


def test_a_lost_latest_pointer_keeps_every_checkpoint(run, corpus):
    tmp = run.parent
    pointer = run / "checkpoints" / "latest"
    for broken in (None, "", "\x00garbage"):
        if broken is None:
            pointer.unlink()
        else:
            pointer.write_text(broken)
        before = snapshot(run)
        for command in ("train", "run"):
            proc = pretrain(command, *run_args(tmp, corpus, "train.max_steps=5"), cwd=tmp, rc=2)
            one_line_error(proc, "complete checkpoint(s)", "step_00000003", f"echo step_00000003 > {pointer}")
            assert snapshot(run) == before  # nothing rotated, trimmed or rewritten
        proc = pretrain("export", run, "--out", tmp / "hf", cwd=tmp, rc=2)
        one_line_error(proc, "step_00000003")
    # the command the message gives resumes where the run was
    pointer.write_text("step_00000003\n")
    proc = pretrain("train", *run_args(tmp, corpus, "train.max_steps=4"), cwd=tmp)
    assert "resumed from" in proc.stderr and "step 3" in proc.stderr
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_rotation_keeps_the_checkpoint_it_wrote_beside_one_a_killed_save_left(run, corpus):
    """A save killed at step 10 left step_00000010 half-written (`latest` never named it); the run resumed from step 3
    and saves at 4 and 5 with keep_checkpoints=1. Rotation counts complete checkpoints up to the one just written:
    counting the half-written one as the newest deleted every good checkpoint, the new one included."""
    tmp, ckpts = run.parent, run / "checkpoints"
    killed = ckpts / "step_00000010"
    killed.mkdir()
    shutil.copy2(ckpts / "step_00000003" / "config.yaml", killed / "config.yaml")
    args = run_args(tmp, corpus, "train.max_steps=5", "train.save_every=1", "train.keep_checkpoints=1")
    pretrain("train", *args, cwd=tmp)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000005", "step_00000010"]
    assert (ckpts / "latest").read_text().strip() == "step_00000005"
    proc = pretrain("train", *run_args(tmp, corpus, "train.max_steps=6", "train.keep_checkpoints=1"), cwd=tmp)
    assert "resumed from" in proc.stderr and "step 5" in proc.stderr


def test_a_changed_corpus_leaves_the_shards_as_they_were(run, corpus, tmp_path):
    tmp = run.parent
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join(CORPUS.read_text().splitlines()[20:40]) + "\n")
    before = snapshot(run)
    proc = pretrain("run", *run_args(tmp, changed, "train.max_steps=5"), "--no-demo", cwd=tmp, rc=2)
    one_line_error(proc, "no longer gives the data this run trained on", "train.allow_changes=[data]")
    assert snapshot(run) == before  # the shards included, byte for byte
    # the same text cut into other shards: refused too, naming the setting rather than blaming the corpus alone
    proc = pretrain(
        "run", *run_args(tmp, corpus, "train.max_steps=5", "data.docs_per_shard=1"), "--no-demo", cwd=tmp, rc=2
    )
    one_line_error(proc, "The shards' settings changed: data.docs_per_shard=1 (was 2000); put them back")
    assert snapshot(run) == before

    # the same text in a file with a new time (a copy, a touch): rebuilt beside, found equal, resumed
    same = tmp_path / "same.jsonl"
    same.write_bytes(corpus.read_bytes())
    proc = pretrain("run", *run_args(tmp, same, "train.max_steps=4"), "--no-demo", cwd=tmp)
    assert "building beside" in proc.stderr and "resumed from" in proc.stderr, proc.stderr[-2000:]
    assert {p: b for p, b in snapshot(run).items() if p.startswith("shards/shard_")} == {
        p: b for p, b in before.items() if p.startswith("shards/shard_")
    }


def test_shards_a_newer_version_builds_otherwise_are_named_as_such(run, corpus, monkeypatch):
    """Shards an earlier version built (its sentence splitter's) whose rebuild holds other data: the refusal said
    'put them back' of a version number no setting changes; it says what this version does otherwise, and the way on."""
    from pretrain import pipeline
    from pretrain.core.errors import UserError
    from pretrain.train import trainer
    from pretrain.train.fingerprint import DATA_KEY
    from pretrain.train.setup import load_config

    manifest = json.loads((run / "shards" / "manifest.json").read_text())
    manifest["settings"]["splitter_version"] = 1  # as the version before wrote them, with other sentences
    manifest["shards"][0]["sha256"]["shard_00000.sents.npy"] = "0" * 64
    (run / "shards" / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(trainer, "saved_fingerprint", lambda checkpoint: {DATA_KEY: "0" * 64})  # other sentences
    preset, *overrides = run_args(run.parent, corpus)
    cfg = load_config(preset, overrides)
    before = snapshot(run)
    with pytest.raises(UserError) as err:
        pipeline._rebuild_for_resume(
            cfg, [corpus], pipeline.shard_settings(cfg.data), run / "checkpoints" / "step_00000003"
        )
    assert "it splits the sentences of non-Latin scripts" in str(err.value) and "put them back" not in str(err.value)
    assert "train.allow_changes=[data] to go on with the new shards" in str(err.value)
    assert snapshot(run) == before


def test_changed_tokenizer_settings_are_refused(run, corpus):
    tmp = run.parent
    before = snapshot(run)
    for change, shown in (("data.vocab_size=1024", "data.vocab_size: 512"), ("data.tokenizer_type=bpe", "wordpiece")):
        proc = pretrain("train", *run_args(tmp, corpus, change), cwd=tmp, rc=2)
        one_line_error(proc, "cannot resume", shown)
        assert snapshot(run) == before


def test_bad_files_on_resume_are_messages(run, corpus):
    tmp = run.parent
    proc = pretrain("train", *run_args(tmp, corpus, "train.lr=nan"), cwd=tmp, rc=2)
    one_line_error(proc, "train.lr", "not a finite number")

    # the run directory's copy of the config is ours and rewritten (the checkpoint's says what changed)
    (run / "config.yaml").write_bytes(b"\xff\xfe: [unclosed")
    proc = pretrain("train", *run_args(tmp, corpus, "train.max_steps=4"), cwd=tmp)
    assert (
        "resumed from" in proc.stderr and yaml.safe_load((run / "config.yaml").read_text())["train"]["max_steps"] == 4
    )

    # max_steps below the checkpoint's step: nothing trained, exit 0, and config.yaml said 2 for a model of 4 steps
    before = (run / "config.yaml").read_bytes()
    proc = pretrain("train", *run_args(tmp, corpus, "train.max_steps=2"), cwd=tmp, rc=2)
    one_line_error(proc, "train.max_steps 2 is below the step of the checkpoint", "step 4): nothing would train")
    assert (run / "config.yaml").read_bytes() == before

    # a foreign pickle in a checkpoint's rng file (its integrity record rewritten to match): refused by name
    from pretrain.train.checkpoint import latest_checkpoint, write_integrity

    latest = latest_checkpoint(run / "checkpoints")
    torch.save({"torch": argparse.Namespace(evil=True)}, latest / "rng_rank0.pt")
    write_integrity(latest)
    proc = pretrain("train", *run_args(tmp, corpus, "train.max_steps=6"), cwd=tmp, rc=2)
    one_line_error(proc, str(latest), "we do not load")


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    from pretrain.core.files import write_atomic, write_json_atomic

    # each write fails after its temporary file was opened, as a full disk fails it
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "config.yaml", 123)
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "state.json", {"a": object()})
    assert list(tmp_path.iterdir()) == []


def test_the_plateau_note_of_an_interrupted_run_is_that_of_one_never_stopped(run):
    """`pretrain run`'s closing note gives the masked-LM loss of the last few metrics lines: a run interrupted between
    two log steps keeps the stop's own line after its resume, and the note gave another loss for it (log_every 2,
    stopped at step 5 of 6: the mean of steps 4, 5 and 6). It takes whole intervals and the last line now."""
    from dataclasses import replace

    from pretrain.core.config import load_yaml
    from pretrain.pipeline import plateau_note
    from pretrain.train.setup import config_from_dict

    cfg = config_from_dict(load_yaml(run / "config.yaml"), apply_init_from=False)
    cfg = replace(cfg, output_dir=str(run.parent), train=replace(cfg.train, log_every=2, max_steps=6))
    loss = {2: 6.25, 4: 6.22, 5: 5.0, 6: 6.16}  # step 5: the stop's own line

    def note(steps):
        text = "".join(
            json.dumps({"step": s, "loss": loss[s], "mlm/loss": loss[s], "tokens": 8 * s}) + "\n" for s in steps
        )
        (run / "metrics.jsonl").write_text(text)
        return plateau_note(cfg)

    assert note([2, 4, 6]).startswith("masked-LM loss 6.21 after 48 tokens")
    assert note([2, 4, 5, 6]) == note([2, 4, 6])


def test_a_run_from_init_from_resumes_with_its_directory_gone(corpus, tmp_path):
    """A run started from `model.init_from: DIR` resumed after DIR was deleted (a scratch directory purged): it
    stopped at 'DIR has no config.json', though the checkpoint holds the weights, the architecture and the tokenizer.
    It now resumes from those; the tokenizer it reads from the checkpoint goes with rotation, and later checkpoints
    still carry it (from the previous checkpoint's copy)."""
    init = tiny_bert(tmp_path / "init", PAIR_WORDS)
    tokenizer = (init / "tokenizer.json").read_bytes()
    args = run_args(tmp_path, corpus, f"model.init_from={init}", "train.save_every=2", "train.keep_checkpoints=1")
    pretrain("run", *args, "train.max_steps=2", "--no-demo", cwd=tmp_path)
    shutil.rmtree(init)
    proc = pretrain("run", *args, "train.max_steps=6", cwd=tmp_path)  # to the end: export, demo, plateau note
    ckpts = tmp_path / "r" / "checkpoints"
    assert f"model.init_from {init} is gone: resuming from {ckpts / 'step_00000002'}" in proc.stderr
    assert proc.stderr.count("is gone: resuming") == 1, proc.stderr  # the config is resolved more than once
    assert "resumed from" in proc.stderr and "(step 2" in proc.stderr
    assert [p.name for p in ckpts.glob("step_*")] == ["step_00000006"]  # step 2, rotated away
    home = tmp_path / "r" / "tokenizer"  # the run's copy of the checkpoint's, which its config now names
    for where in (home, ckpts / "step_00000006" / "tokenizer"):
        assert (where / "tokenizer.json").read_bytes() == tokenizer
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["data"]["tokenizer"] == str(home)
    assert json.loads((ckpts / "step_00000006" / "trainer_state.json").read_text())["step"] == 6
    pretrain("decay", tmp_path / "r", "--steps", "2", cwd=tmp_path)  # a branch of it reads that tokenizer too


def test_the_note_of_a_gone_init_from_is_said_by_rank_0_only(corpus, tmp_path, monkeypatch, capsys):
    """Every rank resolves the config: the note that model.init_from is gone came once per rank."""
    from pretrain.train.setup import load_config

    init = tiny_bert(tmp_path / "init", PAIR_WORDS)
    args = run_args(tmp_path, corpus, f"model.init_from={init}", "train.max_steps=2", "train.save_every=2")
    pretrain("run", *args, "--no-demo", cwd=tmp_path)
    shutil.rmtree(init)
    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        cfg = load_config(args[0], args[1:])
        said[rank] = capsys.readouterr().err
        assert cfg.data.tokenizer == str(tmp_path / "r" / "tokenizer")  # resolved alike on each rank
    assert "is gone: resuming" in said["0"] and "is gone" not in said["1"]


def test_shards_that_differ_only_in_their_word_starts_are_named_so():
    """Rebuilt shards of an unchanged corpus with CJK text or combining marks hold other word starts than an earlier
    version's (whole-word masking's words cut as BERT's since): the resume's refusal said the corpus changed."""
    from pretrain.pipeline import _only_words_differ

    def manifest(words: str, tokens: str = "t") -> dict:
        sha = {"shard_00000.tokens.bin": tokens, "shard_00000.docs.npy": "d", "shard_00000.words.bin": words}
        return {"shards": [{"name": "shard_00000", "sha256": sha}]}

    assert _only_words_differ(manifest("old"), manifest("new"))
    assert not _only_words_differ(manifest("old"), manifest("new", tokens="other"))
    assert not _only_words_differ({}, manifest("new"))  # no earlier manifest: nothing to tell
