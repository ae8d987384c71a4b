"""`pretrain export` as a user meets it: it writes where the run is now (not where it was trained), keeps what the user
added to the export directory, replaces an export only with one that passed its parity check, writes through a
symlinked --out, reads a checkpoint safely while the run is still training, and says in one line what is wrong."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from helpers import one_line_error, run_args, small_corpus, snapshot
from helpers import run_cli as pretrain

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "us-speeches.public-domain.jsonl"
pytestmark = pytest.mark.slow
STEP = "step_00000003"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A finished tiny run, exported to its hf/: never changed by a test (each works on a copy)."""
    tmp = tmp_path_factory.mktemp("runs")
    pretrain("run", *run_args(tmp, corpus), "--no-demo", cwd=tmp)
    return tmp / "r"


def copy_run(trained: Path, dest: Path, final_loss: float | None = None) -> Path:
    """A copy of the run at `dest`; `final_loss` marks its last metrics record, to tell its model card apart."""
    shutil.copytree(trained, dest, symlinks=True)
    if final_loss is not None:
        metrics = dest / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        records[-1]["loss"] = final_loss
        metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    return dest


def card_loss(export: Path) -> str:
    return next(line for line in (export / "README.md").read_text().splitlines() if line.startswith("- Final loss"))


def test_export_lands_in_the_run_given_not_where_it_was_trained(trained, tmp_path):
    original = snapshot(trained)
    run = copy_run(trained, tmp_path / "elsewhere" / "exp", final_loss=1.2345)
    (run / "hf").rename(tmp_path / "old-hf")  # a copy without an export yet
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    pretrain("export", os.path.relpath(run, cwd), cwd=cwd)  # from another working directory, a relative path
    assert (run / "hf" / "model.safetensors").is_file() and card_loss(run / "hf") == "- Final loss: 1.2345"
    assert list(cwd.iterdir()) == []  # no runs/r/hf where the config says the run was
    assert snapshot(trained) == original  # the run it was copied from is untouched

    # a checkpoint inside the run: the same run's hf/
    shutil.rmtree(run / "hf")
    pretrain("export", run / "checkpoints" / STEP, cwd=cwd)
    assert card_loss(run / "hf") == "- Final loss: 1.2345"

    # a checkpoint on its own has no run: --out is needed, and said so
    bare = shutil.copytree(run / "checkpoints" / STEP, tmp_path / "bare" / STEP)
    proc = pretrain("export", bare, cwd=cwd, rc=2)
    one_line_error(proc, str(bare), "--out")
    assert snapshot(trained) == original and list(bare.parent.iterdir()) == [bare]


def test_pretrain_run_under_a_new_name_exports_into_that_run_and_keeps_user_files(trained, tmp_path, corpus):
    """`pretrain run name=r9` on a copy of a finished run re-exports into r9/hf, not into the run it was copied from,
    and what the user added to r9/hf stays."""
    original = snapshot(trained)
    run = copy_run(trained, tmp_path / "r9", final_loss=2.5)
    (run / "hf" / "notes.txt").write_text("my notes")
    (run / "hf" / "finetuned").mkdir()
    (run / "hf" / "finetuned" / "config.json").write_text('{"mine": true}')
    (run / "hf" / "config.json").write_text("{}")  # ours: replaced by the re-export
    pretrain("run", *run_args(tmp_path, corpus, "name=r9"), "--no-demo", cwd=tmp_path)
    assert snapshot(trained) == original
    assert (run / "hf" / "notes.txt").read_text() == "my notes"
    assert (run / "hf" / "finetuned" / "config.json").read_text() == '{"mine": true}'
    assert json.loads((run / "hf" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    assert card_loss(run / "hf") == "- Final loss: 2.5000"
    assert not (run / "hf" / ".tmp-export").exists()


def test_reexport_keeps_user_files_and_replaces_only_its_own(trained, tmp_path):
    run = copy_run(trained, tmp_path / "r")
    hf = run / "hf"
    (hf / "notes.txt").write_text("my notes")
    (hf / "finetuned").mkdir()
    (hf / "finetuned" / "model.safetensors").write_bytes(b"my fine-tuned weights")
    (hf / "generator").mkdir()  # a folder of ours from an earlier ELECTRA export, with a user file in it
    (hf / "generator" / "config.json").write_text("{}")
    (hf / "generator" / "mine.txt").write_text("keep")
    (hf / "README.md").write_text("stale card")
    pretrain("export", run, cwd=tmp_path)
    assert (hf / "notes.txt").read_text() == "my notes"
    assert (hf / "finetuned" / "model.safetensors").read_bytes() == b"my fine-tuned weights"
    assert sorted(p.name for p in (hf / "generator").iterdir()) == ["mine.txt"]  # our stale file went, theirs stayed
    assert "- Objective(s):" in (hf / "README.md").read_text()
    assert not (hf / ".tmp-export").exists() and not list(tmp_path.glob(".*"))


def test_a_failed_parity_check_leaves_the_previous_export(trained, tmp_path, monkeypatch, capsys):
    """The parity check runs on the new export before it replaces anything: an export that does not reproduce the
    model (here one weight changed on its way out) never reaches the run's hf/."""
    import torch

    from pretrain import cli
    from pretrain.hf import interop

    run = copy_run(trained, tmp_path / "r")
    (run / "hf" / "notes.txt").write_text("my notes")
    before = snapshot(run / "hf")
    to_hf = interop.to_hf_state_dict

    def planted(model, arch):
        state = to_hf(model, arch)
        name = next(k for k in state if k.endswith("attention.output.dense.weight"))
        state[name] = state[name] + torch.linspace(-1, 1, len(state[name]))[:, None]  # per row: LayerNorm keeps it
        return state

    monkeypatch.setattr(interop, "to_hf_state_dict", planted)
    assert cli.main(["export", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "differ from ours" in err and str(run / "hf") in err, err
    assert snapshot(run / "hf") == before
    assert cli.main(["export", str(run), "--no-verify"]) == 0  # the user's call: written unchecked
    assert snapshot(run / "hf") != before and (run / "hf" / "notes.txt").is_file()


def test_an_export_stopped_while_replacing_files_is_not_loaded(trained, tmp_path, monkeypatch, capsys):
    """Files are replaced one by one: stopped between config.json and the weights, hf/ held the new config beside the
    old weights and loaded without a word. Until an export completes, nothing loads the directory; the same command
    again completes it."""
    from pretrain import cli
    from pretrain.evaluation.finetune import load_model
    from pretrain.hf import export as export_module

    run = copy_run(trained, tmp_path / "r")
    real_replace = os.replace

    def stop_at_the_weights(src, dst):
        if Path(dst).name == "model.safetensors" and ".tmp-export" in str(src):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(export_module.os, "replace", stop_at_the_weights)
    assert cli.main(["export", str(run), "--arch", "roberta"]) != 0  # interrupted (^C), as the CLI reports it
    monkeypatch.setattr(export_module.os, "replace", real_replace)
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] == "roberta"  # the new config, beside the old (BERT) weights
    for load in (
        lambda: load_model(run / "hf", 2, "classification"),
        lambda: export_module.check_model_dir(run / "hf"),
    ):
        with pytest.raises(export_module.UserError, match="stopped while replacing its files"):
            load()
    assert cli.main(["eval", str(run / "hf"), "--corpus", str(CORPUS), "--max-samples", "4"]) == 2
    assert "stopped while replacing its files" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--arch", "roberta"]) == 0
    assert not (run / "hf" / ".export-incomplete").exists()
    load_model(run / "hf", 2, "classification")


def test_a_symlinked_out_is_written_through(trained, tmp_path):
    real = tmp_path / "disk" / "exports"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    for _ in range(2):  # a re-export through the link too
        pretrain("export", trained, "--out", link, cwd=tmp_path)
        assert link.is_symlink() and link.resolve() == real
        assert (real / "model.safetensors").is_file() and (real / ".bert-pretrain.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link"]  # no .old-link, no temporary left


def test_out_dot_is_the_current_directory(trained, tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    pretrain("export", trained, "--out", ".", cwd=here)
    assert (here / "model.safetensors").is_file() and (here / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("months of work")
    proc = pretrain("export", trained, "--out", ".", cwd=mine, rc=2)
    one_line_error(proc, "--out .", "thesis.tex")
    assert snapshot(mine) == {"thesis.tex": b"months of work"}

    proc = pretrain("export", ".", "--out", ".", cwd=trained, rc=2)
    one_line_error(proc, "is the run directory being exported")


def test_a_stray_optim_states_file_does_not_break_export(trained, tmp_path):
    run = copy_run(trained, tmp_path / "r")
    ckpt = run / "checkpoints" / STEP
    (ckpt / "backup_optim_states.pt").write_bytes(b"not a checkpoint")
    (ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"copied here by mistake")
    proc = pretrain("export", run, "--out", tmp_path / "hf", cwd=tmp_path)
    assert "max |logit diff|" in proc.stderr
    from safetensors.torch import load_file

    ours, theirs = load_file(tmp_path / "hf" / "model.safetensors"), load_file(trained / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)


def test_export_while_the_run_saves_every_step(trained, corpus, tmp_path):
    """Checkpoints rotate away every step (save_every=1, keep 1): each export still reads a whole checkpoint, and the
    trainer neither waits for it nor fails."""
    args = run_args(
        tmp_path,
        corpus,
        "name=t",
        f"data.tokenizer={trained / 'tokenizer'}",
        f"data.shards={trained / 'shards'}",
        "train.max_steps=100000",
        "train.save_every=1",
        "train.keep_checkpoints=1",
        "train.log_every=50",
    )
    trainer = pretrain("train", *args, cwd=tmp_path, wait=False)
    run = tmp_path / "t"
    try:
        deadline = time.time() + 300
        while not (run / "checkpoints" / "latest").is_file() and time.time() < deadline:
            assert trainer.poll() is None, trainer.communicate()[1][-3000:]
            time.sleep(0.2)
        first = (run / "checkpoints" / "latest").read_text()
        for i in range(2):
            proc = pretrain("export", run, "--out", tmp_path / f"hf{i}", "--no-verify", cwd=tmp_path, rc=None)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert trainer.poll() is None, trainer.communicate()[1][-3000:]
        assert (run / "checkpoints" / "latest").read_text() > first  # it trained on meanwhile
    finally:
        trainer.terminate()  # SIGTERM: the trainer saves and exits 75
        _, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 75, err[-3000:]
    # what was put off while an export read is caught up by the next save: keep_checkpoints holds again
    assert len(list((run / "checkpoints").glob("step_*"))) == 1


@pytest.mark.parametrize("command", ["run", "export"])
def test_a_failed_export_check_is_one_line_in_run_as_in_export(command, monkeypatch, capsys, tmp_path):
    """A parity or tokenizer check that fails inside `pretrain run` ends like `pretrain export`'s: one error line
    asking for a report, exit status 2, no traceback."""
    import pretrain.pipeline
    from pretrain.cli import main
    from pretrain.hf.export import ExportError

    def fails(*args, **kwargs):
        raise ExportError("max |logit diff| 0.5 vs transformers")

    monkeypatch.setattr(pretrain.pipeline, "run_all" if command == "run" else "stage_export", fails)
    argv = ["run", "tiny", f"output_dir={tmp_path}"] if command == "run" else ["export", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == "error: max |logit diff| 0.5 vs transformers (the export does not reproduce the model: please report this)"
    )
